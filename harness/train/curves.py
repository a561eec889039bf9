"""`make curves`: learning curves of the tiny models, quality and TPF against training step and
training tokens seen.

    python -m harness curves [--root checkpoints/tiny] [--models ar,refusion,mdm,dream,d2f]
                             [--n 100] [--batch 16] [--out reports/curves]

Each point evaluates one set of weights on a fixed slice of the embedded TEST split (the first
``--n`` items of every kind) with the model's own preset decoder (``PRESET_OF``: the first preset on
``checkpoints/tiny/<model>`` in harness/run/presets.py, so mdm is decoded by llada; knobs as `make eval` sets them:
the task table's budget under the preset's knobs), called in-process through the decoder registry
in left-padded batches of ``--batch`` where the decoder batches, and scored by the tasks' own
scoring (tasks/scoring.py). The weights are the trainer's snapshots
(``<root>/.snapshots/<model>/step-NNNNNN.pt``, written with ``train-tiny --snapshot-every N``)
and the finished checkpoint ``<root>/<model>``. `train-tiny --curves` evaluates each snapshot as
it is written instead (harness/train/train_tiny.py).

TPF is generated tokens over NFE with a row charged every forward of its batch, as `harness eval`
counts it: at ``--batch 1`` it is the bench's figure; in larger batches it is lower, as a batch
runs until its slowest row is done. Points already in the JSON (same run, step, slice and batch)
are kept, so an interrupted or repeated call only evaluates what is new. Output:
``<out>/curves.json`` and ``<out>/curves.png`` (one figure, every run), written atomically.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from harness.run.presets import PRESETS, TINY
from harness.run.store import atomic_save_figure, atomic_write_json
from refusion.train import MODEL_NAMES

# Tiny model -> the preset that decodes it: the first preset on its folder (mdm -> llada).
PRESET_OF = {m: next(n for n, s in PRESETS.items() if s.checkpoint == f"{TINY}/{m}") for m in MODEL_NAMES}
DEFAULT_N = 100
DEFAULT_BATCH = 16
DEFAULT_OUT = Path("reports/curves")
KIND_ORDER = ("math", "code", "choice")


def test_slice(kind: str, n: int) -> list[dict]:
    """The first ``n`` items of one kind of the embedded test split (the split itself is frozen)."""
    from tasks.embedded import load_split

    return load_split(kind, "test")[:n]


def _special_ids(model, tokenizer) -> tuple[list[int], int | None]:
    """EOS ids and mask id by the adapter's rules (harness/run/lm_decode.py ``special_ids``)."""
    from harness.run.lm_decode import special_ids

    eos, mask = special_ids(model, tokenizer)
    return list(eos), mask


def prompt_ids(tokenizer, query: str) -> list[int]:
    """The prompt as `make eval` builds it: the chat template as text, then encoded without extra specials."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": query}], tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def evaluate(model, tokenizer, preset: str, n: int = DEFAULT_N, batch: int = DEFAULT_BATCH,
             kinds: tuple[str, ...] = KIND_ORDER, probe_as: str | None = None) -> dict[str, dict]:
    """Quality and TPF of ``model`` under preset ``preset`` on the first ``n`` test items of each kind.

    Returns {kind: {"quality": mean task score (0..1), "tpf", "generated_tokens", "nfe", "items", "seconds"}};
    math also gets the finer signals of ``arithmetic`` and, with ``probe_as`` (the model's name in
    PRESET_OF), the teacher-forced result-digit probe (harness/train/probe.py).
    """
    import torch

    from harness.run.presets import PRESETS, paper_knobs
    from refusion.decoding import get_decoder, make_knobs
    from tasks.info import task_info
    from tasks.scoring import score_many

    spec = PRESETS[preset]
    decoder = get_decoder(spec.decoder)
    accepted = set(decoder.knobs.names())
    eos, mask = _special_ids(model, tokenizer)
    bs = batch if decoder.batched else 1
    out: dict[str, dict] = {}
    for kind in kinds:
        unit = f"embedded_{kind}"
        knobs = make_knobs(spec.decoder, {**paper_knobs(unit, spec.decoder, accepted), **spec.knobs})
        docs = test_slice(kind, n)
        prompts = [prompt_ids(tokenizer, d["query"]) for d in docs]
        responses, gen, nfe = [], 0, 0
        t0 = time.perf_counter()
        with torch.no_grad():
            for i in range(0, len(prompts), bs):
                chunk = prompts[i:i + bs]
                if len(chunk) == 1:
                    ids, attn = torch.tensor(chunk, dtype=torch.long), None
                else:  # left padding, as the adapter does (the mask tells the decoder what is real)
                    padded = tokenizer.pad({"input_ids": chunk}, padding=True, padding_side="left",
                                           return_tensors="pt")
                    ids, attn = padded["input_ids"], padded["attention_mask"]
                tokens, stats = decoder(model, ids, attn, knobs, eos_token_id=eos, mask_token_id=mask)
                for row in tokens:
                    toks = [int(t) for t in row.tolist()]  # cut after the first EOS by the decoder
                    gen += len(toks)
                    nfe += int(stats["nfe"])  # every row is charged its batch's forwards
                    if toks and toks[-1] in eos:
                        toks = toks[:-1]
                    responses.append(tokenizer.decode(toks, skip_special_tokens=True))
        seconds = time.perf_counter() - t0
        primary = task_info(unit).primary
        scores = [s[primary] for s in score_many(unit, responses, docs)]
        out[kind] = {"quality": sum(scores) / len(scores) if scores else 0.0, "tpf": gen / nfe if nfe else 0.0,
                     "generated_tokens": gen, "nfe": nfe, "items": len(docs), "seconds": round(seconds, 2)}
        if kind == "math":
            out[kind].update(arithmetic(responses, docs))
            if probe_as is not None:
                out[kind].update(probe(model, tokenizer, probe_as, docs))
    return out


def probe(model, tokenizer, name: str, docs: list[dict]) -> dict[str, float]:
    """The result-digit probe of harness/train/probe.py with the model's own mask and EOS ids."""
    from harness.train.probe import result_digit_accuracy

    eos, mask = _special_ids(model, tokenizer)
    pad_eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else eos[0]  # training's EOS pad
    return result_digit_accuracy(model, tokenizer, name, docs, mask, pad_eos)


EQUATION = re.compile(r"(-?\d+) ([+-]) (-?\d+) = (-?\d+)")


def arithmetic(responses: list[str], docs: list[dict]) -> dict[str, float]:
    """Finer math signals than exact match of the final answer (which needs every step right):
    ``arith_lines``, the share of generated "a + b = c" / "a - b = c" equations whose c is right for
    their own a and b; ``first_result``, the share of responses whose first equation's result is the
    gold solution's first intermediate result."""
    right = total = first = 0
    for resp, doc in zip(responses, docs):
        eqs = EQUATION.findall(resp)
        for a, op, b, c in eqs:
            total += 1
            right += int(c) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        gold = EQUATION.findall(doc["response"])
        first += bool(eqs and gold and eqs[0][3] == gold[0][3])
    return {"arith_lines": right / total if total else 0.0, "first_result": first / len(docs) if docs else 0.0}


# ---------------------------------------------------------------- the record

def _load(path: Path) -> dict:
    if path.is_file():
        return json.loads(path.read_text())
    return {"split": "embedded test", "kinds": list(KIND_ORDER), "runs": {}}


def run_key(root: Path | str, model: str) -> str:
    return f"{Path(root).as_posix().rstrip('/')}/{model}"


def find_point(data: dict, key: str, step: int, n: int, batch: int) -> dict | None:
    run = data["runs"].get(key, {})
    return next((p for p in run.get("points", []) if p["step"] == step and p["n_per_kind"] == n
                 and p["batch"] == batch), None)


def has_point(data: dict, key: str, step: int, n: int, batch: int) -> bool:
    return find_point(data, key, step, n, batch) is not None


def lacks_probe(point: dict) -> bool:
    """A math point recorded before the result-digit probe existed (its decoding figures are kept)."""
    return "math" in point["kinds"] and "probe_result_digits" not in point["kinds"]["math"]


@contextmanager
def _locked(path: Path):
    """The curves data at ``path``, loaded under an exclusive lock held until the block ends: models
    trained side by side, and `make curves` beside them, write one file."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield _load(path)


def _save(path: Path, data: dict) -> None:
    atomic_write_json(path, data)
    plot(data, path.with_suffix(".png"))


def add_probe(path: Path, key: str, step: int, n: int, batch: int, values: dict) -> None:
    """Add the probe's figures to an existing math point."""
    with _locked(path) as data:
        find_point(data, key, step, n, batch)["kinds"]["math"].update(values)
        _save(path, data)


def record(path: Path, key: str, model: str, step: int, tokens_seen: int | None, result: dict, n: int,
           batch: int, source: str) -> None:
    """Add (or replace) one point of run ``key`` in the curves JSON and redraw the figure beside it."""
    with _locked(path) as data:
        run = data["runs"].setdefault(key, {"model": model, "preset": PRESET_OF[model], "points": []})
        run["points"] = [p for p in run["points"] if not (p["step"] == step and p["n_per_kind"] == n
                                                           and p["batch"] == batch)]
        run["points"].append({"step": step, "tokens_seen": tokens_seen, "n_per_kind": n, "batch": batch,
                              "source": source, "kinds": result})
        run["points"].sort(key=lambda p: p["step"])
        _save(path, data)


# What a run's curve was trained on: the data mixture and the budget, so curves of several models can be
# checked for the same mixture and the same training tokens.
TRAIN_FIELDS = ("steps", "batch_size", "lr", "seed", "open_share", "result_share", "number_share", "suffix_share",
                "kind_weights")


def train_info(root: Path, model: str) -> dict | None:
    """The recipe fields of the run that wrote ``root/model`` (its train_config.json, or the state file of a
    run still in progress), with its recipe fingerprint and tokens seen when finished; None if neither."""
    cfg = root / model / "train_config.json"
    if cfg.is_file():
        rec = json.loads(cfg.read_text())
        train, extra = rec["train"], {k: rec[k] for k in ("recipe_fingerprint", "tokens_seen") if k in rec}
    else:
        state = root / f".{model}.state.pt"
        if not state.is_file():
            return None
        import torch

        train, extra = torch.load(state, weights_only=False).get("config", {}), {"in_progress": True}
    from refusion.train import TrainConfig

    defaults = TrainConfig()
    return {**{k: train.get(k, getattr(defaults, k)) for k in TRAIN_FIELDS}, **extra}


def set_train(path: Path, key: str, model: str, info: dict | None) -> None:
    """Record ``info`` (train_info) as run ``key``'s ``train`` entry."""
    if info is None or not path.is_file():
        return
    with _locked(path) as data:
        run = data["runs"].setdefault(key, {"model": model, "preset": PRESET_OF[model], "points": []})
        if run.get("train") != info:
            run["train"] = info
            _save(path, data)


# The bottom row: finer math signals than exact match, one per panel (key in the math point, title).
MATH_SIGNALS = (("probe_result_digits", "math: result digits from a clean prefix\n(teacher-forced probe)"),
                ("probe_first_digits", "math: leading result digits\n(teacher-forced probe)"),
                ("arith_lines", "math: generated equations right"))


def merge(path: Path, other: dict) -> int:
    """Add the points of curves data ``other`` that ``path`` lacks (same run, step, slice and batch);
    returns how many were added."""
    added = 0
    with _locked(path) as data:
        for key, run in other.get("runs", {}).items():
            mine = data["runs"].setdefault(key, {"model": run["model"], "preset": run["preset"], "points": []})
            for pt in run["points"]:
                if find_point(data, key, pt["step"], pt["n_per_kind"], pt["batch"]) is None:
                    mine["points"].append(pt)
                    added += 1
            mine["points"].sort(key=lambda q: q["step"])
        if added:
            atomic_write_json(path, data)
    return added


def plot(data: dict, png: Path) -> None:
    """One figure: quality vs step, quality vs training tokens and TPF vs step, one column per kind;
    a last row of math signals finer than exact match (harness/train/probe.py, ``arithmetic``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = data.get("kinds", list(KIND_ORDER))
    cols = max(len(kinds), len(MATH_SIGNALS))
    fig, axes = plt.subplots(4, cols, figsize=(4.2 * cols, 12), squeeze=False)
    for key, run in sorted(data["runs"].items()):
        pts = run["points"]
        label = f"{'/'.join(key.split('/')[-2:])} ({run['preset']})"  # run folder/model (preset)
        for j, kind in enumerate(kinds):
            sel = [p for p in pts if kind in p["kinds"]]
            steps = [p["step"] for p in sel]
            q = [100 * p["kinds"][kind]["quality"] for p in sel]
            axes[0][j].plot(steps, q, marker="o", ms=3, label=label)
            tok = [(p["tokens_seen"], 100 * p["kinds"][kind]["quality"]) for p in sel if p["tokens_seen"] is not None]
            axes[1][j].plot([t / 1e6 for t, _ in tok], [v for _, v in tok], marker="o", ms=3, label=label)
            axes[2][j].plot(steps, [p["kinds"][kind]["tpf"] for p in sel], marker="o", ms=3, label=label)
        math = [p for p in pts if "math" in p["kinds"]]
        for j, (field, _) in enumerate(MATH_SIGNALS):
            sel = [p for p in math if field in p["kinds"]["math"]]
            axes[3][j].plot([p["step"] for p in sel], [100 * p["kinds"]["math"][field] for p in sel], marker="o",
                            ms=3, label=label)
    for j in range(cols):
        if j >= len(kinds):
            for r in range(3):
                axes[r][j].set_visible(False)
            continue
        kind = kinds[j]
        if not axes[1][j].lines or not any(len(ln.get_xdata()) for ln in axes[1][j].lines):
            axes[1][j].text(0.5, 0.5, "no run recorded tokens seen\n(checkpoints trained before the count)",
                            ha="center", va="center", transform=axes[1][j].transAxes, fontsize=8)
        axes[0][j].set_title(f"embedded {kind}")
        axes[0][j].set_xlabel("step")
        axes[1][j].set_xlabel("training tokens seen (M)")
        axes[2][j].set_xlabel("step")
    for j, (_, title) in enumerate(MATH_SIGNALS):
        axes[3][j].set_title(title, fontsize=9)
        axes[3][j].set_xlabel("step")
        axes[3][j].set_ylim(-3, 103)
    for j in range(len(MATH_SIGNALS), cols):
        axes[3][j].set_visible(False)
    axes[0][0].set_ylabel("quality (%)")
    axes[1][0].set_ylabel("quality (%)")
    axes[2][0].set_ylabel("TPF")
    axes[3][0].set_ylabel("accuracy (%)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    atomic_save_figure(fig, png)


# ---------------------------------------------------------------- sources of weights

def snapshot_hook(path: Path, root: Path, n: int = DEFAULT_N, batch: int = DEFAULT_BATCH,
                  kinds: tuple[str, ...] = KIND_ORDER) -> Callable:
    """``on_snapshot`` for refusion/train.py: evaluate each snapshot as it is written, record it."""
    def hook(name: str, step: int, tokens_seen: int, model, tokenizer) -> None:
        key = run_key(root, name)
        if has_point(_load(path), key, step, n, batch):
            return
        t0 = time.time()
        res = evaluate(model, tokenizer, PRESET_OF[name], n, batch, kinds, probe_as=name)
        record(path, key, name, step, tokens_seen, res, n, batch, source="during training")
        summary = ", ".join(f"{k} {100 * v['quality']:.1f}% tpf {v['tpf']:.2f}" for k, v in res.items())
        print(f"[curves] {name} step {step}: {summary} ({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
    return hook


def _start(folder: Path, model: str) -> tuple[Path | None, int, int]:
    """Where the run that wrote checkpoint ``folder`` started: (the checkpoint it continued, or None for
    a run from random weights or from another model's weights in its own output folder; the steps and
    training tokens of continuation runs before it). A run that continued a trained checkpoint
    (``--init-dir X --<model>-init Y``) starts from X/Y; if X/Y was itself written by such a run, its
    steps and tokens count too, so a run continued in pieces reads as one curve."""
    cfg = folder / "train_config.json"
    if not cfg.is_file():
        return None, 0, 0
    train = json.loads(cfg.read_text())["train"]
    init, init_dir = train.get(f"{model}_init"), train.get("init_dir")
    if not init or init == "scratch" or not init_dir:
        return None, 0, 0
    start = Path(init_dir) / init
    if start.resolve() == folder.resolve() or not (start / "config.json").is_file():
        return None, 0, 0
    before, steps, tokens = _start(start, model)
    if before is None:  # the chain's first run: its start is the base the curve's steps count from
        return start, 0, 0
    conf = json.loads((start / "train_config.json").read_text())
    return start, steps + int(conf["train"]["steps"]), tokens + int(conf.get("tokens_seen") or 0)


def sources(root: Path, model: str) -> list[tuple[int, Path]]:
    """(step, file or folder) of every snapshot of ``model`` under ``root`` and of its finished checkpoint;
    a continuation run also gets the checkpoint it started from, at its first step (``_start``)."""
    from refusion.train import snapshot_dir

    final = root / model
    start, offset, _ = _start(final, model)
    found = {}
    for f in sorted(snapshot_dir(root, model).glob("step-*.pt")):
        found[offset + int(f.stem.split("-")[1])] = f
    cfg = final / "train_config.json"
    if cfg.is_file():
        found.setdefault(offset + int(json.loads(cfg.read_text())["train"]["steps"]), final)
    if start is not None:
        found.setdefault(offset, start)
    return sorted(found.items())


def _load_weights(src: Path):
    """(model, tokenizer, tokens_seen or None) of a snapshot file or a checkpoint folder."""
    if src.is_file():
        from refusion.train import load_snapshot

        model, tok, _, tokens = load_snapshot(src)
        return model, tok, tokens
    from harness.models.checkpoints import load_model

    loaded = load_model(src)
    model, tok = loaded.model, loaded.tokenizer
    return model, tok, json.loads((src / "train_config.json").read_text()).get("tokens_seen")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness curves", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", action="append", default=None,
                   help="trainer output folder holding <model>/ and .snapshots/<model>/ (repeatable; default "
                   "checkpoints/tiny)")
    p.add_argument("--models", default=",".join(PRESET_OF), help="comma-separated subset of " + ",".join(PRESET_OF))
    p.add_argument("--n", type=int, default=DEFAULT_N, help="test items per kind (the first n)")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="rows per decoder call where it batches")
    p.add_argument("--kinds", default=",".join(KIND_ORDER), help="comma-separated embedded kinds")
    p.add_argument("--every", type=int, default=1, help="evaluate every k-th snapshot only (the final one always)")
    p.add_argument("--merge", action="append", default=[],
                   help="a curves JSON written elsewhere (e.g. by train-tiny --curves --curves-out); its points are "
                   "added to --out first, so only what neither has is evaluated (repeatable)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(DEFAULT_OUT), help="folder of curves.json and curves.png")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    kinds = tuple(k.strip() for k in a.kinds.split(",") if k.strip())
    bad = [m for m in models if m not in PRESET_OF] + [k for k in kinds if k not in KIND_ORDER]
    if bad or not models or not kinds or a.n < 1 or a.batch < 1 or a.every < 1:
        print(f"error: unknown model/kind {', '.join(bad)}; valid models {', '.join(PRESET_OF)}, kinds "
              f"{', '.join(KIND_ORDER)}; --n, --batch, --every >= 1", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(a.threads)
    path = Path(a.out) / "curves.json"
    for other in a.merge:
        if not Path(other).is_file():
            print(f"error: --merge {other}: no such file", file=sys.stderr)
            return 2
        merge(path, json.loads(Path(other).read_text()))
    roots = [Path(r) for r in (a.root or ["checkpoints/tiny"])]
    todo = 0
    for root in roots:
        found = {model: sources(root, model) for model in models}
        if not any(found.values()):  # a run folder usually holds one model
            print(f"[curves] {root}: no snapshot or checkpoint of {', '.join(models)}", file=sys.stderr)
        for model, srcs in found.items():
            start, _, token_offset = _start(root / model, model)
            for i, (step, src) in enumerate(srcs):
                if i % a.every and i != len(srcs) - 1:
                    continue
                key = run_key(root, model)
                point = find_point(_load(path), key, step, a.n, a.batch)
                if point is not None:
                    if lacks_probe(point):  # cheap: no decoding, one teacher-forced pass
                        net, tok, _ = _load_weights(src)
                        values = probe(net, tok, model, test_slice("math", a.n))
                        add_probe(path, key, step, a.n, a.batch, values)
                        print(f"[curves] {key} step {step}: probe added, result digits "
                              f"{100 * values['probe_result_digits']:.1f}%", flush=True)
                    continue
                todo += 1
                net, tok, tokens = _load_weights(src)
                if tokens is not None and src != start:  # this run's own count, after the runs it continued
                    tokens += token_offset
                t0 = time.time()
                res = evaluate(net, tok, PRESET_OF[model], a.n, a.batch, kinds, probe_as=model)
                record(path, key, model, step, tokens, res, a.n, a.batch, source=str(src))
                summary = ", ".join(f"{k} {100 * v['quality']:.1f}% tpf {v['tpf']:.2f}" for k, v in res.items())
                print(f"[curves] {key} step {step}: {summary} ({time.time() - t0:.0f}s)", flush=True)
            if srcs:
                set_train(path, run_key(root, model), model, train_info(root, model))
    if path.is_file():
        plot(_load(path), path.with_suffix(".png"))
        print(f"{path} ({todo} new points), {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
