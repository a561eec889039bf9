"""docs/extending.md, executed: the example task beside a built-in one through `make eval`, the example
model family, custom tasks as first-class (--tasks-dir adds; validate-tasks checks any task), and the
bad inputs an extender meets, each one `error:` line and exit 2 before any model runs.

(The guide's third example, the decoder, runs the conformance suite in tests/test_conformance.py.)
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from harness.run import runner
from tasks import validate

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_TASKS = REPO / "examples" / "tasks"
GUIDE = (REPO / "docs" / "extending.md").read_text(encoding="utf-8")


def _error(capsys, argv: list[str], out: Path) -> str:
    assert runner.main(argv + ["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert not out.exists()  # nothing written
    return err


# ---------------------------------------------------------------- the example task


@pytest.mark.slow  # 53 s; make test runs a --tasks-dir task through the runner (tests/test_checkpoints.py)
def test_example_task_runs_beside_a_builtin_one_through_make_eval(tmp_path, fake_venv):
    out = tmp_path / "runs"
    # The command docs/extending.md gives, with a model, a run id and an output folder of the test's.
    command = "make eval TASK=embedded_math,arith TASKS_DIR=examples/tasks LIMIT=2"
    assert command in GUIDE
    p = subprocess.run([*command.split(), "-s", f"VENV={fake_venv}", "MODELS=ar", "EVAL_ARGS=--threads 1 --run-id ex",
                        f"OUT={out}"], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    run = json.loads((out / "ex" / "run.json").read_text())
    assert [u["name"] for u in run["units"]] == ["embedded_math", "arith"]
    assert run["tasks_dirs"] == [str(EXAMPLE_TASKS)]
    for unit in ("embedded_math", "arith"):
        metrics = json.loads((out / "ex" / "metrics" / f"ar__{unit}.json").read_text())
        assert metrics["speed"]["samples"] == 2 and metrics["quality_primary"] in metrics["quality"], metrics
    rows = [json.loads(line) for line in (out / "ex" / "models" / "ar" / "samples" / "arith.jsonl").open()]
    assert [r["target"] for r in rows] == ["42", "56"]  # the file's answers, not the field's name


def test_tasks_dir_adds_to_the_builtin_tasks_and_later_folders_win(write_task, tmp_path):
    other = write_task(tmp_path / "mine", "tiny_gen", n=3)
    units = runner.resolve_units("embedded_math,arith,tiny_gen", [EXAMPLE_TASKS, other], limit=2)
    assert [u["name"] for u in units] == ["embedded_math", "arith", "tiny_gen"]


def test_validate_tasks_checks_a_custom_task(tmp_path, capsys):
    assert "make validate-tasks TASKS_DIR=examples/tasks VALIDATE_ARGS='--tasks arith'" in GUIDE
    assert validate.main(["--tasks", "arith", "--tasks-dir", str(EXAMPLE_TASKS)]) == 0
    out = capsys.readouterr().out
    assert "items=10" in out and "exact_match,last_number: gold=1.0000 wrong=0.0000" in out, out
    # A row with an empty answer is named; so is a target the filters cannot read back.
    bad = tmp_path / "bad"
    bad.mkdir()
    rows = [json.loads(line) for line in (EXAMPLE_TASKS / "arith" / "arith.jsonl").open()]
    rows[3]["answer"] = ""
    (bad / "arith2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    yaml = (EXAMPLE_TASKS / "arith" / "arith.yaml").read_text()
    yaml = yaml.replace("task: arith", "task: arith2").replace("examples/tasks/arith/arith.jsonl",
                                                               str(bad / "arith2.jsonl"))
    (bad / "arith2.yaml").write_text(yaml)
    assert validate.main(["--tasks", "arith2", "--tasks-dir", str(bad)]) == 1
    assert "arith2 row 4: target field 'answer' is empty" in capsys.readouterr().out


# ---------------------------------------------------------------- the example family


def test_example_family_folder_loads_with_bidirectional_attention(tmp_path, monkeypatch, make_checkpoint,
                                                                  load_example):
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from harness.models import families
    from harness.models.checkpoints import inspect_checkpoint, load_model

    monkeypatch.setattr(families, "FAMILIES", dict(families.FAMILIES))
    monkeypatch.setattr(families, "MODEL_TYPES", dict(families.MODEL_TYPES))
    # A folder laid out like such a release: Llama fields and tensor names, its own model_type.
    folder = tmp_path / "bidir-llama"
    tok = AutoTokenizer.from_pretrained(str(make_checkpoint(tmp_path / "tok")))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(model_type="bidir_llama", architectures=["BidirLlamaForMaskedDiffusion"])
    (folder / "config.json").write_text(json.dumps(raw))

    with pytest.raises(ValueError, match="model_type 'bidir_llama' is not a family"):
        inspect_checkpoint(folder)
    load_example("family_bidir_llama").register_example()
    info = inspect_checkpoint(folder)
    assert info.family.name == "bidir_llama" and info.causal is False
    loaded = load_model(folder)
    assert type(loaded.model).__name__ == "LlamaForCausalLM"
    assert loaded.mask_id == tok.mask_token_id  # from the tokenizer, by the family's mask token
    # Bidirectional for real: changing the last token changes the first position's logits.
    ids = torch.tensor([[5, 6, 7, 8]])
    other = torch.tensor([[5, 6, 7, 9]])
    with torch.no_grad():
        a, b = loaded.model(input_ids=ids).logits, loaded.model(input_ids=other).logits
    assert not torch.allclose(a[0, 0], b[0, 0])
    from refusion.decoding import check_attention

    check_attention("llada", info.causal)  # a masked-diffusion decoder takes it
    with pytest.raises(ValueError, match="needs a causal model"):
        check_attention("ar", info.causal)


# ---------------------------------------------------------------- bad inputs: one line, exit 2, nothing run


def test_block_length_that_does_not_divide_a_task_budget_stops_the_dry_run(write_task, tmp_path, capsys,
                                                                            tiny_checkpoint):
    tasks = write_task(tmp_path / "tasks", "tiny_gen", n=2)
    yaml = tasks / "tiny_gen.yaml"
    yaml.write_text(yaml.read_text().replace("max_gen_toks: 6", "max_gen_toks: 50"))
    models = f"x={tiny_checkpoint('mdm')}:llada"
    for extra in (["--dry-run"], []):
        err = _error(capsys, ["--task", "tiny_gen", "--tasks-dir", str(tasks), "--models", models, *extra],
                     tmp_path / "out")
        assert "model 'x' on task 'tiny_gen' (its max_gen_toks 50 is the gen_length)" in err, err
        assert "block_length must divide gen_length 50, got 32" in err, err
    # The dry run shows the real budget it checked, not a placeholder.
    assert runner.main(["--task", "tiny_gen", "--tasks-dir", str(tasks), "--models", models + ":block_length=10",
                        "--dry-run", "--out", str(tmp_path / "out")]) == 0
    assert "gen_length=50" in capsys.readouterr().out


def test_a_row_without_its_target_field_is_named_before_anything_runs(tmp_path, capsys, tiny_checkpoint):
    tasks = tmp_path / "tasks"
    (tasks / "arith").mkdir(parents=True)
    rows = [json.loads(line) for line in (EXAMPLE_TASKS / "arith" / "arith.jsonl").open()]
    del rows[2]["answer"]
    data = tasks / "arith" / "arith.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    yaml = (EXAMPLE_TASKS / "arith" / "arith.yaml").read_text().replace("examples/tasks/arith/arith.jsonl", str(data))
    (tasks / "arith" / "arith.yaml").write_text(yaml)
    err = _error(capsys, ["--task", "arith", "--tasks-dir", str(tasks), "--models", "ar"], tmp_path / "out")
    assert f"task 'arith', row 3 of {data}: target field 'answer' is null" in err, err
    # The whole column gone: lm-eval would score against the literal 'answer'; here it is one line too.
    for r in rows:
        r.pop("answer", None)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    err = _error(capsys, ["--task", "arith", "--tasks-dir", str(tasks), "--models", "ar"], tmp_path / "out")
    assert f"row 1 of {data}: no target field 'answer'" in err, err


def test_validate_tasks_without_data_is_one_error_line(monkeypatch, capsys):
    monkeypatch.delenv("REFUSION_DATA_DIR", raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert validate.main(["--tasks", "gsm8k_cot", "--limit", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: gsm8k/test: data is not available offline") and "\n" not in err, err
    assert "REFUSION_DATA_DIR" in err
