"""Runs read for a report: one or more run folders, cross-checked, as table rows.

``load_runs`` turns run folders into a ``RunSet``: one row per model, except where merging would
hide or mix measurements (docs in ``RunSet``); every metrics file keyed by (row label, task), with
the run it came from and the device it decoded on. ``resolve_runs`` reads ``RUN=a,b`` (each item
optionally ``label=run``). Used by ``harness report``, ``harness compare`` and ``harness sweep``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from harness.run.store import read_json

# Settings that must agree when two runs measured the same model / (model, task).
MODEL_KEYS = ("checkpoint", "decoder", "knobs")
TASK_KEYS = ("limit", "seed", "chat_template", "device", "batch_size", "task_defaults")


class InputError(Exception):
    """Bad user input: one line, exit 2, nothing written."""


PAPER_ROW = " [paper prompts]"  # suffix of a row measured with the authors' prompts beside a stock-prompt one


@dataclass
class RunSet:
    runs: list[dict]  # run.json of each run, plus "dir" and "label" (the run id, or the label given)
    # One entry per table row: the run.json model entry plus "name" (the row label), "model" (its
    # name in the run), "run_id" (first run), "prompts" (stock / paper). A model is one row unless
    # runs measured it with other settings (then one row per run, "model@run") or with both prompt
    # variants (then "model" and "model [paper prompts]"), so no average mixes the two.
    models: list[dict]
    metrics: dict[tuple[str, str], dict] = field(default_factory=dict)  # (row label, unit) -> metrics JSON
    missing: list[tuple[str, str, str]] = field(default_factory=list)  # (row label, unit, run dir)
    notes: list[str] = field(default_factory=list)

    @property
    def baseline(self) -> str | None:
        """The AR reference: the first run's baseline, else the first model decoded with ``ar``."""
        for r in self.runs:
            if r.get("baseline"):
                return r["baseline"]
        plain = [m["model"] for m in self.models if m["decoder"] == "ar" and not m.get("engine")]
        return next(iter(plain), next((m["model"] for m in self.models if m["decoder"] == "ar"), None))

    @property
    def merged(self) -> bool:
        return len(self.runs) > 1

    def why_not_comparable(self, run_a: str | None, run_b: str | None) -> str | None:
        """None when cells of the two runs (by run id) may be divided: the same run, or runs with the same
        hardware, dtype and batch size; else the reason, one line."""
        if run_a == run_b:
            return None
        by_id = {(r.get("run_id") or Path(r["dir"]).name): r for r in self.runs}
        if run_a not in by_id or run_b not in by_id:
            return f"run {run_a if run_a not in by_id else run_b} unknown"
        return not_comparable(by_id[run_a], by_id[run_b])


# The help of the options whose meaning differs between `harness report` and `harness compare`.
OPTION_HELP = {
    "report": {
        "run": "run folder or run id, or a comma list to merge, each optionally label=run (the label names the run's "
               "rows when a model differs between runs) (default: the newest run under --runs-root)",
        "name": "report folder name (default: the run id(s) joined by '+')",
        "allow_partial": "report an unfinished run, missing cells marked"},
    "compare": {
        "run": "two or more run folders or ids, comma-separated, each optionally label=run; ratios are to the first "
               "(default: the two newest runs under --runs-root)",
        "name": "folder name (default: compare-<run>-vs-<run>)",
        "allow_partial": "compare unfinished runs, missing cells marked"},
}


def run_parser(command: str, description: str):
    """The parser of `harness report` or `harness compare`: the runs (--run, --runs-root) and where the output
    goes (--out, --name, --allow-partial)."""
    import argparse

    helps = OPTION_HELP[command]
    p = argparse.ArgumentParser(prog=f"python -m harness {command}", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default=None, help=helps["run"])
    p.add_argument("--runs-root", default="results/runs", help="where run ids are looked up (default: %(default)s)")
    p.add_argument("--out", default="reports", help="reports folder (default: %(default)s)")
    p.add_argument("--name", default=None, help=helps["name"])
    p.add_argument("--allow-partial", action="store_true", help=helps["allow_partial"])
    return p


def resolve_run(text: str, root: Path) -> Path:
    for p in (Path(text), root / text):
        if p.is_dir():
            if not (p / "run.json").is_file():
                raise InputError(f"{p}: not a run folder (no run.json)")
            return p
    raise InputError(f"run {text!r}: no such folder (looked for {text} and {root / text})")


def resolve_runs(text: str | None, root: Path, newest: int = 1) -> tuple[list[Path], list[str | None]]:
    """``RUN`` -> run folders and their labels: a comma list of run ids or folders, each optionally
    ``label=run``; without it the ``newest`` runs under ``root`` (oldest first)."""
    items = [t.strip() for t in (text or "").split(",") if t.strip()]
    if not items:
        return newest_runs(root, newest), [None] * newest
    dirs, labels = [], []
    for item in items:
        label, eq, run = item.partition("=")
        if eq and not (Path(item).is_dir() or (root / item).is_dir()):
            if not re.fullmatch(r"[A-Za-z0-9_.\-]+", label):
                raise InputError(f"run label {label!r} may only use letters, digits, '_', '.', '-'")
            dirs.append(resolve_run(run, root))
            labels.append(label)
        else:
            dirs.append(resolve_run(item, root))
            labels.append(None)
    if len({d.resolve() for d in dirs}) != len(dirs):
        raise InputError(f"run given twice in {text!r}")
    given = [x for x in labels if x]
    if len(set(given)) != len(given):
        raise InputError(f"run label given twice in {text!r}")
    return dirs, labels


def newest_runs(root: Path, k: int = 1) -> list[Path]:
    runs = [p for p in root.glob("*/run.json")] if root.is_dir() else []
    if len(runs) < k:
        raise InputError(f"{root}: {'no run folder' if not runs else f'only {len(runs)} run folder(s)'} there "
                         f"(run `make eval` first, or give RUN=<run dir>{',<run dir>' * (k - 1)})")

    def created(p: Path) -> tuple[str, float]:
        try:
            return (str(read_json(p).get("created") or ""), p.stat().st_mtime)
        except (OSError, ValueError):
            return ("", p.stat().st_mtime)

    return [p.parent for p in sorted(runs, key=created)[-k:]]


def newest_run(root: Path) -> Path:
    return newest_runs(root, 1)[0]


def _read(path: Path) -> dict:
    try:
        return read_json(path)
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: unreadable ({type(e).__name__}: {e})".replace("\n", " ")) from None


def _task_settings(cfg: dict, model: dict, unit: dict) -> dict:
    leaves = unit.get("leaves") or [unit["name"]]
    tk = model.get("task_knobs") or {}
    return {**{k: model.get(k) for k in MODEL_KEYS}, **{k: cfg.get(k) for k in TASK_KEYS},
            "task_knobs": {leaf: tk[leaf] for leaf in leaves if leaf in tk},
            "chat_template_args": model.get("chat_template_args", cfg.get("chat_template_args") or {})}


def prompt_variant(cfg: dict, unit: str) -> str:
    """``paper`` for the authors' prompt variant of a task or any task of a ``--prompts paper`` run
    (whose responses are cut at the first python fence), else ``stock``."""
    from tasks.info import PAPER_TASKS

    return "paper" if cfg.get("prompts") == "paper" or unit in PAPER_TASKS else "stock"


def device_text(cfg: dict) -> str:
    """Where a run decoded: the GPU's name, or ``cpu (k threads)``."""
    env = cfg.get("environment") or {}
    if str(env.get("hardware") or "").startswith("mixed: "):  # shards merged with --allow-mixed
        return str(env["hardware"])
    dev = str(cfg.get("device") or env.get("device") or "?")
    if dev.startswith("cuda"):
        return str(env.get("gpu") or dev)
    threads = cfg.get("threads") or env.get("threads_per_process")
    return f"{dev} ({threads} threads)" if threads else dev


def speed_setting(cfg: dict) -> dict:
    """What decides a run's tokens/s besides the model: the hardware (the GPU, or the CPU and its threads
    per process; run.json's ``environment.hardware``, derived for runs recorded before it), the dtype and
    the batch size. Two runs with equal settings give comparable tokens/s, so speedups across them hold."""
    env = cfg.get("environment") or {}
    dev = str(cfg.get("device") or env.get("device") or "?")
    hw = env.get("hardware")
    if not hw:
        threads = cfg.get("threads") or env.get("threads_per_process")
        hw = env.get("gpu") if dev.startswith("cuda") else f"{env.get('cpu')}, {threads} thread(s) per process"
    return {"hardware": hw or dev, "dtype": cfg.get("dtype", "float32"), "batch_size": cfg.get("batch_size", 1)}


def not_comparable(a: dict, b: dict) -> str | None:
    """Why tokens/s of run ``a`` and run ``b`` are not comparable (one line), or None when they are."""
    sa, sb = speed_setting(a), speed_setting(b)
    diff = [f"{k} {sa[k]} vs {sb[k]}" for k in sa if sa[k] != sb[k]]
    if not diff:
        return None
    ida, idb = a.get("run_id") or "?", b.get("run_id") or "?"
    return f"runs {ida} and {idb} differ in " + "; ".join(diff)


def _split_models(cfgs: list[tuple[Path, dict]]) -> dict[str, str]:
    """Model names that get one row per run -> why: measured with other settings in different runs,
    or the same task measured in more than one run (both measurements stay visible, each beside its
    own run's references). Every other model is one row across the runs."""
    specs: dict[str, dict] = {}
    cells: dict[tuple[str, str, str], dict] = {}
    why: dict[str, set[str]] = {}
    for d, cfg in cfgs:
        for m in cfg["models"]:
            spec = {k: m.get(k) for k in MODEL_KEYS}
            prev_spec = specs.setdefault(m["name"], spec)
            why.setdefault(m["name"], set()).update(k for k in MODEL_KEYS if prev_spec[k] != spec[k])
            for u in cfg["units"]:
                key = (m["name"], prompt_variant(cfg, u["name"]), u["name"])
                settings = _task_settings(cfg, m, u)
                if key in cells:
                    prev = cells[key]
                    diff = {k for k in settings if prev.get(k) != settings[k]}
                    why[m["name"]].update(diff or {f"the same task ({u['name']}) measured in both"})
                cells.setdefault(key, settings)
    def text(ks: set[str]) -> str:
        keys = sorted(k for k in ks if " " not in k)
        return "; ".join([*([f"other settings ({', '.join(keys)})"] if keys else []),
                          *sorted(k for k in ks if " " in k)])

    return {name: text(ks) for name, ks in why.items() if ks}


def load_runs(dirs: list[Path], allow_partial: bool = False, labels: list[str | None] | None = None) -> RunSet:
    """Read and cross-check runs; raises InputError naming the folder and what is wrong."""
    rs = RunSet(runs=[], models=[])
    cfgs = []
    for i, d in enumerate(dirs):
        cfg = _read(d / "run.json")
        for key in ("models", "units"):
            if not isinstance(cfg.get(key), list):
                raise InputError(f"{d}/run.json: no {key!r} list (not written by `harness eval`?)")
        if cfg.get("shard"):
            sh = cfg["shard"]
            raise InputError(f"{d} is shard {sh.get('index')}/{sh.get('count')} of a run: join the shards first "
                             "(`make merge RUN=<every shard> NAME=<run id>`), then report the merged run")
        label = (labels[i] if labels and i < len(labels) else None) or cfg.get("run_id") or d.name
        cfgs.append((d, cfg))
        rs.runs.append({**cfg, "dir": str(d), "label": label})
    split = _split_models(cfgs)
    variants: dict[str, set[str]] = {}  # model (or model@run) -> prompt variants measured
    for run, (d, cfg) in zip(rs.runs, cfgs):
        for m in cfg["models"]:
            base = f"{m['name']}@{run['label']}" if m["name"] in split else m["name"]
            variants.setdefault(base, set()).update(prompt_variant(cfg, u["name"]) for u in cfg["units"])
    for name, why in split.items():
        rows = [f"{name}@{r['label']}" for r in rs.runs if any(m["name"] == name for m in r["models"])]
        rs.notes.append(f"{name} is reported per run ({', '.join(rows)}): {why}")
    rows: dict[str, dict] = {}
    seen_cell: dict[tuple[str, str], Path] = {}
    for run, (d, cfg) in zip(rs.runs, cfgs):
        run_id = cfg.get("run_id") or d.name
        absent = []
        for m in cfg["models"]:
            base = f"{m['name']}@{run['label']}" if m["name"] in split else m["name"]
            for u in cfg["units"]:
                variant = prompt_variant(cfg, u["name"])
                label = base + (PAPER_ROW if variant == "paper" and len(variants[base]) > 1 else "")
                if label not in rows:
                    rows[label] = {**m, "name": label, "model": m["name"], "run_id": run_id, "prompts": variant}
                    rs.models.append(rows[label])
                cell = (label, u["name"])
                if cell in seen_cell:
                    other = seen_cell[cell]
                    rs.notes.append(f"{label} on {u['name']}: measured in {other} and {d}; "
                                    f"the first ({other.name}) is reported")
                    continue
                path = d / "metrics" / f"{m['name']}__{u['name']}.json"
                if not path.is_file():
                    absent.append(path.name)
                    rs.missing.append((label, u["name"], str(d)))
                    continue
                seen_cell[cell] = d
                met = _read(path)
                rs.metrics[cell] = {**met, "_run_id": run_id, "_run_dir": str(d), "_device": device_text(cfg)}
        if absent and not allow_partial:
            more = f" and {len(absent) - 3} more" if len(absent) > 3 else ""
            raise InputError(f"{d}: unfinished run, missing metrics/{', metrics/'.join(absent[:3])}{more} "
                             f"(resume it with `make eval ... EVAL_ARGS='--run-id {d.name}'`, "
                             "or report it with --allow-partial)")
    return rs


