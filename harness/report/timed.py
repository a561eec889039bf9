"""Readers of a run's timed rounds for the reports: whether a metrics file's wall-clock figures are timed,
their intervals, a bootstrap distribution over rounds, and one model's speedup over another from one
run's timing.json (the rounds themselves: harness/run/rounds.py; the statistics: harness/run/timing.py)."""

from __future__ import annotations

from pathlib import Path

from harness.run import timing
from harness.run.store import read_json


def is_timed(met: dict) -> bool:
    """Whether a metrics file's wall-clock figures come from timed rounds."""
    return ((met.get("speed") or {}).get("timing") or {}).get("mode") == "interleaved"


def speed_interval(met: dict, figure: str) -> dict | None:
    """The timed interval of a wall-clock figure of a metrics file (None for a single pass)."""
    return (met.get("intervals") or {}).get(figure) if is_timed(met) else None


def rounds_dist(met: dict, stream: object) -> "object | None":
    """A bootstrap distribution of a timed tokens/s figure over its rounds (the median of resampled rounds;
    for a row's average over tasks, resampled per task): None for a single pass."""
    if not is_timed(met):
        return None
    import numpy as np

    vals = np.asarray(met["speed"]["timing"].get("per_round_tokens_per_s") or [], dtype=float)
    if vals.size < 2:
        return None
    g = timing._rng("rounds_dist", stream, vals.size)
    return np.median(vals[g.integers(0, vals.size, size=(timing.BOOT, vals.size))], axis=1)


_TIMED: dict[str, tuple[float, dict | None]] = {}


def _timing_of(run_dir: str | Path) -> dict | None:
    """timing.json of a run folder, read once per change (the reports ask for many pairs)."""
    p = Path(run_dir) / "timing.json"
    try:
        mtime = p.stat().st_mtime
    except OSError:
        return None
    key = str(p.resolve())
    if key not in _TIMED or _TIMED[key][0] != mtime:
        try:
            _TIMED[key] = (mtime, read_json(p))
        except (OSError, ValueError):
            _TIMED[key] = (mtime, None)
    return _TIMED[key][1]


def mean_in_run(run_dir: str | Path, model: str, units: list[str]) -> dict | None:
    """``model``'s mean tokens/s over ``units`` from one run's timed rounds, the rounds drawn once for all of them
    (``timing.mean_figure``). None when no pass timed the model on every unit."""
    timed = _timing_of(run_dir)
    if not timed or not timed.get("passes"):
        return None
    ps = next((p for p in timed["passes"] if model in p["sides"]), None)
    return None if ps is None else timing.mean_figure(ps["records"], model, units, key=str(Path(run_dir).name))


def ratio_in_run(run_dir: str | Path, model: str, ref: str, units: list[str]) -> dict | None:
    """``model``'s tokens/s over ``ref``'s from one run's timed rounds, when one pass timed both: per unit
    (``timing.ratio``) and their mean (``timing.mean_ratio``). None when the run has no such rounds."""
    timed = _timing_of(run_dir)
    if not timed or not timed.get("passes"):
        return None
    ps = next((p for p in timed["passes"] if model in p["sides"] and ref in p["sides"]), None)
    if ps is None:
        return None
    per = {u: timing.ratio(ps["records"], model, ref, u) for u in units}
    mean = timing.mean_ratio(ps["records"], model, ref, units) if units and all(per.values()) else None
    return {"per_unit": per, "mean": mean}


def timed_average(cells: dict[str, dict]) -> tuple[dict | None, str | None]:
    """(interval, None) of a Table 1 row's Avg tokens/s whose columns (harness/report/paper_report.py cells) were
    timed in rounds, from ``mean_in_run``: one run timed every column, so its rounds are drawn once for all of
    them and each task's items on their own; else (None, why)."""
    got = [c for c in cells.values() if c.get("tokens_per_s") is not None]
    if not all(c.get("timed") for c in got):
        return None, "some columns were timed in rounds and some in a single pass: no joint interval"
    places = {(c.get("_run_dir"), c.get("model_in_run")) for c in got}
    if len(places) != 1 or None in next(iter(places)):
        return None, "the columns were timed in different runs, whose rounds do not pair: no joint interval"
    run_dir, model = next(iter(places))
    m = mean_in_run(run_dir, model, [c["task"] for c in got])
    if m is None or m["interval"] is None:
        return None, "the run's timing.json does not hold every column's rounds"
    return dict(m["interval"]), None
