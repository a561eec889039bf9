"""Run summary: one row per (model, task), as JSON, a Markdown table and a console table."""

from __future__ import annotations

from pathlib import Path


def _row(m: dict) -> dict:
    q = m.get("quality", {})
    prim = m.get("quality_primary")
    s = m["speed"]
    return {
        "model": m["model"], "task": m["task"], "decoder": m["decoder"], "samples": s["samples"],
        "quality_metric": prim, "quality": q.get(prim) if prim else None,
        "tokens_per_s": s["tokens_per_s"]["ratio_of_sums"], "tokens_per_s_mean_of_ratios": s["tokens_per_s"][
            "mean_of_ratios"],
        "tpf": s["tpf"]["ratio_of_sums"], "nfe_mean": s["nfe"]["mean"], "generated_tokens": s["generated_tokens"]["total"],
        "latency_mean_s": s["latency_s"]["mean"], "latency_p50_s": s["latency_s"]["p50"],
        "latency_p90_s": s["latency_s"]["p90"], "speedup": (m.get("speedup") or {}).get("tokens_per_s"),
        "peak_rss_bytes": m["memory"].get("peak_rss_bytes"), "kv_peak_bytes": m["memory"].get("kv_peak_bytes"),
        "gpu_peak_bytes": m["memory"].get("gpu_peak_bytes"),
        "outside_forward_share": s.get("outside_forward_share"),
    }


def summary(cfg: dict, metrics: list[dict]) -> dict:
    rows = [_row(m) for m in metrics]
    # Mean over tasks of the per-task speedup: the paper's headline convention (docs/design.md §6).
    by_model: dict[str, list[float]] = {}
    for r in rows:
        if r["speedup"] is not None:
            by_model.setdefault(r["model"], []).append(r["speedup"])
    return {
        "run_id": cfg.get("run_id"), "task": cfg["task"], "limit": cfg["limit"], "baseline": cfg.get("baseline"),
        "models": [m["name"] for m in cfg["models"]], "units": [u["name"] for u in cfg["units"]],
        "rows": rows, "mean_speedup": {k: sum(v) / len(v) for k, v in by_model.items()},
        "environment": cfg.get("environment"),
    }


def _fmt(v, spec: str = ".3f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


COLUMNS = [("model", "model", None), ("task", "task", None), ("n", "samples", None),
           ("quality", "quality", ".3f"), ("tok/s", "tokens_per_s", ".1f"), ("speedup", "speedup", ".2f"),
           ("TPF", "tpf", ".2f"), ("NFE/sample", "nfe_mean", ".1f"), ("lat p50 s", "latency_p50_s", ".3f"),
           ("lat p90 s", "latency_p90_s", ".3f"), ("RSS MiB", "peak_rss_bytes", None),
           ("KV KiB", "kv_peak_bytes", None)]


def _cells(r: dict) -> list[str]:
    out = []
    for _, key, spec in COLUMNS:
        v = r.get(key)
        if key == "peak_rss_bytes" and v is not None:
            v = f"{v / 2**20:.0f}"
        elif key == "kv_peak_bytes" and v is not None:
            v = f"{v / 2**10:.1f}"
        out.append(_fmt(v, spec) if spec else _fmt(v))
    return out


def markdown(s: dict) -> str:
    head = [c[0] for c in COLUMNS]
    lines = [f"# Run {s['run_id']}: {s['task']} (limit {s['limit']}, speedup vs {s['baseline']})", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in s["rows"]]
    if s["mean_speedup"]:
        lines += ["", "Mean per-task speedup: " + ", ".join(f"{k} {v:.2f}x" for k, v in s["mean_speedup"].items())]
    env = s.get("environment") or {}
    lines += ["", f"Quality metric per task: " + ", ".join(sorted({f"{r['task']}={r['quality_metric']}"
                                                                  for r in s["rows"]})),
              f"Environment: commit {env.get('git_commit')}{' (dirty)' if env.get('git_dirty') else ''}, "
              f"{env.get('device')}, {env.get('threads_per_process')} threads x {env.get('num_processes')} process(es), "
              f"seed {env.get('seed')}, torch {(env.get('packages') or {}).get('torch')}, "
              f"lm-eval {(env.get('packages') or {}).get('lm-eval')}", ""]
    return "\n".join(lines)


def table(s: dict) -> str:
    head = [c[0] for c in COLUMNS]
    body = [_cells(r) for r in s["rows"]]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*b) for b in body])


def one_line(s: dict, run_dir: Path) -> str:
    parts = [f"{k} {v:.2f}x" for k, v in s["mean_speedup"].items() if k != s["baseline"]]
    return (f"done: {len(s['models'])} model(s) x {len(s['units'])} task(s), {sum(r['samples'] for r in s['rows'])} "
            f"samples; mean speedup vs {s['baseline']}: {', '.join(parts) or '-'}; results in {run_dir}")
