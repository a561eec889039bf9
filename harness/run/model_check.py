"""Model and knob validation: every decoder, checkpoint (completely), attention and knob checked before
anything is written, and the knob values each (model, leaf task) will really use resolved."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from harness.run.hints import did_you_mean, unknown
from harness.run.hints import short_list as hints_short_list
from harness.run.model_list import LOAD_OPTIONS, TEMPLATE_OPTION, InputError, template_args
from harness.run.presets import ModelSpec, paper_knobs

REPO = Path(__file__).resolve().parents[2]


def _local_path(path: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_absolute():
        p = (Path.cwd() / p) if (Path.cwd() / p).exists() else (REPO / p)
    return p


def shown_values(values: dict) -> dict:
    """The knob values as the decoders really use them where a knob's default is None (refusion/decoding/
    mdm.py): ``steps`` is gen_length (512 on the paper's tasks), or gen_length / ``tokens_per_step`` (rounded
    up) when that is set, fast_dllm's ``commit_first`` follows ``shift``, an unset ``top_p`` / ``top_k`` /
    ``tokens_per_step`` / ``logits_chunk`` is off, diffusion_gemma's unset ``canvas_length`` is the model's config's. What the
    dry run prints and run.json records never says None."""
    out = dict(values)
    per_step, length = out.get("tokens_per_step"), out.get("gen_length")
    if "steps" in out and per_step is not None:
        out["steps"] = -(-length // per_step) if isinstance(length, int) else f"{length}/{per_step}"
    elif "steps" in out and out["steps"] is None:
        out["steps"] = length
    if "tokens_per_step" in out and per_step is None:
        out["tokens_per_step"] = "off"
    if "commit_first" in out and out["commit_first"] is None:
        out["commit_first"] = out.get("shift")
    if "canvas_length" in out and out["canvas_length"] is None:
        out["canvas_length"] = "config"  # the model's config.canvas_length (a run sets it from config.json)
    for k in ("top_p", "top_k", "logits_chunk"):
        if k in out and out[k] is None:
            out[k] = "off"
    return out


def _inspect(m: ModelSpec, ckpt: Path, base: str | None, inspected: dict[str, Any]):
    """The checkpoint check of one model, once per run (cached by name); its warnings printed once."""
    from harness.models.checkpoints import check_tokenizer, inspect_checkpoint

    if m.name not in inspected:
        info = inspect_checkpoint(ckpt, base)
        check_tokenizer(info)
        for w in info.warnings:
            print(f"warning: model {m.name!r}: {w}", file=sys.stderr)
        inspected[m.name] = info
    return inspected[m.name]


def _template_args(m: ModelSpec) -> dict:
    """A model's own chat-template arguments: a dict from a models file (checked there), or the MODELS text
    (several arguments joined by ';': a comma would start the next knob)."""
    value = m.knobs[TEMPLATE_OPTION]
    if isinstance(value, dict):
        return dict(value)
    return template_args("" if value is None else str(value), m.name)


def validate_models(models: list[ModelSpec], units: list[dict], task_defaults: bool,
                    inspected: dict[str, Any] | None = None, seed: int | None = None,
                    budgets: dict[str, int | None] | None = None) -> list[dict]:
    """Check decoders, checkpoints (completely: harness/models/checkpoints.inspect_checkpoint, an adapter
    against its base), the attention each decoder needs, and knobs; return each model with its per-leaf
    task knobs, the base an adapter is merged into (given or found), and the knob values each leaf will
    really use (``resolved_knobs``: decoder defaults < the checkpoint's own decoding settings (Dream's
    generation_config.json) < the task's settings < the model's knobs; ``budgets``: each leaf's
    response budget, against which the knob rules are checked where gen_length comes from the request).
    ``inspected`` caches checkpoint checks by model name across calls."""
    from harness.models.checkpoints import CheckpointError
    from harness.run.lm_adapter import checkpoint_knobs
    from refusion.decoding import DECODERS, check_attention, check_knob_values, make_knobs

    inspected = {} if inspected is None else inspected
    out = []
    for m in models:
        if m.decoder not in DECODERS:
            raise InputError(f"model {m.name!r}: " + unknown("decoder", m.decoder, DECODERS))
        knobs = {k: v for k, v in m.knobs.items() if k not in (*LOAD_OPTIONS, TEMPLATE_OPTION)}
        engine: dict[str, Any] = {}
        if m.engine:  # ar@vllm: the engine's knobs leave the decoder's (harness/run/engine.py EngineSpec)
            from harness.run.engine import EngineError, EngineSpec, split_knobs

            try:
                spec, knobs = split_knobs(m.engine, knobs)
            except EngineError as e:
                raise InputError(f"model {m.name!r}: {e}") from None
            engine = {"engine": {"name": m.engine, "knobs": spec.to_dict()}}
        accepted = DECODERS[m.decoder].knobs.names()
        bad = [k for k in knobs if k not in accepted]
        if bad:
            extra = EngineSpec.knob_names() if m.engine else ()
            raise InputError(f"model {m.name!r}: unknown knob(s) {', '.join(bad)} for decoder {m.label!r}"
                             f"{did_you_mean(bad[0], [*accepted, *extra, *LOAD_OPTIONS, TEMPLATE_OPTION])}; valid knobs: "
                             + hints_short_list(accepted, lister=f"python -m harness knobs {m.decoder}")
                             + (f"; engine knobs: {', '.join(extra)}" if extra else ""))
        # Not resolved here: the base's name as given (a symlink named like the model) is what its adapter's
        # base_model_name_or_path is compared with; run.json records the resolved folder (info.base.path).
        load: dict[str, Any] = {k: str(_local_path(str(v)).absolute()) for k, v in m.knobs.items()
                                if k in LOAD_OPTIONS}
        if TEMPLATE_OPTION in m.knobs:
            load[TEMPLATE_OPTION] = _template_args(m)
        ckpt = _local_path(m.checkpoint)
        try:
            info = _inspect(m, ckpt, load.get("base"), inspected)
            check_attention(m.decoder, info.causal, info.family.name)
            own = checkpoint_knobs(info, m.decoder)  # Dream: shift=true, its generation_config.json
        except CheckpointError as e:
            raise InputError(f"model {m.name!r}: {e}") from None
        except ValueError as e:
            raise InputError(f"model {m.name!r} ({ckpt}): {e}") from None
        if info.base is not None:
            load["base"] = str(info.base.path)  # the base really used, found beside the adapter or given
        elif "base" in load:
            load["base"] = str(Path(load["base"]).resolve())
        try:  # each knob on its own now; the rules across knobs per task below, with its real budget
            check_knob_values(m.decoder, {**own, **knobs})
            if "gen_length" in {**own, **knobs} or "gen_length" not in DECODERS[m.decoder].knobs.names():
                make_knobs(m.decoder, {**own, **knobs})  # the budget is fixed: every rule holds or fails now
        except ValueError as e:
            raise InputError(f"model {m.name!r}: {e}") from None
        task_knobs, resolved = _leaf_knobs(m, knobs, own, units, task_defaults, seed, budgets or {})
        out.append({**m.to_dict(), "knobs": knobs, **load, "checkpoint": str(ckpt.resolve()),
                    "family": info.family.name, "causal": info.causal, "task_knobs": task_knobs,
                    "resolved_knobs": resolved, **engine})
    return out


def _leaf_knobs(m: ModelSpec, user: dict, own: dict, units: list[dict], task_defaults: bool, seed: int | None,
                budgets: dict[str, int | None]) -> tuple[dict[str, dict], dict[str, dict]]:
    """(task knobs, resolved knobs) per leaf of model ``m`` (``user``: its knobs as given; ``own``: its
    checkpoint's): every knob set the worker will build, built here
    first, with the leaf's real response budget where the adapter takes gen_length from the request, so a
    constraint the budget breaks (a block that does not divide it) stops the run before anything is written."""
    from refusion.decoding import DECODERS, make_knobs

    accepted = set(DECODERS[m.decoder].knobs.names())
    task_knobs: dict[str, dict] = {}
    resolved: dict[str, dict] = {}
    for u in units:
        tk = paper_knobs(u["name"], m.decoder, accepted) if task_defaults else {}
        wanted = {**own, **tk, **user}
        for leaf in u["leaves"]:
            budget = budgets.get(leaf)
            from_request = "gen_length" in accepted and "gen_length" not in wanted
            extra = {"gen_length": budget} if from_request and budget is not None else {}
            try:
                values = make_knobs(m.decoder, {**wanted, **extra}).to_dict()
            except ValueError as e:
                where = f" (its max_gen_toks {budget} is the gen_length)" if extra else ""
                raise InputError(f"model {m.name!r} on task {leaf!r}{where}: {e}") from None
            if from_request and not extra:
                values["gen_length"] = "max_gen_toks"  # the adapter takes the request's budget
            if "seed" in accepted and "seed" not in user and seed is not None:
                values["seed"] = seed  # the adapter passes the run's seed
            resolved[leaf] = shown_values(values)
            if tk:
                task_knobs[leaf] = tk
    return task_knobs, resolved


def compile_settings(model_cfgs: list[dict]) -> dict[str, bool]:
    """Per model, whether it decodes compiled (the decoder knob ``compile`` on for any of its tasks): recorded
    in run.json (derived from the knobs, so not compared on resume) and named by the summary and report."""
    return {m["name"]: any(bool(v.get("compile")) for v in (m.get("resolved_knobs") or {}).values())
            for m in model_cfgs}


def dtype_warning(cfg: dict) -> str | None:
    """One line when the run asks for half precision on the CPU: it works, but most CPUs have no fast
    bfloat16/float16 kernels, so decoding is several times slower than in float32 and the run looks hung)."""
    if cfg["device"] == "cpu" and cfg["dtype"] in ("bfloat16", "float16"):
        return (f"{cfg['dtype']} on the CPU is slow (most CPUs have no fast {cfg['dtype']} kernels; expect several "
                "times float32's decode time); use DTYPE=auto or float32 on the CPU")
    return None


def describe_resolved(cfg: dict) -> str:
    """What a run will do, per model and task: the knob values each leaf task will use (``--dry-run``)."""
    lines = [f"task {cfg['task']}, limit {cfg['limit'] or 'all'}, device {cfg['device']}, dtype {cfg['dtype']}, "
             f"chat template {'on' if cfg['chat_template'] else 'off'}"
             + (f" with {cfg['chat_template_args']}" if cfg["chat_template_args"] else "")]
    for m in cfg["models"]:
        attn = "causal" if m["causal"] else "bidirectional"
        own = m.get(TEMPLATE_OPTION, cfg["chat_template_args"])
        eng = m.get("engine")
        lines.append(f"{m['name']}: decoder {m['decoder']}{'@' + eng['name'] if eng else ''} on {m['checkpoint']} "
                     f"({m['family']} family, {attn}"
                     + (f", LoRA on base {m['base']}" if m.get("base") else "")
                     + (f", chat template arguments {own}" if own != cfg["chat_template_args"] else "")
                     + (", compiled: torch.compile, static shapes" if (cfg.get("compile") or {}).get(m["name"]) else "")
                     + ")")
        if eng:
            ver = eng.get("versions") or {}
            lines.append(f"  engine {eng['name']} {ver.get('vllm', '?')} (torch {ver.get('torch', '?')}, "
                         f"{ver.get('python', 'venv')}): " + ", ".join(f"{k}={v}" for k, v in eng["knobs"].items()
                                                                 if k != "engine"))
        for u in cfg["units"]:
            groups: dict[str, list[str]] = {}
            for leaf in u["leaves"]:
                groups.setdefault(json.dumps(m["resolved_knobs"][leaf], sort_keys=True), []).append(leaf)
            for values, leaves in groups.items():
                where = u["name"] if len(groups) == 1 else ",".join(leaves)
                knobs = ", ".join(f"{k}={v}" for k, v in json.loads(values).items())
                lines.append(f"  {where}: {knobs}")
    return "\n".join(lines)

