"""The busy-machine guard: what else used the machine while speed was measured.

``Guard`` reads, at the edges of the timed rounds, the machine's CPU counters (``/proc/stat``: every
process's CPU time and the hypervisor's steal time), our own processes' CPU time (``/proc/<pid>/stat``) and
the load average, and on a GPU other processes' memory and the utilisation through NVML when it is
installed. Others' share = (machine CPU time - ours + steal) / machine capacity over the timed rounds; over
``busy_share`` (or with another process on the GPU) the figures are flagged as measured on a busy machine
(``busy_text``)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

BUSY_SHARE = 0.10  # others' share of the machine (CPU + steal) above which the speed figures are flagged


def _proc_stat(root: str = "/proc") -> tuple[int, int, int] | None:
    """(busy, steal, total) jiffies of the whole machine from /proc/stat's first line; None off Linux."""
    try:
        with open(f"{root}/stat") as f:
            parts = f.readline().split()
    except OSError:
        return None
    if not parts or parts[0] != "cpu":
        return None
    v = [int(x) for x in parts[1:9]] + [0] * max(0, 8 - len(parts[1:9]))
    user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
    return user + nice + system + irq + softirq, steal, sum(v[:8])


def _pid_cpu(pid: int, root: str = "/proc") -> tuple[int, int] | None:
    """(parent pid, utime + stime jiffies) of one process; None when it is gone."""
    try:
        with open(f"{root}/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    rest = text[text.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
    try:
        return int(rest[1]), int(rest[11]) + int(rest[12])
    except (IndexError, ValueError):
        return None


def _tree_cpu(roots: set[int], root: str = "/proc") -> int | None:
    """CPU jiffies of the processes in ``roots`` and all their descendants, now; None when the process table
    cannot be listed (then our share is unknown, and so is everyone else's: never 0, which would count all of
    our own CPU as a neighbour's)."""
    table: dict[int, tuple[int, int]] = {}
    try:
        names = os.listdir(root)
    except OSError:
        return None
    for name in names:
        if name.isdigit():
            got = _pid_cpu(int(name), root)
            if got is not None:
                table[int(name)] = got
    ours, total = set(), 0
    changed = True
    ours |= {p for p in roots if p in table}
    while changed:
        changed = False
        for pid, (ppid, _) in table.items():
            if pid not in ours and ppid in ours:
                ours.add(pid)
                changed = True
    for pid in ours:
        total += table[pid][1]
    return total


def _loadavg(root: str = "/proc") -> float | None:
    try:
        with open(f"{root}/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class _Nvml:
    """Other processes' GPU memory and the device utilisation through NVML (pynvml), when both are there."""

    def __init__(self, device_index: int | None) -> None:
        self.h = None
        self.why: str | None = None  # why the GPU is not watched, when it should be
        if device_index is None:
            return
        try:
            import pynvml  # nvidia-ml-py: optional; without it the GPU's other users are unknown

            pynvml.nvmlInit()
            self.nv = pynvml
            self.h = pynvml.nvmlDeviceGetHandleByIndex(int(device_index))
        except Exception as e:  # noqa: BLE001: no NVML, no driver, no such device: the GPU is not watched
            self.h = None
            self.why = f"NVML unavailable ({type(e).__name__}: {str(e)[:120] or 'no message'})"

    def read(self, ours: set[int]) -> dict | None:
        if self.h is None:
            return None
        try:
            procs = self.nv.nvmlDeviceGetComputeRunningProcesses(self.h)
            others = [p for p in procs if p.pid not in ours]
            util = self.nv.nvmlDeviceGetUtilizationRates(self.h).gpu
            return {"other_processes": len(others),
                    "other_memory_bytes": int(sum(int(p.usedGpuMemory or 0) for p in others)),
                    "utilization_pct": int(util)}
        except Exception as e:  # noqa: BLE001
            self.why = f"NVML read failed ({type(e).__name__}: {str(e)[:120] or 'no message'})"
            return None


@dataclass
class Guard:
    """Reads what else uses the machine at the edges of the timed rounds (module doc). ``roots``: our
    processes (this one and the workers; their descendants count as ours too)."""
    roots: set[int] = field(default_factory=lambda: {os.getpid()})
    busy_share: float = BUSY_SHARE
    gpu_index: int | None = None
    proc: str = "/proc"
    _marks: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._nvml = _Nvml(self.gpu_index)

    def mark(self, label: str = "") -> None:
        """Read the counters now (a round edge)."""
        st = _proc_stat(self.proc)
        self._marks.append({"label": label, "t": time.monotonic(), "stat": st,
                            "ours": _tree_cpu(self.roots, self.proc) if st is not None else None,
                            "load1": _loadavg(self.proc), "gpu": self._nvml.read(self.roots)})

    @staticmethod
    def _share(a: dict, b: dict) -> dict | None:
        if a["stat"] is None or b["stat"] is None or a["ours"] is None or b["ours"] is None:
            return None
        busy = b["stat"][0] - a["stat"][0]
        steal = b["stat"][1] - a["stat"][1]
        total = b["stat"][2] - a["stat"][2]
        ours = b["ours"] - a["ours"]
        if total <= 0:
            return None
        others = max(0, busy - ours)
        return {"others_cpu_share": others / total, "steal_share": steal / total,
                "others_share": (others + steal) / total, "our_cpu_share": min(1.0, ours / total)}

    def result(self) -> dict:
        """What the guard saw over all marks, per window between marks, and the verdict: ``state`` is busy,
        quiet, or unknown (with ``why``) where the counters could not be read; ``busy`` is True only when busy."""
        base = {"threshold": self.busy_share}
        if len(self._marks) < 2 or self._marks[0]["stat"] is None:
            return {**base, "available": False, "busy": False, "state": "unknown",
                    "why": "no /proc/stat here: the machine's load was not watched"}
        whole = self._share(self._marks[0], self._marks[-1])
        if whole is None:
            return {**base, "available": False, "busy": False, "state": "unknown",
                    "why": f"the process table ({self.proc}) could not be read: our own CPU time, and so the "
                           "others', is unknown"}
        windows = [self._share(a, b) for a, b in zip(self._marks, self._marks[1:])]
        loads = [m["load1"] for m in self._marks if m["load1"] is not None]
        gpus = [m["gpu"] for m in self._marks if m["gpu"]]
        gpu = None
        if gpus:
            gpu = {"other_processes_max": max(g["other_processes"] for g in gpus),
                   "other_memory_bytes_max": max(g["other_memory_bytes"] for g in gpus),
                   "utilization_pct_mean": sum(g["utilization_pct"] for g in gpus) / len(gpus)}
        busy = whole["others_share"] > self.busy_share or bool(gpu and gpu["other_processes_max"])
        gpu_unknown = self.gpu_index is not None and len(gpus) < len(self._marks)
        state = "busy" if busy else "unknown" if gpu_unknown else "quiet"
        out = {**base, "available": True, "busy": busy, "state": state, **whole,
               "windows_others_share": [None if w is None else round(w["others_share"], 4) for w in windows],
               "windows_over_threshold": sum(1 for w in windows if w and w["others_share"] > self.busy_share),
               "load1_mean": sum(loads) / len(loads) if loads else None, "load1_max": max(loads) if loads else None,
               "cpu_count": os.cpu_count(), "seconds": self._marks[-1]["t"] - self._marks[0]["t"], "gpu": gpu}
        if gpu_unknown:
            out["why"] = (f"the GPU's other users are unknown: {self._nvml.why or 'NVML gave no reading'}; the CPU "
                          f"was {'busy' if busy else 'quiet'}")
        return out


def state_of(guard: dict | None) -> str:
    """busy, quiet or unknown: what one guard result says of the machine (a result without ``state``, from an
    older run: busy or quiet by its flag, unknown when it was not available)."""
    if not guard:
        return "unknown"
    if guard.get("state"):
        return guard["state"]
    return "busy" if guard.get("busy") else "quiet" if guard.get("available", True) else "unknown"


def combined_state(guards: list[dict | None]) -> str:
    """The machine's state over several guarded passes: busy if any was, else unknown if any was, else quiet."""
    states = [state_of(g) for g in guards] or ["unknown"]
    return "busy" if "busy" in states else "unknown" if "unknown" in states else "quiet"


def state_text(guards: list[dict | None]) -> str | None:
    """The sentence for a machine whose load is unknown (None when it was watched throughout)."""
    whys = list(dict.fromkeys(g.get("why") or "not watched" for g in guards if state_of(g) == "unknown"))
    if not guards:
        return "machine load unknown: the timed rounds recorded no guard"
    return "machine load unknown: " + "; ".join(whys) if whys else None


def busy_text(guard: dict | None) -> str | None:
    """The flag's sentence, or None when the machine was quiet (or not watched)."""
    if not guard or not guard.get("busy"):
        return None
    parts = [f"other processes used {100 * guard.get('others_cpu_share', 0):.0f}% of the machine's CPU"]
    if guard.get("steal_share", 0) >= 0.005:
        parts.append(f"the hypervisor took {100 * guard['steal_share']:.0f}% (steal)")
    if (guard.get("gpu") or {}).get("other_processes_max"):
        parts.append(f"{guard['gpu']['other_processes_max']} other process(es) held the GPU")
    return ("measured on a busy machine: during the timed rounds " + " and ".join(parts) +
            f" (flag above {100 * guard['threshold']:.0f}%); speed figures may be off")
