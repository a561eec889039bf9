"""pass@1 for code tasks through harness.sandbox (DESIGN §5: hub `code_eval` fails offline).

The program is ``prediction + "\\n" + reference`` (solution, then its tests), the
same program lm-eval's code_eval metric would run. Greedy decoding gives one
sample per problem, so pass@1 is the fraction of programs that pass.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from harness.sandbox import SandboxResult, run_many


@dataclass(frozen=True)
class CodeLimits:
    # code_eval uses 3 s; MBPP 123's reference needs ~9 s of CPU on a
    # loaded 2-core box, so 20 s keeps gold answers passing while bounding hung programs.
    timeout_s: float = 20.0
    memory_mb: int = 1024
    workers: int = max(2, min(8, os.cpu_count() or 2))


def run_checks(programs: list[str], limits: CodeLimits = CodeLimits()) -> list[SandboxResult]:
    return run_many(programs, workers=limits.workers, timeout_s=limits.timeout_s, memory_mb=limits.memory_mb)


def pass_at_1(references: list[str] | str, predictions: list[list[str]] | list[str],
              limits: CodeLimits = CodeLimits()) -> float:
    """Mean over problems of "the first prediction passes its tests"."""
    refs = [references] if isinstance(references, str) else list(references)
    preds = [p if isinstance(p, str) else p[0] for p in predictions]
    if len(refs) != len(preds):
        raise ValueError(f"{len(refs)} references but {len(preds)} predictions")
    if not refs:
        return 0.0
    results = run_checks([p + "\n" + r for p, r in zip(preds, refs)], limits)
    return sum(r.passed for r in results) / len(results)
