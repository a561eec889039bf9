"""What a new user meets first: one-line errors, task aliases, overall progress, resumed runs marked,
no library noise, and the lm-eval command of docs/running.md working as written.

Everything here but the last test is fast (no decoding): the runner's pieces are called directly.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from harness import cli
from harness.run import run_dir, runner, summary

REPO = Path(__file__).resolve().parents[1]
RUNNING = (REPO / "docs" / "running.md").read_text()  # the user guide's page on `make eval`
TABLE1 = (REPO / "docs" / "reproduce-table1.md").read_text()
# Every user page a command can be copied from: the README and the guide.
USER_DOCS = {p.relative_to(REPO).as_posix(): p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]}


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


# ---------------------------------------------------------------- one error line


@pytest.mark.parametrize("argv, words", [
    (["eval", "--limit", "abc"], ["--limit", "invalid int value: 'abc'"]),
    (["eval", "--prompts", "nope"], ["--prompts", "invalid choice"]),
    (["report", "--bogus"], ["unrecognized arguments: --bogus"]),
    (["compare", "--runs-root"], ["--runs-root", "expected one argument"]),
    (["regress", "--limit", "x"], ["--limit"]),
    (["validate-tasks", "--nope"], ["--nope"]),  # tasks/ parsers too, which cannot import harness
])
def test_bad_options_are_one_error_line(argv, words, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = _one_error(capsys)
    assert all(w in err for w in words), err
    assert f"python -m harness {argv[0]} --help" in err
    # The swap is scoped to the command: argparse is itself again afterwards.
    assert argparse.ArgumentParser.error is not cli._one_line_error


def test_the_guide_says_which_line_to_read_when_make_fails():
    assert "make: *** [Makefile" in RUNNING and "`error:` line" in RUNNING


# ---------------------------------------------------------------- task names


def _config_names() -> set[str]:
    names = set()
    for p in (REPO / "tasks" / "configs").rglob("*.yaml"):
        names |= set(re.findall(r"^(?:task|group):\s*(\S+)", p.read_text(), flags=re.M))
    return names


def test_aliases_name_real_tasks_and_shadow_none():
    from tasks.info import BENCHMARK_TASKS, TASK_ALIASES, TASKS, resolve_aliases

    configs = _config_names()
    assert set(BENCHMARK_TASKS) <= configs
    for alias, task in TASK_ALIASES.items():
        assert task in TASKS and task in configs, alias
        assert alias not in configs and alias not in TASKS, alias
    for short in ("humaneval", "gsm8k", "math", "arc", "arc_challenge", "gpqa", "mmlu_pro", "mbpp"):
        assert resolve_aliases(short)[0] in BENCHMARK_TASKS, short
    assert resolve_aliases(" humaneval, gsm8k ,embedded") == ("humaneval_instruct,gsm8k_cot,embedded",
                                                              [("humaneval", "humaneval_instruct"),
                                                               ("gsm8k", "gsm8k_cot")])
    # --prompts paper maps the resolved name to the authors' variant.
    assert runner.paper_tasks(resolve_aliases("gsm8k,humaneval")[0]) == "gsm8k_cot_paper,humaneval_instruct_noprefix"


def test_alias_is_resolved_before_anything_is_written(tmp_path, monkeypatch, capsys):
    seen = {}

    def build_config(ns, checked=None):
        seen["task"] = ns.task
        raise runner.InputError("stop here")

    monkeypatch.setattr(runner, "build_config", build_config)
    assert runner.main(["--task", "humaneval,math", "--out", str(tmp_path / "out")]) == 2
    assert seen["task"] == "humaneval_instruct,minerva_math"  # what run.json's "task" would record
    err = capsys.readouterr().err
    assert "task 'humaneval' is 'humaneval_instruct'" in err and not (tmp_path / "out").exists()


def test_the_guide_lists_the_task_names_and_aliases():
    from tasks.info import BENCHMARK_TASKS, EMBEDDED_TASKS, TASK_ALIASES

    for name in (*BENCHMARK_TASKS, *EMBEDDED_TASKS, *TASK_ALIASES):
        assert f"`{name}`" in RUNNING, name


# ---------------------------------------------------------------- overall progress


def test_progress_counts_every_sample_of_every_model_and_task(write_task, tmp_path):
    tasks = write_task(tmp_path / "tasks", "tiny_gen", n=5)
    write_task(tasks, "tiny_two", n=2)
    units = runner.resolve_units("tiny_gen,tiny_two", [tasks], limit=3)
    assert [(u["name"], u["samples"]) for u in units] == [("tiny_gen", 3), ("tiny_two", 2)]  # LIMIT per leaf
    cfg = {"models": [{"name": "ar"}, {"name": "refusion"}, {"name": "llada"}], "units": units}
    now = [0.0]
    p = summary.Progress(cfg, clock=lambda: now[0])
    assert p.start_line() == "run: 3 model(s) x 2 task(s) = 15 samples"
    assert p.total == 15
    now[0] = 100.0  # the first model was already finished (resume): nothing decoded yet
    assert p.finished("ar", decoded_share=0.0) == "progress: 1/3 models, 5/15 samples (33%), 1m40s elapsed, ETA unknown"
    now[0] = 110.0  # refusion decoded its whole budget in 10 s; llada's pace is not known: assumed the same
    assert p.finished("refusion", decoded_share=1.0) == ("progress: 2/3 models, 10/15 samples (67%), 1m50s "
                                                         "elapsed, ETA 10s (llada at the mean pace so far)")
    now[0] = 200.0
    assert p.finished("llada") == "progress: 3/3 models, 15/15 samples (100%), 3m20s elapsed, done"


def test_eta_uses_each_models_budget_and_own_pace():
    """The case the ETA got wrong: after a fast AR model it said 2 minutes, and LLaDA at steps = length took
    ten times longer per token. With each model's budget and its own pace (an earlier run's, --rate) it
    is right; without one it says which models it assumed the mean pace for."""
    unit = {"name": "t", "leaves": ["t"], "samples": 10, "max_gen_toks": 256}
    models = [{"name": "ar", "resolved_knobs": {"t": {"gen_length": 256}}},
              {"name": "llada", "resolved_knobs": {"t": {"gen_length": 512, "steps": 512}}}]
    now = [0.0]
    p = summary.Progress({"models": models, "units": [unit]}, clock=lambda: now[0], rates={"llada": 51.2})
    assert p.budget == {"ar": 2560, "llada": 5120}
    now[0] = 12.8  # ar: 2560 budget tokens at 200 tokens/s
    assert p.finished("ar").endswith("ETA 1m40s")  # llada: 5120 tokens at its own 51.2 tokens/s
    now[0] = 0.0
    q = summary.Progress({"models": models, "units": [unit]}, clock=lambda: now[0])
    now[0] = 25.6
    assert q.finished("ar").endswith("ETA 51s (llada at the mean pace so far)")  # 5120 / (2560 / 25.6)


def test_progress_of_a_run_json_without_sample_counts():
    p = summary.Progress({"models": [{"name": "a"}], "units": [{"name": "t"}]})
    assert p.start_line() == "run: 1 model(s) x 1 task(s)"
    assert p.finished("a") == "progress: 1/1 models (a finished)"


def test_decoded_share_reads_done_json(tmp_path):
    (tmp_path / "done.json").write_text(json.dumps({"computed": 3, "served_from_journal": 1}))
    assert summary.decoded_share(tmp_path / "done.json") == 0.75
    assert summary.decoded_share(tmp_path / "absent.json") == 1.0


# ---------------------------------------------------------------- summary: no AR, resumed


def _metrics(model: str, tps: float, spd: float | None) -> dict:
    return {"model": model, "task": "embedded_math", "decoder": model, "quality": {"exact_match,extract": 0.5},
            "quality_primary": "exact_match,extract",
            "speed": {"samples": 4, "tokens_per_s": {"ratio_of_sums": tps, "mean_of_ratios": tps},
                      "tpf": {"ratio_of_sums": 2.0}, "nfe": {"mean": 5.0}, "generated_tokens": {"total": 40},
                      "latency_s": {"mean": 0.1, "p50": 0.1, "p90": 0.2}},
            "memory": {"peak_rss_bytes": 2**27, "kv_peak_bytes": 2**12},
            "speedup": {"baseline": None, "tokens_per_s": spd}}


def _cfg(models: list[str], baseline: str | None, **extra) -> dict:
    return {"run_id": "r", "task": "embedded_math", "limit": 4, "baseline": baseline,
            "models": [{"name": m} for m in models], "units": [{"name": "embedded_math"}],
            "environment": {"device": "cpu"}, **extra}


def test_a_run_without_ar_has_no_speedup_line_or_column(tmp_path):
    s = summary.summary(_cfg(["llada", "refusion"], None), [_metrics("llada", 50.0, None),
                                                           _metrics("refusion", 100.0, None)])
    md = summary.markdown(s)
    assert "None" not in md.splitlines()[0] and "speedup" not in md
    assert "speedup" not in summary.table(s)
    line = summary.one_line(s, tmp_path)
    assert "speedup" not in line and line.startswith("done: 2 model(s) x 1 task(s), 8 samples; results in")
    # With an AR reference both are there.
    s = summary.summary(_cfg(["ar", "refusion"], "ar"), [_metrics("ar", 50.0, 1.0), _metrics("refusion", 100.0, 2.0)])
    # Without timed rounds (a single pass) every wall-clock column says so.
    assert "speedup vs ar" in summary.markdown(s) and "| speedup [95% CI] (single pass) |" in summary.markdown(s)
    assert "mean speedup vs ar: refusion 2.00x" in summary.one_line(s, tmp_path)


def test_resumed_run_records_its_sessions_and_says_so(tmp_path):
    run_json = tmp_path / "run.json"
    run_json.write_text(json.dumps({**_cfg(["ar", "refusion"], "ar"), "created": "2026-01-01T00:00:00",
                                    "sessions": [{"started": "2026-01-01T00:00:00", "models": []}]}))
    summary.session_ran(run_json, "ar")
    summary.session_ran(run_json, "refusion")
    summary.session_ran(run_json, "refusion")  # once per session
    cfg = json.loads(run_json.read_text())
    rows = [_metrics("ar", 50.0, 1.0), _metrics("refusion", 100.0, 2.0)]
    assert summary.session_note(summary.sessions(cfg)) is None
    assert "Resumed" not in summary.markdown(summary.summary(cfg, rows))
    summary.add_session(run_json)  # `--run-id r` again after an interruption
    summary.session_ran(run_json, "refusion")
    cfg = json.loads(run_json.read_text())
    assert [x["models"] for x in cfg["sessions"]] == [["ar", "refusion"], ["refusion"]]
    s = summary.summary(cfg, rows)
    md = summary.markdown(s)
    assert "Resumed run: measured in 2 sessions (started 2026-01-01T00:00:00, " in md
    assert "ar in session 1; refusion in sessions 1, 2." in md and "separate invocations" in md
    assert "resumed, measured in 2 sessions" in summary.one_line(s, tmp_path)
    assert s["sessions"] == cfg["sessions"]


def test_resume_accepts_a_run_json_written_before_units_counted_samples():
    old = [{"name": "t", "leaves": ["t"], "primary": None}]
    new = [{"name": "t", "leaves": ["t"], "primary": None, "samples": 3}]
    assert run_dir._resume_value("units", old) == run_dir._resume_value("units", new)
    assert run_dir._resume_value("limit", 3) == 3


def test_resume_accepts_a_run_json_written_before_this_branch():
    """A run.json from before: resolved knobs with None, no base of an adapter found beside it, no per-leaf
    counts or data hash, no shard. Still resumable; a changed knob or base still is not."""
    old = {"units": [{"name": "t", "leaves": ["t"], "primary": None, "samples": 2}], "limit": 2,
           "models": [{"name": "d", "decoder": "d2f", "knobs": {}, "resolved_knobs": {"t": {"steps": None}}}]}
    new = {"units": [{"name": "t", "leaves": ["t"], "primary": None, "samples": 2, "docs": {"t": 2},
                      "data_sha256": "x", "max_gen_toks": 8}], "limit": 2, "shard": None,
           "models": [{"name": "d", "decoder": "d2f", "knobs": {}, "base": "/ckpt/base",
                       "resolved_knobs": {"t": {"steps": 8}}}]}
    assert run_dir.settings_diff(old, new) == []
    changed = {**new, "models": [{**new["models"][0], "knobs": {"block_size": 4}}]}
    assert run_dir.settings_diff(old, changed) == ["models"]
    with_base = {**old, "models": [{**old["models"][0], "base": "/ckpt/other"}]}
    assert run_dir.settings_diff(with_base, new) == ["models"]


# ---------------------------------------------------------------- library noise


def test_quiet_drops_only_the_metadata_hint_and_the_weight_bar():
    from transformers.utils import logging as hf_logging

    from harness.run.quiet import METADATA_HINT, quiet_libraries

    got: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append(record.getMessage())

    log = logging.getLogger("lm_eval.api.task")
    handler = Keep(level=logging.DEBUG)
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.DEBUG)  # whatever another test left on the lm_eval logger
    was_on = hf_logging.is_progress_bar_enabled()
    try:
        quiet_libraries()
        quiet_libraries()  # idempotent: one filter
        assert len([f for f in log.filters if type(f).__name__ == "DropMetadataHint"]) == 1
        log.warning("embedded_math: " + METADATA_HINT + " in console (as json string) or to the TaskManager.")
        log.warning("a real warning")
        log.error("a real error")
        assert got == ["a real warning", "a real error"]
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        if was_on:
            hf_logging.enable_progress_bar()


def test_loading_an_embedded_task_logs_no_metadata_hint():
    """The real source of the hint: lm-eval loading a task through the custom_dataset hook."""
    from lm_eval.tasks import TaskManager

    from harness.run.quiet import METADATA_HINT, quiet_libraries

    got: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append(record.getMessage())

    log, task_log = logging.getLogger("lm_eval"), logging.getLogger("lm_eval.api.task")
    handler = Keep(level=logging.DEBUG)
    log.addHandler(handler)
    levels = log.level, task_log.level
    log.setLevel(logging.WARNING)
    task_log.setLevel(logging.NOTSET)
    filters = list(task_log.filters)
    tm = TaskManager(include_path=str(REPO / "tasks"), include_defaults=False)
    try:
        for f in filters:  # as lm-eval is out of the box: the hint is there
            task_log.removeFilter(f)
        tm.load(["embedded_math"])
        assert any(METADATA_HINT in m for m in got), got
        got.clear()
        quiet_libraries()
        tm.load(["embedded_math"])
    finally:
        log.removeHandler(handler)
        log.setLevel(levels[0])
        task_log.setLevel(levels[1])
    assert not any(METADATA_HINT in m for m in got), got


# ---------------------------------------------------------------- the guide's lm-eval command


def _readme_lm_eval_command() -> list[str]:
    cmds = re.findall(r"`((?:\.venv/bin/)?python -m harness\.lm_eval_cli run [^`]+)`", RUNNING)
    assert len(cmds) == 1, cmds
    return shlex.split(cmds[0])


@pytest.mark.slow
def test_readme_lm_eval_command_runs_as_written(tmp_path):
    argv = _readme_lm_eval_command()
    assert "--confirm_run_unsafe_code" in argv
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, *argv[1:], "--limit", "1"]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    for task in ("embedded_math", "embedded_code", "embedded_choice"):
        assert task in p.stdout
    assert "Custom kwargs" not in p.stderr and "Loading weights" not in p.stderr
    # Without the consent flag: one error line saying what to add, no traceback.
    bare = [a for a in argv[1:] if a != "--confirm_run_unsafe_code"]
    bare[bare.index("--tasks") + 1] = "embedded_code"
    cmd = [sys.executable, *bare, "--limit", "1"]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: embedded_code executes generated code") and "--confirm_run_unsafe_code" in last


def test_readme_out_folders_are_ignored_by_git():
    """Every OUT folder the README or the guide tells a user to write into is ignored, so the run after it is
    not `(dirty)`."""
    outs = sorted({o for text in USER_DOCS.values() for o in re.findall(r"\bOUT=([\w./-]+)", text)})
    assert "results/table1" in outs, outs
    for out in outs:
        rc = subprocess.run(["git", "check-ignore", "-q", "--no-index", f"{out}/some-run/run.json"],
                            cwd=REPO).returncode
        assert rc == 0, f"{out} is not ignored by .gitignore"


def test_readme_table1_recipe_is_nine_rows_in_one_run():
    """The recipe's models file (examples/table1_models.toml, docs/reproduce-table1.md) holds the nine Table 1
    rows, with enable_thinking=false as Qwen3's and ReFusion's own setting; one `make eval` runs them."""
    from harness.run.model_list import load_models_file

    section = TABLE1.split("## Regenerate Table 1")[1].split("\n## ")[0]
    block = next(b.split("```")[0] for b in section.split("```bash")[1:] if "make report" in b.split("```")[0])
    joined = re.sub(r"\\\n\s*", "", block)
    evals = [ln for ln in joined.splitlines() if "make eval" in ln]
    assert len(evals) == 1, evals
    models_file = shlex.split(evals[0].split("MODELS_FILE=", 1)[1])[0]
    specs = load_models_file(REPO / models_file)
    assert [(m.name, m.decoder) for m in specs] == [
        ("llama3", "ar"), ("qwen3", "ar"), ("llada", "llada"), ("llada_fast_dllm", "fast_dllm"), ("llada_d2f", "d2f"),
        ("dream", "dream"), ("dream_fast_dllm", "fast_dllm"), ("dream_d2f", "d2f"), ("refusion", "refusion")]
    thinking = {m.name: m.knobs.get("chat_template_args") for m in specs}
    assert thinking == {**{m.name: None for m in specs}, "qwen3": {"enable_thinking": False},
                        "refusion": {"enable_thinking": False}}
    assert "RUN=table1" in joined


def test_summary_records_compiled_models():
    """Under the knob compile the summary's rows and per-model totals carry compilations and compile seconds,
    and summary.md names the compiled models; an eager run has no such line."""
    comp = _metrics("refusion", 100.0, 2.0)
    comp["speed"]["compile"] = {"compiled": True, "compilations": 4, "compile_s": 2.5}
    s = summary.summary(_cfg(["ar", "refusion"], "ar", compile={"ar": False, "refusion": True}),
                        [_metrics("ar", 50.0, 1.0), comp], {"refusion": {"compilations": 2, "compile_s": 10.0}})
    row = next(r for r in s["rows"] if r["model"] == "refusion")
    assert row["compiled"] and row["compilations"] == 4 and row["compile_s"] == 2.5
    assert s["compile"] == {"ar": {"compiled": False, "compilations": 0, "compile_s": 0.0, "warmup_compilations": 0,
                                   "warmup_compile_s": 0.0},
                            "refusion": {"compiled": True, "compilations": 6, "compile_s": 12.5,
                                         "warmup_compilations": 2, "warmup_compile_s": 10.0}}
    assert "Compiled decoding (knob compile: torch.compile, static shapes) for refusion (refusion: 6 compilation(s), " \
           "12.5 s, warm-up call included)" in summary.markdown(s)
    eager = summary.summary(_cfg(["ar"], "ar"), [_metrics("ar", 50.0, 1.0)])
    assert "Compiled decoding" not in summary.markdown(eager) and not eager["compile"]["ar"]["compiled"]
