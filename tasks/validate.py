"""`python -m harness validate-tasks`: score every task's gold answers (docs/design.md §5).

For each task of the task table (tasks/info.py), builds its lm-eval Task(s) from our YAMLs, writes the gold
answer of each document in the form the prompt asks for, scores it through the
task's own filters and metrics (tasks.scoring) and prints one line:

    task  items  gold=<primary score>  wrong=<score of a deliberately wrong answer>

plus any item whose gold answer failed. Any other task (a user's, from ``--tasks-dir``) gets the
generic checks of ``validate_generic``. Exit 0 when every gold score is 1 and every wrong score
is 0 (items listed in KNOWN_GOLD_FAILURES excepted), else 1; 2 with one ``error:`` line for bad
input or data that is not there (no REFUSION_DATA_DIR offline).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

from tasks import math_equiv
from tasks.info import BENCHMARK_TASKS, EMBEDDED_TASKS, PAPER_TASKS, PAPER_VARIANTS, TASKS, UnknownTask, task_info
from tasks.scoring import lm_eval_task, score_many, task_manager

ALL_TASKS = BENCHMARK_TASKS + PAPER_TASKS + EMBEDDED_TASKS
# Reference solutions that fail under the upstream task definition itself.
KNOWN_GOLD_FAILURES = {
    # MBPP task 367's tests use trees built in `test_setup_code`, which lm-eval's
    # mbpp task never puts into the program (NameError: root).
    ("mbpp", 367): "tests need test_setup_code, which lm-eval's mbpp omits",
    ("mbpp_paper", 367): "tests need test_setup_code, which lm-eval's mbpp omits",
}


def _other_letter(letter: str, n: int) -> str:
    letters = "ABCDEFGHIJ"[:max(n, 2)]
    return letters[(letters.index(letter) + 1) % len(letters)] if letter in letters else "A"


def gold_and_wrong(task: str, doc: dict) -> tuple[str, str]:
    """(gold response, wrong response) for one processed doc, shaped as the prompt asks."""
    if task == "humaneval_instruct_noprefix":  # the answer opens inside a fence: the whole function
        return (doc["prompt"] + doc["canonical_solution"] + "\n```\n",
                doc["prompt"] + "    raise ValueError('deliberately wrong')\n```\n")
    task = {paper: stock for stock, paper in PAPER_VARIANTS.items()}.get(task, task)
    if task == "mmlu_pro":
        return (f"Let's think step by step. The answer is ({doc['answer']}).",
                f"The answer is ({_other_letter(doc['answer'], len(doc['options']))}).")
    if task == "arc_challenge_chat":
        key = doc["answerKey"]
        gold = "ABCD"[int(key) - 1] if key in "1234" else key
        return " " + gold, " " + _other_letter(gold, 4)
    if task == "gsm8k_cot":
        reasoning, _, final = doc["answer"].partition("####")
        reasoning = re.sub(r"<<[^>]*>>", "", reasoning).strip().replace("\n", " ")
        final = final.strip()
        wrong = str(int(final.replace(",", "")) + 1)
        return f"{reasoning} The answer is {final}.", f"{reasoning} The answer is {wrong}."
    if task == "minerva_math":
        # One line: a few boxed answers wrap ("90\\text{ square\\nfeet}") and the
        # "Final Answer: ..." pattern does not cross lines.
        boxed = math_equiv.unbox(math_equiv.last_boxed(doc["solution"])).replace("\n", " ")
        return (f"{doc['solution']}\nFinal Answer: The final answer is ${boxed}$. I hope it is correct.",
                "Final Answer: The final answer is $-987654321$. I hope it is correct.")
    if task.startswith("gpqa_main_generative"):
        letter = doc["answer"].strip("()")
        return f"The answer is {doc['answer']}.", f"The answer is ({_other_letter(letter, 4)})."
    if task == "humaneval_instruct":
        return doc["canonical_solution"] + "\n```\n", "    raise ValueError('deliberately wrong')\n```\n"
    if task == "mbpp":
        return doc["code"], "def unrelated_function():\n    return None\n"
    if task == "embedded_math":
        return doc["response"], f"#### {int(doc['answer']) + 1}"
    if task == "embedded_choice":
        return doc["response"], f"The answer is ({_other_letter(doc['answer'], 10)})"
    if task == "embedded_code":
        return doc["response"], "def unrelated_function():\n    return None\n"
    raise UnknownTask(f"no gold formatter for task {task!r}")


def _doc_id(task: str, doc: dict, index: int):
    return doc.get("task_id", index) if task in ("mbpp", "mbpp_paper") else index


def validate_task(task: str, limit: int | None, workers: int) -> dict:
    info = task_info(task)
    docs: list[dict] = []
    for leaf in info.leaves:
        docs.extend(dict(d) for d in lm_eval_task(leaf).eval_docs)
    if limit is not None:
        docs = docs[:limit]
    pairs = [gold_and_wrong(task, d) for d in docs]
    gold = score_many(task, [g for g, _ in pairs], docs, workers)
    wrong = score_many(task, [w for _, w in pairs], docs, workers)
    key = info.primary
    failures = [(_doc_id(task, d, i), g) for i, (d, g) in enumerate(zip(docs, gold)) if g[key] != 1.0]
    unexpected = [f for f in failures if (task, f[0]) not in KNOWN_GOLD_FAILURES]
    n = max(len(docs), 1)
    other_keys = sorted(k for k in gold[0] if k != key) if gold else []
    return {"task": task, "items": len(docs), "metric": key,
            "gold": sum(g[key] for g in gold) / n, "wrong": sum(w[key] for w in wrong) / n,
            "other_gold": {k: sum(g[k] for g in gold) / n for k in other_keys},
            "other_wrong": {k: sum(w[k] for w in wrong) / n for k in other_keys},
            "failures": failures, "unexpected": unexpected}


# ---------------------------------------------------------------- any task (docs/extending.md)


def validate_generic(name: str, tm, limit: int | None, workers: int) -> dict:
    """The checks every task gets, ours or a user's: each document renders, each row has a non-empty gold
    answer (tasks/checks.py), and, for a generated-answer task scored by exact_match (the metric that
    compares a response with the target), the gold answer's own text scores 1 and an empty response 0.
    Other scorers (code execution, a custom function) cannot take the target text as an answer: their
    score is shown, not checked."""
    from tasks.checks import target_problem
    from tasks.scoring import score_docs_with_task

    loaded = tm.load([name])
    problems, gold_scores, wrong_scores, items, checked = [], [], [], 0, True
    for leaf, task in sorted(loaded.get("tasks", {}).items()):
        docs = [dict(d) for d in task.eval_docs]
        docs = docs[:limit] if limit is not None else docs
        items += len(docs)
        for i, doc in enumerate(docs):
            try:
                task.doc_to_text(doc)
                problem = target_problem(task, doc)
                if task.OUTPUT_TYPE == "multiple_choice":
                    task.doc_to_choice(doc)
            except Exception as e:  # noqa: BLE001 - templates and hooks raise anything
                problem = f"does not render: {type(e).__name__}: {e}".replace("\n", " ")
            if problem:
                problems.append(f"{leaf} row {i + 1}: {problem}")
        if problems or task.OUTPUT_TYPE != "generate_until" or not docs:
            continue
        golds = [str(task.doc_to_target(d)) for d in docs]
        gold_scores += score_docs_with_task(task, golds, docs, workers)
        wrong_scores += score_docs_with_task(task, [""] * len(docs), docs, workers)
        checked = checked and any(m.get("metric") == "exact_match" for m in task.config.metric_list or [])
    keys = sorted(gold_scores[0]) if gold_scores else []
    n = max(len(gold_scores), 1)
    return {"task": name, "items": items, "problems": problems, "checked": checked and bool(keys),
            "gold": {k: sum(g[k] for g in gold_scores) / n for k in keys},
            "wrong": {k: sum(w[k] for w in wrong_scores) / n for k in keys}}


def _report_generic(r: dict, seconds: float) -> bool:
    scores = "  ".join(f"{k}: gold={r['gold'][k]:.4f} wrong={r['wrong'][k]:.4f}" for k in r["gold"])
    note = "" if r["checked"] or not r["gold"] else "  (gold not checked: the scorer is not exact_match)"
    print(f"{r['task']:<22} items={r['items']:<6} {scores or 'no generated answers to score'}  ({seconds:.1f}s){note}",
          flush=True)
    for line in r["problems"][:20]:
        print(f"    bad document: {line}")
    if len(r["problems"]) > 20:
        print(f"    ... and {len(r['problems']) - 20} more")
    exact = [k for k in r["gold"] if k.startswith("exact_match,")]
    if r["checked"] and any(r["gold"][k] != 1.0 for k in exact):
        print(f"    gold failed: the targets' own text does not score 1 under {r['task']}'s filters and exact_match")
        return False
    return not r["problems"] and not any(r["wrong"][k] > 0 for k in exact)


def _data_error(exc: BaseException) -> str | None:
    """The message of a DataError anywhere in an exception's chain (lm-eval and datasets wrap them)."""
    from tasks.data import DataError

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, DataError):
            return str(exc).replace("\n", " ")
        exc = exc.__cause__ or exc.__context__
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness validate-tasks", description=__doc__.split("\n")[0])
    p.add_argument("--tasks", default=",".join(ALL_TASKS),
                   help=f"comma-separated task names (default: all built-in ones: {', '.join(TASKS)}); any task "
                   "of --tasks-dir too, with the generic checks")
    p.add_argument("--tasks-dir", action="append", default=[], metavar="DIR",
                   help="a folder of your own lm-eval task YAMLs, added to the built-in ones (repeatable)")
    p.add_argument("--limit", type=int, default=None, help="score only the first N items of each task")
    p.add_argument("--workers", type=int, default=max(2, (os.cpu_count() or 2) * 2),
                   help="concurrent sandboxed programs for the code tasks")
    args = p.parse_args(argv)
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if args.limit is not None and args.limit <= 0:
        print("error: --limit must be a positive integer", file=sys.stderr)
        return 2
    bad_dirs = [d for d in args.tasks_dir if not os.path.isdir(d)]
    if bad_dirs:
        print(f"error: --tasks-dir {bad_dirs[0]!r} is not a folder", file=sys.stderr)
        return 2
    import logging

    import datasets

    datasets.disable_progress_bars()  # one line per task, not a progress bar per subtask
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    tm = task_manager(extra_dirs=args.tasks_dir)
    valid = set(tm.all_tasks) | set(tm.all_groups) | set(TASKS)
    unknown = [t for t in names if t not in valid]
    if unknown:
        print(f"error: unknown task(s) {', '.join(unknown)}; known tasks: {', '.join(sorted(valid))}", file=sys.stderr)
        return 2
    try:
        return _validate_all(names, tm, args)
    except Exception as e:  # noqa: BLE001 - only a data error is the user's to fix; anything else is a bug
        msg = _data_error(e)
        if msg is None:
            raise
        print(f"error: {msg}", file=sys.stderr)
        return 2


def _validate_all(names: list[str], tm, args) -> int:
    ok = True
    t_all = time.monotonic()
    for name in names:
        t0 = time.monotonic()
        if name not in TASKS:
            ok = _report_generic(validate_generic(name, tm, args.limit, args.workers), time.monotonic() - t0) and ok
            continue
        r = validate_task(name, args.limit, args.workers)
        extra = "".join(f"  {k}: gold={r['other_gold'][k]:.4f} wrong={r['other_wrong'][k]:.4f}"
                        for k in r["other_gold"])
        print(f"{name:<22} items={r['items']:<6} {r['metric']:<30} gold={r['gold']:.4f} "
              f"wrong={r['wrong']:.4f}  ({time.monotonic() - t0:.1f}s){extra}", flush=True)
        for doc_id, _ in r["failures"]:
            why = KNOWN_GOLD_FAILURES.get((name, doc_id), "UNEXPECTED")
            print(f"    gold failed: {name} item {doc_id}: {why}")
        ok = ok and not r["unexpected"] and r["wrong"] == 0.0
    print(f"total {time.monotonic() - t_all:.1f}s: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
