"""Peak decode memory at released model size, weights excluded, with no real weights and no real
compute: the released architectures are built under ``FakeTensorMode`` (every tensor has a shape, a dtype
and a storage of the right ``nbytes``, but no data), and each decoder's largest forwards -- its *phases* --
are driven through the same dispatch tracker that measures real decodes (harness/run/memory.py).

    table = released_table(batches=(1, 8), prompt=256, gen=512)
    table["models"]["refusion-8b"]["decoders"]["refusion"]["8"]["peak_bytes"]

    python -m harness.speed.memory_estimate --out results/memory_estimate.json

**The estimate** of a decoder at (batch, prompt, gen) is the largest phase peak. A phase builds the state the
decoder holds when that forward runs -- its KV cache at that length (zeros in the model's dtype), the
previous step's logits where the decoder still holds them -- *inside* the tracked region, then runs the
forward and the decoder's work on its logits (common.forward's finiteness reduction in the model's dtype and
float32 copy of the positions the step reads, the softmax / max of a greedy pick, Dream's entropy, a cache
commit). So a phase's peak is live KV at that phase plus that forward's peak of new storages. Each step's logits
are dropped before the next forward, as the decoders drop them. ``Shape.chunk`` is the knob logits_chunk of
the STREAMED decoders (default LOGITS_CHUNK): their phases make the logits of ``chunk`` decided positions at a
time from the backbone's hidden states (common.streamed_proposal, heads.Heads); with None, the model's own
forward over every position.
Phases (B batch, P prompt, G gen, L slot size, K block length):

- ``ar``: prefill (P tokens, logits [B, P, V], float32 of the last); step (two one-token steps ending with the
  cache at P+G-1).
- ``refusion``: plan (the first round: prompt + every slot as masks, [B, P+G] in one stacked call; each row's
  prompt KV committed; the slots' first tokens, then, worst case every slot picked, the drafts of all G
  positions, ``chunk`` positions at a time -- with None the logits [B, P+G, V], float32 of the G slot positions,
  the drafts 8 slots at a time); verify (the first global verify: rows' caches at P, moved into the stacked
  call's padded copy layer by layer, the drafts [B, G]; every draft accepted and committed, each row's cache a
  view of the stacked result that the commit widens); late (rows' caches at P+G-L: plan and verify of the last
  slot, stacked the same way). A batch of one runs on its own cache (no stacked copy).
- ``llada`` / ``dream``: two full forwards over [B, P+G] with no cache; LLaDA softmaxes a block [B, K, V],
  Dream the open columns [B, G, V] (the second step's G-1 columns gathered) and computes their entropy.
- ``fast_dllm`` (dual cache): full (a block's first forward over [B, P+G] writing the cache, then the
  prefix + suffix kept: the first block's suffix is copied); cached (two block steps [B, K] against the
  cache at P+G-K). ``fast_dllm (prefix)``: full (the prefix kept); cached (the first block's steps, block and
  suffix [B, G] against the prompt's KV).
- ``d2f``: first (prompt + first block [B, P+K] in one stacked call, the block's ``chunk`` positions at a time
  -- with None every position's float32 logits --, the prompt's KV kept); late (two active blocks [B, 2K]
  after caches at P+G-2K, the first one kept).
- ``sdar``: prefill (the prompt's blocks, block-causal, no logits: KV only); denoise (two steps and the store
  forward of the last block [B, 4] after the cache at P+G-4).
- ``llada2``: the same two phases with its block of 32, its model's float32 logits; its routed experts at their
  worst case (``_routing_worst_case``: every token choosing the same k experts).

**The floor** (``floor``): the KV cache the algorithm holds at its largest (FLOOR_KV), the tracker's peak of the
backbone alone over its largest forward (embeddings, residual stream, one layer's transients) and one chunk of
logits (B x 32 positions; AR 1, SDAR its block) in the model's dtype and float32. ``decoder_entry`` gives each
estimate with its floor, the ratio, and for the decoders with logits_chunk the estimate with it none.

**What it leaves out**: everything the tracker leaves out (harness/run/memory.py: allocator caching and
rounding, kernels' scratch, the interpreter), the weights (``weights_bytes`` beside), data-dependent work the
phases do not replay (ReFusion's parallel infill with the slot KV kept aside -- smaller than the late phase's
whole cache --, an argmax that lands on the mask id and is redone, EOS handling), the decoders' small host-side
bookkeeping tensors ([B, G] token buffers), Fast-dLLM's Dream shift (same shapes, one position over) and
D2F's (a shifted copy of the forward's hidden states [B, q, H]; with logits_chunk none, of its float32 logits).
Prompts are of one length (no padding): the decoders' 2-D padding masks are all ones, which transformers
reads and drops (SDPA then runs with ``is_causal`` or no mask, and GQA without repeating the KV heads); fake
tensors cannot be read, so the phases hand the model None, the same outcome. A left-padded batch would add
its masks [B, 1, q, kv] and, with grouped KV heads, each layer's repeated keys / values. ReFusion's explicit
visibility masks are built and passed as the decoder does. Attention runs the kernel the CPU picks for fake
tensors (SDPA's flash attention for CPU, every phase: no [q, kv] score matrix), as the fused kernels a GPU
picks; the estimate is of CPU-style dispatch with bfloat16 storage sizes.

tests/test_memory.py checks the fake estimate against the same phases run with real tensors on the tiny
checkpoints (within 5%; they agree to the byte), and the phases' maximum against the real decoders' measured
peaks (within 5%).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import DynamicCache

from harness.models.checkpoints import build_config, inspect_checkpoint, model_class
from harness.models.families import FAMILIES
from harness.run.memory import LEAVES_OUT, DecodeMemory, weights_bytes
from harness.run.store import atomic_write_json
from refusion.decoding import DECODERS
from refusion.decoding.common import cache_append, cache_from, cache_keep, floated, model_mask, positions_from_mask
from refusion.decoding.heads import Heads, chunks, greedy_at, prob_at
from refusion.decoding.knobs import LOGITS_CHUNK
from refusion.decoding.mdm import FastDllmKnobs
from refusion.decoding.refusion import PLAN_CHUNK, RefusionKnobs, Req, stack_rows


@dataclass(frozen=True)
class Shape:
    """One decode's size: batch, prompt and response length; ReFusion's slot size and the block length of
    LLaDA / Fast-dLLM, by default the decoders' own knob defaults."""
    batch: int
    prompt: int
    gen: int
    slot_size: int = RefusionKnobs.slot_size
    block_length: int = FastDllmKnobs.block_length
    chunk: int | None = LOGITS_CHUNK  # the knob logits_chunk of the STREAMED decoders (None: the model's own forward)


@dataclass(frozen=True)
class Released:
    family: str       # harness/models/families.py
    config: dict      # the published config.json fields the family maps (Family.to_config)
    decoders: tuple[str, ...]
    source: str


RELEASED = {
    "refusion-8b": Released("refusion", dict(
        model_type="qwen3", auto_map={"AutoModelForCausalLM": "modeling_qwen3_refusion.Qwen3ForCausalLM"},
        vocab_size=151671, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, max_position_embeddings=40960),
        ("refusion", "ar"), "Qwen3-8B shape, ReFusion's vocabulary 151671 (families.py)"),
    "llada-8b": Released("llada", dict(
        model_type="llada", d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, mlp_hidden_size=12288,
        vocab_size=126464, embedding_size=126464, max_sequence_length=4096, rope_theta=500000.0,
        weight_tying=False, mask_token_id=126336), ("llada", "fast_dllm", "fast_dllm (prefix)", "d2f"),
        "GSAI-ML/LLaDA-8B-Instruct config.json fields (OLMo-style), as LlamaForCausalLM"),
    "dream-7b": Released("dream", dict(
        model_type="Dream", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False, max_position_embeddings=131072),
        ("dream", "fast_dllm", "fast_dllm (prefix)", "d2f"), "Qwen2.5-7B shape (qkv bias), as Qwen2ForCausalLM"),
    "sdar-8b": Released("sdar", dict(
        model_type="sdar", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
        max_position_embeddings=32768, block_size=4), ("sdar",),
        "JetLM/SDAR-8B-Chat: Qwen3-8B shape, Qwen3's vocabulary 151936, block 4, as Qwen3ForCausalLM"),
    "llada2-mini": Released("llada2", dict(
        model_type="llada2_moe", vocab_size=157184, hidden_size=2048, intermediate_size=5120, num_hidden_layers=20,
        num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=256, num_experts_per_tok=8,
        num_shared_experts=1, n_group=8, topk_group=4, moe_intermediate_size=512, first_k_dense_replace=1,
        routed_scaling_factor=2.5, partial_rotary_factor=0.5, rope_theta=600000.0, use_qk_norm=True,
        use_qkv_bias=False, use_bias=False, tie_word_embeddings=False, max_position_embeddings=32768,
        pad_token_id=156892), ("llada2",),
        "inclusionAI/LLaDA2.0-mini config.json fields (as a public loader test quotes them: 20 layers, 256 routed "
        "experts, 8 a token, 1 shared), as refusion/llada2_moe.py"),
}
# The decoders each committed tiny checkpoint runs (checkpoints/tiny/<name>), for the fake-vs-real check.
TINY_DECODERS = {"ar": ("ar",), "refusion": ("refusion", "ar"), "mdm": ("llada", "fast_dllm", "fast_dllm (prefix)"),
                 "dream": ("dream", "fast_dllm"), "d2f": ("d2f",)}


# ---------------------------------------------------------------- models with no data


def fake_model(family: str, raw: dict, dtype: torch.dtype, mode: FakeTensorMode):
    """The family's transformers class (or this project's, ``model_class``) for a published config, its
    parameters fake tensors of ``dtype``."""
    fam = FAMILIES[family]
    cfg = build_config(fam, copy.deepcopy(raw))
    with mode:
        return model_class(fam)._from_config(cfg, dtype=dtype).eval()


def fake_tiny(folder, mode: FakeTensorMode):
    """A committed checkpoint folder's model (its family, config and dtype) with fake parameters."""
    info = inspect_checkpoint(folder)
    dtype = getattr(torch, info.config.get("dtype") or info.config.get("torch_dtype") or "float32")
    return fake_model(info.family.name, info.config, dtype, mode)


# ---------------------------------------------------------------- the phases' pieces


def _dims(model) -> tuple[int, int, int]:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim


def _cache(model, batch: int, length: int):
    """A DynamicCache holding ``length`` tokens of KV per layer: keys / values [batch, kv_heads, length, d]."""
    layers, heads, d = _dims(model)
    shape = (batch, heads, length, d)
    return cache_from(model, [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
                              for _ in range(layers)])


def _forward(model, ids, pos, *, mask=None, visible=None, cache=None, keep=None) -> torch.Tensor:
    """common.forward's tensors: the model call, check_finite's reduction over its logits [B, q, V] in the model's
    dtype, then the float32 copy of the kept positions (``floated``: [B, k, V]; all with ``keep`` None)."""
    mask = model_mask(model, mask, visible)
    kv_only = isinstance(keep, slice) and keep.start == keep.stop == 0  # the LM head on no position at all
    extra = {"logits_to_keep": torch.zeros(0, dtype=torch.long)} if kv_only else {}
    logits = model(input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache,
                   use_cache=cache is not None, **extra).logits
    if not kv_only:
        logits.amax(-1)  # [B, q]
    return floated(logits, keep)


def _streamed_hidden(model, ids, pos, *, mask=None, cache=None) -> torch.Tensor:
    """common.forward_streamed's tensors: the model's forward with the last position's logits only (their
    finiteness reduction); returns the backbone's hidden states [B, q, H]."""
    hidden = []
    hook = model.get_decoder().register_forward_hook(lambda _m, _a, out: hidden.append(out.last_hidden_state))
    try:
        model(input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache, use_cache=cache is not None,
              logits_to_keep=1).logits.amax(-1)
    finally:
        hook.remove()
    return hidden[0]


def _proposal(model, ids, pos, keep, s: Shape, step, *, cache=None) -> None:
    """common.proposal's tensors: with ``s.chunk`` None ``_forward`` then ``step`` on its kept logits; else
    common.streamed_proposal's: ``_streamed_hidden``, then, ``s.chunk`` kept positions at a time, the LM head's
    logits [B, n, V], their float32 copy, check_finite's reduction and ``step``."""
    if s.chunk is None:
        step(_forward(model, ids, pos, cache=cache, keep=keep))
        return
    hidden = _streamed_hidden(model, ids, pos, cache=cache)
    if isinstance(keep, slice):
        keep = slice(*keep.indices(hidden.shape[1])[:2])
    for part in chunks(keep, s.chunk):
        logits = model.get_output_embeddings()(hidden[:, part]).float()
        logits.amax(-1)
        step(logits)
        del logits


def _pick(logits: torch.Tensor) -> torch.Tensor:
    """A greedy pick's tensors: softmax [..., V], then its max -> tokens [...]."""
    return torch.softmax(logits, -1).max(-1)[1]


def _tokens(batch: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, padding mask, positions), each [batch, n]; token 4 everywhere (any id: values change no size).
    The mask is all ones (prompts of one length): the phases build it as the decoders do but hand the model
    None, which is what transformers makes of an all-ones mask after reading it (fake tensors cannot be read)."""
    ids = torch.full((batch, n), 4, dtype=torch.long)
    mask = torch.ones(batch, n, dtype=torch.long)
    return ids, mask, positions_from_mask(mask)


def _entropy_propose(logits: torch.Tensor) -> None:
    """mdm.dream_propose's tensors for alg entropy: softmax [..., V], its max, the entropy's temporaries."""
    probs = logits.softmax(-1)
    probs.max(-1)
    (probs * torch.log(probs + 1e-10)).sum(-1)


def _visible(batch: int, cached: int, q: int) -> torch.Tensor:
    """Bool [batch, q, cached + q]: everything cached, causal among the query (ReFusion's dense pattern)."""
    vis = torch.ones(q, cached + q, dtype=torch.bool).tril(cached)
    return vis.expand(batch, -1, -1)


# ---------------------------------------------------------------- phases


def ar_prefill(model, s: Shape) -> None:
    ids, _, pos = _tokens(s.batch, s.prompt)
    cache = DynamicCache(config=model.config)
    logits = _forward(model, ids, pos, cache=cache, keep=slice(-1, None))[:, -1]  # [B, V]
    _pick(logits)


def ar_step(model, s: Shape) -> None:
    start = s.prompt + max(s.gen - 3, 0)
    cache = _cache(model, s.batch, start)
    logits = torch.zeros(s.batch, model.config.vocab_size)  # the step before's [B, V]
    for n in (start, start + 1):  # each step's logits are dropped once its token is picked, before the next
        tok = _pick(logits)
        del logits
        pos = torch.full((s.batch, 1), n, dtype=torch.long)
        # the decoder hands the model its padding mask [B, n + 1], all ones: transformers makes None of it
        logits = _forward(model, tok[:, None], pos, cache=cache)[:, -1]
    _pick(logits)


def _heads(model, ids, pos, visible, cache, skip: int, chunk: int | None) -> Heads:
    """common.forward_heads' tensors for a visibility-masked call: with ``chunk`` None ``_forward``'s float32
    logits of the positions from ``skip``; else ``_streamed_hidden``, kept for ``Heads.at``."""
    if chunk is None:
        return Heads(dense=_forward(model, ids, pos, visible=visible, cache=cache, keep=slice(skip, None)))
    hidden = _streamed_hidden(model, ids, pos, mask=model_mask(model, None, visible), cache=cache)
    return Heads(hidden=hidden[:, skip:], head=model.get_output_embeddings(), check=lambda lg: lg.amax(-1))


def _stacked(model, s: Shape, rows: list, q: int, pos_from: int, commit: int, skip: int = 0,
             chunk: int | None = None) -> list[Heads]:
    """refusion.stacked_call's tensors for every row asking q tokens after its cache (the rows' caches are
    equally long): one row runs on its own cache, cropped straight back; several on a padded copy of their caches,
    which each row's cache moves into and is then a view of. Then each row commits the KV of its first ``commit``
    query tokens (``cache_append``: the view widened, no copy).
    Returns per row the logits of its q - skip read positions (``Heads``: ``_heads`` with ``chunk``).
    """
    t = rows[0].get_seq_length()
    ids = torch.full((s.batch, q), 4, dtype=torch.long)
    pos = torch.arange(pos_from, pos_from + q).expand(s.batch, -1)
    if s.batch == 1:
        heads = _heads(model, ids, pos, _visible(1, t, q), rows[0], skip, chunk)
        answers = [(heads, [(lay.keys[:, :, -q:], lay.values[:, :, -q:]) for lay in rows[0].layers])]
        rows[0].crop(-q)
    else:
        vis = torch.zeros(s.batch, q, t + q, dtype=torch.bool)
        vis[:] = _visible(s.batch, t, q)
        # as stacked_call: each row's cache moved into the padded copy layer by layer (stack_rows), then made
        # its part of the stacked result
        reqs = [Req("phase", row, ids[b:b + 1], pos[b:b + 1], None) for b, row in enumerate(rows)]
        stacked = cache_from(model, stack_rows(reqs, [t] * s.batch, [1] * s.batch, t, [t > 0] * s.batch))
        heads = _heads(model, ids, pos, vis, stacked, skip, chunk)  # every row skips as much
        answers = []
        for b, row in enumerate(rows):
            if t:
                for mine, lay in zip(row.layers, stacked.layers):
                    mine.keys, mine.values = lay.keys[b:b + 1, :, :t], lay.values[b:b + 1, :, :t]
            answers.append((heads.part(slice(b, b + 1), slice(None)),
                            [(lay.keys[b:b + 1, :, t:], lay.values[b:b + 1, :, t:]) for lay in stacked.layers]))
    if commit:
        for row, (_, kv) in zip(rows, answers):
            cache_append(row, [[(k[:, :, :commit], v[:, :, :commit]) for k, v in kv]])
    return [h for h, _ in answers]


def refusion_plan(model, s: Shape) -> None:
    rows = [DynamicCache(config=model.config) for _ in range(s.batch)]
    m = -(-s.gen // s.slot_size)  # slots, all masked
    # the prompt's KV committed; its logits not read (skip)
    for heads in _stacked(model, s, rows, s.prompt + m * s.slot_size, 0, s.prompt, skip=s.prompt, chunk=s.chunk):
        greedy_at(heads, torch.arange(m) * s.slot_size, s.chunk)  # the slots' first tokens
        # worst case: every slot picked, its drafts s.chunk positions (or PLAN_CHUNK slots) at a time
        greedy_at(heads, torch.arange(m * s.slot_size), s.chunk or PLAN_CHUNK * s.slot_size)


def refusion_verify(model, s: Shape) -> None:
    rows = [_cache(model, 1, s.prompt) for _ in range(s.batch)]
    q = -(-s.gen // s.slot_size) * s.slot_size  # every slot drafted
    tokens = torch.full((q - 1,), 4, dtype=torch.long)
    for heads in _stacked(model, s, rows, q, s.prompt, q, chunk=s.chunk):  # worst case: every draft accepted
        prob_at(heads, slice(0, q - 1), tokens, 0.0, s.chunk)


def refusion_late(model, s: Shape) -> None:
    t = s.prompt + -(-s.gen // s.slot_size) * s.slot_size - s.slot_size
    rows = [_cache(model, 1, t) for _ in range(s.batch)]
    L = s.slot_size
    for heads in _stacked(model, s, rows, L, t, 0, chunk=s.chunk):  # plan of the last slot
        greedy_at(heads, torch.arange(1), s.chunk)
        greedy_at(heads, torch.arange(L), s.chunk or PLAN_CHUNK * L)
    del heads  # drive_rows drops each answer once its row has read it
    for heads in _stacked(model, s, rows, L, t, L, chunk=s.chunk):  # its verify and commit
        prob_at(heads, slice(0, L - 1), torch.full((L - 1,), 4, dtype=torch.long), 0.0, s.chunk)


def llada_step(model, s: Shape) -> None:
    ids, _, pos = _tokens(s.batch, s.prompt + s.gen)
    lo = s.prompt
    for _ in range(2):  # two steps: the first one's logits are gone before the second forward
        _proposal(model, ids, pos, slice(lo, lo + s.block_length), s, _pick)


def dream_step(model, s: Shape) -> None:
    ids, _, pos = _tokens(s.batch, s.prompt + s.gen)
    for open_cols in (s.gen, s.gen - 1):  # the second step proposes at its open columns only
        keep = slice(s.prompt - 1, -1) if open_cols == s.gen else torch.arange(open_cols) + (s.prompt - 1)
        _proposal(model, ids, pos, keep, s, _entropy_propose)


def fast_dllm_full(model, s: Shape) -> None:
    ids, _, pos = _tokens(s.batch, s.prompt + s.gen)
    lo, hi, total = s.prompt, s.prompt + s.block_length, s.prompt + s.gen
    cache = DynamicCache(config=model.config)
    _proposal(model, ids, pos, slice(lo, hi), s, _pick, cache=cache)
    cache_keep(cache, lo, torch.arange(hi - lo, total - lo))  # the first block: the suffix copied


def fast_dllm_cached(model, s: Shape) -> None:
    ids, mask, pos = _tokens(s.batch, s.prompt + s.gen)
    lo, hi, total = s.prompt, s.prompt + s.block_length, s.prompt + s.gen
    cache = _cache(model, s.batch, total - s.block_length)
    torch.cat([mask[:, :lo], mask[:, hi:], mask[:, lo:hi]], 1)  # the mask in cache order (all ones: None)
    window = torch.arange(s.block_length)
    for _ in range(2):
        _proposal(model, ids[:, lo:hi], pos[:, lo:hi], window, s, _pick, cache=cache)
        cache_keep(cache, lo + total - hi)


def fast_dllm_prefix_full(model, s: Shape) -> None:
    ids, _, pos = _tokens(s.batch, s.prompt + s.gen)
    lo, hi = s.prompt, s.prompt + s.block_length
    cache = DynamicCache(config=model.config)
    _proposal(model, ids, pos, slice(lo, hi), s, _pick, cache=cache)
    cache_keep(cache, lo)  # the prefix only


def fast_dllm_prefix_cached(model, s: Shape) -> None:
    """The first block's cached steps: block + suffix [B, G] forwarded against the prompt's KV (the largest query
    of the prefix cache), its KV dropped again after each step."""
    ids, _, pos = _tokens(s.batch, s.prompt + s.gen)
    lo = s.prompt
    cache = _cache(model, s.batch, lo)
    for _ in range(2):
        _proposal(model, ids[:, lo:], pos[:, lo:], torch.arange(s.block_length), s, _pick, cache=cache)
        cache_keep(cache, lo)


def d2f_first(model, s: Shape) -> None:
    """d2f's first step: prompt + the first block [B, P + K] in one stacked call (with ``chunk`` None every
    position's float32 logits), the prompt's KV kept; the block's greedy pick."""
    rows = [DynamicCache(config=model.config) for _ in range(s.batch)]
    for heads in _stacked(model, s, rows, s.prompt + s.block_length, 0, s.prompt, chunk=s.chunk):
        greedy_at(heads, slice(s.prompt, s.prompt + s.block_length), s.chunk)


def d2f_late(model, s: Shape) -> None:
    """d2f late in the response: two active blocks [B, 2K] after caches at P + G - 2K; the first one finished and
    kept."""
    t = s.prompt + s.gen - 2 * s.block_length
    rows = [_cache(model, 1, t) for _ in range(s.batch)]
    for heads in _stacked(model, s, rows, 2 * s.block_length, t, s.block_length, chunk=s.chunk):
        greedy_at(heads, torch.arange(2 * s.block_length), s.chunk)  # both blocks' positions, as an index


def _block_visible(batch: int, n: int, size: int) -> torch.Tensor:
    """Bool [batch, n, n]: block-causal over blocks of ``size`` (SDAR's prefill of the prompt's whole blocks)."""
    blk = torch.arange(n) // size
    return (blk[None, :] <= blk[:, None]).expand(batch, -1, -1)


def sdar_prefill(model, s: Shape) -> None:
    """block_loop's prefill: the prompt's whole blocks [B, P] block-causal into the cache, no float32 logits."""
    ids, _, pos = _tokens(s.batch, s.prompt)
    _forward(model, ids, pos, visible=_block_visible(s.batch, s.prompt, SDAR_BLOCK), cache=DynamicCache(
        config=model.config), keep=slice(0, 0))


def sdar_denoise(model, s: Shape) -> None:
    """The last block: two denoise forwards of [B, K] after the cache at P + G - K (cut back before each), each
    step's logits gone before the next; then the store forward (KV only)."""
    t = s.prompt + s.gen - SDAR_BLOCK
    cache = _cache(model, s.batch, t)
    ids = torch.full((s.batch, SDAR_BLOCK), 4, dtype=torch.long)
    pos = torch.arange(t, t + SDAR_BLOCK).expand(s.batch, -1)
    vis = torch.ones(s.batch, SDAR_BLOCK, t + SDAR_BLOCK, dtype=torch.bool)
    for keep in (None, None, slice(0, 0)):
        cache_keep(cache, t)
        logits = _forward(model, ids, pos, visible=vis, cache=cache, keep=keep)
        torch.softmax(logits, -1).max(-1)  # the draw's probabilities and pick
        del logits


def llada2_prefill(model, s: Shape) -> None:
    """Llada2Rule.start's prefill: the prompt's whole blocks [B, P] block-causal into the cache; the model makes
    float32 logits of every position (its forward's own), none of them read."""
    ids, _, pos = _tokens(s.batch, s.prompt)
    with _routing_worst_case():
        _forward(model, ids, pos, visible=_block_visible(s.batch, s.prompt, LLADA2_BLOCK),
                 cache=DynamicCache(config=model.config), keep=slice(0, 0))


def llada2_denoise(model, s: Shape) -> None:
    """The last block: two denoise forwards of [B, K] after the cache at P + G - K (cut back before each), each
    step's float32 logits [B, K, V] read by llada2_propose (argmax, softmax, gather) and gone before the next;
    then the store forward (KV only)."""
    t = s.prompt + s.gen - LLADA2_BLOCK
    cache = _cache(model, s.batch, t)
    ids = torch.full((s.batch, LLADA2_BLOCK), 4, dtype=torch.long)
    pos = torch.arange(t, t + LLADA2_BLOCK).expand(s.batch, -1)
    vis = torch.ones(s.batch, LLADA2_BLOCK, t + LLADA2_BLOCK, dtype=torch.bool)
    with _routing_worst_case():
        for keep in (None, None, slice(0, 0)):
            cache_keep(cache, t)
            logits = _forward(model, ids, pos, visible=vis, cache=cache, keep=keep)
            guess = logits.argmax(-1)
            torch.softmax(logits.float(), dim=-1).gather(-1, guess[..., None])
            del logits, guess


@contextlib.contextmanager
def _routing_worst_case():
    """LLaDA2's routed experts run the experts some token chose only, by a host read of their token counts
    (refusion/llada2_moe.py: ``.tolist()``), which fake tensors cannot give. The phases take the worst case
    instead: every token's k choices are the same k experts, so each of those runs all N tokens (the largest
    per-expert transient [N, 2I]); the stacked rows [N * k, H] and their outputs are as in any routing. The
    expert loop below is the model's with those counts (kept in step with it by tests/test_memory.py)."""
    from refusion import llada2_moe

    def worst_case(self, x, ids, weights):
        n, k = ids.shape
        inner = self.down_proj.shape[-1]
        order = ids.reshape(-1).argsort()
        rows = x[order // k]  # [N*k, hidden]
        outs = []
        for e in range(k):  # k experts of N tokens each
            gate_up = torch.nn.functional.linear(rows[e * n:(e + 1) * n], self.gate_up_proj[e])  # [N, 2I]
            outs.append(torch.nn.functional.linear(torch.nn.functional.silu(gate_up[:, :inner]) * gate_up[:, inner:],
                                                   self.down_proj[e]))
        placed = torch.empty_like(rows)
        placed[order] = torch.cat(outs)
        return (placed.view(n, k, -1).float() * weights[:, :, None]).sum(dim=1).to(x.dtype)

    saved = llada2_moe.Experts.forward
    llada2_moe.Experts.forward = worst_case
    try:
        yield
    finally:
        llada2_moe.Experts.forward = saved


SDAR_BLOCK = 4  # SDAR's generate.py block_length (its folders' block_size)
LLADA2_BLOCK = 32  # Llada2Knobs.block_length's default (dInfer's LLaDA2 setup)
PHASES: dict[str, dict[str, Callable]] = {
    "ar": {"prefill": ar_prefill, "step": ar_step},
    "refusion": {"plan": refusion_plan, "verify": refusion_verify, "late": refusion_late},
    "llada": {"step": llada_step},
    "dream": {"step": dream_step},
    "fast_dllm": {"full": fast_dllm_full, "cached": fast_dllm_cached},
    "fast_dllm (prefix)": {"full": fast_dllm_prefix_full, "cached": fast_dllm_prefix_cached},
    "d2f": {"first": d2f_first, "late": d2f_late},
    "sdar": {"prefill": sdar_prefill, "denoise": sdar_denoise},
    "llada2": {"prefill": llada2_prefill, "denoise": llada2_denoise},
}
# The decoders with the knob logits_chunk (default LOGITS_CHUNK; their "full" estimate is logits_chunk none).
STREAMED = tuple(n for n in PHASES if "logits_chunk" in DECODERS[n.split(" (")[0]].knobs.names())
STREAM_CHUNK = LOGITS_CHUNK


# ---------------------------------------------------------------- estimates


def phase_peaks(model, decoder: str, s: Shape, mode: FakeTensorMode | None = None) -> dict[str, dict]:
    """Each phase of ``decoder`` run under its own DecodeMemory (and ``mode``, the fake mode of a fake model):
    phase -> {"peak_bytes", "breakdown"}."""
    out = {}
    for name, phase in PHASES[decoder].items():
        with mode if mode is not None else contextlib.nullcontext(), torch.no_grad(), DecodeMemory(model) as mem:
            phase(model, s)
        r = mem.result()
        out[name] = {"peak_bytes": r["peak_bytes"], "breakdown": r["breakdown"]}
    return out


def estimate(model, decoder: str, s: Shape, mode: FakeTensorMode | None = None) -> dict:
    """{"peak_bytes": the largest phase peak, "phase": its name, "breakdown": its breakdown, "phases":
    phase -> peak bytes}."""
    peaks = phase_peaks(model, decoder, s, mode)
    top = max(peaks, key=lambda p: peaks[p]["peak_bytes"])
    return {"peak_bytes": peaks[top]["peak_bytes"], "phase": top, "breakdown": peaks[top]["breakdown"],
            "phases": {p: v["peak_bytes"] for p, v in peaks.items()}}


# ---------------------------------------------------------------- the floor


# What a decoder's algorithm must hold at its largest moment (B batch, P prompt, G gen, K block, L slot): the
# tokens of its KV cache, the tokens of its largest forward (whose activations it must make), and the positions
# one chunk of logits covers (decided positions, at most ``STREAM_CHUNK``).
FLOOR_KV = {"ar": lambda s: s.prompt + s.gen - 1, "refusion": lambda s: s.prompt + s.gen, "llada": lambda s: 0,
            "dream": lambda s: 0, "fast_dllm": lambda s: s.prompt + s.gen - s.block_length,
            "fast_dllm (prefix)": lambda s: s.prompt + s.gen - s.block_length,
            "d2f": lambda s: s.prompt + s.gen - s.block_length, "sdar": lambda s: s.prompt + s.gen - SDAR_BLOCK,
            "llada2": lambda s: s.prompt + s.gen - LLADA2_BLOCK}
FLOOR_QUERY = {"ar": lambda s: s.prompt, "d2f": lambda s: s.prompt + s.block_length, "sdar": lambda s: s.prompt,
               "llada2": lambda s: s.prompt}
FLOOR_CHUNK = {"ar": 1, "sdar": SDAR_BLOCK, "llada2": LLADA2_BLOCK}


def _kv_bytes(model, batch: int, tokens: int) -> int:
    """2 (keys, values) x layers x batch x tokens x kv heads x head dim x bytes per element."""
    layers, heads, d = _dims(model)
    return 2 * layers * batch * tokens * heads * d * model.dtype.itemsize


def floor(model, decoder: str, s: Shape, mode: FakeTensorMode | None = None) -> dict:
    """The least a decode of ``decoder`` at ``s`` can hold: {"kv_cache": its KV at its largest (FLOOR_KV),
    "activations": the tracker's peak of the backbone alone (no cache, no logits) over its largest forward
    (FLOOR_QUERY, default P + G) -- embeddings, the residual stream and one layer's transients --, "logits": one
    chunk of B x FLOOR_CHUNK (default STREAM_CHUNK) positions' logits in the model's dtype and float32,
    "bytes": their sum}."""
    q = FLOOR_QUERY.get(decoder, lambda s: s.prompt + s.gen)(s)
    with mode if mode is not None else contextlib.nullcontext(), torch.no_grad(), DecodeMemory(model) as mem, \
            _routing_worst_case():
        ids, _, pos = _tokens(s.batch, q)
        if hasattr(model, "backbone"):  # refusion/llada2_moe.py: its forward without the LM head
            model.backbone(ids, pos)
        else:
            model.get_decoder()(input_ids=ids, position_ids=pos, use_cache=False)
    out = {"kv_cache": _kv_bytes(model, s.batch, FLOOR_KV[decoder](s)), "activations": mem.result()["peak_bytes"],
           "logits": s.batch * FLOOR_CHUNK.get(decoder, STREAM_CHUNK) * model.config.vocab_size
           * (model.dtype.itemsize + 4)}
    return {**out, "bytes": sum(out.values())}


def decoder_entry(model, decoder: str, s: Shape, mode: FakeTensorMode | None = None) -> dict:
    """``estimate`` at the decoder's default knobs (``s``), its ``floor`` and the ratio ``over_floor``; for the
    STREAMED decoders also ``full``, the estimate with logits_chunk none (the model's own forward), and its
    ratio."""
    entry = estimate(model, decoder, s, mode)
    entry["floor"] = floor(model, decoder, s, mode)
    entry["over_floor"] = round(entry["peak_bytes"] / entry["floor"]["bytes"], 3)
    if decoder in STREAMED:
        entry["logits_chunk"] = s.chunk
        full = estimate(model, decoder, replace(s, chunk=None), mode)
        full["over_floor"] = round(full["peak_bytes"] / entry["floor"]["bytes"], 3)
        entry["full"] = {"logits_chunk": None, **full}
    return entry


def released_table(batches=(1, 8), prompt: int = 256, gen: int = 512, models=None,
                   dtype: torch.dtype = torch.bfloat16) -> dict:
    """{"models": {model: {"weights_bytes", "source", "decoders": {decoder: {str(batch): decoder_entry}}}},
    "settings": ...} for the RELEASED models (all, or those named in ``models``)."""
    table: dict = {}
    for name in models or RELEASED:
        rel = RELEASED[name]
        mode = FakeTensorMode()
        model = fake_model(rel.family, rel.config, dtype, mode)
        table[name] = {"weights_bytes": weights_bytes(model), "source": rel.source, "decoders": {
            dec: {str(b): decoder_entry(model, dec, Shape(b, prompt, gen), mode) for b in batches}
            for dec in rel.decoders}}
    knobs = Shape(1, prompt, gen)
    settings = {"batches": list(batches), "prompt": prompt, "gen": gen, "dtype": str(dtype).removeprefix("torch."),
                "slot_size": knobs.slot_size, "block_length": knobs.block_length, "sdar_block": SDAR_BLOCK,
                "logits_chunk": STREAM_CHUNK}
    return {"models": table, "settings": settings,
            "method": "fake tensors at released size through the dispatch tracker; peak = max over phases of live "
                      "KV + the phase forward's new storages; weights excluded; floor = KV cache at its largest + "
                      "the backbone's peak over the largest forward + one chunk of logits",
            "leaves_out": LEAVES_OUT}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.speed.memory_estimate", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/memory_estimate.json")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--gen", type=int, default=512)
    ap.add_argument("--models", nargs="+", choices=sorted(RELEASED), default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    table = released_table(tuple(args.batches), args.prompt, args.gen, args.models)
    atomic_write_json(args.out, table)
    for model, entry in table["models"].items():
        print(f"{model}: weights {_gib(entry['weights_bytes'])}")
        for dec, per_batch in entry["decoders"].items():
            cells = ", ".join(f"batch {b}: {_gib(e['peak_bytes'])} ({e['phase']}) = {e['over_floor']:.2f} x floor "
                              f"{_gib(e['floor']['bytes'])}" + (f", logits_chunk none {_gib(e['full']['peak_bytes'])} = "
                                                                 f"{e['full']['over_floor']:.2f} x" if "full" in e else "")
                              for b, e in per_batch.items())
            print(f"  {dec}: {cells}")
    print(f"wrote {args.out} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
