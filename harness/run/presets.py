"""Named defaults of the runner: the model presets of the default run. The per-task decoding
settings (the paper's, docs/design.md §5) live in the task table, tasks/info.py.

PRESETS is a plain dict; the runner looks names up here and lists the valid ones when a name
is unknown. ``MODEL_GROUPS`` names lists of presets: ``MODELS=all`` (or ``all`` inside a comma list)
runs every preset, the default suite's and the others (ablations, dream, dream_fast_dllm, d2f).
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
    engine: str | None = None  # decoder "ar@vllm": the ar decoder served by an engine (harness/run/engine.py)

    def to_dict(self) -> dict:
        out = {"name": self.name, "checkpoint": self.checkpoint, "decoder": self.decoder, "knobs": dict(self.knobs)}
        if self.engine:  # only then: run.json of a run without an engine row stays as it was
            out["engine"] = {"name": self.engine}
        return out

    @property
    def label(self) -> str:
        """The decoder as the user wrote it: ``ar`` or ``ar@vllm``."""
        return f"{self.decoder}@{self.engine}" if self.engine else self.decoder


# The default run: every decoder on the committed tiny checkpoints, with the knobs of the
# decoder benchmark (harness/speed/bench.py), so `make eval` reproduces its figures through lm-eval.
# The causal ReFusion checkpoint serves `refusion`; the bidirectional MDM one the MDM baselines.
TINY_REFUSION_KNOBS = {"slot_size": 4, "serial_num_blocks": 1, "slot_threshold": 0.6, "token_threshold": 0.3}
PRESETS: dict[str, ModelSpec] = {
    "ar": ModelSpec("ar", f"{TINY}/ar", "ar"),
    "refusion": ModelSpec("refusion", f"{TINY}/refusion", "refusion", dict(TINY_REFUSION_KNOBS)),
    "refusion_left_to_right": ModelSpec("refusion_left_to_right", f"{TINY}/refusion", "refusion",
                                        {**TINY_REFUSION_KNOBS, "left_to_right": True}),
    # ReFusion ablations (make bench-decoders): KV recomputed after parallel commits, no KV reuse, and the
    # reference's per-slot copy of the committed cache (same tokens as `refusion`).
    "refusion_recompute_kv": ModelSpec("refusion_recompute_kv", f"{TINY}/refusion", "refusion",
                                       {**TINY_REFUSION_KNOBS, "recompute_kv": True}),
    "refusion_no_cache": ModelSpec("refusion_no_cache", f"{TINY}/refusion", "refusion",
                                   {**TINY_REFUSION_KNOBS, "no_cache": True}),
    "refusion_replicated": ModelSpec("refusion_replicated", f"{TINY}/refusion", "refusion",
                                     {**TINY_REFUSION_KNOBS, "kv_layout": "replicated"}),
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
DEFAULT_MODELS = ("ar", "refusion", "llada", "fast_dllm")
# make regress: the default run plus the other diffusion decoders (Dream, D2F), so a changed math figure of
# any diffusion decoder fails the check.
REGRESS_MODELS = (*DEFAULT_MODELS, "dream", "d2f")
# make bench-decoders: every decoder and ReFusion ablation.
BENCH_MODELS = ("ar", "refusion", "refusion_left_to_right", "refusion_recompute_kv", "refusion_no_cache",
                "refusion_replicated", "llada", "fast_dllm", "dream", "dream_fast_dllm", "d2f")
# Names that stand for several presets in MODELS (harness.run.runner.parse_models expands them).
MODEL_GROUPS: dict[str, tuple[str, ...]] = {"all": tuple(PRESETS)}


def paper_knobs(unit: str, decoder: str, accepted: set[str]) -> dict[str, Any]:
    """Per-task decoding defaults from the task table (tasks/info.py: the paper's gen_length and ReFusion
    slot settings for the benchmarks, response budgets for the embedded suite), limited to the knobs
    ``decoder`` accepts; {} for a task the table does not know."""
    from tasks.info import TASKS

    return TASKS[unit].decoding_knobs(decoder, accepted) if unit in TASKS else {}
