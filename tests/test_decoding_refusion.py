"""`refusion` decoder (docs/design.md §3): cache exactness after every commit, output = committed
tokens by position, the zero-threshold single-plan identity, no_cache == default, exact
NFE, ablation modes and knob errors.

Random tiny models are near-uniform, so the thresholds below were chosen for this seeded
model (initializer_range 0.1, vocab 48) to exercise both the global-verify commit and the
parallel infill of several slots; every test asserts from the counters that the path it
is about really ran.
"""

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config

from refusion.decoding import DECODERS
from refusion.decoding.refusion import infill_seeds


pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = torch.randint(3, 47, (1, 6), generator=torch.Generator().manual_seed(0))
# (knobs, expected paths) -- the mix of paths each config takes on the seeded model.
MIXED = dict(gen_length=24, slot_size=4, serial_num_blocks=2, slot_threshold=0.05, token_threshold=0.03)
WIDE = dict(gen_length=24, slot_size=4, serial_num_blocks=1, slot_threshold=0.05, token_threshold=0.02)


@pytest.fixture(scope="module")
def model(tiny_qwen3):
    return tiny_qwen3(vocab=48, eos=2, pad=0, mask=47, init_range=0.1)


@pytest.fixture(scope="module")
def run_checked(assert_cache_matches_fresh_forward):
    """`run_checked(model, **knobs) -> (tokens, stats, kinds, last_info)`: decode with an on_commit hook
    that compares the cache to a fresh forward after every commit."""

    def run(model, **knobs):
        kinds, last = [], {}

        def check(info):
            kinds.append(info["kind"])
            last.update(info)
            assert_cache_matches_fresh_forward(model, info)

        tokens, stats = DECODERS["refusion"](model, PROMPT, on_commit=check, **knobs)
        return tokens[0], stats, kinds, last

    return run


def sorted_committed(info, prompt_len, eos):
    pairs = sorted(zip(info["pos"][prompt_len:], info["ids"][prompt_len:]))
    out = []
    for _, t in pairs:
        out.append(t)
        if t in eos:
            break
    return torch.tensor(out)


SETTINGS = [{}, {"infill_seed": "first"}, {"kv_layout": "replicated"}]
SETTING_IDS = ["global", "first", "replicated"]


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("knobs", [MIXED, WIDE, dict(WIDE, recompute_kv=True)], ids=["mixed", "wide", "recompute"])
def test_cache_equals_fresh_forward_after_every_commit(model, run_checked, knobs, setting):
    knobs = dict(knobs, **setting)
    tokens, stats, kinds, last = run_checked(model, **knobs)
    assert "verify" in kinds and "infill" in kinds  # both commit paths ran and were checked
    assert stats["slots_parallel_max"] >= 2  # several slots infilled together (packed)
    if knobs.get("recompute_kv"):
        assert "recompute" in kinds and stats["nfe_recompute"] >= 1
    assert torch.equal(tokens, sorted_committed(last, PROMPT.shape[1], (2,)))
    assert tokens.numel() == 24


def test_eos_drops_later_slots_and_output_is_sorted_commits(model, run_checked):
    free, _, _, _ = run_checked(model, **WIDE)
    eos = int(free[8])  # a token that first shows up in the middle of the response
    tokens, stats, kinds, last = run_checked(model, **WIDE, eos_token_id=eos)
    assert int(tokens[-1]) == eos and tokens.numel() < 24
    assert int((tokens == eos).nonzero()[0, 0]) == tokens.numel() - 1
    assert torch.equal(tokens, sorted_committed(last, PROMPT.shape[1], (eos,)))
    assert stats["generated_tokens"] == tokens.numel()


def test_zero_thresholds_single_block_is_argmax_of_one_plan(model):
    gen = 20
    ids = torch.cat([PROMPT, torch.full((1, gen), 47)], 1)
    with torch.no_grad():
        want = model(ids).logits[0, PROMPT.shape[1]:].argmax(-1)
    knobs = dict(gen_length=gen, slot_size=5, serial_num_blocks=1, slot_threshold=0.0, token_threshold=0.0)
    tokens, stats = DECODERS["refusion"](model, PROMPT, **knobs)
    assert torch.equal(tokens[0], want)
    assert stats["nfe_plan"] == 1 and stats["nfe_verify"] == 1 and stats["nfe"] == 2
    eos = int(want[11])
    cut = int((want == eos).nonzero()[0, 0]) + 1
    tokens, _ = DECODERS["refusion"](model, PROMPT, eos_token_id=eos, **knobs)
    assert torch.equal(tokens[0], want[:cut])


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("knobs", [MIXED, WIDE, dict(MIXED, left_to_right=True)], ids=["mixed", "wide", "l2r"])
def test_no_cache_gives_identical_tokens(model, knobs, setting):
    knobs = dict(knobs, **setting)
    a, sa = DECODERS["refusion"](model, PROMPT, **knobs)
    b, sb = DECODERS["refusion"](model, PROMPT, no_cache=True, **knobs)
    assert torch.equal(a[0], b[0])
    assert sa["nfe"] == sb["nfe"] and sb["kv_peak_bytes"] == 0 < sa["kv_peak_bytes"]


def test_nfe_equals_real_forward_calls(model):
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        for extra in ({}, {"recompute_kv": True}, {"no_cache": True}, {"left_to_right": True}):
            calls.clear()
            _, stats = DECODERS["refusion"](model, PROMPT, **WIDE, **extra)
            assert stats["nfe"] == len(calls)
            phases = ("plan", "verify", "draft", "infill", "recompute")
            assert stats["nfe"] == sum(stats[f"nfe_{p}"] for p in phases)
            assert stats["tpf"] == pytest.approx(stats["generated_tokens"] / stats["nfe"])
    finally:
        handle.remove()


def test_left_to_right_commits_slots_in_position_order(model):
    order = []
    tokens, stats = DECODERS["refusion"](
        model, PROMPT, left_to_right=True, on_commit=lambda info: order.append(list(info["pos"])), **WIDE
    )
    final = order[-1][PROMPT.shape[1]:]
    assert final == sorted(final) and stats["slots_parallel_max"] <= 1 and tokens[0].numel() == 24


def test_replicated_layout_same_tokens_more_kv(model):
    """The per-slot copy of the committed cache: same tokens and forwards, k copies of the prefix KV."""
    a, sa = DECODERS["refusion"](model, PROMPT, **WIDE)
    b, sb = DECODERS["refusion"](model, PROMPT, kv_layout="replicated", **WIDE)
    assert torch.equal(a[0], b[0]) and sa["nfe"] == sb["nfe"] and sa["slots_parallel_max"] >= 2
    assert sb["kv_peak_bytes"] > sa["kv_peak_bytes"] > 0


def test_infill_seeds_rule_on_hand_built_probabilities():
    """Slot j starts from its own longest prefix that passed global verification ("global"),
    or only slot 0 does ("first"). Token 0 of a slot always passes; its probability is ignored."""
    L, thr = 4, 0.5
    probs = torch.tensor([0.0, 0.9, 0.9, 0.1,  # slot 0: 3 pass
                          0.0, 0.9, 0.2, 0.9,  # slot 1: 2 (token 3 passes but follows a failure)
                          0.0, 0.6, 0.7, 0.8,  # slot 2: all 4
                          0.0, 0.1, 0.9, 0.9])  # slot 3: only token 0
    want = []
    for j in range(4):  # the rule as written, token by token
        n = 1
        while n < L and probs[j * L + n] > thr:
            n += 1
        want.append(n)
    assert infill_seeds(probs, L, thr) == want == [3, 2, 4, 1]
    assert infill_seeds(probs, L, thr, "first") == [3, 1, 1, 1]


class RuleModel(torch.nn.Module):
    """A hand-built causal 'model' with a real KV cache: keys hold (token, position), and the
    logits of a query depend on its own token and on the visible token one position before it.

    Prompt tokens are 8..13, response tokens 5, 6, 7, mask 15. A mask predicts 5 after a prompt
    token, 6 after a response token, and A(p) after a mask or nothing (A = 7 at position 5, else
    5). A real token predicts 6 after itself if it is 6, else 5. Every prediction has prob 0.9.
    """

    def __init__(self):
        super().__init__()
        self.config = Qwen3Config(vocab_size=16, hidden_size=4, intermediate_size=4, num_hidden_layers=1,
                                  num_attention_heads=1, num_key_value_heads=1, head_dim=2, eos_token_id=14,
                                  pad_token_id=0, mask_token_id=15)
        self.w = torch.nn.Parameter(torch.zeros(1))

    @property
    def dtype(self):
        return torch.float32

    def forward(self, input_ids, position_ids, attention_mask, cache=None, use_cache=False):
        b, q = input_ids.shape
        new = torch.stack([input_ids.float(), position_ids.float()], -1)[:, None]  # [B, 1, q, 2]
        keys = cache.update(new, new, 0)[0] if cache is not None else new
        visible = attention_mask[:, 0] == 0  # [B, q, kv]
        logits = torch.full((b, q, 16), torch.log(torch.tensor(0.1 / 15)).item())
        for r in range(b):
            for i in range(q):
                tok, pos = int(input_ids[r, i]), int(position_ids[r, i])
                prev = [int(keys[r, 0, j, 0]) for j in range(keys.shape[2])
                        if visible[r, i, j] and int(keys[r, 0, j, 1]) == pos - 1]
                prev = prev[0] if prev else None
                if tok == 15:
                    out = 5 if prev is not None and prev >= 8 and prev != 15 else (
                        6 if prev is not None and prev != 15 else (7 if pos == 5 else 5))
                else:
                    out = 6 if tok == 6 else 5
                logits[r, i, out] = torch.log(torch.tensor(0.9)).item()
        return SimpleNamespace(logits=logits)


def test_infill_seed_global_keeps_verified_prefixes_of_every_slot():
    """Two slots of 3 after prompt [8, 9, 10]. Plan drafts [5, 5, 7 | 5, 5, 5]; global verification
    rejects the 7 (slot 0 prefix 2) and passes all of slot 1 (prefix 3), so nothing is committed
    and both slots go to parallel infill. "global": slot 1 keeps [5, 5, 5]; slot 0 redrafts its
    last token after a 5 -> 6. "first": slot 1 restarts from its first token and is redrafted
    after real tokens -> [5, 6, 6]."""
    model = RuleModel().eval()
    knobs = dict(gen_length=6, slot_size=3, slot_threshold=0.5, token_threshold=0.5)
    prompt = torch.tensor([[8, 9, 10]])
    a, sa = DECODERS["refusion"](model, prompt, **knobs)
    b, sb = DECODERS["refusion"](model, prompt, infill_seed="first", **knobs)
    assert sa["verify_commits"] == sb["verify_commits"] == 0 and sa["slots_parallel_max"] == 2
    assert a[0].tolist() == [5, 5, 6, 5, 5, 5]
    assert b[0].tolist() == [5, 5, 6, 5, 6, 6]
    c, _ = DECODERS["refusion"](model, prompt, no_cache=True, **knobs)
    d, _ = DECODERS["refusion"](model, prompt, kv_layout="replicated", **knobs)
    assert torch.equal(a[0], c[0]) and torch.equal(a[0], d[0])


@pytest.mark.parametrize("extra", [{}, {"kv_layout": "replicated"}], ids=["packed", "replicated"])
def test_batch_rows_equal_one_by_one(model, left_pad, extra, assert_cache_matches_fresh_forward):
    """4 rows of different prompt lengths that stop at different times: every row's tokens equal
    decoding it alone, with one model call per step for all rows (rows at different phases stacked). After every
    commit a row's cache equals a fresh forward of its committed tokens, also while it is a view of a stacked
    call's cache (its KV moved there, its commits widening the view: refusion.stack_rows, cache.continues)."""
    g = torch.Generator().manual_seed(11)
    rows = [torch.randint(3, 47, (n,), generator=g) for n in (3, 5, 6, 8)]
    ids, mask = left_pad(rows)
    knobs = dict(MIXED, eos_token_id=[2, 34], **extra)
    calls, views, checking = [], [], []

    def check(info):
        checking.append(1)  # the fresh forward is no decoder call
        assert_cache_matches_fresh_forward(model, info)
        checking.pop()
        keys = info["cache"].layers[0].keys
        views.append(keys._base is not None and keys._base.shape[0] > keys.shape[0])  # part of a stacked call's

    handle = model.register_forward_pre_hook(lambda *_: None if checking else calls.append(1))
    try:
        batched, stats = DECODERS["refusion"](model, ids, attention_mask=mask, on_commit=check, **knobs)
    finally:
        handle.remove()
    assert any(views) and len(views) > 8
    single = [DECODERS["refusion"](model, r[None], **knobs) for r in rows]
    for got, (want, _) in zip(batched, single):
        assert torch.equal(got, want[0])
    lengths = [t.numel() for t in batched]
    assert len(set(lengths)) == 4 and min(lengths) < 24  # different EOS times, some row stops early
    assert stats["nfe"] == len(calls) == max(s["nfe"] for _, s in single) < sum(s["nfe"] for _, s in single)
    assert stats["generated_tokens"] == sum(lengths)


@pytest.mark.parametrize(
    "knob,value",
    [("slot_size", 0), ("gen_length", 0), ("slot_threshold", 1.5), ("token_threshold", -0.1),
     ("serial_num_blocks", 5), ("serial_num_blocks", 0), ("temperature", -1.0)],
)
def test_invalid_knobs(model, knob, value):
    knobs = dict(gen_length=24, slot_size=4)
    knobs[knob] = value
    with pytest.raises(ValueError, match=knob):
        DECODERS["refusion"](model, PROMPT, **knobs)


@pytest.mark.parametrize(
    "knob,value", [("infill_seed", "all"), ("kv_layout", "per_slot")],
)
def test_invalid_choices_name_the_knob_and_values(model, knob, value):
    with pytest.raises(ValueError, match=f"{knob} must be one of .*(global|packed)"):
        DECODERS["refusion"](model, PROMPT, **{knob: value}, gen_length=8, slot_size=4)


@pytest.mark.parametrize("row", [[1, 1, 0], [1, 0, 1], [0, 0, 0], [0, 2, 1]], ids=["right", "hole", "empty", "two"])
def test_attention_mask_must_be_left_padding(model, row):
    ids = torch.full((2, 3), 5)
    mask = torch.tensor([[0, 1, 1], row])
    with pytest.raises(ValueError, match="attention_mask must be left padding"):
        DECODERS["refusion"](model, ids, attention_mask=mask, gen_length=8, slot_size=4)


def test_sampling_is_seeded(model):
    a, _ = DECODERS["refusion"](model, PROMPT, **MIXED, temperature=1.0, seed=3)
    b, _ = DECODERS["refusion"](model, PROMPT, **MIXED, temperature=1.0, seed=3)
    assert torch.equal(a[0], b[0])
