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

Figures (``figure``, ``ratio``, ``mean_ratio``): per round, a block's tokens/s is its tokens over its wall
seconds (for batches: generated tokens over the wall time from the first submission to the last
completion, MLPerf's offline rule). A figure is the **median over rounds**; a speedup is the median of the
ratio over each two adjacent rounds (both sides measured moments apart, once in each order, so a steady
drift of the machine cancels). The 95% interval is
a bootstrap over rounds *and* items together (``BOOT`` resamples, fixed seed): a resample draws rounds and
calls with replacement, so it holds the round-to-round spread (a neighbour, a clock change) as well as
the item-to-item one. Two runs' figures are compared with ``between_runs``: a Mann-Whitney U test of their
per-round values, called different only at p < ``RUNS_ALPHA`` *and* a ratio beyond ``RUNS_FACTOR`` (asv's
rule).

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

DEFAULT_ROUNDS = 9  # Google Benchmark's minimum for its U test; asv and pyperf also repeat
DEFAULT_ITEMS = "auto"  # timed items per task of a run: ``items_auto``
ROUNDS_SHARE = 0.5  # --timing-items auto: the rounds re-decode about this share of the decoding pass ...
MAX_AUTO_ITEMS = 32  # ... with at most this many items per task
MIN_BLOCK_S = 0.05  # a block shorter than this is repeated within its round (timer and scheduler-tick noise)
MAX_REPEAT = 64
BOOT = 2000
SEED = 1234
RUNS_ALPHA = 0.002  # asv: p < 0.002 ...
RUNS_FACTOR = 1.10  # ... and a change beyond 1.1x
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
    decode every time); the first call's output and ``extra`` (anything else it returned) are kept."""

    def __init__(self, name: str, calls: dict[str, list[Callable[[], tuple]]],
                 sync: Callable[[], None] | None = None) -> None:
        self.name, self.calls, self.sync = name, calls, sync
        self.outputs: dict[tuple[str, int], Any] = {}
        self.extra: dict[tuple[str, int], Any] = {}

    def block(self, group: str, repeat: int) -> list[dict]:
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
               desc: str = "timed rounds", flip: bool = False, same_repeat: bool = False) -> dict:
    """Warm-up, then ``rounds`` interleaved rounds (module doc). Returns {"records": [{round, group, side,
    repeat, calls}], "repeat": {group: {side: n}}, "order", "rounds", "guard"}. ``flip`` starts ABBA on the other
    side (a confirmation run). Each side repeats a short block until it lasts ``min_block_s`` on its own;
    ``same_repeat`` gives every side the fastest side's count instead (two versions of the same work, as in
    an A/B, whose blocks must stay alike: a repeated block runs on warmer caches)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    from tqdm import tqdm

    names = [s.name for s in sides]
    by = {s.name: s for s in sides}
    repeat: dict[str, dict[str, int]] = {}
    for g in groups:  # untimed warm-up: first calls, allocations, caches; sets each side's repeat count
        # per side, not per group: a fast side's short block must not make a slow side repeat too
        repeat[g] = {n: max(1, min(MAX_REPEAT, math.ceil(min_block_s / max(
            sum(c["wall_s"] for c in by[n].block(g, 1)), 1e-6)))) for n in names}
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


def matrix(records: Iterable[dict], side: str, group: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(wall [R, C], cpu [R, C], tokens [C]) of one side's blocks of one group: R rounds, C calls, seconds per
    one pass of the block (a repeated block's time divided by its repeat count); None when it has none."""
    recs = sorted((r for r in records if r["side"] == side and r["group"] == group), key=lambda r: r["round"])
    if not recs:
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


def _interval(dist: np.ndarray, calls: int = 2) -> dict | None:
    """The 95% percentile interval of a bootstrap distribution. With one timed call per group there is no
    item to resample: the interval holds the round-to-round spread only, and its method says so."""
    d = dist[np.isfinite(dist)]
    if d.size == 0:
        return None
    lo, hi = np.percentile(d, [2.5, 97.5])
    return {"lo": float(lo), "hi": float(hi),
            "method": "bootstrap over rounds and items" if calls > 1 else "bootstrap over rounds (one timed item)"}


def figure(records: list[dict], side: str, group: str, key: Any = None) -> dict | None:
    """One side's tokens/s on one group: median over rounds, its interval, the CPU-time tokens/s and the mean
    latency per call (median over rounds, with its interval), and the per-round values."""
    m = matrix(records, side, group)
    if m is None:
        return None
    wall, cpu, tokens = m
    per_round = _tps(wall, tokens)
    rho, kappa = _draws(*wall.shape, key=(key, side, group))
    dist = np.median(_tps(wall, tokens, rho, kappa), axis=1)
    lat = wall.mean(axis=1)  # mean seconds per call in each round
    w = wall[rho[:, :, None], kappa[:, None, :]]  # [B, R, C]
    lat_dist = np.median(w.mean(axis=2), axis=1)
    per_call = np.median(wall, axis=0)  # each call's median seconds over rounds [C]
    per_call_dist = np.median(w, axis=1)  # [B, C]
    cpu_tps = tokens.sum() / cpu.sum(axis=1) if np.all(np.isfinite(cpu)) and np.all(cpu.sum(axis=1) > 0) else None
    c = wall.shape[1]
    return {"tokens_per_s": float(np.median(per_round)), "interval": _interval(dist, c),
            "latency_s": float(np.median(lat)), "latency_interval": _interval(lat_dist, c),
            "latency_p50_s": float(np.percentile(per_call, 50)),
            "latency_p50_interval": _interval(np.percentile(per_call_dist, 50, axis=1), c),
            "latency_p90_s": float(np.percentile(per_call, 90)),
            "latency_p90_interval": _interval(np.percentile(per_call_dist, 90, axis=1), c),
            "cpu_tokens_per_s": None if cpu_tps is None else float(np.median(cpu_tps)),
            "mean_of_ratios": float(np.mean(tokens / per_call)) if np.all(per_call > 0) else None,
            "per_round": [float(x) for x in per_round], "rounds": int(wall.shape[0]), "calls": int(wall.shape[1]),
            "per_round_latency_p50_s": [float(x) for x in np.percentile(wall, 50, axis=1)],
            "per_round_latency_p90_s": [float(x) for x in np.percentile(wall, 90, axis=1)],
            "tokens": int(tokens.sum())}


def _pair(records: list[dict], side: str, ref: str, group: str):
    a, b = matrix(records, side, group), matrix(records, ref, group)
    if a is None or b is None or a[0].shape != b[0].shape:
        return None
    return a, b


def _adjacent(wall: np.ndarray) -> np.ndarray:
    """Seconds of each two adjacent rounds together ([R - 1, C]; [1, C] for one round). Under ABBA one of the
    two went forward and the other backward, so a steady drift of the machine's speed cancels in their sum:
    a ratio from one round alone carries it with alternating sign, and the median over an odd number of
    rounds would keep one sign."""
    return wall if wall.shape[0] < 2 else wall[:-1] + wall[1:]


def ratio(records: list[dict], side: str, ref: str, group: str, key: Any = None, clock_: str = "wall") -> dict | None:
    """``side``'s tokens/s over ``ref``'s on one group: the median over adjacent-round pairs of their ratio
    (``_adjacent``), its interval (pairs and items resampled together, the same draws for both sides), the
    bootstrap share of ratios >= 1, and the per-pair ratios. ``clock_`` = "cpu" uses CPU time instead."""
    got = _pair(records, side, ref, group)
    if got is None:
        return None
    (wa, ca, ta), (wb, cb, tb) = got
    if clock_ == "cpu":
        wa, wb = ca, cb
        if not (np.all(np.isfinite(wa)) and np.all(np.isfinite(wb))):
            return None
    wa, wb = _adjacent(wa), _adjacent(wb)
    per_round = _tps(wa, ta) / _tps(wb, tb)
    rho, kappa = _draws(*wa.shape, key=(key, side, ref, group))
    dist = np.median(_tps(wa, ta, rho, kappa) / _tps(wb, tb, rho, kappa), axis=1)
    return {"ratio": float(np.median(per_round)), "interval": _interval(dist, wa.shape[1]),
            "p_not_below_1": float(np.mean(dist >= 1.0)), "per_round": [float(x) for x in per_round]}


def mean_ratio(records: list[dict], side: str, ref: str, groups: Sequence[str], key: Any = None) -> dict | None:
    """The mean over groups of ``ratio`` (the paper's headline convention): per adjacent-round pair, the mean
    of the groups' ratios; the median over pairs and its interval (pairs resampled together across groups)."""
    pairs = [_pair(records, side, ref, g) for g in groups]
    if not pairs or any(p is None for p in pairs):
        return None
    n_rounds = min(p[0][0].shape[0] for p in pairs)
    pairs = [((_adjacent(a[0][:n_rounds]),) + a[1:], (_adjacent(b[0][:n_rounds]),) + b[1:]) for a, b in pairs]
    n_rounds = pairs[0][0][0].shape[0]
    per_round = np.mean([_tps(a[0][:n_rounds], a[2]) / _tps(b[0][:n_rounds], b[2]) for a, b in pairs], axis=0)
    g = _rng(key, side, ref, tuple(groups))
    rho = g.integers(0, n_rounds, size=(BOOT, n_rounds))
    dists = []
    for a, b in pairs:
        c = a[0].shape[1]
        kappa = g.integers(0, c, size=(BOOT, c))
        dists.append(_tps(a[0][:n_rounds], a[2], rho, kappa) / _tps(b[0][:n_rounds], b[2], rho, kappa))
    dist = np.median(np.mean(dists, axis=0), axis=1)
    return {"ratio": float(np.median(per_round)), "interval": _interval(dist, sum(a[0].shape[1] for a, _ in pairs)),
            "per_round": [float(x) for x in per_round]}


# ---------------------------------------------------------------- between runs


def between_runs(a: Sequence[float], b: Sequence[float], alpha: float = RUNS_ALPHA,
                 factor: float = RUNS_FACTOR) -> dict:
    """Two runs' per-round values of one figure: the ratio of medians b / a, the Mann-Whitney U p-value
    (two-sided) and whether it differs (p < alpha and the ratio beyond ``factor`` either way)."""
    from scipy.stats import mannwhitneyu

    a, b = [float(x) for x in a], [float(x) for x in b]
    r = float(np.median(b) / np.median(a)) if a and b and np.median(a) > 0 else None
    if len(a) < 2 or len(b) < 2 or r is None:
        return {"ratio": r, "p": None, "differs": False, "test": "not testable: fewer than 2 rounds"}
    p = float(mannwhitneyu(a, b, alternative="two-sided").pvalue)
    return {"ratio": r, "p": p, "differs": bool(p < alpha and (r > factor or r < 1 / factor)),
            "test": f"Mann-Whitney U over rounds ({len(a)} vs {len(b)}), p < {alpha} and beyond {factor}x",
            "rounds": [len(a), len(b)]}


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


def items_auto(docs: int, rounds: int = DEFAULT_ROUNDS, share: float = ROUNDS_SHARE, cap: int = MAX_AUTO_ITEMS) -> int:
    """Timed items per task for ``--timing-items auto``: k = floor(docs x share / rounds), between 1 and
    ``cap``, so that the rounds re-decode about ``share`` of what the decoding pass decoded (each timed item is
    decoded once per round). It depends on the run's shape only (the task's document count and the rounds),
    never on a measured time, so every run of one setting, on any machine, times the same items (a
    time-based choice would move with the machine's speed); and it costs every model the same fraction of its
    own pass, a slow row as much as a fast one."""
    if docs < 1 or rounds < 1:
        return 1
    return max(1, min(cap, int(docs * share // rounds)))


def parse_items(text: str | int) -> str | int:
    """``--timing-items``: auto, all or a positive count (ValueError otherwise)."""
    t = str(text).strip().lower()
    if t in ("auto", "all"):
        return t
    if t.isdigit() and int(t) >= 1:
        return int(t)
    raise ValueError(f"--timing-items must be auto, all or a count >= 1, got {text!r}")
