"""Example decoder of docs/extending.md: LLaDA decoding that unmasks left to right.

The stock ``llada`` decoder unmasks, at each step of a block, the block's most confident masked
positions. This variant unmasks the *leftmost* ones instead: the same forwards and the same
proposals, only the choice of positions differs. So it is ``llada``'s step rule with another step
(``LladaRule.step``): the shared block loop (block_loop.py ``decode_blocks``) runs it, so it is
counted, traced and stopped at EOS like every other decoder, and it writes no loop of its own.

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
from refusion.decoding.block_loop import BlockRun, decode_blocks
from refusion.decoding.common import proposal
from refusion.decoding.knobs import Knobs, compile_knob, gen_length, seed, temperature
from refusion.decoding.mdm import (LladaRule, block_length_knob, check_steps, llada_propose, steps_knob,
                                   stop_at_eos_knob, tokens_per_step_knob)
from refusion.decoding.proposals import make_generator
from refusion.decoding.tokens import eos_ids, mask_id


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
    compile: bool = compile_knob()  # the loop's Meter(..., compile=) does the rest

    def check(self) -> None:
        check_steps(self)  # block_length divides gen_length; steps a multiple of the block count


class LtrLladaRule(LladaRule):
    """``llada``'s rule (its canvas, blocks and schedule: the shared block loop runs them) with another step:
    the same forward and proposal, then the schedule's count of the *leftmost* open positions of each row."""

    def step(self, run: BlockRun, lo: int, hi: int, s: int, open_: list[list[int]]):
        x0, _ = proposal(run.model, run.meter, "step", self.x, slice(lo, hi), None,  # [B, block]: a token each
                         lambda lg: llada_propose(lg, self.k.temperature, self.gen, self.mask),
                         position_ids=self.pos, attention_mask=self.attn)
        return x0, [op[:self.schedule[s]] for op in open_]  # open positions are ascending: the leftmost first


@torch.no_grad()
def ltr_llada(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
              knobs: LtrLladaKnobs | dict | None = None, *, mask_token_id: int | None = None,
              eos_token_id: int | list[int] | None = None, **overrides) -> tuple[list[torch.Tensor], dict]:
    """Blocks left to right; each of a block's steps / n_blocks full forwards proposes a token for every
    masked position and commits the leftmost masked ones. input_ids [B, P] left-padded; returns one
    1-D response per row, cut after its first EOS, and the stats of ``Meter.finish``."""
    k = LtrLladaKnobs.of(knobs, overrides, "ltr_llada")
    mask, eos = mask_id(model, mask_token_id), eos_ids(model, eos_token_id)
    return decode_blocks(model, input_ids, attention_mask, LtrLladaRule(k, mask, make_generator(input_ids.device,
                                                                                                 k.seed)), eos)


def register_example() -> Decoder:
    """Register ``ltr_llada`` in ``refusion.decoding.DECODERS`` (what the one registry line above does)."""
    return register("ltr_llada", ltr_llada, LtrLladaKnobs, batched=True, causal=False, masked_diffusion=True)
