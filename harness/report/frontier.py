"""`python -m harness frontier` / `make frontier`: every decoder's accuracy-parallelism frontier and its AUP.

    python -m harness frontier                                # the tiny suite: ar, refusion, llada, fast_dllm,
                                                              # 100 items per kind, every point of each grid
    python -m harness frontier --models ar,dream,d2f --limit 20
    python -m harness frontier --task gsm8k_cot --models-file examples/table1_models.toml --dry-run

Each model of MODELS (or --models-file) is measured at every point of its decoder's parallelism grid, which the
decoder registry declares beside its knobs (``refusion.decoding.Grid``: thresholds, or tokens per step where no
threshold applies); AR is one point at TPF 1, a decoder without a grid one point at its own setting. A point is
the model with the grid point's knobs on top of its own (``{}``: its own setting, keeping its name; any other
point is named ``<model>.<knob initials><value>``, e.g. ``fast_dllm.t0.7``). All points are the models of one
ordinary ``harness eval`` run (``OUT/frontier-<hash of the settings>``: resumable with the same command, recorded
like any run, the same documents for every point); ``--dry-run`` prints the points, then the eval's own dry run:
each point's knobs per task and the generated-token budget. Options not listed here go to ``harness eval``
(``--threads``, ``--num-processes``, ``--device``, ``--dtype``, ...).

Then the run's report (``make report``) goes to ``<reports>/<name>/``; a frontier run adds
(harness/report/aup.py)

    frontier_<task>_tpf.png, frontier_<task>_tps.png   accuracy against TPF and against tokens/s, one line per
                                                       model, 95% intervals, the Pareto set marked
    frontier_<task>_speedup_<baseline>.png             accuracy against the speedup over each AR baseline of the
                                                       run (an ar row, an engine row such as ar@vllm)
    aup.md                                             AUP (d3LLM's accuracy under parallelism) per model and task
    frontier.json                                      every point, its intervals, the Pareto sets and the AUPs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.report.aup import PLAN_FILE

DEFAULT_LIMIT = 100  # items per kind on the tiny suite: 13 points x 300 items, about 16 minutes (docs/reports.md)


class InputError(Exception):
    """Bad user input: one line, exit 2, nothing written."""


# ---------------------------------------------------------------- the plan: models x grid points


def _initials(knob: str) -> str:
    return "".join(part[0] for part in knob.split("_") if part)


def point_name(model: str, point: dict[str, Any], own: bool) -> str:
    """``model`` for its own setting, else ``model.<knob initials><value>[-...]`` (``refusion.st0.9-tt0.6``)."""
    return model if own else model + "." + "-".join(f"{_initials(k)}{v}" for k, v in point.items())


@dataclass
class Group:
    """One model of MODELS and its points: (name, the grid point's knobs, whether it is the model's own)."""
    model: str
    decoder: str
    checkpoint: str
    doc: str
    points: list[dict] = field(default_factory=list)
    engine: str | None = None  # an AR row served by an engine (decoder ar@vllm): its grid is ar's, one point

    def to_dict(self) -> dict:
        return {"model": self.model, "decoder": self.decoder, "checkpoint": self.checkpoint, "grid": self.doc,
                "points": self.points, **({"engine": self.engine} if self.engine else {})}

    @property
    def label(self) -> str:
        """The decoder as a MODELS string names it: ``ar`` or ``ar@vllm``."""
        return f"{self.decoder}@{self.engine}" if self.engine else self.decoder


def plan(specs: list) -> list[Group]:
    """Every model's points (``specs``: ModelSpecs). The grid comes from the decoder registry; InputError when two
    points would share a name."""
    from refusion.decoding import DECODERS

    groups, names = [], set()
    for spec in specs:
        grid = DECODERS[spec.decoder].grid
        g = Group(spec.name, spec.decoder, spec.checkpoint,
                  grid.doc if grid else "no grid registered: one point at the model's own setting",
                  engine=getattr(spec, "engine", None))
        for point in (grid.points if grid else ({},)):
            knobs = {**spec.knobs, **point}
            own = knobs == spec.knobs
            name = point_name(g.model, dict(point), own)
            if name in names:
                raise InputError(f"frontier point {name!r} appears twice (two models with one name, or a grid whose "
                                 "knobs share initials); rename a model")
            names.add(name)
            g.points.append({"name": name, "knobs": dict(point), "own": own, "model_knobs": knobs})
        groups.append(g)
    return groups


def _spec_text(name: str, checkpoint: str, decoder: str, knobs: dict) -> str:
    """One model of a MODELS string; InputError for a value the string cannot carry."""
    from harness.run.model_list import TEMPLATE_OPTION

    parts = []
    for k, v in knobs.items():
        if v is None:
            continue  # None is every optional knob's default: leaving it out gives the same setting
        if k == TEMPLATE_OPTION and isinstance(v, dict):
            v = ";".join(f"{a}={str(b).lower() if isinstance(b, bool) else b}" for a, b in v.items())
        text = str(v).lower() if isinstance(v, bool) else str(v)
        if re.search(r"[,:]", text) and k != TEMPLATE_OPTION:
            raise InputError(f"model {name!r}: knob {k}={text!r} holds ',' or ':', which a MODELS string cannot carry")
        parts.append(f"{k}={text}")
    if re.search(r"[,:]", checkpoint):
        raise InputError(f"model {name!r}: checkpoint path {checkpoint!r} holds ',' or ':'; link it elsewhere first")
    return f"{name}={checkpoint}:{decoder}" + (":" + ",".join(parts) if parts else "")


def models_text(groups: list[Group]) -> str:
    """The eval run's MODELS string: every point of every group, in order."""
    return ",".join(_spec_text(p["name"], g.checkpoint, g.label, p["model_knobs"]) for g in groups for p in g.points)


def describe_plan(groups: list[Group]) -> str:
    """The points, one line each, under one line per model with its grid."""
    lines = [f"frontier: {sum(len(g.points) for g in groups)} point(s) of {len(groups)} model(s)"]
    for g in groups:
        lines.append(f"{g.model} ({g.label}): {g.doc}")
        for p in g.points:
            knobs = ", ".join(f"{k}={v}" for k, v in p["knobs"].items()) or "its own setting"
            lines.append(f"  {p['name']}: {knobs}")
    return "\n".join(lines)


# ---------------------------------------------------------------- command


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness frontier", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="embedded", help="task, group or comma list (default: %(default)s)")
    p.add_argument("--models", default=None, help="models as in `harness eval` (presets or name=checkpoint:decoder"
                   "[:knobs]); each gets its decoder's grid (default: ar,refusion,llada,fast_dllm)")
    p.add_argument("--models-file", default=None, metavar="FILE", help="the models as a TOML models file instead")
    p.add_argument("--limit", type=int, default=None, help=f"items per task (default: {DEFAULT_LIMIT} on the "
                   "embedded suite, else all)")
    p.add_argument("--out", default="results/runs", help="runs folder (default: %(default)s)")
    p.add_argument("--run-id", default=None, help="run id (default: frontier-<hash of the settings>; the same "
                   "command resumes it)")
    p.add_argument("--reports", default="reports", help="reports folder (default: %(default)s)")
    p.add_argument("--name", default=None, help="report folder name (default: the run id)")
    p.add_argument("--dry-run", action="store_true", help="print the points, each one's knobs per task and the "
                   "generated-token budget; run nothing, write nothing")
    p.add_argument("--no-traces", dest="traces", action="store_false", help="the report draws no decode traces "
                   "(as `harness report --no-traces`)")
    return p


def _specs(ns: argparse.Namespace) -> list:
    from harness.run.model_list import InputError as ModelsError
    from harness.run.model_list import load_models_file, parse_models
    from harness.run.presets import DEFAULT_MODELS
    from refusion.decoding import DECODERS

    if ns.models is not None and ns.models_file is not None:
        raise InputError("give either --models (MODELS) or --models-file (MODELS_FILE), not both")
    try:
        specs = load_models_file(ns.models_file) if ns.models_file else parse_models(ns.models or ",".join(DEFAULT_MODELS))
    except ModelsError as e:
        raise InputError(str(e)) from None
    for spec in specs:
        if spec.decoder not in DECODERS:
            from harness.run.hints import unknown

            raise InputError(f"model {spec.name!r}: " + unknown("decoder", spec.decoder, DECODERS))
    return specs


def main(argv: list[str] | None = None) -> int:
    ns, passthrough = _parser().parse_known_args(argv)
    from harness.run import runner

    try:
        if ns.limit is not None and ns.limit < 1:
            raise InputError(f"--limit must be >= 1, got {ns.limit}")
        if ns.name is not None and (not ns.name or ns.name.startswith(".") or "/" in ns.name):
            raise InputError(f"--name {ns.name!r}: use a plain folder name")
        groups = plan(_specs(ns))
        models = models_text(groups)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    limit = ns.limit if ns.limit is not None else (DEFAULT_LIMIT if ns.task == "embedded" else None)
    settings = {"task": ns.task, "limit": limit, "models": models, "extra": passthrough}
    run_id = ns.run_id or "frontier-" + hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    print(describe_plan(groups))
    args = ["--task", ns.task, "--models", models, "--out", ns.out, "--run-id", run_id,
            *(["--limit", str(limit)] if limit is not None else []), *passthrough]
    if ns.dry_run:
        return runner.main([*args, "--dry-run"])
    rc = runner.main(args)
    run_dir = Path(ns.out) / run_id
    if (run_dir / "run.json").is_file():  # the plan beside the run, also when it stopped (a partial report)
        from harness.run.store import atomic_write_json

        atomic_write_json(run_dir / PLAN_FILE, {"groups": [g.to_dict() for g in groups], "task": ns.task,
                                                "limit": limit})
    if rc != 0:
        return rc
    from harness.report.paper_report import main as report

    return report(["--run", str(run_dir), "--out", ns.reports, "--name", ns.name or run_id,
                   *([] if ns.traces else ["--no-traces"])])


if __name__ == "__main__":
    raise SystemExit(main())
