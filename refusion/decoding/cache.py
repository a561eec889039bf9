"""KV-cache surgery shared by the decoders: an empty cache for a call (a ``DynamicCache``, or a static one under
compiled decoding), its size in bytes, and keeping, copying, building and appending per-layer keys and values
(each [B, kv_heads, T, head_dim]). A static cache (compiled.StaticKV) does each in place, with the same meaning."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from .compiled import StaticKV, query_bucket

if TYPE_CHECKING:
    from .common import Meter


def new_cache(model, meter: Meter) -> DynamicCache:
    """An empty KV cache for one decoder call: a ``DynamicCache``, or with ``meter.compiled`` a static one
    (compiled.StaticKV: preallocated at its first write for the first need plus the response budget and a
    query bucket of slack; the same interface for the decoders)."""
    if not meter.compiled:
        return DynamicCache(config=model.config)
    return StaticKV(model.config, reserve=meter.budget + query_bucket(max(1, meter.budget)))


def cache_bytes(cache: DynamicCache | None) -> int:
    if cache is None:
        return 0
    total = 0
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)  # None until the layer's first update
        if keys is not None:
            total += keys.nbytes + layer.values.nbytes
    return total


def kv_parts_bytes(parts) -> int:
    """Bytes of per-layer (keys, values) chunks as returned by `cache_tail`."""
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for p in parts for k, v in p)


def cache_len(cache: DynamicCache | None) -> int:
    return 0 if cache is None else cache.get_seq_length()


def cache_keep(cache: DynamicCache, start: int, keep: torch.Tensor | None = None) -> None:
    """Keep cache[:start] plus, of the tail cache[start:], the rows `keep` (in that order).

    keys/values are (B, kv_heads, T, head_dim); `keep` indexes the tail (None = drop
    the tail). Used to drop mask-token KV after a plan and to keep accepted tokens only.
    A static cache (compiled decoding) does it in place.
    """
    if is_static(cache):
        cache.keep(start, keep)
        return
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False) or layer.keys is None:
            continue
        head_k, head_v = layer.keys[:, :, :start], layer.values[:, :, :start]
        if keep is not None and keep.numel():
            tail_k = layer.keys[:, :, start:].index_select(2, keep)
            tail_v = layer.values[:, :, start:].index_select(2, keep)
            head_k, head_v = torch.cat([head_k, tail_k], 2), torch.cat([head_v, tail_v], 2)
        layer.keys, layer.values = head_k, head_v


def cache_tail(cache: DynamicCache, start: int, rows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copy of the tail rows `rows` (indices into cache[start:]) of every layer."""
    out = []
    for layer in cache.layers:
        k = layer.keys[:, :, start:].index_select(2, rows)
        v = layer.values[:, :, start:].index_select(2, rows)
        out.append((k, v))
    return out


def cache_from(model, parts: list[tuple[torch.Tensor, torch.Tensor]] | None) -> DynamicCache:
    """A DynamicCache whose layers hold the given per-layer (keys, values) tensors as they are
    (no copy; expanded views are fine: the model's next update concatenates into a new tensor).
    None or an empty list gives an empty cache."""
    cache = DynamicCache(config=model.config)
    for layer, (k, v) in zip(cache.layers, parts or []):
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    return cache


def cache_append(cache: DynamicCache, parts: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
    """Append several per-layer (keys, values) chunks to the cache, in list order (a static cache: copied
    into its buffers after the live length). One chunk that already lies right after the layer's keys and values
    in their storage (a forward's KV that a crop cut off: ``continues``) is taken back by widening the view, with
    no copy: a copy would hold the whole cache twice while the forward's tensors are still referenced."""
    if not parts:
        return
    if is_static(cache):
        cache.append(parts)
        return
    for i, layer in enumerate(cache.layers):
        ks = [p[i][0] for p in parts]
        vs = [p[i][1] for p in parts]
        if not getattr(layer, "is_initialized", False) or layer.keys is None:
            layer.lazy_initialization(ks[0], vs[0])  # an empty cache: the chunks become its content
        elif len(parts) == 1 and continues(layer.keys, ks[0]) and continues(layer.values, vs[0]):
            layer.keys, layer.values = _widened(layer.keys, ks[0]), _widened(layer.values, vs[0])
            continue
        else:
            ks, vs = [layer.keys] + ks, [layer.values] + vs
        layer.keys, layer.values = torch.cat(ks, 2), torch.cat(vs, 2)


def continues(t: torch.Tensor, part: torch.Tensor) -> bool:
    """Whether ``part`` [B, h, n, d] is the view of ``t``'s storage that comes right after ``t`` [B, h, T, d] along
    the sequence (dim 2), with the same strides: then ``t`` widened by n positions is ``cat([t, part], 2)``."""
    return (part.dim() == t.dim() == 4 and part.shape[:2] == t.shape[:2] and part.shape[3] == t.shape[3]
            and part.stride() == t.stride() and part.dtype == t.dtype and part.device == t.device
            and _root(part) is _root(t) and part.storage_offset() == t.storage_offset() + t.shape[2] * t.stride(2))


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage ``t`` views (itself when it is no view): the same object for two views of one
    storage, real or fake (a fake tensor has no data pointer to compare)."""
    return t if t._base is None else t._base


def _widened(t: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """``t`` and the ``part`` that ``continues`` it, as one view [B, h, T + n, d] of their storage."""
    size = (t.shape[0], t.shape[1], t.shape[2] + part.shape[2], t.shape[3])
    return t.as_strided(size, t.stride(), t.storage_offset())


def is_static(cache) -> bool:
    """Whether ``cache`` is a static one (compiled decoding), whose buffers are edited in place."""
    return isinstance(cache, StaticKV)
