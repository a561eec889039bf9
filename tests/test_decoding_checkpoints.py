"""The decoders on the committed trained tiny checkpoints (checkpoints/tiny/{ar,refusion,mdm,dream,d2f})."""

import pytest
import torch
from transformers import DynamicCache

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
        assert_cache_matches_fresh_forward(model, info)  # vs the independent recomputation

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


def test_dream_checkpoint_dream_equals_fast_dllm_shift_without_cache(tiny_checkpoint):
    model, ids = load(tiny_checkpoint("dream"))
    assert model.config.is_causal is False
    # the old rules' knob values: Dream's schedule at eps -> 0, the LLaDA rule on shifted logits
    a, _ = DECODERS["dream"](model, ids, gen_length=32, alg="maskgit_plus", transfer_schedule="limit")
    b, _ = DECODERS["fast_dllm"](model, ids, gen_length=32, block_length=32, threshold=2.0, cache="none", shift=True,
                                 commit_first=False)
    assert torch.equal(a[0], b[0])
    c, sc = DECODERS["fast_dllm"](model, ids, gen_length=32, block_length=32, threshold=0.9, shift=True)
    assert sc["tpf"] > 1.0  # trained: the dual-cache threshold decoder commits several tokens per forward


def test_d2f_checkpoint_cache_exact_and_no_cache_identical(tiny_checkpoint, assert_close):
    from refusion.objective import block_causal_mask

    model, ids = load(tiny_checkpoint("d2f"))
    n_prompt = ids.shape[1]

    def check(info):  # the cached KV of finished blocks == a fresh forward under the block-causal mask
        x = info["ids"]
        block = torch.cat([torch.zeros(n_prompt, dtype=torch.long), 1 + torch.arange(x.numel() - n_prompt) // 8])
        fresh = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=x[None], position_ids=torch.arange(x.numel())[None], cache=fresh, use_cache=True,
                  attention_mask=block_causal_mask(torch.ones(1, x.numel(), dtype=torch.bool), block[None]))
        for mine, theirs in zip(info["cache"].layers, fresh.layers):
            assert_close(mine.keys, theirs.keys)
            assert_close(mine.values, theirs.values)

    depth = []
    # The preset's thresholds (the trained model fills each block of 8 in one forward there), and one token a step
    # per fully active block with blocks activated at half their predecessor, so that blocks overlap in the pipeline.
    for skip, ready in ((0.9, 0.95), (1.0, 0.5)):
        knobs = dict(gen_length=32, block_size=8, skip_threshold=skip, decoded_token_threshold=ready)
        a, sa = DECODERS["d2f"](model, ids, **knobs, on_cache=check)
        b, sb = DECODERS["d2f"](model, ids, **knobs, no_cache=True)
        assert torch.equal(a[0], b[0]) and sa["nfe"] == sb["nfe"] and sa["tpf"] > 1.0
        depth.append(sa["pipeline_max"])
    assert max(depth) >= 2
