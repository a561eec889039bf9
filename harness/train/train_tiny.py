"""`python -m harness train-tiny`: the tiny-model trainer (refusion/train.py) fed with the embedded
suite's training split. The trainer takes its corpus as an argument, so the model package does not
depend on the task definitions.

Here too: where an open-ended item may end (``cut_chars``, used by ``--open-share``) and the
learning curves evaluated as the trainer writes snapshots (``--curves``, harness/train/curves.py)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

# A math solution line "After ...: 90 + 37 = 127." states an intermediate result; the next line
# or the final "#### 127" restates it. An open-ended item ends right after the line's period.
RESULT_LINE = re.compile(r"= -?\d+\.(?=\n|$)")


def math_cut_chars(response: str) -> list[int]:
    """Character offsets just after each intermediate result ("= 127.") of a math response."""
    return [m.end() for m in RESULT_LINE.finditer(response)]


NUMBER = re.compile(r"\d+")


def math_number_spans(response: str) -> list[tuple[int, int]]:
    """Character spans of every number of a math response: the first line's amount, each line's two
    operands and result, and the final answer."""
    return [m.span() for m in NUMBER.finditer(response)]


def embedded_corpus() -> dict[str, list[dict]]:
    """Training rows of every embedded kind (query / response texts), generated deterministically; math
    rows carry ``cut_chars`` and ``number_spans`` (the mixtures' cut points and every number; the rows
    and texts are the same either way)."""
    from tasks.embedded import KINDS, load_split

    rows = {kind: load_split(kind, "train") for kind in KINDS}
    for r in rows["math"]:
        r["cut_chars"] = math_cut_chars(r["response"])
        r["number_spans"] = math_number_spans(r["response"])
    return rows


def add_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("learning curves (harness/train/curves.py)")
    g.add_argument("--curves", action=argparse.BooleanOptionalAction, default=False,
                   help="evaluate every snapshot (--snapshot-every) as it is written on the embedded test slice "
                   "with the model's preset decoder; record to --curves-out")
    g.add_argument("--curves-n", type=int, default=100, help="test items per kind (the first n)")
    g.add_argument("--curves-batch", type=int, default=16, help="rows per decoder call (1: the bench's TPF)")
    g.add_argument("--curves-kinds", default="math,code,choice", help="comma-separated embedded kinds")
    g.add_argument("--curves-out", default="reports/curves/curves.json", help="curves JSON (the figure beside it)")


def make_hook(a: argparse.Namespace):
    if not a.curves:
        return None
    if a.snapshot_every < 1:
        raise SystemExit("error: --curves needs --snapshot-every N (the steps at which curves are evaluated)")
    from harness.train.curves import snapshot_hook

    out = Path(a.curves_out)
    kinds = tuple(k.strip() for k in a.curves_kinds.split(",") if k.strip())
    return snapshot_hook(out, Path(a.out), a.curves_n, a.curves_batch, kinds)


def main(argv: list[str] | None = None) -> int:
    from refusion import train

    return train.main(sys.argv[1:] if argv is None else argv, corpus=embedded_corpus, entry=__name__,
                      add_options=add_options, make_hook=make_hook)


if __name__ == "__main__":
    sys.exit(main())
