"""Masked-diffusion baselines on a bidirectional model (docs/design.md §4): LLaDA-style
semi-autoregressive low-confidence / random remasking, and Fast-dLLM (block-wise prefix
or dual KV cache + confidence-threshold parallel decoding).

The model is a Qwen3ForCausalLM whose config has is_causal=False (bidirectional) and a
mask_token_id; the logit at position i predicts the token at position i (no shift).
Batches are left-padded; the padding mask travels as a 2-D mask, so the model's own
bidirectional mask hides pads. Response region: gen_length mask tokens after the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .common import (
    Meter,
    cache_keep,
    cut_after_eos,
    eos_ids,
    forward,
    is_eos,
    make_generator,
    mask_id,
    padding_mask,
    pick,
    positions_from_mask,
    token_prob,
)
from .knobs import Knobs, gen_length, knob, seed, temperature


def _block_length() -> int:
    return knob(32, "tokens per block, decoded left to right (must divide gen_length)", low=1)


def _stop_at_eos() -> bool:
    return knob(True, "stop after the first block at which every row holds an EOS (same tokens, fewer forwards)")


def _check_blocks(k) -> None:
    if k.block_length > k.gen_length or k.gen_length % k.block_length:
        raise ValueError(f"block_length must divide gen_length {k.gen_length}, got {k.block_length}")


@dataclass(frozen=True)
class LladaKnobs(Knobs):
    """Knobs of ``llada`` (docs/design.md §4)."""
    gen_length: int = gen_length(128)
    steps: int = knob(None, "forwards in all (default gen_length: one token per step); a multiple of the block "
                      "count, at most gen_length", low=1, optional=True)
    block_length: int = _block_length()
    remasking: str = knob("low_confidence", "which masked tokens a step unmasks",
                          choices=("low_confidence", "random"))
    temperature: float = temperature()
    stop_at_eos: bool = _stop_at_eos()
    seed: int = seed()

    def check(self) -> None:
        _check_blocks(self)
        n_blocks = self.gen_length // self.block_length
        steps = self.gen_length if self.steps is None else self.steps
        if not n_blocks <= steps <= self.gen_length or steps % n_blocks:
            raise ValueError(f"steps must be a multiple of the block count {n_blocks} in [{n_blocks}, "
                             f"{self.gen_length}], got {self.steps}")


@dataclass(frozen=True)
class FastDllmKnobs(Knobs):
    """Knobs of ``fast_dllm`` (docs/design.md §4)."""
    gen_length: int = gen_length(128)
    block_length: int = _block_length()
    threshold: float = knob(0.9, "unmask every masked token whose confidence passes this (at least one per "
                            "step); >= 1 means one token per step", low=0.0)
    cache: str = knob("dual", "KV reuse inside a block: none, prefix, or prefix and suffix (dual)",
                      choices=("none", "prefix", "dual"))
    temperature: float = temperature()
    stop_at_eos: bool = _stop_at_eos()
    seed: int = seed()

    def check(self) -> None:
        _check_blocks(self)


def _start(model, input_ids, attention_mask, gen_length, mask):
    """x [B, P+G] = prompt then G masks; 2-D padding mask and position ids of the same shape."""
    pad = padding_mask(input_ids, attention_mask)
    batch = input_ids.shape[0]
    x = torch.cat([input_ids, torch.full((batch, gen_length), mask, dtype=torch.long, device=input_ids.device)], 1)
    attn = torch.cat([pad, torch.ones(batch, gen_length, dtype=torch.long, device=input_ids.device)], 1)
    return x, attn, positions_from_mask(attn)


def _commit_topk(x, x0, conf, k) -> None:
    """Write x0 into x at the k highest-confidence entries of each row (conf -inf = not eligible).

    x, x0, conf: [B, n] views of the current block; k: [B] long, per-row count.
    """
    order = conf.argsort(dim=-1, descending=True, stable=True)  # stable: ties go to the leftmost
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(conf.shape[1], device=conf.device).expand_as(order))
    chosen = (rank < k[:, None]) & torch.isfinite(conf)
    x[chosen] = x0[chosen]


def _propose(logits, temperature, gen):
    """Proposed token per position and its confidence, the *untempered* softmax probability
    (as in LLaDA: sampling noise picks the token, the model's own probability ranks it)."""
    x0, prob = pick(logits, temperature, gen)
    if temperature > 0:
        prob = token_prob(logits, x0, 0.0)
    return x0, prob


def _finished(x, prompt_len, end, eos) -> bool:
    """True when every row has an EOS in its decoded response x[:, prompt_len:end] (all of it decoded)."""
    return bool(is_eos(x[:, prompt_len:end], eos).any(-1).all())


@torch.no_grad()
def llada(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    knobs: LladaKnobs | dict | None = None,
    *,
    mask_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    **overrides,
) -> tuple[list[torch.Tensor], dict]:
    """LLaDA semi-autoregressive decoding: blocks left to right, steps / n_blocks full
    forwards per block, each unmasking a fixed number of the block's masked tokens -- the
    most confident (low_confidence) or random ones (random); no KV cache.

    steps (default gen_length: one token per step) must be a multiple of the block
    count and at most gen_length. stop_at_eos ends
    after the first block at which every row holds an EOS (later blocks cannot change
    earlier ones, so the response is the same; only the cost drops).
    """
    k = LladaKnobs.of(knobs, overrides, "llada")
    gen_length, block_length, remasking, temperature = k.gen_length, k.block_length, k.remasking, k.temperature
    n_blocks = gen_length // block_length
    steps = gen_length if k.steps is None else k.steps
    mask, eos = mask_id(model, mask_token_id), eos_ids(model, eos_token_id)
    gen = make_generator(input_ids.device, k.seed)
    meter = Meter(model, ("step",))
    x, attn, pos = _start(model, input_ids, attention_mask, gen_length, mask)
    p0, per_block = input_ids.shape[1], steps // n_blocks
    # Tokens unmasked at each step of a block: block_length spread evenly, remainder first.
    schedule = [block_length // per_block + (i < block_length % per_block) for i in range(per_block)]
    for b in range(n_blocks):
        lo, hi = p0 + b * block_length, p0 + (b + 1) * block_length
        for n_unmask in schedule:
            logits = forward(model, meter, "step", x, position_ids=pos, attention_mask=attn)[:, lo:hi]
            x0, prob = _propose(logits, temperature, gen)  # [B, block]
            if remasking == "random":
                prob = torch.rand(prob.shape, generator=gen, device=prob.device)
            block = x[:, lo:hi]
            conf = torch.where(block == mask, prob, torch.full_like(prob, -torch.inf))
            _commit_topk(block, x0, conf, torch.full((x.shape[0],), n_unmask, device=x.device))
        if k.stop_at_eos and _finished(x, p0, hi, eos):
            break
    responses = [cut_after_eos(row, eos) for row in x[:, p0:]]
    return responses, meter.finish(responses)


@torch.no_grad()
def fast_dllm(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    knobs: FastDllmKnobs | dict | None = None,
    *,
    mask_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    **overrides,
) -> tuple[list[torch.Tensor], dict]:
    """Fast-dLLM: per block, unmask every masked token whose confidence > threshold (at
    least the single most confident one per row per step) until the block is full.

    cache="none": every step is a full forward. "prefix": the first step of a block is
    a full forward whose KV of everything before the block is kept (approximate: it is
    refreshed only at block boundaries); later steps forward block + suffix after it.
    "dual": the full forward's KV of prefix and suffix are both kept and later steps
    forward the block alone. threshold >= 1 means exactly one token per step.
    Phases: full (whole-sequence forwards) and cached (steps reusing the block cache).
    """
    k = FastDllmKnobs.of(knobs, overrides, "fast_dllm")
    gen_length, block_length, threshold, temperature = k.gen_length, k.block_length, k.threshold, k.temperature
    cache_mode = k.cache
    mask, eos = mask_id(model, mask_token_id), eos_ids(model, eos_token_id)
    gen = make_generator(input_ids.device, k.seed)
    meter = Meter(model, ("full", "cached"))
    x, attn, pos = _start(model, input_ids, attention_mask, gen_length, mask)
    p0, total = input_ids.shape[1], x.shape[1]
    for b in range(gen_length // block_length):
        lo, hi = p0 + b * block_length, p0 + (b + 1) * block_length
        kv = None
        while bool((x[:, lo:hi] == mask).any()):
            if kv is None:
                kv = None if cache_mode == "none" else DynamicCache(config=model.config)
                logits = forward(model, meter, "full", x, position_ids=pos, attention_mask=attn, cache=kv)[:, lo:hi]
                if cache_mode == "prefix":
                    cache_keep(kv, lo)  # keep positions < lo (x is in position order)
                elif cache_mode == "dual":
                    cache_keep(kv, lo, torch.arange(hi - lo, total - lo, device=x.device))  # prefix + suffix
            elif cache_mode == "prefix":
                logits = forward(model, meter, "cached", x[:, lo:], position_ids=pos[:, lo:], attention_mask=attn,
                                 cache=kv)[:, : hi - lo]
                cache_keep(kv, lo)
            else:  # dual: cache order is prefix, suffix, then the block just forwarded
                order = torch.cat([attn[:, :lo], attn[:, hi:], attn[:, lo:hi]], 1)
                logits = forward(model, meter, "cached", x[:, lo:hi], position_ids=pos[:, lo:hi], attention_mask=order,
                                 cache=kv)
                cache_keep(kv, lo + total - hi)
            x0, prob = _propose(logits, temperature, gen)  # [B, block]
            block = x[:, lo:hi]
            masked = block == mask
            conf = torch.where(masked, prob, torch.full_like(prob, -torch.inf))
            # Count per row: all above threshold, at least one while the row has masks left.
            n_unmask = torch.maximum((conf > threshold).sum(-1), masked.any(-1).long())
            _commit_topk(block, x0, conf, n_unmask)
        if k.stop_at_eos and _finished(x, p0, hi, eos):
            break
    responses = [cut_after_eos(row, eos) for row in x[:, p0:]]
    return responses, meter.finish(responses)
