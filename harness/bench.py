"""`make bench-decoders`: every decoder and ReFusion ablation on the embedded suite, one run.

    python -m harness bench-decoders [--limit 100] [--kinds math,code,choice] [--out results/bench_decoders.json]

Same prompts for every decoder, greedy, ``torch.set_num_threads(threads)``, one
warm-up call per (config, kind) excluded from timing. Counting follows DESIGN §6:
generated tokens up to and including the first EOS; TPS = sum of tokens / sum of
decode seconds (ratio of sums, and the mean of per-sample ratios); NFE and TPF
from the decoder's own counters. Wall-clock figures are only compared as ratios
inside this one run. Results are written atomically as JSON, with the knobs of
every configuration and the figures of issue 4 checked against their targets.
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

from harness.presets import EMBEDDED_GEN_LENGTH, PRESETS, TINY_REFUSION_KNOBS
from harness.store import atomic_write_json

REPO = Path(__file__).resolve().parents[1]
# Knobs and per-kind response budgets are shared with the runner's default run (one source).
GEN_LENGTH = {name.removeprefix("embedded_"): n for name, n in EMBEDDED_GEN_LENGTH.items()}


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
    texts, secs, toks, nfes = [], [], [], []
    for ids in prompts:
        t0 = time.perf_counter()
        out, stats = decoder(model, ids, **knobs)
        secs.append(time.perf_counter() - t0)
        toks.append(stats["generated_tokens"])
        nfes.append(stats["nfe"])
        texts.append(tokenizer.decode(out[0].tolist(), skip_special_tokens=True))
    scores = score_many(f"embedded_{kind}", texts, rows)
    acc = 100 * sum(next(iter(s.values())) for s in scores) / len(scores)
    return {
        "knobs": knobs, "items": len(rows), "accuracy": round(acc, 2),
        "tps": sum(toks) / sum(secs), "tps_mean_of_ratios": statistics.mean(t / s for t, s in zip(toks, secs)),
        "tpf": sum(toks) / sum(nfes), "nfe": sum(nfes), "nfe_per_sample": sum(nfes) / len(nfes),
        "generated_tokens": sum(toks), "decode_seconds": sum(secs),
        "latency_mean_s": statistics.mean(secs), "latency_p50_s": statistics.median(secs),
    }


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness bench-decoders", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoints", default=str(REPO / "checkpoints" / "tiny"))
    p.add_argument("--kinds", default="math,code,choice")
    p.add_argument("--configs", default=",".join(CONFIG_NAMES), help="subset of: " + ", ".join(CONFIG_NAMES))
    p.add_argument("--limit", type=int, default=100, help="test items per kind (same items for every decoder)")
    p.add_argument("--threads", type=int, default=2)
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

    report = {
        "command": "python -m harness bench-decoders " + " ".join(argv if argv is not None else sys.argv[1:]),
        "env": {"git_commit": _git_commit(), "torch": torch.__version__, "transformers": transformers.__version__,
                "threads": a.threads, "machine": platform.machine(), "device": "cpu", "greedy": True,
                "batch_size": 1, "warmup": "one call per (config, kind), not timed"},
        "limit": a.limit, "results": results,
    }
    if all({"ar", "refusion", "llada", "fast_dllm"} <= set(r) for r in results.values()):
        report["targets"] = check_targets(results)
    atomic_write_json(a.out, report)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
