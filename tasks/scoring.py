"""Offline scoring for every task, in one place (docs/design.md §5).

    score(task_name, response, doc) -> float          # the task's headline metric, 0..1
    score_details(task_name, response, doc) -> dict   # every "metric,filter" value
    score_many(task_name, responses, docs) -> list[dict]

Benchmark tasks are scored through lm-eval's own machinery for our YAMLs (the
task's filter ensembles, then its ``process_results``), so a score here is the
score ``lm_eval.evaluate`` would give. The embedded kinds are scored by the
functions below, which the embedded YAMLs also use as their filters. ``doc`` is
a document as the task yields it (``Task.eval_docs``; for the embedded tasks a
row of ``tasks.embedded.load_split``).
"""

from __future__ import annotations

import functools
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tasks.info import BENCHMARK_TASKS, EMBEDDED_TASKS, TASKS, TaskInfo, UnknownTask, task_info  # noqa: F401

TASKS_DIR = Path(__file__).resolve().parent
INVALID = "[invalid]"


# ---------------------------------------------------------------- embedded kinds
def extract_math(text: str) -> str:
    """'#### <int>' if present, else the last integer in the text (gsm8k flexible style)."""
    m = re.search(r"#### (-?\d+)", text)
    if m:
        return m.group(1)
    ints = re.findall(r"-?\d+", text)
    return ints[-1] if ints else INVALID


def extract_choice(text: str) -> str:
    m = re.search(r"answer is \(?([A-J])\)?", text)
    return m.group(1) if m else INVALID


def extract_code(text: str) -> str:
    """The response itself, or its first fenced block when the model used markdown."""
    m = re.search(r"```(?:python)?\n(.*?)(?:```|$)", text, re.DOTALL)
    return m.group(1) if m else text


def python_fence(text: str) -> str:
    """The body of the first fenced ```python block of a response, else the response unchanged (what the
    ReFusion authors' model wrapper does to every generation; applied under ``--prompts paper``)."""
    m = re.search(r"```python\n(.*?)\n```", text, re.DOTALL)
    return m.group(1) if m else text


def _per_response(fn):
    def lm_eval_filter(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
        return [[fn(r) for r in resp] for resp in resps]
    return lm_eval_filter


embedded_math_filter = _per_response(extract_math)
embedded_choice_filter = _per_response(extract_choice)
embedded_code_filter = _per_response(extract_code)


def code_program(response: str, doc: dict) -> str:
    """Embedded code as one text (solution, then its asserts), for display; scoring keeps them apart."""
    return extract_code(response) + "\n" + "\n".join(doc["tests"])


def _score_embedded(name: str, responses: list[str], docs: list[dict]) -> list[dict]:
    key = TASKS[name].primary
    if name == "embedded_math":
        return [{key: float(extract_math(r) == str(d["answer"]))} for r, d in zip(responses, docs)]
    if name == "embedded_choice":
        return [{key: float(extract_choice(r) == str(d["answer"]))} for r, d in zip(responses, docs)]
    from tasks.code_exec import run_checks

    results = run_checks([(extract_code(r), "\n".join(d["tests"])) for r, d in zip(responses, docs)])
    return [{key: float(res.passed)} for res in results]


# ---------------------------------------------------------------- lm-eval tasks
def task_manager(include_defaults: bool = False, extra_dirs=()):
    """A TaskManager that indexes our YAMLs, then the folders ``extra_dirs`` (a user's tasks, ``--tasks-dir``).
    Entries from include_path override lm-eval's built-ins of the same name and later paths win over
    earlier ones (with a warning), so ours are used either way and a user's folder wins over ours;
    include_defaults=False is the default because it skips indexing ~10k built-in YAMLs and removes the
    ambiguity altogether."""
    from lm_eval.tasks import TaskManager

    extra = [str(d) for d in extra_dirs if Path(d).resolve() != TASKS_DIR]
    return TaskManager(include_path=[str(TASKS_DIR), *extra] if extra else str(TASKS_DIR),
                       include_defaults=include_defaults)


def lm_eval_task(leaf: str):
    """The lm-eval Task object of one of our leaf tasks (built once per process and data dir: the Task holds
    its dataset, so a changed ``REFUSION_DATA_DIR`` builds it again)."""
    return _lm_eval_task(leaf, os.environ.get("REFUSION_DATA_DIR"))


@functools.lru_cache(maxsize=64)
def _lm_eval_task(leaf: str, data_dir: str | None):
    return task_manager().load([leaf])["tasks"][leaf]


def score_docs_with_task(task, responses: list[str], docs: list[dict], workers: int = 1) -> list[dict]:
    """Run lm-eval's filters and process_results on (response, doc) pairs, as its evaluator does."""
    from lm_eval.api.instance import Instance

    instances = []
    for i, (resp, doc) in enumerate(zip(responses, docs)):
        inst = Instance(request_type="generate_until", doc=doc, arguments=("", {}), idx=0,
                        metadata=(task.config.task, i, 1))
        inst.resps = [resp]
        instances.append(inst)
    if not instances:
        return []
    for ensemble in task._filters:
        ensemble.apply(instances)

    def one(inst) -> dict:
        out = {}
        for filter_key, filtered in inst.filtered_resps.items():
            for metric, value in task.process_results(inst.doc, [filtered]).items():
                out[f"{metric},{filter_key}"] = float(value)
        return out

    if workers <= 1:
        return [one(inst) for inst in instances]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, instances))


def score_many(task_name: str, responses: list[str], docs: list[dict], workers: int = 1) -> list[dict]:
    """Every "metric,filter" score for each (response, doc) pair."""
    info = task_info(task_name)
    if len(responses) != len(docs):
        raise ValueError(f"{len(responses)} responses but {len(docs)} docs")
    if task_name in EMBEDDED_TASKS:
        return _score_embedded(task_name, list(responses), list(docs))
    # All leaves of a group share filters and metrics: score with the first one.
    return score_docs_with_task(lm_eval_task(info.leaves[0]), list(responses), list(docs), workers)


def score_details(task_name: str, response: str, doc: dict) -> dict:
    return score_many(task_name, [response], [doc])[0]


def score(task_name: str, response: str, doc: dict) -> float:
    """The task's headline metric (TASKS[...].primary) for one response."""
    return score_details(task_name, response, doc)[task_info(task_name).primary]
