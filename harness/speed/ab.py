"""Speed A/B of `make regress`: the current code against the baseline commit's, on this machine, now.

A speed figure recorded on one machine says nothing about another: a ratio between workloads of
different shapes (one-token AR steps against full-block diffusion forwards) moves by 20-30% between
CPU types. So the baseline records no speed at all, only its commit, and the check decodes the same
workload with both code versions in one run:

1. The baseline commit's ``refusion/``, ``harness/`` and ``tasks/`` are extracted with ``git archive``
   into an ignored folder (``results/tmp/regress-base/<commit>/``, kept for the next run). A commit that
   is not in the clone (a shallow clone) makes the speed part say so in one line; the deterministic
   part of the check runs anyway.
2. Two persistent worker processes (harness/speed/ab_worker.py), one per tree, one torch thread each,
   load the *current* checkpoints (the weights are the same data for both; the code is what is
   compared) and decode on request. Only one decodes at a time.
3. The workload: the first ``--ab-limit`` test items of each embedded kind for every preset, chat-templated
   by the current tokenizer (both sides get the same token ids and knobs), batch 1. Each item is decoded
   in rounds, each round once by each side in alternating order (ABBA), after an untimed warm-up per
   (preset, kind); an item that takes less than ``MIN_BLOCK_S`` gets more rounds, so each side's timed
   block lasts about that long. Time is the worker's CPU time in the decoder call (one thread), not the
   wall clock: while another process holds the core, neither side's clock runs, so a busy machine (a
   sandbox user, busy loops, a trainer) does not blur the ratio; a slower step is more work and counts.
4. Per (preset, kind): the paired ratio per item, current tokens/s over baseline tokens/s (each side's
   best round: the one least disturbed by whatever else the machine does), and the
   geometric mean of those ratios with a 95% bootstrap interval over items (``BOOT`` resamples, fixed
   seed). A figure fails only when its whole interval lies below ``1 - tolerance``; such a figure is
   measured once more and fails only if it is below the line again. A faster figure always passes.

Both versions' absolute tokens/s, the interval and the machine (CPU model and flags) go into the
report; absolute figures are never compared with another run.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tasks.embedded import KINDS

REPO = Path(__file__).resolve().parents[2]
BASE_TREES = REPO / "results" / "tmp" / "regress-base"
CODE_DIRS = ("refusion", "harness", "tasks")
AB_LIMIT = 4
TOLERANCE = 0.10
MIN_BLOCK_S = 0.1
MIN_ROUNDS = 2
MAX_ROUNDS = 16
BOOT = 2000
# CPU flags that decide how fast a kernel runs (vector and matrix units); the report lists these.
KEY_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
             "amx_tile", "amx_bf16", "amx_int8", "avx_vnni")


class ABUnavailable(Exception):
    """The A/B cannot run (no baseline commit, a shallow clone, an old tree): one line for the report."""


def machine() -> dict:
    """CPU model, the key vector/matrix flags, core count, and the full flag list (for information)."""
    cpu, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and cpu in ("", platform.machine(), platform.processor()):
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith(("flags", "Features")) and not flags:
                    flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    return {"cpu": cpu, "key_flags": [f for f in KEY_FLAGS if f in flags], "cpu_count": os.cpu_count(),
            "flags": flags, "platform": platform.platform()}


def base_tree(commit: str | None, root: Path = BASE_TREES, repo: Path = REPO) -> Path:
    """The baseline commit's code, extracted once into ``root/<commit>`` (ABUnavailable if impossible)."""
    if not commit:
        raise ABUnavailable("the baseline records no commit; record one with `make regress-update`")
    dest = root / commit
    if (dest / ".complete").is_file():
        return dest
    try:
        have = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=repo, capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError) as e:
        raise ABUnavailable(f"git is not usable here ({e})") from None
    if not have:
        shallow = (repo / ".git" / "shallow").is_file()
        raise ABUnavailable(f"the baseline commit {commit[:12]} is not in this clone"
                            + (" (a shallow clone: fetch with --unshallow)" if shallow else ""))
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{commit[:12]}-", dir=root))
    try:
        with tempfile.TemporaryFile() as tar:
            rc = subprocess.run(["git", "archive", "--format=tar", commit, *CODE_DIRS], cwd=repo, stdout=tar,
                                stderr=subprocess.PIPE, timeout=120)
            if rc.returncode != 0:
                raise ABUnavailable(f"git archive {commit[:12]} failed: {rc.stderr.decode().strip()[:200]}")
            tar.seek(0)
            with tarfile.open(fileobj=tar) as t:
                t.extractall(staging, filter="data")
        (staging / ".complete").write_text(commit + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest


@dataclass(frozen=True)
class Item:
    preset: str
    kind: str
    index: int
    checkpoint: str
    decoder: str
    knobs: dict
    ids: list


def workload(models: tuple[str, ...], limit: int, kinds: tuple[str, ...] = KINDS) -> list[Item]:
    """The first ``limit`` test items per kind for every preset, as token ids (current tokenizer)."""
    from transformers import AutoTokenizer

    from harness.run.presets import PRESETS
    from tasks.embedded import load_split
    from tasks.info import TASKS

    rows = {k: load_split(k, "test")[:limit] for k in kinds}
    items, toks = [], {}
    for name in models:
        spec = PRESETS[name]
        ckpt = str(REPO / spec.checkpoint)
        if ckpt not in toks:
            toks[ckpt] = AutoTokenizer.from_pretrained(ckpt)
        tok = toks[ckpt]
        for kind in kinds:
            for i, row in enumerate(rows[kind]):
                text = tok.apply_chat_template([{"role": "user", "content": row["query"]}], tokenize=False,
                                               add_generation_prompt=True)
                items.append(Item(name, kind, i, ckpt, spec.decoder,
                                  {**spec.knobs, "gen_length": TASKS[f"embedded_{kind}"].gen_length},
                                  tok(text, add_special_tokens=False)["input_ids"]))
    return items


class Worker:
    """One persistent ab_worker.py process on one tree."""

    def __init__(self, tree: Path, threads: int, label: str) -> None:
        self.label = label
        self.err = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty tree never blocks on it
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("ab_worker.py")), "--tree",
                                      str(tree), "--threads", str(threads)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True, cwd=str(tree))
        hello = self._read()
        if not hello.get("ok"):
            self.close()
            raise ABUnavailable(f"{label} code: {hello.get('error')}")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            self.err.seek(0)
            err = self.err.read().strip().splitlines()
            raise ABUnavailable(f"{self.label} worker exited: {err[-1] if err else 'no output'}")
        return json.loads(line)

    def decode(self, it: Item) -> dict:
        """One decode of ``it``: {"seconds": the worker's CPU seconds in the decoder call, "wall_seconds",
        "tokens", "nfe"}."""
        self.proc.stdin.write(json.dumps({"op": "decode", "checkpoint": it.checkpoint, "decoder": it.decoder,
                                          "knobs": it.knobs, "ids": it.ids}) + "\n")
        self.proc.stdin.flush()
        ans = self._read()
        if not ans.get("ok"):
            raise ABUnavailable(f"{self.label} code cannot decode {it.preset}/{it.kind}: {ans.get('error')}")
        return ans

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
        except (OSError, ValueError, subprocess.SubprocessError):
            self.proc.kill()
        finally:
            for f in (self.proc.stdin, self.proc.stdout, self.err):
                try:
                    f.close()
                except OSError:
                    pass


def measure(items: list[Item], cur: Worker, base: Worker, progress: bool = True, flip: bool = False,
            min_block_s: float = MIN_BLOCK_S, min_rounds: int = MIN_ROUNDS) -> list[dict]:
    """Per item and side: the summed and the best (shortest) seconds of its rounds, tokens and NFE. An item
    is decoded in rounds, each round once by each side in alternating order (ABBA...), so a burst of load
    falls on both sides alike. The first item of each (preset, kind) is decoded once by both sides untimed
    first (model load, first-call allocations); its time on the current side sets the rounds of the
    group's items: at least ``min_rounds``, and enough for each side's timed block to last about
    ``min_block_s``."""
    from tqdm import tqdm

    rounds_of: dict[tuple[str, str], int] = {}
    out = []
    for n, it in enumerate(tqdm(items, desc="speed A/B", disable=not progress, file=sys.stderr)):
        group = (it.preset, it.kind)
        if group not in rounds_of:
            warm = cur.decode(it)["seconds"]
            base.decode(it)
            rounds_of[group] = max(min_rounds, min(MAX_ROUNDS, math.ceil(min_block_s / max(warm, 1e-6))))
        rounds = rounds_of[group]
        rec = {"preset": it.preset, "kind": it.kind, "index": it.index, "rounds": rounds,
               "cur": {"seconds": 0.0, "best": math.inf}, "base": {"seconds": 0.0, "best": math.inf}}
        for r in range(rounds):
            first_cur = ((n + r) % 2 == 0) != flip
            for key, w in ((("cur", cur), ("base", base)) if first_cur else (("base", base), ("cur", cur))):
                ans = w.decode(it)
                side = rec[key]
                side["seconds"] += ans["seconds"]
                side["best"] = min(side["best"], ans["seconds"])
                side["tokens"], side["nfe"] = ans["tokens"], ans["nfe"]  # per decode: the same every round
        out.append(rec)
    return out


def _interval(logs: list[float], seed: int) -> tuple[float, float]:
    rng = random.Random(seed)
    n = len(logs)
    means = sorted(sum(logs[rng.randrange(n)] for _ in range(n)) / n for _ in range(BOOT))
    return math.exp(means[int(0.025 * BOOT)]), math.exp(means[min(BOOT - 1, int(0.975 * BOOT))])


def summarize(records: list[dict], tolerance: float = TOLERANCE) -> list[dict]:
    """One row per (preset, kind): both sides' tokens/s (ratio of sums), the geometric mean of the
    per-item ratios current/baseline, its bootstrap interval, and the verdict."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["preset"], r["kind"]), []).append(r)
    rows = []
    for gi, ((preset, kind), recs) in enumerate(sorted(groups.items())):
        logs = []
        for r in recs:  # per item: tokens/s of each side's best round (the one least disturbed by the machine)
            a, b = r["cur"], r["base"]
            if a["tokens"] and b["tokens"] and a["best"] > 0 and b["best"] > 0:
                logs.append(math.log((a["tokens"] / a["best"]) / (b["tokens"] / b["best"])))
        tps = {k: sum(r[k]["tokens"] * r["rounds"] for r in recs) / max(1e-12, sum(r[k]["seconds"] for r in recs))
               for k in ("cur", "base")}
        if logs:
            ratio = math.exp(sum(logs) / len(logs))
            lo, hi = _interval(logs, seed=gi)
        else:
            ratio = lo = hi = None
        ok = hi is None or hi >= 1 - tolerance
        rows.append({"figure": f"{preset}/embedded_{kind} tokens/s", "preset": preset, "kind": kind,
                     "items": len(recs), "current_tps": tps["cur"], "baseline_tps": tps["base"], "ratio": ratio,
                     "lo": lo, "hi": hi, "rule": f"95% interval not wholly below {1 - tolerance:.2f}x", "ok": ok,
                     "same_tokens": all(r["cur"]["tokens"] == r["base"]["tokens"] for r in recs)})
    return rows


def run(models: tuple[str, ...], commit: str | None, limit: int = AB_LIMIT, threads: int = 1,
        tolerance: float = TOLERANCE, current: Path = REPO, progress: bool = True, confirm: bool = True,
        baseline_tree: Path | None = None, min_block_s: float = MIN_BLOCK_S, min_rounds: int = MIN_ROUNDS,
        kinds: tuple[str, ...] = KINDS) -> dict:
    """The whole A/B: ``{"rows": [...], "machine": {...}, "baseline_commit": ..., "seconds": ...}``, or
    ``{..., "unavailable": "<one line>"}`` when the baseline code cannot be run. ``current`` is the tree of
    the code under test (this checkout); ``baseline_tree`` replaces the commit's extracted code (tests)."""
    t0 = time.time()
    info = {"machine": machine(), "baseline_commit": commit, "limit": limit, "threads": threads,
            "tolerance": tolerance, "current_tree": str(current)}
    workers: list[Worker] = []
    try:
        tree = baseline_tree or base_tree(commit)
        items = workload(models, limit, kinds)
        workers = [Worker(current, threads, "current"), Worker(tree, threads, f"baseline ({str(commit)[:12]})")]
        timing = {"min_block_s": min_block_s, "min_rounds": min_rounds}
        records = measure(items, *workers, progress=progress, **timing)
        rows = summarize(records, tolerance)
        bad = [r for r in rows if not r["ok"]]
        if bad and confirm:
            # A disturbance that hit one side more than the other must show twice to count.
            again_items = [it for it in items if (it.preset, it.kind) in {(r["preset"], r["kind"]) for r in bad}]
            again = {(r["preset"], r["kind"]): r for r in summarize(measure(again_items, *workers, progress=progress,
                                                                          flip=True, **timing),
                                                                  tolerance)}
            for r in rows:
                if not r["ok"]:
                    a = again[(r["preset"], r["kind"])]
                    r["confirm"] = {k: a[k] for k in ("ratio", "lo", "hi", "current_tps", "baseline_tps")}
                    r["ok"] = a["ok"]
        return {**info, "rows": rows, "records": records, "seconds": round(time.time() - t0, 1)}
    except ABUnavailable as e:
        return {**info, "unavailable": str(e), "seconds": round(time.time() - t0, 1)}
    finally:
        for w in workers:
            w.close()
