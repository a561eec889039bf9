"""Regenerate tests/fixtures/released/: tiny random-weight checkpoints in the file layouts of the
released diffusion / AR checkpoints, with reference logits and greedy generations produced by the
AUTHORS' OWN code (imported from a local checkout, never copied here), or for DiffusionGemma by
transformers' own generate.

Upstream code (pass each checkout's root with the flags below; commits recorded in every reference):
  --llada     ML-GSAI/LLaDA                         b7e6c3565f194352da44b38dd12b6970597309f3  generate.py
  --fastdllm  NVlabs/Fast-dLLM                      24cc59e75f20a6384bae8c905965bb090b96388e  llada/, dream/
  --d2f       zhijie-group/Discrete-Diffusion-Forcing 771f745f6770230dd6ea6a283519b31c5d57e6ed  D2F-eval/, D2F-train/
  --refusion  ML-GSAI/ReFusion                      7c20c120b8e558ebee3cb5e72a1393d9ef4a3a2b  qwen3/, generate.py
Dream-org/Dream and the hub repos were not available: Dream's original generation_utils.py is read from
D2F-eval/model_cache/dream/ (the hub file unmodified), its modelling file and tokenizer class from
Fast-dLLM dream/model/ (the hub file plus cache arguments unused without a cache); the LLaDA modelling
file from Fast-dLLM llada/model/. D2F's own copies of both modelling files give identical logits
(recorded in d2f_*/reference.json as d2f_modeling_vs_base_reference_max_abs).

Two scratch virtualenvs (never the project's .venv), CPU, float32:
  --py446  python with torch==2.13.0 (local CPU build), transformers==4.46.3, peft==0.13.2,
           accelerate==1.0.1, einops, regex, safetensors, numpy  (LLaDA, Fast-dLLM, Dream, D2F, Llama)
  --py452  python with torch==2.13.0, transformers==4.52.4, pandas, tqdm, safetensors (ReFusion's
           qwen3 file needs 4.52: SlidingWindowCache was removed in 4.53)
e.g.  python3 -m venv /tmp/authors-venv && /tmp/authors-venv/bin/pip install torch==2.13.0 && \
      /tmp/authors-venv/bin/pip install transformers==4.46.3 peft==0.13.2 accelerate==1.0.1 einops regex

Run:  python3 scripts/make_release_fixtures.py --llada L --fastdllm F --d2f D --refusion R \
          --py446 /tmp/authors-venv/bin/python --py452 /tmp/authors-venv-q3/bin/python
The Qwen3-8B stand-in (qwen3/, stock transformers code, the AR row of the paper's headline speedup) alone:
      .venv/bin/python scripts/make_release_fixtures.py --only-qwen3
DiffusionGemma (diffusiongemma/, beyond Table 1: google/diffusiongemma-26B-A4B-it's layout on transformers' own
DiffusionGemmaForBlockDiffusion, references from its DiffusionGemmaGenerationMixin.generate, seeded) alone, in
the project's venv (transformers >= 5.24):
      .venv/bin/python scripts/make_release_fixtures.py --only-diffusiongemma
The driver runs each stage in a subprocess of the right interpreter (the upstream repos all name
their packages `model`/`generate`, so stages cannot share one process). Everything is seeded.

The D2F evaluation modules import lm_eval / datasets at module level for their lm-eval wrapper
classes; the stages put empty stand-ins for those two packages in sys.modules (the decoding methods
used here never touch them) and build the wrapper object without its lm-eval __init__, setting only
the attributes its `_generate_block_single` reads.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

UPSTREAM = {
    "llada": ("ML-GSAI/LLaDA", "b7e6c3565f194352da44b38dd12b6970597309f3"),
    "fastdllm": ("NVlabs/Fast-dLLM", "24cc59e75f20a6384bae8c905965bb090b96388e"),
    "d2f": ("zhijie-group/Discrete-Diffusion-Forcing", "771f745f6770230dd6ea6a283519b31c5d57e6ed"),
    "refusion": ("ML-GSAI/ReFusion", "7c20c120b8e558ebee3cb5e72a1393d9ef4a3a2b"),
}
SEED = 20240611
# Tiny shapes shared by every family: hidden 64, 2 layers, 4 query heads (head_dim 16).
HIDDEN, LAYERS, HEADS, MLP = 64, 2, 4, 128
# A small corpus for the byte-level BPE; the base vocab is 256 bytes + merges up to BPE_SIZE.
CORPUS = [
    "the cat sat on the mat and the dog ran to the park",
    "one two three four five six seven eight nine ten",
    "def add(a, b):\n    return a + b\n",
    "Question: what is 12 plus 30? Answer: 42.",
    "a slot of tokens is decoded in parallel then verified",
    "Lily can run 12 kilometers per hour for 4 hours.",
]
BPE_SIZE = 300
# Output-layer scale: logits of std ~HEAD_SCALE make the top-1 probability range over (0.2, 1), so the
# confidence thresholds of the decoders (0.5-0.9) both pass and fail.
HEAD_SCALE = 8.0
PROMPTS = ["the cat sat on", "one two three", "def add(a, b):"]


# --------------------------------------------------------------------------------------------
# Stage "assets": tokenizers, configs and random weights (any venv with torch+tokenizers).
# --------------------------------------------------------------------------------------------

QWEN_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
              "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
              "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
              "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
              "<|repo_name|>", "<|file_sep|>"]
# Tokens that Qwen marks special=False in added_tokens_decoder.
QWEN_NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
                    "<think>", "</think>"}
# LLaDA: released ids 126080.. (<|mdm_mask|> is 126336 among 256 reserved tokens); tiny keeps the order.
LLADA_ADDED = ["<|startoftext|>", "<|endoftext|>", "[CLS]", "[gMASK]", "<|reserved_token_0|>",
               "<|reserved_token_1|>", "<|mdm_mask|>", "<|reserved_token_255|>", "<role>", "</role>",
               "<|arithmetic_start|>", "<|arithmetic_end|>", "<|number_start|>", "<|number_end|>",
               "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_ADDED = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                "<|reserved_special_token_1|>", "<|reserved_special_token_2|>", "<|reserved_special_token_3|>",
                "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]

# Chat templates: the released ones' behaviour on plain system/user/assistant chats, written here
# (not copied). LLaDA's appends the assistant header unconditionally, as released.
LLAMA_STYLE_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}")
LLADA_TEMPLATE = LLAMA_STYLE_TEMPLATE + "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
LLAMA3_TEMPLATE = LLAMA_STYLE_TEMPLATE + (
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
QWEN25_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
QWEN3_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}")


def _train_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _added_decoder(names, base, special_of=lambda n: True):
    return {str(base + i): {"content": n, "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": special_of(n)} for i, n in enumerate(names)}


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def _fast_tokenizer(folder: Path, added: list[str]) -> tuple[int, dict]:
    """tokenizer.json with `added` appended after the base vocab; returns (len, name -> id)."""
    from tokenizers import AddedToken

    tok = _train_bpe()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    tok.save(str(folder / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in added}
    return tok.get_vocab_size(), ids


def _slow_tokenizer(folder: Path, added: list[str]) -> tuple[int, dict]:
    """vocab.json + merges.txt (byte-level BPE) with `added` ids following the base vocab."""
    tok = _train_bpe()
    tok.model.save(str(folder))
    base = tok.get_vocab_size()
    return base + len(added), {t: base + i for i, t in enumerate(added)}


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _weights(names_shapes: list[tuple[str, tuple[int, ...]]], seed: int, head: str, dead_rows: list[int]):
    """Random tensors: norms near 1 (jittered, so a swapped norm shows), biases small,
    matrices N(0, 1.5/sqrt(fan_in)), the output layer N(0, HEAD_SCALE/sqrt(fan_in))."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in names_shapes:
        if name.endswith("norm.weight") or "_norm." in name or name.endswith("ln_f.weight"):
            t = 1.0 + 0.2 * torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            t = 0.3 * torch.randn(shape, generator=g)
        elif "embed_tokens" in name or name.endswith("wte.weight"):
            t = torch.randn(shape, generator=g)
        elif name == head:
            t = torch.randn(shape, generator=g) * (HEAD_SCALE / shape[-1] ** 0.5)
        else:
            t = torch.randn(shape, generator=g) * (1.5 / shape[-1] ** 0.5)
        if name == head:
            # A zero output row gives logit 0, below the max of ~300 random logits: the tiny model never
            # predicts the mask token or a padding row (as trained models don't; the authors' loops that
            # run until no mask is left would otherwise never end).
            t[dead_rows] = 0.0
        # Stored in bfloat16 like the releases ("torch_dtype": "bfloat16"); references load them as float32.
        out[name] = t.to(torch.bfloat16).contiguous()
    return out


def _save_sharded(folder: Path, tensors: dict, shards: int = 2) -> None:
    """model-0000k-of-0000n.safetensors + model.safetensors.index.json, as the 7-8B releases ship."""
    from safetensors.torch import save_file

    names = list(tensors)
    per = (len(names) + shards - 1) // shards
    weight_map, total = {}, 0
    for k in range(shards):
        part = names[k * per:(k + 1) * per]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / fname), metadata={"format": "pt"})
        for n in part:
            weight_map[n] = fname
            total += tensors[n].numel() * tensors[n].element_size()
    _write_json(folder / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _qwen_like_names(prefix_bias: bool, qk_norm: bool, vocab: int, heads: int, kv: int, hd: int):
    ns = [("model.embed_tokens.weight", (vocab, HIDDEN))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        ns += [(p + "input_layernorm.weight", (HIDDEN,)), (p + "post_attention_layernorm.weight", (HIDDEN,)),
               (p + "self_attn.q_proj.weight", (heads * hd, HIDDEN)), (p + "self_attn.k_proj.weight", (kv * hd, HIDDEN)),
               (p + "self_attn.v_proj.weight", (kv * hd, HIDDEN)), (p + "self_attn.o_proj.weight", (HIDDEN, heads * hd)),
               (p + "mlp.gate_proj.weight", (MLP, HIDDEN)), (p + "mlp.up_proj.weight", (MLP, HIDDEN)),
               (p + "mlp.down_proj.weight", (HIDDEN, MLP))]
        if prefix_bias:
            ns += [(p + "self_attn.q_proj.bias", (heads * hd,)), (p + "self_attn.k_proj.bias", (kv * hd,)),
                   (p + "self_attn.v_proj.bias", (kv * hd,))]
        if qk_norm:
            ns += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
    ns += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (vocab, HIDDEN))]
    return ns


def build_llada(root: Path) -> None:
    d = root / "llada"
    d.mkdir(parents=True, exist_ok=True)
    n, ids = _fast_tokenizer(d, LLADA_ADDED)
    vocab = _round_up(n, 64)  # released: 126464 rows for 126349 tokens
    cfg = {
        "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
        "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                     "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM", "AutoModel": "modeling_llada.LLaDAModelLM"},
        "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": HIDDEN,
        "embedding_dropout": 0.0, "embedding_size": vocab, "eos_token_id": ids["<|endoftext|>"],
        "flash_attention": False, "include_bias": False, "include_qkv_bias": False, "init_cutoff_factor": None,
        "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False,
        "layer_norm_type": "rms", "layer_norm_with_affine": True, "mask_token_id": ids["<|mdm_mask|>"],
        "max_sequence_length": 4096, "mlp_hidden_size": MLP, "mlp_ratio": 4, "model_type": "llada",
        "multi_query_attention": None, "n_heads": HEADS, "n_kv_heads": HEADS, "n_layers": LAYERS,
        "pad_token_id": ids["<|endoftext|>"], "precision": "amp_bf16", "residual_dropout": 0.0,
        "rms_norm_eps": 1e-05, "rope": True, "rope_full_precision": True, "rope_theta": 500000.0,
        "scale_logits": False, "transformers_version": "4.46.3", "use_cache": False, "vocab_size": vocab,
        "weight_tying": False}
    _write_json(d / "config.json", cfg)
    special = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
               "cls_token": "[CLS]"}
    _write_json(d / "tokenizer_config.json", {
        "add_bos_token": False, "add_eos_token": False,
        "added_tokens_decoder": _added_decoder(LLADA_ADDED, ids[LLADA_ADDED[0]]),
        "additional_special_tokens": ["<role>", "</role>", "<|arithmetic_start|>", "<|arithmetic_end|>",
                                      "<|number_start|>", "<|number_end|>"],
        **special, "chat_template": LLADA_TEMPLATE, "clean_up_tokenization_spaces": False,
        "fast_tokenizer": True, "gmask_token": "[gMASK]", "merges_file": None,
        "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 1000000000000000019884624838656,
        "tokenizer_class": "PreTrainedTokenizerFast", "trust_remote_code": True, "vocab_file": None})
    _write_json(d / "special_tokens_map.json", {**special, "additional_special_tokens": [
        "<role>", "</role>", "<|arithmetic_start|>", "<|arithmetic_end|>", "<|number_start|>", "<|number_end|>"]})
    _write_json(d / "generation_config.json", {"_from_model_config": True, "bos_token_id": ids["<|startoftext|>"],
                                               "eos_token_id": ids["<|endoftext|>"], "pad_token_id": ids["<|endoftext|>"],
                                               "transformers_version": "4.46.3"})
    ns = [("model.transformer.wte.weight", (vocab, HIDDEN))]
    for i in range(LAYERS):
        p = f"model.transformer.blocks.{i}."
        ns += [(p + "attn_norm.weight", (HIDDEN,)), (p + "ff_norm.weight", (HIDDEN,)),
               (p + "q_proj.weight", (HIDDEN, HIDDEN)), (p + "k_proj.weight", (HIDDEN, HIDDEN)),
               (p + "v_proj.weight", (HIDDEN, HIDDEN)), (p + "attn_out.weight", (HIDDEN, HIDDEN)),
               (p + "ff_proj.weight", (MLP, HIDDEN)), (p + "up_proj.weight", (MLP, HIDDEN)),
               (p + "ff_out.weight", (HIDDEN, MLP))]
    ns += [("model.transformer.ln_f.weight", (HIDDEN,)), ("model.transformer.ff_out.weight", (vocab, HIDDEN))]
    _save_sharded(d, _weights(ns, SEED + 1, "model.transformer.ff_out.weight", [ids["<|mdm_mask|>"], *range(n, vocab)]))


def build_dream(root: Path, name: str, seed: int) -> None:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    added = QWEN_ADDED + ["<|beginoftext|>", "<|mask|>"]
    n, ids = _slow_tokenizer(d, added)
    vocab = _round_up(n, 64)  # released: 152064 rows for 151667 tokens
    kv = 2
    cfg = {"architectures": ["DreamModel"], "attention_dropout": 0.0,
           "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
           "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|endoftext|>"], "hidden_act": "silu",
           "hidden_size": HIDDEN, "initializer_range": 0.02, "intermediate_size": MLP,
           "mask_token_id": ids["<|mask|>"], "max_position_embeddings": 131072, "max_window_layers": 28,
           "model_type": "Dream", "num_attention_heads": HEADS, "num_hidden_layers": LAYERS,
           "num_key_value_heads": kv, "pad_token_id": ids["<|endoftext|>"], "rms_norm_eps": 1e-06,
           "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "transformers_version": "4.46.2", "use_cache": False,
           "use_sliding_window": False, "vocab_size": vocab}
    _write_json(d / "config.json", cfg)
    _write_json(d / "generation_config.json", {
        "_from_model_config": True, "alg": "origin", "alg_temp": None, "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|endoftext|>"], "eps": 0.001, "mask_token_id": None, "output_history": False,
        "pad_token_id": ids["<|endoftext|>"], "steps": 512, "temperature": 0.0, "top_k": None, "top_p": None,
        "transformers_version": "4.46.2"})
    special = {"bos_token": "<|beginoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
               "mask_token": "<|mask|>", "unk_token": None}
    addl = ["<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
            "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
            "<|image_pad|>", "<|video_pad|>"]
    _write_json(d / "tokenizer_config.json", {
        "add_bos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": _added_decoder(added, ids[added[0]], lambda t: t not in QWEN_NOT_SPECIAL),
        "additional_special_tokens": addl, **special,
        "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
        "chat_template": QWEN25_TEMPLATE, "clean_up_tokenization_spaces": False, "errors": "replace",
        "model_max_length": 131072, "split_special_tokens": False, "tokenizer_class": "DreamTokenizer"})
    _write_json(d / "special_tokens_map.json", {k: v for k, v in special.items() if v is not None}
                | {"additional_special_tokens": addl})
    _save_sharded(d, _weights(_qwen_like_names(True, False, vocab, HEADS, kv, HIDDEN // HEADS), seed, "lm_head.weight",
                              [ids["<|mask|>"], *range(n, vocab)]))


def build_refusion(root: Path) -> None:
    d = root / "refusion"
    d.mkdir(parents=True, exist_ok=True)
    added = QWEN_ADDED + ["<tool_response>", "</tool_response>", "<think>", "</think>", "<|beginoftext|>", "<|mask|>"]
    n, ids = _slow_tokenizer(d, added)
    vocab = n  # train.py: resize_token_embeddings(len(tokenizer)) -> 151671 exactly
    kv, hd = 2, 16
    cfg = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
           "auto_map": {"AutoConfig": "configuration_qwen3.Qwen3Config",
                        "AutoModelForCausalLM": "modeling_qwen3_refusion.Qwen3ForCausalLM"},
           "bos_token_id": ids["<|beginoftext|>"], "eos_token_id": ids["<|im_end|>"], "head_dim": hd,
           "hidden_act": "silu", "hidden_size": HIDDEN, "initializer_range": 0.02, "intermediate_size": MLP,
           "mask_token_id": ids["<|mask|>"], "max_position_embeddings": 40960, "max_window_layers": 36,
           "model_type": "qwen3", "num_attention_heads": HEADS, "num_hidden_layers": LAYERS,
           "num_key_value_heads": kv, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
           "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "transformers_version": "4.52.4", "use_cache": False, "use_sliding_window": False, "vocab_size": vocab}
    _write_json(d / "config.json", cfg)
    _write_json(d / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"], "do_sample": True, "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"], "temperature": 0.6, "top_k": 20, "top_p": 0.95,
        "transformers_version": "4.52.4"})
    special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    addl = ["<|beginoftext|>", "<|mask|>"]
    _write_json(d / "tokenizer_config.json", {
        "add_bos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": _added_decoder(added, ids[added[0]], lambda t: t not in QWEN_NOT_SPECIAL),
        "additional_special_tokens": addl, "bos_token": None, "chat_template": QWEN3_TEMPLATE,
        "clean_up_tokenization_spaces": False, **special, "errors": "replace", "extra_special_tokens": {},
        "model_max_length": 4096, "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None})
    _write_json(d / "special_tokens_map.json", {"additional_special_tokens": addl, **special})
    _write_json(d / "added_tokens.json", {t: ids[t] for t in added})
    _save_sharded(d, _weights(_qwen_like_names(False, True, vocab, HEADS, kv, hd), SEED + 3, "lm_head.weight",
                              [ids["<|mask|>"]]))


def build_llama3(root: Path) -> None:
    d = root / "llama3"
    d.mkdir(parents=True, exist_ok=True)
    n, ids = _fast_tokenizer(d, LLAMA3_ADDED)
    vocab, kv = n, 2
    cfg = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
           "bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": ids["<|eot_id|>"], "hidden_act": "silu",
           "hidden_size": HIDDEN, "initializer_range": 0.02, "intermediate_size": MLP,
           "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": HEADS,
           "num_hidden_layers": LAYERS, "num_key_value_heads": kv, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
           "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "transformers_version": "4.40.0.dev0", "use_cache": True, "vocab_size": vocab}
    _write_json(d / "config.json", cfg)
    _write_json(d / "generation_config.json", {
        "bos_token_id": ids["<|begin_of_text|>"], "do_sample": True,
        "eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]], "max_length": 4096, "temperature": 0.6,
        "top_p": 0.9, "transformers_version": "4.40.0.dev0"})
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    _write_json(d / "tokenizer_config.json", {
        "added_tokens_decoder": _added_decoder(LLAMA3_ADDED, ids[LLAMA3_ADDED[0]]), **special,
        "chat_template": LLAMA3_TEMPLATE, "clean_up_tokenization_spaces": True,
        "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 1000000000000000019884624838656,
        "tokenizer_class": "PreTrainedTokenizerFast"})
    _write_json(d / "special_tokens_map.json", special)
    _save_sharded(d, _weights(_qwen_like_names(False, False, vocab, HEADS, kv, HIDDEN // HEADS), SEED + 4,
                              "lm_head.weight", []))


def build_qwen3(root: Path) -> None:
    """Qwen/Qwen3-8B's layout (the AR row ReFusion's headline speedup is measured against): stock
    Qwen3ForCausalLM, no auto_map, no mask token, the slow Qwen2Tokenizer with Qwen3's chat template
    (enable_thinking), an embedding padded past the tokenizer as released (151936 rows for 151669 tokens)."""
    d = root / "qwen3"
    d.mkdir(parents=True, exist_ok=True)
    added = QWEN_ADDED + ["<tool_response>", "</tool_response>", "<think>", "</think>"]
    n, ids = _slow_tokenizer(d, added)
    vocab, kv, hd = _round_up(n, 64), 2, 16
    cfg = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
           "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "head_dim": hd,
           "hidden_act": "silu", "hidden_size": HIDDEN, "initializer_range": 0.02, "intermediate_size": MLP,
           "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
           "num_attention_heads": HEADS, "num_hidden_layers": LAYERS, "num_key_value_heads": kv,
           "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
           "use_cache": True, "use_sliding_window": False, "vocab_size": vocab}
    _write_json(d / "config.json", cfg)
    _write_json(d / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"], "do_sample": True, "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"], "temperature": 0.6, "top_k": 20, "top_p": 0.95,
        "transformers_version": "4.51.0"})
    special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    addl = [t for t in QWEN_ADDED if t not in QWEN_NOT_SPECIAL and t != "<|endoftext|>"]
    _write_json(d / "tokenizer_config.json", {
        "add_bos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": _added_decoder(added, ids[added[0]], lambda t: t not in QWEN_NOT_SPECIAL),
        "additional_special_tokens": addl, "bos_token": None, "chat_template": QWEN3_TEMPLATE,
        "clean_up_tokenization_spaces": False, **special, "errors": "replace", "model_max_length": 131072,
        "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None})
    _write_json(d / "special_tokens_map.json", {"additional_special_tokens": addl, **special})
    _write_json(d / "added_tokens.json", {t: ids[t] for t in added})
    _save_sharded(d, _weights(_qwen_like_names(False, True, vocab, HEADS, kv, hd), SEED + 6, "lm_head.weight",
                              list(range(n, vocab))))


def stage_assets(a) -> None:
    root = Path(a.out)
    build_llada(root)
    build_dream(root, "dream_instruct", SEED + 2)
    build_dream(root, "dream_base", SEED + 5)
    build_refusion(root)
    build_llama3(root)
    build_qwen3(root)


# --------------------------------------------------------------------------------------------
# Helpers shared by the model stages (run inside an authors' venv).
# --------------------------------------------------------------------------------------------

def _load_path(name: str, path: Path):
    """Import one upstream file under a unique module name."""
    spec = importlib.util.spec_from_file_location(name, str(path))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _stub_lm_eval() -> None:
    """Empty stand-ins for lm_eval / datasets, imported at module level by D2F's eval wrappers."""
    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec() on a stub must not raise
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    class _LM:  # base class of the wrappers; nothing of it is used by the decoding methods
        def __init__(self, *a, **k):
            pass

    mod("lm_eval", utils=types.SimpleNamespace())
    mod("lm_eval.api")
    mod("lm_eval.api.instance", Instance=object)
    mod("lm_eval.api.model", LM=_LM, TemplateLM=_LM)
    mod("lm_eval.api.registry", register_model=lambda *a, **k: (lambda c: c))
    mod("lm_eval.models")
    mod("lm_eval.models.utils", get_dtype=lambda d: d)
    mod("lm_eval.__main__", cli_evaluate=lambda *a, **k: None)
    mod("lm_eval.utils")
    if importlib.util.find_spec("datasets") is None:
        mod("datasets", Dataset=object)


def _prompt_ids(encode, bos: list[int]) -> list[list[int]]:
    return [bos + encode(p) for p in PROMPTS]


def _fast_encode(folder: Path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return lambda s: tok.encode(s, add_special_tokens=False).ids


def _logit_batch(cfg_vocab_tokens: int, mask_id: int | None, seed: int) -> list[list[int]]:
    """2 rows x 12 ids from the base vocab; for diffusion models positions 7..11 of row 0 and 4..8 of
    row 1 are the mask token."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg_vocab_tokens, (2, 12), generator=g)
    if mask_id is not None:
        ids[0, 7:] = mask_id
        ids[1, 4:9] = mask_id
    return ids.tolist()


def _save_logits(folder: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().float().contiguous() for k, v in tensors.items()}, str(folder / "reference.safetensors"),
              metadata={"format": "pt"})


def _base_size(folder: Path) -> int:
    return len(json.loads((folder / "vocab.json").read_text())) if (folder / "vocab.json").exists() else BPE_SIZE


def _token_id(folder: Path, content: str) -> int:
    return next(t["id"] for t in json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
                if t["content"] == content)


def _dream_tokenizer(a, folder: Path):
    """The hub's slow DreamTokenizer class (Fast-dLLM's copy of tokenization_dream.py)."""
    mod = _load_path("fastdllm_tokenization_dream", Path(a.fastdllm) / "dream/model/tokenization_dream.py")
    return mod.DreamTokenizer.from_pretrained(str(folder))


def _gen(generator: str, kwargs: dict, prompt: list[int], out: list[int], **extra) -> dict:
    return {"generator": generator, "kwargs": kwargs, "prompt_ids": prompt, "output_ids": out, **extra}


def _dump(path: Path, obj) -> None:
    _write_json(path, obj)


# --------------------------------------------------------------------------------------------
# Stage "llada": LLaDA generate.py + Fast-dLLM (py446).
# --------------------------------------------------------------------------------------------

def stage_llada(a) -> None:
    import torch

    torch.manual_seed(SEED)
    folder = Path(a.out) / "llada"
    cfg = json.loads((folder / "config.json").read_text())
    mask = cfg["mask_token_id"]
    sys.path.insert(0, str(Path(a.fastdllm) / "llada"))
    from model.modeling_llada import LLaDAModelLM  # Fast-dLLM's copy of the hub modelling file

    model = LLaDAModelLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    batch = _logit_batch(BPE_SIZE, mask, SEED + 11)
    with torch.no_grad():
        logits = model(torch.tensor(batch)).logits
    llada_gen = _load_path("llada_generate", Path(a.llada) / "generate.py")
    fd_gen = _load_path("fastdllm_llada_generate", Path(a.fastdllm) / "llada/generate.py")
    prompts = _prompt_ids(_fast_encode(folder), [_token_id(folder, "<|startoftext|>")])
    gens = []
    for p in prompts:
        x = torch.tensor([p])
        for steps, gl, bl in [(16, 16, 8), (8, 16, 16), (32, 32, 8)]:
            kw = {"steps": steps, "gen_length": gl, "block_length": bl, "temperature": 0.0, "cfg_scale": 0.0,
                  "remasking": "low_confidence", "mask_id": mask}
            out = llada_gen.generate(model, x, **kw)
            gens.append(_gen("llada.generate", kw, p, out[0, len(p):].tolist()))
        for fn in ["generate", "generate_with_prefix_cache", "generate_with_dual_cache"]:
            for thr in [None, 0.9, 0.5]:
                kw = {"steps": 16, "gen_length": 32, "block_length": 8, "temperature": 0.0,
                      "remasking": "low_confidence", "mask_id": mask, "threshold": thr}
                out, nfe = getattr(fd_gen, fn)(model, x, **kw)
                gens.append(_gen(f"fast_dllm.llada.{fn}", kw, p, out[0, len(p):].tolist(), nfe=int(nfe)))
    _save_logits(folder, {"logits": logits})
    _dump(Path(a.tmp) / "llada.json", {"logits_input_ids": batch, "generations": gens})


# --------------------------------------------------------------------------------------------
# Stage "dream": Dream's own diffusion_generate + Fast-dLLM's Dream (py446).
# --------------------------------------------------------------------------------------------

def stage_dream(a) -> None:
    """Dream's own diffusion_generate (the hub generation_utils.py, D2F's unmodified copy) and Fast-dLLM's
    block/cache variant (dream/model/generation_utils_block.py), both on Fast-dLLM's DreamModel: the hub
    modeling_dream.py plus optional cache arguments that are unused when no cache is passed. (D2F's own
    copy of modeling_dream.py is changed for D2F's masks and no longer accepts Dream's "full" mask.)"""
    import types as _t

    import torch

    sys.path.insert(0, str(Path(a.fastdllm) / "dream"))
    from model.generation_utils import DreamGenerationMixin as ParallelMixin
    from model.generation_utils_block import DreamGenerationMixin as BlockMixin
    from model.modeling_dream import DreamModel

    orig = _load_path("dream_hub_generation_utils", Path(a.d2f) / "D2F-eval/model_cache/dream/generation_utils.py")

    class HubDream(orig.DreamGenerationMixin, DreamModel):
        """DreamModel whose diffusion_generate/_sample are the hub file's (first in the MRO)."""

    res = {}
    for name in ["dream_instruct", "dream_base"]:
        folder = Path(a.out) / name
        cfg = json.loads((folder / "config.json").read_text())
        mask = cfg["mask_token_id"]
        model = HubDream.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
        batch = _logit_batch(_base_size(folder), mask, SEED + 12)
        with torch.no_grad():
            logits = model(torch.tensor(batch)).logits
        tok = _dream_tokenizer(a, folder)
        prompts = [tok.encode(s, add_special_tokens=False) for s in PROMPTS]
        gens = []
        for p in prompts:
            x = torch.tensor([p])
            for gl, steps, alg in [(16, 16, "entropy"), (16, 8, "entropy"), (32, 32, "entropy"), (32, 16, "entropy"),
                                   (16, 16, "maskgit_plus")]:
                kw = {"max_new_tokens": gl, "steps": steps, "temperature": 0.0, "alg": alg, "alg_temp": 0.0,
                      "top_p": None, "eps": 1e-3, "output_history": False, "return_dict_in_generate": True}
                out = model.diffusion_generate(x, **kw).sequences
                gens.append(_gen("dream.diffusion_generate", kw, p, out[0, len(p):].tolist()))
            # Defaults: without generation_config, diffusion_generate builds its config from config.json
            # (alg 'origin', steps 512, eps 1e-3, temperature 0); 'origin' draws torch.rand each step.
            torch.manual_seed(SEED)
            kw = {"max_new_tokens": 16}
            out = model.diffusion_generate(x, **kw)
            gens.append(_gen("dream.diffusion_generate", kw, p, out[0, len(p):].tolist(),
                             note="defaults: alg origin, steps 512, temperature 0; random transfer order "
                                  f"(torch.manual_seed({SEED}) right before the call)"))
        fast = DreamModel.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
        for mixin, tag in [(ParallelMixin, "generation_utils"), (BlockMixin, "generation_utils_block")]:
            # Fast-dLLM dream/eval.py binds both methods of the chosen file onto the model.
            fast.diffusion_generate = _t.MethodType(mixin.diffusion_generate, fast)
            fast._sample = _t.MethodType(mixin._sample, fast)
            for p in prompts:
                x = torch.tensor([p])
                for dual in ([False, True] if mixin is BlockMixin else [None]):
                    algs = [("confidence_threshold", 0.9), ("confidence_threshold", 0.5)]
                    algs += [("entropy", 0.9)] if mixin is BlockMixin else []
                    for alg, thr in algs:
                        kw = {"max_new_tokens": 32, "steps": 32 if mixin is BlockMixin else 8, "temperature": 0.0,
                              "top_p": None, "alg": alg, "alg_temp": 0.0, "threshold": thr,
                              "output_history": False, "return_dict_in_generate": True}
                        if mixin is BlockMixin:
                            kw |= {"block_length": 8, "dual_cache": dual}
                        out = fast.diffusion_generate(x, **kw).sequences
                        gens.append(_gen(f"fast_dllm.dream.diffusion_generate({tag})", kw, p, out[0, len(p):].tolist()))
        _save_logits(folder, {"logits": logits})
        res[name] = {"logits_input_ids": batch, "generations": gens}
    _dump(Path(a.tmp) / "dream.json", res)


# --------------------------------------------------------------------------------------------
# Stage "d2f": D2F adapters (peft) + D2F's block decoding loops (py446).
# --------------------------------------------------------------------------------------------

def _make_adapter(model, folder: Path, targets: list[str], base_id: str, seed: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    # D2F-train/utils/model.py: LoraConfig(r=32, lora_alpha=32, lora_dropout=0.1, target_modules=...)
    pm = get_peft_model(model, LoraConfig(r=32, lora_alpha=32, lora_dropout=0.1, target_modules=targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_A" in n or "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 / p.shape[-1] ** 0.5))
    folder.mkdir(parents=True, exist_ok=True)
    pm.save_pretrained(str(folder))
    cfgp = folder / "adapter_config.json"
    c = json.loads(cfgp.read_text())
    c["base_model_name_or_path"] = base_id
    c["target_modules"] = sorted(c["target_modules"])  # peft writes a set: fix the order
    c.pop("auto_mapping", None)  # names this script's import path of the base class; not part of the release
    _write_json(cfgp, c)
    (folder / "README.md").unlink(missing_ok=True)


def _d2f_wrapper(cls, model, tokenizer, *, mask_id, max_new_tokens, block_size, block_add_threshold,
                 decoded_token_threshold, skip_threshold, max_length):
    """The lm-eval wrapper object without its __init__ (which needs accelerate and a hub load):
    exactly the attributes `_generate_block_single` reads, set to the wrapper's own meanings."""
    import torch

    w = cls.__new__(cls)
    w.model, w.tokenizer = model, tokenizer
    w._device = torch.device("cpu")
    w.mask_token_id, w.block_size = mask_id, block_size
    w.block_add_threshold, w.decoded_token_threshold, w.skip_threshold = (
        block_add_threshold, decoded_token_threshold, skip_threshold)
    w.max_new_tokens, w.max_length = max_new_tokens, max_length
    w.temperature, w.top_p, w.top_k = 0.0, None, None
    w.sampling_strategy = "default"
    w.target_dtype = torch.float32
    return w


class _RecordingTokenizer:
    """Delegates to the real tokenizer and keeps the last id list passed to decode (D2F's Dream loop
    returns decoded text; this recovers the ids it decoded)."""

    def __init__(self, tok):
        self._tok, self.last = tok, None

    def decode(self, ids, *a, **k):
        self.last = list(ids)
        return self._tok.decode(ids, *a, **k)

    def __getattr__(self, n):
        return getattr(self._tok, n)


def stage_d2f(a) -> None:
    import torch
    from peft import PeftModel

    _stub_lm_eval()
    sys.path.insert(0, str(Path(a.d2f) / "D2F-eval"))
    from model_cache.dream.model_dream import DreamModel
    from model_cache.llada.configuration_llada import LLaDAConfig
    from model_cache.llada.modeling_llada import LLaDAModelLM

    root, res = Path(a.out), {}
    knob_sets = [dict(block_size=4, block_add_threshold=0.5, decoded_token_threshold=0.9, skip_threshold=0.9),
                 dict(block_size=8, block_add_threshold=0.1, decoded_token_threshold=0.5, skip_threshold=0.6),
                 dict(block_size=4, block_add_threshold=1.0, decoded_token_threshold=1.0, skip_threshold=1.0)]
    for fam in ["llada", "dream"]:
        base_dir = root / ("llada" if fam == "llada" else "dream_base")
        ad_dir = root / f"d2f_{fam}"
        if fam == "llada":
            def load():
                return LLaDAModelLM.from_pretrained(str(base_dir), config=LLaDAConfig.from_pretrained(str(base_dir)),
                                                    torch_dtype=torch.float32).eval()
            targets, hub = ["q_proj", "v_proj", "k_proj", "attn_out"], "GSAI-ML/LLaDA-8B-Instruct"
        else:
            def load():
                return DreamModel.from_pretrained(str(base_dir), torch_dtype=torch.float32).eval()
            targets, hub = ["q_proj", "v_proj", "k_proj", "o_proj"], "Dream-org/Dream-v0-Base-7B"
        _make_adapter(load(), ad_dir, targets, hub, SEED + (21 if fam == "llada" else 22))
        cfg = json.loads((base_dir / "config.json").read_text())
        mask = cfg["mask_token_id"]
        base_ref = json.loads((Path(a.tmp) / ("llada.json" if fam == "llada" else "dream.json")).read_text())
        batch = base_ref["logits_input_ids"] if fam == "llada" else base_ref["dream_base"]["logits_input_ids"]
        base_model = load()
        with torch.no_grad():
            base_logits = base_model(torch.tensor(batch)).logits
        pm = PeftModel.from_pretrained(load(), str(ad_dir)).eval()  # as D2F-eval's _create_model_and_tokenizer
        with torch.no_grad():
            unmerged = pm(torch.tensor(batch)).logits
            merged_model = PeftModel.from_pretrained(load(), str(ad_dir)).merge_and_unload().eval()
            merged = merged_model(torch.tensor(batch)).logits
        # The D2F block loop, as run by the authors' eval wrapper.
        if fam == "llada":
            ev = _load_path("d2f_eval_llada", Path(a.d2f) / "D2F-eval/eval_llada.py")
            from transformers import PreTrainedTokenizerFast
            tok = PreTrainedTokenizerFast(tokenizer_file=str(base_dir / "tokenizer.json"))
            wcls = ev.DreamLoRA
            prompts = _prompt_ids(_fast_encode(base_dir), [_token_id(base_dir, "<|startoftext|>")])
        else:
            ev = _load_path("d2f_eval_dream", Path(a.d2f) / "D2F-eval/eval_dream.py")
            tok = _RecordingTokenizer(_dream_tokenizer(a, base_dir))
            wcls = ev.DreamLoRA
            prompts = [tok.encode(s, add_special_tokens=False) for s in PROMPTS]
        gens = []
        for p in prompts:
            for ks in knob_sets:
                for gl in [16, 32]:
                    w = _d2f_wrapper(wcls, pm, tok, mask_id=mask, max_new_tokens=gl, max_length=len(p) + gl + 64, **ks)
                    out = w._generate_block_single(torch.tensor([p]))
                    if fam == "dream":
                        out = tok.last
                    kw = {**ks, "max_new_tokens": gl, "mask_token_id": mask, "temperature": 0.0, "top_p": None,
                          "top_k": None, "sampling_strategy": "default"}
                    gens.append(_gen(f"d2f.{wcls.__name__}._generate_block_single({'eval_llada' if fam == 'llada' else 'eval_dream'}.py)",
                                     kw, p, list(out)))
        _save_logits(ad_dir, {"logits": unmerged, "logits_merged": merged, "logits_base": base_logits})
        from safetensors.torch import load_file
        base_file = base_dir / "reference.safetensors"
        res[fam] = {"logits_input_ids": batch, "generations": gens,
                    "d2f_modeling_vs_base_reference_max_abs": float((base_logits - load_file(str(base_file))["logits"]).abs().max()),
                    "max_abs_merged_minus_unmerged": float((merged - unmerged).abs().max()),
                    "max_abs_adapter_effect": float((unmerged - base_logits).abs().max())}
    _dump(Path(a.tmp) / "d2f.json", res)


# --------------------------------------------------------------------------------------------
# Stage "llama3": transformers' LlamaForCausalLM greedy generate (py446).
# --------------------------------------------------------------------------------------------

def stage_llama3(a) -> None:
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    folder = Path(a.out) / "llama3"
    model = LlamaForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    batch = _logit_batch(BPE_SIZE, None, SEED + 14)
    with torch.no_grad():
        logits = model(torch.tensor(batch)).logits
    cfg = json.loads((folder / "config.json").read_text())
    prompts = _prompt_ids(_fast_encode(folder), [cfg["bos_token_id"]])
    gc = GenerationConfig.from_pretrained(str(folder))
    gens = []
    for p in prompts:
        kw = {"max_new_tokens": 24, "do_sample": False, "eos_token_id": gc.eos_token_id}
        out = model.generate(torch.tensor([p]), **kw, pad_token_id=gc.eos_token_id[0])
        gens.append(_gen("transformers.LlamaForCausalLM.generate", kw, p, out[0, len(p):].tolist()))
    _save_logits(folder, {"logits": logits})
    _dump(Path(a.tmp) / "llama3.json", {"logits_input_ids": batch, "generations": gens})


# --------------------------------------------------------------------------------------------
# Stage "qwen3": transformers' Qwen3ForCausalLM greedy generate (py452, or any transformers >= 4.51).
# --------------------------------------------------------------------------------------------

def stage_qwen3(a) -> None:
    import torch
    import transformers
    from transformers import AutoTokenizer, GenerationConfig, Qwen3ForCausalLM

    folder = Path(a.out) / "qwen3"
    model = Qwen3ForCausalLM.from_pretrained(str(folder)).float().eval()
    batch = _logit_batch(_base_size(folder), None, SEED + 16)
    with torch.no_grad():
        logits = model(torch.tensor(batch)).logits
    tok = AutoTokenizer.from_pretrained(str(folder), use_fast=False)
    gc = GenerationConfig.from_pretrained(str(folder))
    gens = []
    for p in [tok.encode(s, add_special_tokens=False) for s in PROMPTS]:
        kw = {"max_new_tokens": 24, "do_sample": False, "eos_token_id": gc.eos_token_id}
        out = model.generate(torch.tensor([p]), **kw, pad_token_id=gc.pad_token_id)
        gens.append(_gen("transformers.Qwen3ForCausalLM.generate", kw, p, out[0, len(p):].tolist()))
    _save_logits(folder, {"logits": logits})
    _dump(Path(a.tmp) / "qwen3.json", {"logits_input_ids": batch, "generations": gens,
                                       "transformers": transformers.__version__})


def qwen3_reference(tmp: Path, facts: dict) -> dict:
    q3 = json.loads((tmp / "qwen3.json").read_text())
    return {"upstream": [{"repo": "huggingface/transformers", "commit": f"v{q3['transformers']}",
                          "files": ["Qwen3ForCausalLM.generate (greedy)"]}],
            "logits": {"input_ids": q3["logits_input_ids"], "file": "reference.safetensors", "key": "logits",
                       "model": f"transformers {q3['transformers']} Qwen3ForCausalLM, float32"},
            "generations": q3["generations"], "facts": facts["qwen3"]}


# --------------------------------------------------------------------------------------------
# Stage "refusion": ReFusion's qwen3 file + generate_refusion (py452).
# --------------------------------------------------------------------------------------------

def stage_refusion(a) -> None:
    import torch

    torch.manual_seed(SEED)
    sys.path.insert(0, str(Path(a.refusion)))
    gen_mod = _load_path("refusion_generate", Path(a.refusion) / "generate.py")
    Qwen3ForCausalLM = gen_mod.Qwen3ForCausalLM
    from transformers import AutoTokenizer

    folder = Path(a.out) / "refusion"
    cfg = json.loads((folder / "config.json").read_text())
    mask = cfg["mask_token_id"]
    model = Qwen3ForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32,
                                             attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(str(folder), use_fast=False)
    batch = _logit_batch(_base_size(folder), mask, SEED + 15)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(batch)).logits
    prompts = [tok.encode(s, add_special_tokens=False) for s in PROMPTS]
    gens = []
    for p in prompts:
        for gl, slot, serial, st, tt in [(16, 4, 2, 0.9, 0.9), (32, 4, 4, 0.6, 0.3), (32, 8, 1, 0.6, 0.3),
                                         (16, 4, 1, 0.2, 0.1), (24, 8, 3, 0.9, 0.5)]:
            kw = {"gen_length": gl, "temperature": 0.0, "mask_id": mask, "slot_size": slot,
                  "serial_num_blocks": serial, "slot_threshold": st, "token_threshold": tt}
            out, tpf = gen_mod.generate_refusion(model, tok, torch.tensor([p]), **kw)
            gens.append(_gen("refusion.generate_refusion", kw, p, out[0, len(p):].tolist(), tpf=float(tpf)))
    _save_logits(folder, {"logits": logits})
    _dump(Path(a.tmp) / "refusion.json", {"logits_input_ids": batch, "generations": gens})


# --------------------------------------------------------------------------------------------
# DiffusionGemma (google/diffusiongemma-26B-A4B-it's layout), stock transformers >= 5.24 only:
# the folder as DiffusionGemmaForBlockDiffusion.save_pretrained writes it (sharded like the release),
# and reference generations from transformers' own DiffusionGemmaGenerationMixin.generate, seed for seed.
# --------------------------------------------------------------------------------------------

DG_ADDED = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
            "<image_soft_token>", "<end_of_image>"]
# Gemma's turn format (bos, then <start_of_turn>role ... <end_of_turn>, the model turn opened by the
# generation prompt); the release's own template file is not available offline (release_facts.json).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
DG_CANVAS = 16  # canvas (block) length of the fixture: 2 canvases for the tests' 32-token budget
DG_EMBED_STD = 0.25  # tied embedding / output layer: entropies from ~0 to a few nats, so every knob matters
# 24 chat prompts for the reference generations (tokenized with the fixture's chat template).
DG_QUERIES = [
    "the cat sat on", "one two three", "def add(a, b):", "what is 12 plus 30?", "the dog ran to the park",
    "four five six seven", "Lily can run 12 kilometers", "a slot of tokens", "return a + b", "Question: what is 2?",
    "eight nine ten", "the mat and the dog", "decoded in parallel", "then verified", "per hour for 4 hours",
    "Answer: 42.", "the park", "one", "def", "seven eight", "the cat and the dog sat on the mat",
    "Question: what is 12 plus 30? Answer:", "run to the park and sat", "tokens are verified in parallel",
]
# Knob settings of the reference generations: transformers' defaults (bar the step cap, which only bounds
# a canvas that never becomes stable), a bold entropy bound with a flat schedule, a cautious one with a
# longer stability window.
DG_SETTINGS = [
    {"max_denoising_steps": 16},
    {"max_denoising_steps": 12, "entropy_bound": 1.0, "t_min": 0.2, "t_max": 0.5, "confidence_threshold": 0.05},
    {"max_denoising_steps": 24, "entropy_bound": 0.02, "stability_threshold": 2, "confidence_threshold": 0.01},
]
DG_GEN_LENGTH = 32
DG_SEED = 17


def dg_generate_kwargs(setting: dict) -> dict:
    """A setting (decoder knob names) -> kwargs of DiffusionGemmaForBlockDiffusion.generate."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    kw = {k: v for k, v in setting.items() if k != "entropy_bound"}
    if "entropy_bound" in setting:
        kw["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=float(setting["entropy_bound"]))
    return kw


def build_diffusiongemma(root: Path) -> None:
    """google/diffusiongemma-26B-A4B-it's layout: DiffusionGemmaConfig (text_config with MoE and sliding /
    full layers, a vision_config), weights under DiffusionGemmaForBlockDiffusion's own names in shards with
    an index, generation_config.json, a fast tokenizer with Gemma's special tokens and chat template."""
    import torch
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    d = root / "diffusiongemma"
    d.mkdir(parents=True, exist_ok=True)
    n, ids = _fast_tokenizer(d, DG_ADDED)
    vocab = _round_up(n, 64)
    text = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                num_global_key_value_heads=1, sliding_window=32, num_experts=4, top_k_experts=2,
                moe_intermediate_size=32, layer_types=["sliding_attention", "full_attention"],
                max_position_embeddings=4096, pad_token_id=ids["<pad>"], eos_token_id=ids["<eos>"],
                bos_token_id=ids["<bos>"])
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8, patch_size=4,
                  position_embedding_size=64)
    cfg = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=DG_CANVAS,
                               image_token_id=ids["<image_soft_token>"], boi_token_id=ids["<start_of_image>"],
                               eoi_token_id=ids["<end_of_image>"])
    torch.manual_seed(SEED + 20)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    with torch.no_grad():
        emb = model.model.decoder.embed_tokens.weight
        emb.normal_(0.0, DG_EMBED_STD)
        emb[n:] = 0.0  # rows past the tokenizer (padding of the embedding, as released) are never predicted
    model.generation_config.bos_token_id = ids["<bos>"]
    model.generation_config.pad_token_id = ids["<pad>"]
    model.generation_config.eos_token_id = [ids["<eos>"], ids["<end_of_turn>"]]
    model.to(torch.bfloat16).save_pretrained(str(d), max_shard_size="200KB")
    special = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "mask_token": "<mask>"}
    _write_json(d / "tokenizer_config.json", {
        "added_tokens_decoder": _added_decoder(DG_ADDED, ids[DG_ADDED[0]]), **special,
        "chat_template": GEMMA_TEMPLATE, "clean_up_tokenization_spaces": False, "padding_side": "left",
        "model_max_length": 1000000000000000019884624838656,
        # the release names GemmaTokenizer (a SentencePiece-derived BPE): the fixture's byte-level BPE loads as the
        # generic fast class, as llama3/ does
        "tokenizer_class": "PreTrainedTokenizerFast"})
    _write_json(d / "special_tokens_map.json", special)


def stage_diffusiongemma(a) -> None:
    """Reference generations: transformers' generate, one prompt at a time, torch.manual_seed(DG_SEED) before each."""
    import torch
    import transformers
    from transformers import AutoTokenizer, DiffusionGemmaForBlockDiffusion

    folder = Path(a.out) / "diffusiongemma"
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(folder), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(folder))
    gens = []
    for setting in DG_SETTINGS:
        for q in DG_QUERIES:
            p = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
            torch.manual_seed(DG_SEED)
            kw = {"max_new_tokens": DG_GEN_LENGTH, **setting}
            out = model.generate(torch.tensor([p]), **dg_generate_kwargs(kw))
            gens.append(_gen("transformers.DiffusionGemmaForBlockDiffusion.generate", kw, p,
                             out.sequences[0, len(p):].tolist(), seed=DG_SEED,
                             tokens_per_forward=float(out.tokens_per_forward[0])))
    _dump(Path(a.tmp) / "diffusiongemma.json", {"generations": gens, "transformers": transformers.__version__})


def diffusiongemma_reference(tmp: Path, facts: dict) -> dict:
    dg = json.loads((tmp / "diffusiongemma.json").read_text())
    return {"upstream": [{"repo": "huggingface/transformers", "commit": f"v{dg['transformers']}",
                          "files": ["src/transformers/models/diffusion_gemma/generation_diffusion_gemma.py "
                                    "(DiffusionGemmaGenerationMixin.generate)"]}],
            "generations": dg["generations"], "facts": facts["diffusiongemma"],
            "prompt_texts": {"texts": DG_QUERIES, "encode": "tokenizer.apply_chat_template([{'role': 'user', "
                             "'content': text}], add_generation_prompt=True)"},
            "seeding": "torch.manual_seed(seed) before each generate call; batch 1; CPU; float32 (weights "
                       "stored bfloat16)"}


# --------------------------------------------------------------------------------------------
# Driver: run stages, then write reference.json per folder.
# --------------------------------------------------------------------------------------------

FACTS_FILE = Path(__file__).with_name("release_facts.json")


def write_references(a) -> None:
    root, tmp = Path(a.out), Path(a.tmp)
    facts = json.loads(FACTS_FILE.read_text())
    load = lambda n: json.loads((tmp / n).read_text())  # noqa: E731
    llada, dream, d2f, rf, l3 = (load(n) for n in ["llada.json", "dream.json", "d2f.json", "refusion.json", "llama3.json"])

    def up(*keys_files):
        return [{"repo": UPSTREAM[k][0], "commit": UPSTREAM[k][1], "files": f} for k, f in keys_files]

    refs = {
        "llada": {"upstream": up(("llada", ["generate.py"]), ("fastdllm", ["llada/generate.py", "llada/model/modeling_llada.py"])),
                  "logits": {"input_ids": llada["logits_input_ids"], "file": "reference.safetensors", "key": "logits",
                             "model": "Fast-dLLM llada/model/modeling_llada.py LLaDAModelLM, float32, no attention mask"},
                  "generations": llada["generations"], "facts": facts["llada"]},
        "refusion": {"upstream": up(("refusion", ["generate.py", "qwen3/modeling_qwen3_refusion.py"])),
                     "logits": {"input_ids": rf["logits_input_ids"], "file": "reference.safetensors", "key": "logits",
                                "model": "ReFusion qwen3/modeling_qwen3_refusion.py Qwen3ForCausalLM (sdpa), float32, causal"},
                     "generations": rf["generations"], "facts": facts["refusion"]},
        "llama3": {"upstream": [{"repo": "huggingface/transformers", "commit": "v4.46.3",
                                 "files": ["LlamaForCausalLM.generate (greedy)"]}],
                   "logits": {"input_ids": l3["logits_input_ids"], "file": "reference.safetensors", "key": "logits",
                              "model": "transformers 4.46.3 LlamaForCausalLM, float32"},
                   "generations": l3["generations"], "facts": facts["llama3"]},
        "qwen3": qwen3_reference(tmp, facts),
    }
    for name in ["dream_instruct", "dream_base"]:
        refs[name] = {
            "upstream": up(("d2f", ["D2F-eval/model_cache/dream/generation_utils.py"]),
                           ("fastdllm", ["dream/model/modeling_dream.py", "dream/model/generation_utils_block.py",
                                         "dream/model/tokenization_dream.py"])),
            "logits": {"input_ids": dream[name]["logits_input_ids"], "file": "reference.safetensors", "key": "logits",
                       "model": "Dream modeling_dream.py DreamModel (Fast-dLLM's copy, no cache), float32, attention 'full'; "
                                "logits are NOT shifted (position i-1 predicts token i)"},
            "generations": dream[name]["generations"], "facts": facts["dream"]}
    for fam, base in [("llada", "llada"), ("dream", "dream_base")]:
        r = d2f[fam]
        refs[f"d2f_{fam}"] = {
            "upstream": up(("d2f", ["D2F-eval/eval_llada.py" if fam == "llada" else "D2F-eval/eval_dream.py",
                                    "D2F-train/utils/model.py", f"D2F-eval/model_cache/{fam}/"])),
            "base": f"../{base}",
            "logits": {"input_ids": r["logits_input_ids"], "file": "reference.safetensors",
                       "key": "logits", "key_merged": "logits_merged", "key_base": "logits_base",
                       "model": "peft PeftModel.from_pretrained(base, adapter) forward (unmerged); logits_merged after "
                                "merge_and_unload(); logits_base without the adapter",
                       "max_abs_merged_minus_unmerged": r["max_abs_merged_minus_unmerged"],
                       "max_abs_adapter_effect": r["max_abs_adapter_effect"]},
            "generations": r["generations"], "facts": facts[f"d2f_{fam}"]}
    # Every generation's prompt_ids = prefix + the tokenizer's encoding of one of these texts.
    prefix = {"llada": ["<|startoftext|>"], "d2f_llada": ["<|startoftext|>"], "llama3": ["<|begin_of_text|>"]}
    for name, ref in refs.items():
        _write_reference(root, name, ref, prefix.get(name, []))


def _write_reference(root: Path, name: str, ref: dict, prefix: list[str]) -> None:
    ref["prompt_texts"] = {"texts": PROMPTS, "prefix_tokens": prefix,
                           "encode": "tokenizer.encode(text, add_special_tokens=False)"}
    _write_json(root / name / "reference.json", ref)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llada"), p.add_argument("--fastdllm"), p.add_argument("--d2f"), p.add_argument("--refusion")
    p.add_argument("--py446"), p.add_argument("--py452")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests/fixtures/released"))
    p.add_argument("--tmp", default="/tmp/release-fixtures-work")
    p.add_argument("--stage", help="internal: run one stage in this interpreter")
    p.add_argument("--only-qwen3", action="store_true",
                   help="(re)make qwen3/ alone in this interpreter (transformers >= 4.51; no upstream checkout needed)")
    p.add_argument("--only-diffusiongemma", action="store_true",
                   help="(re)make diffusiongemma/ alone in this interpreter (transformers >= 5.24; no upstream checkout)")
    a = p.parse_args()
    if a.stage:
        globals()[f"stage_{a.stage}"](a)
        return 0
    if a.only_qwen3:
        Path(a.tmp).mkdir(parents=True, exist_ok=True)
        build_qwen3(Path(a.out))
        stage_qwen3(a)
        _write_reference(Path(a.out), "qwen3", qwen3_reference(Path(a.tmp), json.loads(FACTS_FILE.read_text())), [])
        return 0
    if a.only_diffusiongemma:
        Path(a.tmp).mkdir(parents=True, exist_ok=True)
        build_diffusiongemma(Path(a.out))
        stage_diffusiongemma(a)
        ref = diffusiongemma_reference(Path(a.tmp), json.loads(FACTS_FILE.read_text()))
        _write_json(Path(a.out) / "diffusiongemma" / "reference.json", ref)
        return 0
    Path(a.tmp).mkdir(parents=True, exist_ok=True)
    common = ["--llada", a.llada, "--fastdllm", a.fastdllm, "--d2f", a.d2f, "--refusion", a.refusion,
              "--out", a.out, "--tmp", a.tmp]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    for stage, py in [("assets", a.py446), ("llada", a.py446), ("dream", a.py446),
                      ("d2f", a.py446), ("llama3", a.py446), ("refusion", a.py452), ("qwen3", a.py452)]:
        print(f"stage {stage} ...", flush=True)
        subprocess.run([py, __file__, "--stage", stage, *common], check=True, env=env, cwd="/tmp")
    write_references(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
