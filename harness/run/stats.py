"""Intervals and paired tests over the items of a run (docs/design.md "Intervals and paired tests").

Every figure a run reports is a statistic of its items, and carries a 95% interval:

- quality: a proportion (every item scored 0 or 1: accuracy, exact match, pass@1) gets the **Wilson** score
  interval; any other per-item score the **bootstrap** percentile interval of the item mean. A unit of several
  leaf tasks (MMLU-Pro's 14 subjects) pools its items.
- tokens/s (ratio of sums), TPF (ratio of sums), NFE per item and latency (mean, p50, p90): the bootstrap
  percentile interval over items, ``BOOT`` resamples of the items with replacement.

Two rows measured on the same items are compared item by item:

- quality: **McNemar**'s exact test on the discordant pairs (binary scores), else a paired bootstrap of the
  mean difference;
- a speed ratio (tokens/s, TPF, NFE, latency of one row over the other): a **paired bootstrap** (both rows
  resampled with the same item indices); its interval, and a two-sided p-value ``2 min(P*(r <= 1), P*(r >= 1))``
  from the resampled ratios. A row "differs" when p < ``ALPHA`` (for the bootstrap: when 1 lies outside the
  interval).

Resamples are drawn from a generator seeded by ``SEED`` and the stream's name (the task and the item count),
so every figure is the same on every machine and at every call, and two rows on the same items draw the same
indices. Pure functions of the per-item values: ``Items`` holds them, read from a run's per-sample logs
(``read_items``).
"""

from __future__ import annotations

import functools
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
BOOT = 2000  # bootstrap resamples
SEED = 1234
ALPHA = 0.05
CHUNK = 250  # resamples drawn at a time (bounds memory: CHUNK x items indices)


# ---------------------------------------------------------------- single figures


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of k successes in n trials (ValueError unless 0 <= k <= n, n > 0)."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"wilson needs 0 <= k <= n and n > 0, got k={k}, n={n}")
    p = k / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, centre - half), min(1.0, centre + half)


def rng_for(*key: Any) -> np.random.Generator:
    """The generator of one resampling stream: ``SEED`` and a CRC-32 of the key's text."""
    return np.random.default_rng([SEED, zlib.crc32(json.dumps(key, default=str).encode())])


def resamples(n: int, key: Any, boot: int = BOOT) -> Any:
    """The bootstrap's item indices, ``CHUNK`` resamples at a time ([<= CHUNK, n] arrays), ``boot`` in all."""
    rng = rng_for(key, n)
    done = 0
    while done < boot:
        size = min(CHUNK, boot - done)
        yield rng.integers(0, n, size=(size, n))
        done += size


def boot_dist(columns: dict[str, np.ndarray], stat: Callable[[dict[str, np.ndarray]], np.ndarray], key: Any,
              boot: int = BOOT, groups: np.ndarray | None = None) -> np.ndarray:
    """``boot`` values of ``stat`` over resamples of the items: ``columns`` are per-item arrays of one length,
    ``stat`` maps the resampled columns ([r, n] each) to [r] values.

    ``groups`` (one label per item): resample whole groups instead (a cluster bootstrap), every item of a drawn
    group taken each time it is drawn: the rows of one batch share its call's time, so they are one draw, not
    several. Without groups, or when every group is one item, the items are resampled as before (the same
    values, bit for bit)."""
    n = len(next(iter(columns.values())))
    units = unit_members(groups)
    if units is None:
        out = [stat({k: v[idx] for k, v in columns.items()}) for idx in resamples(n, key, boot)]
        return np.concatenate(out) if out else np.zeros(0)
    out = []
    for idx in resamples(len(units), (key, "groups"), boot):
        for row in idx:  # one resample: the drawn groups' items, a group as often as it was drawn
            take = np.concatenate([units[g] for g in row])
            out.append(stat({k: v[take][None, :] for k, v in columns.items()}))
    return np.concatenate(out) if out else np.zeros(0)


def unit_members(groups: np.ndarray | None) -> list[np.ndarray] | None:
    """The item indices of each group, in first-seen order; None when there are no groups of two or more items
    (every item its own unit: the plain bootstrap)."""
    if groups is None or len(groups) == 0:
        return None
    order: dict[Any, list[int]] = {}
    for i, g in enumerate(groups.tolist()):
        order.setdefault(g, []).append(i)
    if len(order) == len(groups):
        return None
    return [np.array(v, dtype=int) for v in order.values()]


def unit_text(n: int, groups: np.ndarray | None, what: str = "items") -> str:
    """What a bootstrap resampled, for an interval's label: "N items", or "G batches (N items)"."""
    units = unit_members(groups)
    if units is None:
        return f"{n} {what if n != 1 else what.rstrip('s')}"
    return f"{len(units)} batch{'es' if len(units) != 1 else ''} ({n} {what}; a batch's rows are one draw)"


def percentile_interval(dist: np.ndarray) -> tuple[float, float] | None:
    """The central 95% of a bootstrap distribution (non-finite values dropped); None when empty."""
    d = np.asarray(dist, dtype=float)
    d = d[np.isfinite(d)]
    if d.size == 0:
        return None
    lo, hi = np.percentile(d, [2.5, 97.5])
    return float(lo), float(hi)


def boot_p(dist: np.ndarray, null: float) -> float | None:
    """Two-sided bootstrap p-value of ``null``: 2 min(share of resamples <= null, share >= null), at most 1."""
    d = np.asarray(dist, dtype=float)
    d = d[np.isfinite(d)]
    if d.size == 0:
        return None
    return float(min(1.0, 2 * min(np.mean(d <= null), np.mean(d >= null))))


@dataclass(frozen=True)
class Interval:
    """A 95% interval of one figure: ``lo``, ``hi`` and how it was computed (``wilson`` or ``bootstrap``)."""
    lo: float
    hi: float
    method: str

    def to_dict(self) -> dict:
        return {"lo": self.lo, "hi": self.hi, "method": self.method}

    @staticmethod
    def of(d: dict | None) -> "Interval | None":
        return None if not d else Interval(float(d["lo"]), float(d["hi"]), str(d.get("method", "")))

    def scaled(self, f: float) -> "Interval":
        return Interval(self.lo * f, self.hi * f, self.method)


# ---------------------------------------------------------------- items


@dataclass
class Items:
    """Per-item values of one (model, unit), in ``keys`` order ((leaf, doc_id), sorted): ``score`` the primary
    metric (NaN when the logs do not carry it); ``tokens``, ``seconds``, ``nfe`` the decode (NaN for an item
    that was not decoded: a failed one, or a log-likelihood request); ``seconds`` is the item's share of its
    call's time (sums give the decode time: throughput), ``latency`` its request latency (the whole call's
    time: a batch releases its rows together; harness/run/metrics.py ``latency_of``)."""
    keys: list[tuple[str, Any]]
    score: np.ndarray
    tokens: np.ndarray
    seconds: np.ndarray
    nfe: np.ndarray
    latency: np.ndarray | None = None  # None: the seconds (one row per call)
    # The call each item was decoded in (``batch_of``): items of one batch share its time, so single-pass speed
    # statistics resample batches (``boot_dist``'s groups). None: every item its own call (batch 1).
    batch: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.latency is None:
            self.latency = self.seconds

    def __len__(self) -> int:
        return len(self.keys)

    def take(self, keys: list[tuple[str, Any]]) -> "Items":
        """These items only, in the order of ``keys`` (each must be one of ours)."""
        pos = {k: i for i, k in enumerate(self.keys)}
        idx = np.array([pos[k] for k in keys], dtype=int)
        return Items(list(keys), self.score[idx], self.tokens[idx], self.seconds[idx], self.nfe[idx],
                     self.latency[idx], None if self.batch is None else self.batch[idx])

    @property
    def has_scores(self) -> bool:
        return len(self) > 0 and bool(np.all(np.isfinite(self.score)))

    @property
    def decoded(self) -> np.ndarray:
        return np.isfinite(self.tokens) & np.isfinite(self.seconds) & np.isfinite(self.nfe)

    @property
    def binary(self) -> bool:
        return self.has_scores and bool(np.all((self.score == 0) | (self.score == 1)))


def _split_primary(primary: str | None) -> tuple[str | None, str]:
    metric, _, flt = (primary or "").partition(",")
    return (metric or None), (flt or "none")


def items_from_rows(rows: list[dict], primary: str | None, rename: Callable[[str], str] | None = None) -> Items:
    """The items of one (model, unit) from its sample-log rows (one row per lm-eval filter of a document):
    the primary metric's value from the row of its filter, the decode figures from any row of the document.
    ``rename`` maps a leaf's name in the keys (a paper prompt variant to its benchmark, for pairing)."""
    from harness.run.metrics import latency_of

    metric, flt = _split_primary(primary)
    vals: dict[tuple[str, Any], list[float]] = {}
    calls: dict[tuple[str, Any], Any] = {}
    for r in rows:
        key = (rename(r["task"]) if rename else r["task"], r["doc_id"])
        v = vals.setdefault(key, [math.nan] * 5)
        got = (r.get("metrics") or {}).get(metric) if metric else None
        if (r.get("filter") or "none") == flt and isinstance(got, (int, float)):  # bool counts as 0 / 1
            v[0] = float(got)
        if r.get("generated_tokens") is not None and not r.get("failed") and r.get("decode_s") is not None:
            v[1], v[2], v[3] = float(r["generated_tokens"]), float(r["decode_s"]), float(r.get("nfe") or math.nan)
            v[4] = latency_of(r)
            calls[key] = batch_of(r, key)
    keys = sorted(vals, key=lambda k: (k[0], str(k[1])))
    cols = np.array([vals[k] for k in keys], dtype=float).reshape(len(keys), 5)
    codes: dict[Any, int] = {}
    batch = np.array([codes.setdefault(calls.get(k, ("item", k)), len(codes)) for k in keys], dtype=int)
    return Items(keys, cols[:, 0], cols[:, 1], cols[:, 2], cols[:, 3], cols[:, 4],
                 batch if unit_members(batch) is not None else None)


def batch_of(record: dict, key: tuple[str, Any]) -> Any:
    """The call a decoded sample-log row came from: its ``batch_id`` (harness/run/lm_decode.py: the key of the
    call's first row), or, in logs written before that field, the call's rank and wall time (the rows of one
    call share ``batch_wall_s``, and in older logs ``latency_s``, to the bit); the row's own key at batch 1, or
    when a log gives no way to tell its calls apart."""
    if int(record.get("batch_size") or 1) <= 1:
        return ("item", key)
    if record.get("batch_id") is not None:
        return ("batch", str(record["batch_id"]))
    wall = record.get("batch_wall_s", record.get("latency_s"))
    if wall is None:
        return ("item", key)
    return ("batch", record.get("rank"), float(wall), int(record["batch_size"]))


def samples_path(run_dir: Path, model: str, unit: str) -> Path:
    return Path(run_dir) / "models" / model / "samples" / f"{unit}.jsonl"


def read_items(run_dir: str | Path, model: str, unit: str, primary: str | None,
               rename: Callable[[str], str] | None = None) -> Items | None:
    """The items of (``model``, ``unit``) from a run folder's per-sample log; None when the run kept none."""
    path = samples_path(Path(run_dir), model, unit)
    if not path.is_file():
        return None
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    rows = [r for r in rows if isinstance(r, dict) and "task" in r and "doc_id" in r]
    return items_from_rows(rows, primary, rename) if rows else None


def cached_items(run_dir: str | Path, model: str, unit: str, primary: str | None,
                 rename: Callable[[str], str] | None = None) -> Items | None:
    """``read_items``, read once per process for a log that has not changed since (its size and mtime key
    the cache): a report reads each cell's items for its intervals, averages and paired tests."""
    path = samples_path(Path(run_dir), model, unit)
    try:
        st = path.stat()
    except OSError:
        return None
    return _cached(str(path), st.st_size, st.st_mtime_ns, str(run_dir), model, unit, primary, rename)


@functools.lru_cache(maxsize=512)
def _cached(_path: str, _size: int, _mtime: int, run_dir: str, model: str, unit: str, primary: str | None,
            rename: Callable[[str], str] | None) -> Items | None:
    return read_items(run_dir, model, unit, primary, rename)


# ---------------------------------------------------------------- the figures of one row


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    s = den.sum(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(s > 0, num.sum(axis=-1) / np.where(s > 0, s, 1), np.nan)


SPEED: dict[str, Callable[[dict[str, np.ndarray]], np.ndarray]] = {
    "tokens_per_s": lambda c: _ratio(c["tokens"], c["seconds"]),
    "tpf": lambda c: _ratio(c["tokens"], c["nfe"]),
    "nfe_mean": lambda c: c["nfe"].mean(axis=-1),
    "latency_mean_s": lambda c: c["latency"].mean(axis=-1),
    "latency_p50_s": lambda c: np.percentile(c["latency"], 50, axis=-1),
    "latency_p90_s": lambda c: np.percentile(c["latency"], 90, axis=-1),
}


def speed_columns(it: Items) -> dict[str, np.ndarray]:
    ok = it.decoded
    return {"tokens": it.tokens[ok], "seconds": it.seconds[ok], "nfe": it.nfe[ok], "latency": it.latency[ok]}


def speed_groups(it: Items) -> np.ndarray | None:
    """The batch of each decoded item (``speed_columns``'s order), or None at batch 1."""
    return None if it.batch is None else it.batch[it.decoded]


def quality_interval(it: Items | None = None, value: float | None = None, n: int | None = None,
                     stream: Any = "quality") -> Interval | None:
    """The 95% interval of a quality figure (a share in [0, 1]): from the items (Wilson for binary scores, else
    the bootstrap of the mean), else from the figure and its item count when those make a whole number of
    successes (Wilson); None when neither is possible."""
    if it is not None and it.has_scores:
        if it.binary:
            return Interval(*wilson(int(it.score.sum()), len(it)), "wilson")
        got = percentile_interval(boot_dist({"s": it.score}, lambda c: c["s"].mean(axis=-1), stream))
        return Interval(*got, "bootstrap") if got else None
    if value is not None and n:
        k = value * n
        if abs(k - round(k)) < 1e-6 * max(1.0, n):
            return Interval(*wilson(int(round(k)), n), "wilson")
    return None


def row_intervals(it: Items | None, stream: Any, value: float | None = None, n: int | None = None) -> dict:
    """Every interval of one (model, unit): ``quality`` (a share) and each speed figure of ``SPEED`` (None
    where the items cannot give it), as dicts (``Interval.to_dict``), plus ``items``: how many were used."""
    out: dict[str, Any] = {"quality": quality_interval(it, value, n, (stream, "quality"))}
    cols = speed_columns(it) if it is not None else None
    groups = speed_groups(it) if it is not None else None
    for name, stat in SPEED.items():
        got = None
        if cols is not None and len(cols["tokens"]) and not (name in ("tpf", "nfe_mean") and
                                                             not np.all(np.isfinite(cols["nfe"]))):
            got = percentile_interval(boot_dist(cols, stat, (stream, "speed"), groups=groups))
        n = len(cols["tokens"]) if cols is not None else 0
        out[name] = Interval(*got, f"bootstrap over {unit_text(n, groups)} ({BOOT} resamples)") if got else None
    out = {k: (v.to_dict() if v is not None else None) for k, v in out.items()}
    out["items"] = {"scored": int(np.isfinite(it.score).sum()) if it is not None else None,
                    "decoded": int(it.decoded.sum()) if it is not None else None}
    return out


# ---------------------------------------------------------------- paired tests


def mcnemar(a: Sequence[float], b: Sequence[float]) -> dict:
    """McNemar's exact test of two binary score vectors on the same items: ``a_only`` (right in a, wrong in b),
    ``b_only``, and the two-sided p-value, 2 x the binomial(n = a_only + b_only, 1/2) tail at min(a_only, b_only),
    at most 1 (1 when no pair is discordant)."""
    a_only = int(sum(1 for x, y in zip(a, b) if x == 1 and y == 0))
    b_only = int(sum(1 for x, y in zip(a, b) if x == 0 and y == 1))
    n = a_only + b_only
    tail = sum(math.comb(n, i) for i in range(min(a_only, b_only) + 1))
    return {"test": "mcnemar", "a_only": a_only, "b_only": b_only, "p": min(1.0, 2 * tail / 2 ** n) if n else 1.0}


def shared_keys(a: Items, b: Items) -> list[tuple[str, Any]]:
    """The items both rows have, in ``a``'s order."""
    theirs = set(b.keys)
    return [k for k in a.keys if k in theirs]


def paired_quality(a: Items, b: Items, stream: Any = "paired") -> dict | None:
    """b's quality against a's on their shared items: the difference (b - a, a share) with its interval, and the
    test: McNemar when both are binary, else a paired bootstrap of the mean difference. None without scores."""
    keys = shared_keys(a, b)
    if not keys:
        return None
    a, b = a.take(keys), b.take(keys)
    if not (a.has_scores and b.has_scores):
        return None
    diff = float(b.score.mean() - a.score.mean())
    dist = boot_dist({"a": a.score, "b": b.score}, lambda c: c["b"].mean(axis=-1) - c["a"].mean(axis=-1),
                     (stream, "quality"))
    ci = percentile_interval(dist)
    test = mcnemar(a.score, b.score) if a.binary and b.binary else {"test": "paired bootstrap",
                                                                   "p": boot_p(dist, 0.0)}
    return {"items": len(keys), "a": float(a.score.mean()), "b": float(b.score.mean()), "difference": diff,
            "interval": None if ci is None else {"lo": ci[0], "hi": ci[1], "method": "paired bootstrap"},
            **test, "differs": test["p"] is not None and test["p"] < ALPHA}


def paired_ratio_dist(a: Items, b: Items, figure: str, stream: Any) -> tuple[float | None, np.ndarray]:
    """(b's figure / a's, its paired bootstrap distribution) over the items both decoded; (None, []) if none.
    Items decoded in one batch on either side are resampled together (``paired_groups``)."""
    ok = a.decoded & b.decoded
    if not ok.any():
        return None, np.zeros(0)
    groups = paired_groups(a, b, ok)
    cols = {f"{side}_{k}": v[ok] for side, it in (("a", a), ("b", b)) for k, v in
            (("tokens", it.tokens), ("seconds", it.seconds), ("nfe", it.nfe))}
    stat = SPEED[figure]

    def ratio(c: dict[str, np.ndarray]) -> np.ndarray:
        one = stat({k[2:]: v for k, v in c.items() if k.startswith("a_")})
        two = stat({k[2:]: v for k, v in c.items() if k.startswith("b_")})
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(one > 0, two / np.where(one > 0, one, 1), np.nan)

    point = ratio({k: v[None, :] for k, v in cols.items()})[0]
    return (float(point) if np.isfinite(point) else None), boot_dist(cols, ratio, (stream, "speed"), groups=groups)


def paired_groups(a: Items, b: Items, ok: np.ndarray) -> np.ndarray | None:
    """The resampling units of two rows' shared items (same keys, same order; ``ok`` the items both decoded):
    items decoded in one call on either side are one unit, joined across both sides (connected components), so
    no resample splits a batch of either row. None when every item is its own call on both sides."""
    if a.batch is None and b.batch is None:
        return None
    n = int(ok.sum())
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for side in (a.batch, b.batch):
        if side is None:
            continue
        first: dict[int, int] = {}
        for i, g in enumerate(side[ok].tolist()):
            j = first.setdefault(g, i)
            parent[find(i)] = find(j)
    return np.array([find(i) for i in range(n)], dtype=int)


def paired_ratio(a: Items, b: Items, figure: str = "tokens_per_s", stream: Any = "paired") -> dict | None:
    """b's ``figure`` (a key of ``SPEED``) over a's on the items both decoded: the ratio at the full sample, its
    paired bootstrap interval (the same statistic on resampled items) and p-value against 1, and whether it
    differs (p < ALPHA). None when they share no decoded item."""
    keys = shared_keys(a, b)
    if not keys:
        return None
    a, b = a.take(keys), b.take(keys)
    point, dist = paired_ratio_dist(a, b, figure, stream)
    ci, p = percentile_interval(dist), boot_p(dist, 1.0)
    if point is None:
        return None
    ok = a.decoded & b.decoded
    n = int(ok.sum())
    units = unit_text(n, paired_groups(a, b, ok), "items both decoded")
    return {"items": n, "ratio": point, "test": "paired bootstrap",
            "interval": None if ci is None else {"lo": ci[0], "hi": ci[1], "items": n,
                                                 "method": f"paired bootstrap over {units} ({BOOT} resamples)"},
            "p": p, "differs": p is not None and p < ALPHA}


def mean_ratio_interval(pairs: list[tuple[Items, Items]], figure: str = "tokens_per_s",
                        streams: list[Any] | None = None) -> dict | None:
    """The mean over tasks of per-task paired ratios (b over a; the paper's mean of per-task speedups): the point
    (the mean of the per-task ratios on the items both decoded) and its stratified paired bootstrap interval
    (each task's items resampled on their own, the ratios averaged per resample). None when a task has no
    shared decoded item."""
    dists, points, n, batches = [], [], 0, 0
    for i, (a, b) in enumerate(pairs):
        keys = shared_keys(a, b)
        if not keys:
            return None
        a, b = a.take(keys), b.take(keys)
        point, dist = paired_ratio_dist(a, b, figure, streams[i] if streams else i)
        if point is None:
            return None
        dists.append(dist)
        points.append(point)
        n += len(keys)
        units = unit_members(paired_groups(a, b, a.decoded & b.decoded))
        batches += len(units) if units is not None else 0
    if not dists:
        return None
    ci = percentile_interval(np.mean(np.vstack(dists), axis=0))
    return {"ratio": float(np.mean(points)),
            "interval": None if ci is None else {
                "lo": ci[0], "hi": ci[1], "items": n,
                "method": f"stratified paired bootstrap over {n} items of {len(points)} tasks, each task's items "
                          + (f"resampled on their own, in batches where a task was decoded in batches ({batches} "
                             "batches in all; a batch's rows are one draw)" if batches else "resampled on their own")
                          + f" ({BOOT} resamples)"},
            "statistic": "arithmetic mean over tasks of each task's speedup (the ratio of throughputs, tokens over "
                         "seconds, on the items both decoded)"}


def mean_interval(dists: list[np.ndarray]) -> tuple[float, float] | None:
    """The interval of a mean over strata (tasks) from each stratum's bootstrap distribution (same length)."""
    if not dists or any(d.size == 0 for d in dists):
        return None
    return percentile_interval(np.mean(np.vstack(dists), axis=0))


def quality_dist(it: Items, stream: Any) -> np.ndarray:
    """The bootstrap distribution of an item mean (a share), for means over tasks (``mean_interval``)."""
    if not it.has_scores:
        return np.zeros(0)
    return boot_dist({"s": it.score}, lambda c: c["s"].mean(axis=-1), (stream, "quality"))


def speed_dist(it: Items, figure: str, stream: Any) -> np.ndarray:
    """The bootstrap distribution of one speed figure of ``SPEED`` over the decoded items."""
    cols = speed_columns(it)
    if not len(cols["tokens"]):
        return np.zeros(0)
    return boot_dist(cols, SPEED[figure], (stream, "speed"), groups=speed_groups(it))


def fmt_interval(iv: dict | Interval | None, spec: str, scale: float = 1.0) -> str:
    """`` [lo, hi]`` in ``spec`` (values times ``scale``), or '' without an interval."""
    if iv is None:
        return ""
    lo, hi = (iv.lo, iv.hi) if isinstance(iv, Interval) else (iv["lo"], iv["hi"])
    return f" [{format(lo * scale, spec)}, {format(hi * scale, spec)}]"


def fmt_p(p: float | None) -> str:
    """A p-value as printed: three decimals, ``<0.001`` below that, '-' when absent."""
    if p is None:
        return "-"
    return "<0.001" if p < 0.001 else f"{p:.3f}"
