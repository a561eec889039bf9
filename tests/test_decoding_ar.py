"""`ar` decoder: equals model.generate greedy, batched == one by one, exact NFE, knobs."""

import pytest
import torch

from refusion.decoding import DECODERS, get_decoder


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_causal(tiny_qwen3):
    """`tiny_causal(seed=0)`: a random causal tiny Qwen3, vocab 96, EOS 3, pad 0."""
    return lambda seed=0: tiny_qwen3(vocab=96, seed=seed, eos=3, pad=0)


class CallCounter:
    """Counts real forward calls of a module with a pre-hook (independent of the decoder's own counter)."""

    def __init__(self, model):
        self.n = 0
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.n += 1


def test_ar_equals_generate_greedy_and_counts_forwards(tiny_causal):
    model = tiny_causal()
    prompt = torch.randint(4, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    ref = model.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=3, pad_token_id=0)[0, 9:]
    counter = CallCounter(model)
    tokens, stats = DECODERS["ar"](model, prompt, gen_length=24)
    assert torch.equal(tokens[0], ref)
    assert stats["nfe"] == counter.n == 24
    assert stats["nfe_prefill"] == 1 and stats["nfe_step"] == 23
    assert stats["generated_tokens"] == 24 and stats["tpf"] == pytest.approx(1.0)
    assert stats["kv_peak_bytes"] > 0

    # Make the 6th greedy token the EOS: decoding must stop right after it.
    eos = int(ref[5])
    first = int((ref == eos).nonzero()[0, 0])
    counter.n = 0
    tokens, stats = DECODERS["ar"](model, prompt, gen_length=24, eos_token_id=[eos, 95])
    assert torch.equal(tokens[0], ref[: first + 1])
    assert stats["generated_tokens"] == first + 1 == stats["nfe"] == counter.n
    ref_eos = model.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=0)[0, 9:]
    assert torch.equal(tokens[0], ref_eos[: first + 1])


def test_ar_batched_left_padded_equals_rows_one_by_one(tiny_causal, left_pad):
    model = tiny_causal(1)
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(4, 96, (n,), generator=g) for n in (5, 11, 8)]
    single = [DECODERS["ar"](model, r[None], gen_length=16)[0][0] for r in rows]
    # An EOS inside the row outputs: use the 4th token of row 1 so rows stop at different steps.
    eos = int(single[1][3])
    single = [DECODERS["ar"](model, r[None], gen_length=16, eos_token_id=eos)[0][0] for r in rows]
    ids, mask = left_pad(rows)
    tokens, stats = DECODERS["ar"](model, ids, attention_mask=mask, gen_length=16, eos_token_id=eos)
    for got, want in zip(tokens, single):
        assert torch.equal(got, want)
    assert any(t.numel() < 16 for t in tokens) and any(t.numel() == 16 for t in tokens)
    assert stats["generated_tokens"] == sum(t.numel() for t in single)


def test_ar_sampling_is_seeded(tiny_causal):
    model = tiny_causal(2)
    prompt = torch.randint(4, 96, (2, 6), generator=torch.Generator().manual_seed(3))
    a, _ = DECODERS["ar"](model, prompt, gen_length=12, temperature=1.0, seed=7)
    b, _ = DECODERS["ar"](model, prompt, gen_length=12, temperature=1.0, seed=7)
    c, _ = DECODERS["ar"](model, prompt, gen_length=12, temperature=1.0, seed=8)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("knob,value", [("gen_length", 0), ("temperature", -0.1), ("gen_length", 2.5)])
def test_ar_invalid_knobs(tiny_causal, knob, value):
    model = tiny_causal()
    with pytest.raises(ValueError, match=knob):
        DECODERS["ar"](model, torch.ones(1, 3, dtype=torch.long), **{knob: value})


def test_registry_unknown_name_lists_valid():
    with pytest.raises(ValueError, match="ar"):
        get_decoder("nope")
    assert get_decoder("ar") is DECODERS["ar"]
