"""Command-line entry point: `python -m harness <command> [args]`.

Each command lives in its own module exposing ``main(argv) -> int``; this file
only dispatches, so `--help` stays instant and works before every module
exists. A command whose module is not built yet ends with a one-line message
(exit 2), never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import signal
import sys
from typing import Iterator

# command -> ("module" with main(argv) or "module:function", one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "eval": ("harness.run.runner", "run decoders on a task or suite and record quality and speed"),
    "validate-tasks": ("tasks.validate", "score every task's gold answers (one line per task)"),
    "train-tiny": ("harness.train.train_tiny", "train the tiny models (ar from scratch, the others from its weights)"),
    "bench-decoders": ("harness.speed.bench", "benchmark every decoder on the embedded suite (JSON to results/)"),
    "bench-kernels": ("harness.speed.bench_kernels", "time and memory of the slot-attention kernels (JSON to results/)"),
    "bench-e2e": ("harness.speed.bench_e2e", "end-to-end decode timing at the Qwen3-8B shape on random weights (GPU check)"),
    "scaling": ("harness.speed.scaling", "latency, tokens/s, NFE and peak memory vs generation, prompt and batch size"),
    "bench-compile": ("harness.speed.bench_compile", "eager vs compiled decoding (knob compile) at the 8B shapes on random weights (GPU check)"),
    "generate-eval": ("harness.run.hf_generate", "accuracy of causal checkpoints with plain model.generate (left to right)"),
    "knobs": ("harness.run.knobs", "every decoder's knobs: defaults, accepted values, help"),
    "data": ("tasks.data", "show where each benchmark's data is read from"),
    "regress": ("harness.speed.regress", "compare the default run with the committed baseline (CI regression check)"),
    "regress-update": ("harness.speed.regress:main_update", "rewrite the regression baseline on purpose (--reason)"),
    "merge": ("harness.run.merge", "join the shards of one run (eval --shard I/N) into one run folder"),
    "report": ("harness.report.paper_report", "the paper's Table 1, speedups and figures from one or more runs"),
    "sweep": ("harness.report.sweep", "ReFusion accuracy vs tokens/s as its knobs vary (ablation view)"),
    "frontier": ("harness.report.frontier", "every decoder's accuracy-parallelism frontier over its grid, with AUP"),
    "compare": ("harness.report.compare", "the same models in two or more runs side by side, with ratios"),
    "spread": ("harness.speed.spread", "how far a second run lands: repeated idle runs, compare over their pairs, A/Bs"),
    "curves": ("harness.train.curves", "learning curves: preset decoders on 100 test items per kind vs training step"),
    "engine-check": ("harness.speed.engine_check", "the real vLLM engine row: lifecycle, agreement with ar, timings (JSON to results/)"),
    "trace": ("harness.report.trace", "how each decoder fills one answer, forward by forward (figures, GIFs, HTML)"),
}


def _one_line_error(parser: argparse.ArgumentParser, message: str) -> None:
    """argparse's error() without the usage block: one `error:` line naming the command, exit 2."""
    print(f"error: {parser.prog}: {message} (see `{parser.prog} --help`)".replace("\n", " "), file=sys.stderr)
    raise SystemExit(2)


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Every argparse parser built while a command runs reports bad options as one line.

    The commands (and tasks.validate / tasks.data, which may not import harness) build plain
    ``argparse.ArgumentParser``s; swapping the class's ``error`` for the command's duration covers
    all of them without each module knowing about it. Restored afterwards.
    """
    saved = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = _one_line_error  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.error = saved  # type: ignore[method-assign]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m harness",
        description="refusion-bench: evaluate ReFusion and its AR / MDM rivals side by side.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {k:<16} {v[1]}" for k, v in COMMANDS.items())
        + "\n\nRun `python -m harness <command> --help` for a command's options.",
    )
    p.add_argument("command", choices=sorted(COMMANDS), metavar="command", help="one of: " + ", ".join(COMMANDS))
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the command")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        _parser().print_help()
        return 0
    if argv[0] not in COMMANDS and not argv[0].startswith("-"):
        print(f"error: unknown command {argv[0]!r}; valid commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    # SIGTERM and SIGUSR1 (Slurm's warning before a job's end) unwind like an exception, so a command's
    # temporary files and folders are removed on the way out (atomic writes: nothing is half-written).
    saved = {sig: signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
             for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        return _dispatch(argv)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _dispatch(argv: list[str]) -> int:
    with one_line_errors():
        ns = _parser().parse_args(argv)
        module_name, _, func = COMMANDS[ns.command][0].partition(":")
        if importlib.util.find_spec(module_name) is None:
            print(f"error: `{ns.command}` is not available yet: module {module_name} is not built", file=sys.stderr)
            return 2
        module = importlib.import_module(module_name)
        try:
            return int(getattr(module, func or "main")(ns.args) or 0)
        except OSError as e:
            # A full disk or quota, wherever a command writes: one line naming the path (harness/run/faults.py).
            from harness.run.faults import disk_full

            line = disk_full(e)
            if line is None or "--debug" in ns.args:
                raise
            print(f"error: {line}, then rerun the same command (a run resumes where it stopped)", file=sys.stderr)
            return 2


if __name__ == "__main__":
    raise SystemExit(main())
