"""Run summary: one row per (model, task), as JSON, a Markdown table and a console table; the run's
sessions (a resumed run has several) and its overall progress line."""

from __future__ import annotations

import datetime as _dt
import time
from pathlib import Path
from typing import Callable

from harness.run.store import atomic_write_json, read_json


def _row(m: dict) -> dict:
    q = m.get("quality", {})
    prim = m.get("quality_primary")
    s = m["speed"]
    timing = s.get("timing") or {}
    failed = (m.get("failed") or {}).get("items", [])
    return {
        # n counts every item; the failed ones (harness/run/faults.py) scored as wrong, outside the speed figures
        "model": m["model"], "task": m["task"], "samples": s["samples"] + len(failed),
        # an engine row (ar@vllm) names its engine; its latency is measured at the client
        "decoder": m["decoder"] + (f"@{m['engine']['name']}" if m.get("engine") else ""), "engine": bool(m.get("engine")),
        "failed": len(failed), "failed_items": failed,
        # code verdicts on programs importing a package the sandbox did not give (no namespaces, a private venv)
        "sandbox_withheld": (m.get("sandbox_withheld") or {}).get("count", 0),
        "quality_metric": prim, "quality": q.get(prim) if prim else None,
        "tokens_per_s": s["tokens_per_s"]["ratio_of_sums"], "tokens_per_s_mean_of_ratios": s["tokens_per_s"][
            "mean_of_ratios"],
        "tpf": s["tpf"]["ratio_of_sums"], "nfe_mean": s["nfe"]["mean"], "generated_tokens": s["generated_tokens"]["total"],
        "latency_mean_s": s["latency_s"]["mean"], "latency_p50_s": s["latency_s"]["p50"],
        "latency_p90_s": s["latency_s"]["p90"], "speedup": (m.get("speedup") or {}).get("tokens_per_s"),
        "peak_rss_bytes": m["memory"].get("peak_rss_bytes"), "kv_peak_bytes": m["memory"].get("kv_peak_bytes"),
        "gpu_peak_bytes": m["memory"].get("gpu_peak_bytes"),
        # the memory pass (harness/run/memory_pass.py): tensor bytes one decode call held at once, and the weights
        "decode_peak_bytes": m["memory"].get("decode_peak_bytes"), "weights_bytes": m["memory"].get("weights_bytes"),
        "decode_breakdown": m["memory"].get("decode_breakdown"),
        "outside_forward_share": s.get("outside_forward_share"),
        # compiled decoding (knob compile): graphs compiled and their seconds, left out of tok/s and latency
        "compiled": bool((s.get("compile") or {}).get("compiled")),
        "compilations": (s.get("compile") or {}).get("compilations", 0),
        "compile_s": (s.get("compile") or {}).get("compile_s", 0.0),
        # 95% intervals (harness/run/stats.py; None where the run kept no per-item logs), quality as a share
        **{f"{k}_ci": (m.get("intervals") or {}).get(k) for k in INTERVAL_FIGURES},
        "speedup_ci": (m.get("speedup") or {}).get("interval"), "speedup_p": (m.get("speedup") or {}).get("p"),
        # where the speedup and tok/s come from: the timed rounds (their items and rounds) or the decoding pass
        "speedup_source": (m.get("speedup") or {}).get("source") if (m.get("speedup") or {}).get("tokens_per_s")
        is not None else None,
        "timed": timing.get("mode") == "interleaved", "timed_items": timing.get("items"),
        "timed_calls": timing.get("calls"),
        "timed_rounds": timing.get("rounds") if timing.get("mode") == "interleaved" else None,
        "timed_dropped": timing.get("dropped") or [], "timed_why": timing.get("why"),
        # the rounds' mean request latency (the table's latency percentiles are the pass's, over every item)
        "timed_latency_s": timing.get("latency_s"), "timed_latency_s_ci": (m.get("intervals") or {}).get(
            "timed_latency_s"),
    }


INTERVAL_FIGURES = ("quality", "tokens_per_s", "tpf", "nfe_mean", "latency_mean_s", "latency_p50_s", "latency_p90_s")


def attach_intervals(run_dir: Path, cfg: dict, metrics: list[dict]) -> dict[str, dict | None]:
    """Add to every metrics dict its 95% intervals (``intervals``: quality and each speed figure over its items,
    harness/run/stats.py) and, beside a speedup over the run's baseline, the speedup of the items both decoded
    (the point at the full sample) with its paired bootstrap interval and p-value. Returns, per model other than
    the baseline, its mean per-task speedup: point, interval (a stratified paired bootstrap) and statistic (None
    where a task lacks per-item logs)."""
    from harness.run import stats

    items = {(m["model"], m["task"]): stats.read_items(run_dir, m["model"], m["task"], m.get("quality_primary"))
             for m in metrics}
    for m in metrics:
        prim = m.get("quality_primary")
        value = (m.get("quality") or {}).get(prim) if prim else None
        n = m["speed"]["samples"] + (m.get("failed") or {}).get("count", 0)
        m["intervals"] = stats.row_intervals(items[(m["model"], m["task"])], m["task"], value, n)
    base = cfg.get("baseline")
    means: dict[str, dict | None] = {}
    for model in dict.fromkeys(m["model"] for m in metrics):
        if model == base:
            continue
        pairs, tasks = [], []
        for m in metrics:
            a, b = items.get((base, m["task"])), items.get((model, m["task"]))
            if m["model"] != model or (m.get("speedup") or {}).get("tokens_per_s") is None:
                continue
            got = stats.paired_ratio(a, b, "tokens_per_s", m["task"]) if a is not None and b is not None else None
            m["speedup"] = {**m["speedup"], "interval": got and got["interval"], "p": got and got["p"],
                            "items": got and got["items"], "source": "single pass",
                            "statistic": "ratio of throughputs (tokens over seconds) on the items both decoded"}
            if got is not None:
                m["speedup"]["tokens_per_s"] = got["ratio"]  # the interval's statistic at the full sample
            pairs.append((a, b))
            tasks.append(m["task"])
        if pairs:
            ok = all(a is not None and b is not None for a, b in pairs)
            means[model] = stats.mean_ratio_interval(pairs, streams=tasks) if ok else None
    return means


def summary(cfg: dict, metrics: list[dict], warmup: dict[str, dict] | None = None,
            mean_speedups: dict[str, dict | None] | None = None) -> dict:
    """The run summary; ``warmup``: per model, what its warm-up calls compiled (done.json's warmup_compile);
    ``mean_speedups``: per model, its mean per-task speedup as one statistic with its interval ({ratio,
    interval, statistic}: ``attach_intervals`` for a single pass, the timed rounds' ``timing.mean_ratio``). A
    model without one gets the arithmetic mean of its rows' speedups, without an interval."""
    rows = [_row(m) for m in metrics]
    by_model: dict[str, list[float]] = {}
    for r in rows:
        if r["speedup"] is not None:
            by_model.setdefault(r["model"], []).append(r["speedup"])
    base = cfg.get("baseline")
    means = {k: (mean_speedups or {}).get(k) or {
        "ratio": sum(v) / len(v), "interval": None,
        "statistic": "the reference (1 by definition)" if k == base else
        "arithmetic mean over tasks of the per-task speedups (no interval: a task's speedup has none, or its rows "
        "were timed in different ways)"} for k, v in by_model.items()}
    return {
        "run_id": cfg.get("run_id"), "task": cfg["task"], "limit": cfg["limit"], "baseline": cfg.get("baseline"),
        "models": [m["name"] for m in cfg["models"]], "units": [u["name"] for u in cfg["units"]],
        "rows": rows, "mean_speedup": {k: v["ratio"] for k, v in means.items()},
        "mean_speedup_interval": {k: v["interval"] for k, v in means.items()},
        "mean_speedup_statistic": {k: v["statistic"] for k, v in means.items()},
        "environment": cfg.get("environment"), "sessions": sessions(cfg),
        "compile": compile_totals(cfg, rows, warmup or {}),
    }


def compile_totals(cfg: dict, rows: list[dict], warmup: dict[str, dict]) -> dict:
    """Per model: whether it decoded compiled (the knob ``compile``, as run.json records it, or as its samples
    say), and the graphs compiled and their seconds: its warm-up calls' (``warmup``, per model) plus those
    of its recorded decodes over every task."""
    out = {}
    for m in cfg["models"]:
        mine = [r for r in rows if r["model"] == m["name"]]
        warm = warmup.get(m["name"]) or {}
        on = bool((cfg.get("compile") or {}).get(m["name"])) or any(r["compiled"] for r in mine)
        out[m["name"]] = {"compiled": on,
                          "compilations": sum(r["compilations"] or 0 for r in mine) + warm.get("compilations", 0),
                          "compile_s": sum(r["compile_s"] or 0.0 for r in mine) + warm.get("compile_s", 0.0),
                          "warmup_compilations": warm.get("compilations", 0),
                          "warmup_compile_s": warm.get("compile_s", 0.0)}
    return out


def warmup_compile(run_dir: Path, cfg: dict) -> dict[str, dict]:
    """Per model, the compilations and compile seconds of its warm-up calls, summed over its ranks
    (``models/<name>/done.json``; {} for a model whose done.json lacks them)."""
    out = {}
    for m in cfg["models"]:
        path = run_dir / "models" / m["name"] / "done.json"
        ranks = [w for w in (read_json(path).get("warmup_compile") or []) if w] if path.is_file() else []
        if ranks:
            out[m["name"]] = {"compilations": sum(int(w.get("compilations", 0)) for w in ranks),
                              "compile_s": sum(float(w.get("compile_s", 0.0)) for w in ranks)}
    return out


def compile_note(s: dict) -> str | None:
    """One line naming the models decoded under torch.compile (None when every model ran eager)."""
    on = {k: v for k, v in (s.get("compile") or {}).items() if v["compiled"]}
    if not on:
        return None
    per = "; ".join(f"{k}: {v['compilations']} compilation(s), {v['compile_s']:.1f} s, warm-up call included"
                    for k, v in on.items())
    return (f"Compiled decoding (knob compile: torch.compile, static shapes) for {', '.join(on)} ({per}); "
            "compile seconds are left out of tok/s and latency. The other models, and the paper, decode eagerly.")


# ---------------------------------------------------------------- sessions (resume)


def sessions(cfg: dict) -> list[dict]:
    """The invocations that wrote a run: ``started`` and the ``models`` whose worker ran in each.

    A run.json written before sessions were recorded counts as one session."""
    return cfg.get("sessions") or [{"started": cfg.get("created"), "models": [m["name"] for m in cfg["models"]]}]


def _now() -> str:
    return _dt.datetime.now().isoformat(timespec="seconds")


def add_session(run_json: Path) -> None:
    """A resumed run: record one more session in run.json (its settings are unchanged)."""
    cfg = read_json(run_json)
    atomic_write_json(run_json, {**cfg, "sessions": [*sessions(cfg), {"started": _now(), "models": []}]})


def session_ran(run_json: Path, model: str) -> None:
    """Record that ``model``'s worker runs in the current (last) session."""
    cfg = read_json(run_json)
    ss = sessions(cfg)
    if model not in ss[-1]["models"]:
        ss[-1] = {**ss[-1], "models": [*ss[-1]["models"], model]}
        atomic_write_json(run_json, {**cfg, "sessions": ss})


def session_note(ss: list[dict]) -> str | None:
    """One line for a resumed run (None for a run whose models all ran in one session).

    Sessions in which no model ran (a finished run started again) do not count."""
    merged = next((x["merged"] for x in ss if x.get("merged")), None)
    if merged:
        return (f"Merged from {merged} shards (--shard I/{merged}, one job each, `make merge`): each (model, task) "
                "combines the shards' samples; tokens/s and speedups pool their decode times.")
    ran = [x for x in ss if x.get("models")]
    if len(ran) < 2:
        return None
    where: dict[str, list[int]] = {}
    for i, sess in enumerate(ran, 1):
        for m in sess["models"]:
            where.setdefault(m, []).append(i)
    per = "; ".join(f"{m} in session{'s' if len(v) > 1 else ''} {', '.join(map(str, v))}" for m, v in where.items())
    return (f"Resumed run: measured in {len(ran)} sessions (started {', '.join(str(x.get('started')) for x in ran)}): "
            f"{per}. Timings, tokens/s and speedups combine measurements taken in separate invocations.")


def resumed(ss: list[dict]) -> int:
    """How many sessions measured something (1 for a run that was not resumed)."""
    return max(1, sum(1 for x in ss if x.get("models")))


def _fmt(v, spec: str = ".3f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


COLUMNS = [("model", "model", None), ("task", "task", None), ("n", "samples", None),
           ("quality [95% CI]", "quality", ".3f"), ("tok/s [95% CI]", "tokens_per_s", ".1f"),
           ("speedup [95% CI]", "speedup", ".2f"), ("TPF [95% CI]", "tpf", ".2f"),
           ("NFE/sample [95% CI]", "nfe_mean", ".1f"), ("lat p50 s [95% CI]", "latency_p50_s", ".3f"),
           ("lat p90 s [95% CI]", "latency_p90_s", ".3f"), ("decode peak MiB", "decode_peak_bytes", None),
           ("weights MiB", "weights_bytes", None), ("KV KiB", "kv_peak_bytes", None)]
def intervals_note(baseline: str | None, single: bool = True, rounds: int | None = None) -> str:
    """The summary's line on its intervals: for each figure its statistic and what its bootstrap resampled."""
    head = ("Intervals: 95%, each the percentile bootstrap (2000 resamples, fixed seed) of the figure's own statistic, "
            "whose value at the full sample is the printed point; quality by Wilson's score interval (every item "
            "scored 0 or 1; else a bootstrap over items); ")
    if single:
        sp = (f"speedup: the ratio of throughputs (tokens over seconds) on the items both it and {baseline} decoded, "
              "resampling those items in pairs; mean speedup: the arithmetic mean over tasks of those, each task's "
              "items resampled on their own; " if baseline else "")
        speed = "tokens/s, TPF, NFE and latency: over the decoded items, resampling items; " + sp
    else:
        from harness.run.timing import pairs_text

        r = rounds or 0
        sp = (f"speedup: per timed item (a batch above batch 1), the median over its {pairs_text(r)} (rounds 1+2, "
              f"3+4, ...: disjoint, so independent) of the ratio of its tokens/s to {baseline}'s on that item; the "
              "task's speedup is the geometric mean over its items, with a two-level bootstrap (the items, then "
              "each item's round pairs); mean speedup: the arithmetic mean over tasks of the per-task speedups "
              "(the paper's convention), each task resampled on its own; " if baseline else "")
        speed = (f"tok/s: the median over {r} timed rounds of each round's tokens over its seconds, resampling rounds "
                 "and the timed items together; " + sp + "TPF, NFE and the latency percentiles: over every decoded "
                 "item of the decoding pass, resampling items (a latency is a request's seconds from its call's "
                 "start to its return; the pass decodes its calls one after another); ")
    return (head + speed + "each cell's item count is in the table or beside the cell (harness/run/timing.py, "
            "harness/run/stats.py). Peak memory is a maximum, not a mean over items: no interval. Any other figure "
            "without one: the run kept no per-item logs for it.")


SPEED_KEYS = ("tokens_per_s", "speedup", "latency_p50_s", "latency_p90_s")
TIMED_KEYS = ("tokens_per_s", "speedup")  # from the timed rounds in an interleaved run; latency stays the pass's


def single_pass(s: dict) -> bool:
    """Whether the run's wall-clock figures come from its one decoding pass (no timed rounds)."""
    return (s.get("timing") or {}).get("mode", "single pass") != "interleaved"


def timing_note(s: dict) -> str | None:
    """The summary's sentences on how its speed figures were timed, what their intervals do not hold, the
    machine's state, and the items the rounds dropped."""
    t = s.get("timing")
    if not t:
        return None
    if t.get("mode") != "interleaved":
        return ("Speed: a single pass (" + str(t.get("why")) + "): tokens/s, latency and speedup come from the "
                "decoding pass, one model after another, so a change in the machine between models moves them and "
                "their intervals (over items) do not show it.")
    items = t.get("items") or "all"
    text = (f"Speed: {t['rounds']} timed rounds of {items} item(s) per task, the models in turn ({t.get('order')}, "
            f"{'all loaded' if t.get('memory') == 'all' else 'two at a time against ' + str(s.get('baseline'))}); "
            "tok/s and speedup from the rounds"
            + (" (one timed item per task: a cell marked `1 item` is that item's, and its interval holds the "
               "rounds' spread only)" if items == 1 else "") +
            ", the latency percentiles from the decoding pass. What the intervals hold: the spread between this "
            "run's rounds and between its timed items. What they do not: the machine's state between runs, and "
            "the choice of timed items (another seed times others), so a second run may land outside them "
            "(docs/design.md \"What a second run shows\").")
    if t.get("busy_text"):
        text += " **Flag: " + t["busy_text"] + ".**"
    elif t.get("machine_text"):
        text += " **" + t["machine_text"][0].upper() + t["machine_text"][1:] + ".**"
    dropped = t.get("dropped") or []
    if dropped:
        text += (" **Dropped from the timed rounds (a fault twice; every side's figures leave them out): " +
                 "; ".join(f"{d['side']} on {d['group']}: document(s) {', '.join(str(x[1]) for x in d['docs'])} "
                           f"({d['reason']})" for d in dropped) + ".**")
    elif t.get("retried"):
        text += f" {t['retried']} timed call(s) met a fault and were decoded again; none was dropped."
    return text


def _suffix(r: dict, key: str, run_timed: bool) -> str:
    """What a speed cell adds about its own sample: ``1 item`` for a figure of one timed item, ``single pass`` for
    a row of an interleaved run that the rounds could not time."""
    if not run_timed or key not in TIMED_KEYS or key == "speedup" and not r.get("speedup_source"):
        return ""
    if key == "speedup" and r.get("speedup_source") == "single pass" or key == "tokens_per_s" and not r.get("timed"):
        return " (single pass)"
    if r.get("timed") and r.get("timed_items") == 1:
        return " (1 item)"
    return ""


def _cells(r: dict, run_timed: bool = False) -> list[str]:
    from harness.run.stats import fmt_interval

    out = []
    for _, key, spec in COLUMNS:
        v = r.get(key)
        if key == "samples" and r.get("failed"):
            v = f"{v} ({r['failed']} failed)"
        elif key in ("decode_peak_bytes", "weights_bytes") and v is not None:
            v = f"{v / 2**20:.2f}"
        elif key == "kv_peak_bytes" and v is not None:
            v = f"{v / 2**10:.1f}"
        text = _fmt(v, spec) if spec else _fmt(v)
        if spec and v is not None:
            text += fmt_interval(r.get(f"{key}_ci"), spec) + _suffix(r, key, run_timed)
            if r.get("engine") and key.startswith("latency"):
                text += " (at client)"
        out.append(text)
    return out


def _other_baselines(s: dict) -> tuple[list[str], list[list[str]]]:
    """(headers, cells per row) of the speedup columns against the AR baselines after the run's own (engine
    rows, harness/run/speedups.py); ([], []) for a run without them."""
    from harness.run.stats import fmt_interval

    labels = s.get("baseline_labels") or {}
    others = [b for b in (s.get("speedups") or {}) if b != s.get("baseline")]
    heads = [f"speedup vs {labels.get(b, b)} [95% CI]" for b in others]
    cells = []
    for r in s["rows"]:
        row = []
        for b in others:
            got = ((s["speedups"][b].get(r["model"]) or {}).get("per_task") or {}).get(r["task"])
            row.append("1.00x (itself)" if r["model"] == b else "-" if not got else
                       f"{got['ratio']:.2f}x{fmt_interval(got['interval'], '.2f')}")
        cells.append(row)
    return heads, cells


def _columns(s: dict) -> list[int]:
    """Indices of COLUMNS to show: no speedup column when the run has no AR reference."""
    return [i for i, c in enumerate(COLUMNS) if c[1] != "speedup" or s.get("baseline")]


def _head(s: dict, keep: list[int]) -> list[str]:
    """Column headings; a single pass says so beside every wall-clock figure, a timed run beside the figures
    that still come from the decoding pass (the latency percentiles). With several AR baselines (engine rows)
    the speedup column names its own, and the others' columns follow (``_other_baselines``)."""
    if s.get("speedups") and s.get("baseline"):
        label = (s.get("baseline_labels") or {}).get(s["baseline"], s["baseline"])
        s = {**s, "_vs": f"speedup vs {label} [95% CI]"}
    head = _head_plain(s, keep)
    if s.get("_vs"):
        head = [s["_vs"] + h[len("speedup [95% CI]"):] if h.startswith("speedup [95% CI]") else h for h in head]
    return head + _other_baselines(s)[0]


def _head_plain(s: dict, keep: list[int]) -> list[str]:
    if single_pass(s):
        return [COLUMNS[i][0] + (" (single pass)" if COLUMNS[i][1] in SPEED_KEYS else "") for i in keep]
    return [COLUMNS[i][0].replace(" [", " (pass) [") if COLUMNS[i][1] in SPEED_KEYS and COLUMNS[i][1] not in
            TIMED_KEYS else COLUMNS[i][0] for i in keep]


def markdown(s: dict) -> str:
    keep = _columns(s)
    head = _head(s, keep)
    vs = f", speedup vs {s['baseline']}" if s.get("baseline") else ""
    lines = [f"# Run {s['run_id']}: {s['task']} (limit {s['limit']}{vs})", ""]
    note = session_note(s.get("sessions") or [])
    if note:
        lines += [f"**{note}**", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    extra = _other_baselines(s)[1]
    lines += ["| " + " | ".join([_cells(r, not single_pass(s))[i] for i in keep] + (extra[j] if extra else []))
              + " |" for j, r in enumerate(s["rows"])]
    failed = [f"{r['model']} on {r['task']}: " + ", ".join(f"document {f['doc_id']} ({f['reason']})"
                                                        for f in r["failed_items"])
              for r in s["rows"] if r.get("failed_items")]
    if failed:
        lines += ["", "Failed items (scored as wrong, outside the speed figures): " + "; ".join(failed)]
    if withheld_note(s):
        lines += ["", withheld_note(s)]
    if s["mean_speedup"] and s.get("baseline"):
        from harness.run.stats import fmt_interval

        ivs = s.get("mean_speedup_interval") or {}
        how = sorted({v for k, v in (s.get("mean_speedup_statistic") or {}).items() if k != s.get("baseline")})
        lines += ["", "Mean per-task speedup [95% CI]: " + ", ".join(f"{k} {v:.2f}x{fmt_interval(ivs.get(k), '.2f')}"
                                                                     for k, v in s["mean_speedup"].items())
                  + (f" ({'; '.join(how)})" if how else "")]
    from harness.run import agreement, speedups

    for line in speedups.lines(s) + agreement.lines(s.get("agreement")):
        lines += ["", line]
    if any(r.get("engine") for r in s["rows"]):
        lines += ["", "Engine rows (ar@vllm): latency and tokens/s are measured at the client, per request over "
                  "HTTP, with the server's CPU time counted as the row's own (docs/engines.md)."]
    lines += ["", intervals_note(s.get("baseline"), single_pass(s), (s.get("timing") or {}).get("rounds"))]
    if timing_note(s):
        lines += ["", timing_note(s)]
    if compile_note(s):
        lines += ["", compile_note(s)]
    lines += ["", memory_note(s)]
    env = s.get("environment") or {}
    lines += ["", "Quality metric per task: " + ", ".join(sorted({f"{r['task']}={r['quality_metric']}"
                                                                  for r in s["rows"]})),
              f"Environment: commit {env.get('git_commit')}{' (dirty)' if env.get('git_dirty') else ''}, "
              f"{env.get('device')}, {env.get('threads_per_process')} threads x {env.get('num_processes')} process(es), "
              f"seed {env.get('seed')}, torch {(env.get('packages') or {}).get('torch')}, "
              f"lm-eval {(env.get('packages') or {}).get('lm-eval')}", ""]
    return "\n".join(lines)


def table(s: dict) -> str:
    keep = _columns(s)
    head = _head(s, keep)
    extra = _other_baselines(s)[1]
    body = [[c[i] for i in keep] + (extra[j] if extra else [])
            for j, c in enumerate(_cells(r, not single_pass(s)) for r in s["rows"])]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*b) for b in body])


def memory_note(s: dict) -> str:
    """The summary's sentence on what the memory columns count and which items measured them."""
    mp = s.get("memory_pass")
    if not mp:
        return ("Memory: no memory pass in this run (--memory-items 0, merged shards, or an older run): the decode "
                "peak is not measured; each metrics file keeps the process's peak RSS.")
    items = mp["settings"]["items"]
    bs = mp["settings"].get("batch_size", 1)
    return (f"Memory: decode peak = the largest, over {items} call(s) per task ({bs} row(s) each; the items: "
            "memory.json), of the tensor bytes one decoder call held at once above what was live when it began "
            "(on CUDA the allocator's peak over the call, weights excluded); weights = the model's parameters "
            "and buffers. Neither counts allocator caching and fragmentation, kernels' scratch memory, the "
            "interpreter or the libraries (the process's peak RSS is in each metrics file). KV = the decoder's "
            "own largest KV-cache bytes over every item.")


def withheld_note(s: dict) -> str | None:
    """One line naming how many code verdicts may depend on a package the sandbox did not give (None when
    none): their programs import such a package, so the score can be lower than the official scorers'."""
    per = [f"{r['model']} on {r['task']} {r['sandbox_withheld']} of {r['samples']}" for r in s["rows"]
           if r.get("sandbox_withheld")]
    if not per:
        return None
    total = sum(r.get("sandbox_withheld") or 0 for r in s["rows"])
    why = (((s.get("environment") or {}).get("sandbox") or {}).get("packages") or {}).get("warning")
    return (f"Code verdicts that may depend on a package the sandbox did not give: {total} ({'; '.join(per)}), "
            "marked `sandbox_withheld` in samples/<task>.jsonl (their programs or tests import it, the sandboxed "
            "ones could not)" + (f"; {why}" if why else ""))


def failed_lines(s: dict, run_dir: Path) -> list[str]:
    """One line per (model, task) with failed items: which documents, why, and how to retry them."""
    out = []
    for r in s["rows"]:
        items = r.get("failed_items") or []
        if items:
            docs = ", ".join(f"{f['doc_id']} ({f['reason']})" for f in items[:10])
            more = f" and {len(items) - 10} more" if len(items) > 10 else ""
            out.append(f"warning: {r['model']} on {r['task']}: {len(items)} failed item(s), counted as wrong: "
                       f"document {docs}{more}; retry them with --run-id {run_dir.name} --retry-failed")
    total = sum(r.get("sandbox_withheld") or 0 for r in s["rows"])
    if total:
        out.append(f"warning: {total} code verdict(s) may depend on a package the sandbox did not give, marked "
                   f"in the sample logs ({run_dir / 'summary.md'} says which and why, with the fix)")
    return out


def one_line(s: dict, run_dir: Path) -> str:
    parts = [f"{k} {v:.2f}x" for k, v in s["mean_speedup"].items() if k != s["baseline"]]
    vs = f"; mean speedup vs {s['baseline']}: {', '.join(parts)}" if s.get("baseline") and parts else ""
    for base, per in (s.get("speedups") or {}).items():  # engine rows: the other AR baselines
        more = [f"{k} {v['ratio']:.2f}x" for k, v in per.items() if v.get("ratio") is not None]
        if base != s.get("baseline") and more:
            vs += f"; vs {base}: {', '.join(more)}"
    for p in (s.get("agreement") or {}).get("pairs", []):
        vs += f"; agreement {p['engine']}/{p['reference']} {p['equal']}/{p['items']}{'' if p['ok'] else ' FAILED'}"
    k = resumed(s.get("sessions") or [])
    merged = next((x["merged"] for x in s.get("sessions") or [] if x.get("merged")), None)
    again = f"; merged from {merged} shards" if merged else f"; resumed, measured in {k} sessions" if k > 1 else ""
    return (f"done: {len(s['models'])} model(s) x {len(s['units'])} task(s), {sum(r['samples'] for r in s['rows'])} "
            f"samples{vs}{again}; results in {run_dir}")


# ---------------------------------------------------------------- overall progress


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


class Progress:
    """Done / total samples of a whole run (every model x task), one line per finished model, with an ETA.

    A unit's ``samples`` is its document count after LIMIT (the runner counts them while checking
    the data). The ETA is the remaining models' generated-token budget (requests x gen_length,
    harness/run/cluster.py) over each one's pace in budget tokens per second: its own from ``rates``
    (``--rate``: a number, or an earlier run's measured pace per model), else the mean pace of the models
    decoded so far in this session, and says which models it assumed that for (LLaDA at steps = length
    runs 10x slower per token than AR, so one model's pace says little about another's). Without a
    budget it extrapolates this session's samples per second. A resumed model's samples read back from
    its journal cost nothing and measure no pace.
    """

    def __init__(self, cfg: dict, clock: Callable[[], float] = time.monotonic, rates: dict | None = None):
        from harness.run.cluster import budget

        self.models = [m["name"] for m in cfg["models"]]
        counts = [u.get("samples") for u in cfg["units"]]
        self.per_model = sum(counts) if counts and None not in counts else None
        self.total = None if self.per_model is None else self.per_model * len(self.models)
        self.units = len(cfg["units"])
        tokens: dict[str, int | None] = {}
        for b in budget(cfg) if self.per_model is not None else []:
            tokens[b["model"]] = None if b["tokens"] is None or tokens.get(b["model"], 0) is None \
                else tokens.get(b["model"], 0) + b["tokens"]
        self.budget = tokens if tokens and None not in tokens.values() else None
        self.rates = dict(rates or {})
        self.paces: dict[str, float] = {}  # budget tokens / s measured this session
        self.finished_models = 0
        self.done = 0
        self.decoded = 0.0
        self.clock = clock
        self.t0 = self.last = clock()

    def start_line(self) -> str:
        total = f" = {self.total} samples" if self.total is not None else ""
        return f"run: {len(self.models)} model(s) x {self.units} task(s){total}"

    def _eta(self, model: str, share: float, spent: float, elapsed: float) -> str:
        left = self.total - self.done
        if left == 0:
            return "done"
        if self.budget is not None:
            if share > 0 and spent > 0:
                self.paces[model] = self.budget[model] * share / spent
            rest = self.models[self.finished_models:]
            mean = sum(self.paces.values()) / len(self.paces) if self.paces else None
            assumed = [m for m in rest if m not in self.rates and m not in self.paces]
            if assumed and mean is None:
                return "ETA unknown"
            seconds = sum(self.budget[m] / (self.rates.get(m) or self.paces.get(m) or mean) for m in rest)
            return f"ETA {_duration(seconds)}" + (f" ({', '.join(assumed)} at the mean pace so far)" if assumed else "")
        return f"ETA {_duration(elapsed / self.decoded * left)}" if self.decoded > 0 else "ETA unknown"

    def finished(self, model: str, decoded_share: float = 1.0) -> str:
        """``model`` is finished; ``decoded_share`` of its samples was decoded now (0 when skipped)."""
        self.finished_models += 1
        n = len(self.models)
        now = self.clock()
        spent, self.last = now - self.last, now
        if self.per_model is None:
            return f"progress: {self.finished_models}/{n} models ({model} finished)"
        self.done += self.per_model
        share = max(0.0, min(1.0, decoded_share))
        self.decoded += self.per_model * share
        elapsed = now - self.t0
        eta = self._eta(model, share, spent, elapsed)
        pct = 100.0 * self.done / self.total if self.total else 100.0
        return (f"progress: {self.finished_models}/{n} models, {self.done}/{self.total} samples ({pct:.0f}%), "
                f"{_duration(elapsed)} elapsed, {eta}")


def decoded_share(done_json: Path) -> float:
    """Share of a finished model's requests decoded by its last worker (the rest came from the journal)."""
    try:
        d = read_json(done_json)
        computed, served = int(d.get("computed", 0)), int(d.get("served_from_journal", 0))
    except (OSError, ValueError, TypeError):
        return 1.0
    return computed / (computed + served) if computed + served else 1.0
