"""The decoders on the committed trained tiny checkpoints (checkpoints/tiny/{ar,refusion,mdm})."""

import sys
from pathlib import Path

import pytest
import torch

from refusion.decoding import DECODERS


pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny"
QUERY = "Ana has 85 apples. Ana uses 22 apples. Then Ana gives 45 apples to Lily. How many apples does Ana have now?"


def load(name):
    path = ROOT / name
    assert (path / "model.safetensors").is_file(), f"checkpoint {path} is missing (run `make train-tiny`)"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from refusion.tokenizer import encode_chat

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    return model, torch.tensor([encode_chat(tok, QUERY)])


def test_ar_checkpoint_equals_generate():
    model, ids = load("ar")
    eos = model.config.eos_token_id
    want = model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=eos,
                          pad_token_id=model.config.pad_token_id)[0, ids.shape[1]:]
    got, stats = DECODERS["ar"](model, ids, gen_length=40)
    assert torch.equal(got[0], want)  # batch 1: generate stops right after the EOS, as ar does
    assert stats["nfe"] == got[0].numel()


def test_refusion_checkpoint_cache_exact_and_no_cache_identical():
    model, ids = load("refusion")
    sys.path.insert(0, str(Path(__file__).parent))
    from test_decoding_refusion import fresh_cache  # the independent recomputation

    kinds = []

    def check(info):
        kinds.append(info["kind"])
        ref = fresh_cache(model, info)
        for mine, theirs in zip(info["cache"].layers, ref.layers):
            assert (mine.keys - theirs.keys).abs().max().item() <= 1e-4
            assert (mine.values - theirs.values).abs().max().item() <= 1e-4

    knobs = dict(gen_length=32, slot_size=4, serial_num_blocks=2, slot_threshold=0.6, token_threshold=0.3)
    a, sa = DECODERS["refusion"](model, ids, on_commit=check, **knobs)
    b, sb = DECODERS["refusion"](model, ids, no_cache=True, **knobs)
    assert torch.equal(a[0], b[0]) and sa["nfe"] == sb["nfe"] and kinds
    assert sa["generated_tokens"] == a[0].numel() and sa["tpf"] > 1.0  # trained: more than a token per forward


def test_mdm_checkpoint_llada_equals_fast_dllm_without_cache():
    model, ids = load("mdm")
    assert model.config.is_causal is False
    a, _ = DECODERS["llada"](model, ids, gen_length=32, steps=32, block_length=16)
    b, _ = DECODERS["fast_dllm"](model, ids, gen_length=32, block_length=16, threshold=2.0, cache="none")
    assert torch.equal(a[0], b[0])
