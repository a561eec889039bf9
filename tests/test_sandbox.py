"""Hostile programs against harness.sandbox.run_program (issue 5 acceptance list)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness.sandbox import SandboxResult, run_program

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="uid isolation (signals, /proc, setsid escapes) needs root")


@pytest.fixture()
def decoy(tmp_path: Path) -> Path:
    """A directory outside the sandbox that hostile programs try to damage."""
    d = tmp_path / "decoy"
    d.mkdir()
    (d / "keep.txt").write_text("precious")
    d.chmod(0o755)
    tmp_path.chmod(0o755)
    (d / "keep.txt").chmod(0o644)
    return d


def _intact(d: Path) -> bool:
    return (d / "keep.txt").read_text() == "precious" and sorted(p.name for p in d.iterdir()) == ["keep.txt"]


def test_passing_and_failing_programs():
    ok = run_program("def f(x):\n    return x + 1\nassert f(1) == 2\nprint('done')\n")
    assert ok.passed and ok.reason == "passed" and ok.returncode == 0 and ok.stdout == "done\n"
    bad = run_program("def f(x):\n    return x\nassert f(1) == 2\n")
    assert not bad.passed and bad.reason == "error" and "AssertionError" in bad.stderr


@pytest.mark.parametrize("name,program,reasons", [
    ("infinite loop", "while True:\n    pass\n", {"timeout"}),
    ("fork bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
     {"timeout"}),
    ("10 GB allocation", "x = bytearray(10 * 1024 ** 3)\n", {"memory"}),
    ("1 GB file", "with open('big.bin', 'wb') as f:\n    for _ in range(1024):\n"
                  "        f.write(b'0' * 1024 * 1024)\n", {"file_size"}),
    ("100 MB stdout", "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1024 * 1024)\n",
     {"output_limit"}),
    ("os._exit before tests", "import os\nos._exit(0)\nassert False\n", {"exited"}),
    ("sys.exit(0) before tests", "import sys\nsys.exit(0)\nassert False\n", {"exited"}),
])
def test_hostile_programs_fail_with_reason(name, program, reasons, decoy):
    t0 = time.monotonic()
    r = run_program(program, timeout_s=3)
    assert not r.passed, name
    assert r.reason in reasons, (name, r.reason, r.stderr[-300:])
    assert time.monotonic() - t0 < 20, name
    assert len(r.stdout) <= 64 * 1024 and len(r.stderr) <= 64 * 1024
    assert _intact(decoy)


def test_delete_files_outside_sandbox(decoy):
    prog = (f"import shutil, os\nshutil.rmtree({str(decoy)!r})\n")
    r = run_program(prog, timeout_s=5)
    assert not r.passed and r.reason == "error"
    assert "PermissionError" in r.stderr or not ROOT
    assert _intact(decoy)


def test_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("REFUSION_TEST_SECRET", "hunter2")
    prog = ("import os\nassert 'REFUSION_TEST_SECRET' not in os.environ\n"
            "assert 'hunter2' not in repr(dict(os.environ))\n")
    assert run_program(prog).passed
    # And not through the parent's /proc entry either.
    leak = (f"data = open('/proc/{os.getpid()}/environ', 'rb').read()\n"
            "assert b'hunter2' not in data\n")
    r = run_program(leak)
    if ROOT:
        assert not r.passed and "PermissionError" in r.stderr  # different uid: no access
    else:
        assert r.reason in ("passed", "error")


@needs_root
def test_cannot_kill_parent():
    r = run_program("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
                    f"os.kill({os.getpid()}, signal.SIGKILL)\n")
    assert not r.passed and r.reason == "error" and "PermissionError" in r.stderr
    assert run_program("assert True\n").passed  # the harness is still here


@needs_root
def test_setsid_grandchild_does_not_outlive_the_run(tmp_path):
    marker = tmp_path / "alive"
    tmp_path.chmod(0o777)  # let the sandbox uid write the marker if it ever wakes up
    prog = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            "        time.sleep(4)\n"
            f"        open({str(marker)!r}, 'w').write('escaped')\n"
            "    os._exit(0)\n"
            "time.sleep(30)\n")
    t0 = time.monotonic()
    r = run_program(prog, timeout_s=2)
    assert r.reason == "timeout" and time.monotonic() - t0 < 10
    time.sleep(4)
    assert not marker.exists()


@needs_root
def test_background_child_killed_when_program_exits(tmp_path):
    marker = tmp_path / "alive"
    tmp_path.chmod(0o777)
    prog = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    time.sleep(3)\n"
            f"    open({str(marker)!r}, 'w').write('escaped')\n"
            "    os._exit(0)\n")
    r = run_program(prog, timeout_s=10)
    assert r.passed  # the main program finished; its detached child must not survive it
    time.sleep(3.5)
    assert not marker.exists()


def test_concurrent_runs_do_not_interfere():
    programs = [f"import time\ntime.sleep(0.3)\nassert {i} * 2 == {2 * i}\nprint({i})\n" for i in range(6)]
    programs.append("while True:\n    pass\n")
    programs.append("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    # The hostile pair gets a short deadline; the benign ones a generous one, since on a
    # loaded 2-core machine starting 8 interpreters next to a fork bomb can take seconds.
    limits = [30] * 6 + [4, 4]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results: list[SandboxResult] = list(pool.map(lambda pl: run_program(pl[0], timeout_s=pl[1]),
                                                     zip(programs, limits)))
    for i, r in enumerate(results[:6]):
        assert r.passed and r.stdout.strip() == str(i), (i, r.reason, r.stderr[-300:])
    assert [r.reason for r in results[6:]] == ["timeout", "timeout"]


def test_bad_limits_rejected():
    with pytest.raises(ValueError):
        run_program("pass", timeout_s=0)
