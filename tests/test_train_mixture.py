"""The arithmetic-signal mixtures (refusion/train.py ``open_share``, ``result_share``): open-ended items end
right after an intermediate result, result items are that result after a clean context, and no objective
trains an EOS (or EOS padding, or any target) after their end."""

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
    from harness.train.train_tiny import embedded_corpus

    rows = {k: v[:20] for k, v in embedded_corpus().items()}  # the trainer's rows, with their cut points
    return prepare(CFG, rows)


def test_cut_points_end_right_after_each_intermediate_result(data):
    from harness.train.train_tiny import math_cut_chars

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


def test_result_items_are_the_result_after_a_clean_context(data):
    tok, examples = data
    for full in examples["math"]:
        for i, end in enumerate(full.cuts):  # every cut has its result
            ex = full.result(i)
            start = len(ex.prompt) - len(full.prompt)
            assert ex.open_ended and ex.prompt == full.prompt + full.response[:start]
            assert ex.response == full.response[start:end]
            text = tok.decode(ex.response)
            assert text[:-1].isdigit() and text.endswith(".")  # "127."
            assert tok.decode(ex.prompt).endswith("= ")
    with pytest.raises(ValueError, match="outside the response"):
        obj.Example([1], [5, 6, 7, 2], numbers=((2, 3),), cuts=(4,)).result(0)
    with pytest.raises(ValueError, match="no number ends right before cut"):
        obj.Example([1], [5, 6, 7, 2], numbers=((1, 2),), cuts=(2,)).result(0)


def unmixed(examples, step: int, cfg):
    """The items of ``step``'s batch as drawn before any mixture rule, and the generator after them
    (written out here as refusion/train.py ``draw_items`` draws them)."""
    rng = random.Random(f"{cfg.seed}/{step}")
    weights = dict(cfg.kind_weights)
    kinds = [k for k in examples if weights.get(k, 0) > 0]
    drawn = rng.choices(kinds, [weights[k] for k in kinds], k=cfg.batch_size)
    return [rng.choice(examples[k]) for k in drawn], rng


@pytest.mark.parametrize("share, make", [("result_share", "result"), ("number_share", "number")])
def test_share_one_replaces_every_math_item(data, share, make):
    _, examples = data
    only = dataclasses.replace(CFG, open_share=0.0, **{share: 1.0})
    for step in range(3):
        base, _ = draw_items(examples, step, dataclasses.replace(CFG, open_share=0.0))
        mixed, _ = draw_items(examples, step, only)
        for b, m in zip(base, mixed):  # every math item becomes one of its items of that kind, the rest unchanged
            if b.cuts:
                n = len(b.cuts) if make == "result" else len(b.numbers)
                assert m.open_ended and any(m == getattr(b, make)(i) for i in range(n))
            else:
                assert m == b


def test_result_share_zero_keeps_earlier_draws(data):
    _, examples = data
    # result_share 0 keeps the draws of open_share alone exactly (runs started before it resume the same):
    # the rule as it was written before result items existed
    half = dataclasses.replace(CFG, open_share=0.5)
    for step in range(3):
        old, rng = unmixed(examples, step, half)
        old = [ex.cut(rng.choice(ex.cuts)) if ex.cuts and rng.random() < half.open_share else ex for ex in old]
        new, rnew = draw_items(examples, step, half)
        assert new == old and rnew.random() == rng.random()
    # both: each math item is open-ended, a result item, or kept, by one draw
    both = dataclasses.replace(CFG, open_share=0.4, result_share=0.4, batch_size=256)
    items, _ = draw_items(examples, 0, both)
    kinds = {"cut": 0, "result": 0, "full": 0}
    for m in items:
        if m.open_ended:
            kinds["result" if tok_is_result(m) else "cut"] += 1
        elif m.cuts:
            kinds["full"] += 1
    assert all(v > 0 for v in kinds.values()), kinds


def tok_is_result(ex) -> bool:
    """A result item's response is a few digits and a period; an open-ended cut keeps a whole solution."""
    return len(ex.response) <= 5


def test_number_items_cover_every_number_of_the_solution(data):
    tok, examples = data
    for full in examples["math"]:
        text = tok.decode(full.response[:-1])
        numbers = [tok.decode(full.response[a:b]) for a, b in full.numbers]
        assert numbers == probe_numbers(text)  # operands, results and the answer, in order
        for i, (start, end) in enumerate(full.numbers):
            ex = full.number(i)
            assert ex.open_ended and ex.prompt == full.prompt + full.response[:start]
            assert tok.eos_token_id not in ex.response and ex.response[:end - start] == full.response[start:end]
            assert len(ex.response) == end - start + (1 if end < len(full.response) - 1 else 0)


def probe_numbers(text: str) -> list[str]:
    import re

    return re.findall(r"\d+", text)


def test_number_share_zero_keeps_earlier_draws(data):
    _, examples = data
    # number_share 0 keeps the draws of open_share + result_share: the rule as written before number items
    mix = dataclasses.replace(CFG, open_share=0.2, result_share=0.4)
    for step in range(3):
        items, rng = unmixed(examples, step, mix)
        old = []
        for ex in items:
            if ex.cuts:
                u = rng.random()
                if u < 0.2:
                    ex = ex.cut(rng.choice(ex.cuts))
                elif u < 0.6:
                    ex = ex.result(rng.randrange(len(ex.cuts)))
            old.append(ex)
        new, rnew = draw_items(examples, step, mix)
        assert new == old and rnew.random() == rng.random()
