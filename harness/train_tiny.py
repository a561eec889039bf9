"""`python -m harness train-tiny`: the tiny-model trainer (refusion/train.py) fed with the embedded
suite's training split. The trainer takes its corpus as an argument, so the model package does not
depend on the task definitions."""

from __future__ import annotations

import sys


def embedded_corpus() -> dict[str, list[dict]]:
    """Training rows of every embedded kind (query / response texts), generated deterministically."""
    from tasks.embedded import KINDS, load_split

    return {kind: load_split(kind, "train") for kind in KINDS}


def main(argv: list[str] | None = None) -> int:
    from refusion import train

    return train.main(sys.argv[1:] if argv is None else argv, corpus=embedded_corpus, entry=__name__)


if __name__ == "__main__":
    sys.exit(main())
