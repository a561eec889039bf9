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

from .block_loop import BlockGrid, BlockRule, BlockRun, decode_blocks, prefill_blocks
from .cache import new_cache
from .knobs import Knobs, compile_knob, gen_length, knob
from .tokens import eos_ids, mask_id

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
    compile: bool = compile_knob()
    # harness trace: the blocks start at the prompt's start, so the answer's first block is partial
    blocks_from_prompt_start: ClassVar[bool] = True


def llada2_propose(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaDA2's proposal at temperature 0 (ThresholdParallelDecoder, parallel_strategy.py): logits [b, B, V] ->
    (the argmax [b, B], its softmax probability in float32 [b, B])."""
    guess = logits.argmax(-1)
    prob = torch.softmax(logits.float(), dim=-1).gather(-1, guess[..., None]).squeeze(-1)
    return guess, prob


def threshold_step(block: torch.Tensor, guess: torch.Tensor, prob: torch.Tensor, mask: int,
                   threshold: float) -> torch.Tensor:
    """One ThresholdParallelDecoder step: block [b, B] with the proposal (``llada2_propose``) -> the block with its
    confident masked positions committed (module doc)."""
    masked = block == mask
    conf = torch.where(masked & (guess != mask), prob, torch.full_like(prob, float("-inf")))
    bar = (conf.max(dim=1).values - 1e-5).clamp(-1000, threshold)[:, None]
    return torch.where((conf >= bar) & masked, guess, block)


class Llada2Rule(BlockRule):
    """LLaDA2's step rule for the shared block loop (block_loop.decode_blocks): prefill the prompt's whole blocks
    (one block at least), denoise a block in dInfer's rounds by ``threshold_step`` until no mask is left, store it
    unless the round's last forward already saw it finished."""
    phases = ("prefill", "denoise", "store")
    aligned = True

    def __init__(self, k: Llada2Knobs, mask: int):
        self.k, self.fill, self.size, self.gen_length = k, mask, k.block_length, k.gen_length
        self.compile = k.compile
        self.saw_finished = False  # the block's last denoise forward saw it with no mask: its KV is the store's

    def budget(self, grid: BlockGrid) -> tuple[int, int | None]:
        # the response width of dInfer's layout: whole blocks from the prompt's first token
        return max(s + n * self.size - p for s, n, p in zip(grid.starts, grid.blocks, grid.lengths)), None

    def start(self, run: BlockRun, input_ids: torch.Tensor, pad: torch.Tensor) -> None:
        # dInfer's prefill: [0, max(first, B)) of each row; a row whose first decoded block is its first block
        # (first 0) prefills that block with its masks and reads none of it (decoded next, over an empty prefix)
        run.cache = new_cache(run.model, run.meter)
        widths = [max(s, self.size) for s in run.grid.starts]
        real = prefill_blocks(run, input_ids, widths, self.fill)
        run.seen = real & torch.tensor([s > 0 for s in run.grid.starts], device=run.device)[:, None]

    def decide(self, run: BlockRun, j: int, block: torch.Tensor | None) -> torch.Tensor:
        """dInfer's rounds of max(2, min(4, masks // 8)) denoise forwards while the block [b, size] has a mask."""
        mask, meter, last_saw_mask, g = self.fill, run.meter, None, run.grid
        # response column of block position p in live row i: start of the block - prompt length + p
        offset = [g.starts[b] + j * g.size - g.lengths[b] for b in run.live]
        while bool((block == mask).any()):
            rounds = max(min(int((block == mask).sum()) // EXPECTED_TPF, MAX_UNROLL), MIN_UNROLL)
            for _ in range(rounds):
                last_saw_mask = bool((block == mask).any())
                logits = run.forward_block("denoise", block)
                new = threshold_step(block, *llada2_propose(logits), mask, self.k.threshold)
                del logits  # before the next forward (docs/design.md §6)
                for i, p in (new != block).nonzero().tolist():  # newly committed
                    if offset[i] + p >= 0:  # a mask id in the prompt's tail is no response
                        meter.commit(run.live[i], [offset[i] + p], [meter.calls - 1], ["denoise"])
                block = new
        self.saw_finished = last_saw_mask is False
        return block

    def store(self, run: BlockRun, block: torch.Tensor) -> None:
        if not self.saw_finished:  # else the last forward's keys and values are the finished block's
            run.forward_block("store", block, logits=False)

    def stats(self, run: BlockRun) -> dict:
        return {"block_length": self.size, "blocks": run.row_blocks}


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
    eos, mask = eos_ids(model, eos_token_id), mask_id(model, mask_token_id)
    return decode_blocks(model, input_ids, attention_mask, Llada2Rule(k, mask), eos)
