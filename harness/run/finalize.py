"""Finalize a run: speedups and 95% intervals in every metrics file, the timed rounds' figures applied, and
the run summary (summary.json, summary.md) written."""

from __future__ import annotations

from pathlib import Path

from harness.run import summary
from harness.run.faults import pause_at
from harness.run.metrics import speedup
from harness.run.store import atomic_write_json, atomic_write_text, read_json


def finalize(run_dir: Path) -> dict:
    """Add speedups and 95% intervals (harness/run/stats.py) to every metrics file and write the run summary
    (JSON + Markdown)."""
    cfg = read_json(run_dir / "run.json")
    pause_at("finalize")  # a test hook: a stop signal before the summary
    rows = []
    for m in cfg["models"]:
        for u in cfg["units"]:
            p = run_dir / "metrics" / f"{m['name']}__{u['name']}.json"
            if p.exists():
                rows.append(read_json(p))
    base = cfg.get("baseline")
    base_tps = {r["task"]: r["speed"]["tokens_per_s"]["ratio_of_sums"] for r in rows if r["model"] == base}
    for r in rows:
        b = base_tps.get(r["task"])
        r["speedup"] = {"baseline": base, "tokens_per_s": speedup(r["speed"]["tokens_per_s"]["ratio_of_sums"], b)}
    means = summary.attach_intervals(run_dir, cfg, rows)  # 95% intervals from the per-sample logs
    from harness.run.rounds import apply_timing, load_timing

    # Wall-clock figures from the timed rounds (harness/run/timing.py), or marked as a single pass.
    raw = load_timing(run_dir, cfg)
    timed = apply_timing(raw, cfg, rows)
    if timed["mode"] == "interleaved":
        means = {**{k: None for k in means}, **timed["mean_speedup"]}  # the rounds' statistic, not the pass's
    # run.json records how the speed figures were timed: the guard's verdict, what was dropped, and each
    # interval's method with what it resampled
    methods = {f"{r['model']}/{r['task']}": {k: (v or {}).get("method") for k, v in (
        ("speedup", (r.get("speedup") or {}).get("interval") if r["model"] != base else None),
        ("tokens_per_s", (r.get("intervals") or {}).get("tokens_per_s")),
        ("latency_p50_s", (r.get("intervals") or {}).get("latency_p50_s")))} for r in rows}
    atomic_write_json(run_dir / "run.json", {**read_json(run_dir / "run.json"), "timing_result": {
        **{k: v for k, v in timed.items() if k != "mean_speedup"}, "interval_methods": methods,
        "mean_speedup": {k: v for k, v in means.items() if v}}})
    from harness.run.memory_pass import apply_memory

    memory = apply_memory(run_dir, cfg, rows)  # the memory pass's decode peaks, when the run has them
    for r in rows:
        atomic_write_json(run_dir / "metrics" / f"{r['model']}__{r['task']}.json", r)
    result = summary.summary(cfg, rows, summary.warmup_compile(run_dir, cfg), means)
    result["timing"] = {k: v for k, v in timed.items() if k != "mean_speedup"}
    result["memory_pass"] = None if memory is None else {"settings": memory["settings"], "docs": memory["docs"]}
    if any(m.get("engine") for m in cfg["models"]):
        # Engine rows (ar@vllm, docs/engines.md): the speedup against every AR baseline, and the engine's greedy
        # agreement with the transformers row. Only then: a run without one keeps its summary as it was.
        from harness.run import agreement, speedups

        result["speedups"] = speedups.all_speedups(raw, cfg)
        result["baseline_labels"] = {b: speedups.baseline_label(cfg, b) for b in speedups.ar_baselines(cfg)}
        result["agreement"] = agreement.check(run_dir, cfg)
        if result["agreement"] is not None:
            atomic_write_json(run_dir / "agreement.json", result["agreement"])
    atomic_write_json(run_dir / "summary.json", result)
    atomic_write_text(run_dir / "summary.md", summary.markdown(result))
    return result

