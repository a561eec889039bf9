"""Packed slot attention for ReFusion's parallel infill (docs/design.md §3 step 3).

k picked slots are packed into one query run of n = sum(slot_lens) tokens that
follows a shared prefix of C cached tokens. Visibility of packed query i:
  * every prefix key (full over the prefix, read once for all slots),
  * the keys of its own slot up to itself (causal inside a slot),
  * nothing of any other slot (empty across slots).
This replaces the authors' per-slot copy of the prefix cache (batch_repeat_interleave).

Three pieces, all plain PyTorch:
  * `slot_visibility` -- the bool [n, C + n] pattern; the decoders pass it to the
    model as an explicit 4-D float mask (so SDPA / eager / any backend run it);
  * `slot_attention` -- the reference a fused kernel must match: a two-part attention
    (prefix part + in-slot part) merged by log-sum-exp, never materialising a
    per-slot copy of the prefix;
  * `replicated_slot_attention` -- the per-slot replicated computation (what the
    authors do) used as the independent check.
Shapes: query [B, H, n, D]; key/value [B, Hkv, C + n, D] (prefix first, then the
packed slots in query order), H a multiple of Hkv (GQA); output [B, H, n, D].
Dtypes: float32 / bfloat16 / float16 (the softmax runs in float32).
Tested: tests/test_slot_attention.py on CPU, float32, max abs diff <= 1e-5 against
the replicated computation, at the op level and through a whole Qwen3 model.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch


def slot_ids(slot_lens: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """[n] slot index of every packed token."""
    lens = torch.as_tensor(list(slot_lens), dtype=torch.long, device=device)
    return torch.repeat_interleave(torch.arange(len(lens), device=device), lens)


def slot_visibility(prefix_len: int, slot_lens: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool [n, prefix_len + n]: True where packed query i may attend key j.

    With a single slot this is the ordinary causal pattern after a cache, so the
    plan and verify forwards use it too.
    """
    inside = _in_slot_pattern(tuple(int(s) for s in slot_lens), torch.device(device))  # [n, n], shared: read only
    # Runs once per decoder forward: every prefix key, then the in-slot pattern (built once per slot lengths).
    return torch.cat([inside.new_ones(inside.shape[0], prefix_len), inside], 1)


@functools.lru_cache(maxsize=256)
def _in_slot_pattern(slot_lens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Bool [n, n]: causal inside each slot, nothing across slots (cached; callers copy, never write)."""
    n = sum(slot_lens)
    vis = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    if len(slot_lens) > 1:
        sid = slot_ids(slot_lens, device)  # [n]
        vis &= sid[:, None] == sid[None, :]
    return vis


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, Hkv, T, D] -> [B, H, T, D] by repeating each kv head H / Hkv times (GQA)."""
    rep = heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def slot_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prefix_len: int,
    slot_lens: Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """Reference packed slot attention: prefix part and in-slot part merged by log-sum-exp.

    query [B, H, n, D]; key/value [B, Hkv, prefix_len + n, D]; returns [B, H, n, D].
    """
    heads, dim = query.shape[1], query.shape[-1]
    scale = dim**-0.5 if scale is None else scale
    q = query.float()
    k = _expand_kv(key, heads).float()
    v = _expand_kv(value, heads).float()
    kp, vp = k[:, :, :prefix_len], v[:, :, :prefix_len]  # [B, H, C, D] shared by all slots
    ks, vs = k[:, :, prefix_len:], v[:, :, prefix_len:]  # [B, H, n, D]

    s_prefix = q @ kp.transpose(-1, -2) * scale  # [B, H, n, C]
    s_slot = q @ ks.transpose(-1, -2) * scale  # [B, H, n, n]
    allowed = slot_visibility(0, slot_lens, query.device)  # [n, n]
    s_slot = s_slot.masked_fill(~allowed, float("-inf"))

    # Each query sees at least itself, so the row max is finite.
    m = torch.maximum(
        s_prefix.amax(-1, keepdim=True) if prefix_len else torch.full_like(s_slot[..., :1], float("-inf")),
        s_slot.amax(-1, keepdim=True),
    )  # [B, H, n, 1]
    p_prefix, p_slot = (s_prefix - m).exp(), (s_slot - m).exp()
    num = p_prefix @ vp + p_slot @ vs  # [B, H, n, D]
    den = p_prefix.sum(-1, keepdim=True) + p_slot.sum(-1, keepdim=True)
    return (num / den).to(query.dtype)


def replicated_slot_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prefix_len: int,
    slot_lens: Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """The per-slot computation: copy the prefix for each slot and run causal attention.

    Same shapes as `slot_attention`; independent code path (SDPA per slot).
    """
    heads, dim = query.shape[1], query.shape[-1]
    scale = dim**-0.5 if scale is None else scale
    k, v = _expand_kv(key, heads), _expand_kv(value, heads)
    outs, start = [], 0
    for length in slot_lens:
        q_s = query[:, :, start : start + length]  # [B, H, L, D]
        k_s = torch.cat([k[:, :, :prefix_len], k[:, :, prefix_len + start : prefix_len + start + length]], 2)
        v_s = torch.cat([v[:, :, :prefix_len], v[:, :, prefix_len + start : prefix_len + start + length]], 2)
        causal = torch.ones(length, prefix_len + length, dtype=torch.bool, device=query.device).tril(prefix_len)
        outs.append(torch.nn.functional.scaled_dot_product_attention(q_s, k_s, v_s, attn_mask=causal, scale=scale))
        start += length
    return torch.cat(outs, dim=2)
