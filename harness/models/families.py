"""The model families the harness loads, in one table: how a released checkpoint folder maps onto a
``transformers`` class without its authors' remote code, and the facts the decoders need.

A folder's family is recognised from its ``config.json`` (``model_type``, and ``auto_map`` to tell
ReFusion from a plain Qwen3). Loading (harness/models/checkpoints.py) then builds the family's stock
``transformers`` config (or, for LLaDA2, that of this project's refusion/llada2_moe.py, named ``module:Class``)
from the published one (``to_config``) and loads the weights under the
published tensor names through ``from_pretrained(key_mapping=...)``: nothing is converted on disk.

Every fact carries its source (the authors' public code, the release's own config files); the
file:line sources gathered when the test fixtures were made are in scripts/release_facts.json. Ids in a
folder's own ``config.json`` / ``generation_config.json`` / tokenizer win over the table (a fine-tune
or a test fixture may use others); the table's ids are what the releases ship, and the fallback when
a release leaves one out (ReFusion's ``<|mask|>`` is an added special token, not the tokenizer's
mask token, and the config may lack ``mask_token_id``).

Attention: ``causal`` None means "read ``config.is_causal``" (the tiny checkpoints of this project
say it in their config); True / False is fixed by the family (LLaDA and Dream are bidirectional
whatever their config says, as their modelling code ignores any causal flag).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class Family:
    name: str
    model_class: str                 # the transformers class that runs the weights ("module:Class": this project's)
    causal: bool | None              # None: config.is_causal decides (default causal)
    logit_shift: bool = False        # the logit at i-1 predicts a masked token at i (Dream)
    mask_token: str | None = None    # the mask token's text, looked up in the tokenizer
    mask_id: int | None = None       # the released mask id (fallback when config and tokenizer lack it)
    eos_ids: tuple[int, ...] = ()    # the released EOS / end-of-turn ids (fallback)
    tokenizer_class: str | None = None  # load the tokenizer with this class (AutoTokenizer would need remote code)
    # regex on the published tensor names -> the transformers class's names (from_pretrained(key_mapping=))
    key_mapping: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    # LoRA target module names of the published adapters -> the transformers class's module names
    module_renames: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    to_config: Callable[[dict], dict] | None = None  # published config.json -> kwargs of model_class's config
    notes: str = ""
    sources: tuple[str, ...] = ()


def _llada_config(raw: dict) -> dict:
    """LLaDA's OLMo-style config.json -> LlamaConfig kwargs (names from LLaDA's configuration_llada.py)."""
    if raw.get("include_bias") or raw.get("include_qkv_bias"):
        raise ValueError("LLaDA checkpoints with attention biases do not map onto Llama (the releases have none)")
    if raw.get("attention_layer_norm") or raw.get("input_emb_norm") or raw.get("scale_logits"):
        raise ValueError("LLaDA options attention_layer_norm / input_emb_norm / scale_logits are not supported "
                         "(the releases leave them off)")
    heads = raw["n_heads"]
    kv = raw.get("n_kv_heads") or heads
    hidden = raw.get("mlp_hidden_size") or raw.get("mlp_ratio", 4) * raw["d_model"]
    return dict(
        vocab_size=raw.get("embedding_size") or raw["vocab_size"], hidden_size=raw["d_model"],
        intermediate_size=hidden, num_hidden_layers=raw["n_layers"], num_attention_heads=heads,
        num_key_value_heads=kv, max_position_embeddings=raw.get("max_sequence_length", 4096),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5), rope_theta=raw.get("rope_theta", 10000.0),
        tie_word_embeddings=bool(raw.get("weight_tying", False)), attention_bias=False, mlp_bias=False,
        hidden_act="silu", bos_token_id=raw.get("bos_token_id"), eos_token_id=raw.get("eos_token_id"),
        pad_token_id=raw.get("pad_token_id"), mask_token_id=raw.get("mask_token_id"))


def plain_config(raw: dict) -> dict:
    """A config.json whose fields are already the model class's config kwargs (stock Qwen3 / Qwen2 /
    Llama, Dream's Qwen2 with model_type "Dream" per its configuration_dream.py, a family added by
    docs/extending.md): everything but the fields that name the class or the file's writer."""
    drop = {"model_type", "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype"}
    return {k: v for k, v in raw.items() if k not in drop}


def _sdar_config(raw: dict) -> dict:
    """SDAR's config.json (its configuration_sdar.py: Qwen3Config's fields plus training switches) -> Qwen3Config
    (or Qwen3MoeConfig) kwargs: the fields that only its training code reads are left out, and so is
    ``attn_implementation`` ("flex_attention", the training kernel; inference here uses the harness's own)."""
    training = {"attn_implementation", "debug", "ep_size", "fuse_cross_entropy", "micro_forward", "skip_checkpoint",
                "use_deepep"}
    return {k: v for k, v in plain_config(raw).items() if k not in training}


_SDAR_NOTES = ("Qwen3 continued-trained for block diffusion: the weights and tensor names are Qwen3's (q_norm / "
               "k_norm, no qkv bias); attention is block-causal (a block sees itself and every earlier block), which the "
               "decoder sdar builds as an explicit mask (so the family is causal for the guard); config.json's "
               "block_size is the trained block length (4 by default); <|MASK|> 151669 is an added special token and "
               "the tokenizer's mask token; EOS <|endoftext|> 151643 and <|im_end|> 151645 (generation_config.json)")
_LLADA = r"^model\.transformer\."
FAMILIES: dict[str, Family] = {
    "llada": Family(
        name="llada", model_class="LlamaForCausalLM", causal=False, mask_token="<|mdm_mask|>", mask_id=126336,
        eos_ids=(126081, 126348), to_config=_llada_config,
        key_mapping=MappingProxyType({
            _LLADA + r"wte\.": "model.embed_tokens.",
            _LLADA + r"blocks\.(\d+)\.attn_norm\.": r"model.layers.\1.input_layernorm.",
            _LLADA + r"blocks\.(\d+)\.ff_norm\.": r"model.layers.\1.post_attention_layernorm.",
            _LLADA + r"blocks\.(\d+)\.q_proj\.": r"model.layers.\1.self_attn.q_proj.",
            _LLADA + r"blocks\.(\d+)\.k_proj\.": r"model.layers.\1.self_attn.k_proj.",
            _LLADA + r"blocks\.(\d+)\.v_proj\.": r"model.layers.\1.self_attn.v_proj.",
            _LLADA + r"blocks\.(\d+)\.attn_out\.": r"model.layers.\1.self_attn.o_proj.",
            _LLADA + r"blocks\.(\d+)\.ff_proj\.": r"model.layers.\1.mlp.gate_proj.",
            _LLADA + r"blocks\.(\d+)\.up_proj\.": r"model.layers.\1.mlp.up_proj.",
            _LLADA + r"blocks\.(\d+)\.ff_out\.": r"model.layers.\1.mlp.down_proj.",
            _LLADA + r"ln_f\.": "model.norm.",
            _LLADA + r"ff_out\.": "lm_head.",
        }),
        module_renames=MappingProxyType({"attn_out": "o_proj", "ff_proj": "gate_proj", "ff_out": "down_proj"}),
        notes="OLMo-style LLaDAModelLM; bidirectional; rotate-half RoPE as Llama's, theta 500000; no GQA; "
              "untied output layer; EOS/pad 126081 (<|eot_id|> 126348 ends a chat turn)",
        sources=("GSAI-ML/LLaDA-8B-Instruct config.json, modeling_llada.py (LLaDALlamaBlock: act(ff_proj(x)) * "
                 "up_proj(x) -> ff_out)", "ML-GSAI/LLaDA generate.py (mask_id=126336)")),
    "dream": Family(
        name="dream", model_class="Qwen2ForCausalLM", causal=False, logit_shift=True, mask_token="<|mask|>",
        mask_id=151666, eos_ids=(151643, 151645), tokenizer_class="Qwen2Tokenizer", to_config=plain_config,
        notes="DreamModel = Qwen2.5 with bidirectional attention; tensor names as Qwen2ForCausalLM (qkv bias); "
              "the model's logits are unshifted and the sampler shifts them (the logit at i-1 predicts i); "
              "the tokenizer is a Qwen2 BPE behind a remote-code DreamTokenizer class",
        sources=("Dream-org/Dream-v0-Instruct-7B config.json, modeling_dream.py, generation_utils.py "
                 "(logits = torch.cat([logits[:, :1], logits[:, :-1]], 1))",)),
    "refusion": Family(
        name="refusion", model_class="Qwen3ForCausalLM", causal=True, mask_token="<|mask|>", mask_id=151670,
        eos_ids=(151645,), to_config=plain_config,
        notes="Qwen3-8B fine-tuned; modeling_qwen3_refusion.py adds only training code (no weights); "
              "<|beginoftext|> 151669 and <|mask|> 151670 are added special tokens (vocab 151671); "
              "the tokenizer is saved slow (vocab.json + merges.txt)",
        sources=("ML-GSAI/ReFusion qwen3/modeling_qwen3_refusion.py, generate.py (mask_id=151670)",)),
    "sdar": Family(
        name="sdar", model_class="Qwen3ForCausalLM", causal=True, mask_token="<|MASK|>", mask_id=151669,
        eos_ids=(151643, 151645), to_config=_sdar_config, notes=_SDAR_NOTES,
        sources=("JetAstra/SDAR training/model/SDAR-8B-Chat/ config.json, modeling_sdar.py (SDARAttention = Qwen3's "
                 "with store_kv), tokenizer_config.json (mask_token <|MASK|>), generation_config.json",
                 "JetAstra/SDAR generate.py (block_diffusion_generate)")),
    "sdar_moe": Family(
        name="sdar_moe", model_class="Qwen3MoeForCausalLM", causal=True, mask_token="<|MASK|>", mask_id=151669,
        eos_ids=(151643, 151645), to_config=_sdar_config,
        notes=_SDAR_NOTES.replace("Qwen3 continued", "Qwen3-30B-A3B (MoE) continued") + "; Qwen3-MoE's per-expert "
              "tensor names (mlp.gate, mlp.experts.N.gate/up/down_proj), fused by transformers' own conversion on "
              "loading",
        sources=("JetAstra/SDAR README (SDAR-30B-A3B-Chat / -Sci from Qwen3-30B-A3B-Base); model_type sdar_moe and "
                 "architecture SDARMoeForCausalLM as the release names them (its modeling_sdar_moe.py is on the hub "
                 "only, not in the JetAstra/SDAR repository)",
                 "Labman42/JetEngine 11563d1 jetengine/models/sdar_moe.py (the inference engine for the SDAR "
                 "series): Qwen3-MoE's tensor names and rule (mlp.gate; mlp.experts.N.gate/up/down_proj; softmax "
                 "over the experts, top-k, renormalised; MoE every decoder_sparse_step layers)")),
    "qwen3": Family(name="qwen3", model_class="Qwen3ForCausalLM", causal=None, to_config=plain_config,
                    notes="stock Qwen3 (Qwen3-8B) and this project's tiny models (is_causal in config.json)",
                    sources=("transformers Qwen3Config",)),
    "qwen2": Family(name="qwen2", model_class="Qwen2ForCausalLM", causal=None, to_config=plain_config,
                    sources=("transformers Qwen2Config",)),
    "llama": Family(name="llama", model_class="LlamaForCausalLM", causal=None, to_config=plain_config,
                    notes="Llama-3-8B-Instruct: EOS <|end_of_text|> 128001 and <|eot_id|> 128009 "
                          "(generation_config.json)",
                    sources=("meta-llama/Meta-Llama-3-8B-Instruct generation_config.json",)),
    "diffusion_gemma": Family(
        name="diffusion_gemma", model_class="DiffusionGemmaForBlockDiffusion", causal=True, to_config=plain_config,
        notes="google/diffusiongemma-26B-A4B-it: transformers' own DiffusionGemmaForBlockDiffusion (no remote "
              "code); a causal encoder writes the KV cache, a bidirectional decoder denoises a canvas of random "
              "tokens against it (decoder diffusion_gemma only); no mask token; ids from config.json's text_config "
              "and generation_config.json (pad 0, eos 1, bos 2 by default); canvas_length in config.json",
        sources=("transformers 5.24.0 models/diffusion_gemma (configuration_diffusion_gemma.py, "
                 "generation_diffusion_gemma.py)",)),
    "llada2": Family(
        name="llada2", model_class="refusion.llada2_moe:LLaDA2MoeModelLM", causal=False, mask_token="<|mask|>",
        mask_id=156895, eos_ids=(156892,), to_config=plain_config,
        notes="inclusionAI/LLaDA2.0-mini (-flash): a MoE converted from an AR model, trained for block diffusion "
              "(block-causal attention, bidirectional within a block of 32); the class is this project's "
              "refusion/llada2_moe.py (published tensor names, no remote code: the folder's modeling_llada2_moe.py "
              "is never run); runs the decoder llada2 only; <|endoftext|> 156892 is EOS and padding, <|mask|> "
              "156895 the mask",
        sources=("inclusionAI/dInfer fce4e32 python/dinfer/model/modeling_llada2_moe.py, "
                 "configuration_llada2_moe.py; benchmarks/benchmark.py (mask_id = 156895, eos_id = 156892)",)),
}
# config.json model_type -> family (ReFusion is told apart from Qwen3 by its auto_map)
MODEL_TYPES = {"llada": "llada", "Dream": "dream", "dream": "dream", "qwen3": "qwen3", "qwen2": "qwen2",
               "llama": "llama", "diffusion_gemma": "diffusion_gemma", "llada2_moe": "llada2",
               "sdar": "sdar", "sdar_moe": "sdar_moe"}


def register_family(family: Family, model_types: tuple[str, ...]) -> Family:
    """Add ``family`` to FAMILIES and route each config.json ``model_type`` in ``model_types`` to it (ValueError
    when the name or a model_type is taken). In-tree, the same is one entry in each table above
    (docs/extending.md)."""
    taken = [t for t in model_types if t in MODEL_TYPES]
    if family.name in FAMILIES or taken or not model_types:
        raise ValueError(f"family {family.name!r}: name or model_type(s) {taken} already registered, or no "
                         f"model_type given; families: {', '.join(FAMILIES)}")
    FAMILIES[family.name] = family
    MODEL_TYPES.update({t: family.name for t in model_types})
    return family


def family_of(raw: dict[str, Any]) -> Family:
    """The family of a published config.json; ValueError naming the model_type when unknown (the caller
    names the file)."""
    mt = raw.get("model_type")
    if mt not in MODEL_TYPES:
        raise ValueError(f"model_type {mt!r} is not a family this harness loads; known: "
                         f"{', '.join(sorted(set(MODEL_TYPES)))} (add one: docs/extending.md)")
    fam = FAMILIES[MODEL_TYPES[mt]]
    auto = " ".join(str(v) for v in (raw.get("auto_map") or {}).values()).lower()
    if fam.name == "qwen3" and "refusion" in auto:
        fam = FAMILIES["refusion"]
    return fam


def model_is_causal(fam: Family, raw: dict[str, Any]) -> bool:
    """The attention the checkpoint was built for: the family's, else its config's is_causal (default True)."""
    return fam.causal if fam.causal is not None else bool(raw.get("is_causal", True))
