"""The real engine's checks (`make test-engine`, where .venv-vllm exists): `python -m harness engine-check`.

CI runs the engine's client and lifecycle against a test double (tests/test_engine.py); this command runs them
against vLLM itself on the tiny AR checkpoint and writes ``results/engine_check.json``:

1. versions: vllm, torch and transformers of .venv-vllm, and .venv's torch and transformers;
2. lifecycle: a server started, a token-id request answered, then a process holding a server killed with
   SIGTERM: no process of the server left and its port free;
3. agreement and timing: two real runs (`harness eval`, embedded suite, ``--limit``), ``ar`` beside
   ``vllm=checkpoints/tiny/ar:ar@vllm``, at batch 1 and at ``--batch-size 4``: the engine's greedy agreement
   with the transformers row (harness/run/agreement.py) and the interleaved ratio of tokens/s vLLM / ar with
   its 95% interval (harness/run/speedups.py), per task and as the mean over tasks.

Exit 0 when every check holds, 1 otherwise (the JSON says which failed).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.run.engine import EngineClient, EngineServer, EngineSpec, check_engine, free_port, port_free, server_command
from harness.run.store import atomic_write_json, read_json

REPO = Path(__file__).resolve().parents[2]
TINY_AR = REPO / "checkpoints" / "tiny" / "ar"

HOLDER = """
import json, sys, time
from harness.run.engine import EngineServer
cmd, port, log = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
s = EngineServer(cmd, port, log, health_timeout_s=600).start()
print(" ".join(map(str, sorted(s.pids()))), flush=True)
time.sleep(3600)
"""


def _lifecycle(spec: EngineSpec, tmp: Path) -> dict:
    """Start, one request, stop; then SIGTERM to a process that holds a server (module doc, 2)."""
    port = free_port()
    t0 = time.monotonic()
    server = EngineServer(server_command(spec, str(TINY_AR), port, "float32", "cpu"), port, tmp / "server.log",
                          health_timeout_s=spec.health_timeout_s).start()
    start_s = time.monotonic() - t0
    try:
        toks, wall = EngineClient(server.url).complete([1, 2, 3], max_tokens=8, stop_ids=[])
        pids = server.pids()
    finally:
        server.stop()
    left_after_stop = [p for p in pids if Path(f"/proc/{p}").exists()]
    port2 = free_port()
    cmd = server_command(spec, str(TINY_AR), port2, "float32", "cpu")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, json.dumps(cmd), str(port2), str(tmp / "held.log")],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    held = {int(p) for p in holder.stdout.readline().split()}
    holder.send_signal(signal.SIGTERM)
    holder.wait(timeout=120)
    end = time.monotonic() + 60
    while time.monotonic() < end and any(Path(f"/proc/{p}").exists() for p in held):
        time.sleep(0.2)
    left_after_sigterm = [p for p in held if Path(f"/proc/{p}").exists()]
    ok = (len(toks) == 8 and not left_after_stop and port_free(port) and len(held) >= 2 and not left_after_sigterm
          and port_free(port2))
    return {"ok": ok, "start_s": round(start_s, 1), "request_tokens": toks, "request_s": round(wall, 3),
            "processes": len(pids), "left_after_stop": left_after_stop, "port_free_after_stop": port_free(port),
            "held_processes": len(held), "left_after_sigterm": left_after_sigterm,
            "port_free_after_sigterm": port_free(port2)}


def _run(tmp: Path, limit: int, batch: int, venv: str) -> dict:
    """One real run, ar beside ar@vllm (module doc, 3): its agreement and speedups, and its wall seconds."""
    out = tmp / f"runs-b{batch}"
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "harness", "eval", "--task", "embedded", "--limit", str(limit),
                        "--models", f"ar,vllm={TINY_AR}:ar@vllm:venv={venv}", "--batch-size", str(batch),
                        "--out", str(out), "--run-id", "check"], cwd=REPO, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    if p.returncode != 0:
        return {"ok": False, "error": (p.stderr.strip().splitlines() or ["no output"])[-1], "seconds": seconds}
    s = read_json(out / "check" / "summary.json")
    vs_ar = (s.get("speedups") or {}).get("ar", {}).get("vllm") or {}
    agreement = (s.get("agreement") or {}).get("pairs", [{}])[0]
    tps = {r["task"] + "/" + r["model"]: round(r["tokens_per_s"], 1) for r in s["rows"]}
    return {"ok": bool(agreement.get("ok")) and vs_ar.get("ratio") is not None, "batch_size": batch,
            "limit": limit, "seconds": round(seconds, 1),
            "agreement": {k: agreement.get(k) for k in ("items", "equal", "share", "differences", "ok")},
            "ratio_vllm_over_ar": {"mean": vs_ar.get("ratio"), "interval": vs_ar.get("interval"),
                                   "per_task": vs_ar.get("per_task")},
            "tokens_per_s": tps, "busy": (s.get("timing") or {}).get("busy"),
            "engine_quiet_wait_s": (read_json(out / "check" / "timing.json") or {}).get("engine_quiet_wait_s")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness engine-check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--venv", default=".venv-vllm")
    p.add_argument("--limit", type=int, default=20, help="items per embedded task in each run (default 20)")
    p.add_argument("--batch-sizes", default="1,4", help="one run per batch size (default 1,4)")
    p.add_argument("--out", default=str(REPO / "results" / "engine_check.json"))
    ns = p.parse_args(argv)
    from harness.run.engine import EngineError

    spec = EngineSpec(venv=ns.venv)
    try:
        versions = check_engine(spec)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch
    import transformers

    result: dict = {"versions": {"engine_venv": {k: v for k, v in versions.items() if k != "python"},
                                 "harness_venv": {"torch": torch.__version__, "transformers": transformers.__version__}},
                    "checkpoint": str(TINY_AR.relative_to(REPO)), "dtype": "float32", "device": "cpu"}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="engine-check-") as tmp:
        result["lifecycle"] = _lifecycle(spec, Path(tmp))
        print(f"lifecycle: {'ok' if result['lifecycle']['ok'] else 'FAILED'}", file=sys.stderr, flush=True)
        result["runs"] = []
        for b in (int(x) for x in ns.batch_sizes.split(",")):
            got = _run(Path(tmp), ns.limit, b, ns.venv)
            result["runs"].append(got)
            r = got.get("ratio_vllm_over_ar") or {}
            a, iv = got.get("agreement") or {}, r.get("interval") or {}
            print(f"batch {b}: agreement {a.get('equal')}/{a.get('items')}, tokens/s vllm/ar {r.get('mean')} "
                  f"[{iv.get('lo')}, {iv.get('hi')}] ({got['seconds']} s)"
                  + ("" if got["ok"] else f" FAILED {got.get('error')}"), file=sys.stderr, flush=True)
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["ok"] = result["lifecycle"]["ok"] and all(r["ok"] for r in result["runs"])
    atomic_write_json(Path(ns.out), result)
    print(f"engine check {'ok' if result['ok'] else 'FAILED'}: {ns.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
