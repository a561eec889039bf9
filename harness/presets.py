"""Named defaults of the runner: the model presets of the default run and the per-benchmark
decoding settings the ReFusion paper used (docs/design.md §5).

Both are plain dicts; the runner looks names up here and lists the valid ones when
a name is unknown. ``MODEL_GROUPS`` names lists of presets: ``MODELS=all`` (or ``all`` inside
a comma list) runs every preset, the default suite's and the others (dream, dream_fast_dllm, d2f).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TINY = "checkpoints/tiny"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    checkpoint: str
    decoder: str
    knobs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"name": self.name, "checkpoint": self.checkpoint, "decoder": self.decoder, "knobs": dict(self.knobs)}


# The default run: every decoder on the committed tiny checkpoints, with the knobs of the
# decoder benchmark (harness/bench.py), so `make eval` reproduces its figures through lm-eval.
# The causal ReFusion checkpoint serves `refusion`; the bidirectional MDM one the MDM baselines.
TINY_REFUSION_KNOBS = {"slot_size": 4, "serial_num_blocks": 1, "slot_threshold": 0.6, "token_threshold": 0.3}
PRESETS: dict[str, ModelSpec] = {
    "ar": ModelSpec("ar", f"{TINY}/ar", "ar"),
    "refusion": ModelSpec("refusion", f"{TINY}/refusion", "refusion", dict(TINY_REFUSION_KNOBS)),
    "refusion_left_to_right": ModelSpec("refusion_left_to_right", f"{TINY}/refusion", "refusion",
                                        {**TINY_REFUSION_KNOBS, "left_to_right": True}),
    "llada": ModelSpec("llada", f"{TINY}/mdm", "llada", {"block_length": 32, "remasking": "low_confidence"}),
    "fast_dllm": ModelSpec("fast_dllm", f"{TINY}/mdm", "fast_dllm",
                           {"block_length": 32, "threshold": 0.9, "cache": "dual"}),
    # The rest of the paper's Table 1: Dream (shifted MDM, checkpoint trained with collate_mdm(shift=True)),
    # Fast-dLLM on Dream, and D2F (block-causal MDM, collate_d2f with block_size 8).
    "dream": ModelSpec("dream", f"{TINY}/dream", "dream", {"alg": "entropy"}),
    "dream_fast_dllm": ModelSpec("dream_fast_dllm", f"{TINY}/dream", "fast_dllm",
                                 {"block_length": 32, "threshold": 0.9, "cache": "dual", "shift": True}),
    "d2f": ModelSpec("d2f", f"{TINY}/d2f", "d2f", {"block_size": 8, "block_add_threshold": 0.1,
                                                   "decoded_token_threshold": 0.95, "skip_threshold": 0.9}),
}
# Response budget of the embedded tasks (their longest gold responses: math 80, code 27, choice
# 19 tokens), as harness/bench.py uses; the YAMLs' max_gen_toks (512) would only add padding work.
EMBEDDED_GEN_LENGTH = {"embedded_math": 96, "embedded_code": 32, "embedded_choice": 32}
DEFAULT_MODELS = ("ar", "refusion", "llada", "fast_dllm")
# Names that stand for several presets in MODELS (harness.runner.parse_models expands them).
MODEL_GROUPS: dict[str, tuple[str, ...]] = {"all": tuple(PRESETS)}

# docs/design.md §5: zero-shot, chat template, gen_length 512, batch 1, greedy; ReFusion's slot settings
# per benchmark. Applied to the knobs a decoder accepts; anything given in MODELS wins.
PAPER_GEN_LENGTH = 512
PAPER_REFUSION: dict[str, dict[str, Any]] = {
    "mmlu_pro": {"slot_size": 16, "serial_num_blocks": 4, "slot_threshold": 0.9, "token_threshold": 0.4},
    "arc_challenge_chat": {"slot_size": 8, "serial_num_blocks": 64, "slot_threshold": 0.8, "token_threshold": 0.1},
    "gsm8k_cot": {"slot_size": 32, "serial_num_blocks": 4, "slot_threshold": 0.9, "token_threshold": 0.4},
    "minerva_math": {"slot_size": 32, "serial_num_blocks": 8, "slot_threshold": 0.8, "token_threshold": 0.6},
    "gpqa_main_generative": {"slot_size": 8, "serial_num_blocks": 32, "slot_threshold": 0.8, "token_threshold": 0.2},
    "gpqa_main_generative_n_shot": {"slot_size": 8, "serial_num_blocks": 32, "slot_threshold": 0.8,
                                    "token_threshold": 0.2},
    "humaneval_instruct": {"slot_size": 32, "serial_num_blocks": 4, "slot_threshold": 0.9, "token_threshold": 0.4},
    "mbpp": {"slot_size": 32, "serial_num_blocks": 4, "slot_threshold": 0.9, "token_threshold": 0.3},
}


def paper_knobs(unit: str, decoder: str, accepted: set[str]) -> dict[str, Any]:
    """Per-task decoding defaults (docs/design.md §5 for the benchmarks, response budgets for the
    embedded suite), limited to the knobs ``decoder`` accepts."""
    if unit in EMBEDDED_GEN_LENGTH:
        return {"gen_length": EMBEDDED_GEN_LENGTH[unit]} if "gen_length" in accepted else {}
    if unit not in PAPER_REFUSION:
        return {}
    knobs: dict[str, Any] = {"gen_length": PAPER_GEN_LENGTH}
    if decoder == "refusion":
        knobs.update(PAPER_REFUSION[unit])
    return {k: v for k, v in knobs.items() if k in accepted}
