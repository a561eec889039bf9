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
file (written atomically every ``--save-every`` steps); the finished folder
replaces the old one atomically.
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MODEL_NAMES = ("ar", "refusion", "mdm", "dream", "d2f")  # training order (each after the model it starts from)

# Per-model recipe (steps, peak lr): ar learns the tasks from scratch; the others adapt trained
# weights to their objective, as ReFusion fine-tunes Qwen3-8B, Dream starts from Qwen2.5 and D2F
# distils a trained LLaDA / Dream. Each fits in under 60 minutes on 2 CPU cores (README: measured times).
RECIPES: dict[str, tuple[int, float]] = {"ar": (3000, 2e-3), "refusion": (1500, 1e-3), "mdm": (1500, 1e-3),
                                         "dream": (1800, 1e-3), "d2f": (1800, 1e-3)}
# Bidirectional (LLaDA, Dream) or block-causal (D2F, explicit masks) attention: not causal.
NON_CAUSAL = ("mdm", "dream", "d2f")


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
    save_every: int = 200
    refusion_init: str = "ar"  # "ar": start from the trained ar checkpoint in the same folder; "scratch"
    mdm_init: str = "ar"       # likewise for mdm
    dream_init: str = "ar"     # Dream is initialised from an AR model
    d2f_init: str = "mdm"      # D2F starts from a trained masked-diffusion model
    d2f_block_size: int = 8    # D2F's block (the decoder's block_size on the tiny model)
    # Share of each kind in a batch: arithmetic is the hardest thing the suite asks of a tiny model.
    kind_weights: tuple[tuple[str, float], ...] = (("math", 0.45), ("code", 0.2), ("choice", 0.35))


def recipe(name: str, **overrides) -> TrainConfig:
    """The committed training configuration of one tiny model; ``overrides`` replace fields."""
    steps, lr = RECIPES[name]
    return dataclasses.replace(TrainConfig(steps=steps, lr=lr), **overrides)


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


def make_batch(name: str, examples, step: int, cfg: TrainConfig, tokenizer):
    """Batch for ``step``: a pure function of (seed, step), so a resumed run sees the same data."""
    from refusion import objective as obj

    rng = random.Random(f"{cfg.seed}/{step}")
    weights = dict(cfg.kind_weights)
    kinds = [k for k in examples if weights.get(k, 0) > 0]
    if not kinds:
        raise ValueError(f"no training kind has a positive weight: {sorted(examples)} vs {weights}")
    drawn = rng.choices(kinds, [weights[k] for k in kinds], k=cfg.batch_size)
    batch = [rng.choice(examples[k]) for k in drawn]
    if name == "refusion":
        return obj.collate_refusion(batch, rng, tokenizer.mask_token_id, tokenizer.pad_token_id, cfg.slot_sizes)
    if name in ("mdm", "dream"):
        return obj.collate_mdm(batch, rng, tokenizer.mask_token_id, tokenizer.pad_token_id,
                               eos_token_id=tokenizer.eos_token_id, shift=name == "dream")
    if name == "d2f":
        return obj.collate_d2f(batch, rng, tokenizer.mask_token_id, tokenizer.pad_token_id,
                               block_size=cfg.d2f_block_size, eos_token_id=tokenizer.eos_token_id)
    return obj.collate_ar(batch, tokenizer.pad_token_id)


def train_one(name: str, tokenizer, examples, cfg: TrainConfig, shape: ModelShape, out_dir: Path,
              progress: bool = True, bar_position: int = 0) -> Path:
    import torch
    from tqdm import tqdm
    from transformers import Qwen3ForCausalLM

    from refusion.objective import OBJECTIVES

    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODEL_NAMES)}")
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    model_cfg = make_config(tokenizer, shape, name)
    model = Qwen3ForCausalLM._from_config(copy.deepcopy(model_cfg), attn_implementation="sdpa")
    init = init_of(name, cfg)
    if init != "scratch":
        _load_init(model, tokenizer, out_dir / init)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    loss_fn = OBJECTIVES[name]

    out_dir.mkdir(parents=True, exist_ok=True)
    state_path = out_dir / f".{name}.state.pt"
    log: list[dict] = []
    start = 0
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        if state["config"] == dataclasses.asdict(cfg) and state["shape"] == dataclasses.asdict(shape):
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            start, log = state["step"], state["log"]
            print(f"[{name}] resuming at step {start}", file=sys.stderr)

    model.train()
    t0 = time.time()
    bar = tqdm(range(start, cfg.steps), desc=f"train {name}", disable=not progress, initial=start,
               total=cfg.steps, position=bar_position)
    for step in bar:
        batch = make_batch(name, examples, step, cfg, tokenizer)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        loss = loss_fn(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        log.append({"step": step + 1, "loss": loss.item(), "lr": opt.param_groups[0]["lr"],
                    "elapsed_s": round(time.time() - t0, 2)})
        bar.set_postfix(loss=f"{log[-1]['loss']:.3f}")
        if (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
            tmp = state_path.with_name(state_path.name + ".tmp")
            torch.save({"config": dataclasses.asdict(cfg), "shape": dataclasses.asdict(shape), "step": step + 1,
                        "model": model.state_dict(), "optim": opt.state_dict(), "log": log}, tmp)
            os.replace(tmp, state_path)

    # Write the finished checkpoint next to its final place, then swap it in.
    final = out_dir / name
    staging = out_dir / f".{name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    model.eval()
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    _write_log(staging, log, name)
    _atomic_write_text(staging / "train_config.json", json.dumps(
        {"model": name, "train": dataclasses.asdict(cfg), "shape": dataclasses.asdict(shape),
         "parameters": sum(p.numel() for p in model.parameters()),
         "train_seconds": log[-1]["elapsed_s"] if log else 0.0, "final_loss": log[-1]["loss"] if log else None},
        indent=2))
    old = out_dir / f".{name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(staging, final)
    shutil.rmtree(old, ignore_errors=True)
    state_path.unlink(missing_ok=True)
    return final


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
        w = csv.DictWriter(f, fieldnames=["step", "loss", "lr", "elapsed_s"])
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


Corpus = dict[str, list[dict]]  # kind -> training rows with "query" and "response" texts


def prepare(cfg: TrainConfig, rows: Corpus):
    """Train the tokenizer on the corpus and tokenize its rows (shared by every model)."""
    from refusion.objective import Example
    from refusion.tokenizer import TokenizerConfig, encode_chat, encode_response, train_tokenizer

    texts = [t for kind_rows in rows.values() for r in kind_rows for t in (r["query"], r["response"])]
    tokenizer = train_tokenizer(texts, TokenizerConfig(vocab_size=cfg.vocab_size))
    examples = {kind: [Example(encode_chat(tokenizer, r["query"]), encode_response(tokenizer, r["response"]))
                       for r in kind_rows] for kind, kind_rows in rows.items()}
    return tokenizer, examples


def main(argv: list[str] | None = None, corpus: Callable[[], Corpus] | None = None,
         entry: str | None = None) -> int:
    """Command line of the trainer. ``corpus()`` returns the training rows per kind (the harness
    passes the embedded suite's training split: this package does not import the tasks);
    ``entry`` is the module that side-by-side children are started as (``python -m entry``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if corpus is None or entry is None:
        print("error: the trainer needs a corpus: run it as `python -m harness train-tiny`", file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(prog="python -m harness train-tiny", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODEL_NAMES),
                   help=f"comma-separated subset of {','.join(MODEL_NAMES)} (default: all)")
    p.add_argument("--out", default="checkpoints/tiny", help="output folder (one sub-folder per model)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps for every model (default: each model's recipe: "
                   + ", ".join(f"{k} {v[0]}" for k, v in RECIPES.items()) + ")")
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate for every model (default: the recipe's)")
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--threads", type=int, default=TrainConfig.threads)
    for m in MODEL_NAMES[1:]:
        default = getattr(TrainConfig, f"{m}_init")
        p.add_argument(f"--{m}-init", choices=[default, "scratch"], default=default,
                       help=f"start {m} from the trained {default} checkpoint (default) or from random weights")
    p.add_argument("--sequential", action="store_true",
                   help="train the models of one stage (those starting from the same trained model) one after "
                   "the other with all threads (default: side by side, threads split between them)")
    p.add_argument("--bar-position", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    names = [n.strip() for n in a.models.split(",") if n.strip()]
    bad = [n for n in names if n not in MODEL_NAMES]
    if bad or not names:
        print(f"error: unknown model(s) {', '.join(bad) or '(none)'}; valid: {', '.join(MODEL_NAMES)}", file=sys.stderr)
        return 2
    if (a.steps is not None and a.steps < 1) or a.batch_size < 1 or (a.lr is not None and a.lr <= 0):
        print("error: --steps and --batch-size must be >= 1, --lr > 0", file=sys.stderr)
        return 2
    overrides = dict(batch_size=a.batch_size, seed=a.seed, threads=a.threads,
                     **{f"{m}_init": getattr(a, f"{m}_init") for m in MODEL_NAMES[1:]})
    overrides.update({k: v for k, v in (("steps", a.steps), ("lr", a.lr)) if v is not None})
    base = TrainConfig(**overrides)
    prepared = None
    for stage in stages(sorted(set(names), key=MODEL_NAMES.index), base):
        if len(stage) > 1 and not a.sequential and a.threads >= 2:
            # Models of one stage depend only on earlier stages: one process each, threads split.
            code = _side_by_side(stage, a, argv, entry)
            if code:
                return code
            continue
        prepared = prepared or prepare(base, corpus())
        for name in stage:
            _train_timed(name, *prepared, recipe(name, **overrides), Path(a.out), a.bar_position)
    return 0


def stages(names: list[str], cfg: TrainConfig) -> list[list[str]]:
    """``names`` grouped by depth in the start-from chain among ``names`` (ar; then what starts from
    ar; then what starts from those), so each stage needs only checkpoints trained by an earlier
    stage or already on disk."""
    def depth(n: str) -> int:
        init = init_of(n, cfg)
        return 1 + depth(init) if init in names else 0
    out: dict[int, list[str]] = {}
    for n in names:
        out.setdefault(depth(n), []).append(n)
    return [out[d] for d in sorted(out)]


def _train_timed(name: str, tokenizer, examples, cfg: TrainConfig, out: Path, bar_position: int) -> None:
    t0 = time.time()
    path = train_one(name, tokenizer, examples, cfg, ModelShape(), out, bar_position=bar_position)
    print(f"{name}: {path} in {time.time() - t0:.0f}s", flush=True)


def _side_by_side(names: list[str], a: argparse.Namespace, argv: list[str], entry: str) -> int:
    import subprocess

    keep = []  # the caller's options except those set per child below
    skip = {"--models", "--threads", "--bar-position"}
    it = iter(argv)
    for tok in it:
        if tok.split("=")[0] in skip:
            if "=" not in tok:
                next(it, None)
            continue
        keep.append(tok)
    per = max(1, a.threads // len(names))
    procs = [subprocess.Popen([sys.executable, "-m", entry, *keep, "--models", n, "--threads", str(per),
                               "--bar-position", str(i)]) for i, n in enumerate(names)]
    try:
        codes = [p.wait() for p in procs]
    except BaseException:
        for p in procs:
            p.terminate()  # state files keep the progress: rerunning resumes
        raise
    for n, c in zip(names, codes):
        if c != 0:
            print(f"error: training {n} failed (exit {c}); rerun to resume from its last state", file=sys.stderr)
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())  # says how to run it with a corpus
