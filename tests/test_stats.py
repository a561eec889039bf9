"""harness/run/stats.py: 95% intervals and paired tests, against values worked by hand or tabulated.

scipy is not a dependency of the project (pyproject.toml), so the known values are written out: Wilson's
interval and McNemar's exact p from their closed forms (each line says how), bootstrap intervals where the
resampling distribution is small enough to enumerate, or against the normal approximation at n = 400.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from harness.run import stats


def _items(score, tokens=None, seconds=None, nfe=None, task="t") -> stats.Items:
    n = len(score)
    col = lambda v: np.array(v if v is not None else [math.nan] * n, dtype=float)  # noqa: E731
    return stats.Items([(task, i) for i in range(n)], col(score), col(tokens), col(seconds), col(nfe))


# ---------------------------------------------------------------- Wilson


@pytest.mark.parametrize("k, n, lo, hi", [
    # (p + z^2/2n +- z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), z = 1.959964; tabulated values of the Wilson
    # score interval (e.g. Newcombe 1998, Table I: 8/10 -> 0.4902-0.9433; 0/10 -> 0-0.2775)
    (8, 10, 0.4901625, 0.9433178),
    (0, 10, 0.0, 0.2775328),
    (3, 3, 0.4385030, 1.0),
    (57, 100, 0.4721539, 0.6626670),
])
def test_wilson_matches_tabulated_values(k, n, lo, hi):
    got = stats.wilson(k, n)
    assert got == pytest.approx((lo, hi), abs=1e-6)


def test_wilson_refuses_impossible_counts():
    for k, n in ((1, 0), (-1, 5), (6, 5)):
        with pytest.raises(ValueError, match="0 <= k <= n"):
            stats.wilson(k, n)


def test_quality_interval_is_wilson_for_binary_items_and_bootstrap_otherwise():
    iv = stats.quality_interval(_items([1, 1, 1, 1, 1, 1, 1, 1, 0, 0]))
    assert iv.method == "wilson" and (iv.lo, iv.hi) == pytest.approx((0.4901625, 0.9433178), abs=1e-6)
    # Without items: from the figure and its item count, when they make a whole number of successes.
    assert stats.quality_interval(None, 0.8, 10).lo == pytest.approx(0.4901625, abs=1e-6)
    assert stats.quality_interval(None, 0.123456, 10) is None
    # A non-binary score (a partial credit): bootstrap of the mean; all items equal -> the point itself.
    iv = stats.quality_interval(_items([0.5] * 20))
    assert iv.method == "bootstrap" and (iv.lo, iv.hi) == (0.5, 0.5)


# ---------------------------------------------------------------- bootstrap


def test_bootstrap_of_a_ratio_of_sums_enumerated():
    """Two items, tokens (10, 10), seconds (1, 3): a resample is (1,1) -> 10 tok/s, (3,3) -> 10/3, or mixed -> 20/4
    = 5, with probabilities 1/4, 1/4, 1/2; 2000 resamples hold both extremes, so the central 95% is [10/3, 10]."""
    it = _items([1, 0], tokens=[10, 10], seconds=[1, 3], nfe=[5, 5])
    iv = stats.row_intervals(it, "t")
    assert (iv["tokens_per_s"]["lo"], iv["tokens_per_s"]["hi"]) == pytest.approx((10 / 3, 10.0))
    assert (iv["tpf"]["lo"], iv["tpf"]["hi"]) == (2.0, 2.0)  # every item 10 tokens in 5 forwards
    assert (iv["latency_p50_s"]["lo"], iv["latency_p50_s"]["hi"]) == (1.0, 3.0)
    assert iv["quality"]["method"] == "wilson" and iv["items"] == {"scored": 2, "decoded": 2}


def test_bootstrap_mean_agrees_with_the_normal_approximation_at_n_400():
    """400 items, half right: the mean's standard error is 0.025, so the 95% interval is 0.5 -+ 0.049."""
    score = np.array([1.0, 0.0] * 200)
    lo, hi = stats.percentile_interval(stats.boot_dist({"s": score}, lambda c: c["s"].mean(axis=-1), "n400"))
    assert lo == pytest.approx(0.5 - 1.96 * 0.025, abs=0.006) and hi == pytest.approx(0.5 + 1.96 * 0.025, abs=0.006)


def test_bootstrap_is_deterministic_and_seeded_per_stream():
    score = np.arange(50, dtype=float)
    one = stats.boot_dist({"s": score}, lambda c: c["s"].mean(axis=-1), "a")
    assert np.array_equal(one, stats.boot_dist({"s": score}, lambda c: c["s"].mean(axis=-1), "a"))
    assert not np.array_equal(one, stats.boot_dist({"s": score}, lambda c: c["s"].mean(axis=-1), "b"))
    assert one.size == stats.BOOT


def test_boot_p_is_two_sided():
    assert stats.boot_p(np.array([2.0, 3.0, 4.0]), 1.0) == 0.0
    assert stats.boot_p(np.array([0.5, 1.5, 2.0, 3.0]), 1.0) == 0.5  # 2 x min(1/4, 3/4)
    assert stats.boot_p(np.array([1.0, 1.0]), 1.0) == 1.0


# ---------------------------------------------------------------- paired tests


@pytest.mark.parametrize("a_only, b_only, p", [
    (1, 6, 0.125),  # 2 x (C(7,0) + C(7,1)) / 2^7 = 2 x 8 / 128
    (0, 5, 0.0625),  # 2 x 1 / 32
    (2, 10, 0.03857421875),  # 2 x (1 + 12 + 66) / 4096
    (0, 0, 1.0),  # no discordant pair
])
def test_mcnemar_exact_p(a_only, b_only, p):
    both = 7  # concordant pairs change nothing
    a = [1] * a_only + [0] * b_only + [1] * both + [0] * 3
    b = [0] * a_only + [1] * b_only + [1] * both + [0] * 3
    got = stats.mcnemar(a, b)
    assert (got["a_only"], got["b_only"]) == (a_only, b_only)
    assert got["p"] == pytest.approx(p, rel=1e-12)


def test_paired_quality_uses_mcnemar_and_says_differs_only_below_alpha():
    a = _items([1] * 10 + [0] * 10)
    b = _items([0] * 1 + [1] * 9 + [1] * 10)  # 1 pair right in a only, 10 right in b only
    got = stats.paired_quality(a, b)
    assert got["test"] == "mcnemar" and (got["a_only"], got["b_only"]) == (1, 10)
    assert got["p"] == pytest.approx(2 * 12 / 2 ** 11) and got["differs"]  # 2 x (1 + 11) / 2048 = 0.0117
    assert got["difference"] == pytest.approx(0.45) and got["items"] == 20
    b2 = _items([0] * 1 + [1] * 9 + [1] * 2 + [0] * 8)  # 1 against 2: p = 1
    assert not stats.paired_quality(a, b2)["differs"]


def test_paired_ratio_exact_cases():
    a = _items([1] * 8, tokens=[10] * 8, seconds=[1, 2, 3, 4, 1, 2, 3, 4], nfe=[10] * 8)
    twice = _items([1] * 8, tokens=[10] * 8, seconds=[0.5, 1, 1.5, 2, 0.5, 1, 1.5, 2], nfe=[5] * 8)
    got = stats.paired_ratio(a, twice, "tokens_per_s")
    assert got["ratio"] == pytest.approx(2.0) and got["p"] == 0.0 and got["differs"]
    assert (got["interval"]["lo"], got["interval"]["hi"]) == pytest.approx((2.0, 2.0))
    assert stats.paired_ratio(a, twice, "tpf")["ratio"] == pytest.approx(2.0)
    same = stats.paired_ratio(a, a, "tokens_per_s")
    assert same["ratio"] == 1.0 and same["p"] == 1.0 and not same["differs"]


def test_paired_tests_pair_only_shared_items():
    a = _items([1, 1, 0, 0], tokens=[4] * 4, seconds=[1] * 4, nfe=[4] * 4)
    b = stats.Items([("t", 2), ("t", 3), ("t", 9)], np.array([1.0, 1.0, 0.0]), np.array([4.0] * 3),
                    np.array([0.5] * 3), np.array([4.0] * 3))
    q = stats.paired_quality(a, b)
    assert q["items"] == 2 and q["difference"] == 1.0 and q["b_only"] == 2
    r = stats.paired_ratio(a, b)
    assert r["items"] == 2 and r["ratio"] == pytest.approx(2.0)
    assert stats.paired_ratio(a, stats.Items([("u", 0)], *[np.array([1.0])] * 4)) is None


def test_mean_of_per_task_ratios_interval_is_stratified():
    """Two tasks, b exactly 2x and 4x as fast on every item: the mean of ratios is 3 in every resample."""
    a1 = _items([1] * 5, tokens=[10] * 5, seconds=[1, 2, 3, 4, 5], nfe=[10] * 5, task="x")
    b1 = _items([1] * 5, tokens=[10] * 5, seconds=[0.5, 1, 1.5, 2, 2.5], nfe=[10] * 5, task="x")
    a2 = _items([1] * 3, tokens=[8] * 3, seconds=[4, 4, 8], nfe=[8] * 3, task="y")
    b2 = _items([1] * 3, tokens=[8] * 3, seconds=[1, 1, 2], nfe=[8] * 3, task="y")
    got = stats.mean_ratio_interval([(a1, b1), (a2, b2)], streams=["x", "y"])
    iv = got["interval"]
    assert (iv["lo"], iv["hi"]) == pytest.approx((3.0, 3.0)) and got["ratio"] == pytest.approx(3.0)
    assert iv["method"].startswith("stratified paired bootstrap over 8 items of 2 tasks")


def test_single_pass_points_are_their_statistic_and_lie_in_their_intervals():
    """Noisy items, some failed on one side: the per-task point is the ratio on the items both decoded (the
    interval's statistic at the full sample), inside its interval; the mean is the mean of those points."""
    g = np.random.default_rng(5)
    pairs = []
    for t, n in (("x", 12), ("y", 7)):
        sa, sb = g.uniform(0.5, 2.0, n), g.uniform(0.2, 1.0, n)
        sb[0] = np.nan  # b failed its first item: only the shared ones count
        a = _items([1] * n, tokens=list(g.integers(5, 30, n)), seconds=list(sa), nfe=[4] * n, task=t)
        b = _items([1] * n, tokens=list(g.integers(5, 30, n)), seconds=list(sb), nfe=[4] * n, task=t)
        pairs.append((a, b))
        got = stats.paired_ratio(a, b, "tokens_per_s", t)
        ok = np.isfinite(sb)
        independent = (b.tokens[ok].sum() / sb[ok].sum()) / (a.tokens[ok].sum() / sa[ok].sum())
        assert got["ratio"] == pytest.approx(independent, rel=1e-12) and got["items"] == n - 1
        assert got["interval"]["lo"] <= got["ratio"] <= got["interval"]["hi"]
        assert got["interval"]["method"] == f"paired bootstrap over {n - 1} items both decoded (2000 resamples)"
    mean = stats.mean_ratio_interval(pairs, streams=["x", "y"])
    per = [stats.paired_ratio(a, b, "tokens_per_s", t)["ratio"] for (a, b), t in zip(pairs, "xy")]
    assert mean["ratio"] == pytest.approx(sum(per) / 2, rel=1e-12)
    assert mean["interval"]["lo"] <= mean["ratio"] <= mean["interval"]["hi"]


# ---------------------------------------------------------------- items from the logs


def test_items_from_sample_rows(tmp_path):
    rows = [
        # document 0: two filters, the primary one is "extract"
        {"task": "t", "doc_id": 0, "filter": "none", "metrics": {"exact_match": 0.0}},
        {"task": "t", "doc_id": 0, "filter": "extract", "metrics": {"exact_match": 1.0}, "generated_tokens": 6,
         "decode_s": 0.5, "nfe": 3},
        # document 1: failed (scored as wrong, no speed figures)
        {"task": "t", "doc_id": 1, "filter": "extract", "metrics": {"exact_match": 0.0}, "failed": "out of memory",
         "generated_tokens": 0, "decode_s": 0.0, "nfe": 0},
        {"task": "t", "doc_id": 2, "filter": "extract", "metrics": {"exact_match": True}, "generated_tokens": 4,
         "decode_s": 0.25, "nfe": 4},
    ]
    it = stats.items_from_rows(rows, "exact_match,extract")
    assert it.keys == [("t", 0), ("t", 1), ("t", 2)]
    assert it.score.tolist() == [1.0, 0.0, 1.0] and it.binary
    assert it.decoded.tolist() == [True, False, True]
    iv = stats.row_intervals(it, "t")
    assert iv["items"] == {"scored": 3, "decoded": 2}
    path = tmp_path / "models" / "m" / "samples" / "t.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn": ')
    got = stats.read_items(tmp_path, "m", "t", "exact_match,extract")
    assert got.keys == it.keys and got.score.tolist() == it.score.tolist()
    assert stats.read_items(tmp_path, "m", "other", "exact_match,extract") is None
    assert stats.cached_items(tmp_path, "m", "t", "exact_match,extract").keys == it.keys


def test_formatting():
    assert stats.fmt_interval({"lo": 0.1234, "hi": 0.5}, ".2f", 100) == " [12.34, 50.00]"
    assert stats.fmt_interval(None, ".2f") == ""
    assert (stats.fmt_p(0.0004), stats.fmt_p(0.0312), stats.fmt_p(None)) == ("<0.001", "0.031", "-")


# ---------------------------------------------------------------- batches are the units of a batched run


def _batched_rows(n_docs: int = 12, batch: int = 4, legacy: bool = False) -> list[dict]:
    """Sample-log rows of ``n_docs`` documents decoded ``batch`` at a time: the rows of a call share its wall time
    (latency_s, batch_wall_s) and split it evenly (decode_s), as harness/run/lm_decode.py writes them."""
    rows = []
    for d in range(n_docs):
        call = d // batch
        wall = 0.5 + 0.37 * call  # every call its own time
        r = {"task": "t", "doc_id": d, "filter": "none", "metrics": {"exact_match": float(d % 2)},
             "generated_tokens": 10 + 3 * d, "decode_s": wall / batch, "latency_s": wall, "batch_wall_s": wall,
             "batch_size": batch, "nfe": 7 + call, "rank": 0}
        if not legacy:
            r["batch_id"] = f"k{call * batch}"
        rows.append(r)
    return rows


@pytest.mark.parametrize("legacy", [False, True], ids=["batch_id", "older-log"])
def test_a_batch_4_runs_speed_intervals_resample_its_batches(legacy):
    """12 documents at batch 4 are 3 calls: the single-pass intervals resample the 3 batches, not the 12 rows.
    Checked independently: every bootstrap value of tokens/s is the ratio of sums over some multiset of 3 whole
    batches (10 possible values), and the interval's label names 3 batches. Resampling the rows instead (the
    old way) gives values outside that set, so the check can fail. Logs written before ``batch_id`` group the
    rows by their call's rank and wall time."""
    from itertools import combinations_with_replacement

    it = stats.items_from_rows(_batched_rows(legacy=legacy), "exact_match,none")
    groups = stats.speed_groups(it)
    units = stats.unit_members(groups)
    assert units is not None and len(units) == 3 and [len(u) for u in units] == [4, 4, 4]  # unit count = batches
    cols = stats.speed_columns(it)
    per = [(cols["tokens"][u].sum(), cols["seconds"][u].sum()) for u in units]
    allowed = np.array([sum(per[g][0] for g in c) / sum(per[g][1] for g in c)
                        for c in combinations_with_replacement(range(3), 3)])
    dist = stats.boot_dist(cols, stats.SPEED["tokens_per_s"], "t", groups=groups)
    assert np.all(np.min(np.abs(dist[:, None] - allowed[None, :]), axis=1) < 1e-9 * allowed.max())
    assert len(np.unique(np.round(dist, 9))) > 3  # the draws do vary
    rows_way = stats.boot_dist(cols, stats.SPEED["tokens_per_s"], "t")
    assert np.any(np.min(np.abs(rows_way[:, None] - allowed[None, :]), axis=1) > 1e-6)
    ivs = stats.row_intervals(it, "t")
    for name in ("tokens_per_s", "latency_p50_s", "latency_p90_s", "tpf"):
        assert "over 3 batches (12 items" in ivs[name]["method"], ivs[name]
    # Latency percentiles over batches: the interval's ends are batch latencies (every row of a call waits it).
    lat = sorted({float(cols["latency"][u][0]) for u in units})
    assert ivs["latency_p50_s"]["lo"] >= lat[0] and ivs["latency_p50_s"]["hi"] <= lat[-1]
    # Quality does not depend on the batch (each row decodes as alone): its interval stays over items.
    assert ivs["quality"]["method"] == "wilson"


def test_paired_speedups_keep_either_sides_batches_whole():
    """b at batch 4 against a at batch 1: the paired units are b's 3 batches; at batch 1 on both sides the items
    are the units and the distribution is the plain paired bootstrap's, bit for bit."""
    b = stats.items_from_rows(_batched_rows(), "exact_match,none")
    one = [dict(r, batch_size=1, batch_id=None, decode_s=r["decode_s"] * 2, latency_s=r["decode_s"] * 2,
                batch_wall_s=r["decode_s"] * 2) for r in _batched_rows()]
    a = stats.items_from_rows(one, "exact_match,none")
    assert a.batch is None
    ok = a.decoded & b.decoded
    groups = stats.paired_groups(a, b, ok)
    assert len(stats.unit_members(groups)) == 3
    got = stats.paired_ratio(a, b)
    assert "over 3 batches (12 items both decoded" in got["interval"]["method"]
    assert got["interval"]["lo"] <= got["ratio"] <= got["interval"]["hi"]
    plain = stats.paired_ratio(a, a)
    assert "over 12 items both decoded" in plain["interval"]["method"]
    cols = {"tokens": a.tokens, "seconds": a.seconds}
    same = np.arange(len(a.keys))  # every item its own group: the plain bootstrap
    assert np.array_equal(stats.boot_dist(cols, stats.SPEED["tokens_per_s"], "k", groups=same),
                          stats.boot_dist(cols, stats.SPEED["tokens_per_s"], "k"))
