"""`python -m harness eval` / `make eval`: run decoders on a task or suite through lm-eval and
record quality, latency, tokens/s, NFE/TPF, memory and speedup (docs/design.md §6).

    python -m harness eval                          # embedded suite, tiny checkpoints, 4 decoders
    python -m harness eval --task gsm8k_cot --limit 20 \\
        --models 'ar=checkpoints/tiny/ar:ar,rf=checkpoints/tiny/refusion:refusion:slot_size=8,token_threshold=0.3'

MODELS is a comma-separated list of ``name=checkpoint:decoder[:knob=value,...]``
(knobs continue after commas until the next ``name=...:``) or preset names
(``ar``, ``refusion``, ``llada``, ``fast_dllm``, ``dream``, ``d2f``, ..., optionally
``preset:knob=value``) or ``all`` (every preset; harness/run/presets.py MODEL_GROUPS).

Everything is validated before anything is written (exit 2 with one line naming
the problem and the valid choices; ``--debug`` shows the full traceback instead).
Each model then runs in its own process (``harness.run.worker``; under ``accelerate
launch`` with ``--num-processes`` > 1), so its peak RSS is that model's. Output,
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
import datetime as _dt
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness.run import cluster, summary
from harness.run.faults import STOP_SIGNALS, pause_at
from harness.run.metrics import speedup
from harness.run.hints import did_you_mean, models_change, unknown
from harness.run.hints import short_list as hints_short_list
from harness.run.model_list import (LOAD_OPTIONS, TEMPLATE_OPTION, InputError, KnobHelp, load_models_file,
                                    parse_models, template_args)
from harness.run.presets import DEFAULT_MODELS, MODEL_GROUPS, ModelSpec, paper_knobs
from harness.run.store import atomic_write_json, read_json
from harness.run.timing import BUSY_SHARE, DEFAULT_ITEMS as TIMING_ITEMS, DEFAULT_ROUNDS as TIMING_ROUNDS, \
    parse_items
from tasks.checks import target_problem
from tasks.scoring import task_manager

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TASK = "embedded"
# The default run (embedded suite x 4 decoders on tiny checkpoints) must finish in < 15 min on 2 cores.
DEFAULT_LIMIT = 20
# Settings that must match for a run id to be resumed.
RESUME_KEYS = ("task", "units", "models", "limit", "seed", "chat_template", "device", "batch_size",
               "bootstrap_iters", "task_defaults", "baseline", "dtype", "chat_template_args", "shard")
# Unit fields counted from the data, not set by the user (older runs lack them): not compared on resume.
DERIVED_UNIT_KEYS = ("samples", "docs", "max_gen_toks", "data_sha256")


# ---------------------------------------------------------------- parsing: harness/run/model_list.py


# ---------------------------------------------------------------- validation


def _chain(exc: BaseException) -> list[BaseException]:
    out = [exc]
    while True:
        nxt = out[-1].__cause__ or out[-1].__context__
        if nxt is None or nxt in out:
            return out
        out.append(nxt)


def known_error(exc: BaseException) -> str | None:
    """One line for an error that is the user's data or files, wherever in the chain it sits; else None.

    lm-eval wraps what a dataset hook or a template raises, so the useful message is
    often several links down (and the outermost one names neither file nor field).
    """
    from tasks.data import DataError
    from harness.run.faults import disk_full
    from harness.run.lm_adapter import CheckpointError

    if (line := disk_full(exc)) is not None:
        return line
    for e in _chain(exc):
        if isinstance(e, (DataError, CheckpointError)):
            return str(e).replace("\n", " ")
    try:
        from jinja2.exceptions import UndefinedError
    except ImportError:
        return None
    for e in _chain(exc):
        if isinstance(e, UndefinedError):
            return (f"the task's template cannot use a document of its data ({e}); check that the rows "
                    "have the fields the task's YAML names").replace("\n", " ")
    return None


def _root_message(exc: BaseException) -> str:
    known = known_error(exc)
    if known is not None:
        return known
    seen = _chain(exc)[-1]
    return f"{type(seen).__name__}: {seen}".replace("\n", " ")


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
            raise InputError(f"task {name!r}: cannot load its data: {_root_message(e)}") from e
        gmap = loaded.get("group_map", {})
        checked = {leaf: check_docs(leaf, task, limit) for leaf, task in loaded.get("tasks", {}).items()}
        counts = {leaf: n for leaf, (n, _) in checked.items()}
        leaf_budgets = {leaf: generation_budget(task) for leaf, task in loaded.get("tasks", {}).items()}
        if budgets is not None:
            budgets.update(leaf_budgets)

        def expand(n: str) -> list[str]:
            if n in KNOWN or n not in gmap:
                return [n]
            return [u for child in gmap[n] for u in expand(child)]

        for u in expand(name):
            leaves = sorted(KNOWN[u].leaves) if u in KNOWN else ([u] if u in loaded["tasks"] else
                                                                  sorted(_leaves(u, gmap)))
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
        raise InputError(f"task {leaf!r}: cannot load its data: {_root_message(e)}") from e
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
            why = _root_message(e)
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


def _leaves(name: str, gmap: dict) -> list[str]:
    if name not in gmap:
        return [name]
    return [leaf for c in gmap[name] for leaf in _leaves(c, gmap)]


def _local_path(path: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_absolute():
        p = (Path.cwd() / p) if (Path.cwd() / p).exists() else (REPO / p)
    return p


def shown_values(values: dict) -> dict:
    """The knob values as the decoders really use them where a knob's default is None (refusion/decoding/
    mdm.py): ``steps`` is gen_length (512 on the paper's tasks), or gen_length / ``tokens_per_step`` (rounded
    up) when that is set, fast_dllm's ``commit_first`` follows ``shift``, an unset ``top_p`` / ``top_k`` /
    ``tokens_per_step`` is off, diffusion_gemma's unset ``canvas_length`` is the model's config's. What the
    dry run prints and run.json records never says None."""
    out = dict(values)
    per_step, length = out.get("tokens_per_step"), out.get("gen_length")
    if "steps" in out and per_step is not None:
        out["steps"] = -(-length // per_step) if isinstance(length, int) else f"{length}/{per_step}"
    elif "steps" in out and out["steps"] is None:
        out["steps"] = length
    if "tokens_per_step" in out and per_step is None:
        out["tokens_per_step"] = "off"
    if "commit_first" in out and out["commit_first"] is None:
        out["commit_first"] = out.get("shift")
    if "canvas_length" in out and out["canvas_length"] is None:
        out["canvas_length"] = "config"  # the model's config.canvas_length (a run sets it from config.json)
    for k in ("top_p", "top_k"):
        if k in out and out[k] is None:
            out[k] = "off"
    return out


def _inspect(m: ModelSpec, ckpt: Path, base: str | None, inspected: dict[str, Any]):
    """The checkpoint check of one model, once per run (cached by name); its warnings printed once."""
    from harness.models.checkpoints import check_tokenizer, inspect_checkpoint

    if m.name not in inspected:
        info = inspect_checkpoint(ckpt, base)
        check_tokenizer(info)
        for w in info.warnings:
            print(f"warning: model {m.name!r}: {w}", file=sys.stderr)
        inspected[m.name] = info
    return inspected[m.name]


def _template_args(m: ModelSpec) -> dict:
    """A model's own chat-template arguments: a dict from a models file (checked there), or the MODELS text
    (several arguments joined by ';': a comma would start the next knob)."""
    value = m.knobs[TEMPLATE_OPTION]
    if isinstance(value, dict):
        return dict(value)
    return template_args("" if value is None else str(value), m.name)


def validate_models(models: list[ModelSpec], units: list[dict], task_defaults: bool,
                    inspected: dict[str, Any] | None = None, seed: int | None = None,
                    budgets: dict[str, int | None] | None = None) -> list[dict]:
    """Check decoders, checkpoints (completely: harness/models/checkpoints.inspect_checkpoint, an adapter
    against its base), the attention each decoder needs, and knobs; return each model with its per-leaf
    task knobs, the base an adapter is merged into (given or found), and the knob values each leaf will
    really use (``resolved_knobs``: decoder defaults < the checkpoint's own decoding settings (Dream's
    generation_config.json) < the task's settings < the model's knobs; ``budgets``: each leaf's
    response budget, against which the knob rules are checked where gen_length comes from the request).
    ``inspected`` caches checkpoint checks by model name across calls."""
    from harness.models.checkpoints import CheckpointError
    from harness.run.lm_adapter import checkpoint_knobs
    from refusion.decoding import DECODERS, check_attention, check_knob_values, make_knobs

    inspected = {} if inspected is None else inspected
    out = []
    for m in models:
        if m.decoder not in DECODERS:
            raise InputError(f"model {m.name!r}: " + unknown("decoder", m.decoder, DECODERS))
        knobs = {k: v for k, v in m.knobs.items() if k not in (*LOAD_OPTIONS, TEMPLATE_OPTION)}
        accepted = DECODERS[m.decoder].knobs.names()
        bad = [k for k in knobs if k not in accepted]
        if bad:
            raise InputError(f"model {m.name!r}: unknown knob(s) {', '.join(bad)} for decoder {m.decoder!r}"
                             f"{did_you_mean(bad[0], [*accepted, *LOAD_OPTIONS, TEMPLATE_OPTION])}; valid knobs: "
                             + hints_short_list(accepted, lister=f"python -m harness knobs {m.decoder}"))
        # Not resolved here: the base's name as given (a symlink named like the model) is what its adapter's
        # base_model_name_or_path is compared with; run.json records the resolved folder (info.base.path).
        load: dict[str, Any] = {k: str(_local_path(str(v)).absolute()) for k, v in m.knobs.items()
                                if k in LOAD_OPTIONS}
        if TEMPLATE_OPTION in m.knobs:
            load[TEMPLATE_OPTION] = _template_args(m)
        ckpt = _local_path(m.checkpoint)
        try:
            info = _inspect(m, ckpt, load.get("base"), inspected)
            check_attention(m.decoder, info.causal, info.family.name)
            own = checkpoint_knobs(info, m.decoder)  # Dream: shift=true, its generation_config.json
        except CheckpointError as e:
            raise InputError(f"model {m.name!r}: {e}") from None
        except ValueError as e:
            raise InputError(f"model {m.name!r} ({ckpt}): {e}") from None
        if info.base is not None:
            load["base"] = str(info.base.path)  # the base really used, found beside the adapter or given
        elif "base" in load:
            load["base"] = str(Path(load["base"]).resolve())
        try:  # each knob on its own now; the rules across knobs per task below, with its real budget
            check_knob_values(m.decoder, {**own, **knobs})
            if "gen_length" in {**own, **knobs} or "gen_length" not in DECODERS[m.decoder].knobs.names():
                make_knobs(m.decoder, {**own, **knobs})  # the budget is fixed: every rule holds or fails now
        except ValueError as e:
            raise InputError(f"model {m.name!r}: {e}") from None
        task_knobs, resolved = _leaf_knobs(m, knobs, own, units, task_defaults, seed, budgets or {})
        out.append({**m.to_dict(), "knobs": knobs, **load, "checkpoint": str(ckpt.resolve()),
                    "family": info.family.name, "causal": info.causal, "task_knobs": task_knobs,
                    "resolved_knobs": resolved})
    return out


def _leaf_knobs(m: ModelSpec, user: dict, own: dict, units: list[dict], task_defaults: bool, seed: int | None,
                budgets: dict[str, int | None]) -> tuple[dict[str, dict], dict[str, dict]]:
    """(task knobs, resolved knobs) per leaf of model ``m`` (``user``: its knobs as given; ``own``: its
    checkpoint's): every knob set the worker will build, built here
    first, with the leaf's real response budget where the adapter takes gen_length from the request, so a
    constraint the budget breaks (a block that does not divide it) stops the run before anything is written."""
    from refusion.decoding import DECODERS, make_knobs

    accepted = set(DECODERS[m.decoder].knobs.names())
    task_knobs: dict[str, dict] = {}
    resolved: dict[str, dict] = {}
    for u in units:
        tk = paper_knobs(u["name"], m.decoder, accepted) if task_defaults else {}
        wanted = {**own, **tk, **user}
        for leaf in u["leaves"]:
            budget = budgets.get(leaf)
            from_request = "gen_length" in accepted and "gen_length" not in wanted
            extra = {"gen_length": budget} if from_request and budget is not None else {}
            try:
                values = make_knobs(m.decoder, {**wanted, **extra}).to_dict()
            except ValueError as e:
                where = f" (its max_gen_toks {budget} is the gen_length)" if extra else ""
                raise InputError(f"model {m.name!r} on task {leaf!r}{where}: {e}") from None
            if from_request and not extra:
                values["gen_length"] = "max_gen_toks"  # the adapter takes the request's budget
            if "seed" in accepted and "seed" not in user and seed is not None:
                values["seed"] = seed  # the adapter passes the run's seed
            resolved[leaf] = shown_values(values)
            if tk:
                task_knobs[leaf] = tk
    return task_knobs, resolved


# ---------------------------------------------------------------- environment


def environment(device: str, threads: int, num_processes: int, seed: int) -> dict:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    pkgs = {}
    for p in ("torch", "transformers", "lm-eval", "accelerate", "datasets", "tokenizers", "numpy", "psutil"):
        try:
            pkgs[p] = version(p)
        except PackageNotFoundError:
            pkgs[p] = None
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = None
    if device.startswith("cuda"):
        import torch

        gpu = torch.cuda.get_device_name(0)
    status = git("status", "--porcelain")
    # What a tokens/s figure was measured on: runs with the same hardware (and dtype, batch size) can be
    # compared across runs (harness/report/runset.py speed_setting).
    hardware = gpu if gpu else f"{cpu}, {threads} thread(s) per process"
    return {"hardware": hardware, "git_commit": git("rev-parse", "HEAD"), "git_dirty": bool(status) if status is not None else None,
            "packages": pkgs, "python": platform.python_version(), "platform": platform.platform(),
            "device": device, "cpu": cpu, "gpu": gpu, "cpu_count": os.cpu_count(), "threads_per_process": threads,
            "num_processes": num_processes, "seed": seed}


# ---------------------------------------------------------------- running


def worker_error_file(run_dir: Path, model: str) -> Path:
    """Where a worker leaves its one-line error for the runner to report."""
    return run_dir / "models" / model / "error.txt"


def worker_command(run_dir: Path, model: str, num_processes: int, port: int, debug: bool = False,
                   launch: dict | None = None, retry_failed: bool = False) -> list[str]:
    base = ["-m", "harness.run.worker", "--run-dir", str(run_dir), "--model", model,
            "--error-file", str(worker_error_file(run_dir, model))] + (["--debug"] if debug else []) \
        + (["--retry-failed"] if retry_failed else [])
    launch = launch or {}
    if num_processes <= 1 and not launch.get("accelerate_config") and int(launch.get("num_machines") or 1) == 1:
        return [sys.executable, *base]
    # --multi_gpu picks accelerate's multi-process (torchrun) launcher; on CPU the adapter joins gloo.
    return [sys.executable, "-m", "accelerate.commands.launch", *cluster.launch_args(launch, num_processes, port),
            *base]


def _parser() -> argparse.ArgumentParser:
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
    return p


def _timing_arguments(p: argparse.ArgumentParser) -> None:
    """The timing protocol's options (harness/run/timing.py)."""
    t = p.add_argument_group("timing (docs/design.md \"Timing protocol\")")
    t.add_argument("--timing", choices=("interleaved", "sequential"), default="interleaved",
                   help="interleaved: tokens/s, latency and speedup from timed rounds after the decoding pass, every "
                   "model decoding the same items in turn (default); sequential: from the decoding pass itself, one "
                   "model after another (a single pass, marked as such beside every speed figure)")
    t.add_argument("--timing-rounds", type=int, default=TIMING_ROUNDS,
                   help="timed rounds (default: %(default)s); the figure is the median over rounds")
    t.add_argument("--timing-items", default=TIMING_ITEMS,
                   help="timed items per task: a sample drawn with the run's seed from the documents every model "
                   "decoded (the first k of a seeded shuffle); a count, 'all', or 'auto': k = documents x 0.5 / rounds, "
                   "1 to 32, so the rounds re-decode about half the decoding pass (default: %(default)s)")
    t.add_argument("--timing-order", choices=("abba", "random"), default="abba",
                   help="the models' order within each round: ABBA (forward, then backward) or seeded random "
                   "(default: %(default)s)")
    t.add_argument("--timing-memory", choices=("auto", "all", "pairs"), default="auto",
                   help="all: every model loaded for the rounds at once; pairs: each model timed against the "
                   "speedup baseline, two loaded at a time; auto: all when the weights fit (default: %(default)s)")
    t.add_argument("--busy-share", type=float, default=BUSY_SHARE,
                   help="flag the speed figures when other processes (and the hypervisor's steal) took more than this "
                   "share of the machine during the timed rounds (default: %(default)s)")


def _may(path: Path, mode: int) -> bool:
    """Whether this process may use ``path`` with ``mode`` (os.access with the effective ids, which the
    open() calls of this process will be checked against); one place, so tests can inject a refusal."""
    eff = os.access in os.supports_effective_ids
    return os.access(path, mode, effective_ids=eff)


def check_out_writable(out: Path, run_id: str | None) -> None:
    """InputError unless the run folder can be created in OUT (checked, not tried: nothing is written).

    Walks from the filesystem root down to the deepest existing folder on the way to the run folder:
    each folder passed through must be searchable (x), the deepest also writable. A folder that
    cannot be searched is named instead of letting stat()'s PermissionError out as a traceback."""
    target = (out / run_id if run_id else out).absolute()
    deepest = Path(target.anchor)
    for part in target.parts[1:]:
        if not _may(deepest, os.X_OK):
            raise InputError(f"--out {str(out)!r}: folder {str(deepest)!r} cannot be entered (no search "
                             "permission); choose another --out or make it accessible")
        nxt = deepest / part
        try:
            st = os.stat(nxt)
        except (FileNotFoundError, NotADirectoryError):
            break
        except OSError as e:  # PermissionError and the like: the folder above cannot be read into
            raise InputError(f"--out {str(out)!r}: cannot look into {str(deepest)!r} ({e.strerror}); "
                             "choose another --out") from None
        if not stat.S_ISDIR(st.st_mode):
            raise InputError(f"--out {str(out)!r}: {str(nxt)!r} is a file, not a folder; choose another --out")
        deepest = nxt
    if not _may(deepest, os.W_OK | os.X_OK):
        raise InputError(f"--out folder {str(deepest)!r} is not writable; choose another --out "
                         "or make it writable")


def build_config(ns: argparse.Namespace) -> dict:
    """Everything a run needs, validated; raises InputError. Writes nothing."""
    if ns.limit is not None and ns.limit < 1:
        raise InputError(f"--limit must be >= 1, got {ns.limit}")
    if ns.num_processes < 1:
        raise InputError(f"--num-processes must be >= 1, got {ns.num_processes}")
    if ns.batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {ns.batch_size}")
    if ns.run_id is not None and not re.fullmatch(r"[A-Za-z0-9_.\-]+", ns.run_id):
        raise InputError(f"--run-id {ns.run_id!r} may only use letters, digits, '_', '.', '-'")
    check_out_writable(Path(ns.out), ns.run_id)  # before minutes of loading, not after
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
    tasks_dirs = [Path(d).expanduser() for d in ns.tasks_dir]
    for d in tasks_dirs:
        if not d.is_dir():
            raise InputError(f"--tasks-dir {str(d)!r} is not a folder")
    from harness.models.checkpoints import resolve_dtype
    run_template_args = template_args(ns.chat_template_args)
    task_defaults = not ns.no_task_defaults
    inspected: dict[str, Any] = {}
    task_arg = paper_tasks(ns.task) if ns.prompts == "paper" else ns.task
    tm = task_manager(extra_dirs=tasks_dirs)  # tasks/ and the --tasks-dir folders: indexing only
    task_names(task_arg, tm)  # a misspelt task fails in seconds, before any checkpoint
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
    baseline = ns.baseline
    if baseline is not None and baseline not in [m["name"] for m in model_cfgs]:
        raise InputError(f"--baseline {baseline!r} is not a model of this run; valid: "
                         f"{', '.join(m['name'] for m in model_cfgs)}")
    if baseline is None:
        baseline = next((m["name"] for m in model_cfgs if m["decoder"] == "ar"), None)
    launch = {k: getattr(ns, k) for k in cluster.LAUNCH_OPTIONS if getattr(ns, k) is not None}
    try:
        cluster.check_launch(launch, ns.num_processes)
        launch["machine_rank"] = cluster.machine_rank(launch)
    except ValueError as e:
        raise InputError(str(e)) from None
    if int(launch.get("num_machines") or 1) > 1 and ns.run_id is None:
        raise InputError("--num-machines > 1 needs --run-id: every machine writes into that one run folder")
    timing = timing_config(ns)
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
    }


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


def compile_settings(model_cfgs: list[dict]) -> dict[str, bool]:
    """Per model, whether it decodes compiled (the decoder knob ``compile`` on for any of its tasks): recorded
    in run.json (derived from the knobs, so not compared on resume) and named by the summary and report."""
    return {m["name"]: any(bool(v.get("compile")) for v in (m.get("resolved_knobs") or {}).values())
            for m in model_cfgs}


def dtype_warning(cfg: dict) -> str | None:
    """One line when the run asks for half precision on the CPU: it works, but most CPUs have no fast
    bfloat16/float16 kernels, so decoding is several times slower than in float32 (the issue that added
    this line met a run that looked hung)."""
    if cfg["device"] == "cpu" and cfg["dtype"] in ("bfloat16", "float16"):
        return (f"{cfg['dtype']} on the CPU is slow (most CPUs have no fast {cfg['dtype']} kernels; expect several "
                "times float32's decode time); use DTYPE=auto or float32 on the CPU")
    return None


def describe_resolved(cfg: dict) -> str:
    """What a run will do, per model and task: the knob values each leaf task will use (``--dry-run``)."""
    lines = [f"task {cfg['task']}, limit {cfg['limit'] or 'all'}, device {cfg['device']}, dtype {cfg['dtype']}, "
             f"chat template {'on' if cfg['chat_template'] else 'off'}"
             + (f" with {cfg['chat_template_args']}" if cfg["chat_template_args"] else "")]
    for m in cfg["models"]:
        attn = "causal" if m["causal"] else "bidirectional"
        own = m.get(TEMPLATE_OPTION, cfg["chat_template_args"])
        lines.append(f"{m['name']}: decoder {m['decoder']} on {m['checkpoint']} ({m['family']} family, {attn}"
                     + (f", LoRA on base {m['base']}" if m.get("base") else "")
                     + (f", chat template arguments {own}" if own != cfg["chat_template_args"] else "")
                     + (", compiled: torch.compile, static shapes" if (cfg.get("compile") or {}).get(m["name"]) else "")
                     + ")")
        for u in cfg["units"]:
            groups: dict[str, list[str]] = {}
            for leaf in u["leaves"]:
                groups.setdefault(json.dumps(m["resolved_knobs"][leaf], sort_keys=True), []).append(leaf)
            for values, leaves in groups.items():
                where = u["name"] if len(groups) == 1 else ",".join(leaves)
                knobs = ", ".join(f"{k}={v}" for k, v in json.loads(values).items())
                lines.append(f"  {where}: {knobs}")
    return "\n".join(lines)


def paper_tasks(task_arg: str) -> str:
    """The comma list with every task that has the authors' prompt variant replaced by it."""
    from tasks.info import TASKS

    names = [t.strip() for t in task_arg.split(",") if t.strip()]
    return ",".join(TASKS[n].paper_variant if n in TASKS and TASKS[n].paper_variant else n for n in names)


LOCK_NAME = ".lock"
_held_locks: list[int] = []  # open for the life of the process: closing would drop the lock


def default_run_id() -> str:
    """A timestamp plus random hex: two runs started in the same second still get different folders."""
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def lock_run_dir(run_dir: Path) -> None:
    """Take the run folder's exclusive lock (released when this process ends, however it ends).

    A second run into the same folder fails at once with the holder's pid instead of
    journaling every sample twice."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise InputError(f"cannot create run folder {run_dir}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "another process"
        os.close(fd)
        raise InputError(f"run {run_dir.name!r} is in use by {holder}; wait for it or choose another --run-id")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}, started "
                  f"{_dt.datetime.now().isoformat(timespec='seconds')}\n".encode(), 0)
    _held_locks.append(fd)


def settings_diff(old: dict, cfg: dict) -> list[str]:
    """The resume settings in which a recorded run.json and this command differ. What is derived, not set,
    is left out: a unit's counts and data hash, a model's resolved knobs (they follow from the knobs,
    the task and the checkpoint, compared themselves) and a base an older run.json did not record (one
    found beside its adapter)."""
    old_models = {m.get("name"): m for m in old.get("models") or [] if isinstance(m, dict)}

    def models(entries: Any, other: dict[str, dict] | None) -> Any:
        if not isinstance(entries, list):
            return entries
        out = []
        for m in entries:
            m = {k: v for k, v in m.items() if k != "resolved_knobs"}
            if other is not None and "base" not in other.get(m.get("name"), {"base": None}):
                m.pop("base", None)
            out.append(m)
        return out

    diff = []
    for k in RESUME_KEYS:
        a, b = _resume_value(k, old.get(k)), _resume_value(k, cfg.get(k))
        if k == "models":
            a, b = models(a, None), models(b, old_models)
        if a != b:
            diff.append(k)
    return diff


def describe_diff(old: dict, cfg: dict, diff: list[str]) -> str:
    """The differing settings as one phrase, each with its old and new value, and for the models the knob
    that changed (``models: model 'rf' knobs slot_size: 8 -> 4``)."""
    parts = []
    for k in diff:
        if k == "models":
            strip = [{kk: v for kk, v in m.items() if kk != "resolved_knobs"} for m in old.get(k) or []]
            new = [{kk: v for kk, v in m.items() if kk != "resolved_knobs"} for m in cfg.get(k) or []]
            parts.append(f"models: {models_change(strip, new) or 'changed'}")
        elif k == "units":
            parts.append("units: the tasks or their documents")
        else:
            a, b = json.dumps(old.get(k), default=str), json.dumps(cfg.get(k), default=str)
            parts.append(f"{k}: {a[:40]} -> {b[:40]}")
    return "; ".join(parts)


def _resume_value(key: str, value: Any) -> Any:
    """A setting as compared on resume: a unit's sample count is derived, not set (older runs lack it)."""
    if key == "units" and isinstance(value, list):
        return [{k: v for k, v in u.items() if k not in DERIVED_UNIT_KEYS} for u in value]
    return value


def _prepare_run_dir(out: Path, run_id: str | None, cfg: dict) -> Path:
    if run_id is None:
        run_id = default_run_id()
    run_dir = out / run_id
    lock_run_dir(run_dir)
    if (run_dir / "run.json").exists():
        old = read_json(run_dir / "run.json")
        diff = settings_diff(old, cfg)
        if diff:
            raise InputError(f"run {run_id!r} exists with different settings ({describe_diff(old, cfg, diff)}); "
                             "use a new --run-id or the same settings to resume")
        print(f"resuming run {run_id} in {run_dir}", file=sys.stderr)
        summary.add_session(run_dir / "run.json")  # timings of this session may mix with the earlier ones
        return run_dir
    if run_dir.exists() and any(p.name != LOCK_NAME for p in run_dir.iterdir()):
        raise InputError(f"{run_dir} exists and is not a run folder (no run.json); choose another --run-id")
    env = environment(cfg["device"], cfg["threads"], cfg["num_processes"], cfg["seed"])
    from tasks.sandbox import WARNED_ENV, capabilities

    env["sandbox"] = capabilities()  # what code-task isolation and packages this machine gave, with its warning
    if env["sandbox"]["warning"]:
        print(f"warning: {env['sandbox']['warning']}", file=sys.stderr)
        os.environ[WARNED_ENV] = "1"  # the workers inherit it and do not repeat the warning: once per run
    created = _dt.datetime.now().isoformat(timespec="seconds")
    atomic_write_json(run_dir / "run.json", {**cfg, "run_id": run_id, "environment": env, "created": created,
                                             "sessions": [{"started": created, "models": []}]})
    return run_dir


JOIN_WAIT_S = 600.0  # how long a machine of rank > 0 waits for rank 0 to create the run folder


def _join_run_dir(out: Path, run_id: str | None, cfg: dict, wait_s: float = JOIN_WAIT_S) -> Path:
    """Machine rank > 0: the run folder rank 0 creates (same --out on a shared file system, same --run-id),
    once its run.json is there, with the same settings; nothing is written."""
    import time

    if run_id is None:
        raise InputError("--machine-rank > 0 needs the --run-id machine rank 0 uses (one run folder for all)")
    run_json = out / run_id / "run.json"
    deadline = time.monotonic() + wait_s
    while not run_json.is_file():
        if time.monotonic() > deadline:
            raise InputError(f"{run_json} did not appear within {wait_s:.0f} s: start machine rank 0 with the "
                             "same --out (a shared folder) and --run-id")
        time.sleep(0.5)
    old = read_json(run_json)
    diff = settings_diff(old, cfg)
    if diff:
        raise InputError(f"run {run_id!r} of machine rank 0 has other settings ({', '.join(diff)}); give every "
                         "machine the same command")
    return out / run_id


def finalize(run_dir: Path) -> dict:
    """Add speedups and 95% intervals (harness/run/stats.py) to every metrics file and write the run summary
    (JSON + Markdown)."""
    cfg = read_json(run_dir / "run.json")
    pause_at("finalize")  # a test hook: a stop signal before the summary
    rows = []
    for m in cfg["models"]:
        for u in cfg["units"]:
            p = run_dir / "metrics" / f"{m['name']}__{u['name']}.json"
            if p.exists():
                rows.append(read_json(p))
    base = cfg.get("baseline")
    base_tps = {r["task"]: r["speed"]["tokens_per_s"]["ratio_of_sums"] for r in rows if r["model"] == base}
    for r in rows:
        b = base_tps.get(r["task"])
        r["speedup"] = {"baseline": base, "tokens_per_s": speedup(r["speed"]["tokens_per_s"]["ratio_of_sums"], b)}
    mean_intervals = summary.attach_intervals(run_dir, cfg, rows)  # 95% intervals from the per-sample logs
    from harness.run.rounds import apply_timing, load_timing

    # Wall-clock figures from the timed rounds (harness/run/timing.py), or marked as a single pass.
    timed = apply_timing(load_timing(run_dir, cfg), cfg, rows)
    if timed["mode"] == "interleaved":
        mean_intervals = {**{k: None for k in mean_intervals}, **timed["mean_speedup_interval"]}
    if timed.get("guard") is not None:  # run.json records what the guard saw (the figures' flag)
        atomic_write_json(run_dir / "run.json", {**read_json(run_dir / "run.json"),
                                                 "timing_result": {k: v for k, v in timed.items()
                                                                   if k != "mean_speedup_interval"}})
    for r in rows:
        atomic_write_json(run_dir / "metrics" / f"{r['model']}__{r['task']}.json", r)
    result = summary.summary(cfg, rows, summary.warmup_compile(run_dir, cfg), mean_intervals)
    result["timing"] = {k: v for k, v in timed.items() if k != "mean_speedup_interval"}
    atomic_write_json(run_dir / "summary.json", result)
    (run_dir / "summary.md").parent.mkdir(parents=True, exist_ok=True)
    from harness.run.store import atomic_write_text

    atomic_write_text(run_dir / "summary.md", summary.markdown(result))
    return result


class _Stopped(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum, _frame) -> None:
    """Signal handler: a stop signal unwinds the runner as an exception (``_Stopped``)."""
    raise _Stopped(signum)


def _die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Linux: have the kernel send `sig` to this process when its parent dies."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _run_worker(cmd: list[str], env: dict) -> int:
    """Run one model's worker; SIGTERM, SIGINT and SIGUSR1 (Slurm's warning before the end of a job) stop it
    cleanly: the journal keeps finished samples, the run resumes with its run id."""
    old = {s: signal.signal(s, _raise_stopped) for s in STOP_SIGNALS}
    # The worker gets SIGKILL if this runner dies in any way (kill -9 included).
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, preexec_fn=lambda: _die_with_parent(signal.SIGKILL))
    try:
        return proc.wait()
    except _Stopped:
        for s in old:
            signal.signal(s, signal.SIG_IGN)
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("REFUSION_DIE_WITH_PARENT") == "1":
        _die_with_parent()  # `make eval` killed: stop as if by SIGTERM instead of running on orphaned
    ns = _parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tasks.info import resolve_aliases

    ns.task, aliased = resolve_aliases(ns.task)  # before anything is written: run.json records the real name
    for short, real in aliased:
        print(f"task {short!r} is {real!r}", file=sys.stderr)
    try:
        cfg = build_config(ns)
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
            run_dir = _join_run_dir(Path(ns.out), ns.run_id, cfg)
        else:
            run_dir = _prepare_run_dir(Path(ns.out), ns.run_id, cfg)
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
    saved = {sig: signal.signal(sig, _raise_stopped) for sig in STOP_SIGNALS}
    try:
        rc = _run_models(run_dir, cfg, ns.debug, rates, ns.retry_failed)
        if rc is not None:
            return rc
        if cfg["launch"].get("machine_rank"):
            print(f"machine rank {cfg['launch']['machine_rank']}: every model done; machine rank 0 writes the "
                  f"results in {run_dir}", file=sys.stderr)
            return 0
        rc = _timed_rounds(run_dir, cfg)
        if rc is not None:
            return rc
        result = finalize(run_dir)
    except _Stopped as e:
        for sig in STOP_SIGNALS:  # a second signal (Slurm sends one to every process) changes nothing now
            signal.signal(sig, signal.SIG_IGN)
        print(f"stopped by {signal.Signals(e.signum).name}; rerun with --run-id {run_dir.name} to resume",
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


def _timed_rounds(run_dir: Path, cfg: dict) -> int | None:
    """The timed rounds of an interleaved run (harness/run/rounds.py, its own process), unless timing.json
    holds them for these timing settings already (a resumed run); an exit status to stop with, or None."""
    t = cfg.get("timing") or {}
    old = read_json(run_dir / "run.json")
    if old.get("timing") != t:  # a resumed run timed with other settings: run.json says what timing.json holds
        atomic_write_json(run_dir / "run.json", {**old, "timing": t})
    if t.get("mode", "interleaved") != "interleaved":
        return None
    done = run_dir / "timing.json"
    if done.is_file():
        try:
            if read_json(done).get("settings") == t:
                print("timed rounds: already measured, kept", file=sys.stderr)
                return None
        except (OSError, ValueError):
            pass
    print(f"timed rounds: {t['rounds']} rounds, {t['items']} item(s) per task, the models in turn "
          f"({t['order']}), wall time", file=sys.stderr)
    tmp = run_dir / ".tmp-timing"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "TMPDIR": str(tmp)}
    env.pop("REFUSION_BENCH_FAULTS", None)  # test hooks are for the decoding pass; the rounds re-decode good items
    try:
        rc = _run_worker([sys.executable, "-m", "harness.run.rounds", "--run-dir", str(run_dir)], env)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if rc != 0:
        print(f"error: the timed rounds failed (exit {rc}); quality and counts are kept: rerun with --run-id "
              f"{run_dir.name} to time again, or --timing sequential for single-pass figures", file=sys.stderr)
        return 1
    return None


def _worker_port(launch: dict) -> int:
    # One machine: a port of its own per runner, so two runs side by side do not meet; several machines
    # must agree on it, so accelerate's usual port unless given.
    if launch.get("main_process_port"):
        return int(launch["main_process_port"])
    return 29500 if int(launch.get("num_machines") or 1) > 1 else 29500 + (os.getpid() % 1000)


def _has_failed(run_dir: Path, cfg: dict, model: str) -> bool:
    """Whether a finished model recorded failed items (its metrics files say so)."""
    for u in cfg["units"]:
        p = run_dir / "metrics" / f"{model}__{u['name']}.json"
        if p.exists() and (read_json(p).get("failed") or {}).get("count"):
            return True
    return False


def _run_models(run_dir: Path, cfg: dict, debug: bool, rates: dict[str, float] | None = None,
                retry_failed: bool = False) -> int | None:
    """Each model's worker in turn (skipping finished ones); an exit status to stop with, or None when done.
    A machine of rank > 0 starts the same workers, which join rank 0's through accelerate, and writes
    nothing of the run's own (run.json, summary): rank 0 does."""
    rank = int(cfg["launch"].get("machine_rank") or 0)
    n = len(cfg["models"])
    progress = summary.Progress(cfg, rates=rates)
    print(progress.start_line(), file=sys.stderr)
    for i, m in enumerate(cfg["models"], 1):
        done = run_dir / "models" / m["name"] / "done.json"
        if retry_failed and done.exists() and _has_failed(run_dir, cfg, m["name"]):
            done.unlink()  # its worker runs again: served from the journal but for the failed items
        if done.exists():
            print(f"[{i}/{n}] {m['name']}: already finished, skipped", file=sys.stderr)
            print(progress.finished(m["name"], decoded_share=0.0), file=sys.stderr)
            continue
        print(f"[{i}/{n}] {m['name']}: {m['decoder']} on {m['checkpoint']}", file=sys.stderr)
        if rank == 0:
            summary.session_ran(run_dir / "run.json", m["name"])
        cmd = worker_command(run_dir, m["name"], cfg["num_processes"], _worker_port(cfg["launch"]), debug,
                             cfg["launch"], retry_failed)
        err_file = worker_error_file(run_dir, m["name"])
        err_file.unlink(missing_ok=True)
        # The worker's temporary files (torchelastic_* of a multi-process launch, the sandbox's
        # folders) go to a folder of its own inside the run folder (one per machine: the folder may be
        # shared), removed when the worker ends; one left by a runner killed with SIGKILL is removed on resume.
        tmp = run_dir / (f".tmp-{m['name']}" + (f"-machine{rank}" if rank else ""))
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o700)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               "TMPDIR": str(tmp)}
        try:
            rc = _run_worker(cmd, env)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        stopped = {128 + int(sig) for sig in STOP_SIGNALS} | {-int(sig) for sig in STOP_SIGNALS}
        if rc in stopped:  # the worker got the stop signal itself (Slurm signals every process of the step)
            raise _Stopped(abs(rc) - 128 if rc > 0 else -rc)
        if rc != 0 and err_file.exists():
            # The worker stopped on bad data or files and said why in one line: pass it on as ours.
            msg = " ".join(err_file.read_text(encoding="utf-8").split())
            err_file.unlink(missing_ok=True)
            print(f"error: model {m['name']!r}: {msg}; fix it and rerun with --run-id {run_dir.name} to resume",
                  file=sys.stderr)
            return 2
        if rc == 2:  # the worker said why on stderr itself (its error file could not be written: a full disk)
            return 2
        if rc != 0:
            print(f"error: model {m['name']!r} failed (exit {rc}); rerun with --run-id {run_dir.name} to resume",
                  file=sys.stderr)
            return 1
        print(progress.finished(m["name"], summary.decoded_share(run_dir / "models" / m["name"] / "done.json")),
              file=sys.stderr)
    return None


if __name__ == "__main__":
    raise SystemExit(main())
