"""The environment a run records in run.json: hardware, packages, git commit, threads and processes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def environment(device: str, threads: int, num_processes: int, seed: int) -> dict:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    pkgs = {}
    for p in ("torch", "transformers", "lm-eval", "accelerate", "datasets", "tokenizers", "numpy", "psutil"):
        try:
            pkgs[p] = version(p)
        except PackageNotFoundError:
            pkgs[p] = None
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = None
    if device.startswith("cuda"):
        import torch

        gpu = torch.cuda.get_device_name(0)
    status = git("status", "--porcelain")
    # What a tokens/s figure was measured on: runs with the same hardware (and dtype, batch size) can be
    # compared across runs (harness/report/runset.py speed_setting).
    hardware = gpu if gpu else f"{cpu}, {threads} thread(s) per process"
    return {"hardware": hardware, "git_commit": git("rev-parse", "HEAD"), "git_dirty": bool(status) if status is not None else None,
            "packages": pkgs, "python": platform.python_version(), "platform": platform.platform(),
            "device": device, "cpu": cpu, "gpu": gpu, "cpu_count": os.cpu_count(), "threads_per_process": threads,
            "num_processes": num_processes, "seed": seed}

