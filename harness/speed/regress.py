"""`make regress` / `make regress-update`: CI regression tracking of quality and speed.

    python -m harness regress                         # run, compare with results/baseline/embedded.json
    python -m harness regress-update --reason "..."   # run, rewrite the baseline, append to history.jsonl

Both run the embedded evaluation of the default decoders plus Dream and D2F
(``REGRESS_MODELS``: every diffusion decoder, so a changed math figure of any of
them fails) on the committed tiny checkpoints at a fixed LIMIT, seed and thread
count, through the same runner as ``make eval``, into an ignored folder
(``results/runs/regress-*``).

What is compared:

- **deterministic figures, exactly**, per (model, task): quality, generated tokens,
  NFE, TPF and peak KV-cache bytes. Greedy decoding in float32 on the CPU with a
  fixed thread count gives the same tokens every run, on any machine, so any change
  here is a behaviour change, not noise;
- **speed, against the baseline commit's code on this machine, now**
  (harness/speed/ab.py, timed by harness/run/timing.py): the baseline records the commit
  it was made at, and the check decodes the same items with that commit's code and with the
  current code in two persistent workers, in interleaved rounds (ABBA), and compares wall-time
  tokens/s as the median over rounds of the per-round ratio, with a bootstrap interval over
  rounds and items; CPU time is the second signal (wall slower, CPU not: a wait). A figure fails
  when its ratio is below ``1 - --tolerance`` (0.90) *and* its whole interval lies below 1, twice:
  the first time beside the evaluation (each on one of CI's two cores), the second in fresh
  workers with twice the rounds once the evaluation has ended.
  Nothing recorded on another machine is ever compared, so a baseline recorded on one CPU type
  holds on any other. When the baseline commit is not in the clone (a shallow clone), the speed
  part says so in one line and the deterministic part still decides.

A baseline recorded with other settings (models, knobs, LIMIT, seed, threads or
checkpoint hashes) is never compared: exit 2, naming the setting. Exit codes: 0
no regression, 1 regression, 2 bad input (missing / corrupt / mismatched baseline).
The report (reports/regress.md, and reports/regress.json with every timing) gives
both versions' absolute tokens/s, the ratio and its interval, and the machine (CPU
model and flags); the baseline's recorded machine is kept for information only.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

from harness.run.presets import PRESETS, REGRESS_MODELS
from harness.run.store import atomic_save_figure, atomic_write_json, atomic_write_text, read_json
from harness.speed import ab

REPO = Path(__file__).resolve().parents[2]
BASELINE = REPO / "results" / "baseline" / "embedded.json"
HISTORY_NAME = "history.jsonl"
REPORT = REPO / "reports" / "regress.md"  # and regress.json beside it
TREND = REPO / "reports" / "trend.png"
TASK = "embedded"
# Per task: 4 x 3 kinds x 6 decoders. Every decoder still meets every kind; 12, then 6, made the evaluation the
# longest part of CI after the tests (2 min 40 s of a 3 min 40 s regress stage, then 2 min of 2 min 50 s, on a
# 2-core machine half as fast as the one the suite was tuned on, where CI came within 40 s of its hard limit).
LIMIT = 4
# Calls per task and model of the memory pass (the decode peak and retained bytes the check compares): one.
MEMORY_ITEMS = 1
SEED = 1234
# One torch thread, in the evaluation and in each A/B worker: greedy float32 tokens are the same at any
# thread count only for the same count, and one thread leaves a core to whatever else runs on a 2-core
# machine.
THREADS = 1
TOLERANCE = ab.TOLERANCE
# Rounds of the speed A/B: 4 (2 disjoint round pairs) rather than the runs' 10, so the A/B (one core) ends
# with the evaluation and its memory pass beside it (the other core); CI's time is the longer of the two. The
# A/B's time is mostly the slow decoders' single-item blocks (llada, dream: about a second each on a slow
# core), so it scales with the rounds, not with --ab-limit. A figure still fails only below 0.90 with its whole
# interval below 1, in two measurements: what 2 pairs can see is a clear slowdown, not a few percent.
ROUNDS = 4
# decode_peak_bytes / decode_retained_bytes: the memory pass's tensor bytes at a call's peak and at its end,
# exact on the CPU (harness/run/memory.py).
DETERMINISTIC = ("quality", "generated_tokens", "nfe", "tpf", "kv_peak_bytes", "decode_peak_bytes",
                 "decode_retained_bytes")


class RegressError(Exception):
    """Bad input: one line, exit 2."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def settings(models: tuple[str, ...] = REGRESS_MODELS, limit: int = LIMIT) -> dict:
    """Everything that must match for two runs to be comparable."""
    specs = [PRESETS[m] for m in models]
    ckpts = sorted({s.checkpoint for s in specs})
    return {
        "task": TASK, "limit": limit, "seed": SEED, "threads": THREADS, "memory_items": MEMORY_ITEMS,
        "models": [{"name": s.name, "decoder": s.decoder, "checkpoint": s.checkpoint, "knobs": dict(s.knobs)}
                   for s in specs],
        "checkpoint_sha256": {c: {f: _sha256(REPO / c / f) for f in ("config.json", "model.safetensors")}
                              for c in ckpts},
    }


def run_eval(cfg: dict, out: Path, run_id: str) -> Path:
    """The default evaluation through the runner (its own processes), at the fixed settings."""
    cmd = [sys.executable, "-m", "harness", "eval", "--task", cfg["task"], "--limit", str(cfg["limit"]),
           "--seed", str(cfg["seed"]), "--threads", str(cfg["threads"]), "--device", "cpu",
           "--models", ",".join(m["name"] for m in cfg["models"]), "--out", str(out), "--run-id", run_id,
           # The check reads the run's deterministic figures only; speed is the A/B's (timed in its own rounds).
           "--timing", "sequential", "--memory-items", str(MEMORY_ITEMS)]
    rc = subprocess.run(cmd, cwd=REPO).returncode
    if rc != 0:
        raise RuntimeError(f"evaluation failed (exit {rc}); resume with: {' '.join(cmd)}")
    return out / run_id


def figures(run_dir: Path) -> dict:
    """Deterministic figures per 'model/task' of a finished run, and its tokens/s (for information only:
    speed is judged by the A/B, never against a recorded figure)."""
    cfg = read_json(run_dir / "run.json")
    det, tps = {}, {}
    for m in cfg["models"]:
        for u in cfg["units"]:
            r = read_json(run_dir / "metrics" / f"{m['name']}__{u['name']}.json")
            s = r["speed"]
            det[f"{m['name']}/{u['name']}"] = {
                "quality": r["quality"].get(r["quality_primary"]) if r.get("quality_primary") else None,
                "generated_tokens": s["generated_tokens"]["total"], "nfe": s["nfe"]["total"],
                "tpf": s["tpf"]["ratio_of_sums"], "kv_peak_bytes": (r.get("memory") or {}).get("kv_peak_bytes"),
                "decode_peak_bytes": (r.get("memory") or {}).get("decode_peak_bytes"),
                "decode_retained_bytes": (r.get("memory") or {}).get("decode_retained_bytes")}
            tps[f"{m['name']}/{u['name']}"] = s["tokens_per_s"]["ratio_of_sums"]
    return {"deterministic": det, "tokens_per_s": tps}


def compare(base: dict, now: dict) -> list[dict]:
    """Rows of (figure, baseline, now, verdict) of the deterministic figures; failures first. A figure the
    baseline does not record (a baseline older than the figure) is not compared."""
    rows = []
    for key in sorted(set(base["deterministic"]) | set(now["deterministic"])):
        b, n = base["deterministic"].get(key, {}), now["deterministic"].get(key, {})
        for fig in DETERMINISTIC:
            if key in base["deterministic"] and fig not in b:
                continue
            ok = key in base["deterministic"] and key in now["deterministic"] and b.get(fig) == n.get(fig)
            rows.append({"figure": f"{key} {fig}", "baseline": b.get(fig), "now": n.get(fig),
                         "rule": "exact", "ok": ok})
    rows.sort(key=lambda r: r["ok"])  # stable: failures first, each group in name order
    return rows


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _machine_text(mach: dict) -> str:
    return (f"{mach.get('cpu')} ({mach.get('cpu_count')} cores; flags "
            f"{', '.join(mach.get('key_flags') or []) or '-'})")


def render(rows: list[dict], run_dir: Path, baseline_path: Path, speed: dict | None = None,
           recorded_on: dict | None = None) -> str:
    """The Markdown report: verdict, the speed A/B (machine, both versions' tokens/s, ratio and interval),
    then every deterministic figure. ``recorded_on``: the baseline's hardware, printed for information only
    (speed is never compared with a figure from it)."""
    speed_rows = (speed or {}).get("rows") or []
    bad = [r for r in rows if not r["ok"]] + [r for r in speed_rows if not r["ok"]]
    total = len(rows) + len(speed_rows)
    out = [f"# Regression check: {'FAIL' if bad else 'OK'} ({len(bad)} of {total} figures regressed)\n",
           f"Run `{run_dir}` against `{baseline_path}`. Deterministic figures must match exactly; speed is the "
           "current code against the baseline commit's, decoded in turn on this machine in this run.\n"]
    if speed is not None:
        mach = speed.get("machine") or {}
        out.append("## Speed: current code against the baseline commit, same machine, same run\n")
        out.append(f"Machine: {_machine_text(mach)}, {speed.get('threads')} thread(s) per worker. "
                   f"Baseline commit `{speed.get('baseline_commit')}`; {speed.get('limit')} items per kind, "
                   f"{speed.get('rounds')} interleaved rounds (ABBA), wall time with CPU time beside it; "
                   f"{speed.get('seconds')} s.\n")
        from harness.run.guard import busy_text

        g = speed.get("guard") or {}
        if g.get("available"):
            out.append(f"Machine load during the rounds: other processes {100 * g.get('others_cpu_share', 0):.0f}% of "
                       f"the CPU, steal {100 * g.get('steal_share', 0):.0f}%"
                       + (f" ({busy_text(g)}; the A/B's ratios pair the two sides round by round)" if g.get("busy")
                          else "") + ".\n")
        cg = speed.get("confirm_guard") or {}
        if cg.get("available"):
            out.append(f"Machine load during the confirmation (after the evaluation beside the first rounds had ended): "
                       f"other processes {100 * cg.get('others_cpu_share', 0):.0f}% of the CPU, steal "
                       f"{100 * cg.get('steal_share', 0):.0f}%.\n")
        if recorded_on:
            out.append(f"The baseline was recorded on {_machine_text(recorded_on)}: for information only, as "
                       "both code versions were timed here.\n")
        if speed.get("unavailable"):
            out.append(f"**Speed not checked:** {speed['unavailable']}.\n")
        elif speed_rows:
            out.append("| status | figure | baseline tok/s | current tok/s | current / baseline, wall (median over "
                       "rounds) | 95% interval | CPU-time ratio | rule |")
            out.append("|---|---|---|---|---|---|---|---|")
            for r in sorted(speed_rows, key=lambda r: r["ok"]):
                conf = r.get("confirm")
                again = (f"; again ({conf.get('rounds')} rounds): {_fmt(conf['ratio'])} [{_fmt(conf['lo'])}, "
                         f"{_fmt(conf['hi'])}]" if conf else "")
                what = f" ({r['slowdown']})" if r.get("slowdown") else ""
                out.append(f"| {'ok' if r['ok'] else 'FAIL'} | {r['figure']} | {_fmt(r['baseline_tps'])} | "
                           f"{_fmt(r['current_tps'])} | {_fmt(r['ratio'])}{what} | [{_fmt(r['lo'])}, {_fmt(r['hi'])}]"
                           f"{again} | {_fmt(r.get('cpu_ratio'))} | {r['rule']} |")
            out.append("")
    out.append("## Deterministic figures\n")
    lines = ["| status | figure | baseline | now | rule |", "|---|---|---|---|---|"]
    lines += [f"| {'ok' if r['ok'] else 'FAIL'} | {r['figure']} | {_fmt(r['baseline'])} | {_fmt(r['now'])} | "
              f"{r['rule']} |" for r in rows]
    return "\n".join(out) + "\n" + "\n".join(lines) + "\n"


def load_baseline(path: Path) -> dict:
    how = "create it with `make regress-update REASON=\"...\"`"
    if not path.is_file():
        raise RegressError(f"no baseline at {path}; {how}")
    try:
        data = read_json(path)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        for k in ("settings", "figures"):
            if k not in data:
                raise ValueError(f"missing {k!r}")
        if not isinstance(data["figures"].get("deterministic"), dict):
            raise ValueError("missing figures.deterministic")
    except (OSError, ValueError) as e:
        raise RegressError(f"baseline {path} is corrupt ({e}); {how}") from None
    return data


def check_settings(base: dict, now: dict, path: Path) -> None:
    for k in sorted(set(base) | set(now)):
        if base.get(k) != now.get(k):
            raise RegressError(f"baseline {path} was recorded with different {k} "
                               f"({json.dumps(base.get(k))[:200]} vs now {json.dumps(now.get(k))[:200]}); "
                               "not comparable: rerun `make regress-update REASON=\"...\"` on purpose")


def _git(*args: str) -> str | None:
    """stdout of a git command in the repository, stripped; None when git cannot answer."""
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _git_commit() -> str | None:
    return _git("rev-parse", "HEAD")


def changed(old: dict | None, new: dict) -> dict:
    """Flat {figure: [old, new]} of every deterministic figure that differs (every figure when there is no old)."""
    out = {}
    o, n = (old or {}).get("deterministic", {}), new["deterministic"]
    for key in sorted(set(o) | set(n)):
        for fig in DETERMINISTIC:
            a, b = (o.get(key) or {}).get(fig), (n.get(key) or {}).get(fig)
            if a != b or old is None:
                out[f"{key} {fig}"] = [a, b]
    return out


def trend(history_path: Path, out: Path) -> None:
    """Plot how quality and TPF moved across the baseline history (one point per update); the speed ratios
    of baselines recorded before the A/B (history lines that have them) are drawn too."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = [json.loads(line) for line in history_path.read_text().splitlines() if line.strip()]
    state: dict[str, float] = {}
    series: dict[str, list] = {}
    for i, e in enumerate(entries):
        for k, (_, v) in e["changed"].items():
            state[k] = v
        for k, v in state.items():
            if (k.endswith(" tpf") or k.endswith(" ratio") or k.endswith(" quality")) and v is not None:
                series.setdefault(k, []).append((i, v))
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, suffix, label in zip(axes, (" quality", " tpf", " ratio"),
                                 ("quality (fraction)", "tokens per forward", "tokens/s ratio in one run, before the A/B (x)")):
        for k, pts in sorted(series.items()):
            if k.endswith(suffix):
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=k.removesuffix(suffix))
        ax.set_xlabel("baseline update (history line)")
        ax.set_ylabel(label)
        ax.set_title(label.split(" (")[0])
        ax.set_xticks(range(len(entries)))
    handles, labels = axes[2].get_legend_handles_labels()
    if handles:
        axes[2].legend(fontsize=6, loc="best")
    fig.tight_layout()
    atomic_save_figure(fig, out)


def _parser(update: bool) -> argparse.ArgumentParser:
    prog = "python -m harness regress-update" if update else "python -m harness regress"
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default=str(BASELINE), help="baseline JSON (default: %(default)s)")
    p.add_argument("--out", default=str(REPO / "results" / "runs"), help="run folder parent (ignored by git)")
    p.add_argument("--run", default=None, help="use this finished run folder instead of running the evaluation")
    p.add_argument("--limit", type=int, default=LIMIT, help="documents per task (default: %(default)s)")
    p.add_argument("--models", default=",".join(REGRESS_MODELS), help="preset names (default: %(default)s)")
    p.add_argument("--report", default=str(REPORT), help="Markdown report, JSON beside it (default: %(default)s)")
    if update:
        p.add_argument("--reason", required=True, help="why the baseline changes (kept in history.jsonl)")
    else:
        p.add_argument("--tolerance", type=float, default=TOLERANCE,
                       help="a speed figure fails when its current / baseline tokens/s ratio is below 1 - this and "
                       "its whole 95%% interval below 1, twice (default: %(default)s)")
        p.add_argument("--rounds", type=int, default=ROUNDS,
                       help="timed rounds of the speed A/B (default: %(default)s)")
        p.add_argument("--ab-limit", type=int, default=ab.AB_LIMIT,
                       help="test items per embedded kind and preset in the speed A/B (default: %(default)s)")
        p.add_argument("--no-speed", dest="speed", action="store_false",
                       help="skip the speed A/B against the baseline commit (deterministic figures only)")
        p.add_argument("--no-confirm", dest="confirm", action="store_false",
                       help="fail a speed figure on its first interval, without measuring it again")
    return p


def _check_run(run_dir: Path, cfg: dict, models: tuple[str, ...]) -> None:
    """A finished run given with --run has the check's settings and models; RegressError says what differs."""
    ran = read_json(run_dir / "run.json") if (run_dir / "run.json").is_file() else None
    if ran is None:
        raise RegressError(f"{run_dir} is not a run folder (no run.json)")
    for k in ("limit", "seed", "threads"):
        if ran.get(k) != cfg[k]:
            raise RegressError(f"run {run_dir} used {k}={ran.get(k)}, the check needs {cfg[k]}")
    if [m["name"] for m in ran["models"]] != list(models):
        raise RegressError(f"run {run_dir} has models {[m['name'] for m in ran['models']]}, "
                           f"the check needs {list(models)}")


def _git_dirty() -> bool | None:
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status)


def _rewrite_baseline(baseline_path: Path, cfg: dict, base: dict | None, now: dict, reason: str) -> None:
    """`regress-update`: the new baseline (deterministic figures, the commit the speed A/B will check out, the
    machine for information), a history line (date, commit, reason, changed figures), the trend."""
    hist = baseline_path.with_name(HISTORY_NAME)
    entry = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "commit": _git_commit(),
             "reason": reason, "changed": changed(base["figures"] if base else None, now)}
    mach = ab.machine()
    atomic_write_json(baseline_path, {
        "settings": cfg, "figures": {"deterministic": now["deterministic"]}, "recorded": entry["date"],
        "commit": entry["commit"], "commit_had_uncommitted_changes": _git_dirty(), "reason": entry["reason"],
        "hardware": {k: mach[k] for k in ("cpu", "key_flags", "cpu_count", "platform")},
        "hardware_note": "for information only: speed is checked against this commit's code on the checking "
                         "machine (harness/speed/ab.py), never against figures recorded here",
        "tokens_per_s_for_information": now.get("tokens_per_s")})
    with open(hist, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    trend(hist, TREND)
    print(f"baseline {baseline_path} rewritten ({len(entry['changed'])} figures changed); "
          f"history {hist}; trend {TREND}")


def main(argv: list[str] | None = None, update: bool = False) -> int:
    ns = _parser(update).parse_args(argv)
    baseline_path = Path(ns.baseline)
    try:
        models = tuple(m.strip() for m in ns.models.split(",") if m.strip())
        unknown = [m for m in models if m not in PRESETS]
        if unknown or not models:
            from harness.run.hints import did_you_mean

            hint = did_you_mean(unknown[0], PRESETS) if unknown else ""
            raise RegressError(f"unknown preset(s) {', '.join(unknown) or '(none)'}{hint}; valid: {', '.join(PRESETS)}")
        if ns.limit < 1:
            raise RegressError(f"--limit must be >= 1, got {ns.limit}")
        if not update and ns.ab_limit < 1:
            raise RegressError(f"--ab-limit must be >= 1, got {ns.ab_limit}")
        if not update and ns.rounds < 2:
            raise RegressError(f"--rounds must be >= 2, got {ns.rounds}")
        if update and not ns.reason.strip():
            raise RegressError("--reason must say why the baseline changes")
        cfg = settings(models, ns.limit)
        base = None
        if not update:
            base = load_baseline(baseline_path)
            check_settings(base["settings"], cfg, baseline_path)
        elif baseline_path.is_file():
            try:
                base = load_baseline(baseline_path)
            except RegressError:
                base = None  # a corrupt baseline is being replaced on purpose
        if ns.run:
            run_dir = Path(ns.run)
            _check_run(run_dir, cfg, models)
    except RegressError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    speed = None
    run_speed = not update and ns.speed
    if run_speed:
        print(f"speed: current code against the baseline commit {str(base.get('commit'))[:12]}, "
              f"{ns.ab_limit} items per kind and preset", file=sys.stderr, flush=True)
    with ThreadPoolExecutor(max_workers=1) as pool:
        # The evaluation (one thread, its own processes) and the speed A/B (one thread, its two workers taking
        # turns) each keep one core of a 2-core machine busy: side by side they take the time of the longer.
        # Both A/B sides see the same neighbour, in alternating order, so the paired ratios stay fair.
        pending = None
        if not ns.run:
            run_id = "regress-" + _dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
            pending = pool.submit(run_eval, cfg, Path(ns.out), run_id)
        if run_speed:
            speed = ab.run(models, base.get("commit"), limit=ns.ab_limit, threads=THREADS, tolerance=ns.tolerance,
                           confirm=ns.confirm, progress=ns.run is not None, rounds=ns.rounds,
                           settle=None if pending is None else lambda: wait([pending]))
            print("speed not checked: " + speed["unavailable"] if speed.get("unavailable") else
                  f"speed A/B done in {speed['seconds']} s", file=sys.stderr, flush=True)
        if pending is not None:
            try:
                run_dir = pending.result()
            except RuntimeError as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
    now = figures(run_dir)
    if update:
        _rewrite_baseline(baseline_path, cfg, base, now, ns.reason.strip())
        return 0
    rows = compare(base["figures"], now)
    text = render(rows, run_dir, baseline_path, speed, base.get("hardware"))
    report = Path(ns.report)
    atomic_write_text(report, text)
    atomic_write_json(report.with_suffix(".json"), {"run": str(run_dir), "baseline": str(baseline_path),
                                                    "deterministic": rows, "speed": speed})
    print(text)
    speed_rows = (speed or {}).get("rows") or []
    for line in failing_lines(rows, speed_rows):  # again at the end: a log cut to its tail still names them
        print(line)
    bad = sum(not r["ok"] for r in rows) + sum(not r["ok"] for r in speed_rows)
    total = len(rows) + len(speed_rows)
    print(f"{'REGRESSION' if bad else 'ok'}: {bad} of {total} figures off the baseline; report {ns.report}")
    return 1 if bad else 0


def failing_lines(rows: list[dict], speed_rows: list[dict]) -> list[str]:
    """One line per failing figure (deterministic: baseline and now; speed: the ratio, its interval and the
    confirmation's), for the end of the output."""
    out = [f"FAIL {r['figure']}: baseline {_fmt(r['baseline'])}, now {_fmt(r['now'])}" for r in rows if not r["ok"]]
    for r in speed_rows:
        if not r["ok"]:
            conf = r.get("confirm") or {}
            again = f"; again {_fmt(conf.get('ratio'))} [{_fmt(conf.get('lo'))}, {_fmt(conf.get('hi'))}]" if conf else ""
            out.append(f"FAIL {r['figure']}: current / baseline {_fmt(r['ratio'])} [{_fmt(r['lo'])}, {_fmt(r['hi'])}]"
                       f"{again}")
    return out


def main_update(argv: list[str] | None = None) -> int:
    return main(argv, update=True)


if __name__ == "__main__":
    raise SystemExit(main())
