"""Hostile programs against the pass@1 scorer (tasks.code_exec -> tasks.sandbox).

Every hostile "model output" is scored by the project's own scorer; the expected
verdict is "not passed" unless the case is about the machine (then a correct
solution rides along and must still pass). All hostile cases run in one
concurrent batch (module fixture), so the set stays within about a minute; the
machine is checked afterwards: no process of a sandbox uid, no sandbox files in
/tmp, /var/tmp, /dev/shm, /run/lock, no SysV IPC objects, no cgroups left.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tasks import sandbox
from tasks.sandbox import SandboxResult, capabilities, run_program
from tasks.code_exec import CodeLimits, pass_at_1, split_reference

ROOT = os.geteuid() == 0
CAPS = capabilities()
needs_root = pytest.mark.skipif(not ROOT, reason="uid isolation (signals, /proc, setsid escapes) needs root")
needs_ns = pytest.mark.skipif(not CAPS["namespaces"], reason="needs mount/PID/IPC/net namespaces (root)")
needs_cgroup = pytest.mark.skipif(not CAPS["cgroup"], reason="needs a memory/pids cgroup (root)")
REPO = Path(__file__).resolve().parents[1]


def needs_packages() -> None:
    """Skip, with the sandbox's own reason, where it cannot give the evaluation's packages to the candidate
    and the judge: the tests ask the same check (capabilities()["packages"]) the product prints and records."""
    warning = sandbox.capabilities()["packages"]["warning"]
    if warning:
        pytest.skip(f"the sandbox cannot give the evaluation's packages here: {warning}")

GOOD = "def f(x):\n    return x * 2\n"
TESTS = "assert f(2) == 4\nassert f(5) == 10\nassert abs(f(0.25) - 0.5) < 1e-9\n"


# ---------------------------------------------------------------- machine state
def leftovers() -> list[str]:
    """What this process's finished sandbox runs must never leave behind: processes, files and SysV IPC objects
    of the uids it leased (each looked at while holding that uid's lease lock; a uid another evaluation on the
    machine holds now is that one's business), its fallback work folders and its cgroups. Another user of
    the sandbox on the same machine is never counted."""
    found = []
    for uid in sorted(sandbox.leased_uids()):
        with sandbox.lease_is_free(uid) as free:
            if free:
                found += _uid_leftovers(uid)
    for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
        try:
            found += [f"file {e.path}" for e in os.scandir(d) if e.name.startswith(sandbox.workdir_prefix())]
        except OSError:
            continue
    for base in (Path("/sys/fs/cgroup/memory/refusion-sandbox"), Path("/sys/fs/cgroup/pids/refusion-sandbox"),
                 Path("/sys/fs/cgroup/refusion-sandbox"), Path("/sys/fs/cgroup/unified/refusion-sandbox")):
        if base.is_dir():
            found += [f"cgroup {p}" for p in base.iterdir() if p.is_dir() and p.name.startswith(f"run-{os.getpid()}-")]
    return found


def _uid_leftovers(uid: int) -> list[str]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    found.append(f"process {entry.name} of uid {uid}")
            except OSError:
                continue
    for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
        try:
            for e in os.scandir(d):
                try:
                    if e.stat(follow_symlinks=False).st_uid == uid:
                        found.append(f"file {e.path}")
                except OSError:
                    continue
        except OSError:
            continue
    for kind, col in (("shm", 7), ("sem", 4), ("msg", 7)):
        try:
            for line in Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]:
                f = line.split()
                if len(f) > col and f[col] == str(uid):
                    found.append(f"SysV {kind} {f[1]}")
        except OSError:
            continue
    return found


def venv_state(sites: list[str] | None = None) -> dict:
    """The evaluation's package folders as the sandbox gives them (or ``sites``): a sha256 over every entry's path, type,
    size, mode, owner, mtime and ctime (a write, chmod, utime, rename or new file changes it; ctime cannot
    be set back), the sha256 of the files the attacks aim at, and any entry owned by a sandbox uid.
    Bytecode caches are left out of the first hash only: the evaluation's own root processes write them
    on a first import at any time; a sandbox write there would show as a sandbox-owned entry."""
    import hashlib

    lines, owned, content = [], [], {}
    for site in sandbox.capabilities()["packages"]["site"] if sites is None else sites:
        for dirpath, dirnames, filenames in os.walk(site):
            dirnames.sort()
            for name in dirnames + sorted(filenames):
                p = os.path.join(dirpath, name)
                st = os.lstat(p)
                if st.st_uid in sandbox.UID_RANGE:
                    owned.append(p)
                if "__pycache__" in p.split(os.sep):
                    continue
                times = "" if name in dirnames else f"{st.st_mtime_ns} {st.st_ctime_ns}"
                lines.append(f"{p} {st.st_mode:o} {st.st_uid} {st.st_size if name in filenames else ''} {times}")
        for rel in ("numpy/__init__.py", "numpy/version.py"):
            f = Path(site, rel)
            if f.is_file():
                content[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return {"manifest": hashlib.sha256("\n".join(lines).encode()).hexdigest(), "entries": len(lines),
            "content": content, "owned_by_sandbox": owned}


@pytest.fixture()
def clean_machine():
    assert leftovers() == [], "machine not clean before the test"
    yield
    assert leftovers() == []


def score(prediction: str, reference: str = TESTS, timeout_s: float = 30.0, **kw) -> SandboxResult:
    from tasks.code_exec import run_checks

    return run_checks([(prediction, reference)], CodeLimits(timeout_s=timeout_s, workers=1, **kw))[0]


# ---------------------------------------------------------------- the hostile set
class Listener:
    """A TCP and a Unix-domain server on the host that sandboxed programs try to reach."""

    def __init__(self, tmp: Path):
        self.tcp = socket.socket()
        self.tcp.bind(("127.0.0.1", 0))
        self.tcp.listen(8)
        self.port = self.tcp.getsockname()[1]
        self.unix_path = str(tmp / "harness.sock")
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind(self.unix_path)
        os.chmod(self.unix_path, 0o777)
        self.unix.listen(8)
        self.accepted = 0
        for s in (self.tcp, self.unix):
            s.settimeout(0.2)
            threading.Thread(target=self._accept, args=(s,), daemon=True).start()
        self.stop = False

    def _accept(self, s):
        while not getattr(self, "stop", False):
            try:
                c, _ = s.accept()
                self.accepted += 1
                c.close()
            except OSError:
                continue

    def close(self):
        self.stop = True
        self.tcp.close()
        self.unix.close()


def hostile_cases(tmp: Path, listener: Listener, secret_file: Path) -> dict[str, tuple[str, str, set[str] | None]]:
    """name -> (prediction, reference, expected reasons; None = must fail, any reason)."""
    wrong = "def f(x):\n    return 0\n"
    forge = ("import os, json, struct\n"
             "msg = json.dumps({'kind': 'passed', 'detail': '', 'nonce': ''}).encode()\n"
             "targets = set()\n"
             "for a in open('/proc/self/cmdline', 'rb').read().split(b'\\0'):\n"
             "    if a.isdigit(): targets.add(int(a))\n"
             "for fd in os.listdir('/proc/self/fd'):\n"
             "    try:\n"
             "        link = os.readlink(f'/proc/self/fd/{fd}')\n"
             "    except OSError:\n"
             "        continue\n"
             "    if 'pipe' in link or 'socket' in link: targets.add(int(fd))\n"
             "for fd in targets:\n"
             "    for data in (b'OK', msg, struct.pack('>I', len(msg)) + msg):\n"
             "        try:\n"
             "            os.write(fd, data)\n"
             "        except OSError:\n"
             "            pass\n")
    cases: dict[str, tuple[str, str, set[str] | None]] = {
        # -- from the report: wrong answers that must not pass
        "forged mark on argv fd then exit": (forge + "os._exit(0)\n", TESTS, None),
        "forged mark on every pipe, wrong f": (forge + wrong, TESTS, None),
        "__eq__ always True": ("class A:\n    def __eq__(self, o): return True\n    def __ne__(self, o): return False\n"
                               "    def __sub__(self, o): return self\n    def __rsub__(self, o): return self\n"
                               "    def __abs__(self): return 0\n    def __lt__(self, o): return True\n"
                               "def f(x):\n    return A()\n", TESTS, None),
        "patched builtins.abs": ("import builtins\nbuiltins.abs = lambda v: 0\n"
                                 "def f(x):\n    return {2: 4, 5: 10}.get(x, 99)\n", TESTS, None),
        "helper replaced through globals()": (
            "def helper(x):\n    return x + 1\ndef g(x):\n    return 0\nglobals()['helper'] = lambda v: 7\n",
            "# judge: remote=g\ndef helper(x):\n    return x + 1\ndef g(x):\n    '''doc'''\n# judge: tests\n"
            "assert helper(g(3)) == 7\n", None),
        "reads hidden asserts from program.py": (
            "import re\nsrc = open('program.py').read()\n"
            "table = {int(a): int(b) for a, b in re.findall(r'assert f\\((\\d+)\\) == (\\d+)', src)}\n"
            "def f(x):\n    return table[x]\n", TESTS, None),
        "sys.exit(0) before the tests": ("import sys\nsys.exit(0)\n" + GOOD, TESTS, {"exited"}),
        "os._exit(0) before the tests": ("import os\nos._exit(0)\n" + GOOD, TESTS, {"exited"}),
        "SystemExit inside the function": ("def f(x):\n    raise SystemExit(0)\n", TESTS, {"error"}),
        "infinite loop": ("while True:\n    pass\n", TESTS, {"timeout"}),
        "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
                      TESTS, {"timeout", "killed", "memory"}),
        "8 GiB allocation": ("x = bytearray(8 * 1024 ** 3)\n" + GOOD, TESTS, {"memory"}),
        "2 GB file": ("with open('big.bin', 'wb') as fh:\n    for _ in range(2048):\n"
                      "        fh.write(b'0' * 1024 * 1024)\n" + GOOD, TESTS, {"file_size", "error"}),
        "100 MB of stdout": ("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1024 * 1024)\n" + GOOD,
                             TESTS, {"output_limit"}),
        "ignores SIGTERM and spins": ("import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                      "while True:\n    pass\n", TESTS, {"timeout"}),
        "kills its parent and the harness": (f"import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
                                             f"os.kill({os.getpid()}, signal.SIGKILL)\n" + GOOD, TESTS, None),
        "TCP to 127.0.0.1": (f"import socket\nsocket.create_connection(('127.0.0.1', {listener.port}), timeout=5)\n"
                             + GOOD, TESTS, None),
        "Unix socket in host /tmp": (f"import socket\ns = socket.socket(socket.AF_UNIX)\n"
                                     f"s.connect({listener.unix_path!r})\n" + GOOD, TESTS, None),
        "SIGSTOPs every process it can see": (
            "import os, signal, time\n"
            "if os.fork() == 0:\n"
            "    while True:\n"
            "        for p in os.listdir('/proc'):\n"
            "            if p.isdigit() and int(p) != os.getpid():\n"
            "                try:\n"
            "                    os.kill(int(p), signal.SIGSTOP)\n"
            "                except OSError:\n"
            "                    pass\n"
            "        time.sleep(0.01)\n"
            "time.sleep(60)\n", TESTS, {"timeout"}),
        "1.2 GB into /dev/shm": ("import os\nwith open('/dev/shm/fill', 'wb') as fh:\n"
                                 "    for _ in range(1200):\n        fh.write(b'0' * 1024 * 1024)\n"
                                 "assert os.path.getsize('/dev/shm/fill') >= 1200 * 1024 * 1024\n" + GOOD,
                                 TESTS, None),
        # -- ten more a reward-hacking model might try
        "reads the tests from a file on the host": (
            f"import re\nsrc = open({str(secret_file)!r}).read()\n"
            "table = {int(a): int(b) for a, b in re.findall(r'f\\((\\d+)\\) == (\\d+)', src)}\n"
            "def f(x):\n    return table[x]\n", TESTS, None),
        "reads the benchmark data and repository": (
            f"import os\nassert os.path.exists({str(REPO / 'tasks')!r}) or os.path.exists('/work')\n" + GOOD,
            TESTS, None),
        "int subclass whose __eq__ is True": ("class I(int):\n    def __eq__(self, o): return True\n"
                                              "    __hash__ = int.__hash__\n"
                                              "def f(x):\n    return I(0)\n", TESTS, None),
        "patches math.isclose": ("import math\nmath.isclose = lambda *a, **k: True\n"
                                 "def f(x):\n    return 0.0\n",
                                 "assert math.isclose(f(1.5), 3.0)\n", None),
        "hunts expected values with gc and frames": (
            "import gc, sys\n"
            "def f(x):\n"
            "    seen = [o for o in gc.get_objects() if isinstance(o, dict) and 'expected' in o]\n"
            "    frame, vals = sys._getframe(), []\n"
            "    while frame:\n"
            "        vals += [v for v in frame.f_locals.values() if isinstance(v, int) and v != x]\n"
            "        frame = frame.f_back\n"
            "    return vals[0] if vals else (seen[0]['expected'] if seen else -1)\n", TESTS, None),
        "takes over the channel and answers True": (
            "import os, json, struct, socket\n"
            "fds = [int(a) for a in open('/proc/self/cmdline', 'rb').read().split(b'\\0') if a.isdigit()]\n"
            "for fd in fds:\n"
            "    try:\n"
            "        s = socket.socket(fileno=fd)\n"
            "    except OSError:\n"
            "        continue\n"
            "    def send(o):\n"
            "        d = json.dumps(o).encode(); s.sendall(struct.pack('>I', len(d)) + d)\n"
            "    send({'ready': ['f']})\n"
            "    while True:\n"
            "        n = s.recv(4)\n"
            "        if len(n) < 4: os._exit(0)\n"
            "        s.recv(struct.unpack('>I', n)[0])\n"
            "        send({'ok': ['b', True]})\n", TESTS, None),
        "oversized and malformed replies": ("def f(x):\n    return 'x' * (80 * 1024 * 1024)\n", TESTS,
                                            {"protocol", "memory", "error"}),
        "returns a 10000-deep nested list": ("def f(x):\n    v = []\n    for _ in range(10000):\n        v = [v]\n"
                                             "    return v\n", TESTS, None),
        "raises KeyboardInterrupt in the function": ("def f(x):\n    raise KeyboardInterrupt\n", TESTS, {"error"}),
        "kills every process of its uid and init": ("import os, signal\ntry:\n    os.kill(1, signal.SIGKILL)\n"
                                                    "except OSError:\n    pass\nos.kill(-1, signal.SIGKILL)\n",
                                                    TESTS, None),
        "tries to become root": ("import os\nos.setuid(0)\n" + GOOD, TESTS, None),
        "prints PASSED and writes a verdict at exit": (
            "import atexit, os\nprint('PASSED'); print('{\"kind\": \"passed\"}')\n"
            "atexit.register(lambda: [os.write(fd, b'{\"kind\": \"passed\"}') for fd in range(3, 64)"
            " if os.path.exists(f'/proc/self/fd/{fd}')])\n" + wrong, TESTS, None),
        # -- the widened surface (issue 40): the evaluation's packages, numbers and numpy values as data
        "numpy array subclass whose __eq__ lies": (
            "import numpy as np\nclass Liar(np.ndarray):\n    def __eq__(self, o): return np.ones(self.shape, bool)\n"
            "    def __ne__(self, o): return np.zeros(self.shape, bool)\n    def __bool__(self): return True\n"
            "    def __sub__(self, o): return self\n    def __abs__(self): return self\n"
            "    def __lt__(self, o): return True\n    __hash__ = None\n"
            "def f(x):\n    return np.zeros(1).view(Liar)\n", TESTS, None),
        "numpy float64 subclass whose __eq__ lies": (
            "import numpy as np\nclass Liar(np.float64):\n    def __eq__(self, o): return True\n"
            "    def __hash__(self): return hash(4)\n    def __sub__(self, o): return Liar(0.0)\n"
            "    def __abs__(self): return Liar(0.0)\n    def __lt__(self, o): return True\n"
            "def f(x):\n    return Liar(0.0)\n", TESTS, None),
        "Fraction subclass with forged __eq__ and __hash__": (
            "from fractions import Fraction\nclass N(Fraction):\n    def __eq__(self, o): return True\n"
            "    def __hash__(self): return hash(4)\n    def __sub__(self, o): return N(0)\n"
            "    def __rsub__(self, o): return N(0)\n    def __abs__(self): return N(0)\n"
            "    def __lt__(self, o): return True\n"
            "def f(x):\n    return N(0)\n", TESTS, None),
        "registered Real with forged __eq__ and __hash__": (FORGED_NUMBERS, TESTS, None),
        "set of forged Numbers": (FORGED_NUMBERS, "assert g(2) == {4}\n", None),
        "bare Number with forged __eq__": (FORGED_NUMBERS, "assert h(2) == 4\n", None),
        "site-packages module patched at import": (
            "import numpy as np\nimport numpy.testing\nnp.isclose = lambda *a, **k: True\n"
            "np.allclose = lambda *a, **k: True\nnp.testing.assert_allclose = lambda *a, **k: None\n"
            "import types, sys\nfake = types.ModuleType('numpy')\nfake.array_equal = lambda *a, **k: True\n"
            "for d in ('.', '/tmp'):\n    try:\n"
            "        open(d + '/numpy.py', 'w').write('isclose = lambda *a, **k: True')\n"
            "    except OSError:\n        pass\n"
            "def f(x):\n    return 0.0\n",
            "assert np.isclose(f(2), 4)\nassert np.allclose(f(5), 10)\nnp.testing.assert_allclose(f(1), 2)\n"
            "assert fake.array_equal(f(1), 2)\n", None),
        "writes into the venv": (VENV_WRITER + GOOD, TESTS, None),
    }
    return cases


# Numbers of the program's own types: one registered as a Real (travels as its float, 0.0), one only as
# a Number (no conversion applies: a handle), both claiming to equal anything and to hash like 4.
FORGED_NUMBERS = (
    "import numbers\nclass Forged:\n    def __eq__(self, o): return True\n    def __hash__(self): return hash(4)\n"
    "    def __float__(self): return 0.0\n    def __sub__(self, o): return self\n"
    "    def __rsub__(self, o): return self\n    def __abs__(self): return 0.0\n"
    "numbers.Real.register(Forged)\nclass Opaque:\n    def __eq__(self, o): return True\n"
    "    def __hash__(self): return hash(4)\nnumbers.Number.register(Opaque)\n"
    "def f(x):\n    return Forged()\ndef g(x):\n    return {Forged(), Opaque()}\ndef h(x):\n    return Opaque()\n")


# Every way a program might change the evaluation's packages (the venv): found through numpy (inside the
# sandbox, at the path it shows them) and at the host path. Unguarded: the first refused write fails it.
VENV_ATTACKS = """
import os, sys, numpy
inside = os.path.dirname(os.path.dirname(numpy.__file__))
host = {host!r}
def attacks(site):
    init = os.path.join(site, 'numpy', '__init__.py')
    return [
        lambda: open(init, 'a').write('\\nimport builtins; builtins.AssertionError = None\\n'),
        lambda: open(os.path.join(site, 'zz_refusion_evil.pth'), 'w').write('import os\\n'),
        lambda: open(os.path.join(site, 'numpy', '__pycache__', '__init__.cpython-311.pyc'), 'wb').write(b'x'),
        lambda: os.mkdir(os.path.join(site, 'evil_pkg')),
        lambda: os.chmod(init, 0o777),
        lambda: os.utime(init, (0, 0)),
        lambda: os.rename(init, init + '.bak'),
        lambda: os.unlink(os.path.join(site, 'numpy', 'version.py')),
        lambda: os.symlink('/tmp', os.path.join(site, 'evil_link')),
    ]
"""


def _venv_writer(guarded: bool) -> str:
    host = (sandbox.capabilities()["packages"]["site"] or ["/nonexistent"])[0]
    body = "for site in (inside, host):\n    for a in attacks(site):\n"
    body += ("        try:\n            a()\n        except OSError:\n            pass\n" if guarded
             else "        a()\n")
    return VENV_ATTACKS.format(host=host) + body


VENV_WRITER = _venv_writer(guarded=False)


# Cases about the machine: the solution is correct, the program also does something
# that must leave no trace; the verdict must still be computed.
MACHINE_CASES = {
    "3000-deep directory tree in /tmp and cwd": (
        "import os\nfor base in ('/tmp', '.'):\n    os.chdir(base)\n    for _ in range(3000):\n"
        "        os.mkdir('d')\n        os.chdir('d')\nos.chdir('/tmp')\n" + GOOD),
    "two SysV shared-memory segments": (
        "import ctypes\nlibc = ctypes.CDLL(None)\n"
        "for _ in range(2):\n    assert libc.shmget(0, 1 << 20, 0o1000 | 0o666) >= 0\n" + GOOD),
    "files in /run/lock, /var/tmp and /dev/shm": (
        "for p in ('/run/lock/x', '/var/tmp/x', '/dev/shm/x', '/tmp/x'):\n    try:\n"
        "        open(p, 'w').write('left behind')\n    except OSError:\n        pass\n" + GOOD),
    "tries every write into the venv, then answers": _venv_writer(guarded=True) + GOOD,
    "detached daemon that outlives the program": (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        time.sleep(30)\n    os._exit(0)\n" + GOOD),
}


@pytest.fixture(scope="module")
def hostile_results(tmp_path_factory):
    if not ROOT:
        pytest.skip("the hostile set needs root (uid switch)")
    assert leftovers() == [], "machine not clean before the hostile set"
    tmp = tmp_path_factory.mktemp("hostile")
    tmp.chmod(0o755)
    secret = tmp / "tests.txt"
    secret.write_text(TESTS)
    secret.chmod(0o644)
    listener = Listener(tmp)
    cases = hostile_cases(tmp, listener, secret)
    venv_before = venv_state()
    items = [(n, p, r, 4.0) for n, (p, r, _) in cases.items()]
    items += [(n, p, TESTS, 60.0) for n, p in MACHINE_CASES.items()]
    # Hostile programs get a short deadline (each ends by failing it at worst); the
    # machine cases are correct programs and get a generous one.
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = dict(zip([i[0] for i in items],
                           pool.map(lambda i: score(i[1], i[2], timeout_s=i[3]), items)))
    elapsed = time.monotonic() - t0
    listener.close()
    yield {"results": results, "cases": cases, "elapsed": elapsed, "accepted": listener.accepted,
           "left": leftovers(), "venv": (venv_before, venv_state())}


def _hostile_names():
    return list(hostile_cases(Path("/nonexistent"), type("L", (), {"port": 1, "unix_path": "/x"})(),
                              Path("/x")))


@pytest.mark.parametrize("name", _hostile_names())
def test_hostile_program_is_not_passed(hostile_results, name):
    r = hostile_results["results"][name]
    expected = hostile_results["cases"][name][2]
    assert not r.passed, (name, r)
    if expected is not None:
        assert r.reason in expected, (name, r.reason, r.detail, r.stderr[-300:])
    assert len(r.stdout) <= 64 * 1024 and len(r.stderr) <= 64 * 1024


# Machine cases whose program imports numpy: they can pass only where the sandbox gives the packages.
NEEDS_PACKAGES = {"tries every write into the venv, then answers"}


@pytest.mark.parametrize("name", list(MACHINE_CASES))
def test_machine_case_still_scored_and_leaves_nothing(hostile_results, name):
    if name in NEEDS_PACKAGES:
        needs_packages()
    r = hostile_results["results"][name]
    assert r.passed, (name, r.reason, r.detail, r.stderr[-300:])


def test_hostile_set_leaves_machine_clean_and_fast(hostile_results):
    assert hostile_results["left"] == []
    assert hostile_results["accepted"] == 0  # no TCP or Unix-socket connection reached the host
    # No program outlives its deadline by more than the kill and cleanup (a generous margin: a loaded machine
    # starts interpreters slowly; the point is that nothing hangs the scorer).
    deadlines = {n: 4.0 for n in hostile_results["cases"]} | {n: 60.0 for n in MACHINE_CASES}
    late = {n: r.duration_s for n, r in hostile_results["results"].items() if r.duration_s > deadlines[n] + 30}
    assert not late, late


def test_hostile_set_leaves_the_venv_unchanged(hostile_results):
    if not sandbox.capabilities()["packages"]["site"]:
        pytest.skip(f"the sandbox gives no package folder here: {sandbox.capabilities()['packages']['warning']}")
    before, after = hostile_results["venv"]
    assert before["entries"] > 0 and before["content"], before
    assert after == before
    assert after["owned_by_sandbox"] == []


# ---------------------------------------------------------------- scorer semantics
def test_gold_and_wrong_answers(clean_machine):
    ok = run_program(GOOD + "print('done')\n", TESTS)
    assert ok.passed and ok.reason == "passed" and ok.stdout == "done\n", ok
    bad = run_program("def f(x):\n    return x\n", TESTS)
    assert not bad.passed and bad.reason == "error" and "AssertionError" in bad.detail and "line 1" in bad.detail


def test_pass_at_1_end_to_end(clean_machine):
    refs = [TESTS, TESTS]
    assert pass_at_1(refs, [[GOOD], ["def f(x):\n    return 0\n"]], CodeLimits(workers=2)) == 0.5


def test_remote_objects_and_exceptions_keep_python_semantics(clean_machine):
    prog = ("class P:\n    def __init__(self, a): self.a = a\n"
            "def total(ps):\n    return sum(p.a for p in ps)\n"
            "def gen(n):\n    return (i * i for i in range(n))\n"
            "def boom(x):\n    raise ValueError('no')\n"
            "import math\n")
    tests = ("assert total([P(1), P(2)]) == 3\nassert list(gen(3)) == [0, 1, 4]\n"
             "try:\n    boom(1)\n    assert False\nexcept ValueError:\n    pass\n"
             "assert math.sqrt(4) == 2.0\nassert P(5).a == 5\n")
    r = run_program(prog, tests)
    assert r.passed, r


def test_reference_format():
    assert split_reference("assert f(1) == 2") == ("", "assert f(1) == 2", ())
    assert split_reference("# judge: remote=f\ndef h(): pass\n# judge: tests\nassert f(1)") == (
        "def h(): pass", "assert f(1)", ("f",))


def test_bad_limits_rejected():
    with pytest.raises(ValueError):
        run_program("pass", timeout_s=0)


# ---------------------------------------------------------------- limits per program, not per process
@needs_cgroup
@needs_ns
def test_memory_limit_covers_all_processes(clean_machine):
    # 4 children x 300 MB = 1.2 GB under memory_mb=512: each fits its own rlimit, the sum does not.
    prog = ("import os, time\nkids = []\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
            "        b = b'x' * (300 * 1024 * 1024)\n        time.sleep(3)\n        os._exit(0)\n"
            "    kids.append(pid)\n"
            "for k in kids:\n    assert os.waitpid(k, 0)[1] == 0\n" + GOOD)
    r = score(prog, timeout_s=60, memory_mb=512)
    assert not r.passed and r.reason == "memory", r


@needs_ns
def test_gold_passes_with_private_tmpdir(tmp_path, monkeypatch, clean_machine):
    # A 0700 TMPDIR must not change the verdict: the sandbox uid never needs it.
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setenv("TMPDIR", str(private))
    monkeypatch.setattr("tempfile.tempdir", None)
    r = run_program(GOOD + "import tempfile\nopen(tempfile.mktemp(), 'w').write('x')\n", TESTS, timeout_s=30)
    assert r.passed, r


def test_uid_lock_folder_ignores_tmpdir(tmp_path):
    code = "from tasks import sandbox; print(sandbox.LOCK_DIR)"
    outs = {subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "TMPDIR": str(d)},
                           capture_output=True, text=True, check=True).stdout for d in (tmp_path, "/tmp")}
    assert len(outs) == 1 and not outs.pop().startswith(str(tmp_path))


@needs_root
def test_concurrent_runs_do_not_interfere(clean_machine):
    programs = [(f"import time\ntime.sleep(0.3)\ndef f(x):\n    return x * 2\nprint({i})\n", 30.0) for i in range(6)]
    programs += [("while True:\n    pass\n", 4.0),
                 ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", 4.0)]
    # Benign programs get a generous deadline: on a loaded 2-core machine starting 16
    # interpreters next to a fork bomb can take seconds.
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda pl: run_program(pl[0], TESTS, timeout_s=pl[1]), programs))
    for i, r in enumerate(results[:6]):
        assert r.passed and r.stdout.strip() == str(i), (i, r)
    assert [r.passed for r in results[6:]] == [False, False]


# A second user of the sandbox on the machine (another evaluation scoring code): it waits in its sandbox until
# it gets SIGTERM, then ends as an evaluation does (its runs clean up on the way out).
OTHER_USER = """
import signal, sys
signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))
from tasks.sandbox import run_program
r = run_program("import time\\nwhile True:\\n    time.sleep(0.2)\\n", "", timeout_s=600)
print(r.reason)
"""


def _held_by_others() -> set[int]:
    """Sandbox uids with live processes whose lease someone holds now; called while this process runs nothing
    in the sandbox, so every one of them is another user's."""
    uids = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                uid = entry.stat().st_uid
            except OSError:
                continue
            if uid in sandbox.UID_RANGE:
                uids.add(uid)
    held = set()
    for uid in uids:
        with sandbox.lease_is_free(uid) as free:
            if not free:
                held.add(uid)
    return held


def _sandbox_uids_under(pid: int) -> set[int]:
    """Sandbox uids of the live processes descended from ``pid`` (another user's run, told apart from any
    other sandbox user on the machine, such as a `make eval` scoring code beside the test suite)."""
    parent, uid_of = {}, {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry.name}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        parent[int(entry.name)] = int(fields.get("PPid", "0").strip() or 0)
        uid_of[int(entry.name)] = int(fields.get("Uid", "0").split()[0])
    out = set()
    for p, uid in uid_of.items():
        q = p
        while q and q != pid:
            q = parent.get(q, 0)
        if q == pid and uid in sandbox.UID_RANGE:
            out.add(uid)
    return out


@needs_root
def test_two_sandbox_users_at_once(clean_machine):
    """Another process scoring code in the sandbox at the same time (possibly under a uid this process leased
    before): our runs still pass, our leftover check does not count its processes, the two never share a
    uid at once, and it cleans up after itself."""
    other = subprocess.Popen([sys.executable, "-c", OTHER_USER], cwd=REPO, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 120  # a wait for a condition, not a timing: it is usually met in < 1 s
        while not (theirs := _sandbox_uids_under(other.pid) & _held_by_others()):
            assert other.poll() is None and time.monotonic() < deadline, "the other user's sandbox never started"
            time.sleep(0.05)
        before = sandbox.leased_uids()
        r = score(GOOD)
        assert r.passed, r
        assert leftovers() == []  # their live processes are not our leftovers
        assert not theirs & (sandbox.leased_uids() - before)
        # Its program sleeps until it is stopped below, so it still holds its uid: the two runs overlapped.
        assert theirs <= _sandbox_uids_under(other.pid) & _held_by_others(), "no overlap shown"
    finally:
        other.send_signal(15)
        out, _ = other.communicate(timeout=120)
    assert other.returncode == 3, (other.returncode, out)
    for uid in theirs:  # the other user's exit killed its sandbox processes
        with sandbox.lease_is_free(uid) as free:
            assert not free or not any(p.startswith("process") for p in _uid_leftovers(uid)), uid


def test_environment_is_scrubbed(monkeypatch, clean_machine):
    monkeypatch.setenv("REFUSION_TEST_SECRET", "hunter2")
    prog = ("import os\nassert 'REFUSION_TEST_SECRET' not in os.environ\n"
            f"try:\n    data = open('/proc/{os.getpid()}/environ', 'rb').read()\nexcept OSError:\n    data = b''\n"
            "assert b'hunter2' not in data\n" + GOOD)
    r = run_program(prog, TESTS, timeout_s=30)
    assert r.passed or not ROOT, r


def test_capabilities_report_is_one_line_or_none():
    w = CAPS["warning"]
    assert w is None or "\n" not in w
    if ROOT:
        assert CAPS["uid_switch"]


# ---------------------------------------------------------------- the evaluation's packages (issue 40)
def test_program_runs_as_under_exec_with_the_packages(clean_machine):
    """No __name__ (reads 'builtins', as exec(program, {}) gives it), so a main guard does not run; stdin
    refuses reads as under the official scorers; numpy comes from the evaluation's venv, read-only."""
    needs_packages()
    prog = ("import numpy as np\nimport sys\nNAME = __name__\ndef f(x):\n    return np.float32(x) * 2\n"
            "def reads():\n    try:\n        sys.stdin.read()\n    except OSError:\n        return 'refused'\n"
            "    return 'read'\n"
            "if __name__ == '__main__':\n    print(f(int(input())))\n")
    tests = ("assert f(2) == 4 and f(0.1) == 0.2\nassert NAME == 'builtins'\nassert reads() == 'refused'\n"
             "import numpy\nassert type(f(1)) is numpy.float32\n")
    r = run_program(prog, tests, timeout_s=30)
    assert r.passed, r
    assert r.stdout == ""  # the main guard did not run


@pytest.fixture()
def public_dir():
    """A folder every user can traverse (pytest's own tmp folders are private), outside /tmp (which the
    namespace replaces); removed afterwards."""
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="refusion-issue40-", dir="/var/tmp"))
    base.chmod(0o755)
    yield base
    subprocess.run(["rm", "-rf", "--", str(base)], check=True)


def test_package_environment_names_cause_and_fix(public_dir):
    tmp_path = public_dir
    site = tmp_path / "venv" / "site-packages"
    site.mkdir(parents=True)
    (site / "pkg").mkdir()
    env = sandbox.package_environment(as_other_uid=True, dirs=[str(site)])
    assert env["site"] == [str(site)] and env["warning"] is None, env
    (tmp_path / "venv").chmod(0o700)  # a private home folder above the venv
    env = sandbox.package_environment(as_other_uid=True, dirs=[str(site)])
    w = env["warning"]
    assert env["site"] == [] and "\n" not in w, env
    assert f"{tmp_path / 'venv'} is not traversable by other users (mode 700)" in w
    assert "standard library only" in w and "fix: " in w and f"chmod -R o+rX {site}" in w
    (tmp_path / "venv").chmod(0o755)
    (site / "pkg").chmod(0o700)
    assert f"{site / 'pkg'} is not readable by other users (mode 700)" in \
        sandbox.package_environment(as_other_uid=True, dirs=[str(site)])["warning"]
    # A readable folder beside an unreadable one is still given, and the warning says which.
    other = tmp_path / "other-site"
    other.mkdir(mode=0o755)
    env = sandbox.package_environment(as_other_uid=True, dirs=[str(site), str(other)])
    assert env["site"] == [str(other)] and f"see only {other}, not all" in env["warning"], env
    # The same user (the non-root fallback) reads it whatever the modes.
    assert sandbox.package_environment(as_other_uid=False, dirs=[str(site)])["site"] == [str(site)]
    # With namespaces the folder is bound into the sandbox's own root: a private folder above it (or /tmp)
    # does not matter, only its own entries do, and an entry that links outside it (the namespace shows
    # the folder alone).
    (site / "pkg").chmod(0o755)
    (tmp_path / "venv").chmod(0o700)
    env = sandbox.package_environment(as_other_uid=True, namespaces=True, dirs=[str(site)])
    assert env["site"] == [str(site)] and env["withheld"] == [] and env["warning"] is None, env
    if sandbox._stdlib_reason() is None:  # root starts the evaluation's own interpreter, wherever it lives
        assert env["python"] == sandbox._own_interpreter(), env
    (site / "pkg").chmod(0o700)
    env = sandbox.package_environment(as_other_uid=True, namespaces=True, dirs=[str(site)])
    assert env["site"] == [] and env["withheld"] == [str(site)], env
    assert f"{site / 'pkg'} is not readable by other users (mode 700)" in env["warning"]
    assert f"fix: let every user read the packages (chmod -R o+rX {site})" in env["warning"]
    (site / "pkg").chmod(0o755)
    (site / "linked").symlink_to(other)
    w = sandbox.package_environment(as_other_uid=True, namespaces=True, dirs=[str(site)])["warning"]
    assert f"{site / 'linked'} links to {other}, outside the package folder" in w, w


def test_package_environment_refuses_another_python_version(monkeypatch):
    monkeypatch.setattr(sandbox, "_python_version", lambda python: "3.99")
    env = sandbox.package_environment(as_other_uid=True, dirs=["/usr/lib/python3/dist-packages"])
    assert env["site"] == [] and "(3.99), not the evaluation's" in env["warning"] and "fix: install python" in \
        env["warning"]


def test_warning_printed_once_per_run(monkeypatch, capsys):
    caps = {"warning": "sandbox: programs and tests see the standard library only: x; fix: y"}
    monkeypatch.setattr(sandbox, "_warned", threading.Event())
    monkeypatch.delenv(sandbox.WARNED_ENV, raising=False)
    sandbox._warn_once(caps)
    sandbox._warn_once(caps)
    assert capsys.readouterr().err == f"warning: {caps['warning']}\n"
    monkeypatch.setattr(sandbox, "_warned", threading.Event())
    monkeypatch.setenv(sandbox.WARNED_ENV, "1")  # a worker whose runner printed it
    sandbox._warn_once(caps)
    assert capsys.readouterr().err == ""


@needs_ns
def test_unreadable_packages_are_withheld_with_a_warning(monkeypatch, public_dir, clean_machine):
    """End to end with a package folder of our own: readable, the program imports from it, also below a
    private folder (bound into the namespace, the sandbox uid never passes it); with an entry only its
    owner can read, capabilities() says so and the program sees the standard library only: never a
    quietly poorer environment."""
    base = public_dir
    site = base / "site-packages"
    site.mkdir(mode=0o755)
    module = site / "issue40_fakepkg.py"
    module.write_text("VALUE = 21\n")
    prog = "from issue40_fakepkg import VALUE\ndef f(x):\n    return x * VALUE\n"
    monkeypatch.setattr(sandbox, "_package_dirs", lambda: [str(site)])
    try:
        for base_mode, module_mode, passes in ((0o755, 0o644, True), (0o700, 0o644, True), (0o755, 0o600, False)):
            base.chmod(base_mode)
            module.chmod(module_mode)
            sandbox.capabilities.cache_clear()
            caps = sandbox.capabilities()
            assert (caps["warning"] is not None and str(module) in caps["warning"]) == (not passes), caps
            r = run_program(prog, "assert f(2) == 42\n", timeout_s=30)
            assert r.passed == passes, r
            if not passes:
                assert "No module named 'issue40_fakepkg'" in r.stderr, r
    finally:
        base.chmod(0o755)
        sandbox.capabilities.cache_clear()


@needs_root
def test_without_namespaces_a_private_venv_is_withheld_and_its_verdicts_marked(monkeypatch, public_dir,
                                                                               clean_machine):
    """Where no namespace can show the packages (forced here: the uid switch alone), the sandbox uids open them
    at their host paths, so a private folder above the venv withholds them: the warning says so, and a
    verdict on a program that imports one of them is marked in the sample log and counted in the summary."""
    from harness.run import summary, worker
    from harness.run.metrics import withheld_verdicts

    site = public_dir / "home" / "site-packages"
    site.mkdir(parents=True)
    (site / "issue_fakepkg.py").write_text("VALUE = 21\n")
    (public_dir / "home").chmod(0o700)
    caps = {**sandbox.capabilities(), "namespaces": False,
            "packages": sandbox.package_environment(as_other_uid=True, namespaces=False, dirs=[str(site)])}
    monkeypatch.setattr(sandbox, "capabilities", lambda: caps)
    assert caps["packages"]["withheld"] == [str(site)] and "is not traversable by other users (mode 700)" in \
        caps["packages"]["warning"]
    prog = "import json\nfrom issue_fakepkg import VALUE\ndef f(x):\n    return x * VALUE\n"
    r = run_program(prog, "assert f(2) == 42\n", timeout_s=30)
    assert not r.passed and "No module named 'issue_fakepkg'" in r.stderr, r
    assert sandbox.withheld_imports(prog) == ["issue_fakepkg"]
    assert sandbox.withheld_imports("import json\n__import__('issue_fakepkg.sub')\n") == ["issue_fakepkg"]
    assert sandbox.withheld_imports(GOOD, "import json, os\n") == []
    # The worker's sample rows: only verdicts of the sandbox's metrics are looked at.
    samples = {"t": [{"doc_id": 0, "filtered_resps": [prog], "target": "assert f(2) == 42", "filter": "none",
                      "metrics": ["pass_at_1"], "pass_at_1": 0.0},
                     {"doc_id": 1, "filtered_resps": [GOOD], "target": TESTS, "filter": "none",
                      "metrics": ["pass_at_1"], "pass_at_1": 1.0},
                     {"doc_id": 2, "filtered_resps": [prog], "target": "x", "filter": "none",
                      "metrics": ["exact_match"], "exact_match": 0.0}]}
    rows = worker._sample_rows(samples, {}, {"leaves": ["t"]})
    assert [r.get("sandbox_withheld") for r in rows] == [["issue_fakepkg"], None, None]
    marked = withheld_verdicts(rows)
    assert marked == {"count": 1, "items": [{"task": "t", "doc_id": 0, "modules": ["issue_fakepkg"]}]}
    s = summary.summary({"task": "t", "limit": None, "models": [{"name": "a"}], "units": [{"name": "t"}],
                         "environment": {"sandbox": caps}},
                        [{"model": "a", "task": "t", "decoder": "ar", "quality": {}, "sandbox_withheld": marked,
                          "speed": {"samples": 3, **{k: {"ratio_of_sums": None, "mean_of_ratios": None, "mean": None,
                                                          "p50": None, "p90": None, "total": 0}
                                                     for k in ("tokens_per_s", "tpf", "nfe", "latency_s",
                                                               "generated_tokens")}},
                          "memory": {}}])
    note = summary.markdown(s).split("Code verdicts that may depend")[1].splitlines()[0]
    assert note.startswith(" on a package the sandbox did not give: 1 (a on t 1 of 3), marked `sandbox_withheld`")
    assert caps["packages"]["warning"] in note
    assert any("1 code verdict(s) may depend on a package the sandbox did not give" in line
               for line in summary.failed_lines(s, Path("/runs/r")))


# A program that imports numpy from the venv the sandbox was given, returns numpy and Fraction values, and
# first tries every write into that venv (inside the sandbox and at its host path), each refused.
PRIVATE_VENV_PROGRAM = (VENV_ATTACKS + "for site in (inside, host):\n    for a in attacks(site):\n"
                        "        try:\n            a()\n        except OSError:\n            pass\n"
                        "from fractions import Fraction\nimport numpy as np\n"
                        "def f(x):\n    return np.float32(x) * 2\ndef g(x):\n    return Fraction(x, 3)\n")
PRIVATE_VENV_TESTS = ("import numpy\nassert f(2) == 4 and type(f(1)) is numpy.float32\n"
                      "from fractions import Fraction\nassert g(2) == Fraction(2, 3)\n")


@pytest.mark.parametrize("parent", ["/var/tmp", "/tmp"])
def test_packages_of_a_venv_below_a_private_folder(parent, monkeypatch, clean_machine):
    """A venv's site-packages below a folder only its owner may enter (a mode-700 home), outside and under
    /tmp (which the namespace replaces by its scratch folder): the candidate and the judge import numpy
    from it, and it is unchanged after a program tried every write into it. Built here as a copy of the
    layout of numpy (no install); where the sandbox cannot give it, skipped with the sandbox's reason."""
    import shutil
    import tempfile

    import numpy

    real = Path(numpy.__file__).resolve().parent.parent  # the evaluation's site-packages
    home = Path(tempfile.mkdtemp(prefix="refusion-private-home-", dir=parent))  # mode 700
    try:
        site = home / "venv" / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
        site.mkdir(parents=True, mode=0o755)
        for name in ("numpy", "numpy.libs"):
            if (real / name).is_dir():  # a copy, not links: a hard link would touch the real venv's files
                shutil.copytree(real / name, site / name, symlinks=True)
        subprocess.run(["chmod", "-R", "o+rX", "--", str(site)], check=True)  # as pip leaves a venv
        assert (site / "numpy" / "__init__.py").is_file()
        assert home.stat().st_mode & 0o777 == 0o700
        monkeypatch.setattr(sandbox, "_package_dirs", lambda: [str(site)])
        sandbox.capabilities.cache_clear()
        caps = sandbox.capabilities()
        if caps["namespaces"]:  # the folders are bound into the namespace: neither the home nor /tmp may matter
            assert str(home) not in (caps["packages"]["warning"] or ""), caps
        needs_packages()
        assert sandbox.capabilities()["packages"]["site"] == [str(site)]
        before = venv_state([str(site)])
        r = run_program(PRIVATE_VENV_PROGRAM.format(host=str(site)), PRIVATE_VENV_TESTS, timeout_s=30)
        assert r.passed, r
        after = venv_state([str(site)])
        assert before["entries"] > 0 and before["content"] and after == before
        assert after["owned_by_sandbox"] == []
    finally:
        sandbox.capabilities.cache_clear()
        subprocess.run(["rm", "-rf", "--", str(home)], check=True)


# ---------------------------------------------------------------- values as data (issue 40)
def _round_trip(value):
    """encode in one process, JSON on the wire, decode in another: here both in this process."""
    from tasks import sandbox_child as sc

    handles = []
    msg = json.loads(json.dumps(sc.encode(value, lambda o: handles.append(o) or ["h", len(handles) - 1])))
    return sc.decode(msg, lambda tag, ref: ("handle", ref)), handles


def test_numbers_travel_as_data_and_compare_as_python_does():
    from decimal import Decimal
    from fractions import Fraction

    import numpy as np
    import sympy

    for value, expected_type, equal_to in (
            (Fraction(1, 2), Fraction, 0.5), (Fraction(4, 2), Fraction, 2), (Decimal("0.1"), Decimal, Decimal("0.1")),
            (Decimal(0.5), Decimal, 0.5), (np.float32(0.1), np.float32, 0.1), (np.int64(5), np.int64, 5),
            (np.bool_(True), np.bool_, True), (np.str_("ab"), np.str_, "ab"), (np.float64(2.5), np.float64, 2.5),
            (np.complex64(1 + 2j), np.complex64, 1 + 2j), (sympy.Integer(7), int, 7),
            (sympy.Rational(1, 3), Fraction, Fraction(1, 3)), (True, bool, 1)):
        back, handles = _round_trip(value)
        assert type(back) is expected_type and back == equal_to and handles == [], (value, back)
    back, _ = _round_trip([np.float32(0.1), (Fraction(1, 3), {Decimal("1.5"): np.int8(3)})])
    assert back == [0.1, (Fraction(1, 3), {Decimal("1.5"): 3})]
    # No equality of the number's own: a subclass travels as its base; an unconvertible Number is a handle.
    class Liar(Fraction):
        def __eq__(self, other):
            return True

        __hash__ = Fraction.__hash__

    class Bare:
        pass

    import numbers
    numbers.Number.register(Bare)
    back, handles = _round_trip([Liar(0), Bare()])
    assert type(back[0]) is Fraction and back[0] != 4 and back[1] == ("handle", 0) and len(handles) == 1


def test_numpy_arrays_travel_as_data():
    import numpy as np

    for arr in (np.arange(6, dtype=np.int16).reshape(2, 3), np.array([], dtype=float), np.array(["a", "bc"]),
                np.array([1.5, 2.5], dtype=">f4"), np.array(["2020-01-01"], dtype="datetime64[D]"),
                np.asarray(3.0), np.array([b"x", b"yz"]), np.array([True, False])):
        back, _ = _round_trip(arr)
        assert type(back) is np.ndarray and back.dtype == arr.dtype and back.shape == arr.shape, arr
        assert np.array_equal(back, arr) and back.flags.writeable
    back, handles = _round_trip(np.array([1, "a", None], dtype=object))
    assert back.dtype == object and list(back) == [1, "a", None] and handles == []

    class Lies(np.ndarray):
        def __eq__(self, other):
            return True

    back, _ = _round_trip(np.zeros(2).view(Lies))
    assert type(back) is np.ndarray and not (back == 4).any()
    back, handles = _round_trip(np.zeros(1, dtype=[("a", "i4")]))  # a structured array holds no plain value
    assert back == ("handle", 0)


@pytest.mark.parametrize("msg", [
    ["A", "|O", [2], [["i", "1"]]],  # wrong element count
    ["A", "<i4", [2], "00000000"],  # wrong byte count
    ["N", "<i4,<f8", [], "00" * 12],  # structured
    ["A", "O", [1], "00" * 8],  # objects as bytes
    ["A", "<i4", [-1], ""],
    ["A", "<i4", [1], "zz"],
    ["q", "1", "0"],
    ["q", 1, 2],
    ["D", "not a number"],
    ["D", 1.5],
])
def test_malformed_numbers_and_arrays_are_protocol_errors(msg):
    from tasks import sandbox_child as sc

    with pytest.raises(sc.WireError):
        sc.decode(msg, lambda tag, ref: None)
