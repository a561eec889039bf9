"""`python -m harness bench-compile`: eager vs compiled decoding (the decoder knob ``compile``) at the 8B shapes.

    python -m harness bench-compile --device cuda                  # scripts/gpu_check.sh (bfloat16)
    python -m harness bench-compile --device cpu --tiny            # the same code path on tiny shapes (tests)

Random-weight models of the released shapes are built on the device: Qwen3-8B (ReFusion's backbone, the
shape of harness/speed/bench_e2e.py) for ``ar`` and ``refusion``, LLaDA-8B (a bidirectional Llama: 32 layers,
hidden 4096, 32 heads without GQA, MLP 12288, vocab 126464) for ``llada`` and ``fast_dllm``; ``--layers N``
keeps every per-layer shape and the vocabulary but stacks N layers (compile time grows with depth; the
eager / compiled ratio hardly does). Each decoder decodes the same ``--prompts`` random prompts of
``--prompt-len`` tokens, batch 1, greedy, ``--gen-length`` tokens, first eagerly, then with ``compile=true``;
each pass starts with one warm-up decode of the first prompt (it compiles every shape bucket the prompts
need: prompts of one length meet the same buckets), then times all prompts. Per decoder it records tokens/s
of both passes and their ratio, NFE, TPF, whether the compiled tokens equal the eager ones (per prompt, and
the longest common prefix), the graphs compiled and their seconds. Random weights give near-uniform
distributions, so in bfloat16 a near tie may break the other way under another kernel's rounding: a
mismatch is reported (``tokens_equal`` false, with the common prefix), not hidden. ``--budget-s`` skips the
decoders left once that many seconds have passed (the first always runs; the others are recorded as skipped). Results merge into
``results/gpu_check.json`` under ``"compile"`` (atomic write, after every decoder).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from harness.run.store import atomic_write_json, read_json

REPO = Path(__file__).resolve().parents[2]
QWEN3_8B = dict(vocab_size=151671, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1000000.0, tie_word_embeddings=False)
LLADA_8B = dict(vocab_size=126464, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rope_theta=500000.0,
                rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048)
# name -> (model class, config kwargs, causal)
SHAPES = {"qwen3-8b": ("qwen3", QWEN3_8B, True), "llada-8b": ("llama", LLADA_8B, False),
          "qwen3-tiny": ("qwen3", {**TINY, "head_dim": 16}, True), "llada-tiny": ("llama", TINY, False)}
# decoder -> the shape it runs on (the tiny variant with --tiny)
DECODERS = {"ar": "qwen3-8b", "refusion": "qwen3-8b", "llada": "llada-8b", "fast_dllm": "llada-8b"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness bench-compile", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda or cpu (default: %(default)s)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--tiny", action="store_true", help="tiny shapes of the same two families (tests, CPU)")
    p.add_argument("--layers", type=int, default=0, help="layers to stack (0 = the shape's own: 36 / 32)")
    p.add_argument("--decoders", default=",".join(DECODERS), help=f"comma list of {', '.join(DECODERS)}")
    p.add_argument("--prompts", type=int, default=2, help="prompts per decoder (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--gen-length", type=int, default=32, help="response budget (default: %(default)s)")
    p.add_argument("--slot-size", type=int, default=32, help="ReFusion slot size (default: %(default)s)")
    p.add_argument("--budget-s", type=float, default=0.0, help="skip the decoders left after this many seconds "
                                                                 "(0 = no limit)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default: %(default)s; tests: "
                                                          "aot_eager)")
    p.add_argument("--out", default=str(REPO / "results" / "gpu_check.json"))
    p.add_argument("--seed", type=int, default=0)
    return p


def build_model(shape: str, device: str, dtype, layers: int = 0):
    """A random-weight model of ``shape`` (SHAPES) in ``dtype`` on ``device``, mask id = last id, EOS = the one
    before; ``layers`` > 0 stacks that many layers instead of the shape's own."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    family, kwargs, causal = SHAPES[shape]
    cfg_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if family == "qwen3" else (LlamaConfig, LlamaForCausalLM)
    cfg = cfg_cls(**{**kwargs, **({"num_hidden_layers": layers} if layers else {})})
    cfg.mask_token_id, cfg.eos_token_id = cfg.vocab_size - 1, cfg.vocab_size - 2
    if not causal:
        cfg.is_causal = False
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the target dtype: no float32 copy of 8B parameters
    try:
        with torch.device(device):
            model = model_cls(cfg)
    finally:
        torch.set_default_dtype(before)
    return model.eval()


def decoder_knobs(decoder: str, gen_length: int, slot_size: int) -> dict:
    """The knobs each decoder runs with here (besides gen_length and compile): one block of gen_length."""
    return {"refusion": {"slot_size": slot_size}, "llada": {"block_length": gen_length},
            "fast_dllm": {"block_length": gen_length}}.get(decoder, {})


def decode_pass(model, decoder: str, knobs: dict, prompts) -> dict:
    """One pass (module doc): a warm-up decode of the first prompt, then every prompt timed; its tokens, the
    totals, and what the warm-up and the timed decodes compiled."""
    import torch

    from refusion.decoding import DECODERS as REGISTRY

    cfg = model.config
    call = dict(mask_token_id=cfg.mask_token_id, eos_token_id=[cfg.eos_token_id], **knobs)
    cuda = prompts[0].device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    _, warm = REGISTRY[decoder](model, prompts[0], **call)
    sync()
    warm_s = time.perf_counter() - t0
    tokens, gen, nfe, seconds, comp, comp_s = [], 0, 0, 0.0, 0, 0.0
    for ids in prompts:
        sync()
        t0 = time.perf_counter()
        out, stats = REGISTRY[decoder](model, ids, **call)
        sync()
        seconds += time.perf_counter() - t0 - stats["timings"]["compile_s"]  # warm-up forwards apart
        tokens.append(out[0].tolist())
        gen, nfe = gen + stats["generated_tokens"], nfe + stats["nfe"]
        comp, comp_s = comp + stats["compilations"], comp_s + stats["timings"]["compile_s"]
    return {"tokens": tokens, "generated_tokens": gen, "nfe": nfe, "tpf": gen / nfe if nfe else 0.0,
            "decode_s": seconds, "tokens_per_s": gen / seconds if seconds > 0 else None,
            "warmup_s": warm_s, "warmup_compilations": warm["compilations"],
            "warmup_compile_s": warm["timings"]["compile_s"], "compilations": comp, "compile_s": comp_s}


def compare(eager: dict, comp: dict) -> dict:
    """Token identity of the two passes, prompt by prompt, with the longest common prefix of each."""
    prefix = []
    for a, b in zip(eager["tokens"], comp["tokens"]):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append({"common_prefix": n, "eager_len": len(a), "compiled_len": len(b)})
    equal = [a == b for a, b in zip(eager["tokens"], comp["tokens"])]
    return {"tokens_equal": all(equal), "prompts_equal": sum(equal), "per_prompt": prefix}


def run_decoder(model, decoder: str, knobs: dict, prompts, shape: str, layers: int) -> dict:
    eager = decode_pass(model, decoder, {**knobs, "compile": False}, prompts)
    comp = decode_pass(model, decoder, {**knobs, "compile": True}, prompts)
    te, tc = eager["tokens_per_s"], comp["tokens_per_s"]
    out = {"shape": shape, "layers": layers, "knobs": knobs, **compare(eager, comp),
           "nfe": {"eager": eager["nfe"], "compiled": comp["nfe"]},
           "tpf": {"eager": eager["tpf"], "compiled": comp["tpf"]},
           "tokens_per_s": {"eager": te, "compiled": tc, "speedup": tc / te if te and tc else None},
           "compilations": comp["warmup_compilations"] + comp["compilations"],
           "compile_s": comp["warmup_compile_s"] + comp["compile_s"],
           "compilations_after_warmup": comp["compilations"], "warmup_s": {"eager": eager["warmup_s"],
                                                                           "compiled": comp["warmup_s"]}}
    return out


def line(name: str, r: dict) -> str:
    if "skipped" in r:
        return f"compile {name}: skipped ({r['skipped']})"
    t = r["tokens_per_s"]
    sp = f"x{t['speedup']:.2f}" if t["speedup"] else "-"
    eq = "tokens equal" if r["tokens_equal"] else (
        "tokens DIFFER (common prefix " + ", ".join(f"{p['common_prefix']}/{p['eager_len']}" for p in r["per_prompt"])
        + ")")
    return (f"compile {name} ({r['shape']}, {r['layers']} layers): eager {t['eager']:.1f} tok/s, compiled "
            f"{t['compiled']:.1f} tok/s ({sp}), {eq} ({r['prompts_equal']}/{len(r['per_prompt'])} prompts), NFE "
            f"{r['nfe']['eager']}/{r['nfe']['compiled']}, TPF {r['tpf']['eager']:.2f}/{r['tpf']['compiled']:.2f}, "
            f"{r['compilations']} compilations in {r['compile_s']:.1f} s")


def _check(ns: argparse.Namespace, names: list[str]) -> str | None:
    import torch

    bad = [d for d in names if d not in DECODERS]
    if bad or not names:
        return f"unknown decoder(s) {', '.join(bad) or '(none)'}; valid: {', '.join(DECODERS)}"
    if ns.device.startswith("cuda") and not torch.cuda.is_available():
        return "--device cuda but this torch sees no CUDA device; valid: cpu"
    if min(ns.prompts, ns.prompt_len, ns.gen_length, ns.slot_size) < 1 or ns.layers < 0:
        return "--prompts, --prompt-len, --gen-length and --slot-size must be >= 1, --layers >= 0"
    return None


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    import torch

    names = [d.strip() for d in ns.decoders.split(",") if d.strip()]
    err = _check(ns, names)
    if err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from harness.run.environment import environment
    from refusion.decoding import compiled

    compiled.BACKEND = ns.backend
    dtype = getattr(torch, ns.dtype or ("bfloat16" if ns.device.startswith("cuda") else "float32"))
    out = Path(ns.out)
    results: dict[str, dict] = {}
    doc = read_json(out) if out.is_file() else {}
    doc["compile"] = {"device": ns.device, "dtype": str(dtype).removeprefix("torch."), "prompts": ns.prompts,
                      "prompt_len": ns.prompt_len, "gen_length": ns.gen_length, "backend": ns.backend,
                      "weights": "random (shape and cost only; TPF is not a trained model's)",
                      "environment": environment(ns.device, torch.get_num_threads(), 1, ns.seed), "results": results}
    t_start, models = time.perf_counter(), {}
    for name in names:
        shape = DECODERS[name].replace("-8b", "-tiny") if ns.tiny else DECODERS[name]
        if ns.budget_s and results and time.perf_counter() - t_start > ns.budget_s:  # the first always runs
            results[name] = {"skipped": f"time budget of {ns.budget_s:g} s spent"}
        else:
            if shape not in models:
                if models:  # one model on the device at a time; its graphs, buffers and CUDA graphs go too
                    models.clear()
                    compiled.clear()
                    compiled.BACKEND = ns.backend
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                torch.manual_seed(ns.seed)
                models[shape] = build_model(shape, ns.device, dtype, ns.layers)
            model = models[shape]
            g = torch.Generator().manual_seed(ns.seed)
            prompts = [torch.randint(0, model.config.vocab_size - 2, (1, ns.prompt_len), generator=g).to(ns.device)
                       for _ in range(ns.prompts)]
            knobs = {"gen_length": ns.gen_length, **decoder_knobs(name, ns.gen_length, ns.slot_size)}
            results[name] = run_decoder(model, name, knobs, prompts, shape, model.config.num_hidden_layers)
        print(line(name, results[name]), flush=True)
        atomic_write_json(out, doc)  # after every decoder: a timed-out check keeps what it measured
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
