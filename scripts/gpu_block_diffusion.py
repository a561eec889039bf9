"""The block-diffusion families (sdar, sdar_moe, llada2) on a GPU: their release-layout fixtures
(tests/fixtures/released/{sdar,sdar_moe,llada2}) loaded onto CUDA and decoded with the authors' reference knobs.

For each fixture, every stored generation (24 prompts x its settings):
  - float32, batch 1: how many rows give the authors' tokens (made on a CPU), and whether NFE equals the
    reference. Meaningful for llada2 (greedy). sdar samples (generate.py's temperature 1.0) from each row's
    seeded generator on the model's device, and CUDA's random stream is not the CPU's, so its CPU references
    are not expected on a GPU. With --authors-on-device FILE (written by ``scripts/make_sdar_fixtures.py
    --device cuda --reference-only FILE``, the authors' generate.py run on the same GPU in its own environment)
    the sdar rows are also compared with the authors' tokens made there;
  - float32 and bfloat16, left-padded batches of 4: how many rows equal the same row decoded alone on the same
    device and dtype;
  - bfloat16: no non-finite logits, decode seconds (one pass, not a benchmark);
  - llada2 only: the logits of the stored prompts in float32 against dInfer's (max |diff|) and whether the
    experts chosen are the same.
It writes one JSON file (default results/gpu/block_diffusion.json). Nothing here is a test: tests never need a GPU.

  python scripts/gpu_block_diffusion.py --device cuda --out results/gpu/block_diffusion.json

With the authors' SDAR tokens made on the same GPU (their environment: transformers 4.52.4, tokenizers 0.21,
huggingface_hub < 1, and a checkout of JetAstra/SDAR; see scripts/make_sdar_fixtures.py):

  PYTHONPATH=<4.52.4 site> python scripts/make_sdar_fixtures.py --sdar SDAR --device cuda --reference-only A.json
  python scripts/gpu_block_diffusion.py --device cuda --authors-on-device A.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.models.checkpoints import load_model  # noqa: E402
from refusion.decoding import DECODERS  # noqa: E402
from refusion.decoding.common import cut_after_eos  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures" / "released"


def _cases(name: str) -> list[dict]:
    """(prompt ids, knobs, the authors' answer, their NFE or None) of every stored generation."""
    ref = json.loads((FIXTURES / name / "reference.json").read_text())
    out = []
    for g in ref["generations"]:
        if name == "llada2":
            eos = (ref["special_ids"]["eos"],)
            want = cut_after_eos(torch.tensor(g["tokens"]), eos)[:g["knobs"]["gen_length"]].tolist()
            out.append({"prompt": g["prompt"], "knobs": dict(g["knobs"]), "want": want, "nfe": g["nfe"]})
        else:
            out.append({"prompt": g["prompt_ids"], "knobs": {**g["kwargs"], "seed": g["seed"]},
                        "output_ids": g["output_ids"], "nfe": None})
    return out


def _decode(m, decoder: str, rows: list[list[int]], knobs: dict):
    pad = m.tokenizer.pad_token_id if m.tokenizer.pad_token_id is not None else m.eos_ids[0]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - len(r):], mask[b, width - len(r):] = torch.tensor(r), 1
    device = next(m.model.parameters()).device
    extra = {"eos_token_id": list(m.eos_ids), "mask_token_id": m.mask_id} if decoder == "llada2" else {}
    tokens, stats = DECODERS[decoder](m.model, ids.to(device), mask.to(device) if len(rows) > 1 else None,
                                      dict(knobs), **extra)
    return [t.tolist() for t in tokens], stats


def _settings(cases: list[dict]) -> list[list[int]]:
    """The cases' indices, grouped by knob setting (the seed aside)."""
    groups: dict[str, list[int]] = {}
    for i, c in enumerate(cases):
        groups.setdefault(json.dumps(c["knobs"] | {"seed": None}, sort_keys=True), []).append(i)
    return list(groups.values())


def check(name: str, device: str, authors_there: dict | None = None) -> dict:
    decoder = "llada2" if name == "llada2" else "sdar"
    cases = _cases(name)
    rec: dict = {"rows": len(cases)}
    for dtype in ("float32", "bfloat16"):
        m = load_model(FIXTURES / name, device=device, dtype=dtype)
        if name != "llada2":
            for c in cases:
                c["want"] = cut_after_eos(torch.tensor(c["output_ids"]), tuple(m.eos_ids))[
                    :c["knobs"]["gen_length"]].tolist()
        finite = {"bad": 0}
        hook = m.model.register_forward_hook(
            lambda _m, _a, out: finite.__setitem__("bad", finite["bad"] + int(not torch.isfinite(out.logits).all())))
        alone, nfe_equal, t0 = [], 0, time.perf_counter()
        for c in cases:
            toks, stats = _decode(m, decoder, [c["prompt"]], c["knobs"])
            alone.append(toks[0])
            nfe_equal += c["nfe"] is not None and stats["nfe"] == c["nfe"]
        seconds_alone = time.perf_counter() - t0
        same_in_batch, t0 = 0, time.perf_counter()
        for group in _settings(cases):
            for i in range(0, len(group), 4):
                part = group[i:i + 4]
                toks, _ = _decode(m, decoder, [cases[j]["prompt"] for j in part], cases[part[0]]["knobs"])
                same_in_batch += sum(t == alone[j] for t, j in zip(toks, part))
        hook.remove()
        r = {"authors_tokens": sum(a == c["want"] for a, c in zip(alone, cases)),
             "batch4_equal_to_alone": same_in_batch, "nonfinite_forwards": finite["bad"],
             "decode_s_batch1": round(seconds_alone, 2), "decode_s_batch4": round(time.perf_counter() - t0, 2)}
        if name == "llada2":
            r["nfe_equal"] = nfe_equal
        elif authors_there is not None and dtype == "float32":
            there = authors_there[name]["generations"]
            assert [g["prompt_ids"] for g in there] == [c["prompt"] for c in cases]
            r["authors_tokens_on_device"] = sum(
                a == cut_after_eos(torch.tensor(g["output_ids"]), tuple(m.eos_ids))[:g["kwargs"]["gen_length"]].tolist()
                for a, g in zip(alone, there))
        rec[dtype] = r
        if name == "llada2" and dtype == "float32":
            rec["logits"] = _llada2_logits(m)
        del m
        if device == "cuda":
            torch.cuda.empty_cache()
    return rec


def _llada2_logits(m) -> dict:
    from safetensors.torch import load_file

    from refusion.llada2_moe import Router

    ref = json.loads((FIXTURES / "llada2" / "reference.json").read_text())
    want = load_file(str(FIXTURES / "llada2" / ref["logits"]["file"]))
    chosen: list = []
    hooks = [mod.register_forward_hook(lambda _m, _a, out: chosen.append(out[0].cpu()))
             for mod in m.model.modules() if isinstance(mod, Router)]
    out = {}
    device = next(m.model.parameters()).device
    for key, prompt in zip(("full_0", "block8_1"), ref["logits"]["prompts"]):
        mask = None
        if key.startswith("block8"):
            blocks = torch.arange(len(prompt)) // 8
            mask = (blocks[None, :] <= blocks[:, None])[None, None].to(device)
        chosen.clear()
        with torch.no_grad():
            got = m.model(torch.tensor([prompt], device=device), attention_mask=mask).logits[0].float().cpu()
        out[key] = {"max_abs_diff": (got - want[key]).abs().max().item(),
                    "experts_equal": bool(torch.equal(torch.stack(chosen), want[f"experts_{key}"]))}
    for h in hooks:
        h.remove()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--fixtures", default="sdar,sdar_moe,llada2")
    ap.add_argument("--out", default=str(REPO / "results" / "gpu" / "block_diffusion.json"))
    ap.add_argument("--authors-on-device", metavar="JSON", help="the authors' SDAR generations made on this device "
                    "(module doc)")
    a = ap.parse_args()
    there = json.loads(Path(a.authors_on_device).read_text()) if a.authors_on_device else None
    if a.device == "cuda" and not torch.cuda.is_available():
        print(f"error: this torch ({torch.__version__}) sees no CUDA device", file=sys.stderr)
        return 2
    import transformers
    res = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__,
           "transformers": transformers.__version__, "fixtures": {}}
    if a.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 (the CPU tests' precision)
        torch.backends.cudnn.allow_tf32 = False
    for name in a.fixtures.split(","):
        t0 = time.perf_counter()
        res["fixtures"][name] = check(name, a.device, there if name != "llada2" else None)
        res["fixtures"][name]["wall_s"] = round(time.perf_counter() - t0, 1)
        print(name, json.dumps(res["fixtures"][name]), flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
