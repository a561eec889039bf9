"""`python -m harness bench-e2e`: end-to-end decode timing at the released model's shape, on random weights.

    python -m harness bench-e2e --device cuda                  # Qwen3-8B shape, bfloat16 (scripts/gpu_check.sh)
    python -m harness bench-e2e --device cpu --shape tiny      # the same code path on a small shape (tests)

A Qwen3ForCausalLM with the Qwen3-8B / ReFusion shape (36 layers, hidden 4096, 32 query / 8 KV heads of
128, vocab 151671 with the mask as last id) is built with random weights on the device, and each decoder
configuration (``ar``; ``refusion`` with attn sdpa / flex / triton) decodes the same prompts of
``--prompt-len`` random tokens, batch 1, greedy, ``--gen-length`` tokens. Per configuration it records
decode tokens/s (ratio of sums over the prompts, after one warm-up prompt), NFE, TPF, and the mean
milliseconds of one model forward per call kind, by the number of query tokens of the call: ``prefill``
(the prompt), ``one`` (a single token: AR steps), ``slots`` (2..``--prompt-len``-1 tokens: ReFusion's plan,
verify and infill forwards). Forward times come from a second pass with synchronising hooks around
every forward, so they do not slow the tokens/s pass. Random weights make ReFusion's confidences low
(about one slot per round), so its TPF here is not the trained model's: the point is the cost of each
call kind at the real shape and the kernels' share of it. Results merge into ``results/gpu_check.json``
under ``"e2e"`` (atomic write).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from harness.run.store import atomic_write_json, read_json

REPO = Path(__file__).resolve().parents[2]
SHAPES = {
    # Qwen3-8B (ReFusion's backbone): config.json of the release, vocab with its two added tokens
    "qwen3-8b": dict(vocab_size=151671, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                     rope_theta=1000000.0, tie_word_embeddings=False),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048),
}
CONFIGS = {"ar": ("ar", {}), "refusion_sdpa": ("refusion", {"attn": "sdpa"}),
           "refusion_flex": ("refusion", {"attn": "flex"}), "refusion_triton": ("refusion", {"attn": "triton"})}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness bench-e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda or cpu (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--prompts", type=int, default=8, help="prompts per configuration (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=700, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--gen-length", type=int, default=128, help="response budget (default: %(default)s)")
    p.add_argument("--slot-size", type=int, default=32, help="ReFusion slot size (default: %(default)s)")
    p.add_argument("--out", default=str(REPO / "results" / "gpu_check.json"))
    p.add_argument("--seed", type=int, default=0)
    return p


def _kind(q_len: int, prompt_len: int) -> str:
    return "prefill" if q_len >= prompt_len else "one" if q_len == 1 else "slots"


def build_model(shape: str, device: str, dtype):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**SHAPES[shape])
    cfg.mask_token_id = cfg.vocab_size - 1
    cfg.eos_token_id = cfg.vocab_size - 2
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the target dtype: no float32 copy of 8B parameters
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(before)
    return model.eval()


def run_config(model, decoder: str, knobs: dict, prompts, gen_length: int, prompt_len: int) -> dict:
    import torch

    from refusion.decoding import DECODERS

    cfg = model.config
    call = dict(mask_token_id=cfg.mask_token_id, eos_token_id=[cfg.eos_token_id], gen_length=gen_length, **knobs)
    sync = torch.cuda.synchronize if prompts[0].device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        DECODERS[decoder](model, prompts[0], **call)  # warm-up: compiles, allocator, autotune
        tokens = nfe = 0
        sync()
        t0 = time.perf_counter()
        for ids in prompts:
            _, stats = DECODERS[decoder](model, ids, **call)
            tokens += stats["generated_tokens"]
            nfe += stats["nfe"]
        sync()
        seconds = time.perf_counter() - t0
        # Second pass: per-call forward times with synchronising hooks.
        times: dict[str, list[float]] = {}
        start: list[float] = []

        def pre(_m, args, kwargs):
            sync()
            start.append(time.perf_counter())

        def post(_m, args, kwargs, _out):
            sync()
            ids = kwargs.get("input_ids", args[0] if args else None)
            times.setdefault(_kind(int(ids.shape[1]), prompt_len), []).append(
                (time.perf_counter() - start.pop()) * 1e3)

        hooks = [model.register_forward_pre_hook(pre, with_kwargs=True),
                 model.register_forward_hook(post, with_kwargs=True)]
        try:
            for ids in prompts:
                DECODERS[decoder](model, ids, **call)
        finally:
            for h in hooks:
                h.remove()
    return {"decoder": decoder, "knobs": knobs, "generated_tokens": tokens, "nfe": nfe,
            "tpf": tokens / nfe if nfe else 0.0, "decode_s": seconds, "tokens_per_s": tokens / seconds,
            "forward_ms": {k: {"calls": len(v), "mean": sum(v) / len(v)} for k, v in sorted(times.items())}}


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    import torch

    names = [c.strip() for c in ns.configs.split(",") if c.strip()]
    bad = [c for c in names if c not in CONFIGS]
    if bad or not names:
        print(f"error: unknown config(s) {', '.join(bad) or '(none)'}; valid: {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    if ns.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but this torch sees no CUDA device; valid: cpu", file=sys.stderr)
        return 2
    if min(ns.prompts, ns.prompt_len, ns.gen_length, ns.slot_size) < 1:
        print("error: --prompts, --prompt-len, --gen-length and --slot-size must be >= 1", file=sys.stderr)
        return 2
    from harness.run.environment import environment
    from refusion.decoding import make_knobs

    dtype = getattr(torch, ns.dtype)
    torch.manual_seed(ns.seed)
    model = build_model(ns.shape, ns.device, dtype)
    g = torch.Generator().manual_seed(ns.seed)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab - 2, (1, ns.prompt_len), generator=g).to(ns.device)
               for _ in range(ns.prompts)]
    results = {}
    for name in names:
        decoder, knobs = CONFIGS[name]
        if decoder == "refusion":
            knobs = {**knobs, "slot_size": ns.slot_size}
        try:
            make_knobs(decoder, knobs)  # e.g. attn=triton without triton or CUDA: one line, skip it
        except ValueError as e:
            results[name] = {"skipped": str(e)}
            print(f"{name}: skipped ({e})", flush=True)
            continue
        r = run_config(model, decoder, knobs, prompts, ns.gen_length, ns.prompt_len)
        results[name] = r
        fwd = ", ".join(f"{k} {v['mean']:.2f} ms x{v['calls']}" for k, v in r["forward_ms"].items())
        print(f"{name}: {r['tokens_per_s']:.1f} tok/s, TPF {r['tpf']:.2f}, forwards: {fwd}", flush=True)
    out = Path(ns.out)
    doc = read_json(out) if out.is_file() else {}
    doc["e2e"] = {"shape": ns.shape, "model": SHAPES[ns.shape], "dtype": ns.dtype, "prompts": ns.prompts,
                  "prompt_len": ns.prompt_len, "gen_length": ns.gen_length, "slot_size": ns.slot_size,
                  "weights": "random (shape and cost only; TPF is not a trained model's)",
                  "environment": environment(ns.device, torch.get_num_threads(), 1, ns.seed), "results": results}
    atomic_write_json(out, doc)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
