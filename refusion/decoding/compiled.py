"""Compiled decoding: the decoder knob ``compile`` (docs/design.md "Compiled decoding").

With ``compile`` on, ``common.forward`` runs the model through ``compiled_call`` instead of calling it
eagerly. The model runs under ``torch.compile`` with every shape static, so each compiled graph serves
many calls (and on CUDA is replayed as a CUDA graph, ``mode="reduce-overhead"``):

* **query buckets**: a query of q tokens is padded to ``query_bucket(q)`` (powers of two up to
  ``QUERY_STEP``, then multiples of it); padded query rows get token 0 at position 0, see only their own
  cache slot, and their logits are dropped;
* **a static KV cache** (``StaticKV``): per layer one preallocated buffer [B, kv_heads, C, head_dim]
  plus a length n; the capacity C is a multiple of ``CACHE_STEP`` sized at the first write for the
  run's maximum (that length, plus the response budget and one query bucket of slack: ``new_cache``),
  grown (copied) only if a decoder ever needs more. The model writes a query's KV at [n, n + bucket)
  (``index_copy_`` inside the graph) and attends over all C columns; **the mask does the rest**: an
  explicit boolean visibility [B, 1, bucket, C] is built outside the graph from what the decoder gave
  (a 2-D padding mask turned into the model's causal or bidirectional pattern in cache order, exactly
  as transformers builds it; a ``visible`` pattern; a ReFusion slot layout, as its dense pattern), with
  every column at or after n + q hidden. Cache surgery (``keep``, ``append``, ``crop``, the batch
  ops) are index copies inside the buffer plus a new length: no reallocation, stable addresses;
* **a per-model memo** of the compiled callable (``_entry``) and a pool of buffers (``_POOL``) so a
  second decode of the same shapes reuses both: no recompilation, no new CUDA-graph recording.

The decoders keep their step loops: they create their caches with ``common.new_cache`` (a
``StaticKV`` when compiled) and use ``layers[i].keys / .values`` (views of the live length),
``crop``, ``batch_repeat_interleave``, ``batch_select_indices`` and common.py's cache helpers as
before. A plain ``DynamicCache`` handed to a compiled forward (ReFusion's and D2F's stacked batch
calls build one per call) is staged: copied into a pooled static buffer for the call, and the
query's KV appended back to it afterwards, as an eager forward would.

Counting (``Meter``): a compiled forward is one NFE like any other; a call during which dynamo
compiled a graph (``counters["stats"]["unique_graphs"]`` grew), or on CUDA the next call of that
shape (the CUDA-graph recording), is a warm-up call: its seconds go to ``compile_s`` and are taken
out of ``decode_s`` and ``forward_s``; ``compilations`` counts the graphs compiled.
Tokens: logits differ from eager by float rounding only (other kernels, other summation order; the
masked columns add exact zeros), so greedy tokens are expected to be the same;
tests/test_compiled.py checks them decoder by decoder.
"""

from __future__ import annotations

import weakref
from collections import defaultdict

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

QUERY_STEP = 64  # query lengths up to it pad to a power of two, longer ones to a multiple of it
CACHE_STEP = 256  # static cache capacities are multiples of it
RECOMPILE_LIMIT = 512  # dynamo's per-function limit during compiled calls (default 8 would fall back to eager)
BACKEND = "inductor"  # torch.compile backend; tests may use "aot_eager" (same tracing, no code generation)
MASKED_IMPLEMENTATIONS = ("sdpa", "eager", "refusion_sdpa", "refusion_flex", "refusion_triton")


def query_bucket(n: int) -> int:
    """The padded length of a query of ``n`` tokens: the next power of two up to QUERY_STEP, beyond it the
    next multiple of QUERY_STEP."""
    if n < 1:
        raise ValueError(f"query length must be >= 1, got {n}")
    if n <= QUERY_STEP:
        return 1 << (n - 1).bit_length()
    return -(-n // QUERY_STEP) * QUERY_STEP


def capacity_bucket(n: int) -> int:
    """A static cache's capacity for ``n`` tokens: the next multiple of CACHE_STEP (at least one)."""
    return max(1, -(-n // CACHE_STEP)) * CACHE_STEP


def n_buckets(max_len: int) -> int:
    """How many query buckets lengths 1..max_len fall into (the bound on compilations per shape family)."""
    return len({query_bucket(n) for n in range(1, max_len + 1)})


# ---------------------------------------------------------------- the buffer pool


class _Pool:
    """Free static buffers by (shape, dtype, device): a decode returns its buffers when its cache dies, and
    the next decode of the same shapes gets the same tensors back (stable addresses for CUDA graphs)."""

    def __init__(self) -> None:
        self.free: dict[tuple, list[torch.Tensor]] = defaultdict(list)

    def lease(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (tuple(shape), dtype, torch.device(device))
        if self.free[key]:
            return self.free[key].pop()
        t = torch.zeros(shape, dtype=dtype, device=device)  # finite: stale columns are masked, never NaN
        torch._dynamo.mark_static_address(t)  # unguarded: a new address re-records a CUDA graph, no recompile
        return t

    def give_back(self, t: torch.Tensor) -> None:
        self.free[(tuple(t.shape), t.dtype, t.device)].append(t)

    def clear(self) -> None:
        self.free.clear()


_POOL = _Pool()


class _Store:
    """The buffers one cache holds (given back to the pool when the cache is collected) and its sizing."""

    def __init__(self, reserve: int) -> None:
        self.reserve = reserve  # tokens allocated beyond the first write's need (budget + query slack)
        self.held: dict[int, torch.Tensor] = {}

    def lease(self, shape, dtype, device) -> torch.Tensor:
        t = _POOL.lease(shape, dtype, device)
        self.held[id(t)] = t
        return t

    def give_back(self, t: torch.Tensor | None) -> None:
        if t is not None and self.held.pop(id(t), None) is not None:
            _POOL.give_back(t)

    def release_all(self) -> None:
        for t in self.held.values():
            _POOL.give_back(t)
        self.held.clear()


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src), safe when src is a view of the same buffer (same place: nothing to do; elsewhere:
    through a copy, as the regions may overlap)."""
    if src.numel() == 0:
        return
    if src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr():
        if _same_view(dst, src):
            return
        src = src.clone()
    dst.copy_(src)


# ---------------------------------------------------------------- the static cache


class StaticKVLayer(CacheLayerMixin):
    """One layer of a ``StaticKV``: buffers [B, H, C, D] and a length n. ``keys`` / ``values`` are views of
    the live part [:, :, :n]; assigning a tensor copies it into the buffer (a new buffer only when the
    batch or head shape changes or it does not fit), so DynamicCache-style code works unchanged."""

    is_compileable = True
    is_croppable = True
    is_sliding = False

    def __init__(self, store: _Store) -> None:  # no super().__init__: keys / values are properties
        self._store = store
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self.n = 0

    # ------------------------------------------------ views and assignment
    @property
    def is_initialized(self) -> bool:
        return self._k is not None

    @is_initialized.setter
    def is_initialized(self, value: bool) -> None:  # CacheLayerMixin.reset writes it; nothing to store
        pass

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[:, :, :self.n]

    @keys.setter
    def keys(self, t: torch.Tensor | None) -> None:
        self._k = self._assign(self._k, t)

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:, :, :self.n]

    @values.setter
    def values(self, t: torch.Tensor | None) -> None:
        self._v = self._assign(self._v, t)

    @property
    def capacity(self) -> int:
        return 0 if self._k is None else min(self._k.shape[2], self._v.shape[2])

    def _assign(self, buf: torch.Tensor | None, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            self._store.give_back(buf)
            self.n = 0
            return None
        length = t.shape[2]
        if (buf is None or buf.shape[0] != t.shape[0] or buf.shape[1] != t.shape[1] or buf.shape[3] != t.shape[3]
                or buf.shape[2] < length or buf.dtype != t.dtype or buf.device != t.device):
            cap = max(capacity_bucket(length + self._store.reserve), self.capacity if buf is not None else 0)
            new = self._store.lease((t.shape[0], t.shape[1], cap, t.shape[3]), t.dtype, t.device)
            new[:, :, :length].copy_(t)
            self._store.give_back(buf)
            buf = new
        else:
            _copy(buf[:, :, :length], t)
        self.n = length
        return buf

    def allocate(self, batch: int, heads: int, dim: int, dtype, device, capacity: int) -> None:
        """Buffers [batch, heads, >= capacity, dim] (the live content [:n] kept), leased anew only when the
        present ones are smaller or of another shape."""
        for name in ("_k", "_v"):
            buf = getattr(self, name)
            if (buf is not None and buf.shape[0] == batch and buf.shape[1] == heads and buf.shape[3] == dim
                    and buf.shape[2] >= capacity and buf.dtype == dtype and buf.device == torch.device(device)):
                continue
            cap = max(capacity, 0 if buf is None else buf.shape[2])
            new = self._store.lease((batch, heads, cap, dim), dtype, device)
            if buf is not None and self.n:
                new[:, :, :self.n].copy_(buf[:, :, :self.n].expand(batch, -1, -1, -1))
            self._store.give_back(buf)
            setattr(self, name, new)

    # ------------------------------------------------ the CacheLayerMixin interface
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.allocate(b, h, d, key_states.dtype, key_states.device,
                      capacity_bucket(key_states.shape[2] + self._store.reserve))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Eager use (a model called directly with this cache): append, then the live keys and values."""
        need = self.n + key_states.shape[2]
        if self._k is None or self.capacity < need:
            b, h, _, d = key_states.shape
            self.allocate(b, h, d, key_states.dtype, key_states.device, capacity_bucket(need + self._store.reserve))
        q = key_states.shape[2]
        self._k[:, :, self.n:self.n + q].copy_(key_states)
        self._v[:, :, self.n:self.n + q].copy_(value_states)
        self.n += q
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n + query_length, 0

    def get_seq_length(self) -> int:
        return self.n if self._k is not None else 0

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.n = 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        self.n = max(0, self.n - abs(tokens_to_remove))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            self.keys, self.values = (self.keys.repeat_interleave(repeats, dim=0),
                                      self.values.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            self.keys, self.values = self.keys[indices, ...], self.values[indices, ...]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)


class StaticKV(Cache):
    """A KV cache of preallocated buffers (module doc), a drop-in for the decoders' ``DynamicCache``.

    ``reserve``: tokens allocated beyond the first write's need (the response budget plus one query
    bucket, so one allocation serves the whole decode)."""

    def __init__(self, config, reserve: int = 0) -> None:
        types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        if any(t != "full_attention" for t in types):
            raise ValueError(f"compile supports full-attention layers only; this model has {sorted(set(types))}")
        self._store = _Store(int(reserve))
        super().__init__(layers=[StaticKVLayer(self._store) for _ in range(config.num_hidden_layers)])
        weakref.finalize(self, self._store.release_all)  # buffers back to the pool when the cache dies
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    @property
    def length(self) -> int:
        return self.layers[0].get_seq_length()

    @property
    def capacity(self) -> int:
        return min(layer.capacity for layer in self.layers)

    def ensure(self, need: int, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        """Every layer holds at least ``need`` tokens for ``batch`` rows: allocated at the first call (with
        ``reserve`` more), grown by a copy if a decoder ever needs more (then with ``reserve`` more again)."""
        if all(x._k is not None and x._k.shape[0] == batch and x.capacity >= need and x._k.dtype == dtype
               for x in self.layers):
            return
        have = max(x.capacity for x in self.layers)
        cap = max(have, capacity_bucket(need + self._store.reserve))
        for x in self.layers:
            x.allocate(batch, self.kv_heads, self.head_dim, dtype, device, cap)

    def buffers(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        return tuple(x._k for x in self.layers), tuple(x._v for x in self.layers)

    def advance(self, q: int) -> None:
        """The model wrote q more tokens at [n, n + q) of every layer (its padded rows after them are junk)."""
        for x in self.layers:
            x.n += q

    # ------------------------------------------------ in-place surgery (common.py's helpers call these)
    def keep(self, start: int, keep: torch.Tensor | None = None) -> None:
        """cache[:start] plus the tail rows ``keep`` (indices into cache[start:]), in place."""
        for x in self.layers:
            if x._k is None:
                continue
            m = 0 if keep is None else int(keep.numel())
            if m:
                idx = keep + start
                for buf in (x._k, x._v):
                    buf[:, :, start:start + m] = buf.index_select(2, idx)
            x.n = min(x.n, start) if not m else start + m

    def append(self, parts: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Append per-layer (keys, values) chunks in list order, copied into the buffers after the length."""
        if not parts:
            return
        total = sum(p[0][0].shape[2] for p in parts)
        k0 = parts[0][0][0]
        self.ensure(self.length + total, max(self.batch_size(), k0.shape[0]), k0.dtype, k0.device)
        for i, x in enumerate(self.layers):
            at = x.n
            for p in parts:
                k, v = p[i]
                n = k.shape[2]
                _copy(x._k[:, :, at:at + n], k)
                _copy(x._v[:, :, at:at + n], v)
                at += n
            x.n = at

    def batch_size(self) -> int:
        lay = self.layers[0]
        return 0 if lay._k is None else lay._k.shape[0]


# ---------------------------------------------------------------- the compiled call


class _Writer:
    """What the model's attention sees as its cache inside the compiled graph: ``update`` writes the query's
    KV at ``cache_position`` of the static buffers and returns the whole buffers (the mask hides what is
    not live). Built inside the traced function from plain tensors, so no Python int reaches a guard."""

    def __init__(self, keys, values, cache_position) -> None:
        self.keys, self.values, self.cache_position = keys, values, cache_position

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_copy_(2, self.cache_position, key_states)
        v.index_copy_(2, self.cache_position, value_states)
        return k, v


def _model_call(model, input_ids, position_ids, mask, cache_position, keys, values):
    cache = None if keys is None else _Writer(keys, values, cache_position)
    return model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, cache=cache,
                 use_cache=cache is not None).logits


class _Entry:
    """One model's compiled callable (per backend and device type), the call counts per static signature (the recording call of a
    CUDA graph is a warm-up too) and the totals."""

    def __init__(self, fn, cudagraphs: bool) -> None:
        self.fn, self.cudagraphs = fn, cudagraphs
        self.calls: dict[tuple, int] = {}
        self.compilations = 0


_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _entry(model, device: torch.device) -> _Entry:
    """The model's compiled callable for the current BACKEND and device type (made at the first call)."""
    per_model = _MEMO.setdefault(model, {})
    key = (BACKEND, device.type)
    if key not in per_model:
        mode = "reduce-overhead" if device.type == "cuda" and BACKEND == "inductor" else None
        fn = torch.compile(_model_call, backend=BACKEND, mode=mode, dynamic=False, fullgraph=True)
        per_model[key] = _Entry(fn, cudagraphs=mode == "reduce-overhead")
    return per_model[key]


def _invoke(e: _Entry, sig, *args, **kwargs) -> tuple:
    """One call of entry ``e``'s compiled callable: (its output, graphs compiled by this call, whether it was a
    warm-up call: it compiled, or on CUDA ran before the recording or recorded the CUDA graph of ``sig``)."""
    seen = e.calls.get(sig, 0)
    before = _graphs()
    if e.cudagraphs:
        torch.compiler.cudagraph_mark_step_begin()
    # capture_scalar_outputs: a routed MoE (refusion/llada2_moe.py) reads its per-expert token counts on the
    # host; they become unbacked sizes inside the one graph instead of a graph break
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=RECOMPILE_LIMIT * 4,
                                    capture_scalar_outputs=True), torch.no_grad():
        out = e.fn(*args, **kwargs)
    fresh = _graphs() - before
    e.calls[sig] = seen + 1
    e.compilations += fresh
    return out, fresh, bool(fresh) or (e.cudagraphs and seen < 2)  # cudagraph trees: warm-up run, then recording


def compiled_module_call(model, name: str, fn, *args, **kwargs) -> tuple:
    """``fn(*args, **kwargs)`` compiled as ``torch.compile(fn, fullgraph=True, dynamic=False)`` -- for a model half
    that its decoder calls with its own keywords and caches (DiffusionGemma's encoder and decoder:
    refusion/decoding/diffusion_gemma.py), memoized per (model, ``name``, backend, device type) like
    ``compiled_call``'s. Returns (what ``fn`` returns, graphs compiled, warm-up call), as ``compiled_call`` does:
    ``common.counted_call(..., compiled=True)`` counts and times it."""
    per_model = _MEMO.setdefault(model, {})
    device = next(model.parameters()).device
    key = (BACKEND, device.type, name)
    if key not in per_model:
        mode = "reduce-overhead" if device.type == "cuda" and BACKEND == "inductor" else None
        per_model[key] = _Entry(torch.compile(fn, backend=BACKEND, mode=mode, dynamic=False, fullgraph=True),
                                cudagraphs=mode == "reduce-overhead")
    return _invoke(per_model[key], _signature(kwargs), *args, **kwargs)


def _signature(value):
    """Shapes and dtypes of the tensors in ``value`` (nested dicts, lists), a hashable key."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    if isinstance(value, dict):
        return tuple((k, _signature(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    return type(value).__name__


def clear() -> None:
    """Forget every compiled callable and pooled buffer (and dynamo's caches): the next compiled forward
    compiles afresh."""
    _MEMO.clear()
    _POOL.clear()
    torch._dynamo.reset()


def compilations(model) -> int:
    """Graphs compiled so far for ``model`` by compiled forwards (0 when none ran)."""
    return sum(e.compilations for e in _MEMO.get(model, {}).values())


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def visibility(model, batch: int, q: int, cached: int, attention_mask, visible, slots, device) -> torch.Tensor:
    """Bool [B, q, cached + q] (key order = cache order, then the query): what each query token attends,
    from whichever form the decoder gave (common.forward's arguments), as the eager model would build it."""
    t = cached + q
    if visible is not None:
        vis = visible if visible.dim() == 3 else visible[None]
        return vis.to(device=device, dtype=torch.bool).expand(batch, q, t)
    if slots is not None:
        from ..slot_attention import slot_visibility

        return slot_visibility(slots.prefix_len, slots.slot_lens, device)[None].expand(batch, q, t)
    if attention_mask is None:
        pad = torch.ones(batch, t, dtype=torch.bool, device=device)
    else:
        if attention_mask.dim() != 2 or attention_mask.shape[1] != t:
            raise ValueError(f"a 2-D attention mask must be [B, cached + q] = [{batch}, {t}], got "
                             f"{tuple(attention_mask.shape)}")
        pad = attention_mask.to(device=device, dtype=torch.bool)
    if getattr(model.config, "is_causal", True):  # causal in cache order, as transformers' create_causal_mask
        causal = torch.arange(t, device=device)[None, :] <= cached + torch.arange(q, device=device)[:, None]
        return pad[:, None, :] & causal[None]
    return pad[:, None, :].expand(batch, q, t)  # bidirectional: the padding mask alone


def compiled_call(model, input_ids: torch.Tensor, *, position_ids=None, attention_mask=None, visible=None,
                  slots=None, cache=None) -> tuple[torch.Tensor, int, bool]:
    """One model forward through the compiled path; returns (float logits [B, q, V], graphs compiled by this
    call, whether it was a warm-up call: it compiled, or recorded a CUDA graph).

    ``cache``: None, a ``StaticKV`` (written in place) or a ``DynamicCache`` (staged; its layers get the
    query's KV appended, as an eager forward does)."""
    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if impl not in MASKED_IMPLEMENTATIONS:
        raise ValueError(f"compile needs an attention implementation that takes a dense mask "
                         f"({', '.join(MASKED_IMPLEMENTATIONS)}); this model uses {impl!r}")
    device = input_ids.device
    batch, q = input_ids.shape
    qb = query_bucket(q)
    dtype = next(model.parameters()).dtype
    staged = None
    if cache is not None and not isinstance(cache, StaticKV):  # a DynamicCache: stage it
        staged, cache = cache, _stage(model, cache, batch, qb, dtype, device)
    cached = 0 if cache is None else cache.length
    if cache is not None:
        cache.ensure(cached + qb, batch, dtype, device)
        width = cache.capacity
    else:
        width = qb
    # The padded mask: real rows as the decoder asked, nothing at or after cached + q; every row that would
    # see nothing (padded rows, pad tokens of a causal prompt) sees its own slot, so no row is all -inf.
    vis = visibility(model, batch, q, cached, attention_mask, visible, slots, device)
    mask = torch.zeros(batch, qb, width, dtype=torch.bool, device=device)
    mask[:, :q, :cached + q] = vis
    rows = torch.arange(qb, device=device)
    mask[:, rows, cached + rows] |= ~mask.any(-1)
    if impl == "eager":  # the eager attention adds the mask: additive float form
        mask4 = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, torch.finfo(dtype).min)[:, None]
    else:
        mask4 = mask[:, None]
    ids = torch.zeros(batch, qb, dtype=input_ids.dtype, device=device)
    ids[:, :q] = input_ids
    pos = torch.zeros(batch, qb, dtype=torch.long, device=device)
    if position_ids is None:
        pos[:, :q] = torch.arange(cached, cached + q, device=device)
    else:
        pos[:, :q] = position_ids
    cpos = torch.arange(cached, cached + qb, device=device)
    keys, values = (None, None) if cache is None else cache.buffers()

    e = _entry(model, device)
    sig = (batch, qb, width, cache is not None, mask4.dtype, dtype, device)
    out, fresh, warm = _invoke(e, sig, model, ids, pos, mask4, cpos, keys, values)
    logits = out[:, :q].float()
    if e.cudagraphs and logits.data_ptr() == out.data_ptr():
        logits = logits.clone()  # a CUDA graph's output is overwritten by its next replay
    if cache is not None:
        cache.advance(q)
    if staged is not None:
        _unstage(staged, cache, cached, q)
    return logits, fresh, warm


def _stage(model, dyn, batch: int, qb: int, dtype, device) -> StaticKV:
    """A temporary StaticKV holding a copy of DynamicCache ``dyn`` with room for one query bucket."""
    st = StaticKV(model.config, reserve=0)
    t = dyn.get_seq_length()
    if t:
        st.ensure(t + qb, batch, dtype, device)
        st.append([[(lay.keys, lay.values) for lay in dyn.layers]])
    return st


def _unstage(dyn, st: StaticKV, cached: int, q: int) -> None:
    """Append the query's KV (now at [cached, cached + q) of the staged buffers) to DynamicCache ``dyn``."""
    for lay, x in zip(dyn.layers, st.layers):
        k = x._k[:, :, cached:cached + q].clone()
        v = x._v[:, :, cached:cached + q].clone()
        if not getattr(lay, "is_initialized", False) or lay.keys is None or lay.keys.numel() == 0:
            lay.lazy_initialization(k, v)
            lay.keys, lay.values = k, v
        else:
            lay.keys, lay.values = torch.cat([lay.keys, k], 2), torch.cat([lay.values, v], 2)

