"""The arithmetic-signal mixture (refusion/train.py ``open_share``): open-ended items end right after an
intermediate result, and no objective trains an EOS (or EOS padding, or any target) after their end."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from refusion import objective as obj
from refusion.train import TrainConfig, collate, draw_items, prepare

CFG = TrainConfig(batch_size=16, open_share=1.0)


@pytest.fixture(scope="module")
def data():
    from harness.train_tiny import math_cut_chars
    from tasks.embedded import KINDS, load_split

    rows = {k: load_split(k, "train")[:20] for k in KINDS}
    for r in rows["math"]:
        r["cut_chars"] = math_cut_chars(r["response"])
    return prepare(CFG, rows)


def test_cut_points_end_right_after_each_intermediate_result(data):
    from harness.train_tiny import math_cut_chars

    tok, examples = data
    resp = "Ana starts with 90 apples.\nAfter getting 37: 90 + 37 = 127.\nAfter losing 4: 127 - 4 = 123.\n#### 123"
    assert math_cut_chars(resp) == [resp.index("127.") + 4, resp.index("123.") + 4]
    for ex in examples["math"]:
        assert len(ex.cuts) >= 2  # one per solution step (2 or 3 steps)
        for n in ex.cuts:
            text = tok.decode(ex.response[:n])
            assert text.endswith(".") and "= " in text.splitlines()[-1] and "####" not in text
    assert all(not ex.cuts for k in ("code", "choice") for ex in examples[k])


def test_open_ended_item_has_no_eos_target_in_any_objective(data):
    tok, examples = data
    eos, mask, pad = tok.eos_token_id, tok.mask_token_id, tok.pad_token_id
    full = examples["math"][0]
    ex = full.cut(full.cuts[0])
    assert ex.open_ended and eos not in ex.response and ex.response == full.response[:full.cuts[0]]
    rng = random.Random(0)
    for name in ("ar", "refusion", "mdm", "dream", "d2f"):
        b = collate(name, [ex, full], rng, CFG, tok)
        assert eos not in b["labels"][0].tolist(), name
        # No EOS padding and no position after the end: the open-ended row is prompt + response, then pads.
        n_real = len(ex.prompt) + len(ex.response)
        assert b["input_ids"][0, n_real:].eq(pad).all() and b["input_ids"][0, :n_real].ne(pad).all(), name
        assert (b["labels"][0, n_real:] == obj.IGNORE).all(), name
        if name in ("mdm", "dream", "d2f"):  # the full row is EOS-padded to a multiple of 32, the cut one not
            assert b["response_len"][0] == len(ex.response) and b["response_len"][1] % 32 == 0, name
    # ar: the last response token predicts nothing (no EOS after the end).
    b = obj.collate_ar([ex], pad)
    assert b["labels"][0, -1] == obj.IGNORE and b["labels"][0, -2] == ex.response[-1]


def test_open_share_keeps_the_drawn_items_and_cuts_math_only(data):
    _, examples = data
    for step in range(3):
        base, _ = draw_items(examples, step, dataclasses.replace(CFG, open_share=0.0))
        mixed, _ = draw_items(examples, step, CFG)
        assert not any(e.open_ended for e in base)
        for b, m in zip(base, mixed):  # the same items, math ones cut (share 1.0), the rest unchanged
            if b.cuts:
                assert m.open_ended and m.prompt == b.prompt and len(m.response) in b.cuts
                assert m.response == b.response[:len(m.response)]
            else:
                assert m == b


def test_cut_outside_the_response_is_refused():
    ex = obj.Example([1], [5, 6, 2])
    with pytest.raises(ValueError, match="outside the response"):
        ex.cut(3)
    with pytest.raises(ValueError, match="outside the response"):
        ex.cut(0)


def test_suffix_plan_never_leaves_a_clean_slot_after_a_masked_one():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 60)
        plan = obj.draw_suffix_plan(n, rng, slot_sizes=(4, 8, 16))
        k = plan.masked.index(True)  # at least the last slot is masked
        assert all(plan.masked[k:]) and not any(plan.masked[:k])
        assert sorted(plan.clean_order) == list(range(k)) and plan.p == (len(plan.masked) - k) / len(plan.masked)


def test_suffix_share_in_the_refusion_collate():
    ex = obj.Example(prompt=[1, 2], response=list(range(20, 40)) + [2])
    # share 0 is the paper's objective, drawn exactly as before (no extra random number)
    a = obj.collate_refusion([ex] * 4, random.Random(5), 9, 0, slot_sizes=(4,))
    b = obj.collate_refusion([ex] * 4, random.Random(5), 9, 0, slot_sizes=(4,), suffix_share=0.0)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # share 1: in every row each masked position comes after every clean response position
    c = obj.collate_refusion([ex] * 8, random.Random(5), 9, 0, slot_sizes=(4,), suffix_share=1.0)
    for row in range(8):
        pos, mdm = c["position_ids"][row], c["is_mdm"][row]
        clean_resp = pos[(~mdm) & (pos >= 2)]
        assert mdm.any() and (clean_resp.numel() == 0 or pos[mdm].min() > clean_resp.max())
