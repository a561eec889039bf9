"""`make bench-decoders`: every decoder and ReFusion ablation on the embedded suite, measured by
the same path as `make eval`, plus the target checks.

    python -m harness bench-decoders [--limit 100] [--batch 8] [--long-prompts 8] [--compiled 2] [--threads 2]
                                     [--out results/bench_decoders.json]

1. One `harness eval` run of the preset list ``BENCH_MODELS`` (harness/run/presets.py) on the
   embedded suite at batch 1: the lm-eval adapter decodes, the worker aggregates (counting as
   docs/design.md §6: tokens up to and including the first EOS, TPS = sum of tokens / sum of decode
   seconds, NFE and TPF from the decoders' counters, the share of decode time outside model calls),
   and the run's ``summary.json`` is what the checks read.
2. One `harness eval` run of ``refusion`` in left-padded batches of ``--batch`` on the same
   documents: same tokens per document (read from both runs' sample logs), tokens/s ratio.
3. The long-prompt layout case (an op-level check, like `make bench-kernels`, not a task): packed
   vs replicated KV for parallel infill after ~700 prompt tokens (12 code examples as chat turns
   before the question, gen_length 128, slot_size 8, low thresholds so several slots are infilled
   together, no EOS), decoder called directly.

4. Eager vs compiled (``run_compiled``): one preset per decoder on ``--compiled`` items per kind, called
   directly with the knob ``compile`` off and on; tokens/s of each and their ratio (compile time excluded by
   the untimed warm-up), and whether tokens and NFE are identical.

Every speed figure comes from the timing protocol (harness/run/timing.py): the two eval runs time their
models in interleaved rounds after their decoding pass, and the direct comparisons (3 and 4) run as two
sides in ``--rounds`` ABBA rounds after a warm-up, each figure the median over rounds with its interval.
Both runs live under ``--runs-root`` with ids derived from the settings, so an interrupted bench
resumes where it stopped. Wall-clock figures are only compared as ratios inside one bench. The
environment is the run's own (run.json). Results are written atomically as JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
from pathlib import Path

from harness.run.guard import Guard
from harness.run.presets import BENCH_MODELS
from harness.run.store import atomic_write_json

REPO = Path(__file__).resolve().parents[2]


def _run_eval(run_id: str, models: str, limit: int, threads: int, batch: int, runs_root: Path) -> Path:
    """One `harness eval` run (resumed if it exists); its folder."""
    from harness.run import runner

    rc = runner.main(["--task", "embedded", "--models", models, "--limit", str(limit), "--threads", str(threads),
                      "--batch-size", str(batch), "--out", str(runs_root), "--run-id", run_id])
    if rc != 0:
        raise SystemExit(rc)
    return runs_root / run_id


def _rows(run_dir: Path) -> dict[str, dict[str, dict]]:
    """summary.json rows as {kind: {model: figures}} in the bench's units (accuracy in %)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    out: dict[str, dict[str, dict]] = {}
    for r in summary["rows"]:
        kind = r["task"].removeprefix("embedded_")
        out.setdefault(kind, {})[r["model"]] = {
            "accuracy": round(100 * r["quality"], 2), "tps": r["tokens_per_s"],
            "tps_mean_of_ratios": r["tokens_per_s_mean_of_ratios"], "tpf": r["tpf"], "nfe_per_sample": r["nfe_mean"],
            "generated_tokens": r["generated_tokens"], "latency_mean_s": r["latency_mean_s"],
            "latency_p50_s": r["latency_p50_s"], "outside_forward_share": r["outside_forward_share"],
            "kv_peak_bytes_max": r["kv_peak_bytes"], "samples": r["samples"],
            "_outputs": _tokens(run_dir, r["model"], r["task"]),
        }
    return out


def _tokens(run_dir: Path, model: str, task: str) -> list:
    """Generated token ids per document, in document order, from the run's sample log."""
    path = run_dir / "models" / model / "samples" / f"{task}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r.get("tokens") for r in sorted(rows, key=lambda r: r["doc_id"])]


# Long-prompt case: packed vs replicated parallel infill where the committed prefix dominates.
LONG_KNOBS = {"gen_length": 128, "slot_size": 8, "serial_num_blocks": 1, "slot_threshold": 0.1,
              "token_threshold": 0.3}
NO_EOS = -1  # passed as eos_token_id: no token is EOS, so every row generates 128 tokens
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


def run_long_prompt(model, tokenizer, n: int, rounds: int = 9) -> dict:
    """Packed vs replicated KV layout on ``n`` long prompts, batch 1, same knobs otherwise, timed by the timing
    protocol (harness/run/timing.py: an untimed warm-up, then ``rounds`` ABBA rounds; medians over rounds)."""
    import torch

    from harness.run import timing
    from refusion.decoding import get_decoder

    decoder = get_decoder("refusion")
    prompts = [torch.tensor([p]) for p in long_prompts(tokenizer, n)]

    def call(ids, knobs):
        def fn():
            out, st = decoder(model, ids, None, knobs, eos_token_id=NO_EOS)
            return out[0].tolist(), st["generated_tokens"], st
        return fn

    sides = [timing.FnSide(layout, {"long": [call(ids, {**LONG_KNOBS, "kv_layout": layout}) for ids in prompts]})
             for layout in ("packed", "replicated")]
    got = timing.run_rounds(sides, ["long"], rounds=rounds, progress=False, guard=Guard(),
                            same_repeat=True)
    res = {"timing": {"rounds": rounds, "order": "abba", "guard": got["guard"]}}
    for side in sides:
        fig = timing.figure(got["records"], side.name, "long")
        st = [side.extra[("long", i)][0] for i in range(len(prompts))]
        secs = fig["tokens"] / fig["tokens_per_s"]
        kv = [x["kv_peak_bytes"] for x in st]
        slots, commits = sum(x["infill_slots"] for x in st), sum(x["infill_commits"] for x in st)
        res[side.name] = {"knobs": {**LONG_KNOBS, "kv_layout": side.name}, "tps": fig["tokens_per_s"],
                          "tps_interval": fig["interval"], "generated_tokens": fig["tokens"],
                          "decode_seconds": secs,
                          "outside_forward_share": 1 - sum(x["timings"]["forward_s"] for x in st) / secs,
                          "kv_peak_bytes_max": max(kv), "kv_peak_bytes_mean": statistics.mean(kv),
                          "slots_infilled_together_mean": slots / commits if commits else 0.0,
                          "_outputs": [side.outputs[("long", i)] for i in range(len(prompts))]}
    p, r = res["packed"], res["replicated"]
    k = p["slots_infilled_together_mean"]
    speed = timing.ratio(got["records"], "packed", "replicated", "long")
    res["summary"] = {
        "prompts": n, "prompt_tokens_mean": statistics.mean(x.shape[1] for x in prompts),
        "same_tokens": p["_outputs"] == r["_outputs"],
        "packed_speedup": speed["ratio"], "packed_speedup_interval": speed["interval"],
        "kv_peak_ratio": p["kv_peak_bytes_max"] / r["kv_peak_bytes_max"],
        "slots_infilled_together_mean": k,
        # The packed cache still holds the k * L query tokens' KV after a call, the replicated one k * (T + L):
        # (T + k L) / (k (T + L)) is the best ratio one layout can show against the other at prompt length T.
        "kv_ratio_bound_with_query_kv": ((statistics.mean(x.shape[1] for x in prompts) + k * LONG_KNOBS["slot_size"])
                                         / (k * (statistics.mean(x.shape[1] for x in prompts)
                                                 + LONG_KNOBS["slot_size"])) if k else None),
    }
    return res


def compiled_presets() -> list[str]:
    """Eager vs compiled (the decoder knob ``compile``, docs/design.md §6a): the first preset of each decoder that
    takes ``compile`` (its registry entry's capability), in preset order."""
    from harness.run.presets import PRESETS
    from refusion.decoding import DECODERS

    first: dict[str, str] = {}
    for name, spec in PRESETS.items():
        if DECODERS[spec.decoder].compile:
            first.setdefault(spec.decoder, name)
    return list(first.values())


def run_compiled(n: int, threads: int, rounds: int = 9) -> dict:
    """Per decoder preset: the first ``n`` test items of each embedded kind (chat-templated, the kind's
    gen_length, the preset's knobs), decoded eagerly and with ``compile=True``, batch 1, timed by the timing
    protocol (harness/run/timing.py): an untimed warm-up block of each (the compiled one compiles every query
    bucket these prompts meet), then ``rounds`` ABBA rounds of eager and compiled; tokens/s is the median over
    rounds, the ratio the median over disjoint round pairs with its interval. Compile seconds and compilations
    from the warm-up's stats; every timed decode must repeat its first tokens, and eager and compiled must agree
    on tokens and NFE."""
    import torch

    from harness.models.checkpoints import load_model
    from harness.run import timing
    from harness.run.presets import PRESETS
    from refusion.decoding import DECODERS
    from tasks.embedded import load_split
    from tasks.info import TASKS

    torch.set_num_threads(threads)
    out, loaded = {}, {}
    for name in compiled_presets():
        spec = PRESETS[name]
        if spec.checkpoint not in loaded:
            loaded[spec.checkpoint] = load_model(str(REPO / spec.checkpoint))
        lm = loaded[spec.checkpoint]
        special = {"eos_token_id": list(lm.eos_ids), "mask_token_id": lm.mask_id}
        items = []
        for kind in ("math", "code", "choice"):
            for row in load_split(kind, "test")[:n]:
                text = lm.tokenizer.apply_chat_template([{"role": "user", "content": row["query"]}], tokenize=False,
                                                        add_generation_prompt=True)
                ids = torch.tensor([lm.tokenizer(text, add_special_tokens=False)["input_ids"]])
                items.append((ids, {**spec.knobs, "gen_length": TASKS[f"embedded_{kind}"].gen_length}))
        dec = DECODERS[spec.decoder]

        def call(ids, kn, c):
            def fn():
                toks, st = dec(lm.model, ids, None, {**kn, "compile": c}, **special)
                return [t.tolist() for t in toks], st["generated_tokens"], st
            return fn

        sides = [timing.FnSide(label, {name: [call(ids, kn, c) for ids, kn in items]})
                 for label, c in (("eager", False), ("compiled", True))]
        got = timing.run_rounds(sides, [name], rounds=rounds, progress=False, same_repeat=True)
        eager, comp = (timing.figure(got["records"], s_.name, name) for s_ in sides)
        speed = timing.ratio(got["records"], "compiled", "eager", name)
        keys = list(sides[0].outputs)
        same = all(sides[0].outputs[k] == sides[1].outputs[k] and
                   sides[0].extra[k][0]["nfe"] == sides[1].extra[k][0]["nfe"] for k in keys)
        stats = [sides[1].extra[k][0] for k in keys]
        out[name] = {"prompts": len(items), "rounds": rounds, "eager_tps": eager["tokens_per_s"],
                     "compiled_tps": comp["tokens_per_s"], "compiled_over_eager": speed["ratio"],
                     "compiled_over_eager_interval": speed["interval"],
                     "same_tokens": same, "compilations": sum(s_.get("compilations", 0) for s_ in stats),
                     "compile_s": sum(s_["timings"].get("compile_s", 0.0) for s_ in stats)}
        r = out[name]
        print(f"compile {name:<10} eager {r['eager_tps']:8.1f} tok/s  compiled {r['compiled_tps']:8.1f} tok/s  "
              f"x{r['compiled_over_eager']:.2f}  same={same}  graphs={r['compilations']} ({r['compile_s']:.1f} s)",
              file=sys.stderr)
    return out


def check_targets(results: dict) -> dict:
    """The decoder targets (speed and quality against ar and llada), each as (value, target, met) per kind."""
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


OUTSIDE_FORWARD_TARGET = 0.05  # at most 5% of decode time outside model forwards, every decoder


def check_outside_forward(results: dict) -> dict:
    """Per kind and decoder preset: the share of decode time spent outside model calls (the decoder's own
    step logic: docs/design.md §6), as (value, target, met)."""
    return {kind: {label: [round(x["outside_forward_share"], 4), f"<= {OUTSIDE_FORWARD_TARGET}",
                           x["outside_forward_share"] <= OUTSIDE_FORWARD_TARGET]
                   for label, x in r.items() if x.get("outside_forward_share") is not None}
            for kind, r in results.items()}


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
    p.add_argument("--limit", type=int, default=100, help="test items per kind (same items for every decoder)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=8,
                   help="also decode refusion in batches of this size (same items; 1 = skip)")
    p.add_argument("--rounds", type=int, default=9,
                   help="timed rounds of the direct comparisons (long prompts, eager vs compiled; default: %(default)s)")
    p.add_argument("--long-prompts", type=int, default=8,
                   help="long-prompt packed vs replicated case: this many prompts (0 = skip)")
    p.add_argument("--compiled", type=int, default=2,
                   help="eager vs compiled (knob compile): this many items per kind per decoder (0 = skip)")
    p.add_argument("--runs-root", default=str(REPO / "results" / "runs"), help="where the two eval runs are kept")
    p.add_argument("--out", default=str(REPO / "results" / "bench_decoders.json"))
    a = p.parse_args(argv)
    if a.limit < 1 or a.threads < 1 or a.batch < 1 or a.long_prompts < 0 or a.compiled < 0:
        print("error: --limit, --threads and --batch must be >= 1, --long-prompts and --compiled >= 0", file=sys.stderr)
        return 2

    models = ",".join(BENCH_MODELS)
    tag = hashlib.sha256(f"{models}|{a.limit}|{a.threads}".encode()).hexdigest()[:10]
    runs_root = Path(a.runs_root)
    run = _run_eval(f"bench-{tag}", models, a.limit, a.threads, 1, runs_root)
    results = _rows(run)
    batch: dict[str, dict] = {}
    if a.batch > 1:
        brun = _run_eval(f"bench-{tag}-batch{a.batch}", "refusion", a.limit, a.threads, a.batch, runs_root)
        for kind, r in _rows(brun).items():
            batch[kind] = {**r["refusion"], "batch_size": a.batch}
    long = None
    if a.long_prompts > 0:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from harness.run.presets import PRESETS

        torch.set_num_threads(a.threads)
        path = REPO / PRESETS["refusion"].checkpoint
        model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
        long = run_long_prompt(model, tok, a.long_prompts, a.rounds)
        s = long["summary"]
        print(f"long    packed/replicated tps x{s['packed_speedup']:.2f}  kv x{s['kv_peak_ratio']:.3f}  "
              f"k={s['slots_infilled_together_mean']:.2f}  same={s['same_tokens']}", file=sys.stderr)

    compiled = run_compiled(a.compiled, a.threads, a.rounds) if a.compiled > 0 else None

    env = json.loads((run / "run.json").read_text()).get("environment")
    report = {
        "command": "python -m harness bench-decoders " + " ".join(argv if argv is not None else sys.argv[1:]),
        "runs": {"batch1": str(run.relative_to(REPO)) if run.is_relative_to(REPO) else str(run),
                 **({"batched": str(brun.name)} if a.batch > 1 else {})},
        "environment": env, "limit": a.limit, "threads": a.threads, "results": results, "batched": batch,
        "long_prompt": long, "compiled": compiled,
    }
    if all({"ar", "refusion", "llada", "fast_dllm"} <= set(r) for r in results.values()):
        report["targets"] = check_targets(results)
    report["refusion_checks"] = check_refusion(results, batch, long)
    report["outside_forward"] = check_outside_forward(results)
    atomic_write_json(a.out, _strip(report))
    for kind, r in results.items():
        for label, x in r.items():
            print(f"{kind:<7} {label:<24} acc={x['accuracy']:6.2f}  tps={x['tps']:8.1f}  tpf={x['tpf']:5.2f}  "
                  f"nfe/sample={x['nfe_per_sample']:6.1f}  outside={x['outside_forward_share']:.3f}", file=sys.stderr)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
