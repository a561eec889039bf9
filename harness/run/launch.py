"""Worker processes and stop signals: each model's worker and the timed rounds run as child processes with
a temporary folder of their own; SIGTERM, SIGINT and SIGUSR1 stop them cleanly so the run resumes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from harness.run import cluster, summary, zygote
from harness.run.faults import STOP_SIGNALS
from harness.run.store import atomic_write_json, read_json, read_json_or_none
from harness.run.zygote import die_with_parent  # noqa: F401 - the runner's, re-exported

REPO = Path(__file__).resolve().parents[2]


def worker_error_file(run_dir: Path, model: str) -> Path:
    """Where a worker leaves its one-line error for the runner to report."""
    return run_dir / "models" / model / "error.txt"


def worker_command(run_dir: Path, model: str, num_processes: int, port: int, debug: bool = False,
                   launch: dict | None = None, retry_failed: bool = False) -> list[str]:
    """The command line of one model's worker: plain Python, or accelerate launch for several processes or
    machines."""
    base = ["-m", "harness.run.worker", "--run-dir", str(run_dir), "--model", model,
            "--error-file", str(worker_error_file(run_dir, model))] + (["--debug"] if debug else []) \
        + (["--retry-failed"] if retry_failed else [])
    launch = launch or {}
    if num_processes <= 1 and not launch.get("accelerate_config") and int(launch.get("num_machines") or 1) == 1:
        return [sys.executable, *base]
    # --multi_gpu picks accelerate's multi-process (torchrun) launcher; on CPU the adapter joins gloo.
    return [sys.executable, "-m", "accelerate.commands.launch", *cluster.launch_args(launch, num_processes, port),
            *base]


class Stopped(Exception):
    """A stop signal (``signum``) received while the runner waited: unwinds to main, which says how to resume."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def raise_stopped(signum, _frame) -> None:
    """Signal handler: a stop signal unwinds the runner as an exception (``Stopped``)."""
    raise Stopped(signum)


def run_worker(cmd: list[str], env: dict, server: zygote.Server | None = None) -> int:
    """Run one model's worker; SIGTERM, SIGINT and SIGUSR1 (Slurm's warning before the end of a job) stop it
    cleanly: the journal keeps finished samples, the run resumes with its run id. ``server``: the run's fork
    server (harness/run/zygote.py), which starts it warm where it can; a plain process otherwise."""
    old = {s: signal.signal(s, raise_stopped) for s in STOP_SIGNALS}
    # The worker gets SIGKILL if this runner dies in any way (kill -9 included); a forked one when the server
    # dies, which dies with this runner.
    proc = server.start(cmd, env, str(REPO)) if server is not None else None
    if proc is None:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, preexec_fn=lambda: die_with_parent(signal.SIGKILL))
    try:
        return proc.wait()
    except Stopped:
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


def child_env(tmp: Path | None = None) -> dict:
    """The environment of the run's children (and of its fork server): this one, the repository first on the
    import path, and TMPDIR their own folder."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    if tmp is not None:
        env["TMPDIR"] = str(tmp)
    return env


def fork_server() -> zygote.Server | None:
    """The run's fork server, not started yet: the runner starts it once the run's tasks are checked
    (``server.begin``), or else its first child (``run_child``), in the environment the children get then, with
    a temporary folder of its own (``zygote.Server.begin``). None where ``REFUSION_FORK_SERVER=0``: every child
    then a plain process."""
    if os.environ.get("REFUSION_FORK_SERVER", "1") == "0":
        return None
    return zygote.Server(child_env, str(REPO))


def run_child(cmd: list[str], run_dir: Path, tmp_name: str, drop_env: tuple[str, ...] = (),
              server: zygote.Server | None = None) -> int:
    """``run_worker`` with the child's temporary files (torchelastic_* of a multi-process launch, the
    sandbox's folders) in a folder of its own inside the run folder, ``tmp_name``, removed when the child
    ends; one left by a runner killed with SIGKILL is removed at the next start. ``drop_env``: variables
    the child must not inherit."""
    tmp = run_dir / tmp_name
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    env = child_env(tmp)
    for name in drop_env:
        env.pop(name, None)
    try:
        return run_worker(cmd, env, server)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def timed_rounds(run_dir: Path, cfg: dict, server: zygote.Server | None = None) -> int | None:
    """The timed rounds of an interleaved run (harness/run/rounds.py, its own process), unless timing.json
    holds them for these timing settings already (a resumed run); an exit status to stop with, or None."""
    t = cfg.get("timing") or {}
    old = read_json(run_dir / "run.json")
    if old.get("timing") != t:  # a resumed run timed with other settings: run.json says what timing.json holds
        atomic_write_json(run_dir / "run.json", {**old, "timing": t})
    if t.get("mode", "interleaved") != "interleaved":
        return None
    if (read_json_or_none(run_dir / "timing.json") or {}).get("settings") == t:
        print("timed rounds: already measured, kept", file=sys.stderr)
        return None
    print(f"timed rounds: {t['rounds']} rounds, {t['items']} item(s) per task, the models in turn "
          f"({t['order']}), wall time", file=sys.stderr)
    # A fault in a timed decode (out of memory, non-finite logits) is retried once, then the item is dropped from
    # the timing and named (harness/run/rounds.py); the rounds fail only on a bug or on a timed decode whose
    # tokens differ from the pass's.
    rc = run_child([sys.executable, "-m", "harness.run.rounds", "--run-dir", str(run_dir)], run_dir, ".tmp-timing",
                   server=server)
    for d in (read_json_or_none(run_dir / "timing.json") or {}).get("dropped") or []:
        print(f"warning: timed rounds: {d['side']} on {d['group']}: document(s) "
              f"{', '.join(str(x[1]) for x in d['docs'])} failed twice ({d['reason']}); left out of every model's "
              "timing of that task (summary.md names them)", file=sys.stderr)
    if rc != 0:
        print(f"error: the timed rounds failed (exit {rc}); quality and counts are kept: rerun with --run-id "
              f"{run_dir.name} to time again, or --timing sequential for single-pass figures", file=sys.stderr)
        return 1
    return None


def memory_pass(run_dir: Path, cfg: dict, server: zygote.Server | None = None) -> None:
    """The memory pass (harness/run/memory_pass.py, its own process), unless memory.json holds it for these
    settings already (a resumed run) or it is off (``--memory-items 0``). A failed pass is a warning: quality,
    counts and speed are kept, and the summary says the decode peak was not measured."""
    from harness.run.memory_pass import load_memory, settings_of

    want = cfg.get("memory_pass") or {}
    old = read_json(run_dir / "run.json")
    if old.get("memory_pass") != want:  # a resumed run with other settings: run.json says what memory.json holds
        atomic_write_json(run_dir / "run.json", {**old, "memory_pass": want})
    if int(settings_of(cfg)["items"]) < 1:
        return
    if load_memory(run_dir, cfg) is not None:
        print("memory pass: already measured, kept", file=sys.stderr)
        return
    print(f"memory pass: {settings_of(cfg)['items']} call(s) per task and model under the tensor tracker",
          file=sys.stderr)
    # The fault hooks stay: a call that faults is retried once, then named and left out of the peak.
    rc = run_child([sys.executable, "-m", "harness.run.memory_pass", "--run-dir", str(run_dir)], run_dir,
                   ".tmp-memory", server=server)
    if rc != 0:
        print(f"warning: the memory pass failed (exit {rc}); the decode peak is not measured: rerun with --run-id "
              f"{run_dir.name} to measure it", file=sys.stderr)


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


def run_models(run_dir: Path, cfg: dict, debug: bool, rates: dict[str, float] | None = None,
               retry_failed: bool = False, server: zygote.Server | None = None) -> int | None:
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
        eng = f"@{m['engine']['name']}" if m.get("engine") else ""  # ar@vllm: served by the engine
        print(f"[{i}/{n}] {m['name']}: {m['decoder']}{eng} on {m['checkpoint']}", file=sys.stderr)
        if rank == 0:
            summary.session_ran(run_dir / "run.json", m["name"])
        cmd = worker_command(run_dir, m["name"], cfg["num_processes"], _worker_port(cfg["launch"]), debug,
                             cfg["launch"], retry_failed)
        err_file = worker_error_file(run_dir, m["name"])
        err_file.unlink(missing_ok=True)
        # One temporary folder per machine: the run folder may be shared between machines.
        rc = run_child(cmd, run_dir, f".tmp-{m['name']}" + (f"-machine{rank}" if rank else ""), server=server)
        stopped = {128 + int(sig) for sig in STOP_SIGNALS} | {-int(sig) for sig in STOP_SIGNALS}
        if rc in stopped:  # the worker got the stop signal itself (Slurm signals every process of the step)
            raise Stopped(abs(rc) - 128 if rc > 0 else -rc)
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

