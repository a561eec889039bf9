"""The timing protocol (harness/run/timing.py) and a run's timed rounds (harness/run/rounds.py).

Synthetic sides with a clock of their own make every figure exact: no test here races a timer."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from harness.run import guard, rounds, timing


class Clocked:
    """A side on a synthetic machine: each call costs ``cost[group][i]`` seconds x ``factor`` x the machine's
    speed at that moment, which drifts by ``drift`` per call made by any side (a neighbour slowly arriving)."""
    machine = {"t": 0}

    def __init__(self, name: str, cost: dict[str, list[float]], factor: float = 1.0, drift: float = 0.0,
                 tokens: int = 10) -> None:
        self.name, self.cost, self.factor, self.drift, self.tokens = name, cost, factor, drift, tokens

    def block(self, group: str, repeat: int) -> list[dict]:
        out = []
        for c in self.cost[group]:
            wall = 0.0
            for _ in range(repeat):
                Clocked.machine["t"] += 1
                wall += c * self.factor * (1 + self.drift * Clocked.machine["t"])
            out.append({"wall_s": wall, "cpu_s": wall, "tokens": self.tokens})
        return out


def test_abba_alternates_and_random_is_seeded():
    assert [timing.side_order("abc", r, 0, "abba", 1) for r in range(3)] == [list("abc"), list("cba"), list("abc")]
    assert timing.side_order("abc", 0, 1, "abba", 1) == list("cba")  # the next group starts the other way
    orders = [timing.side_order("abcd", r, 0, "random", 7) for r in range(6)]
    assert orders == [timing.side_order("abcd", r, 0, "random", 7) for r in range(6)]
    assert all(sorted(o) == list("abcd") for o in orders) and len({tuple(o) for o in orders}) > 1
    with pytest.raises(ValueError, match="valid: abba, random"):
        timing.side_order("ab", 0, 0, "nope", 1)


def test_figures_are_exact_on_a_steady_machine():
    cost = {"g": [0.1, 0.3]}
    got = timing.run_rounds([Clocked("a", cost), Clocked("b", cost, factor=2.0)], ["g"], rounds=10, progress=False)
    assert len(got["records"]) == 20 and got["repeat"] == {"g": {"a": 1, "b": 1}}
    fa = timing.figure(got["records"], "a", "g")
    assert fa["tokens_per_s"] == pytest.approx(20 / 0.4) and fa["rounds"] == 10 and fa["calls"] == 2
    assert fa["interval"]["lo"] <= 50.0 <= fa["interval"]["hi"]
    assert fa["interval"]["method"] == "bootstrap over 10 rounds and 2 items, resampled together (2000 resamples)"
    assert fa["latency_s"] == pytest.approx(0.2)  # the mean request latency
    r = timing.ratio(got["records"], "b", "a", "g")
    assert r["ratio"] == pytest.approx(0.5) and len(r["per_pair"]) == r["pairs"] == 5  # disjoint round pairs
    assert r["interval"]["lo"] == pytest.approx(0.5) and r["interval"]["hi"] == pytest.approx(0.5)
    assert r["interval"]["method"] == ("two-level bootstrap: 2 items, then within each its 5 round pairs "
                                       "(2000 resamples)")
    assert r["per_item"] == pytest.approx([0.5, 0.5])
    m = timing.mean_ratio(got["records"], "b", "a", ["g"])
    assert m["ratio"] == pytest.approx(0.5)
    odd = timing.ratio(timing.run_rounds([Clocked("a", cost), Clocked("b", cost)], ["g"], rounds=9,
                                         progress=False)["records"], "b", "a", "g")
    assert odd["pairs"] == 4 and "4 round pairs (round 9 unpaired, left out)" in odd["interval"]["method"]


def test_round_pairs_are_disjoint():
    wall = np.arange(7.0)[:, None] * np.ones((1, 2))  # rounds 0..6, 2 calls
    assert timing.round_pairs(wall)[:, 0].tolist() == [0 + 1, 2 + 3, 4 + 5]  # round 6 left out, none twice
    assert timing.round_pairs(wall[:1]).tolist() == [[0.0, 0.0]]
    assert timing.pairs_text(10) == "5 round pairs" and timing.pairs_text(1) == "1 round (unpaired)"


def test_one_timed_item_is_named_and_not_resampled():
    got = timing.run_rounds([Clocked("a", {"g": [0.1]}), Clocked("b", {"g": [0.2]})], ["g"], rounds=4, progress=False)
    r = timing.ratio(got["records"], "b", "a", "g")
    assert r["items"] == 1 and r["interval"]["method"] == ("bootstrap over the 2 round pairs of 1 item, not "
                                                           "resampled (2000 resamples)")


def _independent_ratio(records: list[dict], side: str, ref: str, group: str) -> float:
    """The per-task speedup recomputed from the records alone: per item and disjoint pair of rounds (1+2, 3+4,
    ...), each side's tokens over its seconds on that item, their ratio; each item's median over pairs; the
    geometric mean over items."""
    import math
    import statistics

    def per_round(name):
        rs = sorted((r for r in records if r["side"] == name and r["group"] == group), key=lambda r: r["round"])
        return [[(c["tokens"], c["wall_s"] / r["repeat"]) for c in r["calls"]] for r in rs]
    a, b = per_round(side), per_round(ref)
    logs = []
    for item in range(len(a[0])):
        ratios = []
        for i in range(0, len(a) - 1, 2):
            sa, sb = a[i][item][1] + a[i + 1][item][1], b[i][item][1] + b[i + 1][item][1]
            ratios.append((a[i][item][0] / sa) / (b[i][item][0] / sb))
        logs.append(math.log(statistics.median(ratios)))
    return math.exp(sum(logs) / len(logs))


def test_each_point_is_its_statistic_and_lies_in_its_interval():
    """On a noisy synthetic machine (random per-call wobble), per group and for the mean over groups, the point
    equals an independent recomputation and lies inside its own interval."""
    import random

    class Noisy(Clocked):
        def __init__(self, *a, seed=0, **k):
            super().__init__(*a, **k)
            self.rng = random.Random(seed)

        def block(self, group, repeat):
            return [{**c, "wall_s": c["wall_s"] * self.rng.uniform(0.7, 1.4)} for c in super().block(group, repeat)]

    cost = {"g": [0.1, 0.3, 0.2], "h": [0.05], "k": [0.2, 0.1]}
    for seed in range(6):
        got = timing.run_rounds([Noisy("a", cost, seed=seed), Noisy("b", cost, factor=1.7, seed=seed + 50)],
                                list(cost), rounds=10, progress=False)
        points = []
        for g in cost:
            r = timing.ratio(got["records"], "b", "a", g)
            assert r["ratio"] == pytest.approx(_independent_ratio(got["records"], "b", "a", g), rel=1e-12)
            assert r["interval"]["lo"] <= r["ratio"] <= r["interval"]["hi"]
            f = timing.figure(got["records"], "b", g)
            assert f["interval"]["lo"] <= f["tokens_per_s"] <= f["interval"]["hi"]
            points.append(r["ratio"])
        m = timing.mean_ratio(got["records"], "b", "a", list(cost))
        assert m["ratio"] == pytest.approx(sum(points) / len(points), rel=1e-12)
        assert m["interval"]["lo"] <= m["ratio"] <= m["interval"]["hi"]
        assert m["interval"]["method"].startswith("two-level bootstrap within each of 3 tasks, drawn on their own")


def test_the_task_speedup_weighs_every_item_alike():
    """Items whose speedups are 1x, 2x and 4x (steady machine) give the geometric mean, 2x, whatever their
    lengths; the two-level interval spans the items' spread (resampling items) and names both units."""
    cost_a = {"g": [0.1, 1.0, 0.4]}
    cost_b = {"g": [0.1, 0.5, 0.1]}  # item speedups b over a: 1, 2, 4
    got = timing.run_rounds([Clocked("a", cost_a), Clocked("b", cost_b)], ["g"], rounds=6, progress=False)
    r = timing.ratio(got["records"], "b", "a", "g")
    assert r["per_item"] == pytest.approx([1.0, 2.0, 4.0]) and r["ratio"] == pytest.approx(2.0)
    assert r["interval"]["lo"] < 1.6 and r["interval"]["hi"] > 2.5  # the items' spread, not the rounds' (none)
    assert r["interval"]["method"] == "two-level bootstrap: 3 items, then within each its 3 round pairs (2000 resamples)"
    # a pooled ratio of sums would be dominated by the long item: 1.5 / 0.7 = 2.14
    assert r["ratio"] != pytest.approx(1.5 / 0.7, rel=1e-3)


def test_nested_bootstrap_draws_pairs_within_each_item():
    """Per item the pairs are drawn on their own: one item steady at 2x, another whose pairs are 1x and 3x; the
    draws reproduce from the key, and a resample's value is a geometric mean of per-item medians."""
    q = np.array([[2.0, 1.0], [2.0, 3.0]])  # [pairs, items]
    d = timing.nested_dist(q, key="k", boot=500)
    assert np.array_equal(d, timing.nested_dist(q, key="k", boot=500))
    medians = {1.0, 2.0, 3.0}  # item 2's possible medians over 2 drawn pairs: 1, 2 (one of each), 3
    allowed = {round(float(np.exp(np.mean(np.log([x, y])))), 9) for x in medians | {2.0} for y in medians | {2.0}}
    assert {round(float(v), 9) for v in d} <= allowed
    assert timing.task_speedup(q) == pytest.approx(2.0)


def test_a_short_block_is_repeated_within_its_round():
    got = timing.run_rounds([Clocked("a", {"g": [0.001]}), Clocked("b", {"g": [0.002]})], ["g"], rounds=2,
                            min_block_s=0.05, progress=False)
    assert got["repeat"] == {"g": {"a": 50, "b": 25}}  # each side's block lasts MIN_BLOCK_S, no side longer
    ab = timing.run_rounds([Clocked("a", {"g": [0.001]}), Clocked("b", {"g": [0.002]})], ["g"], rounds=2,
                           min_block_s=0.05, progress=False, same_repeat=True)
    assert ab["repeat"] == {"g": {"a": 50, "b": 50}}  # an A/B's two versions: alike blocks
    fa = timing.figure(got["records"], "a", "g")
    assert fa["tokens_per_s"] == pytest.approx(10 / 0.001)  # seconds per pass: the block's time / its repeats


def test_a_block_decoded_untimed_already_is_not_warmed_up_again():
    """``warmed`` (the A/B's sizing decode of a one-item block): no warm-up call for that group, and each side's
    repeat count comes from the given seconds; the other group is warmed up as before."""
    calls = []

    class Counted(Clocked):
        def block(self, group, repeat):
            calls.append((self.name, group, repeat))
            return super().block(group, repeat)

    cost = {"slow": [0.5], "fast": [0.01]}
    got = timing.run_rounds([Counted("a", cost), Counted("b", cost)], ["slow", "fast"], rounds=2, progress=False,
                            min_block_s=0.1, warmed={"slow": {"a": 0.04, "b": 0.5}})
    assert got["repeat"] == {"slow": {"a": 3, "b": 1}, "fast": {"a": 10, "b": 10}}
    assert calls[:2] == [("a", "fast", 1), ("b", "fast", 1)]  # the warm-up: the fast group only
    assert sorted(calls[2:]) == sorted([(n, "slow", got["repeat"]["slow"][n]) for n in "ab"] * 2
                                       + [(n, "fast", 10) for n in "ab"] * 2)


def test_abba_cancels_a_drifting_machine():
    """Identical code on a machine that slows down steadily (5% per call): in ABBA rounds their speedup is 1,
    while comparing each side's own figure (what one pass after the other gives) is far off."""
    cost = {"g": [0.1, 0.1, 0.1]}
    Clocked.machine["t"] = 0
    got = timing.run_rounds([Clocked("a", cost, drift=0.05), Clocked("b", cost, drift=0.05)], ["g"], rounds=9,
                            progress=False)
    r = timing.ratio(got["records"], "b", "a", "g")
    assert r["ratio"] == pytest.approx(1.0, abs=0.01)
    Clocked.machine["t"] = 0
    first = timing.run_rounds([Clocked("a", cost, drift=0.05)], ["g"], rounds=9, progress=False)
    second = timing.run_rounds([Clocked("b", cost, drift=0.05)], ["g"], rounds=9, progress=False)
    seq = timing.figure(second["records"], "b", "g")["tokens_per_s"] / timing.figure(first["records"], "a", "g")[
        "tokens_per_s"]
    assert seq < 0.75


def test_interval_holds_round_to_round_spread():
    """A round-to-round wobble of +-10% on one side widens the speedup interval; an item bootstrap alone (one
    pass) could not see it."""
    import random

    class Wobbly(Clocked):
        rng = random.Random(3)

        def block(self, group, repeat):
            f = self.rng.uniform(0.9, 1.1)  # this round's neighbour
            return [{**c, "wall_s": c["wall_s"] * f} for c in super().block(group, repeat)]

    cost = {"g": [0.1, 0.1]}
    Clocked.machine["t"] = 0
    got = timing.run_rounds([Clocked("a", cost), Wobbly("b", cost)], ["g"], rounds=9, progress=False)
    r = timing.ratio(got["records"], "b", "a", "g")
    assert r["interval"]["hi"] - r["interval"]["lo"] > 0.05


def test_the_between_run_threshold_is_students_t_on_the_spread_of_log_speedups():
    """spread_factor against a hand computation: s = sd(log v) (n - 1), t the two-sided 0.99 quantile with n - 1
    degrees of freedom, factor exp(t s sqrt 2); a change beyond it either way differs, within it not."""
    import math
    import statistics

    from scipy.stats import t as student

    values = [2.0, 2.2, 1.9, 2.1, 2.05, 2.3]
    got = timing.spread_factor(values)
    s = statistics.stdev(math.log(v) for v in values)
    want = math.exp(student.ppf(0.995, 5) * s * math.sqrt(2))
    assert got["factor"] == pytest.approx(want, rel=1e-12) and got["runs"] == 6 and got["alpha"] == 0.01
    assert timing.spread_verdict(2.0, 2.0 * want * 1.01, got)["differs"]
    assert timing.spread_verdict(2.0, 2.0 / (want * 1.01), got)["differs"]  # slower, beyond it
    assert not timing.spread_verdict(2.0, 2.0 * want * 0.99, got)["differs"]
    assert timing.spread_factor(values[:4]) is None  # fewer than MIN_SPREAD_RUNS runs
    assert timing.spread_factor([2.0, 0.0, 1.0, 1.0, 1.0]) is None


def test_sample_docs_is_seeded_and_nested():
    docs = list(range(40))
    four = timing.sample_docs(docs, 4, 1234, "embedded_math")
    eight = timing.sample_docs(docs, 8, 1234, "embedded_math")
    assert len(four) == 4 and set(four) <= set(eight) and four == sorted(four)
    assert four == timing.sample_docs(docs, 4, 1234, "embedded_math") != timing.sample_docs(docs, 4, 1234, "other")
    assert timing.sample_docs(docs, None, 1, "x") == docs and timing.sample_docs(docs, 99, 1, "x") == docs
    # auto: at least 8 items (all of a task with fewer); a large run's rounds re-decode about half the decoding
    # pass (k x rounds ~ docs / 2); at most 32 items per task
    assert [timing.items_auto(n) for n in (1, 5, 20, 40, 60, 100, 400, 1319)] == [1, 5, 8, 8, 8, 12, 32, 32]
    assert [timing.items_auto(n, rounds=10) for n in (20, 100, 400)] == [8, 8, 20]
    assert timing.items_auto(60, rounds=3) == 10 and timing.items_auto(0) == 1
    assert timing.parse_items("auto") == "auto" and timing.parse_items("7") == 7
    with pytest.raises(ValueError, match="auto, all or a count"):
        timing.parse_items("0")


def _fake_proc(root: Path, stat: tuple, procs: dict[int, tuple[int, int]], load: float = 0.5) -> None:
    """/proc/stat (user nice system idle iowait irq softirq steal), /proc/<pid>/stat (ppid, utime + stime in
    utime) and /proc/loadavg."""
    root.mkdir(exist_ok=True)
    (root / "stat").write_text("cpu  " + " ".join(map(str, stat)) + " 0 0\ncpu0 1 2 3\n")
    (root / "loadavg").write_text(f"{load} 0.4 0.3 1/100 999\n")
    for pid, (ppid, cpu) in procs.items():
        (root / str(pid)).mkdir(exist_ok=True)
        (root / str(pid) / "stat").write_text(f"{pid} (py (x) y) S {ppid} 1 1 0 -1 0 0 0 0 0 {cpu} 0 0 0\n")


def test_guard_counts_others_and_steal_and_flags_a_busy_machine(tmp_path):
    proc = tmp_path / "proc"
    # Us: pid 10 and its child 11; a stranger: pid 20.
    _fake_proc(proc, (100, 0, 0, 1000, 0, 0, 0, 0), {10: (1, 50), 11: (10, 20), 20: (1, 30)})
    g = guard.Guard(roots={10}, proc=str(proc))
    g.mark("start")
    # Over the window: 400 jiffies in all; busy +200 of which ours +120 (10: +100, 11: +20), steal +20.
    _fake_proc(proc, (300, 0, 0, 1180, 0, 0, 0, 20), {10: (1, 150), 11: (10, 40), 20: (1, 110)}, load=1.5)
    g.mark("end")
    res = g.result()
    assert res["available"] and res["others_cpu_share"] == pytest.approx(80 / 400)
    assert res["steal_share"] == pytest.approx(20 / 400) and res["others_share"] == pytest.approx(0.25)
    assert res["our_cpu_share"] == pytest.approx(120 / 400) and res["load1_max"] == 1.5 and res["busy"]
    text = guard.busy_text(res)
    assert "other processes used 20% of the machine's CPU and the hypervisor took 5% (steal)" in text
    quiet = guard.Guard(roots={10}, proc=str(proc), busy_share=0.3)
    quiet._marks = g._marks
    assert not quiet.result()["busy"] and guard.busy_text(quiet.result()) is None
    assert quiet.result()["state"] == "quiet" and res["state"] == "busy"
    assert guard.Guard(proc=str(tmp_path / "none")).result()["available"] is False


def test_guard_says_unknown_when_it_cannot_read_the_process_table(tmp_path, monkeypatch):
    """/proc/stat readable but the process table not listable: our CPU is unknown, so the verdict is unknown
    (with why), never busy (all our CPU counted as a neighbour's) nor quiet."""
    proc = tmp_path / "proc"
    _fake_proc(proc, (100, 0, 0, 1000, 0, 0, 0, 0), {10: (1, 50)})
    g = guard.Guard(roots={10}, proc=str(proc))
    real = guard.os.listdir
    monkeypatch.setattr(guard.os, "listdir", lambda p: (_ for _ in ()).throw(PermissionError(13, "denied"))
                        if str(p) == str(proc) else real(p))
    g.mark("start")
    _fake_proc(proc, (900, 0, 0, 1000, 0, 0, 0, 0), {10: (1, 850)})  # all of it ours
    g.mark("end")
    res = g.result()
    assert res["state"] == "unknown" and not res["busy"] and "process table" in res["why"]
    assert guard.busy_text(res) is None and "unknown" in guard.state_text([res])
    assert guard.combined_state([res, {"state": "quiet"}]) == "unknown"


def test_guard_on_a_gpu_without_nvml_says_unknown_and_why(tmp_path, monkeypatch):
    proc = tmp_path / "proc"
    _fake_proc(proc, (100, 0, 0, 1000, 0, 0, 0, 0), {10: (1, 50)})
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    g = guard.Guard(roots={10}, proc=str(proc), gpu_index=0)
    g.mark("start")
    _fake_proc(proc, (200, 0, 0, 1100, 0, 0, 0, 0), {10: (1, 150)})
    g.mark("end")
    res = g.result()
    assert res["state"] == "unknown" and "NVML unavailable (ModuleNotFoundError" in res["why"] and "CPU was quiet" in res["why"]


# ---------------------------------------------------------------- a real run's timed rounds


def _copy_run(reference: Path, dst: Path) -> Path:
    shutil.copytree(reference, dst, ignore=shutil.ignore_patterns(".lock", ".tmp-*"))
    (dst / "timing.json").unlink()
    return dst


def test_timed_decode_with_other_tokens_is_an_error_naming_model_and_item(runner_reference, tmp_path, capsys):
    run = _copy_run(runner_reference, tmp_path / "run")
    cfg = json.loads((run / "run.json").read_text())
    cfg["timing"] = {**cfg["timing"], "rounds": 2, "items": "all"}
    (run / "run.json").write_text(json.dumps(cfg))
    p = run / "models" / "a" / "samples" / "tiny_gen.jsonl"
    rows = [json.loads(x) for x in p.read_text().splitlines()]
    rows[3]["tokens"] = rows[3]["tokens"][:-1] + [rows[3]["tokens"][-1] + 1]  # the quality pass "said" otherwise
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert rounds.main(["--run-dir", str(run), "--no-progress"]) == 3
    err = capsys.readouterr().err
    assert f"error: model 'a': the timed decode of tiny_gen document {rows[3]['doc_id']} gave other tokens" in err
    assert not (run / "timing.json").exists()


def test_pairs_time_each_model_against_the_reference_two_at_a_time(runner_reference, tmp_path):
    """Three rows with --timing-memory pairs: two passes (a with b, a with c), each holding two models; every row
    gets its figures, the speedups come from the pass that timed both."""
    run = _copy_run(runner_reference, tmp_path / "run")
    cfg = json.loads((run / "run.json").read_text())
    a = cfg["models"][0]
    cfg["models"] = [a, {**a, "name": "b"}, {**a, "name": "c"}]
    cfg["baseline"] = "a"
    cfg["timing"] = {**cfg["timing"], "rounds": 3, "items": 2, "memory": "pairs"}
    (run / "run.json").write_text(json.dumps(cfg))
    for n in ("b", "c"):
        shutil.copytree(run / "models" / "a", run / "models" / n)
        met = json.loads((run / "metrics" / "a__tiny_gen.json").read_text())
        (run / "metrics" / f"{n}__tiny_gen.json").write_text(json.dumps({**met, "model": n}))
    assert rounds.main(["--run-dir", str(run), "--no-progress"]) == 0
    timed = json.loads((run / "timing.json").read_text())
    assert timed["memory"] == "pairs" and [p["sides"] for p in timed["passes"]] == [["a", "b"], ["a", "c"]]
    assert all(len(ks) == 2 for ks in timed["docs"].values())
    from harness.run import runner

    result = runner.finalize(run)
    assert result["timing"]["mode"] == "interleaved" and result["timing"]["memory"] == "pairs"
    rows = {r["model"]: r for r in result["rows"]}
    assert all(rows[n]["tokens_per_s"] > 0 and rows[n]["tokens_per_s_ci"] for n in "abc")
    # Each speedup is the ratio over the pass that timed both sides (recomputed here from that pass's records, not
    # the other one), and lies in its own interval. Its size is not asserted: b and c are a under other names, but
    # a neighbour's load can move the ratio of two sides timed moments apart on a shared 2-core machine.
    for n, ps in zip("bc", timed["passes"]):
        want = {t: timing.ratio(ps["records"], n, "a", t)["ratio"] for t in timed["docs"]}
        got = {r["task"]: r["speedup"] for r in result["rows"] if r["model"] == n}
        assert got == pytest.approx(want) and rows[n]["speedup"] > 0
        assert rows[n]["speedup_ci"]["lo"] <= rows[n]["speedup"] <= rows[n]["speedup_ci"]["hi"]
    md = (run / "summary.md").read_text()
    assert "Speed: 3 timed rounds of 2 item(s) per task, the models in turn (abba, two at a time against a)" in md


def _block_records(side: str, walls: dict[str, list[list[float]]], tokens: int = 30) -> list[dict]:
    """Timed-round records of one side: per group, per round, one block of calls with these wall seconds."""
    return [{"side": side, "group": g, "round": r, "repeat": 1,
             "calls": [{"wall_s": w, "cpu_s": w, "tokens": tokens, "rows": 1} for w in row]}
            for g, rounds_ in walls.items() for r, row in enumerate(rounds_)]


def test_the_average_over_tasks_draws_the_rounds_once():
    """Table 1's Avg tokens/s of a timed row (timing.mean_figure): the point is the mean of each task's figure, and
    the resamples draw one set of rounds for every task. Two tasks with the same walls in every round and one call
    each: every bootstrap value is then a median over one multiset of rounds, which draws made for each task on
    its own (the old way: their mean of two different medians) would leave."""
    from itertools import combinations_with_replacement

    walls = [[1.0], [1.3], [0.8], [1.9]]  # 4 rounds, one call: a slow round is slow for both tasks
    recs = _block_records("a", {"t1": walls, "t2": walls})
    got = timing.mean_figure(recs, "a", ["t1", "t2"], with_dist=True)
    one = timing.figure(recs, "a", "t1")
    assert got["tokens_per_s"] == pytest.approx(one["tokens_per_s"])  # the mean of two equal figures
    tps = [30 / w[0] for w in walls]
    medians = {round(float(np.median(c)), 9) for c in combinations_with_replacement(tps, 4)}
    assert {round(float(v), 9) for v in got["dist"]} <= medians
    assert "4 rounds (drawn once for all 2 tasks)" in got["interval"]["method"]
    assert got["interval"]["lo"] <= got["tokens_per_s"] <= got["interval"]["hi"]
    # Drawn per task, the same data gives means of two medians that no single multiset has.
    g = np.random.default_rng(0)
    own = [np.median(np.array(tps)[g.integers(0, 4, size=(200, 4))], axis=1) for _ in range(2)]
    assert not {round(float(v), 9) for v in np.mean(own, axis=0)} <= medians
