"""`dream`, `fast_dllm` with `shift` (Fast-dLLM on Dream) and `d2f` on random tiny bidirectional
Qwen3 models: the logit shift itself, one-token-per-step settings reducing to the plain method,
Dream's step schedule, exact caches (a one-layer model for Fast-dLLM's approximate cache; D2F's
cached KV against a fresh block-causal forward, and its no-cache ablation), hand-counted NFE of
the D2F pipeline, batched rows == rows one by one, EOS handling and knob errors.
"""

import pytest
import torch
from transformers import DynamicCache

from refusion.decoding import DECODERS
from refusion.decoding.mdm import _top_p
from refusion.objective import block_causal_mask

MASK = 47  # conftest's MDM_MASK: the mask id of its tiny_mdm models

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tiny_mdm):
    return tiny_mdm()


@pytest.fixture(scope="module")
def prompts(mdm_prompts):
    return mdm_prompts


def counted(model):
    """Forward pre-hook recording every call's input_ids (works for positional and keyword calls)."""
    seen = []

    def hook(_mod, args, kwargs):
        seen.append((kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]).clone())

    return seen, model.register_forward_pre_hook(hook, with_kwargs=True)


def assert_batched_equals_rows(model, prompts, name, lengths=(6, 3, 5), **knobs):
    rows, ids, mask = prompts(lengths, seed=2)
    seen, handle = counted(model)
    try:
        batched, stats = DECODERS[name](model, ids, attention_mask=mask, **knobs)
    finally:
        handle.remove()
    assert stats["nfe"] == len(seen) and stats["generated_tokens"] == sum(t.numel() for t in batched)
    for got, row in zip(batched, rows):
        want, _ = DECODERS[name](model, row[None], **knobs)
        assert torch.equal(got, want[0])
    return stats


# ---------------------------------------------------------------- dream / fast_dllm shift


def test_dream_first_token_comes_from_the_prompts_last_logit(prompts, model):
    _, ids, _ = prompts()
    got, stats = DECODERS["dream"](model, ids, gen_length=1, alg="maskgit_plus", stop_at_eos=False)
    with torch.no_grad():
        logits = model(torch.cat([ids, torch.tensor([[MASK]])], 1)).logits
    assert int(got[0][0]) == int(logits[0, ids.shape[1] - 1].argmax()) and stats["nfe"] == 1


def test_dream_one_token_per_step_equals_fast_dllm_shift_without_cache(prompts, model):
    _, ids, _ = prompts()
    a, sa = DECODERS["dream"](model, ids, gen_length=16, alg="maskgit_plus", stop_at_eos=False)
    b, sb = DECODERS["fast_dllm"](model, ids, gen_length=16, block_length=16, threshold=1.5, cache="none",
                                  shift=True, stop_at_eos=False)
    assert torch.equal(a[0], b[0]) and sa["nfe"] == sb["nfe"] == 16
    # shift matters: the unshifted decoder reads other logits and gives other tokens
    c, _ = DECODERS["fast_dllm"](model, ids, gen_length=16, block_length=16, threshold=1.5, cache="none",
                                 stop_at_eos=False)
    assert not torch.equal(a[0], c[0])


@pytest.mark.parametrize("alg", ["maskgit_plus", "topk_margin", "entropy", "origin"])
def test_dream_schedule(prompts, model, alg):
    # m masks left before step i of `steps` -> m // (steps - i) unmasked: 16 over 5 steps is 3, 3, 3, 3, 4.
    _, ids, _ = prompts()
    seen, handle = counted(model)
    try:
        out, stats = DECODERS["dream"](model, ids, gen_length=16, steps=5, alg=alg, stop_at_eos=False, seed=3)
    finally:
        handle.remove()
    masks = [int((s == MASK).sum()) for s in seen]
    assert out[0].numel() <= 16 and MASK not in out[0].tolist()
    if alg == "origin":  # each mask goes w.p. 1 / (steps - i): random counts, all gone at the last step
        assert masks[0] == 16 and stats["nfe"] == len(masks) <= 5 and masks == sorted(masks, reverse=True)
    else:
        assert masks == [16, 13, 10, 7, 4] and stats["nfe"] == 5


@pytest.mark.parametrize("knobs", [dict(alg="maskgit_plus", steps=8), dict(alg="entropy", steps=16),
                                   dict(alg="topk_margin", steps=4)])
def test_dream_batched_equals_rows(prompts, model, knobs):
    assert_batched_equals_rows(model, prompts, "dream", gen_length=16, **knobs)


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_fast_dllm_shift_batched_equals_rows(prompts, model, cache):
    stats = assert_batched_equals_rows(model, prompts, "fast_dllm", gen_length=16, block_length=8, threshold=0.05,
                                       cache=cache, shift=True)
    assert stats["nfe"] < 16  # the threshold really unmasked several tokens in some step


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_fast_dllm_shift_cache_is_exact_for_a_one_layer_model(tiny_mdm, prompts, cache):
    # As in test_decoding_mdm: with one layer the block caches are stale only through nothing,
    # so they must reproduce the uncached run -- here with the window starting one position early.
    model = tiny_mdm(3, layers=1)
    _, ids, mask = prompts((6, 3))
    for th in (1.5, 0.045):
        ref, sr = DECODERS["fast_dllm"](model, ids, attention_mask=mask, gen_length=12, block_length=4,
                                        threshold=th, cache="none", shift=True, stop_at_eos=False)
        got, sg = DECODERS["fast_dllm"](model, ids, attention_mask=mask, gen_length=12, block_length=4,
                                        threshold=th, cache=cache, shift=True, stop_at_eos=False)
        assert all(torch.equal(r, g) for r, g in zip(ref, got))
        assert sg["nfe_full"] == 3 and sg["nfe_cached"] == sr["nfe"] - 3
    assert sr["nfe"] < 12


def test_dream_sampling_is_seeded_and_top_p_filters(tiny_mdm, prompts):
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    kept = _top_p(logits, 0.6) > torch.finfo(logits.dtype).min
    assert kept.tolist() == [[True, True, False]]  # 0.5 < 0.6: the token crossing top_p stays, the rest go
    model = tiny_mdm()
    _, ids, _ = prompts()
    knobs = dict(gen_length=16, steps=8, alg="maskgit_plus", temperature=1.0, top_p=0.9, alg_temp=0.5)
    a, _ = DECODERS["dream"](model, ids, seed=1, **knobs)
    b, _ = DECODERS["dream"](model, ids, seed=1, **knobs)
    c, _ = DECODERS["dream"](model, ids, seed=2, **knobs)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])


def test_dream_stop_at_eos_only_saves_work(prompts, model):
    # A run with no EOS (the mask id is never proposed) records when each position is decoded;
    # with an EOS value v the run must stop right after the step that decodes every position up
    # to v's first occurrence, and return the same tokens as the run that does all 16 steps.
    _, ids, _ = prompts()
    knobs = dict(gen_length=16, alg="maskgit_plus")
    seen, handle = counted(model)
    try:
        free, _ = DECODERS["dream"](model, ids, eos_token_id=MASK, stop_at_eos=False, **knobs)
    finally:
        handle.remove()
    free = free[0].tolist()
    done_at = [next(s for s, x in enumerate(seen[1:] + [None], 1) if x is None or int(x[0, 6 + p]) != MASK)
               for p in range(16)]  # step after which position p holds its token

    def cost(v):  # steps until every position up to v's first occurrence is decoded
        return max(done_at[: free.index(v) + 1])

    eos = min(free, key=cost)
    a, sa = DECODERS["dream"](model, ids, eos_token_id=eos, **knobs)
    b, sb = DECODERS["dream"](model, ids, eos_token_id=eos, stop_at_eos=False, **knobs)
    assert a[0].tolist() == b[0].tolist() == free[: free.index(eos) + 1]
    assert sa["nfe"] == cost(eos) < sb["nfe"] == 16


# ---------------------------------------------------------------- d2f


def blockwise_reference(model, prompt, gen_length, size, shift):
    """D2F with one block at a time and one token per step, written plainly: every step one full
    forward of prompt + blocks so far under the training objective's block-causal mask, no cache;
    unmask the current block's most probable masked token (never the mask id, as d2f)."""
    x = prompt.clone()
    for _ in range(gen_length // size):
        x = torch.cat([x, torch.full((size,), MASK)])
        lo = x.numel() - size
        block = torch.cat([torch.zeros(prompt.numel(), dtype=torch.long),
                           1 + torch.arange(x.numel() - prompt.numel()) // size])
        attn = block_causal_mask(torch.ones(1, x.numel(), dtype=torch.bool), block[None])
        for _ in range(size):
            with torch.no_grad():
                logits = model(input_ids=x[None], position_ids=torch.arange(x.numel())[None],
                               attention_mask=attn).logits[0]
            probs = logits[lo - int(shift):x.numel() - int(shift)].softmax(-1)
            tok = probs.index_fill(-1, torch.tensor([MASK]), -1.0).argmax(-1)
            conf = probs.gather(-1, tok[:, None])[:, 0]
            conf[x[lo:] != MASK] = -1.0
            j = int(conf.argmax())
            x[lo + j] = tok[j]
    return x[prompt.numel():]


@pytest.mark.parametrize("shift", [False, True])
def test_d2f_one_token_per_step_is_blockwise_decoding(prompts, model, shift):
    # eos_token_id=MASK: d2f never proposes the mask id, so no EOS cuts the pipeline short
    rows, _, _ = prompts((5,), seed=4)
    got, stats = DECODERS["d2f"](model, rows[0][None], gen_length=12, block_size=4, block_add_threshold=1.0,
                                 decoded_token_threshold=1.0, skip_threshold=1.5, shift=shift, eos_token_id=MASK,
                                 stop_at_eos=False)
    assert torch.equal(got[0], blockwise_reference(model, rows[0], 12, 4, shift))
    assert stats["nfe"] == 12 and stats["pipeline_max"] == 1


@pytest.mark.parametrize("add,act,skip,nfe,depth", [
    (0.0, 0.0, 1.5, 4 + 3 - 1, 3),  # every block fully active at once: a new block and a token per block per step
    (0.0, 1.0, 1.5, 12, 3),  # blocks join at once but stay semi-active (commit nothing) until the previous is done
    (0.0, 0.0, 0.0, 3, 1),  # every token passes: a block per step, each done the step it joins
])
def test_d2f_pipeline_nfe_by_hand(prompts, model, add, act, skip, nfe, depth):
    _, ids, _ = prompts()
    seen, handle = counted(model)
    try:
        out, stats = DECODERS["d2f"](model, ids, gen_length=12, block_size=4, block_add_threshold=add,
                                     decoded_token_threshold=act, skip_threshold=skip, eos_token_id=MASK,
                                     stop_at_eos=False)
    finally:
        handle.remove()
    assert stats["nfe"] == len(seen) == nfe and stats["pipeline_max"] == depth and out[0].numel() == 12
    if skip == 1.5 and act == 0.0:
        # every uncached token is forwarded: prompt + b1; b1 + b2; b1..b3 twice; b1 (cached by it) .. b3; b2 + b3
        assert [s.shape[1] for s in seen] == [6 + 4, 8, 12, 12, 12, 8]


@pytest.mark.parametrize("shift", [False, True])
def test_d2f_cached_kv_equals_a_fresh_block_causal_forward_and_no_cache_is_identical(prompts, model, shift,
                                                                                     assert_close):
    _, ids, mask = prompts((6, 3), seed=5)
    knobs = dict(gen_length=16, block_size=4, block_add_threshold=0.25, decoded_token_threshold=0.5,
                 skip_threshold=0.05, shift=shift, eos_token_id=MASK, stop_at_eos=False)  # every block
    checked = []

    def check(info):
        x = info["ids"]
        n_prompt = int(mask[info["row"]].sum())
        block = torch.cat([torch.zeros(n_prompt, dtype=torch.long), 1 + torch.arange(x.numel() - n_prompt) // 4])
        fresh = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=x[None], position_ids=torch.arange(x.numel())[None], cache=fresh, use_cache=True,
                  attention_mask=block_causal_mask(torch.ones(1, x.numel(), dtype=torch.bool), block[None]))
        for mine, theirs in zip(info["cache"].layers, fresh.layers):
            assert mine.keys.shape == theirs.keys.shape
            assert_close(mine.keys, theirs.keys)
            assert_close(mine.values, theirs.values)
        checked.append(x.numel())

    a, sa = DECODERS["d2f"](model, ids, attention_mask=mask, on_cache=check, **knobs)
    b, sb = DECODERS["d2f"](model, ids, attention_mask=mask, no_cache=True, **knobs)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and sa["nfe"] == sb["nfe"]
    assert sa["pipeline_max"] >= 2 and sa["kv_peak_bytes"] > 0 and sb["kv_peak_bytes"] == 0
    assert len(checked) >= 4 and sa["nfe"] < 16  # caches grew while later blocks were decoded; parallel commits


@pytest.mark.parametrize("shift,temperature", [(False, 0.0), (True, 0.0), (False, 1.0)])
def test_d2f_batched_equals_rows(prompts, model, shift, temperature):
    # sampling too: every row has its own seeded generator
    stats = assert_batched_equals_rows(model, prompts, "d2f", gen_length=16, block_size=4, block_add_threshold=0.5,
                                       decoded_token_threshold=0.75, skip_threshold=0.06, shift=shift,
                                       temperature=temperature, seed=5)
    assert stats["pipeline_max"] >= 2


def test_d2f_stop_at_eos_only_saves_work(prompts, model):
    # Every block fully active at once, a token per block per step: when the EOS of block 1 settles,
    # later blocks are still being decoded, and without stop_at_eos the row finishes them.
    _, ids, _ = prompts()
    knobs = dict(gen_length=16, block_size=4, block_add_threshold=0.0, decoded_token_threshold=0.0,
                 skip_threshold=1.5)
    free, _ = DECODERS["d2f"](model, ids, stop_at_eos=False, **knobs)
    eos = int(free[0][2])
    a, sa = DECODERS["d2f"](model, ids, eos_token_id=eos, **knobs)
    b, sb = DECODERS["d2f"](model, ids, eos_token_id=eos, stop_at_eos=False, **knobs)
    assert torch.equal(a[0], b[0]) and int(a[0][-1]) == eos and sa["nfe"] < sb["nfe"]


@pytest.mark.parametrize(
    "name,knob,value",
    [("dream", "steps", 0), ("dream", "steps", 17), ("dream", "alg", "random"), ("dream", "top_p", 1.5),
     ("dream", "alg_temp", -1.0), ("dream", "temperature", -0.1), ("fast_dllm", "shift", "yes"),
     ("d2f", "block_size", 5), ("d2f", "block_size", 0), ("d2f", "skip_threshold", -0.1),
     ("d2f", "block_add_threshold", 1.5), ("d2f", "decoded_token_threshold", -0.1), ("d2f", "no_cache", 1)],
)
def test_invalid_knobs(model, name, knob, value):
    knobs = dict(gen_length=16)
    knobs[knob] = value
    with pytest.raises(ValueError, match=knob):
        DECODERS[name](model, torch.ones(1, 3, dtype=torch.long), **knobs)
