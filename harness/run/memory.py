"""Peak decode memory of one decoder call: how many bytes of tensors the call itself made live at
once, with a breakdown at that moment into KV cache, logits and everything else.

    with DecodeMemory(model) as mem:
        tokens, stats = DECODERS["ar"](model, input_ids, gen_length=256)
    mem.result()  # {"peak_bytes": ..., "breakdown": {"kv_cache": ..., "logits": ..., "other": ...}, ...}

or ``tokens, stats, memory = measure_decode("ar", model, input_ids, gen_length=256)``.

**The figure (any device): the dispatch tracker.** ``StorageTracker`` is a ``TorchDispatchMode``: every aten
op of the call passes through it, and each tensor *storage* an op creates is counted once, by its
``untyped_storage()`` (views and in-place results share their input's storage and add nothing), with its
``nbytes``; a weak reference on the storage takes its bytes off again when the last tensor using it dies.
``peak_bytes`` is the largest number of bytes held at once by storages created during the call. Tensors that
existed before the call -- the weights, the prompt, a tensor cached by an earlier call -- are never counted,
and neither is their freeing. The count is exact and deterministic for a deterministic decode: same bytes every
run on any machine (given the same kernels' choices of output tensors) -- except that the first call in a
process also counts the tensors a decoder helper memoizes for later calls (``common.id_tensor``, ReFusion's
slot patterns), which later calls find made.

**What it leaves out.** Whatever does not pass through the dispatcher as an op's output: the allocator's own
rounding, caching and fragmentation (the CUDA caching allocator's reserved-but-free blocks); scratch memory a
kernel allocates for itself (oneDNN / MKL packing buffers, the temporaries inside SDPA's flash-attention
kernels, cuBLAS workspaces); the Python interpreter, libraries and their caches; storages grown in place that
existed before the call. Sparse and meta tensors hold no counted storage and are skipped. It also cannot see
compiled code (the decoder knob ``compile``): torch.compile skips every frame while a dispatch mode is active,
so a compiled decode is refused (on CUDA, ``dispatch=False`` measures it by the allocator alone).

**Breakdown at the peak** (storages live at the moment of the peak, each in one class, classified when the
call ends -- a storage counts as what it was found to be at any time of its life):

- ``kv_cache``: storages held by the model's KV cache (a transformers ``Cache``'s ``layers[i].keys / .values``,
  an encoder-decoder cache's parts, a legacy tuple) when a forward begins or ends -- of the model, or of a
  module at most two levels below it (its base model, encoder / decoder halves) taking a ``cache`` /
  ``past_key_values`` keyword. So a layer's new concatenated KV counts as cache even while the forward that
  made it is still running, and so does a padded copy of several rows' caches that a stacked batch call hands
  the model as its cache (ReFusion). A concatenation onto cached KV is cache too, also when no forward sees
  the result (a commit appending accepted KV after the last forward, ``cache_append``; ``cache_keep``'s
  prefix + suffix). KV a decoder keeps aside and never hands the model as a cache (ReFusion's accepted-slot
  KV copies between infill steps) is ``other``.
- ``logits``: the LM head's output (a forward hook on ``model.get_output_embeddings()``) and every
  floating-point tensor whose last dimension is the vocabulary computed by an op from a logits tensor: the
  float32 copy ``common.forward`` makes, rows gathered from it, tempered logits, softmax probabilities,
  top-p / top-k filtered copies. A vocabulary-sized tensor computed from something else (a boolean mask over
  the vocabulary) is ``other``.
- ``other``: the rest (activations inside the forward, attention masks, position ids, token buffers):
  ``peak_bytes - kv_cache - logits``.

``weights_bytes``: the model's parameters and buffers, each storage once (tied embeddings once); not in the
peak. ``allocations``: storages the call created.

**On CUDA** ``peak_bytes`` is the allocator's: ``torch.cuda.reset_peak_memory_stats`` before the call, then
``max_memory_allocated() - memory_allocated()`` at its start -- the weights and everything else allocated
before are excluded by the subtraction; the allocator rounds each block up (512 B) and counts kernels' scratch,
so it is a little above the tracker's figure. With ``dispatch=True`` (the default) the tracker runs too and
gives the breakdown, which then sums to ``dispatch_peak_bytes``, not to ``peak_bytes``.

``profiler_peak(fn)`` is an independent count for the CPU: torch.profiler's allocation events of the CPU
allocator (each ``[memory]`` event carries the allocator's running total), peak above the total at the
start. It sees kernels' scratch too; tests/test_memory.py checks the tracker against it.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

METHOD_DISPATCH = "dispatch: live tensor storages created in the call"
METHOD_CUDA = "cuda allocator"
METHOD_PROFILER = "cpu allocator: torch.profiler memory events"
KINDS = ("kv_cache", "logits", "other")
LEAVES_OUT = ("allocator rounding, caching and fragmentation; scratch memory inside kernels (oneDNN, SDPA "
              "internals, cuBLAS workspaces); the interpreter and libraries; tensors made before the call")
_FRESH = {torch.ops.aten.lift_fresh.default}  # torch.tensor(...): the op's input is the new tensor itself
_CONCAT = {torch.ops.aten.cat.default}
CACHE_KEYWORDS = ("cache", "past_key_values")


class _Record:
    """One storage created in the call: its bytes, the tracker's clock when it was made, its class."""
    __slots__ = ("nbytes", "born", "kind")

    def __init__(self, nbytes: int, born: int, kind: str = "other"):
        self.nbytes, self.born, self.kind = nbytes, born, kind


def _tensors(x: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs: ``x`` itself, or inside (nested) tuples, lists and dicts, the
    only containers an aten op takes or returns. pytree's tree_leaves gives the same tensors; this plain walk
    costs a fraction of it, and it runs at every op of a tracked decode."""
    if isinstance(x, torch.Tensor):
        return [x]
    out: list[torch.Tensor] = []
    stack = [x]
    while stack:
        y = stack.pop()
        if isinstance(y, torch.Tensor):
            out.append(y)
        elif isinstance(y, (tuple, list)):
            stack.extend(reversed(y))
        elif isinstance(y, dict):
            stack.extend(reversed(list(y.values())))
    return out


def storages(t: Any) -> Iterator[torch.UntypedStorage]:
    """The untyped storages behind ``t`` (a wrapper subclass's inner tensors'); nothing for a non-tensor, a
    sparse or other non-strided tensor, or a meta tensor (no memory)."""
    if not isinstance(t, torch.Tensor):
        return
    if is_traceable_wrapper_subclass(t):
        for name in t.__tensor_flatten__()[0]:
            yield from storages(getattr(t, name))
        return
    if t.layout != torch.strided or t.device.type == "meta":
        return
    try:
        yield t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a functional wrapper)
        return


class StorageTracker(TorchDispatchMode):
    """Live bytes of the storages created while the mode is active (module doc); ``peak_bytes`` their peak.

    A logical clock ticks at every op that creates storages and at every free, so "live at the peak" is
    ``born <= peak_at`` and not freed before it: records freed after the peak are kept in ``_at_peak``,
    records freed before a new peak are dropped, so memory stays bounded by what one peak holds."""

    def __init__(self, vocab: int | None = None):
        super().__init__()
        self.vocab = vocab
        self.live_bytes = self.peak_bytes = self.peak_at = self.clock = self.allocations = 0
        self.retained_bytes = 0
        self._live: dict[int, tuple[weakref.ref, _Record]] = {}
        self._at_peak: list[_Record] = []  # freed after the current peak, live at it
        self.closed = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.closed:
            self._created(func, args, kwargs, out)
        return out

    def _created(self, func, args, kwargs, out) -> None:
        inputs = {id(st): st for a in _tensors((args, kwargs)) for st in storages(a)}
        kinds = {self._kind(k) for k in inputs}
        onto_kv = func in _CONCAT and "kv_cache" in kinds  # a commit appending KV to cached KV
        fresh = func in _FRESH
        new = []
        for t in _tensors(out):
            for st in storages(t):
                key = id(st)
                if key in self._live:
                    self._resized(key, st)
                elif key not in inputs or fresh:
                    kind = ("kv_cache" if onto_kv else
                            "logits" if "logits" in kinds and self._vocab_sized(t) else "other")
                    new.append((key, st, kind))
        if not new:
            return
        self.clock += 1
        for key, st, kind in new:
            if key in self._live:  # two outputs sharing one new storage
                continue
            rec = _Record(int(st.nbytes()), self.clock, kind)
            self._live[key] = (weakref.ref(st, lambda _, key=key: self._freed(key)), rec)
            self.live_bytes += rec.nbytes
            self.allocations += 1
        self._maybe_peak()

    def _vocab_sized(self, t: torch.Tensor) -> bool:
        return self.vocab is not None and t.is_floating_point() and t.dim() > 0 and t.shape[-1] == self.vocab

    def _kind(self, key: int) -> str | None:
        entry = self._live.get(key)
        return entry[1].kind if entry else None

    def _resized(self, key: int, st: torch.UntypedStorage) -> None:
        """A tracked storage grown or shrunk in place (``resize_``, an ``out=`` argument)."""
        rec = self._live[key][1]
        nbytes = int(st.nbytes())
        if nbytes != rec.nbytes:
            self.clock += 1
            self.live_bytes += nbytes - rec.nbytes
            rec.nbytes = nbytes
            self._maybe_peak()

    def _maybe_peak(self) -> None:
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_at = self.live_bytes, self.clock
            self._at_peak.clear()  # freed before this peak: live at no later one either

    def _freed(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is None or self.closed:
            return
        rec = entry[1]
        self.clock += 1
        self.live_bytes -= rec.nbytes
        if rec.born <= self.peak_at:
            self._at_peak.append(rec)

    def mark(self, t: Any, kind: str) -> None:
        """Class the storages of tensor(s) ``t`` created in the call as ``kind`` (kv_cache wins over logits)."""
        for leaf in tree_leaves(t):
            for st in storages(leaf):
                entry = self._live.get(id(st))
                if entry is not None and entry[1].kind != "kv_cache":
                    entry[1].kind = kind

    def close(self) -> dict[str, int]:
        """Stop counting; the breakdown of the storages live at the peak (sums to ``peak_bytes``). The bytes
        still live now are ``retained_bytes``: what the call handed back or left behind."""
        self.retained_bytes = self.live_bytes
        self.closed = True
        at_peak = [rec for _, rec in self._live.values() if rec.born <= self.peak_at] + self._at_peak
        out = {k: sum(rec.nbytes for rec in at_peak if rec.kind == k) for k in ("kv_cache", "logits")}
        # ``other`` by difference: equal to the sum of the other records unless a storage was resized in place
        # after the peak (its bytes at the peak are not kept)
        out["other"] = self.peak_bytes - out["kv_cache"] - out["logits"]
        self._live.clear()  # drops the weak references: no callback runs after the call
        self._at_peak = []
        return out


def cache_tensors(cache: Any) -> Iterator[torch.Tensor]:
    """The key / value tensors a cache object holds now: a transformers ``Cache`` (``layers[i].keys /
    .values``), one whose parts are caches (encoder-decoder), or a legacy tuple of (keys, values) pairs."""
    if cache is None:
        return
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor):
                    yield t
    for part in ("self_attention_cache", "cross_attention_cache"):
        yield from cache_tensors(getattr(cache, part, None))
    if isinstance(cache, (tuple, list)):
        for item in cache:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (tuple, list)):
                yield from cache_tensors(item)


def weights_bytes(model) -> int:
    """Bytes of the model's parameters and buffers, each storage once (tied weights once)."""
    seen: dict[int, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        for st in storages(t):
            seen[id(st)] = int(st.nbytes())
    return sum(seen.values())


def _takes_cache(module) -> bool:
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return any(k in params for k in CACHE_KEYWORDS)


class DecodeMemory:
    """Context manager measuring the peak memory of the code it wraps (module doc); ``result()`` after it.

    ``dispatch``: run the dispatch tracker (default True; required off CUDA). On CUDA ``dispatch=False``
    measures by the allocator alone, for compiled decoding or without the tracker's per-op overhead.
    Entering twice, or nesting two DecodeMemory, is allowed: each counts what was created inside it."""

    def __init__(self, model, *, dispatch: bool = True):
        self.model = model
        param = next(iter(model.parameters()), None)
        self.device = param.device if param is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        if not dispatch and not self.cuda:
            raise ValueError("DecodeMemory: off CUDA the dispatch tracker is the only method (dispatch=True)")
        self.dispatch = dispatch
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.head = head
        vocab = getattr(head, "out_features", None) or getattr(model.config, "vocab_size", None)
        self.tracker = StorageTracker(vocab) if dispatch else None
        self._hooks: list = []
        self._result: dict | None = None
        self._cuda_start = 0

    def _mark_caches(self, kwargs: dict, output: Any = None) -> None:
        # An output's fields by their keys: reading a deprecated alias attribute (past_key_values) warns.
        fields = set(output.keys()) if output is not None and hasattr(output, "keys") else set()
        for k in CACHE_KEYWORDS:
            self.tracker.mark(list(cache_tensors(kwargs.get(k))), "kv_cache")
            if k in fields:
                self.tracker.mark(list(cache_tensors(output[k])), "kv_cache")

    def _install_hooks(self) -> None:
        if self.head is not None:
            self._hooks.append(self.head.register_forward_hook(lambda m, i, o: self.tracker.mark(o, "logits")))
        for name, module in self.model.named_modules():
            # the model and the parts of it a decoder may call (its base model, encoder / decoder halves): not
            # every layer, whose hooks would walk the whole cache once per layer
            if name.count(".") < 2 and _takes_cache(module):
                self._hooks.append(module.register_forward_pre_hook(
                    lambda m, a, kw: self._mark_caches(kw), with_kwargs=True))
                self._hooks.append(module.register_forward_hook(
                    lambda m, a, kw, o: self._mark_caches(kw, o), with_kwargs=True))

    def __enter__(self) -> DecodeMemory:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_start = torch.cuda.memory_allocated(self.device)
        if self.tracker is not None:
            self._install_hooks()
            self.tracker.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        breakdown = None
        if self.tracker is not None:
            self.tracker.__exit__(exc_type, exc, tb)
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
            breakdown = self.tracker.close()
        cuda_peak = cuda_retained = None
        if self.cuda:
            torch.cuda.synchronize(self.device)
            cuda_peak = torch.cuda.max_memory_allocated(self.device) - self._cuda_start
            cuda_retained = torch.cuda.memory_allocated(self.device) - self._cuda_start
        self._result = self._build(breakdown, cuda_peak, cuda_retained)
        if isinstance(exc, RuntimeError) and self.tracker is not None and "torch.compile" in str(exc):
            raise RuntimeError("DecodeMemory: compiled decoding cannot run under the dispatch tracker (torch.compile "
                               "skips every frame while a dispatch mode is active); measure the eager decoder, or "
                               "on CUDA use DecodeMemory(model, dispatch=False)") from exc

    def _build(self, breakdown: dict | None, cuda_peak: int | None, cuda_retained: int | None = None) -> dict:
        t = self.tracker
        out = {"peak_bytes": cuda_peak if cuda_peak is not None else t.peak_bytes,
               # still live when the call ended: its outputs, and whatever it leaked (kept past its own use)
               "retained_bytes": cuda_retained if cuda_retained is not None else t.retained_bytes,
               "method": METHOD_CUDA if cuda_peak is not None else METHOD_DISPATCH,
               "breakdown": breakdown, "weights_bytes": weights_bytes(self.model), "device": str(self.device),
               "leaves_out": LEAVES_OUT}
        if t is not None:
            out.update(dispatch_peak_bytes=t.peak_bytes, allocations=t.allocations)
        return out

    def result(self) -> dict:
        """{"peak_bytes", "retained_bytes", "method", "breakdown" {kv_cache, logits, other} (None without the tracker),
        "weights_bytes", "device", "leaves_out", and with the tracker "dispatch_peak_bytes", "allocations"}."""
        if self._result is None:
            raise RuntimeError("DecodeMemory.result() is ready once the with-block has ended")
        return dict(self._result)


def measure_decode(name: str, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   knobs=None, *, dispatch: bool = True, special: dict | None = None,
                   **overrides) -> tuple[list[torch.Tensor], dict, dict]:
    """One call of registered decoder ``name`` under ``DecodeMemory``: (tokens, stats, memory result).
    ``special``: the call's special-id keywords (eos_token_id, mask_token_id). ValueError for compiled decoding
    under the tracker (module doc)."""
    from refusion.decoding import get_decoder

    decoder = get_decoder(name)
    k = decoder.knobs.of(knobs, overrides, name)
    if dispatch and getattr(k, "compile", False):
        raise ValueError(f"decoder {name!r} with compile=true: the dispatch tracker cannot see compiled forwards "
                         "(torch.compile skips frames under a dispatch mode); measure with compile=false, or on "
                         "CUDA with dispatch=False")
    with DecodeMemory(model, dispatch=dispatch) as mem:
        tokens, stats = decoder(model, input_ids, attention_mask, k, **(special or {}))
    return tokens, stats, mem.result()


def profiler_peak(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(peak bytes of the CPU allocator above its level at the start, fn's result) for ``fn()`` run under
    ``torch.profiler`` with ``profile_memory``: every allocation / free event carries the allocator's running
    total, so the peak is the largest total seen minus the total before the first event. Counts what the
    allocator hands out, kernels' scratch included; CPU only."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        value = fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            events.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.total_allocated))
    if not events:
        return 0, value
    events.sort(key=lambda e: e[0])
    start = events[0][2] - events[0][1]
    return max(0, max(e[2] for e in events) - start), value
