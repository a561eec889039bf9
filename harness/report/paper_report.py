"""`python -m harness report` / `make report`: the paper's Table 1, speedups and figures from one or more runs.

    python -m harness report                                  # newest run under results/runs
    python -m harness report --run 20260101-120000            # a run id under --runs-root, or a run folder
    python -m harness report --run runA,runB --name merged    # several runs merged into one report
    python -m harness report --run base=runA,new=runB         # the same, rows of a model that differs
                                                              # between the runs named model@base / @new
    python -m harness report --run R --allow-partial          # an unfinished run, missing cells marked
    python -m harness report --run R --no-traces              # no decode traces drawn (the committed reports)

Writes ``<out>/<name>/`` (default name: the run id, runs joined by ``+``):

    table1.md, table1.csv, table1.tex   Table 1 layout, ours and the published numbers
    speedup.md                          per task, mean of per-task ratios and ratio of averages
    *.png                               Pareto views, speedup, TPF, latency, memory
    index.md                            links, the runs' settings and environment
    memory.md                           decode peaks per decoder, and the estimate at released sizes
    report.json                         every number above, machine-readable
    trace/<task>/                       one logged decode trace per task (not with --no-traces)

Merged runs keep every measurement apart that differs: a model with both prompt variants gets a
second row ``model [paper prompts]`` (no average mixes the variants), a model run with other
settings in two runs (or whose same task two runs measured) gets one row per run ``model@<run>``.
Every row carries its sample count and device.

Everything is read and checked first; bad input (no such run, missing metrics) is one line and
exit 2 with nothing written. The folder is built next to its target and swapped in at the end, so
a failure leaves the previous report (or nothing) in place.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path

from harness.report import paper
from harness.report.timed import timed_average
from harness.run import stats
from harness.run.metrics import speedup
# Loading lives in harness/report/runset.py; load_runs stays importable from here (harness.report.sweep, tests).
from harness.report.runset import (PAPER_ROW, InputError, RunSet, device_text, load_runs, resolve_runs,
                                   run_parser)
from harness.run.store import atomic_dir, read_json

REPO = Path(__file__).resolve().parents[2]
NOT_MEASURED = "n/m"  # the run has no such (model, task)
MISSING = "missing"  # the run should have it, but its metrics file is absent (--allow-partial)


# ---------------------------------------------------------------- numbers


def quality_pct(m: dict) -> float | None:
    prim = m.get("quality_primary")
    v = (m.get("quality") or {}).get(prim) if prim else None
    return None if v is None else 100.0 * float(v)


def tps(m: dict) -> float | None:
    return ((m.get("speed") or {}).get("tokens_per_s") or {}).get("ratio_of_sums")


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _average(cells: dict[str, dict], n_columns: int, dists: dict[str, dict] | None = None) -> dict:
    """The row's Avg (mean of its columns) and, from each column's bootstrap distributions (``dists``, our rows
    with per-item logs), the 95% interval of each mean: a bootstrap stratified by task (each task's items
    resampled on their own). No interval when a column has no per-item log."""
    qs = [c["quality"] for c in cells.values() if c.get("quality") is not None]
    ts = [c["tokens_per_s"] for c in cells.values() if c.get("tokens_per_s") is not None]
    out = {"quality": _mean(qs), "tokens_per_s": _mean(ts), "columns": min(len(qs), len(ts)),
           "complete": len(qs) == len(ts) == n_columns, "quality_ci": None, "tokens_per_s_ci": None}
    for what, vals in (("quality", qs), ("tokens_per_s", ts)):
        if what == "tokens_per_s" and any(c.get("timed") for c in cells.values() if c.get(what) is not None):
            out[f"{what}_ci"], out[f"{what}_ci_why"] = timed_average(cells)
            continue
        got = [(dists or {}).get(k, {}).get(what) for k, c in cells.items() if c.get(what) is not None]
        iv = stats.mean_interval(got) if vals and all(d is not None for d in got) else None
        out[f"{what}_ci"] = None if iv is None else {"lo": iv[0], "hi": iv[1], "method": "stratified bootstrap"}
        if iv is None and vals:
            out[f"{what}_ci_why"] = "a column has no per-item log to resample"
    return out


def cell_items(rs: RunSet, cell: dict) -> stats.Items | None:
    """The items of one of our cells, from its run's per-sample log (None where the run kept none)."""
    run = next((r for r in rs.runs if (r.get("run_id") or Path(r["dir"]).name) == cell.get("run_id")), None)
    if run is None or not cell.get("model_in_run"):
        return None
    return stats.cached_items(run["dir"], cell["model_in_run"], cell["task"], cell.get("quality_metric"))


def _cell(met: dict, task: str, it: stats.Items | None) -> tuple[dict, dict]:
    """One of our cells (quality %, tokens/s and TPF with their 95% intervals) and the bootstrap distributions
    of its quality and tokens/s (for the row's Avg interval; empty without per-item logs)."""
    q, n = quality_pct(met), _items(met)
    qiv = stats.quality_interval(it, None if q is None else q / 100, n, (task, "quality"))
    from harness.report import timed

    if timed.is_timed(met):  # timed rounds (harness/run/timing.py): their interval, rounds resampled for Avg
        tps_dist = timed.rounds_dist(met, (task, met.get("model")))
        got = timed.speed_interval(met, "tokens_per_s")
        tiv = None if got is None else (got["lo"], got["hi"])
    else:
        tps_dist = stats.speed_dist(it, "tokens_per_s", task) if it is not None else None
        tiv = stats.percentile_interval(tps_dist) if tps_dist is not None else None
    cell = {"task": task, "quality": q, "tokens_per_s": tps(met),
            "tpf": ((met.get("speed") or {}).get("tpf") or {}).get("ratio_of_sums"),
            "quality_ci": None if qiv is None else qiv.scaled(100.0).to_dict(),
            "tokens_per_s_ci": None if tiv is None else {"lo": tiv[0], "hi": tiv[1], "method": "bootstrap"},
            "timed": timed.is_timed(met), "_run_dir": str(met["_run_dir"]) if met.get("_run_dir") else None,
            "quality_metric": met.get("quality_primary"), "run_id": met["_run_id"], "model_in_run": met.get("model"),
            "samples": _items(met), "failed": (met.get("failed") or {}).get("count", 0), "device": met.get("_device")}
    dists = {}
    if it is not None and it.has_scores:
        dists["quality"] = 100.0 * stats.quality_dist(it, task)
    if tps_dist is not None and tps_dist.size:
        dists["tokens_per_s"] = tps_dist
    return cell, dists


def our_rows(rs: RunSet, suite: paper.Suite) -> list[dict]:
    """One row per model of the run(s): each column's quality (%), tokens/s and status, then the average."""
    missing = {(m, u) for m, u, _ in rs.missing}
    rows = []
    for m in rs.models:
        cells: dict[str, dict] = {}
        dists: dict[str, dict] = {}
        status: dict[str, str] = {}
        for col in suite.columns:
            task = next((t for t in col.tasks if (m["name"], t) in rs.metrics), None)
            if task is None:
                status[col.key] = MISSING if any((m["name"], t) in missing for t in col.tasks) else NOT_MEASURED
                continue
            met = rs.metrics[(m["name"], task)]
            it = stats.cached_items(met["_run_dir"], met.get("model", m["model"]), task, met.get("quality_primary"))
            cells[col.key], dists[col.key] = _cell(met, task, it)
            status[col.key] = "ok"
        rows.append({"model": m["name"], "decoder": m["decoder"], "family": m.get("family"),
                     "source": ours_label(rs), "cells": cells,
                     "status": status, "average": _average(cells, len(suite.columns), dists),
                     "n": sorted({c["samples"] for c in cells.values() if c.get("samples") is not None}),
                     "failed": sum(c.get("failed", 0) for c in cells.values()),
                     "device": sorted({c["device"] for c in cells.values() if c.get("device")})})
    return rows


def _items(met: dict) -> int | None:
    """Items of a (model, task): those decoded plus those that failed (harness/run/faults.py: scored as wrong)."""
    n = (met.get("speed") or {}).get("samples")
    return None if n is None else n + (met.get("failed") or {}).get("count", 0)


def ours_label(rs: RunSet) -> str:
    return "these runs" if rs.merged else "this run"


PUBLISHED_N = "full"  # the published rows score every document of each benchmark's test set
PUBLISHED_DEVICE = "GPU (paper)"


def published_rows(suite: paper.Suite) -> list[dict]:
    if not suite.published:
        return []
    rows = []
    for r in paper.published_rows():
        cells = {c.key: {"task": c.key, **r["cells"][c.key]} for c in suite.columns if c.key in r["cells"]}
        avg = _average(cells, len(suite.columns))
        rows.append({"model": r["model"], "decoder": r["decoder"], "kind": r["kind"], "family": r.get("family"),
                     "source": "published",
                     "cells": cells, "status": {c.key: "ok" if c.key in cells else NOT_MEASURED
                                                for c in suite.columns},
                     "average": avg, "published_average": r.get("average"), "n": PUBLISHED_N,
                     "device": PUBLISHED_DEVICE})
    return rows


def speedup_summary(row: dict, ref: dict, keys: list[str], rs: RunSet | None = None) -> dict:
    """Per-column speedup of ``row`` over ``ref`` (same task), their mean (the paper's headline convention)
    and the ratio of the mean tokens/s over the same columns. With ``rs`` (our rows), cells of two runs are
    divided only when the runs share hardware, dtype and batch size; otherwise the column is None and
    ``refused`` says why. Without it (the published rows) every column is divided."""
    per: dict[str, float | None] = {}
    tests: dict[str, dict | None] = {}
    quality: dict[str, dict | None] = {}
    pairs: dict[str, tuple] = {}
    timed_pairs: dict[str, tuple] = {}
    refused: set[str] = set()
    for k in keys:
        a, b = row["cells"].get(k), ref["cells"].get(k)
        if a is None or b is None or a["task"] != b["task"]:
            per[k] = None
            continue
        mine_it, ref_it = (cell_items(rs, a), cell_items(rs, b)) if rs is not None else (None, None)
        if mine_it is not None and ref_it is not None:  # quality pairs whatever the hardware
            quality[k] = stats.paired_quality(ref_it, mine_it, a["task"])
        why = rs.why_not_comparable(a.get("run_id"), b.get("run_id")) if rs is not None else None
        if why:
            refused.add(why)
            per[k] = None
            continue
        per[k] = speedup(a["tokens_per_s"], b["tokens_per_s"])
        if a.get("timed") or b.get("timed"):
            # Timed rounds: the ratio and its interval from the rounds both rows were timed in (same run, same
            # pass); rows timed apart have a ratio and no interval. A single pass's item bootstrap would not
            # mix with them.
            same = a.get("_run_dir") and a.get("_run_dir") == b.get("_run_dir")
            from harness.report.timed import ratio_in_run

            got = ratio_in_run(a["_run_dir"], a["model_in_run"], b["model_in_run"], [a["task"]]) if same else None
            q = got and got["per_unit"][a["task"]]
            if q:
                per[k] = q["ratio"]
                tests[k] = {"ratio": q["ratio"], "interval": q["interval"], "p": None, "differs": False,
                            "test": "timed rounds", "items": None}
            timed_pairs[k] = (a, b)
        elif mine_it is not None and ref_it is not None and per[k] is not None:
            tests[k] = stats.paired_ratio(ref_it, mine_it, "tokens_per_s", a["task"])
            if tests[k] is not None:  # the point of the interval's statistic: the items both decoded
                per[k] = tests[k]["ratio"]
            pairs[k] = (ref_it, mine_it)
    both = [k for k, v in per.items() if v is not None]
    mine = _mean([row["cells"][k]["tokens_per_s"] for k in both])
    theirs = _mean([ref["cells"][k]["tokens_per_s"] for k in both])
    got = (stats.mean_ratio_interval([pairs[k] for k in both], streams=[row["cells"][k]["task"] for k in both])
           if both and all(k in pairs for k in both) else None)
    mean_iv = got and got["interval"]
    if both and all(k in timed_pairs for k in both):
        dirs = {timed_pairs[k][0].get("_run_dir") for k in both} | {timed_pairs[k][1].get("_run_dir") for k in both}
        if len(dirs) == 1:
            from harness.report.timed import ratio_in_run

            a0, b0 = timed_pairs[both[0]]
            got = ratio_in_run(a0["_run_dir"], a0["model_in_run"], b0["model_in_run"],
                               [row["cells"][k]["task"] for k in both])
            mean_iv = got and got["mean"] and got["mean"]["interval"]
    return {"per_task": per, "mean_of_ratios": _mean([per[k] for k in both]),
            "ratio_of_averages": speedup(mine, theirs), "tasks": len(both), "refused": sorted(refused),
            "per_task_test": tests, "mean_of_ratios_interval": mean_iv, "quality_tests": quality}


def is_masked_diffusion(decoder: str) -> bool:
    """Whether the registry marks ``decoder`` a masked-diffusion baseline (refusion.decoding.Decoder); a decoder
    a run recorded but this checkout does not register is not one."""
    from refusion.decoding import DECODERS

    entry = DECODERS.get(decoder)
    return bool(entry and entry.masked_diffusion)


def _ar_role(m: dict) -> str:
    """An AR reference's role, naming what runs it: an engine row (decoder ar@vllm, docs/engines.md) is the AR
    model as served, its latency measured at the client; a plain ar row is transformers' loop."""
    eng = (m.get("engine") or {}).get("name")
    if eng:
        return f"AR baseline, {'vLLM' if eng == 'vllm' else eng} at client"
    return "AR baseline"


def references(rs: RunSet) -> list[tuple[str, str]]:
    """(row, role) pairs speedups are measured against: every row of the runs' AR baselines and of every
    other AR model (the paper measures ReFusion against each AR row), then every MDM baseline (a model with
    rows per run or per prompt variant is a reference in each)."""
    bases = {r["baseline"] for r in rs.runs if r.get("baseline")} or {rs.baseline}
    out = [(m["name"], _ar_role(m)) for m in rs.models if m["model"] in bases]
    out += [(m["name"], _ar_role(m)) for m in rs.models if m["decoder"] == "ar" and m["model"] not in bases]
    from harness.report.aup import not_own_points

    extra = not_own_points(rs)  # a frontier's other grid points are rows, not references
    out += [(m["name"], "MDM baseline") for m in rs.models if is_masked_diffusion(m["decoder"])
            and m["name"] not in extra]
    return out


def _ours_for(pub: dict, ours: list[dict]) -> dict | None:
    """Our row measuring what a published row measured: the same decoder on a checkpoint of the same family
    (harness/models/families.py; a D2F adapter has its base's), or the only published row of its decoder."""
    same = [r for r in ours if r["decoder"] == pub["decoder"] and suite_row_measured(r)]
    exact = [r for r in same if r.get("family") == pub.get("family")]
    unique = sum(1 for p in paper.published_rows() if p["decoder"] == pub["decoder"]) == 1
    return exact[0] if exact else (same[0] if same and unique else None)


BEYOND_TITLE = "Beyond Table 1"
BEYOND_NOTE = ("Systems the paper's Table 1 has no row for (a decoder none of its rows ran, as DiffusionGemma's): "
               "no published numbers to match, and another backbone and size class than the 7-8B rows, so compare "
               "accuracy-parallelism frontiers (`make frontier`), not single points (docs/design.md §4b).")


def beyond_table1(row: dict) -> bool:
    """Whether one of our rows is a system outside the paper's Table 1: its decoder is none of the published
    rows' (harness/report/paper_table1.json). Such rows are reported in a section of their own."""
    return row["decoder"] not in {p["decoder"] for p in paper.published_rows()}


def split_rows(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the rows of Table 1's systems, the rows beyond Table 1), each in run order."""
    return [r for r in rows if not beyond_table1(r)], [r for r in rows if beyond_table1(r)]


def suite_row_measured(row: dict) -> bool:
    return any(st == "ok" for st in row["status"].values())


def claims(rs: RunSet, ours: list[dict], pub: list[dict], pub_sp: list[dict], keys: list[str]) -> list[dict]:
    """The paper's speedup claims (ReFusion over each other published row) beside ours: the same pair of
    systems found among our rows, divided over the tasks both measured."""
    out = []
    by_model = {r["model"]: r for r in pub}
    for claim in pub_sp:
        mine, other = _ours_for(by_model[claim["model"]], ours), _ours_for(by_model[claim["reference"]], ours)
        got, why = None, f"no row of ours is {claim['reference'] if mine else claim['model']}"
        if mine and other:
            got = speedup_summary(mine, other, keys, rs)
            why = None if got["tasks"] else ("; ".join(got["refused"]) or "no task measured by both")
        out.append({"claim": f"{claim['model']} over {claim['reference']}", "published": claim,
                    "ours": got if not why else None, "rows": [mine and mine["model"], other and other["model"]],
                    "why": why})
    return out


def report_suites(rs: RunSet) -> list[paper.Suite]:
    """The paper's benchmarks (they have published numbers), the embedded suite when the run(s) have an
    embedded task (no table without data), and any other task the run(s) measured."""
    known = paper.suites()
    covered = {t for s in known for c in s.columns for t in c.tasks}
    units = []
    for r in rs.runs:
        units += [u["name"] for u in r["units"] if u["name"] not in units]
    keep = [s for s in known if s.published or any(t in units for c in s.columns for t in c.tasks)]
    other = [u for u in units if u not in covered]
    if not other:
        return keep
    return [*keep, paper.Suite("other", "Other tasks (no published numbers)",
                               tuple(paper.Column(u, u, (u,)) for u in other), False)]


def suite_measured(rows: list[dict]) -> bool:
    """Whether the run(s) have any cell of a suite (measured or missing): else our table would be all n/m."""
    return any(st != NOT_MEASURED for r in rows for st in r["status"].values())


def build(rs: RunSet) -> dict:
    """Every number of the report, per suite: our rows, published rows, speedups."""
    suites = []
    for s in report_suites(rs):
        ours = our_rows(rs, s)
        keys = [c.key for c in s.columns]
        by_name = {r["model"]: r for r in ours}
        sp = []
        for ref_name, role in references(rs):
            ref = by_name[ref_name]
            for r in ours:
                if r["model"] != ref_name:
                    sp.append({"model": r["model"], "decoder": r["decoder"], "reference": ref_name, "role": role,
                               **speedup_summary(r, ref, keys, rs)})
        pub = published_rows(s)
        pub_sp = []
        for ref in pub:
            for r in pub:
                if r["kind"] == "refusion" and ref["kind"] != "refusion":
                    pub_sp.append({"model": r["model"], "reference": ref["model"], **speedup_summary(r, ref, keys)})
        suites.append({"suite": s, "ours": ours, "published": pub, "speedups": sp, "published_speedups": pub_sp,
                       "claims": claims(rs, ours, pub, pub_sp, keys) if suite_measured(ours) else []})
    return {"suites": suites, "baseline": rs.baseline}


# ---------------------------------------------------------------- formatting


def _num(v: float | None, spec: str = ".2f") -> str:
    return NOT_MEASURED if v is None else format(v, spec)


def _with_ci(d: dict, what: str, spec: str = ".2f") -> str:
    """A figure of a cell or average with its 95% interval (`` [lo, hi]``) where it has one."""
    return _num(d[what], spec) + ("" if d[what] is None else stats.fmt_interval(d.get(f"{what}_ci"), spec))


def cell_text(row: dict, key: str) -> str:
    st = row["status"].get(key, NOT_MEASURED)
    if st != "ok":
        return st
    c = row["cells"][key]
    return f"{_with_ci(c, 'quality')} / {_with_ci(c, 'tokens_per_s')}"


def avg_text(row: dict, n_columns: int) -> str:
    a = row["average"]
    if a["quality"] is None and a["tokens_per_s"] is None:
        return NOT_MEASURED
    mark = "" if a["complete"] else f" ({a['columns']}/{n_columns})"
    return f"{_with_ci(a, 'quality')} / {_with_ci(a, 'tokens_per_s')}{mark}"


def speedup_cell(x: dict, key: str) -> str:
    """A per-task speedup with its paired bootstrap interval and p-value; "differs" only where p < 0.05."""
    v, t = x["per_task"].get(key), (x.get("per_task_test") or {}).get(key)
    if v is None or t is None:
        return _num(v)
    verdict = ": differs" if t["differs"] else ""
    return f"{v:.2f}{stats.fmt_interval(t.get('interval'), '.2f')}, p {stats.fmt_p(t['p'])}{verdict}"


def quality_test_cell(t: dict | None) -> str:
    """A quality difference against the reference (points) with McNemar's p; "differs" only where p < 0.05."""
    if t is None:
        return "-"
    verdict = ": differs" if t["differs"] else ""
    return f"{100 * t['difference']:+.2f} pp, p {stats.fmt_p(t['p'])}{verdict}"


def n_text(row: dict) -> str:
    """Samples per task of a row: one number, or the range when the tasks differ."""
    n = row.get("n")
    if isinstance(n, str):
        return n
    if not n:
        return "-"
    failed = f" ({row['failed']} failed)" if row.get("failed") else ""
    return (str(n[0]) if len(n) == 1 else f"{n[0]}-{n[-1]}") + failed


def device_cell(row: dict) -> str:
    d = row.get("device")
    return d if isinstance(d, str) else (", ".join(d) if d else "-")


def _md_table(head: list[str], body: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(b) + " |" for b in body])


def _run_names(rs: RunSet) -> str:
    names = ", ".join(str(r.get("run_id") or Path(r["dir"]).name) for r in rs.runs)
    return f"runs {names}" if rs.merged else f"run {names}"


def legend(rs: RunSet) -> str:
    who = ours_label(rs)
    return (f"Cells: quality (accuracy or pass@1, %) / tokens per second (generated tokens / decode seconds, "
            f"ratio of sums). `n` = samples per task (a range when the tasks differ; the published rows score "
            f"whole test sets), `device` = where it decoded: with a small LIMIT and tiny or CPU models our rows "
            f"are not comparable in absolute terms with the published 7-8B GPU numbers. `{NOT_MEASURED}` = not "
            f"measured by {who}; `{MISSING}` = part of the run but its metrics file is absent (reported with "
            "--allow-partial); `(k/n)` after an average = mean over the k measured columns only. Avg = mean of "
            "the columns, as in the paper; a row never mixes prompt variants (a model measured with both has a "
            f"second row marked `{PAPER_ROW.strip()}`). `[lo, hi]` = 95% interval (harness/run/stats.py): quality by "
            "Wilson's score interval (items scored 0 or 1; else a bootstrap over items), tokens/s of a run timed in "
            "rounds by a bootstrap over rounds and items (harness/run/timing.py), of a single pass by a bootstrap over "
            "items (2000 resamples, fixed seed), Avg by a bootstrap stratified by task (a timed Avg tokens/s: the "
            "run's rounds drawn once for every task, each task's items on their own); a figure without one: the "
            "run kept no per-item logs for it (the published rows have none), or, for an Avg, the line under the "
            "table says why. The notes below say how each run's speed was timed.")


def run_notes(rs: RunSet) -> list[str]:
    """Resumed runs and merge decisions, one line each (shown in table1.md and index.md)."""
    from harness.run.summary import session_note, sessions

    out = []
    for r in rs.runs:
        note = timing_note(r)
        if note:
            out.append(f"{r['label']}: {note}")
        note = session_note(sessions(r))
        if note:
            out.append(f"{r['label']}: {note}")
        on = [m["name"] for m in r["models"] if compile_cell(rs, r, m) != "no"]
        if on:
            out.append(f"{r['label']}: {', '.join(on)} decoded compiled (decoder knob compile: torch.compile with static "
                       "shapes; compile seconds left out of tok/s); the other rows, and the published numbers, are eager.")
    return out + rs.notes


def timing_note(run: dict) -> str:
    """How a run's speed figures were timed (harness/run/timing.py): rounds, items, what the intervals resample and
    do not hold, the machine's state, and the items the rounds dropped."""
    from harness.run.rounds import load_timing
    from harness.run.guard import busy_text, combined_state, state_text
    from harness.run.timing import pairs_text

    timed = load_timing(Path(run["dir"]), run) if run.get("dir") else None
    if timed is None or not timed.get("passes"):
        why = (timed or {}).get("why") or "no timed rounds"
        return ("speed figures (tokens/s, speedups) are a single pass (" + why + "): the decoding pass's own times, "
                "one model after another; a change in the machine between models moves them unseen")
    counts = sorted({len(v) for v in (timed.get("docs") or {}).values()}) or [0]
    items = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    rounds = int(timed["settings"]["rounds"])
    text = (f"speed figures from {rounds} timed rounds of {items} item(s) per task, the models in turn: tokens/s the "
            f"median over rounds; a task's speedup the geometric mean over its timed items of each item's median "
            f"over its {pairs_text(rounds)}, its interval a two-level bootstrap (the items, then each item's round "
            "pairs); the intervals do not hold the machine's state between runs")
    guards = [p_.get("guard") for p_ in timed["passes"]]
    state = combined_state(guards)
    busy = [g for g in guards if (g or {}).get("busy")]
    if state == "busy" and busy:
        text += f"; **{busy_text(busy[0])}**"
    elif state == "unknown":
        text += f"; **{state_text(guards)}**"
    dropped = timed.get("dropped") or []
    if dropped:
        text += "; **dropped from the rounds (a fault twice): " + "; ".join(
            f"{d['side']} on {d['group']} document(s) {', '.join(str(x[1]) for x in d['docs'])} ({d['reason']})"
            for d in dropped) + "**"
    return text


def compile_cell(rs: RunSet, run: dict, model: dict) -> str:
    """A model's cell in the runs table: "no" (eager), or "yes" with the graphs compiled and their seconds: the
    run's summary.json totals (warm-up calls included) when it has them, else the sum over its metrics files."""
    mets = [met for met in rs.metrics.values() if met.get("model") == model["name"]
            and (met.get("run") or {}).get("run_id") == run.get("run_id")]
    comp = [(met.get("speed") or {}).get("compile") or {} for met in mets]
    resolved = (model.get("resolved_knobs") or {}).values()
    if not ((run.get("compile") or {}).get(model["name"]) or any(c.get("compiled") for c in comp)
            or any(k.get("compile") for k in resolved)):
        return "no"
    path = Path(run["dir"]) / "summary.json"
    total = ((read_json(path).get("compile") or {}).get(model["name"]) if path.is_file() else None) or {
        "compilations": sum(c.get("compilations", 0) for c in comp), "compile_s": sum(c.get("compile_s", 0.0) for c in comp)}
    return f"yes: {total['compilations']} compilation(s), {total['compile_s']:.1f} s"


def _prompts_line(rs: RunSet) -> str:
    kinds = sorted({m.get("prompts", "stock") for m in rs.models})
    if kinds == ["paper"]:
        return "Prompts: the ReFusion authors' variants (`--prompts paper` or their task names)."
    if kinds == ["stock"]:
        return "Prompts: lm-eval's stock prompts."
    return f"Prompts: both variants; rows marked `{PAPER_ROW.strip()}` used the authors' prompts."


def _row_cells(r: dict, suite: paper.Suite) -> list[str]:
    return [r["model"], r["decoder"], n_text(r), device_cell(r), *[cell_text(r, c.key) for c in suite.columns],
            avg_text(r, len(suite.columns))]


def table1_md(rs: RunSet, data: dict) -> str:
    lines = [f"# Table 1: {_run_names(rs)}", "", legend(rs), "", _prompts_line(rs), ""]
    lines += [f"**Note:** {x}" for x in run_notes(rs)] + ([""] if run_notes(rs) else [])
    heading = "These runs" if rs.merged else "This run"
    for s in data["suites"]:
        suite: paper.Suite = s["suite"]
        head = ["Model", "decoder", "n", "device", *[c.label for c in suite.columns], "Avg"]
        lines += [f"## {suite.title}", "", f"### {heading}", ""]
        table, beyond = split_rows(s["ours"])
        if not suite_measured(s["ours"]):
            lines += [f"{heading} measured none of these tasks."]
        elif table:
            lines += _md_table(head, [_row_cells(r, suite) for r in table])
        else:
            lines += [f"{heading} has no row of a Table 1 system (see {BEYOND_TITLE} below)."]
        if beyond and suite_measured(s["ours"]):
            lines += ["", f"### {BEYOND_TITLE}", "", BEYOND_NOTE, ""]
            lines += _md_table(head, [_row_cells(r, suite) for r in beyond])
        why = [f"{r['model']}: {r['average'][f'{w}_ci_why']}" for r in s["ours"] for w in ("quality", "tokens_per_s")
               if r["average"].get(f"{w}_ci_why") and suite_measured(s["ours"])]
        if why:
            lines += ["", "Avg without an interval: " + "; ".join(why) + "."]
        metrics = sorted({f"{c['task']}={c['quality_metric']}" for r in s["ours"] for c in r["cells"].values()})
        if metrics:
            lines += ["", "Quality metric per task: " + ", ".join(metrics)]
        if s["published"]:
            lines += ["", f"### Published ({paper.source()})", ""]
            lines += _md_table(head, [_row_cells(r, suite) for r in s["published"]])
        lines.append("")
    return "\n".join(lines)


def _csv_value(row: dict, key: str, what: str) -> str | float:
    st = row["status"].get(key, NOT_MEASURED)
    if st != "ok":
        return st
    v = row["cells"][key][what]
    if v is None:
        return NOT_MEASURED
    return round(v, 6) if isinstance(v, float) else v


def table1_csv(data: dict) -> str:
    cols = [c for s in data["suites"] for c in s["suite"].columns]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["suite", "source", "model", "decoder", "device"]
               + [f"{c.key}_{what}" for c in cols for what in ("quality", "tokens_per_s", "n")]
               + ["avg_quality", "avg_tokens_per_s", "avg_columns", "avg_columns_total"]
               + [f"{c.key}_{what}_{end}" for c in cols for what in ("quality", "tokens_per_s") for end in ("lo", "hi")]
               + [f"avg_{what}_{end}" for what in ("quality", "tokens_per_s") for end in ("lo", "hi")]
               + ["section"])
    for s in data["suites"]:
        keys = {c.key for c in s["suite"].columns}
        for r in (s["ours"] if suite_measured(s["ours"]) else []) + s["published"]:
            vals = []
            for c in cols:
                for what in ("quality", "tokens_per_s", "samples"):
                    if c.key not in keys:
                        vals.append("")
                    elif what == "samples" and r["source"] == "published":
                        vals.append(PUBLISHED_N if r["status"].get(c.key) == "ok" else NOT_MEASURED)
                    else:
                        vals.append(_csv_value(r, c.key, what))
            a = r["average"]
            ivs = []
            for c in cols:
                for what in ("quality", "tokens_per_s"):
                    iv = (r["cells"].get(c.key) or {}).get(f"{what}_ci") if c.key in keys else None
                    ivs += [NOT_MEASURED if iv is None else round(iv[end], 6) for end in ("lo", "hi")]
            ivs += [NOT_MEASURED if a.get(f"{what}_ci") is None else round(a[f"{what}_ci"][end], 6)
                    for what in ("quality", "tokens_per_s") for end in ("lo", "hi")]
            w.writerow([s["suite"].name, r["source"], r["model"], r["decoder"], device_cell(r), *vals,
                        NOT_MEASURED if a["quality"] is None else round(a["quality"], 6),
                        NOT_MEASURED if a["tokens_per_s"] is None else round(a["tokens_per_s"], 6),
                        a["columns"], len(s["suite"].columns), *ivs,
                        "published" if r["source"] == "published" else
                        "beyond table 1" if beyond_table1(r) else "table 1"])
    return buf.getvalue()


def _tex(text: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("_", r"\_"), ("#", r"\#"),
                 ("$", r"\$")):
        text = text.replace(a, b)
    return text


def table1_tex(rs: RunSet, data: dict) -> str:
    out = [f"% Table 1 from {_tex(_run_names(rs))}; published rows: {_tex(paper.source())}.",
           f"% {NOT_MEASURED}: not measured by {ours_label(rs)}; {MISSING}: metrics file absent; (k/n): mean of k "
           "columns; n: samples per task; device: where it decoded."]
    for s in data["suites"]:
        suite = s["suite"]
        n = len(suite.columns)
        out += [f"% {suite.title}", "\\begin{tabular}{llll" + "c" * (n + 1) + "}", "\\hline",
                " & ".join(["Model", "Decoder", "n", "Device", *[_tex(c.label) for c in suite.columns], "Avg"])
                + r" \\", "\\hline"]
        table, beyond = split_rows(s["ours"]) if suite_measured(s["ours"]) else ([], [])
        for r in table:
            out.append(" & ".join(_tex(x) for x in _row_cells(r, suite)) + r" \\")
        if beyond:
            out += ["\\hline", f"\\multicolumn{{{n + 5}}}{{l}}{{\\emph{{{BEYOND_TITLE} (no published numbers)}}}} \\\\",
                    "\\hline"]
            for r in beyond:
                out.append(" & ".join(_tex(x) for x in _row_cells(r, suite)) + r" \\")
        if s["published"]:
            out += ["\\hline", f"\\multicolumn{{{n + 5}}}{{l}}{{\\emph{{Published: {_tex(paper.source())}}}}} \\\\",
                    "\\hline"]
            for r in s["published"]:
                out.append(" & ".join(_tex(x) for x in _row_cells(r, suite)) + r" \\")
        out += ["\\hline", "\\end{tabular}", ""]
    return "\n".join(out)


CONVENTION = ("speedup = TPS(model) / TPS(reference), same task, same run or runs on the same hardware with the "
              "same dtype and batch size (run.json), TPS = generated tokens / decode "
              "seconds (ratio of sums). **mean of ratios** = mean over the tasks of the per-task speedups (the "
              "paper's headline convention: ReFusion is 2.33x faster than Qwen3-8B); **ratio of averages** = mean "
              "TPS of the model / mean TPS of the reference over the same tasks (2.24x for that pair). "
              f"`{NOT_MEASURED}`: either side not measured, or measured in runs that are not comparable (the reason "
              "follows the table). Rows timed in the same run's rounds (harness/run/timing.py): a per-task speedup is "
              "the geometric mean over the timed items of each item's speedup (the median over its disjoint round "
              "pairs, rounds 1+2, 3+4, ..., of the ratio of tokens/s on it), with its 95% interval from a two-level "
              "bootstrap (the items, then each item's round pairs), and the mean of ratios the arithmetic mean of "
              "those, each task resampled on its own. Single passes where both rows kept per-item logs: a "
              "per-task speedup is the ratio of throughputs on the items both decoded, with its 95% interval and "
              "p-value from a paired bootstrap over those items, and the mean of ratios a bootstrap stratified by "
              "task. Each point is its interval's statistic at the full sample. The quality table below each compares the two rows' answers item "
              "by item (McNemar's exact test). \"differs\" only where p < 0.05 (harness/run/stats.py).")


def speedup_md(rs: RunSet, data: dict) -> str:
    lines = [f"# Speedup: {_run_names(rs)}", "", CONVENTION, ""]
    lines += [f"**Note:** {x}" for x in run_notes(rs)] + ([""] if run_notes(rs) else [])
    refs = references(rs)
    if not refs:
        lines += [f"{'These runs have' if rs.merged else 'This run has'} no AR model and no MDM baseline to "
                  "measure speedups against.", ""]
    for s in data["suites"]:
        suite = s["suite"]
        measured = [c for c in suite.columns if any(r["status"][c.key] == "ok" for r in s["ours"])]
        if not ((measured and refs) or s["published_speedups"]):
            continue
        lines += [f"## {suite.title}", ""]
        if not measured:
            lines += [f"{'These runs' if rs.merged else 'This run'} measured none of these tasks.", ""]
        for ref, role in refs if measured else []:
            rows = [x for x in s["speedups"] if x["reference"] == ref]
            lines += [f"### vs {ref} ({role})", ""]
            lines += _md_table(["model", "decoder", *[c.label for c in measured], "mean of ratios",
                                "ratio of averages"],
                               [[x["model"], x["decoder"], *[speedup_cell(x, c.key) for c in measured],
                                 _num(x["mean_of_ratios"]) + stats.fmt_interval(x.get("mean_of_ratios_interval"), ".2f"),
                                 _num(x["ratio_of_averages"])] for x in rows])
            lines.append("")
            if any(x.get("quality_tests") for x in rows):
                lines += [f"Quality against {ref}, item by item (points, McNemar's exact test):", ""]
                lines += _md_table(["model", "decoder", *[c.label for c in measured]],
                                   [[x["model"], x["decoder"], *[quality_test_cell((x.get("quality_tests") or {}).get(
                                       c.key)) for c in measured]] for x in rows])
                lines.append("")
            for why in sorted({w for x in rows for w in x["refused"]}):
                lines += [f"Not divided ({', '.join(x['model'] for x in rows if why in x['refused'])}): {why}.", ""]
        if s.get("claims"):
            lines += claims_md(s["claims"])
        if s["published_speedups"]:
            lines += [f"### Published speedups of ReFusion, for reference ({paper.source()})", ""]
            lines += _md_table(["model", "vs", *[c.label for c in suite.columns], "mean of ratios",
                                "ratio of averages"],
                               [[x["model"], x["reference"], *[_num(x["per_task"][c.key]) for c in suite.columns],
                                 _num(x["mean_of_ratios"]), _num(x["ratio_of_averages"])]
                                for x in s["published_speedups"]])
            lines.append("")
    return "\n".join(lines)


def claims_md(rows: list[dict]) -> list[str]:
    """The paper's speedup claims, published value beside ours (mean of per-task ratios and ratio of averages)."""
    lines = [f"### The paper's speedup claims beside ours ({paper.source()})", "",
             "Published: the paper's tokens/s over the seven benchmarks. Ours: the same two systems among our rows "
             "(same decoder, same model family), over the tasks both measured, so with a small LIMIT, other "
             "hardware or tiny models the values measure this setup, not the paper's.", ""]
    body = []
    for c in rows:
        o, p = c["ours"] or {}, c["published"]
        body.append([c["claim"], _num(p["mean_of_ratios"]), _num(o.get("mean_of_ratios")), _num(p["ratio_of_averages"]),
                     _num(o.get("ratio_of_averages")), str(o.get("tasks", 0)),
                     " / ".join(x for x in c["rows"] if x) if c["ours"] else c["why"]])
    lines += _md_table(["claim", "published mean of ratios", "ours", "published ratio of averages", "ours",
                        "tasks (ours)", "our rows"], body)
    return lines + [""]


def _show_path(path: str) -> str:
    """Paths inside the repository relative to it, so a committed report names no machine's folders."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def index_md(rs: RunSet, data: dict, figures: dict[str, str], memory: bool = False) -> str:
    lines = [f"# Report: {_run_names(rs)}", "",
             "- [table1.md](table1.md) (also [table1.csv](table1.csv), [table1.tex](table1.tex)): the paper's "
             f"Table 1 layout, {ours_label(rs)} beside the published numbers ({paper.source()})",
             "- [speedup.md](speedup.md): per-task speedups, mean of ratios and ratio of averages",
             "- [report.json](report.json): every number of this report", ""]
    if memory:
        lines[-1:-1] = ["- [memory.md](memory.md): peak decode memory per decoder (KV cache, logits, other) beside "
                        "the weights, and the estimate at the released sizes beside the paper's memory claim"]
    if any(name.startswith("frontier_") for name in figures):
        lines[-1:-1] = ["- [aup.md](aup.md) and [frontier.json](frontier.json): each decoder's accuracy-parallelism "
                        "frontier, its AUP per task and the Pareto sets (`make frontier`)"]
    if rs.missing:
        lines += [f"**Partial:** {len(rs.missing)} (model, task) metrics file(s) missing, marked `{MISSING}`: "
                  + ", ".join(f"{m} on {u}" for m, u, _ in rs.missing), ""]
    for note in run_notes(rs):
        lines += [f"Note: {note}", ""]
    lines += ["## Figures", ""]
    for name, caption in figures.items():
        lines += [f"### {caption}", "", f"![{caption}]({name})", ""]
    lines += ["## Runs", ""]
    from harness.run.summary import resumed, sessions

    for r in rs.runs:
        env = r.get("environment") or {}
        pk = env.get("packages") or {}
        name = r.get("run_id") or Path(r["dir"]).name
        k = resumed(sessions(r))
        lines += [f"### {name}" + (f" (label {r['label']})" if r["label"] != name else ""), "",
                  f"- folder `{_show_path(r['dir'])}`, created {r.get('created')}"
                  + (f", resumed: measured in {k} sessions" if k > 1 else "")
                  + (f", merged from {len(r['merged_from'])} shards" if r.get("merged_from") else ""),
                  f"- task `{r.get('task')}` ({', '.join(u['name'] for u in r['units'])}), limit {r.get('limit')}, "
                  f"seed {r.get('seed')}, batch size {r.get('batch_size')}, chat template {r.get('chat_template')}, "
                  f"prompts {r.get('prompts') or 'stock'}, paper task defaults {r.get('task_defaults')}, "
                  f"speedup baseline {r.get('baseline')}, dtype {r.get('dtype', 'float32')}"
                  + (f", chat template arguments {r['chat_template_args']}" if r.get("chat_template_args") else ""),
                  f"- device {device_text(r)}, {r.get('threads')} thread(s) x {r.get('num_processes')} process(es)",
                  f"- environment: commit {env.get('git_commit')}{' (dirty)' if env.get('git_dirty') else ''}, "
                  f"python {env.get('python')}, torch {pk.get('torch')}, transformers {pk.get('transformers')}, "
                  f"lm-eval {pk.get('lm-eval')}, CPU {env.get('cpu')} ({env.get('cpu_count')} cores), "
                  f"GPU {env.get('gpu')}, {env.get('platform')}", "",
                  "| model | decoder | checkpoint | knobs given | knobs used per task (resolved) | compiled |",
                  "|---|---|---|---|---|---|"]
        for m in r["models"]:
            given = {**(m.get("knobs") or {}), **({"chat_template_args": m["chat_template_args"]}
                                                   if "chat_template_args" in m else {})}
            knobs = ", ".join(f"{k}={v}" for k, v in sorted(given.items())) or "-"
            # What each task really ran with (decoder defaults < checkpoint < task < model knobs); runs
            # recorded before resolved_knobs existed show their task defaults instead.
            used = m.get("resolved_knobs") or m.get("task_knobs") or {}
            per_task = "; ".join(f"{t}: " + ", ".join(f"{k}={v}" for k, v in sorted(tk.items()))
                                 for t, tk in sorted(used.items())) or "-"
            ckpt = f"`{_show_path(m['checkpoint'])}`" + (f" + base `{_show_path(m['base'])}`" if m.get("base") else "")
            lines.append(f"| {m['name']} | {m['decoder']} | {ckpt} | {knobs} | {per_task} | {compile_cell(rs, r, m)} |")
        lines.append("")
    return "\n".join(lines)


def _json_ready(data: dict) -> dict:
    return {"baseline": data["baseline"], "suites": [
        {**{k: v for k, v in s.items() if k != "suite"}, "name": s["suite"].name, "title": s["suite"].title,
         "columns": [{"key": c.key, "label": c.label, "tasks": list(c.tasks)} for c in s["suite"].columns]}
        for s in data["suites"]], "published_source": paper.source()}


# ---------------------------------------------------------------- command


def write_report(rs: RunSet, target: Path, traces: bool = True) -> Path:
    """Build every file into a temp folder and swap it in as ``target``; `traces`: draw one logged decode
    trace per task under trace/ (else the index names the `make trace` command of each)."""
    from harness.report import figures

    from harness.run.store import atomic_write_json, atomic_write_text

    data = build(rs)
    with atomic_dir(target) as tmp:
        atomic_write_text(tmp / "table1.md", table1_md(rs, data))
        atomic_write_text(tmp / "table1.csv", table1_csv(data))
        atomic_write_text(tmp / "table1.tex", table1_tex(rs, data))
        atomic_write_text(tmp / "speedup.md", speedup_md(rs, data))
        atomic_write_json(tmp / "report.json", {"runs": [_show_path(r["dir"]) for r in rs.runs],
                                                "missing": [(m, u, _show_path(d)) for m, u, d in rs.missing],
                                                "notes": run_notes(rs), **_json_ready(data)})
        made = figures.save_all(figures.build_all(rs, data), tmp)
        from harness.report.trace import report_traces  # one logged sample per task, when the runs recorded traces

        from harness.report import aup  # a frontier run (`make frontier`): its figures, aup.md, frontier.json

        made.update(aup.write(rs, tmp, _run_names(rs)))
        from harness.report.memory_report import memory_md  # decode peaks, and the estimate at released size

        memory = memory_md(rs)
        if memory:
            atomic_write_text(tmp / "memory.md", memory)
        atomic_write_text(tmp / "index.md", index_md(rs, data, made, memory is not None)
                          + report_traces(rs, tmp, draw=traces))
        from harness.run.faults import pause_at

        pause_at("report")  # a test hook: a stop signal before the new report folder is swapped in
    return target


def _parser() -> argparse.ArgumentParser:
    p = run_parser("report", __doc__)
    p.add_argument("--no-traces", dest="traces", action="store_false",
                   help="draw no decode traces: the index names the `make trace` command of each task's logged "
                        "sample instead (the committed reports are made so: they keep no trace/ folder)")
    return p


def check_name(name: str) -> str:
    if not name or name.startswith(".") or "/" in name:
        raise InputError(f"--name {name!r}: use a plain folder name")
    return name


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    try:
        dirs, labels = resolve_runs(ns.run, Path(ns.runs_root))
        name = check_name(ns.name or "+".join(d.name for d in dirs))
        rs = load_runs(dirs, allow_partial=ns.allow_partial, labels=labels)
        if not rs.metrics:
            raise InputError(f"{', '.join(map(str, dirs))}: no metrics file at all (run not started?)")
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    target = write_report(rs, Path(ns.out) / name, traces=ns.traces)
    print(f"wrote {target}/index.md ({len(rs.metrics)} (model, task) cells from {len(dirs)} run(s)"
          f"{f', {len(rs.missing)} missing' if rs.missing else ''})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
