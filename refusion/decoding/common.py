"""Counting, shared by every decoder: the meter (forwards per phase, KV peak, time, the commit order and
the stats dict), the one counted way to call the model (``forward``, ``counted_call``), and the item faults
those raise. The other shared helpers live by role: ``tokens`` (special ids, EOS, padding, positions),
``cache`` (KV-cache surgery), ``proposals`` (a token and its probability), ``block_loop`` (the block
decoders' loop). Their public names stay importable from here too, as the harness and the tests import them.

Counting follows docs/design.md §6: NFE = model forward calls (one batched call is one NFE),
generated tokens = response tokens up to and including the first EOS, TPF =
generated tokens / NFE, kv_peak_bytes = the largest number of bytes held by KV-cache
tensors at any point (measured right after each cached forward, when the cache also
holds the KV of the tokens just forwarded).

Commit order (``CommitLog``, docs/design.md §6): per row, the index of the forward after which
each returned token was fixed for good (``commit_forward``) and that step's kind (``commit_kind``),
plus the phase of every forward (``forward_phase``): what `harness trace` draws.

Item faults (docs/design.md "Faults"): ``forward`` refuses non-finite logits (``NonFiniteLogits``)
before any decoder reads them, and ``Meter`` stops a call that runs past its forward budget
(``ForwardBudgetExceeded``; set by ``track``). Both are ``ItemFault``s: the harness fails the item
(bisecting a batch first), never the run.

Compiled decoding (the knob ``compile``, refusion/decoding/compiled.py): ``Meter(..., compile=True)``
sends every ``forward`` through the compiled path and makes ``new_cache`` return a static cache;
stats then carry ``compiled``, ``compilations`` and ``timings["compile_s"]`` (warm-up calls, taken out
of decode_s and forward_s; docs/design.md "Compiled decoding").
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import DynamicCache

# Re-exported (module doc): the names decoders, the harness and the tests import from ``common``.
from .cache import (  # noqa: F401
    cache_append,
    cache_bytes,
    cache_from,
    cache_keep,
    cache_len,
    cache_tail,
    kv_parts_bytes,
    new_cache,
)
from .compiled import compiled_call
from .heads import Heads, chunks
from .proposals import as_float32, make_generator, propose, propose_from_probs, token_prob  # noqa: F401
from .tokens import (  # noqa: F401
    cut_after_eos,
    eos_ids,
    id_tensor,
    is_eos,
    left_padding_mask,
    mask_id,
    padding_mask,
    positions_from_mask,
)

# ---------------------------------------------------------------- item faults


class ItemFault(RuntimeError):
    """A decode that cannot give an answer for the rows of this call (not a bug of the harness): the
    harness retries the rows one by one and records the row that still fails as a failed item, with
    ``str(fault)`` as its reason (harness/run/lm_records.py)."""


class KnobLimit(ValueError):
    """A knob value that a decoder cannot apply to this request, for a limit it states (``compile`` on a
    DiffusionGemma context past its sliding window): the whole call is refused, and the harness reports the
    message in one line (harness/run/errors.py), since every later request may hit it too."""


class NonFiniteLogits(ItemFault):
    """A forward returned NaN or +inf logits, or only -inf ones, on a real (non-padding) query position
    (``check_finite``): no token is
    committed from it. ``forward`` is the 1-based index of that forward in the call, ``rows`` the
    batch rows affected."""

    def __init__(self, forward: int, rows: list[int]):
        super().__init__(f"non-finite logits at forward {forward}")
        self.forward, self.rows = forward, rows


class ForwardBudgetExceeded(ItemFault):
    """The call needed more forwards than its budget (``Meter.track``): a decoder that stopped making
    progress, stopped instead of looping for ever."""

    def __init__(self, budget: int):
        super().__init__(f"forward budget exceeded ({budget} forwards)")
        self.budget = budget


# Per response token, at most this many forwards per row, plus a constant for the prompt and the last
# block (docs/design.md "Faults"). Every registered decoder needs at most 2 a token (ReFusion: plan +
# infill when nothing is accepted in parallel; recompute_kv adds < 1/2); the rest is margin.
FORWARDS_PER_TOKEN = 3
FORWARDS_EXTRA = 8


def forward_budget(rows: int, length: int, steps: int | None = None) -> int:
    """Forward budget of one decoder call: per row, ``FORWARDS_PER_TOKEN`` x max(length, steps) +
    ``FORWARDS_EXTRA`` (``steps``: a decoder whose schedule may run more forwards than tokens, Dream's
    ``steps``); times the rows, since a batched call may serve them one at a time."""
    per_row = FORWARDS_PER_TOKEN * max(int(length), int(steps or 0)) + FORWARDS_EXTRA
    return max(1, int(rows)) * per_row


def check_finite(logits: torch.Tensor, real: torch.Tensor | None, forward_index: int) -> None:
    """NonFiniteLogits unless every real query position of logits [B, q, V] holds no NaN, no +inf and some
    finite value (-inf alone is a token ruled out, as a logit processor writes it; a row of nothing but -inf
    has no token to give). ``real``: bool [B, q] (None = all): padding positions of a left-padded prompt
    may be anything, no token comes from them. One max over V (it propagates NaN) and one host read: a
    fraction of the lm head's own cost."""
    bad = ~torch.isfinite(logits.amax(-1))  # [B, q]
    if real is not None:
        bad &= real
    if bool(bad.any()):
        rows = bad.any(-1).nonzero().flatten().tolist()
        raise NonFiniteLogits(forward_index, rows)


def real_queries(q: int, attention_mask: torch.Tensor | None, visible: torch.Tensor | None) -> torch.Tensor | None:
    """bool [B, q] of the query positions that are real tokens (None = all): under a 2-D padding mask
    [B, kv] its last q columns; under a visibility [B, q, kv] the rows that see some key."""
    if attention_mask is not None and attention_mask.dim() == 2:
        return attention_mask[:, -q:].bool()
    if visible is not None:
        seen = visible.any(-1)
        return seen if seen.dim() == 2 else seen[None]
    return None


# ---------------------------------------------------------------- counting


class Meter:
    """Counts forward calls per phase, KV-cache peak bytes and decode time.

    The same object is threaded through one decoder call; `finish` turns it into the
    stats dict of the interface (nfe, nfe_<phase>, generated_tokens, tpf, ...).
    """

    def __init__(self, model, phases: Sequence[str], compile: bool = False):
        self.counts = {p: 0 for p in phases}
        self.compiled = bool(compile)  # forwards run compiled (compiled.compiled_call), caches are static
        self.compilations = 0  # graphs compiled during this call
        self.compile_s = 0.0  # seconds of warm-up forwards (compiling, or recording a CUDA graph)
        self.budget = 0  # response tokens per row (from `track`): sizes a static cache's reserve
        self.calls = 0  # model calls; one call may serve several phases (rows of a batch at different stages)
        self.forward_s = 0.0  # seconds inside model calls, to tell forward time from decoder overhead
        self.kv_peak_bytes = 0
        self.phase_log: list[str] = []  # per model call, its phase(s) ("a+b" for a call serving several)
        self.commits: CommitLog | None = None  # set by `track`
        self.max_calls: int | None = None  # forward budget of the call (`track`); None = unbounded
        self.cuda = next(model.parameters()).device.type == "cuda"
        self._sync()
        self.t0 = time.perf_counter()

    def _sync(self) -> None:
        if self.cuda:  # timing brackets real work only on GPU; CPU needs no sync
            torch.cuda.synchronize()

    def kv(self, *caches: DynamicCache | None, extra: int = 0) -> None:
        """Record the bytes held now by the given caches (keys + values, all layers) plus `extra`."""
        total = extra + sum(cache_bytes(c) for c in caches if c is not None)
        self.kv_peak_bytes = max(self.kv_peak_bytes, total)

    def count(self, phases: str | Sequence[str]) -> None:
        """One model call serving `phases` (a name or several names): nfe + 1, each phase + 1.
        ForwardBudgetExceeded instead when the call has used its whole budget (``track``)."""
        if self.max_calls is not None and self.calls >= self.max_calls:
            raise ForwardBudgetExceeded(self.max_calls)
        self.calls += 1
        names = (phases,) if isinstance(phases, str) else tuple(phases)
        for p in names:
            self.counts[p] += 1
        self.phase_log.append("+".join(names))

    # ------------------------------------------------ commit order (module doc; CommitLog)

    def track(self, rows: int, length: int, device: torch.device, steps: int | None = None) -> None:
        """Record the commit order of `rows` responses of at most `length` tokens (see CommitLog), and bound
        the call's forwards (``forward_budget``; `steps`: a schedule that may take more forwards than tokens)."""
        self.commits = CommitLog(rows, length, device)
        self.budget = max(self.budget, int(length))
        self.max_calls = forward_budget(rows, length, steps)

    def settle(self, tokens: torch.Tensor, empty: int | None = None, row: int | None = None) -> None:
        """Call once after every forward, when the response tokens [B, n] (or one row's [n] with `row`) hold
        every commit made from its output: the positions that no longer hold `empty` (the mask id) since
        the previous call, or with `empty` None the positions appended since then, were committed by that
        forward. No host sync (CommitLog)."""
        self.commits.settle(tokens, empty, row, self.calls - 1)

    def commit(self, row: int, cols: Sequence[int], forwards: Sequence[int], kinds: Sequence[str]) -> None:
        """Explicit commits of row `row`: response positions `cols`, fixed after forwards `forwards` (indices
        in call order) by steps of kinds `kinds` (host lists, for decoders that already hold them there)."""
        self.commits.mark(row, cols, forwards, kinds)

    def finish(self, responses: list[torch.Tensor], **extra) -> dict:
        self._sync()
        seconds = time.perf_counter() - self.t0
        nfe = self.calls
        generated = sum(int(r.numel()) for r in responses)
        stats = {"nfe": nfe, "generated_tokens": generated, "tpf": generated / nfe if nfe else 0.0}
        stats.update({f"nfe_{p}": n for p, n in self.counts.items()})
        stats["kv_peak_bytes"] = self.kv_peak_bytes
        # Warm-up forwards (compiling, recording a CUDA graph) are reported apart, not as decoding time.
        stats["timings"] = {"decode_s": seconds - self.compile_s, "forward_s": self.forward_s - self.compile_s,
                            "compile_s": self.compile_s}
        stats["compiled"] = self.compiled
        stats["compilations"] = self.compilations
        stats.update(extra)
        if self.commits is not None:
            fwd, kind = self.commits.export([int(r.numel()) for r in responses], self.phase_log)
            stats.update(commit_forward=fwd, commit_kind=kind, forward_phase=list(self.phase_log))
        return stats


class CommitLog:
    """Which forward committed each response token, per row (the stats ``commit_forward`` /
    ``commit_kind``).

    A token is committed by the forward after which its value was fixed for good: the forward
    whose output the decoder unmasked it from (masked diffusion), sampled it from (AR), or
    accepted it with (ReFusion: docs/design.md §3). Three ways in, none with a host sync:

    - ``settle(tokens, empty)`` after every forward, for decoders that write commits into a token
      tensor where open positions hold `empty` (the mask id): ``waited`` [B, G] counts, per
      position, the settles that still found it open, which is the index of the forward that
      committed it when every forward is settled exactly once (checked on the host per row:
      two small kernels a forward, eq and add);
    - ``settle(tokens)`` (no `empty`) for decoders that append tokens: the new tail positions
      are the latest forward's (a host range, no kernel);
    - ``mark`` for decoders whose commits are host lists already (ReFusion), with their kinds.

    ``export`` reads it back once, at the end of the call.
    """

    def __init__(self, rows: int, length: int, device: torch.device):
        self.waited = torch.zeros(rows, length, dtype=torch.long, device=device)  # [B, G], see the class doc
        self.settles: dict[int | None, int] = {}  # row (None = all rows) -> settles so far
        self.filled: dict[int | None, int] = {}  # appending decoders: row -> positions already dated
        self.ranges: list[tuple[int | None, int, int, int]] = []  # (row, start, end, forward) of appended tokens
        self.marked: dict[int, dict[int, tuple[int, str]]] = {}  # row -> position -> (forward, kind)

    def settle(self, tokens: torch.Tensor, empty: int | None, row: int | None, forward: int) -> None:
        n = tokens.shape[-1]
        if empty is None:
            self.ranges.append((row, self.filled.get(row, 0), n, forward))
            self.filled[row] = n
            return
        done = self.settles.get(row, 0)
        if done != forward:  # the count is the forward index only if no forward went unsettled
            raise RuntimeError(f"CommitLog.settle: forward {forward} follows {done} settles of row {row}; "
                               "settle once after every forward")
        self.settles[row] = done + 1
        waited = self.waited if row is None else self.waited[row]  # a view: writes land
        waited[..., :n] += tokens == empty
        if n < waited.shape[-1]:  # positions the decoder has not laid out yet are open too
            waited[..., n:] += 1

    def mark(self, row: int, cols: Sequence[int], forwards: Sequence[int], kinds: Sequence[str]) -> None:
        into = self.marked.setdefault(row, {})
        for c, f, k in zip(cols, forwards, kinds, strict=True):
            into[int(c)] = (int(f), k)

    def export(self, lengths: list[int], phases: list[str]) -> tuple[list[list[int]], list[list[str]]]:
        """Per row, its first `lengths[b]` positions: (forward index, kind). The kind of a settled commit is
        the phase of its forward (phases[i], as Meter.phase_log); marks carry their own."""
        table = self.waited.tolist()
        for row, a, z, f in self.ranges:
            for b in range(len(table)) if row is None else (row,):
                table[b][a:z] = [f] * (z - a)
        fwd, kind = [], []
        for b, n in enumerate(lengths):
            f = table[b][:n]
            k = [phases[i] if 0 <= i < len(phases) else "" for i in f]
            for c, (i, name) in self.marked.get(b, {}).items():
                if c < n:
                    f[c], k[c] = i, name
            fwd.append(f)
            kind.append(k)
        return fwd, kind


# ---------------------------------------------------------------- forwards


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool visibility [B, q, kv] (or [q, kv]) -> additive float mask [B, 1, q, kv].

    Float, not bool: the eager attention path *adds* the mask (docs/design.md §8).
    """
    if allowed.dim() == 2:
        allowed = allowed.unsqueeze(0)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.unsqueeze(1)


def model_mask(model, attention_mask: torch.Tensor | None, visible: torch.Tensor | None) -> torch.Tensor | None:
    """The mask a model call takes: ``attention_mask`` (a 2-D padding mask [B, kv]) as it is, or the visibility
    ``visible`` (bool [B, q, kv] / [q, kv]) as a 4-D mask: the bool pattern itself for SDPA (True = attend, no
    float mask to build per call), the additive float form for eager attention, which adds it."""
    if visible is None:
        return attention_mask
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        return (visible if visible.dim() == 3 else visible[None])[:, None]
    return additive_mask(visible, model.dtype)


def forward(
    model,
    meter: Meter,
    phase: str,
    input_ids: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    visible: torch.Tensor | None = None,
    slots=None,
    cache: DynamicCache | None = None,
    kv_extra: int = 0,
    keep: slice | torch.Tensor | None = None,
) -> torch.Tensor:
    """One counted, timed model call; returns float logits [B, q, V], or [B, k, V] with ``keep``.

    `phase` is a phase name, or several when one call serves rows at different stages
    (counted once in nfe and once in each phase). `kv_extra`: bytes of KV held outside
    `cache` (copies kept aside by the caller), added to the peak measured after the call.

    Give either `attention_mask`, a 2-D padding mask [B, kv] (the model applies its
    own causal or bidirectional pattern), or `visible`, a bool [B, q, kv] / [q, kv]
    (kv = cached + q) passed as an explicit 4-D float mask -- needed whenever position
    ids jump (docs/design.md §8). Or `slots`, a `refusion.kernels.SlotLayout` (prefix length and
    packed slot lengths): no mask is built, the model's attention (a refusion_* implementation,
    see `kernels.attention_backend`) receives the slot structure as the keyword `slot_layout`.

    Logits that are not finite on a real query position raise ``NonFiniteLogits`` (module doc), so no
    decoder commits a token from them.

    With ``meter.compiled`` the call goes through ``compiled.compiled_call`` (static shapes, the same
    visibility as an explicit mask); a call that compiled counts its seconds in ``meter.compile_s``.

    `keep`: the query positions whose logits the caller reads (a slice, or a 1-D index tensor [k]). The model
    still computes the logits of every position (the same matmul, so the same bits); the finiteness check
    reads all of them, in the model's dtype; then only the kept positions get the float32 copy (``floated``),
    and the rest is freed when this returns (docs/design.md §6, "Peak decode memory").
    """
    if meter.compiled:
        logits = counted_call(meter, phase, lambda: compiled_call(
            model, input_ids, position_ids=position_ids, attention_mask=attention_mask, visible=visible, slots=slots,
            cache=cache), compiled=True)
        if cache is not None:
            meter.kv(cache, extra=kv_extra)
        check_finite(logits, real_queries(input_ids.shape[1], attention_mask, visible), meter.calls)
        return floated(logits, keep)
    attention_mask = model_mask(model, attention_mask, visible)
    extra = {} if slots is None else {"slot_layout": slots}
    kv_only = isinstance(keep, slice) and keep.start == keep.stop == 0
    if kv_only:  # a call made for its KV only (keep no position): the LM head runs on no position at all
        extra["logits_to_keep"] = torch.zeros(0, dtype=torch.long, device=input_ids.device)
    meter.count(phase)
    meter._sync()
    t0 = time.perf_counter()
    out = model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        cache=cache,
        use_cache=cache is not None,
        **extra,
    )
    meter._sync()
    meter.forward_s += time.perf_counter() - t0
    if cache is not None:
        meter.kv(cache, extra=kv_extra)
    logits = out.logits  # [B, q, V] in the model's dtype ([B, 0, V] for KV only); ``out`` dies with this frame
    if not kv_only:
        check_finite(logits, real_queries(input_ids.shape[1], attention_mask if visible is None else None, visible),
                     meter.calls)
    return floated(logits, keep)


def floated(logits: torch.Tensor, keep: slice | torch.Tensor | None = None) -> torch.Tensor:
    """float32 logits of the kept query positions: logits [B, q, V] -> [B, k, V] (all q with `keep` None).

    Selecting before the float32 copy changes no value (the copy is elementwise) and, for a model in bfloat16,
    never makes a float32 tensor of the positions nobody reads. A float32 model's logits are returned as a view
    (a slice) or a gathered copy (an index tensor), as the decoders sliced them before."""
    if keep is not None:
        logits = logits[:, keep]
    return logits.float()


def counted_call(meter: Meter, phase: str, call, check: bool = False, compiled: bool = False):
    """One counted, timed model call ``call()`` for decoders whose model is not called as ``model(input_ids=...)``
    (``forward`` above): an encoder half, a decoder half with its own keywords (refusion/decoding/
    diffusion_gemma.py). Returns what ``call`` returns; with ``check`` that is float logits [B, q, V], refused
    when not finite (``check_finite``, every query position real). ``compiled``: ``call`` returns (output, graphs
    compiled, warm-up call), as ``compiled.compiled_call`` / ``compiled_module_call`` do; a warm-up call's seconds
    go to ``meter.compile_s``, its graphs to ``meter.compilations``."""
    meter.count(phase)
    meter._sync()
    t0 = time.perf_counter()
    out = call()
    meter._sync()
    seconds = time.perf_counter() - t0
    meter.forward_s += seconds
    if compiled:
        out, fresh, warm = out
        meter.compilations += fresh
        if warm:
            meter.compile_s += seconds
    if check:
        check_finite(out, None, meter.calls)
    return out


# ---------------------------------------------------------------- streamed proposals (the knob logits_chunk)


def forward_streamed(model, meter: Meter, phase: str, input_ids: torch.Tensor, *,
                     position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                     visible: torch.Tensor | None = None, slots=None, cache: DynamicCache | None = None,
                     kv_extra: int = 0) -> torch.Tensor:
    """One counted, timed call of the model with ``logits_to_keep=1``: the LM head runs on the last query position
    only, whose logits are refused when not finite (the last position is a real token, or a padded query that
    sees itself). Returns the backbone's last hidden states [B, q, H] after its final norm, taken by a hook on
    ``model.get_decoder()``, from which the positions a step reads get their logits (``streamed_proposal``,
    ``heads.Heads``). The model's own forward runs, so what hooks on the model see (tests' forward counts,
    FAULTS_ENV's faults on its LM head) is as in ``forward``. Masks, slot layout, counting and metering as
    ``forward`` (never compiled)."""
    hidden: list[torch.Tensor] = []
    hook = model.get_decoder().register_forward_hook(lambda _m, _a, out: hidden.append(out.last_hidden_state))
    extra = {} if slots is None else {"slot_layout": slots}
    meter.count(phase)
    meter._sync()
    t0 = time.perf_counter()
    try:
        out = model(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=cache is not None,
                    attention_mask=model_mask(model, attention_mask, visible), logits_to_keep=1, **extra)
    finally:
        hook.remove()
    meter._sync()
    meter.forward_s += time.perf_counter() - t0
    if cache is not None:
        meter.kv(cache, extra=kv_extra)
    check_finite(out.logits, None, meter.calls)
    return hidden[-1]


def forward_heads(model, meter: Meter, phase: str, input_ids: torch.Tensor, *, stream: bool,
                  keep: slice | None = None, **call) -> Heads:
    """One counted, timed forward whose logits of the query positions ``keep`` (a slice; None = all) come as
    ``heads.Heads``: with ``stream`` (and eager, and a transformers model) made on demand from the hidden states
    (``forward_streamed``), else ``forward``'s float32 logits. ``call``: ``forward``'s keywords."""
    if not stream or meter.compiled or not hasattr(model, "get_decoder"):
        return Heads(dense=forward(model, meter, phase, input_ids, keep=keep, **call))
    hidden = forward_streamed(model, meter, phase, input_ids, **call)
    calls = meter.calls
    return Heads(hidden=hidden[:, keep or slice(None)], head=model.get_output_embeddings(),
                 check=lambda lg: check_finite(lg, None, calls))


def streamed_proposal(model, meter: Meter, phase: str, input_ids: torch.Tensor, keep: slice | torch.Tensor,
                      chunk: int, step, **call) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward and ``step``'s (token [B, k], confidence [B, k]) at the query positions ``keep`` (a slice with
    a stop, or an index tensor [k]), their logits made ``chunk`` positions at a time by the LM head on the
    backbone's hidden states (``forward_streamed``), so at most one chunk's logits [B, chunk, V] (and its float32
    copy) is alive, and no index tensor is made before the forward. ``step``: float32 logits [B, n, V] ->
    (token [B, n], confidence [B, n]), each position on its own. Each chunk is refused when not finite
    (``check_finite``). Only for models that apply nothing after their LM head (the Llama / Qwen2 / Qwen3 classes
    the streamed decoders load).

    The head's matmul has B x chunk rows instead of B x q: a BLAS picks its kernel by the row count, so a logit
    can differ in its last bit from the full product's (docs/design.md §6)."""
    hidden = forward_streamed(model, meter, phase, input_ids, **call)
    if isinstance(keep, slice):
        keep = slice(*keep.indices(hidden.shape[1])[:2])  # a negative stop made absolute
    head, toks, confs = model.get_output_embeddings(), [], []
    for part in chunks(keep, chunk):
        logits = head(hidden[:, part]).float()  # [B, n, V]
        check_finite(logits, None, meter.calls)
        tok, conf = step(logits)
        del logits  # one chunk alive at a time
        toks.append(tok)
        confs.append(conf)
    return torch.cat(toks, 1), torch.cat(confs, 1)


def proposal(model, meter: Meter, phase: str, input_ids: torch.Tensor, keep: slice | torch.Tensor,
             chunk: int | None, step, **call) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward and ``step``'s (token [B, k], confidence [B, k]) at its query positions ``keep`` (a slice, or
    an index tensor [k]); ``call``: ``forward``'s keywords (position_ids, attention_mask, cache). ``chunk`` None,
    every compiled forward, and a model without transformers' ``get_decoder`` / ``get_output_embeddings`` (a
    test's scripted stand-in): the model's own forward (logits of every position, float32 copy of the kept
    ones); else ``streamed_proposal``, ``chunk`` positions at a time. The logits are gone when this returns, so
    none is alive during the next forward."""
    if chunk is None or meter.compiled or not hasattr(model, "get_decoder"):
        return step(forward(model, meter, phase, input_ids, keep=keep, **call))
    return streamed_proposal(model, meter, phase, input_ids, keep, chunk, step, **call)
