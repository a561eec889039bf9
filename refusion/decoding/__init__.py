"""Decoder registry: one plain dict from name to ``Decoder`` (function, knob class, batching).

Every decoder is called as ``DECODERS[name](model, input_ids, attention_mask=None, knobs=None,
**overrides)`` with ``knobs`` an instance of its knob class (or a dict, or None for the defaults)
and keyword overrides of single knobs; it returns ``(tokens, stats)`` (see common.Meter.finish).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .ar import ArKnobs, ar
from .d2f import D2fKnobs, d2f
from .knobs import Knobs
from .mdm import DreamKnobs, FastDllmKnobs, LladaKnobs, dream, fast_dllm, llada
from .refusion import RefusionKnobs, refusion


@dataclass(frozen=True)
class Decoder:
    """A registered decoder: its function, its knob dataclass, and whether it decodes a left-padded
    batch of rows together (else the adapter feeds it one row at a time)."""
    fn: Callable
    knobs: type[Knobs]
    batched: bool = True

    def __call__(self, *args: Any, **kwargs: Any):
        return self.fn(*args, **kwargs)


DECODERS: dict[str, Decoder] = {
    "ar": Decoder(ar, ArKnobs),
    "refusion": Decoder(refusion, RefusionKnobs),
    "llada": Decoder(llada, LladaKnobs),
    "fast_dllm": Decoder(fast_dllm, FastDllmKnobs),
    "dream": Decoder(dream, DreamKnobs),
    "d2f": Decoder(d2f, D2fKnobs),
}


def get_decoder(name: str) -> Decoder:
    """The decoder called `name`; an unknown name raises ValueError listing the valid ones."""
    try:
        return DECODERS[name]
    except KeyError:
        raise ValueError(f"unknown decoder {name!r}; valid decoders: {', '.join(sorted(DECODERS))}") from None


def make_knobs(name: str, values: dict[str, Any] | None = None) -> Knobs:
    """The validated knob set of decoder ``name`` from plain values (unknown names and bad values raise
    ValueError naming the decoder and the knob)."""
    cls = get_decoder(name).knobs
    try:
        return cls.of(values, decoder=name)
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith("unknown knob") else f"decoder {name!r}: {msg}") from None
