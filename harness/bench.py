"""`make bench-decoders`: every decoder and ReFusion ablation on the embedded suite, one run.

    python -m harness bench-decoders [--limit 100] [--kinds math,code,choice] [--batch 8] [--long-prompts 8]
                                     [--out results/bench_decoders.json]

Same prompts for every decoder, greedy, ``torch.set_num_threads(threads)``, one
warm-up call per (config, kind) excluded from timing. Counting follows docs/design.md §6:
generated tokens up to and including the first EOS; TPS = sum of tokens / sum of
decode seconds (ratio of sums, and the mean of per-sample ratios); NFE and TPF
from the decoder's own counters. Wall-clock figures are only compared as ratios
inside this one run. Results are written atomically as JSON, with the knobs of
every configuration and the decoder targets checked.

ReFusion figures (``refusion_checks``): the packed KV layout against the reference's
per-slot copy (``refusion_replicated``: same tokens, tokens/s and peak KV bytes) on the
suite and on a long-prompt case (12 code examples as chat turns before the question,
~700 prompt tokens, gen_length 128, slot_size 8, low thresholds so several slots are
infilled together, no EOS), where packed should be >= 1.5x faster and hold <= 1/k of the
replicated KV (k = mean number of slots infilled together); the share of decode time
spent outside model calls (<= 10%); and refusion in left-padded batches of ``--batch``
against batch 1 (same tokens, tokens/s ratio).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.presets import PRESETS, TINY_REFUSION_KNOBS
from tasks.info import EMBEDDED_TASKS, TASKS
from harness.store import atomic_write_json

REPO = Path(__file__).resolve().parents[1]
# Knobs and per-kind response budgets are shared with the runner's default run (one source).
GEN_LENGTH = {name.removeprefix("embedded_"): TASKS[name].gen_length for name in EMBEDDED_TASKS}


@dataclass(frozen=True)
class BenchConfig:
    label: str
    model: str  # sub-folder of --checkpoints
    decoder: str
    knobs: dict = field(default_factory=dict)


def _preset(name: str) -> BenchConfig:
    spec = PRESETS[name]
    return BenchConfig(name, Path(spec.checkpoint).name, spec.decoder, dict(spec.knobs))


CONFIGS = [
    _preset("ar"),
    _preset("refusion"),
    _preset("refusion_left_to_right"),
    BenchConfig("refusion_recompute_kv", "refusion", "refusion", {**TINY_REFUSION_KNOBS, "recompute_kv": True}),
    BenchConfig("refusion_no_cache", "refusion", "refusion", {**TINY_REFUSION_KNOBS, "no_cache": True}),
    # The reference's per-slot copy of the committed cache for parallel infill (same tokens as `refusion`).
    BenchConfig("refusion_replicated", "refusion", "refusion", {**TINY_REFUSION_KNOBS, "kv_layout": "replicated"}),
    _preset("llada"),  # steps defaults to gen_length: one token per step
    _preset("fast_dllm"),
]
CONFIG_NAMES = [c.label for c in CONFIGS]


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_config(cfg: BenchConfig, model, tokenizer, kind: str, rows: list[dict]) -> dict:
    """Decode ``rows`` one by one (batch 1, as the paper) and score them."""
    import torch

    from refusion.decoding import get_decoder
    from refusion.tokenizer import encode_chat
    from tasks.scoring import score_many

    decoder = get_decoder(cfg.decoder)
    knobs = {"gen_length": GEN_LENGTH[kind], **cfg.knobs}
    prompts = [torch.tensor([encode_chat(tokenizer, r["query"])]) for r in rows]
    decoder(model, prompts[0], **knobs)  # warm-up, not timed
    texts, secs, toks, nfes, fwd, kv, outputs = [], [], [], [], [], [], []
    for ids in prompts:
        t0 = time.perf_counter()
        out, stats = decoder(model, ids, **knobs)
        secs.append(time.perf_counter() - t0)
        toks.append(stats["generated_tokens"])
        nfes.append(stats["nfe"])
        fwd.append(stats["timings"]["forward_s"])
        kv.append(stats["kv_peak_bytes"])
        outputs.append(out[0].tolist())
        texts.append(tokenizer.decode(out[0].tolist(), skip_special_tokens=True))
    scores = score_many(f"embedded_{kind}", texts, rows)
    acc = 100 * sum(next(iter(s.values())) for s in scores) / len(scores)
    return {
        "knobs": knobs, "items": len(rows), "accuracy": round(acc, 2),
        "tps": sum(toks) / sum(secs), "tps_mean_of_ratios": statistics.mean(t / s for t, s in zip(toks, secs)),
        "tpf": sum(toks) / sum(nfes), "nfe": sum(nfes), "nfe_per_sample": sum(nfes) / len(nfes),
        "generated_tokens": sum(toks), "decode_seconds": sum(secs),
        "latency_mean_s": statistics.mean(secs), "latency_p50_s": statistics.median(secs),
        # Share of the decode time spent outside model calls (decoder bookkeeping, cache surgery, masks).
        "outside_forward_share": 1 - sum(fwd) / sum(secs), "kv_peak_bytes_max": max(kv),
        "kv_peak_bytes_mean": statistics.mean(kv), "_outputs": outputs,
    }


def _left_pad(prompts: list[list[int]], pad: int):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def run_batched(knobs: dict, model, tokenizer, kind: str, rows: list[dict], batch: int) -> dict:
    """ReFusion on ``rows`` in left-padded batches of ``batch`` (one warm-up batch, not timed)."""
    from refusion.decoding import get_decoder
    from refusion.tokenizer import encode_chat

    decoder = get_decoder("refusion")
    knobs = {"gen_length": GEN_LENGTH[kind], **knobs}
    prompts = [encode_chat(tokenizer, r["query"]) for r in rows]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    decoder(model, *_left_pad(groups[0], pad), **knobs)  # warm-up, not timed
    secs, toks, nfes, fwd, outputs = 0.0, 0, 0, 0.0, []
    for group in groups:
        ids, mask = _left_pad(group, pad)
        t0 = time.perf_counter()
        out, stats = decoder(model, ids, mask, **knobs)
        secs += time.perf_counter() - t0
        toks += stats["generated_tokens"]
        nfes += stats["nfe"]
        fwd += stats["timings"]["forward_s"]
        outputs += [o.tolist() for o in out]
    return {"knobs": knobs, "batch_size": batch, "items": len(rows), "tps": toks / secs, "tpf": toks / nfes,
            "nfe": nfes, "generated_tokens": toks, "decode_seconds": secs, "outside_forward_share": 1 - fwd / secs,
            "_outputs": outputs}


# Long-prompt case: packed vs replicated parallel infill where the committed prefix dominates.
LONG_KNOBS = {"gen_length": 128, "slot_size": 8, "serial_num_blocks": 1, "slot_threshold": 0.1,
              "token_threshold": 0.3, "eos_token_id": -1}  # -1: no EOS, every row generates 128 tokens
LONG_SHOTS = 12


def long_prompts(tokenizer, n: int, shots: int = LONG_SHOTS) -> list[list[int]]:
    """n prompts of ``shots`` embedded code examples as chat turns before a code question (~700 tokens)."""
    from tasks.embedded import load_split

    train, test = load_split("code", "train"), load_split("code", "test")
    out = []
    for i in range(n):
        msgs = []
        for r in train[i * shots:(i + 1) * shots]:
            msgs += [{"role": "user", "content": r["query"]}, {"role": "assistant", "content": r["response"]}]
        msgs.append({"role": "user", "content": test[i]["query"]})
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        out.append(list(ids))
    return out


def run_long_prompt(model, tokenizer, n: int) -> dict:
    """Packed vs replicated KV layout on ``n`` long prompts, batch 1, same knobs otherwise."""
    import torch

    from refusion.decoding import get_decoder

    decoder = get_decoder("refusion")
    prompts = [torch.tensor([p]) for p in long_prompts(tokenizer, n)]
    res = {}
    for layout in ("packed", "replicated"):
        knobs = {**LONG_KNOBS, "kv_layout": layout}
        decoder(model, prompts[0], **knobs)  # warm-up, not timed
        secs, toks, fwd, kv, slots, commits, outs = 0.0, 0, 0.0, [], 0, 0, []
        for ids in prompts:
            t0 = time.perf_counter()
            out, stats = decoder(model, ids, **knobs)
            secs += time.perf_counter() - t0
            toks += stats["generated_tokens"]
            fwd += stats["timings"]["forward_s"]
            kv.append(stats["kv_peak_bytes"])
            slots += stats["infill_slots"]
            commits += stats["infill_commits"]
            outs.append(out[0].tolist())
        res[layout] = {"knobs": knobs, "tps": toks / secs, "generated_tokens": toks, "decode_seconds": secs,
                       "outside_forward_share": 1 - fwd / secs, "kv_peak_bytes_max": max(kv),
                       "kv_peak_bytes_mean": statistics.mean(kv),
                       "slots_infilled_together_mean": slots / commits if commits else 0.0, "_outputs": outs}
    p, r = res["packed"], res["replicated"]
    k = p["slots_infilled_together_mean"]
    res["summary"] = {
        "prompts": n, "prompt_tokens_mean": statistics.mean(x.shape[1] for x in prompts),
        "same_tokens": p["_outputs"] == r["_outputs"],
        "packed_speedup": p["tps"] / r["tps"],
        "kv_peak_ratio": p["kv_peak_bytes_max"] / r["kv_peak_bytes_max"],
        "slots_infilled_together_mean": k,
        # The packed cache still holds the k * L query tokens' KV after a call, the replicated one k * (T + L):
        # (T + k L) / (k (T + L)) is the best ratio one layout can show against the other at prompt length T.
        "kv_ratio_bound_with_query_kv": ((statistics.mean(x.shape[1] for x in prompts) + k * LONG_KNOBS["slot_size"])
                                         / (k * (statistics.mean(x.shape[1] for x in prompts)
                                                 + LONG_KNOBS["slot_size"])) if k else None),
    }
    return res


def check_targets(results: dict) -> dict:
    """Issue 4's figures, each as (value, target, met) per kind."""
    checks = {}
    for kind, r in results.items():
        ar, rf, ll, fd = r["ar"], r["refusion"], r["llada"], r["fast_dllm"]
        checks[kind] = {
            "refusion_acc_minus_ar": [round(rf["accuracy"] - ar["accuracy"], 2), ">= -3"],
            "refusion_tpf": [round(rf["tpf"], 2), ">= 3"],
            "refusion_tps_over_ar": [round(rf["tps"] / ar["tps"], 2), ">= 2.5"],
            "refusion_tps_over_llada": [round(rf["tps"] / ll["tps"], 2), ">= 10"],
            "fast_dllm_tps_over_llada": [round(fd["tps"] / ll["tps"], 2), ">= 3"],
            "fast_dllm_acc_minus_llada": [round(fd["accuracy"] - ll["accuracy"], 2), ">= -3"],
            "llada_accuracy": [ll["accuracy"], ">= 40"],
        }
        for v in checks[kind].values():
            op, target = v[1].split()
            v.append(v[0] >= float(target))
    return checks


def check_refusion(results: dict, batch: dict, long: dict | None) -> dict:
    """The packed layout's saving, the decoder's overhead and batching, each (value, target, met)."""
    checks: dict = {}

    def put(name, value, target=None, met=None):
        checks[name] = [round(value, 4) if isinstance(value, float) else value, target, met]

    for kind, r in results.items():
        rf, rep = r.get("refusion"), r.get("refusion_replicated")
        if rf:
            share = rf["outside_forward_share"]
            put(f"{kind}_refusion_outside_forward_share", share, "<= 0.10", share <= 0.10)
        if rf and rep:
            put(f"{kind}_replicated_same_tokens", rf["_outputs"] == rep["_outputs"], "true",
                rf["_outputs"] == rep["_outputs"])
            put(f"{kind}_packed_tps_over_replicated", rf["tps"] / rep["tps"])
            put(f"{kind}_packed_kv_over_replicated", rf["kv_peak_bytes_max"] / rep["kv_peak_bytes_max"])
        if rf and kind in batch:
            b = batch[kind]
            same = b["_outputs"] == rf["_outputs"]
            put(f"{kind}_batch{b['batch_size']}_same_tokens", same, "true", same)
            put(f"{kind}_batch{b['batch_size']}_tps_over_batch1", b["tps"] / rf["tps"])
    if long:
        s = long["summary"]
        put("long_prompt_same_tokens", s["same_tokens"], "true", s["same_tokens"])
        put("long_prompt_packed_speedup", s["packed_speedup"], ">= 1.5", s["packed_speedup"] >= 1.5)
        k = s["slots_infilled_together_mean"]
        put("long_prompt_kv_ratio", s["kv_peak_ratio"], f"<= 1/k = {1 / k:.3f}" if k else "n/a",
            bool(k) and s["kv_peak_ratio"] <= 1 / k)
        put("long_prompt_slots_infilled_together_mean", k)
    return checks


def _strip(obj):
    """Drop the in-memory token lists (keys starting with '_') before writing."""
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if not k.startswith("_")}
    return obj


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness bench-decoders", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoints", default=str(REPO / "checkpoints" / "tiny"))
    p.add_argument("--kinds", default="math,code,choice")
    p.add_argument("--configs", default=",".join(CONFIG_NAMES), help="subset of: " + ", ".join(CONFIG_NAMES))
    p.add_argument("--limit", type=int, default=100, help="test items per kind (same items for every decoder)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=8,
                   help="also decode refusion in batches of this size (same items; 1 = skip)")
    p.add_argument("--long-prompts", type=int, default=8,
                   help="long-prompt packed vs replicated case: this many prompts (0 = skip)")
    p.add_argument("--out", default=str(REPO / "results" / "bench_decoders.json"))
    a = p.parse_args(argv)

    from tasks.embedded import KINDS, load_split

    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    labels = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [k for k in kinds if k not in KINDS] + [c for c in labels if c not in CONFIG_NAMES]
    if bad or a.limit < 1:
        print(f"error: unknown kind/config {', '.join(bad) or '(limit < 1)'}; kinds: {', '.join(KINDS)}; "
              f"configs: {', '.join(CONFIG_NAMES)}", file=sys.stderr)
        return 2
    configs = [c for c in CONFIGS if c.label in labels]
    missing = sorted({c.model for c in configs if not (Path(a.checkpoints) / c.model / "config.json").is_file()})
    if missing:
        print(f"error: no checkpoint for {', '.join(missing)} under {a.checkpoints} (run `make train-tiny`)",
              file=sys.stderr)
        return 2

    import torch
    import transformers
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(a.threads)
    results: dict[str, dict] = {k: {} for k in kinds}
    loaded: dict[str, tuple] = {}
    jobs = [(c, k) for c in configs for k in kinds]
    for cfg, kind in tqdm(jobs, desc="bench", file=sys.stderr):
        if cfg.model not in loaded:
            path = Path(a.checkpoints) / cfg.model
            loaded[cfg.model] = (AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path))
        model, tok = loaded[cfg.model]
        rows = load_split(kind, "test")[: a.limit]
        r = run_config(cfg, model, tok, kind, rows)
        results[kind][cfg.label] = r
        print(f"{kind:<7} {cfg.label:<24} acc={r['accuracy']:6.2f}  tps={r['tps']:8.1f}  tpf={r['tpf']:5.2f}  "
              f"nfe/sample={r['nfe_per_sample']:6.1f}", file=sys.stderr)

    batch: dict[str, dict] = {}
    long = None
    if "refusion" in [c.label for c in configs] and a.batch > 1:
        model, tok = loaded["refusion"]
        for kind in kinds:
            rows = load_split(kind, "test")[: a.limit]
            batch[kind] = b = run_batched(TINY_REFUSION_KNOBS, model, tok, kind, rows, a.batch)
            print(f"{kind:<7} refusion batch {a.batch:<9} tps={b['tps']:8.1f}  tpf={b['tpf']:5.2f}", file=sys.stderr)
    if a.long_prompts > 0 and "refusion" in {c.model for c in configs}:
        model, tok = loaded["refusion"]
        long = run_long_prompt(model, tok, a.long_prompts)
        s = long["summary"]
        print(f"long    packed/replicated tps x{s['packed_speedup']:.2f}  kv x{s['kv_peak_ratio']:.3f}  "
              f"k={s['slots_infilled_together_mean']:.2f}  same={s['same_tokens']}", file=sys.stderr)

    report = {
        "command": "python -m harness bench-decoders " + " ".join(argv if argv is not None else sys.argv[1:]),
        "env": {"git_commit": _git_commit(), "torch": torch.__version__, "transformers": transformers.__version__,
                "threads": a.threads, "machine": platform.machine(), "device": "cpu", "greedy": True,
                "batch_size": 1, "batched_section_batch_size": a.batch,
                "warmup": "one call per (config, kind), not timed"},
        "limit": a.limit, "results": results, "batched": batch, "long_prompt": long,
    }
    if all({"ar", "refusion", "llada", "fast_dllm"} <= set(r) for r in results.values()):
        report["targets"] = check_targets(results)
    report["refusion_checks"] = check_refusion(results, batch, long)
    atomic_write_json(a.out, _strip(report))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
