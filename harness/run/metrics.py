"""Aggregate per-sample decode records into the figures docs/design.md §6 defines.

A sample record (one journal line) carries at least ``generated_tokens``,
``nfe``, ``decode_s`` (the decoder call only, after warm-up, device
synchronised) and optionally ``forward_s`` (time inside model calls), per-phase
``nfe_*`` counts, ``kv_peak_bytes`` and ``gpu_peak_bytes``, and under the decoder knob ``compile``
``compiled``, ``compilations`` and ``compile_s`` (warm-up seconds, already left out of ``decode_s``).
Everything here is a pure function of those records, so a
resumed run that reads the same records back produces the same figures.
"""

from __future__ import annotations

import math
from typing import Iterable


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolation percentile (same rule as numpy's default), ``q`` in [0, 100]."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def latency_of(rec: dict) -> float:
    """A request's latency (seconds): from its submission (the start of its decoder call) to its completion.
    A batch releases its rows together, so every row's latency is the whole call's time (``latency_s``; a
    record written before it was recorded: its ``decode_s`` share times the batch size). ``decode_s`` stays the
    row's share of the call, so that sums over rows give the decode time and tokens/s stays MLPerf's offline
    throughput (docs/design.md §6)."""
    if rec.get("latency_s") is not None:
        return float(rec["latency_s"])
    return float(rec["decode_s"]) * int(rec.get("batch_size") or 1)


def aggregate(records: Iterable[dict]) -> dict:
    """Speed / work / memory figures over the generation samples of one (model, task)."""
    # A failed item (harness/run/faults.py) has no tokens or time: counted apart, not in these figures.
    recs = [r for r in records if r.get("kind", "generate") == "generate" and not r.get("failed")]
    gen = [int(r["generated_tokens"]) for r in recs]
    nfe = [int(r["nfe"]) for r in recs]
    secs = [float(r["decode_s"]) for r in recs]  # each row's share of its call: sums are decode time
    lat = [latency_of(r) for r in recs]  # each request's latency: its whole call
    out: dict = {
        "samples": len(recs),
        "generated_tokens": {"total": sum(gen), "mean": _mean(gen)},
        "latency_s": {"mean": _mean(lat), "p50": percentile(lat, 50), "p90": percentile(lat, 90),
                      "total": sum(secs)},
        "tokens_per_s": {
            # The authors' TPS: total tokens over total decode time.
            "ratio_of_sums": (sum(gen) / sum(secs)) if sum(secs) > 0 else None,
            "mean_of_ratios": _mean([g / t for g, t in zip(gen, secs) if t > 0]),
        },
        "nfe": {"total": sum(nfe), "mean": _mean(nfe)},
        "tpf": {
            "ratio_of_sums": (sum(gen) / sum(nfe)) if sum(nfe) > 0 else None,
            "mean_of_ratios": _mean([g / n for g, n in zip(gen, nfe) if n > 0]),
        },
    }
    fwd = [float(r["forward_s"]) for r in recs if r.get("forward_s") is not None]
    # Share of decode time spent outside model calls (decoder bookkeeping, cache surgery, masks).
    out["outside_forward_share"] = (1 - sum(fwd) / sum(secs)) if fwd and len(fwd) == len(recs) and sum(secs) > 0 \
        else None
    phases = sorted({k for r in recs for k in r if k.startswith("nfe_")})
    out["nfe_by_phase"] = {k: sum(int(r.get(k, 0)) for r in recs) for k in phases}
    kv = [int(r["kv_peak_bytes"]) for r in recs if r.get("kv_peak_bytes") is not None]
    gpu = [int(r["gpu_peak_bytes"]) for r in recs if r.get("gpu_peak_bytes") is not None]
    # Compiled decoding (knob compile): graphs compiled and their seconds, apart from the decode time above.
    out["compile"] = {"compiled": any(bool(r.get("compiled")) for r in recs),
                      "compilations": sum(int(r.get("compilations") or 0) for r in recs),
                      "compile_s": sum(float(r.get("compile_s") or 0.0) for r in recs)}
    out["memory"] = {
        "kv_peak_bytes": max(kv) if kv else None,
        "gpu_peak_bytes": max(gpu) if gpu else None,
    }
    return out


def speedup(tps: float | None, baseline_tps: float | None) -> float | None:
    """TPS(model) / TPS(baseline), same task, same run (docs/design.md §6)."""
    if not tps or not baseline_tps:
        return None
    return tps / baseline_tps


def quality_metrics(task_results: dict) -> dict[str, float]:
    """Numeric metrics of one task from lm-eval's ``results[task]`` (stderr and aliases dropped)."""
    out: dict[str, float] = {}
    for k, v in task_results.items():
        if k in ("alias", "samples", "name", "sample_len") or "stderr" in k:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        out[k] = float(v)
    return out


def withheld_verdicts(rows: Iterable[dict]) -> dict:
    """The code verdicts of a (model, task) that may depend on a package the sandbox did not give (sample rows
    marked ``sandbox_withheld`` by the worker; tasks/sandbox.py: withheld_imports): count and items."""
    items = sorted(({"task": r["task"], "doc_id": r["doc_id"], "modules": r["sandbox_withheld"]} for r in rows
                    if r.get("sandbox_withheld")), key=lambda f: (f["task"], str(f["doc_id"])))
    return {"count": len(items), "items": items}
