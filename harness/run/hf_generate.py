"""Accuracy of causal checkpoints on the embedded test splits with plain ``model.generate``.

    python -m harness generate-eval [--models checkpoints/tiny/ar,checkpoints/tiny/refusion] [--limit N]

This is the left-to-right reference: greedy
``transformers`` generation, no project decoder involved, so it measures what a
model learned independently of the decoders. For the ReFusion model it is the
"ReFusion left-to-right" ablation of the paper (its AR ability alone). Results
go to ``results/generate_eval.json`` (atomic write) and a table on stdout.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from harness.run.store import atomic_write_json


def generate_responses(model, tokenizer, queries: list[str], *, max_new_tokens: int = 96,
                       batch_size: int = 32) -> list[str]:
    """Greedy responses (text up to the first EOS) for chat queries, left-padded batches."""
    import torch

    from refusion.tokenizer import encode_chat

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    out: list[str] = []
    for i in range(0, len(queries), batch_size):
        prompts = [encode_chat(tokenizer, q) for q in queries[i: i + batch_size]]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=pad)
        for row in gen[:, width:].tolist():
            if eos in row:
                row = row[: row.index(eos)]
            out.append(tokenizer.decode(row, skip_special_tokens=True))
    return out


def evaluate_checkpoint(path: str | Path, *, limit: int | None = None, threads: int = 2) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.embedded import KINDS, load_split
    from tasks.scoring import score_many

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    if getattr(model.config, "is_causal", True) is False:
        raise ValueError(f"{path}: bidirectional (MDM) model; left-to-right generate does not apply")
    result = {}
    for kind in KINDS:
        rows = load_split(kind, "test")[:limit]
        t0 = time.time()
        responses = generate_responses(model, tokenizer, [r["query"] for r in rows])
        scores = score_many(f"embedded_{kind}", responses, rows)
        key = next(iter(scores[0])) if scores else None
        acc = sum(s[key] for s in scores) / max(1, len(scores))
        result[kind] = {"items": len(rows), "accuracy": round(100 * acc, 2), "seconds": round(time.time() - t0, 1)}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness generate-eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="checkpoints/tiny/ar,checkpoints/tiny/refusion",
                   help="comma-separated checkpoint folders (causal models)")
    p.add_argument("--limit", type=int, default=None, help="at most this many test items per kind")
    p.add_argument("--out", default="results/generate_eval.json")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    paths = [m.strip() for m in a.models.split(",") if m.strip()]
    missing = [m for m in paths if not (Path(m) / "config.json").is_file()]
    if missing:
        print(f"error: no checkpoint (config.json) in: {', '.join(missing)}", file=sys.stderr)
        return 2
    from harness.run.environment import environment

    report = {"command": "python -m harness generate-eval " + " ".join(argv or []),
              "decoding": "transformers generate, greedy, max_new_tokens=96",
              "environment": environment("cpu", a.threads, 1, 0), "models": {}}
    for m in paths:
        report["models"][m] = evaluate_checkpoint(m, limit=a.limit, threads=a.threads)
        cells = "  ".join(f"{k}={v['accuracy']:.1f}% ({v['items']})" for k, v in report["models"][m].items())
        print(f"{m}: {cells}")
    atomic_write_json(a.out, report)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
