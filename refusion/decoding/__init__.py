"""Decoder registry: one plain dict from name to ``Decoder`` (function, knob class, explicit flags).

Every decoder is called as ``DECODERS[name](model, input_ids, attention_mask=None, knobs=None,
**overrides)`` with ``knobs`` an instance of its knob class (or a dict, or None for the defaults)
and keyword overrides of single knobs; it returns ``(tokens, stats)`` (see common.Meter.finish).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from .ar import ArKnobs, ar
from .d2f import D2fKnobs, d2f
from .diffusion_gemma import FOLDER_KNOBS as DIFFUSION_GEMMA_FOLDER_KNOBS, DiffusionGemmaKnobs, diffusion_gemma
from .knobs import Knobs, folder_knobs
from .llada2 import Llada2Knobs, llada2
from .mdm import DREAM_FOLDER_KNOBS, DreamKnobs, FastDllmKnobs, LladaKnobs, dream, fast_dllm, llada
from .refusion import RefusionKnobs, refusion
from .sdar import FOLDER_KNOBS as SDAR_FOLDER_KNOBS, SdarKnobs, sdar


@dataclass(frozen=True)
class Grid:
    """A decoder's parallelism grid: the knob sets at which ``make frontier`` measures its accuracy against its
    parallelism (tokens per forward), each given on top of a model's own knobs (docs/design.md "Frontier and
    AUP"). ``{}`` is the model's own setting. ``doc`` says in one line what varies and which values mean what.

    The grid sits in the registry beside the decoder's knob class, so registering a decoder with one gives it a
    frontier without any change to harness/. A decoder without a grid is one point at its own setting."""
    points: tuple[Mapping[str, Any], ...]
    doc: str

    def __post_init__(self) -> None:
        points = tuple(MappingProxyType(dict(p)) for p in self.points)
        if not points:
            raise ValueError("a grid needs at least one point ({} = the model's own setting)")
        if len({tuple(sorted(p.items())) for p in points}) != len(points):
            raise ValueError(f"a grid point appears twice: {[dict(p) for p in points]}")
        if not isinstance(self.doc, str) or not self.doc.strip():
            raise ValueError("a grid needs a one-line doc: what varies and what its values mean")
        object.__setattr__(self, "points", points)

    @classmethod
    def over(cls, knob: str, values: tuple, doc: str, own: bool = False) -> "Grid":
        """One knob at ``values`` (``own``: the model's own setting first, as ``{}``)."""
        return cls(points=(({},) if own else ()) + tuple({knob: v} for v in values), doc=doc)

    def varied(self) -> list[str]:
        """The knobs some point sets, in first-use order."""
        return list(dict.fromkeys(k for p in self.points for k in p))


@dataclass(frozen=True, kw_only=True)
class Decoder:
    """A registered decoder. Every flag is stated at registration (``register``), none defaults:

    - ``batched``: it decodes a left-padded batch of rows together, each row exactly as alone (else the
      adapter feeds it one row at a time);
    - ``causal``: the attention of the models it was written for (AR and ReFusion: causal; masked
      diffusion: bidirectional; D2F builds its block-causal masks itself on a bidirectional model);
    - ``masked_diffusion``: a masked-diffusion baseline, which reports measure ReFusion against as an
      "MDM baseline" row (harness/report/paper_report.py reads it from here).

    ``grid`` (optional): its parallelism grid for ``make frontier`` (``Grid``); every point's knobs are checked
    against ``knobs`` here, so a bad grid fails at registration.

    ``family`` (optional): the one model family (harness/models/families.py) it runs, for a decoder written
    for a model class of its own (``diffusion_gemma`` on DiffusionGemmaForBlockDiffusion); such a family then
    runs only its decoders (``check_attention``). None: any causal-LM family of its attention.

    ``folder_knobs`` (optional): the knobs a checkpoint folder sets for itself, as file name -> {knob: key in
    that file} (``knobs.folder_knobs``; Dream's generation_config.json, DiffusionGemma's config.json and
    generation_config.json), read by ``checkpoint_defaults``.

    Capabilities read from the entry (``capabilities``), never listed anywhere else: ``batched`` above,
    ``compile`` and ``sampling`` (its knob class declares ``compile`` / ``seed``), ``families`` (its one
    family, or every family of its attention). The docs' decoder and knob tables (docs/decoders.md) are generated
    from these entries (harness/run/knobs.py ``markdown``), and a test fails when the page drifts.

    Calling it runs ``fn`` and checks the result's contract (``check_result``): a decoder that
    generated tokens without a counted forward is an error, never a TPF of 0."""
    name: str
    fn: Callable
    knobs: type[Knobs]
    batched: bool
    causal: bool
    masked_diffusion: bool
    grid: Grid | None = field(default=None)
    family: str | None = field(default=None)
    folder_knobs: Mapping[str, Mapping[str, str]] | None = field(default=None)

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
        if self.grid is not None:
            if not isinstance(self.grid, Grid):
                raise TypeError(f"decoder {self.name!r}: grid must be a Grid, got {type(self.grid).__name__}")
            for point in self.grid.points:
                try:
                    self.knobs.check_each(dict(point), decoder=self.name)
                except ValueError as e:
                    raise ValueError(f"decoder {self.name!r}: grid point {dict(point)}: {e}") from None

    @property
    def compile(self) -> bool:
        """It takes the knob ``compile`` (torch.compile with static shapes; refusion/decoding/compiled.py)."""
        return "compile" in self.knobs.names()

    @property
    def sampling(self) -> bool:
        """It can sample: its knob class has ``seed`` (the generator of its draws; where it also has
        ``temperature``, 0 is greedy)."""
        return "seed" in self.knobs.names()

    def families(self, table: Mapping[str, bool | None]) -> list[str]:
        """The model families it runs, given ``table``: family name -> that family's attention (True causal,
        False bidirectional, None read from the checkpoint's config, causal by default). A decoder with a
        ``family`` runs that one; any other runs every family of its attention that has no decoder of its own."""
        if self.family is not None:
            return [self.family]
        own = {d.family for d in DECODERS.values() if d.family is not None}
        return [f for f, causal in table.items()
                if f not in own and (causal is None or causal == self.causal)]

    def capabilities(self) -> dict[str, Any]:
        """The flags a table of decoders shows: batched, compile, sampling, attention, masked_diffusion (an MDM
        baseline row of the reports), family (None: any of its attention), the grid's varied knobs."""
        return {"batched": self.batched, "compile": self.compile, "sampling": self.sampling,
                "attention": "causal" if self.causal else "bidirectional",
                "masked_diffusion": self.masked_diffusion, "family": self.family,
                "grid": self.grid.varied() if self.grid is not None else []}

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
             masked_diffusion: bool, grid: Grid | None = None, family: str | None = None,
             folder_knobs: Mapping[str, Mapping[str, str]] | None = None) -> Decoder:
    """Add decoder ``name`` to ``DECODERS`` (ValueError if the name is taken) and return its entry; every
    flag must be given (see ``Decoder``), the parallelism ``grid`` of ``make frontier`` may be. Registering is
    enough to put it under tests/test_conformance.py and give it a frontier."""
    if name in DECODERS:
        raise ValueError(f"decoder {name!r} is already registered; registered: {', '.join(sorted(DECODERS))}")
    DECODERS[name] = Decoder(name=name, fn=fn, knobs=knobs, batched=batched, causal=causal,
                             masked_diffusion=masked_diffusion, grid=grid, family=family, folder_knobs=folder_knobs)
    return DECODERS[name]


# The parallelism grids of `make frontier` (docs/design.md "Frontier and AUP"): each decoder's thresholds from
# cautious to bold, or, where no threshold applies (LLaDA, Dream), the tokens unmasked per step. Four points
# each: with 100 items per kind the tiny suite's default frontier (4 presets) fits 30 minutes on 2 cores.
STEP_GRID_DOC = ("tokens unmasked per step: the model's own steps (the presets: one a step, steps = gen_length, "
                 "32 steps a block at block_length 32), then tokens_per_step 2, 4, 8 (16, 8, 4 steps a block)")
register("ar", ar, ArKnobs, batched=True, causal=True, masked_diffusion=False,
         grid=Grid(points=({},), doc="one point: AR commits one token per forward (TPF 1)"))
register("refusion", refusion, RefusionKnobs, batched=True, causal=True, masked_diffusion=False,
         grid=Grid(points=tuple({"slot_threshold": s, "token_threshold": t}
                                for s, t in ((0.9, 0.6), (0.8, 0.4), (0.6, 0.3), (0.4, 0.1))),
                   doc="slot_threshold / token_threshold lowered together: 0.9/0.6, 0.8/0.4, 0.6/0.3 (the tiny "
                       "preset), 0.4/0.1; lower thresholds plan more slots and accept more drafted tokens"))
register("llada", llada, LladaKnobs, batched=True, causal=False, masked_diffusion=True,
         grid=Grid.over("tokens_per_step", (2, 4, 8), STEP_GRID_DOC, own=True))
register("fast_dllm", fast_dllm, FastDllmKnobs, batched=True, causal=False, masked_diffusion=True,
         grid=Grid.over("threshold", (0.95, 0.9, 0.7, 0.5),
                        "threshold 0.95, 0.9 (the paper's and the presets'), 0.7, 0.5: every masked token above it "
                        "is unmasked in a step"))
register("dream", dream, DreamKnobs, batched=True, causal=False, masked_diffusion=True,
         folder_knobs=DREAM_FOLDER_KNOBS,
         grid=Grid.over("tokens_per_step", (2, 4, 8), "tokens unmasked per step: the model's own steps (the preset: "
                        "one a step, steps = gen_length; the whole response is Dream's one block), then "
                        "tokens_per_step 2, 4, 8", own=True))
register("d2f", d2f, D2fKnobs, batched=True, causal=False, masked_diffusion=True,
         grid=Grid.over("skip_threshold", (0.95, 0.9, 0.7, 0.5),
                        "skip_threshold 0.95, 0.9 (D2F's and the preset's), 0.7, 0.5: every masked token of an "
                        "active block above it is committed in a step"))
# DiffusionGemma (refusion/decoding/diffusion_gemma.py) runs its own model class only (family).
register("diffusion_gemma", diffusion_gemma, DiffusionGemmaKnobs, batched=True, causal=True, masked_diffusion=False,
         family="diffusion_gemma", folder_knobs=DIFFUSION_GEMMA_FOLDER_KNOBS,
         grid=Grid.over("entropy_bound", (0.02, 0.1, 0.5, 2.0),
                        "entropy_bound 0.02, 0.1 (transformers' default), 0.5, 2.0: the sampled tokens of lowest "
                        "entropy are accepted in a step while their entropy sum minus the largest stays below it"))

# LLaDA2.x (refusion/decoding/llada2.py) runs its own model class only (refusion/llada2_moe.py, family llada2). A
# masked-diffusion model, but beyond Table 1 (another backbone and size class): not one of the "MDM baseline"
# rows ReFusion's speedups are measured against; compare its frontier (docs/models.md).
register("llada2", llada2, Llada2Knobs, batched=True, causal=False, masked_diffusion=False, family="llada2",
         grid=Grid.over("threshold", (0.95, 0.9, 0.7, 0.5),
                        "threshold 0.95, 0.9 (dInfer's LLaDA2 default), 0.7, 0.5: every masked token of the block "
                        "at or above it is committed in a denoise step"))

# SDAR (refusion/decoding/sdar.py): block diffusion on Qwen3 with the block-causal mask it builds itself.
register("sdar", sdar, SdarKnobs, batched=True, causal=True, masked_diffusion=False, folder_knobs=SDAR_FOLDER_KNOBS,
         grid=Grid.over("confidence_threshold", (0.95, 0.85, 0.7, 0.5),
                        "confidence_threshold 0.95, 0.85 (generate.py's), 0.7, 0.5 of low_confidence_dynamic: every "
                        "masked token drawn above it is committed in a step (at most block_length a forward; the "
                        "block length is the checkpoint's own, a frontier per trained block size)"))


def get_decoder(name: str) -> Decoder:
    """The decoder called `name`; an unknown name raises ValueError listing the valid ones."""
    try:
        return DECODERS[name]
    except KeyError:
        raise ValueError(f"unknown decoder {name!r}; valid decoders: {', '.join(sorted(DECODERS))}") from None


def checkpoint_defaults(name: str, folder) -> dict[str, Any]:
    """The knobs of decoder ``name`` that a checkpoint folder sets for itself (``Decoder.folder_knobs``), read
    and validated by ``knobs.folder_knobs``; {} for a decoder that reads none. ValueError naming the file and
    field for a value the knob rejects."""
    entry = get_decoder(name)
    return folder_knobs(folder, entry.knobs, dict(entry.folder_knobs)) if entry.folder_knobs else {}


def check_attention(name: str, model_causal: bool, family: str | None = None) -> None:
    """ValueError when decoder ``name`` would run a model with the other attention than it was written for
    (a bidirectional LLaDA decoded causally, or an AR model decoded as a masked-diffusion one), or, given the
    checkpoint's ``family``, a model of another class than its own (``Decoder.family``: DiffusionGemma runs
    ``diffusion_gemma`` only, and ``diffusion_gemma`` runs DiffusionGemma only)."""
    entry = get_decoder(name)
    if family is not None:
        own = sorted(n for n, d in DECODERS.items() if d.family == family)
        if entry.family is not None and entry.family != family:
            raise ValueError(f"decoder {name!r} runs {entry.family} checkpoints only, but this checkpoint is of the "
                             f"{family} family")
        if own and name not in own:
            raise ValueError(f"decoder {name!r} cannot run a {family} checkpoint (a model class of its own); valid "
                             f"decoders for it: {', '.join(own)}")
    want = entry.causal
    if want != model_causal:
        need, got = ("causal", "bidirectional") if want else ("bidirectional", "causal")
        valid = sorted(n for n, d in DECODERS.items() if d.causal == model_causal and d.family is None)
        raise ValueError(f"decoder {name!r} needs a {need} model, but this checkpoint is {got} "
                         f"(config is_causal / its model family); valid decoders for it: {', '.join(valid)}")


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
