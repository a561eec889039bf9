"""pass@1 for code tasks through tasks.sandbox (docs/design.md §5: hub `code_eval` fails offline).

lm-eval's code_eval would run ``prediction + "\\n" + reference`` as one program. We
keep the two apart: the prediction runs in the sandbox's candidate process, the
reference (the tests) in its judge, which calls the prediction's functions and
compares plain results itself (see tasks.sandbox). A reference may carry a
trusted prelude, the task's own prompt code, whose helpers the tests use:

    # judge: remote=<name>[,<name>...]     names the tests must take from the prediction
    <prelude>
    # judge: tests
    <tests>

Without the header the whole reference is tests. Greedy decoding gives one
sample per problem, so pass@1 is the fraction of programs that pass.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tasks.sandbox import SandboxResult, run_many

REMOTE_HEADER = "# judge: remote="
TESTS_MARK = "# judge: tests"


@dataclass(frozen=True)
class CodeLimits:
    # code_eval uses 3 s; MBPP 123's reference needs ~9 s of CPU on a
    # loaded 2-core box, so 20 s keeps gold answers passing while bounding hung programs.
    timeout_s: float = 20.0
    memory_mb: int = 1024
    workers: int = max(2, min(8, os.cpu_count() or 2))


def split_reference(reference: str) -> tuple[str, str, tuple[str, ...]]:
    """(prelude, tests, remote names) of a reference in the format of the module doc."""
    first, _, rest = reference.partition("\n")
    if not first.startswith(REMOTE_HEADER):
        return "", reference, ()
    remote = tuple(n.strip() for n in first[len(REMOTE_HEADER):].split(",") if n.strip())
    lines = rest.split("\n")
    if TESTS_MARK not in lines:
        return "", rest, remote
    i = lines.index(TESTS_MARK)
    return "\n".join(lines[:i]), "\n".join(lines[i + 1:]), remote


def run_checks(pairs: list[tuple[str, str]], limits: CodeLimits = CodeLimits()) -> list[SandboxResult]:
    """Each (prediction, reference) run in the sandbox: the prediction as the candidate, the reference as tests."""
    items = [(pred, *split_reference(ref)) for pred, ref in pairs]
    items = [(p, tests, prelude, remote) for p, prelude, tests, remote in items]
    return run_many(items, workers=limits.workers, timeout_s=limits.timeout_s, memory_mb=limits.memory_mb)


def pass_at_1(references: list[str] | str, predictions: list[list[str]] | list[str],
              limits: CodeLimits = CodeLimits()) -> float:
    """Mean over problems of "the first prediction passes its tests"."""
    refs = [references] if isinstance(references, str) else list(references)
    preds = [p if isinstance(p, str) else p[0] for p in predictions]
    if len(refs) != len(preds):
        raise ValueError(f"{len(refs)} references but {len(preds)} predictions")
    if not refs:
        return 0.0
    results = run_checks(list(zip(preds, refs)), limits)
    return sum(r.passed for r in results) / len(results)
