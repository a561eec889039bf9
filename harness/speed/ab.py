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
3. The workload: of the first ``--ab-limit`` test items of each embedded kind for every preset (chat-templated
   by the current tokenizer: both sides get the same token ids and knobs; batch 1), as many as fill about
   ``TARGET_BLOCK_S`` by the first item's time, at least one (a slow decoder's block is one item). It is timed by the
   harness's timing protocol (harness/run/timing.py): per (preset, kind) one block of its items, decoded by
   each side in turn in each of ``ROUNDS`` rounds (ABBA), after an untimed warm-up (for a one-item block,
   the decode that sized it); a block shorter than
   ``MIN_BLOCK_S`` is repeated within its round. Time is wall time, so a slowdown that waits (a sleep, a
   lock, a blocking read) counts like one that works; the worker's CPU time is recorded beside it as the
   second signal (a slowdown in wall time alone is a wait).
4. Per (preset, kind): the current/baseline ratio of tokens/s, the median over rounds of the per-round
   ratio (both sides measured moments apart), with a 95% bootstrap interval over rounds and items. A figure
   fails only when the ratio is below ``1 - tolerance`` *and* its whole interval lies below 1 (significantly
   slower); such a figure is measured once more, in fresh worker processes with the order flipped and twice
   the rounds, after the evaluation `make regress` runs beside the first measurement has ended, and fails only
   if it fails again. A faster figure always passes. The busy-machine guard's view of the rounds goes into the report.

Both versions' absolute tokens/s, the interval and the machine (CPU model and flags) go into the
report; absolute figures are never compared with another run.

The same A/B against any commit, outside `make regress` (JSON to results/):

    python -m harness.speed.ab --commit 70fba97 --rounds 10 --out results/ab_70fba97.json
    python -m harness.speed.ab --commit HEAD~3 --models refusion,fast_dllm
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness.run import timing
from harness.run.guard import Guard
from tasks.embedded import KINDS

REPO = Path(__file__).resolve().parents[2]
BASE_TREES = REPO / "results" / "tmp" / "regress-base"
CODE_DIRS = ("refusion", "harness", "tasks")
AB_LIMIT = 4
TOLERANCE = 0.10
MIN_BLOCK_S = 0.1
TARGET_BLOCK_S = 0.15  # items per (preset, kind): as many as fill this, at least one
ROUNDS = timing.DEFAULT_ROUNDS
CONFIRM_ROUNDS = 2  # a confirmation takes this many times the first measurement's rounds
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


class ABSide:
    """One code version as a timing side (harness/run/timing.py): its worker decodes a group's items (one
    preset on one kind) one after another; the tokens of every decode must equal its first decode's."""

    def __init__(self, name: str, worker: Worker, groups: dict[str, list[Item]]) -> None:
        self.name, self.worker, self.groups = name, worker, groups
        self.tokens: dict[tuple[str, int], int] = {}

    def block(self, group: str, repeat: int) -> list[dict]:
        calls = []
        for i, it in enumerate(self.groups[group]):
            wall = cpu = 0.0
            for _ in range(repeat):
                ans = self.worker.decode(it)
                wall += float(ans.get("wall_seconds", ans["seconds"]))
                cpu += float(ans["seconds"])
                first = self.tokens.setdefault((group, i), int(ans["tokens"]))
                if int(ans["tokens"]) != first:
                    raise timing.TimingMismatch(f"{self.name} code: {it.preset}/{it.kind} item {it.index} gave "
                                                f"{ans['tokens']} tokens, {first} before")
            calls.append({"wall_s": wall, "cpu_s": cpu, "tokens": int(ans["tokens"]), "nfe": int(ans["nfe"])})
        return calls


def groups_of(items: list[Item]) -> dict[str, list[Item]]:
    out: dict[str, list[Item]] = {}
    for it in items:
        out.setdefault(f"{it.preset}/{it.kind}", []).append(it)
    return out


def measure(items: list[Item], cur: Worker, base: Worker, progress: bool = True, flip: bool = False,
            min_block_s: float = MIN_BLOCK_S, rounds: int = ROUNDS, guard: Guard | None = None) -> dict:
    """The timing protocol over the two code versions: per (preset, kind) a block of its items, decoded by
    each side in turn in every round (ABBA; ``flip`` starts with the other side), after an untimed warm-up
    (harness/run/timing.py ``run_rounds``). Returns run_rounds' result plus both sides' tokens."""
    groups = groups_of(items)
    warmed: dict[str, dict[str, float]] = {}
    for g, its in groups.items():
        # Items per group: as many of the first --ab-limit as fill about TARGET_BLOCK_S, at least one (a slow
        # decoder's block is one item long: its rounds, not its items, are what the ratio needs).
        first = {n: float(w.decode(its[0]).get("wall_seconds") or 0.0) for n, w in (("current", cur),
                                                                                   ("baseline", base))}
        groups[g] = its[:max(1, min(len(its), int(TARGET_BLOCK_S / max(min(first.values()), 1e-6))))]
        if len(groups[g]) == 1:  # that decode was the block's warm-up: a slow block is not decoded once more
            warmed[g] = first
    sides = [ABSide("current", cur, groups), ABSide("baseline", base, groups)]
    got = timing.run_rounds(sides, list(groups), rounds=rounds, order="abba", min_block_s=min_block_s, guard=guard,
                            progress=progress, desc="speed A/B", flip=flip, same_repeat=True, warmed=warmed)
    got["same_tokens"] = {g: all(sides[0].tokens.get((g, i)) == sides[1].tokens.get((g, i))
                                 for i in range(len(its))) for g, its in groups.items()}
    got["items"] = {g: len(its) for g, its in groups.items()}
    return got


def summarize(res: dict, tolerance: float = TOLERANCE) -> list[dict]:
    """One row per (preset, kind): both sides' tokens/s (median over rounds), the current/baseline ratio of
    wall-time tokens/s (median over rounds of the per-round ratio) with its interval over rounds and items, the
    same ratio in CPU time (the second signal: a slowdown in wall time but not in CPU time is a wait), and the
    verdict: a figure fails when its ratio is below ``1 - tolerance`` and its whole interval lies below 1."""
    rows = []
    recs = res["records"]
    for g in res["items"]:
        preset, kind = g.split("/", 1)
        a, b = timing.figure(recs, "current", g), timing.figure(recs, "baseline", g)
        w, c = timing.ratio(recs, "current", "baseline", g), timing.ratio(recs, "current", "baseline", g,
                                                                           clock_="cpu")
        lo, hi = ((w or {}).get("interval") or {}).get("lo"), ((w or {}).get("interval") or {}).get("hi")
        ok = w is None or hi is None or not (w["ratio"] < 1 - tolerance and hi < 1)
        row = {"figure": f"{preset}/embedded_{kind} tokens/s", "preset": preset, "kind": kind, "items": res["items"][g],
               "rounds": res["rounds"], "current_tps": a and a["tokens_per_s"], "baseline_tps": b and b["tokens_per_s"],
               "ratio": w and w["ratio"], "lo": lo, "hi": hi, "per_pair": w and w["per_pair"],
               "cpu_ratio": c and c["ratio"], "cpu_lo": c and (c["interval"] or {}).get("lo"),
               "cpu_hi": c and (c["interval"] or {}).get("hi"),
               "rule": f"fails when the median ratio < {1 - tolerance:.2f} and its 95% interval lies below 1, twice",
               "ok": ok, "same_tokens": res["same_tokens"][g]}
        if not ok:
            row["slowdown"] = "work (CPU time too)" if c and c["ratio"] < 1 - tolerance else "a wait (wall time only)"
        rows.append(row)
    return rows


def _pair(current: Path, tree: Path, threads: int, commit: str | None) -> tuple[list[Worker], Guard | None]:
    """Fresh workers on both trees, and a guard that counts them as ours (the evaluation `make regress` runs
    beside them is a neighbour); none for stand-in workers with no process (tests)."""
    workers = [Worker(current, threads, "current"), Worker(tree, threads, f"baseline ({str(commit)[:12]})")]
    pids = {w.proc.pid for w in workers if getattr(w, "proc", None) is not None}
    return workers, Guard(roots=pids) if pids else None


def run(models: tuple[str, ...], commit: str | None, limit: int = AB_LIMIT, threads: int = 1,
        tolerance: float = TOLERANCE, current: Path = REPO, progress: bool = True, confirm: bool = True,
        baseline_tree: Path | None = None, min_block_s: float = MIN_BLOCK_S, rounds: int = ROUNDS,
        kinds: tuple[str, ...] = KINDS, settle: Callable[[], None] | None = None) -> dict:
    """The whole A/B: ``{"rows": [...], "machine": {...}, "baseline_commit": ..., "guard": ..., "seconds": ...}``,
    or ``{..., "unavailable": "<one line>"}`` when the baseline code cannot be run. ``current`` is the tree of
    the code under test (this checkout); ``baseline_tree`` replaces the commit's extracted code (tests).
    ``settle``: called before a confirmation and waits for the work the caller runs beside the A/B (`make
    regress`'s evaluation), so that a confirmation has the machine to itself: the first measurement is a screen
    taken beside that work, the confirmation (``CONFIRM_ROUNDS`` x the rounds) the verdict."""
    t0 = time.time()
    info = {"machine": machine(), "baseline_commit": commit, "limit": limit, "threads": threads, "rounds": rounds,
            "tolerance": tolerance, "current_tree": str(current), "clock": "wall time; CPU time beside it"}
    workers: list[Worker] = []
    try:
        tree = baseline_tree or base_tree(commit)
        items = workload(models, limit, kinds)
        workers, guard = _pair(current, tree, threads, commit)
        first = measure(items, *workers, progress=progress, min_block_s=min_block_s, rounds=rounds, guard=guard)
        rows = summarize(first, tolerance)
        bad = [r for r in rows if not r["ok"]]
        second: dict = {}
        if bad and confirm:
            # A disturbance that hit one side more than the other must show twice to count. The second
            # measurement runs in fresh worker processes (pyperf's rule): a process that landed badly (its
            # memory layout, its core) would otherwise carry the same bias into the confirmation. It waits for
            # the work beside it to end (on 2 cores an evaluation's load comes and goes with its phases, which
            # round-by-round pairing evens out only on average), and takes more rounds.
            for w in workers:
                w.close()
            if settle is not None:
                if progress:
                    print(f"speed A/B: {len(bad)} figure(s) to confirm, once the evaluation beside it has ended",
                          file=sys.stderr, flush=True)
                settle()
            workers, guard = _pair(current, tree, threads, commit)
            again_items = [it for it in items if (it.preset, it.kind) in {(r["preset"], r["kind"]) for r in bad}]
            second = measure(again_items, *workers, progress=progress, flip=True, min_block_s=min_block_s,
                             rounds=CONFIRM_ROUNDS * rounds, guard=guard)
            again = {(r["preset"], r["kind"]): r for r in summarize(second, tolerance)}
            for r in rows:
                if not r["ok"]:
                    a = again[(r["preset"], r["kind"])]
                    r["confirm"] = {k: a[k] for k in ("ratio", "lo", "hi", "cpu_ratio", "current_tps", "baseline_tps",
                                                      "rounds")}
                    r["ok"] = a["ok"]
        return {**info, "rows": rows, "records": first["records"], "guard": first.get("guard"),
                "confirm_guard": second.get("guard"),
                "seconds": round(time.time() - t0, 1)}
    except (ABUnavailable, timing.TimingMismatch) as e:
        return {**info, "unavailable": str(e), "seconds": round(time.time() - t0, 1)}
    finally:
        for w in workers:
            w.close()


def resolve(rev: str, repo: Path = REPO) -> str:
    """The full commit id of ``rev`` (a hash, a branch, HEAD~n), ValueError naming it when git does not know it."""
    try:
        rc = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=repo,
                            capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"git is not usable here ({e})") from None
    if rc.returncode != 0 or not rc.stdout.strip():
        raise ValueError(f"--commit {rev!r} is no commit of this clone")
    return rc.stdout.strip()


def preset_names(text: str, rounds: int, limit: int) -> tuple[str, ...]:
    """The comma-separated preset names of a command line (harness/run/presets.py), with its rounds and items
    checked: ValueError naming what is wrong (shared with harness/speed/knob_ab.py)."""
    from harness.run.presets import PRESETS

    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [x for x in names if x not in PRESETS]
    if unknown or not names:
        raise ValueError(f"unknown preset(s) {', '.join(unknown) or '(none)'}; valid: {', '.join(PRESETS)}")
    if rounds < 2 or limit < 1:
        raise ValueError("--rounds must be >= 2 and --limit >= 1")
    return names


def row_line(r: dict) -> str:
    """One printed row: the figure, both sides' tokens/s, the ratio with its interval and the CPU-time ratio."""
    return (f"  {r['figure']:<34} {r['baseline_tps']:8.1f} -> {r['current_tps']:8.1f} tok/s  ratio {r['ratio']:.3f} "
            f"[{r['lo']:.3f}, {r['hi']:.3f}]  CPU {r['cpu_ratio']:.3f}")


def main(argv: list[str] | None = None) -> int:
    """The speed A/B of this checkout's code against ``--commit``'s (module doc), rows printed, JSON written."""
    from harness.run.presets import REGRESS_MODELS
    from harness.run.store import atomic_write_json

    p = argparse.ArgumentParser(prog="python -m harness.speed.ab", description="This checkout's code against a "
                                "commit's, decoded in turn on this machine now: tokens/s ratios with 95% intervals.")
    p.add_argument("--commit", required=True, help="the code to compare with (hash, branch, HEAD~n)")
    p.add_argument("--models", default=",".join(REGRESS_MODELS), help="preset names (default: %(default)s)")
    p.add_argument("--limit", type=int, default=AB_LIMIT, help="test items per kind (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved rounds (default: %(default)s)")
    p.add_argument("--tolerance", type=float, default=TOLERANCE,
                   help="a figure fails below 1 - this with its interval below 1, twice (default: %(default)s)")
    p.add_argument("--out", default=None, help="JSON file (default: results/ab_<commit>.json)")
    ns = p.parse_args(argv)
    try:
        models = preset_names(ns.models, ns.rounds, ns.limit)
        commit = resolve(ns.commit)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = run(models, commit, limit=ns.limit, rounds=ns.rounds, tolerance=ns.tolerance)
    if "unavailable" in out:
        print(f"error: {out['unavailable']}", file=sys.stderr)
        return 2
    path = ns.out or f"results/ab_{commit[:12]}.json"
    atomic_write_json(path, {k: v for k, v in out.items() if k != "records"})
    print(f"this checkout against {commit[:12]} ({out['rounds']} rounds, {out['machine']['cpu']}):")
    for r in out["rows"]:
        print(f"{row_line(r)}  {'ok' if r['ok'] else 'SLOWER'}")
    print(f"wrote {path} in {out['seconds']} s")
    return 0 if all(r["ok"] for r in out["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
