"""Python hooks the task YAMLs in this folder reference with ``!function hooks.<name>``.

Datasets come from ``tasks.data.load_rows`` only (REFUSION_DATA_DIR, else the
HF ids), turned into an in-memory ``datasets.Dataset`` so nothing is written to
a datasets cache (GPQA questions never touch the disk). Prompts, filters and
metrics follow lm-eval 0.4.13's tasks of the same name (docs/design.md §5); the
differences are listed in tasks/README.md.
"""

from __future__ import annotations

import ast
import builtins
import functools
import os
import random
import re
from typing import Any

from tasks import math_equiv
from tasks.code_exec import REMOTE_HEADER, TESTS_MARK
from tasks.code_exec import pass_at_1 as _pass_at_1

LETTERS = "ABCDEFGHIJ"
GPQA_SHUFFLE_SEED = 0


# ---------------------------------------------------------------- datasets
@functools.lru_cache(maxsize=16)
def _dataset(benchmark: str, split: str, data_dir: str | None):
    """One benchmark split as an in-memory Dataset (cached per process: MMLU-Pro's 14
    subtasks share one load). Keyed by the data dir so a changed env var is honoured."""
    import datasets

    from tasks.data import load_rows

    if benchmark.startswith("embedded_"):
        from tasks.embedded import load_split

        rows = load_split(benchmark[len("embedded_"):], split)
    else:
        rows = load_rows(benchmark, split)
    return datasets.Dataset.from_list(rows)


def load_dataset(benchmark: str, split: str = "test", where: dict[str, Any] | None = None, **_: Any) -> dict:
    """lm-eval ``custom_dataset`` hook: {split: Dataset} from our resolver.

    lm-eval calls it with the task's metadata and ``dataset_kwargs`` as keywords; only
    ``benchmark``, ``split`` and ``where`` matter, the rest (version, ...) is ignored.
    ``where`` ({field: value}) keeps the rows whose fields equal those values: a subject
    task (mmlu_pro_biology, minerva_math_algebra) is its benchmark plus one ``where`` in
    its YAML.
    """
    ds = _dataset(benchmark, split, os.environ.get("REFUSION_DATA_DIR"))
    if where:
        missing = sorted(set(where) - set(ds.column_names))
        if missing:
            raise ValueError(f"dataset_kwargs.where: {benchmark} rows have no field(s) {', '.join(missing)}")
        ds = ds.filter(lambda d: all(d[k] == v for k, v in where.items()))
    return {split: ds}


# ---------------------------------------------------------------- MMLU-Pro
def mmlu_pro_doc_to_text(doc: dict) -> str:
    """Zero-shot CoT prompt of lm-eval's mmlu_pro (question, lettered options, answer cue)."""
    lines = ["Question:", doc["question"], "Options:"]
    lines += [f"{LETTERS[i]}. {opt.strip()}" for i, opt in enumerate(doc["options"][:len(LETTERS)])]
    return "\n".join(lines) + "\nAnswer: Let's think step by step."


# ---------------------------------------------------------------- GPQA
def _gpqa_clean(text: str | None, drop_brackets: bool = False) -> str:
    if text is None:
        return " "
    text = text.strip().replace(" [title]", ". ")
    if drop_brackets:  # the ReFusion authors' cleaning also removes "[...]" spans
        text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def gpqa_process_docs(dataset, drop_brackets: bool = False):
    """Four shuffled choices and the gold letter "(X)", as lm-eval's gpqa generative task.

    lm-eval shuffles with the global `random` state; we seed a generator per
    question (its Record ID) so the order does not depend on task load order.
    """
    def one(doc: dict) -> dict:
        correct = _gpqa_clean(doc["Correct Answer"], drop_brackets)
        choices = [_gpqa_clean(doc[f"Incorrect Answer {i}"], drop_brackets) for i in (1, 2, 3)] + [correct]
        random.Random(f"{GPQA_SHUFFLE_SEED}:{doc.get('Record ID', doc['Question'])}").shuffle(choices)
        return {"choice1": choices[0], "choice2": choices[1], "choice3": choices[2], "choice4": choices[3],
                "choices": choices, "answer": f"({'ABCD'[choices.index(correct)]})"}

    return dataset.map(one)


def gpqa_process_docs_paper(dataset):
    """gpqa_process_docs with the ReFusion authors' text cleaning (``gpqa_main_generative_paper``)."""
    return gpqa_process_docs(dataset, drop_brackets=True)


# ---------------------------------------------------------------- MATH (minerva_math)
def math_process_docs(dataset):
    """The gold answer of each problem (the last boxed expression of its solution) as ``answer``."""
    return dataset.map(lambda d: {"problem": d["problem"], "solution": d["solution"],
                                  "answer": math_equiv.gold_answer(d["solution"])})


def math_doc_to_text(doc: dict) -> str:
    return "Problem:\n" + doc["problem"] + "\n\nSolution:"


def math_process_results(doc: dict, results: list[str]) -> dict[str, int]:
    """exact_match via Minerva answer equivalence (lm-eval's math_verify is not installed)."""
    return {"exact_match": int(math_equiv.score_response(results[0], doc["answer"]))}


# ---------------------------------------------------------------- code (HumanEval, MBPP, embedded)
def humaneval_build_predictions_instruct(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    """The prompt (already in the gen_prefix) plus the completion up to its closing fence."""
    return [[doc["prompt"] + (r if "```" not in r else r[:r.find("```")]) for r in resp]
            for resp, doc in zip(resps, docs)]


def humaneval_build_predictions_noprefix(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    """``humaneval_instruct_noprefix``: the prompt, then the code of the answer's first fence (the answer
    opens inside one), reduced to definitions by ``sanitize_program``."""
    return [[sanitize_program(doc["prompt"] + "\n" + r.split("```python\n", 1)[-1].split("```")[0])
             for r in resp] for resp, doc in zip(resps, docs)]


def sanitize_program(code: str) -> str:
    """Imports and top-level definitions (functions, classes, assignments) of ``code``; statements that
    would run (tests, prints) are dropped. Code that does not parse is cut back line by line from the
    end until it does (a generation stopped mid-statement), as the authors' sanitize step does."""
    lines = code.splitlines()
    while lines:
        try:
            tree = ast.parse("\n".join(lines))
            break
        except SyntaxError:
            lines.pop()
    else:
        return code
    keep = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign,
            ast.AnnAssign)
    spans = []
    for n in tree.body:
        if isinstance(n, keep):
            first = min([n.lineno] + [d.lineno for d in getattr(n, "decorator_list", [])])
            spans.append("\n".join(lines[first - 1:n.end_lineno]))
    return "\n\n".join(spans) + "\n"


def pass_at_k(references: list[str], predictions: list[list[str]], k: list[int] | int = 1) -> dict[str, float]:
    """lm-eval's humaneval metric interface, pass@1 only, run in our sandbox (greedy: one sample)."""
    ks = [k] if isinstance(k, int) else list(k)
    if ks != [1]:
        raise ValueError("only pass@1 is supported (greedy decoding, one sample per problem)")
    return {"pass@1": _pass_at_1(references, predictions)}


def pass_at_1(references: list[str] | str, predictions: list[list[str]] | list[str]) -> float:
    """lm-eval's mbpp metric interface (the program is prediction + "\\n" + reference)."""
    return _pass_at_1(references, predictions)


def mbpp_doc_to_target(doc: dict) -> str:
    """The three asserts (the gold code for a few-shot example), as lm-eval's mbpp target.

    Tests call the function under test by name; when that name is also a builtin
    (MBPP 126 tests a ``sum(a, b)``), a header tells the sandbox's judge to take it from
    the model's program. The names come from the reference solution, never from the
    model, so a model that redefines ``sorted`` or ``set`` cannot reach the comparisons.
    """
    if "is_fewshot" in doc:
        return doc["code"] + "\n[DONE]"
    tests = "\n".join(doc["test_list"][:3])
    shadowed = sorted(_defined_names(doc.get("code", "")) & _called_names(tests) & set(dir(builtins)))
    return (f"{REMOTE_HEADER}{','.join(shadowed)}\n{TESTS_MARK}\n" if shadowed else "") + tests


def _defined_names(code: str) -> set[str]:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def _called_names(code: str) -> set[str]:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    return {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def embedded_code_target(doc: dict) -> str:
    return "\n".join(doc["tests"])
