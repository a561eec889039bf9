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
from typing import Any

from tasks import math_equiv
from tasks.code_exec import REMOTE_HEADER, TESTS_MARK
from tasks.code_exec import pass_at_1 as _pass_at_1

LETTERS = "ABCDEFGHIJ"
MATH_TYPES = {"algebra": "Algebra", "counting_and_prob": "Counting & Probability", "geometry": "Geometry",
              "intermediate_algebra": "Intermediate Algebra", "num_theory": "Number Theory",
              "prealgebra": "Prealgebra", "precalc": "Precalculus"}
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


def load_dataset(benchmark: str, split: str = "test", **_: Any) -> dict:
    """lm-eval ``custom_dataset`` hook: {split: Dataset} from our resolver.

    lm-eval calls it with the task's metadata and ``dataset_kwargs`` as keywords;
    only ``benchmark`` and ``split`` matter, the rest (version, ...) is ignored.
    """
    return {split: _dataset(benchmark, split, os.environ.get("REFUSION_DATA_DIR"))}


# ---------------------------------------------------------------- MMLU-Pro
def mmlu_pro_doc_to_text(doc: dict) -> str:
    """Zero-shot CoT prompt of lm-eval's mmlu_pro (question, lettered options, answer cue)."""
    lines = ["Question:", doc["question"], "Options:"]
    lines += [f"{LETTERS[i]}. {opt.strip()}" for i, opt in enumerate(doc["options"][:len(LETTERS)])]
    return "\n".join(lines) + "\nAnswer: Let's think step by step."


def _mmlu_pro_subject(subject: str):
    def process(dataset):
        return dataset.filter(lambda d: d["category"] == subject)
    return process


mmlu_pro_biology = _mmlu_pro_subject("biology")
mmlu_pro_business = _mmlu_pro_subject("business")
mmlu_pro_chemistry = _mmlu_pro_subject("chemistry")
mmlu_pro_computer_science = _mmlu_pro_subject("computer science")
mmlu_pro_economics = _mmlu_pro_subject("economics")
mmlu_pro_engineering = _mmlu_pro_subject("engineering")
mmlu_pro_health = _mmlu_pro_subject("health")
mmlu_pro_history = _mmlu_pro_subject("history")
mmlu_pro_law = _mmlu_pro_subject("law")
mmlu_pro_math = _mmlu_pro_subject("math")
mmlu_pro_other = _mmlu_pro_subject("other")
mmlu_pro_philosophy = _mmlu_pro_subject("philosophy")
mmlu_pro_physics = _mmlu_pro_subject("physics")
mmlu_pro_psychology = _mmlu_pro_subject("psychology")


# ---------------------------------------------------------------- GPQA
def _gpqa_clean(text: str | None) -> str:
    if text is None:
        return " "
    return text.strip().replace(" [title]", ". ").replace("  ", " ")


def gpqa_process_docs(dataset):
    """Four shuffled choices and the gold letter "(X)", as lm-eval's gpqa generative task.

    lm-eval shuffles with the global `random` state; we seed a generator per
    question (its Record ID) so the order does not depend on task load order.
    """
    def one(doc: dict) -> dict:
        correct = _gpqa_clean(doc["Correct Answer"])
        choices = [_gpqa_clean(doc[f"Incorrect Answer {i}"]) for i in (1, 2, 3)] + [correct]
        random.Random(f"{GPQA_SHUFFLE_SEED}:{doc.get('Record ID', doc['Question'])}").shuffle(choices)
        return {"choice1": choices[0], "choice2": choices[1], "choice3": choices[2], "choice4": choices[3],
                "choices": choices, "answer": f"({'ABCD'[choices.index(correct)]})"}

    return dataset.map(one)


# ---------------------------------------------------------------- MATH (minerva_math)
def _math_subject(type_name: str | None):
    def process(dataset):
        if type_name is not None:
            dataset = dataset.filter(lambda d: d["type"] == type_name)
        return dataset.map(lambda d: {"problem": d["problem"], "solution": d["solution"],
                                      "answer": math_equiv.gold_answer(d["solution"])})
    return process


math_algebra = _math_subject(MATH_TYPES["algebra"])
math_counting_and_prob = _math_subject(MATH_TYPES["counting_and_prob"])
math_geometry = _math_subject(MATH_TYPES["geometry"])
math_intermediate_algebra = _math_subject(MATH_TYPES["intermediate_algebra"])
math_num_theory = _math_subject(MATH_TYPES["num_theory"])
math_prealgebra = _math_subject(MATH_TYPES["prealgebra"])
math_precalc = _math_subject(MATH_TYPES["precalc"])
math_all = _math_subject(None)


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
