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
    """A registered decoder: its function, its knob dataclass, whether it decodes a left-padded
    batch of rows together (else the adapter feeds it one row at a time), and the attention of the
    models it was written for (``causal``: AR and ReFusion; else bidirectional masked diffusion; D2F
    builds its block-causal masks itself on a bidirectional model)."""
    fn: Callable
    knobs: type[Knobs]
    batched: bool = True
    causal: bool = False

    def __call__(self, *args: Any, **kwargs: Any):
        return self.fn(*args, **kwargs)


DECODERS: dict[str, Decoder] = {
    "ar": Decoder(ar, ArKnobs, causal=True),
    "refusion": Decoder(refusion, RefusionKnobs, causal=True),
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


def check_attention(name: str, model_causal: bool) -> None:
    """ValueError when decoder ``name`` would run a model with the other attention than it was written for
    (a bidirectional LLaDA decoded causally, or an AR model decoded as a masked-diffusion one)."""
    want = get_decoder(name).causal
    if want != model_causal:
        need, got = ("causal", "bidirectional") if want else ("bidirectional", "causal")
        raise ValueError(f"decoder {name!r} needs a {need} model, but this checkpoint is {got} "
                         f"(config is_causal / its model family); valid decoders for it: "
                         f"{', '.join(sorted(n for n, d in DECODERS.items() if d.causal == model_causal))}")


def make_knobs(name: str, values: dict[str, Any] | None = None) -> Knobs:
    """The validated knob set of decoder ``name`` from plain values (unknown names and bad values raise
    ValueError naming the decoder and the knob)."""
    cls = get_decoder(name).knobs
    try:
        return cls.of(values, decoder=name)
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith("unknown knob") else f"decoder {name!r}: {msg}") from None
