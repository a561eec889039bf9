"""`python -m harness eval` on broken inputs a new user meets: one stderr line naming the file, line,
field or variable to fix, exit 2, no traceback, nothing written into OUT (all caught in validation).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GSM8K_ROW = {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
             "answer": "3 + 4 = 7\n#### 7"}


@pytest.fixture(scope="module")
def setup(make_checkpoint, write_task, tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    return {"ckpt": make_checkpoint(root / "ckpt"), "tasks": write_task(root / "tasks", "tiny_gen", n=3)}


def _eval(capsys, out: Path, *argv: str) -> str:
    """Run the runner in-process; return its one stderr line after checking exit 2 and no traceback."""
    from harness.run import runner

    assert runner.main([*argv, "--out", str(out), "--run-id", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    return err


def _gsm8k_dir(root: Path, lines: list[str]) -> Path:
    (root / "gsm8k").mkdir(parents=True)
    (root / "gsm8k" / "test.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return root


def test_truncated_safetensors_names_the_file(setup, tmp_path, capsys):
    bad = tmp_path / "ckpt"
    shutil.copytree(setup["ckpt"], bad)
    weights = bad / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)  # a copy that stopped half-way
    out = tmp_path / "out"
    err = _eval(capsys, out, "--task", "tiny_gen", "--tasks-dir", str(setup["tasks"]), "--models", f"a={bad}:ar")
    assert str(weights) in err and "cannot be read" in err and "truncated" in err, err
    assert not out.exists()


def test_broken_jsonl_line_names_file_and_line(setup, tmp_path, capsys, monkeypatch):
    good = json.dumps(GSM8K_ROW)
    data = _gsm8k_dir(tmp_path / "data", [good] * 4 + [good[:60]] + [good])  # line 5 cut short
    monkeypatch.setenv("REFUSION_DATA_DIR", str(data))
    out = tmp_path / "out"
    err = _eval(capsys, out, "--task", "gsm8k_cot", "--models", f"a={setup['ckpt']}:ar")
    assert f"{data / 'gsm8k' / 'test.jsonl'}, line 5: not valid JSON" in err and "gsm8k_cot" in err, err
    assert not out.exists()


def test_row_missing_answer_field_names_task_row_and_field(setup, write_task, tmp_path, capsys, monkeypatch):
    rows = [json.dumps(GSM8K_ROW)] * 4
    rows[2] = json.dumps({"question": GSM8K_ROW["question"]})  # line 3 has no answer
    data = _gsm8k_dir(tmp_path / "data", rows)
    monkeypatch.setenv("REFUSION_DATA_DIR", str(data))
    out = tmp_path / "out"
    err = _eval(capsys, out, "--task", "gsm8k_cot", "--models", f"a={setup['ckpt']}:ar")
    assert "gsm8k_cot" in err and f"{data / 'gsm8k' / 'test.jsonl'}, line 3" in err and "'answer'" in err, err
    assert "UndefinedError" not in err
    assert not out.exists()

    # A task of one's own (plain lm-eval JSON data) whose rows lack the field its target template reads:
    # named by the task and the field, not a jinja traceback.
    tasks = write_task(tmp_path / "tasks", "tiny_gen", n=3)
    rows = [json.loads(line) for line in (tasks / "tiny_gen.jsonl").read_text().splitlines()]
    (tasks / "tiny_gen.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "a"}) + "\n"
                                                  for r in rows))
    err = _eval(capsys, out, "--task", "tiny_gen", "--tasks-dir", str(tasks), "--models", f"a={setup['ckpt']}:ar")
    assert "task 'tiny_gen'" in err and "'a' is undefined" in err, err
    assert not out.exists()


def test_offline_without_data_dir_says_to_set_it(setup, tmp_path):
    """Through the real command line, with an empty Hugging Face cache so the result does not depend
    on what this machine happened to download."""
    env = {k: v for k, v in os.environ.items() if k != "REFUSION_DATA_DIR"}
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    env.pop("HF_DATASETS_CACHE", None)
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "harness", "eval", "--task", "gsm8k_cot", "--models",
                        f"a={setup['ckpt']}:ar", "--out", str(out)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    err = p.stderr.strip()
    assert p.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "not available offline" in err and "REFUSION_DATA_DIR" in err and "gsm8k/test.jsonl" in err, err
    assert "gsm8k_cot" in err
    assert not out.exists()


def test_callback_hook_is_not_a_knob(setup, tmp_path, capsys):
    from refusion.decoding import DECODERS

    names = DECODERS["refusion"].knobs.names()
    assert "on_commit" not in names and "slot_size" in names
    out = tmp_path / "out"
    err = _eval(capsys, out, "--task", "tiny_gen", "--tasks-dir", str(setup["tasks"]),
                "--models", f"a={setup['ckpt']}:refusion:on_commit=1")
    assert "unknown knob(s) on_commit for decoder 'refusion'; valid knobs: " in err, err
    assert "on_commit" not in err.split("valid knobs:")[1]
    assert not out.exists()

    # --debug: the same error, raised with its traceback instead of the one line.
    from harness.run import runner

    with pytest.raises(runner.InputError, match="on_commit"):
        runner.main(["--task", "tiny_gen", "--tasks-dir", str(setup["tasks"]), "--models",
                     f"a={setup['ckpt']}:refusion:on_commit=1", "--out", str(out), "--debug"])
    assert not out.exists()


def _deny(monkeypatch, folder: Path, bit: int) -> None:
    """Make the runner's permission check refuse ``bit`` on ``folder``: root may write anywhere and the
    temp directory's own mode varies (a private ``mktemp -d`` TMPDIR), so the refusal is injected."""
    from harness.run import run_dir

    real = run_dir._may
    monkeypatch.setattr(run_dir, "_may", lambda p, mode: not (Path(p) == folder and mode & bit) and real(p, mode))


def test_read_only_out_folder_is_refused_before_any_model_runs(setup, tmp_path, capsys, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    _deny(monkeypatch, ro, os.W_OK)
    err = _eval(capsys, ro / "runs", "--task", "tiny_gen", "--tasks-dir", str(setup["tasks"]),
                "--models", f"a={setup['ckpt']}:ar")
    assert f"--out folder {str(ro)!r} is not writable" in err, err
    assert list(ro.iterdir()) == []


def test_out_folder_below_an_unsearchable_folder_is_one_error_line(setup, tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    (locked / "inner").mkdir(parents=True)
    with monkeypatch.context() as m:
        _deny(m, locked, os.X_OK)
        err = _eval(capsys, locked / "inner" / "runs", "--task", "tiny_gen", "--tasks-dir", str(setup["tasks"]),
                    "--models", f"a={setup['ckpt']}:ar")
    assert f"folder {str(locked)!r} cannot be entered" in err, err
    assert list((locked / "inner").iterdir()) == []
    if os.geteuid() != 0:
        # Not root: the real thing too, where stat() itself raises PermissionError below the folder.
        locked.chmod(0)
        try:
            err = _eval(capsys, locked / "inner" / "runs", "--task", "tiny_gen", "--tasks-dir",
                        str(setup["tasks"]), "--models", f"a={setup['ckpt']}:ar")
        finally:
            locked.chmod(0o755)
        assert str(locked) in err, err


def test_bfloat16_on_the_cpu_warns_in_one_line(setup, tmp_path, capsys):
    from harness.run import runner

    out = tmp_path / "out"
    assert runner.main(["--task", "tiny_gen", "--tasks-dir", str(setup["tasks"]), "--models", f"a={setup['ckpt']}:ar",
                        "--device", "cpu", "--dtype", "bfloat16", "--dry-run", "--out", str(out)]) == 0
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning: ")]
    assert warnings == [f"warning: {runner.dtype_warning({'device': 'cpu', 'dtype': 'bfloat16'})}"], warnings
    assert "bfloat16 on the CPU is slow" in warnings[0]
    assert runner.dtype_warning({"device": "cpu", "dtype": "float32"}) is None
    assert not out.exists()


def test_worker_error_is_passed_on_as_one_line(setup, tmp_path, capsys, monkeypatch):
    """An error only the model's worker can meet (its one line left in the error file, exit 2) reaches
    the user as one runner line with the resume hint, instead of "failed (exit N)"."""
    from harness.run import launch, runner

    def fake_worker(cmd, env, server=None):
        err_file = Path(cmd[cmd.index("--error-file") + 1])
        err_file.parent.mkdir(parents=True, exist_ok=True)
        err_file.write_text("checkpoint file '/x/model.safetensors' cannot be read: truncated\n")
        return 2

    monkeypatch.setattr(launch, "run_worker", fake_worker)
    out = tmp_path / "out"
    assert runner.main(["--task", "tiny_gen", "--tasks-dir", str(setup["tasks"]), "--models", f"a={setup['ckpt']}:ar",
                        "--out", str(out), "--run-id", "x"]) == 2
    lines = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.startswith("error: ")]
    assert lines == ["error: model 'a': checkpoint file '/x/model.safetensors' cannot be read: truncated; "
                     "fix it and rerun with --run-id x to resume"]
    assert not (out / "x" / "models" / "a" / "error.txt").exists()
