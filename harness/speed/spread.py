"""How far a second run lands (docs/design.md "What a second run shows"): repeated runs of one ``harness eval``
command on one machine, every pair of them through ``make compare``, and repeated speed A/Bs of identical code
(``make regress``'s harness/speed/ab.py). The figures a reader needs beside a run's intervals, which hold the
spread of its own rounds and timed items but not the machine's state between runs.

    python -m harness spread --runs 6                             # the default `make eval`, 6 times
    python -m harness spread --runs 20 --name small --eval-args "--task embedded_math --limit 20 --models ar,refusion"
    python -m harness spread --ab 10                              # 10 A/Bs of this commit against itself
    make spread SPREAD_ARGS="--runs 6"

A spread file is what `make compare --spread FILE` judges speedups against (harness/run/timing.py
``spread_rule``). Calibrating that rule out of sample takes three series of one command:

    python -m harness spread --runs 10 --name rule                # sets the rule's spread
    python -m harness spread --runs 20 --name idle                # new idle runs: false alarms, in pairs 1-2, 3-4, ...
    python -m harness spread --runs 10 --name slow --slow refusion=1.5   # refusion 1.5x as costly (CPU work)
    python -m harness spread --calibrate rule --idle idle --slowed slow  # -> results/compare_calibration.json

Every run and every A/B is kept as it finishes (run folders under ``--out``, ``ab-<i>.json`` beside them), so an
interrupted measurement resumes where it stopped and ``--runs N`` only adds what is missing: the runs can be
made one at a time (between other work) and summarised at the end. Run on an idle machine: every run records its
busy-machine guard, and the summary names the runs that were flagged.

Writes ``results/speed_spread_<name>.json`` (atomically): per run the mean speedups and per-task speedups with
their intervals and the guard's verdict; per model the spread (lowest, highest, highest / lowest) and how many
runs' points lie inside every other run's interval; per pair of runs what ``make compare`` called different; per
A/B which figures failed. Speed is quoted only as ratios measured within one run (docs/design.md §6).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.run.store import atomic_write_json, read_json_or_none

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "results" / "runs" / "spread"


def timing_statistic() -> str:
    """The speedup statistic a spread series is made with (compare refuses a file of another)."""
    from harness.run.timing import RATIO_STATISTIC

    return RATIO_STATISTIC


WALL_FILE = "spread_wall.json"  # in each run folder: the whole command's wall seconds


def _run_id(name: str, i: int) -> str:
    return f"spread-{name}-{i:02d}"


def ensure_runs(n: int, name: str, eval_args: list[str], out: Path, faults: dict | None = None) -> None:
    """Runs 1..n of the command, each in its own run folder; a finished one (summary.json) is kept. ``faults``:
    the fault hook's object for every run (harness/run/faults.py, e.g. a ``"slow"`` decoder)."""
    import os

    from harness.run.faults import FAULTS_ENV

    env = {**os.environ, **({FAULTS_ENV: json.dumps(faults)} if faults else {})}
    for i in range(1, n + 1):
        run = out / _run_id(name, i)
        if (run / "summary.json").is_file():
            continue
        cmd = [sys.executable, "-m", "harness", "eval", *eval_args, "--out", str(out), "--run-id", run.name]
        print(f"spread: run {i}/{n}: {shlex.join(cmd[1:])}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        p = subprocess.run(cmd, cwd=REPO, env=env)
        if p.returncode != 0:
            raise SystemExit(f"error: run {run.name} failed (exit {p.returncode}); rerun to resume it")
        wall = time.monotonic() - t0
        # The command's whole wall time (start to exit, imports included): what `make eval` costs its user.
        atomic_write_json(run / WALL_FILE, {"seconds": round(wall, 1), "command": shlex.join(cmd[1:])})
        print(f"spread: run {i}/{n} done in {wall:.0f} s", file=sys.stderr, flush=True)


def run_figures(run: Path) -> dict:
    """One run's speedups: the mean per model and each (model, task), with intervals; the guard's verdict."""
    s = json.loads((run / "summary.json").read_text())
    t = s.get("timing") or {}
    return {"run": run.name, "commit": (s.get("environment") or {}).get("git_commit"),
            "machine": t.get("machine") or ("busy" if t.get("busy") else "quiet"),
            "timing_seconds": t.get("seconds"), "timed_items": t.get("items"), "rounds": t.get("rounds"),
            "wall_seconds": (read_json_or_none(run / WALL_FILE) or {}).get("seconds"),
            "mean": {m: {"speedup": v, "interval": (s.get("mean_speedup_interval") or {}).get(m)}
                     for m, v in (s.get("mean_speedup") or {}).items() if m != s.get("baseline")},
            "rows": {f"{r['model']}/{r['task']}": {"speedup": r["speedup"], "interval": r.get("speedup_ci")}
                     for r in s["rows"] if r["model"] != s.get("baseline") and r.get("speedup") is not None}}


def _walls(runs: list[dict]) -> dict | None:
    """The runs' whole wall times (each command from start to exit), where recorded."""
    w = [r["wall_seconds"] for r in runs if r.get("wall_seconds") is not None]
    return {"runs": len(w), "lowest": min(w), "median": sorted(w)[len(w) // 2], "highest": max(w),
            "unit": "seconds, the whole `harness eval` command"} if w else None


def spread_of(runs: list[dict], key: str) -> dict:
    """Per figure (a model's mean, or a model/task), over the runs: lowest, highest, highest / lowest, how many
    runs' points lie inside every other run's interval, and the coverage of each run's interval: how many runs'
    intervals hold the median of the other runs' points (what a reader of one run's interval expects of the
    next run)."""
    import statistics

    out = {}
    names = sorted({k for r in runs for k in r[key]})
    for k in names:
        pts = [(r[key][k]["speedup"], r[key][k]["interval"]) for r in runs if k in r[key]]
        vals = [p for p, _ in pts]
        inside = sum(1 for i, (p, _) in enumerate(pts)
                     if all(iv and iv["lo"] <= p <= iv["hi"] for j, (_, iv) in enumerate(pts) if j != i))
        covers = sum(1 for i, (_, iv) in enumerate(pts) if len(pts) > 1 and iv and
                     iv["lo"] <= statistics.median(v for j, v in enumerate(vals) if j != i) <= iv["hi"])
        out[k] = {"values": vals, "lowest": min(vals), "highest": max(vals), "max_over_min": max(vals) / min(vals),
                  "inside_all_others": inside, "covers_others_median": covers, "runs": len(vals)}
    return out


def coverage(spread: dict) -> dict:
    """Over every figure of ``spread_of``: runs whose interval held the median of the other runs' points, of all."""
    held = sum(v["covers_others_median"] for v in spread.values())
    total = sum(v["runs"] for v in spread.values() if v["runs"] > 1)
    return {"held": held, "of": total, "share": held / total if total else None}


def compare_pairs(out: Path, names: list[str], which: str = "all") -> list[dict]:
    """Every pair of runs through ``make compare`` (``harness compare``, its own process): what it called
    different."""
    got = []
    with tempfile.TemporaryDirectory() as tmp:
        pairs = itertools.combinations(names, 2) if which == "all" else zip(names[0::2], names[1::2])
        for a, b in pairs:
            rc = subprocess.run([sys.executable, "-m", "harness", "compare", "--run", f"{a},{b}", "--runs-root",
                                 str(out), "--out", tmp, "--name", "pair"], cwd=REPO, capture_output=True).returncode
            data = json.loads((Path(tmp) / "pair" / "compare.json").read_text()) if rc == 0 else {}
            got.append({"runs": [a, b], "exit": rc, "differ": [
                {k: d[k] for k in ("model", "benchmark", "figure", "test", "p", "change")} for d in data.get("differ",
                                                                                                          [])]})
    return got


def _judged(rule: dict, a: dict, b: dict, only: str | None = None) -> list[dict]:
    """Every (model, task) speedup of run ``b`` against run ``a`` judged by ``rule``'s spread (a spread file's
    data), as `make compare --spread` judges it; ``only``: that model's figures."""
    from harness.run.timing import spread_factor, spread_verdict

    quiet = [r for r in rule["runs"] if r["machine"] == "quiet"]
    out = []
    for key in sorted(set(a["rows"]) & set(b["rows"])):
        if only is not None and key.split("/")[0] != only:
            continue
        thr = spread_factor([r["rows"][key]["speedup"] for r in quiet if key in r["rows"]])
        if thr is not None:
            v = spread_verdict(a["rows"][key]["speedup"], b["rows"][key]["speedup"], thr)
            out.append({"figure": key, "ratio": v["ratio"], "factor": v["factor"], "differs": v["differs"]})
    return out


def calibrate(rule: dict, idle: dict, slowed: dict | None) -> dict:
    """The compare rule out of sample (module doc): false alarms over the disjoint pairs of ``idle`` runs (1-2,
    3-4, ...: identical code, every figure judged against ``rule``'s spread), and detection over the pairs
    (idle run i, slowed run i): the slowed decoder's figures called different and slower. Quiet runs only."""
    from harness.run.timing import SPREAD_ALPHA, spread_rule

    q = [r for r in idle["runs"] if r["machine"] == "quiet"]
    pairs = list(zip(q[0::2], q[1::2]))
    fa = [j for a, b in pairs for j in _judged(rule, a, b)]
    out = {"rule": spread_rule(), "alpha": SPREAD_ALPHA, "rule_series": rule.get("command"),
           "rule_runs": sum(1 for r in rule["runs"] if r["machine"] == "quiet"),
           "idle_pairs": len(pairs), "false_alarm": {
               "figures": len(fa), "called_different": sum(j["differs"] for j in fa),
               "share": sum(j["differs"] for j in fa) / len(fa) if fa else None,
               "pairs_with_any": sum(any(j["differs"] for j in _judged(rule, a, b)) for a, b in pairs),
               "called": [{"runs": [a["run"], b["run"]], **j} for a, b in pairs for j in _judged(rule, a, b)
                          if j["differs"]]}}
    if slowed is not None:
        model, factor = slowed["slow"]["decoder"], slowed["slow"]["factor"]
        s = [r for r in slowed["runs"] if r["machine"] == "quiet"]
        det = [{"runs": [a["run"], b["run"]], **j} for a, b in zip(q, s) for j in _judged(rule, a, b, only=model)]
        hit = [j for j in det if j["differs"] and j["ratio"] < 1]
        out["detection"] = {"decoder": model, "factor": factor, "pairs": min(len(q), len(s)), "figures": len(det),
                            "detected": len(hit), "share": len(hit) / len(det) if det else None,
                            "ratios": [j["ratio"] for j in det]}
    return out


def ensure_abs(n: int, out: Path) -> list[dict]:
    """A/Bs 1..n of this commit's code against itself (``make regress``'s settings), each kept as it finishes."""
    from harness.speed import ab, regress

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    if dirty:
        raise SystemExit("error: the checkout has uncommitted changes: an A/B against HEAD would not be identical "
                         "code; commit first")
    got = []
    for i in range(1, n + 1):
        path = out / f"ab-{i:02d}.json"
        res = read_json_or_none(path)
        if res is None or res.get("commit") != commit:
            print(f"spread: A/B {i}/{n} of {commit[:12]} against itself", file=sys.stderr, flush=True)
            r = ab.run(regress.REGRESS_MODELS, commit, threads=regress.THREADS, tolerance=regress.TOLERANCE)
            if r.get("unavailable"):
                raise SystemExit(f"error: A/B unavailable: {r['unavailable']}")
            res = {"commit": commit, "seconds": r["seconds"], "guard": r.get("guard"),
                   "rows": [{k: row.get(k) for k in ("figure", "ratio", "lo", "hi", "ok", "confirm")}
                            for row in r["rows"]]}
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, res)
        got.append(res)
    return got


def _calibrate_main(ns: argparse.Namespace) -> int:
    """``--calibrate``: read the three series, write results/compare_calibration.json, print its figures."""
    series = {}
    for role, name in (("rule", ns.calibrate), ("idle", ns.idle), ("slowed", ns.slowed)):
        if name is None:
            continue
        series[role] = read_json_or_none(REPO / "results" / f"speed_spread_{name}.json")
        if not series[role] or series[role].get("statistic") != timing_statistic():
            print(f"error: results/speed_spread_{name}.json: missing, or made with another speedup statistic",
                  file=sys.stderr)
            return 2
    if "idle" not in series:
        print("error: --calibrate needs --idle NAME (a series of new idle runs)", file=sys.stderr)
        return 2
    got = calibrate(series["rule"], series["idle"], series.get("slowed"))
    got["series"] = {k: f"results/speed_spread_{v}.json" for k, v in
                     (("rule", ns.calibrate), ("idle", ns.idle), ("slowed", ns.slowed)) if v}
    atomic_write_json(REPO / "results" / "compare_calibration.json", got)
    fa = got["false_alarm"]
    print(f"false alarms: {fa['called_different']} of {fa['figures']} figures ({100 * (fa['share'] or 0):.1f}%) "
          f"over {got['idle_pairs']} idle pairs ({fa['pairs_with_any']} pairs with any)")
    if "detection" in got:
        d = got["detection"]
        print(f"detection of {d['decoder']} x{d['factor']}: {d['detected']} of {d['figures']} figures "
              f"({100 * (d['share'] or 0):.1f}%)")
    print("wrote results/compare_calibration.json")
    return 0


def _parse_slow(text: str | None) -> dict | None | bool:
    """``--slow DECODER=FACTOR`` as {"decoder", "factor"}; None without it; False (after one error line) when bad."""
    if not text:
        return None
    dec, _, f = text.partition("=")
    try:
        slow = {"decoder": dec.strip(), "factor": float(f)}
    except ValueError:
        slow = None
    if not slow or not slow["decoder"] or slow["factor"] <= 1:
        print(f"error: --slow {text!r}: give DECODER=FACTOR with FACTOR > 1, e.g. refusion=1.5", file=sys.stderr)
        return False
    return slow


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness spread", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=0, help="runs of the command to have (missing ones are made)")
    p.add_argument("--name", default="default", help="name of this command's series (default: %(default)s)")
    p.add_argument("--eval-args", default="--task embedded",
                   help="arguments of `harness eval` (default: %(default)r, the default `make eval`)")
    p.add_argument("--ab", type=int, default=0, help="A/Bs of this commit against itself to have")
    p.add_argument("--out", default=str(OUT), help="run folders and A/B records (default: %(default)s)")
    p.add_argument("--no-compare", action="store_true", help="skip `make compare` over the pairs of runs")
    p.add_argument("--pairs", choices=("all", "disjoint"), default="all",
                   help="runs compared: every pair, or disjoint pairs (1-2, 3-4, ...: independent) (default: all)")
    p.add_argument("--slow", default=None, metavar="DECODER=FACTOR",
                   help="every run with that decoder's forwards made FACTOR times as costly by CPU work (the fault "
                        "hook's \"slow\", harness/run/faults.py): the series a calibration's detection is read on")
    p.add_argument("--calibrate", default=None, metavar="RULE",
                   help="calibrate `make compare --spread` out of sample: RULE's series sets the spread, --idle's "
                        "disjoint pairs give the false alarms, --slowed's runs (paired with --idle's) the detection; "
                        "writes results/compare_calibration.json")
    p.add_argument("--idle", default=None, metavar="NAME", help="with --calibrate: the new idle series")
    p.add_argument("--slowed", default=None, metavar="NAME", help="with --calibrate: the series made with --slow")
    ns = p.parse_args(argv)
    out = Path(ns.out)
    if ns.calibrate:
        return _calibrate_main(ns)
    slow = _parse_slow(ns.slow)
    if slow is False:
        return 2
    result_path = REPO / "results" / f"speed_spread_{ns.name}.json"
    result = read_json_or_none(result_path) or {}
    if ns.runs:
        faults = {"slow": {"decoders": [slow["decoder"]], "factor": slow["factor"]}} if slow else None
        ensure_runs(ns.runs, ns.name, shlex.split(ns.eval_args), out, faults)
        runs = [run_figures(out / _run_id(ns.name, i)) for i in range(1, ns.runs + 1)]
        pairs = [] if ns.no_compare else compare_pairs(out, [r["run"] for r in runs], ns.pairs)
        result.pop("version_note", None)  # the runs' figures are this version's now
        result.update({
            "command": f"harness eval {ns.eval_args}", "runs": runs, "statistic": timing_statistic(),
            **({"slow": slow} if slow else {}),
            "flagged": [r["run"] for r in runs if r["machine"] != "quiet"],
            "mean_spread": spread_of(runs, "mean"), "row_spread": spread_of(runs, "rows"),
            "row_coverage": coverage(spread_of(runs, "rows")), "mean_coverage": coverage(spread_of(runs, "mean")),
            "largest_row_ratio": max((v["max_over_min"] for v in spread_of(runs, "rows").values()), default=None),
            "wall_seconds": _walls(runs), "compare_pairs_kind": ns.pairs, "compare_pairs": pairs,
            "compare_pairs_called_different": sum(1 for x in pairs if x["differ"])})
    if ns.ab:
        abs_ = ensure_abs(ns.ab, out)
        result["ab"] = {"runs": abs_, "false_alarms": sum(1 for a in abs_ if not all(r["ok"] for r in a["rows"])),
                        "figures": len(abs_[0]["rows"]) if abs_ else 0}
    result["note"] = ("Idle runs of identical code on one machine. Speedups are ratios measured within each run; "
                      "the spread is between runs (docs/design.md 'What a second run shows').")
    atomic_write_json(result_path, result)
    for k, v in (result.get("mean_spread") or {}).items():
        print(f"{k}: mean speedup {v['lowest']:.2f}x .. {v['highest']:.2f}x over {v['runs']} runs "
              f"(x{v['max_over_min']:.2f}); inside every other run's interval: {v['inside_all_others']}/{v['runs']}")
    if ns.runs and result.get("row_coverage", {}).get("of"):
        c = result["row_coverage"]
        print(f"task speedup intervals holding the median of the other runs' points: {c['held']} of {c['of']} "
              f"({100 * c['share']:.0f}%)")
    if ns.runs and result.get("wall_seconds"):
        w = result["wall_seconds"]
        print(f"wall time of the command: {w['lowest']:.0f}-{w['highest']:.0f} s over {w['runs']} runs")
    if ns.runs and result.get("largest_row_ratio"):
        print(f"largest per-task speedup ratio between two of these runs: x{result['largest_row_ratio']:.2f}")
    if result.get("compare_pairs") is not None and ns.runs:
        print(f"make compare: {result['compare_pairs_called_different']} of {len(result['compare_pairs'])} pairs "
              "called a figure different")
    if ns.ab:
        print(f"A/B of identical code: {result['ab']['false_alarms']} of {len(result['ab']['runs'])} failed a figure")
    print(f"wrote {result_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
