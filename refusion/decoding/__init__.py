"""Decoder registry: one plain dict from name to ``Decoder`` (function, knob class, explicit flags).

Every decoder is called as ``DECODERS[name](model, input_ids, attention_mask=None, knobs=None,
**overrides)`` with ``knobs`` an instance of its knob class (or a dict, or None for the defaults)
and keyword overrides of single knobs; it returns ``(tokens, stats)`` (see common.Meter.finish).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .ar import ArKnobs, ar
from .d2f import D2fKnobs, d2f
from .knobs import Knobs
from .mdm import DreamKnobs, FastDllmKnobs, LladaKnobs, dream, fast_dllm, llada
from .refusion import RefusionKnobs, refusion


@dataclass(frozen=True, kw_only=True)
class Decoder:
    """A registered decoder. Every flag is stated at registration (``register``), none defaults:

    - ``batched``: it decodes a left-padded batch of rows together, each row exactly as alone (else the
      adapter feeds it one row at a time);
    - ``causal``: the attention of the models it was written for (AR and ReFusion: causal; masked
      diffusion: bidirectional; D2F builds its block-causal masks itself on a bidirectional model);
    - ``masked_diffusion``: a masked-diffusion baseline, which reports measure ReFusion against as an
      "MDM baseline" row (harness/report/paper_report.py reads it from here).

    Calling it runs ``fn`` and checks the result's contract (``check_result``): a decoder that
    generated tokens without a counted forward is an error, never a TPF of 0."""
    name: str
    fn: Callable
    knobs: type[Knobs]
    batched: bool
    causal: bool
    masked_diffusion: bool

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", self.name):
            raise ValueError(f"decoder name {self.name!r}: use lower-case letters, digits and '_'")
        if not callable(self.fn):
            raise TypeError(f"decoder {self.name!r}: fn must be callable, got {type(self.fn).__name__}")
        if not (isinstance(self.knobs, type) and issubclass(self.knobs, Knobs)):
            raise TypeError(f"decoder {self.name!r}: knobs must be a Knobs dataclass (refusion/decoding/knobs.py)")
        for flag in ("batched", "causal", "masked_diffusion"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"decoder {self.name!r}: {flag} must be True or False, got {getattr(self, flag)!r}")

    def __call__(self, *args: Any, **kwargs: Any):
        tokens, stats = self.fn(*args, **kwargs)
        check_result(self.name, tokens, stats)
        return tokens, stats


class DecoderContractError(RuntimeError):
    """A decoder returned something the interface forbids (see ``check_result``)."""


STATS_KEYS = ("nfe", "generated_tokens", "tpf", "kv_peak_bytes", "timings")


def check_result(name: str, tokens: Any, stats: Any) -> None:
    """DecoderContractError naming decoder ``name`` and the rule its ``(tokens, stats)`` breaks: tokens is a
    list of 1-D token tensors, stats a dict (common.Meter.finish) with nfe, generated_tokens, tpf,
    kv_peak_bytes and timings (decode_s, forward_s); generated_tokens counts the returned tokens; tokens
    generated with zero counted forwards means the model was called around the meter (call it through
    common.forward); tpf = generated_tokens / nfe."""
    def bad(rule: str) -> DecoderContractError:
        return DecoderContractError(f"decoder {name!r} breaks the decoder contract: {rule}")

    if not isinstance(tokens, list) or not all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in tokens):
        raise bad("tokens must be a list of 1-D tensors, one per row")
    if not isinstance(stats, dict) or any(k not in stats for k in STATS_KEYS):
        missing = [k for k in STATS_KEYS if not isinstance(stats, dict) or k not in stats]
        raise bad(f"stats lacks {', '.join(missing)} (build it with common.Meter.finish)")
    timings = stats["timings"]
    if not isinstance(timings, dict) or not {"decode_s", "forward_s"} <= set(timings):
        raise bad("stats['timings'] must hold decode_s and forward_s (common.Meter.finish)")
    generated, nfe = sum(int(t.numel()) for t in tokens), stats["nfe"]
    if stats["generated_tokens"] != generated:
        raise bad(f"stats say {stats['generated_tokens']} generated tokens, the rows hold {generated}")
    if generated and not nfe:
        raise bad(f"{generated} tokens generated with 0 counted forwards: the model was called around the "
                  "meter; call it through refusion.decoding.common.forward")
    if nfe and abs(stats["tpf"] - generated / nfe) > 1e-9 * max(1.0, generated / nfe):
        raise bad(f"tpf {stats['tpf']} is not generated_tokens / nfe = {generated}/{nfe}")


DECODERS: dict[str, Decoder] = {}


def register(name: str, fn: Callable, knobs: type[Knobs], *, batched: bool, causal: bool,
             masked_diffusion: bool) -> Decoder:
    """Add decoder ``name`` to ``DECODERS`` (ValueError if the name is taken) and return its entry; every
    flag must be given (see ``Decoder``). Registering is enough to put it under tests/test_conformance.py."""
    if name in DECODERS:
        raise ValueError(f"decoder {name!r} is already registered; registered: {', '.join(sorted(DECODERS))}")
    DECODERS[name] = Decoder(name=name, fn=fn, knobs=knobs, batched=batched, causal=causal,
                             masked_diffusion=masked_diffusion)
    return DECODERS[name]


register("ar", ar, ArKnobs, batched=True, causal=True, masked_diffusion=False)
register("refusion", refusion, RefusionKnobs, batched=True, causal=True, masked_diffusion=False)
register("llada", llada, LladaKnobs, batched=True, causal=False, masked_diffusion=True)
register("fast_dllm", fast_dllm, FastDllmKnobs, batched=True, causal=False, masked_diffusion=True)
register("dream", dream, DreamKnobs, batched=True, causal=False, masked_diffusion=True)
register("d2f", d2f, D2fKnobs, batched=True, causal=False, masked_diffusion=True)


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


def check_knob_values(name: str, values: dict[str, Any]) -> None:
    """Names and ranges of decoder ``name``'s knob values, each on its own (``Knobs.check_each``); ValueError
    as ``make_knobs``. For checks made before the response budget is known."""
    try:
        get_decoder(name).knobs.check_each(values, decoder=name)
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith("unknown knob") else f"decoder {name!r}: {msg}") from None


def make_knobs(name: str, values: dict[str, Any] | None = None) -> Knobs:
    """The validated knob set of decoder ``name`` from plain values (unknown names and bad values raise
    ValueError naming the decoder and the knob)."""
    cls = get_decoder(name).knobs
    try:
        return cls.of(values, decoder=name)
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith("unknown knob") else f"decoder {name!r}: {msg}") from None
