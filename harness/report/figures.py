"""Report figures (matplotlib, Agg): each builder returns a Figure, so tests can count its series.

Every figure has a title, axis labels with units and a legend, and is saved small
(``FIGSIZE`` at ``DPI``) so the committed example stays light.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

FIGSIZE = (7.0, 4.2)
DPI = 100
# This run: filled markers in colour; published points: hollow grey markers, so the two never mix up.
OURS_MARKERS = "osD^vP*Xh<>p"
PAPER_MARKERS = "osD^vP*Xh"


def model_colors(names: list[str]) -> dict[str, tuple]:
    """One colour per model for every figure of a report (tab10, then tab20's lighter shades), so a model
    is the same colour in the Pareto views, the bars, the latency lines and the memory panels."""
    base = [plt.get_cmap("tab10")(i) for i in range(10)] + [plt.get_cmap("tab20")(2 * i + 1) for i in range(10)]
    return {name: base[i % len(base)] for i, name in enumerate(dict.fromkeys(names))}


def _color(colors: dict | None, name: str, i: int):
    return (colors or {}).get(name, f"C{i % 10}")


def _left_out_line(left_out: list[str], why: str) -> str:
    """The title line naming the points a figure does not show, so a missing model is never silent."""
    if not left_out:
        return ""
    names = ", ".join(left_out[:6]) + (f" and {len(left_out) - 6} more" if len(left_out) > 6 else "")
    return f"\nnot shown: {names} ({why})"


def _fig() -> tuple[Figure, plt.Axes]:
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    return fig, ax


def _legend(ax: plt.Axes) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)


def _err(v: float, iv: dict | None) -> list[list[float]]:
    """An interval as matplotlib's asymmetric error bar ([[below], [above]]); none -> 0."""
    return [[max(0.0, v - iv["lo"]) if iv else 0.0], [max(0.0, iv["hi"] - v) if iv else 0.0]]


def pareto(title: str, ours: list[tuple], published: list[tuple[str, float, float]],
           ours_label: str = "this run", published_label: str = "published", colors: dict | None = None,
           left_out: list[str] | None = None, left_out_why: str = "", errors: dict | None = None) -> Figure:
    """Quality (%) vs tokens/s: one marker per model/decoder; ours filled, published hollow grey.

    ``ours`` holds (name, tokens/s, quality) or (name, tokens/s, quality, detail); the detail (sample
    count, device) joins the legend label, so a LIMIT-3 CPU point is never read as a full GPU one.
    ``left_out``: our models the figure cannot show, named in the title with ``left_out_why``. ``errors``:
    per model (tokens/s interval, quality interval), drawn as 95% error bars where given."""
    fig, ax = _fig()
    title += _left_out_line(left_out or [], left_out_why)
    for i, (name, x, y, *detail) in enumerate(ours):
        what = ", ".join([ours_label, *[d for d in detail if d]])
        ax.scatter([x], [y], marker=OURS_MARKERS[i % len(OURS_MARKERS)], s=60, color=_color(colors, name, i),
                   edgecolors="black", linewidths=0.5, zorder=3, label=f"{name} ({what})")
        x_iv, y_iv = (errors or {}).get(name, (None, None))
        if x_iv or y_iv:
            ax.errorbar([x], [y], xerr=_err(x, x_iv), yerr=_err(y, y_iv), fmt="none", ecolor=_color(colors, name, i),
                        elinewidth=0.8, capsize=2, zorder=2)
    for i, (name, x, y) in enumerate(published):
        ax.scatter([x], [y], marker=PAPER_MARKERS[i % len(PAPER_MARKERS)], s=50, facecolors="none",
                   edgecolors="0.45", linewidths=1.0, zorder=2, label=f"{name} ({published_label})")
    xs = [p[1] for p in ours + published if p[1] and p[1] > 0]
    if xs and max(xs) / min(xs) > 20:
        ax.set_xscale("log")  # ours (tiny models, CPU) and published (8B, GPU) differ by orders of magnitude
    ax.set_xlabel("throughput (generated tokens / s)")
    ax.set_ylabel("quality (accuracy or pass@1, %)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    _legend(ax)
    return fig


def grouped_bars(title: str, groups: list[str], series: dict[str, list[float | None]], ylabel: str,
                 hline: float | None = None, xlabel: str = "task", colors: dict | None = None,
                 errors: dict[str, list[dict | None]] | None = None) -> Figure:
    """One bar series per key of ``series``, one group per entry of ``groups`` (None = no bar); ``errors``: per
    series, each bar's 95% interval (or None), drawn as error bars."""
    fig, ax = _fig()
    n = max(len(series), 1)
    width = 0.8 / n
    for i, (name, vals) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        ys = [v if v is not None else 0.0 for v in vals]
        ivs = (errors or {}).get(name) or []
        yerr = None
        if any(ivs):
            bars = [_err(v, iv) for v, iv in zip(ys, ivs + [None] * (len(ys) - len(ivs)))]
            yerr = [[b[0][0] for b in bars], [b[1][0] for b in bars]]
        ax.bar(xs, ys, width=width, label=name, color=_color(colors, name, i), yerr=yerr, capsize=2 if yerr else 0,
               error_kw={"elinewidth": 0.8})
    ax.set_xticks(range(len(groups)), groups, rotation=20 if len(groups) > 5 else 0, fontsize=8)
    if hline is not None:
        ax.axhline(hline, color="black", linewidth=0.8, linestyle="--")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    _legend(ax)
    return fig


def item_strips(title: str, groups: list[str], per_item: dict[str, list[list[float] | None]],
                points: dict[str, list[float | None]], ylabel: str, colors: dict | None = None) -> Figure:
    """Per group (task) and series (model), one dot per item (``per_item``, sorted, spread evenly across the
    series' slot) and a bar at the series' figure for the group (``points``), on a log axis with a line at 1."""
    fig, ax = _fig()
    n = max(len(per_item), 1)
    width = 0.8 / n
    for i, (name, groups_vals) in enumerate(per_item.items()):
        color, labelled = _color(colors, name, i), False
        for g, vals in enumerate(groups_vals):
            if not vals:
                continue
            mid = g + (i - (n - 1) / 2) * width
            k = len(vals)
            xs = [mid + width * 0.6 * ((j + 0.5) / k - 0.5) for j in range(k)]
            ax.scatter(xs, sorted(vals), s=10, color=color, alpha=0.75, label=None if labelled else name, zorder=3)
            labelled = True
            pt = (points.get(name) or [None] * len(groups_vals))[g]
            if pt is not None:
                ax.hlines(pt, mid - width * 0.4, mid + width * 0.4, color=color, linewidth=2.0, zorder=4)
    ax.set_yscale("log")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), groups, rotation=20 if len(groups) > 5 else 0, fontsize=8)
    ax.set_xlabel("task")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    _legend(ax)
    return fig


def latency_cdf(title: str, latencies: dict[str, list[float]], colors: dict | None = None) -> Figure:
    """Empirical CDF of per-sample decode seconds, one line per model/decoder."""
    fig, ax = _fig()
    for i, (name, xs) in enumerate(latencies.items()):
        xs = sorted(xs)
        ys = [(k + 1) / len(xs) for k in range(len(xs))]
        ax.step(xs, ys, where="post", label=f"{name} (n={len(xs)})", color=_color(colors, name, i))
    all_x = [x for xs in latencies.values() for x in xs if x > 0]
    if all_x and max(all_x) / min(all_x) > 20:
        ax.set_xscale("log")
    ax.set_xlabel("decode latency per sample (s)")
    ax.set_ylabel("fraction of samples")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    _legend(ax)
    return fig


def _in_unit(values: list[float | None]) -> tuple[list[float], str]:
    """Bytes -> the largest binary unit that keeps the biggest value >= 1."""
    top = max((v for v in values if v), default=0)
    for power, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if top >= 2 ** (10 * power):
            return [(v or 0) / 2 ** (10 * power) for v in values], unit
    return [float(v or 0) for v in values], "bytes"


def memory_bars(title: str, models: list[str], peak_bytes: list[float | None], peak_label: str,
                second_bytes: list[float | None], colors: dict | None = None, second_label: str = "peak KV cache",
                breakdown: list[dict | None] | None = None) -> Figure:
    """Two panels per model: its peak (the decode peak, split into KV cache / logits / other when ``breakdown``
    gives the parts; or the process's or GPU's peak) and ``second_bytes`` (the weights beside a decode peak,
    else the decoder's peak KV-cache bytes)."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=FIGSIZE, dpi=DPI, layout="constrained", sharey=True)
    peak, pu = _in_unit(peak_bytes)
    second, su = _in_unit(second_bytes)
    # Horizontal bars: model names stay readable however many there are.
    shades = [_color(colors, name, i) for i, name in enumerate(models)]  # each model its report colour
    if breakdown and any(breakdown):
        scale = [p / b if b else 0.0 for p, b in zip(peak, (v or 0 for v in peak_bytes))]
        left = [0.0] * len(models)
        for part, hatch, alpha in (("kv_cache", "//", 1.0), ("logits", "..", 0.7), ("other", "", 0.4)):
            width = [((d or {}).get(part) or 0) * k for d, k in zip(breakdown, scale)]
            a1.barh(models, width, left=left, color=shades, hatch=hatch, alpha=alpha, label=part.replace("_", " "))
            left = [x + w for x, w in zip(left, width)]
    else:
        a1.barh(models, peak, color=shades, label=peak_label)
    a1.set_xlabel(f"{peak_label} ({pu})")
    a1.set_ylabel("model / decoder")
    a1.invert_yaxis()  # run order, top to bottom
    a2.barh(models, second, color=shades, hatch="//", label=second_label)
    a2.set_xlabel(f"{second_label} ({su})")
    a2.set_ylabel("model / decoder")
    for a in (a1, a2):
        a.tick_params(axis="y", labelsize=8)
        a.grid(True, axis="x", alpha=0.3)
        a.legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    return fig


# ---------------------------------------------------------------- from a report


def _latencies(rs) -> dict[str, list[float]]:
    """Per-sample request latency (seconds, harness/run/metrics.py ``latency_of``) pooled over each row's tasks,
    from the runs' sample logs.

    A sample log holds one row per lm-eval filter of a document (gsm8k_cot has two, both with the
    same decode), so each (leaf task, document) is counted once."""
    from harness.run.metrics import latency_of

    out: dict[str, list[float]] = {}
    for (label, unit), met in rs.metrics.items():
        model = met.get("model") or label  # the name the run stored it under (the label may add @run)
        path = Path(met["_run_dir"]) / "models" / model / "samples" / f"{unit}.jsonl"
        if not path.is_file():
            continue
        seen: set[tuple] = set()
        with open(path, encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                key = (rec.get("task", unit), rec.get("doc_id"))
                if rec.get("decode_s") is None or key in seen:
                    continue
                seen.add(key)
                out.setdefault(label, []).append(latency_of(rec))
    return {m["name"]: out[m["name"]] for m in rs.models if m["name"] in out}


def _where(rs) -> str:
    """Sample count per task and device of what a figure shows, e.g. ``n=3 per task, cpu (2 threads)``."""
    mets = list(rs.metrics.values())
    ns = sorted({(m.get("speed") or {}).get("samples") for m in mets} - {None})
    devices = sorted({m.get("_device") for m in mets} - {None})
    n = f"n={ns[0]}" if len(ns) == 1 else f"n={ns[0]}-{ns[-1]}" if ns else "n=?"
    return f"{n} per task, {', '.join(devices) or 'device unknown'}"


def _detail(cell: dict) -> str:
    return ", ".join(x for x in (f"n={cell['samples']}" if cell.get("samples") is not None else "",
                                 cell.get("device") or "") if x)


def _avg_detail(row: dict) -> str:
    n = row.get("n") or []
    devices = row.get("device") or []
    return ", ".join(x for x in ((f"n={n[0]}" if len(n) == 1 else f"n={n[0]}-{n[-1]}") if n else "",
                                 ", ".join(devices)) if x)


def _memory(rs) -> dict:
    """What the memory figure draws: the decode peak (the memory pass) with its breakdown and the weights when
    the runs measured it; else the GPU's or the process's peak beside the decoder's KV-cache bytes."""
    mems = [met.get("memory") or {} for met in rs.metrics.values()]
    if any(m.get("decode_peak_bytes") for m in mems):
        key, label, second, second_label = "decode_peak_bytes", "decode peak", "weights_bytes", "weights"
    elif any(m.get("gpu_peak_bytes") for m in mems):
        key, label, second, second_label = "gpu_peak_bytes", "peak GPU memory", "kv_peak_bytes", "peak KV cache"
    else:
        key, label, second, second_label = "peak_rss_bytes", "peak RSS (process)", "kv_peak_bytes", "peak KV cache"
    out = {"names": [], "peak": [], "label": label, "second": [], "second_label": second_label, "breakdown": []}
    for m in rs.models:
        mets = [met.get("memory") or {} for (name, _), met in rs.metrics.items() if name == m["name"]]
        if not mets:
            continue
        top = max((x for x in mets if x.get(key)), key=lambda x: x[key], default={})
        sec = [x[second] for x in mets if x.get(second)]
        out["names"].append(m["name"])
        out["peak"].append(top.get(key))
        out["second"].append(max(sec) if sec else None)
        out["breakdown"].append(top.get("decode_breakdown") if key == "decode_peak_bytes" else None)
    return out


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)


def _task_paretos(s: dict, measured: list, who: str, pub_label: str, colors: dict) -> dict:
    """One quality-vs-tokens/s figure per measured column; a measured model without both numbers is named."""
    figs = {}
    for c in measured:
        shown, left_out = [], []
        for r in s["ours"]:
            if r["status"][c.key] != "ok":
                continue
            cell = r["cells"][c.key]
            if cell["quality"] is None or not cell["tokens_per_s"]:
                left_out.append(r["model"])
                continue
            shown.append((r["model"], cell["tokens_per_s"], cell["quality"], _detail(cell)))
        errors = {r["model"]: (r["cells"][c.key].get("tokens_per_s_ci"), r["cells"][c.key].get("quality_ci"))
                  for r in s["ours"] if r["status"][c.key] == "ok"}
        pub = [(r["model"], r["cells"][c.key]["tokens_per_s"], r["cells"][c.key]["quality"])
               for r in s["published"] if c.key in r["cells"]]
        figs[f"pareto_{c.key}.png"] = (pareto(f"{c.label}: quality vs throughput", shown, pub, ours_label=who,
                                              published_label=pub_label, colors=colors, left_out=left_out,
                                              left_out_why="no quality or tokens/s", errors=errors),
                                       f"{c.label} ({c.key}): quality vs tokens/s"
                                       + (f"; not shown: {', '.join(left_out)}" if left_out else ""))
    return figs


def _avg_pareto(s: dict, who: str, pub_avg: list, colors: dict) -> tuple[str, tuple]:
    """Average quality vs average tokens/s over the suite: only models that measured every column have an
    average comparable with the published one; the others are named in the title and the caption."""
    suite = s["suite"]
    short = "paper benchmarks" if suite.published else f"{suite.name} suite"
    shown = [(r["model"], r["average"]["tokens_per_s"], r["average"]["quality"], _avg_detail(r))
             for r in s["ours"] if r["average"]["complete"]]
    left_out = [r["model"] for r in s["ours"] if not r["average"]["complete"]
                and any(st == "ok" for st in r["status"].values())]
    note = "" if suite.published else "\n(published: averages over the paper's 7 benchmarks, 7-8B models)"
    errors = {r["model"]: (r["average"].get("tokens_per_s_ci"), r["average"].get("quality_ci")) for r in s["ours"]}
    fig = pareto(f"Average over the {suite.name} suite{note}", shown, pub_avg, ours_label=who,
                 published_label="published avg: full test sets, GPU", colors=colors, left_out=left_out,
                 left_out_why="not every task measured", errors=errors)
    caption = f"{short}: average quality vs average tokens/s (models that measured every task)"
    if left_out:
        caption += f"; not shown (not every task measured): {', '.join(left_out)}"
    return f"pareto_avg_{suite.name}.png", (fig, caption)


def _speedup_bars(s: dict, measured: list, where: str, colors: dict) -> dict:
    """One figure per AR reference, titled by it, one series per model with at least one ratio to it; a
    merge of runs with two AR baselines gets two figures instead of one series overwriting the other."""
    suite = s["suite"]
    short = "paper benchmarks" if suite.published else f"{suite.name} suite"
    refs = list(dict.fromkeys(x["reference"] for x in s["speedups"] if x["role"] == "AR baseline"))
    figs = {}
    for ref in refs:
        rows = [x for x in s["speedups"] if x["reference"] == ref]
        series = {x["model"]: [x["per_task"][c.key] for c in measured] + [x["mean_of_ratios"]] for x in rows
                  if any(x["per_task"][c.key] is not None for c in measured)}
        left_out = [x["model"] for x in rows if x["model"] not in series]
        name = f"speedup_{suite.name}.png" if len(refs) == 1 else f"speedup_{suite.name}_vs_{_slug(ref)}.png"
        title = (f"Speedup vs {ref} per task ({suite.name} suite)\n{where}"
                 + _left_out_line(left_out, "no task measured comparably with " + ref))
        errors = {x["model"]: [((x.get("per_task_test") or {}).get(c.key) or {}).get("interval") for c in measured]
                  + [x.get("mean_of_ratios_interval")] for x in rows}
        figs[name] = (grouped_bars(title, [c.label for c in measured] + ["mean of ratios"], series,
                                   f"speedup over {ref} (x, tokens/s ratio, 95% interval)", hline=1.0, colors=colors,
                                   errors=errors),
                      f"{short}: speedup over {ref} per task and mean of per-task ratios"
                      + (f"; not shown: {', '.join(left_out)}" if left_out else ""))
    return figs


def _item_speedups(s: dict, measured: list, where: str, colors: dict) -> dict:
    """Per AR reference timed in one pass with the models: the per-item spread of each task's speedup, one dot
    per timed item (its median over round pairs), a bar at the task's speedup (their geometric mean)."""
    from harness.report.timed import ratio_in_run

    rows = {r["model"]: r for r in s["ours"]}
    refs = list(dict.fromkeys(x["reference"] for x in s["speedups"] if x["role"] == "AR baseline"))
    figs = {}
    for ref in refs:
        per_item: dict[str, list] = {}
        points: dict[str, list] = {}
        for x in (x for x in s["speedups"] if x["reference"] == ref):
            mine, theirs = rows.get(x["model"]), rows.get(ref)
            if mine is None or theirs is None:
                continue
            vals, pts = [], []
            for c in measured:
                a, b = mine["cells"].get(c.key), theirs["cells"].get(c.key)
                got = None
                if a and b and a.get("timed") and b.get("timed") and a["_run_dir"] == b["_run_dir"]:
                    got = (ratio_in_run(a["_run_dir"], a["model_in_run"], b["model_in_run"], [a["task"]]) or
                           {"per_unit": {}})["per_unit"].get(a["task"])
                vals.append(got and got.get("per_item"))
                pts.append(got and got["ratio"])
            if any(vals):
                per_item[x["model"]], points[x["model"]] = vals, pts
        if not per_item:
            continue
        name = (f"speedup_items_{s['suite'].name}.png" if len(refs) == 1 else
                f"speedup_items_{s['suite'].name}_vs_{_slug(ref)}.png")
        counts = sorted({len(v) for vals in per_item.values() for v in vals if v})
        n_text = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
        figs[name] = (item_strips(f"Per-item speedup vs {ref} ({s['suite'].name} suite, {n_text} timed items per "
                                  f"task)\n{where}", [c.label for c in measured], per_item, points,
                                  f"speedup over {ref} (x, log scale)", colors),
                      f"{s['suite'].name} suite: each timed item's speedup over {ref} (a dot: the median over its "
                      "round pairs) and the task's speedup (a bar: their geometric mean)")
    return figs


def build_all(rs, data: dict) -> dict[str, tuple[Figure, str]]:
    """file name -> (figure, caption) for everything the run measured."""
    figs: dict[str, tuple[Figure, str]] = {}
    who = "these runs" if len(rs.runs) > 1 else "this run"
    where = _where(rs)
    colors = model_colors([m["name"] for m in rs.models])
    pub_avg = []
    for s in data["suites"]:
        if s["suite"].published:
            pub_avg = [(r["model"], r["average"]["tokens_per_s"], r["average"]["quality"]) for r in s["published"]]
    for s in data["suites"]:
        suite = s["suite"]
        short = "paper benchmarks" if suite.published else f"{suite.name} suite"
        measured = [c for c in suite.columns if any(r["status"][c.key] == "ok" for r in s["ours"])]
        figs.update(_task_paretos(s, measured, who, "published: full test sets, GPU", colors))
        if not measured:
            continue
        name, fig = _avg_pareto(s, who, pub_avg, colors)
        figs[name] = fig
        figs.update(_speedup_bars(s, measured, where, colors))
        figs.update(_item_speedups(s, measured, where, colors))
        tpf = {r["model"]: [r["cells"][c.key]["tpf"] if r["status"][c.key] == "ok" else None for c in measured]
               for r in s["ours"] if any(r["status"][c.key] == "ok" for c in measured)}
        figs[f"tpf_{suite.name}.png"] = (
            grouped_bars(f"Tokens per forward per task ({suite.name} suite)\n{where}", [c.label for c in measured],
                         tpf, "TPF (generated tokens / forward)", hline=1.0, colors=colors),
            f"{short}: tokens per forward (TPF) per task")
    lat = _latencies(rs)
    if lat:
        figs["latency.png"] = (latency_cdf(f"Decode latency per sample (all tasks of {who})\n{where}", lat, colors),
                               "Latency distribution per decoder (CDF of per-sample decode seconds)")
    mem = _memory(rs)
    if mem["names"]:
        what = f"{mem['label']} and {mem['second_label']}"
        figs["memory.png"] = (memory_bars(f"Memory per decoder ({what})\n{where}", mem["names"], mem["peak"],
                                          mem["label"], mem["second"], colors, mem["second_label"], mem["breakdown"]),
                              f"Memory per decoder ({what}"
                              + ("; the decode peak split into KV cache, logits and other: the memory pass's "
                                 "tensor bytes)" if mem["label"] == "decode peak" else
                                 "; no memory pass in these runs: the peak is not the decode's own)"))
    return figs


def save_all(figs: dict[str, tuple[Figure, str]], folder: Path) -> dict[str, str]:
    """Write every figure as PNG, close it, and return file name -> caption."""
    out = {}
    for name, (fig, caption) in figs.items():
        save_png(fig, folder / name)
        plt.close(fig)
        out[name] = caption
    return out


def save_png(fig: Figure, path: Path) -> None:
    """PNG with an adaptive 128-colour palette: a third of the bytes, no visible loss on flat plots."""
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    buf.seek(0)
    Image.open(buf).convert("RGB").quantize(colors=128).save(path, "PNG", optimize=True)
