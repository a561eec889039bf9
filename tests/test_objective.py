"""ReFusion / AR / MDM objectives (docs/design.md §2): hand-built example, finite loss, overfitting."""

import random

import pytest
import torch

from refusion import objective as obj

MASK, PAD = 9, 0


@pytest.fixture(scope="module")
def tiny_model(tiny_qwen3):
    """`tiny_model(causal=True, seed=0)`: a random tiny Qwen3 (vocab 32, tied embeddings) in training mode."""
    return lambda causal=True, seed=0: tiny_qwen3(
        vocab=32, seed=seed, causal=causal, max_positions=128, mask=MASK, tie=True, impl="sdpa").train()


def test_refusion_sequence_hand_built():
    # prompt [1 2 3] (positions 0-2); response [20 21 22 23 24 25 26 2] in slots of 3:
    #   slot0 = offsets 0-2 (pos 3-5), slot1 = 3-5 (pos 6-8), slot2 = 6-7 (pos 9-10)
    ex = obj.Example(prompt=[1, 2, 3], response=[20, 21, 22, 23, 24, 25, 26, 2])
    plan = obj.SlotPlan(slot_size=3, p=0.5, masked=(False, True, False), clean_order=(2, 0))
    seq = obj.build_refusion_sequence(ex, plan, MASK)
    I = obj.IGNORE
    assert seq["input_ids"] == [1, 2, 3, 26, 2, 20, 21, 22, MASK, MASK, MASK]
    assert seq["position_ids"] == [0, 1, 2, 9, 10, 3, 4, 5, 6, 7, 8]
    # clean slot 2: 26 -> 2, last no label; clean slot 0: 20 -> 21 -> 22, last no label;
    # masked slot 1 predicts its own tokens at the same positions.
    assert seq["labels"] == [I, I, I, 2, I, 21, 22, I, 23, 24, 25]
    assert seq["is_mdm"] == [False] * 8 + [True] * 3


def test_collate_refusion_weights_and_mask():
    ex = obj.Example(prompt=[1, 2], response=[20, 21, 22, 23, 2])
    rng = random.Random(3)
    b = obj.collate_refusion([ex, obj.Example([1], [20, 2])], rng, MASK, PAD, slot_sizes=(2,))
    assert b["input_ids"].shape == b["position_ids"].shape == b["labels"].shape
    # 1/p exactly on masked positions, zero elsewhere.
    assert torch.all((b["mdm_weight"] > 0) == b["is_mdm"])
    assert torch.all(b["mdm_weight"][b["is_mdm"]] >= 1.0)
    m = b["attention_mask"]
    assert m.shape == (2, 1, 7, 7) and m.dtype == torch.float32
    # causal over sequence order; pad keys hidden from real queries
    assert m[0, 0, 0, 1] < -1e30 and m[0, 0, 6, 0] == 0
    assert torch.all(m[1, 0, :3, 3:] < -1e30)


def test_sequence_order_is_seen_causally_not_by_position(tiny_model, assert_close):
    # A clean slot placed *later* in the sequence but at *earlier* positions must still
    # see the slots before it in sequence order: the mask is causal over indices.
    model = tiny_model()
    ex = obj.Example(prompt=[1, 2, 3], response=[20, 21, 22, 23, 2])
    plan = obj.SlotPlan(slot_size=2, p=0.5, masked=(False, False, True), clean_order=(1, 0))
    seq = obj.build_refusion_sequence(ex, plan, MASK)
    ids = torch.tensor([seq["input_ids"]])
    pos = torch.tensor([seq["position_ids"]])
    mask = obj.additive_mask(torch.ones_like(ids, dtype=torch.bool), causal=True)
    full = model(input_ids=ids, position_ids=pos, attention_mask=mask).logits
    # Reference: feed the same tokens one prefix at a time (true causal over sequence order).
    for i in range(ids.shape[1]):
        part = model(input_ids=ids[:, : i + 1], position_ids=pos[:, : i + 1],
                     attention_mask=obj.additive_mask(torch.ones(1, i + 1, dtype=torch.bool), causal=True)).logits
        assert_close(part[0, -1], full[0, i], msg=f"index {i}")


@pytest.mark.parametrize("name", ["refusion", "ar", "mdm"])
def test_one_step_finite_loss(tiny_model, name):
    model = tiny_model(causal=name != "mdm")
    rng = random.Random(0)
    exs = [obj.Example([1, 2, 3], [10 + i, 11 + i, 12 + i, 13, 14, 2]) for i in range(4)]
    batch = {"refusion": lambda: obj.collate_refusion(exs, rng, MASK, PAD, slot_sizes=(2, 4)),
             "ar": lambda: obj.collate_ar(exs, PAD),
             "mdm": lambda: obj.collate_mdm(exs, rng, MASK, PAD)}[name]()
    loss = obj.OBJECTIVES[name](model, batch)
    assert torch.isfinite(loss) and loss.item() > 0
    loss.backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
