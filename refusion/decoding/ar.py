"""Autoregressive baseline decoder (docs/design.md §4 "AR"): greedy or temperature sampling
with a KV cache, batch >= 1 with left padding.
"""

from __future__ import annotations

import torch

from dataclasses import dataclass

from .cache import new_cache
from .common import Meter, forward
from .knobs import Knobs, compile_knob, gen_length, seed, temperature
from .proposals import make_generator, propose
from .tokens import cut_after_eos, eos_ids, is_eos, padding_mask, positions_from_mask


@dataclass(frozen=True)
class ArKnobs(Knobs):
    """Knobs of ``ar``."""
    gen_length: int = gen_length(256)
    temperature: float = temperature()
    seed: int = seed()
    compile: bool = compile_knob()


@torch.no_grad()
def ar(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    knobs: ArKnobs | dict | None = None,
    *,
    eos_token_id: int | list[int] | None = None,
    mask_token_id: int | None = None,
    **overrides,
) -> tuple[list[torch.Tensor], dict]:
    """Decode at most `gen_length` tokens per row, one forward per token.

    input_ids [B, P] left-padded, attention_mask [B, P] (1 = real token); ``knobs`` an
    ``ArKnobs`` (or dict), keyword ``overrides`` replace its fields. Returns one
    1-D response per row, cut after its first EOS. `mask_token_id` is accepted and
    ignored so every decoder takes the same special-id keywords.
    Phases: prefill (the prompt forward, which also yields the first token) and step.
    """
    k = ArKnobs.of(knobs, overrides, "ar")
    gen_length, temperature = k.gen_length, k.temperature
    eos = eos_ids(model, eos_token_id)
    device = input_ids.device
    gen = make_generator(device, k.seed)
    meter = Meter(model, ("prefill", "step"), compile=k.compile)

    mask = padding_mask(input_ids, attention_mask)  # [B, P]
    batch = input_ids.shape[0]
    meter.track(batch, gen_length, device)  # commit order: token t comes from forward t
    cache = new_cache(model, meter)
    logits = forward(
        model, meter, "prefill", input_ids,
        position_ids=positions_from_mask(mask), attention_mask=mask, cache=cache, keep=slice(-1, None),
    )[:, -1]  # [B, V]: left padding puts every row's last real token at the end
    next_pos = mask.sum(-1, keepdim=True)  # [B, 1] position of the first response token

    # Everything a step needs is laid out once (docs/design.md §6, "work outside the forwards"): the
    # padding mask of every length [B, P + G] and the response positions [B, G] are sliced per step, and
    # the tokens go into a preallocated [B, G]; the EOS check reads the step's B tokens on the host once.
    full_mask = torch.cat([mask, mask.new_ones(batch, gen_length)], 1)  # [B, P + G]
    positions = next_pos + torch.arange(gen_length, device=device)  # [B, G]
    out = torch.empty(batch, gen_length, dtype=torch.long, device=device)
    eos_set, done = frozenset(eos), [False] * batch
    n_prompt, n = mask.shape[1], 0
    for step in range(gen_length):
        tok, _ = propose(logits, temperature, gen)  # [B]
        del logits  # a float32 model's prefill logits are a view of all [B, P, V]: gone before the next forward
        out[:, step] = tok
        n = step + 1
        meter.settle(out[:, :n])
        done = [d or t in eos_set for d, t in zip(done, tok.tolist())]
        if all(done) or step == gen_length - 1:
            break
        # Finished rows keep decoding junk that is cut afterwards; one batched call.
        logits = forward(
            model, meter, "step", tok[:, None],
            position_ids=positions[:, step:n], attention_mask=full_mask[:, :n_prompt + n], cache=cache,
        )[:, -1]
    out = out[:, :n]
    responses = [cut_after_eos(row, eos) for row in out]
    return responses, meter.finish(responses)
