"""Run one untrusted Python program (a model's solution plus its tests) safely.

Public API: ``run_program(program, ...) -> SandboxResult``. Used for pass@1 on
HumanEval, MBPP and the embedded code task (DESIGN §5: lm-eval's
``evaluate.load("code_eval")`` does not work offline, so we execute ourselves).

What is guaranteed when the harness runs as root (the normal case here and in CI):

* The program runs in a fresh process under a *fresh unprivileged uid* taken
  from a private range (50000-59999), one uid per concurrent run, reserved
  across processes with an ``flock`` so parallel harnesses never share one.
  Because of that uid it cannot signal the harness (EPERM), cannot read the
  harness's ``/proc/<pid>/environ``, cannot delete or write root-owned files,
  and its ``RLIMIT_NPROC`` (per-uid in Linux) bounds its own processes only,
  so a fork bomb in one run cannot starve another run.
* After the program ends (or at the wall-clock deadline) every process owned by
  that uid is killed with ``kill(-1, SIGKILL)`` issued *as that uid*. This also
  catches grandchildren that called ``setsid()`` or double-forked: nothing the
  program started outlives ``run_program``. Files it left in /tmp, /var/tmp or
  /dev/shm (world-writable) are removed, and so is its working directory.
* Limits, set as hard limits inside the child before the program starts: CPU
  seconds, address space, processes, file size (also caps stdout/stderr, which
  go to unlinked temporary files, never to a pipe read into memory), open files,
  no core dumps; ``no_new_privs`` so setuid binaries cannot regain root.
* Environment is scrubbed (PATH, HOME and TMPDIR pointing at the sandbox dir,
  LANG, PYTHONHASHSEED=0 for determinism). The interpreter runs with ``-I -S``:
  standard library only, no site-packages, no user site.
* Network: when ``unshare --net`` works (probed once) the program gets an empty
  network namespace. Otherwise network access is NOT restricted.
* ``passed`` needs exit status 0 *and* the launcher's completion mark written
  after the program's last line ran, so ``sys.exit(0)`` / ``os._exit(0)``
  before the tests is reported as ``exited``, not passed. (This stops
  accidents; a program that deliberately forges the mark via introspection of
  its own interpreter is out of scope.)

Not guaranteed: total disk use is bounded only by file size x time; files that
are world-readable on this machine (source code, data) can be read. Without
root there is no uid switch: limits still apply, but the program could signal
the harness and a ``setsid()`` grandchild can escape the cleanup
(``SandboxResult.isolated`` is False then).
"""

from __future__ import annotations

import fcntl
import functools
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REASONS = ("passed", "timeout", "memory", "error", "exited", "killed", "output_limit", "file_size", "sandbox_error")
_UID_RANGE = range(50000, 60000)
_LOCK_DIR = Path(tempfile.gettempdir()) / "refusion-sandbox-locks"
_SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm")

# Runs inside the child (as the sandbox uid): apply limits, then run the program
# in this same process and write the completion mark only if it returned.
_LAUNCHER = r"""
import ctypes, os, resource, runpy, sys
mark_fd = int(sys.argv[1])
cpu, mem, nproc, fsize, nofile = (int(x) for x in sys.argv[2:7])
try:
    ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
except Exception:
    pass
for res, val in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (mem, mem)),
                 (resource.RLIMIT_NPROC, (nproc, nproc)), (resource.RLIMIT_FSIZE, (fsize, fsize)),
                 (resource.RLIMIT_NOFILE, (nofile, nofile)), (resource.RLIMIT_CORE, (0, 0))):
    resource.setrlimit(res, val)
sys.argv = ["program.py"]
sys.path.insert(0, os.getcwd())
runpy.run_path("program.py", run_name="__main__")
sys.stdout.flush()
os.write(mark_fd, b"OK")
"""
_KILLER = "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept ProcessLookupError:\n    pass\n"


@dataclass(frozen=True)
class SandboxResult:
    passed: bool
    reason: str  # one of REASONS
    returncode: int | None
    stdout: str  # first `output_bytes` bytes, decoded leniently
    stderr: str
    duration_s: float
    isolated: bool  # True when the program ran under its own unprivileged uid


class _UidLease:
    """A sandbox uid reserved for one run, across threads and processes (flock)."""

    def __init__(self) -> None:
        _LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
        start = random.randrange(len(_UID_RANGE))
        for i in range(len(_UID_RANGE)):
            uid = _UID_RANGE[(start + i) % len(_UID_RANGE)]
            fd = os.open(_LOCK_DIR / f"{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            return
        raise RuntimeError("sandbox: every uid in the sandbox range is in use")

    def release(self) -> None:
        os.close(self._fd)  # closing drops the flock


def _world_executable(path: str) -> bool:
    """True when an unprivileged uid can execute `path` (every ancestor dir o+x)."""
    p = Path(path).resolve()
    if not p.is_file() or not (p.stat().st_mode & stat.S_IXOTH):
        return False
    return all(d.stat().st_mode & stat.S_IXOTH for d in p.parents)


def _interpreter(as_other_uid: bool) -> str:
    candidates = [getattr(sys, "_base_executable", None), sys.executable, "/usr/bin/python3", shutil.which("python3")]
    for c in candidates:
        if c and os.path.isfile(c) and (not as_other_uid or _world_executable(c)):
            return str(Path(c).resolve())
    raise RuntimeError("sandbox: no Python interpreter executable by an unprivileged user was found")


@functools.lru_cache(maxsize=1)
def _net_namespace_works() -> bool:
    """Probe once whether `unshare --net` + `setpriv` are usable (needs root)."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"):
        return False
    try:
        return subprocess.run(["unshare", "--net", "--", "true"], timeout=10,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _uid_processes(uid: int) -> list[int]:
    """Live (non-zombie) pids whose real uid is `uid`."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            status = Path(entry.path, "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1 ").split()[0]) == uid and not fields.get("State", "").strip().startswith("Z"):
            pids.append(int(entry.name))
    return pids


def _kill_uid(uid: int, python: str) -> None:
    """SIGKILL every process of `uid`, signalled *as* `uid` (so setsid escapes are caught)."""
    # Only uid processes can create uid processes, so an empty scan is final.
    for _ in range(5):
        if not _uid_processes(uid):
            return
        subprocess.run([python, "-I", "-S", "-c", _KILLER], user=uid, group=uid, extra_groups=[],
                       env={}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=30, cwd="/")
    if _uid_processes(uid):
        raise RuntimeError(f"sandbox: processes of uid {uid} survived SIGKILL")


def _kill_session(pid: int) -> None:
    """Non-root fallback: kill the process group and anything still in the session."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == pid:
                    os.kill(int(entry.name), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue


def _remove_scratch_files(uid: int) -> None:
    for d in _SCRATCH_DIRS:
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            try:
                if e.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if e.is_dir(follow_symlinks=False):
                    shutil.rmtree(e.path, ignore_errors=True)
                else:
                    os.unlink(e.path)
            except OSError:
                continue


def _read_capped(f, limit: int) -> tuple[str, int]:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(0)
    return f.read(limit).decode("utf-8", errors="replace"), size


def _classify(timed_out: bool, rc: int | None, completed: bool, stderr: str,
              out_size: int, err_size: int, file_limit: int) -> str:
    if timed_out:
        return "timeout"
    if rc == 0:
        return "passed" if completed else "exited"
    if rc is not None and rc < 0:
        sig = -rc
        if sig == signal.SIGXCPU:
            return "timeout"
        if sig == signal.SIGXFSZ:
            return "output_limit" if max(out_size, err_size) >= file_limit else "file_size"
        return "killed"
    tail = stderr[-2000:]
    if "MemoryError" in tail:
        return "memory"
    if max(out_size, err_size) >= file_limit:
        return "output_limit"
    if "File too large" in tail or "Errno 27" in tail:
        return "file_size"
    return "error"


def run_program(program: str, *, timeout_s: float = 10.0, cpu_s: int | None = None, memory_mb: int = 1024,
                max_procs: int = 32, file_mb: int = 16, output_bytes: int = 64 * 1024,
                open_files: int = 64) -> SandboxResult:
    """Run `program` (Python source: solution + asserts) in a sandbox; see the module doc.

    timeout_s: wall-clock limit; cpu_s: CPU-seconds limit (default: ceil(timeout_s));
    memory_mb: address-space limit; max_procs: processes of the sandbox uid;
    file_mb: largest file it may write (stdout/stderr included); output_bytes: how
    much of stdout/stderr is returned. Thread-safe: call it from a thread pool.
    """
    if timeout_s <= 0 or memory_mb <= 0 or max_procs <= 0 or file_mb <= 0:
        raise ValueError("sandbox limits must be positive")
    cpu = int(cpu_s if cpu_s is not None else max(1, -(-timeout_s // 1)))
    root = os.geteuid() == 0
    lease = _UidLease() if root else None
    python = _interpreter(as_other_uid=root)
    workdir = tempfile.mkdtemp(prefix="refusion-sbx-")
    file_limit = file_mb * 1024 * 1024
    mark_r, mark_w = os.pipe()
    start = time.monotonic()
    proc = None
    try:
        Path(workdir, "program.py").write_text(program, encoding="utf-8")
        nproc = max_procs
        if lease is not None:
            os.chown(workdir, lease.uid, lease.uid)
            os.chown(Path(workdir, "program.py"), lease.uid, lease.uid)
        else:
            # RLIMIT_NPROC counts every process of our own uid, so allow for those.
            nproc = max_procs + len(_uid_processes(os.getuid()))
        os.chmod(workdir, 0o700)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
               "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
        cmd = [python, "-I", "-S", "-c", _LAUNCHER, str(mark_w), str(cpu), str(memory_mb * 1024 * 1024),
               str(nproc), str(file_limit), str(open_files)]
        popen_kw: dict = {}
        if lease is not None and _net_namespace_works():
            u = str(lease.uid)
            cmd = ["unshare", "--net", "--", "setpriv", f"--reuid={u}", f"--regid={u}", "--clear-groups",
                   "--", *cmd]
        elif lease is not None:
            popen_kw = {"user": lease.uid, "group": lease.uid, "extra_groups": []}
        with tempfile.TemporaryFile() as out_f, tempfile.TemporaryFile() as err_f:
            timed_out = False
            try:
                proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out_f,
                                        stderr=err_f, pass_fds=(mark_w,), start_new_session=True, **popen_kw)
            except OSError as e:
                return SandboxResult(False, "sandbox_error", None, "", f"could not start: {e}",
                                     time.monotonic() - start, lease is not None)
            os.close(mark_w)
            mark_w = -1
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                rc = None
            duration = time.monotonic() - start
            # Kill everything the program started, whether it finished or not.
            if lease is not None:
                _kill_uid(lease.uid, python)
            else:
                _kill_session(proc.pid)
            final_rc = proc.wait()
            rc = final_rc if not timed_out else None
            os.set_blocking(mark_r, False)
            try:
                completed = os.read(mark_r, 16) == b"OK"
            except BlockingIOError:
                completed = False
            stdout, out_size = _read_capped(out_f, output_bytes)
            stderr, err_size = _read_capped(err_f, output_bytes)
        reason = _classify(timed_out, rc, completed, stderr, out_size, err_size, file_limit)
        return SandboxResult(reason == "passed", reason, rc, stdout, stderr, duration, lease is not None)
    finally:
        if proc is not None and proc.poll() is None:  # only on an unexpected exception above
            proc.kill()
            proc.wait()
        for fd in (mark_r, mark_w):
            if fd >= 0:
                os.close(fd)
        if lease is not None:
            _remove_scratch_files(lease.uid)
            lease.release()
        shutil.rmtree(workdir, ignore_errors=True)


def run_many(programs: list[str], *, workers: int = 4, **limits) -> list[SandboxResult]:
    """Run several programs concurrently (threads; each in its own sandbox), results in input order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda p: run_program(p, **limits), programs))

