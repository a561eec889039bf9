"""Training objectives: ReFusion (docs/design.md §2), plain AR, LLaDA-style masked diffusion,
Dream-style shifted masked diffusion and D2F block-wise (diffusion-forcing) masked diffusion.

Each objective is two plain functions: a *collate* from examples (prompt ids,
response ids ending with EOS, or an open-ended response cut short without one) to a batch of tensors, and a *loss* from
``(model, batch)`` to a scalar. They work on any Qwen3-family causal LM from
``transformers`` — the tiny models here or a real checkpoint.

All three build an explicit 4-D additive float mask and explicit position ids:
with jumping position ids and no mask, transformers reads the sequence as packed
documents (docs/design.md §8), and the eager path adds the mask, so bool would be wrong.
Logits are scored at the position they sit on (labels are already aligned), so no
objective relies on the model's internal label shift.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE = -100
EPS = 1e-3  # p = (1 - eps) t + eps, docs/design.md §2 step 2


@dataclass(frozen=True)
class Example:
    """One training item. ``open_ended``: the response is a prefix of a longer one (cut right after an
    intermediate result, so no restatement of it follows), with no EOS: every objective trains its
    tokens only, never an EOS after them nor EOS padding, so no model learns to stop there.
    ``cuts``: token counts after which the trainer may cut this response into such an item.
    ``numbers``: [start, end) token spans of every number of the response (operands, results, the
    final answer), or empty; the result a cut ends is the number right before its period."""
    prompt: list[int]
    response: list[int]  # ends with EOS unless open_ended
    open_ended: bool = False
    cuts: tuple[int, ...] = ()
    numbers: tuple[tuple[int, int], ...] = ()

    def cut(self, n: int) -> "Example":
        """The open-ended item made of the prompt and the first ``n`` response tokens."""
        if not 0 < n < len(self.response):
            raise ValueError(f"cut {n} outside the response (length {len(self.response)})")
        return Example(self.prompt, self.response[:n], open_ended=True)

    def result(self, i: int) -> "Example":
        """The open-ended item whose prompt runs up to the ``i``-th cut's result and whose response is
        that result and its period ("127."): the response is computed from a context that is all
        clean, for every objective, the condition a decoder meets."""
        end = self.cuts[i]
        start = next((a for a, b in self.numbers if b == end - 1), None)  # "127" of "127." ends before "."
        if start is None:
            raise ValueError(f"no number ends right before cut {i} (at {end})")
        if not 0 < start < end < len(self.response):
            raise ValueError(f"result {i} at [{start}, {end}) outside the response (length {len(self.response)})")
        return Example(self.prompt + self.response[:start], self.response[start:end], open_ended=True)

    def number(self, i: int) -> "Example":
        """The open-ended item whose prompt runs up to the ``i``-th number of the response and whose
        response is that number and the token after it ("29 +", "127."; the final answer's EOS is never
        included): copying an operand or the answer, or computing a result, from a clean context."""
        start, end = self.numbers[i]
        last = len(self.response) - (0 if self.open_ended else 1)  # tokens before the EOS
        if not 0 < start < end <= last:
            raise ValueError(f"number {i} at [{start}, {end}) outside the response (length {len(self.response)})")
        return Example(self.prompt + self.response[:start], self.response[start:min(end + 1, last)],
                       open_ended=True)


@dataclass(frozen=True)
class SlotPlan:
    """Random choices of one ReFusion example (docs/design.md §2 steps 1-3)."""
    slot_size: int
    p: float                  # per-slot mask probability
    masked: tuple[bool, ...]  # one flag per slot, in position order
    clean_order: tuple[int, ...]  # indices of unmasked slots in their shuffled sequence order


def draw_slot_plan(n_response: int, rng: random.Random, slot_sizes=(4, 8, 16, 32), eps: float = EPS) -> SlotPlan:
    """Slot size from ``slot_sizes``; t ~ U(0,1), p = (1-eps)t + eps; each slot masked w.p. p; shuffle clean slots."""
    size = rng.choice(list(slot_sizes))
    n_slots = -(-n_response // size)
    p = (1 - eps) * rng.random() + eps
    masked = tuple(rng.random() < p for _ in range(n_slots))
    clean = [i for i, m in enumerate(masked) if not m]
    rng.shuffle(clean)
    return SlotPlan(size, p, masked, tuple(clean))


def draw_suffix_plan(n_response: int, rng: random.Random, slot_sizes=(4, 8, 16, 32)) -> SlotPlan:
    """A plan as the decoder meets it (not the paper's): the slots from a uniformly drawn k on are masked,
    those before it clean, so no masked slot ever sees a clean slot positioned after it; the loss weight
    1/p uses the masked share p = (n - k) / n."""
    size = rng.choice(list(slot_sizes))
    n_slots = -(-n_response // size)
    k = rng.randrange(n_slots)
    clean = list(range(k))
    rng.shuffle(clean)
    return SlotPlan(size, (n_slots - k) / n_slots, tuple(i >= k for i in range(n_slots)), tuple(clean))


def build_refusion_sequence(ex: Example, plan: SlotPlan, mask_token_id: int) -> dict[str, list]:
    """One ReFusion training sequence (docs/design.md §2 steps 3-4), as plain lists of length L.

    Order: prompt; clean slots in ``plan.clean_order``; masked slots in position
    order with every token replaced by the mask id. Every token keeps its true
    position id. ``labels[i]`` is what the logit at sequence index i must predict:
    the next token of the same clean slot (none for a slot's last token), or the
    original token at a masked position. ``is_mdm[i]`` flags masked positions.
    """
    P, R, S = len(ex.prompt), len(ex.response), plan.slot_size
    slots = [list(range(s, min(s + S, R))) for s in range(0, R, S)]  # response offsets per slot
    if len(slots) != len(plan.masked):
        raise ValueError(f"plan has {len(plan.masked)} slots, response needs {len(slots)}")
    ids, pos, labels, is_mdm = list(ex.prompt), list(range(P)), [IGNORE] * P, [False] * P
    for k in plan.clean_order:
        for j, off in enumerate(slots[k]):
            ids.append(ex.response[off])
            pos.append(P + off)
            nxt = slots[k][j + 1] if j + 1 < len(slots[k]) else None
            labels.append(ex.response[nxt] if nxt is not None else IGNORE)
            is_mdm.append(False)
    for k, m in enumerate(plan.masked):
        if m:
            for off in slots[k]:
                ids.append(mask_token_id)
                pos.append(P + off)
                labels.append(ex.response[off])
                is_mdm.append(True)
    return {"input_ids": ids, "position_ids": pos, "labels": labels, "is_mdm": is_mdm}


def additive_mask(valid: torch.Tensor, causal: bool, dtype=torch.float32) -> torch.Tensor:
    """[B, L] bool of real (non-pad) tokens -> [B, 1, L, L] additive mask (0 visible, min-float hidden).

    Causal over the *sequence* order when ``causal``; bidirectional otherwise.
    Pad queries see themselves only, so no row is fully masked (no NaN).
    """
    B, L = valid.shape
    see = valid[:, None, None, :].expand(B, 1, L, L).clone()
    if causal:
        see &= torch.ones(L, L, dtype=torch.bool, device=valid.device).tril()
    see |= torch.eye(L, dtype=torch.bool, device=valid.device)
    return torch.zeros(B, 1, L, L, dtype=dtype, device=valid.device).masked_fill(~see, torch.finfo(dtype).min)


def _pad(rows: list[list], value) -> torch.Tensor:
    L = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (L - len(r)) for r in rows])


def collate_refusion(examples: list[Example], rng: random.Random, mask_token_id: int, pad_token_id: int,
                     slot_sizes=(4, 8, 16, 32), suffix_share: float = 0.0) -> dict[str, torch.Tensor]:
    """``suffix_share``: the share of examples drawn with ``draw_suffix_plan`` instead of the paper's
    random plan (0: the faithful objective, and no extra number is drawn)."""
    seqs, weights, resp_len = [], [], []
    for ex in examples:
        if suffix_share > 0 and rng.random() < suffix_share:
            plan = draw_suffix_plan(len(ex.response), rng, slot_sizes)
        else:
            plan = draw_slot_plan(len(ex.response), rng, slot_sizes)
        seq = build_refusion_sequence(ex, plan, mask_token_id)
        seqs.append(seq)
        weights.append([1.0 / plan.p if m else 0.0 for m in seq["is_mdm"]])
        resp_len.append(len(ex.response))
    ids = _pad([s["input_ids"] for s in seqs], pad_token_id)
    valid = _pad([[True] * len(s["input_ids"]) for s in seqs], False)
    return {
        "input_ids": ids,
        "position_ids": _pad([s["position_ids"] for s in seqs], 0),
        "attention_mask": additive_mask(valid, causal=True),
        "labels": _pad([s["labels"] for s in seqs], IGNORE),
        "is_mdm": _pad([s["is_mdm"] for s in seqs], False),
        "mdm_weight": _pad(weights, 0.0).float(),
        "response_len": torch.tensor(resp_len, dtype=torch.float32),
    }


def _token_ce(model, batch) -> torch.Tensor:
    """[B, L] cross-entropy of the logit at each index against ``labels`` at that index (0 where ignored)."""
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                attention_mask=batch["attention_mask"], use_cache=False)
    logits = out.logits.float()
    labels = batch["labels"]
    ce = F.cross_entropy(logits.flatten(0, 1), labels.clamp_min(0).flatten(), reduction="none")
    return ce.view_as(labels) * (labels != IGNORE)


def refusion_loss(model, batch) -> torch.Tensor:
    """AR part: mean CE over clean-slot labels. MDM part: sum over masked tokens of CE / p,
    divided by response length and batch size (docs/design.md §2 step 5)."""
    ce = _token_ce(model, batch)
    ar_sel = (batch["labels"] != IGNORE) & ~batch["is_mdm"]
    ar = ce[ar_sel].sum() / ar_sel.sum().clamp_min(1)
    mdm = ((ce * batch["mdm_weight"]).sum(1) / batch["response_len"]).mean()
    return ar + mdm


def collate_ar(examples: list[Example], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Prompt + response; labels[i] = token i+1 on response targets only (next-token loss)."""
    ids, labels = [], []
    for ex in examples:
        seq = ex.prompt + ex.response
        lab = [IGNORE] * (len(ex.prompt) - 1) + ex.response + [IGNORE]
        ids.append(seq)
        labels.append(lab)
    input_ids = _pad(ids, pad_token_id)
    valid = _pad([[True] * len(s) for s in ids], False)
    return {"input_ids": input_ids, "position_ids": torch.arange(input_ids.shape[1]).expand_as(input_ids),
            "attention_mask": additive_mask(valid, causal=True), "labels": _pad(labels, IGNORE)}


def ar_loss(model, batch) -> torch.Tensor:
    ce = _token_ce(model, batch)
    sel = batch["labels"] != IGNORE
    return ce.sum() / sel.sum().clamp_min(1)


def _eos_padded(ex: Example, eos_token_id: int | None, pad_multiple: int) -> Example:
    """LLaDA / Dream SFT: the response padded with EOS up to the next multiple of ``pad_multiple``; the
    pads are trained like response tokens, so the model learns to fill a fixed window's tail with EOS.
    An open-ended example gets no padding: nothing is known about what follows its last token."""
    if eos_token_id is None or ex.open_ended:
        return ex
    target = -(-len(ex.response) // pad_multiple) * pad_multiple
    return Example(ex.prompt, ex.response + [eos_token_id] * (target - len(ex.response)))


def _draw_masks(n: int, ratios: list[float], rng: random.Random) -> list[bool]:
    """One flag per response token, token i masked w.p. ratios[i]; at least one masked token."""
    m = [rng.random() < r for r in ratios]
    if not any(m):  # at least one target per example
        m[rng.randrange(n)] = True
    return m


def _mdm_batch(rows: list[tuple[Example, list[bool], list[float]]], mask_token_id: int, pad_token_id: int,
               shift: bool, block_size: int | None) -> dict[str, torch.Tensor]:
    """Shared tail of the masked-diffusion collates: rows of (example, masked flags, per-token mask ratio).

    ``labels[i]`` is what the logit at index i must predict: the original token at masked position i,
    or with ``shift`` (Dream) the original token at masked position i + 1. ``block_size`` set: the
    attention is block-causal (prompt one block, then response blocks of ``block_size``), else
    bidirectional.
    """
    ids, labels, weights, resp_len, blocks = [], [], [], [], []
    for ex, m, ratio in rows:
        P = len(ex.prompt)
        ids.append(ex.prompt + [mask_token_id if mi else tok for tok, mi in zip(ex.response, m)])
        lab = [IGNORE] * P + [tok if mi else IGNORE for tok, mi in zip(ex.response, m)]
        w = [0.0] * P + [1.0 / r if mi else 0.0 for mi, r in zip(m, ratio)]
        if shift:  # the logit at i - 1 predicts token i; the last logit predicts nothing
            lab, w = lab[1:] + [IGNORE], w[1:] + [0.0]
        labels.append(lab)
        weights.append(w)
        resp_len.append(len(ex.response))
        if block_size is not None:
            blocks.append([0] * P + [1 + j // block_size for j in range(len(ex.response))])
    input_ids = _pad(ids, pad_token_id)
    valid = _pad([[True] * len(s) for s in ids], False)
    if block_size is None:
        mask = additive_mask(valid, causal=False)
    else:
        mask = block_causal_mask(valid, _pad(blocks, 0))
    return {"input_ids": input_ids, "position_ids": torch.arange(input_ids.shape[1]).expand_as(input_ids),
            "attention_mask": mask, "labels": _pad(labels, IGNORE),
            "mdm_weight": _pad(weights, 0.0).float(), "response_len": torch.tensor(resp_len, dtype=torch.float32)}


def block_causal_mask(valid: torch.Tensor, block: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """[B, L] real-token flags and [B, L] block index -> [B, 1, L, L] additive mask where a query sees
    every real key of its own and all earlier blocks (bidirectional inside a block, causal across
    blocks: D2F's attention). Pad queries see themselves only."""
    B, L = valid.shape
    see = valid[:, None, None, :] & (block[:, None, None, :] <= block[:, None, :, None])
    see |= torch.eye(L, dtype=torch.bool, device=valid.device)
    return torch.zeros(B, 1, L, L, dtype=dtype, device=valid.device).masked_fill(~see, torch.finfo(dtype).min)


def collate_mdm(examples: list[Example], rng: random.Random, mask_token_id: int, pad_token_id: int,
                eps: float = EPS, eos_token_id: int | None = None, pad_multiple: int = 32,
                shift: bool = False) -> dict[str, torch.Tensor]:
    """LLaDA SFT: each response token masked w.p. t ~ U(0,1) (floored at eps); bidirectional attention;
    the logit at a masked position predicts the token at that same position. With ``shift`` it is
    Dream's objective instead: the logit at position i - 1 predicts masked token i, so an AR model's
    next-token head carries over (Dream starts from Qwen2.5).

    As in LLaDA's SFT, the response is padded with EOS tokens (here up to the next
    multiple of ``pad_multiple``) that are trained like response tokens.
    """
    rows = []
    for ex in examples:
        ex = _eos_padded(ex, eos_token_id, pad_multiple)
        t = (1 - eps) * rng.random() + eps
        n = len(ex.response)
        rows.append((ex, _draw_masks(n, [t] * n, rng), [t] * n))
    return _mdm_batch(rows, mask_token_id, pad_token_id, shift=shift, block_size=None)


def collate_d2f(examples: list[Example], rng: random.Random, mask_token_id: int, pad_token_id: int,
                block_size: int = 8, eps: float = EPS, eos_token_id: int | None = None,
                pad_multiple: int = 32) -> dict[str, torch.Tensor]:
    """D2F (discrete diffusion forcing) SFT: the EOS-padded response cut into blocks of ``block_size``;
    block b masked at ratio t_b with t_1 <= t_2 <= ... (sorted uniform draws, floored at eps), so later
    blocks are noisier, as when a pipeline decoder starts a block before the previous one is done;
    block-causal attention; the logit at a masked position predicts the token there (as LLaDA)."""
    rows = []
    for ex in examples:
        ex = _eos_padded(ex, eos_token_id, pad_multiple)
        n = len(ex.response)
        n_blocks = -(-n // block_size)
        ts = sorted((1 - eps) * rng.random() + eps for _ in range(n_blocks))
        ratio = [ts[j // block_size] for j in range(n)]
        rows.append((ex, _draw_masks(n, ratio, rng), ratio))
    return _mdm_batch(rows, mask_token_id, pad_token_id, shift=False, block_size=block_size)


def mdm_loss(model, batch) -> torch.Tensor:
    """Sum over masked tokens of CE / t, divided by response length, averaged over the batch
    (LLaDA, Dream and D2F alike; their collates differ)."""
    ce = _token_ce(model, batch)
    return ((ce * batch["mdm_weight"]).sum(1) / batch["response_len"]).mean()


OBJECTIVES = {"refusion": refusion_loss, "ar": ar_loss, "mdm": mdm_loss, "dream": mdm_loss, "d2f": mdm_loss}
