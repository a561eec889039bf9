"""A run's speed statistics end to end (harness/run/timing.py, rounds.py, summary.py): every speedup point is its
interval's statistic at the full sample, recomputed here from timing.json by a function of this file, and lies
inside its interval, per (model, task) and for each model's mean; the labels count what was resampled; the
latency is a request's in every mode; a fault in the timed rounds is retried, then dropped and named, never
fatal. No test races a timer: the checks hold for any measured times."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harness.run import metrics, rounds

REPO = Path(__file__).resolve().parents[1]


def _task_speedup(timed: dict, model: str, ref: str, task: str) -> float:
    """The task's speedup recomputed from timing.json: per timed call (an item, or a batch) and disjoint pair of
    rounds (1+2, 3+4, ...; a last odd round left out), the ratio of the two models' tokens over seconds on that
    call; each call's median over pairs; the geometric mean over calls."""
    import math
    import statistics

    ps = next(p for p in timed["passes"] if model in p["sides"] and ref in p["sides"])

    def per_round(name: str) -> list[list[tuple[float, float]]]:
        recs = sorted((r for r in ps["records"] if r["side"] == name and r["group"] == task), key=lambda r: r["round"])
        return [[(c["tokens"], c["wall_s"] / r["repeat"]) for c in r["calls"]] for r in recs]

    a, b = per_round(model), per_round(ref)
    logs = []
    for c in range(len(a[0])):
        pairs = [((a[i][c][0] / (a[i][c][1] + a[i + 1][c][1])) / (b[i][c][0] / (b[i][c][1] + b[i + 1][c][1])))
                 for i in range(0, len(a) - 1, 2)]
        logs.append(math.log(statistics.median(pairs)))
    return math.exp(sum(logs) / len(logs))


def check_speedups(run: Path) -> dict:
    """Every speedup of summary.json (rows and means) against timing.json: equal to the recomputed statistic,
    inside its own interval, the interval labelled with what it resampled. Returns the summary."""
    s = json.loads((run / "summary.json").read_text())
    timed = json.loads((run / "timing.json").read_text())
    base = s["baseline"]
    per_model: dict[str, list[float]] = {}
    for r in s["rows"]:
        if r["model"] == base:
            continue
        assert r["speedup_source"] == "timed rounds", r
        want = _task_speedup(timed, r["model"], base, r["task"])
        assert r["speedup"] == pytest.approx(want, rel=1e-12)
        iv = r["speedup_ci"]
        assert iv["lo"] <= r["speedup"] <= iv["hi"], (r["model"], r["task"], iv)
        items, calls = r["timed_items"], r["timed_calls"]
        assert "round pairs" in iv["method"] and iv["items"] == items
        if calls < items:  # batches: a batch is what is resampled, and the label says so
            assert (f"two-level bootstrap: {calls} batches ({items} items), then within each its "
                    if calls > 1 else f"of 1 batch ({items} items), not resampled") in iv["method"]
        else:
            assert (f"two-level bootstrap: {items} items, then within each its " if items > 1 else
                    "of 1 item, not resampled") in iv["method"]
        tps_iv = r["tokens_per_s_ci"]
        assert tps_iv["lo"] <= r["tokens_per_s"] <= tps_iv["hi"] and f"{r['timed_rounds']} rounds" in tps_iv["method"]
        per_model.setdefault(r["model"], []).append(want)
    for model, points in per_model.items():
        assert s["mean_speedup"][model] == pytest.approx(sum(points) / len(points), rel=1e-12)
        iv = s["mean_speedup_interval"][model]
        assert iv["lo"] <= s["mean_speedup"][model] <= iv["hi"]
        assert "arithmetic mean over tasks" in s["mean_speedup_statistic"][model]
        one = {r["timed_calls"] for r in s["rows"] if r["model"] == model} == {1}
        assert ("each task's 1 " in iv["method"]) == one and "drawn on their own" in iv["method"]
    run_json = json.loads((run / "run.json").read_text())
    methods = run_json["timing_result"]["interval_methods"]
    assert all(v["speedup"] and "round pairs" in v["speedup"] for k, v in methods.items() if not k.startswith(base))
    return s


def _two_model_run(reference: Path, dst: Path, **timing) -> Path:
    """The reference run with a second model ``b`` (the same checkpoint and decoder under another name) and the
    timed rounds redone with these settings, then finalized."""
    shutil.copytree(reference, dst, ignore=shutil.ignore_patterns(".lock", ".tmp-*"))
    (dst / "timing.json").unlink()
    cfg = json.loads((dst / "run.json").read_text())
    a = cfg["models"][0]
    cfg["models"], cfg["baseline"] = [a, {**a, "name": "b"}], "a"
    cfg["timing"] = {**cfg["timing"], **timing}
    (dst / "run.json").write_text(json.dumps(cfg))
    shutil.copytree(dst / "models" / "a", dst / "models" / "b")
    for p in (dst / "metrics").glob("a__*.json"):
        met = json.loads(p.read_text())
        (dst / "metrics" / p.name.replace("a__", "b__", 1)).write_text(json.dumps({**met, "model": "b"}))
    assert rounds.main(["--run-dir", str(dst), "--no-progress"]) == 0
    from harness.run import runner

    runner.finalize(dst)
    return dst


@pytest.mark.parametrize("items", [1, "all"])
def test_every_speedup_is_its_statistic_and_lies_in_its_interval(runner_reference, tmp_path, items):
    run = _two_model_run(runner_reference, tmp_path / "run", rounds=4, items=items)
    s = check_speedups(run)
    row = next(r for r in s["rows"] if r["model"] == "b")
    md = (run / "summary.md").read_text()
    line = next(x for x in md.splitlines() if x.startswith("| b |"))
    # The pass's latency percentiles over all 6 decoded items, whatever the rounds timed.
    lat = [metrics.latency_of(json.loads(x)) for x in
           (run / "models" / "b" / "samples" / "tiny_gen.jsonl").read_text().splitlines()]
    assert row["latency_p50_s"] == pytest.approx(float(np.percentile(lat, 50)))
    assert row["latency_p90_s"] == pytest.approx(float(np.percentile(lat, 90))) != row["latency_p50_s"]
    assert "lat p50 s (pass) [95% CI]" in md and "bootstrap over 6 items" in row["latency_p50_s_ci"]["method"]
    if items == 1:  # one timed item: the timed cells say so themselves, not only the footer
        assert row["timed_items"] == 1 and line.count("(1 item)") == 2
        assert "a cell marked `1 item` is that item's" in md
    else:
        assert row["timed_items"] == 6 and "(1 item)" not in line
    assert "What they do not: the machine's state between runs, and the choice of timed items" in md


def test_a_row_the_rounds_could_not_time_says_single_pass(runner_reference, tmp_path):
    """A speedup without timed rounds keeps its single-pass point, and its cell says so."""
    run = _two_model_run(runner_reference, tmp_path / "run", rounds=2, items=1)
    timed = json.loads((run / "timing.json").read_text())
    for rec in timed["passes"][0]["records"]:  # b's rounds lost: no ratio can be formed
        if rec["side"] == "b":
            rec["side"] = "gone"
    (run / "timing.json").write_text(json.dumps(timed))
    from harness.run import runner

    s = runner.finalize(run)
    row = next(r for r in s["rows"] if r["model"] == "b")
    assert row["speedup_source"] == "single pass" and row["speedup_ci"]["lo"] <= row["speedup"] <= row["speedup_ci"]["hi"]
    line = next(x for x in (run / "summary.md").read_text().splitlines() if x.startswith("| b |"))
    assert line.count("(single pass)") == 2  # its tok/s and its speedup


def test_a_request_latency_is_its_whole_call():
    """Four rows decoded in one 2 s call: each request waited 2 s (latency), the rows' shares sum to the decode
    time (throughput); a record written before latency_s was kept reads the same."""
    recs = [{"generated_tokens": 10, "nfe": 5, "decode_s": 0.5, "latency_s": 2.0, "batch_size": 4} for _ in range(4)]
    got = metrics.aggregate(recs)
    assert got["latency_s"]["p50"] == got["latency_s"]["mean"] == 2.0 and got["latency_s"]["total"] == 2.0
    assert got["tokens_per_s"]["ratio_of_sums"] == 20.0
    old = [{k: v for k, v in r.items() if k != "latency_s"} for r in recs]
    assert metrics.aggregate(old)["latency_s"] == got["latency_s"]


def test_a_fault_in_the_timed_rounds_is_retried_then_dropped_and_named(runner_setup):
    """Non-finite logits in the first three decoder calls of every process: the pass fails its first three items
    and names them; in the rounds the first timed call fails twice (dropped, named in the console, summary.md
    and run.json) and the next fails once (retried); the run exits 0."""
    s = runner_setup
    cmd = [sys.executable, "-m", "harness", "eval", "--task", s["task"], "--models", s["models"], "--tasks-dir",
           str(s["tasks"]), "--out", str(s["out"]), "--run-id", "nan3", "--threads", "1", "--no-chat-template",
           "--timing-items", "all", "--timing-rounds", "2", "--memory-items", "0"]  # no memory pass: not checked
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false",
           "REFUSION_BENCH_FAULTS": json.dumps({"nan": {"first_calls": 3}})}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    run = s["out"] / "nan3"
    summary = json.loads((run / "summary.json").read_text())
    row = summary["rows"][0]
    assert row["failed"] == 3 and len(row["failed_items"]) == 3  # the pass: named, scored as wrong
    assert "warning: a on tiny_gen: 3 failed item(s)" in p.stderr
    timed = json.loads((run / "timing.json").read_text())
    assert len(timed["dropped"]) == 1 and len(timed["retried"]) == 2  # the dropped call's first try, and one more
    d = timed["dropped"][0]
    assert d["side"] == "a" and "non-finite" in d["reason"]
    assert f"warning: timed rounds: a on tiny_gen: document(s) {d['docs'][0][1]} failed twice" in p.stderr
    assert "Dropped from the timed rounds" in (run / "summary.md").read_text()
    assert json.loads((run / "run.json").read_text())["timing_result"]["dropped"] == timed["dropped"]
    assert row["timed_items"] == 2 and row["timed_dropped"] == [d["docs"][0]]


def test_a_run_without_generation_says_so(tmp_path):
    """timing.json of a run whose tasks only score log-likelihoods holds no passes and says why; the summary
    repeats that reason, not "merged shards, or an older run"."""
    cfg = {"timing": {"mode": "interleaved"}, "baseline": None, "models": [{"name": "a"}]}
    why = "no task of the run generates text: nothing to time"
    t = rounds.settings_of(cfg)
    (tmp_path / "timing.json").write_text(json.dumps({"settings": t, "docs": {}, "passes": [], "why": why}))
    timed = rounds.load_timing(tmp_path, cfg)
    row = {"model": "a", "task": "mc", "speed": {"tokens_per_s": {"ratio_of_sums": None}}}
    got = rounds.apply_timing(timed, cfg, [row])
    assert got["mode"] == "single pass" and got["why"] == why and row["speed"]["timing"]["why"] == why
