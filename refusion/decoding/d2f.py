"""D2F, discrete diffusion forcing (Wang et al. 2025, "Diffusion LLMs Can Do Faster-Than-AR
Inference via Discrete Diffusion Forcing", arXiv 2508.09192): pipelined block decoding of a
block-causal masked-diffusion model with a KV cache of finished blocks (docs/design.md §4).

The model: a Qwen3ForCausalLM with config.is_causal=False, trained (refusion/objective.py
``collate_d2f``) under an explicit block-causal mask -- the prompt is block 0, the response is
cut into blocks of ``block_size`` from the prompt's end, a query sees every key of its own
block and of all earlier blocks. Later blocks were trained noisier than earlier ones, which
is what lets a block start before its predecessor is done. The logit at i predicts token i
(LLaDA-based D2F); ``shift`` is for Dream-based D2F (the logit at i - 1 predicts token i).

One row's loop, one forward per step (as the authors' ``_generate_block_single``):
  grow      while fewer than gen_length / block_size blocks exist and no EOS has been
            committed, append a block of masks once the last block's decoded fraction
            reaches ``block_add_threshold`` (at most one per step; the first block joins at
            once, the prompt counting as decoded);
  activate  a block whose predecessor's decoded fraction reached
            ``decoded_token_threshold`` becomes fully active (for good);
  forward   every token not in the cache (blocks finished last step, then the active
            ones) under the block-causal mask, after the cache;
  cache     the finished blocks just forwarded append their KV: they saw only the
            prompt, earlier finished blocks and themselves, all final, so their KV is what
            a fresh forward of the committed sequence gives (exact, not approximate);
  commit    in each active block, every masked token whose probability passes
            ``skip_threshold``; a fully active block that has none commits its single most
            confident token, a semi-active one commits nothing;
  retire    a block with no mask left stops being active once every earlier block has
            (so finished blocks reach the cache in order).
The loop ends when no block is active (or, with stop_at_eos, once the row holds an EOS
with nothing masked before it: no later step can change that prefix).

Deliberate differences from the authors' code: it decodes one row at a time (batch 1);
here rows of a left-padded batch each run their own pipeline and every pending row's
forward is stacked into one model call (caches left-padded, queries right-padded, as
ReFusion's rows), with positions counted from each row's first real token and a sampling
generator per row, so a row's tokens do not depend on its batch. The mask id is never
proposed (proposals.propose_from_probs; the authors' loop would re-decode such a position until its
10,000-step guard). And stop_at_eos.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache

from .cache import new_cache
from .common import Meter
from .heads import greedy_at
from .knobs import Knobs, compile_knob, gen_length, knob, logits_chunk_knob, seed, stream_chunk, temperature
from .mdm import settled_row
from .proposals import as_float32, make_generator, propose
from .refusion import Req, Steps, drive_rows  # per-row generators answered by one stacked model call
from .tokens import cut_after_eos, eos_ids, left_padding_mask, mask_id

ACTIVE, TO_CACHE, CACHED = "active", "to_cache", "cached"


@dataclass(frozen=True)
class D2fKnobs(Knobs):
    """Knobs of ``d2f`` (docs/design.md §4). Defaults: the D2F evaluation scripts' most common
    setting (block 32, add 0.1, fully active 0.95, skip 0.9)."""
    gen_length: int = gen_length(256)
    block_size: int = knob(32, "tokens per block (must divide gen_length); attention is bidirectional inside a "
                           "block and causal across blocks, as the model was trained", low=1)
    block_add_threshold: float = knob(0.1, "a new block joins the pipeline once the last block's decoded fraction "
                                      "reaches this", low=0.0, high=1.0)
    decoded_token_threshold: float = knob(0.95, "a block becomes fully active (at least one token per step) once "
                                          "its predecessor's decoded fraction reaches this; before that it commits "
                                          "only tokens above skip_threshold", low=0.0, high=1.0)
    skip_threshold: float = knob(0.9, "every masked token of an active block whose probability passes this is "
                                 "committed in parallel; >= 1: one token per step per fully active block", low=0.0)
    temperature: float = temperature()
    shift: bool = knob(False, "Dream-based D2F: the logit at i - 1 predicts token i")
    no_cache: bool = knob(False, "no KV reuse: every forward re-encodes the whole row under the block-causal mask "
                          "(same tokens; ablation)")
    stop_at_eos: bool = knob(True, "stop a row once it holds an EOS with nothing masked before it (same tokens, "
                             "fewer forwards)")
    seed: int = seed()
    compile: bool = compile_knob()
    logits_chunk: int | None = logits_chunk_knob()

    def check(self) -> None:
        if self.block_size > self.gen_length or self.gen_length % self.block_size:
            raise ValueError(f"block_size must divide gen_length {self.gen_length}, got {self.block_size}")


@dataclass(frozen=True)
class _Run:
    """Constants of one decode call."""
    knobs: D2fKnobs
    n_blocks: int
    mask: int
    eos: tuple[int, ...]
    on_cache: Callable[[dict], None] | None
    skip: float  # skip_threshold as float32: probabilities are float32, compared in float32 as torch does
    chunk: int | None  # positions per chunk of logits (stream_chunk), None: the model's own forward


class _Pipeline:
    """One row's blocks on the host (module doc), read once per step (docs/design.md §6): each block's state and
    whether it is fully active, its open (masked) positions (absolute, ascending), the response so far (None =
    masked), the positions laid out so far and whether an EOS was committed. Block 0 is the prompt."""

    def __init__(self, n_prompt: int, size: int, n_blocks: int, eos: tuple[int, ...]):
        self.n_prompt, self.size, self.n_blocks = n_prompt, size, n_blocks
        self.length = n_prompt  # positions [0, length) exist: the prompt, then every block added so far
        self.state = [TO_CACHE]  # per block; the prompt is encoded (and cached) by the first forward
        self.full = [True]  # per block: fully active
        self.open_: list[list[int]] = [[]]  # per block: its masked positions (absolute), ascending
        self.toks: list[int | None] = []  # the response so far (None = masked)
        self.eos_set, self.eos_seen = frozenset(eos), False

    def span(self, j: int) -> tuple[int, int]:
        """Positions [lo, hi) of block j."""
        return (0, self.n_prompt) if j == 0 else (self.n_prompt + (j - 1) * self.size, self.n_prompt + j * self.size)

    def decoded(self, j: int) -> float:
        """Block j's decoded fraction as the float32 mean of a 0/1 tensor gives it (an exact count over size)."""
        return float(np.float32(self.size - len(self.open_[j])) / np.float32(self.size)) if j else 1.0

    def grow(self, k: D2fKnobs) -> list[int]:
        """The grow and activate moves (module doc); returns the active blocks."""
        n = len(self.state) - 1  # response blocks so far
        if n < self.n_blocks and not self.eos_seen and self.decoded(n) >= k.block_add_threshold:
            lo, hi = self.span(n + 1)
            self.length = hi
            self.state.append(ACTIVE)
            self.full.append(False)
            self.open_.append(list(range(lo, hi)))
            self.toks += [None] * self.size
        for j in range(1, len(self.state)):
            self.full[j] = self.full[j] or self.decoded(j - 1) >= k.decoded_token_threshold
        return [j for j, s in enumerate(self.state) if s == ACTIVE]

    def done(self, active: list[int], k: D2fKnobs) -> bool:
        """No block active, or (stop_at_eos) an EOS with nothing masked before it."""
        return not active or (k.stop_at_eos and self.eos_seen and settled_row(self.toks, self.eos_set))

    def take(self, work: list[int], tok_h: list[int], prob_h: list[float], skip: float) -> tuple[list, list]:
        """The commit move for blocks ``work`` whose positions' tokens and probabilities are ``tok_h`` / ``prob_h``
        (host lists, block after block): every open position above ``skip``; a fully active block with none, its
        single most confident one (first on ties). Returns (positions, tokens) committed."""
        commit_pos, commit_tok = [], []
        for i, j in enumerate(work):
            base = i * self.size - self.span(j)[0]  # index into tok_h / prob_h of absolute position p: p + base
            take = [p for p in self.open_[j] if prob_h[p + base] > skip]
            if self.full[j] and not take:
                take = [max(self.open_[j], key=lambda p: prob_h[p + base])]  # base: this block's, called at once
            if take:
                commit_pos += take
                commit_tok += [tok_h[p + base] for p in take]
                taken = set(take)
                self.open_[j] = [p for p in self.open_[j] if p not in taken]
        for p, t in zip(commit_pos, commit_tok):
            self.toks[p - self.n_prompt] = t
        self.eos_seen = self.eos_seen or any(t in self.eos_set for t in commit_tok)
        return commit_pos, commit_tok

    def retire(self, active: list[int]) -> None:
        """The retire move, in order, so a block retires right after its predecessor."""
        for j in active:
            if self.state[j - 1] != ACTIVE and not self.open_[j]:
                self.state[j] = TO_CACHE


def _decode_row(b: int, prompt: torch.Tensor, kn: _Run, cache: DynamicCache | None,
                gen: torch.Generator | None, counts: dict, meter: Meter) -> Steps:
    """One row's pipeline (module doc); yields its model requests, returns its response.

    The row's bookkeeping lives on the host (``_Pipeline``); the tensors (ids, block index, positions) are laid
    out once at full length and sliced to the blocks added so far."""
    k, mask, device = kn.knobs, kn.mask, prompt.device
    size, n_prompt = k.block_size, prompt.numel()
    row = _Pipeline(n_prompt, size, kn.n_blocks, kn.eos)
    total = n_prompt + kn.n_blocks * size
    ids = torch.cat([prompt, prompt.new_full((total - n_prompt,), mask)])  # [P + G]: undecoded = mask
    blk = torch.cat([prompt.new_zeros(n_prompt), torch.arange(1, kn.n_blocks + 1, device=device).repeat_interleave(size)])
    positions = torch.arange(total, device=device)
    cached = 0  # positions [0, cached) hold KV in the cache: prompt, then finished blocks in order
    last = None  # shift: Heads.raw [1, D] of position cached - 1 (its logits, or its hidden state when streamed)
    greedy = k.temperature == 0
    vis, vis_key = None, None

    while True:
        active = row.grow(k)
        if row.done(active, k):
            break
        length = row.length

        # Forward every position not in the cache; with no_cache, the whole row. The blocks finished last step
        # lead the query: the call keeps their KV in the cache (cache step of the module doc).
        start = 0 if cache is None else cached
        if vis_key != (start, length):  # the pattern changes only when a block joins or one is cached
            vis, vis_key = blk[None, :length] <= blk[start:length, None], (start, length)  # [q, L]: key <= query block
        new = [j for j in range(len(row.state)) if row.state[j] == TO_CACHE]
        end = row.span(new[-1])[1] if new else cached
        keep = end - cached if cache is not None else 0
        # the answer's query KV is not kept (a name bound to it would hold the stacked call's cache alive)
        heads = (yield Req("step", cache, ids[None, start:length], positions[None, start:length], vis, keep=keep))[0]
        # heads: [1, q] positions, position j is start + j (heads.Heads: made on demand when streamed). With shift
        # the prediction for position p is the logit at p - 1; `last` serves p = start.
        pred = heads.shifted(heads.raw(0) if last is None else last) if k.shift else heads

        if new:  # finished blocks are contiguous from `cached` (module doc: retire)
            if cache is not None and kn.on_cache is not None:
                kn.on_cache({"row": b, "ids": ids[:end].clone(), "cache": cache})
            last = heads.raw(end - start - 1)  # a copy: a view would hold this step's tensor [q, D]
            cached = end
            for j in new:
                row.state[j] = CACHED

        counts["row_steps"] += 1
        counts["active_blocks"] += len(active)
        counts["pipeline_max"] = max(counts["pipeline_max"], len(active))
        work = [j for j in active if row.open_[j]]  # active blocks with masks left (the others commit nothing)
        if work:
            # Token and probability of every position of those blocks: one pick over all of them when greedy
            # (each position's softmax is its own), one per block when sampling (the generator's draws).
            spans = [row.span(j) for j in work]
            if greedy and len(work) > 1:
                rows = torch.cat([torch.arange(lo - start, hi - start, device=device) for lo, hi in spans])
                tok, prob = greedy_at(pred, rows, kn.chunk, exclude=mask)
            elif greedy:
                tok, prob = greedy_at(pred, slice(spans[0][0] - start, spans[0][1] - start), kn.chunk, exclude=mask)
            else:  # sampled: the model's own logits (stream_chunk None)
                picks = [propose(pred.at(slice(lo - start, hi - start)), k.temperature, gen, exclude=mask)
                         for lo, hi in spans]
                tok, prob = torch.cat([t for t, _ in picks]), torch.cat([p for _, p in picks])
            commit_pos, commit_tok = row.take(work, tok.tolist(), prob.tolist(), kn.skip)
            if commit_pos:
                ids[torch.tensor(commit_pos, device=device)] = torch.tensor(commit_tok, device=device)
                cols = [p - n_prompt for p in commit_pos]
                meter.commit(b, cols, [meter.calls - 1] * len(cols), [meter.phase_log[-1]] * len(cols))
        del heads, pred  # this step's logits go before the next forward (docs/design.md §6)
        row.retire(active)
    return cut_after_eos(ids[n_prompt:row.length], kn.eos)


@torch.no_grad()
def d2f(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    knobs: D2fKnobs | dict | None = None,
    *,
    mask_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    on_cache: Callable[[dict], None] | None = None,
    **overrides,
) -> tuple[list[torch.Tensor], dict]:
    """D2F pipelined block decoding (module doc), every row of the batch together.

    input_ids [B, P] left-padded, attention_mask [B, P] (1 = real token). on_cache(info) is
    called (tests) after every cache append with the row index, the ids whose KV the
    row's cache now holds and the cache. Phase: step (one model call serves every pending
    row). Extra stats: pipeline_max (most blocks active in one row's step) and
    pipeline_mean (active blocks per row step).
    """
    k = D2fKnobs.of(knobs, overrides, "d2f")
    kn = _Run(k, k.gen_length // k.block_size, mask_id(model, mask_token_id), eos_ids(model, eos_token_id), on_cache,
              as_float32(k.skip_threshold), stream_chunk(k))
    pad = left_padding_mask(input_ids, attention_mask)
    meter = Meter(model, ("step",), compile=k.compile)
    counts = {"row_steps": 0, "active_blocks": 0, "pipeline_max": 0}
    meter.track(input_ids.shape[0], k.gen_length, input_ids.device)
    rows = [
        _decode_row(b, row[m.bool()], kn, None if k.no_cache else new_cache(model, meter),
                    make_generator(input_ids.device, k.seed), counts, meter)
        for b, (row, m) in enumerate(zip(input_ids, pad))
    ]
    responses = drive_rows(model, meter, rows, stream=kn.chunk is not None)
    extra = {"pipeline_max": counts["pipeline_max"],
             "pipeline_mean": counts["active_blocks"] / counts["row_steps"] if counts["row_steps"] else 0.0}
    return responses, meter.finish(responses, **extra)
