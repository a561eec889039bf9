"""Example decoder of docs/extending.md: LLaDA decoding that unmasks left to right.

The stock ``llada`` decoder unmasks, at each step of a block, the block's most confident masked
positions. This variant unmasks the *leftmost* ones instead: the same forwards and the same
proposals, only the choice of positions differs. It is written entirely from the public building
blocks of ``refusion.decoding`` (common.py: the meter and the counted forward; mdm.py: the canvas,
the proposal, the commit and the stopping test), so it is counted, traced and stopped at EOS like
every other decoder.

To use it in runs, copy this file to ``refusion/decoding/ltr_llada.py`` and add one line to the
registry in ``refusion/decoding/__init__.py``::

    register("ltr_llada", ltr_llada, LtrLladaKnobs, batched=True, causal=False, masked_diffusion=True)

From then on ``MODELS=x=checkpoints/tiny/mdm:ltr_llada`` works in ``make eval`` and
tests/test_conformance.py checks it with every other decoder. tests/test_conformance.py runs this
file as it is (``register_example``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refusion.decoding import Decoder, register
from refusion.decoding.common import Meter, cut_after_eos, eos_ids, forward, make_generator, mask_id
from refusion.decoding.knobs import Knobs, compile_knob, gen_length, seed, temperature
from refusion.decoding.mdm import (block_length_knob, block_schedule, check_steps, commit_topk, finished, llada_propose,
                                   masked_start, steps_knob, stop_at_eos_knob, tokens_per_step_knob)


@dataclass(frozen=True)
class LtrLladaKnobs(Knobs):
    """Knobs of ``ltr_llada``: those of ``llada`` without ``remasking`` (the order is fixed)."""
    gen_length: int = gen_length(128)
    steps: int = steps_knob()
    tokens_per_step: int = tokens_per_step_knob()  # set, it replaces steps (block_schedule reads it)
    block_length: int = block_length_knob()
    temperature: float = temperature()
    stop_at_eos: bool = stop_at_eos_knob()
    seed: int = seed()
    compile: bool = compile_knob()  # every decoder has it: Meter(..., compile=) does the rest

    def check(self) -> None:
        check_steps(self)  # block_length divides gen_length; steps a multiple of the block count


@torch.no_grad()
def ltr_llada(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
              knobs: LtrLladaKnobs | dict | None = None, *, mask_token_id: int | None = None,
              eos_token_id: int | list[int] | None = None, **overrides) -> tuple[list[torch.Tensor], dict]:
    """Blocks left to right; each of a block's steps / n_blocks full forwards proposes a token for every
    masked position and commits the leftmost masked ones. input_ids [B, P] left-padded; returns one
    1-D response per row, cut after its first EOS, and the stats of ``Meter.finish``."""
    k = LtrLladaKnobs.of(knobs, overrides, "ltr_llada")
    mask, eos = mask_id(model, mask_token_id), eos_ids(model, eos_token_id)
    gen = make_generator(input_ids.device, k.seed)
    meter = Meter(model, ("step",), compile=k.compile)  # one phase: every forward is a full one
    x, attn, pos = masked_start(model, input_ids, attention_mask, k.gen_length, mask)  # [B, P+G] each
    p0 = input_ids.shape[1]
    n_blocks, schedule = block_schedule(k)  # tokens committed at each step of a block, as llada
    meter.track(x.shape[0], k.gen_length, x.device)  # the commit log: which forward fixed each token
    # Position score: the leftmost position ranks first ([block], larger = earlier).
    leftness = -torch.arange(k.block_length, dtype=torch.float32, device=x.device)
    for b in range(n_blocks):
        lo, hi = p0 + b * k.block_length, p0 + (b + 1) * k.block_length
        for n in schedule:
            logits = forward(model, meter, "step", x, position_ids=pos, attention_mask=attn)[:, lo:hi]
            x0, _ = llada_propose(logits, k.temperature, gen, mask)  # [B, block]: a token per position
            block = x[:, lo:hi]  # a view: commits land in x
            score = torch.where(block == mask, leftness.expand_as(x0), torch.full_like(x0, -torch.inf,
                                                                                           dtype=torch.float32))
            commit_topk(block, x0, score, torch.full((x.shape[0],), n, device=x.device))
            meter.settle(x[:, p0:], mask)  # after every forward: records what it committed
        if k.stop_at_eos and finished(x, p0, hi, eos):
            break
    responses = [cut_after_eos(row, eos) for row in x[:, p0:]]
    return responses, meter.finish(responses)


def register_example() -> Decoder:
    """Register ``ltr_llada`` in ``refusion.decoding.DECODERS`` (what the one registry line above does)."""
    return register("ltr_llada", ltr_llada, LtrLladaKnobs, batched=True, causal=False, masked_diffusion=True)
