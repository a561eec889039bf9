"""The run folder: its lock, its creation with run.json, resume (the same settings or one error naming what
differs), and a machine of rank > 0 joining the folder rank 0 created."""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
import secrets
import stat
import sys
from pathlib import Path
from typing import Any

from harness.run import summary
from harness.run.environment import environment
from harness.run.hints import models_change
from harness.run.model_list import InputError
from harness.run.store import atomic_write_json, read_json

# Settings that must match for a run id to be resumed.
RESUME_KEYS = ("task", "units", "models", "limit", "seed", "chat_template", "device", "batch_size",
               "bootstrap_iters", "task_defaults", "baseline", "dtype", "chat_template_args", "shard")
# Unit fields counted from the data, not set by the user (older runs lack them): not compared on resume.
DERIVED_UNIT_KEYS = ("samples", "docs", "max_gen_toks", "data_sha256")


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
        for m in _set_knobs(entries):
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
            change = models_change(_set_knobs(old.get(k) or []), _set_knobs(cfg.get(k) or []))
            parts.append(f"models: {change or 'changed'}")
        elif k == "units":
            parts.append("units: the tasks or their documents")
        else:
            a, b = json.dumps(old.get(k), default=str), json.dumps(cfg.get(k), default=str)
            parts.append(f"{k}: {a[:40]} -> {b[:40]}")
    return "; ".join(parts)


def _set_knobs(models: list[dict]) -> list[dict]:
    """Each model entry without its resolved knobs, which follow from what is compared (knobs, task,
    checkpoint)."""
    return [{k: v for k, v in m.items() if k != "resolved_knobs"} for m in models]


def check_same_settings(run_json: Path, cfg: dict, remedy: str) -> None:
    """InputError naming each setting (old -> new) in which a recorded run.json and this command differ."""
    old = read_json(run_json)
    diff = settings_diff(old, cfg)
    if diff:
        raise InputError(f"run {run_json.parent.name!r} exists with different settings "
                         f"({describe_diff(old, cfg, diff)}); {remedy}")


def _resume_value(key: str, value: Any) -> Any:
    """A setting as compared on resume: a unit's sample count is derived, not set (older runs lack it)."""
    if key == "units" and isinstance(value, list):
        return [{k: v for k, v in u.items() if k not in DERIVED_UNIT_KEYS} for u in value]
    return value


def prepare_run_dir(out: Path, run_id: str | None, cfg: dict) -> Path:
    """The run folder, locked: created with run.json (settings + environment), or resumed when run.json is
    there with the same settings."""
    if run_id is None:
        run_id = default_run_id()
    run_dir = out / run_id
    lock_run_dir(run_dir)
    if (run_dir / "run.json").exists():
        check_same_settings(run_dir / "run.json", cfg, "use a new --run-id or the same settings to resume")
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


def join_run_dir(out: Path, run_id: str | None, cfg: dict, wait_s: float = JOIN_WAIT_S) -> Path:
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
    check_same_settings(run_json, cfg, "machine rank 0 started it: give every machine the same command")
    return out / run_id

