"""ReFusion plan-and-infill decoder with full KV reuse, and its ablations as modes of the
same function: left_to_right, recompute_kv, no_cache, and the replicated KV layout.

A round of one row, each phase a short function over the row's `_State`:
  plan           every masked slot of the block as mask tokens, causal after the committed
                 row; pick the confident slots and their argmax drafts;
  global verify  the drafts concatenated in slot order, causal after the row; commit the
                 accepted whole slots (or up to an accepted EOS) and end the round;
  parallel infill otherwise: every picked slot after the shared committed KV plus its own
                 tokens, draft / verify at most slot_size times;
  commit         the finished slots' tokens and KV, in slot order;
  recompute      (recompute_kv) one causal forward over the slots just infilled together.

Committed state (`_Row`): the committed sequence in commit order (ids, true position ids)
and, for every committed token, which earlier committed tokens it attended to when its KV
was computed: commit indices [0, base) plus [start, itself]. Prompt and global-verify
tokens are causal (base = start = 0); a slot infilled in parallel saw the cache as it
stood at the start of its round (base = that length) plus its own earlier tokens (start =
its first commit index). The row's KV cache holds exactly those tokens' KV in commit order
between model calls: a call appends the query's KV, the caller of the model (`stacked_call`) crops
it back at once, and only commits append kept KV. `no_cache` keeps the same state but no
cache: every forward re-encodes the committed sequence under that recorded pattern, so
tokens are unchanged and only the cost differs.

Infill seed (`infill_seed`). When global verification commits nothing, parallel infill
starts every picked slot from an accepted prefix. "global" (default, the reference rule):
picked slot j starts from the longest prefix of its own tokens that passed global
verification (token 0 always passes; token i > 0 passes when the AR probability from the
previous stream position exceeds token_threshold). "first": only the first picked slot
keeps its verified prefix, the others start from their first token.

EOS during parallel infill: an accepted EOS ends its slot and drops the picked slots after
it; slots positioned after the EOS are never decoded, so the committed positions stay
contiguous up to the EOS. (The reference implementation drops later slots by their index
among the picked slots rather than by position, which can leave unfilled slots between
picked ones; that is not reproduced.)

KV layout of parallel infill (`kv_layout`). "packed" (default): the picked slots form one
query run with a mask that is full over the committed prefix, causal inside a slot and
empty across slots, so the prefix KV is held and read once. "replicated": the reference's
layout, the committed cache copied once per picked slot (batch rows, shrunk as slots
finish) and each slot decoded in its own row; same tokens, k times the prefix KV.

Commit order (stats commit_forward / commit_kind, common.CommitLog): a committed token is dated
by the forward that fixed it in the round that committed it: a slot's first token by the plan
that picked the slot ("plan"), a token accepted by global verification by that forward
("verify", also when its slot is then infilled from that prefix), a token accepted by a
parallel-infill verify forward by that one ("infill"). So inside a slot the dates never go back.

Batches: rows are left-padded prompts. Each row's decoding is a generator that yields one
model request at a time; the driver answers every pending row with one model call (rows at
different phases stacked, their caches left-padded, queries right-padded, all masked), so a
row's tokens do not depend on its batch. Sampling uses one generator per row seeded with
`seed`, for the same reason.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ..kernels import BACKENDS as ATTN_BACKENDS
from ..kernels import SlotLayout, attention_backend, require
from ..slot_attention import slot_visibility
from .cache import cache_append, cache_from, cache_len, is_static, kv_parts_bytes, new_cache
from .common import Meter, forward_heads
from .heads import Heads, greedy_at, prob_at
from .knobs import Knobs, compile_knob, gen_length, knob, logits_chunk_knob, seed, stream_chunk, temperature
from .proposals import as_float32, make_generator, propose
from .tokens import eos_ids, is_eos, left_padding_mask, mask_id

PHASES = ("plan", "verify", "draft", "infill", "recompute")
INFILL_SEEDS = ("global", "first")
KV_LAYOUTS = ("packed", "replicated")
PLAN_CHUNK = 8  # picked slots whose drafts one greedy plan proposes at a time (the gathered logits [8, L, V])

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [U, kv_heads, T, head_dim]


@dataclass
class _Row:
    """Committed tokens of one row in commit order, with the pattern each was encoded under."""

    ids: list[int]
    pos: list[int]
    base: list[int] = field(default_factory=list)
    start: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.base = self.base or [0] * len(self.ids)
        self.start = self.start or [0] * len(self.ids)

    def add(self, ids: list[int], pos: list[int], base: int = 0, start: int = 0) -> None:
        """Append tokens that saw commit indices [0, base) and [start, themselves].

        The default (0, 0) is causal: each saw everything committed before it.
        """
        self.ids += ids
        self.pos += pos
        self.base += [base] * len(ids)
        self.start += [start] * len(ids)

    def visibility(self, device) -> torch.Tensor:
        """Bool [c, c]: committed token i attended j (j < base[i] or start[i] <= j <= i)."""
        c = len(self.ids)
        i = torch.arange(c, device=device)[:, None]
        j = torch.arange(c, device=device)[None, :]
        base = torch.tensor(self.base, device=device)[:, None]
        start = torch.tensor(self.start, device=device)[:, None]
        return (j < base) | ((j >= start) & (j <= i))


@dataclass(frozen=True)
class RefusionKnobs(Knobs):
    """Knobs of ``refusion`` (docs/design.md §3); the paper's per-benchmark values are in harness/run/presets.py."""
    gen_length: int = gen_length(256)
    slot_size: int = knob(8, "tokens per slot; gen_length is padded up to a multiple", low=1)
    serial_num_blocks: int = knob(1, "consecutive blocks the slots are cut into (must divide the slot count); "
                                  "the plan picks slots of the leftmost unfinished block only", low=1)
    slot_threshold: float = knob(0.9, "a slot is picked when its first token's probability passes this",
                                 low=0.0, high=1.0)
    token_threshold: float = knob(0.4, "a drafted token is accepted when its verify probability passes this",
                                  low=0.0, high=1.0)
    temperature: float = temperature()
    left_to_right: bool = knob(False, "the plan may only pick the leftmost masked slot (ablation)")
    recompute_kv: bool = knob(False, "after a parallel commit of >= 2 slots, recompute their KV by one causal "
                              "forward in commit order (ablation; may change tokens)")
    no_cache: bool = knob(False, "no KV reuse: every forward re-encodes the committed sequence (same tokens)")
    infill_seed: str = knob("global", "accepted prefix each picked slot starts parallel infill from",
                            choices=INFILL_SEEDS)
    kv_layout: str = knob("packed", "parallel-infill KV: one shared prefix (packed) or one copy per slot "
                          "(replicated, the reference's layout; same tokens)", choices=KV_LAYOUTS)
    attn: str = knob("sdpa", "attention of the decoder's forwards: the model's own with a dense mask (sdpa), or "
                     "the fused slot-attention kernels of refusion/kernels.py given the slot layout (flex, "
                     "triton; same tokens)", choices=ATTN_BACKENDS)
    seed: int = seed()
    compile: bool = compile_knob()
    logits_chunk: int = logits_chunk_knob()

    @property
    def n_slots(self) -> int:
        return -(-self.gen_length // self.slot_size)

    def check(self) -> None:
        require(self.attn)  # one line naming what is missing (triton, CUDA) before any model is touched
        if self.compile and self.attn != "sdpa":
            raise ValueError(f"compile runs the dense-mask path (attn=sdpa); got attn={self.attn}")
        if self.serial_num_blocks > self.n_slots or self.n_slots % self.serial_num_blocks:
            raise ValueError(
                f"serial_num_blocks must divide the slot count {self.n_slots} (gen_length {self.gen_length} / "
                f"slot_size {self.slot_size}), got {self.serial_num_blocks}")


@dataclass(frozen=True)
class _Run:
    """Constants of one decode call: the knobs plus what is derived from them and the model."""
    slot_size: int
    n_slots: int
    per_block: int
    slot_threshold: float
    token_threshold: float
    temperature: float
    left_to_right: bool
    recompute_kv: bool
    no_cache: bool
    infill_seed: str
    kv_layout: str
    attn: str
    chunk: int | None  # positions per chunk of logits (stream_chunk), None: the model's own forward
    mask: int
    eos: tuple[int, ...]
    on_commit: Callable[[dict], None] | None


@dataclass
class Req:
    """One row's share of a model call: `ids` [U, q] at `pos` [U, q] after the row's cache.

    U is 1, or the number of slots decoded in their own rows (replicated layout). `vis`
    is bool [q, T + q] (T = cached length), the same for every unit; None when `layout`
    describes it (prefix T, packed slot lengths; see `_vis`). `rows` picks units of a
    replicated cache (None: all of them). `extra`: KV bytes the row holds aside.
    """

    phase: str
    cache: DynamicCache | None
    ids: torch.Tensor
    pos: torch.Tensor
    vis: torch.Tensor | None
    rows: list[int] | None = None
    extra: int = 0
    layout: SlotLayout | None = None
    keep: int = 0  # the call commits the KV of the first `keep` query tokens to the row's cache (rows None)
    skip: int = 0  # the first `skip` query tokens' logits are not read: the answer leaves them out (no float32 copy)


def _vis(r: Req) -> torch.Tensor:
    """The request's visibility [q, T + q], built from its layout when it has one."""
    if r.vis is not None:
        return r.vis
    return slot_visibility(r.layout.prefix_len, r.layout.slot_lens, r.ids.device)


Answer = tuple[Heads, KV | None]  # the logits of [U, q] read positions (made on demand) and the query's KV
Steps = Generator[Req, Answer, object]


@dataclass
class _State:
    """One row: committed state, cache, the block's masked slots and the current round."""

    row: _Row
    cache: DynamicCache | None
    positions: torch.Tensor  # [n_slots, L] true position of every response token
    gen: torch.Generator | None
    counts: dict  # shared counters of the call
    meter: Meter  # the call's counter: its forward index dates commits (stats commit_forward)
    index: int = 0  # the row's index in the batch
    lp: int = 0  # position of the first response token (= prompt length)
    done: dict[int, int] = field(default_factory=dict)  # position -> committed response token
    eos_pos: int | None = None  # position of the first committed EOS
    masked: list[int] = field(default_factory=list)  # masked slots of the current block
    # the round
    c: int = 0  # committed length at the start of the round
    slots: list[int] = field(default_factory=list)  # picked slots, position order
    drafts: torch.Tensor | None = None  # [k, L]
    accepted: list[int] = field(default_factory=list)  # per picked slot, accepted prefix length
    alive: list[int] = field(default_factory=list)  # picked-slot indices still being infilled
    finished: dict[int, int] = field(default_factory=dict)  # picked-slot index -> final length
    kv_store: dict[int, KV] = field(default_factory=dict)  # picked-slot index -> its accepted KV [1, h, n, d]
    # per picked slot, (forward index, kind) of each token of its accepted prefix: when it was fixed
    fixed: list[list[tuple[int, str]]] = field(default_factory=list)
    units: list[int] = field(default_factory=list)  # replicated layout: picked-slot index of each cache row

    def notify(self, kn: _Run, kind: str) -> None:
        if kn.on_commit is not None:
            r = self.row
            kn.on_commit(dict(kind=kind, ids=list(r.ids), pos=list(r.pos), base=list(r.base), start=list(r.start),
                              cache=self.cache))

    def now(self) -> int:
        """Index of the forward whose answer the row is processing (the latest call)."""
        return self.meter.calls - 1

    def add(self, tokens: list[int], positions: list[int], eos: tuple[int, ...], base: int = 0,
            start: int = 0, *, fixed: list[tuple[int, str]]) -> None:
        """Commit response tokens at `positions`; `fixed`: (forward index, kind) when each was fixed."""
        self.row.add(tokens, positions, base, start)
        self.meter.commit(self.index, [p - self.lp for p in positions], [f for f, _ in fixed], [k for _, k in fixed])
        for t, p in zip(tokens, positions):
            self.done[p] = t
            if t in eos and (self.eos_pos is None or p < self.eos_pos):
                self.eos_pos = p

    def drop_after_eos(self) -> None:
        if self.eos_pos is not None:
            self.masked = [s for s in self.masked if int(self.positions[s, 0]) < self.eos_pos]

    def output(self) -> torch.Tensor:
        """Committed response tokens sorted by position, cut after the first EOS."""
        lp = int(self.positions[0, 0])
        last = max(self.done) if self.eos_pos is None else self.eos_pos
        positions = [p for p in sorted(self.done) if p <= last]
        assert positions == list(range(lp, last + 1)), "committed positions must be contiguous up to the end"
        return torch.tensor([self.done[p] for p in positions], dtype=torch.long, device=self.positions.device)


# ---------------------------------------------------------------- model calls


def stacked_call(model, meter: Meter, reqs: list[Req], attn: str = "sdpa", stream: bool = False) -> list[Answer]:
    """One model call for every pending request; returns (the logits of [U, q - skip] positions as
    ``heads.Heads``, made on demand with ``stream``; the KV of the query) each.

    A single request runs on its own cache, which is cropped straight back to the
    committed tokens (the one place the cache is trimmed; keeping KV is the commit's
    job); with attn "flex" / "triton" and a slot layout, the model gets the layout instead
    of a dense mask. Several requests are stacked: caches left-padded to the longest,
    queries right-padded, padding never visible (a padded query sees only itself); they
    always take the dense mask (rows with different layouts).
    """
    phases = tuple(dict.fromkeys(r.phase for r in reqs))
    if any(r.keep and (r.rows is not None or r.cache is None) for r in reqs):
        raise ValueError("Req.keep needs the row's own cache (rows None)")
    if len(reqs) == 1:
        r = reqs[0]
        cache = r.cache
        if cache is not None and r.rows is not None and cache_len(cache):  # a subset of the replicated rows
            idx = torch.tensor(r.rows, device=r.ids.device)
            cache = cache_from(model, [(lay.keys[idx], lay.values[idx]) for lay in cache.layers])
        q = r.ids.shape[1]
        keep = slice(r.skip, None) if r.skip else None  # float32 logits of the positions read only
        if attn != "sdpa" and r.layout is not None:  # the fused slot-attention kernels
            logits = forward_heads(model, meter, phases, r.ids, stream=stream, position_ids=r.pos, slots=r.layout,
                                   cache=cache, kv_extra=r.extra, keep=keep)
        else:
            logits = forward_heads(model, meter, phases, r.ids, stream=stream, position_ids=r.pos,
                                   visible=_vis(r).expand(r.ids.shape[0], -1, -1), cache=cache, kv_extra=r.extra,
                                   keep=keep)
        if cache is None:
            return [(logits, None)]
        kv = [(lay.keys[:, :, -q:], lay.values[:, :, -q:]) for lay in cache.layers]
        if q > r.keep:  # kept KV stays where the model's update put it: no copy (crop is a slice)
            cache.crop(-(q - r.keep))
        return [(logits, kv)]

    device = reqs[0].ids.device
    lens = [cache_len(r.cache) for r in reqs]
    qs = [r.ids.shape[1] for r in reqs]
    us = [r.ids.shape[0] for r in reqs]
    tm, qm, n = max(lens), max(qs), sum(us)
    ids = torch.zeros(n, qm, dtype=torch.long, device=device)
    pos = torch.zeros(n, qm, dtype=torch.long, device=device)
    vis = torch.zeros(n, qm, tm + qm, dtype=torch.bool, device=device)
    j = torch.arange(qm, device=device)
    vis[:, j, tm + j] = True  # padded queries see themselves only
    u0 = 0
    for r, t, q, u in zip(reqs, lens, qs, us):
        ids[u0:u0 + u, :q], pos[u0:u0 + u, :q] = r.ids, r.pos
        rv = _vis(r)
        vis[u0:u0 + u, :q, tm - t:tm] = rv[:, :t]
        vis[u0:u0 + u, :q, tm:tm + q] = rv[:, t:]
        u0 += u
    moved = [r.cache is not None and t > 0 and r.rows is None and not is_static(r.cache) for r, t in zip(reqs, lens)]
    cache = None if reqs[0].cache is None else cache_from(model, stack_rows(reqs, lens, us, tm, moved))
    low = min(r.skip for r in reqs)  # float32 logits of the positions some request reads only
    logits = forward_heads(model, meter, phases, ids, stream=stream, position_ids=pos, visible=vis, cache=cache,
                           kv_extra=sum(r.extra for r in reqs), keep=slice(low, None))
    out, u0 = [], 0
    for r, t, q, u, m in zip(reqs, lens, qs, us, moved):
        kv = None if cache is None else [(lay.keys[u0:u0 + u, :, tm:tm + q], lay.values[u0:u0 + u, :, tm:tm + q])
                                         for lay in cache.layers]
        if m:  # the row's cache becomes its part of the stacked one: views, right before its query's KV
            for mine, lay in zip(r.cache.layers, cache.layers):
                mine.keys, mine.values = lay.keys[u0:u0 + u, :, tm - t:tm], lay.values[u0:u0 + u, :, tm - t:tm]
        if r.keep and kv is not None:  # after a moved row's views: widened over them, no copy (cache.continues)
            cache_append(r.cache, [[(k[:, :, :r.keep], v[:, :, :r.keep]) for k, v in kv]])
        out.append((logits.part(slice(u0, u0 + u), slice(r.skip - low, q - low)), kv))  # they start at `low`
        u0 += u
    return out


def stack_rows(reqs: list[Req], lens: list[int], us: list[int], tm: int, moved: list[bool]) -> list | None:
    """The requests' caches as one left-padded batch, per layer (keys, values) [sum(us), h, tm, d] (None: every
    cache empty). A ``moved`` request's cache gives its layer up once copied (``layer.keys`` None until
    ``stacked_call`` makes it a view of the stacked result), so each layer is held once, not twice: the rows'
    KV and its padded copy are never alive together beyond one layer."""
    if not tm:
        return None
    ref = next(r.cache for r, t in zip(reqs, lens) if t)
    n, parts = sum(us), []
    for i, lay in enumerate(ref.layers):
        k = lay.keys.new_zeros(n, lay.keys.shape[1], tm, lay.keys.shape[3])
        v = lay.values.new_zeros(n, lay.values.shape[1], tm, lay.values.shape[3])
        u0 = 0
        for r, t, u, m in zip(reqs, lens, us, moved):
            if t:
                mine = r.cache.layers[i]
                idx = slice(None) if r.rows is None else torch.tensor(r.rows, device=k.device)
                k[u0:u0 + u, :, tm - t:], v[u0:u0 + u, :, tm - t:] = mine.keys[idx], mine.values[idx]
                if m:
                    mine.keys = mine.values = None
            u0 += u
        parts.append((k, v))
    return parts


def drive_rows(model, meter: Meter, rows: list[Generator], attn: str = "sdpa",
               stream: bool = False) -> list[torch.Tensor]:
    """Run per-row decoding generators to completion, answering every pending row's next request
    with one model call (``stacked_call``); returns each generator's return value (its response)."""
    responses: list[torch.Tensor | None] = [None] * len(rows)
    pending: dict[int, Req] = {}
    for b, g in enumerate(rows):
        try:
            pending[b] = next(g)
        except StopIteration as stop:  # a row with nothing to decode
            responses[b] = stop.value
    while pending:
        order = list(pending)
        answers = stacked_call(model, meter, [pending[b] for b in order], attn, stream)
        answers.reverse()  # popped in row order, so each answer is held by its row's generator only
        for b in order:
            ans = answers.pop()
            try:
                pending[b] = rows[b].send(ans)
            except StopIteration as stop:
                responses[b] = stop.value
                del pending[b]
            del ans  # the step's logits die with the row's use of them, before the next model call
    return responses


def _ask(st: _State, phase: str, ids: torch.Tensor, pos: torch.Tensor, slot_lens: list[int],
         rows: list[int] | None = None, extra: int = 0) -> Steps:
    """Forward new tokens `ids` [U, q] at `pos` [U, q] after the committed row.

    New tokens see every committed token plus the packed-slot pattern `slot_lens` among
    themselves (one run = causal). Committed tokens not in the cache (the prompt in the
    first round, everything under no_cache) are re-encoded in the same call under their
    recorded pattern; their KV is committed here. Returns (logits [U, q, V], the new
    tokens' KV [U, h, q, d] per layer, or None without cache).

    The pattern goes with the request as a slot layout (prefix = the cached tokens) when it
    is one: always with every committed token cached, and with uncached ones when they and
    the new tokens form one causal run (the first round; no_cache until slots infilled
    together are committed). Otherwise as a dense bool visibility.
    """
    device = ids.device
    c, cached = len(st.row.ids), cache_len(st.cache)
    pre = c - cached
    layout, vis = None, None
    if not pre:
        layout = SlotLayout(c, tuple(slot_lens))  # = slot_visibility(c, slot_lens)
    elif len(slot_lens) == 1 and all(s <= b for s, b in zip(st.row.start[cached:], st.row.base[cached:])):
        layout = SlotLayout(cached, (pre + slot_lens[0],))  # one causal run after the cache
    if pre:
        q = ids.shape[1]
        if layout is None:
            full = torch.zeros(c + q, c + q, dtype=torch.bool, device=device)
            full[:c, :c] = st.row.visibility(device)
            full[c:] = slot_visibility(c, slot_lens, device)
            vis = full[cached:]  # rows of the uncached committed tokens and the new ones
        u = ids.shape[0]
        ids = torch.cat([torch.tensor(st.row.ids[cached:], device=device).expand(u, -1), ids], 1)
        pos = torch.cat([torch.tensor(st.row.pos[cached:], device=device).expand(u, -1), pos], 1)
    logits, kv = yield Req(phase, st.cache, ids, pos, vis, rows, extra, layout, skip=pre)  # [U, q, V]: no `pre`
    if pre and st.cache is not None:
        cache_append(st.cache, [[(k[:1, :, :pre], v[:1, :, :pre]) for k, v in kv]])
    if kv is not None and pre:
        kv = [(k[:, :, pre:], v[:, :, pre:]) for k, v in kv]
    return logits, kv


# ---------------------------------------------------------------- phases


def _plan(st: _State, kn: _Run) -> Steps:
    """Mask tokens for every masked slot of the block; pick slots and their drafts."""
    L, m = kn.slot_size, len(st.masked)
    pos = st.positions[st.masked].flatten()  # [m * L]
    heads, _ = yield from _ask(st, "plan", torch.full_like(pos, kn.mask)[None], pos[None], [m * L])  # [1, m * L]
    if kn.temperature > 0:  # sampling draws every position, in order (the generator's stream)
        tok, conf = propose(heads.all()[0].view(m, L, -1), kn.temperature, st.gen)  # [m, L] each
        first = conf[:, 0].tolist()
    elif not kn.left_to_right:
        # Greedy: each position's pick is its own row's softmax, so only what is used is computed -- the
        # slots' first tokens to choose the slots, then the chosen slots' drafts.
        first = greedy_at(heads, torch.arange(m, device=pos.device) * L, kn.chunk)[1].tolist()
    if kn.left_to_right:
        picked = [0]
    else:  # the slots whose first token passes, else the most confident one (first on ties); host values
        picked = [i for i, c in enumerate(first) if c > kn.slot_threshold] or [max(range(m), key=first.__getitem__)]
    st.slots = [st.masked[i] for i in picked]  # position order
    if kn.temperature > 0:
        st.drafts = tok[picked].clone()  # [k, L]
    else:
        # the picked slots' positions, logits_chunk at a time (PLAN_CHUNK slots with the model's own logits):
        # each position's softmax is its own, so the drafts are those of one call over all of them
        at = (torch.tensor(picked, device=pos.device)[:, None] * L + torch.arange(L, device=pos.device)).flatten()
        st.drafts = greedy_at(heads, at, kn.chunk or PLAN_CHUNK * L)[0].view(len(picked), L)  # [k, L]
    st.fixed = [[(st.now(), "plan")] for _ in picked]  # a picked slot's first token is always accepted


def infill_seeds(probs: torch.Tensor, slot_size: int, token_threshold: float, rule: str = "global") -> list[int]:
    """Accepted prefix of every picked slot at the start of parallel infill.

    probs [k * L]: global-verification probability of every stream token (token i > 0 of
    a slot: the AR probability from the previous stream position; token 0 is always
    accepted, its entry is ignored). "global": per slot, the longest prefix whose tokens
    all pass token_threshold (>= 1). "first": that for the first slot, 1 for the others.
    """
    ok = (probs > token_threshold).view(-1, slot_size)  # [k, L]
    ok[:, 0] = True
    seeds = ok.long().cumprod(1).sum(1)  # [k]
    if rule == "first":
        seeds[1:] = 1
    return seeds.tolist()


def _global_verify(st: _State, kn: _Run) -> Steps:
    """The drafts as one causal stream; commit accepted whole slots (or up to an EOS) -> True."""
    L, k = kn.slot_size, len(st.slots)
    stream, spos = st.drafts.flatten(), st.positions[st.slots].flatten()  # [k * L]
    heads, kv = yield from _ask(st, "verify", stream[None], spos[None], [k * L])  # [1, k * L]
    # Host bookkeeping once per step: the probabilities and the stream are read once. Token i > 0 is predicted
    # from position i - 1; a slot's first token is always accepted; the accepted run is the leading one.
    probs = [1.0] + prob_at(heads, slice(0, k * L - 1), stream[1:], kn.temperature, kn.chunk).tolist()  # [k * L]
    n_acc = next((i for i in range(1, k * L) if i % L and not probs[i] > kn.token_threshold), k * L)
    tokens = stream.tolist()
    hit = next((i for i in range(n_acc) if tokens[i] in kn.eos), None)
    n_commit = hit + 1 if hit is not None else (n_acc // L) * L
    if not n_commit:
        st.accepted = infill_seeds(torch.tensor(probs), L, kn.token_threshold, kn.infill_seed)
        st.fixed = [f + [(st.now(), "verify")] * (n - 1) for f, n in zip(st.fixed, st.accepted)]
        return False
    fixed = [st.fixed[i // L][0] if i % L == 0 else (st.now(), "verify") for i in range(n_commit)]
    st.add(tokens[:n_commit], spos[:n_commit].tolist(), kn.eos, fixed=fixed)  # causal
    if st.cache is not None:
        cache_append(st.cache, [[(ks[:, :, :n_commit], vs[:, :, :n_commit]) for ks, vs in kv]])
    st.counts["verify_commits"] += 1
    committed = {st.slots[i // L] for i in range(n_commit)}
    st.masked = [s for s in st.masked if s not in committed]
    st.notify(kn, "verify")
    return True


def _infill_ask(st: _State, kn: _Run, phase: str, which: list[int], ids: torch.Tensor) -> Steps:
    """Forward picked slots `which` with tokens `ids` [n, L], each after the committed row only.

    Returns the logits of the n x L positions (``heads.Heads``, flat index r * L + j in either layout) and a
    function (r, length) -> the first `length` tokens' KV of the r-th slot, copied ([1, h, length, d] per
    layer; None without cache).
    """
    L, n = kn.slot_size, len(which)
    pos = st.positions[[st.slots[i] for i in which]]  # [n, L]
    extra = kv_parts_bytes(st.kv_store.values())
    if kn.kv_layout == "replicated":  # each slot its own row of the replicated cache
        rows = None if which == st.units or st.cache is None else [st.units.index(i) for i in which]
        logits, kv = yield from _ask(st, phase, ids, pos, [L], rows=rows, extra=extra)

        def part(r: int, length: int) -> KV:
            return [(k[r:r + 1, :, :length].clone(), v[r:r + 1, :, :length].clone()) for k, v in kv]
    else:  # packed: one run, slots invisible to each other
        logits, kv = yield from _ask(st, phase, ids.reshape(1, -1), pos.reshape(1, -1), [L] * n, extra=extra)

        def part(r: int, length: int) -> KV:
            return [(k[:, :, r * L:r * L + length].clone(), v[:, :, r * L:r * L + length].clone()) for k, v in kv]

    return logits, (part if kv is not None else None)


def _infill_draft(st: _State, kn: _Run, todo: list[int]) -> Steps:
    """Not-yet-accepted tokens as masks; take the predictions at those positions."""
    ids = st.drafts[todo].clone()  # [n, L]
    for r, i in enumerate(todo):
        ids[r, st.accepted[i]:] = kn.mask
    heads, _ = yield from _infill_ask(st, kn, "draft", todo, ids)
    n, L = ids.shape
    if kn.temperature > 0:  # a sample of every position, in order (the generator's stream)
        new, _ = propose(heads.all().reshape(n, L, -1), kn.temperature, st.gen)  # [n, L]
    else:
        new = greedy_at(heads, slice(0, n * L), kn.chunk)[0].view(n, L)
    for r, i in enumerate(todo):
        st.drafts[i, st.accepted[i]:] = new[r, st.accepted[i]:]


def _infill_verify(st: _State, kn: _Run) -> Steps:
    """Each alive slot causal inside itself; accept its longest confident prefix (>= one more token)."""
    L, alive = kn.slot_size, st.alive
    drafts = st.drafts[alive]  # [n, L]
    heads, part = yield from _infill_ask(st, kn, "infill", alive, drafts)
    n = len(alive)
    at = (torch.arange(n, device=drafts.device)[:, None] * L + torch.arange(L - 1, device=drafts.device)).flatten()
    good = (prob_at(heads, at, drafts[:, 1:].flatten(), kn.temperature, kn.chunk) > kn.token_threshold).view(
        n, L - 1).tolist()  # [n][L-1]: token j + 1 from position j
    eos = is_eos(drafts, kn.eos).tolist()  # [n][L]
    stop_after: int | None = None
    for r, i in enumerate(alive):
        n = min(st.accepted[i] + 1, L)  # the first not-yet-accepted token is always accepted
        while n < L and good[r][n - 1]:  # token n predicted from position n - 1
            n += 1
        hit = next((t for t in range(n) if eos[r][t]), None)
        st.accepted[i] = n if hit is None else hit + 1
        st.fixed[i] = (st.fixed[i] + [(st.now(), "infill")] * L)[:st.accepted[i]]
        if part is not None:
            st.kv_store[i] = part(r, st.accepted[i])
        if st.accepted[i] == L or hit is not None:
            st.finished[i] = st.accepted[i]
        if hit is not None:
            stop_after = i
            break
    if stop_after is not None:  # an accepted EOS drops every later picked slot (all positioned after it)
        st.finished = {i: n for i, n in st.finished.items() if i <= stop_after}
        st.kv_store = {i: kv for i, kv in st.kv_store.items() if i <= stop_after}
    st.alive = [i for i in alive if i not in st.finished and (stop_after is None or i < stop_after)]


def _parallel_infill(st: _State, kn: _Run) -> Steps:
    """Draft / verify every picked slot against the shared committed KV until all are finished."""
    L, k = kn.slot_size, len(st.slots)
    st.counts["slots_parallel_max"] = max(st.counts["slots_parallel_max"], k)
    st.counts["infill_slots"] += k
    st.alive, st.finished, st.kv_store = list(range(k)), {}, {}
    replicated = kn.kv_layout == "replicated" and st.cache is not None
    if replicated:  # the reference layout: one copy of the committed cache per picked slot
        st.cache.batch_repeat_interleave(k)
        st.units = list(range(k))
    else:
        st.units = list(range(k))
    for _ in range(L):
        if not st.alive:
            break
        if replicated and st.alive != st.units:  # drop the rows of finished slots
            st.cache.batch_select_indices(torch.tensor([st.units.index(i) for i in st.alive]))
        st.units = list(st.alive)
        st.counts["infill_rounds"] += 1
        todo = [i for i in st.alive if st.accepted[i] < L]
        if todo:
            yield from _infill_draft(st, kn, todo)
        yield from _infill_verify(st, kn)
    assert not st.alive, "infill must finish within slot_size rounds"
    if replicated:  # every row holds the same committed KV: keep one (a view, no copy)
        for lay in st.cache.layers:
            lay.keys, lay.values = lay.keys[:1], lay.values[:1]


def _commit_infill(st: _State, kn: _Run) -> None:
    """Finished slots in slot order, each with the KV computed at its true positions."""
    order = sorted(st.finished)
    first = st.c
    for i in order:
        n = st.finished[i]
        st.add(st.drafts[i, :n].tolist(), st.positions[st.slots[i], :n].tolist(), kn.eos, base=st.c, start=first,
               fixed=st.fixed[i][:n])
        first += n
    if st.cache is not None:
        cache_append(st.cache, [st.kv_store[i] for i in order])
    st.counts["infill_commits"] += 1
    st.masked = [s for s in st.masked if s not in {st.slots[i] for i in order}]
    st.notify(kn, "infill")


def _recompute(st: _State, kn: _Run) -> Steps:
    """Slots infilled together now see each other: one causal forward over the commit order."""
    c, row = st.c, st.row
    ids, pos = row.ids[c:], row.pos[c:]
    del row.ids[c:], row.pos[c:], row.base[c:], row.start[c:]
    if st.cache is not None:
        st.cache.crop(-(cache_len(st.cache) - c))
        device = st.positions.device
        _, kv = yield from _ask(st, "recompute", torch.tensor([ids], device=device),
                                torch.tensor([pos], device=device), [len(ids)])
        cache_append(st.cache, [kv])
    row.add(ids, pos)  # causal now
    st.notify(kn, "recompute")


def _decode_row(st: _State, kn: _Run) -> Steps:
    """All blocks of one row, round by round; returns the response [n]."""
    for b in range(kn.n_slots // kn.per_block):
        st.masked = list(range(b * kn.per_block, (b + 1) * kn.per_block))
        while True:
            st.drop_after_eos()  # slots after the first EOS are never decoded (here and in later blocks)
            if not st.masked:
                break
            st.counts["rounds"] += 1
            st.c = len(st.row.ids)
            yield from _plan(st, kn)
            if (yield from _global_verify(st, kn)):
                continue
            yield from _parallel_infill(st, kn)
            _commit_infill(st, kn)
            if kn.recompute_kv and len(st.finished) > 1:
                yield from _recompute(st, kn)
        if st.eos_pos is not None:
            break
    return st.output()


# ---------------------------------------------------------------- the decoder


@torch.no_grad()
def refusion(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    knobs: RefusionKnobs | dict | None = None,
    *,
    mask_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    on_commit: Callable[[dict], None] | None = None,
    **overrides,
) -> tuple[list[torch.Tensor], dict]:
    """ReFusion plan / global verify / parallel infill / commit, every row of the batch together.

    input_ids [B, P] left-padded, attention_mask [B, P] (1 = real token). ``knobs``: a
    ``RefusionKnobs`` (or a dict), keyword ``overrides`` replace fields (see RefusionKnobs
    for each knob; the modes are described in the module doc). on_commit(info)
    is called after every commit (tests) with the row's committed ids / positions / base /
    start, its cache (None under no_cache) and the commit kind ("verify", "infill",
    "recompute"). stats commit_forward / commit_kind: see "Commit order" in the module doc.
    Phases counted: plan, verify (global), draft and infill (infill draft /
    verify), recompute; one call serving rows at several phases counts once in nfe and
    once in each of them. stats["timings"]["forward_s"] is the time inside model calls.
    """
    k = RefusionKnobs.of(knobs, overrides, "refusion")
    slot_size, n_slots = k.slot_size, k.n_slots
    kn = _Run(
        slot_size=slot_size, n_slots=n_slots, per_block=n_slots // k.serial_num_blocks,
        # float32 like the probabilities they meet: a tensor compares with a Python number in float32, and the
        # host-side comparisons below (values read once per step) must decide the same way
        slot_threshold=as_float32(k.slot_threshold), token_threshold=as_float32(k.token_threshold),
        temperature=k.temperature,
        left_to_right=k.left_to_right, recompute_kv=k.recompute_kv, no_cache=k.no_cache,
        infill_seed=k.infill_seed, kv_layout=k.kv_layout, attn=k.attn, chunk=stream_chunk(k),
        mask=mask_id(model, mask_token_id), eos=eos_ids(model, eos_token_id), on_commit=on_commit,
    )
    pad = left_padding_mask(input_ids, attention_mask)
    require(kn.attn, input_ids.device)
    meter = Meter(model, PHASES, compile=k.compile)
    device = input_ids.device
    counts = {"rounds": 0, "verify_commits": 0, "infill_rounds": 0, "infill_commits": 0, "slots_parallel_max": 0,
              "infill_slots": 0}
    rows = []
    meter.track(input_ids.shape[0], n_slots * slot_size, device)
    for b, (row_ids, row_mask) in enumerate(zip(input_ids, pad)):
        prompt = row_ids[row_mask.bool()]
        lp = prompt.numel()
        st = _State(
            row=_Row(ids=prompt.tolist(), pos=list(range(lp))),
            cache=None if kn.no_cache else new_cache(model, meter),
            positions=lp + torch.arange(n_slots * slot_size, device=device).view(n_slots, slot_size),
            gen=make_generator(device, k.seed), counts=counts, meter=meter, index=b, lp=lp,
        )
        rows.append(_decode_row(st, kn))

    with attention_backend(model, kn.attn):
        responses = drive_rows(model, meter, rows, kn.attn, kn.chunk is not None)
    counts["slots_parallel_mean"] = counts["infill_slots"] / counts["infill_commits"] if counts["infill_commits"] else 0.0
    return responses, meter.finish(responses, **counts)
