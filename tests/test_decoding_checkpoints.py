"""The decoders on the committed trained tiny checkpoints (checkpoints/tiny/{ar,refusion,mdm})."""

import pytest
import torch

from refusion.decoding import DECODERS


pytestmark = pytest.mark.usefixtures("one_thread")

QUERY = "Ana has 85 apples. Ana uses 22 apples. Then Ana gives 45 apples to Lily. How many apples does Ana have now?"


def load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from refusion.tokenizer import encode_chat

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    return model, torch.tensor([encode_chat(tok, QUERY)])


def test_ar_checkpoint_equals_generate(tiny_checkpoint):
    model, ids = load(tiny_checkpoint("ar"))
    eos = model.config.eos_token_id
    want = model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=eos,
                          pad_token_id=model.config.pad_token_id)[0, ids.shape[1]:]
    got, stats = DECODERS["ar"](model, ids, gen_length=40)
    assert torch.equal(got[0], want)  # batch 1: generate stops right after the EOS, as ar does
    assert stats["nfe"] == got[0].numel()


def test_refusion_checkpoint_cache_exact_and_no_cache_identical(tiny_checkpoint, assert_cache_matches_fresh_forward):
    model, ids = load(tiny_checkpoint("refusion"))
    kinds = []

    def check(info):
        kinds.append(info["kind"])
        assert_cache_matches_fresh_forward(model, info, atol=1e-4)  # vs the independent recomputation

    knobs = dict(gen_length=32, slot_size=4, serial_num_blocks=2, slot_threshold=0.6, token_threshold=0.3)
    a, sa = DECODERS["refusion"](model, ids, on_commit=check, **knobs)
    b, sb = DECODERS["refusion"](model, ids, no_cache=True, **knobs)
    assert torch.equal(a[0], b[0]) and sa["nfe"] == sb["nfe"] and kinds
    assert sa["generated_tokens"] == a[0].numel() and sa["tpf"] > 1.0  # trained: more than a token per forward


def test_mdm_checkpoint_llada_equals_fast_dllm_without_cache(tiny_checkpoint):
    model, ids = load(tiny_checkpoint("mdm"))
    assert model.config.is_causal is False
    a, _ = DECODERS["llada"](model, ids, gen_length=32, steps=32, block_length=16)
    b, _ = DECODERS["fast_dllm"](model, ids, gen_length=32, block_length=16, threshold=2.0, cache="none")
    assert torch.equal(a[0], b[0])
