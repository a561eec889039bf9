"""The operating-system resources of a sandboxed run (tasks/sandbox.py): the per-run cgroup with its memory and
process limits, and the processes and files a run's uid leaves behind, killed and removed after the run.
Nothing here raises on cleanup: a problem comes back as text for the run's ``sandbox_error`` detail."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

# The world-writable folders a uid's leftover files are swept from when there are no namespaces.
SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
CGROUP_NAME = "refusion-sandbox"


def cgroup_setup() -> tuple[str | None, list[Path]]:
    """('v2'|'v1', parent folders for per-run cgroups) when memory and pids limits work, else (None, [])."""
    for mount in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        ctl = mount / "cgroup.controllers"
        try:
            if not {"memory", "pids"} <= set(ctl.read_text().split()):
                continue
            base = mount / CGROUP_NAME
            base.mkdir(exist_ok=True)
            for d in (mount, base):
                try:
                    (d / "cgroup.subtree_control").write_text("+memory +pids")
                except OSError:
                    pass
            if {"memory", "pids"} <= set((base / "cgroup.subtree_control").read_text().split()):
                return "v2", [base]
        except OSError:
            continue
    try:
        bases = [Path("/sys/fs/cgroup/memory") / CGROUP_NAME, Path("/sys/fs/cgroup/pids") / CGROUP_NAME]
        for b in bases:
            b.mkdir(exist_ok=True)
        if (bases[0] / "memory.limit_in_bytes").exists() and (bases[1] / "pids.max").exists():
            return "v1", bases
    except OSError:
        pass
    return None, []



class Cgroup:
    """Per-run cgroup(s) with a memory and a process limit for the whole program."""

    def __init__(self, memory_bytes: int, pids: int, kind: str | None) -> None:
        """``kind``: 'v2', 'v1' or None (nothing is made), as the sandbox's capabilities found it."""
        _, bases = cgroup_setup() if kind else (None, [])
        self.kind = kind
        name = f"run-{os.getpid()}-{secrets.token_hex(6)}"
        self.dirs = [b / name for b in bases]
        made = []
        try:
            for d in self.dirs:
                d.mkdir()
                made.append(d)
            if kind == "v2":
                d = self.dirs[0]
                (d / "memory.max").write_text(str(memory_bytes))
                if (d / "memory.swap.max").exists():
                    (d / "memory.swap.max").write_text("0")
                (d / "pids.max").write_text(str(pids))
            elif kind == "v1":
                mem, pid = self.dirs
                (mem / "memory.limit_in_bytes").write_text(str(memory_bytes))
                if (mem / "memory.memsw.limit_in_bytes").exists():
                    try:
                        (mem / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
                    except OSError:
                        pass
                (pid / "pids.max").write_text(str(pids))
        except OSError:
            self.dirs = made
            self.remove()
            raise

    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def oom_kills(self) -> int:
        files = {"v2": "memory.events", "v1": "memory.oom_control"}
        if not self.dirs or self.kind not in files:
            return 0
        try:
            for line in (self.dirs[0] / files[self.kind]).read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == "oom_kill":
                    return int(v)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self) -> str | None:
        """Kill what is left in the cgroups and delete them; a problem as text, never raised."""
        problem = None
        for d in self.dirs:
            for _ in range(100):
                try:
                    pids = [int(p) for p in (d / "cgroup.procs").read_text().split()]
                except (OSError, ValueError):
                    pids = []
                for p in pids:
                    try:
                        os.kill(p, signal.SIGKILL)
                    except OSError:
                        pass
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)  # killed processes are still exiting
            else:
                problem = f"cgroup {d} could not be removed"
        return problem


# ---------------------------------------------------------------- processes and files of a uid
def uid_processes(uid: int) -> list[int]:
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
        try:
            if int(fields.get("Uid", "-1 ").split()[0]) == uid and not fields.get("State", "").strip().startswith("Z"):
                pids.append(int(entry.name))
        except ValueError:
            continue
    return pids


def kill_uid(uid: int) -> str | None:
    """Root: SIGKILL every process of `uid` until none is left (a stopped one dies too). Never raises."""
    # Only processes of the uid can create more of them and each kill is final, so the loop ends.
    for _ in range(200):
        pids = uid_processes(uid)
        if not pids:
            return None
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
    return f"processes of uid {uid} survived SIGKILL"


def kill_session(pid: int) -> None:
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


def rm_rf(path: str) -> str | None:
    # `rm -rf` walks any depth; shutil.rmtree recurses in Python and raises RecursionError
    # on a few thousand nested folders.
    try:
        r = subprocess.run(["rm", "-rf", "--one-file-system", "--", path], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, timeout=120)
        return None if r.returncode == 0 and not os.path.lexists(path) else f"could not remove {path}"
    except (OSError, subprocess.SubprocessError) as e:
        return f"could not remove {path}: {e}"


def remove_uid_leftovers(uid: int) -> list[str]:
    """Fallback mode: files of `uid` in the world-writable folders and its SysV IPC objects."""
    problems = []
    for d in SCRATCH_DIRS:
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            try:
                if e.stat(follow_symlinks=False).st_uid == uid:
                    p = rm_rf(e.path)
                    if p:
                        problems.append(p)
            except OSError:
                continue
    for kind, flag in (("shm", "-m"), ("sem", "-s"), ("msg", "-q")):
        try:
            lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            # columns: key id perms ... uid (the 8th for shm, 5th for sem, 8th for msg)
            uid_col = {"shm": 7, "sem": 4, "msg": 7}[kind]
            if len(f) > uid_col and f[uid_col] == str(uid):
                subprocess.run(["ipcrm", flag, f[1]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return problems
