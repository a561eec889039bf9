"""Teacher-forced probe of the one skill the tiny diffusion models lack: computing a math result.

Exact match on decoded math needs every digit of every step right, so it sits at the floor until a
model is nearly there and says little about whether more training is helping. This probe asks each
model, one position at a time, for the next digit of an intermediate result ("45 + 12 = [5]7.") under
the condition its decoder meets: the prompt and the response up to that digit clean, everything from
the digit on unknown (mask tokens for the diffusion models). Nothing after the digit is visible, so a
restatement of the result on the next line cannot be copied; the digit has to be computed from the
operands. It scores the argmax of the head the model's decoder takes that digit from:

- ``ar``        the causal head: the logit at the previous position.
- ``refusion``  the masked head: a mask token at the digit's own position after the clean prefix
                (causal, so the masks after it change nothing); the decoder takes a slot's first token
                from this head without verification (docs/design.md §3).
- ``mdm``       LLaDA: bidirectional, the logit at the digit's position, masks over the rest of the
                EOS-padded response (its training layout).
- ``dream``     the same input, the logit at the previous position (Dream's shift).
- ``d2f``       the same input under D2F's block-causal attention (blocks of 8).

Inputs are built with the training objective's own sequence builders (refusion/objective.py), so the
probe sees exactly the layout training does. Reported: ``probe_result_digits`` (every digit of every
"= N" result) and ``probe_first_digits`` (the leading digit of each, the one that needs the carry),
on the same first-n math test items as the curves.
"""

from __future__ import annotations

import re

import torch

from refusion.objective import Example, SlotPlan, _mdm_batch, _pad, _eos_padded, additive_mask, \
    build_refusion_sequence, collate_ar

RESULT = re.compile(r"= (-?\d+)\.")
D2F_BLOCK = 8      # refusion/train.py TrainConfig.d2f_block_size
EOS_PAD_MULTIPLE = 32  # refusion/objective.py collate_mdm / collate_d2f default
PROBED = ("ar", "refusion", "mdm", "dream", "d2f")


def result_targets(tokenizer, response: str) -> tuple[list[int], list[tuple[int, bool]]]:
    """Response ids (as training encodes them, EOS last) and (token index, is_leading_digit) for each
    token inside an intermediate result "= N." of the response."""
    from refusion.tokenizer import encode_response

    ids = encode_response(tokenizer, response)
    enc = tokenizer(response, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) != ids[:-1]:
        raise ValueError("tokenizer offsets do not match the training encoding")
    spans = [m.span(1) for m in RESULT.finditer(response)]
    out = []
    for i, (s, e) in enumerate(enc["offset_mapping"]):
        for a, b in spans:
            if a <= s and e <= b and e > s:
                out.append((i, s == a))
    return ids, out


def _logits(model, batch: dict) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                 attention_mask=batch["attention_mask"], use_cache=False).logits


def _probe_rows(name: str, prompt: list[int], response: list[int], js: list[int], mask_id: int,
                eos_id: int) -> tuple[list, list[int]]:
    """(rows to batch, index of the scored logit in each row) for digit positions ``js``."""
    P = len(prompt)
    if name == "refusion":
        rows = []
        for j in js:  # one-token slots: clean 0..j-1 in order, masked from j on
            plan = SlotPlan(1, 1.0, tuple(i >= j for i in range(len(response))), tuple(range(j)))
            rows.append(build_refusion_sequence(Example(prompt, response), plan, mask_id))
        return rows, [P + j for j in js]
    ex = _eos_padded(Example(prompt, response), eos_id, EOS_PAD_MULTIPLE)
    n = len(ex.response)
    rows = [(ex, [i >= j for i in range(n)], [1.0] * n) for j in js]
    shift = 1 if name == "dream" else 0
    return rows, [P + j - shift for j in js]


@torch.no_grad()
def result_digit_accuracy(model, tokenizer, name: str, docs: list[dict], mask_id: int | None,
                          eos_id: int, chunk: int = 64) -> dict[str, float]:
    """Share of intermediate-result digits (and of their leading digits) the model's decoding head
    predicts right from a clean prefix, over ``docs`` (math items with ``query`` and ``response``)."""
    from refusion.tokenizer import encode_chat

    if name not in PROBED:
        raise KeyError(f"unknown model {name!r}; probed: {', '.join(PROBED)}")
    model.eval()
    hits: list[tuple[bool, bool]] = []  # (predicted right, is a leading digit) per probed digit
    pending: list[tuple] = []  # (row, index, target, is_leading)

    def flush() -> None:
        if not pending:
            return
        rows = [p[0] for p in pending]
        if name == "refusion":
            ids = _pad([r["input_ids"] for r in rows], tokenizer.pad_token_id)
            valid = _pad([[True] * len(r["input_ids"]) for r in rows], False)
            batch = {"input_ids": ids, "position_ids": _pad([r["position_ids"] for r in rows], 0),
                     "attention_mask": additive_mask(valid, causal=True)}
        else:
            batch = _mdm_batch(rows, mask_id, tokenizer.pad_token_id, shift=False,
                               block_size=D2F_BLOCK if name == "d2f" else None)
        pred = _logits(model, batch).argmax(-1)  # [B, L]
        hits.extend((int(pred[b, idx]) == target, lead) for b, (_, idx, target, lead) in enumerate(pending))
        pending.clear()

    for doc in docs:
        prompt = encode_chat(tokenizer, doc["query"])
        response, targets = result_targets(tokenizer, doc["response"])
        if name == "ar":  # one causal forward scores every position at once
            pred = _logits(model, collate_ar([Example(prompt, response)], tokenizer.pad_token_id)).argmax(-1)[0]
            hits.extend((int(pred[len(prompt) + j - 1]) == response[j], lead) for j, lead in targets)
            continue
        rows, idx = _probe_rows(name, prompt, response, [j for j, _ in targets], mask_id, eos_id)
        for row, i, (j, lead) in zip(rows, idx, targets):
            pending.append((row, i, response[j], lead))
            if len(pending) >= chunk:
                flush()
    flush()
    leads = [ok for ok, lead in hits if lead]
    return {"probe_result_digits": sum(ok for ok, _ in hits) / len(hits) if hits else 0.0,
            "probe_first_digits": sum(leads) / len(leads) if leads else 0.0}
