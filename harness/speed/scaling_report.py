"""The report of `python -m harness scaling` (harness/speed/scaling.py): ``index.md`` with the slopes, the budget
and every point, and log-log figures, one line per decoder: latency and peak decode memory against each swept
size, and tokens/s against batch. The folder is built aside and swapped in whole (store.atomic_dir).

The figures follow the report style of harness/report/figures.py (size, resolution, tab10 colours in decoder
order, legend outside on the right); speed/ may not import report/ (tests/test_layering.py), so the few
constants are repeated here.
"""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402

from harness.run.guard import busy_text  # noqa: E402
from harness.run.store import atomic_dir, atomic_save_figure  # noqa: E402

FIGSIZE = (7.0, 4.2)  # harness/report/figures.py
DPI = 100
MARKERS = "osD^vP*Xh<>p"
AXIS = {"gen": "generation length (tokens)", "prompt": "prompt length (tokens)", "batch": "batch size (rows)"}
FIXED = {"gen": ("prompt", "batch"), "prompt": ("gen", "batch"), "batch": ("prompt", "gen")}
SWEEPS = ("gen", "prompt", "batch")


def colors(names: list[str]) -> dict[str, tuple]:
    """One colour per decoder, tab10 in order (as harness/report/figures.py model_colors)."""
    cmap = plt.get_cmap("tab10")
    return {n: cmap(i % 10) for i, n in enumerate(dict.fromkeys(names))}


def fixed_text(settings: dict, sweep: str) -> str:
    s = settings["sweeps"][sweep]
    return ", ".join(f"{k} {s[k]}" for k in FIXED[sweep])


def _series(result: dict, sweep: str, what: str) -> dict[str, tuple[list, list]]:
    out: dict[str, tuple[list, list]] = {}
    for p in result["points"]:
        if p["sweep"] == sweep and what_of(p, what) is not None:  # an engine row has no tracked memory
            xs, ys = out.setdefault(p["decoder"], ([], []))
            xs.append(p["x"])
            ys.append(what_of(p, what))
    return out


def what_of(point: dict, what: str) -> float | None:
    if what == "latency_s":
        return point["timing"]["latency_s"]
    if what == "tokens_per_s":
        return point["timing"]["tokens_per_s"]
    peak = point["memory"]["peak_bytes"]
    return None if peak is None else peak / 2**20


YLABEL = {"latency_s": "latency per decoder call (s)", "peak_bytes": "peak decode memory (MiB, weights excluded)",
          "tokens_per_s": "tokens/s (all rows)"}
TITLE = {"latency_s": "Latency", "peak_bytes": "Peak decode memory", "tokens_per_s": "Throughput"}


def loglog_figure(result: dict, sweep: str, what: str):
    """One line per decoder on log-log axes, its fitted slope in the legend."""
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    names = result["settings"]["decoders"]
    col = colors(names)
    for i, (d, (xs, ys)) in enumerate(_series(result, sweep, what).items()):
        fit = (result["fits"].get(d, {}).get(sweep) or {}).get(what)
        label = f"{d} (slope {fit['slope']:.2f})" if fit else d
        ax.plot(xs, ys, marker=MARKERS[i % len(MARKERS)], color=col.get(d), label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(AXIS[sweep])
    ax.set_ylabel(YLABEL[what])
    ax.set_title(f"{TITLE[what]} vs {AXIS[sweep].split(' (')[0]} ({fixed_text(result['settings'], sweep)}; "
                 "log-log)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    return fig


FILE = {"latency_s": "latency", "peak_bytes": "memory", "tokens_per_s": "throughput"}
FIGURES = [(f"{FILE[what]}_{sweep}.png", sweep, what) for sweep in SWEEPS
           for what in ("latency_s", "peak_bytes")] + [("throughput_batch.png", "batch", "tokens_per_s")]


def _f(v, fmt: str = ".3g") -> str:
    return "-" if v is None else format(v, fmt)


def _iv(iv: dict | None, fmt: str) -> str:
    return "" if not iv else f" [{format(iv['lo'], fmt)}, {format(iv['hi'], fmt)}]"


def slopes_md(result: dict) -> list[str]:
    lines = ["| decoder | latency vs gen | memory vs gen | latency vs prompt | memory vs prompt | latency vs batch "
             "| memory vs batch | tokens/s vs batch | memory linear in batch: R² | bytes per row |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for d in result["settings"]["decoders"]:  # the run's order (a JSON written with sorted keys loses it)
        f = result["fits"].get(d) or {}
        cells = []
        for sweep, what in (("gen", "latency_s"), ("gen", "peak_bytes"), ("prompt", "latency_s"),
                            ("prompt", "peak_bytes"), ("batch", "latency_s"), ("batch", "peak_bytes"),
                            ("batch", "tokens_per_s")):
            fit = (f.get(sweep) or {}).get(what)
            cells.append(_f(fit and fit["slope"], ".2f"))
        lin = (f.get("batch") or {}).get("memory_linear")
        cells += [_f(lin and lin["r2"], ".4f"), _f(lin and lin["slope"], ",.0f")]
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    return lines


def budget_md(result: dict) -> list[str]:
    b = result["budget"]
    lines = [f"Budget **{b['budget_bytes'] / 2**30:.3g} GiB** ({b['budget_bytes']:,} bytes) for peak decode memory "
             f"+ weights; rule: {b['rule']}; cap {b['max_batch']}. A largest batch beyond the batch sweep's "
             f"largest ({max(result['settings']['sweeps']['batch']['values'])}) is the fit carried past the measured "
             "batches, marked (extrapolated).", "",
             "| decoder | weights (MiB) | fit: MiB + MiB/row | largest batch | measured at batch | peak there: "
             "measured / predicted (MiB) | tokens/s there | tokens/s at the largest batch | how |",
             "|---|---|---|---|---|---|---|---|---|"]
    top = max(result["settings"]["sweeps"]["batch"]["values"])
    for d in [d for d in result["settings"]["decoders"] if d in b["decoders"]]:
        r = b["decoders"][d]
        fit = r.get("fit")
        fit_s = f"{fit['intercept'] / 2**20:+.2f} + {fit['slope'] / 2**20:.3f}·B" if fit else "-"
        peak = (f"{r['measured_peak_bytes'] / 2**20:.1f} / {r['predicted_peak_bytes'] / 2**20:.1f}"
                if r.get("measured_peak_bytes") is not None else "-")
        how = r.get("throughput", "not measured: no batch fits" if not r["largest_batch"] else "-")
        # beyond the sweep's largest batch B* is the fit carried past the data (also for a JSON written before
        # rows carried largest_batch_extrapolated)
        largest = _f(r["largest_batch"], "d") + (" (extrapolated)" if r["largest_batch"] is not None
                                                 and r["largest_batch"] > top else "")
        weights = _f(None if r["weights_bytes"] is None else r["weights_bytes"] / 2**20, ".2f")
        lines.append(f"| {d} | {weights} | {fit_s} | {largest} | "
                     f"{_f(r['measured_batch'], 'd')} | {peak} | {_f(r.get('measured_tokens_per_s'), '.1f')} | "
                     f"{_f(r.get('tokens_per_s_at_largest'), '.1f')} | {how} |")
    return lines


def points_md(result: dict, sweep: str) -> list[str]:
    lines = [f"### {AXIS[sweep].split(' (')[0].capitalize()} ({fixed_text(result['settings'], sweep)})", "",
             "| decoder | x | latency (s) [95%] | tokens/s | NFE | TPF | peak (MiB) | kv_cache | logits | other |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in result["points"]:
        if p["sweep"] != sweep:
            continue
        t, m = p["timing"], p["memory"]
        bd = m["breakdown"] or {}
        if m["peak_bytes"] is None:  # an engine row: memory in the server's process, not tracked
            lines.append(f"| {p['decoder']} | {p['x']} | {t['latency_s']:.4g}{_iv(t['latency_interval'], '.4g')} "
                         f"(at client) | {t['tokens_per_s']:.1f} | {p['nfe']} | {p['tpf']:.2f} | - | - | - | - |")
            continue
        lines.append(f"| {p['decoder']} | {p['x']} | {t['latency_s']:.4g}{_iv(t['latency_interval'], '.4g')} | "
                     f"{t['tokens_per_s']:.1f} | {p['nfe']} | {p['tpf']:.2f} | {m['peak_bytes'] / 2**20:.2f} | "
                     f"{_f(bd.get('kv_cache', 0) / 2**20, '.2f')} | {_f(bd.get('logits', 0) / 2**20, '.2f')} | "
                     f"{_f(bd.get('other', 0) / 2**20, '.2f')} |")
    return lines + [""]


def index_md(result: dict, json_path: Path, folder: Path) -> str:
    s, env = result["settings"], result["environment"]
    rel = os.path.relpath(json_path, folder)
    busy = any(p["timing"].get("busy") for p in result["points"])
    lines = ["# Scaling: cost as the work grows", "",
             f"`{result['command']}` — decoders {', '.join(s['decoders'])} (presets of harness/run/presets.py), "
             f"{s['rounds']} timed round{'s' if s['rounds'] > 1 else ''} (ABBA order) per point after a warm-up, "
             f"{env.get('hardware')}, torch {env['packages'].get('torch')}, commit {str(env.get('git_commit'))[:10]}"
             f"{' (dirty)' if env.get('git_dirty') else ''}; {result['elapsed_s']:.0f} s"
             f"{' (this session of a resumed run)' if result.get('resumed') else ''}. Data: [{Path(rel).name}]({rel}).",
             "", f"**Fixed work**: {result['how_work_is_fixed']}. Prompts: {result['prompt_recipe']}; all rows of a batch have one length, attention mask all ones.", ""]
    if busy:
        lines += ["**Warning**: some points were " + (busy_text({"busy": True, "threshold": 0.1,
                  "others_cpu_share": max((p["timing"].get("others_share") or 0) for p in result["points"])})
                  or "measured on a busy machine") + ".", ""]
    lines += ["## Log-log slopes", "",
              "Least squares of log y on log x over each sweep (1 = linear growth, 2 = quadratic, 0 = flat); "
              "R² and bytes per row from the linear fit of peak decode memory on batch.", ""]
    lines += slopes_md(result) + ["", "## Largest batch under the memory budget", ""] + budget_md(result)
    lines += ["", "## Figures", ""]
    lines += [f"![{name}]({name})" for name, _, _ in FIGURES]
    lines += ["", "## Points", "", "Latency: seconds per decoder call (one batch), median over rounds with its "
              "bootstrap interval; tokens/s: all rows' tokens over that; peak decode memory from the dispatch "
              "tracker (harness/run/memory.py), weights excluded, split at the peak.", ""]
    for sweep in SWEEPS:
        lines += points_md(result, sweep)
    return "\n".join(lines) + "\n"


def write_report(result: dict, folder: Path, json_path: Path) -> None:
    """index.md and the figures into ``folder`` (replaced whole)."""
    folder = Path(folder)
    with atomic_dir(folder) as tmp:
        for name, sweep, what in FIGURES:
            atomic_save_figure(loglog_figure(result, sweep, what), tmp / name, dpi=DPI)
        (tmp / "index.md").write_text(index_md(result, Path(json_path).resolve(), folder.resolve()),
                                      encoding="utf-8")
