"""`python -m harness merge` / `make merge`: the shards of one run (``--shard I/N``, one run folder each,
e.g. the jobs of a Slurm array) joined into one run folder, as if one job had run every document.

    python -m harness merge --run s1,s2,s3 --runs-root results/table1 --run-id table1

Refused, with one ``error:`` line naming the runs and what differs, before anything is written: runs that
are not shards, shards of different settings (models and knobs, dtype, prompts, LIMIT, seed, tasks and
their data, ...), shards of different N, a shard given twice (overlap) or missing, an unfinished shard.
The merged run's per-sample logs are the shards' together; its quality is the mean over every sample
(lm-eval's mean metrics, and its size-weighted group means, are exactly that), its speed figures are
recomputed from the samples with the same rules (harness/run/metrics.py), and the speedups and the summary
come from the runner's own ``finalize``. ``make report RUN=<merged run>`` then reports it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import sys
from pathlib import Path

from harness.run.metrics import aggregate, withheld_verdicts
from harness.run.store import atomic_dir, atomic_write_json, atomic_write_jsonl, read_json

# Settings every shard of one run shares (the runner's resume keys, less the shard itself, plus prompts).
EXTRA_KEYS = ("prompts", "tasks_dir", "tasks_dirs")


class InputError(Exception):
    """Shards that cannot be joined: one line, exit 2, nothing written."""


def _settings(cfg: dict) -> dict:
    from harness.run.run_dir import RESUME_KEYS

    out = {k: cfg.get(k) for k in (*RESUME_KEYS, *EXTRA_KEYS) if k != "shard"}
    # The documents are the data: the per-leaf counts and hash must agree, the shard's own count not.
    out["units"] = [{k: v for k, v in u.items() if k != "samples"} for u in cfg.get("units") or []]
    return out


def _env(cfg: dict, key: str) -> str:
    return str((cfg.get("environment") or {}).get(key))


def _by_value(runs: list[tuple[Path, dict]], key: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for d, cfg in runs:
        out.setdefault(_env(cfg, key), []).append(d.name)
    return out


def mixed_text(runs: list[tuple[Path, dict]], key: str = "hardware") -> str:
    """``hwA (s1, s3); hwB (s2)``: which shards ran on which hardware (or commit)."""
    return "; ".join(f"{v} ({', '.join(names)})" for v, names in _by_value(runs, key).items())


def check_shards(dirs: list[Path], allow_mixed: bool = False) -> list[tuple[Path, dict]]:
    """Read and cross-check the shards; InputError naming the runs and what is wrong. Shards that ran on
    different hardware or at different commits are refused unless ``allow_mixed``: tokens/s of one merged
    row would mix them."""
    runs = []
    for d in dirs:
        if not (d / "run.json").is_file():
            raise InputError(f"{d}: not a run folder (no run.json)")
        cfg = read_json(d / "run.json")
        if not cfg.get("shard"):
            raise InputError(f"{d}: not a shard (run without --shard I/N); only shards of one run are merged")
        runs.append((d, cfg))
    first_dir, first = runs[0]
    counts = sorted({c["shard"]["count"] for _, c in runs})
    if len(counts) > 1:
        given = ", ".join(f"{d.name}: {c['shard']['index']}/{c['shard']['count']}" for d, c in runs)
        raise InputError(f"shards of different N ({given})")
    base = _settings(first)
    for d, cfg in runs[1:]:
        mine = _settings(cfg)
        diff = [("data (documents or their hash)" if k == "units" else k) for k in base if base[k] != mine[k]]
        if diff:
            raise InputError(f"shards {first_dir.name} and {d.name} have different settings ({', '.join(diff)}); "
                             "only shards of one command are merged")
    if not allow_mixed:
        for key, what in (("hardware", "hardware"), ("git_commit", "commits")):
            if len(_by_value(runs, key)) > 1:
                raise InputError(f"the shards ran on different {what} ({mixed_text(runs, key)}): a merged row's "
                                 "tokens/s would mix them; rerun those shards alike, or pass --allow-mixed to merge "
                                 f"anyway (the report then names the {what} per row)")
    n = counts[0]
    where: dict[int, list[str]] = {}
    for d, cfg in runs:
        where.setdefault(cfg["shard"]["index"], []).append(d.name)
    twice = {i: names for i, names in where.items() if len(names) > 1}
    if twice:
        raise InputError("overlapping shards: " + "; ".join(f"shard {i}/{n} given twice ({', '.join(names)})"
                                                            for i, names in sorted(twice.items())))
    missing = [i for i in range(1, n + 1) if i not in where]
    if missing:
        raise InputError(f"missing shard(s) {', '.join(f'{i}/{n}' for i in missing)} (given: "
                         + ", ".join(f"{i}/{n} in {names[0]}" for i, names in sorted(where.items())) + ")")
    for d, cfg in runs:
        for m in cfg["models"]:
            for u in cfg["units"]:
                if not (d / "metrics" / f"{m['name']}__{u['name']}.json").is_file():
                    raise InputError(f"shard {d.name} is unfinished (no metrics/{m['name']}__{u['name']}.json); "
                                     "resume it with its --run-id first")
    return sorted(runs, key=lambda r: r[1]["shard"]["index"])


def _rows(runs: list[tuple[Path, dict]], model: str, unit: str) -> list[dict]:
    rows = []
    for d, _ in runs:
        p = d / "models" / model / "samples" / f"{unit}.jsonl"
        if p.is_file():
            rows += [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    return sorted(rows, key=lambda r: (r["task"], r["doc_id"], r.get("filter") or ""))


def _pooled_quality(rows: list[dict], shard_mets: list[dict]) -> dict:
    """Mean of every per-sample metric over all samples (``metric,filter`` as lm-eval names it); a figure the
    samples do not carry is the shards' mean weighted by their sample counts."""
    sums: dict[str, list[float]] = {}
    for r in rows:
        for k, v in (r.get("metrics") or {}).items():
            if isinstance(v, (int, float)):
                sums.setdefault(f"{k},{r.get('filter') or 'none'}", []).append(float(v))
    out = {}
    for key in shard_mets[0].get("quality") or {}:
        if key in sums:
            out[key] = sum(sums[key]) / len(sums[key])
            continue
        weights = [((m.get("speed") or {}).get("samples") or 0, (m.get("quality") or {}).get(key)) for m in shard_mets]
        weights = [(w, v) for w, v in weights if v is not None]
        total = sum(w for w, _ in weights)
        out[key] = sum(w * v for w, v in weights) / total if total else None
    return out


def _merged_metrics(runs: list[tuple[Path, dict]], model: str, unit: str, rows: list[dict], run_id: str) -> dict:
    mets = [read_json(d / "metrics" / f"{model}__{unit}.json") for d, _ in runs]
    seen, decoded = set(), []
    for r in rows:  # one row per lm-eval filter of a document; each document decoded once
        if r.get("generated_tokens") is not None and (r["task"], r["doc_id"]) not in seen:
            seen.add((r["task"], r["doc_id"]))
            decoded.append(r)
    speed = aggregate(decoded)
    memory = {k: max((v for v in ((m.get("memory") or {}).get(k) for m in mets) if isinstance(v, (int, float))),
                     default=None) for k in (mets[0].get("memory") or {}) if k != "peak_rss_by_rank"}
    requests = {k: sum((m.get("requests") or {}).get(k, 0) for m in mets) for k in (mets[0].get("requests") or {})}
    failed = sorted((f for m in mets for f in (m.get("failed") or {}).get("items", [])),
                    key=lambda f: (f["task"], str(f["doc_id"])))
    return {**mets[0], "quality": _pooled_quality(rows, mets), "failed": {"count": len(failed), "items": failed},
            "sandbox_withheld": withheld_verdicts(rows),
            "speed": {k: v for k, v in speed.items() if k != "memory"}, "memory": memory, "requests": requests,
            "run": {**(mets[0].get("run") or {}), "run_id": run_id},
            "merged_from": [m.get("run", {}).get("run_id") for m in mets]}


def merge(dirs: list[Path], target: Path, allow_mixed: bool = False) -> Path:
    """Check the shards, then write the merged run folder ``target`` (swapped in whole) and its summary.

    The merged run is described as merged from N shards, never as sessions of one resumed run: its
    ``sessions`` is one entry (every model), each shard's own sessions stay under ``merged_from``. Mixed
    hardware (``allow_mixed``) is recorded as the run's hardware, naming each kind's shards."""
    runs = check_shards(dirs, allow_mixed)
    first = runs[0][1]
    units = [{**u, "samples": sum(next(x for x in c["units"] if x["name"] == u["name"]).get("samples") or 0
                                   for _, c in runs)} for u in first["units"]]
    hardware = sorted({_env(c, "hardware") for _, c in runs})
    env = dict(first.get("environment") or {})
    if len(hardware) > 1:
        env["hardware"] = f"mixed: {mixed_text(runs)}"
    if len({_env(c, "git_commit") for _, c in runs}) > 1:
        env["git_commit"] = f"mixed: {mixed_text(runs, 'git_commit')}"
    created = _dt.datetime.now().isoformat(timespec="seconds")
    cfg = {**first, "run_id": target.name, "shard": None, "units": units, "created": created, "environment": env,
           "merged_from": [{"run_id": c.get("run_id"), "dir": str(d), "shard": c["shard"],
                            "hardware": (c.get("environment") or {}).get("hardware"),
                            "git_commit": (c.get("environment") or {}).get("git_commit"),
                            "sessions": c.get("sessions") or []} for d, c in runs],
           "sessions": [{"started": created, "models": [m["name"] for m in first["models"]], "merged": len(runs)}]}
    with atomic_dir(target) as tmp:
        atomic_write_json(tmp / "run.json", cfg)
        for m in first["models"]:
            for u in first["units"]:
                rows = _rows(runs, m["name"], u["name"])
                atomic_write_jsonl(tmp / "models" / m["name"] / "samples" / f"{u['name']}.jsonl", rows)
                atomic_write_json(tmp / "metrics" / f"{m['name']}__{u['name']}.json",
                                  _merged_metrics(runs, m["name"], u["name"], rows, target.name))
            atomic_write_json(tmp / "models" / m["name"] / "done.json", {"merged_from": [d.name for d, _ in runs]})
    from harness.run.finalize import finalize

    finalize(target)
    if len(hardware) > 1:
        print(f"warning: --allow-mixed: the shards ran on different hardware ({mixed_text(runs)}): tokens/s of the "
              "merged run mixes them", file=sys.stderr)
    return target


def shard_status(dirs: list[Path]) -> tuple[list[str], bool]:
    """One line per shard of the run: done, unfinished (which (model, task) metrics are missing) or missing
    (no run folder, or an index 1..N none of the given folders holds); and whether every shard is done.
    Does not stop at the first problem."""
    lines, counts, seen, ok = [], set(), {}, True
    for d in dirs:
        if not (d / "run.json").is_file():
            lines.append(f"{d.name}: missing (no run folder with a run.json at {d})")
            ok = False
            continue
        cfg = read_json(d / "run.json")
        sh = cfg.get("shard") or {}
        if sh:
            counts.add(sh["count"])
            seen.setdefault(sh["index"], []).append(d.name)
        todo = [f"{m['name']}__{u['name']}" for m in cfg.get("models") or [] for u in cfg.get("units") or []
                if not (d / "metrics" / f"{m['name']}__{u['name']}.json").is_file()]
        label = f"shard {sh['index']}/{sh['count']}" if sh else "not a shard"
        total = len(cfg.get("models") or []) * len(cfg.get("units") or [])
        if todo:
            ok = False
            lines.append(f"{d.name}: {label}, unfinished ({total - len(todo)}/{total} (model, task) done; next: "
                         f"{todo[0]}); resume it with its --run-id")
        else:
            lines.append(f"{d.name}: {label}, done")
    for n in sorted(counts):
        for i in range(1, n + 1):
            if i not in seen:
                ok = False
                lines.append(f"shard {i}/{n}: missing (none of the given runs)")
    twice = {i: names for i, names in seen.items() if len(names) > 1}
    for i, names in sorted(twice.items()):
        ok = False
        lines.append(f"shard {i}: given twice ({', '.join(names)})")
    if len(counts) > 1:
        ok = False
        lines.append(f"shards of different N ({', '.join(map(str, sorted(counts)))})")
    done = sum(1 for ln in lines if ln.endswith(", done"))
    lines.append(f"{done} of {max(counts, default=len(dirs))} shard(s) done" + ("" if ok else "; not ready to merge"))
    return lines, ok


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness merge", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="the shards: run folders or ids under --runs-root, comma-separated")
    p.add_argument("--runs-root", default="results/runs", help="where run ids are looked up (default: %(default)s)")
    p.add_argument("--run-id", default=None, help="name of the merged run folder, under --runs-root (required "
                   "unless --status)")
    p.add_argument("--allow-mixed", action="store_true",
                   help="merge shards that ran on different hardware or commits (refused otherwise); the report "
                   "names the hardware per row")
    p.add_argument("--status", action="store_true",
                   help="list each shard as done, unfinished or missing and exit (0: all done, 1: not yet); "
                   "writes nothing (make shards-status)")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    root = Path(ns.runs_root)
    try:
        names = [t.strip() for t in ns.run.split(",") if t.strip()]
        dirs = [Path(t) if Path(t).is_dir() else root / t for t in names]
        if not dirs:
            raise InputError("--run: no shard given")
        if ns.status:
            lines, ok = shard_status(dirs)
            print("\n".join(lines))
            return 0 if ok else 1
        if ns.run_id is None:
            raise InputError("--run-id: the merged run's name is required (NAME=... under make)")
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", ns.run_id):
            raise InputError(f"--run-id {ns.run_id!r} may only use letters, digits, '_', '.', '-'")
        target = root / ns.run_id
        if target.exists():
            raise InputError(f"{target} exists; choose another --run-id")
        merge(dirs, target, ns.allow_mixed)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"merged {len(dirs)} shard(s) into {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
