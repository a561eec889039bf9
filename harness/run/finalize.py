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
    mean_intervals = summary.attach_intervals(run_dir, cfg, rows)  # 95% intervals from the per-sample logs
    from harness.run.rounds import apply_timing, load_timing

    # Wall-clock figures from the timed rounds (harness/run/timing.py), or marked as a single pass.
    timed = apply_timing(load_timing(run_dir, cfg), cfg, rows)
    if timed["mode"] == "interleaved":
        mean_intervals = {**{k: None for k in mean_intervals}, **timed["mean_speedup_interval"]}
    if timed.get("guard") is not None:  # run.json records what the guard saw (the figures' flag)
        atomic_write_json(run_dir / "run.json", {**read_json(run_dir / "run.json"),
                                                 "timing_result": {k: v for k, v in timed.items()
                                                                   if k != "mean_speedup_interval"}})
    from harness.run.memory_pass import apply_memory

    memory = apply_memory(run_dir, cfg, rows)  # the memory pass's decode peaks, when the run has them
    for r in rows:
        atomic_write_json(run_dir / "metrics" / f"{r['model']}__{r['task']}.json", r)
    result = summary.summary(cfg, rows, summary.warmup_compile(run_dir, cfg), mean_intervals)
    result["timing"] = {k: v for k, v in timed.items() if k != "mean_speedup_interval"}
    result["memory_pass"] = None if memory is None else {"settings": memory["settings"], "docs": memory["docs"]}
    atomic_write_json(run_dir / "summary.json", result)
    atomic_write_text(run_dir / "summary.md", summary.markdown(result))
    return result

