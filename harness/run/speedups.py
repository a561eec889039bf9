"""Speedups against every AR baseline of a run: the run's baseline (the transformers ``ar`` row, ``--baseline``)
and each engine row (``ar@vllm``: the AR model as it is served, docs/engines.md). The run's baseline keeps its
place in every figure the harness had before (metrics ``speedup``, the summary's speedup column); this module
adds the others beside it, from the same timed rounds and by the same statistic (harness/run/timing.py
``ratio`` / ``mean_ratio``: the median over disjoint round pairs, with its bootstrap interval), so that a
reader sees each model's speedup against the AR model as the paper measured it and as people deploy it.

    ar_baselines(cfg)            ["ar", "qwen3_vllm"]: the run's baseline first, then the engine rows
    baseline_label(cfg, name)    "ar (transformers)" / "qwen3_vllm (vLLM, latency at client)"
    all_speedups(timing, cfg)    {baseline: {model: {"ratio", "interval", "statistic", "per_task": {task: ...}}}}
"""

from __future__ import annotations

from typing import Any


def ar_baselines(cfg: dict) -> list[str]:
    """The AR rows every speedup is shown against: the run's baseline, then every engine row (in run order)."""
    out = [cfg["baseline"]] if cfg.get("baseline") else []
    out += [m["name"] for m in cfg["models"] if m.get("engine") and m["name"] not in out]
    return out


def engine_of(cfg: dict, name: str) -> str | None:
    m = next((m for m in cfg["models"] if m["name"] == name), None)
    return (m.get("engine") or {}).get("name") if m else None


def baseline_label(cfg: dict, name: str) -> str:
    """How a column header names a baseline: the row and what runs it."""
    eng = engine_of(cfg, name)
    if eng:
        return f"{name} ({'vLLM' if eng == 'vllm' else eng}, at client)"
    m = next((m for m in cfg["models"] if m["name"] == name), {})
    return f"{name} (transformers)" if m.get("decoder") == "ar" else name


def all_speedups(timed: dict | None, cfg: dict) -> dict[str, dict[str, Any]]:
    """Per AR baseline, per other model: the mean per-task speedup (point, interval, statistic) and each task's
    (point, interval), from the timed rounds' records (timing.json). A (model, baseline) pair that no pass
    timed together is left out; {} for a run without timed rounds."""
    from harness.run import timing

    if not timed or not timed.get("passes"):
        return {}
    units = [u["name"] for u in cfg["units"]]
    out: dict[str, dict[str, Any]] = {}
    for base in ar_baselines(cfg):
        per_model: dict[str, Any] = {}
        for m in cfg["models"]:
            name = m["name"]
            if name == base:
                continue
            ps = next((p for p in timed["passes"] if name in p["sides"] and base in p["sides"]), None)
            if ps is None:
                continue
            tasks = {}
            for u in units:
                q = timing.ratio(ps["records"], name, base, u)
                if q is not None:
                    tasks[u] = {"ratio": q["ratio"], "interval": q["interval"]}
            if not tasks:
                continue
            mean = timing.mean_ratio(ps["records"], name, base, list(tasks))
            per_model[name] = {"ratio": mean["ratio"] if mean else None,
                               "interval": mean["interval"] if mean else None,
                               "statistic": mean["statistic"] if mean else None, "per_task": tasks}
        if per_model:
            out[base] = per_model
    return out


def lines(s: dict) -> list[str]:
    """The summary's lines for the baselines after the run's own (which keeps its line): one per baseline."""
    from harness.run.stats import fmt_interval

    sp = s.get("speedups") or {}
    labels = s.get("baseline_labels") or {}
    out = []
    for base, per in sp.items():
        if base == s.get("baseline") or not per:
            continue
        out.append(f"Mean per-task speedup vs {labels.get(base, base)} [95% CI]: " + ", ".join(
            f"{k} {v['ratio']:.2f}x{fmt_interval(v['interval'], '.2f')}" for k, v in per.items()
            if v.get("ratio") is not None))
    return out
