"""Each decoder's accuracy-parallelism frontier in a report, and its AUP (docs/design.md §6e).

A frontier run (`make frontier`, harness/report/frontier.py) keeps ``frontier_plan.json`` in its run folder:
which model of the run is which point of which decoder's grid. ``write`` turns such a run into, per task,
accuracy against TPF and against tokens/s (one line per model, 95% intervals, the Pareto set ringed), ``aup.md``
(AUP per model and task) and ``frontier.json``; `make report` calls it for every run (nothing for other runs).

Against each AR baseline among the run's models (each model decoded by ``ar``: the transformers row and an engine
row such as ``ar@vllm``), every point also gets its speedup (its tokens/s over the baseline's on the task) and a
figure of accuracy against that speedup, ``frontier_<task>_speedup_<baseline>.png``. The interval comes from the
run's timed rounds when both were timed in one pass (``ratio_in_run``), else from a paired bootstrap over the
items both decoded.

AUP (accuracy under parallelism, d3LLM): accuracy y in percent, parallelism rho = TPF; the points sorted by rho;
those with y below the first point's y minus ``Y_OFFSET`` dropped; AUP = rho_1 y_1 + sum_i (rho_i - rho_{i-1})
(y_i W(y_i) + y_{i-1} W(y_{i-1})) / 2 with W(y) = min(exp(-ALPHA (1 - y / y_max)), 1), y_max the best accuracy of
any point of any model on that task. Its 95% interval: a bootstrap over items, every point resampled with the
same items (y_max recomputed in each resample).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from harness.report.timed import is_timed, speed_interval
from harness.run import stats

ALPHA = 3.0  # W's penalty for accuracy below y_max (d3LLM)
Y_OFFSET = 5.0  # points below the first point's accuracy minus this (points of %) are dropped (d3LLM)
PLAN_FILE = "frontier_plan.json"  # in the run folder: which model of the run is which point of which grid
FIGURE = ("tpf", "TPF (generated tokens per forward)"), ("tokens_per_s", "throughput (generated tokens / s)")


# ---------------------------------------------------------------- AUP


def weight(y: float, y_max: float, alpha: float = ALPHA) -> float:
    """W(y) = min(exp(-alpha (1 - y / y_max)), 1): 1 at the best accuracy, smaller below it."""
    if y_max <= 0:
        return 1.0
    return min(math.exp(-alpha * (1 - y / y_max)), 1.0)


def kept_points(points: list[tuple[float, float]], offset: float = Y_OFFSET) -> list[tuple[float, float]]:
    """(rho, y) pairs sorted by rho (ties in the given order), without those below the first one's y - offset."""
    ordered = sorted(points, key=lambda p: p[0])
    if not ordered:
        return []
    floor = ordered[0][1] - offset
    return [p for p in ordered if p[1] >= floor]


def aup(points: list[tuple[float, float]], y_max: float, alpha: float = ALPHA, offset: float = Y_OFFSET) -> float:
    """d3LLM's AUP of (rho = TPF, y = accuracy in %) points (module doc); ValueError without a point or with a
    rho <= 0."""
    if not points:
        raise ValueError("AUP needs at least one (TPF, accuracy) point")
    if any(not r > 0 for r, _ in points):
        raise ValueError(f"AUP needs every TPF > 0, got {[r for r, _ in points]}")
    kept = kept_points(points, offset)
    total = kept[0][0] * kept[0][1]  # the first point's term is not weighted
    for (r0, y0), (r1, y1) in zip(kept, kept[1:]):
        total += 0.5 * (r1 - r0) * (y1 * weight(y1, y_max, alpha) + y0 * weight(y0, y_max, alpha))
    return total


def read_plan(run_dir: str | Path) -> list[dict] | None:
    """A frontier run's groups (harness/report/frontier.py ``Group.to_dict``), or None for any other run."""
    path = Path(run_dir) / PLAN_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))["groups"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def not_own_points(rs) -> set[str]:
    """Row names of a frontier's points other than each model's own setting (a report's speedup references
    leave them out: every threshold of every baseline would be a reference)."""
    out = set()
    for r in rs.runs:
        for g in read_plan(r["dir"]) or []:
            out.update(p["name"] for p in g["points"] if not p["own"])
    return out


# ---------------------------------------------------------------- the frontier of a run


def pareto(points: list[dict], x: str) -> list[str]:
    """Names of the points no other point beats on both ``x`` and accuracy (at least as good on both, better on
    one); points without either figure take no part."""
    ok = [p for p in points if p.get(x) is not None and p.get("quality") is not None]
    return [p["name"] for p in ok
            if not any(q[x] >= p[x] and q["quality"] >= p["quality"] and (q[x] > p[x] or q["quality"] > p["quality"])
                       for q in ok)]


def _interval(dist: np.ndarray | None, method: str = "bootstrap") -> dict | None:
    got = stats.percentile_interval(dist) if dist is not None else None
    return None if got is None else {"lo": got[0], "hi": got[1], "method": method}


def _point(g: dict, p: dict, met: dict, unit: str, it: stats.Items | None) -> dict:
    """One point on one task: accuracy (%), TPF and tokens/s, each with its 95% interval."""
    prim = met.get("quality_primary")
    q = (met.get("quality") or {}).get(prim) if prim else None
    n = ((met.get("speed") or {}).get("samples") or 0) + (met.get("failed") or {}).get("count", 0)
    qiv = stats.quality_interval(it, q, n, (unit, "quality"))
    speed = met.get("speed") or {}
    return {"model": g["model"], "decoder": g["decoder"], "name": p["name"], "knobs": p["knobs"], "own": p["own"],
            "items": n, "quality": None if q is None else 100.0 * q,
            "quality_ci": None if qiv is None else qiv.scaled(100.0).to_dict(),
            "tpf": (speed.get("tpf") or {}).get("ratio_of_sums"),
            "tpf_ci": _interval(stats.speed_dist(it, "tpf", unit)) if it is not None else None,
            "timed": is_timed(met),
            "tokens_per_s": (speed.get("tokens_per_s") or {}).get("ratio_of_sums"),
            "tokens_per_s_ci": (speed_interval(met, "tokens_per_s") if is_timed(met) else
                                _interval(stats.speed_dist(it, "tokens_per_s", unit)) if it is not None else None)}


def baselines(groups: list[dict]) -> list[str]:
    """The AR baselines of a frontier run: the own point of every model decoded by ``ar`` (the transformers row,
    an engine row), in the run's order."""
    return [p["name"] for g in groups if g["decoder"] == "ar" for p in g["points"] if p["own"]]


def speedup_key(ref: str) -> str:
    return f"speedup:{ref}"


def _speedup(met: dict, ref_met: dict, unit: str, it: stats.Items | None, ref_it: stats.Items | None) -> dict | None:
    """A point's tokens/s over a baseline's on one task (module doc): {"ratio", "interval"}; None when neither the
    timed rounds nor shared items give one."""
    from harness.report.timed import ratio_in_run

    if is_timed(met) and is_timed(ref_met) and met["_run_dir"] == ref_met["_run_dir"]:
        got = ratio_in_run(met["_run_dir"], met["model"], ref_met["model"], [unit])
        q = got and got["per_unit"][unit]
        if q:
            return {"ratio": q["ratio"], "interval": q["interval"]}
    if it is None or ref_it is None:
        return None
    q = stats.paired_ratio(ref_it, it, "tokens_per_s", (unit, "frontier speedup"))
    return None if q is None else {"ratio": q["ratio"], "interval": q.get("interval")}


def _add_speedups(pts: list[dict], mets: dict[str, dict], items: dict, unit: str, refs: list[str]) -> None:
    """Each point's speedup over each baseline, as ``speedup:<ref>`` and its ``_ci`` (the baseline itself: 1)."""
    for ref in refs:
        key = speedup_key(ref)
        for p in pts:
            if ref not in mets:
                p[key] = p[f"{key}_ci"] = None
            elif p["name"] == ref:
                p[key], p[f"{key}_ci"] = 1.0, None
            else:
                got = _speedup(mets[p["name"]], mets[ref], unit, items.get(p["name"]), items.get(ref))
                iv = got and got["interval"]
                p[key] = got and got["ratio"]
                p[f"{key}_ci"] = {"lo": iv["lo"], "hi": iv["hi"], "method": iv.get("method", "paired bootstrap over "
                                                                                  "items")} if iv else None


def _usable(pts: list[dict]) -> list[dict]:
    return [p for p in pts if p["quality"] is not None and p["tpf"] is not None and p["tpf"] > 0]


def _aup_dists(unit: str, pts: list[dict], items: dict[str, stats.Items | None]) -> dict[str, np.ndarray] | None:
    """Per model, AUP over bootstrap resamples of the task's items, every point with the same items (the items
    all points scored; y_max recomputed per resample). None when a point has no per-item log."""
    use = _usable(pts)
    its = [items.get(p["name"]) for p in use]
    if not use or any(it is None or not it.has_scores for it in its):
        return None
    keys = set(its[0].keys).intersection(*(it.keys for it in its[1:]))
    keys = [k for k in its[0].keys if k in keys]
    if not keys:
        return None
    its = [it.take(keys) for it in its]
    score = [it.score for it in its]
    toks = [np.where(it.decoded, it.tokens, 0.0) for it in its]
    nfe = [np.where(it.decoded, it.nfe, 0.0) for it in its]
    members: dict[str, list[int]] = {}
    for i, p in enumerate(use):
        members.setdefault(p["model"], []).append(i)
    out: dict[str, list[float]] = {m: [] for m in members}
    for idx in stats.resamples(len(keys), (unit, "frontier")):
        y = np.stack([100.0 * s[idx].mean(axis=-1) for s in score])  # [points, r]
        with np.errstate(divide="ignore", invalid="ignore"):
            rho = np.stack([t[idx].sum(axis=-1) / f[idx].sum(axis=-1) for t, f in zip(toks, nfe)])
        y_max = y.max(axis=0)
        for j in range(idx.shape[0]):
            for m, rows in members.items():
                got = [(float(rho[i, j]), float(y[i, j])) for i in rows if np.isfinite(rho[i, j]) and rho[i, j] > 0]
                out[m].append(aup(got, float(y_max[j])) if got else math.nan)
    return {m: np.array(v) for m, v in out.items()}


def task_frontier(unit: str, groups: list[dict], rs) -> dict:
    """One task's frontier: every point, y_max, per model its AUP (with its interval, the points kept and dropped)
    and the Pareto sets against TPF and against tokens/s."""
    pts, items, mets = [], {}, {}
    for g in groups:
        for p in g["points"]:
            met = rs.metrics.get((p["name"], unit))
            if met is None:
                continue
            it = stats.cached_items(met["_run_dir"], met.get("model", p["name"]), unit, met.get("quality_primary"))
            items[p["name"]], mets[p["name"]] = it, {**met, "model": met.get("model", p["name"])}
            pts.append(_point(g, p, met, unit, it))
    refs = baselines(groups)
    _add_speedups(pts, mets, items, unit, refs)
    use = _usable(pts)
    y_max = max((p["quality"] for p in use), default=None)
    dists = _aup_dists(unit, pts, items) if use else None
    models: dict[str, dict] = {}
    for g in groups:
        mine = [p for p in use if p["model"] == g["model"]]
        if not mine or y_max is None:
            continue
        ordered = sorted(mine, key=lambda p: p["tpf"])  # kept_points' rule, by name
        kept_names = [p["name"] for p in ordered if p["quality"] >= ordered[0]["quality"] - Y_OFFSET]
        models[g["model"]] = {
            "decoder": g["decoder"], "aup": aup([(p["tpf"], p["quality"]) for p in mine], y_max),
            "aup_ci": _interval(dists.get(g["model"]), "paired bootstrap over items") if dists else None,
            "points": len(mine), "kept": kept_names, "dropped": [p["name"] for p in mine if p["name"] not in kept_names],
            "best_accuracy": max(p["quality"] for p in mine), "max_tpf": max(p["tpf"] for p in mine)}
    return {"task": unit, "y_max": y_max, "y_max_point": next((p["name"] for p in use if p["quality"] == y_max), None),
            "points": pts, "models": models, "baselines": refs,
            "pareto": {x: pareto(pts, x) for x in [*(x for x, _ in FIGURE), *map(speedup_key, refs)]},
            "unusable": [p["name"] for p in pts if p not in use]}


def build(rs) -> dict | None:
    """The frontier of a frontier run (or of several): per task, ``task_frontier``; None for other runs."""
    groups = [g for r in rs.runs for g in (read_plan(r["dir"]) or [])]
    if not groups:
        return None
    units = list(dict.fromkeys(u["name"] for r in rs.runs for u in r["units"]))
    return {"groups": groups, "alpha": ALPHA, "y_offset": Y_OFFSET,
            "tasks": [task_frontier(u, groups, rs) for u in units]}


# ---------------------------------------------------------------- figures, tables, files


def x_name(x: str) -> str:
    """The short name of a figure's x axis: TPF, tokens/s, or the speedup over a baseline."""
    return {"tpf": "TPF", "tokens_per_s": "tokens/s"}.get(x, f"speedup over {x.partition(':')[2]}")


def figure(t: dict, x: str, xlabel: str, where: str, colors: dict):
    """Accuracy against ``x`` on one task: one line per model through its points (sorted by x), 95% intervals as
    error bars, the Pareto set ringed and joined by a dashed line, each model's AUP in the legend."""
    from harness.report.figures import _fig, _legend

    fig, ax = _fig()
    for i, (model, info) in enumerate(t["models"].items()):
        pts = sorted((p for p in t["points"] if p["model"] == model and p.get(x) is not None
                      and p["quality"] is not None), key=lambda p: p[x])
        if not pts:
            continue
        xs, ys = [p[x] for p in pts], [p["quality"] for p in pts]

        def err(key: str, vals: list[float]) -> list[list[float]]:
            ivs = [p.get(f"{key}_ci") for p in pts]
            return [[max(0.0, v - iv["lo"]) if iv else 0.0 for v, iv in zip(vals, ivs)],
                    [max(0.0, iv["hi"] - v) if iv else 0.0 for v, iv in zip(vals, ivs)]]

        color = colors.get(model, f"C{i % 10}")
        ax.errorbar(xs, ys, yerr=err("quality", ys), xerr=err(x, xs), marker="o", ms=4, capsize=2, lw=1.2,
                    color=color, label=f"{model} ({info['decoder']}), AUP {info['aup']:.1f}")
    front = sorted((p for p in t["points"] if p["name"] in t["pareto"][x]), key=lambda p: p[x])
    if front:
        ax.plot([p[x] for p in front], [p["quality"] for p in front], ls="--", color="black", lw=0.8, zorder=1)
        ax.scatter([p[x] for p in front], [p["quality"] for p in front], s=140, facecolors="none",
                   edgecolors="black", linewidths=1.0, zorder=4, label="Pareto set")
    xs = [p[x] for p in t["points"] if p.get(x)]
    if xs and min(xs) > 0 and max(xs) / min(xs) > 20:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("accuracy (%, 95% interval)")
    if x.startswith("speedup:"):
        ax.axvline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_title(f"{t['task']}: accuracy against {x_name(x)}\n{where}", fontsize=9)
    ax.grid(True, alpha=0.3)
    _legend(ax)
    return fig


def _cell(info: dict | None) -> str:
    if info is None:
        return "n/m"
    return f"{info['aup']:.1f}{stats.fmt_interval(info.get('aup_ci'), '.1f')} ({len(info['kept'])}/{info['points']})"


def aup_md(data: dict, title: str) -> str:
    """The AUP table (model x task), the definition, y_max per task, the dropped points, then every point."""
    tasks = data["tasks"]
    lines = [f"# AUP: accuracy under parallelism ({title})", "",
             "AUP (d3LLM): accuracy y in %, parallelism rho = TPF; a model's points sorted by rho, those below the "
             f"first point's accuracy minus {Y_OFFSET:g} dropped; AUP = rho_1 y_1 + sum (rho_i - rho_(i-1)) (y_i W(y_i) + "
             f"y_(i-1) W(y_(i-1))) / 2, W(y) = min(exp(-{ALPHA:g} (1 - y / y_max)), 1), y_max = the best accuracy of any "
             "point on the task. Cells: AUP [95% interval: bootstrap over items, every point resampled with the same "
             "items] (points kept / measured). A single point at TPF 1 (AR) scores its accuracy.", ""]
    head = ["model", "decoder", *[t["task"] for t in tasks]]
    body = [[g["model"], g["decoder"], *[_cell(t["models"].get(g["model"])) for t in tasks]] for g in data["groups"]]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(b) + " |" for b in body]
    lines += ["", "y_max per task: " + ", ".join(f"{t['task']} {t['y_max']:.2f} ({t['y_max_point']})"
                                                 for t in tasks if t["y_max"] is not None)]
    dropped = [f"{n} on {t['task']}" for t in tasks for m in t["models"].values() for n in m["dropped"]]
    lines += ["", "Dropped (below the model's first point minus the offset): " + (", ".join(dropped) or "none")]
    timed = {bool(p.get("timed")) for t in tasks for p in t["points"]}
    lines += ["", "tok/s: " + ("from the run's timed rounds, medians over rounds with intervals over rounds and "
                               "items (docs/design.md §6f)" if timed == {True} else
                               "a single pass (each point timed while it decoded, one after another; intervals over "
                               "items only)" if timed == {False} else "timed rounds for some points, a single pass "
                               "for the others") + "; AUP uses TPF, not tok/s."]
    if any(t.get("baselines") for t in tasks):
        lines += ["", "Speedup over <baseline>: the point's tokens/s over the AR baseline's on the task; interval "
                      "from the timed rounds both were timed in, else a paired bootstrap over the items both "
                      "decoded. The Pareto set against a speedup is the one against tok/s (one baseline per axis)."]
    for t in tasks:
        refs = t.get("baselines") or []
        lines += ["", f"## {t['task']}", "", "| point | model | knobs | TPF [95% CI] | tok/s [95% CI] | "
                  + "".join(f"speedup over {r} [95% CI] | " for r in refs)
                  + "accuracy % [95% CI] | n | Pareto (TPF) | Pareto (tok/s) |",
                  "|---|---|---|---|---|" + "---|" * len(refs) + "---|---|---|---|"]
        for p in t["points"]:
            knobs = ", ".join(f"{k}={v}" for k, v in p["knobs"].items()) or "own"
            cells = [f"{'-' if p.get(k) is None else format(p[k], spec)}{stats.fmt_interval(p.get(f'{k}_ci'), spec)}"
                     for k, spec in (("tpf", ".2f"), ("tokens_per_s", ".1f"),
                                     *((speedup_key(r), ".2f") for r in refs), ("quality", ".1f"))]
            marks = ["yes" if p["name"] in t["pareto"][x] else "" for x, _ in FIGURE]
            lines.append(f"| {p['name']} | {p['model']} | {knobs} | " + " | ".join([*cells, str(p["items"]), *marks]) + " |")
    return "\n".join(lines) + "\n"


def write(rs, folder: Path, title: str) -> dict[str, str]:
    """A frontier run's figures, aup.md and frontier.json into ``folder``; figure file -> caption ({} for a run
    that is not a frontier)."""
    import matplotlib.pyplot as plt

    from harness.report.figures import _where, model_colors, save_png
    from harness.run.store import atomic_write_json, atomic_write_text

    data = build(rs)
    if data is None:
        return {}
    colors = model_colors([g["model"] for g in data["groups"]])
    made = {}
    for t in data["tasks"]:
        if not t["models"]:
            continue
        axes = [*FIGURE, *((speedup_key(r), f"speedup over {r} (tokens/s over its tokens/s on the task)")
                           for r in t.get("baselines") or [])]
        for x, xlabel in axes:
            short = {"tokens_per_s": "tps"}.get(x) or re.sub(r"[^A-Za-z0-9_.-]", "-", x.replace(":", "_"))
            name = f"frontier_{t['task']}_{short}.png"
            fig = figure(t, x, xlabel, _where(rs), colors)
            save_png(fig, folder / name)
            plt.close(fig)
            made[name] = f"{t['task']}: accuracy against {x_name(x)}, every grid point"
    atomic_write_text(folder / "aup.md", aup_md(data, title))
    atomic_write_json(folder / "frontier.json", {**data, "definition": {
        "aup": "rho_1 y_1 + sum_i (rho_i - rho_(i-1)) (y_i W(y_i) + y_(i-1) W(y_(i-1))) / 2 over the kept points",
        "weight": "W(y) = min(exp(-alpha (1 - y / y_max)), 1)", "kept": "y >= y_1 - y_offset, points sorted by TPF",
        "y_max": "best accuracy of any point of any model on the task"}})
    return made
