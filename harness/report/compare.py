"""`python -m harness compare` / `make compare`: the same models in two or more runs side by side.

    python -m harness compare --run runA,runB              # ratios runB / runA per (model, task)
    python -m harness compare --run base=runA,new=runB     # name the runs' columns
    python -m harness compare                              # the two newest runs under --runs-root

For every model name and benchmark measured in the runs, each figure (quality, tokens/s, TPF,
NFE, latency p50/p90, decode peak memory and weights, the run's own speedup over its AR model) is shown per run with
its 95% interval, and with its ratio to the first run. Where two runs measured the same items,
the ratio is a paired test (harness/run/stats.py): McNemar's exact test for quality, a paired
bootstrap for TPF and NFE (interval and p-value); a row "differs" only where p < 0.05, and
the rows that differ are listed first with their p-values. A speedup is judged against the between-run spread of
idle runs of identical code on the machine, from a spread file of `make spread` (``--spread FILE``:
``timing.spread_rule``); without one, compare says it cannot tell. Absolute tokens/s and latency get their ratio
and are not judged. Models pair up by name, so a preset run with other knobs
(``MODELS=refusion:slot_size=8`` in one run, ``MODELS=refusion`` in the other) lines up with
itself; a benchmark pairs up across prompt variants (``gsm8k_cot`` with ``gsm8k_cot_paper``), so
stock and paper prompts can be compared too. The settings that differ between the runs, run-wide
and per model, are listed first. Writes ``<out>/<name>/`` (default ``compare-<a>-vs-<b>``):

    compare.md     the tables
    compare.csv    one line per (model, benchmark, figure): each run's value and its ratio
    compare.json   everything above, machine-readable

Bad input (no such run, an unfinished one without --allow-partial, fewer than two runs) is one
``error:`` line, exit 2, nothing written.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path
from typing import Any, Callable

from harness.report import paper
from harness.run import stats
from harness.run.metrics import speedup
from harness.report.paper_report import NOT_MEASURED, _show_path, check_name, quality_pct, tps
from harness.report.runset import InputError, _read, device_text, resolve_runs, run_parser
from harness.run.summary import resumed, sessions
from harness.run.store import atomic_dir, atomic_write_json, atomic_write_text
from harness.report.timed import is_timed, speed_interval


def _speed(met: dict, *path: str) -> Any:
    v: Any = met.get("speed") or {}
    for p in path:
        v = (v or {}).get(p)
    return v


def _memory_mib(met: dict) -> float | None:
    """The decode peak (the memory pass) in MiB; a run without one has no figure here (its RSS is the
    interpreter, the libraries and the weights, not decoding)."""
    v = (met.get("memory") or {}).get("decode_peak_bytes")
    return None if v is None else v / 2**20


def _weights_mib(met: dict) -> float | None:
    v = (met.get("memory") or {}).get("weights_bytes")
    return None if v is None else v / 2**20


# (key, heading, value from a metrics JSON, format)
FIGURES: list[tuple[str, str, Callable[[dict], Any], str]] = [
    ("quality", "quality (%, accuracy or pass@1)", quality_pct, ".2f"),
    ("tokens_per_s", "tokens/s (ratio of sums)", tps, ".2f"),
    ("tpf", "tokens per forward (TPF)", lambda m: _speed(m, "tpf", "ratio_of_sums"), ".2f"),
    ("nfe_mean", "forwards per sample (NFE)", lambda m: _speed(m, "nfe", "mean"), ".1f"),
    ("latency_p50_s", "latency p50 (s per sample)", lambda m: _speed(m, "latency_s", "p50"), ".3f"),
    ("latency_p90_s", "latency p90 (s per sample)", lambda m: _speed(m, "latency_s", "p90"), ".3f"),
    ("decode_peak_mib", "decode peak MiB (tensor bytes of one decoder call; the memory pass)", _memory_mib, ".2f"),
    ("weights_mib", "weights MiB", _weights_mib, ".2f"),
    ("speedup", "speedup over the run's own AR model (x)", lambda m: (m.get("speedup") or {}).get("tokens_per_s"),
     ".2f"),
]
# Figures with a paired test between runs on the same items: quality (McNemar) and the per-item speed figures
# (paired bootstrap of the ratio); memory (a peak) and the run's own speedup (a ratio of ratios) have none.
PAIRED_SPEED = ("tokens_per_s", "tpf", "nfe_mean", "latency_p50_s", "latency_p90_s")
RUN_KEYS = ("task", "limit", "seed", "prompts", "chat_template", "task_defaults", "batch_size", "num_processes",
            "threads")
MODEL_KEYS = ("decoder", "checkpoint", "knobs", "task_knobs")


def benchmark_of(unit: str) -> str:
    """The Table 1 column a task fills (its prompt variants share one), else the task itself."""
    for suite in paper.suites():
        for col in suite.columns:
            if unit in col.tasks:
                return col.key
    return unit


def load(dirs: list[Path], labels: list[str | None], allow_partial: bool) -> dict:
    runs = []
    for d, label in zip(dirs, labels):
        cfg = _read(d / "run.json")
        for key in ("models", "units"):
            if not isinstance(cfg.get(key), list):
                raise InputError(f"{d}/run.json: no {key!r} list (not written by `harness eval`?)")
        mets, absent = {}, []
        for m in cfg["models"]:
            for u in cfg["units"]:
                path = d / "metrics" / f"{m['name']}__{u['name']}.json"
                if path.is_file():
                    mets[(m["name"], u["name"])] = _read(path)
                else:
                    absent.append(path.name)
        if absent and not allow_partial:
            raise InputError(f"{d}: unfinished run, missing metrics/{absent[0]}"
                             f"{f' and {len(absent) - 1} more' if len(absent) > 1 else ''} (resume it, or compare "
                             "it with --allow-partial)")
        runs.append({"dir": d, "cfg": cfg, "label": label or cfg.get("run_id") or d.name, "metrics": mets,
                     "missing": absent})
    return {"runs": runs}


def pair(runs: list[dict]) -> list[dict]:
    """One entry per (model, benchmark) measured in any run, with each run's task and metrics."""
    per_run: list[dict[tuple[str, str], list[str]]] = []
    for r in runs:
        by: dict[tuple[str, str], list[str]] = {}
        for (model, unit) in r["metrics"]:
            by.setdefault((model, benchmark_of(unit)), []).append(unit)
        per_run.append(by)
    # A run that measured two variants of one benchmark (gsm8k_cot and gsm8k_cot_paper) pairs by task instead.
    ambiguous = {k for by in per_run for k, units in by.items() if len(units) > 1}
    order: dict[tuple[str, str], dict] = {}
    models = list(dict.fromkeys(m["name"] for r in runs for m in r["cfg"]["models"]))
    col_order = [c.key for s in paper.suites() for c in s.columns]
    for i, r in enumerate(runs):
        for (model, unit), met in r["metrics"].items():
            bench = benchmark_of(unit)
            key = (model, unit) if (model, bench) in ambiguous else (model, bench)
            entry = order.setdefault(key, {"model": model, "benchmark": key[1], "tasks": {}, "metrics": {},
                                           "dirs": {}})
            entry["tasks"][r["label"]] = unit
            entry["metrics"][r["label"]] = met
            entry["dirs"][r["label"]] = r["dir"]
    rank = {b: i for i, b in enumerate(col_order)}
    return sorted(order.values(), key=lambda e: (models.index(e["model"]) if e["model"] in models else len(models),
                                                 rank.get(e["benchmark"], len(rank)), e["benchmark"]))


def entry_items(e: dict) -> dict[str, stats.Items | None]:
    """Per run label, the entry's items from that run's per-sample log (None where it kept none), each leaf
    named by its benchmark, so a stock and a paper prompt variant of one benchmark pair by document."""
    return {lab: stats.read_items(e["dirs"][lab], e["model"], unit, e["metrics"][lab].get("quality_primary"),
                                  rename=benchmark_of) for lab, unit in e["tasks"].items()}


def _value_interval(key: str, met: dict, it: stats.Items | None, stream: str) -> dict | None:
    """A figure's 95% interval in the figure's own unit (quality in %), or None."""
    if key == "quality":
        prim = met.get("quality_primary")
        n = (_speed(met, "samples") or 0) + (met.get("failed") or {}).get("count", 0)
        iv = stats.quality_interval(it, (met.get("quality") or {}).get(prim) if prim else None, n, (stream, "quality"))
        return None if iv is None else iv.scaled(100.0).to_dict()
    if key == "speedup":
        return (met.get("speedup") or {}).get("interval")
    if key in WALL and key not in PASS_LATENCY and is_timed(met):  # timed rounds: their interval
        return speed_interval(met, key)
    if key in stats.SPEED and it is not None:
        got = stats.percentile_interval(stats.speed_dist(it, key, stream))
        return None if got is None else {"lo": got[0], "hi": got[1], "method": "bootstrap"}
    return None


# Wall-clock figures: never judged by a paired test over items (the difference between two runs lies between the
# runs, not the items), nor by the rounds of one run (they hold that run's machine state only): a speedup against
# a spread file's between-run spread (timing.spread_verdict); the absolute figures not at all.
WALL = {"tokens_per_s": "per_round_tokens_per_s", "latency_p50_s": None, "latency_p90_s": None, "speedup": None}
PASS_LATENCY = ("latency_p50_s", "latency_p90_s")
NOT_TESTABLE = "not testable: one timed pass per run"
# Absolute wall-clock figures of two runs are not judged: the machine's own speed between the runs is in
# neither run's rounds (a shared machine's speed can move by tens of percent between two idle runs of the same
# code, docs/history.md). A run's speedup over its own reference is measured interleaved, and that is what is
# judged between runs.
NOT_JUDGED = "not judged across runs: absolute speed moves with the machine between runs; the speedup is judged"
NO_SPREAD = ("cannot tell: no between-run spread given (one run's rounds hold its own machine state, not the next "
             "run's): measure this machine's with `make spread`, then pass it with --spread FILE")


class Spread:
    """A spread file of `make spread` (results/speed_spread_<name>.json): per (model, task) the speedups of its
    quiet idle runs, the statistic they were made with and their timing settings. ``load`` checks it."""

    def __init__(self, path: Path, data: dict) -> None:
        self.path, self.command = path, data.get("command")
        quiet = [r for r in data.get("runs") or [] if r.get("machine") == "quiet"]
        self.runs, self.flagged = len(quiet), len(data.get("runs") or []) - len(quiet)
        self.values: dict[str, list[float]] = {}
        for r in quiet:
            for key, v in (r.get("rows") or {}).items():
                if v.get("speedup"):
                    self.values.setdefault(key, []).append(float(v["speedup"]))
        self.settings = {(r.get("rounds"), r.get("timed_items")) for r in quiet}

    @classmethod
    def load(cls, path: str | Path) -> "Spread":
        from harness.run.timing import MIN_SPREAD_RUNS, RATIO_STATISTIC

        p = Path(path)
        data = _read(p) if p.is_file() else None
        if not isinstance(data, dict) or not data.get("runs"):
            raise InputError(f"--spread {path}: not a spread file of `make spread` (results/speed_spread_<name>.json "
                             "with its runs)")
        if data.get("statistic") != RATIO_STATISTIC:
            raise InputError(f"--spread {path}: made with another speedup statistic (an older version: "
                             f"{str(data.get('version_note') or 'no statistic recorded')[:120]}); measure again "
                             "with `make spread`")
        got = cls(p, data)
        if got.runs < MIN_SPREAD_RUNS:
            raise InputError(f"--spread {path}: {got.runs} quiet run(s); the rule needs at least {MIN_SPREAD_RUNS}")
        return got

    def judge(self, ma: dict, mb: dict) -> dict:
        """The speedup of ``mb`` against ``ma`` (two runs' metrics of one model and task), or why not judged."""
        from harness.run.timing import spread_factor, spread_verdict

        key = f"{ma.get('model')}/{ma.get('task')}"
        thr = spread_factor(self.values.get(key, []))
        if thr is None:
            return {"test": f"not judged: {self.path.name} holds {len(self.values.get(key, []))} quiet run(s) of "
                            f"{key} (the rule needs at least 5)", "p": None, "differs": False, "items": "-",
                    "not_testable": True}
        mine = {(((m.get("speed") or {}).get("timing") or {}).get("rounds"),
                 ((m.get("speed") or {}).get("timing") or {}).get("items")) for m in (ma, mb)}
        if not mine <= self.settings:
            return {"test": f"not judged: the runs were timed with other rounds or timed items than {self.path.name}'s "
                            f"(runs {sorted(mine, key=str)}, spread {sorted(self.settings, key=str)})", "p": None,
                    "differs": False, "items": "-", "not_testable": True}
        got = spread_verdict(ma["speedup"]["tokens_per_s"], mb["speedup"]["tokens_per_s"], thr)
        return {**got, "items": f"{thr['runs']} idle runs"}


def _rounds_of(key: str, met: dict) -> list[float] | None:
    """A run's independent per-round (tokens/s) or per-round-pair (speedup) values of a wall-clock figure (None
    for a single pass, or a run written before the pairs were disjoint)."""
    if key == "speedup":
        return (met.get("speedup") or {}).get("per_pair")
    if key in PASS_LATENCY:
        return None
    t = (met.get("speed") or {}).get("timing") or {}
    return t.get(WALL[key]) if t.get("mode") == "interleaved" else None


def _between(key: str, ma: dict, mb: dict, spread: Spread | None = None) -> dict | None:
    """A wall-clock figure of two runs: a speedup against the spread file's between-run spread (``Spread.judge``;
    without one, NO_SPREAD), an absolute figure not judged; 'not testable' for a single pass (printed with the
    ratio, no p)."""
    if key in PASS_LATENCY:  # absolute seconds of each run's own pass: the machine between runs is in them
        return {"test": NOT_JUDGED, "p": None, "differs": False, "items": "-", "not_judged": True}
    a, b = _rounds_of(key, ma), _rounds_of(key, mb)
    if a and b:
        if key != "speedup":  # the ratio of medians over rounds, printed and not judged
            import statistics

            med_a = statistics.median(a)
            got = {"ratio": statistics.median(b) / med_a if med_a > 0 else None, "p": None, "differs": False,
                   "not_judged": True, "test": NOT_JUDGED}
        elif spread is None:
            got = {"ratio": None, "p": None, "differs": False, "not_testable": True, "test": NO_SPREAD}
        else:
            got = spread.judge(ma, mb)
        docs = [((m.get("speed") or {}).get("timing") or {}).get("docs") for m in (ma, mb)]
        notes = []
        if docs[0] is not None and docs[1] is not None and docs[0] != docs[1]:
            notes.append("the runs timed different items")
        busy = [lab for lab, m in (("first", ma), ("second", mb))
                if ((m.get("speed") or {}).get("timing") or {}).get("busy")]
        if busy:
            notes.append(f"the {' and '.join(busy)} run measured on a busy machine")
        if notes:
            got["note"] = "; ".join(notes)
        return {"items": f"{len(a)} vs {len(b)} {'round pairs' if key == 'speedup' else 'rounds'}", **got}
    if key == "speedup" and not ((ma.get("speedup") or {}).get("tokens_per_s") and
                                 (mb.get("speedup") or {}).get("tokens_per_s")):
        return None
    return {"test": NOT_TESTABLE, "p": None, "differs": False, "items": "-", "not_testable": True}


def _paired(key: str, a: stats.Items | None, b: stats.Items | None, stream: str) -> dict | None:
    """The paired test of a figure between two runs on their shared items (None: no test for this figure, or
    no per-item logs, or no shared item)."""
    if a is None or b is None:
        return None
    if key == "quality":
        return stats.paired_quality(a, b, stream)
    if key in PAIRED_SPEED:
        return stats.paired_ratio(a, b, key, stream)
    return None


def figures_of(entries: list[dict], labels: list[str], spread: Spread | None = None) -> list[dict]:
    """Every figure per entry and run with its 95% interval, its ratio to the first run and, where both runs
    measured the same items, the paired test of the difference (``tests``)."""
    ref = labels[0]
    out = []
    for e in entries:
        items = entry_items(e)
        figs = {}
        for key, _, get, _fmt in FIGURES:
            vals = {lab: (get(e["metrics"][lab]) if lab in e["metrics"] else None) for lab in labels}
            ivs = {lab: (_value_interval(key, e["metrics"][lab], items.get(lab), e["benchmark"])
                         if vals[lab] is not None else None) for lab in labels}
            tests = {lab: (None if vals[lab] is None or vals[ref] is None else
                           _between(key, e["metrics"][ref], e["metrics"][lab], spread) if key in WALL else
                           _paired(key, items.get(ref), items.get(lab), e["benchmark"])) for lab in labels[1:]}
            figs[key] = {"values": vals, "intervals": ivs, "ratios": {lab: speedup(vals[lab], vals[ref])
                                                                      for lab in labels[1:]}, "tests": tests}
        out.append({"model": e["model"], "benchmark": e["benchmark"], "tasks": e["tasks"],
                    "samples": {lab: _speed(e["metrics"][lab], "samples") for lab in labels if lab in e["metrics"]},
                    "figures": figs})
    return out


def differing(rows: list[dict], labels: list[str]) -> list[dict]:
    """Every (model, benchmark, figure, run) whose paired test says it differs from the first run."""
    out = []
    for r in rows:
        for key, heading, _, _ in FIGURES:
            for lab, t in r["figures"][key]["tests"].items():
                if t and t.get("differs"):
                    out.append({"model": r["model"], "benchmark": r["benchmark"], "figure": key, "heading": heading,
                                "run": lab, "test": t["test"], "p": t["p"], "items": t["items"],
                                "change": t.get("difference", t.get("ratio"))})
    return out


def _test_cells(t: dict | None, key: str) -> list[str]:
    """The ratio's interval, the p-value and the verdict of one paired test, as table cells."""
    if t is None:
        return ["-", "-", "not tested" if key in ("quality", *PAIRED_SPEED) else "-"]
    if t.get("not_testable"):
        return ["-", "-", t["test"]]
    if t.get("not_judged"):
        return [f"x{t['ratio']:.2f}" if t.get("ratio") else "-", "-", t["test"]]
    if key in WALL:  # a speedup against the spread file's between-run spread
        note = f"; {t['note']}" if t.get("note") else ""
        verdict = "differs" if t["differs"] else "no difference shown"
        return [f"x{t['ratio']:.2f}" if t.get("ratio") else "-", f"x{t['factor']:.2f}" if t.get("factor") else "-",
                f"{verdict} ({t['items']}, {t['test']}{note})"]
    if key == "quality":
        iv = stats.fmt_interval(t.get("interval"), "+.2f", 100.0).strip() or "-"
        what = f"{100 * t['difference']:+.2f} pp {iv}"
    else:
        what = stats.fmt_interval(t.get("interval"), ".2f").strip() or "-"
    verdict = f"differs ({t['items']} items)" if t["differs"] else f"no difference shown ({t['items']} items)"
    return [what, stats.fmt_p(t.get("p")), verdict]


def _show(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_show(x)}" for k, x in sorted(v.items())) or "-"
    return str(v)


def run_settings(runs: list[dict]) -> list[dict]:
    """Run-wide settings of each run (plus device, commit, sessions), keys that differ marked."""
    rows = []
    for r in runs:
        cfg, env = r["cfg"], r["cfg"].get("environment") or {}
        row = {k: cfg.get(k) for k in RUN_KEYS}
        row.update(run_id=cfg.get("run_id") or r["dir"].name, created=cfg.get("created"), device=device_text(cfg),
                   commit=(env.get("git_commit") or "?")[:12] + (" (dirty)" if env.get("git_dirty") else ""),
                   sessions=resumed(sessions(cfg)))
        row["prompts"] = row["prompts"] or "stock"
        rows.append(row)
    return rows


def model_differences(runs: list[dict]) -> list[dict]:
    """Per model in two or more runs: the model settings that differ, with each run's value."""
    out = []
    names = list(dict.fromkeys(m["name"] for r in runs for m in r["cfg"]["models"]))
    for name in names:
        specs = {r["label"]: next((m for m in r["cfg"]["models"] if m["name"] == name), None) for r in runs}
        present = {lab: m for lab, m in specs.items() if m is not None}
        if len(present) < 2:
            continue
        for k in MODEL_KEYS:
            vals = {lab: m.get(k) for lab, m in present.items()}
            if len({repr(v) for v in vals.values()}) > 1:
                out.append({"model": name, "setting": k, "values": {lab: _show(v) for lab, v in vals.items()}})
    return out


def _md_table(head: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(b) + " |" for b in body]


def _fmt(v: Any, spec: str) -> str:
    return NOT_MEASURED if v is None else format(v, spec)


def markdown(runs: list[dict], settings: list[dict], diffs: list[dict], rows: list[dict],
             spread: Spread | None = None) -> str:
    """compare.md; ``spread``: the spread file the speedups were judged against (None: not judged)."""
    labels = [r["label"] for r in runs]
    ref = labels[0]
    lines = [f"# Compare: {' vs '.join(labels)}", "",
             f"Each figure per run and its ratio to `{ref}` (value / value in `{ref}`); `{NOT_MEASURED}`: not "
             "measured in that run (or a zero reference). Tokens/s, latency and memory depend on the device, its "
             "load and the sample count: read their ratios with the settings below.", "", "## Runs", ""]
    shown = ["run_id", "created", *RUN_KEYS, "device", "commit", "sessions"]
    differ = {k for k in shown if len({repr(s[k]) for s in settings}) > 1} - {"run_id", "created"}
    lines += _md_table(["setting", *labels],
                       [[f"**{k}** (differs)" if k in differ else k, *[_show(s[k]) for s in settings]]
                        for k in shown])
    again = [f"{r['label']} ({s['sessions']} sessions)" for r, s in zip(runs, settings) if s["sessions"] > 1]
    if again:
        lines += ["", "Resumed: " + ", ".join(again) + "; their timings combine separate invocations."]
    missing = [f"{r['label']}: {len(r['missing'])} metrics file(s) missing" for r in runs if r["missing"]]
    if missing:
        lines += ["", "Partial: " + "; ".join(missing) + "."]
    lines += ["", *differs_md(rows, labels, spread)]
    lines += ["## Model settings that differ", ""]
    if diffs:
        lines += _md_table(["model", "setting", *labels],
                           [[d["model"], d["setting"], *[d["values"].get(lab, NOT_MEASURED) for lab in labels]]
                            for d in diffs])
    else:
        lines.append("None: every model shared by the runs has the same decoder, checkpoint and knobs.")
    lines += ["", "## Tasks and samples", ""]
    lines += _md_table(["model", "benchmark", *[f"task ({lab})" for lab in labels], *[f"n ({lab})" for lab in labels]],
                       [[r["model"], r["benchmark"], *[r["tasks"].get(lab, NOT_MEASURED) for lab in labels],
                         *[_show(r["samples"].get(lab)) if lab in r["samples"] else NOT_MEASURED for lab in labels]]
                        for r in rows])
    for key, heading, _, spec in FIGURES:
        if all(v is None for r in rows for v in r["figures"][key]["values"].values()):
            continue
        lines += ["", f"## {heading}", ""]
        change = ("difference [95% CI]" if key == "quality" else "ratio" if key in WALL else "ratio 95% CI")
        test = ("p (McNemar / paired bootstrap)" if key == "quality" else "threshold (between-run spread)"
                if key == "speedup" else "-" if key in WALL else "p (paired bootstrap)")
        head = ["model", "benchmark", *labels]
        for lab in labels[1:]:
            head += [f"{lab} / {ref}", f"{lab} vs {ref}: {change}", f"{lab} vs {ref}: {test}", f"{lab} vs {ref}"]
        body = []
        for r in rows:
            f = r["figures"][key]
            cells = [r["model"], r["benchmark"], *[_fmt(f["values"][lab], spec)
                                                   + stats.fmt_interval(f["intervals"][lab], spec) for lab in labels]]
            for lab in labels[1:]:
                cells += [_fmt(f["ratios"][lab], ".2f"), *_test_cells(f["tests"][lab], key)]
            body.append(cells)
        lines += _md_table(head, body)
    lines.append("")
    return "\n".join(lines)


def differs_md(rows: list[dict], labels: list[str], spread: Spread | None = None) -> list[str]:
    """The section naming every row whose test says it differs from the first run, with its p-value; the speed
    rule printed is ``timing.spread_rule`` (the constants the verdict uses), or what cannot be told without a
    spread file."""
    from harness.run.timing import spread_rule

    found = differing(rows, labels)
    speed = (f"Speed between runs is judged through each run's speedup over its own reference (measured "
             f"interleaved in that run) against the between-run spread of {spread.path} ({spread.runs} quiet idle "
             f"runs of `{spread.command}`): {spread_rule()}. " if spread is not None else
             "Speed between runs: " + NO_SPREAD + ". ")
    lines = ["## Rows that differ", "",
             f"Paired tests against `{labels[0]}` on the items both runs measured (95%: p < {stats.ALPHA}): McNemar's "
             "exact test for quality (binary scores; else a paired bootstrap of the difference), a paired bootstrap "
             "(2000 resamples, fixed seed) for TPF and NFE. " + speed + "Absolute tokens/s and "
             "latency get their ratio printed and are not judged: the machine's speed between two runs is in neither "
             f"run's rounds. A run without rounds (a single pass) gets \"{NOT_TESTABLE}\", never a p-value. Only "
             "these rows differ by more than chance; every other difference below is within it.", ""]
    if not found:
        return lines + ["None: no figure differs by more than chance (or no two runs share per-item logs).", ""]
    body = [[d["model"], d["benchmark"], d["heading"], d["run"],
             f"{100 * d['change']:+.2f} pp" if d["figure"] == "quality" else f"x{d['change']:.2f}", d["test"],
             stats.fmt_p(d["p"]), str(d["items"])] for d in found]
    return lines + _md_table(["model", "benchmark", "figure", "run", "change", "test", "p", "items"], body) + [""]


def to_csv(labels: list[str], rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    ref = labels[0]
    w.writerow(["model", "benchmark", "figure", *[f"value_{lab}" for lab in labels],
                *[f"ratio_{lab}_over_{ref}" for lab in labels[1:]], *[f"n_{lab}" for lab in labels],
                *[f"{end}_{lab}" for lab in labels for end in ("lo", "hi")],
                *[f"{what}_{lab}_vs_{ref}" for lab in labels[1:] for what in ("p", "differs")]])

    def num(v):
        return NOT_MEASURED if v is None else round(v, 6)

    for r in rows:
        for key, _, _, _ in FIGURES:
            f = r["figures"][key]
            w.writerow([r["model"], r["benchmark"], key, *[num(f["values"][lab]) for lab in labels],
                        *[num(f["ratios"][lab]) for lab in labels[1:]],
                        *[r["samples"].get(lab, NOT_MEASURED) for lab in labels],
                        *[num((f["intervals"][lab] or {}).get(end)) for lab in labels for end in ("lo", "hi")],
                        *[x for lab in labels[1:] for x in (num((f["tests"][lab] or {}).get("p")),
                                                            (f["tests"][lab] or {}).get("differs", NOT_MEASURED))]])
    return buf.getvalue()


def _parser() -> argparse.ArgumentParser:
    p = run_parser("compare", __doc__)
    p.add_argument("--spread", default=None, metavar="FILE",
                   help="a spread file of `make spread` (results/speed_spread_<name>.json: idle runs of identical "
                        "code on this machine, timed like the runs compared); speedups are judged against its "
                        "between-run spread. Without it compare says it cannot tell whether a speedup changed")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    try:
        dirs, labels = resolve_runs(ns.run, Path(ns.runs_root), newest=2)
        if len(dirs) < 2:
            raise InputError(f"compare needs two or more runs, got {ns.run!r}; give RUN=<run>,<run>")
        data = load(dirs, labels, ns.allow_partial)
        runs = data["runs"]
        names = [r["label"] for r in runs]
        if len(set(names)) != len(names):
            raise InputError(f"two runs share the label {names!r}; name them: RUN=a=<run>,b=<run>")
        name = check_name(ns.name or "compare-" + "-vs-".join(names))
        spread = Spread.load(ns.spread) if ns.spread else None
        rows = figures_of(pair(runs), names, spread)
        if not rows:
            raise InputError(f"{', '.join(map(str, dirs))}: no metrics file at all (runs not started?)")
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    settings, diffs = run_settings(runs), model_differences(runs)
    target = Path(ns.out) / name
    with atomic_dir(target) as tmp:
        atomic_write_text(tmp / "compare.md", markdown(runs, settings, diffs, rows, spread))
        atomic_write_text(tmp / "compare.csv", to_csv(names, rows))
        atomic_write_json(tmp / "compare.json", {
            "runs": [{"label": r["label"], "dir": _show_path(str(r["dir"])), "missing": r["missing"], **s}
                     for r, s in zip(runs, settings)],
            "reference": names[0], "model_differences": diffs, "differ": differing(rows, names),
            "spread": None if spread is None else {"file": str(spread.path), "runs": spread.runs,
                                                   "command": spread.command},
            "rows": rows})
    shared = sum(1 for r in rows if len(r["tasks"]) > 1)
    differ = differing(rows, names)
    print(f"wrote {target}/compare.md ({len(rows)} (model, benchmark) rows, {shared} measured in more than one run; "
          f"{len(differ)} figure(s) differ by their test)")
    for d in differ:
        items = d["items"] if any(w in str(d["items"]) for w in ("round", "runs")) else f"{d['items']} items"
        print(f"  differs: {d['model']} {d['benchmark']} {d['figure']} in {d['run']} ("
              + (f"p {stats.fmt_p(d['p'])}, " if d["p"] is not None else "") + f"{d['test']}, {items})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
