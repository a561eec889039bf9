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
    got = timing.run_rounds([Clocked("a", cost), Clocked("b", cost, factor=2.0)], ["g"], rounds=9, progress=False)
    assert len(got["records"]) == 18 and got["repeat"] == {"g": {"a": 1, "b": 1}}
    fa = timing.figure(got["records"], "a", "g")
    assert fa["tokens_per_s"] == pytest.approx(20 / 0.4) and fa["rounds"] == 9 and fa["calls"] == 2
    assert fa["interval"]["lo"] <= 50.0 <= fa["interval"]["hi"]
    assert fa["latency_s"] == pytest.approx(0.2) and fa["latency_p90_s"] == pytest.approx(0.28)
    r = timing.ratio(got["records"], "b", "a", "g")
    assert r["ratio"] == pytest.approx(0.5) and len(r["per_round"]) == 8  # adjacent-round pairs
    assert r["interval"]["lo"] == pytest.approx(0.5) and r["interval"]["hi"] == pytest.approx(0.5)
    m = timing.mean_ratio(got["records"], "b", "a", ["g"])
    assert m["ratio"] == pytest.approx(0.5)


def test_a_short_block_is_repeated_within_its_round():
    got = timing.run_rounds([Clocked("a", {"g": [0.001]}), Clocked("b", {"g": [0.002]})], ["g"], rounds=2,
                            min_block_s=0.05, progress=False)
    assert got["repeat"] == {"g": {"a": 50, "b": 25}}  # each side's block lasts MIN_BLOCK_S, no side longer
    ab = timing.run_rounds([Clocked("a", {"g": [0.001]}), Clocked("b", {"g": [0.002]})], ["g"], rounds=2,
                           min_block_s=0.05, progress=False, same_repeat=True)
    assert ab["repeat"] == {"g": {"a": 50, "b": 50}}  # an A/B's two versions: alike blocks
    fa = timing.figure(got["records"], "a", "g")
    assert fa["tokens_per_s"] == pytest.approx(10 / 0.001)  # seconds per pass: the block's time / its repeats


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


def test_between_runs_needs_significance_and_a_real_change():
    base = [100 * (1 + 0.02 * ((j * 5) % 9 - 4) / 4) for j in range(9)]
    same = timing.between_runs(base, base[::-1])
    assert not same["differs"] and same["ratio"] == pytest.approx(1.0)
    half = timing.between_runs(base, [x / 2 for x in base])
    assert half["differs"] and half["p"] < 0.002 and half["ratio"] == pytest.approx(0.5)
    small = timing.between_runs(base, [x * 1.05 for x in base])  # significant but within 1.1x: not called
    assert not small["differs"] and small["p"] < 0.002
    one = timing.between_runs([100.0], [50.0])
    assert not one["differs"] and one["p"] is None and "not testable" in one["test"]


def test_sample_docs_is_seeded_and_nested():
    docs = list(range(40))
    four = timing.sample_docs(docs, 4, 1234, "embedded_math")
    eight = timing.sample_docs(docs, 8, 1234, "embedded_math")
    assert len(four) == 4 and set(four) <= set(eight) and four == sorted(four)
    assert four == timing.sample_docs(docs, 4, 1234, "embedded_math") != timing.sample_docs(docs, 4, 1234, "other")
    assert timing.sample_docs(docs, None, 1, "x") == docs and timing.sample_docs(docs, 99, 1, "x") == docs
    # auto: the rounds re-decode about half the decoding pass (k x 9 rounds ~ docs / 2), 1 to 32 items per task
    assert [timing.items_auto(n) for n in (1, 20, 36, 60, 100, 400, 1319)] == [1, 1, 2, 3, 5, 22, 32]
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
    assert guard.Guard(proc=str(tmp_path / "none")).result()["available"] is False


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
    # b and c are a under other names: their speedup over a is about 1 (the same code on the same items)
    assert all(0.5 < rows[n]["speedup"] < 2 and rows[n]["speedup_ci"]["lo"] <= rows[n]["speedup"] for n in "bc")
    md = (run / "summary.md").read_text()
    assert "Speed: 3 timed rounds of 2 item(s) per task, the models in turn (abba, two at a time against a)" in md
