"""Train the tiny ``ar``, ``refusion``, ``mdm``, ``dream`` and ``d2f`` models on a corpus.

    python -m harness train-tiny [--models ar,refusion,mdm,dream,d2f] [--steps N] [--out checkpoints/tiny]

All share one Qwen3 configuration (``ModelShape``, ~3.4M parameters), one tokenizer,
the same training rows and seed; only the objective (refusion/objective.py) and the
recipe (``RECIPES``: steps, peak lr) differ. ``ar`` is trained from scratch. As the
released ReFusion is Qwen3-8B fine-tuned with the ReFusion objective, Dream-7B starts
from an AR model and D2F is distilled from a trained masked-diffusion model,
``refusion``, ``mdm`` and ``dream`` start from the trained ``ar`` weights and ``d2f``
from the trained ``mdm`` ones (``--<model>-init scratch`` trains from random weights
instead; from scratch the ReFusion objective never trains the AR prediction of a slot's
first token, see docs/design.md). Models are trained in stages (``stages``): the models
of one stage depend only on earlier ones and train side by side, one process each with
the threads split (``--sequential`` runs them one after the other). Batches draw each
example's kind by ``TrainConfig.kind_weights``. The corpus (rows per kind) is an
argument of ``main``: the harness passes the embedded suite's training split.

The byte-level BPE tokenizer is trained first on the training corpus and saved
into every model folder. Each model folder is a Hugging Face checkpoint (config,
safetensors, tokenizer with chat template) plus ``train_log.csv``, ``loss.png``
and ``train_config.json``. A run that is interrupted resumes from its last state
file (model, optimizer, step, RNG states, log; written atomically every ``--save-every``
steps and every ``--save-every-s`` seconds), bit-identically; the finished folder
replaces the old one atomically. ``--snapshot-every`` keeps weights-only snapshots for
learning curves; ``--open-share`` trains on the open-ended arithmetic mixture (``draw_items``).
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MODEL_NAMES = ("ar", "refusion", "mdm", "dream", "d2f")  # training order (each after the model it starts from)

# The recipe, one schedule per model (TrainConfig fields: steps, peak lr, data mixture; one warm-up, cosine
# decay, no restart). ar learns the tasks from scratch on the faithful data; the diffusion models adapt the
# trained ar weights to their objective (as ReFusion fine-tunes Qwen3-8B and Dream starts from Qwen2.5) and
# d2f the trained mdm ones (as D2F distils a trained LLaDA / Dream). docs/tiny-models.md ("Training runs")
# gives the reasons:
# - every diffusion model trains on one mixture: 20% of the math items open-ended right after an
#   intermediate result, 40% result items (the masked heads learn to compute a result instead of copying
#   its restatement); the test split and the objectives are the same for every model;
# - refusion, mdm and dream get the same 4000 steps of the same batches (a step's batch is a pure function
#   of seed and step), so the same tokens;
# - d2f 3000 steps from the trained mdm.
MIX: dict[str, float] = {"open_share": 0.2, "result_share": 0.4}
RECIPES: dict[str, dict] = {"ar": {"steps": 3000, "lr": 2e-3},  # the faithful data only
                            "refusion": {"steps": 4000, "lr": 1e-3, **MIX},
                            "mdm": {"steps": 4000, "lr": 1e-3, **MIX},
                            "dream": {"steps": 4000, "lr": 1e-3, **MIX},
                            "d2f": {"steps": 3000, "lr": 1e-3, **MIX}}
# Committed folders that still hold the weights of an earlier recipe, with its settings: a retraining done one
# model at a time lists here the models it has not reached yet, so the fingerprint test pins every committed
# folder to the recipe it was made with. Empty: every committed folder is RECIPES.
PREVIOUS: dict[str, dict] = {}
# Bidirectional (LLaDA, Dream) or block-causal (D2F, explicit masks) attention: not causal.
NON_CAUSAL = ("mdm", "dream", "d2f")
# TrainConfig fields a resumed run may change (how often it saves, how many threads): the rest must match.
OPERATIONAL = ("threads", "save_every", "save_every_s", "snapshot_every")


@dataclass(frozen=True)
class ModelShape:
    """One Qwen3 configuration shared by the three tiny models (~3.4M parameters)."""
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 32
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1500
    batch_size: int = 32
    lr: float = 2e-3
    warmup: int = 100
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    threads: int = 2
    slot_sizes: tuple[int, ...] = (4, 8, 16)  # responses here are 16-80 tokens; 32 would be one slot
    vocab_size: int = 1024
    save_every: int = 200        # state file (model, optimizer, RNG, log) every this many steps ...
    save_every_s: float = 180.0  # ... and after this many seconds of wall clock, whichever comes first
    snapshot_every: int = 0      # weights-only snapshot every this many steps, for learning curves (0: none)
    # Arithmetic-signal mixture: share of the items that have cut points (math: after each intermediate
    # result) replaced by an open-ended item cut there, so no restatement of the result follows it.
    open_share: float = 0.0
    # Result items: share of the items with cut points replaced by one whose prompt runs up to an
    # intermediate result and whose response is that result (Example.result). Drawn after open_share.
    result_share: float = 0.0
    # Number items: likewise for any number of the solution (operand, result, answer; Example.number).
    number_share: float = 0.0
    # refusion only: share of examples whose slot plan masks a suffix of slots (the decoder's condition:
    # no clean slot after a masked one) instead of the paper's random slots (objective.draw_suffix_plan).
    suffix_share: float = 0.0
    init_dir: str = ""         # folder of the checkpoints a model starts from ("": the output folder)
    ar_init: str = "scratch"   # ar trains from random weights; "ar" continues a trained ar checkpoint
    refusion_init: str = "ar"  # "ar": start from the trained ar checkpoint in init_dir; "scratch"
    mdm_init: str = "ar"       # likewise for mdm
    dream_init: str = "ar"     # Dream is initialised from an AR model
    d2f_init: str = "mdm"      # D2F starts from a trained masked-diffusion model
    d2f_block_size: int = 8    # D2F's block (the decoder's block_size on the tiny model)
    # Share of each kind in a batch: arithmetic is the hardest thing the suite asks of a tiny model.
    kind_weights: tuple[tuple[str, float], ...] = (("math", 0.45), ("code", 0.2), ("choice", 0.35))


def recipe(name: str, previous: bool = False, **overrides) -> TrainConfig:
    """The training configuration of one tiny model (``RECIPES``; ``previous``: the earlier recipe of a
    model in ``PREVIOUS``); ``overrides`` replace fields."""
    table = PREVIOUS if previous and name in PREVIOUS else RECIPES
    return dataclasses.replace(TrainConfig(**table[name]), **overrides)


def committed_recipe(name: str) -> TrainConfig:
    """The recipe the committed ``checkpoints/tiny/<name>`` was trained with."""
    return recipe(name, previous=name in PREVIOUS)


def recipe_fingerprint(cfg: TrainConfig | dict, shape: ModelShape | dict) -> str:
    """Hash of what decides a model's weights (every TrainConfig field but ``OPERATIONAL``, and the
    shape); ``train_config.json`` records it, and a test checks that each committed folder's equals
    the recipe's (``recipe(name)``), so `make train-tiny` with its defaults is how they were made. A
    dict (a recorded ``train`` / ``shape``) counts a field it lacks as its default."""
    conf = dataclasses.asdict(cfg) if isinstance(cfg, TrainConfig) else {**dataclasses.asdict(TrainConfig()), **cfg}
    shape = dataclasses.asdict(shape) if isinstance(shape, ModelShape) else dict(shape)
    conf = {k: v for k, v in conf.items() if k not in OPERATIONAL}
    blob = json.dumps({"config": conf, "shape": shape}, sort_keys=True)  # tuples and lists alike
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def init_of(name: str, cfg: TrainConfig) -> str:
    """The model whose trained weights ``name`` starts from, or "scratch"."""
    return getattr(cfg, f"{name}_init", "scratch")


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def make_config(tokenizer, shape: ModelShape, name: str):
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=len(tokenizer), tie_word_embeddings=True, attention_dropout=0.0,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **dataclasses.asdict(shape))
    cfg.mask_token_id = tokenizer.mask_token_id
    if name in NON_CAUSAL:
        cfg.is_causal = False  # bidirectional / block-causal attention (docs/design.md §4, §8)
    return cfg


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up then cosine decay to ``min_lr_ratio``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def draw_items(examples: dict[str, list], step: int, cfg: TrainConfig) -> tuple[list, random.Random]:
    """The items of ``step``'s batch and the generator the collate goes on drawing from: a pure
    function of (seed, step), so a resumed run sees the same data. With ``open_share`` > 0 each
    drawn item that has cut points becomes, with that probability, an open-ended item cut at one
    of them (refusion/objective.py ``Example.cut``); with 0 no extra number is drawn, so the
    default batches are those of the faithful recipe."""
    rng = random.Random(f"{cfg.seed}/{step}")
    weights = dict(cfg.kind_weights)
    kinds = [k for k in examples if weights.get(k, 0) > 0]
    if not kinds:
        raise ValueError(f"no training kind has a positive weight: {sorted(examples)} vs {weights}")
    drawn = rng.choices(kinds, [weights[k] for k in kinds], k=cfg.batch_size)
    items = [rng.choice(examples[k]) for k in drawn]
    if cfg.open_share + cfg.result_share + cfg.number_share > 0:
        items = [_mix(ex, rng, cfg) if ex.cuts else ex for ex in items]
    return items, rng


def _mix(ex, rng: random.Random, cfg: TrainConfig):
    """One draw u per item with cut points: [0, open) open-ended, then a result item, then a number
    item, else the item itself (with only open_share set, the draws of runs made before the others)."""
    u = rng.random()
    if u < cfg.open_share:
        return ex.cut(rng.choice(ex.cuts))
    if u < cfg.open_share + cfg.result_share:  # a corpus without result offsets keeps the item
        return ex.result(rng.randrange(len(ex.cuts))) if ex.numbers else ex
    if u < cfg.open_share + cfg.result_share + cfg.number_share and ex.numbers:
        return ex.number(rng.randrange(len(ex.numbers)))
    return ex


def collate(name: str, items: list, rng: random.Random, cfg: TrainConfig, tokenizer):
    """The batch tensors of objective ``name`` for ``items`` (the collate draws its masks from ``rng``)."""
    from refusion import objective as obj

    if name == "refusion":
        return obj.collate_refusion(items, rng, tokenizer.mask_token_id, tokenizer.pad_token_id, cfg.slot_sizes,
                                    suffix_share=cfg.suffix_share)
    if name in ("mdm", "dream"):
        return obj.collate_mdm(items, rng, tokenizer.mask_token_id, tokenizer.pad_token_id,
                               eos_token_id=tokenizer.eos_token_id, shift=name == "dream")
    if name == "d2f":
        return obj.collate_d2f(items, rng, tokenizer.mask_token_id, tokenizer.pad_token_id,
                               block_size=cfg.d2f_block_size, eos_token_id=tokenizer.eos_token_id)
    return obj.collate_ar(items, tokenizer.pad_token_id)


def make_batch(name: str, examples, step: int, cfg: TrainConfig, tokenizer):
    """Batch for ``step``: a pure function of (seed, step), so a resumed run sees the same data."""
    items, rng = draw_items(examples, step, cfg)
    return collate(name, items, rng, cfg, tokenizer)


def data_fingerprint(examples: dict[str, list]) -> str:
    """Hash of the tokenized corpus (ids, cut points): a state file is resumed only on the same data."""
    h = hashlib.sha256()
    for kind in sorted(examples):
        h.update(kind.encode())
        for ex in examples[kind]:
            h.update(repr((ex.prompt, ex.response, ex.cuts) + ((ex.numbers,) if ex.numbers else ())).encode())
    return h.hexdigest()[:16]


class StateMismatch(ValueError):
    """A state file written by another configuration (or data) than the run asked for."""


def recipe_fields(cfg: TrainConfig) -> dict:
    """The configuration a state file must match to be resumed: everything but ``OPERATIONAL``."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in OPERATIONAL}


def _atomic_torch_save(obj, path: Path) -> None:
    import torch

    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _load_state(state_path: Path, cfg: TrainConfig, shape: ModelShape, fingerprint: str) -> dict:
    """The state file's contents, or StateMismatch naming what differs (never resumed silently)."""
    import torch

    state = torch.load(state_path, weights_only=False)
    want = {"config": recipe_fields(cfg), "shape": dataclasses.asdict(shape), "data": fingerprint}
    # A field added to TrainConfig after the state was written counts as its default (which keeps the
    # old behaviour), so a newer trainer still resumes an older run.
    old = {**dataclasses.asdict(TrainConfig()), **state.get("config", {})}
    have = {"config": {k: v for k, v in old.items() if k not in OPERATIONAL},
            "shape": state.get("shape"), "data": state.get("data")}
    diff = [f"{k}" for k in ("shape", "data") if have[k] != want[k]]
    diff += [f"{k} ({have['config'].get(k)!r} in the state, {v!r} now)" for k, v in want["config"].items()
             if have["config"].get(k) != v]
    diff += [k for k in have["config"] if k not in want["config"]]
    if diff:
        raise StateMismatch(f"{state_path} was written by another configuration ({'; '.join(diff)}): rerun with "
                            f"the settings it was started with, or pass --fresh to discard it and start over")
    return state


# Test hook (environment only, never a knob): after writing the state file at this step the trainer
# stops and waits, so a kill-and-resume test interrupts it at a chosen point instead of racing a timer.
PAUSE_ENV = "REFUSION_TRAIN_PAUSE_AFTER_STEP"


def train_one(name: str, tokenizer, examples, cfg: TrainConfig, shape: ModelShape, out_dir: Path,
              progress: bool = True, bar_position: int = 0, fresh: bool = False,
              on_snapshot: Callable | None = None, stop_after: int | None = None) -> Path | None:
    """Train ``name`` and write its checkpoint folder ``out_dir/name``; returns its path.

    Resumes from ``out_dir/.<name>.state.pt`` when one is there (model, optimizer, step, RNG states,
    log): the weights then end bit-identical to an uninterrupted run's on the same thread count. A
    state written by another configuration or corpus raises StateMismatch unless ``fresh`` (then it
    is discarded with a message). ``on_snapshot(name, step, tokens_seen, model, tokenizer)`` is called
    after each weights-only snapshot (``cfg.snapshot_every``), with the RNG states restored after it so
    it cannot change the run. ``stop_after``: write the state after that step and return None (an
    interruption at a chosen step, for tests)."""
    import torch
    from tqdm import tqdm
    from transformers import Qwen3ForCausalLM

    from refusion.objective import OBJECTIVES

    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODEL_NAMES)}")
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    model_cfg = make_config(tokenizer, shape, name)
    model = Qwen3ForCausalLM._from_config(copy.deepcopy(model_cfg), attn_implementation="sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    loss_fn = OBJECTIVES[name]
    fingerprint = data_fingerprint(examples)

    out_dir.mkdir(parents=True, exist_ok=True)
    state_path = out_dir / f".{name}.state.pt"
    start, log, tokens_seen = _resume_or_init(name, model, opt, tokenizer, cfg, shape, fingerprint, out_dir,
                                              state_path, fresh)

    def save_state(step: int) -> None:
        _atomic_torch_save({"config": dataclasses.asdict(cfg), "shape": dataclasses.asdict(shape),
                            "data": fingerprint, "step": step, "tokens_seen": tokens_seen,
                            "model": model.state_dict(), "optim": opt.state_dict(), "log": log,
                            "python_rng": random.getstate(), "torch_rng": torch.get_rng_state()}, state_path)

    pause_at = int(os.environ.get(PAUSE_ENV, "0") or 0)
    model.train()
    t0 = time.time() - (log[-1]["elapsed_s"] if log else 0.0)
    last_save = time.time()
    bar = tqdm(range(start, cfg.steps), desc=f"train {name}", disable=not progress, initial=start,
               total=cfg.steps, position=bar_position)
    for step in bar:
        items, rng = draw_items(examples, step, cfg)
        batch = collate(name, items, rng, cfg, tokenizer)
        tokens_seen += sum(len(ex.prompt) + len(ex.response) for ex in items)
        loss = _optimizer_step(model, opt, loss_fn, batch, lr_at(step, cfg), cfg.grad_clip)
        done = step + 1
        log.append({"step": done, "loss": loss.item(), "lr": opt.param_groups[0]["lr"], "tokens": tokens_seen,
                    "elapsed_s": round(time.time() - t0, 2)})
        bar.set_postfix(loss=f"{log[-1]['loss']:.3f}")
        if cfg.snapshot_every and done % cfg.snapshot_every == 0:
            _snapshot(name, model, tokenizer, out_dir, done, tokens_seen, on_snapshot)
        last = done == cfg.steps
        if not last and (done % cfg.save_every == 0 or time.time() - last_save >= cfg.save_every_s
                         or done in (stop_after, pause_at)):
            save_state(done)
            last_save = time.time()
        if done == pause_at and not last:
            print(f"{PAUSE_ENV}={pause_at}: state written, waiting to be killed", file=sys.stderr, flush=True)
            while True:
                signal.pause()
        if done == stop_after and not last:
            bar.close()
            return None

    final = _publish(name, model, tokenizer, log, cfg, shape, fingerprint, tokens_seen, out_dir)
    state_path.unlink(missing_ok=True)
    return final


def _resume_or_init(name: str, model, opt, tokenizer, cfg: TrainConfig, shape: ModelShape, fingerprint: str,
                    out_dir: Path, state_path: Path, fresh: bool) -> tuple[int, list[dict], int]:
    """(start step, log, tokens seen): from the state file when there is one (model, optimizer, RNG states
    restored; one of another configuration or corpus raises StateMismatch unless ``fresh``), else step 0 from
    the model's init checkpoint (or from scratch)."""
    import torch

    state = None
    if state_path.exists():
        try:
            state = _load_state(state_path, cfg, shape, fingerprint)
        except StateMismatch as e:
            if not fresh:
                raise
            print(f"[{name}] discarding the state file: {e}", file=sys.stderr)
            state_path.unlink()
    if state is None:
        init = init_of(name, cfg)
        if init != "scratch":
            _load_init(model, tokenizer, Path(cfg.init_dir or out_dir) / init)
        return 0, [], 0
    model.load_state_dict(state["model"])
    model.tie_weights()
    opt.load_state_dict(state["optim"])
    random.setstate(state["python_rng"])
    torch.set_rng_state(state["torch_rng"])
    print(f"[{name}] resuming at step {state['step']} from {state_path}", file=sys.stderr)
    return state["step"], state["log"], state["tokens_seen"]


def _optimizer_step(model, opt, loss_fn, batch, lr: float, grad_clip: float):
    """One AdamW step at learning rate ``lr`` with the gradient norm clipped; returns the loss."""
    import torch

    for g in opt.param_groups:
        g["lr"] = lr
    loss = loss_fn(model, batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    return loss


def _publish(name: str, model, tokenizer, log: list[dict], cfg: TrainConfig, shape: ModelShape, fingerprint: str,
             tokens_seen: int, out_dir: Path) -> Path:
    """Write the finished checkpoint next to its final place (``out_dir/name``), then swap it in."""
    final = out_dir / name
    staging = out_dir / f".{name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    model.eval()
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    _write_log(staging, log, name)
    _atomic_write_text(staging / "train_config.json", json.dumps(
        {"model": name, "train": dataclasses.asdict(cfg), "shape": dataclasses.asdict(shape),
         "recipe_fingerprint": recipe_fingerprint(cfg, shape), "data": fingerprint,
         "parameters": sum(p.numel() for p in model.parameters()), "tokens_seen": tokens_seen,
         "train_seconds": log[-1]["elapsed_s"] if log else 0.0, "final_loss": log[-1]["loss"] if log else None},
        indent=2))
    old = out_dir / f".{name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(staging, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


SNAPSHOTS = ".snapshots"  # <out>/.snapshots/<model>/: config + tokenizer once, then step-NNNNNN.pt (ignored by git)


def snapshot_dir(out_dir: Path, name: str) -> Path:
    return Path(out_dir) / SNAPSHOTS / name


def _snapshot(name: str, model, tokenizer, out_dir: Path, step: int, tokens_seen: int,
              on_snapshot: Callable | None) -> None:
    """Weights only (no optimizer) of step ``step``, written atomically; then ``on_snapshot``."""
    import torch

    folder = snapshot_dir(out_dir, name)
    if not (folder / "config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(folder)
        model.config.save_pretrained(folder)  # config.json last: its presence marks a complete folder
    _atomic_torch_save({"step": step, "tokens_seen": tokens_seen,
                        "model": {k: v.detach().clone() for k, v in model.state_dict().items()}},
                       folder / f"step-{step:06d}.pt")
    if on_snapshot is None:
        return
    py_state, torch_state = random.getstate(), torch.get_rng_state()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            on_snapshot(name, step, tokens_seen, model, tokenizer)
    finally:
        model.train(was_training)
        random.setstate(py_state)
        torch.set_rng_state(torch_state)


def load_snapshot(path: Path):
    """(model in eval mode, tokenizer, step, tokens_seen) of one snapshot file."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, Qwen3ForCausalLM

    folder = Path(path).parent
    snap = torch.load(path, weights_only=True)
    model = Qwen3ForCausalLM._from_config(AutoConfig.from_pretrained(str(folder)), attn_implementation="sdpa")
    model.load_state_dict(snap["model"])
    model.tie_weights()
    return model.eval(), AutoTokenizer.from_pretrained(str(folder)), int(snap["step"]), int(snap["tokens_seen"])


def _load_init(model, tokenizer, init_dir: Path) -> None:
    """Copy weights from a trained checkpoint of the same shape and tokenizer."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    if not (init_dir / "config.json").is_file():
        raise FileNotFoundError(f"this model starts from the {init_dir.name} checkpoint, but {init_dir} has none: "
                                f"train {init_dir.name} first or pass --<model>-init scratch")
    if AutoTokenizer.from_pretrained(str(init_dir)).get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"{init_dir} was trained with a different tokenizer; retrain ar first")
    src = Qwen3ForCausalLM.from_pretrained(str(init_dir))
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise ValueError(f"{init_dir} does not match the model shape: missing {missing}, unexpected {unexpected}")
    model.tie_weights()


def _write_log(folder: Path, log: list[dict], name: str) -> None:
    with open(folder / "train_log.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["step", "loss", "lr", "tokens", "elapsed_s"], extrasaction="ignore")
        w.writeheader()
        w.writerows(log)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [r["step"] for r in log]
    losses = [r["loss"] for r in log]
    k = 25  # running mean for readability; the raw curve is in the CSV
    smooth = [sum(losses[max(0, i - k + 1): i + 1]) / len(losses[max(0, i - k + 1): i + 1]) for i in range(len(losses))]
    ax.plot(steps, losses, alpha=0.3, label="loss")
    ax.plot(steps, smooth, label=f"running mean ({k})")
    ax.set_xlabel("step")
    ax.set_ylabel(f"{name} loss")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "loss.png", dpi=100)
    plt.close(fig)


Corpus = dict[str, list[dict]]  # kind -> training rows with "query" and "response" texts (+ optional "cut_chars")


def prepare(cfg: TrainConfig, rows: Corpus):
    """Train the tokenizer on the corpus and tokenize its rows (shared by every model). A row's optional
    ``cut_chars`` (character offsets in its response where an open-ended item may end) become token
    cut points: the fewest response tokens that cover the offset; its optional ``number_spans``
    (character spans of its numbers) become ``Example.numbers``, token spans."""
    from refusion.objective import Example
    from refusion.tokenizer import TokenizerConfig, encode_chat, encode_response, train_tokenizer

    texts = [t for kind_rows in rows.values() for r in kind_rows for t in (r["query"], r["response"])]
    tokenizer = train_tokenizer(texts, TokenizerConfig(vocab_size=cfg.vocab_size))
    examples = {kind: [Example(encode_chat(tokenizer, r["query"]), encode_response(tokenizer, r["response"]),
                               cuts=token_cuts(tokenizer, r["response"], r.get("cut_chars", ())),
                               numbers=token_spans(tokenizer, r["response"], r.get("number_spans", ())))
                       for r in kind_rows] for kind, kind_rows in rows.items()}
    return tokenizer, examples


def token_cuts(tokenizer, text: str, cut_chars) -> tuple[int, ...]:
    """Token counts n such that the first n tokens of ``text`` end exactly at one of ``cut_chars``
    (offsets where a token ends; an offset inside a token is dropped, so a cut never splits one)."""
    if not cut_chars:
        return ()
    ends = [e for _, e in tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
    want = set(cut_chars)
    return tuple(i + 1 for i, e in enumerate(ends) if e in want)


def token_spans(tokenizer, text: str, spans) -> tuple[tuple[int, int], ...]:
    """[start, end) token spans of character spans ``spans`` of ``text``, for those whose both ends fall
    on token boundaries (a span that starts or ends inside a token is dropped)."""
    if not spans:
        return ()
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    first = {s: i for i, (s, _) in enumerate(offsets)}
    after = {e: i + 1 for i, (_, e) in enumerate(offsets)}
    return tuple((first[a], after[b]) for a, b in spans if a in first and b in after)


def main(argv: list[str] | None = None, corpus: Callable[[], Corpus] | None = None,
         entry: str | None = None, add_options: Callable[[argparse.ArgumentParser], None] | None = None,
         make_hook: Callable[[argparse.Namespace], Callable | None] | None = None) -> int:
    """Command line of the trainer. ``corpus()`` returns the training rows per kind (the harness
    passes the embedded suite's training split: this package does not import the tasks);
    ``entry`` is the module that side-by-side children are started as (``python -m entry``).
    ``add_options(parser)`` adds the caller's options and ``make_hook(args)`` turns them into the
    ``on_snapshot`` callback of ``train_one`` (the harness evaluates learning curves there)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if corpus is None or entry is None:
        print("error: the trainer needs a corpus: run it as `python -m harness train-tiny`", file=sys.stderr)
        return 2
    a = _parser(add_options).parse_args(argv)
    names = [n.strip() for n in a.models.split(",") if n.strip()]
    why = _bad_args(a, names)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    overrides = dict(batch_size=a.batch_size, seed=a.seed, threads=a.threads, warmup=a.warmup,
                     suffix_share=a.suffix_share, save_every=a.save_every,
                     save_every_s=a.save_every_s, snapshot_every=a.snapshot_every, init_dir=a.init_dir,
                     **{f"{m}_init": getattr(a, f"{m}_init") for m in MODEL_NAMES})
    overrides.update({k: v for k, v in (("steps", a.steps), ("lr", a.lr), ("open_share", a.open_share),
                                        ("result_share", a.result_share), ("number_share", a.number_share))
                      if v is not None})
    previous = getattr(a, "recipe", "current") == "previous"
    base = TrainConfig(**overrides)
    hook = make_hook(a) if make_hook is not None else None
    out = Path(a.out)
    # Models a scheduled run already finished (an interrupted `make train-tiny` resumes where it was).
    done = {n for n in names if _finished(out, n, recipe(n, previous, **overrides))}
    for n in sorted(done, key=MODEL_NAMES.index):
        print(f"{n}: {out / n} was finished by this run (same recipe); kept", flush=True)
    todo = [n for n in sorted(set(names), key=MODEL_NAMES.index) if n not in done]
    if len(todo) > 1 and not a.sequential and a.threads >= 2:
        code = _schedule(todo, base, a, argv, entry)
    else:
        code = _in_process(todo, base, overrides, a, corpus, hook, previous)
    if code == 0 and not a.child:
        for n in names:  # the whole run is done: a later `make train-tiny` trains again from scratch
            _done_marker(out, n).unlink(missing_ok=True)
    return code


def _parser(add_options: Callable[[argparse.ArgumentParser], None] | None) -> argparse.ArgumentParser:
    """The trainer's options, and the caller's (``add_options``)."""
    p = argparse.ArgumentParser(prog="python -m harness train-tiny", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODEL_NAMES),
                   help=f"comma-separated subset of {','.join(MODEL_NAMES)} (default: all)")
    p.add_argument("--out", default="checkpoints/tiny", help="output folder (one sub-folder per model)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps for every model (default: each model's recipe: "
                   + ", ".join(f"{k} {v['steps']}" for k, v in RECIPES.items()) + ")")
    if PREVIOUS:  # only while some committed folder still holds an earlier recipe
        p.add_argument("--recipe", choices=["current", "previous"], default="current",
                       help="current: RECIPES (default); previous: the earlier settings, for the models whose "
                       "committed folder still holds them (" + ", ".join(PREVIOUS) + ")")
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate for every model (default: the recipe's)")
    p.add_argument("--warmup", type=int, default=TrainConfig.warmup, help="linear warm-up steps")
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--threads", type=int, default=TrainConfig.threads)
    for m in MODEL_NAMES:
        default = getattr(TrainConfig, f"{m}_init")
        p.add_argument(f"--{m}-init", choices=[*MODEL_NAMES, "scratch"], default=default,
                       help=f"start {m} from this model's trained checkpoint in --init-dir (default {default}) "
                       "or from random weights (scratch)")
    p.add_argument("--init-dir", default="",
                   help="folder of the checkpoints models start from (default: --out); e.g. --out runs-exp/x "
                   "--init-dir checkpoints/tiny --refusion-init refusion continues the committed refusion model")
    p.add_argument("--open-share", type=float, default=None,
                   help="arithmetic-signal mixture: share of math items replaced by an open-ended item that stops "
                   "right after an intermediate result (no EOS, no loss after it); default: each model's recipe "
                   f"({MIX['open_share']} for the diffusion models, 0 for ar: the faithful data)")
    p.add_argument("--result-share", type=float, default=None,
                   help="arithmetic-signal mixture: share of math items replaced by a result item, whose prompt runs "
                   "up to an intermediate result and whose response is that result ('127.'; no EOS); default: "
                   f"each model's recipe ({MIX['result_share']} for the diffusion models, 0 for ar)")
    p.add_argument("--number-share", type=float, default=None,
                   help="arithmetic-signal mixture: share of math items replaced by a number item, whose prompt runs "
                   "up to any number of the solution (operand, result, answer) and whose response is that number "
                   "and the token after it; default: the recipe's (0)")
    p.add_argument("--suffix-share", type=float, default=TrainConfig.suffix_share,
                   help="refusion only: share of examples whose slot plan masks every slot from a random one on "
                   "(as decoding meets them) instead of random slots; default 0, the paper's objective")
    p.add_argument("--save-every", type=int, default=TrainConfig.save_every,
                   help="write the resumable state file every N steps ...")
    p.add_argument("--save-every-s", type=float, default=TrainConfig.save_every_s,
                   help="... and at least every this many seconds (wall clock)")
    p.add_argument("--snapshot-every", type=int, default=TrainConfig.snapshot_every,
                   help="weights-only snapshot every N steps under <out>/.snapshots/<model>/ (0: none)")
    p.add_argument("--fresh", action="store_true",
                   help="discard a state file written by another configuration instead of stopping with an error")
    p.add_argument("--sequential", action="store_true",
                   help="train the models of one stage (those starting from the same trained model) one after "
                   "the other with all threads (default: side by side, threads split between them)")
    p.add_argument("--bar-position", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one model of a scheduled run
    if add_options is not None:
        add_options(p)
    return p


def _bad_args(a: argparse.Namespace, names: list[str]) -> str | None:
    """What is wrong with the options (one line), or None."""
    bad = [n for n in names if n not in MODEL_NAMES]
    if bad or not names:
        return f"unknown model(s) {', '.join(bad) or '(none)'}; valid: {', '.join(MODEL_NAMES)}"
    if (a.steps is not None and a.steps < 1) or a.batch_size < 1 or (a.lr is not None and a.lr <= 0):
        return "--steps and --batch-size must be >= 1, --lr > 0"
    shares = [x for x in (a.open_share, a.result_share, a.number_share) if x is not None]
    if not (all(0 <= x <= 1 for x in shares) and sum(shares) <= 1 and 0 <= a.suffix_share <= 1) \
            or a.save_every < 1 or a.save_every_s <= 0 or a.snapshot_every < 0 or a.warmup < 0:
        return ("--open-share, --result-share, --number-share (and their sum) and --suffix-share must be in "
                "[0, 1], --save-every >= 1, --save-every-s > 0, --snapshot-every >= 0, --warmup >= 0")
    return None


def _in_process(names: list[str], base: TrainConfig, overrides: dict, a: argparse.Namespace,
                corpus: Callable[[], Corpus], hook: Callable | None, previous: bool = False) -> int:
    """Train ``names`` one after the other in this process, each after the model it starts from."""
    prepared = None
    for stage in stages(names, base):
        prepared = prepared or prepare(base, corpus())
        for name in stage:
            cfg = recipe(name, previous, **overrides)
            try:
                _train_timed(name, *prepared, cfg, Path(a.out), a.bar_position, a.fresh, hook)
            except StateMismatch as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            _atomic_write_text(_done_marker(Path(a.out), name), recipe_fingerprint(cfg, ModelShape()))
    return 0


def _train_timed(name: str, tokenizer, examples, cfg: TrainConfig, out: Path, bar_position: int, fresh: bool,
                 hook: Callable | None) -> None:
    t0 = time.time()
    path = train_one(name, tokenizer, examples, cfg, ModelShape(), out, bar_position=bar_position, fresh=fresh,
                     on_snapshot=hook)
    print(f"{name}: {path} in {time.time() - t0:.0f}s", flush=True)


def _done_marker(out: Path, name: str) -> Path:
    """``out/.<name>.done``: the recipe fingerprint of a model this run finished (ignored by git; removed
    when the whole run is done), so rerunning an interrupted run keeps it instead of training it again."""
    return out / f".{name}.done"


def _finished(out: Path, name: str, cfg: TrainConfig) -> bool:
    marker, conf = _done_marker(out, name), out / name / "train_config.json"
    if not (marker.is_file() and conf.is_file()):
        return False
    want = recipe_fingerprint(cfg, ModelShape())
    rec = json.loads(conf.read_text())
    return marker.read_text().strip() == want == recipe_fingerprint(rec["train"], rec["shape"])


def stages(names: list[str], cfg: TrainConfig) -> list[list[str]]:
    """``names`` grouped by depth in the start-from chain among ``names`` (ar; then what starts from
    ar; then what starts from those), so each stage needs only checkpoints trained by an earlier
    stage or already on disk."""
    def depth(n: str) -> int:
        init = init_of(n, cfg)
        return 1 + depth(init) if init in names and init != n else 0
    out: dict[int, list[str]] = {}
    for n in names:
        out.setdefault(depth(n), []).append(n)
    return [out[d] for d in sorted(out)]


def _schedule(names: list[str], cfg: TrainConfig, a: argparse.Namespace, argv: list[str], entry: str) -> int:
    """Train ``names`` as child processes (``python -m entry --models <one>``), each started as soon as
    the model it starts from is trained, at most ``a.threads`` at a time. Models that others wait on go
    first (mdm before refusion and dream, since d2f starts from mdm). Threads: a model that is alone on
    the machine gets all of them (ar), otherwise one each (the 2-core recipe: ar on both cores, then
    mdm and refusion side by side, then d2f and dream). A failed model's dependents are not started."""
    import subprocess

    local = not cfg.init_dir or Path(cfg.init_dir).resolve() == Path(a.out).resolve()
    deps = {n: init_of(n, cfg) if local and init_of(n, cfg) in names and init_of(n, cfg) != n else None
            for n in names}

    def chain(n: str) -> int:  # length of the longest chain of models waiting on n
        return 1 + max((chain(m) for m in names if deps[m] == n), default=0)

    keep = []  # the caller's options except those set per child below
    skip = {"--models", "--threads", "--bar-position", "--child"}
    it = iter(argv)
    for tok in it:
        if tok.split("=")[0] in skip:
            if "=" not in tok and tok != "--child":
                next(it, None)
            continue
        keep.append(tok)
    waiting = sorted(names, key=lambda n: (-chain(n), MODEL_NAMES.index(n)))
    running: dict[str, tuple[subprocess.Popen, int]] = {}  # name -> (process, progress-bar slot)
    finished: set[str] = set()
    skipped: set[str] = set()  # not started: the model they start from failed
    failed: dict[str, int] = {}  # name -> exit status
    try:
        while waiting or running:
            for n in [n for n in waiting if deps[n] in failed or deps[n] in skipped]:
                waiting.remove(n)
                skipped.add(n)
            ready = [n for n in waiting if deps[n] is None or deps[n] in finished]
            while ready and len(running) < a.threads:
                n = ready.pop(0)
                waiting.remove(n)
                threads = max(1, (a.threads - len(running)) // (1 + len(ready)))
                slot = min(set(range(a.threads)) - {s for _, s in running.values()})
                print(f"{n}: training on {threads} thread(s)", flush=True)
                running[n] = (subprocess.Popen([sys.executable, "-m", entry, *keep, "--models", n, "--threads",
                                                str(threads), "--bar-position", str(slot), "--child"]), slot)
            for n, (proc, _) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[n]
                if proc.returncode == 0:
                    finished.add(n)
                else:
                    failed[n] = proc.returncode
            if running:
                time.sleep(1)
    except BaseException:
        for proc, _ in running.values():
            proc.terminate()  # state files keep the progress: rerunning resumes
        raise
    for n, c in failed.items():
        print(f"error: training {n} failed (exit {c}); rerun to resume from its last state", file=sys.stderr)
    for n in sorted(skipped, key=MODEL_NAMES.index):
        print(f"error: {n} was not trained: the model it starts from ({deps[n]}) was not", file=sys.stderr)
    return 0 if not failed and not skipped else max([1, *(c for c in failed.values() if c > 0)])


if __name__ == "__main__":
    sys.exit(main())  # says how to run it with a corpus
