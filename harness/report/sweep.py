"""`python -m harness sweep` / `make sweep`: ReFusion's quality vs tokens/s as one knob at a time varies.

    python -m harness sweep                                   # embedded suite, default grid, limit 8
    python -m harness sweep --grid 'slot_size=2,4,8;token_threshold=0.1,0.3,0.6' --limit 20

Every variant starts from the ``refusion`` preset's knobs and changes one knob
(the paper's ablation view); the preset itself is the shared point of all curves.
``ar`` and ``refusion_left_to_right`` run as reference points. All variants are
models of one ``harness eval`` run (``OUT/<run id>``; the id is a hash of the
settings, so re-running the same sweep resumes it and a changed one starts
anew). Any option not listed here is passed on to ``harness eval`` (e.g.
``--threads 1``, ``--device cuda``). Results: ``reports/<name>/sweep.json`` (per
point: the knobs, mean quality and mean tokens/s over the tasks, per-task values)
and ``sweep.png``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from harness.run.presets import PRESETS

DEFAULT_GRID = "slot_threshold=0.3,0.6,0.9;token_threshold=0.1,0.3,0.6;slot_size=2,4,8"
# 7 ReFusion variants + 2 references on the embedded suite (3 tasks): at 8 documents per task the
# default sweep is sized to finish in about 10 minutes on 2 cores with the tiny checkpoints.
DEFAULT_LIMIT = 8
REFERENCES = ("ar", "refusion_left_to_right")


class InputError(Exception):
    """Bad user input: one line, exit 2, nothing written."""


def parse_grid(text: str) -> dict[str, list]:
    """``knob=v1,v2;knob2=...`` -> {knob: [values]} (values typed as lm-eval parses model args)."""
    from harness.run.model_list import literal as _value

    grid: dict[str, list] = {}
    for part in [p.strip() for p in text.split(";") if p.strip()]:
        knob, eq, vals = part.partition("=")
        values = [_value(v.strip()) for v in vals.split(",") if v.strip()]
        if not eq or not knob.strip() or not values:
            raise InputError(f"bad grid entry {part!r}: expected knob=value,value,...")
        if knob.strip() in grid:
            raise InputError(f"knob {knob.strip()!r} appears twice in the grid")
        grid[knob.strip()] = values
    if not grid:
        raise InputError("empty grid; expected e.g. " + DEFAULT_GRID)
    return grid


def _slug(v) -> str:
    return str(v).replace("-", "m")


def variants(grid: dict[str, list], base: dict) -> list[dict]:
    """One entry per distinct knob set: {name, knob, value, knobs}; the base point is named ``refusion``."""
    out: dict[str, dict] = {"refusion": {"name": "refusion", "knob": None, "value": None, "knobs": dict(base)}}
    for knob, values in grid.items():
        for v in values:
            knobs = {**base, knob: v}
            name = "refusion" if knobs == base else f"rf_{knob}_{_slug(v)}"
            out.setdefault(name, {"name": name, "knob": knob, "value": v, "knobs": knobs})
    return list(out.values())


def _spec(name: str, ckpt: str, decoder: str, knobs: dict) -> str:
    return f"{name}={ckpt}:{decoder}" + (":" + ",".join(f"{k}={v}" for k, v in knobs.items()) if knobs else "")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", default=DEFAULT_GRID, help="knob=v,v;knob=v,... (default: %(default)s)")
    p.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help="documents per task (default: %(default)s)")
    p.add_argument("--task", default="embedded", help="task, group or comma list (default: %(default)s)")
    p.add_argument("--refusion", default=PRESETS["refusion"].checkpoint, help="ReFusion checkpoint "
                   "(default: %(default)s)")
    p.add_argument("--ar", default=PRESETS["ar"].checkpoint, help="AR reference checkpoint (default: %(default)s)")
    p.add_argument("--out", default="results/runs", help="runs folder (default: %(default)s)")
    p.add_argument("--run-id", default=None, help="run id (default: sweep-<hash of the settings>)")
    p.add_argument("--reports", default="reports", help="reports folder (default: %(default)s)")
    p.add_argument("--name", default="sweep", help="report folder name (default: %(default)s)")
    return p


def summarize(rs, points: list[dict]) -> list[dict]:
    """Mean quality (%) and mean tokens/s over the run's tasks for every model (Table 1's Avg rule)."""
    from harness.report.paper_report import quality_pct, tps

    out = []
    for pt in points:
        mets = {u: met for (m, u), met in rs.metrics.items() if m == pt["name"]}
        q = [quality_pct(x) for x in mets.values()]
        t = [tps(x) for x in mets.values()]
        f = [x["speed"]["tpf"]["ratio_of_sums"] for x in mets.values()]
        ok = mets and None not in q and None not in t
        out.append({**pt, "quality": sum(q) / len(q) if ok else None, "tokens_per_s": sum(t) / len(t) if ok else None,
                    "tpf": sum(f) / len(f) if ok and None not in f else None,
                    "per_task": {u: {"quality": quality_pct(x), "tokens_per_s": tps(x),
                                     "tpf": x["speed"]["tpf"]["ratio_of_sums"], "samples": x["speed"]["samples"]}
                                 for u, x in sorted(mets.items())}})
    return out


def figure(points: list[dict], grid: dict[str, list], title: str):
    """One curve per knob (ordered by value, each point labelled), references as single markers."""
    from harness.report.figures import _fig, _legend

    fig, ax = _fig()
    base = next(p for p in points if p["name"] == "refusion")
    for i, knob in enumerate(grid):
        curve = [p for p in points if p["knob"] == knob or (p["name"] == "refusion" and knob in p["knobs"])]
        curve = [p for p in curve if p["quality"] is not None]
        curve.sort(key=lambda p: p["knobs"][knob])
        xs, ys = [p["tokens_per_s"] for p in curve], [p["quality"] for p in curve]
        ax.plot(xs, ys, marker="o", color=f"C{i}", label=f"refusion, {knob} varies")
        for p in curve:
            if p is not base:  # the shared base point is labelled once, below
                ax.annotate(f"{p['knobs'][knob]}", (p["tokens_per_s"], p["quality"]), fontsize=6,
                            textcoords="offset points", xytext=(4, 4 + 6 * i), color=f"C{i}")
    if base["quality"] is not None:
        ax.annotate("base", (base["tokens_per_s"], base["quality"]), fontsize=7, textcoords="offset points",
                    xytext=(4, -10))
    for j, ref in enumerate(REFERENCES):
        p = next((x for x in points if x["name"] == ref and x["quality"] is not None), None)
        if p is not None:
            ax.scatter([p["tokens_per_s"]], [p["quality"]], marker="*^"[j], s=120, color="black" if j == 0 else "0.5",
                       zorder=3, label=ref)
    ax.margins(0.12)  # room for the value labels
    ax.set_xlabel("throughput (generated tokens / s, mean over tasks)")
    ax.set_ylabel("quality (%, mean over tasks)")
    knobs = ", ".join(f"{k}={v}" for k, v in base["knobs"].items())
    ax.set_title(f"{title}\nbase: {knobs}", fontsize=9)
    ax.grid(True, alpha=0.3)
    _legend(ax)
    return fig


def main(argv: list[str] | None = None) -> int:
    ns, passthrough = _parser().parse_known_args(argv)
    import matplotlib.pyplot as plt

    from harness.run import runner
    from harness.report.figures import save_png
    from harness.report.paper_report import load_runs
    from harness.run.store import atomic_dir, atomic_write_json

    base = dict(PRESETS["refusion"].knobs)
    try:
        if ns.limit < 1:
            raise InputError(f"--limit must be >= 1, got {ns.limit}")
        grid = parse_grid(ns.grid)
        from refusion.decoding import DECODERS

        accepted = set(DECODERS["refusion"].knobs.names())
        bad = sorted(k for k in grid if k not in accepted)
        if bad:
            from harness.run.hints import did_you_mean

            raise InputError(f"unknown refusion knob(s) {', '.join(bad)}{did_you_mean(bad[0], accepted)}; valid knobs: "
                             f"{', '.join(sorted(accepted))}")
        if not ns.name or ns.name.startswith(".") or "/" in ns.name:
            raise InputError(f"--name {ns.name!r}: use a plain folder name")
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    points = variants(grid, base)
    points += [{"name": "ar", "knob": None, "value": None, "knobs": {}},
               {"name": "refusion_left_to_right", "knob": None, "value": None,
                "knobs": {**base, "left_to_right": True}}]
    specs = [_spec("ar", ns.ar, "ar", {})]
    specs += [_spec(p["name"], ns.refusion, "refusion", p["knobs"]) for p in points if p["name"] != "ar"]
    settings = {"grid": grid, "limit": ns.limit, "task": ns.task, "models": specs, "extra": passthrough}
    run_id = ns.run_id or "sweep-" + hashlib.sha256(json.dumps(settings, sort_keys=True, default=str)
                                                    .encode()).hexdigest()[:10]
    rc = runner.main(["--task", ns.task, "--limit", str(ns.limit), "--models", ",".join(specs),
                      "--out", ns.out, "--run-id", run_id, "--baseline", "ar", *passthrough])
    if rc != 0:
        return rc
    run_dir = Path(ns.out) / run_id
    rs = load_runs([run_dir])
    summary = summarize(rs, points)
    target = Path(ns.reports) / ns.name
    with atomic_dir(target) as tmp:
        atomic_write_json(tmp / "sweep.json", {
            "run_dir": str(run_dir), "task": ns.task, "limit": ns.limit, "grid": grid, "base_knobs": base,
            "convention": "quality = mean over tasks of the primary metric (%); tokens_per_s = mean over tasks "
                          "of each task's ratio-of-sums tokens/s (the Avg rule of Table 1)",
            "environment": rs.runs[0].get("environment"), "points": summary})
        fig = figure(summary, grid, f"ReFusion knob sweep ({ns.task}, limit {ns.limit})")
        save_png(fig, tmp / "sweep.png")
        plt.close(fig)
    print(f"wrote {target}/sweep.json and sweep.png ({len(summary)} points from run {run_dir})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
