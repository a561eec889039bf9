"""`make regress` / `make regress-update`: CI regression tracking of quality and speed.

    python -m harness regress                         # run, compare with results/baseline/embedded.json
    python -m harness regress-update --reason "..."   # run, rewrite the baseline, append to history.jsonl

Both run the embedded evaluation of the default decoders plus Dream and D2F
(``REGRESS_MODELS``: every diffusion decoder, so a changed math figure of any of
them fails) on the committed tiny checkpoints at a fixed LIMIT, seed and thread
count, through the same runner as ``make eval``, into an ignored folder
(``results/runs/regress-*``).

What is compared, per (model, task):

- **deterministic figures, exactly**: quality, generated tokens, NFE and TPF.
  Greedy decoding in float32 on the CPU with a fixed thread count gives the same
  tokens every run, so any change here is a behaviour change, not noise;
- **speed, as ratios inside the run only**: tokens/s of every model divided by
  the AR model's (and fast_dllm by llada's) on the same task. A ratio more than
  ``--tolerance`` (20%) below the baseline's fails; a faster one passes. Since
  wall-clock time moves with whatever else the machine does, a ratio below the
  line is confirmed by a second run, and only a ratio below it in both fails.
  Absolute times are recorded but never compared (another machine, another day).

A baseline recorded with other settings (models, knobs, LIMIT, seed, threads or
checkpoint hashes) is never compared: exit 2, naming the setting. Exit codes: 0
no regression, 1 regression, 2 bad input (missing / corrupt / mismatched baseline).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from harness.run.presets import PRESETS, REGRESS_MODELS
from harness.run.store import atomic_save_figure, atomic_write_json, atomic_write_text, read_json

REPO = Path(__file__).resolve().parents[2]
BASELINE = REPO / "results" / "baseline" / "embedded.json"
HISTORY_NAME = "history.jsonl"
REPORT = REPO / "reports" / "regress.md"
TREND = REPO / "reports" / "trend.png"
TASK = "embedded"
LIMIT = 20
SEED = 1234
# One torch thread: on the 2-core CI machine with one CPU-bound process beside it, a one-thread run keeps
# a core of its own and its speed ratios stay put; two threads would wait for each other at every
# parallel region behind that process, and by different amounts per decoder (small AR steps more than
# LLaDA's full forwards), which moves the ratios the check compares.
THREADS = 1
TOLERANCE = 0.20
CONFIRM_PAUSE_S = 20  # let a passing disturbance end before the confirming run
DETERMINISTIC = ("quality", "generated_tokens", "nfe", "tpf")
# Speed ratios: numerator model -> denominator model (both must be in the run). Every model is
# also compared with the run's AR baseline.
EXTRA_RATIOS = (("fast_dllm", "llada"),)


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
        "task": TASK, "limit": limit, "seed": SEED, "threads": THREADS,
        "models": [{"name": s.name, "decoder": s.decoder, "checkpoint": s.checkpoint, "knobs": dict(s.knobs)}
                   for s in specs],
        "checkpoint_sha256": {c: {f: _sha256(REPO / c / f) for f in ("config.json", "model.safetensors")}
                              for c in ckpts},
    }


def run_eval(cfg: dict, out: Path, run_id: str) -> Path:
    """The default evaluation through the runner (its own processes), at the fixed settings."""
    cmd = [sys.executable, "-m", "harness", "eval", "--task", cfg["task"], "--limit", str(cfg["limit"]),
           "--seed", str(cfg["seed"]), "--threads", str(cfg["threads"]), "--device", "cpu",
           "--models", ",".join(m["name"] for m in cfg["models"]), "--out", str(out), "--run-id", run_id]
    rc = subprocess.run(cmd, cwd=REPO).returncode
    if rc != 0:
        raise RuntimeError(f"evaluation failed (exit {rc}); resume with: {' '.join(cmd)}")
    return out / run_id


def figures(run_dir: Path) -> dict:
    """Deterministic figures per 'model/task' and speed ratios per 'num/den/task' of a finished run."""
    cfg = read_json(run_dir / "run.json")
    base = cfg.get("baseline")
    det, tps = {}, {}
    for m in cfg["models"]:
        for u in cfg["units"]:
            p = run_dir / "metrics" / f"{m['name']}__{u['name']}.json"
            r = read_json(p)
            s = r["speed"]
            det[f"{m['name']}/{u['name']}"] = {
                "quality": r["quality"].get(r["quality_primary"]) if r.get("quality_primary") else None,
                "generated_tokens": s["generated_tokens"]["total"], "nfe": s["nfe"]["total"],
                "tpf": s["tpf"]["ratio_of_sums"]}
            tps[(m["name"], u["name"])] = s["tokens_per_s"]["ratio_of_sums"]
    names = [m["name"] for m in cfg["models"]]
    pairs = [(n, base) for n in names if base and n != base] + [p for p in EXTRA_RATIOS if set(p) <= set(names)]
    ratios, absolute = {}, {}
    for num, den in pairs:
        for u in cfg["units"]:
            a, b = tps[(num, u["name"])], tps[(den, u["name"])]
            ratios[f"{num}/{den}/{u['name']}"] = a / b if a and b else None
    for (name, task), v in tps.items():
        absolute[f"{name}/{task}"] = v
    return {"deterministic": det, "ratios": ratios, "tokens_per_s": absolute}


def compare(base: dict, now: dict, tolerance: float = TOLERANCE) -> list[dict]:
    """Rows of (figure, baseline, now, verdict); failures first."""
    rows = []
    for key in sorted(set(base["deterministic"]) | set(now["deterministic"])):
        b, n = base["deterministic"].get(key, {}), now["deterministic"].get(key, {})
        for fig in DETERMINISTIC:
            ok = key in base["deterministic"] and key in now["deterministic"] and b.get(fig) == n.get(fig)
            rows.append({"figure": f"{key} {fig}", "baseline": b.get(fig), "now": n.get(fig),
                         "rule": "exact", "ok": ok})
    for key in sorted(set(base["ratios"]) | set(now["ratios"])):
        b, n = base["ratios"].get(key), now["ratios"].get(key)
        ok = b is not None and n is not None and n >= (1 - tolerance) * b
        if b is None and n is None:
            ok = True
        rows.append({"figure": f"{key} tokens/s ratio", "baseline": b, "now": n,
                     "rule": f">= {1 - tolerance:.2f} x baseline", "ok": ok})
    rows.sort(key=lambda r: r["ok"])  # stable: failures first, each group in name order
    return rows


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def render(rows: list[dict], run_dir: Path, baseline_path: Path) -> str:
    bad = [r for r in rows if not r["ok"]]
    head = (f"# Regression check: {'FAIL' if bad else 'OK'} ({len(bad)} of {len(rows)} figures regressed)\n\n"
            f"Run `{run_dir}` against `{baseline_path}`. Deterministic figures must match exactly; "
            f"tokens/s ratios inside the run may not fall more than {TOLERANCE:.0%} below the baseline's.\n\n")
    lines = ["| status | figure | baseline | now | rule |", "|---|---|---|---|---|"]
    lines += [f"| {'ok' if r['ok'] else 'FAIL'} | {r['figure']} | {_fmt(r['baseline'])} | {_fmt(r['now'])} | "
              f"{r['rule']} |" for r in rows]
    return head + "\n".join(lines) + "\n"


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
        for k in ("deterministic", "ratios"):
            if not isinstance(data["figures"].get(k), dict):
                raise ValueError(f"missing figures.{k}")
    except (OSError, ValueError) as e:
        raise RegressError(f"baseline {path} is corrupt ({e}); {how}") from None
    return data


def check_settings(base: dict, now: dict, path: Path) -> None:
    for k in sorted(set(base) | set(now)):
        if base.get(k) != now.get(k):
            raise RegressError(f"baseline {path} was recorded with different {k} "
                               f"({json.dumps(base.get(k))[:200]} vs now {json.dumps(now.get(k))[:200]}); "
                               "not comparable: rerun `make regress-update REASON=\"...\"` on purpose")


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def changed(old: dict | None, new: dict) -> dict:
    """Flat {figure: [old, new]} of every figure that differs (every figure when there is no old)."""
    out = {}
    for group in ("deterministic", "ratios"):
        o, n = (old or {}).get(group, {}), new[group]
        for key in sorted(set(o) | set(n)):
            if group == "deterministic":
                for fig in DETERMINISTIC:
                    a, b = (o.get(key) or {}).get(fig), (n.get(key) or {}).get(fig)
                    if a != b or old is None:
                        out[f"{key} {fig}"] = [a, b]
            elif o.get(key) != n.get(key) or old is None:
                out[f"{key} ratio"] = [o.get(key), n.get(key)]
    return out


def trend(history_path: Path, out: Path) -> None:
    """Plot how TPF and the speed ratios moved across the baseline history (one point per update)."""
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
                                 ("quality (fraction)", "tokens per forward", "tokens/s ratio (x)")):
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
    p.add_argument("--report", default=str(REPORT), help="Markdown report (default: %(default)s)")
    if update:
        p.add_argument("--reason", required=True, help="why the baseline changes (kept in history.jsonl)")
    else:
        p.add_argument("--tolerance", type=float, default=TOLERANCE,
                       help="allowed fall of a speed ratio below the baseline's (default: %(default)s)")
        p.add_argument("--no-confirm", dest="confirm", action="store_false",
                       help="fail on the first run's speed ratios without a confirming second run")
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


def _rewrite_baseline(baseline_path: Path, cfg: dict, base: dict | None, now: dict, reason: str) -> None:
    """`regress-update`: the new baseline, a history line (date, commit, reason, changed figures), the trend."""
    hist = baseline_path.with_name(HISTORY_NAME)
    entry = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "commit": _git_commit(),
             "reason": reason, "changed": changed(base["figures"] if base else None, now)}
    atomic_write_json(baseline_path, {"settings": cfg, "figures": now, "recorded": entry["date"],
                                      "commit": entry["commit"], "reason": entry["reason"]})
    with open(hist, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    trend(hist, TREND)
    print(f"baseline {baseline_path} rewritten ({len(entry['changed'])} figures changed); "
          f"history {hist}; trend {TREND}")


def _confirmed(base_figures: dict, now: dict, again: dict, tolerance: float) -> list[dict]:
    """Rows of two runs together: each speed ratio at the better of the two; exact figures must agree."""
    best = {k: max((v for v in (now["ratios"].get(k), again["ratios"].get(k)) if v is not None), default=None)
            for k in set(now["ratios"]) | set(again["ratios"])}
    det = now["deterministic"] if now["deterministic"] == again["deterministic"] else again["deterministic"]
    rows = compare(base_figures, {"deterministic": det, "ratios": best}, tolerance)
    if now["deterministic"] != again["deterministic"]:
        rows.insert(0, {"figure": "deterministic figures differ between the two runs", "baseline": None,
                        "now": None, "rule": "exact", "ok": False})
    return rows


def main(argv: list[str] | None = None, update: bool = False) -> int:
    ns = _parser(update).parse_args(argv)
    baseline_path = Path(ns.baseline)
    try:
        models = tuple(m.strip() for m in ns.models.split(",") if m.strip())
        unknown = [m for m in models if m not in PRESETS]
        if unknown or not models:
            raise RegressError(f"unknown preset(s) {', '.join(unknown) or '(none)'}; valid: {', '.join(PRESETS)}")
        if ns.limit < 1:
            raise RegressError(f"--limit must be >= 1, got {ns.limit}")
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
    if not ns.run:
        run_id = "regress-" + _dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        try:
            run_dir = run_eval(cfg, Path(ns.out), run_id)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    now = figures(run_dir)
    if update:
        _rewrite_baseline(baseline_path, cfg, base, now, ns.reason.strip())
        return 0
    rows = compare(base["figures"], now, ns.tolerance)
    slow = [r for r in rows if not r["ok"] and r["rule"] != "exact"]
    if slow and not ns.run and ns.confirm:
        # Wall-clock ratios move with whatever else the machine does (another VM on the host, disk
        # writeback after a test run): a real slowdown must show again in a second run; a ratio
        # counts as regressed only when both runs are below the line. Exact figures must match in both.
        print(f"{len(slow)} speed ratio(s) below the line; confirming with a second run", file=sys.stderr)
        time.sleep(CONFIRM_PAUSE_S)
        try:
            again = figures(run_eval(cfg, Path(ns.out), run_id + "-confirm"))
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        rows = _confirmed(base["figures"], now, again, ns.tolerance)
    text = render(rows, run_dir, baseline_path)
    atomic_write_text(Path(ns.report), text)
    print(text)
    bad = sum(not r["ok"] for r in rows)
    print(f"{'REGRESSION' if bad else 'ok'}: {bad} of {len(rows)} figures off the baseline; report {ns.report}")
    return 1 if bad else 0


def main_update(argv: list[str] | None = None) -> int:
    return main(argv, update=True)


if __name__ == "__main__":
    raise SystemExit(main())
