"""SDAR block diffusion (JetAstra/SDAR: SDAR-1.7B/4B/8B-Chat on Qwen3, SDAR-30B-A3B on Qwen3-MoE): the loop of
the authors' ``block_diffusion_generate`` (generate.py, commit c2041a8), written as this project's decoders are
(docs/design.md §4b), on the stock Qwen3 class with the block-causal mask built here.

The response is decoded in blocks of ``block_length`` tokens laid on the absolute positions: block i holds
positions [i * block_length, (i + 1) * block_length), so the first block decoded also holds the last
``prompt_length % block_length`` prompt tokens. A block sees itself and every earlier block (block-causal).

  prefill   one forward of the prompt's whole blocks, writing their KV (none when the prompt is shorter than a
            block);
  denoise   per block, at most ``denoising_steps + 1`` forwards of the block against the cache, which they read
            and do not write: at each a token is drawn for every position from softmax(logits / temperature)
            (after top_k / top_p) and some are committed by ``remasking_strategy`` with the step's quota
            (``block_length`` split evenly over ``denoising_steps``, the first steps taking the remainder):
              low_confidence_dynamic  every masked position whose drawn token's probability is above
                                      ``confidence_threshold`` when they are at least the quota, else the quota
                                      of highest probability (generate.py's default);
              low_confidence_static   the quota of highest probability;
              sequential              the quota from the first masked position on, left to right;
              entropy_bounded         the masked positions in order of their entropy while the running sum stays
                                      below ``eb_threshold``, at least one (below);
  store     once a block has no mask left, one more forward of it that writes its KV (generate.py's
            ``store_kv=True`` call), then the next block.

A row stops after the block in which an EOS appears (generate.py's stopping_criteria_idx, the EOS ids of the
folder's generation config in its __main__); its response is cut after the first EOS and to ``gen_length``
(generate.py decodes whole blocks up to prompt + gen_length rounded up to a block).

What the authors' code does, kept here: "probability" is that of the drawn token, not of the argmax; the top-k of
the static and dynamic rules ranks committed positions at -inf and may pick them (then it redraws them) when
fewer positions are masked than the quota; sequential's window may cover committed positions after the first
masked one (redrawn too); prompt tokens in the first block can be redrawn so. Where generate.py has no answer,
ours is said: its entropy_bounded branch never sets the positions to commit (``transfer_index`` is unbound
there: the call raises at its first step) and sums the entropy of the drawn tokens' probabilities over the whole
block, not per position; here the positions start empty at every step, as in every other branch, and the
block's sum is taken as every masked position's entropy, as the branch reads (so all tie, and torch.sort orders
them). That reading gives the tokens of generate.py with the one missing line added (the fixture's
entropy_bounded references, scripts/make_sdar_fixtures.py). A drawn mask id leaves its position masked; past the schedule (generate.py would index
past its quota list: IndexError) the quota is every masked position, and a block still masked after
``denoising_steps + 1`` forwards is left so, without its KV, as generate.py's loop leaves it. temperature 0 is
greedy (the argmax and its probability), which generate.py cannot do (it divides by the temperature); its
default is 1.0, sampling.

Batches: rows are laid so that every row's first decoded block lands on the same columns (each row's prompt
padded on the left by whole blocks), positions count from each row's first real token, each row draws from its
own generator (seeded ``seed``) in the order generate.py draws for that row alone, and a row whose block is done
waits (its denoise outputs unused, its stream untouched) while others still denoise: a row decodes exactly as
alone. Rows that ended leave the batch at the next block (their cache rows dropped).

Counting (docs/design.md §6): phases ``prefill``, ``denoise`` and ``store``; NFE = all three, as generate.py
calls the model; TPF = generated tokens / NFE. A token is committed by the denoise forward that last wrote it.
Extra stats: block_length, blocks (row blocks decoded), denoise_steps (denoise forwards per row block, summed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .block_loop import BlockGrid, BlockRule, BlockRun, decode_blocks, prefill_blocks
from .cache import new_cache
from .knobs import Knobs, compile_knob, gen_length, knob, seed
from .proposals import make_generator
from .tokens import eos_ids, mask_id

# generate.py's command-line defaults (its parse_args): what `python generate.py --model_dir ...` runs.
DEFAULT_BLOCK, DEFAULT_STEPS, DEFAULT_THRESHOLD, DEFAULT_EB = 4, 4, 0.85, 0.35
STRATEGIES = ("low_confidence_dynamic", "low_confidence_static", "sequential", "entropy_bounded")
ENTROPY_EPS = 1e-12  # generate.py's clamp before the log


@dataclass(frozen=True)
class SdarKnobs(Knobs):
    """Knobs of ``sdar``, named as generate.py's arguments; defaults: its command line's. A folder's config.json
    ``block_size`` (the trained block length) sets block_length and denoising_steps (``FOLDER_KNOBS``)."""
    gen_length: int = gen_length(256)
    block_length: int = knob(DEFAULT_BLOCK, "tokens per block (absolute positions: the first block decoded holds "
                             "the prompt's last prompt_length % block_length tokens)", low=1)
    denoising_steps: int = knob(DEFAULT_STEPS, "denoising steps a block is scheduled over (block_length split "
                                "evenly, the first steps taking the remainder)", low=1)
    remasking_strategy: str = knob("low_confidence_dynamic", "which drawn tokens a step commits (module doc)",
                                   choices=STRATEGIES)
    confidence_threshold: float = knob(DEFAULT_THRESHOLD, "low_confidence_dynamic: commit every masked token drawn "
                                       "with probability above this (when at least the step's quota)",
                                       low=0.0, high=1.0)
    eb_threshold: float = knob(DEFAULT_EB, "entropy_bounded: the entropy budget of a step", low=0.0)
    temperature: float = knob(1.0, "sampling temperature (generate.py: 1.0); 0 = greedy argmax, ours", low=0.0)
    top_k: int = knob(0, "keep the top_k logits before drawing; 0 = off", low=0)
    top_p: float = knob(1.0, "nucleus filter before drawing; 1 = off", low=0.0, high=1.0)
    seed: int = seed()
    compile: bool = compile_knob()
    # Blocks sit on absolute positions: the trace (harness/report/trace.py) draws the first one shorter.
    blocks_from_prompt_start: ClassVar[bool] = True

    def check(self) -> None:
        if self.remasking_strategy == "entropy_bounded" and self.denoising_steps < self.block_length:
            raise ValueError(f"entropy_bounded commits one token a step at least: denoising_steps must be >= "
                             f"block_length {self.block_length}, got {self.denoising_steps}")


# The knobs an SDAR folder sets for itself: its trained block length (config.json block_size; the releases
# with block 8 .. 64 say so there), denoised in as many steps, as the authors' evaluation runs it.
FOLDER_KNOBS = {"config.json": {"block_length": "block_size", "denoising_steps": "block_size"}}


def quotas(block_length: int, steps: int) -> list[int]:
    """Tokens to commit at each step: block_length split evenly over steps, the first steps one more."""
    base, extra = divmod(block_length, steps)
    return [base + (1 if s < extra else 0) for s in range(steps)]


def filtered(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits [n, V] as generate.py's sampler shapes them: / temperature (unless 1 or greedy), top_k, top_p."""
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, top_k).values[..., -1:]
        logits = torch.where(logits < kth, torch.full_like(logits, float("-inf")), logits)
    if top_p < 1.0:
        ranked, order = torch.sort(logits, descending=True)
        over = torch.softmax(ranked, dim=-1).cumsum(-1) > top_p
        drop = torch.zeros_like(over)
        drop[..., 1:] = over[..., :-1]  # the token that crosses top_p stays
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


def draw(logits: torch.Tensor, k: SdarKnobs, gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """SDAR's proposal: one row's block logits [L, V] -> (drawn tokens [L], their probabilities [L]). Named
    ``draw``, not ``sdar_propose``, as tests/test_decoding_sdar.py patches it by that name."""
    probs = torch.softmax(filtered(logits, k.temperature, k.top_k, k.top_p), dim=-1)
    if k.temperature == 0:
        p, tok = probs.max(dim=-1)
        return tok, p
    tok = torch.multinomial(probs, num_samples=1, generator=gen)
    return tok.squeeze(-1), torch.gather(probs, -1, tok).squeeze(-1)


def to_commit(k: SdarKnobs, masked: torch.Tensor, prob: torch.Tensor, quota: int) -> torch.Tensor:
    """bool [L]: the positions of one row's block that a step commits (module doc). ``masked`` [L] bool, ``prob``
    [L] the drawn tokens' probabilities, ``quota`` the step's share of the block."""
    chosen = torch.zeros_like(masked)
    strategy = k.remasking_strategy
    if strategy == "sequential":
        first = int(masked.nonzero()[0, 0])
        chosen[first:first + quota] = True
        return chosen
    if strategy == "entropy_bounded":
        p = prob.clamp_min(ENTROPY_EPS)
        ent = torch.where(masked, -(p * p.log()).sum(), torch.inf)
        ranked, order = torch.sort(ent[None], dim=1, descending=False)
        spent = torch.cumsum(ranked, dim=1)[0]
        n = int(torch.searchsorted(spent, torch.tensor(k.eb_threshold, device=spent.device), right=False))
        chosen[order[0, :max(1, min(n, int(masked.sum())))]] = True
        return chosen
    confidence = torch.where(masked, prob, -torch.inf)
    if strategy == "low_confidence_dynamic":
        high = confidence > k.confidence_threshold
        if int(high.sum()) >= quota:
            return high
    chosen[torch.topk(confidence, quota).indices] = True
    return chosen


class SdarRule(BlockRule):
    """SDAR's step rule for the shared block loop (block_loop.decode_blocks): prefill the prompt's whole blocks,
    denoise a block by ``draw`` and ``to_commit`` until no row has a mask left or its steps, then store it."""
    phases = ("prefill", "denoise", "store")
    aligned = True

    def __init__(self, k: SdarKnobs, mask: int):
        self.k, self.fill, self.size, self.gen_length = k, mask, k.block_length, k.gen_length
        self.compile = k.compile
        self.schedule = quotas(k.block_length, k.denoising_steps)
        self.gens: list[torch.Generator | None] = []
        self.denoise_steps = 0

    def budget(self, grid: BlockGrid) -> tuple[int, int | None]:
        bound = 1 + max(grid.blocks) * (self.k.denoising_steps + 2)  # forwards per row at most
        return self.gen_length, -(-bound // 3)

    def start(self, run: BlockRun, input_ids: torch.Tensor, pad: torch.Tensor) -> None:
        self.gens = [make_generator(run.device, self.k.seed) for _ in run.live]
        run.cache = new_cache(run.model, run.meter)
        run.seen = prefill_blocks(run, input_ids, run.grid.starts, self.fill)  # the prompt's whole blocks

    def decide(self, run: BlockRun, j: int, cur: torch.Tensor | None) -> torch.Tensor:
        """Denoise forwards of the block cur [b, size] while some row has a mask and steps left; a row whose block
        is done waits (its outputs unused, its generator untouched)."""
        k, mask, meter, lengths = self.k, self.fill, run.meter, run.grid.lengths
        steps = [0] * len(run.live)
        while True:
            todo = [i for i in range(len(run.live)) if steps[i] <= k.denoising_steps and bool((cur[i] == mask).any())]
            if not todo:
                break
            logits = run.forward_block("denoise", cur)  # reads the cache, never writes it
            for i in todo:
                b, s = run.live[i], steps[i]
                masked = cur[i] == mask
                tok, prob = draw(logits[i], k, self.gens[b])
                quota = self.schedule[s] if s < k.denoising_steps else int(masked.sum())
                chosen = to_commit(k, masked, prob, quota)
                cur[i][chosen] = tok[chosen]
                cols = [c for c in (run.pos[i][chosen] - lengths[b]).tolist() if c >= 0]  # prompt tail: no response
                meter.commit(b, cols, [meter.calls - 1] * len(cols), ["denoise"] * len(cols))
                steps[i] += 1
            del logits  # before the next forward (docs/design.md §6)
        self.denoise_steps += sum(steps)
        return cur

    def store(self, run: BlockRun, block: torch.Tensor) -> None:
        run.forward_block("store", block, logits=False)  # generate.py's store_kv=True call: its KV only

    def stats(self, run: BlockRun) -> dict:
        return {"block_length": self.size, "blocks": run.row_blocks, "denoise_steps": self.denoise_steps}


@torch.no_grad()
def sdar(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    knobs: SdarKnobs | dict | None = None,
    *,
    eos_token_id: int | list[int] | None = None,
    mask_token_id: int | None = None,
    **overrides,
) -> tuple[list[torch.Tensor], dict]:
    """SDAR block diffusion (module doc) of a left-padded batch, every row as alone. model: a causal LM that takes
    an explicit 4-D mask (the sdar family on Qwen3ForCausalLM); input_ids [B, P], attention_mask [B, P]."""
    k = SdarKnobs.of(knobs, overrides, "sdar")
    eos, mask = eos_ids(model, eos_token_id), mask_id(model, mask_token_id)
    return decode_blocks(model, input_ids, attention_mask, SdarRule(k, mask), eos)
