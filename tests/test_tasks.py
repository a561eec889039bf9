"""Task definitions (tasks/configs), offline scoring (tasks/scoring.py) and validate-tasks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tasks import math_equiv, scoring, validate

needs_data = pytest.mark.skipif(not os.environ.get("REFUSION_DATA_DIR"),
                                reason="REFUSION_DATA_DIR not set (CI sets it to the offline benchmark copies)")
SAMPLE = {"mmlu_pro": 60, "arc_challenge_chat": 60, "gsm8k_cot": 60, "minerva_math": 60,
          "gpqa_main_generative": 60, "humaneval_instruct": 12, "mbpp": 12,
          # the ReFusion authors' prompt variants (--prompts paper)
          "gsm8k_cot_paper": 30, "gpqa_main_generative_paper": 30, "humaneval_instruct_noprefix": 8, "mbpp_paper": 8}


def _docs(task: str, n: int) -> list[dict]:
    leaf = scoring.task_info(task).leaves[0]
    return [dict(d) for d in scoring.lm_eval_task(leaf).eval_docs][:n]


# ---------------------------------------------------------------- lm-eval loading
@needs_data
@pytest.mark.parametrize("task", list(SAMPLE))
def test_task_loads_and_builds_requests_from_real_data(task):
    leaf = scoring.task_info(task).leaves[0]
    t = scoring.lm_eval_task(leaf)
    assert Path(scoring.task_manager().task_index[leaf].yaml_path).is_relative_to(scoring.TASKS_DIR)
    t.build_all_requests(limit=2, rank=0, world_size=1)
    inst = t.instances[0]
    assert inst.request_type == "generate_until"
    ctx, gen_kwargs = inst.args
    assert gen_kwargs["max_gen_toks"] == 512 and gen_kwargs["do_sample"] is False
    assert t.config.num_fewshot == 0
    doc = inst.doc
    probe = {"mmlu_pro": "question", "arc_challenge_chat": "question", "gsm8k_cot": "question",
             "minerva_math": "problem", "gpqa_main_generative": "Question", "humaneval_instruct": "prompt",
             "mbpp": "text", "gsm8k_cot_paper": "question", "gpqa_main_generative_paper": "Question",
             "humaneval_instruct_noprefix": "prompt", "mbpp_paper": "text"}[task]
    assert doc[probe].strip()[:40] in ctx
    if task in ("gsm8k_cot_paper", "mbpp_paper", "gpqa_main_generative_paper"):  # the authors' instructions
        assert {"gsm8k_cot_paper": "think step-by-step", "mbpp_paper": "Directly after the '[BEGIN]' marker",
                "gpqa_main_generative_paper": "enclosed in parentheses"}[task] in ctx
    if task == "humaneval_instruct_noprefix":
        assert ctx.endswith("```python\n") and gen_kwargs["until"] == ["\nassert", "\n# Test"]


def test_group_members_and_embedded_tasks_are_indexed():
    tm = scoring.task_manager()
    for name in ("mmlu_pro", "minerva_math", "embedded"):
        assert name in tm.all_groups
    for name in scoring.TASKS:
        for leaf in scoring.task_info(name).leaves:
            assert leaf in tm.all_subtasks, leaf


def test_include_path_overrides_builtin_task_of_same_name():
    """lm-eval merges index paths in order, later ones winning: built-ins first, include_path last."""
    import lm_eval.tasks
    from lm_eval.tasks._index import TaskIndex

    builtin = Path(lm_eval.tasks.__file__).parent
    index = TaskIndex.build([builtin / "gsm8k", builtin / "mbpp", scoring.TASKS_DIR])
    for name in ("gsm8k_cot", "mbpp"):
        assert Path(index[name].yaml_path).is_relative_to(scoring.TASKS_DIR)


@needs_data
def test_gpqa_stays_in_memory(tmp_path, monkeypatch):
    """GPQA questions must never be written to disk: the dataset has no cache files. The datasets cache is a
    folder of this test's own: the shared one also gets other tests' (other xdist workers') datasets, so a
    diff of it raced them (CI saw another worker's json dataset appear in it)."""
    import datasets

    from tasks import hooks

    cache = tmp_path / "hf-datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    hooks._dataset.cache_clear()
    try:
        ds = hooks.load_dataset("gpqa", "main")["main"]
        processed = hooks.gpqa_process_docs(ds)
        assert ds.cache_files == [] and processed.cache_files == [] and len(processed) == 448
        assert not cache.exists() or list(cache.rglob("*")) == []
    finally:
        hooks._dataset.cache_clear()  # nothing loaded under the patched cache outlives the test


# ---------------------------------------------------------------- gold and wrong answers
@needs_data
@pytest.mark.parametrize("task", list(SAMPLE))
def test_gold_scores_one_and_wrong_scores_zero(task):
    docs = _docs(task, SAMPLE[task])
    pairs = [validate.gold_and_wrong(task, d) for d in docs]
    key = scoring.task_info(task).primary
    gold = scoring.score_many(task, [g for g, _ in pairs], docs, workers=4)
    wrong = scoring.score_many(task, [w for _, w in pairs], docs, workers=4)
    assert [g[key] for g in gold] == [1.0] * len(docs)
    assert [w[key] for w in wrong] == [0.0] * len(docs)
    for g, w in zip(gold, wrong):  # every filter of the task agrees
        assert set(g.values()) == {1.0} and set(w.values()) == {0.0}


def test_paper_prompt_helpers():
    """--prompts paper: the task swap, the authors' fence extraction and the HumanEval sanitiser."""
    from harness.run.units import paper_tasks
    from tasks.hooks import sanitize_program

    assert paper_tasks("gsm8k_cot,mmlu_pro,mbpp,embedded") == "gsm8k_cot_paper,mmlu_pro,mbpp_paper,embedded"
    assert paper_tasks("humaneval_instruct,gpqa_main_generative_n_shot") == \
        "humaneval_instruct_noprefix,gpqa_main_generative_paper"
    text = "Here you go:\n```python\ndef f(x):\n    return x\n```\nand a second\n```python\nno\n```"
    assert scoring.python_fence(text) == "def f(x):\n    return x"
    assert scoring.python_fence("def f(): pass") == "def f(): pass"  # no fence: unchanged
    prog = "import math\n@cache\ndef f(x):\n    return x\nprint(f(1))\nX = 2\nassert f(2) == 2\ndef g(y):\n    return y +"
    assert sanitize_program(prog) == "import math\n\n@cache\ndef f(x):\n    return x\n\nX = 2\n"
    for stock in ("gsm8k_cot", "mbpp", "humaneval_instruct", "gpqa_main_generative"):
        info = scoring.task_info(stock)
        variant = scoring.task_info(info.paper_variant)
        assert (variant.primary, variant.benchmark, dict(variant.refusion)) == \
            (info.primary, info.benchmark, dict(info.refusion))


@pytest.mark.parametrize("task", scoring.EMBEDDED_TASKS)
def test_embedded_gold_and_wrong(task):
    from tasks.embedded import load_split

    docs = load_split(task.split("_")[1], "test")[:30]
    pairs = [validate.gold_and_wrong(task, d) for d in docs]
    assert [scoring.score(task, g, d) for (g, _), d in zip(pairs, docs)][:5] == [1.0] * 5
    gold = scoring.score_many(task, [g for g, _ in pairs], docs)
    wrong = scoring.score_many(task, [w for _, w in pairs], docs)
    key = scoring.task_info(task).primary
    assert [g[key] for g in gold] == [1.0] * len(docs) and [w[key] for w in wrong] == [0.0] * len(docs)
    # The lm-eval task (its filters and metric) gives the same scores as the direct scorer.
    via_lm_eval = scoring.score_docs_with_task(scoring.lm_eval_task(task), [g for g, _ in pairs][:10], docs[:10])
    assert [v[key] for v in via_lm_eval] == [1.0] * 10


def test_embedded_extractors():
    assert scoring.extract_math("so 3 + 4 = 7\n#### 7") == "7"
    assert scoring.extract_math("the total is 12 then -5") == "-5"
    assert scoring.extract_math("no number") == scoring.INVALID
    assert scoring.extract_choice("The answer is (C)") == "C"
    assert scoring.extract_choice("so the answer is J.") == "J"
    assert scoring.extract_code("```python\ndef f():\n    return 1\n```\ntext") == "def f():\n    return 1\n"
    doc = {"tests": ["assert add(2, 3) == 5"], "answer": "", "entry_point": "add"}
    assert scoring.score("embedded_code", "def add(a, b):\n    return a + b", doc) == 1.0
    assert scoring.score("embedded_code", "def add(a, b):\n    return a * b", doc) == 0.0


# ---------------------------------------------------------------- MATH equivalence
def test_math_boxed_extraction_and_normalisation():
    sol = r"So $x = \boxed{\frac{1}{2}}$ and not \boxed{3}. Finally $\boxed{\dfrac{\sqrt{3}}{2}}$."
    assert math_equiv.unbox(math_equiv.last_boxed(sol)) == r"\dfrac{\sqrt{3}}{2}"
    assert math_equiv.last_boxed("no box here") is None
    assert math_equiv.normalize("10,000") == "10000"
    assert math_equiv.normalize("0,1") == "0,1"  # a tuple, not a thousands separator
    assert math_equiv.normalize(r"5\text{ cm}") == "5"
    assert math_equiv.normalize(r"x = \frac12") == r"\frac{1}{2}"
    assert math_equiv.normalize(r"90^\circ") == "90"


@pytest.mark.parametrize("a,b,equal", [
    (r"\frac{1}{2}", "0.5", True),
    (r"\sqrt{8}", r"2\sqrt{2}", True),
    (r"\frac{\sqrt{3}}{2}", r"\frac{1}{2}\sqrt{3}", True),
    ("(1,2)", "(1,2)", True),
    (r"2\pi", r"\pi*2", True),
    ("3", "4", False),
    (r"\frac{1}{3}", "0.33", False),
    ("(1,2)", "(2,1)", False),
])
def test_math_equivalence(a, b, equal):
    assert math_equiv.is_equiv(math_equiv.normalize(a), math_equiv.normalize(b)) is equal


def test_math_score_response():
    gold = math_equiv.gold_answer(r"The sum is $\boxed{\frac{3}{4}}$.")
    assert math_equiv.score_response("Final Answer: The final answer is $0.75$. I hope it is correct.", gold) == 1
    assert math_equiv.score_response("Final Answer: The final answer is $3/5$. I hope it is correct.", gold) == 0
    assert math_equiv.score_response(r"the answer is \boxed{3/4}", gold) == 0  # not the Minerva format


# ---------------------------------------------------------------- errors
def test_unknown_task_name(capsys):
    assert validate.main(["--tasks", "gsm8k_cot,not_a_task"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "not_a_task" in err and "mmlu_pro" in err and "embedded_code" in err
    with pytest.raises(scoring.UnknownTask, match="known tasks: mmlu_pro"):
        scoring.score("not_a_task", "x", {})


@needs_data
def test_validate_cli_runs_on_a_small_limit(capsys):
    assert validate.main(["--tasks", "gsm8k_cot,embedded_choice", "--limit", "5"]) == 0
    out = capsys.readouterr().out
    assert "gsm8k_cot" in out and "items=5" in out and "gold=1.0000 wrong=0.0000" in out
