"""Masked-diffusion baselines on a bidirectional model (docs/design.md §4): LLaDA-style
semi-autoregressive low-confidence / random remasking, Dream's diffusion generation, and
Fast-dLLM (block-wise prefix or dual KV cache + confidence-threshold parallel decoding) on
either kind of model.

The model is a Qwen3ForCausalLM whose config has is_causal=False (bidirectional) and a
mask_token_id. LLaDA-style models: the logit at position i predicts the token at position
i (no shift). Dream-style models (``dream``, ``fast_dllm`` with ``shift``): the logit at
position i - 1 predicts token i, so an AR model's next-token head carries over; the
response's first token is predicted by the prompt's last position.
Batches are left-padded; the padding mask travels as a 2-D mask, so the model's own
bidirectional mask hides pads. Response region: gen_length mask tokens after the prompt.

``llada``, ``fast_dllm`` and ``dream`` are step rules (``LladaRule``, ``FastDllmRule``, ``DreamRule``:
``CanvasRule``s) of the shared block loop (block_loop.py); a variant of them overrides a rule's ``step`` (docs/extending.md writes a left-to-right
LLaDA so). Public building blocks for other variants:
``masked_start`` (the canvas), ``llada_propose`` / ``dream_propose`` (token and confidence per position),
``commit_topk`` / ``commit_sampled`` (unmask k positions of each row), ``settled`` (when the answer can
no longer change), ``top_p_filter`` / ``top_k_filter``, and the knob pieces
``block_length_knob`` / ``steps_knob`` / ``tokens_per_step_knob`` / ``stop_at_eos_knob`` / ``check_blocks`` /
``check_steps``, and ``block_schedule`` (LLaDA's tokens per step) / ``steps_of`` (the steps a decode takes). With ``common.Meter``, ``common.forward``
(the only counted way to call the model) and ``common.cut_after_eos`` they make a whole decoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .block_loop import BlockGrid, BlockRule, BlockRun, decode_blocks
from .cache import cache_keep, new_cache
from .common import Meter, proposal
from .knobs import Knobs, compile_knob, gen_length, knob, logits_chunk_knob, seed, stream_chunk, temperature
from .proposals import as_float32, make_generator, propose, propose_from_probs, token_prob
from .tokens import eos_ids, is_eos, mask_id, padding_mask, positions_from_mask

__all__ = ["CanvasRule", "DREAM_ALGS", "DreamKnobs", "DreamRule", "FastDllmKnobs", "FastDllmRule", "LladaKnobs", "LladaRule", "as_float32", "block_length_knob",
           "block_schedule", "check_blocks", "check_steps", "commit_chosen", "commit_sampled", "commit_topk", "dream", "DREAM_FOLDER_KNOBS",
           "dream_propose", "fast_dllm", "llada", "masked_start", "llada_propose", "settled", "settled_row",
           "steps_knob", "steps_of",
           "stop_at_eos_knob", "tokens_per_step_knob", "top_k_filter", "top_open", "top_p_filter"]


def block_length_knob() -> int:
    """The ``block_length`` knob field (default 32) of the block-wise decoders: use it in a variant's knob
    class so the name, range and help text stay the same; pair it with ``check_blocks`` in ``check()``."""
    return knob(32, "tokens per block, decoded left to right (must divide gen_length)", low=1)


def stop_at_eos_knob() -> bool:
    """The ``stop_at_eos`` knob field (default true) of the block-wise decoders (the block loop's stop)."""
    return knob(True, "stop after the first block at which every row holds an EOS (same tokens, fewer forwards)")


def check_blocks(k) -> None:
    """ValueError unless ``k.block_length`` divides ``k.gen_length`` (call it from a knob class's ``check``)."""
    if k.block_length > k.gen_length or k.gen_length % k.block_length:
        raise ValueError(f"block_length must divide gen_length {k.gen_length}, got {k.block_length}")


def steps_knob() -> int:
    """The ``steps`` knob field of LLaDA-style block decoding (default None = gen_length); pair it with
    ``check_steps`` in ``check()`` and read it back with ``block_schedule``."""
    return knob(None, "forwards in all (default gen_length: one token per step); a multiple of the block "
                "count, at most gen_length", low=1, optional=True)


def tokens_per_step_knob() -> int:
    """The ``tokens_per_step`` knob field (default None) of the step-count decoders (``llada``, ``dream``): the
    parallelism grid of ``make frontier`` varies it (refusion/decoding/__init__.py); ``steps_of`` reads it."""
    return knob(None, "tokens unmasked per step on average: steps = gen_length / tokens_per_step (LLaDA: "
                "block_length / tokens_per_step steps a block, so it must divide block_length); when set it "
                "replaces steps; none = steps decides", low=1, optional=True)


def steps_of(k) -> int:
    """Forwards a decode takes: gen_length / ``tokens_per_step`` (rounded up) when the knob class has it and it
    is set, else ``steps``, else gen_length (one token a step)."""
    per_step = getattr(k, "tokens_per_step", None)
    if per_step is not None:
        return -(-k.gen_length // per_step)
    return k.gen_length if k.steps is None else k.steps


def check_steps(k) -> None:
    """ValueError unless ``k.block_length`` divides ``k.gen_length`` and the steps (``steps_of``: None =
    gen_length) are a multiple of the block count, at most gen_length; a ``tokens_per_step`` must divide
    block_length."""
    check_blocks(k)
    n_blocks = k.gen_length // k.block_length
    per_step = getattr(k, "tokens_per_step", None)
    if per_step is not None and k.block_length % per_step:
        raise ValueError(f"tokens_per_step must divide block_length {k.block_length}, got {per_step}")
    steps = steps_of(k)
    if not n_blocks <= steps <= k.gen_length or steps % n_blocks:
        raise ValueError(f"steps must be a multiple of the block count {n_blocks} in [{n_blocks}, "
                         f"{k.gen_length}], got {k.steps}")


def block_schedule(k) -> tuple[int, list[int]]:
    """(block count, tokens committed at each step of a block) for knobs checked by ``check_steps``: the
    block's length spread evenly over steps / n_blocks steps, remainder first (LLaDA's schedule)."""
    n_blocks = k.gen_length // k.block_length
    per_block = steps_of(k) // n_blocks
    return n_blocks, [k.block_length // per_block + (i < k.block_length % per_block) for i in range(per_block)]


@dataclass(frozen=True)
class LladaKnobs(Knobs):
    """Knobs of ``llada`` (docs/design.md §4)."""
    gen_length: int = gen_length(128)
    steps: int = steps_knob()
    tokens_per_step: int = tokens_per_step_knob()
    block_length: int = block_length_knob()
    remasking: str = knob("low_confidence", "which masked tokens a step unmasks",
                          choices=("low_confidence", "random"))
    temperature: float = temperature()
    stop_at_eos: bool = stop_at_eos_knob()
    seed: int = seed()
    compile: bool = compile_knob()
    logits_chunk: int = logits_chunk_knob()

    def check(self) -> None:
        check_steps(self)


@dataclass(frozen=True)
class FastDllmKnobs(Knobs):
    """Knobs of ``fast_dllm`` (docs/design.md §4)."""
    gen_length: int = gen_length(128)
    block_length: int = block_length_knob()
    threshold: float = knob(0.9, "unmask every masked token whose confidence passes this (at least one per "
                            "step); > 1 means one token per step", low=0.0)
    cache: str = knob("dual", "KV reuse inside a block: none, prefix, or prefix and suffix (dual)",
                      choices=("none", "prefix", "dual"))
    shift: bool = knob(False, "Dream-style model (Fast-dLLM on Dream): the logit at i - 1 predicts token i")
    commit_first: bool = knob(None, "the Fast-dLLM authors' Dream loop: a block's full forward commits only its "
                              "first token, unconditionally; later steps forward from the block's start and keep "
                              "tokens with confidence >= threshold, read from Dream's sampler (temperature, top_p, "
                              "top_k). false: every token waits for the threshold (> threshold), cached windows "
                              "start one position before the block. none = true with shift, false without",
                              optional=True)
    top_p: float = knob(None, "nucleus filter of Dream's sampler (commit_first only); none = off", low=0.0, high=1.0,
                        optional=True)
    top_k: int = knob(None, "keep the top_k most likely tokens in Dream's sampler (commit_first only); none = off",
                      low=1, optional=True)
    temperature: float = temperature()
    stop_at_eos: bool = stop_at_eos_knob()
    seed: int = seed()
    compile: bool = compile_knob()
    logits_chunk: int = logits_chunk_knob()

    def check(self) -> None:
        if self.commit_first and not self.shift:
            raise ValueError("commit_first is the Fast-dLLM authors' rule for Dream (shift=true); got shift=false")
        if (self.top_p is not None or self.top_k is not None) and not self.dream_loop:
            raise ValueError("top_p and top_k shape Dream's sampler, used with shift=true and commit_first not "
                             "false only")
        check_blocks(self)

    @property
    def dream_loop(self) -> bool:
        """True when the authors' Dream block loop runs (commit_first, resolved)."""
        return self.shift if self.commit_first is None else self.commit_first


DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")


@dataclass(frozen=True)
class DreamKnobs(Knobs):
    """Knobs of ``dream`` (docs/design.md §4); names as in Dream's ``diffusion_generate``."""
    gen_length: int = gen_length(128)
    steps: int = knob(None, "forwards in all (default gen_length); more than gen_length is allowed, as in Dream "
                      "(steps that unmask nothing)", low=1, optional=True)
    tokens_per_step: int = tokens_per_step_knob()
    alg: str = knob("entropy", "which masked tokens a step unmasks: origin (each at random, with the schedule's "
                    "probability), else the most confident by maskgit_plus (top probability), topk_margin (top-1 "
                    "minus top-2 probability) or entropy (negative entropy)", choices=DREAM_ALGS)
    alg_temp: float = knob(0.0, "0: unmask the most confident positions; > 0: draw them from softmax(confidence / "
                           "alg_temp)", low=0.0)
    transfer_schedule: str = knob("dream", "tokens unmasked per step, m masks left before step i: dream = "
                                  "int(m (1 - s/t)) on float32 linspace(1, eps, steps + 1), all at the last step "
                                  "(Dream's _sample); limit = m // (steps - i), its eps -> 0 limit (exactly one "
                                  "per step when steps = gen_length)", choices=("dream", "limit"))
    eps: float = knob(1e-3, "the schedule's last time (transfer_schedule=dream), in [0, 1)", low=0.0)
    temperature: float = temperature()
    top_p: float = knob(None, "nucleus filter applied before sampling and before the confidence is measured; none = "
                        "off", low=0.0, high=1.0, optional=True)
    top_k: int = knob(None, "keep the top_k most likely tokens (after top_p) before sampling and before the "
                      "confidence is measured; none = off", low=1, optional=True)
    stop_at_eos: bool = knob(True, "stop once every row holds an EOS with nothing masked before it (same tokens, "
                             "fewer forwards)")
    seed: int = seed()
    compile: bool = compile_knob()
    logits_chunk: int = logits_chunk_knob()

    def check(self) -> None:
        if not self.eps < 1:
            raise ValueError(f"eps must be in [0, 1), got {self.eps}")


# The knobs a Dream folder sets for itself: the DreamGenerationConfig fields of its generation_config.json
# that are DreamKnobs of the same name and meaning (Dream's ``from_pretrained`` loads that file into
# ``model.generation_config``). max_new_tokens is not among them: an lm-eval request carries its own budget
# (gen_length), as Dream's own eval passes it. Read by ``knobs.folder_knobs`` through the registry.
DREAM_FOLDER_KNOBS = {"generation_config.json": {k: k for k in ("steps", "alg", "alg_temp", "eps", "temperature",
                                                                  "top_p", "top_k")}}


def masked_start(model, input_ids, attention_mask, gen_length, mask):
    """The canvas of a masked-diffusion decode: (x, attn, pos), each [B, P+G] -- x the left-padded prompt
    [B, P] then G = ``gen_length`` copies of the mask id ``mask``, attn the 2-D padding mask (1 = real
    token; the response is real), pos the position ids counting real tokens from 0. ``model`` is unused
    (kept so every start step takes the same arguments)."""
    pad = padding_mask(input_ids, attention_mask)
    batch = input_ids.shape[0]
    x = torch.cat([input_ids, torch.full((batch, gen_length), mask, dtype=torch.long, device=input_ids.device)], 1)
    attn = torch.cat([pad, torch.ones(batch, gen_length, dtype=torch.long, device=input_ids.device)], 1)
    return x, attn, positions_from_mask(attn)


def commit_topk(x, x0, conf, k) -> None:
    """Write x0 into x at the k highest-confidence entries of each row (conf -inf = not eligible).

    x, x0, conf: [B, n] views of the current block; k: [B] long, per-row count.
    """
    order = conf.argsort(dim=-1, descending=True, stable=True)  # stable: ties go to the leftmost
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(conf.shape[1], device=conf.device).expand_as(order))
    chosen = (rank < k[:, None]) & torch.isfinite(conf)
    x[chosen] = x0[chosen]


def top_open(conf: list[float], open_: list[int], n: int) -> list[int]:
    """Host form of ``commit_topk``'s choice for one row: the ``n`` open positions (ascending list) of highest
    confidence ``conf`` (the row's values, read once per step), ties to the leftmost (a stable sort)."""
    return sorted(open_, key=lambda j: -conf[j])[:n] if n < len(open_) else list(open_)


def commit_chosen(x, x0, chosen: list[list[int]], meter: Meter, offset: int, live: list[int] | None = None) -> None:
    """Write x0 into x [B, n] at the host lists of positions ``chosen`` (per row) and mark them committed by
    the forward just made (``Meter.commit``; response column = ``offset`` + position; ``live``: each row's index
    in the call's batch, when rows have left it). Two kernels and one small host-to-device copy for the whole
    batch, instead of per-position indexing."""
    rows = [b for b, c in enumerate(chosen) for _ in c]
    cols = [j for c in chosen for j in c]
    if not cols:
        return
    r = torch.tensor(rows, device=x.device)
    c = torch.tensor(cols, device=x.device)
    x[r, c] = x0[r, c]
    f, kind = meter.calls - 1, meter.phase_log[-1]
    for b, cs in enumerate(chosen):
        if cs:
            meter.commit(b if live is None else live[b], [offset + j for j in cs], [f] * len(cs), [kind] * len(cs))


def llada_propose(logits, temperature, gen, mask):
    """Proposed token per position and its confidence, the *untempered* softmax probability
    (as in LLaDA: sampling noise picks the token, the model's own probability ranks it).
    Never the mask id (proposals.propose_from_probs)."""
    x0, prob = propose(logits, temperature, gen, exclude=mask)
    if temperature > 0:
        prob = token_prob(logits, x0, 0.0)
    return x0, prob


def top_p_filter(logits, top_p):
    """Nucleus filter on logits [..., V]: keep the smallest set of most likely tokens whose
    probability reaches top_p (the most likely always stays); the rest get the lowest logit."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    mass = sorted_logits.softmax(-1).cumsum(-1)
    drop = mass > top_p
    drop[..., 1:] = drop[..., :-1].clone()  # keep the token that crosses top_p
    drop[..., 0] = False
    return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), torch.finfo(logits.dtype).min)


def top_k_filter(logits, top_k):
    """Keep the top_k largest logits of [..., V] (ties with the k-th all stay); the rest get the lowest logit."""
    kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def dream_propose(logits, alg, temperature, top_p, top_k, gen, mask):
    """Dream's token proposal (its ``sample_tokens``): logits [B, n, V] -> (token [B, n], confidence [B, n]).

    Temperature, then top_p, then top_k shape the distribution first -- also under greedy
    decoding, where they change no token but do change the confidences -- and every
    confidence is measured on it: maskgit_plus the proposed token's probability,
    topk_margin top-1 minus top-2 probability, entropy the negative entropy (higher =
    surer); origin ignores it. The token is never the mask id (proposals.propose_from_probs)."""
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        logits = top_p_filter(logits, top_p)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    probs = logits.softmax(-1)
    x0, conf = propose_from_probs(probs, temperature > 0, gen, exclude=mask)
    if alg == "topk_margin":
        top2 = probs.topk(2, dim=-1).values
        conf = top2[..., 0] - top2[..., 1]
    elif alg == "entropy":
        conf = (probs * torch.log(probs + 1e-10)).sum(-1)
    return x0, conf


def commit_sampled(x, x0, scores, k, gen) -> None:
    """Write x0 into x at k[b] positions of row b drawn without replacement from softmax(scores[b])
    (scores -inf = not eligible). x, x0, scores: [B, n]; k: [B] long."""
    probs = scores.softmax(-1)
    # Floor eligible weights above 0: an underflowed softmax must not leave too few to draw from.
    probs = torch.where(torch.isfinite(scores), probs.clamp_min(torch.finfo(probs.dtype).tiny), 0.0)
    for b in range(x.shape[0]):
        if int(k[b]):
            idx = torch.multinomial(probs[b], int(k[b]), replacement=False, generator=gen)
            x[b, idx] = x0[b, idx]


def settled(resp, mask, eos) -> bool:
    """True when every row of resp [B, n] holds an EOS with no mask before its first one: the
    response cut after that EOS can no longer change (no decoder here re-masks a token)."""
    hit = is_eos(resp, eos) & (resp != mask)
    first = torch.where(hit.any(-1), hit.long().argmax(-1), resp.shape[1])  # [B]
    before = torch.arange(resp.shape[1], device=resp.device)[None] < first[:, None]
    return bool(hit.any(-1).all()) and not bool(((resp == mask) & before).any())


class CanvasRule(BlockRule):
    """The step rule of a masked-diffusion decoder on a canvas (``llada``, ``fast_dllm``; ``dream``, whose one
    block is the whole response) for the shared block loop (block_loop.decode_blocks): the rule keeps the canvas
    (``masked_start``: the left-padded prompt, then gen_length masks; each forward reads the whole of it), and block
    j of the loop is the canvas's response columns [j * block_length, (j + 1) * block_length), decoded by the
    rule's ``steps`` until no position of it is masked. Every row stays in the batch until every row has ended (``prune_rows`` false: the rows share one
    generator, whose draws a smaller batch would change), as the authors' loops run a batch."""
    kv = False
    aligned = False
    prune_rows = False

    def __init__(self, k, mask: int, gen: torch.Generator | None, size: int):
        self.k, self.mask, self.gen, self.size = k, mask, gen, size
        self.gen_length, self.compile, self.stop_at_eos = k.gen_length, k.compile, k.stop_at_eos

    def start(self, run: BlockRun, input_ids: torch.Tensor, pad: torch.Tensor) -> None:
        self.x, self.attn, self.pos = masked_start(run.model, input_ids, pad, self.gen_length, self.mask)
        self.p0 = input_ids.shape[1]

    def decide(self, run: BlockRun, j: int, _opening: torch.Tensor | None) -> torch.Tensor:
        lo = self.p0 + j * self.size
        hi = lo + self.size
        self.begin_block(run, lo, hi)
        # Host bookkeeping, once per step (docs/design.md §6): the block's open (masked) positions per row. A block
        # starts all masked: nothing writes ahead of the current block.
        open_ = [list(range(self.size)) for _ in run.live]
        s = 0
        while any(open_):
            x0, chosen = self.step(run, lo, hi, s, open_)
            commit_chosen(self.x[:, lo:hi], x0, chosen, run.meter, lo - self.p0, run.live)
            open_ = [[j for j in op if j not in cs] for op, cs in zip(open_, map(set, chosen))]
            s += 1
        return self.x[:, lo:hi]

    def begin_block(self, run: BlockRun, lo: int, hi: int) -> None:
        """Before the first step of the block at canvas columns [lo, hi)."""

    def step(self, run: BlockRun, lo: int, hi: int, s: int, open_: list[list[int]]):
        """Step s of the block [lo, hi): one forward; returns (proposed tokens [b, size], per row the block
        positions it commits, a host list; its logits are gone already)."""
        raise NotImplementedError


class LladaRule(CanvasRule):
    """``llada``'s step: a full forward of the canvas, the block's proposal (``llada_propose``), and the
    schedule's count of the most confident (or random) open positions per row."""
    phases = ("step",)

    def __init__(self, k: LladaKnobs, mask: int, gen: torch.Generator | None):
        super().__init__(k, mask, gen, k.block_length)
        self.schedule = block_schedule(k)[1]  # tokens unmasked at each step of a block

    def step(self, run: BlockRun, lo: int, hi: int, s: int, open_: list[list[int]]):
        k = self.k
        # token and confidence at the block only [b, block]; its logits are gone before the next forward
        x0, prob = proposal(run.model, run.meter, "step", self.x, slice(lo, hi), stream_chunk(k),
                            lambda lg: llada_propose(lg, k.temperature, self.gen, self.mask), position_ids=self.pos,
                            attention_mask=self.attn)
        if k.remasking == "random":
            prob = torch.rand(prob.shape, generator=self.gen, device=prob.device)
        # commit_topk on the host: the schedule's count of most confident open positions per row, ties leftmost.
        return x0, [top_open(c, op, self.schedule[s]) for c, op in zip(prob.tolist(), open_)]


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
    mask, eos = mask_id(model, mask_token_id), eos_ids(model, eos_token_id)
    rule = LladaRule(k, mask, make_generator(input_ids.device, k.seed))
    return decode_blocks(model, input_ids, attention_mask, rule, eos)


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
    """Fast-dLLM (Wu et al. 2025, arXiv 2505.22618): per block, unmask every masked token whose
    confidence passes threshold (at least the single most confident one per row per step)
    until the block is full.

    cache="none": every step is a full forward. "prefix": the first step of a block is
    a full forward whose KV of everything before the block is kept (approximate: it is
    refreshed only at block boundaries); later steps forward block + suffix after it.
    "dual": the full forward's KV of prefix and suffix are both kept and later steps
    forward the block alone. Without shift (LLaDA, the authors' llada/generate.py): the
    confidence is the untempered probability of the proposed token and a token passes at
    confidence > threshold, so threshold > 1 means exactly one token per step.

    shift (Fast-dLLM on Dream): the logit at i - 1 predicts token i. commit_first (default
    with shift) is the authors' Dream block loop (dream/model/generation_utils_block.py):
    the block's full forward commits its first token, predicted by the position before the
    block, unconditionally and nothing else; later steps forward windows that start at the
    block (the token before it is no longer needed), propose by Dream's sampler
    (``dream_propose``: temperature, top_p, top_k shape the distribution the confidence is
    read from) and keep the most confident token plus every one with confidence >=
    threshold. commit_first=false keeps the LLaDA rule on shifted logits: the block's
    predictions come from positions [lo - 1, hi - 1), every cached step forwards that one
    position more (its KV recomputed, not kept), so shift with threshold > 1 and
    cache="none" is ``dream`` with transfer_schedule=limit and one token per step.
    Phases: full (whole-sequence forwards) and cached (steps reusing the block cache).
    """
    k = FastDllmKnobs.of(knobs, overrides, "fast_dllm")
    mask, eos = mask_id(model, mask_token_id), eos_ids(model, eos_token_id)
    rule = FastDllmRule(k, mask, make_generator(input_ids.device, k.seed))
    return decode_blocks(model, input_ids, attention_mask, rule, eos)


class FastDllmRule(CanvasRule):
    """``fast_dllm``'s step (its docstring): the block's first step a full forward (whose KV the prefix or dual
    cache keeps), later ones full again (cache none) or the cached window; per row every open position whose
    confidence passes the threshold, at least one (``_threshold_choice``)."""
    phases = ("full", "cached")

    def __init__(self, k: FastDllmKnobs, mask: int, gen: torch.Generator | None):
        super().__init__(k, mask, gen, k.block_length)
        self.shift, self.thr, self.propose = int(k.shift), as_float32(k.threshold), _fast_dllm_propose(k, gen, mask)
        self.cache = None

    def begin_block(self, run: BlockRun, lo: int, hi: int) -> None:
        self.window = _cached_window(self.attn, lo, hi, self.shift, self.k.dream_loop, self.k.cache == "dual")
        self.cache = None  # the last block's is dropped before this block's first forward

    def step(self, run: BlockRun, lo: int, hi: int, s: int, open_: list[list[int]]):
        k, x, pos, shift, total = self.k, self.x, self.pos, self.shift, self.x.shape[1]
        model, meter, (a, window_idx, order), mode = run.model, run.meter, self.window, k.cache
        if s == 0 or mode == "none":
            if s == 0:
                self.cache = None if mode == "none" else new_cache(model, meter)
            kv = self.cache
            x0, prob = proposal(model, meter, "full", x, slice(lo - shift, hi - shift), stream_chunk(k), self.propose,
                                position_ids=pos, attention_mask=self.attn, cache=kv)  # [b, block] each
            if s == 0 and mode == "prefix":
                cache_keep(kv, a)  # keep positions < a (x is in position order)
            elif s == 0 and mode == "dual":
                cache_keep(kv, a, torch.arange(hi - a, total - a, device=x.device))  # prefix + suffix
        elif mode == "prefix":
            x0, prob = proposal(model, meter, "cached", x[:, a:], window_idx, stream_chunk(k), self.propose,
                                position_ids=pos[:, a:], attention_mask=self.attn, cache=self.cache)
            cache_keep(self.cache, a)
        else:  # dual
            x0, prob = proposal(model, meter, "cached", x[:, a:hi], window_idx, stream_chunk(k), self.propose,
                                position_ids=pos[:, a:hi], attention_mask=order, cache=self.cache)
            cache_keep(self.cache, a + total - hi)
        return x0, _threshold_choice(prob, k, open_, s == 0, self.thr)  # the step's logits are gone already


def _cached_window(attn: torch.Tensor, lo: int, hi: int, shift: int, dream_loop: bool,
                   dual: bool) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """Where ``fast_dllm``'s cached steps read block [lo, hi): (a, window_idx [block], order [B, kv] or None).
    Block token j is predicted by the logit at j - shift. Cached steps forward the window [a, ...): from lo - 1
    when that logit is needed there, from lo in the Dream loop (token lo is already committed by then; its slot
    gets a stand-in logit, never read) and without shift; window_idx picks each block token's logit from the
    window's. With the dual cache, ``order`` is the padding mask in cache order: prefix, suffix, then the window."""
    a = lo - int(shift and not dream_loop)
    window_idx = (torch.arange(lo, hi, device=attn.device) - shift - a).clamp_min(0)  # [block]
    order = torch.cat([attn[:, :a], attn[:, hi:], attn[:, a:hi]], 1) if dual else None
    return a, window_idx, order


def _fast_dllm_propose(k: FastDllmKnobs, gen: torch.Generator | None, mask: int):
    """``fast_dllm``'s proposal, block logits [B, block, V] -> (x0 [B, block], prob [B, block]): Dream's sampler in
    the Dream loop, else LLaDA's."""
    if k.dream_loop:
        return lambda logits: dream_propose(logits, "maskgit_plus", k.temperature, k.top_p, k.top_k, gen, mask)
    return lambda logits: llada_propose(logits, k.temperature, gen, mask)


def _threshold_choice(prob: torch.Tensor, k: FastDllmKnobs, open_: list[list[int]], first: bool,
                      thr: float) -> list[list[int]]:
    """One ``fast_dllm`` step's choice from its confidences prob [B, block]: per row the block positions to commit,
    a host list. The Dream loop's full forward fixes the block's first token only (the authors' rule);
    otherwise commit_topk's rule on the host: per row every open position whose confidence passes ``thr`` (at
    least the most confident one), most confident first, ties to the leftmost."""
    dream_loop = k.dream_loop
    if dream_loop and first:
        return [[0] for _ in open_]
    conf = prob.tolist()  # [B][block], float32 values
    chosen = []
    for c, op in zip(conf, open_):
        passed = sum(1 for j in op if (c[j] >= thr if dream_loop else c[j] > thr))
        chosen.append(top_open(c, op, max(passed, 1 if op else 0)))
    return chosen


def _dream_greedy(model, meter, k, x, attn, pos, p0, times, mask, eos) -> None:
    """``dream``'s loop for greedy top-k unmasking (temperature 0, alg != origin, alg_temp 0), with its
    bookkeeping on the host once per step (docs/design.md §6): the open positions of each row are a host
    list, the proposal and confidence are computed for the open columns only (each row's softmax and
    confidence do not depend on the other rows), and the schedule's float32 count, the top-k choice and the
    stop check read host values. Same tokens as the general loop; writes x in place."""
    resp, rows, gen_length = x[:, p0:], x.shape[0], x.shape[1] - p0
    open_ = [list(range(gen_length)) for _ in range(rows)]
    toks: list[list[int | None]] = [[None] * gen_length for _ in range(rows)]  # committed tokens, host copy
    eos_set, steps = frozenset(eos), times.numel() - 1
    parts = (1 - times[1:] / times[:-1]).tolist()  # float32 values: the share of the masks step i unmasks
    for i in range(steps):
        if not any(open_):
            break
        cols = sorted(set().union(*open_))  # columns still open in some row
        where = {j: t for t, j in enumerate(cols)}
        # Shift: position p0 - 1 + j predicts response token j; the float32 copy of the open columns only.
        keep = slice(p0 - 1, -1) if len(cols) == gen_length else torch.tensor(cols, device=x.device) + (p0 - 1)
        x0, conf = proposal(model, meter, "step", x, keep, stream_chunk(k),  # [B, m] each; no logits left after
                            lambda lg: dream_propose(lg, k.alg, k.temperature, k.top_p, k.top_k, None, mask),
                            position_ids=pos, attention_mask=attn)
        last, left = i == steps - 1, steps - i
        confs, x0s = conf.tolist(), x0.tolist()
        chosen = []
        for b in range(rows):
            m = len(open_[b])
            if last:
                n = m
            elif k.transfer_schedule == "dream":  # int() of a float32 product: truncation, as Dream
                n = int(torch.tensor(m, dtype=torch.float32) * parts[i]) if m else 0
            else:
                n = m // left
            row = confs[b]
            chosen.append(top_open({j: row[where[j]] for j in open_[b]}, open_[b], n))
        r = [b for b, c in enumerate(chosen) for _ in c]
        c = [j for cs in chosen for j in cs]
        if c:
            resp[torch.tensor(r, device=x.device), torch.tensor(c, device=x.device)] = torch.tensor(
                [x0s[b][where[j]] for b, j in zip(r, c)], device=x.device)
        f, kind = meter.calls - 1, meter.phase_log[-1]
        for b, cs in enumerate(chosen):
            for j in cs:
                toks[b][j] = x0s[b][where[j]]
            if cs:
                meter.commit(b, cs, [f] * len(cs), [kind] * len(cs))
            open_[b] = [j for j in open_[b] if j not in set(cs)]
        if k.stop_at_eos and all(settled_row(t, eos_set) for t in toks):
            break


def settled_row(toks: list[int | None], eos_set: frozenset) -> bool:
    """Host form of ``settled`` for one row's committed tokens (None = still masked): an EOS with nothing
    masked before it. For decoders that keep their tokens on the host (dream's greedy loop, d2f)."""
    for t in toks:
        if t is None:
            return False
        if t in eos_set:
            return True
    return False


@torch.no_grad()
def dream(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    knobs: DreamKnobs | dict | None = None,
    *,
    mask_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    **overrides,
) -> tuple[list[torch.Tensor], dict]:
    """Dream's ``diffusion_generate`` (Ye et al. 2025, "Dream 7B", arXiv 2508.15487): the whole
    response is one masked window; each of ``steps`` full forwards (no cache) shifts the
    logits (the logit at i - 1 predicts token i) and unmasks part of the window.

    Schedule (transfer_schedule): with m masks left before step i (0-based) of a row, t and
    s the step's two times on Dream's float32 ``linspace(1, eps, steps + 1)``, ``dream``
    unmasks int(m (1 - s/t)) tokens, computed in float32 as Dream's ``_sample`` does, and
    all that are left at the last step: with steps = gen_length its first step unmasks
    nothing and its last one two. ``limit`` takes eps -> 0, m // (steps - i): exactly one
    token per step when steps = gen_length. ``origin`` instead unmasks each masked token
    with probability 1 - s/t (``limit``: 1 / (steps - i); 1 at the last step), its token
    from ``dream_propose``; the other algs unmask the top-k masked positions by their
    confidence (see ``dream_propose``), or with alg_temp > 0 positions drawn from
    softmax(confidence / alg_temp). Rows share one generator (seeded), so under sampling a
    row's tokens depend on its batch.

    stop_at_eos ends as soon as every row holds an EOS with nothing masked before it (the
    reference runs all steps; the returned tokens are the same). Phase: step.
    """
    k = DreamKnobs.of(knobs, overrides, "dream")
    mask, eos = mask_id(model, mask_token_id), eos_ids(model, eos_token_id)
    rule = DreamRule(k, mask, make_generator(input_ids.device, k.seed))
    return decode_blocks(model, input_ids, attention_mask, rule, eos)


class DreamRule(CanvasRule):
    """``dream``'s rule for the shared block loop: the whole response is one block (Dream's one masked window),
    decided by its steps: ``_dream_greedy`` for greedy top-k unmasking, else ``_dream_steps`` (sampling,
    ``origin``, ``alg_temp``)."""
    phases = ("step",)

    def __init__(self, k: DreamKnobs, mask: int, gen: torch.Generator | None):
        super().__init__(k, mask, gen, k.gen_length)
        self.steps = steps_of(k)

    def budget(self, grid: BlockGrid) -> tuple[int, int | None]:
        return self.gen_length, self.steps  # steps may exceed gen_length (Dream)

    def decide(self, run: BlockRun, j: int, _opening: torch.Tensor | None) -> torch.Tensor:
        k, x = self.k, self.x
        # Dream's times, float32 on the decoding device as in the reference (the rounding of int() depends on it).
        times = torch.linspace(1, k.eps, self.steps + 1, dtype=torch.float32, device=x.device)
        args = (run.model, run.meter, k, x, self.attn, self.pos, self.p0, times, self.mask, run.eos)
        if k.temperature == 0 and k.alg != "origin" and k.alg_temp == 0:
            _dream_greedy(*args)
        else:
            _dream_steps(*args, self.gen)
        return x[:, self.p0:]


def _dream_steps(model, meter, k, x, attn, pos, p0, times, mask, eos, gen) -> None:
    """``dream``'s general loop (sampling, ``origin``, ``alg_temp``): each step a full forward, the shifted
    proposal of every position, and the schedule's share of the masked ones unmasked; writes x in place."""
    resp, steps = x[:, p0:], times.numel() - 1  # [B, G] view: writes land in x
    for i in range(steps):
        masked = resp == mask  # [B, G]
        if not bool(masked.any()):
            break  # origin can finish early; the remaining steps would change nothing
        # Shift: position p0 - 1 + j predicts response token j. [B, G, V]
        x0, conf = proposal(model, meter, "step", x, slice(p0 - 1, -1), stream_chunk(k),  # [B, G] each
                            lambda lg: dream_propose(lg, k.alg, k.temperature, k.top_p, k.top_k, gen, mask),
                            position_ids=pos, attention_mask=attn)
        last, left = i == steps - 1, steps - i
        part = 1 - times[i + 1] / times[i]  # 0-d float32: the share of the masks this step unmasks
        if k.alg == "origin":
            p_take = 1.0 if last else (part if k.transfer_schedule == "dream" else 1.0 / left)
            take = masked & (torch.rand(masked.shape, generator=gen, device=x.device) < p_take)
            resp[take] = x0[take]
        else:
            conf = torch.where(masked, conf, torch.full_like(conf, -torch.inf))
            m = masked.sum(-1)  # [B]
            if last:
                n = m
            elif k.transfer_schedule == "dream":
                n = (m.to(torch.float32) * part).long()  # int() of a float32 product: truncation, as Dream
            else:
                n = m // left
            if k.alg_temp > 0:
                commit_sampled(resp, x0, conf / k.alg_temp, n, gen)
            else:
                commit_topk(resp, x0, conf, n)
        meter.settle(resp, mask)
        if k.stop_at_eos and settled(resp, mask, eos):
            break
