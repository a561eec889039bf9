"""Regenerate tests/fixtures/released/llada2/: a tiny random-weight LLaDA2.x MoE checkpoint in the layout of
inclusionAI/LLaDA2.0-mini (config.json naming LLaDA2MoeModelLM with an auto_map, stand-in modelling and
configuration files, a fast tokenizer with a chat template, sharded safetensors + index), and reference.json
with what the AUTHORS' OWN code computes on it (imported from a local export of their repository, never
copied here):

  inclusionAI/dInfer  fce4e32804103baa5d55230dff0352da0cdd6ceb
      python/dinfer/model/modeling_llada2_moe.py, configuration_llada2_moe.py   logits and expert choices
      python/dinfer/decoding/generate_uniform.py (BlockDiffusionLLM), parallel_strategy.py
      (ThresholdParallelDecoder), utils.py (BlockIteratorFactory, KVCacheFactory)   generations

The generations use the setup of dInfer's README and benchmarks/benchmark.py for LLaDA2 (--model_type llada2
--use_bd --cache prefix --parallel_decoding threshold --threshold 0.9 --block_length 32):
BlockDiffusionLLM(model, ThresholdParallelDecoder(temperature=0, threshold, mask_id, eos_id),
BlockIteratorFactory(start_block_align=True, use_block_diffusion=True), KVCacheFactory('prefix',
is_bd_model=True), early_stop=True), one prompt at a time; 24 chat prompts x 3 settings (the defaults, block
length 16, threshold 0.7).

What the driver supplies in place of the authors' environment (their files are not edited):
  - vLLM is not installed (it needs CUDA): the modules the modelling file imports from it are stand-ins put in
    sys.modules. The one that computes is ``FusedMoE``: it holds the experts as vLLM does (w13 = [gate; up]
    stacked per expert, w2 = down), calls the authors' own routing function (LLaDA2MoeGate.routing, passed as
    custom_routing_function) and computes the experts as vLLM's own CPU path does (cpu_fused_moe_torch in
    vllm/model_executor/layers/fused_moe/cpu_fused_moe.py: tokens grouped by expert, one matmul per expert,
    weight x down(silu(gate x) * up x) summed over the chosen experts); it records the chosen expert ids.
    The tensor-parallel helpers are the one-process identities (rank 0 of 1).
  - torch.compile is disabled (TORCH_COMPILE_DISABLE=1): the decoders' functions run eagerly.
  - dinfer's package __init__ files (they import the serving stack) are not run: the packages are registered
    with their folders as __path__ and the modules above imported from them.
  - TokenArray.get_generated_tokens is wrapped to return the whole token array (the authors' drops every EOS
    id from a batch-1 result), so the reference holds each position.

Scratch virtualenv (never the project's .venv): python 3.11, torch==2.13.0 (local CPU build),
transformers==4.56.2 (vLLM 0.10.2's floor; dInfer's file needs a 4.x transformers), safetensors, tokenizers,
numpy, scipy, tqdm. Run (about a minute):

  python3 -m venv /tmp/venv-llada2 && /tmp/venv-llada2/bin/pip install torch==2.13.0 && \\
      /tmp/venv-llada2/bin/pip install transformers==4.56.2 safetensors tokenizers numpy scipy tqdm
  git archive of inclusionAI/dInfer at the commit above -> /tmp/dinfer-src
  /tmp/venv-llada2/bin/python scripts/make_llada2_fixture.py --dinfer /tmp/dinfer-src
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UPSTREAM = ("inclusionAI/dInfer", "fce4e32804103baa5d55230dff0352da0cdd6ceb")
OUT = REPO / "tests" / "fixtures" / "released" / "llada2"


def _release_helpers():
    """scripts/make_release_fixtures.py (tokenizer, weights, shards, prompts), loaded by path."""
    path = REPO / "scripts" / "make_release_fixtures.py"
    spec = importlib.util.spec_from_file_location("make_release_fixtures", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


R = _release_helpers()
# Special tokens after the byte-level BPE, in the released order around the two the decoders need
# (<|endoftext|> 156892 is EOS and padding, <|mask|> 156895 the mask in the release).
ADDED = ["<|startoftext|>", "<|endoftext|>", "<|arithmetic_start|>", "<|arithmetic_end|>", "<|mask|>",
         "<role>", "</role>", "<|role_end|>"]
# The turn format of dInfer's benchmarks for LLaDA2 ('<role>SYSTEM</role>...<|role_end|><role>HUMAN</role>'
# question '<|role_end|><role>ASSISTANT</role>'), written here as a chat template.
TEMPLATE = (
    "{% for message in messages %}{% set role = {'system': 'SYSTEM', 'user': 'HUMAN', 'assistant': 'ASSISTANT'}"
    "[message['role']] %}{{ '<role>' + role + '</role>' + message['content'] + '<|role_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<role>ASSISTANT</role>' }}{% endif %}")
CONFIG = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, rope_theta=600000.0,
              num_experts=8, num_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
              routed_scaling_factor=2.5, moe_intermediate_size=16, first_k_dense_replace=1, rms_norm_eps=1e-6,
              use_qkv_bias=False, use_bias=False, use_qk_norm=True, norm_head=False, norm_topk_prob=True,
              score_function="sigmoid", moe_router_enable_expert_bias=True, tie_word_embeddings=False,
              max_position_embeddings=4096, hidden_act="silu", attention_dropout=0.0, embedding_dropout=0.0,
              output_dropout=0.0, initializer_range=0.02, use_cache=False)
SETTINGS = [{"block_length": 32, "threshold": 0.9}, {"block_length": 16, "threshold": 0.9},
            {"block_length": 32, "threshold": 0.7}]
GEN_LENGTH = 32
EOS_BOOST = 1.6
SEED = 20240611 + 57
STANDIN = '''"""Stand-in for the release's {name}: this fixture tests that the harness loads the folder without
running the Python files it ships (harness/models/checkpoints.py), so importing this file fails."""

raise ImportError("tests/fixtures/released/llada2/{name} must never be imported: the harness loads LLaDA2 "
                  "folders with refusion/llada2_moe.py")
'''


def build(out: Path) -> dict:
    """The folder (no reference yet); returns the special ids."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    n, ids = R._fast_tokenizer(out, ADDED)
    vocab = R._round_up(n, 64)
    eos, mask = ids["<|endoftext|>"], ids["<|mask|>"]
    cfg = {"architectures": ["LLaDA2MoeModelLM"],
           "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                        "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                        "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
           "model_type": "llada2_moe", "vocab_size": vocab, **CONFIG, "pad_token_id": eos, "eos_token_id": eos,
           "torch_dtype": "bfloat16", "transformers_version": "4.56.2"}
    R._write_json(out / "config.json", cfg)
    R._write_json(out / "generation_config.json", {"bos_token_id": ids["<|startoftext|>"], "eos_token_id": eos,
                                                   "pad_token_id": eos})
    special = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
               "mask_token": "<|mask|>"}
    R._write_json(out / "tokenizer_config.json", {
        "added_tokens_decoder": R._added_decoder(ADDED, ids[ADDED[0]]), **special, "chat_template": TEMPLATE,
        "clean_up_tokenization_spaces": False, "model_max_length": 32768, "padding_side": "left",
        "tokenizer_class": "PreTrainedTokenizerFast"})
    R._write_json(out / "special_tokens_map.json", special)
    for name in ("modeling_llada2_moe.py", "configuration_llada2_moe.py"):
        (out / name).write_text(STANDIN.format(name=name))
    h, c = CONFIG["hidden_size"], CONFIG
    hd, heads, kv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    names = [("model.word_embeddings.weight", (vocab, h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                  (p + "attention.query_key_value.weight", ((heads + 2 * kv) * hd, h)),
                  (p + "attention.query_layernorm.weight", (hd,)), (p + "attention.key_layernorm.weight", (hd,)),
                  (p + "attention.dense.weight", (h, heads * hd))]
        mlp = [(p + "mlp.", c["intermediate_size"])] if i < c["first_k_dense_replace"] else \
            [(p + f"mlp.experts.{e}.", c["moe_intermediate_size"]) for e in range(c["num_experts"])] + \
            [(p + "mlp.shared_experts.", c["moe_intermediate_size"] * c["num_shared_experts"])]
        for q, inner in mlp:
            names += [(q + "gate_proj.weight", (inner, h)), (q + "up_proj.weight", (inner, h)),
                      (q + "down_proj.weight", (h, inner))]
        if i >= c["first_k_dense_replace"]:
            names += [(p + "mlp.gate.weight", (c["num_experts"], h)), (p + "mlp.gate.expert_bias", (c["num_experts"],))]
    names += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    tensors = R._weights(names, SEED, "lm_head.weight", [mask, *range(n, vocab)])
    g = torch.Generator().manual_seed(SEED + 1)
    for name in tensors:
        if name.endswith("word_embeddings.weight"):
            tensors[name] = torch.randn(vocab, h, generator=g).to(torch.bfloat16)
        elif name.endswith("expert_bias"):  # a correction large enough to change some choices
            tensors[name] = (0.1 * torch.randn(c["num_experts"], generator=g)).to(torch.bfloat16)
    # EOS a little likelier than a random token, so that some generations end early (the early stop is tested)
    tensors["lm_head.weight"][eos] *= EOS_BOOST
    R._save_sharded(out, tensors, shards=2)
    return {"eos": eos, "mask": mask, "vocab": vocab}


# ------------------------------------------------------------------ the authors' code (scratch venv)


def _stand_in_vllm(choices: list):
    """sys.modules entries for the vLLM names dInfer's modelling file imports (module doc)."""
    import torch
    from torch import nn

    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    class FusedMoE(nn.Module):
        def __init__(self, num_experts, top_k, hidden_size, intermediate_size, reduce_results=True, quant_config=None,
                     tp_size=None, custom_routing_function=None, prefix=""):
            super().__init__()
            self.top_k, self.route = top_k, custom_routing_function
            self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
            self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
            self.expert_map = None

        def forward_impl(self, hidden_states, router_logits):
            # vLLM's own CPU path (fused_moe/cpu_fused_moe.py, cpu_fused_moe_torch): the (token, slot) pairs
            # ordered by expert, one matmul per expert over its tokens with the stacked [gate; up] weight, the
            # down matmul, each output back in its (token, slot) place, times its weight, summed over the slots.
            weights, ids = self.route(hidden_states, router_logits, self.top_k, True)
            choices.append(ids.clone())
            n, k = ids.shape
            inner = self.w2_weight.shape[-1]
            order = ids.reshape(-1).argsort()
            per_expert = torch.bincount(ids.reshape(-1), minlength=self.w13_weight.shape[0]).tolist()
            rows = hidden_states[order // k]
            outs, start = [], 0
            for e, count in enumerate(per_expert):
                if count:
                    gu = nn.functional.linear(rows[start:start + count], self.w13_weight[e])
                    act = nn.functional.silu(gu[:, :inner]) * gu[:, inner:]
                    outs.append(nn.functional.linear(act, self.w2_weight[e]))
                    start += count
            placed = torch.empty(n * k, hidden_states.shape[-1], dtype=hidden_states.dtype)
            placed[order] = torch.cat(outs)
            out = placed.view(n, k, -1).to(weights.dtype) * weights[:, :, None]
            return out.sum(dim=1).to(hidden_states.dtype)

    class _Linear(nn.Module):  # only used by tensor_parallel(), which the fixture never calls
        def __init__(self, *a, **k):
            raise RuntimeError("tensor parallelism is not stood in")

    mod("vllm")
    mod("vllm.model_executor")
    mod("vllm.model_executor.layers")
    mod("vllm.model_executor.layers.fused_moe", FusedMoE=FusedMoE)
    mod("vllm.model_executor.models")
    mod("vllm.model_executor.models.utils", maybe_prefix=lambda prefix, name: f"{prefix}.{name}" if prefix else name)
    mod("vllm.model_executor.layers.linear", ColumnParallelLinear=_Linear, ReplicatedLinear=_Linear,
        QKVParallelLinear=_Linear, RowParallelLinear=_Linear)
    mod("vllm.distributed", divide=lambda a, b: a // b, get_tensor_model_parallel_rank=lambda: 0,
        get_tensor_model_parallel_world_size=lambda: 1, tensor_model_parallel_all_reduce=lambda t: t)
    sys.modules["vllm"].distributed = sys.modules["vllm.distributed"]


def _import_dinfer(root: Path):
    """dinfer.model.modeling_llada2_moe and the decoding modules, without the package __init__ files."""
    import importlib

    base = root / "python" / "dinfer"
    for pkg, folder in (("dinfer", base), ("dinfer.model", base / "model"), ("dinfer.decoding", base / "decoding")):
        m = types.ModuleType(pkg)
        m.__path__ = [str(folder)]
        sys.modules[pkg] = m
    return (importlib.import_module("dinfer.model.modeling_llada2_moe"),
            importlib.import_module("dinfer.decoding.generate_uniform"),
            importlib.import_module("dinfer.decoding.parallel_strategy"),
            importlib.import_module("dinfer.decoding.utils"))


def authors(dinfer: Path, out: Path, ids: dict) -> dict:
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    torch.manual_seed(SEED)
    # One thread, as the tests compare (tests/conftest.py one_thread): a float32 matmul's rounding can change
    # with how the work is split between threads.
    torch.set_num_threads(1)
    choices: list = []
    _stand_in_vllm(choices)
    modeling, uniform, strategy, utils = _import_dinfer(dinfer)
    utils.TokenArray.get_generated_tokens = lambda self: self.data.clone()
    raw = json.loads((out / "config.json").read_text())
    kwargs = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map", "model_type", "torch_dtype",
                                                        "transformers_version")}
    config = modeling.LLaDA2MoeConfig(**kwargs)
    config._attn_implementation = "sdpa"
    model = modeling.LLaDA2MoeModelLM(config).eval()
    model.load_weights(str(out), torch_dtype=torch.float32, device="cpu")
    tok = AutoTokenizer.from_pretrained(str(out))
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
               for q in R.DG_QUERIES]
    # Logits and expert choices: prompt 0 with every key visible, prompt 1 under the block-causal mask of 8;
    # in float32 and again with the weights in float64 (where the authors' code keeps float32, both do).
    logits, routes = {}, {}

    def forward_all(prefix: str) -> None:
        with torch.no_grad():
            for i, p in enumerate(prompts[:2]):
                ids_t = torch.tensor([p])
                for kind in (("full",), ("block8",))[i]:
                    mask = None
                    if kind == "block8":
                        blocks = torch.arange(len(p)) // 8
                        mask = (blocks[None, :] <= blocks[:, None]).float()[None]
                    choices.clear()
                    out_l = model(ids_t, attention_mask=mask).logits
                    logits[f"{prefix}{kind}_{i}"] = out_l[0].contiguous()
                    routes[f"{prefix}{kind}_{i}"] = torch.stack(choices).to(torch.int64)  # [moe layers, T, k]

    forward_all("")
    model.load_weights(str(out), torch_dtype=torch.float64, device="cpu")
    forward_all("float64_")
    model.load_weights(str(out), torch_dtype=torch.float32, device="cpu")
    save_file({**logits, **{f"experts_{k}": v for k, v in routes.items()}}, str(out / "reference.safetensors"))
    gens = []
    for setting in SETTINGS:
        for p in prompts:
            decoder = strategy.ThresholdParallelDecoder(temperature=0, threshold=setting["threshold"],
                                                        mask_id=ids["mask"], eos_id=ids["eos"])
            dllm = uniform.BlockDiffusionLLM(
                model, decoder, utils.BlockIteratorFactory(start_block_align=True, use_block_diffusion=True),
                cache_factory=utils.KVCacheFactory("prefix", is_bd_model=True), early_stop=True)
            with torch.no_grad():
                full = dllm.generate(torch.tensor([p]), gen_length=GEN_LENGTH, block_length=setting["block_length"])
            gens.append({"knobs": {**setting, "gen_length": GEN_LENGTH}, "prompt": p,
                         "tokens": full[0, len(p):].tolist(), "nfe": int(dllm.num_forwards)})
    return {"generations": gens, "logit_prompts": prompts[:2], "transformers": transformers.__version__,
            "torch": torch.__version__}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dinfer", required=True, help="root of an export of inclusionAI/dInfer at the commit above")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args()
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    out = Path(a.out)
    ids = build(out)
    ref = authors(Path(a.dinfer), out, ids)
    R._write_json(out / "reference.json", {
        "upstream": [{"repo": UPSTREAM[0], "commit": UPSTREAM[1],
                      "files": ["python/dinfer/model/modeling_llada2_moe.py", "python/dinfer/model/"
                                "configuration_llada2_moe.py", "python/dinfer/decoding/generate_uniform.py "
                                "(BlockDiffusionLLM)", "python/dinfer/decoding/parallel_strategy.py "
                                "(ThresholdParallelDecoder)", "python/dinfer/decoding/utils.py"]}],
        "venv": {"transformers": ref["transformers"], "torch": ref["torch"]},
        "stand_ins": "vLLM's FusedMoE and tensor-parallel helpers (scripts/make_llada2_fixture.py); "
                     "torch.compile disabled; TokenArray.get_generated_tokens returns the whole array",
        "special_ids": ids, "gen_length": GEN_LENGTH, "settings": SETTINGS,
        "logits": {"file": "reference.safetensors", "prompts": ref["logit_prompts"],
                   "kinds": {"full_0": "prompt 0, no mask (every key)",
                             "block8_1": "prompt 1, block-causal mask, blocks of 8"},
                   "dtypes": "<kind>: float32 weights and activations, one thread; float64_<kind>: the weights "
                             "loaded as float64 (the authors' float32 steps, router and rotary tables, kept)",
                   "experts": "experts_<kind>_<i>: [MoE layer, position, k] expert ids in the authors' top-k order"},
        "generations": ref["generations"],
        "prompt_texts": {"texts": R.DG_QUERIES, "encode": "tokenizer.apply_chat_template([{'role': 'user', "
                         "'content': text}], add_generation_prompt=True)"},
        "decoding": "BlockDiffusionLLM + ThresholdParallelDecoder(temperature=0) + prefix KV cache, batch 1, "
                    "CPU, float32 (weights stored bfloat16); tokens = the whole array after the prompt (EOS fill "
                    "included), nfe = BlockDiffusionLLM.num_forwards"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
