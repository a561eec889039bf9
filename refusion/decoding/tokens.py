"""What a decoder reads off its inputs: the special ids (EOS, mask), EOS tests and the cut after the first EOS,
the padding mask of a left-padded batch and the positions counted from each row's first real token."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch


def eos_ids(model, eos_token_id: int | Sequence[int] | None) -> tuple[int, ...]:
    """EOS ids from the keyword, else model.generation_config / model.config (int or list)."""
    value = eos_token_id
    if value is None:
        gen_cfg = getattr(model, "generation_config", None)
        value = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
    if value is None:
        value = getattr(model.config, "eos_token_id", None)
    if value is None:
        raise ValueError("eos_token_id: not set in model.config; pass eos_token_id=")
    ids = (value,) if isinstance(value, int) else tuple(int(v) for v in value)
    if not ids:
        raise ValueError("eos_token_id must name at least one id")
    return ids


def mask_id(model, mask_token_id: int | None) -> int:
    """Mask id from the keyword, else model.config.mask_token_id."""
    value = mask_token_id if mask_token_id is not None else getattr(model.config, "mask_token_id", None)
    if value is None:
        raise ValueError("mask_token_id: not set in model.config; pass mask_token_id=")
    return int(value)


@functools.lru_cache(maxsize=64)
def id_tensor(ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The ids as a 1-D long tensor on `device`, built once per (ids, device): decoders ask for the EOS
    set every step, and a fresh host-to-device tensor per step is pure overhead (docs/design.md §6). Read-only."""
    return torch.tensor(ids, dtype=torch.long, device=device)


def is_eos(tokens: torch.Tensor, eos: tuple[int, ...]) -> torch.Tensor:
    """Bool tensor, same shape as `tokens`, True where the token is any EOS id."""
    if len(eos) == 1:  # one comparison instead of isin's sort-based kernel
        return tokens == eos[0]
    return torch.isin(tokens, id_tensor(eos, tokens.device))


def cut_after_eos(tokens: torch.Tensor, eos: tuple[int, ...]) -> torch.Tensor:
    """1-D response -> prefix up to and including the first EOS (all of it if none)."""
    hits = is_eos(tokens, eos).nonzero()
    return tokens if hits.numel() == 0 else tokens[: int(hits[0, 0]) + 1]


def padding_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """[B, P] long mask (1 = real token); all ones when none is given."""
    if attention_mask is None:
        return torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}"
        )
    return attention_mask.to(device=input_ids.device, dtype=torch.long)


def left_padding_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """`padding_mask`, checked to be left padding: every row zeros then ones, with at least one one."""
    mask = padding_mask(input_ids, attention_mask)
    ok = bool(((mask == 0) | (mask == 1)).all()) and bool((mask[:, 1:] >= mask[:, :-1]).all())
    if not ok or not bool(mask[:, -1].all()):
        raise ValueError("attention_mask must be left padding: each row 0 ... 0 then 1 ... 1 (values 0 and 1,"
                         " at least one 1)")
    return mask


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Left-padded [B, T] mask -> position ids [B, T] counting real tokens from 0 (pads get 0)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)
