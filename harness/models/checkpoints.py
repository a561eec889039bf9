"""Checkpoint folders as published: checked completely before any model runs, then loaded onto a stock
``transformers`` class by the family table (harness/models/families.py), with no remote code (a family
transformers lacks, LLaDA2, loads onto this project's class: ``model_class``).

    info = inspect_checkpoint("/ckpt/LLaDA-8B-Instruct")          # reads headers only; CheckpointError
    loaded = load_model("/ckpt/LLaDA-8B-Instruct", dtype="bfloat16")
    loaded.model, loaded.tokenizer, loaded.family, loaded.mask_id, loaded.eos_ids

A PEFT LoRA adapter folder (``adapter_config.json``, as the D2F releases) is checked and loaded with its
base: ``base=DIR``, else the adapter's ``base_model_name_or_path`` when it is a local folder, else a
folder of the same name beside the adapter (``/ckpt/LLaDA-8B-Instruct`` next to
``/ckpt/D2F_LLaDA_Instruct_8B_Lora``). The LoRA is merged into the base weights with ``peft``.

``inspect_checkpoint`` is what the runner calls for every model before the first sample: config and
family, tokenizer files, every weight file (safetensors headers, shard index, truncation) and the
tensor names against the class the family maps to (built on the meta device: no memory, no time),
and for an adapter its files and its base, recursively.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.models.families import Family, family_of, model_is_causal

DTYPES = ("auto", "bfloat16", "float16", "float32")
ADAPTER_CONFIG = "adapter_config.json"
INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint folder that does not exist, is incomplete or cannot be loaded (one line)."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    family: Family
    causal: bool
    config: dict                      # the published config.json
    base: CheckpointInfo | None = None  # for a LoRA adapter: its base model
    adapter: dict | None = None       # adapter_config.json
    warnings: tuple[str, ...] = ()    # what may be wrong but cannot be told from the files (a base's name)


@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    info: CheckpointInfo
    mask_id: int | None
    eos_ids: tuple[int, ...]

    @property
    def family(self) -> Family:
        return self.info.family


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto``: bfloat16 on CUDA (as the paper's figures), float32 on the CPU."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "auto":
        return "bfloat16" if str(device).startswith("cuda") else "float32"
    return dtype


# ---------------------------------------------------------------- checks (headers only)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise CheckpointError(f"{str(path)!r} cannot be read: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{str(path)!r} is not a JSON object")
    return data


def clip_middle(text: str, limit: int = 300) -> str:
    """``text`` on one line, at most ``limit`` characters, cut in the middle: the start says what failed
    and the end usually names the file (a tokenizer error ends with the missing file's path)."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    keep = (limit - 5) // 2
    return f"{text[:keep]} ... {text[-keep:]}"


def safetensors_names(path: Path) -> list[str]:
    """The tensor names of a safetensors file, read from its header (see ``safetensors_shapes``)."""
    return list(safetensors_shapes(path))


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a safetensors file, read from its header; CheckpointError naming the file when
    the header is unreadable or the data is cut short (a copy that stopped half-way)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            # safetensors caps the header at 100 MB; a bigger length means the first bytes are not a header.
            header = json.loads(f.read(n)) if 0 < n <= min(size - 8, 100_000_000) else None
    except OSError as e:
        raise CheckpointError(f"checkpoint file {str(path)!r} cannot be read: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict):
        raise CheckpointError(f"checkpoint file {str(path)!r} cannot be read: truncated or corrupt "
                              f"(no valid safetensors header in its {size} bytes)")
    end = max((int(t["data_offsets"][1]) for k, t in header.items()
               if k != "__metadata__" and isinstance(t, dict) and "data_offsets" in t), default=0)
    if size < 8 + n + end:
        raise CheckpointError(f"checkpoint file {str(path)!r} cannot be read: truncated ({size} bytes, "
                              f"its header needs {8 + n + end})")
    return {k: tuple(int(x) for x in t.get("shape", ())) for k, t in header.items()
            if k != "__metadata__" and isinstance(t, dict)}


def _weight_names(p: Path) -> list[str]:
    """Every tensor name of the folder's weights (index and shards checked); CheckpointError if none."""
    index = p / INDEX
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{str(index)!r} has no weight_map")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (p / s).is_file()]
        if missing:
            raise CheckpointError(f"{str(index)!r} lists shard(s) that are not in the folder: {', '.join(missing)}")
        names = []
        for s in shards:
            got = set(safetensors_names(p / s))
            want = {k for k, v in weight_map.items() if v == s}
            if want - got:
                raise CheckpointError(f"shard {str(p / s)!r} lacks {len(want - got)} tensor(s) its index names, "
                                      f"e.g. {sorted(want - got)[0]!r}")
            names += sorted(got)
        return names
    files = sorted(p.glob("*.safetensors"))
    if not files:
        bins = sorted(p.glob("pytorch_model*.bin"))
        if bins:
            raise CheckpointError(f"checkpoint directory {str(p)!r} has only PyTorch .bin weights; "
                                  "convert them to safetensors (this harness loads no pickles)")
        raise CheckpointError(f"checkpoint directory {str(p)!r} has no weights (no *.safetensors)")
    return [n for f in files for n in safetensors_names(f)]


def model_class(fam: Family):
    """The class a family's weights load onto: a transformers class by name, or ``module:Class`` for one written
    in this project (LLaDA2's refusion/llada2_moe.py); never a class from the checkpoint folder."""
    import importlib

    import transformers

    if ":" in fam.model_class:
        module, name = fam.model_class.split(":")
        return getattr(importlib.import_module(module), name)
    return getattr(transformers, fam.model_class)


def _meta_model(fam: Family, cfg):
    """The family's class for ``cfg``, built on the meta device (no memory)."""
    import torch

    cls = model_class(fam)
    with torch.device("meta"):
        return cls(cfg)


def _meta_shapes(fam: Family, cfg) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the family's class for ``cfg``, built on the meta device (no memory)."""
    return {k: tuple(v.shape) for k, v in _meta_model(fam, cfg).state_dict().items()}


def _expected_names(fam: Family, cfg) -> tuple[set[str], set[str]]:
    """(parameter names, names that may be absent) of the family's class for ``cfg``, built on the meta device:
    a tied weight may be stored once under the name it is tied to (the model's ``all_tied_weights_keys``, e.g.
    DiffusionGemma's encoder layers tied to its decoder's)."""
    model = _meta_model(fam, cfg)
    names = set(model.state_dict())
    optional = {"lm_head.weight"} if getattr(cfg, "tie_word_embeddings", False) else set()
    optional |= {n for n in names if n.endswith("rotary_emb.inv_freq")}
    optional |= set(getattr(model, "all_tied_weights_keys", None) or {})
    return names, optional


def _fused_name(name: str, model_type: str) -> str:
    """The name a stored tensor has in a class whose tensors transformers fuses on loading, by the class's own
    checkpoint conversion mapping (``from_pretrained`` applies it): a Qwen3-MoE release's per-expert
    ``mlp.experts.N.gate_proj.weight`` is ``mlp.experts.gate_up_proj`` of the stock class (the sdar_moe family)."""
    from transformers.conversion_mapping import WeightConverter, get_checkpoint_conversion_mapping

    for conv in get_checkpoint_conversion_mapping(model_type) or ():
        if not isinstance(conv, WeightConverter):
            continue
        targets = conv.target_patterns if isinstance(conv.target_patterns, list) else [conv.target_patterns]
        sources = conv.source_patterns if isinstance(conv.source_patterns, list) else [conv.source_patterns]
        if len(targets) != 1 or not all("*" in src for src in sources):
            continue
        for src in sources:
            new, n = re.subn(re.escape(src).replace(r"\*", r"\d+"), targets[0], name)
            if n:
                return new
    return name


def _map_name(name: str, mapping) -> str:
    for pattern, repl in mapping.items():
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    return name


def build_config(fam: Family, raw: dict):
    """The stock transformers config of ``fam`` for a published config.json (attention fixed here)."""
    cls = model_class(fam)
    cfg = cls.config_class(**(fam.to_config(raw) if fam.to_config else raw))
    if not getattr(cfg, "sub_configs", None):  # a composite config (DiffusionGemma) sets attention per part itself
        cfg.is_causal = model_is_causal(fam, raw)
    if raw.get("mask_token_id") is not None:
        cfg.mask_token_id = int(raw["mask_token_id"])
    cfg.architectures = [cls.__name__]
    return cfg


def _tokenizer_files(p: Path) -> None:
    if not any((p / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                                           "vocab.json")):
        raise CheckpointError(f"checkpoint directory {str(p)!r} has no tokenizer files")


def inspect_checkpoint(path: str | os.PathLike, base: str | os.PathLike | None = None,
                       _seen: tuple[Path, ...] = ()) -> CheckpointInfo:
    """Everything about a folder that can go wrong before its weights are read (see the module doc)."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise CheckpointError(f"checkpoint directory {str(p)!r} does not exist")
    if (p / ADAPTER_CONFIG).is_file():
        return _inspect_adapter(p, base, _seen)
    if not (p / "config.json").is_file():
        raise CheckpointError(f"checkpoint directory {str(p)!r} has no config.json (nor {ADAPTER_CONFIG})")
    raw = _read_json(p / "config.json")
    try:
        fam = family_of(raw)
        cfg = build_config(fam, raw)
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{str(p / 'config.json')!r}: {e}") from None
    _tokenizer_files(p)
    names = _weight_names(p)
    want, optional = _expected_names(fam, cfg)
    model_type = getattr(cfg, "model_type", "")
    have = {_fused_name(_map_name(n, fam.key_mapping), model_type) for n in names}
    missing, extra = sorted(want - have - optional), sorted(have - want)
    if missing or extra:
        what = (f"lacks {len(missing)} tensor(s) of {fam.model_class}, e.g. {missing[0]!r}" if missing
                else f"has {len(extra)} tensor(s) {fam.model_class} does not take, e.g. {extra[0]!r}")
        raise CheckpointError(f"weights of {str(p)!r} ({fam.name} family) {what}")
    return CheckpointInfo(p.resolve(), fam, model_is_causal(fam, raw), raw)


def _base_candidates(p: Path, adapter: dict, base: str | os.PathLike | None) -> list[Path]:
    if base is not None:
        return [Path(base).expanduser()]
    name = str(adapter.get("base_model_name_or_path") or "")
    if not name:
        return []
    given = Path(name).expanduser()
    return [given if given.is_absolute() else p / given, p.parent / given.name]


def _inspect_adapter(p: Path, base, seen: tuple[Path, ...]) -> CheckpointInfo:
    adapter = _read_json(p / ADAPTER_CONFIG)
    if str(adapter.get("peft_type", "")).upper() != "LORA":
        raise CheckpointError(f"{str(p / ADAPTER_CONFIG)!r}: peft_type {adapter.get('peft_type')!r} is not "
                              "supported (LoRA adapters only)")
    weights = p / "adapter_model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"adapter {str(p)!r} has no adapter_model.safetensors")
    safetensors_names(weights)
    found = next((c for c in _base_candidates(p, adapter, base) if c.is_dir()), None)
    if found is None:
        said = f"base={base}" if base is not None else \
            f"base_model_name_or_path {adapter.get('base_model_name_or_path')!r} in {ADAPTER_CONFIG}"
        raise CheckpointError(f"adapter {str(p)!r}: its base model ({said}) is not a local folder; download it "
                              "and give its folder with the knob base=DIR (or put it beside the adapter)")
    if found.resolve() in seen or found.resolve() == p.resolve():
        raise CheckpointError(f"adapter {str(p)!r}: its base {str(found)!r} is an adapter of itself")
    base_info = inspect_checkpoint(found, _seen=(*seen, p.resolve()))
    if base_info.adapter is not None:
        raise CheckpointError(f"adapter {str(p)!r}: its base {str(found)!r} is itself an adapter")
    check_adapter_fits(p, adapter, safetensors_shapes(weights), base_info)
    return CheckpointInfo(p.resolve(), base_info.family, base_info.causal, base_info.config, base_info, adapter,
                          (*base_info.warnings, *_base_name_warning(p, adapter, found)))


# A LoRA tensor's name: the module path, then lora_A / lora_B (optionally .<adapter name>) .weight, or an
# embedding's lora_embedding_A / _B.
LORA_TENSOR = re.compile(r"(.*)\.(lora_[AB](?:\.[^.]+)?\.weight|lora_embedding_[AB](?:\.[^.]+)?)$")
LORA_PREFIX = "base_model.model."


def _lora_module(name: str, fam: Family) -> tuple[str, str] | None:
    """(the base weight a LoRA tensor adapts, in the family's class names; lora_A / lora_B / ...) or None."""
    inner = name[len(LORA_PREFIX):] if name.startswith(LORA_PREFIX) else name
    m = LORA_TENSOR.match(inner)
    if not m:
        return None
    return _map_name(m.group(1) + ".weight", fam.key_mapping), m.group(2).split(".")[0]


def check_adapter_fits(p: Path, adapter: dict, shapes: dict[str, tuple[int, ...]], base: CheckpointInfo) -> None:
    """CheckpointError unless every LoRA tensor of the adapter adapts a weight the base has, with its input
    (lora_A) and output (lora_B) sizes, and every target module of adapter_config.json is a module of the
    base: a D2F adapter given another model as its base fails here, before anything is written, instead of
    with peft's ``size mismatch`` after the run started. Shapes only: the meta device, headers."""
    fam = base.family
    have = _meta_shapes(fam, build_config(fam, base.config))
    where = f"adapter {str(p)!r} does not fit its base {str(base.path)!r} ({fam.name} family)"
    for name, shape in shapes.items():
        hit = _lora_module(name, fam)
        if hit is None:
            continue
        weight, kind = hit
        if weight not in have:
            raise CheckpointError(f"{where}: LoRA tensor {name!r} adapts {weight!r}, which the base has not "
                                  "(an adapter of another model family?)")
        want = have[weight]
        if len(shape) == 2 and len(want) == 2 and (
                (kind == "lora_A" and shape[1] != want[1]) or (kind == "lora_B" and shape[0] != want[0])):
            raise CheckpointError(f"{where}: LoRA tensor {name!r} has shape {list(shape)}, but the base's {weight!r} "
                                  f"is {list(want)} (an adapter trained on another base model?)")
    targets = adapter.get("target_modules")
    if isinstance(targets, list):
        renames = dict(fam.module_renames)
        modules = {k.rsplit(".", 1)[0] for k in have}
        absent = [t for t in targets if not any(mp == renames.get(t, t) or mp.endswith("." + renames.get(t, t))
                                                for mp in modules)]
        if absent:
            raise CheckpointError(f"{where}: target_modules {absent} of {ADAPTER_CONFIG} are no modules of the base")


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _names_along_links(path: Path) -> list[str]:
    """The folder's names: as given, each symlink's target on the way (a Hugging Face cache snapshot, a copy
    under another name), and the resolved one. A base reached through a link named like the model it is
    counts as named so."""
    names, p, seen = [], Path(path).absolute(), set()
    while p not in seen:
        seen.add(p)
        names.append(p.name)
        if not p.is_symlink():
            break
        p = (p.parent / os.readlink(p)).absolute()
    return [*names, p.resolve().name]


def _base_name_warning(p: Path, adapter: dict, found: Path) -> tuple[str, ...]:
    """A warning when the base folder's name is not the model the adapter names (Dream-v0-Instruct-7B given
    for Dream-v0-Base-7B has the same shapes and merges without complaint, but is not what D2F trained on)."""
    declared = str(adapter.get("base_model_name_or_path") or "")
    if not declared or _norm(Path(declared).name) in {_norm(n) for n in _names_along_links(found)}:
        return ()
    return (f"adapter {str(p)!r} names its base {declared!r} in {ADAPTER_CONFIG}, but the base used is "
            f"{str(found)!r}; check it is that model (same shapes do not prove it)",)


# ---------------------------------------------------------------- loading


def _torch_dtype(dtype: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def load_tokenizer(info: CheckpointInfo):
    import transformers

    folder = info.base.path if info.base is not None and not _has_tokenizer(info.path) else info.path
    fam = info.family
    if fam.tokenizer_class:  # the release names a remote-code class (Dream): its stock equivalent instead
        return getattr(transformers, fam.tokenizer_class).from_pretrained(str(folder))
    # The stock config, so that AutoTokenizer neither reads the published one (an unknown model_type) nor
    # asks about remote code; never trust it.
    return transformers.AutoTokenizer.from_pretrained(str(folder), config=build_config(fam, info.config),
                                                      trust_remote_code=False)


def check_tokenizer(info: CheckpointInfo) -> None:
    """Load the tokenizer once (seconds at most): a broken tokenizer file stops the run before it starts."""
    try:
        load_tokenizer(info)
    except Exception as e:  # noqa: BLE001 - whatever the tokenizer library raises, one line naming the folder
        raise CheckpointError(f"the tokenizer of {str(info.path)!r} does not load: "
                              f"{type(e).__name__}: {clip_middle(str(e))}") from None


def _has_tokenizer(p: Path) -> bool:
    return any((p / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))


def _load_weights(info: CheckpointInfo, device: str, dtype: str):
    fam = info.family
    cls = model_class(fam)
    cfg = build_config(fam, info.config)
    kw: dict[str, Any] = {"config": cfg, "dtype": _torch_dtype(dtype)}
    if fam.key_mapping:
        kw["key_mapping"] = dict(fam.key_mapping)
    model = cls.from_pretrained(str(info.path), **kw)
    return model.to(device)


def merge_lora(model, info: CheckpointInfo):
    """The adapter's LoRA merged into ``model`` (the base) with peft; published module names mapped by the
    family table (LLaDA's attn_out -> o_proj ...)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    fam, adapter = info.family, dict(info.adapter or {})
    renames = dict(fam.module_renames)
    targets = adapter.get("target_modules")
    if isinstance(targets, list):
        adapter["target_modules"] = [renames.get(t, t) for t in targets]
    keep = set(LoraConfig.__dataclass_fields__)
    config = LoraConfig(**{k: v for k, v in adapter.items() if k in keep and k not in ("base_model_name_or_path",
                                                                                       "revision")})
    state = load_file(str(info.path / "adapter_model.safetensors"))
    prefix = LORA_PREFIX
    mapped = {}
    for k, v in state.items():
        inner = k[len(prefix):] if k.startswith(prefix) else k
        # The family's key mapping works on weight names: map the module path of the LoRA tensor.
        m = LORA_TENSOR.match(inner)
        if m:
            inner = _map_name(m.group(1) + ".weight", fam.key_mapping)[: -len(".weight")] + "." + m.group(2)
        mapped[prefix + inner] = v
    peft_model = get_peft_model(model, config)
    result = set_peft_model_state_dict(peft_model, mapped)
    unexpected = getattr(result, "unexpected_keys", None) or []
    if unexpected:
        raise CheckpointError(f"adapter {str(info.path)!r}: {len(unexpected)} LoRA tensor(s) match no module of "
                              f"the base, e.g. {unexpected[0]!r}")
    lora_missing = [k for k in (getattr(result, "missing_keys", None) or []) if "lora_" in k]
    if lora_missing:
        raise CheckpointError(f"adapter {str(info.path)!r}: no tensor for {len(lora_missing)} LoRA module(s), "
                              f"e.g. {lora_missing[0]!r}")
    return peft_model.merge_and_unload()


def special_ids(model, tokenizer, fam: Family) -> tuple[int | None, tuple[int, ...]]:
    """(mask id, EOS ids): the folder's own (config, generation config, tokenizer), else the family table's."""
    cfg = model.config
    text = cfg.get_text_config()  # the config itself, or an encoder-decoder's text config (DiffusionGemma)
    mask = getattr(cfg, "mask_token_id", None)
    if mask is None and fam.mask_token:
        tid = tokenizer.convert_tokens_to_ids(fam.mask_token)
        mask = tid if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None else None
    if mask is None:
        tok_mask = getattr(tokenizer, "mask_token_id", None)
        mask = tok_mask if tok_mask is not None else (fam.mask_id if fam.mask_id is not None and
                                                      fam.mask_id < text.vocab_size else None)
    eos: list[int] = []
    # The union: a chat turn may end with another id than the config's EOS (Llama-3's <|eot_id|>, Dream's
    # <|im_end|>, LLaDA's <|eot_id|>); the family's released ids count where the vocabulary has them.
    for src in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                getattr(text, "eos_token_id", None), tokenizer.eos_token_id,
                [i for i in fam.eos_ids if i < text.vocab_size]):
        for i in ([src] if isinstance(src, int) else list(src or [])):
            if int(i) not in eos:
                eos.append(int(i))
    return (None if mask is None else int(mask)), tuple(eos)


def load_model(path: str | os.PathLike, *, device: str = "cpu", dtype: str = "float32",
               base: str | os.PathLike | None = None, info: CheckpointInfo | None = None) -> Loaded:
    """Check, then load a folder (or adapter + base) in eval mode; see the module doc."""
    info = info or inspect_checkpoint(path, base)
    dtype = resolve_dtype(dtype, device)
    target = info.base if info.base is not None else info
    try:
        model = _load_weights(target, device, dtype)
        if info.adapter is not None:
            model = merge_lora(model, info)
        tokenizer = load_tokenizer(info)
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"cannot load checkpoint {str(info.path)!r}: {clip_middle(str(e), 400)}") from e
    mask, eos = special_ids(model, tokenizer, info.family)
    if mask is not None:
        model.config.mask_token_id = mask  # the decoders read it from the config (refusion/decoding/common.py)
    model.generation_config.eos_token_id = list(eos)
    return Loaded(model.eval(), tokenizer, info, mask, eos)
