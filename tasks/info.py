"""The task table: one ``TaskInfo`` per task, the single description everything else reads
(docs/design.md §5).

For each task: its lm-eval leaf tasks, the "metric,filter" reported as its score, where its
documents come from (a ``tasks.data`` benchmark, or an embedded kind), its response budget, and
the ReFusion settings the paper used on it. The YAMLs in tasks/configs hold the prompts,
filters and metrics (lm-eval's format); the runner, the scorer, the validator and the presets
take everything else from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

# docs/design.md §5: zero-shot, chat template, gen_length 512, batch 1, greedy.
PAPER_GEN_LENGTH = 512


@dataclass(frozen=True)
class TaskInfo:
    leaves: tuple[str, ...]  # lm-eval leaf tasks (a group has several)
    primary: str  # "metric,filter" reported as the task's score
    benchmark: str  # tasks.data benchmark (or embedded_<kind>)
    gen_length: int = PAPER_GEN_LENGTH  # response budget of every decoder on this task
    # ReFusion's slot settings the paper used on this benchmark (empty: none published)
    refusion: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    # The task with the ReFusion authors' prompt changes (tasks/configs/paper/), used by `--prompts paper`
    paper_variant: str | None = None

    def decoding_knobs(self, decoder: str, accepted: set[str]) -> dict[str, Any]:
        """Per-task decoding defaults for ``decoder``, limited to the knobs it accepts."""
        knobs: dict[str, Any] = {"gen_length": self.gen_length}
        if decoder == "refusion":
            knobs.update(self.refusion)
        return {k: v for k, v in knobs.items() if k in accepted}


def _rf(slot_size: int, serial_num_blocks: int, slot_threshold: float, token_threshold: float) -> MappingProxyType:
    return MappingProxyType({"slot_size": slot_size, "serial_num_blocks": serial_num_blocks,
                             "slot_threshold": slot_threshold, "token_threshold": token_threshold})


MMLU_PRO_SUBJECTS = ("biology", "business", "chemistry", "computer_science", "economics", "engineering", "health",
                     "history", "law", "math", "other", "philosophy", "physics", "psychology")
MATH_SUBJECTS = ("algebra", "counting_and_prob", "geometry", "intermediate_algebra", "num_theory", "prealgebra",
                 "precalc")

# Embedded budgets: the longest gold responses are math 80, code 27, choice 19 tokens; the YAMLs'
# max_gen_toks (512) would only add padding work.
TASKS: dict[str, TaskInfo] = {
    "mmlu_pro": TaskInfo(tuple(f"mmlu_pro_{s}" for s in MMLU_PRO_SUBJECTS), "exact_match,custom-extract",
                         "mmlu_pro", refusion=_rf(16, 4, 0.9, 0.4)),
    "arc_challenge_chat": TaskInfo(("arc_challenge_chat",), "exact_match,remove_whitespace", "arc_challenge",
                                   refusion=_rf(8, 64, 0.8, 0.1)),
    "gsm8k_cot": TaskInfo(("gsm8k_cot",), "exact_match,flexible-extract", "gsm8k", refusion=_rf(32, 4, 0.9, 0.4)),
    "minerva_math": TaskInfo(tuple(f"minerva_math_{s}" for s in MATH_SUBJECTS), "exact_match,none", "math",
                             refusion=_rf(32, 8, 0.8, 0.6)),
    "gpqa_main_generative": TaskInfo(("gpqa_main_generative",), "exact_match,flexible-extract", "gpqa",
                                     refusion=_rf(8, 32, 0.8, 0.2)),
    "humaneval_instruct": TaskInfo(("humaneval_instruct",), "pass@1,create_test", "humaneval",
                                   refusion=_rf(32, 4, 0.9, 0.4)),
    "mbpp": TaskInfo(("mbpp",), "pass_at_1,none", "mbpp", refusion=_rf(32, 4, 0.9, 0.3)),
    "embedded_math": TaskInfo(("embedded_math",), "exact_match,extract", "embedded_math", gen_length=96),
    "embedded_code": TaskInfo(("embedded_code",), "pass_at_1,extract", "embedded_code", gen_length=32),
    "embedded_choice": TaskInfo(("embedded_choice",), "exact_match,extract", "embedded_choice", gen_length=32),
}
TASKS["gpqa_main_generative_n_shot"] = TASKS["gpqa_main_generative"]  # same documents, scoring and settings
# The authors' prompt variants (tasks/README.md lists every change): same data, metric and settings.
PAPER_VARIANTS = {"gsm8k_cot": "gsm8k_cot_paper", "gpqa_main_generative": "gpqa_main_generative_paper",
                  "gpqa_main_generative_n_shot": "gpqa_main_generative_paper",
                  "humaneval_instruct": "humaneval_instruct_noprefix", "mbpp": "mbpp_paper"}
for _stock, _paper in PAPER_VARIANTS.items():
    if _paper not in TASKS:
        TASKS[_paper] = replace(TASKS[_stock], leaves=(_paper,))
    TASKS[_stock] = replace(TASKS[_stock], paper_variant=_paper)
PAPER_TASKS = tuple(dict.fromkeys(PAPER_VARIANTS.values()))
BENCHMARK_TASKS = ("mmlu_pro", "arc_challenge_chat", "gsm8k_cot", "minerva_math", "gpqa_main_generative",
                   "humaneval_instruct", "mbpp")
EMBEDDED_TASKS = ("embedded_math", "embedded_code", "embedded_choice")


# Short names a user types for the seven benchmarks -> the task name they mean. Resolved before a
# run writes anything, so run.json, metrics and reports only ever carry the real name. None of
# these is a task or group name of tasks/configs (tests/test_ux.py checks it).
TASK_ALIASES = MappingProxyType({
    "gsm8k": "gsm8k_cot", "humaneval": "humaneval_instruct", "math": "minerva_math",
    "arc": "arc_challenge_chat", "arc_challenge": "arc_challenge_chat", "gpqa": "gpqa_main_generative",
    "mmlu-pro": "mmlu_pro",
})


def resolve_aliases(task_arg: str) -> tuple[str, list[tuple[str, str]]]:
    """A comma list of task names with every alias replaced by its task; also the (alias, task) pairs used."""
    names = [t.strip() for t in task_arg.split(",") if t.strip()]
    used = [(n, TASK_ALIASES[n]) for n in names if n in TASK_ALIASES]
    return ",".join(TASK_ALIASES.get(n, n) for n in names), used


class UnknownTask(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def task_info(name: str) -> TaskInfo:
    if name not in TASKS:
        raise UnknownTask(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[name]
