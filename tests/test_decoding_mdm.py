"""`llada` and `fast_dllm` on a bidirectional Qwen3 (config.is_causal=False): the convention
itself, llada one-token-per-step == fast_dllm threshold > 1 without cache, exact caches on a
single block, batched == one by one, exact NFE, EOS handling and knob errors.

Convention check (transformers 5.24): `config.is_causal = False` on a plain Qwen3Config makes
Qwen3ForCausalLM attend bidirectionally under both sdpa and eager, and the flag survives
save_pretrained / from_pretrained (config.json stores "is_causal": false). Nothing else needed.
"""

import copy

import pytest
import torch
from transformers import Qwen3ForCausalLM

from refusion.decoding import DECODERS


pytestmark = pytest.mark.usefixtures("one_thread")

MASK, EOS = 47, 2  # conftest's MDM_MASK, MDM_EOS: the ids of its tiny_mdm models


@pytest.fixture(scope="module")
def model(tiny_mdm):
    return tiny_mdm()


@pytest.fixture(scope="module")
def prompts(mdm_prompts):
    return mdm_prompts


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_is_causal_false_is_bidirectional_and_survives_save_load(tiny_mdm, impl, tmp_path, assert_close):
    model = tiny_mdm(1, impl)
    x = torch.randint(3, 47, (1, 10), generator=torch.Generator().manual_seed(1))
    y = x.clone()
    y[0, 8] = (y[0, 8] + 1) % 47
    with torch.no_grad():
        a, b = model(x).logits, model(y).logits
    assert (a[0, :8] - b[0, :8]).abs().max().item() > 1e-4  # a later token changes earlier logits
    model.save_pretrained(tmp_path)
    again = Qwen3ForCausalLM.from_pretrained(tmp_path, attn_implementation=impl).eval()
    assert again.config.is_causal is False
    with torch.no_grad():
        assert_close(again(x).logits, a)
    causal = copy.deepcopy(model.config)
    causal.is_causal = True
    with torch.no_grad():
        c = Qwen3ForCausalLM(causal).eval()
        c.load_state_dict(model.state_dict())
        assert (c(x).logits[0, :8] - c(y).logits[0, :8]).abs().max().item() == 0.0  # control: causal is not


def test_llada_one_token_per_step_equals_fast_dllm_no_cache(model, prompts):
    _, ids, _ = prompts()
    a, sa = DECODERS["llada"](model, ids, gen_length=16, steps=16, block_length=8, stop_at_eos=False)
    b, sb = DECODERS["fast_dllm"](model, ids, gen_length=16, block_length=8, threshold=1.5, cache="none",
                                  stop_at_eos=False)
    assert torch.equal(a[0], b[0]) and sa["nfe"] == sb["nfe"] == 16
    # with a mid-response EOS both stop after the block holding it, identically
    eos = int(a[0][5])
    a, sa = DECODERS["llada"](model, ids, gen_length=16, steps=16, block_length=8, eos_token_id=eos)
    b, sb = DECODERS["fast_dllm"](model, ids, gen_length=16, block_length=8, threshold=1.5, cache="none",
                                  eos_token_id=eos)
    assert torch.equal(a[0], b[0]) and int(a[0][-1]) == eos and sa["nfe"] == sb["nfe"] == 8


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_fast_dllm_cache_is_exact_for_a_one_layer_model(tiny_mdm, prompts, cache):
    # With one layer a token's K/V depend only on the token and its position, never on
    # what it attends to, so the block-wise caches (stale only through attention) must
    # reproduce the uncached run token for token -- a check of the cache plumbing:
    # positions, the 2-D mask in cache order, cropping between steps and blocks.
    model = tiny_mdm(3, layers=1)
    _, ids, mask = prompts((6, 3))
    for th in (1.5, 0.045):
        ref, sr = DECODERS["fast_dllm"](model, ids, attention_mask=mask, gen_length=12, block_length=4,
                                        threshold=th, cache="none", stop_at_eos=False)
        got, sg = DECODERS["fast_dllm"](model, ids, attention_mask=mask, gen_length=12, block_length=4,
                                        threshold=th, cache=cache, stop_at_eos=False)
        assert all(torch.equal(r, g) for r, g in zip(ref, got))
        assert sg["nfe_full"] == 3 and sg["nfe_cached"] == sr["nfe"] - 3 and sg["kv_peak_bytes"] > 0
    assert sr["nfe"] < 12  # the low threshold really decoded several tokens in some step


@pytest.mark.parametrize(
    "name,knobs",
    [("llada", dict(steps=8, block_length=8)), ("llada", dict(steps=16, block_length=4)),
     ("fast_dllm", dict(block_length=8, threshold=0.06, cache="none")),
     ("fast_dllm", dict(block_length=8, threshold=0.06, cache="prefix")),
     ("fast_dllm", dict(block_length=8, threshold=0.06, cache="dual"))],
)
def test_batched_equals_rows_one_by_one_and_nfe_is_exact(model, prompts, name, knobs):
    rows, ids, mask = prompts((6, 3, 5), seed=2)
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        batched, stats = DECODERS[name](model, ids, attention_mask=mask, gen_length=16, **knobs)
        assert stats["nfe"] == len(calls)
    finally:
        handle.remove()
    for got, row in zip(batched, rows):
        want, _ = DECODERS[name](model, row[None], gen_length=16, **knobs)
        assert torch.equal(got, want[0])
    assert stats["generated_tokens"] == sum(t.numel() for t in batched)


def test_random_remasking_is_seeded(model, prompts):
    _, ids, _ = prompts()
    knobs = dict(gen_length=16, steps=8, block_length=8, remasking="random")
    a, _ = DECODERS["llada"](model, ids, seed=1, **knobs)
    b, _ = DECODERS["llada"](model, ids, seed=1, **knobs)
    c, _ = DECODERS["llada"](model, ids, seed=2, **knobs)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    knobs = dict(gen_length=16, block_length=8, threshold=0.05, cache="dual", temperature=1.0)
    a, _ = DECODERS["fast_dllm"](model, ids, seed=1, **knobs)
    b, _ = DECODERS["fast_dllm"](model, ids, seed=1, **knobs)
    c, _ = DECODERS["fast_dllm"](model, ids, seed=2, **knobs)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])


def test_stop_at_eos_only_saves_work(model, prompts):
    _, ids, _ = prompts()
    free, _ = DECODERS["llada"](model, ids, gen_length=16, steps=16, block_length=4, stop_at_eos=False)
    eos = int(free[0][2])
    a, sa = DECODERS["llada"](model, ids, gen_length=16, steps=16, block_length=4, eos_token_id=eos)
    b, sb = DECODERS["llada"](model, ids, gen_length=16, steps=16, block_length=4, eos_token_id=eos,
                              stop_at_eos=False)
    assert torch.equal(a[0], b[0]) and sa["nfe"] < sb["nfe"]


@pytest.mark.parametrize(
    "name,knob,value",
    [("llada", "steps", 0), ("llada", "block_length", 5), ("llada", "gen_length", 0), ("llada", "steps", 3),
     ("llada", "remasking", "entropy"), ("fast_dllm", "threshold", -0.5), ("fast_dllm", "cache", "paged"),
     ("fast_dllm", "block_length", 0), ("llada", "temperature", -1.0)],
)
def test_invalid_knobs(model, name, knob, value):
    knobs = dict(gen_length=16, block_length=8)
    knobs[knob] = value
    with pytest.raises(ValueError, match=knob):
        DECODERS[name](model, torch.ones(1, 3, dtype=torch.long), **knobs)
