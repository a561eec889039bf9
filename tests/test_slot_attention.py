"""Packed slot attention vs the per-slot replicated computation (op level and whole model)."""

import copy

import pytest
import torch
from transformers import DynamicCache

from refusion.decoding.common import additive_mask
from refusion.slot_attention import replicated_slot_attention, slot_attention, slot_visibility


pytestmark = pytest.mark.usefixtures("one_thread")


def test_visibility_pattern_by_hand():
    vis = slot_visibility(2, [2, 3])
    want = torch.tensor([
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 1, 0],
        [1, 1, 0, 0, 1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(vis, want)


@pytest.mark.parametrize("prefix_len,slot_lens", [(7, [4, 4, 4]), (0, [3, 5]), (11, [1]), (5, [2, 6, 1])])
def test_slot_attention_matches_replicated(prefix_len, slot_lens, assert_close):
    g = torch.Generator().manual_seed(0)
    n = sum(slot_lens)
    q = torch.randn(2, 4, n, 8, generator=g)
    k = torch.randn(2, 2, prefix_len + n, 8, generator=g)
    v = torch.randn(2, 2, prefix_len + n, 8, generator=g)
    ref = replicated_slot_attention(q, k, v, prefix_len, slot_lens)
    out = slot_attention(q, k, v, prefix_len, slot_lens)
    assert_close(out, ref)
    # The same pattern as an SDPA mask gives the same result (what the decoders run through the model).
    mask = additive_mask(slot_visibility(prefix_len, slot_lens), torch.float32)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask
    )
    assert_close(sdpa, ref)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_model_forward_matches_per_slot_cache_copies(tiny_qwen3, impl, assert_close):
    model = tiny_qwen3(vocab=80, seed=0, max_positions=128, impl=impl)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 80, (1, 9), generator=g)
    slot_len, starts = 4, [13, 21, 9]  # true positions of 3 slots, out of order with gaps
    slots = torch.randint(0, 80, (3, slot_len), generator=g)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(prompt, cache=cache, use_cache=True)
        # Per-slot: a copy of the prefix cache for each slot, plain causal forward at true positions.
        ref = []
        for s, p0 in zip(slots, starts):
            own = copy.deepcopy(cache)
            pos = torch.arange(p0, p0 + slot_len)[None]
            vis = slot_visibility(9, [slot_len])
            ref.append(model(s[None], position_ids=pos, attention_mask=additive_mask(vis, torch.float32),
                             cache=own, use_cache=True).logits[0])
        ref = torch.cat(ref)
        # Packed: one forward, one read of the shared prefix.
        pos = torch.cat([torch.arange(p0, p0 + slot_len) for p0 in starts])[None]
        vis = slot_visibility(9, [slot_len] * 3)
        packed = model(slots.flatten()[None], position_ids=pos, attention_mask=additive_mask(vis, torch.float32),
                       cache=cache, use_cache=True).logits[0]
    assert_close(packed, ref)
