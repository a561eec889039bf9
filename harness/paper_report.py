"""`python -m harness report` / `make report`: the paper's Table 1, speedups and figures from one or more runs.

    python -m harness report                                  # newest run under results/runs
    python -m harness report --run 20260101-120000            # a run id under --runs-root, or a run folder
    python -m harness report --run runA,runB --name merged    # several runs merged into one report
    python -m harness report --run R --allow-partial          # an unfinished run, missing cells marked

Writes ``<out>/<name>/`` (default name: the run id, runs joined by ``+``):

    table1.md, table1.csv, table1.tex   Table 1 layout, ours and the published numbers
    speedup.md                          per task, mean of per-task ratios and ratio of averages
    *.png                               Pareto views, speedup, TPF, latency, memory
    index.md                            links, the runs' settings and environment
    report.json                         every number above, machine-readable

Everything is read and checked first; bad input (no such run, missing metrics,
conflicting settings) is one line and exit 2 with nothing written. The folder is
built next to its target and swapped in at the end, so a failure leaves the
previous report (or nothing) in place.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from dataclasses import dataclass, field
from pathlib import Path

from harness import paper
from harness.metrics import speedup
from harness.store import atomic_dir, read_json

REPO = Path(__file__).resolve().parents[1]
NOT_MEASURED = "n/m"  # the run has no such (model, task)
MISSING = "missing"  # the run should have it, but its metrics file is absent (--allow-partial)
MDM_DECODERS = ("llada", "fast_dllm", "dream", "d2f")
# Settings that must agree when two runs measured the same model / (model, task).
MODEL_KEYS = ("checkpoint", "decoder", "knobs")
TASK_KEYS = ("limit", "seed", "chat_template", "device", "batch_size", "task_defaults")


class InputError(Exception):
    """Bad user input: one line, exit 2, nothing written."""


# ---------------------------------------------------------------- loading


@dataclass
class RunSet:
    runs: list[dict]  # run.json of each run, plus "dir"
    models: list[dict]  # run.json model entries, first occurrence, plus "run_id"
    metrics: dict[tuple[str, str], dict] = field(default_factory=dict)  # (model, unit) -> metrics JSON
    missing: list[tuple[str, str, str]] = field(default_factory=list)  # (model, unit, run dir)
    notes: list[str] = field(default_factory=list)

    @property
    def baseline(self) -> str | None:
        """The AR reference: the first run's baseline, else the first model decoded with ``ar``."""
        for r in self.runs:
            if r.get("baseline"):
                return r["baseline"]
        return next((m["name"] for m in self.models if m["decoder"] == "ar"), None)


def resolve_run(text: str, root: Path) -> Path:
    for p in (Path(text), root / text):
        if p.is_dir():
            if not (p / "run.json").is_file():
                raise InputError(f"{p}: not a run folder (no run.json)")
            return p
    raise InputError(f"run {text!r}: no such folder (looked for {text} and {root / text})")


def newest_run(root: Path) -> Path:
    runs = [p for p in root.glob("*/run.json")] if root.is_dir() else []
    if not runs:
        raise InputError(f"{root}: no run folder there (run `make eval` first, or give RUN=<run dir>)")

    def created(p: Path) -> tuple[str, float]:
        try:
            return (str(read_json(p).get("created") or ""), p.stat().st_mtime)
        except (OSError, ValueError):
            return ("", p.stat().st_mtime)

    return max(runs, key=created).parent


def _read(path: Path) -> dict:
    try:
        return read_json(path)
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: unreadable ({type(e).__name__}: {e})".replace("\n", " ")) from None


def _task_settings(cfg: dict, model: dict, unit: dict) -> dict:
    leaves = unit.get("leaves") or [unit["name"]]
    tk = model.get("task_knobs") or {}
    return {**{k: model.get(k) for k in MODEL_KEYS}, **{k: cfg.get(k) for k in TASK_KEYS},
            "task_knobs": {leaf: tk[leaf] for leaf in leaves if leaf in tk}}


def load_runs(dirs: list[Path], allow_partial: bool = False) -> RunSet:
    """Read and cross-check runs; raises InputError naming the folder and what is wrong."""
    rs = RunSet(runs=[], models=[])
    seen_model: dict[str, tuple[dict, Path]] = {}
    seen_cell: dict[tuple[str, str], tuple[dict, Path]] = {}
    for d in dirs:
        cfg = _read(d / "run.json")
        for key in ("models", "units"):
            if not isinstance(cfg.get(key), list):
                raise InputError(f"{d}/run.json: no {key!r} list (not written by `harness eval`?)")
        rs.runs.append({**cfg, "dir": str(d)})
        run_id = cfg.get("run_id") or d.name
        absent = []
        for m in cfg["models"]:
            spec = {k: m.get(k) for k in MODEL_KEYS}
            if m["name"] in seen_model and seen_model[m["name"]][0] != spec:
                other = seen_model[m["name"]][1]
                diff = ", ".join(k for k in MODEL_KEYS if seen_model[m["name"]][0][k] != spec[k])
                raise InputError(f"{d}: model {m['name']!r} has other settings ({diff}) than in {other}; "
                                 "report them separately or rename one")
            if m["name"] not in seen_model:
                seen_model[m["name"]] = (spec, d)
                rs.models.append({**m, "run_id": run_id})
            for u in cfg["units"]:
                cell = (m["name"], u["name"])
                settings = _task_settings(cfg, m, u)
                if cell in seen_cell:
                    prev, other = seen_cell[cell]
                    if prev != settings:
                        diff = ", ".join(sorted(k for k in settings if prev.get(k) != settings[k]))
                        raise InputError(f"{d}: model {m['name']!r} on {u['name']!r} was also run in {other} "
                                         f"with other settings ({diff})")
                    rs.notes.append(f"{m['name']} on {u['name']}: measured in {other} and {d}; "
                                    f"the first ({other.name}) is reported")
                    continue
                path = d / "metrics" / f"{m['name']}__{u['name']}.json"
                if not path.is_file():
                    absent.append(path.name)
                    rs.missing.append((m["name"], u["name"], str(d)))
                    continue
                seen_cell[cell] = (settings, d)
                met = _read(path)
                rs.metrics[cell] = {**met, "_run_id": run_id, "_run_dir": str(d)}
        if absent and not allow_partial:
            more = f" and {len(absent) - 3} more" if len(absent) > 3 else ""
            raise InputError(f"{d}: unfinished run, missing metrics/{', metrics/'.join(absent[:3])}{more} "
                             f"(resume it with `make eval ... EVAL_ARGS='--run-id {d.name}'`, "
                             "or report it with --allow-partial)")
    return rs


# ---------------------------------------------------------------- numbers


def quality_pct(m: dict) -> float | None:
    prim = m.get("quality_primary")
    v = (m.get("quality") or {}).get(prim) if prim else None
    return None if v is None else 100.0 * float(v)


def tps(m: dict) -> float | None:
    return ((m.get("speed") or {}).get("tokens_per_s") or {}).get("ratio_of_sums")


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _average(cells: dict[str, dict], n_columns: int) -> dict:
    qs = [c["quality"] for c in cells.values() if c.get("quality") is not None]
    ts = [c["tokens_per_s"] for c in cells.values() if c.get("tokens_per_s") is not None]
    return {"quality": _mean(qs), "tokens_per_s": _mean(ts), "columns": min(len(qs), len(ts)),
            "complete": len(qs) == len(ts) == n_columns}


def our_rows(rs: RunSet, suite: paper.Suite) -> list[dict]:
    """One row per model of the run(s): each column's quality (%), tokens/s and status, then the average."""
    missing = {(m, u) for m, u, _ in rs.missing}
    rows = []
    for m in rs.models:
        cells: dict[str, dict] = {}
        status: dict[str, str] = {}
        for col in suite.columns:
            task = next((t for t in col.tasks if (m["name"], t) in rs.metrics), None)
            if task is None:
                status[col.key] = MISSING if any((m["name"], t) in missing for t in col.tasks) else NOT_MEASURED
                continue
            met = rs.metrics[(m["name"], task)]
            cells[col.key] = {"task": task, "quality": quality_pct(met), "tokens_per_s": tps(met),
                              "tpf": ((met.get("speed") or {}).get("tpf") or {}).get("ratio_of_sums"),
                              "quality_metric": met.get("quality_primary"), "run_id": met["_run_id"],
                              "samples": (met.get("speed") or {}).get("samples")}
            status[col.key] = "ok"
        rows.append({"model": m["name"], "decoder": m["decoder"], "source": "this run", "cells": cells,
                     "status": status, "average": _average(cells, len(suite.columns))})
    return rows


def published_rows(suite: paper.Suite) -> list[dict]:
    if not suite.published:
        return []
    rows = []
    for r in paper.published_rows():
        cells = {c.key: {"task": c.key, **r["cells"][c.key]} for c in suite.columns if c.key in r["cells"]}
        avg = _average(cells, len(suite.columns))
        rows.append({"model": r["model"], "decoder": r["decoder"], "kind": r["kind"], "source": "published",
                     "cells": cells, "status": {c.key: "ok" if c.key in cells else NOT_MEASURED
                                                for c in suite.columns},
                     "average": avg, "published_average": r.get("average")})
    return rows


def speedup_summary(row: dict, ref: dict, keys: list[str], same_run: bool = True) -> dict:
    """Per-column speedup of ``row`` over ``ref`` (same task, same run), their mean (the paper's
    headline convention) and the ratio of the mean tokens/s over the same columns."""
    per: dict[str, float | None] = {}
    for k in keys:
        a, b = row["cells"].get(k), ref["cells"].get(k)
        if a is None or b is None or (same_run and a.get("run_id") != b.get("run_id")):
            per[k] = None
            continue
        per[k] = speedup(a["tokens_per_s"], b["tokens_per_s"])
    both = [k for k, v in per.items() if v is not None]
    mine = _mean([row["cells"][k]["tokens_per_s"] for k in both])
    theirs = _mean([ref["cells"][k]["tokens_per_s"] for k in both])
    return {"per_task": per, "mean_of_ratios": _mean([per[k] for k in both]),
            "ratio_of_averages": speedup(mine, theirs), "tasks": len(both)}


def references(rs: RunSet) -> list[tuple[str, str]]:
    """(model, role) pairs speedups are measured against: the run's AR model, then every MDM baseline."""
    out = []
    if rs.baseline and any(m["name"] == rs.baseline for m in rs.models):
        out.append((rs.baseline, "AR baseline"))
    out += [(m["name"], "MDM baseline") for m in rs.models if m["decoder"] in MDM_DECODERS]
    return out


def report_suites(rs: RunSet) -> list[paper.Suite]:
    """The paper's benchmarks, the embedded suite, and any other task the run(s) measured."""
    known = paper.suites()
    covered = {t for s in known for c in s.columns for t in c.tasks}
    units = []
    for r in rs.runs:
        units += [u["name"] for u in r["units"] if u["name"] not in covered and u["name"] not in units]
    if not units:
        return list(known)
    return [*known, paper.Suite("other", "Other tasks (no published numbers)",
                                tuple(paper.Column(u, u, (u,)) for u in units), False)]


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
                               **speedup_summary(r, ref, keys)})
        pub = published_rows(s)
        pub_sp = []
        for ref in pub:
            for r in pub:
                if r["kind"] == "refusion" and ref["kind"] != "refusion":
                    pub_sp.append({"model": r["model"], "reference": ref["model"],
                                   **speedup_summary(r, ref, keys, same_run=False)})
        suites.append({"suite": s, "ours": ours, "published": pub, "speedups": sp, "published_speedups": pub_sp})
    return {"suites": suites, "baseline": rs.baseline}


# ---------------------------------------------------------------- formatting


def _num(v: float | None, spec: str = ".2f") -> str:
    return NOT_MEASURED if v is None else format(v, spec)


def cell_text(row: dict, key: str) -> str:
    st = row["status"].get(key, NOT_MEASURED)
    if st != "ok":
        return st
    c = row["cells"][key]
    return f"{_num(c['quality'])} / {_num(c['tokens_per_s'])}"


def avg_text(row: dict, n_columns: int) -> str:
    a = row["average"]
    if a["quality"] is None and a["tokens_per_s"] is None:
        return NOT_MEASURED
    mark = "" if a["complete"] else f" ({a['columns']}/{n_columns})"
    return f"{_num(a['quality'])} / {_num(a['tokens_per_s'])}{mark}"


def _md_table(head: list[str], body: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(b) + " |" for b in body])


def _run_names(rs: RunSet) -> str:
    return ", ".join(str(r.get("run_id") or Path(r["dir"]).name) for r in rs.runs)


LEGEND = (f"Cells: quality (accuracy or pass@1, %) / tokens per second (generated tokens / decode seconds, ratio "
          f"of sums). `{NOT_MEASURED}` = not measured by this run; `{MISSING}` = part of the run but its metrics "
          "file is absent (reported with --allow-partial); `(k/n)` after an average = mean over the k measured "
          "columns only. Avg = mean of the columns, as in the paper.")


def table1_md(rs: RunSet, data: dict) -> str:
    lines = [f"# Table 1: run {_run_names(rs)}", "", LEGEND, ""]
    for s in data["suites"]:
        suite: paper.Suite = s["suite"]
        head = ["Model", "decoder", *[c.label for c in suite.columns], "Avg"]
        n = len(suite.columns)
        lines += [f"## {suite.title}", "", "### This run", ""]
        lines += _md_table(head, [[r["model"], r["decoder"], *[cell_text(r, c.key) for c in suite.columns],
                                   avg_text(r, n)] for r in s["ours"]])
        metrics = sorted({f"{c['task']}={c['quality_metric']}" for r in s["ours"] for c in r["cells"].values()})
        if metrics:
            lines += ["", "Quality metric per task: " + ", ".join(metrics)]
        if s["published"]:
            lines += ["", f"### Published ({paper.source()})", ""]
            lines += _md_table(head, [[r["model"], r["decoder"], *[cell_text(r, c.key) for c in suite.columns],
                                       avg_text(r, n)] for r in s["published"]])
        lines.append("")
    return "\n".join(lines)


def _csv_value(row: dict, key: str, what: str) -> str | float:
    st = row["status"].get(key, NOT_MEASURED)
    if st != "ok":
        return st
    v = row["cells"][key][what]
    return NOT_MEASURED if v is None else round(v, 6)


def table1_csv(data: dict) -> str:
    cols = [c for s in data["suites"] for c in s["suite"].columns]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["suite", "source", "model", "decoder"]
               + [f"{c.key}_{what}" for c in cols for what in ("quality", "tokens_per_s")]
               + ["avg_quality", "avg_tokens_per_s", "avg_columns", "avg_columns_total"])
    for s in data["suites"]:
        keys = {c.key for c in s["suite"].columns}
        for r in s["ours"] + s["published"]:
            vals = []
            for c in cols:
                for what in ("quality", "tokens_per_s"):
                    vals.append(_csv_value(r, c.key, what) if c.key in keys else "")
            a = r["average"]
            w.writerow([s["suite"].name, r["source"], r["model"], r["decoder"], *vals,
                        NOT_MEASURED if a["quality"] is None else round(a["quality"], 6),
                        NOT_MEASURED if a["tokens_per_s"] is None else round(a["tokens_per_s"], 6),
                        a["columns"], len(s["suite"].columns)])
    return buf.getvalue()


def _tex(text: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("_", r"\_"), ("#", r"\#"),
                 ("$", r"\$")):
        text = text.replace(a, b)
    return text


def table1_tex(rs: RunSet, data: dict) -> str:
    out = [f"% Table 1 from run {_tex(_run_names(rs))}; published rows: {_tex(paper.source())}.",
           f"% {NOT_MEASURED}: not measured by this run; {MISSING}: metrics file absent; (k/n): mean of k columns."]
    for s in data["suites"]:
        suite = s["suite"]
        n = len(suite.columns)
        out += [f"% {suite.title}", "\\begin{tabular}{ll" + "c" * (n + 1) + "}", "\\hline",
                " & ".join(["Model", "Decoder", *[_tex(c.label) for c in suite.columns], "Avg"]) + r" \\", "\\hline"]
        for r in s["ours"]:
            out.append(" & ".join([_tex(r["model"]), _tex(r["decoder"]),
                                   *[_tex(cell_text(r, c.key)) for c in suite.columns], _tex(avg_text(r, n))])
                       + r" \\")
        if s["published"]:
            out += ["\\hline", f"\\multicolumn{{{n + 3}}}{{l}}{{\\emph{{Published: {_tex(paper.source())}}}}} \\\\",
                    "\\hline"]
            for r in s["published"]:
                out.append(" & ".join([_tex(r["model"]), _tex(r["decoder"]),
                                       *[_tex(cell_text(r, c.key)) for c in suite.columns], _tex(avg_text(r, n))])
                           + r" \\")
        out += ["\\hline", "\\end{tabular}", ""]
    return "\n".join(out)


CONVENTION = ("speedup = TPS(model) / TPS(reference), same task, same run, TPS = generated tokens / decode "
              "seconds (ratio of sums). **mean of ratios** = mean over the tasks of the per-task speedups (the "
              "paper's headline convention: ReFusion is 2.33x faster than Qwen3-8B); **ratio of averages** = mean "
              "TPS of the model / mean TPS of the reference over the same tasks (2.24x for that pair). "
              f"`{NOT_MEASURED}`: either side not measured (or measured in different runs).")


def speedup_md(rs: RunSet, data: dict) -> str:
    lines = [f"# Speedup: run {_run_names(rs)}", "", CONVENTION, ""]
    refs = references(rs)
    if not refs:
        lines += ["This run has no AR model and no MDM baseline to measure speedups against.", ""]
    for s in data["suites"]:
        suite = s["suite"]
        measured = [c for c in suite.columns if any(r["status"][c.key] == "ok" for r in s["ours"])]
        if not ((measured and refs) or s["published_speedups"]):
            continue
        lines += [f"## {suite.title}", ""]
        if not measured:
            lines += ["This run measured none of these tasks.", ""]
        for ref, role in refs if measured else []:
            rows = [x for x in s["speedups"] if x["reference"] == ref]
            lines += [f"### vs {ref} ({role})", ""]
            lines += _md_table(["model", "decoder", *[c.label for c in measured], "mean of ratios",
                                "ratio of averages"],
                               [[x["model"], x["decoder"], *[_num(x["per_task"][c.key]) for c in measured],
                                 _num(x["mean_of_ratios"]), _num(x["ratio_of_averages"])] for x in rows])
            lines.append("")
        if s["published_speedups"]:
            lines += [f"### Published speedups of ReFusion, for reference ({paper.source()})", ""]
            lines += _md_table(["model", "vs", *[c.label for c in suite.columns], "mean of ratios",
                                "ratio of averages"],
                               [[x["model"], x["reference"], *[_num(x["per_task"][c.key]) for c in suite.columns],
                                 _num(x["mean_of_ratios"]), _num(x["ratio_of_averages"])]
                                for x in s["published_speedups"]])
            lines.append("")
    return "\n".join(lines)


def _show_path(path: str) -> str:
    """Paths inside the repository relative to it, so a committed report names no machine's folders."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def index_md(rs: RunSet, data: dict, figures: dict[str, str]) -> str:
    lines = [f"# Report: run {_run_names(rs)}", "",
             "- [table1.md](table1.md) (also [table1.csv](table1.csv), [table1.tex](table1.tex)): the paper's "
             f"Table 1 layout, this run beside the published numbers ({paper.source()})",
             "- [speedup.md](speedup.md): per-task speedups, mean of ratios and ratio of averages",
             "- [report.json](report.json): every number of this report", ""]
    if rs.missing:
        lines += [f"**Partial:** {len(rs.missing)} (model, task) metrics file(s) missing, marked `{MISSING}`: "
                  + ", ".join(f"{m} on {u}" for m, u, _ in rs.missing), ""]
    for note in rs.notes:
        lines += [f"Note: {note}", ""]
    lines += ["## Figures", ""]
    for name, caption in figures.items():
        lines += [f"### {caption}", "", f"![{caption}]({name})", ""]
    lines += ["## Runs", ""]
    for r in rs.runs:
        env = r.get("environment") or {}
        pk = env.get("packages") or {}
        lines += [f"### {r.get('run_id') or Path(r['dir']).name}", "",
                  f"- folder `{_show_path(r['dir'])}`, created {r.get('created')}",
                  f"- task `{r.get('task')}` ({', '.join(u['name'] for u in r['units'])}), limit {r.get('limit')}, "
                  f"seed {r.get('seed')}, batch size {r.get('batch_size')}, chat template {r.get('chat_template')}, "
                  f"paper task defaults {r.get('task_defaults')}, speedup baseline {r.get('baseline')}",
                  f"- device {r.get('device')}, {r.get('threads')} thread(s) x {r.get('num_processes')} process(es)",
                  f"- environment: commit {env.get('git_commit')}{' (dirty)' if env.get('git_dirty') else ''}, "
                  f"python {env.get('python')}, torch {pk.get('torch')}, transformers {pk.get('transformers')}, "
                  f"lm-eval {pk.get('lm-eval')}, CPU {env.get('cpu')} ({env.get('cpu_count')} cores), "
                  f"GPU {env.get('gpu')}, {env.get('platform')}", "",
                  "| model | decoder | checkpoint | knobs | per-task defaults |", "|---|---|---|---|---|"]
        for m in r["models"]:
            knobs = ", ".join(f"{k}={v}" for k, v in sorted((m.get("knobs") or {}).items())) or "-"
            per_task = "; ".join(f"{t}: " + ", ".join(f"{k}={v}" for k, v in sorted(tk.items()))
                                 for t, tk in sorted((m.get("task_knobs") or {}).items())) or "-"
            lines.append(f"| {m['name']} | {m['decoder']} | `{_show_path(m['checkpoint'])}` | {knobs} | {per_task} |")
        lines.append("")
    return "\n".join(lines)


def _json_ready(data: dict) -> dict:
    return {"baseline": data["baseline"], "suites": [
        {**{k: v for k, v in s.items() if k != "suite"}, "name": s["suite"].name, "title": s["suite"].title,
         "columns": [{"key": c.key, "label": c.label, "tasks": list(c.tasks)} for c in s["suite"].columns]}
        for s in data["suites"]], "published_source": paper.source()}


# ---------------------------------------------------------------- command


def write_report(rs: RunSet, target: Path) -> Path:
    """Build every file into a temp folder and swap it in as ``target``."""
    from harness import figures

    from harness.store import atomic_write_json, atomic_write_text

    data = build(rs)
    with atomic_dir(target) as tmp:
        atomic_write_text(tmp / "table1.md", table1_md(rs, data))
        atomic_write_text(tmp / "table1.csv", table1_csv(data))
        atomic_write_text(tmp / "table1.tex", table1_tex(rs, data))
        atomic_write_text(tmp / "speedup.md", speedup_md(rs, data))
        atomic_write_json(tmp / "report.json", {"runs": [_show_path(r["dir"]) for r in rs.runs],
                                                "missing": [(m, u, _show_path(d)) for m, u, d in rs.missing],
                                                "notes": rs.notes, **_json_ready(data)})
        made = figures.save_all(figures.build_all(rs, data), tmp)
        from harness.trace import report_traces  # one logged sample per task, when the runs recorded traces

        atomic_write_text(tmp / "index.md", index_md(rs, data, made) + report_traces(rs, tmp))
    return target


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default=None, help="run folder or run id, or a comma list to merge "
                   "(default: the newest run under --runs-root)")
    p.add_argument("--runs-root", default="results/runs", help="where run ids are looked up (default: %(default)s)")
    p.add_argument("--out", default="reports", help="reports folder (default: %(default)s)")
    p.add_argument("--name", default=None, help="report folder name (default: the run id(s) joined by '+')")
    p.add_argument("--allow-partial", action="store_true", help="report an unfinished run, missing cells marked")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    try:
        root = Path(ns.runs_root)
        texts = [t.strip() for t in (ns.run or "").split(",") if t.strip()]
        dirs = [resolve_run(t, root) for t in texts] if texts else [newest_run(root)]
        if len({d.resolve() for d in dirs}) != len(dirs):
            raise InputError(f"run given twice in {ns.run!r}")
        name = ns.name or "+".join(d.name for d in dirs)
        if not name or name.startswith(".") or "/" in name:
            raise InputError(f"--name {name!r}: use a plain folder name")
        rs = load_runs(dirs, allow_partial=ns.allow_partial)
        if not rs.metrics:
            raise InputError(f"{', '.join(map(str, dirs))}: no metrics file at all (run not started?)")
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    target = write_report(rs, Path(ns.out) / name)
    print(f"wrote {target}/index.md ({len(rs.metrics)} (model, task) cells from {len(dirs)} run(s)"
          f"{f', {len(rs.missing)} missing' if rs.missing else ''})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
