"""`python -m harness validate-tasks`: score every task's gold answers (docs/design.md §5).

For each task, builds its lm-eval Task(s) from our YAMLs, writes the gold
answer of each document in the form the prompt asks for, scores it through the
task's own filters and metrics (tasks.scoring) and prints one line:

    task  items  gold=<primary score>  wrong=<score of a deliberately wrong answer>

plus any item whose gold answer failed. Exit 0 when every gold score is 1 and
every wrong score is 0 (items listed in KNOWN_GOLD_FAILURES excepted), else 1.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

from tasks import math_equiv
from tasks.info import BENCHMARK_TASKS, EMBEDDED_TASKS, PAPER_TASKS, PAPER_VARIANTS, TASKS, UnknownTask, task_info
from tasks.scoring import lm_eval_task, score_many

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness validate-tasks", description=__doc__.split("\n")[0])
    p.add_argument("--tasks", default=",".join(ALL_TASKS),
                   help=f"comma-separated task names (default: all). Known: {', '.join(TASKS)}")
    p.add_argument("--limit", type=int, default=None, help="score only the first N items of each task")
    p.add_argument("--workers", type=int, default=max(2, (os.cpu_count() or 2) * 2),
                   help="concurrent sandboxed programs for the code tasks")
    args = p.parse_args(argv)
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in names if t not in TASKS]
    if unknown:
        print(f"error: unknown task(s) {', '.join(unknown)}; known tasks: {', '.join(TASKS)}", file=sys.stderr)
        return 2
    if args.limit is not None and args.limit <= 0:
        print("error: --limit must be a positive integer", file=sys.stderr)
        return 2
    import datasets

    datasets.disable_progress_bars()  # one line per task, not a progress bar per subtask
    ok = True
    t_all = time.monotonic()
    for name in names:
        t0 = time.monotonic()
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
