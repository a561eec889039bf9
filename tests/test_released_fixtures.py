"""The tiny checkpoints in the layouts of the released ones (tests/fixtures/released/, made by
scripts/make_release_fixtures.py from the authors' own code) are complete and self-consistent.

Checks that need only the fixtures and the pinned stack: size budget, every reference parses and
matches its logits file, configs keep the released keys and ids agree with the tokenizers, and the
tokenizers load without remote code. That the harness's loader and decoders reproduce the authors'
logits and tokens on them is tests/test_released_loading.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent / "fixtures" / "released"
BASES = ["llada", "dream_instruct", "dream_base", "refusion", "llama3", "qwen3"]
ADAPTERS = {"d2f_llada": "llada", "d2f_dream": "dream_base"}
DIFFUSION = {"llada", "dream_instruct", "dream_base", "refusion", "d2f_llada", "d2f_dream"}
# Layouts whose reference is transformers' own generate (no authors' logits): checked by their decoder's tests
# (tests/test_decoding_diffusion_gemma.py).
TRANSFORMERS_ONLY = ["diffusiongemma"]
# Layouts whose loading and decoding are tested by their own test file (tests/test_llada2.py).
OWN_TESTS = ["llada2"]
# Layouts checked by their decoder's tests against the authors' generate loop (tests/test_decoding_sdar.py).
DECODER_TESTED = ["sdar", "sdar_moe"]
BUDGET_BYTES = 4 * 1024 * 1024 + 512 * 1024  # sdar/ and sdar_moe/ (about 450 KB each), llada2/ (about 500 KB)

# The released names of each family, as config.json publishes them.
RELEASED = {
    "llada": {"model_type": "llada", "architectures": ["LLaDAModelLM"],
              "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                           "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
                           "AutoModel": "modeling_llada.LLaDAModelLM"}},
    "dream_instruct": {"model_type": "Dream", "architectures": ["DreamModel"],
                       "auto_map": {"AutoConfig": "configuration_dream.DreamConfig",
                                    "AutoModel": "modeling_dream.DreamModel"}},
    "refusion": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
    "llama3": {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
}
RELEASED["dream_base"] = RELEASED["dream_instruct"]
# (folder, special token that config.json's mask_token_id must name)
MASK_TOKEN = {"llada": "<|mdm_mask|>", "dream_instruct": "<|mask|>", "dream_base": "<|mask|>", "refusion": "<|mask|>"}

def _json(path: Path):
    return json.loads(path.read_text())


def _ref(name: str) -> dict:
    return _json(ROOT / name / "reference.json")


def _ref_tensors(name: str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(ROOT / name / "reference.safetensors"))


def _tokenizer(name: str):
    """The tokenizer as a loader without remote code can have it: Dream's tokenizer_config names the
    remote DreamTokenizer class, whose files are a Qwen2 byte-level BPE."""
    from transformers import AutoTokenizer, Qwen2Tokenizer

    if name.startswith("dream"):
        return Qwen2Tokenizer.from_pretrained(str(ROOT / name))
    return AutoTokenizer.from_pretrained(str(ROOT / name), trust_remote_code=False)


def test_fixtures_fit_the_size_budget():
    total = sum(p.stat().st_size for p in ROOT.rglob("*") if p.is_file())
    assert 0 < total <= BUDGET_BYTES, f"{total} bytes"
    assert sorted(p.name for p in ROOT.iterdir()) == sorted(BASES + list(ADAPTERS) + TRANSFORMERS_ONLY + OWN_TESTS +
                                                            DECODER_TESTED)


@pytest.mark.parametrize("name", BASES + list(ADAPTERS))
def test_reference_parses_and_matches_its_logits(name):
    import torch

    ref = _ref(name)
    for up in ref["upstream"]:
        assert up["repo"] and up["files"]
        if up["repo"] != "huggingface/transformers":
            assert re.fullmatch(r"[0-9a-f]{40}", up["commit"]), up
    ids = ref["logits"]["input_ids"]
    tensors = _ref_tensors(name)
    logits = tensors[ref["logits"]["key"]]
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert list(logits.shape[:2]) == [len(ids), len(ids[0])]
    cfg_dir = ROOT / ADAPTERS.get(name, name)
    cfg = _json(cfg_dir / "config.json")
    vocab = cfg.get("vocab_size") or cfg["embedding_size"]
    assert logits.shape[2] == vocab
    if name in DIFFUSION:
        assert any(cfg["mask_token_id"] in row for row in ids), "the logits batch holds mask tokens"
    assert ref["facts"] and ref["generations"]


@pytest.mark.parametrize("name", BASES + list(ADAPTERS))
def test_generations_are_complete_and_prompts_reencode(name):
    ref = _ref(name)
    cfg = _json(ROOT / ADAPTERS.get(name, name) / "config.json")
    tok = _tokenizer(ADAPTERS.get(name, name))
    texts, prefix = ref["prompt_texts"]["texts"], ref["prompt_texts"]["prefix_tokens"]
    expected_prompts = [tok.convert_tokens_to_ids(prefix) + tok.encode(t, add_special_tokens=False) for t in texts]
    eos = {tok.eos_token_id, cfg.get("eos_token_id")} - {None}
    for g in ref["generations"]:
        assert set(g) >= {"generator", "kwargs", "prompt_ids", "output_ids"}
        assert g["prompt_ids"] in expected_prompts, g["generator"]
        assert not eos & set(g["prompt_ids"]), "prompts hold no EOS"
        out = g["output_ids"]
        assert all(0 <= t < (cfg.get("vocab_size") or cfg["embedding_size"]) for t in out)
        if name in DIFFUSION:
            assert cfg["mask_token_id"] not in out, f"{g['generator']} left a mask"
        kw = g["kwargs"]
        want = kw.get("gen_length") or kw.get("max_new_tokens")
        if name == "refusion":
            slot = kw["slot_size"]
            want = want + (slot - want % slot) % slot
        stops_at_eos = name in ("refusion", "llama3", "qwen3")
        assert len(out) == want or (stops_at_eos and len(out) < want and out[-1] in eos), (g["generator"], len(out))


@pytest.mark.parametrize("name", BASES)
def test_config_keeps_the_released_layout(name):
    cfg = _json(ROOT / name / "config.json")
    for key, value in RELEASED[name].items():
        assert cfg[key] == value, key
    index = _json(ROOT / name / "model.safetensors.index.json")
    shards = set(index["weight_map"].values())
    assert all((ROOT / name / s).is_file() for s in shards) and len(shards) == 2
    from safetensors import safe_open

    names = set()
    for s in shards:
        with safe_open(str(ROOT / name / s), "pt") as f:
            names |= set(f.keys())
    assert names == set(index["weight_map"])
    if name == "llada":
        assert "model.transformer.ff_out.weight" in names and "model.transformer.blocks.0.attn_out.weight" in names
    if name.startswith("dream"):
        assert "model.layers.0.self_attn.q_proj.bias" in names
    if name == "refusion":
        assert "model.layers.0.self_attn.q_norm.weight" in names


@pytest.mark.parametrize("name", BASES)
def test_tokenizer_loads_without_remote_code_and_carries_the_special_tokens(name):
    tok = _tokenizer(name)
    cfg = _json(ROOT / name / "config.json")
    if name in MASK_TOKEN:
        assert tok.convert_tokens_to_ids(MASK_TOKEN[name]) == cfg["mask_token_id"]
    text = tok.apply_chat_template([{"role": "user", "content": "one two"}], add_generation_prompt=True, tokenize=False)
    gen = _json(ROOT / name / "generation_config.json") if (ROOT / name / "generation_config.json").exists() else {}
    if name in ("llada", "llama3"):
        assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n") and "<|eot_id|>" in text
        assert text.startswith(tok.bos_token)
    if name == "llada":
        assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == cfg["eos_token_id"]
    if name == "llama3":
        assert gen["eos_token_id"] == tok.convert_tokens_to_ids(["<|end_of_text|>", "<|eot_id|>"])
    if name.startswith("dream") or name in ("refusion", "qwen3"):
        assert text.endswith("<|im_start|>assistant\n") and "<|im_end|>" in text
    if name.startswith("dream"):
        assert tok.eos_token_id == cfg["eos_token_id"] and tok.bos_token == "<|beginoftext|>"
    if name == "qwen3":  # Qwen3-8B: no mask token, no auto_map, an embedding padded past the tokenizer
        assert type(tok).__name__ == "Qwen2Tokenizer" and tok.eos_token_id == cfg["eos_token_id"]
        assert "auto_map" not in cfg and "mask_token_id" not in cfg and cfg["vocab_size"] > len(tok)
        thinking_off = tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                               tokenize=False, enable_thinking=False)
        assert thinking_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    if name == "refusion":
        assert type(tok).__name__ == "Qwen2Tokenizer" and tok.eos_token_id == cfg["eos_token_id"]
        assert tok.convert_tokens_to_ids("<|beginoftext|>") == cfg["bos_token_id"]


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_adapter_config_and_weights(name):
    from safetensors.torch import load_file

    ac = _json(ROOT / name / "adapter_config.json")
    assert ac["peft_type"] == "LORA" and ac["r"] == 32 and ac["lora_alpha"] == 32
    want = {"q_proj", "k_proj", "v_proj", "attn_out" if name == "d2f_llada" else "o_proj"}
    assert set(ac["target_modules"]) == want
    assert ac["base_model_name_or_path"] == ("GSAI-ML/LLaDA-8B-Instruct" if name == "d2f_llada"
                                             else "Dream-org/Dream-v0-Base-7B")
    w = load_file(str(ROOT / name / "adapter_model.safetensors"))
    assert w and all(t.abs().sum() > 0 for k, t in w.items() if ".lora_B." in k)
    ref = _ref(name)["logits"]
    assert ref["max_abs_adapter_effect"] > 1.0, "the adapter changes the logits"
