"""`python -m harness trace` / `make trace`: how each decoder fills one answer, forward by forward.

    python -m harness trace                                     # embedded_math item 0, the default models
    python -m harness trace --task embedded_code --index 3 --models ar,refusion
    python -m harness trace --prompt "Ana has 12 apples ..." --gen-length 64
    python -m harness trace --run RUN --task embedded_math --index 5   # a sample's prompt from a run's logs

Prompt: ``--prompt`` text (the chat template applied, as `harness eval` does), the test item
``--index`` of an embedded task, or with ``--run`` the prompt a run logged for (``--task``,
``--index`` = lm-eval doc_id) in ``models/<model>/samples/<unit>.jsonl``, already templated.
``--task`` also applies that task's decoding defaults (tasks/info.py), as a run does.
Models: ``--models`` with the syntax of `harness eval` (default: the run's models with ``--run``,
else ar, refusion, llada, fast_dllm on the tiny checkpoints), each loaded and decoded through the
lm-eval adapter of the runner (RefusionBenchLM.decode_record): the same knobs, the same tokens,
and the decoders' commit order (stats commit_forward / commit_kind / forward_phase).

Writes ``<out>/<name>/trace/`` (default name ``trace-<task>-<index>`` or ``trace-prompt-<hash>``),
swapped in whole: ``trace.json`` (prompt, per model tokens, texts and commit order), per model
``<model>.png`` and ``<model>.gif``, ``all.gif`` (every model on one clock) and ``index.html``
(arrow keys step through the forwards); see harness/report/trace_draw.py. Bad input is one ``error:``
line, exit 2, nothing written.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path

from harness.run.store import atomic_dir, atomic_write_json, read_json

DEFAULT_TASK, DEFAULT_INDEX = "embedded_math", 0


class InputError(Exception):
    """Bad user input: one line, exit 2, nothing written."""


# ---------------------------------------------------------------- the prompt


def _unit_of(task: str) -> str:
    """The task-table entry a task or leaf belongs to (for its decoding defaults)."""
    from tasks.info import TASKS

    if task in TASKS:
        return task
    for name, info in TASKS.items():
        if task in info.leaves:
            return name
    from harness.run.hints import did_you_mean

    raise InputError(f"unknown task {task!r}{did_you_mean(task, TASKS)}; known tasks: {', '.join(TASKS)}")


def embedded_query(task: str, index: int) -> str:
    """The raw query of test item `index` of an embedded task (its lm-eval doc_to_text is the query)."""
    from tasks.embedded import load_split
    from tasks.info import EMBEDDED_TASKS

    if task not in EMBEDDED_TASKS:
        raise InputError(f"--task {task!r} without --run needs --prompt (a prompt is taken from the task itself "
                         f"only for {', '.join(EMBEDDED_TASKS)})")
    items = load_split(task.removeprefix("embedded_"), "test")
    if not 0 <= index < len(items):
        raise InputError(f"--index {index}: {task} has test items 0 to {len(items) - 1}")
    return items[index]["query"]


def run_prompts(run_dir: Path, cfg: dict, task: str, index: int) -> tuple[str, dict[str, str]]:
    """(leaf task, {model name: the prompt it was sent}) for doc `index` of `task` in a run's sample logs."""
    unit = next((u for u in cfg["units"] if task == u["name"] or task in u["leaves"]), None)
    if unit is None:
        raise InputError(f"--task {task!r} is not a task of run {run_dir.name}; its tasks: "
                         + ", ".join(sorted({x for u in cfg["units"] for x in [u["name"], *u["leaves"]]})))
    if task == unit["name"] and len(unit["leaves"]) > 1:
        raise InputError(f"--task {task!r} has {len(unit['leaves'])} subtasks, each with its own doc ids; name one: "
                         + ", ".join(unit["leaves"]))
    leaf = task if task in unit["leaves"] else unit["leaves"][0]
    prompts: dict[str, str] = {}
    for m in cfg["models"]:
        path = run_dir / "models" / m["name"] / "samples" / f"{unit['name']}.jsonl"
        if not path.is_file():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line) if line.strip() else {}
            if row.get("task") == leaf and row.get("doc_id") == index and row.get("prompt") is not None:
                prompts[m["name"]] = row["prompt"]
                break
    if not prompts:
        raise InputError(f"run {run_dir.name}: no logged sample of {leaf} with doc id {index} (looked in "
                         f"models/*/samples/{unit['name']}.jsonl; an unfinished model writes them at its end)")
    return leaf, prompts


# ---------------------------------------------------------------- decoding


def _models(ns: argparse.Namespace, cfg: dict | None):
    """ModelSpecs from --models, else the run's models, else the default run's presets."""
    from harness.run.presets import DEFAULT_MODELS, ModelSpec
    from harness.run.model_list import InputError as RunnerInputError
    from harness.run.model_list import KnobHelp, parse_models

    try:
        if ns.models:
            models = parse_models(ns.models)
        elif cfg is not None:
            models = [ModelSpec(m["name"], m["checkpoint"], m["decoder"],
                                {**m["knobs"], **({"base": m["base"]} if m.get("base") else {})})
                      for m in cfg["models"]]
        else:
            models = parse_models(",".join(DEFAULT_MODELS))
    except (RunnerInputError, KnobHelp) as e:
        raise InputError(f"--models: {e}") from None
    if ns.gen_length is not None:
        models = [replace(m, knobs={**m.knobs, "gen_length": ns.gen_length}) for m in models]
    return models


def decode_all(models, units: list[dict], leaf: str | None, prompts: dict[str, str], raw: str | None,
               settings: dict) -> list[dict]:
    """Decode the prompt with every model through the adapter; one trace entry per model."""
    from harness.run.lm_adapter import RefusionBenchLM
    from harness.run.model_list import InputError as RunnerInputError
    from harness.run.model_check import validate_models

    try:
        specs = validate_models(models, units, settings["task_defaults"], seed=settings["seed"])
    except RunnerInputError as e:
        raise InputError(str(e)) from None
    out = []
    for spec in specs:
        try:
            lm = RefusionBenchLM(
                pretrained=spec["checkpoint"], decoder=spec["decoder"], device=settings["device"],
                dtype=settings["dtype"], seed=settings["seed"], threads=settings["threads"],
                task_knobs=spec["task_knobs"], warmup=False, base=spec.get("base"),
                chat_template_args=spec.get("chat_template_args", settings["chat_template_args"]) or None,
                **spec["knobs"])
            if raw is not None:  # a text prompt: this model's chat template, as lm-eval applies it
                context = raw if not settings["chat_template"] else lm.apply_chat_template(
                    [{"role": "user", "content": raw}])
            elif spec["name"] in prompts:  # the prompt the run sent this model
                context = prompts[spec["name"]]
            else:  # a model not in the run: the prompt another model got (templated by that model's tokenizer)
                other, context = next(iter(prompts.items()))
                print(f"note: {spec['name']} is not a model of the run; it gets the prompt logged for {other}",
                      file=sys.stderr)
            rec = lm.decode_record(context, task=leaf, gen_kwargs={"max_gen_toks": settings["max_gen_toks"]})
        except ValueError as e:
            raise InputError(f"model {spec['name']!r}: {e}") from None
        out.append(entry(spec["name"], spec["decoder"], rec, lm.tokenizer, lm.eos))
        print(f"{spec['name']}: {rec['generated_tokens']} tokens in {rec['nfe']} forwards", file=sys.stderr)
        del lm  # one model in memory at a time
    return out


def _group(decoder: str, knobs: dict, prompt_tokens: int | None = None) -> dict | None:
    """The unit a decoder fills the answer by: ReFusion's slots, the block decoders' blocks, DiffusionGemma's
    canvases. A decoder whose blocks count from the prompt's start (``blocks_from_prompt_start`` on its knob
    class: llada2, sdar) has a partial first block: ``offset`` is where the answer's first full block starts."""
    from refusion.decoding import get_decoder

    for key, name in (("slot_size", "slot"), ("block_length", "block"), ("block_size", "block"),
                      ("canvas_length", "canvas")):
        if key in knobs and isinstance(knobs[key], int):
            group = {"name": name, "size": int(knobs[key])}
            if getattr(get_decoder(decoder).knobs, "blocks_from_prompt_start", False) and prompt_tokens:
                group["offset"] = -int(prompt_tokens) % group["size"]
            return group
    return None


def entry(name: str, decoder: str, rec: dict, tokenizer, eos: tuple[int, ...] | set[int]) -> dict:
    """One model's trace from a decode record (a run's sample row or `decode_record`'s result)."""
    from refusion.decoding import make_knobs

    if "commit_forward" not in rec:
        raise InputError(f"model {name!r}: the record has no commit order (logged before decode traces existed)")
    tokens = [int(t) for t in rec["tokens"]]
    knobs = make_knobs(decoder, rec.get("knobs") or {}).to_dict()
    return {
        "name": name, "decoder": decoder, "knobs": knobs, "nfe": int(rec["nfe"]), "tokens": tokens,
        "pieces": [tokenizer.decode([t]) for t in tokens], "commit_forward": rec["commit_forward"],
        "commit_kind": rec["commit_kind"], "forward_phase": rec.get("forward_phase") or [],
        "eos_at": len(tokens) - 1 if tokens and tokens[-1] in set(eos) else None,
        "group": _group(decoder, knobs, rec.get("prompt_tokens")),
    }


# ---------------------------------------------------------------- traces a run logged (make report)


def _eos_of(folder: Path, tokenizer) -> set[int]:
    """EOS ids of a checkpoint folder without loading its weights: the tokenizer's, config.json's and
    generation_config.json's (the decoders cut after the first of them)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for name in ("config.json", "generation_config.json"):
        try:
            value = read_json(folder / name).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        ids.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    return ids


def _logged_rows(rs, unit: str):
    """Per model of the report that logged `unit`: (model entry, its logged rows that carry a commit order),
    in the report's model order; the rows of a run from before decode traces are dropped."""
    for m in rs.models:
        cell = rs.metrics.get((m["name"], unit))
        if cell is None:
            continue
        path = Path(cell["_run_dir"]) / "models" / m["name"] / "samples" / f"{unit}.jsonl"
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
                if line.strip()] if path.is_file() else []
        yield m, cell, [r for r in rows if r.get("commit_forward") is not None and r.get("tokens") is not None]


def logged_sample(rs, unit: str) -> tuple[str, int, str] | None:
    """(task, doc id, run folder) of the first sample of `unit` a run of the report logged with a commit order
    (the sample `logged_trace` draws), without loading any checkpoint; None when no run logged one."""
    for _, cell, rows in _logged_rows(rs, unit):
        if rows:
            return rows[0]["task"], rows[0]["doc_id"], cell["_run_dir"]
    return None


def logged_trace(rs, unit: str) -> dict | None:
    """The trace of the first sample of `unit` that the runs of a report logged with a commit order, for
    every model that logged that sample; None when none did. `rs`: harness.report.paper_report.RunSet."""
    from harness.models.checkpoints import inspect_checkpoint, load_tokenizer

    doc, models, prompt = None, [], None
    for m, _, rows in _logged_rows(rs, unit):
        if doc is None and rows:
            doc = (rows[0]["task"], rows[0]["doc_id"])
        row = next((r for r in rows if (r["task"], r["doc_id"]) == doc), None)
        if row is None:
            continue
        info = inspect_checkpoint(m["checkpoint"], m.get("base"))
        tokenizer = load_tokenizer(info)
        models.append(entry(m["name"], m["decoder"], row, tokenizer, _eos_of(info.path, tokenizer)))
        prompt = prompt or row.get("prompt")
    if not models:
        return None
    return {"source": f"{doc[0]} doc {doc[1]} as logged by the run", "task": doc[0], "index": doc[1],
            "prompt": prompt or "", "models": models}


def trace_command(run_dir: str, task: str, index: int) -> str:
    """The `make trace` command that draws one logged sample, with the models of its run (a run inside the
    repository by its relative path, so a committed report names no machine's folders)."""
    repo = Path(__file__).resolve().parents[2]
    try:
        shown = Path(run_dir).resolve().relative_to(repo)
    except ValueError:
        shown = Path(run_dir)
    return f"`make trace RUN={shown} TASK={task} INDEX={index}`"


def report_traces(rs, folder: Path, draw: bool = True) -> str:
    """`make report`: per task whose samples carry a commit order, the trace of its first sample, and the
    Markdown section about them ('' if no task has one). With `draw`, the figures and the page (no GIFs) go
    under folder/trace/<task>/ and the section links the files found there, and only those; without it
    (`--no-traces`) nothing is drawn and the section names, per task, the `make trace` command that draws it."""
    from harness.report import trace_draw
    from harness.models.checkpoints import CheckpointError

    units = list(dict.fromkeys(u for _, u in rs.metrics))
    lines = []
    for unit in units:
        try:
            sample = logged_sample(rs, unit)
            if sample is None:
                continue
            task, index, run_dir = sample
            draw_it = trace_command(run_dir, task, index)
            if not draw:
                lines.append(f"- {unit}, doc {index}: {draw_it}")
                continue
            trace = logged_trace(rs, unit)
        except (CheckpointError, OSError, ValueError) as e:  # a checkpoint moved since the run: no trace
            lines.append(f"- {unit}: no trace ({' '.join(str(e).split())[:200]})")
            continue
        sub = folder / "trace" / unit
        atomic_write_json(sub / "trace.json", trace)
        files = [f for f in trace_draw.write_all(trace, sub, gifs=False) if (sub / f).is_file()]
        pngs = ", ".join(f"[{f.removesuffix('.png')}](trace/{unit}/{f})" for f in files if f.endswith(".png"))
        page = f"[step through it](trace/{unit}/index.html) (arrow keys)" if "index.html" in files else "no page"
        lines.append(f"- {unit}, doc {index}: {page}; figures {pngs or 'none'} ({draw_it} draws it with animations)")
    if not lines:
        return ""
    if draw:
        head = ("Which forward committed each token of one answer per task (`make trace` draws any prompt, "
                "with animations):")
    else:
        head = ("Which forward committed each token: the runs logged it for every sample; this report was made "
                "with `--no-traces`, so it draws none. Each command below draws one answer per task, for every "
                "model of its run (`make trace` draws any prompt):")
    return "\n## Decode traces\n\n" + head + "\n\n" + "\n".join(lines) + "\n"


# ---------------------------------------------------------------- command


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", default=None, help="the prompt text (the chat template is applied)")
    p.add_argument("--run", default=None, help="a run folder or id: take the prompt of --task / --index from its logs")
    p.add_argument("--runs-root", default="results/runs", help="where run ids are looked up (default: %(default)s)")
    p.add_argument("--task", default=None, help="the task the prompt belongs to: its decoding defaults apply; "
                   f"with --index, its prompt (default without --prompt: {DEFAULT_TASK})")
    p.add_argument("--index", type=int, default=None, help="doc id of the prompt in --task (default: 0)")
    p.add_argument("--models", default=None, help="as `harness eval --models` (default: the run's models with --run, "
                   "else ar,refusion,llada,fast_dllm)")
    p.add_argument("--gen-length", type=int, default=None, help="gen_length knob of every model (default: the "
                   "task's, else 128)")
    p.add_argument("--name", default=None, help="report folder name (default: trace-<task>-<index> or "
                   "trace-prompt-<hash>)")
    p.add_argument("--out", default="reports", help="reports folder (default: %(default)s)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=("auto", "bfloat16", "float16", "float32"),
                   help="(default: the run's, else auto)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--seed", type=int, default=None, help="decoder seed (default: the run's, else 1234)")
    p.add_argument("--no-chat-template", action="store_true", help="send --prompt as it is")
    p.add_argument("--chat-template-args", default=None, help="as `harness eval` (default: the run's, else none)")
    p.add_argument("--fps", type=float, default=4.0, help="GIF frames (forwards) per second (default: %(default)s)")
    p.add_argument("--no-gif", action="store_true", help="figures and the page only")
    p.add_argument("--debug", action="store_true", help="full traceback instead of the one-line error")
    return p


def build(ns: argparse.Namespace) -> tuple[dict, str]:
    """The trace (decoding every model) and the folder name; raises InputError on bad input."""
    import torch

    if ns.index is not None and ns.index < 0:
        raise InputError(f"--index must be >= 0, got {ns.index}")
    if ns.gen_length is not None and ns.gen_length < 1:
        raise InputError(f"--gen-length must be >= 1, got {ns.gen_length}")
    if ns.fps <= 0:
        raise InputError(f"--fps must be > 0, got {ns.fps}")
    if ns.prompt is not None and ns.run is not None:
        raise InputError("give --prompt or --run, not both")
    if ns.run is not None and ns.task is None:
        raise InputError("--run needs --task (and --index, default 0): which sample's prompt to trace")
    if ns.index is not None and ns.task is None:
        raise InputError("--index needs --task")
    cfg, run_dir = None, None
    if ns.run is not None:
        for cand in (Path(ns.run), Path(ns.runs_root) / ns.run):
            if (cand / "run.json").is_file():
                run_dir = cand
                break
        if run_dir is None:
            raise InputError(f"--run {ns.run!r}: no run folder there (looked for {ns.run}/run.json and "
                             f"{Path(ns.runs_root) / ns.run}/run.json)")
        cfg = read_json(run_dir / "run.json")
    task = ns.task if (ns.task or ns.prompt is not None) else DEFAULT_TASK
    index = ns.index if ns.index is not None else DEFAULT_INDEX
    raw, prompts, leaf = ns.prompt, {}, task
    if cfg is None and task is not None:
        _unit_of(task)  # an unknown task is named as such first
    if cfg is not None:
        leaf, prompts = run_prompts(run_dir, cfg, task, index)
        source = f"{leaf} doc {index} of run {cfg.get('run_id') or run_dir.name}"
    elif raw is None:
        raw = embedded_query(task, index)
        source = f"{task} test item {index}"
    else:
        source = f"a prompt ({task} settings)" if task else "a prompt"
    units = []
    if leaf is not None:
        units = [{"name": _unit_of(leaf) if cfg is None else next(
            u["name"] for u in cfg["units"] if leaf in u["leaves"]), "leaves": [leaf]}]
    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("--device cuda given but no CUDA device is available; valid: cpu")
    from harness.models.checkpoints import resolve_dtype
    from harness.run.lm_adapter import parse_chat_template_args

    try:
        template_args = parse_chat_template_args(ns.chat_template_args if ns.chat_template_args is not None
                                                 else (cfg or {}).get("chat_template_args"))
    except ValueError as e:
        raise InputError(f"--chat-template-args: {e}") from None
    settings = {
        "device": device, "dtype": resolve_dtype(ns.dtype or (cfg or {}).get("dtype") or "auto", device),
        "seed": ns.seed if ns.seed is not None else (cfg or {}).get("seed", 1234), "threads": ns.threads,
        "chat_template": not ns.no_chat_template, "chat_template_args": template_args,
        "task_defaults": (cfg or {}).get("task_defaults", True), "max_gen_toks": 128,
    }
    name = ns.name
    if name is None:
        tag = f"{leaf}-{index}" if ns.prompt is None else "prompt-" + hashlib.sha256(
            ns.prompt.encode("utf-8")).hexdigest()[:8]
        name = f"trace-{tag}"
    if not name or name.startswith(".") or "/" in name:
        raise InputError(f"--name {name!r}: use a plain folder name")
    models = _models(ns, cfg)
    trace = {"source": source, "task": leaf, "index": index if (leaf and ns.prompt is None) else None,
             "prompt": raw if raw is not None else next(iter(prompts.values())),
             "settings": {k: v for k, v in settings.items() if k != "threads"},
             "models": decode_all(models, units, leaf, prompts, raw, settings)}
    return trace, name


def write(trace: dict, target: Path, gifs: bool = True, fps: float = 4.0) -> list[str]:
    """trace.json and every drawing into `target`, built aside and swapped in whole."""
    from harness.report import trace_draw

    with atomic_dir(target) as tmp:
        atomic_write_json(tmp / "trace.json", trace)
        return ["trace.json"] + trace_draw.write_all(trace, tmp, gifs=gifs, fps=fps)


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    if ns.threads:
        import torch

        torch.set_num_threads(ns.threads)
    try:
        trace, name = build(ns)
    except InputError as e:
        if ns.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    target = Path(ns.out) / name / "trace"
    files = write(trace, target, gifs=not ns.no_gif, fps=ns.fps)
    print(f"wrote {target}/: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
