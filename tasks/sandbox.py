"""Run one untrusted Python program (a model's solution) against trusted tests, safely.

Public API:

    run_program(program, tests, prelude="", remote=(), ...) -> SandboxResult
    run_many([(program, tests, prelude, remote), ...], workers=4, ...) -> list[SandboxResult]
    capabilities() -> dict      # which isolation mechanisms this machine gives (recorded in run.json)

Used for pass@1 on HumanEval, MBPP and the embedded code task (docs/design.md §5:
lm-eval's hub-hosted ``code_eval`` metric cannot be loaded offline, so we execute
ourselves).

Where the verdict comes from. The model's code (``program``) and the tests never
share a process. The program runs in the *candidate* process; the tests run in a
separate *judge* process under another uid, which receives them on a pipe (they
are never written where the candidate could read them) and sees the program's
functions only as proxies: each call is a request over a socket and each answer
is data (tagged JSON: builtin values, every ``numbers.Number``, numpy scalars and
arrays), rebuilt by the judge with its own types. So a returned object's
``__eq__``, a patched ``builtins.abs`` or a replaced helper never reaches the
comparisons: helpers the tests call come from the trusted ``prelude`` (the
task's own prompt code) and standard modules, and modules of the evaluation's
packages, are the judge's own imports. The judge writes its verdict with a random
nonce to a pipe only it holds; the harness accepts ``passed`` only from that pipe
with that nonce. The program's exit status, output and files never count.

What a correct program gets, as under the official scorers (docs/design.md §6d):
the evaluation's packages (its venv's site-packages) read-only, ``exec``
semantics (no ``__name__``: a main guard does not run; stdin refuses reads).
``capabilities()["packages"]`` says which interpreter and package folders the
sandbox gives, with a warning naming cause and fix when it cannot give them.

Isolation of the candidate (as root, when the kernel allows it; see capabilities()):

* a fresh unprivileged uid per run from 50000-59999 (leased with flock in
  /run/refusion-sandbox, whatever TMPDIR says), so it can neither signal nor
  read the harness or the judge;
* new mount, PID, IPC, network and UTS namespaces: the root is a small tmpfs
  with the system directories bound read-only (no repository, no data, no
  host /tmp, /dev/shm, /run/lock), its /tmp and /dev/shm share one size-capped
  tmpfs, SysV IPC objects and Unix sockets die with the namespace, and there is
  no network. Killing the namespace's init (a root process the program cannot
  touch) kills every process of the program;
* a cgroup with a memory and a process limit for the whole program (v2, else
  v1), on top of per-process rlimits (CPU, address space, processes, file
  size, open files, no core dumps) and ``no_new_privs``;
* the judge in a mount namespace of its own with the same kind of root. In both
  the package folders and the interpreter are bound from descriptors root opened
  first, so they are shown wherever they live (a private home, /tmp).

When a mechanism is missing, the run falls back (uid switch and a root kill
loop, scratch-file sweep) and ``capabilities()["warning"]`` says what is lost;
it is printed once per run (once per process outside a run) and the runner
records it in run.json. Cleanup never raises: a sample whose cleanup fails is
scored failed with reason ``sandbox_error`` and the problem in ``detail``.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tasks.sandbox_os import (Cgroup, cgroup_setup, kill_session, kill_uid, remove_uid_leftovers, rm_rf,
                              uid_processes)

REASONS = ("passed", "timeout", "memory", "error", "exited", "killed", "output_limit", "file_size",
           "protocol", "sandbox_error")
UID_RANGE = range(50000, 60000)
LOCK_DIR = Path("/run/refusion-sandbox")
_CHILD_SRC = (Path(__file__).resolve().parent / "sandbox_child.py").read_text(encoding="utf-8")
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# Set by the runner for its workers once it has printed the sandbox warning: one warning per run.
WARNED_ENV = "REFUSION_SANDBOX_WARNED"
_warned = threading.Event()


@dataclass(frozen=True)
class SandboxResult:
    passed: bool
    reason: str  # one of REASONS
    returncode: int | None  # the candidate's main process: exit code, or -signal
    stdout: str  # first `output_bytes` bytes, decoded leniently
    stderr: str
    duration_s: float
    isolated: bool  # True when the program ran under its own unprivileged uid
    detail: str = ""  # the judge's failure (test line and exception) or a sandbox problem


# ---------------------------------------------------------------- uids, interpreter, probes
# Every sandbox uid this process has leased, so a check for leftovers looks at its own runs only: another
# process on the machine (a second evaluation, another user) leases other uids from the same lock folder.
_LEASED: set[int] = set()
_LEASED_LOCK = threading.Lock()


def leased_uids() -> frozenset[int]:
    """The sandbox uids this process has leased so far (held now or released)."""
    with _LEASED_LOCK:
        return frozenset(_LEASED)


@contextlib.contextmanager
def lease_is_free(uid: int):
    """Holds ``uid``'s lease lock while the block runs when nobody holds it (yields True), else yields False
    without waiting. With it a check of a released uid cannot race a new run taking it."""
    try:
        fd = os.open(LOCK_DIR / f"{uid}.lock", os.O_RDWR)
    except OSError:  # never leased on this machine since boot: nobody holds it
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def workdir_prefix() -> str:
    """Fallback-mode work folders of this process start with this (the pid tells the processes' apart)."""
    return f"refusion-sbx-{os.getpid()}-"


class _UidLease:
    """A sandbox uid reserved for one run, across threads and processes (flock).

    The lowest free uid is taken, so the lock folder holds at most as many files
    as runs ever ran at once."""

    def __init__(self) -> None:
        LOCK_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        for uid in UID_RANGE:
            fd = os.open(LOCK_DIR / f"{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            with _LEASED_LOCK:
                _LEASED.add(uid)
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


def _own_interpreter() -> str:
    """The evaluation's own interpreter (the venv's base), real path."""
    return str(Path(getattr(sys, "_base_executable", None) or sys.executable).resolve())


def _interpreter(as_other_uid: bool, namespaces: bool = False) -> str:
    """The Python the sandbox runs. With namespaces: the evaluation's own interpreter, wherever it lives
    (root starts it and binds its prefix into the namespace), when its standard library is readable by
    other users. Else the evaluation's own when the sandbox uids can execute it, else a world-executable
    one of the same version (same ABI: the venv's compiled packages load in it), else any world-executable
    python3 (package_environment() then says the packages are not given)."""
    own = _own_interpreter()
    if namespaces and os.path.isfile(own) and _stdlib_reason() is None:
        return own
    ver = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    candidates = [getattr(sys, "_base_executable", None), sys.executable, f"/usr/bin/{ver}",
                  f"/usr/local/bin/{ver}", shutil.which(ver), "/usr/bin/python3", shutil.which("python3")]
    for c in candidates:
        if c and os.path.isfile(c) and (not as_other_uid or _world_executable(c)):
            return str(Path(c).resolve())
    raise RuntimeError("sandbox: no Python interpreter executable by an unprivileged user was found")


def _stdlib_reason() -> str | None:
    """Why a sandbox uid could not import the evaluation interpreter's standard library once its folders
    are bound into the namespace (only their own modes count there), or None."""
    import sysconfig

    paths = sysconfig.get_paths()
    for d in dict.fromkeys((paths["stdlib"], paths["platstdlib"], os.path.join(paths["platstdlib"], "lib-dynload"))):
        if os.path.isdir(d) and (why := unreadable_reason(d, parents=False)):
            return why
    return None


def _package_dirs() -> list[str]:
    """The evaluation's package folders: its interpreter's site-packages (the venv's), real paths. Not
    PYTHONPATH entries or the repository: the sandbox never shows those."""
    import site

    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    out: list[str] = []
    for d in dirs:
        r = os.path.realpath(d)
        if os.path.isdir(r) and r not in out:
            out.append(r)
    return out


def _mode(p: Path) -> str:
    return oct(stat.S_IMODE(p.stat().st_mode))[2:]


def unreadable_reason(folder: str, parents: bool = True) -> str | None:
    """Why a sandbox uid (another user, no supplementary groups) cannot read the package folder
    `folder`, or None when it can: every folder above it world-traversable (only with ``parents``: not
    inside the namespace, where the folder is bound below folders of the sandbox's own), the folder and
    each entry in it world-readable (folders also traversable). Without ``parents`` an entry that links
    outside the folder counts too: the namespace shows the folder alone, so such a link leads nowhere."""
    p = Path(folder)
    try:
        if parents:
            for d in reversed(p.parents):
                if not d.stat().st_mode & stat.S_IXOTH:
                    return f"{d} is not traversable by other users (mode {_mode(d)})"
        need = stat.S_IROTH | stat.S_IXOTH
        if p.stat().st_mode & need != need:
            return f"{p} is not readable by other users (mode {_mode(p)})"
        real = os.path.realpath(p)
        for e in os.scandir(p):
            if not parents and e.is_symlink():
                target = os.path.realpath(e.path)
                if os.path.lexists(target) and os.path.commonpath([real, target]) != real:
                    return f"{e.path} links to {target}, outside the package folder"
            try:
                st = e.stat()  # through links: what an import opens
            except FileNotFoundError:  # a dangling link: nothing to import there, for anyone
                continue
            want = need if stat.S_ISDIR(st.st_mode) else stat.S_IROTH
            if st.st_mode & want != want:
                return f"{e.path} is not readable by other users (mode {oct(stat.S_IMODE(st.st_mode))[2:]})"
    except OSError as e:
        return f"{folder} cannot be checked ({e.strerror or e})"
    return None


def _python_version(python: str) -> str | None:
    """'X.Y' of an interpreter (run once, as this user), None when it does not run."""
    try:
        r = subprocess.run([python, "-I", "-S", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                           capture_output=True, text=True, timeout=30)
        return r.stdout.strip() if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def package_environment(as_other_uid: bool, namespaces: bool = False, dirs: list[str] | None = None) -> dict:
    """What the candidate and the judge get of the evaluation's environment (see docs/design.md §6d):
    ``python`` (the interpreter), ``site`` (package folders put on their ``sys.path``, read-only, as host
    paths), ``withheld`` (the evaluation's package folders they do not get) and ``warning`` (one line
    naming the cause and the fix when some or all of them cannot be given; ``site`` then holds the folders
    that can be, often none: the standard library only).

    With namespaces (root) every folder is bound into the sandbox's own root, so where the venv lives
    (a private home, /tmp) does not matter: only the folder's own entries must be readable by other
    users. Without them the sandbox uids open the folders at their host paths: every folder above must
    be traversable too."""
    dirs = _package_dirs() if dirs is None else dirs
    python = _interpreter(as_other_uid, namespaces)
    mine = f"{sys.version_info[0]}.{sys.version_info[1]}"
    given: list[str] = []
    problems: list[str] = []
    fixes: list[str] = []
    theirs = _python_version(python) if dirs else mine
    withheld: list[str] = []
    if theirs != mine:
        problems.append(f"the only Python the sandbox uids can run is {python} ({theirs or 'does not start'}), "
                        f"not the evaluation's {mine} ({getattr(sys, '_base_executable', sys.executable)}), so "
                        "the venv's compiled packages cannot load in it")
        fixes.append(f"install python{mine} where every user can run it (/usr/bin), or make the evaluation's "
                     "interpreter and the folders above it readable and executable by every user")
        dirs, withheld = [], list(dirs)
    for d in dirs:
        why = unreadable_reason(d, parents=not namespaces) if as_other_uid else None
        if why:
            problems.append(why)
            withheld.append(d)
            if namespaces and " links to " in why:
                fixes.append(f"install the packages into {d} itself (no link to another folder)")
            elif namespaces:
                fixes.append(f"let every user read the packages (chmod -R o+rX {d})")
            else:
                fixes.append(f"let every user read the packages (chmod o+x on each folder above {d}, chmod -R "
                             f"o+rX {d}) or create the venv in a world-readable folder")
        else:
            given.append(d)
    warning = None
    if problems:
        what = "the standard library only" if not given else f"only {', '.join(given)}"
        warning = (f"programs and tests see {what}, not all of the evaluation's packages (an import that "
                   f"works under the official scorers can fail here): {'; '.join(problems)}; "
                   f"fix: {'; '.join(fixes)}")
    return {"python": python, "site": given, "withheld": withheld, "warning": warning}


def package_imports(*codes: str, dirs: list[str] | None = None) -> list[str]:
    """The top-level modules that ``codes`` import (``import`` statements anywhere, ``__import__`` or
    ``import_module`` of a literal name) and that the package folders ``dirs`` hold (default: the
    evaluation's, its venv's site-packages), standard modules left out; sorted."""
    import ast
    import importlib.machinery

    dirs = _package_dirs() if dirs is None else dirs
    names: set[str] = set()
    for code in codes:
        try:
            tree = ast.parse(code)
        except (SyntaxError, ValueError):
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                names.update(a.name for a in n.names)
            elif isinstance(n, ast.ImportFrom) and not n.level and n.module:
                names.add(n.module)
            elif isinstance(n, ast.Call) and n.args and isinstance(n.args[0], ast.Constant) and \
                    isinstance(n.args[0].value, str) and \
                    getattr(n.func, "id", getattr(n.func, "attr", None)) in ("__import__", "import_module"):
                names.add(n.args[0].value)
    tops = {n.partition(".")[0] for n in names}
    return sorted(t for t in tops if t.isidentifier() and t not in sys.stdlib_module_names
                  and importlib.machinery.PathFinder.find_spec(t, list(dirs)) is not None)


def withheld_imports(*codes: str) -> list[str]:
    """The modules of ``package_imports(*codes)`` that only the package folders the sandbox withholds here
    hold (``capabilities()["packages"]["withheld"]``): a verdict on such code may depend on a package the
    program and the tests could not import. [] whenever every folder is given, as with namespaces."""
    pk = capabilities()["packages"]
    if not pk.get("withheld"):
        return []
    given = set(package_imports(*codes, dirs=list(pk["site"])))
    return [m for m in package_imports(*codes, dirs=list(pk["withheld"])) if m not in given]


_NS_PROBE = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x00020000 | 0x04000000 | 0x08000000 | 0x20000000 | 0x40000000) != 0:
    raise SystemExit(1)
pid = os.fork()
if pid == 0:
    ok = libc.mount(None, b"/", None, 16384 | (1 << 18), None) == 0
    ok = ok and libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 6, b"size=1m") == 0
    ok = ok and libc.mount(b"proc", b"/tmp", b"proc", 14, None) == 0
    os._exit(0 if ok else 1)
raise SystemExit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


@functools.lru_cache(maxsize=1)
def capabilities() -> dict:
    """Which isolation mechanisms this process gets, probed once; ``warning`` names what is missing."""
    root = os.geteuid() == 0
    namespaces = False
    cgroup, _ = (None, [])
    if root:
        try:
            namespaces = subprocess.run([_own_interpreter(), "-I", "-S", "-c", _NS_PROBE], timeout=30,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
        except (OSError, subprocess.SubprocessError, RuntimeError):
            namespaces = False
        cgroup, _ = cgroup_setup()
    packages = package_environment(as_other_uid=root, namespaces=namespaces)
    missing = []
    if not root:
        missing.append("not root: no uid switch, namespaces or cgroups (the program can signal the harness, "
                       "read its files and the judge's memory, and reach the network)")
    else:
        if not namespaces:
            missing.append("no mount/PID/IPC/network namespaces (the program sees the host filesystem and network)")
        if cgroup is None:
            missing.append("no memory/pids cgroup (limits are per process only)")
    parts = (["reduced isolation: " + "; ".join(missing)] if missing else []) + \
        ([packages["warning"]] if packages["warning"] else [])
    return {"uid_switch": root, "namespaces": namespaces, "cgroup": cgroup, "packages": packages,
            "warning": ("sandbox: " + "; and ".join(parts)) if parts else None}


def _warn_once(caps: dict) -> None:
    """Print the warning once per process, and not at all in a worker whose runner printed it already."""
    if caps["warning"] and not _warned.is_set():
        _warned.set()
        if os.environ.get(WARNED_ENV) != "1":
            print(f"warning: {caps['warning']}", file=sys.stderr)


# ---------------------------------------------------------------- one run
def _read_capped(f, limit: int) -> tuple[str, int]:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(0)
    return f.read(limit).decode("utf-8", errors="replace"), size


def _read_pipe(fd: int, limit: int = 1 << 16) -> bytes:
    os.set_blocking(fd, False)
    chunks = []
    try:
        while sum(map(len, chunks)) < limit:
            b = os.read(fd, 4096)
            if not b:
                break
            chunks.append(b)
    except BlockingIOError:
        pass
    return b"".join(chunks)[:limit]


def _classify(verdict: dict | None, timed_out: bool, rc: int | None, stderr: str, out_size: int,
              err_size: int, file_limit: int, oom: bool) -> str:
    """Reason of a run. Only the judge's verdict (nonce checked by the caller) can say passed;
    the rest only explains a failure. rc counts only when the program ended by itself
    (the judge saw it go): after a verdict the harness kills it, which says nothing."""
    kind = (verdict or {}).get("kind")
    if kind == "passed" and not timed_out:
        return "passed"
    if timed_out:
        return "timeout"
    if oom:
        return "memory"
    ended_by_itself = kind in (None, "candidate_gone")
    if ended_by_itself and rc is not None and rc < 0:
        sig = -rc
        if sig == signal.SIGXCPU:
            return "timeout"
        if sig == signal.SIGXFSZ:
            return "output_limit" if max(out_size, err_size) >= file_limit else "file_size"
        return "killed"
    text = stderr[-2000:] + "\n" + str((verdict or {}).get("detail", ""))
    if "MemoryError" in text:
        return "memory"
    if max(out_size, err_size) >= file_limit:
        return "output_limit"
    if "File too large" in text or "Errno 27" in text:
        return "file_size"
    if kind == "candidate_gone" and rc == 0:
        return "exited"
    if kind == "protocol":
        return "protocol"
    return "error"


def run_program(program: str, tests: str = "", *, prelude: str = "", remote: tuple[str, ...] | list[str] = (),
                timeout_s: float = 10.0, cpu_s: int | None = None, memory_mb: int = 1024, max_procs: int = 32,
                file_mb: int = 16, output_bytes: int = 64 * 1024, open_files: int = 64,
                scratch_mb: int = 64) -> SandboxResult:
    """Run the untrusted `program`, then the trusted `tests` against it; see the module doc.

    prelude: trusted code the tests may use (a task's helper functions), run in the judge;
    remote: names the tests must take from the program even though the prelude defines
    them (the function under test when the prelude is its prompt).
    timeout_s: wall-clock limit of the whole run; cpu_s: CPU seconds per process (default
    ceil(timeout_s)); memory_mb: address space per process and memory of the whole
    program; max_procs: processes of the program; file_mb: largest file (stdout/stderr
    included); scratch_mb: its /tmp + /dev/shm; output_bytes: how much of stdout/stderr
    is returned. Thread-safe: call it from a thread pool.
    """
    if timeout_s <= 0 or memory_mb <= 0 or max_procs <= 0 or file_mb <= 0 or scratch_mb <= 0:
        raise ValueError("sandbox limits must be positive")
    caps = capabilities()
    _warn_once(caps)
    return _Run(program, tests, prelude, tuple(remote), caps, timeout_s=timeout_s,
                cpu=int(cpu_s if cpu_s is not None else max(1, -(-timeout_s // 1))), memory_mb=memory_mb,
                max_procs=max_procs, file_mb=file_mb, output_bytes=output_bytes, open_files=open_files,
                scratch_mb=scratch_mb).run()


class _Run:
    def __init__(self, program, tests, prelude, remote, caps, **lim) -> None:
        self.program, self.tests, self.prelude, self.remote = program, tests, prelude, remote
        self.caps, self.lim = caps, lim
        self.root = os.geteuid() == 0
        self.ns = self.root and caps["namespaces"]
        self.leases: list[_UidLease] = []
        self.cgroup: Cgroup | None = None
        self.workdir: str | None = None
        self.judge = self.cand = None
        self.fds: list[int] = []
        self.socks: list[socket.socket] = []
        self.problems: list[str] = []
        self.status = b""

    def _status_lines(self, fd: int) -> list[str]:
        """Lines the stage process wrote to the status pipe so far (read without blocking)."""
        self.status += _read_pipe(fd)
        return self.status.decode("utf-8", "replace").split("\n")

    def _limits(self, nproc: int, mem_mb: int) -> dict:
        return {"cpu": self.lim["cpu"], "mem": mem_mb * 1024 * 1024, "nproc": nproc,
                "fsize": self.lim["file_mb"] * 1024 * 1024, "nofile": self.lim["open_files"]}

    def _user(self, lease: _UidLease | None) -> dict:
        return {"user": lease.uid, "group": lease.uid, "extra_groups": []} if lease else {}

    def run(self) -> SandboxResult:
        start = time.monotonic()
        result = None
        try:
            with tempfile.TemporaryFile() as out_f, tempfile.TemporaryFile() as err_f:
                result = self._execute(start, out_f, err_f)
        except Exception as e:  # noqa: BLE001 - a sandbox failure scores the sample failed, never the run
            result = SandboxResult(False, "sandbox_error", None, "", "", time.monotonic() - start,
                                   self.root, f"sandbox failed: {type(e).__name__}: {e}")
        finally:
            self._cleanup()
        if self.problems:
            return SandboxResult(False, "sandbox_error", result.returncode, result.stdout, result.stderr,
                                 result.duration_s, result.isolated, "cleanup failed: " + "; ".join(self.problems))
        return result

    def _execute(self, start: float, out_f, err_f) -> SandboxResult:
        lim = self.lim
        python = self.caps["packages"]["python"]
        if self.root:
            self.leases = [_UidLease(), _UidLease()]
        cand_lease, judge_lease = (self.leases + [None, None])[:2]
        if self.ns and self.caps["cgroup"]:
            self.cgroup = Cgroup((lim["memory_mb"] + lim["scratch_mb"]) * 1024 * 1024, lim["max_procs"] + 2,
                                 self.caps["cgroup"])
        jsock, csock = socket.socketpair()
        self.socks = [jsock, csock]
        verdict_r, verdict_w = os.pipe()
        status_r, status_w = os.pipe()
        self.fds = [verdict_r, verdict_w, status_r, status_w]
        nonce = secrets.token_hex(16)
        base_env = dict(_ENV)

        # The judge: trusted tests, its own uid, the only holder of the verdict pipe. With namespaces it
        # starts as root, builds a mount namespace showing the package folders as the candidate's does
        # (tasks/sandbox_child.py: _jail), then takes its uid; else it starts under its uid.
        judge_err = tempfile.TemporaryFile()
        self.judge = subprocess.Popen(
            [python, "-I", "-S", "-c", _CHILD_SRC, "judge", str(jsock.fileno()), str(verdict_w)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=judge_err, cwd="/", env=base_env,
            pass_fds=(jsock.fileno(), verdict_w), start_new_session=True,
            **({} if self.ns else self._user(judge_lease)))
        site = list(self.caps["packages"]["site"])
        judge_cfg = {"nonce": nonce, "prelude": self.prelude, "tests": self.tests, "remote": list(self.remote),
                     "limits": self._limits(8, max(2048, lim["memory_mb"])), "site": site}
        if self.ns:
            judge_cfg["jail"] = {"uid": judge_lease.uid, "scratch_mb": lim["scratch_mb"]}
        self.judge.stdin.write(json.dumps(judge_cfg).encode("utf-8"))
        self.judge.stdin.close()

        # The candidate.
        if self.ns:
            cfg = {"parent": os.getpid(), "cgroups": self.cgroup.procs_files() if self.cgroup else [],
                   "uid": cand_lease.uid, "scratch_mb": lim["scratch_mb"], "program": self.program,
                   "limits": self._limits(lim["max_procs"], lim["memory_mb"]), "site": site}
            self.cand = subprocess.Popen(
                [python, "-I", "-S", "-c", _CHILD_SRC, "stage", str(status_w), str(csock.fileno())],
                stdin=subprocess.PIPE, stdout=out_f, stderr=err_f, cwd="/", env=base_env,
                pass_fds=(status_w, csock.fileno()), start_new_session=True)
            self.cand.stdin.write(json.dumps(cfg).encode("utf-8"))
            self.cand.stdin.close()
        else:
            # Fallback: a world-traversable folder whatever TMPDIR is, so the sandbox uid can enter it.
            self.workdir = tempfile.mkdtemp(prefix=workdir_prefix(), dir="/tmp" if self.root else None)
            Path(self.workdir, "program.py").write_text(self.program, encoding="utf-8")
            nproc = lim["max_procs"]
            if cand_lease is not None:
                os.chown(self.workdir, cand_lease.uid, cand_lease.uid)
                os.chown(Path(self.workdir, "program.py"), cand_lease.uid, cand_lease.uid)
            else:
                nproc += len(uid_processes(os.getuid()))  # RLIMIT_NPROC counts all our own processes
            os.chmod(self.workdir, 0o700)
            self.cand = subprocess.Popen(
                [python, "-I", "-S", "-c", _CHILD_SRC, "candidate", str(csock.fileno()),
                 json.dumps({"limits": self._limits(nproc, lim["memory_mb"]), "site": site})],
                stdin=subprocess.DEVNULL, stdout=out_f, stderr=err_f, cwd=self.workdir,
                env={**base_env, "HOME": self.workdir, "TMPDIR": self.workdir},
                pass_fds=(csock.fileno(),), start_new_session=True, **self._user(cand_lease))
        for s in self.socks:
            s.close()
        self.socks = []
        for fd in (verdict_w, status_w):
            os.close(fd)
            self.fds.remove(fd)

        deadline = start + lim["timeout_s"]
        timed_out = False
        try:
            self.judge.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
        duration = time.monotonic() - start
        verdict = None
        raw = _read_pipe(verdict_r)
        try:
            v = json.loads(raw.decode("utf-8")) if raw else None
            if isinstance(v, dict) and secrets.compare_digest(str(v.get("nonce", "")), nonce):
                verdict = v
        except (UnicodeDecodeError, ValueError):
            verdict = None
        if verdict is not None and verdict.get("kind") == "candidate_gone":
            # The program ended on its own: let its exit status arrive (bounded by the deadline).
            try:
                self.cand.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._stop_judge()
        self._stop_candidate(status_r)
        status = self._status_lines(status_r)
        rc: int | None = None
        setup_error = (verdict or {}).get("detail", "") if (verdict or {}).get("kind") == "setup" else None
        if self.ns:
            for line in status:
                word, _, val = line.partition(" ")
                if word == "exit":
                    rc = int(val)
                elif word == "signal":
                    rc = -int(val)
                elif word == "setup":
                    setup_error = val
        else:
            rc = self.cand.returncode
        oom = self.cgroup.oom_kills() > 0 if self.cgroup else False
        stdout, out_size = _read_capped(out_f, lim["output_bytes"])
        stderr, err_size = _read_capped(err_f, lim["output_bytes"])
        judge_err.seek(0)
        judge_stderr = judge_err.read(4000).decode("utf-8", "replace")
        judge_err.close()
        if setup_error:
            return SandboxResult(False, "sandbox_error", rc, stdout, stderr, duration, self.root,
                                 f"sandbox setup failed: {setup_error}")
        if verdict is None and not timed_out:
            detail = "the judge gave no verdict" + (f": {judge_stderr.strip()[-500:]}" if judge_stderr else "")
        else:
            detail = (verdict or {}).get("detail", "") if not timed_out else f"no verdict within {lim['timeout_s']} s"
        reason = _classify(verdict, timed_out, rc, stderr, out_size, err_size, lim["file_mb"] * 1024 * 1024, oom)
        return SandboxResult(reason == "passed", reason, rc, stdout, stderr, duration, self.root, str(detail))

    def _stop_judge(self) -> None:
        if self.judge is None:
            return
        if self.judge.poll() is None:
            try:
                os.killpg(self.judge.pid, signal.SIGKILL)
            except OSError:
                pass
        self.judge.wait()

    def _stop_candidate(self, status_r: int) -> None:
        if self.cand is None:
            return
        if self.ns:
            # Killing the namespace's init kills every process in it; the stage process
            # returns only after init, hence every process of the program, is gone.
            init = None
            for line in self._status_lines(status_r):
                if line.startswith("init "):
                    init = int(line.split()[1])
            if self.cand.poll() is None:
                if init is not None:
                    try:
                        os.kill(init, signal.SIGKILL)
                    except OSError:
                        pass
                try:
                    self.cand.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.cand.kill()
                    self.cand.wait()
                    self.problems.append("the sandbox namespace did not end")
        else:
            if self.leases:
                p = kill_uid(self.leases[0].uid)
                if p:
                    self.problems.append(p)
            else:
                kill_session(self.cand.pid)
            if self.cand.poll() is None:
                self.cand.kill()
            self.cand.wait()

    def _cleanup(self) -> None:
        """Every step guarded: nothing here may raise out of run_program."""
        for step in (self._cleanup_processes, self._cleanup_files, self._cleanup_handles):
            try:
                step()
            except Exception as e:  # noqa: BLE001
                self.problems.append(f"{step.__name__}: {type(e).__name__}: {e}")

    def _cleanup_processes(self) -> None:
        for p in (self.judge, self.cand):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        for lease in self.leases:
            problem = kill_uid(lease.uid)
            if problem:
                self.problems.append(problem)
        if self.cgroup is not None:
            problem = self.cgroup.remove()
            if problem:
                self.problems.append(problem)

    def _cleanup_files(self) -> None:
        if self.workdir is not None:
            p = rm_rf(self.workdir)
            if p:
                self.problems.append(p)
        if not self.ns:
            for lease in self.leases:
                self.problems.extend(remove_uid_leftovers(lease.uid))

    def _cleanup_handles(self) -> None:
        for s in self.socks:
            s.close()
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []
        for lease in self.leases:
            lease.release()
        self.leases = []


def run_many(items: list, *, workers: int = 4, **limits) -> list[SandboxResult]:
    """Run several (program, tests[, prelude[, remote]]) concurrently (threads), results in input order."""
    from concurrent.futures import ThreadPoolExecutor

    def one(item):
        program, tests, *rest = item if isinstance(item, (tuple, list)) else (item, "")
        prelude = rest[0] if rest else ""
        remote = tuple(rest[1]) if len(rest) > 1 else ()
        return run_program(program, tests, prelude=prelude, remote=remote, **limits)

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(one, items))
