"""`make test-cpus`: the tests that compare against tokens or logits made elsewhere, under other CPUs' kernels.

A float32 sum rounds differently with the vector width of the kernel that computes it (AVX-512, AVX2, no
vectors) and with how many threads split it, so tokens made on one machine (the authors' references, another
CPU) hold on another only where a margin decides them. This runs pytest once per setting below, each in fresh
processes (the variables are read when torch and its libraries load) with its own inductor cache, and says
which passed:

    native        this CPU's best kernels, one torch thread per test worker (what `make test` runs)
    aten-default  ATEN_CPU_CAPABILITY=default: ATen's kernels without vector instructions
    aten-avx2     ATEN_CPU_CAPABILITY=avx2: ATen's AVX2 kernels (a CPU without AVX-512, such as AMD EPYC Zen 2/3)
    mkl-avx2      MKL_ENABLE_INSTRUCTIONS=AVX2: MKL's matmuls at most AVX2
    onednn-avx2   ONEDNN_MAX_CPU_ISA=AVX2: oneDNN's kernels at most AVX2
    all-avx2      the three AVX2 caps together (closest to an AVX2-only CPU)
    threads-4     4 torch threads per test worker (REFUSION_TEST_THREADS=4, OMP_NUM_THREADS=4)

    python scripts/test_cpus.py                       # the `reference` tests, slow ones included
    python scripts/test_cpus.py --scope all           # the whole default suite (`make test`'s selection)
    python scripts/test_cpus.py --settings aten-avx2,threads-4 -- -k sdar

It prints one line per setting and writes results/test_cpus.json (the CPU, torch's reported capability under
each setting, pytest's closing line and exit status). Exit status 1 when any setting failed.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.run.store import atomic_write_json
from harness.speed.ab import machine

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "results" / "test_cpus.json"

SETTINGS: dict[str, dict[str, str]] = {
    "native": {},
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "mkl-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "onednn-avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "all-avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "threads-4": {"REFUSION_TEST_THREADS": "4", "OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4"},
}
SCOPES = {"reference": ["-m", "reference"], "all": ["-m", "not slow"]}
# Variables a setting sets or that would override one: cleared first, so each setting is only itself.
CLEARED = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "REFUSION_TEST_THREADS",
           "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def env_for(name: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(SETTINGS[name])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    # Each setting stands for another machine, and another machine has its own inductor cache: torch 2.13
    # keys compiled CPU kernels by the host CPU, not by ATEN_CPU_CAPABILITY, so a kernel built for AVX-512
    # would be loaded under the AVX2 setting (and crashes there). Without this, settings share one cache.
    env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / f"refusion-test-cpus-inductor-{name}")
    return env


def capability(env: dict[str, str]) -> str:
    """What torch reports under ``env`` (ATen's dispatch level and the thread count a test would use)."""
    code = ("import os, torch; print(torch.backends.cpu.get_cpu_capability(), "
            "os.environ.get('REFUSION_TEST_THREADS', '1'))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return r.stdout.strip() if r.returncode == 0 else f"error: {r.stderr.strip().splitlines()[-1:]}"


def closing_line(text: str) -> str:
    lines = [ln.strip("= ").strip() for ln in text.splitlines()
             if re.search(r"\d+ (passed|failed|error)", ln) or "no tests ran" in ln]
    return lines[-1] if lines else "(no closing line)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scope", choices=sorted(SCOPES), default="reference",
                   help="reference: tests marked `reference`, slow ones included (default); all: `make test`'s")
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help=f"comma-separated, of: {', '.join(SETTINGS)} (default: all)")
    p.add_argument("--workers", type=int, default=2, help="pytest-xdist workers per setting (default 2; 0 = none)")
    p.add_argument("--out", default=str(OUT), help="JSON written here (default: %(default)s)")
    p.add_argument("pytest_args", nargs="*", help="passed on to pytest (after --)")
    ns = p.parse_args(argv)
    names = [s.strip() for s in ns.settings.split(",") if s.strip()]
    unknown = [s for s in names if s not in SETTINGS]
    if unknown or not names:
        print(f"error: unknown setting(s) {', '.join(unknown) or '(none)'}; valid: {', '.join(SETTINGS)}",
              file=sys.stderr)
        return 2
    if ns.workers < 0:
        print(f"error: --workers must be >= 0, got {ns.workers}", file=sys.stderr)
        return 2
    runs = []
    for name in names:
        env = env_for(name)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SCOPES[ns.scope]]
        if ns.workers:
            cmd += ["-n", str(ns.workers), "--dist", "worksteal"]
        cmd += ns.pytest_args
        cap = capability(env)
        print(f"{name}: {' '.join(f'{k}={v}' for k, v in SETTINGS[name].items()) or '(no override)'} "
              f"[torch: {cap}] ...", flush=True)
        t0 = time.monotonic()
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        secs = round(time.monotonic() - t0, 1)
        line = closing_line(r.stdout + r.stderr)
        ok = r.returncode == 0
        print(f"  {'PASS' if ok else 'FAIL'} in {secs} s: {line}", flush=True)
        if not ok:
            failed = [ln for ln in r.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
            for ln in failed[:20]:
                print(f"    {ln}")
        # Rows that differ from a fixture pass only as proven float ties; each says so in a warning.
        ties = sorted({ln.strip() for ln in (r.stdout + r.stderr).splitlines() if "float tie:" in ln
                       and "warnings.warn" not in ln})
        if ties:
            print(f"    {len(ties)} proven float tie(s): " + "; ".join(t.split("float tie: ", 1)[1][:160] for t in ties))
        runs.append({"setting": name, "float_ties": ties, "env": SETTINGS[name], "torch_capability_and_threads": cap,
                     "returncode": r.returncode, "passed": ok, "summary": line, "seconds": secs,
                     "failed": [ln for ln in r.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]})
    mach = machine()
    record = {"made": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "cpu": mach["cpu"],
              "key_flags": mach["key_flags"],
              "scope": ns.scope, "pytest_args": ns.pytest_args, "workers": ns.workers,
              # without it the tests on the real benchmarks' data files skip (as in `make test`)
              "data_dir_set": bool(os.environ.get("REFUSION_DATA_DIR")), "runs": runs}
    try:
        import torch

        record["torch"] = torch.__version__
    except ImportError:
        pass
    out = Path(ns.out)
    atomic_write_json(out, record)
    bad = [r["setting"] for r in runs if not r["passed"]]
    print(f"{len(runs) - len(bad)} of {len(runs)} settings passed" + (f"; failed: {', '.join(bad)}" if bad else "")
          + f"; {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
