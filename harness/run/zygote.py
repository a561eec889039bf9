"""Child processes that start warm: a fork server that imports torch, transformers and lm-eval once per run.

A run's models, its timed rounds and its memory pass each run in a child process of the runner (launch.py):
a crash, an out-of-memory kill or a hung decode ends that child, not the run. Each such child used to import
torch, transformers' Qwen3 and lm-eval itself, 7-10 s on a 2-core machine: more than a tiny model's whole
evaluation, paid again by every model. This server imports them once; each child is then a ``fork()`` of it
that runs its module as ``python -m`` would, with its own argv, environment, working folder and standard
streams (the runner's, passed at each start). What stays as it was:

- a child is a new process: its exit status (a code, or minus the signal that killed it), its own signal
  handlers (the server's are reset), its CPU clock, and the kernel's SIGKILL when its parent dies. The
  server itself dies with the runner, so a runner killed in any way takes the server and its children along;
- nothing of the project is imported by the server: only third-party modules (``PRELOAD``), so each child
  loads refusion/, harness/ and tasks/ from disk as a fresh process would;
- the server never runs a tensor operation, so torch's thread pools do not exist to be forked. The preload
  leaves three native threads beside the main one: the OpenBLAS pools of numpy and of scipy and pyarrow's
  jemalloc background thread, libraries that prepare for fork themselves (pthread_atfork), as every
  fork-started PyTorch DataLoader worker relies on. Before each fork the server checks that no Python thread
  and no native thread has appeared since. Where it cannot serve a command (another module, an environment
  that differs in anything but TMPDIR, REFUSION_* variables and what libraries set at import (``_refuse``), a
  new thread, a server that failed to start), the caller starts the command as a plain process
  (``launch.run_worker``).

Protocol: one SOCK_SEQPACKET socket pair between runner and server. Each start sends a JSON request
(argv, env, cwd, and ``late``: the variables the runner set since the server began) with four file descriptors
(a fresh socket for this child's replies, stdin, stdout, stderr); the server replies on that socket with ``{"pid": n}`` (or ``{"refused": why}``), then
``{"exit": code}`` when the child ends.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

# Modules the children import anyway (worker, rounds, memory pass), heaviest first; one that is missing is skipped.
PRELOAD = ("torch", "transformers", "transformers.models.qwen3.modeling_qwen3", "transformers.generation.utils",
           "lm_eval", "lm_eval.api.model", "lm_eval.api.registry", "lm_eval.evaluator", "datasets", "accelerate",
           "scipy.stats", "sympy", "safetensors.torch", "tokenizers", "numpy", "psutil", "tqdm")
# The commands it serves: `python -m <one of these> ...` (the run's own children).
MODULES = ("harness.run.worker", "harness.run.rounds", "harness.run.memory_pass")
# Variables a child may have unlike the server: each child's temporary folder, and the project's own (read by
# the project's code, which each child loads itself). What the preloaded libraries read at import must match.
PER_CHILD_ENV = ("TMPDIR",)
PER_CHILD_PREFIX = "REFUSION_"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
MAX_MSG = 1 << 20


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Linux: have the kernel send `sig` to this process when its parent dies."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0  # unknown: refuse (fork is safe with one thread only)


def _exit_code(e: SystemExit) -> int:
    """`python`'s rule for ``sys.exit(x)``: None is 0, an int is itself, anything else is printed and is 1."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _child(req: dict, fds: list[int]) -> int:
    """In the forked child: become ``python -m <module> <args>`` in the request's folder and environment."""
    import runpy

    for s in (signal.SIGCHLD, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.set_wakeup_fd(-1)
    die_with_parent(signal.SIGKILL)
    if os.getppid() != req["server_pid"]:  # the server died before the line above: so must this child
        return 1
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    tempfile.tempdir = None  # TMPDIR is the child's own
    module, args = req["argv"][2], req["argv"][3:]
    sys.argv = [module, *args]  # run_module puts the module's file first, as `python -m` does
    sys.path[0] = req["cwd"]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = _exit_code(e)
    except KeyboardInterrupt:  # as python does: die of SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    except BaseException:  # noqa: BLE001 - what python does with an uncaught exception
        traceback.print_exc()
        code = 1
    import atexit
    import threading

    threading._shutdown()  # non-daemon threads finish first, as at interpreter exit
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    return code


def _refuse(req: dict, started: dict, added: dict, threads: int, modules: tuple[str, ...]) -> str | None:
    """Why the server cannot start this request (None: it can). ``started``: its environment before the preload;
    ``added``: what the preload set there itself; ``threads``: its native threads after it. Besides TMPDIR and
    REFUSION_*, the request may differ in the variables of ``added`` and in those it names ``late``: what the
    runner's own imports set after the server began (libraries that set at import what is unset, such as torch's
    inductor cache folder under the runner's TMPDIR or scikit-learn's KMP_DUPLICATE_LIB_OK): a fresh process the
    runner started would have had them; the child gets the request's values."""
    if req["argv"][:2] != [sys.executable, "-m"] or len(req["argv"]) < 3 or req["argv"][2] not in modules:
        return f"not a command it serves: {' '.join(req['argv'][:3])}"
    free = set(added) | set(req.get("late") or ())

    def shared(env: dict) -> dict:
        return {k: v for k, v in env.items()
                if k not in PER_CHILD_ENV and not k.startswith(PER_CHILD_PREFIX) and k not in free}

    theirs, ours = shared(req["env"]), shared(started)
    if theirs != ours:
        names = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
        return f"another environment ({', '.join(names[:5])}{' ...' if len(names) > 5 else ''})"
    import threading

    if threads == 0:
        return "no /proc/self/task to count its threads"
    # Fewer is fine: OpenBLAS stops its pool at a fork (its own pthread_atfork) and starts it when next used.
    if threading.active_count() != 1 or _threads() > threads:
        return f"{_threads()} threads in the server, {threads} after its imports"
    return None


def serve(fd: int, modules: tuple[str, ...] = MODULES, preload: tuple[str, ...] = PRELOAD) -> int:
    """The server's loop (``python -m harness.run.zygote FD [JSON]``): import ``preload``, then start children
    (``python -m`` of one of ``modules``) until the runner closes its end, then wait for the children still
    running."""
    ctl = socket.socket(fileno=fd)
    for s in STOP_SIGNALS:  # the runner decides what a stop signal does; the children get their own handlers
        signal.signal(s, signal.SIG_IGN)
    started = dict(os.environ)
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module missing here is imported by the child, as before
            pass
    # What the imports set in the environment (a fresh process importing them would have it too).
    added = {k: v for k, v in os.environ.items() if started.get(k) != v}
    threads = _threads()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    children: dict[int, socket.socket] = {}
    open_ = True
    while open_ or children:
        ready = select.select([ctl, wake_r] if open_ else [wake_r], [], [], 1.0)[0]
        if wake_r in ready:
            os.read(wake_r, 4096)
        for pid in list(children):
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                _send(children.pop(pid), {"exit": os.waitstatus_to_exitcode(status)})
        if ctl not in ready:
            continue
        try:
            msg, fds, _flags, _addr = socket.recv_fds(ctl, MAX_MSG, 4)
        except OSError:
            msg, fds = b"", []
        if not msg:  # the runner closed its end (or is gone): no more children
            open_ = False
            for f in fds:
                os.close(f)
            continue
        conn = socket.socket(fileno=fds[0])
        req = json.loads(msg)
        why = _refuse(req, started, added, threads, modules)
        if why is not None:
            _send(conn, {"refused": why})
            for f in fds[1:]:
                os.close(f)
            continue
        for f in (sys.stdout, sys.stderr):
            f.flush()
        server_pid = os.getpid()  # taken here: the child's getppid() is already 1 if this server died first
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                ctl.close()
                os.close(wake_r)
                os.close(wake_w)
                conn.close()
                for c in children.values():
                    c.close()
                # The request's values win: a fresh process would have started with them, and its imports set
                # only what was unset.
                code = _child({**req, "env": {**added, **req["env"]}, "server_pid": server_pid}, fds[1:])
            finally:
                os._exit(code)
        for f in fds[1:]:
            os.close(f)
        children[pid] = conn
        _send(conn, {"pid": pid})
    return 0


def _send(conn: socket.socket, obj: dict) -> None:
    try:
        conn.send(json.dumps(obj).encode())
        if "pid" not in obj:
            conn.close()
    except OSError:
        conn.close()


class Child:
    """A started child, as the runner sees it: ``wait``, ``terminate`` and ``kill`` as subprocess.Popen's."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self.conn, self.pid, self.returncode = conn, pid, None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        self.conn.settimeout(timeout)
        try:
            msg = self.conn.recv(MAX_MSG)
        except socket.timeout:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout) from None
        # No message: the server is gone, and the kernel killed its children with it.
        self.returncode = int(json.loads(msg)["exit"]) if msg else -int(signal.SIGKILL)
        self.conn.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Server:
    """The runner's handle on the fork server: ``start(cmd, env, cwd)`` gives a Child, or None where the server
    cannot serve that command (the caller then starts it as a plain process). The server process starts at the
    first ``start`` (a run with nothing left to decode starts none; ``begin()`` starts it ahead), in ``env``
    (or what ``env()`` gives then); ``close()`` ends it; a context manager too."""

    def __init__(self, env: dict | Callable[[], dict], cwd: str, modules: tuple[str, ...] = MODULES,
                 preload: tuple[str, ...] = PRELOAD) -> None:
        self.env, self.cwd, self.modules, self.preload = env, cwd, modules, preload
        self.sock: socket.socket | None = None
        self.proc: subprocess.Popen | None = None
        self.why: str | None = None
        self.tmp: Path | None = None
        self.served = False  # a child was started
        self.began: dict[str, str] = {}

    def begin(self, tmp: Path | None = None) -> None:
        """Start the server process (it imports in the background from now on), with ``tmp`` its TMPDIR (made
        here, a leftover of that name removed first; None: a new folder in the caller's temporary folder),
        removed by ``close``: its imports leave files there (torch's inductor cache folder), not in the
        caller's."""
        if self.proc is not None or self.why is not None:
            return
        env = self.env() if callable(self.env) else dict(self.env)
        try:
            if tmp is None:
                tmp = Path(tempfile.mkdtemp(prefix="refusion-fork-server-"))
            else:
                shutil.rmtree(tmp, ignore_errors=True)  # one left by a runner killed with SIGKILL
                tmp.mkdir(mode=0o700)
        except OSError as e:
            self.why = f"no temporary folder ({e})"
            return
        self.tmp, env["TMPDIR"] = tmp, str(tmp)
        self.began = dict(os.environ)  # the caller's environment now: what it sets later is named at each start
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        spec = json.dumps({"modules": list(self.modules), "preload": list(self.preload)})
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "harness.run.zygote", str(theirs.fileno()), spec],
                                         cwd=self.cwd, env=env, pass_fds=[theirs.fileno()],
                                         stdin=subprocess.DEVNULL, preexec_fn=lambda: die_with_parent(signal.SIGKILL))
        except OSError as e:
            mine.close()
            self.why = f"it did not start ({e})"
        else:
            self.sock = mine
        finally:
            theirs.close()

    def start(self, cmd: list[str], env: dict, cwd: str) -> Child | None:
        self.begin()
        if self.why is not None:
            return None
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            late = sorted(k for k, v in os.environ.items() if self.began.get(k) != v)
            socket.send_fds(self.sock, [json.dumps({"argv": cmd, "env": env, "cwd": cwd, "late": late}).encode()],
                            [theirs.fileno(), 0, 1, 2])
            theirs.close()
            reply = json.loads(mine.recv(MAX_MSG) or b'{"refused": "the server is gone"}')
        except OSError as e:
            theirs.close()
            mine.close()
            self.why = f"the server is gone ({e})"
            return None
        if "pid" not in reply:
            mine.close()
            if os.environ.get("REFUSION_FORK_SERVER_DEBUG"):
                print(f"fork server: {reply['refused']}", file=sys.stderr)
            if reply["refused"] == "the server is gone":
                self.why = reply["refused"]
            return None
        self.served = True
        return Child(mine, int(reply["pid"]))

    def close(self, timeout: float = 0.5) -> None:
        """End the server. Every child has been waited for by then (launch.run_worker), so one still importing
        or waiting is killed after ``timeout`` rather than waited on."""
        if self.sock is not None:
            self.sock.close()
        if self.proc is not None:
            t0 = time.monotonic()
            # one that served no child (a run that stopped at a check) may still be importing: killed at once
            while self.served and self.proc.poll() is None and time.monotonic() - t0 < timeout:
                time.sleep(0.01)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    _spec = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    sys.exit(serve(int(sys.argv[1]), tuple(_spec.get("modules", MODULES)), tuple(_spec.get("preload", PRELOAD))))
