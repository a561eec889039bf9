"""`python -m harness eval` / `make eval`: run decoders on a task or suite through lm-eval and
record quality, latency, tokens/s, NFE/TPF, memory and speedup (docs/design.md §6).

    python -m harness eval                          # embedded suite, tiny checkpoints, 4 decoders
    python -m harness eval --task gsm8k_cot --limit 20 \\
        --models 'ar=checkpoints/tiny/ar:ar,rf=checkpoints/tiny/refusion:refusion:slot_size=8,token_threshold=0.3'

MODELS is a comma-separated list of ``name=checkpoint:decoder[:knob=value,...]``
(knobs continue after commas until the next ``name=...:``) or preset names (harness/run/presets.py PRESETS,
docs/decoders.md; optionally ``preset:knob=value``) or ``all`` (every preset; MODEL_GROUPS there).

Everything is validated before anything is written (exit 2 with one line naming
the problem and the valid choices; ``--debug`` shows the full traceback instead).
Each model then runs in its own process (``harness.run.worker``; under ``accelerate
launch`` with ``--num-processes`` > 1), so its peak RSS is that model's.

This module holds the parser, ``build_config`` and ``main``; the steps live in modules named for their
role: units.py (tasks and data), model_check.py (models and knobs), run_dir.py (lock, resume, join),
launch.py (worker processes and signals), finalize.py (metrics and summary). Output,
all written atomically, in ``OUT/<run_id>/``:

    run.json                         settings + environment (written first)
    models/<model>/journal/          per-sample append-only journal (resume)
    models/<model>/lm_eval_results.json, samples/<task>.jsonl
    metrics/<model>__<task>.json     one per (model, task), speedup included
    summary.json, summary.md         the table

Re-running with the same ``--run-id`` resumes: finished models are skipped and
finished samples are read back from the journal, not recomputed.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any, Callable

from harness.run import cluster, summary
from harness.run.faults import STOP_SIGNALS
from harness.run.finalize import finalize
from harness.run.guard import BUSY_SHARE
from harness.run.launch import (Stopped, die_with_parent, fork_server, memory_pass, raise_stopped, run_models,
                                timed_rounds)
from harness.run.memory_pass import DEFAULT_ITEMS as MEMORY_ITEMS
from harness.run.model_check import compile_settings, describe_resolved, dtype_warning, validate_models
from harness.run.model_list import InputError, KnobHelp, load_models_file, parse_models, template_args
from harness.run.presets import DEFAULT_MODELS, MODEL_GROUPS
from harness.run.run_dir import check_out_writable, join_run_dir, prepare_run_dir
from harness.run.timing import DEFAULT_ITEMS as TIMING_ITEMS, EVAL_ROUNDS as TIMING_ROUNDS, parse_items
from harness.run.units import paper_tasks, resolve_units, task_names
from tasks.scoring import task_manager


REPO = Path(__file__).resolve().parents[2]
DEFAULT_TASK = "embedded"
# The default run (embedded suite x 4 decoders on tiny checkpoints) must finish in < 15 min on 2 cores.
DEFAULT_LIMIT = 20


def _parser() -> argparse.ArgumentParser:
    """The `eval` command's options (``--help`` prints them with the module doc)."""
    p = argparse.ArgumentParser(prog="python -m harness eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default=DEFAULT_TASK, help="task, group or comma list (default: %(default)s)")
    p.add_argument("--models", default=None, help="name=checkpoint:decoder[:knob=v,...],... or preset names, or "
                   f"'all' (every preset) (default: {','.join(DEFAULT_MODELS)} on the tiny checkpoints)")
    p.add_argument("--models-file", default=None, metavar="FILE",
                   help="the models as a TOML file, one [[models]] table each: name, path, decoder (or preset), knobs, "
                   "chat_template_args, base (harness/run/model_list.py; e.g. examples/table1_models.toml)")
    p.add_argument("--limit", type=int, default=None,
                   help=f"documents per leaf task (default: {DEFAULT_LIMIT} for the default suite, with the default "
                   "models or 'all', else all)")
    p.add_argument("--out", default="results/runs", help="output folder (default: %(default)s)")
    p.add_argument("--run-id", default=None,
                   help="run folder name; an existing one is resumed (default: a timestamp and random suffix)")
    p.add_argument("--seed", type=int, default=1234, help="seed for lm-eval and the decoders (default: %(default)s)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process (default: cores / processes)")
    p.add_argument("--num-processes", type=int, default=1,
                   help="data-parallel processes per model via accelerate launch (default: 1)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="rows per decoder call for decoders that batch (default: 1, as in the paper)")
    p.add_argument("--baseline", default=None, help="model the speedup is measured against "
                   "(default: the first model whose decoder is ar)")
    p.add_argument("--no-chat-template", action="store_true", help="send prompts without the chat template")
    p.add_argument("--chat-template-args", default="",
                   help="keyword arguments of the tokenizer's chat template, name=value[,name=value]: e.g. "
                   "enable_thinking=false for Qwen3 and ReFusion (default: none, the template's own defaults)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                   help="weights and activations (default: auto = bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--dry-run", action="store_true",
                   help="check everything, print the knob values each (model, task) will use and the requests and "
                   "generated-token budget of each, and exit (nothing is written)")
    p.add_argument("--rate", default=None,
                   help="budget tokens per second per device (a number, or an earlier run's folder for each model's own "
                   "pace there): --dry-run prints device-hours (GPU-hours on GPUs) and the ETA uses it")
    p.add_argument("--shard", default=None, help="I/N: run only shard I of N of every task's documents (every N-th "
                   "from I-1); N independent jobs (a Slurm array) cover the run, `harness merge` joins them")
    c = p.add_argument_group("several machines (accelerate launch's own options, passed through)")
    c.add_argument("--num-machines", type=int, default=None, help="machines of one data-parallel job (default: 1)")
    c.add_argument("--machine-rank", type=int, default=None, help="this machine's rank (0: the one that writes)")
    c.add_argument("--main-process-ip", default=None, help="address of machine rank 0")
    c.add_argument("--main-process-port", type=int, default=None, help="its port (default: derived from the pid)")
    c.add_argument("--accelerate-config", default=None,
                   help="accelerate's config file instead (its machines, ranks, addresses)")
    p.add_argument("--prompts", choices=("stock", "paper"), default="stock",
                   help="stock: lm-eval's prompts (default); paper: the ReFusion authors' prompt variants "
                   "(gsm8k_cot_paper, gpqa_main_generative_paper, humaneval_instruct_noprefix, mbpp_paper) "
                   "and the first ```python fence of every response, as their model wrapper (tasks/README.md)")
    p.add_argument("--no-task-defaults", action="store_true",
                   help="do not apply the paper's per-benchmark decoding settings (docs/design.md §5)")
    p.add_argument("--bootstrap-iters", type=int, default=0, help="lm-eval stderr bootstrap (default: 0 = off)")
    p.add_argument("--tasks-dir", action="append", default=[], metavar="DIR",
                   help="a folder of your own lm-eval task YAMLs, added to the built-in tasks/ (repeatable; on a "
                   "name clash the last folder wins; docs/extending.md)")
    p.add_argument("--retry-failed", action="store_true",
                   help="on resume, decode again the items that failed (out of memory, non-finite logits, forward "
                   "budget; docs/design.md \"Faults\"); without it they stay failed, counted as wrong")
    p.add_argument("--debug", action="store_true",
                   help="on an error, show the full traceback instead of the one-line message")
    _timing_arguments(p)
    p.add_argument("--memory-items", type=int, default=MEMORY_ITEMS,
                   help="calls per task and model of the memory pass, which measures peak decode memory under a tensor "
                   "tracker after the decoding pass (seeded items, batches of --batch-size rows; 0: no memory pass) "
                   "(default: %(default)s)")
    return p


def _timing_arguments(p: argparse.ArgumentParser) -> None:
    """The timing protocol's options (harness/run/timing.py)."""
    t = p.add_argument_group("timing (docs/design.md \"Timing protocol\")")
    t.add_argument("--timing", choices=("interleaved", "sequential"), default="interleaved",
                   help="interleaved: tokens/s, latency and speedup from timed rounds after the decoding pass, every "
                   "model decoding the same items in turn (default); sequential: from the decoding pass itself, one "
                   "model after another (a single pass, marked as such beside every speed figure)")
    t.add_argument("--timing-rounds", type=int, default=TIMING_ROUNDS,
                   help="timed rounds (default: %(default)s); tok/s is the median over rounds; a task's speedup the "
                   "geometric mean over its timed items of each item's median over disjoint round pairs (1+2, 3+4, "
                   "...), so an odd count leaves its last round out of the speedups")
    t.add_argument("--timing-items", default=TIMING_ITEMS,
                   help="timed items per task: a sample drawn with the run's seed from the documents every model "
                   "decoded (the first k of a seeded shuffle); a count, 'all', or 'auto': k = documents x 0.5 / rounds, "
                   "8 to 32 (every document of a task with fewer than 8), so a task's speedup describes several items "
                   "and a large run's rounds re-decode about half the decoding pass; rounded up to whole batches of "
                   "--batch-size (default: %(default)s)")
    t.add_argument("--timing-order", choices=("abba", "random"), default="abba",
                   help="the models' order within each round: ABBA (forward, then backward) or seeded random "
                   "(default: %(default)s)")
    t.add_argument("--timing-memory", choices=("auto", "all", "pairs"), default="auto",
                   help="all: every model loaded for the rounds at once; pairs: each model timed against the "
                   "speedup baseline, two loaded at a time; auto: all when the weights fit (default: %(default)s)")
    t.add_argument("--busy-share", type=float, default=BUSY_SHARE,
                   help="flag the speed figures when other processes (and the hypervisor's steal) took more than this "
                   "share of the machine during the timed rounds (default: %(default)s)")


def check_run_id(run_id: str | None) -> None:
    if run_id is not None and not re.fullmatch(r"[A-Za-z0-9_.\-]+", run_id):
        raise InputError(f"--run-id {run_id!r} may only use letters, digits, '_', '.', '-'")


def build_config(ns: argparse.Namespace, checked: Callable[[], None] | None = None) -> dict:
    """Everything a run needs, validated; raises InputError. Writes nothing. ``checked()`` runs once the tasks are
    valid, before the slow checks: the runner starts its fork server there (its imports overlap the checks)."""
    if ns.limit is not None and ns.limit < 1:
        raise InputError(f"--limit must be >= 1, got {ns.limit}")
    if ns.num_processes < 1:
        raise InputError(f"--num-processes must be >= 1, got {ns.num_processes}")
    if ns.batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {ns.batch_size}")
    check_run_id(ns.run_id)
    check_out_writable(Path(ns.out), ns.run_id)  # before minutes of loading, not after
    tasks_dirs = [Path(d).expanduser() for d in ns.tasks_dir]
    for d in tasks_dirs:
        if not d.is_dir():
            raise InputError(f"--tasks-dir {str(d)!r} is not a folder")
    task_arg = paper_tasks(ns.task) if ns.prompts == "paper" else ns.task
    tm = task_manager(extra_dirs=tasks_dirs)  # tasks/ and the --tasks-dir folders: indexing only
    task_names(task_arg, tm)  # a misspelt task fails in seconds, before torch is imported or a checkpoint read
    if checked is not None:
        checked()
    import torch

    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise InputError(f"--device must be cpu or cuda, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("--device cuda given but no CUDA device is available; valid: cpu")
    if ns.models is not None and ns.models_file is not None:
        raise InputError("give either --models (MODELS) or --models-file (MODELS_FILE), not both")
    if ns.models_file is not None:
        models = load_models_file(ns.models_file)
    else:
        models = parse_models(ns.models or ",".join(DEFAULT_MODELS))
    from harness.models.checkpoints import resolve_dtype
    run_template_args = template_args(ns.chat_template_args)
    task_defaults = not ns.no_task_defaults
    inspected: dict[str, Any] = {}
    # Cheap checks first (decoders, every checkpoint completely, attention, model knobs), before tasks load.
    validate_models(models, [], task_defaults, inspected)
    limit = ns.limit
    if limit is None and ns.task == DEFAULT_TASK and ns.models_file is None and (ns.models is None or ns.models.strip() in MODEL_GROUPS):
        limit = DEFAULT_LIMIT
    budgets: dict[str, int | None] = {}
    units = resolve_units(task_arg, tasks_dirs, limit, budgets, tm)
    try:
        shard = cluster.parse_shard(ns.shard)
        units = cluster.apply_shard(units, shard)
    except ValueError as e:
        raise InputError(str(e)) from None
    model_cfgs = validate_models(models, units, task_defaults, inspected, ns.seed, budgets)
    check_engines(model_cfgs, resolve_dtype(ns.dtype, device))
    baseline = ns.baseline
    if baseline is not None and baseline not in [m["name"] for m in model_cfgs]:
        raise InputError(f"--baseline {baseline!r} is not a model of this run; valid: "
                         f"{', '.join(m['name'] for m in model_cfgs)}")
    if baseline is None:
        baseline = next((m["name"] for m in model_cfgs if m["decoder"] == "ar" and not m.get("engine")), None)
    launch = {k: getattr(ns, k) for k in cluster.LAUNCH_OPTIONS if getattr(ns, k) is not None}
    try:
        cluster.check_launch(launch, ns.num_processes)
        launch["machine_rank"] = cluster.machine_rank(launch)
    except ValueError as e:
        raise InputError(str(e)) from None
    if int(launch.get("num_machines") or 1) > 1 and ns.run_id is None:
        raise InputError("--num-machines > 1 needs --run-id: every machine writes into that one run folder")
    timing = timing_config(ns)
    if ns.memory_items < 0:
        raise InputError(f"--memory-items must be >= 0, got {ns.memory_items}")
    per_machine = max(1, ns.num_processes // int(launch.get("num_machines") or 1))
    threads = ns.threads or max(1, (os.cpu_count() or 1) // per_machine)
    return {"shard": shard, "launch": launch,
        "task": ns.task, "units": units, "models": model_cfgs, "limit": limit, "seed": ns.seed,
        "chat_template": not ns.no_chat_template, "device": device, "threads": threads,
        "num_processes": ns.num_processes, "batch_size": ns.batch_size, "bootstrap_iters": ns.bootstrap_iters,
        "task_defaults": task_defaults, "baseline": baseline, "tasks_dir": str(REPO / "tasks"),
        "tasks_dirs": [str(d.resolve()) for d in tasks_dirs],
        "prompts": ns.prompts, "dtype": resolve_dtype(ns.dtype, device), "dtype_requested": ns.dtype,
        "chat_template_args": run_template_args, "compile": compile_settings(model_cfgs), "timing": timing,
        "memory_pass": {"items": ns.memory_items},
    }


def check_engines(model_cfgs: list[dict], dtype: str) -> None:
    """Every engine row's venv imports its engine (harness/run/engine.py check_engine), before any model loads
    and in a dry run too: InputError, one line, otherwise. Records the versions and the dtype the server gets."""
    from harness.run.engine import EngineError, EngineSpec, check_engine

    for m in model_cfgs:
        if not m.get("engine"):
            continue
        knobs = m["engine"]["knobs"]
        try:
            m["engine"]["versions"] = check_engine(EngineSpec(**knobs))
        except EngineError as e:
            raise InputError(f"model {m['name']!r}: {e}") from None
        knobs["dtype"] = knobs.get("dtype") or dtype


def timing_config(ns: argparse.Namespace) -> dict:
    """run.json's ``timing``: the timing protocol's settings, validated (InputError)."""
    if ns.timing_rounds < 1:
        raise InputError(f"--timing-rounds must be >= 1, got {ns.timing_rounds}")
    try:
        items = parse_items(ns.timing_items)
    except ValueError as e:
        raise InputError(str(e)) from None
    if not 0 < ns.busy_share < 1:
        raise InputError(f"--busy-share must lie between 0 and 1, got {ns.busy_share}")
    return {"mode": ns.timing, "rounds": ns.timing_rounds, "items": items, "order": ns.timing_order,
            "memory": ns.timing_memory, "busy_share": ns.busy_share}


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("REFUSION_DIE_WITH_PARENT") == "1":
        die_with_parent()  # `make eval` killed: stop as if by SIGTERM instead of running on orphaned
    ns = _parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Each child of the run starts from it (zygote.py): started with the first child, ended with the runner on
    # every way out.
    server = fork_server()
    try:
        return _main(ns, server)
    finally:
        if server is not None:
            server.close()


def _main(ns: argparse.Namespace, server) -> int:
    from tasks.info import resolve_aliases

    ns.task, aliased = resolve_aliases(ns.task)  # before anything is written: run.json records the real name
    for short, real in aliased:
        print(f"task {short!r} is {real!r}", file=sys.stderr)
    try:
        # a run starts its fork server early (its imports then run beside the checks); a dry run needs none
        cfg = build_config(ns, None if server is None or ns.dry_run else server.begin)
        warning = dtype_warning(cfg)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
        try:
            rates = cluster.parse_rate(ns.rate, cfg)
        except ValueError as e:
            raise InputError(str(e)) from None
        remark = cluster.rate_remark(ns.rate, cfg)
        if remark:
            print(f"warning: {remark}", file=sys.stderr)
        if ns.dry_run:
            print(describe_resolved(cfg))
            print(cluster.describe_budget(cfg, rates, remark))
            return 0
        if cfg["launch"].get("machine_rank"):
            run_dir = join_run_dir(Path(ns.out), ns.run_id, cfg)
        else:
            run_dir = prepare_run_dir(Path(ns.out), ns.run_id, cfg)
    except KnobHelp as h:
        from harness.run.knobs import describe

        print(describe(h.decoder))
        return 0
    except InputError as e:
        if ns.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    # A stop signal anywhere below (between models, while the summary is written) ends the run as one
    # during a model does: everything written so far is whole (atomic writes), the run resumes.
    saved = {sig: signal.signal(sig, raise_stopped) for sig in STOP_SIGNALS}
    try:
        rc = run_models(run_dir, cfg, ns.debug, rates, ns.retry_failed, server=server)
        if rc is not None:
            return rc
        if cfg["launch"].get("machine_rank"):
            print(f"machine rank {cfg['launch']['machine_rank']}: every model done; machine rank 0 writes the "
                  f"results in {run_dir}", file=sys.stderr)
            return 0
        rc = timed_rounds(run_dir, cfg, server)
        if rc is not None:
            return rc
        memory_pass(run_dir, cfg, server)
        result = finalize(run_dir)
    except Stopped as e:
        for sig in STOP_SIGNALS:  # a second signal (Slurm sends one to every process) changes nothing now
            signal.signal(sig, signal.SIG_IGN)
        # on a line of its own: a worker's progress bar may have been redrawn without a newline as it stopped
        print(f"\nstopped by {signal.Signals(e.signum).name}; rerun with --run-id {run_dir.name} to resume",
              file=sys.stderr)
        return 128 + e.signum
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    print(summary.table(result))
    print(summary.one_line(result, run_dir))
    flag = (result.get("timing") or {}).get("busy_text")
    if flag:
        print(f"warning: speed {flag}", file=sys.stderr)
    elif summary.single_pass(result):
        print("note: speed figures are a single pass (" + str((result.get("timing") or {}).get("why")) + ")",
              file=sys.stderr)
    for line in summary.failed_lines(result, run_dir):
        print(line, file=sys.stderr)
    return 0

