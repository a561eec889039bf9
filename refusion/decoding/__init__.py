"""Decoder registry: one plain dict from name to decoder function.

Every decoder is called as ``DECODERS[name](model, input_ids, attention_mask=None,
**knobs)`` and returns ``(tokens, stats)`` (see common.Meter.finish for stats).
"""

from __future__ import annotations

from collections.abc import Callable

from .ar import ar
from .mdm import fast_dllm, llada
from .refusion import refusion

DECODERS: dict[str, Callable] = {
    "ar": ar,
    "refusion": refusion,
    "llada": llada,
    "fast_dllm": fast_dllm,
}


def get_decoder(name: str) -> Callable:
    """The decoder called `name`; an unknown name raises ValueError listing the valid ones."""
    try:
        return DECODERS[name]
    except KeyError:
        raise ValueError(f"unknown decoder {name!r}; valid: {sorted(DECODERS)}") from None
