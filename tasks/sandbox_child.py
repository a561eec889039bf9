"""Code that runs in the sandbox's child interpreters, never imported by the harness.

``tasks.sandbox`` passes this file's text to ``python -I -S -c`` with a role:

* ``stage`` (root, only when namespaces work): joins the run's cgroups, enters
  new mount/PID/IPC/network/UTS namespaces, forks the namespace's init, which
  builds a minimal read-only root (system dirs bound read-only, one size-capped
  tmpfs for /tmp and /dev/shm, a private /proc) and forks the candidate under
  the sandbox uid. Killing that init kills every process of the program, and
  the tmpfs, SysV IPC objects and sockets die with the namespaces.
* ``candidate`` (sandbox uid): runs the model's code as ``__main__``, then
  answers requests from the judge on a socket: look up a global, call it, take
  an attribute, iterate... Every answer is plain data (tagged JSON of builtin
  types); anything else stays in the candidate and is named by a handle.
* ``judge`` (a second sandbox uid): receives the trusted prelude and tests on
  stdin (never on disk), runs them with the candidate's functions replaced by
  proxies, so every value the tests compare is a plain builtin object built by
  the judge itself, and writes the verdict with the harness's nonce to a pipe
  only the judge holds.

Standard library only: these interpreters run with ``-I -S``.
"""

import builtins
import json
import os
import socket
import struct
import sys

MAX_MESSAGE = 64 * 1024 * 1024  # bytes of one message the judge accepts from the candidate
MAX_DEPTH = 100  # nesting of a decoded value
_EXC = {name: obj for name, obj in vars(builtins).items()
        if isinstance(obj, type) and issubclass(obj, Exception)}
try:
    sys.set_int_max_str_digits(0)  # big ints travel as decimal strings
except AttributeError:
    pass


class WireError(Exception):
    """A message that is not valid protocol (malformed, too big, too deep)."""


class CandidateGone(Exception):
    """The candidate closed its end: it exited or crashed."""


# ---------------------------------------------------------------- framing
def send_msg(sock, obj):
    data = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv_exact(sock, n):
    chunks, got = [], 0
    while got < n:
        b = sock.recv(min(n - got, 1 << 20))
        if not b:
            raise CandidateGone("connection closed")
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def recv_msg(sock, limit=MAX_MESSAGE):
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > limit:
        raise WireError(f"message of {n} bytes exceeds {limit}")
    try:
        return json.loads(_recv_exact(sock, n).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise WireError(f"malformed message: {e}") from None


# ---------------------------------------------------------------- values
def encode(obj, ref_of, depth=0):
    """Tagged JSON of a value built from builtin types; ``ref_of(obj)`` names anything else.

    Subclasses of builtin types travel as their base type, so a returned value's
    own ``__eq__`` never reaches the judge.
    """
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if obj is None:
        return ["n"]
    if isinstance(obj, bool):
        return ["b", obj is True or bool.__bool__(obj)]
    if isinstance(obj, int):
        return ["i", int.__repr__(int(int.__index__(obj)))]
    if isinstance(obj, float):
        return ["f", float.__repr__(float(obj))]
    if isinstance(obj, complex):
        c = complex(obj)
        return ["c", float.__repr__(c.real), float.__repr__(c.imag)]
    if isinstance(obj, str):
        return ["s", str.__str__(obj)]
    if isinstance(obj, (bytes, bytearray)):
        return ["y" if isinstance(obj, bytes) else "Y", bytes(obj).hex()]
    d = depth + 1
    if isinstance(obj, list):
        return ["l", [encode(x, ref_of, d) for x in list.__iter__(obj)]]
    if isinstance(obj, tuple):
        return ["t", [encode(x, ref_of, d) for x in tuple.__iter__(obj)]]
    if isinstance(obj, frozenset):
        return ["F", [encode(x, ref_of, d) for x in frozenset.__iter__(obj)]]
    if isinstance(obj, set):
        return ["S", [encode(x, ref_of, d) for x in set.__iter__(obj)]]
    if isinstance(obj, dict):
        return ["d", [[encode(k, ref_of, d), encode(dict.__getitem__(obj, k), ref_of, d)]
                      for k in list(dict.__iter__(obj))]]
    return ref_of(obj)


def decode(msg, remote, depth=0):
    """Inverse of ``encode`` that only ever builds builtin objects; ``remote(tag, ref)`` for the rest."""
    if depth > MAX_DEPTH:
        raise WireError("value nested too deeply")
    if not isinstance(msg, list) or not msg or not isinstance(msg[0], str):
        raise WireError("malformed value")
    tag, args, d = msg[0], msg[1:], depth + 1
    try:
        if tag == "n":
            return None
        if tag == "b":
            return args[0] is True
        if tag == "i":
            if not isinstance(args[0], str):
                raise WireError("malformed int")
            return int(args[0])
        if tag == "f":
            return float(str(args[0]))
        if tag == "c":
            return complex(float(str(args[0])), float(str(args[1])))
        if tag == "s":
            if not isinstance(args[0], str):
                raise WireError("malformed str")
            return str(args[0])
        if tag in ("y", "Y"):
            raw = bytes.fromhex(str(args[0]))
            return raw if tag == "y" else bytearray(raw)
        if tag in ("l", "t", "S", "F"):
            if not isinstance(args[0], list):
                raise WireError("malformed sequence")
            items = [decode(x, remote, d) for x in args[0]]
            return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](items)
        if tag == "d":
            if not isinstance(args[0], list):
                raise WireError("malformed dict")
            out = {}
            for pair in args[0]:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise WireError("malformed dict item")
                out[decode(pair[0], remote, d)] = decode(pair[1], remote, d)
            return out
        if tag in ("h", "r"):
            return remote(tag, args[0])
    except (IndexError, TypeError, ValueError) as e:
        if isinstance(e, WireError):
            raise
        raise WireError(f"malformed value: {e}") from None
    raise WireError(f"unknown value tag {tag!r}")


# ---------------------------------------------------------------- candidate
def candidate_main(sock_fd):
    """Run program.py (cwd) as __main__, report its global names, then serve the judge."""
    import types

    conn = socket.socket(fileno=sock_fd)
    os.set_inheritable(sock_fd, False)
    module = types.ModuleType("__main__")
    module.__file__ = os.path.abspath("program.py")
    module.__builtins__ = builtins
    sys.modules["__main__"] = module
    sys.argv = ["program.py"]
    sys.path.insert(0, os.getcwd())
    with open("program.py", encoding="utf-8") as f:
        source = f.read()
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    handles, ids = {}, {}

    def ref_of(obj):
        key = id(obj)
        if key not in ids:
            ids[key] = len(handles)
            handles[ids[key]] = obj
        return ["h", ids[key]]

    def resolve(tag, ref):
        if tag == "r" and isinstance(ref, dict) and "g" in ref:
            return module.__dict__[ref["g"]]
        if tag == "r" and isinstance(ref, dict) and "h" in ref:
            return handles[ref["h"]]
        raise ValueError("bad reference")

    def arg(x):
        return decode(x, resolve)

    def flush():
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except Exception:
                pass

    flush()
    send_msg(conn, {"ready": sorted(k for k in module.__dict__ if isinstance(k, str))})
    while True:
        try:
            req = recv_msg(conn, limit=1 << 62)
        except CandidateGone:
            flush()
            return
        try:
            op = req["op"]
            target = resolve("r", req["ref"]) if "ref" in req else None
            if op == "get":
                result = target
            elif op == "call":
                result = target(*[arg(a) for a in req["args"]], **{k: arg(v) for k, v in req["kwargs"].items()})
            elif op == "getattr":
                result = getattr(target, req["name"])
            elif op == "list":
                result = list(target)
            elif op == "len":
                result = len(target)
            elif op == "bool":
                result = bool(target)
            elif op == "getitem":
                result = target[arg(req["key"])]
            elif op == "contains":
                result = arg(req["item"]) in target
            elif op == "eq":
                result = bool(target == resolve("r", req["other"]))
            elif op in ("repr", "str"):
                result = repr(target) if op == "repr" else str(target)
            else:
                raise ValueError(f"unknown op {op!r}")
            reply = {"ok": encode(result, ref_of)}
        except BaseException as e:  # SystemExit / KeyboardInterrupt from the code too: it failed
            try:
                reply = {"exc": [type(e).__name__, str(e)[:2000]]}
            except BaseException:
                reply = {"exc": ["Exception", "unprintable exception"]}
        flush()
        send_msg(conn, reply)


# ---------------------------------------------------------------- judge
class RemoteError(Exception):
    """An exception raised in the candidate that has no builtin counterpart here."""


def judge_main(sock_fd, verdict_fd):
    import importlib
    import traceback

    cfg = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    _set_limits(cfg["limits"])
    conn = socket.socket(fileno=sock_fd)
    kind, detail = "failed", ""

    def rpc(op, ref, **fields):
        send_msg(conn, {"op": op, "ref": ref, **fields})
        reply = recv_msg(conn)
        if not isinstance(reply, dict):
            raise WireError("malformed reply")
        if "ok" in reply:
            return decode(reply["ok"], make_remote)
        exc = reply.get("exc")
        if not (isinstance(exc, list) and len(exc) == 2 and all(isinstance(x, str) for x in exc)):
            raise WireError("malformed reply")
        cls = _EXC.get(exc[0])
        raise (cls(exc[1]) if cls is not None else RemoteError(f"{exc[0]}: {exc[1]}"))

    def send_arg(x, depth=0):
        def ref_of(obj):
            if isinstance(obj, Remote):
                return ["r", object.__getattribute__(obj, "_ref")]
            raise TypeError(f"cannot pass a {type(obj).__name__} to the candidate")
        return encode(x, ref_of, depth)

    class Remote:
        """An object that lives in the candidate; every use is a request, every answer plain data."""
        __slots__ = ("_ref",)

        def __init__(self, ref):
            object.__setattr__(self, "_ref", ref)

        def _rpc(self, op, **fields):
            return rpc(op, object.__getattribute__(self, "_ref"), **fields)

        def __call__(self, *args, **kwargs):
            return self._rpc("call", args=[send_arg(a) for a in args],
                             kwargs={str(k): send_arg(v) for k, v in kwargs.items()})

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return self._rpc("getattr", name=name)

        def __iter__(self):
            items = self._rpc("list")
            if type(items) is not list:
                raise WireError("list() of a remote object must be a list")
            return iter(items)

        def __len__(self):
            n = self._rpc("len")
            if type(n) is not int:
                raise WireError("len() of a remote object must be an int")
            return n

        def __bool__(self):
            b = self._rpc("bool")
            if type(b) is not bool:
                raise WireError("bool() of a remote object must be a bool")
            return b

        def __getitem__(self, key):
            return self._rpc("getitem", key=send_arg(key))

        def __contains__(self, item):
            return self._rpc("contains", item=send_arg(item)) is True

        def __eq__(self, other):
            # Two candidate objects compare by the candidate's rules (both sides are its own);
            # a candidate object never equals a value the tests built.
            if isinstance(other, Remote):
                return self._rpc("eq", other=object.__getattribute__(other, "_ref")) is True
            return NotImplemented

        def __ne__(self, other):
            eq = self.__eq__(other)
            return eq if eq is NotImplemented else not eq

        __hash__ = object.__hash__

        def __repr__(self):
            r = self._rpc("repr")
            return r if type(r) is str else "<remote object>"

        def __str__(self):
            s = self._rpc("str")
            return s if type(s) is str else "<remote object>"

    def make_remote(tag, ref):
        if tag != "h" or type(ref) is not int:
            raise WireError("malformed handle")
        return Remote({"h": ref})

    def names_in(code, out):
        out.update(code.co_names)
        for c in code.co_consts:
            if hasattr(c, "co_names"):
                names_in(c, out)
        return out

    try:
        ready = recv_msg(conn)
        if not isinstance(ready, dict) or not isinstance(ready.get("ready"), list):
            raise WireError("malformed ready message")
        defined = {n for n in ready["ready"] if isinstance(n, str)}
        g = {"__name__": "__main__", "__builtins__": builtins}
        exec(compile(cfg["prelude"], "<prelude>", "exec"), g)
        tests = compile(cfg["tests"], "<tests>", "exec")
        forced = set(cfg["remote"])
        for name in sorted(names_in(tests, set()) | forced):
            if name in forced:
                g[name] = Remote({"g": name})
            elif name in g or hasattr(builtins, name) or name not in defined:
                continue
            elif name in getattr(sys, "stdlib_module_names", ()):
                # The candidate imported a standard module the tests use unqualified:
                # the tests get their own copy, not the candidate's (possibly patched) one.
                g[name] = importlib.import_module(name)
            else:
                g[name] = rpc("get", {"g": name})
        exec(tests, g)
        kind = "passed"
    except CandidateGone:
        kind, detail = "candidate_gone", "the program exited or closed its channel before the tests finished"
    except WireError as e:
        kind, detail = "protocol", f"the program broke the result protocol: {e}"
    except BaseException as e:  # the tests failed (AssertionError, a remote exception, ...)
        where = [f for f in traceback.extract_tb(e.__traceback__) if f.filename in ("<tests>", "<prelude>")]
        line = ""
        if where:
            src = cfg["tests"] if where[-1].filename == "<tests>" else cfg["prelude"]
            lines = src.splitlines()
            n = where[-1].lineno or 0
            line = f" at {where[-1].filename[1:-1]} line {n}: {lines[n - 1].strip() if 0 < n <= len(lines) else ''}"
        try:
            msg = str(e)[:500]
        except BaseException:
            msg = ""
        detail = f"{type(e).__name__}{': ' + msg if msg else ''}{line}"
    out = json.dumps({"nonce": cfg["nonce"], "kind": kind, "detail": detail}).encode("utf-8")
    os.write(verdict_fd, out)
    os.close(verdict_fd)
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


# ---------------------------------------------------------------- limits and namespaces
def _set_limits(lim):
    import resource

    for res, val in ((resource.RLIMIT_CPU, (lim["cpu"], lim["cpu"] + 1)), (resource.RLIMIT_AS, (lim["mem"],) * 2),
                     (resource.RLIMIT_NPROC, (lim["nproc"],) * 2), (resource.RLIMIT_FSIZE, (lim["fsize"],) * 2),
                     (resource.RLIMIT_NOFILE, (lim["nofile"],) * 2), (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(res, val)


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _check(rc, what):
    import ctypes

    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _prctl(libc, option, arg):
    _check(libc.prctl(option, arg, 0, 0, 0), "prctl")


PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = (
    0x00020000, 0x04000000, 0x08000000, 0x20000000, 0x40000000)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)


def _mount(libc, src, target, fstype, flags, data):
    enc = (lambda s: None if s is None else s.encode())
    _check(libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _drop_privileges(libc, uid):
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    _prctl(libc, PR_SET_NO_NEW_PRIVS, 1)


def _scrub_env():
    os.environ.clear()
    os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp",
                       "LANG": "C.UTF-8"})


def _build_root(libc, root, scratch_mb, binds):
    """A tmpfs root holding read-only binds of the system dirs, a private /proc and
    world-writable /tmp and /dev/shm inside the same size-capped tmpfs."""
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE, None)
    _mount(libc, "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={scratch_mb}m,mode=755")
    for path in binds:
        if not os.path.lexists(path):
            continue
        dst = root + path
        if os.path.islink(path):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if not os.path.lexists(dst):
                os.symlink(os.readlink(path), dst)
            continue
        if os.path.lexists(dst):
            continue  # already inside an earlier bind
        os.makedirs(dst, exist_ok=True)
        _mount(libc, path, dst, None, MS_BIND | MS_REC, None)
        _mount(libc, None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
    os.makedirs(root + "/proc")
    _mount(libc, "proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    os.makedirs(root + "/dev/shm")
    for name in ("null", "zero", "urandom", "random"):
        open(f"{root}/dev/{name}", "w").close()
        _mount(libc, f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND, None)
    os.makedirs(root + "/tmp")
    for d in ("/tmp", "/dev/shm"):
        os.chmod(root + d, 0o1777)
    os.chroot(root)
    os.chdir("/tmp")


def stage_main(status_fd, sock_fd):
    """Root: cgroups, namespaces, init, then the candidate (see the module doc)."""
    import signal

    cfg = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    libc = _libc()

    def status(line):
        try:
            os.write(status_fd, (line + "\n").encode())
        except OSError:
            pass

    try:
        _prctl(libc, PR_SET_PDEATHSIG, signal.SIGKILL)  # the harness died: take everything down
        if os.getppid() != cfg["parent"]:
            os._exit(70)
        for procs in cfg["cgroups"]:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        _check(libc.unshare(CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWPID | CLONE_NEWNET), "unshare")
    except OSError as e:
        status(f"setup {e}")
        os._exit(71)
    binds = ["/usr", "/bin", "/lib", "/lib32", "/lib64", "/libx32", "/sbin", "/etc", sys.base_prefix,
             os.path.dirname(os.path.realpath(sys.executable))]
    init = os.fork()
    if init == 0:
        try:
            _prctl(libc, PR_SET_PDEATHSIG, signal.SIGKILL)
            _build_root(libc, "/tmp", cfg["scratch_mb"], binds)
            with open("/tmp/program.py", "w", encoding="utf-8") as f:
                f.write(cfg["program"])
            os.chown("/tmp/program.py", cfg["uid"], cfg["uid"])
        except Exception as e:
            status(f"setup {type(e).__name__}: {e}")
            os._exit(71)
        child = os.fork()
        if child == 0:
            try:
                os.close(status_fd)
                _drop_privileges(libc, cfg["uid"])
                _scrub_env()
                _set_limits(cfg["limits"])
            except Exception as e:
                print(f"sandbox setup failed: {e}", file=sys.stderr)
                os._exit(71)
            try:
                candidate_main(sock_fd)
            except SystemExit:
                raise
            except BaseException:
                import traceback

                traceback.print_exc()
                sys.stderr.flush()
                os._exit(1)
            os._exit(0)
        os.close(sock_fd)
        while True:  # init: reap everything; when the program's main process ends, end the namespace
            try:
                pid, st = os.wait()
            except ChildProcessError:
                os._exit(0)
            if pid == child:
                status(f"signal {os.WTERMSIG(st)}" if os.WIFSIGNALED(st) else f"exit {os.WEXITSTATUS(st)}")
                os._exit(0)
    os.close(sock_fd)
    status(f"init {init}")
    os.waitpid(init, 0)
    os._exit(0)


def main():
    role = sys.argv[1]
    if role == "candidate":
        _prctl(_libc(), PR_SET_NO_NEW_PRIVS, 1)
        _set_limits(json.loads(sys.argv[3]))
        candidate_main(int(sys.argv[2]))
    elif role == "judge":
        judge_main(int(sys.argv[2]), int(sys.argv[3]))
    elif role == "stage":
        stage_main(int(sys.argv[2]), int(sys.argv[3]))
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main()
