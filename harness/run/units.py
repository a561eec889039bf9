"""Task and data validation: task names -> the run's units (a benchmark or a leaf task each), every document
the run will use rendered and its gold answer checked before anything is written."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from harness.run.errors import root_message
from harness.run.hints import did_you_mean
from harness.run.hints import short_list as hints_short_list
from harness.run.model_list import InputError
from tasks.checks import target_problem
from tasks.scoring import task_manager


def task_names(task_arg: str, tm) -> list[str]:
    """The comma list's names, each a task or group of ``tm`` (a TaskManager: indexing only, no data read);
    InputError listing the valid names otherwise."""
    from tasks.info import TASK_ALIASES

    valid = sorted(set(tm.all_tasks) | set(tm.all_groups))
    names = [t.strip() for t in task_arg.split(",") if t.strip()]
    lister = "python -m harness validate-tasks"
    if not names:
        raise InputError("no task given; valid tasks: " + hints_short_list(valid, tm.all_groups, lister=lister))
    for name in names:
        if name not in valid:
            raise InputError(f"unknown task {name!r}{did_you_mean(name, [*valid, *TASK_ALIASES])}; valid tasks: "
                             + hints_short_list(valid, tm.all_groups, lister=lister))
    return names


def resolve_units(task_arg: str, tasks_dirs: list[Path], limit: int | None = None,
                  budgets: dict[str, int | None] | None = None, tm=None) -> list[dict]:
    """Task names -> units ({name, leaves, primary}); raises InputError for unknown names or missing data.

    A unit is what one metrics file covers: a benchmark (mmlu_pro with its 14 subjects
    is one unit) or a leaf task. A suite group without an aggregate (``embedded``)
    expands to its members. ``budgets``, when given, is filled with each leaf's
    response budget (``generation_budget``). ``tm``: the TaskManager over tasks/ and
    ``tasks_dirs`` when the caller built it already.
    """
    import logging

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    try:  # validation output is one line at most: no dataset-building progress bars
        import datasets

        datasets.disable_progress_bars()
    except ImportError:
        pass
    from tasks.info import TASKS as KNOWN
    tm = tm or task_manager(extra_dirs=tasks_dirs)
    names = task_names(task_arg, tm)
    units: list[dict] = []
    for name in names:
        try:
            loaded = tm.load([name])
        except Exception as e:  # noqa: BLE001 - lm-eval wraps dataset errors in many types
            raise InputError(f"task {name!r}: cannot load its data: {root_message(e)}") from e
        gmap = loaded.get("group_map", {})
        checked = {leaf: check_docs(leaf, task, limit) for leaf, task in loaded.get("tasks", {}).items()}
        counts = {leaf: n for leaf, (n, _) in checked.items()}
        leaf_budgets = {leaf: generation_budget(task) for leaf, task in loaded.get("tasks", {}).items()}
        if budgets is not None:
            budgets.update(leaf_budgets)

        for u in _expand(name, gmap, stop=KNOWN):
            # A unit is a known benchmark (its own leaves) or, past every group, a leaf task itself.
            leaves = sorted(KNOWN[u].leaves) if u in KNOWN else [u]
            primary = KNOWN[u].primary if u in KNOWN else None
            if not any(x["name"] == u for x in units):  # samples: documents after LIMIT (overall progress)
                digest = hashlib.sha256("".join(checked[leaf][1] for leaf in leaves if leaf in checked).encode())
                units.append({"name": u, "leaves": leaves, "primary": primary,
                              "samples": sum(counts.get(leaf, 0) for leaf in leaves),
                              # per leaf: documents after LIMIT (what --shard splits), the request budget
                              "docs": {leaf: counts.get(leaf, 0) for leaf in leaves},
                              "max_gen_toks": max((leaf_budgets.get(leaf) or 0 for leaf in leaves), default=0) or None,
                              "data_sha256": digest.hexdigest()})
    return units


def _data_where(task) -> str:
    """The file (or dataset) a task's documents come from, for error messages."""
    cfg = getattr(task, "config", None)
    kw = dict(getattr(cfg, "dataset_kwargs", None) or {})
    split = getattr(cfg, "test_split", None) or getattr(cfg, "validation_split", None) or "test"
    files = kw.get("data_files")
    if isinstance(files, dict):
        files = files.get(split) or next(iter(files.values()), None)
    if files:
        return str(files[0] if isinstance(files, list) else files)
    if "benchmark" in kw:
        try:
            from tasks.data import resolve

            return resolve(kw["benchmark"], kw.get("split", split)).describe()
        except Exception:  # noqa: BLE001 - embedded benchmarks and bad names: fall back to the name
            return f"{kw['benchmark']} split {kw.get('split', split)}"
    return str(getattr(cfg, "dataset_path", None) or "its dataset")


def check_docs(leaf: str, task, limit: int | None) -> tuple[int, str]:
    """Render every document the run will use with the task's templates and check its gold answer
    (tasks/checks.py); InputError naming the first bad one. Returns how many documents the run will use
    and a hash of them (shards of one run must agree on it).

    lm-eval checks only the first document when it builds a task, so a bad later row
    would otherwise stop the model's worker mid-run.
    """
    try:
        docs = task.eval_docs
    except Exception as e:  # noqa: BLE001
        raise InputError(f"task {leaf!r}: cannot load its data: {root_message(e)}") from e
    choice = getattr(task, "OUTPUT_TYPE", None) == "multiple_choice"
    n = 0
    digest = hashlib.sha256()
    for i, doc in enumerate(docs):
        if limit is not None and i >= limit:
            break
        n += 1
        digest.update(json.dumps(doc, sort_keys=True, default=str).encode())
        try:
            task.doc_to_text(doc)
            problem = target_problem(task, doc)  # also renders the target
            if choice:
                task.doc_to_choice(doc)
        except Exception as e:  # noqa: BLE001 - templates and hooks raise anything; the document is what matters
            why = root_message(e)
            raise InputError(f"task {leaf!r}, document {i} of {_data_where(task)}: {why}") from e
        if problem:
            raise InputError(f"task {leaf!r}, row {i + 1} of {_data_where(task)}: {problem}")
    return n, digest.hexdigest()


def generation_budget(task) -> int | None:
    """The response budget a ``generate_until`` task's requests carry (``max_gen_toks``, as the adapter reads
    it: harness/run/lm_requests.py), or None for a task that generates nothing."""
    from harness.run.lm_requests import DEFAULT_MAX_GEN_TOKS

    if getattr(task, "OUTPUT_TYPE", None) != "generate_until":
        return None
    kwargs = dict(getattr(task.config, "generation_kwargs", None) or {})
    return int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))


def _expand(name: str, gmap: dict, stop=()) -> list[str]:
    """A group's members, groups expanded recursively (``gmap``: lm-eval's group -> members), down to the leaf
    tasks or to a name in ``stop`` (a benchmark that is one unit with its subtasks)."""
    if name in stop or name not in gmap:
        return [name]
    return [u for child in gmap[name] for u in _expand(child, gmap, stop)]


def paper_tasks(task_arg: str) -> str:
    """The comma list with every task that has the authors' prompt variant replaced by it."""
    from tasks.info import TASKS

    names = [t.strip() for t in task_arg.split(",") if t.strip()]
    return ",".join(TASKS[n].paper_variant if n in TASKS and TASKS[n].paper_variant else n for n in names)

