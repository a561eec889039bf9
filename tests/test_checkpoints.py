"""Checkpoint folders checked completely before any model runs, loaded by family, with the run's dtype,
chat-template arguments and the knob values each (model, task) really uses (harness/models/checkpoints.py,
harness/models/families.py, harness/run/runner.py). The released layouts themselves are tested against their
authors' own outputs in tests/test_released_fixtures.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def setup(make_checkpoint, write_task, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {"ckpt": make_checkpoint(root / "ckpt"), "mdm": make_checkpoint(root / "mdm", causal=False, seed=1),
            "tasks": write_task(root / "tasks", "tiny_gen", n=2)}


def _error(capsys, out: Path, setup, models: str, *extra: str) -> str:
    """The runner's one stderr line for a bad MODELS, after checking exit 2 and that nothing was written."""
    from harness.run import runner

    rc = runner.main(["--task", "tiny_gen", "--tasks-dir", str(setup["tasks"]), "--models", models,
                      "--out", str(out), "--run-id", "x", *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert not out.exists()
    return err


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unknown_family_is_one_line_naming_config_even_as_the_last_model(setup, tmp_path, capsys):
    bad = _copy(setup["ckpt"], tmp_path / "odd")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "mamba_plus"
    (bad / "config.json").write_text(json.dumps(cfg))
    err = _error(capsys, tmp_path / "out", setup, f"a={setup['ckpt']}:ar,b={bad}:ar")
    assert "model 'b'" in err and str(bad / "config.json") in err and "'mamba_plus'" in err, err
    assert err.count(str(bad / "config.json")) == 1 and "docs/extending.md" in err, err  # the path once
    assert "pip install" not in err


def test_no_weights_and_truncated_shard_of_an_index(setup, tmp_path, capsys):
    empty = _copy(setup["ckpt"], tmp_path / "empty")
    (empty / "model.safetensors").unlink()
    err = _error(capsys, tmp_path / "out", setup, f"a={setup['ckpt']}:ar,b={empty}:ar")
    assert "has no weights" in err and str(empty) in err, err

    # Sharded like the 8B releases: the last shard listed by the index is cut short.
    from safetensors.torch import load_file, save_file

    sharded = _copy(setup["ckpt"], tmp_path / "sharded")
    state = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(sharded / fname), metadata={"format": "pt"})
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in halves.items() for k in ks}}))
    from harness.models.checkpoints import load_model

    assert load_model(sharded).model.config.vocab_size > 0  # the sharded folder loads as it is
    capsys.readouterr()  # transformers' loading bar
    last = sharded / "model-00002-of-00002.safetensors"
    os.truncate(last, last.stat().st_size - 100)
    err = _error(capsys, tmp_path / "out2", setup, f"a={setup['ckpt']}:ar,b={sharded}:ar")
    assert str(last) in err and "truncated" in err, err
    last.unlink()
    err = _error(capsys, tmp_path / "out3", setup, f"b={sharded}:ar")
    assert "not in the folder" in err and last.name in err, err


def test_broken_tokenizer_is_caught_before_anything_runs(setup, tmp_path, capsys):
    bad = _copy(setup["ckpt"], tmp_path / "badtok")
    (bad / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')  # cut short
    err = _error(capsys, tmp_path / "out", setup, f"a={setup['ckpt']}:ar,b={bad}:ar")
    assert "model 'b'" in err and "tokenizer" in err and str(bad) in err, err


def test_weights_under_other_names_are_caught_before_loading(setup, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    bad = _copy(setup["ckpt"], tmp_path / "renamed")
    state = load_file(str(bad / "model.safetensors"))
    state = {k.replace("self_attn.q_proj", "attn.wq"): v for k, v in state.items()}
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    err = _error(capsys, tmp_path / "out", setup, f"b={bad}:ar")
    assert "qwen3 family" in err and "q_proj" in err, err


def test_attention_guard_both_ways(setup, tmp_path, capsys):
    err = _error(capsys, tmp_path / "o1", setup, f"m={setup['mdm']}:ar")
    assert "decoder 'ar' needs a causal model" in err and "bidirectional" in err and "llada" in err, err
    err = _error(capsys, tmp_path / "o2", setup, f"c={setup['ckpt']}:llada")
    assert "decoder 'llada' needs a bidirectional model" in err, err
    from harness.run.lm_adapter import RefusionBenchLM

    with pytest.raises(ValueError, match="needs a bidirectional model"):
        RefusionBenchLM(pretrained=str(setup["ckpt"]), decoder="fast_dllm")


def test_adapter_whose_base_is_missing(setup, tmp_path, capsys):
    adapter = tmp_path / "D2F_Tiny_Lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "base_model_name_or_path": "SomeOrg/Tiny-Base", "r": 2, "lora_alpha": 2,
         "target_modules": ["q_proj", "v_proj"]}))
    from safetensors.torch import save_file

    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 32)},
              str(adapter / "adapter_model.safetensors"))
    err = _error(capsys, tmp_path / "out", setup, f"a={setup['ckpt']}:ar,d={adapter}:d2f")
    assert "'SomeOrg/Tiny-Base'" in err and "base=DIR" in err and str(adapter) in err, err
    err = _error(capsys, tmp_path / "out2", setup, f"d={adapter}:d2f:base={tmp_path / 'nowhere'}")
    assert "nowhere" in err, err


def test_lora_merge_equals_peft_forward(setup, tmp_path):
    """A LoRA adapter saved by peft on the tiny bidirectional model: merged by the loader == peft's own forward."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(setup["mdm"])).eval()
    torch.manual_seed(0)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                  "o_proj"]))
    for n, p in peft_model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)  # B = 0 at init would make the merge a no-op
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(str(adapter))
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"]  # as published: a name that need not be a local folder
    x = torch.tensor([[5, 9, 33, 7, 40, 7]])
    with torch.no_grad():
        want = peft_model(x).logits
    from harness.models.checkpoints import load_model

    loaded = load_model(adapter, base=setup["mdm"])
    assert loaded.info.adapter is not None and loaded.model.config.is_causal is False
    assert not any("lora" in n for n, _ in loaded.model.named_parameters())  # merged, not wrapped
    with torch.no_grad():
        got = loaded.model(x).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_dtype_and_chat_template_args_are_recorded_and_applied(setup, tmp_path, capsys):
    from harness.run import runner

    out = tmp_path / "out"
    rc = runner.main(["--task", "tiny_gen", "--tasks-dir", str(setup["tasks"]), "--models", f"a={setup['ckpt']}:ar",
                      "--out", str(out), "--run-id", "r", "--limit", "1", "--dtype", "bfloat16",
                      "--chat-template-args", "enable_thinking=false,style=terse",
                      "--timing", "sequential", "--memory-items", "0"])  # no rounds, no memory pass: not checked here
    assert rc == 0, capsys.readouterr().err
    run = json.loads((out / "r" / "run.json").read_text())
    assert run["dtype"] == "bfloat16" and run["dtype_requested"] == "bfloat16"
    assert run["chat_template_args"] == {"enable_thinking": False, "style": "terse"}
    metrics = json.loads(next((out / "r" / "metrics").glob("a__*.json")).read_text())
    assert metrics["run"]["dtype"] == "bfloat16"

    from harness.run.lm_adapter import RefusionBenchLM

    lm = RefusionBenchLM(pretrained=str(setup["ckpt"]), decoder="ar", dtype="auto",
                         chat_template_args="shout=true")
    assert lm.dtype == "float32" and next(lm.model.parameters()).dtype == torch.float32  # auto on the CPU
    lm.tokenizer.chat_template = "{% if shout %}LOUD {% endif %}{{ messages[0]['content'] }}"
    assert lm.apply_chat_template([{"role": "user", "content": "hi"}]) == "LOUD hi"


def test_dry_run_prints_the_resolved_knobs_that_run_json_records(setup, tmp_path, capsys):
    from harness.run import runner

    out = tmp_path / "out"
    args = ["--task", "embedded_math,embedded_code", "--models", f"rf={setup['ckpt']}:refusion,refusion",
            "--out", str(out), "--run-id", "r", "--limit", "1"]
    assert runner.main([*args, "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert not out.exists()
    # The tiny preset keeps its own slot settings; a plain folder gets the task's gen_length and the defaults.
    assert re.search(r"rf: decoder refusion on .* \(qwen3 family, causal\)", printed), printed
    cfg = runner.build_config(runner._parser().parse_args([*args]))
    resolved = {m["name"]: m["resolved_knobs"] for m in cfg["models"]}
    assert resolved["refusion"]["embedded_math"]["slot_size"] == 4
    assert resolved["refusion"]["embedded_math"]["gen_length"] == 96
    assert resolved["rf"]["embedded_code"]["gen_length"] == 32 and resolved["rf"]["embedded_code"]["seed"] == 1234
    for name, per_leaf in resolved.items():
        for leaf, knobs in per_leaf.items():
            line = f"  {leaf}: " + ", ".join(f"{k}={v}" for k, v in sorted(knobs.items()))
            assert line in printed, (name, line)


RELEASED = Path(__file__).resolve().parent / "fixtures" / "released"


def test_adapter_given_a_wrong_base_fails_the_dry_run(setup, tmp_path, capsys):
    """The D2F-Dream adapter given LLaDA as its base (same hidden size, other k/v sizes), and the D2F-LLaDA
    adapter given Dream (its modules do not exist there): one error line, exit 2, nothing written."""
    err = _error(capsys, tmp_path / "out", setup, f"d={RELEASED}/d2f_dream:d2f:base={RELEASED}/llada", "--dry-run")
    assert "does not fit its base" in err and str(RELEASED / "llada") in err and "k_proj.lora_B" in err, err
    assert "[32, 32]" in err and "[64, 64]" in err, err  # the adapter's shape and the base's
    err = _error(capsys, tmp_path / "out", setup, f"d={RELEASED}/d2f_llada:d2f:base={RELEASED}/dream_base")
    assert "does not fit its base" in err and "attn_out" in err, err
    # Without --dry-run the same line, still before run.json.
    err = _error(capsys, tmp_path / "out", setup, f"d={RELEASED}/d2f_dream:d2f:base={RELEASED}/llada")
    assert "does not fit its base" in err, err


def test_base_used_is_warned_about_recorded_and_shown(setup, tmp_path, capsys):
    """A same-shape base of another name (Dream-Instruct for Dream-Base) passes with a warning naming both;
    a base found beside the adapter is printed by the dry run and recorded in the run's settings."""
    from harness.run import runner

    args = ["--task", "tiny_gen", "--tasks-dir", str(setup["tasks"]), "--out", str(tmp_path / "out"), "--dry-run"]
    assert runner.main([*args, "--models", f"d={RELEASED}/d2f_dream:d2f:gen_length=8,block_size=4,base={RELEASED}/dream_instruct"]) == 0
    cap = capsys.readouterr()
    warnings = [ln for ln in cap.err.splitlines() if ln.startswith("warning: ")]
    assert len(warnings) == 1 and "'Dream-org/Dream-v0-Base-7B'" in warnings[0], cap.err
    assert str(RELEASED / "dream_instruct") in warnings[0]
    assert f"LoRA on base {RELEASED / 'dream_instruct'}" in cap.out, cap.out
    # Beside the adapter, under the name its adapter_config.json gives: found, no warning, recorded.
    shutil.copytree(RELEASED / "d2f_dream", tmp_path / "D2F_Dream_Base_7B_Lora")
    shutil.copytree(RELEASED / "dream_base", tmp_path / "Dream-v0-Base-7B")
    models = f"d={tmp_path / 'D2F_Dream_Base_7B_Lora'}:d2f:gen_length=8,block_size=4"
    assert runner.main([*args, "--models", models]) == 0
    cap = capsys.readouterr()
    assert "warning" not in cap.err and f"LoRA on base {tmp_path / 'Dream-v0-Base-7B'}" in cap.out, cap
    cfg = runner.build_config(runner._parser().parse_args([*args, "--models", models]))
    assert cfg["models"][0]["base"] == str((tmp_path / "Dream-v0-Base-7B").resolve())
    assert not (tmp_path / "out").exists()


def test_resolved_knobs_show_values_never_none(setup, tmp_path):
    from harness.run import model_check, runner
    from refusion.decoding import DECODERS, make_knobs

    for dec in DECODERS:
        shown = model_check.shown_values(make_knobs(dec, {"gen_length": 512}).to_dict())
        assert None not in shown.values(), (dec, shown)
    assert model_check.shown_values(make_knobs("llada", {"gen_length": 512}).to_dict())["steps"] == 512
    cfg = runner.build_config(runner._parser().parse_args(
        ["--task", "tiny_gen", "--tasks-dir", str(setup["tasks"]), "--out", str(tmp_path / "o"),
         "--models", f"l={setup['mdm']}:llada:gen_length=64,m={setup['mdm']}:llada:block_length=2,"
                     f"f={setup['mdm']}:fast_dllm:block_length=2"]))
    knobs = {m["name"]: m["resolved_knobs"]["tiny_gen"] for m in cfg["models"]}
    # steps = gen_length; without a gen_length knob that is the task's max_gen_toks (6), checked against the blocks
    assert knobs["l"]["steps"] == 64 and knobs["m"]["steps"] == knobs["m"]["gen_length"] == 6
    assert knobs["f"]["commit_first"] is False and knobs["f"]["top_p"] == "off"
    assert all(v is not None for k in knobs.values() for v in k.values()), knobs


def test_long_errors_keep_their_end(setup, tmp_path):
    """A tokenizer error is cut in the middle, so the missing file's name at its end stays."""
    from harness.models.checkpoints import CheckpointError, check_tokenizer, clip_middle, inspect_checkpoint

    text = "Error while loading: " + "x " * 400 + "/ckpt/Qwen3-8B/merges.txt"
    assert clip_middle(text).endswith("/ckpt/Qwen3-8B/merges.txt") and len(clip_middle(text)) <= 300
    assert clip_middle("short one") == "short one"
    bad = _copy(RELEASED / "refusion", tmp_path / "refusion")
    (bad / "merges.txt").unlink()  # a byte-level BPE without its merges
    info = inspect_checkpoint(bad)
    with pytest.raises(CheckpointError) as e:
        check_tokenizer(info)
    assert len(str(e.value)) < 600 and str(bad) in str(e.value)


def test_chat_template_args_per_model_over_the_run_default(setup, tmp_path, capsys):
    """Qwen3 / ReFusion with enable_thinking=false beside templates that take no argument, in one run: a model's
    own chat_template_args replace the run-wide default for that model (empty: none), recorded per model."""
    from harness.run import runner

    args = ["--task", "tiny_gen", "--tasks-dir", str(setup["tasks"]), "--out", str(tmp_path / "out"),
            "--chat-template-args", "enable_thinking=false",
            "--models", f"q={setup['ckpt']}:ar,l={setup['ckpt']}:ar:chat_template_args=,"
                        f"s={setup['ckpt']}:ar:gen_length=8,chat_template_args=style=terse;enable_thinking=true"]
    cfg = runner.build_config(runner._parser().parse_args(args))
    # A model records its own arguments only (a run.json of an older run still resumes); the others get the
    # run's, as the worker reads them.
    got = {m["name"]: m.get("chat_template_args", cfg["chat_template_args"]) for m in cfg["models"]}
    assert got == {"q": {"enable_thinking": False}, "l": {}, "s": {"style": "terse", "enable_thinking": True}}
    assert "chat_template_args" not in cfg["models"][0]
    assert all("chat_template_args" not in m["knobs"] for m in cfg["models"])
    assert cfg["models"][2]["knobs"] == {"gen_length": 8}
    assert runner.main([*args, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "l: decoder ar" in out and "chat template arguments {}" in out
    assert "chat template arguments {'style': 'terse', 'enable_thinking': True}" in out
    bad = [*args[:-1], f"x={setup['ckpt']}:ar:chat_template_args=oops"]
    err = _error(capsys, tmp_path / "out", setup, bad[-1], "--chat-template-args", "enable_thinking=false")
    assert "model 'x': chat_template_args: chat template argument 'oops': expected name=value" in err, err
