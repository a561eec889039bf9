"""LLaDA2.x block diffusion with a confidence threshold (inclusionAI LLaDA2.0-mini / -flash on
refusion/llada2_moe.py): the loop of dInfer's ``BlockDiffusionLLM`` with ``ThresholdParallelDecoder``
(temperature 0) and the prefix KV cache of a block-diffusion model (python/dinfer/decoding/
generate_uniform.py, parallel_strategy.py, utils.py at commit fce4e32), the setup dInfer's README and
benchmarks/benchmark.py give LLaDA2 (``--use_bd --cache prefix --parallel_decoding threshold
--threshold 0.9 --block_length 32``), written as this project's decoders are (docs/models.md).

Blocks are counted from the prompt's first token: the sequence is prompt + masks up to
ceil((P + gen_length) / B) * B tokens, block b covers [bB, (b + 1)B), and the first block decoded is the one
holding the prompt's end (it may start inside the prompt). The model attends block-causally: a token sees
every earlier block and its whole own block.

  prefill   one forward of the prompt's whole blocks, [0, max(first, B)) (first = the first decoded block's
            start), under the block-causal mask; it writes the cache of [0, first). A prompt shorter than a
            block still gets this forward, of its first block with the masks in it, as dInfer runs it; its
            cache is not used (the block is decoded next, over an empty prefix).
  denoise   forwards of the current block over the cached prefix (the cache is not extended): at every
            masked position the argmax and its softmax probability (float32); a position whose argmax is the
            mask token is not a candidate; every candidate with probability >= min(threshold, best - 1e-5) is
            committed (so the best one at least). dInfer runs these in rounds of
            max(2, min(4, masks // 8)) forwards (masks counted at the round's start), so up to a round's last
            forward may see a block with no mask left; every one is counted, as dInfer counts it.
  store     one more forward of the finished block, whose keys and values extend the cache -- unless the
            round's last forward already saw the finished block (then its keys and values are kept).
  stop      a row whose block holds an EOS id among its response tokens ends after that block.

A left-padded batch decodes each row exactly as alone (its own block grid, positions from its first token,
its own prefix visible): the rows go through their blocks together, a row whose block is finished riding
along (its block then has no mask, so nothing changes; its keys and values are those of its finished block
either way), and a row that ended leaves the batch. Responses are cut after the first EOS and to gen_length
(dInfer returns whole blocks; the tokens past the budget are dropped, as ``diffusion_gemma`` drops whole
canvases').

Where this differs from dInfer, on purpose: its early stop looks for EOS in the whole block, so an EOS id
in the prompt's last partial block would end the answer after one block; here only response tokens count.
And a row whose every masked position predicts the mask token would make dInfer loop for ever; here the
call's forward budget stops it (``ForwardBudgetExceeded``).

Counting (docs/design.md §6): phases ``prefill``, ``denoise``, ``store``; NFE = all three (dInfer's
``num_forwards`` for a batch of one); TPF = generated tokens / NFE. A token is committed by the denoise
forward it was unmasked from. Extra stats: block_length, blocks (row blocks decoded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import DynamicCache

from .common import (Meter, cache_keep, cut_after_eos, eos_ids, forward, is_eos, left_padding_mask, mask_id)
from .knobs import Knobs, gen_length, knob

# dInfer's BlockRunner defaults (generate_uniform.py): rounds of denoise forwards
EXPECTED_TPF, MAX_UNROLL, MIN_UNROLL = 8, 4, 2


@dataclass(frozen=True)
class Llada2Knobs(Knobs):
    """Knobs of ``llada2``; defaults: dInfer's LLaDA2 setup (module doc)."""
    gen_length: int = gen_length(256)
    block_length: int = knob(32, "tokens per block, counted from the prompt's first token (LLaDA2 is trained "
                             "with blocks of 32)", low=1)
    threshold: float = knob(0.9, "commit every masked token whose probability is >= this in a denoise step (the "
                            "most likely one at least); above 1: one token per step", low=0.0)
    # harness trace: the blocks start at the prompt's start, so the answer's first block is partial
    blocks_from_prompt_start: ClassVar[bool] = True


def threshold_step(logits: torch.Tensor, block: torch.Tensor, mask: int, threshold: float) -> torch.Tensor:
    """One ThresholdParallelDecoder step at temperature 0 (parallel_strategy.py): block [b, B] with logits
    [b, B, V] -> the block with its confident masked positions committed (module doc)."""
    guess = logits.argmax(-1)
    prob = torch.softmax(logits.float(), dim=-1).gather(-1, guess[..., None]).squeeze(-1)
    masked = block == mask
    conf = torch.where(masked & (guess != mask), prob, torch.full_like(prob, float("-inf")))
    bar = (conf.max(dim=1).values - 1e-5).clamp(-1000, threshold)[:, None]
    return torch.where((conf >= bar) & masked, guess, block)


def block_causal(pos_q: torch.Tensor, pos_k: torch.Tensor, block: int) -> torch.Tensor:
    """bool [b, q, k]: query at position pos_q sees key at pos_k when the key's block is not after its own."""
    return (pos_k[:, None, :] // block) <= (pos_q[:, :, None] // block)


@torch.no_grad()
def llada2(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    knobs: Llada2Knobs | dict | None = None,
    *,
    eos_token_id: int | list[int] | None = None,
    mask_token_id: int | None = None,
    **overrides,
) -> tuple[list[torch.Tensor], dict]:
    """LLaDA2 threshold block diffusion (module doc) of a left-padded batch, every row as alone.

    model: refusion.llada2_moe.LLaDA2MoeModelLM (or any model taking position ids, a cache and a [b, 1, q, kv]
    mask); input_ids [n, P] left-padded, attention_mask [n, P] (1 = real token)."""
    k = Llada2Knobs.of(knobs, overrides, "llada2")
    size, eos, mask = k.block_length, eos_ids(model, eos_token_id), mask_id(model, mask_token_id)
    device, n = input_ids.device, input_ids.shape[0]
    plen = left_padding_mask(input_ids, attention_mask).sum(-1).tolist()
    total = [-(-(p + k.gen_length) // size) * size for p in plen]  # whole blocks, as dInfer lays them out
    first = [p // size * size for p in plen]
    width = max(total)
    x = torch.full((n, width), mask, dtype=torch.long, device=device)  # each row from its first real token
    for r, p in enumerate(plen):
        x[r, :p] = input_ids[r, input_ids.shape[1] - p:]
    resp_len = max(t - p for t, p in zip(total, plen))
    resp_cols = torch.tensor(plen, device=device)[:, None] + torch.arange(resp_len, device=device)
    resp_cols = resp_cols.clamp(max=width - 1)
    meter = Meter(model, ("prefill", "denoise", "store"))
    meter.track(n, resp_len, device)

    def settle() -> None:
        meter.settle(x.gather(1, resp_cols), mask)

    # prefill: each row's [0, max(first, B)), left-padded to a common width; pads see only themselves
    pre = [max(f, size) for f in first]
    wide = max(pre)
    ids = torch.full((n, wide), mask, dtype=torch.long, device=device)
    pos = torch.zeros(n, wide, dtype=torch.long, device=device)
    real = torch.zeros(n, wide, dtype=torch.bool, device=device)
    for r, f in enumerate(pre):
        ids[r, wide - f:], pos[r, wide - f:], real[r, wide - f:] = x[r, :f], torch.arange(f, device=device), True
    eye = torch.eye(wide, dtype=torch.bool, device=device)[None]
    visible = (block_causal(pos, pos, size) & real[:, None, :] & real[:, :, None]) | (eye & ~real[:, :, None])
    cache = DynamicCache(config=model.config)
    forward(model, meter, "prefill", ids, position_ids=pos, visible=visible, cache=cache)
    settle()
    # the cache columns each row may read: its prefix [0, first); a row with first 0 reads none of the prefill
    seen = real & torch.tensor([f > 0 for f in first], device=device)[:, None]

    live, blocks = list(range(n)), 0
    for j in range(-(-width // size)):
        go = [i for i, r in enumerate(live) if first[r] + j * size < total[r]]
        if not go:
            break
        if len(go) < len(live):
            idx = torch.tensor(go, device=device)
            cache.batch_select_indices(idx)
            seen = seen[idx]
            live = [live[i] for i in go]
        blocks += len(live)
        starts = torch.tensor([first[r] + j * size for r in live], device=device)
        cols = starts[:, None] + torch.arange(size, device=device)  # [b, B] positions of each row's block
        rows = torch.tensor(live, device=device)
        block = x[rows[:, None], cols]
        prefix = cache.get_seq_length()
        visible = torch.cat([seen[:, None, :].expand(-1, size, -1),
                             torch.ones(len(live), size, size, dtype=torch.bool, device=device)], dim=-1)
        last_saw_mask = None
        while bool((block == mask).any()):
            rounds = max(min(int((block == mask).sum()) // EXPECTED_TPF, MAX_UNROLL), MIN_UNROLL)
            for _ in range(rounds):
                last_saw_mask = bool((block == mask).any())
                cache_keep(cache, prefix)
                logits = forward(model, meter, "denoise", block, position_ids=cols, visible=visible, cache=cache)
                block = threshold_step(logits, block, mask, k.threshold)
                x[rows[:, None], cols] = block
                settle()
        if last_saw_mask is not False:  # else the last forward's keys and values are the finished block's
            cache_keep(cache, prefix)
            forward(model, meter, "store", block, position_ids=cols, visible=visible, cache=cache)
            settle()
        seen = torch.cat([seen, torch.ones(len(live), size, dtype=torch.bool, device=device)], dim=1)
        answer = cols >= torch.tensor([plen[r] for r in live], device=device)[:, None]
        for r, e in zip(live, (is_eos(block, eos) & answer).any(-1).tolist()):
            if e:  # the row ends with this block
                total[r] = first[r] + (j + 1) * size
    responses = [cut_after_eos(x[r, plen[r]:total[r]], eos)[:k.gen_length] for r in range(n)]
    return responses, meter.finish(responses, block_length=size, blocks=blocks)
