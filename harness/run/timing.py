"""The timing protocol: how every speed figure of the harness is measured (docs/design.md "Timing protocol").

One module for the runner (``harness eval``'s timed rounds, harness/run/rounds.py), ``make regress``'s
speed A/B (harness/speed/ab.py), the frontier (an eval run) and the benches (harness/speed/bench.py).

Quality, tokens, NFE and TPF come from a run's one decoding pass. Wall-clock figures (tokens/s, latency,
speedup) come from **timed rounds**:

- *Sides* are what is timed against each other: the models of a run, or two versions of the code. A side
  decodes a *group* (a task's sampled items, or one preset's items of one kind) as one *block*: its calls one
  after another, each call one item (batch 1) or one batch (``--batch-size`` > 1).
- An untimed warm-up block per (group, side) comes first; a side whose block is shorter than
  ``min_block_s`` then repeats it within each round until it lasts that long (its own count, so a fast
  model does not make a slow one repeat; ``same_repeat`` for two versions of the same work, as in an A/B).
- In each of ``rounds`` rounds every side decodes every group, interleaved: per (round, group) the sides go
  in turn, in ABBA order (forward in one round, backward in the next: a drift in the machine's speed falls
  on both sides alike) or in a seeded random order. Only one decodes at a time.
- Clock: wall time of the block (the device synchronised at its edges on a GPU), with the process's CPU
  time recorded beside it. A wait (a blocking read, a lock, a device sync) shows in wall time only.

Figures (``figure``, ``ratio``, ``mean_ratio``), each a point and a 95% interval of the same statistic (the
point is the statistic at the full sample, the interval its percentile bootstrap, ``BOOT`` resamples, fixed
seed), and each interval's ``method`` names and counts what was resampled:

- a side's tokens/s: per round, its tokens over its wall seconds (for batches: generated tokens over the wall
  time from the first submission to the last completion, MLPerf's offline rule); the point is the median over
  rounds; resampled: rounds and items together;
- a side's request latency: per round, the mean over its requests of the seconds from a call's start to its
  return (every row of a batch completes when the batch does); median over rounds, resampled likewise;
- a speedup (``ratio``): per **disjoint round pair** (rounds 1+2, 3+4, ...: one forward and one backward
  under ABBA, so a steady drift cancels, and no round counted twice), the ratio of the two sides'
  throughputs; the point is the median over pairs; resampled: round pairs and items together;
- the mean speedup over tasks (``mean_ratio``): the arithmetic mean of the per-task points (the paper's
  convention); resampled: round pairs (once for all tasks) and each task's items.

Two runs' speedups are compared against the between-run spread of idle runs of identical code on the machine
(``spread_factor``, ``spread_verdict``: a spread file of `make spread`), never against the rounds of one run,
which hold that run's machine state only.

What else used the machine meanwhile is read by the busy-machine guard (harness/run/guard.py).
"""

from __future__ import annotations

import math
import random
import sys
import time
import zlib
from typing import Any, Callable, Iterable, Protocol, Sequence

import numpy as np

from harness.run.guard import Guard

DEFAULT_ROUNDS = 10  # 5 disjoint round pairs: the protocol's default (benches, the A/B)
# `harness eval`'s rounds: a task's speedup is a geometric mean over its timed items (``ratio``), so items matter
# more than rounds; 4 rounds give each item 2 disjoint round pairs, and pay for >= 8 items per task.
EVAL_ROUNDS = 4
DEFAULT_ITEMS = "auto"  # timed items per task of a run: ``items_auto``
ROUNDS_SHARE = 0.5  # --timing-items auto: the rounds re-decode about this share of the decoding pass ...
MIN_AUTO_ITEMS = 8  # ... with at least this many items per task (all of a task with fewer) ...
MAX_AUTO_ITEMS = 32  # ... and at most this many
MIN_BLOCK_S = 0.05  # a block shorter than this is repeated within its round (timer and scheduler-tick noise)
MAX_REPEAT = 64
BOOT = 2000
SEED = 1234
# Between runs (``spread_factor``): a speedup differs when |log(b / a)| > t x s x sqrt(2), s the standard
# deviation of that figure's log speedup over a spread series of idle runs (at least MIN_SPREAD_RUNS), t Student's
# two-sided (1 - SPREAD_ALPHA) quantile with n - 1 degrees of freedom: the log ratio of two new runs of identical
# code has the spread of a difference of two runs, judged against a spread estimated from n of them.
SPREAD_ALPHA = 0.01
MIN_SPREAD_RUNS = 5
ORDERS = ("abba", "random")


class TimingMismatch(Exception):
    """A timed decode gave other tokens than the quality pass: the message names the side and the item."""


# ---------------------------------------------------------------- clock


def clock(fn: Callable[[], Any], sync: Callable[[], None] | None = None) -> tuple[Any, float, float]:
    """(fn's result, wall seconds, this process's CPU seconds) of one call; ``sync`` (a device
    synchronisation) runs before the start and before the stop, so queued device work is inside."""
    if sync is not None:
        sync()
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    if sync is not None:
        sync()
    return out, time.perf_counter() - t0, time.process_time() - c0


# ---------------------------------------------------------------- rounds


class Side(Protocol):
    """One thing timed against the others. ``block(group, repeat)`` decodes the group's calls ``repeat``
    times in a row and returns one dict per call: wall_s and cpu_s (summed over the repeats) and tokens
    (generated tokens of one pass). It raises TimingMismatch when tokens differ from the expected ones."""
    name: str

    def block(self, group: str, repeat: int) -> list[dict]: ...


class FnSide:
    """An in-process side: per group, zero-argument calls, each returning (output, generated tokens). The
    output of every call must equal its first call's (TimingMismatch otherwise: a timed decode is the same
    decode every time); the first call's output and ``extra`` (anything else it returned) are kept. ``settle``
    (an engine server's ``wait_quiet``) runs before and after each block, outside the clocks: a server that
    keeps a core busy after its last step must not be timed beside the next side's block."""

    def __init__(self, name: str, calls: dict[str, list[Callable[[], tuple]]],
                 sync: Callable[[], None] | None = None, settle: Callable[[], float] | None = None) -> None:
        self.name, self.calls, self.sync, self.settle = name, calls, sync, settle
        self.outputs: dict[tuple[str, int], Any] = {}
        self.extra: dict[tuple[str, int], Any] = {}
        self.settle_s: list[float] = []

    def block(self, group: str, repeat: int) -> list[dict]:
        if self.settle is not None:
            self.settle_s.append(self.settle())
        out = self._block(group, repeat)
        if self.settle is not None:
            self.settle_s.append(self.settle())
        return out

    def _block(self, group: str, repeat: int) -> list[dict]:
        out = []
        for i, fn in enumerate(self.calls[group]):
            wall = cpu = 0.0
            for _ in range(repeat):
                got, w, c = clock(fn, self.sync)
                wall, cpu = wall + w, cpu + c
                output, tokens = got[0], int(got[1])
                if (group, i) not in self.outputs:
                    self.outputs[(group, i)], self.extra[(group, i)] = output, got[2:]
                elif output != self.outputs[(group, i)]:
                    raise TimingMismatch(f"{self.name}: call {i} of {group} gave another output than its first")
            out.append({"wall_s": wall, "cpu_s": cpu, "tokens": tokens})
        return out


def side_order(names: Sequence[str], rnd: int, gi: int, order: str, seed: int) -> list[str]:
    """The sides' order in one (round, group): ABBA alternates forward and backward by round and group;
    random shuffles with a generator seeded by (seed, round, group)."""
    if order == "abba":
        return list(names) if (rnd + gi) % 2 == 0 else list(reversed(names))
    if order == "random":
        out = list(names)
        random.Random(f"{seed}/{rnd}/{gi}").shuffle(out)
        return out
    raise ValueError(f"unknown order {order!r}; valid: {', '.join(ORDERS)}")


def run_rounds(sides: Sequence[Side], groups: Sequence[str], *, rounds: int = DEFAULT_ROUNDS, order: str = "abba",
               seed: int = SEED, min_block_s: float = MIN_BLOCK_S, guard: Guard | None = None, progress: bool = True,
               desc: str = "timed rounds", flip: bool = False, same_repeat: bool = False,
               warmed: dict[str, dict[str, float]] | None = None) -> dict:
    """Warm-up, then ``rounds`` interleaved rounds (module doc). Returns {"records": [{round, group, side,
    repeat, calls}], "repeat": {group: {side: n}}, "order", "rounds", "guard"}. ``flip`` starts ABBA on the other
    side (a confirmation run). Each side repeats a short block until it lasts ``min_block_s`` on its own;
    ``same_repeat`` gives every side the fastest side's count instead (two versions of the same work, as in
    an A/B, whose blocks must stay alike: a repeated block runs on warmer caches). ``warmed``: {group: {side:
    wall seconds}} of blocks every side has already decoded untimed, exactly as a round would (the A/B's
    sizing decode): their warm-up is that decode, not one more."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    from tqdm import tqdm

    names = [s.name for s in sides]
    by = {s.name: s for s in sides}
    repeat: dict[str, dict[str, int]] = {}
    for g in groups:  # untimed warm-up: first calls, allocations, caches; sets each side's repeat count
        # per side, not per group: a fast side's short block must not make a slow side repeat too
        done = (warmed or {}).get(g) or {}
        repeat[g] = {n: max(1, min(MAX_REPEAT, math.ceil(min_block_s / max(
            done[n] if n in done else sum(c.get("wall_s", 0.0) for c in by[n].block(g, 1)), 1e-6))))
            for n in names}
        if same_repeat:
            repeat[g] = dict.fromkeys(names, max(repeat[g].values()))
    records = []
    if guard is not None:
        guard.mark("start")
    bar = tqdm(total=rounds * len(groups), desc=desc, disable=not progress, file=sys.stderr)
    try:
        for r in range(rounds):
            for gi, g in enumerate(groups):
                for n in side_order(names, r + int(flip), gi, order, seed):
                    records.append({"round": r, "group": g, "side": n, "repeat": repeat[g][n],
                                    "calls": by[n].block(g, repeat[g][n])})
                bar.update(1)
            if guard is not None:
                guard.mark(f"round {r}")
    finally:
        bar.close()
    return {"records": records, "repeat": repeat, "order": order, "rounds": rounds,
            "guard": guard.result() if guard is not None else None}


# ---------------------------------------------------------------- figures


def drop_failed(records: list[dict]) -> tuple[list[dict], dict[str, list[int]]]:
    """The records without the calls that failed in any of them (a side's call that met a fault twice is
    marked ``failed``; harness/run/rounds.py), so that every side of a group is timed on the same calls; and
    per group the indices of the calls left out."""
    out: dict[str, set[int]] = {}
    for r in records:
        for i, c in enumerate(r["calls"]):
            if "failed" in c:
                out.setdefault(r["group"], set()).add(i)
    if not out:
        return records, {}
    kept = [{**r, "calls": [c for i, c in enumerate(r["calls"]) if i not in out.get(r["group"], ())]}
            for r in records]
    return kept, {g: sorted(v) for g, v in out.items()}


def matrix(records: Iterable[dict], side: str, group: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(wall [R, C], cpu [R, C], tokens [C]) of one side's blocks of one group: R rounds, C calls, seconds per
    one pass of the block (a repeated block's time divided by its repeat count); None when it has none."""
    recs = sorted((r for r in records if r["side"] == side and r["group"] == group), key=lambda r: r["round"])
    if not recs or not recs[0]["calls"]:
        return None
    wall = np.array([[c["wall_s"] / r["repeat"] for c in r["calls"]] for r in recs], dtype=float)
    cpu = np.array([[c.get("cpu_s", math.nan) / r["repeat"] for c in r["calls"]] for r in recs], dtype=float)
    tokens = np.array([c["tokens"] for c in recs[0]["calls"]], dtype=float)
    return wall, cpu, tokens


def _rng(*key: Any) -> np.random.Generator:
    return np.random.default_rng([SEED, zlib.crc32(repr(key).encode())])


def _draws(n_rounds: int, n_calls: int, key: Any, boot: int = BOOT) -> tuple[np.ndarray, np.ndarray]:
    """Bootstrap indices: rounds [boot, R] and calls [boot, C], drawn with replacement."""
    g = _rng(key, n_rounds, n_calls)
    return g.integers(0, n_rounds, size=(boot, n_rounds)), g.integers(0, n_calls, size=(boot, n_calls))


def _tps(wall: np.ndarray, tokens: np.ndarray, rho: np.ndarray | None = None,
         kappa: np.ndarray | None = None) -> np.ndarray:
    """Per-round tokens/s ([R]), or per resample and round ([B, R]) under indices rho [B, R], kappa [B, C]."""
    if rho is None:
        return tokens.sum() / wall.sum(axis=1)
    w = wall[rho[:, :, None], kappa[:, None, :]]  # [B, R, C]
    return tokens[kappa].sum(axis=1)[:, None] / w.sum(axis=2)


def round_pairs(wall: np.ndarray) -> np.ndarray:
    """Seconds of disjoint round pairs, rounds 1+2, 3+4, ... together ([R // 2, C]). Under ABBA one round of a
    pair went forward and the other backward, so a steady drift of the machine's speed cancels in their sum,
    and no round is in two pairs: the pairs are independent units for a bootstrap or a rank test. The last
    round of an odd count is left out of the pairs; one round alone ([1, C]) stands for itself."""
    n = wall.shape[0]
    if n < 2:
        return wall
    p = n // 2
    return wall[0:2 * p:2] + wall[1:2 * p:2]


def pairs_text(rounds: int) -> str:
    """The unit of the ratios of ``rounds`` rounds, counted, e.g. ``5 round pairs`` or ``4 round pairs (round 9
    unpaired, left out)``."""
    if rounds < 2:
        return "1 round (unpaired)"
    p = rounds // 2
    return f"{p} round pair{'s' if p != 1 else ''}" + (f" (round {rounds} unpaired, left out)" if rounds % 2 else "")


def _units_text(n: int, unit: str) -> str:
    return f"{n} {unit}{'s' if n != 1 else ''}"


def method(units: str, items: int, rows: int | None = None) -> str:
    """An interval's method with its units and their counts, e.g. ``bootstrap over 5 round pairs and 3 items,
    resampled together (2000 resamples)``; with one item nothing but the ``units`` is resampled, and it says so.
    ``rows`` (more than ``items``): the calls are batches, and a batch is what is resampled."""
    if rows is not None and rows > items:
        what = f"{items} batch{'es' if items != 1 else ''} ({rows} items)"
        return (f"bootstrap over {units} and {what}, resampled together ({BOOT} resamples)" if items > 1 else
                f"bootstrap over {units}; 1 batch ({rows} items), not resampled ({BOOT} resamples)")
    if items > 1:
        return f"bootstrap over {units} and {items} items, resampled together ({BOOT} resamples)"
    return f"bootstrap over {units}; 1 item, not resampled ({BOOT} resamples)"


def _interval(dist: np.ndarray, units: str, items: int, rows: int | None = None) -> dict | None:
    """The 95% percentile interval of a bootstrap distribution, with its ``method`` (``method``): ``items`` calls
    resampled, of ``rows`` items in all."""
    d = dist[np.isfinite(dist)]
    if d.size == 0:
        return None
    lo, hi = np.percentile(d, [2.5, 97.5])
    return {"lo": float(lo), "hi": float(hi), "method": method(units, items, rows), "items": int(rows or items)}


def _latency(wall: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Mean request latency (seconds) per round ([R]) or per resample and round ([B, R]) of calls of ``rows``
    rows each: every row of a call completes when the call returns (a batch releases its rows together)."""
    return (wall * rows).sum(axis=-1) / rows.sum(axis=-1)


def figure(records: list[dict], side: str, group: str, key: Any = None) -> dict | None:
    """One side's tokens/s on one group: the median over rounds of each round's tokens over its seconds, with
    its interval (rounds and items resampled together; the rounds of one side are disjoint samples), the
    CPU-time tokens/s, the mean request latency (median over rounds, with its interval), and the per-round
    values."""
    m = matrix(records, side, group)
    if m is None:
        return None
    wall, cpu, tokens = m
    rows = rows_of(records, side, group)
    per_round = _tps(wall, tokens)
    rho, kappa = _draws(*wall.shape, key=(key, side, group))
    dist = np.median(_tps(wall, tokens, rho, kappa), axis=1)
    lat = _latency(wall, rows)
    w = wall[rho[:, :, None], kappa[:, None, :]]  # [B, R, C]
    lat_dist = np.median(_latency(w, rows[kappa][:, None, :]), axis=1)
    per_call = np.median(wall, axis=0)  # each call's median seconds over rounds [C]
    cpu_tps = tokens.sum() / cpu.sum(axis=1) if np.all(np.isfinite(cpu)) and np.all(cpu.sum(axis=1) > 0) else None
    r, c = wall.shape
    units = _units_text(r, "round")
    n_rows = int(rows.sum())
    return {"tokens_per_s": float(np.median(per_round)), "interval": _interval(dist, units, c, n_rows),
            "latency_s": float(np.median(lat)), "latency_interval": _interval(lat_dist, units, c, n_rows),
            "cpu_tokens_per_s": None if cpu_tps is None else float(np.median(cpu_tps)),
            "mean_of_ratios": float(np.mean(tokens / per_call)) if np.all(per_call > 0) else None,
            "per_round": [float(x) for x in per_round], "per_round_latency_s": [float(x) for x in lat],
            "rounds": int(r), "calls": int(c), "rows": int(rows.sum()), "tokens": int(tokens.sum())}


def rows_of(records: Iterable[dict], side: str, group: str) -> np.ndarray:
    """Rows per call ([C]) of one side's blocks of one group (1 each where the records do not say)."""
    rec = next((r for r in records if r["side"] == side and r["group"] == group), None)
    return np.array([int(c.get("rows", 1)) for c in (rec or {}).get("calls", [])], dtype=float)


def _pair(records: list[dict], side: str, ref: str, group: str):
    a, b = matrix(records, side, group), matrix(records, ref, group)
    if a is None or b is None or a[0].shape != b[0].shape:
        return None
    return a, b


RATIO_STATISTIC = ("geometric mean over the timed items of each item's speedup (the median over disjoint round "
                   "pairs of its tokens/s over the reference's)")


def _geomean(x: np.ndarray, axis: int = -1) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.exp(np.mean(np.log(x), axis=axis))


def item_ratios(wa: np.ndarray, ta: np.ndarray, wb: np.ndarray, tb: np.ndarray) -> np.ndarray:
    """Per round pair and call, one side's tokens/s over the other's ([P, C]) from round-pair seconds [P, C]
    and tokens per call [C]. A call is an item at batch 1, a batch above it (its rows share one time)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return (ta / wa) / (tb / wb)


def task_speedup(q: np.ndarray) -> float:
    """The task's speedup from per-(round pair, call) ratios [P, C]: each call's median over its pairs, then the
    geometric mean over calls (``RATIO_STATISTIC``)."""
    return float(_geomean(np.median(q, axis=0)))


def nested_dist(q: np.ndarray, key: Any, boot: int = BOOT) -> np.ndarray:
    """Two-level bootstrap of ``task_speedup`` ([boot]): the calls (items, or batches) drawn with replacement,
    then for each drawn call its own round pairs drawn with replacement; each call's median over its drawn
    pairs, the geometric mean over the drawn calls."""
    p, c = q.shape
    g = _rng("nested", key, p, c)
    kappa = g.integers(0, c, size=(boot, c))  # [B, C] calls
    rho = g.integers(0, p, size=(boot, c, p))  # [B, C, P] pairs within each drawn call
    per_call = np.median(q[rho, kappa[:, :, None]], axis=2)  # [B, C]
    return _geomean(per_call, axis=1)


def nested_method(pairs: int, rounds: int, calls: int, rows: int) -> str:
    """The label of ``nested_dist``'s interval: both units and their counts."""
    what = (f"{calls} item{'s' if calls != 1 else ''}" if rows <= calls else
            f"{calls} batch{'es' if calls != 1 else ''} ({rows} items)")
    if calls == 1:  # nothing to draw at the first level
        return f"bootstrap over the {pairs_text(rounds)} of {what}, not resampled ({BOOT} resamples)"
    return f"two-level bootstrap: {what}, then within each its {pairs_text(rounds)} ({BOOT} resamples)"


def ratio(records: list[dict], side: str, ref: str, group: str, key: Any = None, clock_: str = "wall") -> dict | None:
    """``side``'s tokens/s over ``ref``'s on one group: the task's speedup. Estimator (``RATIO_STATISTIC``): per
    timed item (per batch above batch 1) and disjoint round pair (``round_pairs``), the ratio of the two sides'
    tokens/s on it; each item's speedup is the median over its pairs; the task's is the geometric mean over
    items, so every item weighs the same whatever its length. Interval: the same statistic on a two-level
    bootstrap (``nested_dist``: items, then round pairs within each item). Also the bootstrap share of ratios
    >= 1, each item's speedup (``per_item``) and each pair's geometric mean over items (``per_pair``: one value
    per pair, for comparing runs). ``clock_`` = "cpu" uses CPU time instead."""
    got = _pair(records, side, ref, group)
    if got is None:
        return None
    (wa, ca, ta), (wb, cb, tb) = got
    rounds = wa.shape[0]
    if clock_ == "cpu":
        wa, wb = ca, cb
        if not (np.all(np.isfinite(wa)) and np.all(np.isfinite(wb))):
            return None
    q = item_ratios(round_pairs(wa), ta, round_pairs(wb), tb)  # [P, C]
    if not np.all(np.isfinite(q) & (q > 0)):
        return None
    dist = nested_dist(q, key=(key, side, ref, group))
    n_rows = int(rows_of(records, side, group).sum())
    iv = _interval(dist, pairs_text(rounds), q.shape[1], n_rows)
    if iv is not None:
        iv["method"] = nested_method(q.shape[0], rounds, q.shape[1], n_rows)
    return {"ratio": task_speedup(q), "interval": iv,
            "p_not_below_1": float(np.mean(dist >= 1.0)), "per_pair": [float(x) for x in _geomean(q, axis=1)],
            "per_item": [float(x) for x in np.median(q, axis=0)],
            "pairs": int(q.shape[0]), "rounds": int(rounds), "items": n_rows, "calls": int(q.shape[1]),
            "statistic": RATIO_STATISTIC}


def mean_ratio(records: list[dict], side: str, ref: str, groups: Sequence[str], key: Any = None) -> dict | None:
    """The arithmetic mean over groups of ``ratio`` (the paper's headline convention: the mean of the per-task
    speedups). The point is the mean of the groups' points; the interval the same statistic on bootstrap
    resamples: round pairs drawn once for every group (a pair holds every group's blocks, so they move
    together), each group's items drawn on their own."""
    mats = [_pair(records, side, ref, g) for g in groups]
    if not mats or any(p is None for p in mats):
        return None
    rounds = min(a[0].shape[0] for a, _ in mats)
    qs = [item_ratios(round_pairs(a[0][:rounds]), a[2], round_pairs(b[0][:rounds]), b[2]) for a, b in mats]
    if not all(np.all(np.isfinite(q) & (q > 0)) for q in qs):
        return None
    points = [task_speedup(q) for q in qs]
    dists = [nested_dist(q, key=(key, side, ref, g)) for q, g in zip(qs, groups)]  # each task's own draws
    items = sum(q.shape[1] for q in qs)
    rows = int(sum(rows_of(records, side, g).sum() for g in groups))
    iv = _interval(np.mean(dists, axis=0), pairs_text(rounds), items, rows)
    if iv is not None:
        call = "item" if rows <= items else "batch"
        iv["method"] = (
            f"bootstrap over the {pairs_text(rounds)} of each task's 1 {call}, not resampled; {len(qs)} tasks "
            f"drawn on their own, their mean per resample ({BOOT} resamples)" if items == len(qs) else
            f"two-level bootstrap within each of {len(qs)} tasks, drawn on their own: {items} {call}"
            f"{'s' if call == 'item' else 'es'}{'' if call == 'item' else f' ({rows} items)'} in all, then within "
            f"each its {pairs_text(rounds)}; the tasks' mean per resample ({BOOT} resamples)")
    return {"ratio": float(np.mean(points)), "interval": iv, "per_group": dict(zip(groups, points)),
            "statistic": f"arithmetic mean over tasks of each task's speedup ({RATIO_STATISTIC})"}


def mean_figure(records: list[dict], side: str, groups: Sequence[str], key: Any = None,
                with_dist: bool = False) -> dict | None:
    """The arithmetic mean over groups of one side's tokens/s (``figure``: the median over rounds), with the
    interval of the same statistic on resamples that draw the rounds once for every group (a round holds every
    group's blocks, so they move together) and each group's calls on their own: Table 1's Avg tokens/s of a row
    timed in one run. None when a group has no blocks of ``side``."""
    mats = [matrix(records, side, g) for g in groups]
    if not mats or any(m is None for m in mats):
        return None
    rounds = min(m[0].shape[0] for m in mats)
    walls = [m[0][:rounds] for m in mats]
    points = [float(np.median(_tps(w, m[2]))) for w, m in zip(walls, mats)]
    g = _rng("mean_figure", key, side, tuple(groups))
    rho = g.integers(0, rounds, size=(BOOT, rounds))
    dists = []
    for w, m in zip(walls, mats):
        kappa = g.integers(0, w.shape[1], size=(BOOT, w.shape[1]))
        dists.append(np.median(_tps(w, m[2], rho, kappa), axis=1))
    items = sum(w.shape[1] for w in walls)
    rows = int(sum(rows_of(records, side, grp).sum() for grp in groups))
    units = f"{_units_text(rounds, 'round')} (drawn once for all {len(mats)} tasks)"
    iv = _interval(np.mean(dists, axis=0), units, items, rows)
    if iv is not None:
        iv["method"] = iv["method"].replace(", resampled together", ", each task's own, resampled together")
    out = {"tokens_per_s": float(np.mean(points)), "interval": iv, "per_group": dict(zip(groups, points)),
           "statistic": "arithmetic mean over tasks of each task's tokens/s (median over rounds)"}
    if with_dist:  # the bootstrap values themselves (tests)
        out["dist"] = np.mean(dists, axis=0)
    return out


# ---------------------------------------------------------------- between runs


def spread_factor(values: Sequence[float], alpha: float = SPREAD_ALPHA) -> dict | None:
    """The between-run threshold of one figure from its speedups over a spread series of idle runs (module
    comment above ``SPREAD_ALPHA``): {"factor", "runs", "sd_log", "t", "alpha"}; None with fewer than
    ``MIN_SPREAD_RUNS`` runs or a value <= 0."""
    from scipy.stats import t as student

    v = np.asarray([float(x) for x in values], dtype=float)
    if v.size < MIN_SPREAD_RUNS or np.any(~np.isfinite(v)) or np.any(v <= 0):
        return None
    s = float(np.std(np.log(v), ddof=1))
    q = float(student.ppf(1 - alpha / 2, v.size - 1))
    return {"factor": float(np.exp(q * s * math.sqrt(2))), "runs": int(v.size), "sd_log": s, "t": q, "alpha": alpha}


def spread_rule(alpha: float = SPREAD_ALPHA, min_runs: int = MIN_SPREAD_RUNS) -> str:
    """The rule ``spread_verdict`` applies, in words, from the constants it uses: what `make compare` prints, so
    the printed rule is the one applied (tests/test_report.py parses it back)."""
    return (f"a speedup differs between two runs when |log(b / a)| > t x s x sqrt(2): s the standard deviation of "
            f"that (model, task)'s log speedup over the idle runs of a spread file (`make spread`, at least "
            f"{min_runs} runs), t Student's two-sided {1 - alpha:g} quantile with runs - 1 degrees of freedom; so "
            f"identical code is called different in about {alpha:g} of the figures judged")


def spread_verdict(a: float, b: float, spread: dict) -> dict:
    """Two runs' speedups of one figure against its between-run threshold (``spread_factor``)."""
    r = float(b) / float(a)
    return {"ratio": r, "p": None, "differs": bool(abs(math.log(r)) > math.log(spread["factor"])),
            "factor": spread["factor"], "spread_runs": spread["runs"],
            "test": f"beyond the between-run spread: x{spread['factor']:.2f} either way ({spread['runs']} idle runs)"}


def sample_docs(docs: Sequence[Any], k: int | None, seed: int, unit: str) -> list[Any]:
    """The timed items of one task: the first ``k`` documents of a shuffle seeded with (seed, task name) of
    the documents every model decoded, back in their order (None or k >= n: all). Samples are nested: the
    items of a smaller k are among those of a larger one."""
    docs = list(docs)
    if k is None or k >= len(docs):
        return docs
    order = list(range(len(docs)))
    random.Random(f"{seed}/{unit}").shuffle(order)
    picked = set(order[:max(1, k)])
    return [d for i, d in enumerate(docs) if i in picked]


def items_auto(docs: int, rounds: int = EVAL_ROUNDS, share: float = ROUNDS_SHARE, cap: int = MAX_AUTO_ITEMS,
               floor: int = MIN_AUTO_ITEMS) -> int:
    """Timed items per task for ``--timing-items auto``: k = floor(docs x share / rounds), at least ``floor``
    (every document of a task with fewer) and at most ``cap``, so that a task's speedup describes several of its
    items, and a large run's rounds re-decode about ``share`` of what the decoding pass decoded (each timed item
    is decoded once per round). It depends on the run's shape only (the task's document count and the rounds),
    never on a measured time, so every run of one setting, on any machine, times the same items (a
    time-based choice would move with the machine's speed); and it costs every model the same fraction of its
    own pass, a slow row as much as a fast one."""
    if docs < 1 or rounds < 1:
        return 1
    return min(docs, max(floor, min(cap, int(docs * share // rounds))))


def parse_items(text: str | int) -> str | int:
    """``--timing-items``: auto, all or a positive count (ValueError otherwise)."""
    t = str(text).strip().lower()
    if t in ("auto", "all"):
        return t
    if t.isdigit() and int(t) >= 1:
        return int(t)
    raise ValueError(f"--timing-items must be auto, all or a count >= 1, got {text!r}")
