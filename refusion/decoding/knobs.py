"""Decoder knobs: one frozen dataclass per decoder, the single source of each knob's name,
default, range and help text.

A decoder's knob class sits beside the decoder (``ArKnobs`` in ar.py, ``RefusionKnobs`` in
refusion.py, ...). Every field is declared with ``knob(...)``, which records its range or
choices; ``Knobs.__post_init__`` checks every field against them and then calls
``check()`` for rules across fields (a block length that must divide gen_length). So a
knob set that exists is valid: the runner builds it once while configuring a run, before
anything is written, and the decoder receives it ready-made.

What is not a knob: the special token ids (``eos_token_id``, ``mask_token_id``: they come
from the tokenizer or the model config and are keyword arguments of the decoder call) and
test hooks (``on_commit``), which no command line can set.

Shared knob makers (``gen_length``, ``temperature``, ``seed``, ``compile_knob``) give a knob the
same meaning and help wherever a decoder declares it; a decoder has only the knobs its class
declares. Which decoders declare ``compile`` (``compile_knob``, docs/design.md "Compiled decoding") is their
registry entry's ``compile`` capability (docs/decoders.md); the others always run eagerly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

K = TypeVar("K", bound="Knobs")


def knob(default: Any, help: str, *, low: float | None = None, high: float | None = None,
         choices: tuple[str, ...] | None = None, optional: bool = False) -> Any:
    """A dataclass field with its checks: numbers in [low, high], strings in ``choices``, bools as
    given; ``optional`` also allows None. The field's type is taken from its annotation."""
    return field(default=default, metadata={"help": help, "low": low, "high": high, "choices": choices,
                                            "optional": optional})


def _check(name: str, kind: str, value: Any, meta: dict) -> Any:
    """``value`` as the field's type, or ValueError naming the knob and what it accepts."""
    if value is None and meta["optional"]:
        return None
    low, high, choices = meta["low"], meta["high"], meta["choices"]
    if choices is not None:
        if value not in choices:
            raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value
    is_num = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "int":
        ok = is_num and float(value).is_integer()
        what = "an integer"
    else:
        ok = is_num and value == value  # not NaN
        what = "a number"
    rng = (f"in [{low}, {high}]" if high is not None else f">= {low}") if low is not None else ""
    if ok and (low is None or value >= low) and (high is None or value <= high):
        return int(value) if kind == "int" else float(value)
    none = " or none" if meta["optional"] else ""
    raise ValueError(f"{name} must be {what} {rng}{none}, got {value!r}".replace("  ", " "))


def _kind(annotation: Any) -> str:
    text = str(annotation)  # a string under `from __future__ import annotations`
    for kind in ("bool", "int", "float", "str"):
        if kind in text:
            return kind
    raise TypeError(f"knob annotation {text!r} is not bool / int / float / str")


@dataclass(frozen=True)
class Knobs:
    """Base class of the decoders' knob dataclasses (see the module docstring)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _check(f.name, _kind(f.type), getattr(self, f.name), f.metadata))
        self.check()

    def check(self) -> None:
        """Rules across knobs; raise ValueError naming the knob."""

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def of(cls: type[K], knobs: K | dict[str, Any] | None = None, overrides: dict[str, Any] | None = None,
           decoder: str | None = None) -> K:
        """``knobs`` (an instance, a dict or None = defaults) with ``overrides`` applied, validated.

        An unknown name raises ValueError listing the valid knobs."""
        if isinstance(knobs, cls) and not overrides:
            return knobs  # already validated when it was built
        given = dataclasses.asdict(knobs) if isinstance(knobs, Knobs) else dict(knobs or {})
        given.update(overrides or {})
        cls._known(given, decoder)
        return cls(**given)

    @classmethod
    def check_each(cls, values: dict[str, Any], decoder: str | None = None) -> None:
        """ValueError for an unknown name or a value out of its knob's range in ``values``; the rules across
        knobs (``check``) are left out, for callers that do not know the response budget yet."""
        cls._known(values, decoder)
        for f in fields(cls):
            if f.name in values:
                _check(f.name, _kind(f.type), values[f.name], f.metadata)

    @classmethod
    def _known(cls, values: dict[str, Any], decoder: str | None) -> None:
        bad = sorted(set(values) - set(cls.names()))
        if bad:
            who = f" for decoder {decoder!r}" if decoder else ""
            raise ValueError(f"unknown knob(s) {', '.join(bad)}{who}; valid knobs: {', '.join(cls.names())}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def describe(cls) -> list[dict[str, Any]]:
        """One row per knob: name, type, default, accepted values, help."""
        rows = []
        for f in fields(cls):
            m = f.metadata
            if m["choices"] is not None:
                accepted = " | ".join(m["choices"])
            elif _kind(f.type) == "bool":
                accepted = "true | false"
            elif m["low"] is not None:
                accepted = f"[{m['low']}, {m['high']}]" if m["high"] is not None else f">= {m['low']}"
            else:
                accepted = "integer" if _kind(f.type) == "int" else "any"
            if m["optional"]:
                accepted += " | none"
            rows.append({"name": f.name, "type": _kind(f.type), "default": f.default, "accepted": accepted,
                         "help": m["help"]})
        return rows


# Knobs several decoders share: one definition of their range and help text each.
def gen_length(default: int) -> Any:
    return knob(default, "response budget in tokens", low=1)


def temperature() -> Any:
    return knob(0.0, "sampling temperature; 0 = greedy (exact)", low=0.0)


def seed() -> Any:
    return knob(0, "seed of the sampling generator (each row gets its own, so a row's tokens do not depend "
                   "on its batch)", optional=True)


def compile_knob() -> Any:
    """The ``compile`` knob (docs/design.md "Compiled decoding"; off by default), declared by the decoders whose
    forwards can run compiled (the registry's ``compile`` capability)."""
    return knob(False, "run the model forward under torch.compile with static shapes (bucketed queries, a "
                       "preallocated KV cache; same tokens); off = the paper's eager setting")


# The default of ``logits_chunk``: positions whose logits one chunk holds (LLaDA's and Fast-dLLM's block length).
LOGITS_CHUNK = 32


def logits_chunk_knob() -> Any:
    """The ``logits_chunk`` knob of the decoders whose steps propose through ``common.proposal`` or read
    ``heads.Heads``; they stream with ``stream_chunk(knobs)``."""
    return knob(LOGITS_CHUNK, "a greedy step's logits computed only at the positions it decides, this many "
                              "positions at a time: at most one chunk of [batch, chunk, vocabulary] logits alive; "
                              "none = the model's own forward (the LM head over every forwarded position, float32 "
                              "copy of the decided ones only). Sampled steps (temperature > 0) and compiled "
                              "forwards always run the model's own forward. The head's matmul over fewer rows can "
                              "round a logit's last bit differently (docs/design.md section 6)",
                low=1, optional=True)


def stream_chunk(k) -> int | None:
    """The chunk ``common.proposal`` streams with under knobs ``k``: ``k.logits_chunk`` for a greedy step, None
    (the model's own forward) for a sampled one, whose draws over [B, positions, V] at once would come in
    another order from a chunked batch. Compiled forwards ignore it (``common.proposal``)."""
    return None if k.temperature > 0 else k.logits_chunk


def folder_knobs(folder, knobs: type[Knobs], sources: dict[str, dict[str, str]]) -> dict[str, Any]:
    """The knobs a checkpoint folder sets for itself, read from its JSON files and validated one way for every
    family. ``sources``: file name (config.json, generation_config.json) -> {knob: its key in that file}, a
    dotted key reaching into a nested object (``sampler_config.entropy_bound``). Absent or null values are left
    out (null means "off" or "the default" in these files); a missing file sets nothing; later files win. A
    value its knob rejects (its range, then the rules across knobs with the others at their defaults) or an
    unreadable file raises ValueError naming the file and the field."""
    from pathlib import Path

    out: dict[str, Any] = {}
    for name, keys in sources.items():
        path = Path(folder) / name
        if not path.is_file():
            continue
        data = read_json_object(path)
        found: dict[str, Any] = {}
        for knob_name, key in keys.items():
            value: Any = data
            for part in key.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if value is not None:
                found[knob_name] = value
        try:
            knobs.check_each(found)
            knobs(**{**out, **found})  # the rules across knobs (Knobs.check), the rest at their defaults
        except ValueError as e:
            raise ValueError(f"{path}: field {e}") from None
        out.update(found)
    return out


def read_json_object(path) -> dict:
    """A checkpoint file holding one JSON object (generation_config.json, config.json); ValueError naming
    the file when it is unreadable or not an object."""
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
