"""The models of a run, from a ``MODELS`` string or a models file, as ModelSpecs; nothing is loaded here.

A ``MODELS`` string is a comma-separated list of ``name=checkpoint:decoder[:knob=value,...]`` (knobs
continue after commas until the next ``name=...:``) or preset names (``preset[:knob=value,...]``, ``all``).
The decoder ``ar@vllm`` is the ``ar`` decoder served by vLLM (harness/run/engine.py); its knobs are ar's
and the engine's (``dtype``, ``max_num_seqs``, ``kv_cache_memory_bytes``, ...), split by the model check.
It is read strictly: a plain value (a decoder, a knob's value, a chat-template argument) that holds ``=``
or ``:`` is another model's spec swallowed by a missing comma, and the error names that model; a
chat-template argument must be a literal the template can take (a bool for ``enable_thinking``, a number
or a short word elsewhere); a model name given twice is an error.

A models file (``--models-file``, TOML: the stdlib reads it) holds one ``[[models]]`` table per model::

    [[models]]
    name = "qwen3"                           # required: letters, digits, '_', '.', '-'
    path = "/ckpt/Qwen3-8B"                  # the checkpoint folder (relative: to the file's folder)
    decoder = "ar"                           # or "ar@vllm"; or preset = "refusion" instead of path and decoder
    knobs = { gen_length = 512 }             # optional: the decoder's knobs, typed values
    chat_template_args = { enable_thinking = false }
    base = "/ckpt/Dream-v0-Base-7B"          # optional: the base folder of a LoRA adapter

Every field is checked against this schema before anything loads (one error line naming the file, the
model and the field); the knobs themselves against the decoder's knob dataclass by the runner.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

from harness.run.hints import did_you_mean, unknown
from harness.run.presets import MODEL_GROUPS, PRESETS, ModelSpec

# A model option that chooses how a checkpoint loads (not a decoding knob), and the model's own
# chat-template arguments (``chat_template_args=enable_thinking=false;x=1`` in MODELS).
LOAD_OPTIONS = ("base",)
TEMPLATE_OPTION = "chat_template_args"
NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_NEW_MODEL = re.compile(r"^[A-Za-z0-9_.\-]+=[^=]*:")
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,39}")
_BOOL_ARGS = ("enable_thinking",)


class InputError(Exception):
    """Bad user input: reported as one line, exit code 2, nothing written."""


class KnobHelp(Exception):
    """``MODELS=<model>:help``: print the decoder's knobs instead of running."""

    def __init__(self, decoder: str):
        super().__init__(decoder)
        self.decoder = decoder


def literal(text: str) -> Any:
    """A plain value as lm-eval reads ``key=value`` arguments: bool, int, float or the string itself."""
    from lm_eval.utils import handle_arg_string

    return handle_arg_string(text)


# ---------------------------------------------------------------- strict MODELS strings


def _shown(text: str, width: int = 48) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _swallowed(value: str, owner: str, where: str, prefixes: tuple[str, ...] = ()) -> InputError:
    """The error for a plain value that holds another model's spec: ``value`` is what follows ``where``
    (e.g. "decoder" or "knob block_length"); the swallowed model's name is what precedes its '=' less the
    value really meant (a number, a bool, one of ``prefixes``)."""
    head = re.split(r"[=:]", value, maxsplit=1)[0]
    meant = ""
    m = _NUMBER.match(head)
    for p in sorted((*prefixes, "true", "false", "True", "False"), key=len, reverse=True):
        if head.startswith(p) and len(head) > len(p):
            meant = p
            break
    if not meant and m and m.end() < len(head):
        meant = m.group(0)
    swallowed = head[len(meant):] or head
    return InputError(f"MODELS: model {swallowed!r} was swallowed by model {owner!r}: its {where} reads "
                      f"{_shown(value)!r}; a comma is missing before {swallowed + '='!r}")


def template_args(text: str, owner: str | None = None) -> dict[str, Any]:
    """``enable_thinking=false;x=1`` -> typed arguments, each a literal the template can take: a bool for
    enable_thinking, a number, a bool or a short word elsewhere. ``owner``: the model the argument belongs
    to (None: the run-wide --chat-template-args)."""
    out: dict[str, Any] = {}
    who = f"model {owner!r}: {TEMPLATE_OPTION}" if owner else "--chat-template-args"
    for part in re.split(r"[;,]", text or ""):
        k, eq, v = part.strip().partition("=")
        if not part.strip():
            continue
        if not eq or not k.strip():
            raise InputError(f"{who}: chat template argument {part.strip()!r}: expected name=value")
        k, v = k.strip(), v.strip()
        if owner and ("=" in v or ":" in v):
            raise _swallowed(v, owner, f"chat template argument {k}")
        out[k] = check_template_value(k, literal(v), who)
    return out


def check_template_value(key: str, value: Any, who: str) -> Any:
    """``value`` if the chat template can take it as argument ``key``; InputError otherwise."""
    if key in _BOOL_ARGS:
        if not isinstance(value, bool):
            raise InputError(f"{who}: {key} must be true or false, got {value!r}")
    elif not (isinstance(value, (bool, int, float)) or (isinstance(value, str) and _WORD.fullmatch(value))):
        raise InputError(f"{who}: {key} must be a number, true/false or a short word (letters, digits, '_', "
                         f"'.', '-'), got {_shown(str(value))!r}")
    return value


def _knob_choices(decoder: str, knob: str) -> tuple[str, ...]:
    from refusion.decoding import DECODERS

    d = DECODERS.get(decoder)
    if d is None:
        return ()
    for f in d.knobs.__dataclass_fields__.values():
        if f.name == knob:
            return tuple(str(c) for c in (f.metadata.get("choices") or ()))
    return ()


def _group(spec: str) -> list[list[str]]:
    groups: list[list[str]] = []
    pieces = [p.strip() for p in spec.split(",") if p.strip()]
    pieces = [name for p in pieces for name in MODEL_GROUPS.get(p, (p,))]  # "all" -> every preset
    for piece in pieces:
        starts_model = bool(_NEW_MODEL.match(piece)) or "=" not in piece.split(":")[0]
        if starts_model or not groups:
            groups.append([piece])
        else:
            groups[-1].append(piece)
    return groups


def parse_models(spec: str) -> list[ModelSpec]:
    """``name=ckpt:decoder[:k=v,...],...`` and preset names -> ModelSpecs (no I/O); InputError naming a
    model swallowed by a missing comma, a bad chat-template argument, an unknown preset, a name used twice."""
    from refusion.decoding import DECODERS

    models: list[ModelSpec] = []
    for head, *more in _group(spec):
        knob_text = list(more)
        if "=" in head.split(":")[0]:
            name, _, rest = head.partition("=")
            parts = rest.split(":")
            if len(parts) < 2 or not parts[0] or not parts[1]:
                raise InputError(f"bad model spec {_shown(head)!r}: expected name=checkpoint:decoder[:knob=value,...]")
            checkpoint, decoder = parts[0], parts[1]
            if "=" in decoder:
                raise _swallowed(":".join(parts[1:]), name, "decoder", tuple(DECODERS))
            if len(parts) > 2:
                knob_text.insert(0, ":".join(parts[2:]))
            decoder, engine = _engine_of(decoder, f"model {name!r}")
            base = ModelSpec(name, checkpoint, decoder, engine=engine)
        else:
            name, *rest = head.split(":")
            if name not in PRESETS:
                raise InputError(unknown("model name", name, PRESETS, label="names")
                                 + " (or give name=checkpoint:decoder[:knob=value,...])")
            base = PRESETS[name]
            if rest:
                knob_text.insert(0, ":".join(rest))
        knobs = dict(base.knobs)
        given: set[str] = set()
        for kv in knob_text:
            if kv.strip() == "help":
                raise KnobHelp(base.decoder)
            k, eq, v = kv.partition("=")
            k, v = k.strip(), v.strip()
            if not eq or not k:
                raise InputError(f"bad knob {_shown(kv)!r} for model {name!r}: expected knob=value")
            if k in given:
                raise InputError(f"model {name!r}: knob {k} given twice")
            given.add(k)
            if k == TEMPLATE_OPTION:
                template_args(v, name)  # checked now: a swallowed model is named before anything else
                knobs[k] = v
                continue
            if "=" in v or ":" in v:
                raise _swallowed(v, name, f"knob {k}", _knob_choices(base.decoder, k))
            knobs[k] = literal(v)
        models.append(replace(base, name=name, knobs=knobs))
    return check_names(models)


def _engine_of(decoder: str, who: str) -> tuple[str, str | None]:
    """``ar@vllm`` -> ("ar", "vllm") (the ar decoder served by an engine, harness/run/engine.py); a plain
    decoder -> (decoder, None); InputError naming the valid engines."""
    from harness.run.engine import EngineError, split_decoder

    try:
        return split_decoder(decoder)
    except EngineError as e:
        raise InputError(f"{who}: {e}") from None


def check_names(models: list[ModelSpec]) -> list[ModelSpec]:
    if not models:
        raise InputError("no models given")
    names = [m.name for m in models]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise InputError(f"model name(s) used twice: {', '.join(dup)}")
    for n in names:
        if not NAME.fullmatch(n):
            raise InputError(f"model name {n!r} may only use letters, digits, '_', '.', '-'")
    return models


# ---------------------------------------------------------------- models file

FIELDS = ("name", "path", "decoder", "preset", "knobs", "chat_template_args", "base")


def load_models_file(path: str | Path) -> list[ModelSpec]:
    """The models of a TOML models file (module docstring), checked field by field; InputError naming the
    file, the model and the field."""
    p = Path(path).expanduser()
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise InputError(f"--models-file {str(path)!r}: cannot be read ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"--models-file {str(path)!r}: not valid TOML ({e})") from None
    extra = [k for k in data if k != "models"]
    if extra:
        raise InputError(f"{p}: unknown top-level key {extra[0]!r}{did_you_mean(extra[0], ['models'])} "
                         "(the file holds [[models]] tables only)")
    entries = data.get("models")
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise InputError(f"{p}: expected one [[models]] table per model")
    return check_names([_entry(p, i, e) for i, e in enumerate(entries, 1)])


def _entry(p: Path, i: int, e: dict) -> ModelSpec:
    name = e.get("name")
    who = f"{p}, model {name!r}" if isinstance(name, str) else f"{p}, model {i}"
    for key in e:
        if key not in FIELDS:
            raise InputError(f"{who}: unknown field {key!r}{did_you_mean(key, FIELDS)} (fields: {', '.join(FIELDS)})")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InputError(f"{who}: field 'name' must be a name of letters, digits, '_', '.', '-'")
    for key in ("path", "decoder", "preset", "base"):
        if key in e and not (isinstance(e[key], str) and e[key].strip()):
            raise InputError(f"{who}: field {key!r} must be a non-empty string, got {e[key]!r}")
    if "preset" in e:
        if "path" in e or "decoder" in e:
            raise InputError(f"{who}: give either 'preset' or 'path' and 'decoder', not both")
        if e["preset"] not in PRESETS:
            raise InputError(f"{who}: field 'preset': " + unknown("preset", e["preset"], PRESETS))
        spec = PRESETS[e["preset"]]
    else:
        missing = [k for k in ("path", "decoder") if k not in e]
        if missing:
            raise InputError(f"{who}: field {missing[0]!r} is missing (or give 'preset')")
        from refusion.decoding import DECODERS

        decoder, engine = _engine_of(e["decoder"], f"{who}: field 'decoder'")
        if decoder not in DECODERS:
            raise InputError(f"{who}: field 'decoder': " + unknown("decoder", decoder, DECODERS))
        spec = ModelSpec(name, _file_path(p, e["path"]), decoder, engine=engine)
    knobs = dict(spec.knobs)
    own = e.get("knobs", {})
    if not isinstance(own, dict):
        raise InputError(f"{who}: field 'knobs' must be a table (knobs = {{ name = value, ... }})")
    for k, v in own.items():
        if k in (*LOAD_OPTIONS, TEMPLATE_OPTION):
            raise InputError(f"{who}: knobs.{k}: give {k!r} as a field of the model, not a knob")
        if not isinstance(v, (bool, int, float, str)):
            raise InputError(f"{who}: knobs.{k} must be a number, true/false or a string, got {v!r}")
        knobs[k] = v
    if "chat_template_args" in e:
        args = e["chat_template_args"]
        if not isinstance(args, dict):
            raise InputError(f"{who}: field 'chat_template_args' must be a table (e.g. {{ enable_thinking = false }})")
        knobs[TEMPLATE_OPTION] = {k: check_template_value(k, v, f"{who}: chat_template_args")
                                  for k, v in args.items()}
    if "base" in e:
        knobs["base"] = _file_path(p, e["base"])
    return replace(spec, name=name, knobs=knobs)


def _file_path(models_file: Path, value: str) -> str:
    """A folder named in the models file: ``~`` expanded, a relative one taken from the file's folder."""
    q = Path(value).expanduser()
    return str(q if q.is_absolute() else (models_file.parent / q).absolute())
