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
