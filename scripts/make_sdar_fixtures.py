"""Regenerate tests/fixtures/released/sdar: a tiny random-weight SDAR checkpoint in the layout of
JetLM/SDAR-8B-Chat (config.json naming SDARForCausalLM with its auto_map, sharded safetensors + index, the slow
Qwen2 tokenizer with <|MASK|>), with reference generations made by the AUTHORS' OWN code
(JetAstra/SDAR generate.py ``block_diffusion_generate`` on training/model/SDAR-8B-Chat/modeling_sdar.py, imported
from a local checkout, never copied here).

Upstream: JetAstra/SDAR c2041a8333333d685f6e15122c84f60f51f85ebd (generate.py, training/model/SDAR-8B-Chat/).

The folder's own modeling_sdar.py, configuration_sdar.py and tokenization_qwen2.py are stand-ins written here
that RAISE when imported: the harness must load the folder without running them (no remote code).

Scratch virtualenv (never the project's .venv), CPU, float32:
    python3 -m venv /work/scratch/venv-sdar
    /work/scratch/venv-sdar/bin/pip install torch==2.13.0      # the local CPU build
    /work/scratch/venv-sdar/bin/pip install transformers==4.52.4 einops safetensors tokenizers
(config.json of the release says transformers 4.52.4; its modeling file imports LossKwargs, gone in later ones.)

Run (ROOT = a checkout of JetAstra/SDAR, or the files above exported from one at the same paths):
    /work/scratch/venv-sdar/bin/python scripts/make_sdar_fixtures.py --sdar ROOT

Shims, of imports only (the authors' files are not edited): modeling_sdar.py imports flash_attn (its RMSNorm
``rms_norm_fn`` and ``flash_attn_func``, CUDA kernels) and, for training, fused_linear_diffusion_cross_entropy
(triton). The driver puts in sys.modules a flash_attn whose rms_norm_fn is the float32 RMSNorm the file itself
keeps commented out under the call, and whose flash_attn_func is torch's scaled_dot_product_attention without a
mask (flash_attn_func(causal=False) over [batch, length, heads, dim]), and a stand-in loss module (training
only, never called). Everything is seeded: torch.manual_seed(SDAR_SEED) before each generate call.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import sys
import tempfile
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_release_fixtures as mrf  # noqa: E402  (the shared tiny tokenizer, weights and shards)

UPSTREAM = ("JetAstra/SDAR", "c2041a8333333d685f6e15122c84f60f51f85ebd")
UPSTREAM_FILES = ["generate.py (block_diffusion_generate)", "training/model/SDAR-8B-Chat/modeling_sdar.py",
                  "training/model/SDAR-8B-Chat/configuration_sdar.py"]
SDAR_SEED = 29
GEN_LENGTH = 32
EOS_LIKE = {"sdar": 144, "sdar_moe": 228}
QUERIES = mrf.DG_QUERIES  # 24 chat prompts
# Reference settings (generate.py argument names): its command-line defaults (block 4, 4 steps,
# low_confidence_dynamic at 0.85, temperature 1); another block length with a lower threshold; the static rule;
# sequential with the release's generation_config.json sampling (temperature 0.6, top_k 20, top_p 0.95).
SETTINGS = [
    {},
    {"block_length": 8, "denoising_steps": 8, "confidence_threshold": 0.7},
    {"remasking_strategy": "low_confidence_static"},
    {"block_length": 8, "denoising_steps": 4, "remasking_strategy": "sequential", "temperature": 0.6, "top_k": 20,
     "top_p": 0.95},
    {"remasking_strategy": "entropy_bounded"},  # made with ENTROPY_FIX (below)
]
# generate.py's entropy_bounded branch never creates transfer_index (every other branch starts with
# ``transfer_index = torch.zeros_like(x0, dtype=torch.bool)``), so it raises UnboundLocalError at its first step.
# Its references come from a copy of generate.py, written to a temporary folder and never kept, with that one
# line added at the top of the branch, as the other branches have it.
ENTROPY_BRANCH = 'elif remasking_strategy == "entropy_bounded":\n'
ENTROPY_FIX = "transfer_index = torch.zeros_like(x0, dtype=torch.bool)"
DEFAULTS = {"block_length": 4, "denoising_steps": 4, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
            "remasking_strategy": "low_confidence_dynamic", "confidence_threshold": 0.85, "eb_threshold": 0.35}
# The MoE fixture's Qwen3-MoE fields (SDAR-30B-A3B: 128 experts, 8 a token; here 4 and 2).
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
       "mlp_only_layers": [], "norm_topk_prob": True, "output_router_logits": False, "router_aux_loss_coef": 0.001}
ADDED = mrf.QWEN_ADDED + ["<tool_response>", "</tool_response>", "<think>", "</think>", "<|MASK|>"]
RAISING = ('"""Stand-in for the SDAR release\'s {name}, written for refusion-bench\'s test fixture (not the '
           'authors\' file):\nthe harness must load this folder without running any file of it."""\n\n'
           'raise ImportError("refusion-bench fixture: {name} must not be imported (no remote code)")\n')
FACTS = {
    "released_ids": {"mask": 151669, "mask_token": "<|MASK|>", "eos": [151645, 151643], "vocab_rows": 151936,
                     "source": "training/model/SDAR-8B-Chat config.json (mask_token_id 151669, block_size 4), "
                               "tokenizer_config.json (mask_token <|MASK|>), generation_config.json (eos 151645, "
                               "151643)"},
    "attention": "block-causal: generate.py builds tril(ones(blocks, blocks)) repeated block_length times in both "
                 "dimensions (a block sees itself and every earlier block); modeling_sdar.py SDARAttention takes "
                 "that mask (SDPA) or, when it is all ones, flash_attn_func(causal=False)",
    "model": "SDARForCausalLM = Qwen3ForCausalLM's weights and names (q_norm / k_norm before RoPE, no bias); "
             "store_kv=True appends the block's KV to the cache, store_kv=False reads the cache only",
    "generate": "block_diffusion_generate: prefill of the prompt's whole blocks (store_kv), then per block up to "
                "denoising_steps + 1 forwards (store_kv=False) and one store_kv forward once no mask is left; "
                "multinomial draws from softmax(logits / temperature) after top_k / top_p; stops after a block "
                "holding a stop id (generation_config eos in its __main__)",
}


def build(root: Path, name: str = "sdar") -> None:
    """JetLM/SDAR-8B-Chat's layout at tiny size; ``sdar_moe``: JetLM/SDAR-30B-A3B-Chat's (Qwen3-MoE's config
    fields and per-expert tensor names, model_type sdar_moe, SDARMoeForCausalLM and its files in auto_map)."""
    moe = name == "sdar_moe"
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    n, ids = mrf._slow_tokenizer(d, ADDED)
    vocab, kv, hd = mrf._round_up(n, 64), 2, 16
    cfg = {"architectures": ["SDARForCausalLM"],
           "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                        "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
           "attention_bias": False, "attention_dropout": 0.0, "attn_implementation": "flex_attention",
           "bos_token_id": ids["<|endoftext|>"], "debug": False, "eos_token_id": ids["<|endoftext|>"],
           "block_size": 4, "mask_token_id": ids["<|MASK|>"], "ep_size": 1, "fuse_cross_entropy": True,
           "head_dim": hd, "hidden_act": "silu", "hidden_size": mrf.HIDDEN, "initializer_range": 0.02,
           "intermediate_size": mrf.MLP, "max_position_embeddings": 32768, "max_window_layers": 36,
           "micro_forward": False, "model_type": "sdar", "num_attention_heads": mrf.HEADS,
           "num_hidden_layers": mrf.LAYERS, "num_key_value_heads": kv, "rms_norm_eps": 1e-06, "rope_scaling": None,
           "rope_theta": 1000000, "skip_checkpoint": False, "sliding_window": None, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "transformers_version": "4.52.4", "use_cache": False, "use_deepep": False,
           "use_sliding_window": False, "vocab_size": vocab}
    if moe:
        cfg.update(architectures=["SDARMoeForCausalLM"], model_type="sdar_moe",
                   auto_map={"AutoConfig": "configuration_sdar_moe.SDARMoeConfig",
                             "AutoModel": "modeling_sdar_moe.SDARMoeModel",
                             "AutoModelForCausalLM": "modeling_sdar_moe.SDARMoeForCausalLM"}, **MOE)
    mrf._write_json(d / "config.json", cfg)
    mrf._write_json(d / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"], "do_sample": True,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"],
        "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"})
    special = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    addl = [t for t in mrf.QWEN_ADDED if t not in mrf.QWEN_NOT_SPECIAL and t != "<|endoftext|>"] + ["<|MASK|>"]
    mrf._write_json(d / "tokenizer_config.json", {
        "add_bos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": mrf._added_decoder(ADDED, ids[ADDED[0]], lambda t: t not in mrf.QWEN_NOT_SPECIAL),
        "additional_special_tokens": addl, "auto_map": {"AutoTokenizer": ["tokenization_qwen2.Qwen2Tokenizer", None]},
        "bos_token": None, "chat_template": mrf.QWEN3_TEMPLATE, "clean_up_tokenization_spaces": False, **special,
        "mask_token": "<|MASK|>", "errors": "replace", "model_max_length": 131072, "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None})
    mrf._write_json(d / "special_tokens_map.json", {"additional_special_tokens": addl, **special})
    mrf._write_json(d / "added_tokens.json", {t: ids[t] for t in ADDED})
    stem = "sdar_moe" if moe else "sdar"
    files = (f"modeling_{stem}.py", f"configuration_{stem}.py")
    for f in (*files, "tokenization_qwen2.py"):
        (d / f).write_text(RAISING.format(name=f))
    names = mrf._qwen_like_names(False, True, vocab, mrf.HEADS, kv, hd)
    if moe:  # Qwen3-MoE's sparse block in place of every MLP, per-expert names as the Qwen3-MoE releases store them
        dense = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
        names = [(k, v) for k, v in names if not any(x in k for x in dense)]
        e, i = MOE["num_experts"], MOE["moe_intermediate_size"]
        for layer in range(mrf.LAYERS):
            p = f"model.layers.{layer}.mlp."
            names += [(p + "gate.weight", (e, mrf.HIDDEN))]
            names += [(p + f"experts.{x}.{w}.weight", shape) for x in range(e)
                      for w, shape in (("gate_proj", (i, mrf.HIDDEN)), ("up_proj", (i, mrf.HIDDEN)),
                                       ("down_proj", (mrf.HIDDEN, i)))]
    tensors = mrf._weights(names, mrf.SEED + (31 if moe else 30), "lm_head.weight", [ids["<|MASK|>"], *range(n, vocab)])
    # <|im_end|>'s output row close to that of a token the tiny model often draws (EOS_LIKE): some answers end
    # inside the budget, so stopping and rows leaving a batch are tested.
    head = tensors["lm_head.weight"]
    head[ids["<|im_end|>"]] = head[EOS_LIKE[name]]
    mrf._save_sharded(d, tensors)


def _shim_imports(pkg: str) -> None:
    """flash_attn (RMSNorm, attention) and the training loss module: see the module doc."""
    import torch
    import torch.nn.functional as F

    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    def rms_norm_fn(x, weight, bias=None, eps=1e-6):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)

    def flash_attn_func(q, k, v, causal=False, softmax_scale=None):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal, scale=softmax_scale, enable_gqa=True)
        return out.transpose(1, 2)

    mod("flash_attn", flash_attn_func=flash_attn_func, flash_attn_varlen_func=None)
    mod("flash_attn.ops")
    mod("flash_attn.ops.triton")
    mod("flash_attn.ops.triton.layer_norm", rms_norm_fn=rms_norm_fn)
    mod("flash_attn.bert_padding", index_first_axis=None, pad_input=None, unpad_input=None)
    mod(f"{pkg}.fused_linear_diffusion_cross_entropy", FusedLinearDiffusionCrossEntropyLoss=None)


def _entropy_fixed(src: Path, tmp: Path):
    """generate.py of ``src`` with ENTROPY_FIX at the top of the entropy_bounded branch, imported from ``tmp``."""
    text = (src / "generate.py").read_text()
    at = text.index(ENTROPY_BRANCH)
    assert text.count(ENTROPY_BRANCH) == 1 and ENTROPY_FIX not in text[at:at + 400], "generate.py changed upstream"
    line_start = text.rfind("\n", 0, at) + 1
    indent = " " * (at - line_start + 4)
    cut = at + len(ENTROPY_BRANCH)
    (tmp / "generate_entropy_fixed.py").write_text(text[:cut] + indent + ENTROPY_FIX + "\n" + text[cut:])
    return mrf._load_path("sdar_generate_entropy_fixed", tmp / "generate_entropy_fixed.py")


def _authors(src: Path):
    """(generate.py module, modeling_sdar module) of the checkout ``src``, its model folder as a package."""
    folder = src / "training/model/SDAR-8B-Chat"
    pkg = "sdar_authors"
    spec = importlib.machinery.ModuleSpec(pkg, None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    sys.modules[pkg] = importlib.util.module_from_spec(spec)
    _shim_imports(pkg)
    modeling = importlib.import_module(f"{pkg}.modeling_sdar")
    gen = mrf._load_path("sdar_generate", src / "generate.py")
    return gen, modeling


class StoreKV(object):
    """The MoE reference model: transformers' own Qwen3MoeForCausalLM (4.52.4) behind the call generate.py makes,
    model(ids, attention_mask=[1, q, kv] 0/1, position_ids, past_key_values, use_cache=True, store_kv=...): the
    mask as an additive 4-D one, and with store_kv False the cache cut back after the call (read, not written),
    as SDARAttention does. Written here; the release's modeling_sdar_moe.py is not in JetAstra/SDAR."""

    def __init__(self, model):
        self.model, self.device = model, model.device

    def eval(self):
        self.model.eval()
        return self

    def __call__(self, ids, attention_mask, position_ids, past_key_values, use_cache, store_kv):
        import torch

        seen = past_key_values.get_seq_length()
        mask = torch.zeros(attention_mask.shape, dtype=torch.float32, device=attention_mask.device).masked_fill(
            ~attention_mask.bool(), torch.finfo(torch.float32).min)
        out = self.model(ids, attention_mask=mask[:, None], position_ids=position_ids,
                         past_key_values=past_key_values, use_cache=use_cache)
        if not store_kv:
            past_key_values.crop(seen)
        return out


def _reference_model(a, name: str, folder: Path):
    """(model as generate.py calls it, a plain forward(ids, block mask [1, q, q]) -> logits, mask id), on
    ``a.device`` (the plain forward: CPU only)."""
    import torch

    gen_mod, modeling = _authors(Path(a.sdar))
    raw = json.loads((folder / "config.json").read_text())
    if name == "sdar":
        config = modeling.SDARConfig.from_dict(raw)
        model = modeling.SDARForCausalLM.from_pretrained(str(folder), config=config,
                                                         torch_dtype=torch.float32).to(a.device).eval()
        plain = lambda ids, mask: model(ids, attention_mask=mask, position_ids=torch.arange(ids.shape[1])[None],
                                        use_cache=False).logits
        return gen_mod, model, plain
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    drop = {"model_type", "architectures", "auto_map", "attn_implementation", "torch_dtype", "transformers_version"}
    config = Qwen3MoeConfig(**{k: v for k, v in raw.items() if k not in drop})
    inner = Qwen3MoeForCausalLM.from_pretrained(str(folder), config=config,
                                                torch_dtype=torch.float32).to(a.device).eval()
    wrapped = StoreKV(inner)
    plain = lambda ids, mask: inner(ids, attention_mask=torch.zeros(mask.shape).masked_fill(
        ~mask.bool(), torch.finfo(torch.float32).min)[:, None], position_ids=torch.arange(ids.shape[1])[None]).logits
    return gen_mod, wrapped, plain


def stage_reference(a, name: str = "sdar") -> dict:
    import torch
    import transformers
    from transformers import AutoTokenizer

    folder = Path(a.out) / name
    gen_mod, model, plain = _reference_model(a, name, folder)
    tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    mask = json.loads((folder / "config.json").read_text())["mask_token_id"]
    stop = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    gens = []
    with tempfile.TemporaryDirectory() as tmp:
        fixed = _entropy_fixed(Path(a.sdar), Path(tmp))
    for setting in SETTINGS:
        kw = {**DEFAULTS, **setting}
        entropy = kw["remasking_strategy"] == "entropy_bounded"
        for q in QUERIES:
            p = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
            torch.manual_seed(SDAR_SEED)
            x = (fixed if entropy else gen_mod).block_diffusion_generate(
                model, {"input_ids": torch.tensor([p], device=a.device)}, mask, gen_length=GEN_LENGTH,
                stopping_criteria_idx=stop, **kw)
            gens.append(mrf._gen("sdar.generate.block_diffusion_generate", {"gen_length": GEN_LENGTH, **kw}, p,
                                 x[0, len(p):].tolist(), seed=SDAR_SEED,
                                 **({"patch": f"generate.py + {ENTROPY_FIX!r} (ENTROPY_FIX)"} if entropy else {})))
    if a.reference_only:
        return {"device": str(a.device), "generations": gens,
                "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}
    # Logits of one block-causal forward (generate.py's prefill call) for the loading test.
    ids = torch.tensor([gens[0]["prompt_ids"][:12]])
    blocks = torch.tril(torch.ones(3, 3)).repeat_interleave(4, 0).repeat_interleave(4, 1)[None]
    with torch.no_grad():
        logits = plain(ids, blocks)
    mrf._save_logits(folder, {"block_causal_logits": logits[0]})
    moe = name == "sdar_moe"
    model_files = ([f"transformers {transformers.__version__} Qwen3MoeForCausalLM (the release's modeling_sdar_moe.py "
                    "is not in JetAstra/SDAR), behind make_sdar_fixtures.StoreKV"] if moe else UPSTREAM_FILES[1:])
    return {"upstream": [{"repo": UPSTREAM[0], "commit": UPSTREAM[1], "files": [UPSTREAM_FILES[0]]},
                         {"model": model_files}],
            "generations": gens, "facts": FACTS,
            "logits": {"input_ids": ids[0].tolist(), "block_length": 4,
                       "call": "forward(ids, block-causal mask [1, 12, 12], position_ids=arange), no cache"},
            "prompt_texts": {"texts": QUERIES, "encode": "tokenizer.apply_chat_template([{'role': 'user', "
                             "'content': text}], add_generation_prompt=True)"},
            "seeding": f"torch.manual_seed({SDAR_SEED}) before each block_diffusion_generate call; batch 1; CPU; "
                       "float32 (weights stored bfloat16); stopping_criteria_idx = generation_config.json eos",
            "shims": "none (no SDAR modeling file runs)" if moe else
                     "flash_attn.ops.triton.layer_norm.rms_norm_fn -> float32 RMSNorm; flash_attn.flash_attn_func -> "
                     "torch SDPA (no mask); fused_linear_diffusion_cross_entropy -> empty (training only)",
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sdar", required=True, help="checkout of JetAstra/SDAR (generate.py, training/model/SDAR-8B-Chat)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests/fixtures/released"))
    p.add_argument("--device", default="cpu", help="where the authors' code runs (the fixture: cpu)")
    p.add_argument("--reference-only", metavar="JSON", help="leave the folders as they are: run the authors' code "
                   "on them and write {fixture: its generations} to JSON (scripts/gpu_block_diffusion.py "
                   "--authors-on-device reads it)")
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 on a GPU too
    if a.reference_only:
        out = {name: stage_reference(a, name) for name in ("sdar", "sdar_moe")}
        Path(a.reference_only).write_text(json.dumps(out) + "\n")
        return 0
    for name in ("sdar", "sdar_moe"):
        build(Path(a.out), name)
        mrf._write_json(Path(a.out) / name / "reference.json", stage_reference(a, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
