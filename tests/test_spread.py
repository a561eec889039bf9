"""`make spread` (harness/speed/spread.py): the spread of a figure over repeated runs and the coverage of each
run's interval (does it hold the median of the other runs' points?), on hand-made runs."""

from __future__ import annotations

import pytest

from harness.speed import spread


def _run(name: str, point: float, lo: float, hi: float) -> dict:
    return {"run": name, "rows": {"refusion/math": {"speedup": point, "interval": {"lo": lo, "hi": hi}}}}


def test_coverage_counts_the_intervals_that_hold_the_others_median():
    # points 2.0, 2.2, 3.0, 2.1: the others' medians are 2.2, 2.1, 2.1, 2.2
    runs = [_run("a", 2.0, 1.9, 2.3), _run("b", 2.2, 2.15, 2.25), _run("c", 3.0, 2.8, 3.2), _run("d", 2.1, 1.5, 2.25)]
    got = spread.spread_of(runs, "rows")["refusion/math"]
    assert got["covers_others_median"] == 2  # a holds 2.2, d holds 2.2; b misses 2.1, c misses 2.1
    assert got["lowest"] == 2.0 and got["highest"] == 3.0 and got["max_over_min"] == pytest.approx(1.5)
    assert got["inside_all_others"] == 0
    c = spread.coverage(spread.spread_of(runs, "rows"))
    assert (c["held"], c["of"]) == (2, 4) and c["share"] == 0.5


def test_one_run_covers_nothing_and_is_not_counted():
    c = spread.coverage(spread.spread_of([_run("a", 2.0, 1.0, 3.0)], "rows"))
    assert c == {"held": 0, "of": 0, "share": None}


def _series(values: dict[str, list[float]], machine: str = "quiet") -> dict:
    n = len(next(iter(values.values())))
    return {"command": "harness eval --task embedded", "runs": [
        {"run": f"r{i}", "machine": machine, "rows": {k: {"speedup": v[i]} for k, v in values.items()}}
        for i in range(n)]}


def test_calibration_counts_false_alarms_on_idle_pairs_and_detections_on_slowed_runs():
    """The rule's spread from one series, false alarms over another's disjoint pairs, detection over (idle i,
    slowed i): each verdict is timing.spread_verdict against timing.spread_factor of the rule's values."""
    from harness.run import timing

    base = [2.0, 2.1, 1.95, 2.05, 2.0, 2.1]
    rule = _series({"refusion/math": base, "llada/math": [0.25] * 5 + [0.26]})
    factor = timing.spread_factor(base)["factor"]
    # idle: pair 1 within the spread, pair 2 beyond it (one false alarm of refusion's)
    idle = _series({"refusion/math": [2.0, 2.05, 2.0, 2.0 * factor * 1.05],
                    "llada/math": [0.25, 0.25, 0.25, 0.25]})
    slowed = _series({"refusion/math": [2.0 / 1.5, 2.0 / 1.5, 2.0 / 1.01, 2.0 / 1.5],
                      "llada/math": [0.25] * 4})
    slowed["slow"] = {"decoder": "refusion", "factor": 1.5}
    got = spread.calibrate(rule, idle, slowed)
    fa = got["false_alarm"]
    assert got["idle_pairs"] == 2 and fa["figures"] == 4 and fa["called_different"] == 1
    assert fa["share"] == 0.25 and fa["pairs_with_any"] == 1 and fa["called"][0]["figure"] == "refusion/math"
    det = got["detection"]
    assert det["decoder"] == "refusion" and det["figures"] == 4  # llada's figures are not the slowed decoder's
    want = sum(timing.spread_verdict(a, b, timing.spread_factor(base))["differs"] and b < a
               for a, b in zip([2.0, 2.05, 2.0, 2.0 * factor * 1.05], [2.0 / 1.5, 2.0 / 1.5, 2.0 / 1.01, 2.0 / 1.5]))
    assert det["detected"] == want == 3  # the third slowed run barely slowed: not called


def test_each_run_records_the_whole_commands_wall_time(tmp_path, monkeypatch):
    """ensure_runs times each `harness eval` from start to exit (what `make eval` costs its user) into the run
    folder; run_figures and the series carry it; a run made before (no record) has none."""
    import json
    import subprocess

    calls = []

    def fake_run(cmd, cwd=None, env=None):
        run = tmp_path / cmd[cmd.index("--run-id") + 1]
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({"rows": [], "timing": {"machine": "quiet"}}))
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(spread.subprocess, "run", fake_run)
    ticks = iter([100.0, 250.5, 300.0, 440.0])
    monkeypatch.setattr(spread.time, "monotonic", lambda: next(ticks))
    spread.ensure_runs(2, "w", ["--task", "embedded"], tmp_path)
    runs = [spread.run_figures(tmp_path / f"spread-w-0{i}") for i in (1, 2)]
    assert [r["wall_seconds"] for r in runs] == [150.5, 140.0] and len(calls) == 2
    assert spread._walls(runs) == {"runs": 2, "lowest": 140.0, "median": 150.5, "highest": 150.5,
                                   "unit": "seconds, the whole `harness eval` command"}
    (tmp_path / "spread-w-02" / spread.WALL_FILE).unlink()
    assert spread.run_figures(tmp_path / "spread-w-02")["wall_seconds"] is None
    assert spread._walls([{"wall_seconds": None}]) is None
