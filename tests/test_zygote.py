"""The run's fork server (harness/run/zygote.py): a child it starts behaves as `python -m` would.

Each test starts a server that preloads torch only (the run's preloads the rest too) and a probe module
written to the test's folder; the run's children (worker, timed rounds, memory pass) go through it in every
eval test of the suite, and `make regress` compares their deterministic figures with a baseline made by
plain processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.run import launch, zygote

PROBE = '''
import atexit, json, os, signal, sys, time
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "tmpdir": os.environ.get("TMPDIR"),
                  "set_by_import": os.environ.get("ZSET"), "kept": os.environ.get("ZKEEP"),
                  "extra": os.environ.get("ZPROBE_EXTRA"), "path0": sys.path[0], "name": __name__,
                  "ppid": os.getppid(), "warm": "torch" in sys.modules,
                  "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                  "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler}), flush=True)
mode = sys.argv[1]
if mode == "exit":
    atexit.register(lambda: print("atexit ran", flush=True))
    sys.exit(int(sys.argv[2]))
if mode == "message":
    sys.exit("a message")
if mode == "raise":
    raise ValueError("boom")
if mode == "sleep":
    time.sleep(120)
'''


# A preloaded module that sets variables the way libraries do at import (setdefault): ZSET unset before it.
ZSET = '''
import os
os.environ.setdefault("ZSET", "by-import")
os.environ.setdefault("ZKEEP", "by-import")
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("zygote")
    (root / "zprobe.py").write_text(PROBE)
    (root / "zset.py").write_text(ZSET)
    env = {**launch.child_env(), "PYTHONPATH": f"{root}{os.pathsep}{launch.REPO}", "ZKEEP": "the-run's"}
    srv = zygote.Server(env, str(root), modules=("zprobe",), preload=("torch", "zset"))
    srv.begin(root / "tmp-server")
    assert (root / "tmp-server").is_dir()
    yield srv, env, root
    srv.close()
    assert not (root / "tmp-server").exists()  # its temporary folder goes with it


def _start(server, capfd, *args, env_extra=None, cwd=None):
    srv, env, root = server
    (root / "tmp-child").mkdir(exist_ok=True)
    child = srv.start([sys.executable, "-m", "zprobe", *args], {**env, "TMPDIR": str(root / "tmp-child"),
                                                                **(env_extra or {})}, str(cwd or root))
    return child


def _out(capfd) -> tuple[dict, str, str]:
    out, err = capfd.readouterr()
    return json.loads(out.splitlines()[0]), out, err


def test_a_child_runs_its_module_as_python_m_would(server, capfd):
    srv, env, root = server
    child = _start(server, capfd, "exit", "3")
    assert child is not None and child.wait() == 3
    got, out, _ = _out(capfd)
    assert got["argv"] == [str(root / "zprobe.py"), "exit", "3"] and got["name"] == "__main__"
    assert got["cwd"] == str(root) and got["path0"] == str(root) and got["tmpdir"] == str(root / "tmp-child")
    assert got["warm"]  # torch came with the fork: the child did not import it
    # what the preload set is there, as a fresh import would set it; what the run gave wins over it
    assert got["set_by_import"] == "by-import" and got["kept"] == "the-run's"
    assert got["sigterm"] and got["sigint"] and got["ppid"] == srv.proc.pid
    assert "atexit ran" in out  # its exit handlers run, as at a normal interpreter exit


@pytest.mark.parametrize("args,code,text", [(("exit", "0"), 0, ""), (("message",), 1, "a message"),
                                            (("raise",), 1, "ValueError: boom")])
def test_exit_status_and_uncaught_errors_as_python_gives_them(server, capfd, args, code, text):
    child = _start(server, capfd, *args)
    assert child.wait() == code
    _, _, err = _out(capfd)
    assert text in err


def test_a_stop_signal_reaches_the_child_and_its_death_is_reported_as_popen_does(server, capfd):
    child = _start(server, capfd, "sleep")
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30:  # until it has printed (its handlers are set)
        out, err = capfd.readouterr()
        if out:
            break
        time.sleep(0.05)
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    child.terminate()
    assert child.wait(timeout=30) == -signal.SIGTERM


def test_what_the_caller_set_since_the_server_began_is_served(server, capfd, monkeypatch):
    """The runner begins the server before its own imports, which set variables (torch's inductor cache folder,
    scikit-learn's KMP_DUPLICATE_LIB_OK): its children, which have them, are served; one set only for the child
    is not."""
    monkeypatch.setenv("ZLATE", "set-by-the-caller-after-begin")
    child = _start(server, capfd, "exit", "0", env_extra={"ZLATE": "set-by-the-caller-after-begin"})
    assert child is not None and child.wait() == 0
    assert _start(server, capfd, "exit", "0", env_extra={"ZLATE": "set-by-the-caller-after-begin",
                                                         "ZOTHER": "1"}) is None


def test_what_it_does_not_serve_is_left_to_a_plain_process(server, capfd):
    srv, env, root = server
    assert srv.start([sys.executable, "-m", "json.tool", "--help"], env, str(root)) is None  # another module
    assert _start(server, capfd, "exit", "0", env_extra={"ZPROBE_EXTRA": "1"}) is None  # another environment
    child = _start(server, capfd, "exit", "0", env_extra={"REFUSION_X": "1"})  # the project's own: its to read
    assert child.wait() == 0
    # a variable the preload set itself, with the runner's own value (its imports set it under its TMPDIR): served,
    # and the child has the runner's value, as a fresh process started by the runner would
    capfd.readouterr()
    child = _start(server, capfd, "exit", "0", env_extra={"ZSET": "by-the-runner's-import"})
    assert child is not None and child.wait() == 0
    assert _out(capfd)[0]["set_by_import"] == "by-the-runner's-import"
    assert srv.why is None  # the server is still up
    child = _start(server, capfd, "exit", "5")
    assert child.wait() == 5


def test_children_die_with_the_server_and_the_server_with_its_runner(tmp_path):
    """A runner killed with SIGKILL: the server gets SIGKILL from the kernel, and so does the child it forked."""
    (tmp_path / "zprobe.py").write_text(PROBE)
    runner = tmp_path / "runner.py"
    runner.write_text(f'''
import os, sys, time
sys.path.insert(0, {str(launch.REPO)!r})
from harness.run import launch, zygote
env = {{**launch.child_env(), "PYTHONPATH": {str(tmp_path)!r} + os.pathsep + {str(launch.REPO)!r}}}
srv = zygote.Server(env, {str(tmp_path)!r}, modules=("zprobe",), preload=())
child = srv.start([sys.executable, "-m", "zprobe", "sleep"], env, {str(tmp_path)!r})
print(srv.proc.pid, child.pid, flush=True)
time.sleep(120)
''')
    proc = subprocess.Popen([sys.executable, str(runner)], stdout=subprocess.PIPE, text=True)
    server_pid, child_pid = map(int, proc.stdout.readline().split()[:2])
    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    alive = [server_pid, child_pid]
    while alive and time.monotonic() - t0 < 30:
        alive = [p for p in alive if Path(f"/proc/{p}").exists() and "Z" not in _state(p)]
        time.sleep(0.05)
    assert not alive


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_the_server_is_off_when_asked(monkeypatch):
    monkeypatch.setenv("REFUSION_FORK_SERVER", "0")
    assert launch.fork_server() is None
