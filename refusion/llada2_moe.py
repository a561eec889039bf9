"""LLaDA2.x (inclusionAI LLaDA2.0-mini / -flash): the mixture-of-experts transformer, written here so that a
released folder loads without running the ``modeling_llada2_moe.py`` it ships (docs/models.md).

What the network computes, as the authors' dInfer code (python/dinfer/model/modeling_llada2_moe.py,
commit fce4e32) computes it; the module names are the published tensor names, so the released
safetensors load as they are:

  embed      ``model.word_embeddings``
  per layer  x + attention(rmsnorm(x)), then h + mlp(rmsnorm(h))
  attention  one fused projection ``query_key_value`` to H query, K key and K value heads of ``head_dim``;
             an RMS norm over each head's dims for queries and keys (``query_layernorm`` /
             ``key_layernorm``, always applied, as dInfer does); rotary embedding on the first
             ``head_dim * partial_rotary_factor`` dims of each head only (rotate-half pairs within that part,
             the rest passes through); grouped keys repeated to H heads; softmax(q k / sqrt(head_dim)) v under
             the mask the caller gives (none: every key); output projection ``dense``
  mlp        layers below ``first_k_dense_replace``: a SwiGLU (down(silu(gate x) * up x)) of
             ``intermediate_size``; the others a MoE block (below)
  head       rmsnorm, ``lm_head``, logits in float32

The MoE block: router logits = x W_gate in float32; scores = sigmoid(logits); the choice uses scores +
``expert_bias`` (a stored per-expert correction): the experts fall into ``n_group`` groups, a group is worth the
sum of its two best biased scores, the ``topk_group`` best groups stay eligible, and the ``num_experts_per_tok``
best biased scores among their experts are the token's experts. Their weights are the *unbiased* scores,
divided by their sum (+1e-20) when more than one expert is chosen, times ``routed_scaling_factor``. The output
is the weighted sum of the chosen experts' SwiGLUs (``moe_intermediate_size``) plus the shared expert, a SwiGLU
of ``moe_intermediate_size * num_shared_experts``.

The routed experts are computed as vLLM's own CPU path computes them (dInfer runs its MoE through vLLM's
``FusedMoE``; vllm/model_executor/layers/fused_moe/cpu_fused_moe.py, ``cpu_fused_moe_torch``): the (token, slot)
pairs ordered by expert, one matmul per expert over its tokens with the stacked [gate; up] weight, the SwiGLU, the
down matmul, each output back in its (token, slot) place, cast to float32, times its weight, summed over the
slots, cast back. The stacked weights are ``experts.gate_up_proj`` [E, 2I, hidden] and ``experts.down_proj``
[E, hidden, I]: the release's per-expert ``mlp.experts.N.{gate,up,down}_proj.weight`` are merged on loading by a
checkpoint conversion mapping registered with transformers for ``llada2_moe`` (as transformers does for its own
Qwen-MoE classes). Why this order and not another: a float32 sum's rounding depends on how the matmuls are cut,
and in this order the logits equal the authors' modelling file's bit for bit (tests/test_llada2.py). Under
torch.compile (the decoder knob ``compile``) the per-expert counts are unbacked sizes of the one graph
(refusion/decoding/compiled.py sets dynamo's ``capture_scalar_outputs``) and every expert's piece is computed, empty
or not.

The attention is whatever mask the caller passes: LLaDA2 is a block-diffusion model (block-causal attention,
bidirectional within a block of 32); the decoder ``llada2`` (refusion/decoding/llada2.py) builds that pattern.
``attention_mask``: None (every key), a 2-D padding mask [B, kv] (1 = real key; bidirectional), a bool
[B, 1, q, kv] (True = attend) or an additive float [B, 1, q, kv]. ``cache``: a transformers ``DynamicCache`` the
forward appends this call's keys and values to (the decoder crops it).

Router choices: each MoE block's ``gate`` is a module returning (expert ids [N, k], weights [N, k]), so a forward
hook on it reads the choices (tests/test_llada2.py compares them with the authors').
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.conversion_mapping import (USER_REGISTERED_MAPPINGS, WeightConverter,
                                             register_checkpoint_conversion_mapping)
from transformers.core_model_loading import Concatenate, MergeModulelist
from transformers.utils import ModelOutput

# The release stores each routed expert's three matrices (mlp.experts.N.gate_proj/up_proj/down_proj.weight);
# this module holds them stacked (Experts). transformers merges them while loading (module doc).
if "llada2_moe" not in USER_REGISTERED_MAPPINGS:
    register_checkpoint_conversion_mapping("llada2_moe", [
        WeightConverter(source_patterns=["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
                        target_patterns="mlp.experts.gate_up_proj",
                        operations=[MergeModulelist(dim=0), Concatenate(dim=1)]),
        WeightConverter(source_patterns="mlp.experts.*.down_proj.weight", target_patterns="mlp.experts.down_proj",
                        operations=[MergeModulelist(dim=0)]),
    ])


class LLaDA2MoeConfig(PretrainedConfig):
    """The published config.json's fields (names and defaults as the authors' configuration_llada2_moe.py)."""

    model_type = "llada2_moe"

    def __init__(self, vocab_size=30592, hidden_size=1024, intermediate_size=None, num_hidden_layers=24,
                 num_attention_heads=16, num_key_value_heads=0, hidden_act="silu", use_qkv_bias=False,
                 use_qk_norm=False, use_bias=True, rms_norm_eps=1e-05, norm_head=False, tie_word_embeddings=False,
                 embedding_dropout=0.1, attention_dropout=0.1, output_dropout=0.1, initializer_range=0.02,
                 max_position_embeddings=16384, rope_theta=10000.0, use_cache=True, rope_scaling=None,
                 pad_token_id=126081, num_experts=16, num_shared_experts=0, num_experts_per_tok=2, n_group=8,
                 topk_group=4, routed_scaling_factor=2.5, moe_intermediate_size=None, first_k_dense_replace=0,
                 head_dim=None, partial_rotary_factor=0.5, **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads, self.hidden_act = num_key_value_heads, hidden_act
        self.use_qkv_bias, self.use_qk_norm, self.use_bias = use_qkv_bias, use_qk_norm, use_bias
        self.rms_norm_eps, self.norm_head = rms_norm_eps, norm_head
        self.embedding_dropout, self.attention_dropout, self.output_dropout = (embedding_dropout, attention_dropout,
                                                                               output_dropout)
        self.initializer_range, self.max_position_embeddings = initializer_range, max_position_embeddings
        if rope_scaling is not None:  # the releases have none; dInfer's rotary would read a scaled type
            raise ValueError(f"rope_scaling {rope_scaling!r} is not supported (LLaDA2 releases have none)")
        self.rope_theta, self.use_cache = rope_theta, use_cache
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.num_experts, self.num_shared_experts = num_experts, num_shared_experts
        self.num_experts_per_tok, self.n_group, self.topk_group = num_experts_per_tok, n_group, topk_group
        self.routed_scaling_factor, self.moe_intermediate_size = routed_scaling_factor, moe_intermediate_size
        self.first_k_dense_replace, self.partial_rotary_factor = first_k_dense_replace, partial_rotary_factor
        super().__init__(pad_token_id=pad_token_id, tie_word_embeddings=tie_word_embeddings, **kwargs)


class RMSNorm(nn.Module):
    """x / rms(x) in float32, cast back, times the weight (in that order, as the authors' norm)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotary_tables(config: LLaDA2MoeConfig, positions: torch.Tensor, dtype: torch.dtype):
    """(cos, sin) [B, T, rot] for position ids [B, T]: rot = head_dim * partial_rotary_factor dims, frequencies
    theta^(-2i/rot), each frequency used for both halves of the rotated part (float32, then cast)."""
    rot = int(config.head_dim * config.partial_rotary_factor)
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.int64, device=positions.device).float()
                                       / rot))
    angles = positions[..., None].float() * inv  # [B, T, rot/2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of the first cos.shape[-1] dims of x [B, h, T, d]; the others unchanged."""
    rot = cos.shape[-1]
    part, rest = x[..., :rot], x[..., rot:]
    half = rot // 2
    turned = torch.cat([-part[..., half:], part[..., :half]], dim=-1)
    return torch.cat([part * cos[:, None] + turned * sin[:, None], rest], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: LLaDA2MoeConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                    config.head_dim)
        width = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.query_key_value = nn.Linear(config.hidden_size, width, bias=config.use_qkv_bias)
        self.query_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.key_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.dense = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=config.use_bias)

    def forward(self, x, cos, sin, mask, cache):
        b, t, _ = x.shape
        qkv = self.query_key_value(x).view(b, t, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = (p.transpose(1, 2) for p in qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=2))
        q, k = rotate(self.query_layernorm(q), cos, sin), rotate(self.key_layernorm(k), cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.dense(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class Router(nn.Module):
    """The expert choice (module doc): returns (expert ids [N, k], weights [N, k] float32) for x [N, hidden]."""

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        self.k, self.groups, self.keep_groups = config.num_experts_per_tok, config.n_group, config.topk_group
        self.scale = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))  # [N, E]
        biased = scores + self.expert_bias.float()
        n, experts = biased.shape
        per_group = biased.view(n, self.groups, experts // self.groups)
        group_worth = per_group.topk(2, dim=-1).values.sum(-1)  # [N, groups]
        best_groups = group_worth.topk(self.keep_groups, dim=-1).indices
        eligible = torch.zeros_like(group_worth, dtype=torch.bool).scatter_(1, best_groups, True)
        eligible = eligible[:, :, None].expand_as(per_group).reshape(n, experts)
        ids = biased.masked_fill(~eligible, float("-inf")).topk(self.k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * self.scale


class Experts(nn.Module):
    """The routed experts, stacked: gate_up_proj [E, 2I, hidden] ([gate; up] per expert), down_proj [E, hidden, I].
    forward(x [N, hidden], ids [N, k], weights [N, k] float32) -> [N, hidden] in vLLM's CPU order (module doc)."""

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n, k = ids.shape
        inner = self.down_proj.shape[-1]
        order = ids.reshape(-1).argsort()  # (token, slot) pairs, flattened, grouped by expert
        flat = ids.reshape(-1)
        # tokens per expert [E]: a static shape (bincount's length depends on the ids), read on the host; under
        # torch.compile (capture_scalar_outputs) the counts are unbacked sizes, nothing is guarded on them
        counts = torch.zeros(self.gate_up_proj.shape[0], dtype=torch.long, device=ids.device).index_add_(
            0, flat, torch.ones_like(flat)).tolist()
        rows = x[order // k]  # [N*k, hidden], expert 0's tokens first
        outs = []
        compiling = torch.compiler.is_compiling()
        for e, chunk in enumerate(torch.split(rows, counts)):  # chunk: [count_e, hidden]
            if compiling or counts[e]:  # eager: only the experts some token chose run (a graph cannot branch)
                gate_up = F.linear(chunk, self.gate_up_proj[e])  # [count, 2I]
                outs.append(F.linear(F.silu(gate_up[:, :inner]) * gate_up[:, inner:], self.down_proj[e]))
        placed = torch.empty_like(rows)
        placed[order] = torch.cat(outs)
        return (placed.view(n, k, -1).float() * weights[:, :, None]).sum(dim=1).to(x.dtype)


class MoE(nn.Module):
    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config)
        self.shared_experts = (SwiGLU(config.hidden_size, config.moe_intermediate_size * config.num_shared_experts)
                               if config.num_shared_experts else None)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, h.shape[-1])
        ids, weights = self.gate(x)
        out = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view_as(h)


class Layer(nn.Module):
    def __init__(self, config: LLaDA2MoeConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        dense = config.num_experts is None or layer < config.first_k_dense_replace
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size) if dense else MoE(config)

    def forward(self, x, cos, sin, mask, cache):
        x = x + self.attention(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


@dataclass
class LLaDA2Output(ModelOutput):
    logits: torch.Tensor | None = None


def _attention_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The caller's mask in the form SDPA takes (module doc)."""
    if mask is None or mask.dim() == 4:
        return mask if mask is None or mask.dtype == torch.bool else mask.to(dtype)
    if mask.dim() == 2:
        return mask.bool()[:, None, None, :]
    raise ValueError(f"attention_mask must be 2-D [B, kv] or 4-D [B, 1, q, kv], got {tuple(mask.shape)}")


class LLaDA2MoeModelLM(PreTrainedModel, GenerationMixin):
    """The released class's tensor layout (``model.*`` + ``lm_head``) with this module's forward. GenerationMixin
    only so that loading reads the folder's generation_config.json (its EOS ids); decoding is ``llada2``'s."""

    config_class = LLaDA2MoeConfig
    base_model_prefix = "model"
    _no_split_modules = ["Layer"]
    _supports_sdpa = True

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__(config)
        self.model = Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, Router):
            nn.init.normal_(module.weight, std=std)
            module.expert_bias.zero_()
        elif isinstance(module, Experts):
            nn.init.normal_(module.gate_up_proj, std=std)
            nn.init.normal_(module.down_proj, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def get_input_embeddings(self):
        return self.model.word_embeddings

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache=None, use_cache: bool = False,
                logits_to_keep: int | torch.Tensor = 0, **_: object) -> LLaDA2Output:
        """Logits [B, T, V] (float32) of input_ids [B, T] at ``position_ids`` [B, T] (default: after the cache);
        ``logits_to_keep`` as transformers takes it: the last n positions (0 = all), or those of an index tensor."""
        del use_cache  # the cache is written whenever one is given
        hidden = self.backbone(input_ids, position_ids, attention_mask, cache)
        if isinstance(logits_to_keep, torch.Tensor):
            hidden = hidden[:, logits_to_keep]
        elif logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return LLaDA2Output(logits=self.lm_head(hidden).float())

    def backbone(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """The last hidden states [B, T, hidden] after the final norm (``forward`` without the LM head)."""
        b, t = input_ids.shape
        if position_ids is None:
            start = 0 if cache is None else cache.get_seq_length()
            position_ids = torch.arange(start, start + t, device=input_ids.device)[None].expand(b, t)
        x = self.model.word_embeddings(input_ids)
        cos, sin = rotary_tables(self.config, position_ids, x.dtype)
        mask = _attention_mask(attention_mask, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask, cache)
        return self.model.norm(x)
