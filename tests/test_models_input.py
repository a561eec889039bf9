"""How a run's models are given (harness/run/model_list.py, harness/run/hints.py): MODELS strings read
strictly (a missing comma names the model it swallowed), chat-template arguments that must be literals,
the models file (examples/table1_models.toml through the dry run on the released layouts), and errors
that point at the fix (did you mean, a short list of valid names, the knob that changed on a refused
resume). Nothing decodes here: every case stops at validation or in the dry run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness.run import hints, runner
from harness.run.model_list import InputError, load_models_file, parse_models

REPO = Path(__file__).resolve().parents[1]
RELEASED = REPO / "tests" / "fixtures" / "released"
EXAMPLE = REPO / "examples" / "table1_models.toml"
TINY = REPO / "checkpoints" / "tiny"
# The README's download folders (examples/table1_models.toml's paths) -> the released layouts standing in for them.
CKPT = {"Meta-Llama-3-8B-Instruct": RELEASED / "llama3", "Qwen3-8B": RELEASED / "qwen3",
        "LLaDA-8B-Instruct": RELEASED / "llada", "Dream-v0-Instruct-7B": RELEASED / "dream_instruct",
        "Dream-v0-Base-7B": RELEASED / "dream_base", "D2F_LLaDA_Instruct_8B_Lora": RELEASED / "d2f_llada",
        "D2F_Dream_Base_7B_Lora": RELEASED / "d2f_dream", "ReFusion": RELEASED / "refusion"}


@pytest.fixture(scope="module")
def tasks(write_task, tmp_path_factory):
    return write_task(tmp_path_factory.mktemp("models-input") / "tasks", "tiny_gen", n=3)


def _eval(capsys, *argv: str) -> tuple[int, str]:
    rc = runner.main(list(argv))
    return rc, capsys.readouterr().err.strip()


def _one_error(rc: int, err: str) -> str:
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("where, models, swallowed, owner", [
    ("after a template argument",
     "qwen3={a}:ar:chat_template_args=enable_thinking=false" "refusion={r}:refusion:chat_template_args=enable_thinking=false",
     "refusion", "qwen3"),
    ("after a decoder", "llama3={a}:ar" "qwen3={a}:ar:chat_template_args=enable_thinking=false", "qwen3", "llama3"),
    ("after a knob", "llada={m}:llada:block_length=32" "llada_fast_dllm={m}:fast_dllm:block_length=32,threshold=0.9",
     "llada_fast_dllm", "llada"),
    ("after a word knob", "fd={m}:fast_dllm:cache=dual" "dream={d}:dream:alg=entropy", "dream", "fd"),
])
def test_a_missing_comma_names_the_swallowed_model(tasks, tmp_path, capsys, where, models, swallowed, owner):
    spec = models.format(a=TINY / "ar", r=TINY / "refusion", m=TINY / "mdm", d=TINY / "dream")
    out = tmp_path / "out"
    err = _one_error(*_eval(capsys, "--task", "tiny_gen", "--tasks-dir", str(tasks), "--models", spec,
                            "--out", str(out), "--run-id", "r"))
    assert f"model {swallowed!r} was swallowed by model {owner!r}" in err, err
    assert f"a comma is missing before '{swallowed}='" in err, err
    assert not out.exists()


def test_chat_template_arguments_are_literals_and_names_are_unique():
    ck = TINY / "ar"
    assert parse_models(f"q={ck}:ar:chat_template_args=enable_thinking=false;n=3;style=short")[0].knobs == {
        "chat_template_args": "enable_thinking=false;n=3;style=short"}
    for spec, words in ((f"q={ck}:ar:chat_template_args=enable_thinking=no", "enable_thinking must be true or false"),
                        (f"q={ck}:ar:chat_template_args=enable_thinking=1", "enable_thinking must be true or false"),
                        (f"q={ck}:ar:chat_template_args=style=a b", "must be a number, true/false or a short word"),
                        (f"q={ck}:ar:chat_template_args=oops", "expected name=value"),
                        (f"q={ck}:ar,q={ck}:refusion", "model name(s) used twice: q"),
                        ("ar:gen_length=8,gen_length=9", "knob gen_length given twice")):
        with pytest.raises(InputError) as e:
            parse_models(spec)
        assert words in str(e.value), (spec, str(e.value))
    with pytest.raises(InputError, match="--chat-template-args: enable_thinking must be true or false"):
        runner.template_args("enable_thinking=maybe")


def test_typos_get_a_did_you_mean_and_a_short_list(tasks, tmp_path, capsys):
    out = tmp_path / "out"
    base = ["--tasks-dir", str(tasks), "--out", str(out), "--run-id", "r"]
    err = _one_error(*_eval(capsys, "--task", "gsm8kk", *base, "--models", "ar"))
    assert err.startswith("error: unknown task 'gsm8kk' (did you mean 'gsm8k'?); valid tasks: "), err
    assert "mmlu_pro (+14 subtasks)" in err and "mmlu_pro_law" not in err and len(err) < 400, (len(err), err)
    cases = [("refusoin", "unknown model name 'refusoin' (did you mean 'refusion'?)"),
             (f"a={TINY / 'ar'}:refusoin", "model 'a': unknown decoder 'refusoin' (did you mean 'refusion'?)"),
             (f"a={TINY / 'refusion'}:refusion:slot_sise=4",
              "model 'a': unknown knob(s) slot_sise for decoder 'refusion' (did you mean 'slot_size'?); valid knobs:")]
    for models, words in cases:
        err = _one_error(*_eval(capsys, "--task", "tiny_gen", *base, "--models", models))
        assert words in err, err
    assert not out.exists()
    assert hints.did_you_mean("zzz", ["ar", "refusion"]) == ""
    assert hints.short_list([f"t{i}" for i in range(30)], lister="ls") == \
        ", ".join(f"t{i}" for i in range(16)) + ", ... (14 more); `ls` lists every one"


def test_a_refused_resume_names_the_knob_that_changed(tasks, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["--task", "tiny_gen", "--tasks-dir", str(tasks), "--out", str(out), "--run-id", "r"]
    cfg = runner.build_config(runner._parser().parse_args([*args, "--models", f"a={TINY / 'ar'}:ar:gen_length=8"]))
    (out / "r").mkdir(parents=True)
    (out / "r" / "run.json").write_text(json.dumps({**cfg, "run_id": "r"}))
    err = _one_error(*_eval(capsys, *args, "--models", f"a={TINY / 'ar'}:ar:gen_length=16,b={TINY / 'ar'}:ar"))
    assert "run 'r' exists with different settings (models: model 'b' added; model 'a' knobs gen_length: 8 -> 16" \
        in err, err
    assert sorted(p.name for p in (out / "r").iterdir()) == [".lock", "run.json"]


def _ckpt_folders(root: Path) -> Path:
    """The README's /ckpt folders as symlinks to the released layouts (a base beside its adapter)."""
    ckpt = root / "ckpt"
    ckpt.mkdir()
    for name, target in CKPT.items():
        (ckpt / name).symlink_to(target, target_is_directory=True)
    return ckpt


def _table1_setup(tmp_path: Path, monkeypatch) -> Path:
    """The example models file pointed at the release fixtures (``_ckpt_folders``) and one GSM8K item as the
    data; returns the models file."""
    ckpt = _ckpt_folders(tmp_path)
    models = tmp_path / "table1.toml"
    models.write_text(EXAMPLE.read_text().replace('"/ckpt/', f'"{ckpt}/'))
    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True)
    (data / "test.jsonl").write_text(json.dumps({"question": "Tom has 3 apples and buys 4 more. How many?",
                                                 "answer": "3 + 4 = 7\n#### 7"}) + "\n")
    monkeypatch.setenv("REFUSION_DATA_DIR", str(tmp_path / "data"))
    return models


def test_the_table1_models_file_is_the_nine_rows_and_passes_the_dry_run(tmp_path, monkeypatch, capsys):
    specs = load_models_file(EXAMPLE)
    assert [(m.name, m.decoder) for m in specs] == [
        ("llama3", "ar"), ("qwen3", "ar"), ("llada", "llada"), ("llada_fast_dllm", "fast_dllm"), ("llada_d2f", "d2f"),
        ("dream", "dream"), ("dream_fast_dllm", "fast_dllm"), ("dream_d2f", "d2f"), ("refusion", "refusion")]
    assert {m.name: m.knobs.get("chat_template_args") for m in specs if "chat_template_args" in m.knobs} == {
        "qwen3": {"enable_thinking": False}, "refusion": {"enable_thinking": False}}
    models = _table1_setup(tmp_path, monkeypatch)
    out = tmp_path / "out"
    rc = runner.main(["--task", "gsm8k_cot", "--limit", "1", "--models-file", str(models), "--out", str(out),
                      "--dry-run", "--prompts", "paper", "--baseline", "qwen3"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    heads = [ln.split(":")[0] for ln in captured.out.splitlines() if re.match(r"^[a-z0-9_]+: decoder ", ln)]
    assert heads == [m.name for m in specs], captured.out
    assert "qwen3: decoder ar on " in captured.out and "chat template arguments {'enable_thinking': False}" in captured.out
    # Symlinked base folders named as the adapters name them: no false "base name differs" warning.
    assert "names its base" not in captured.err, captured.err
    assert not out.exists()


@pytest.mark.parametrize("text, words", [
    ('[[models]]\nname = "a"\npath = "x"\ndecoder = "ar"\nknobz = { gen_length = 8 }\n',
     "model 'a': unknown field 'knobz' (did you mean 'knobs'?)"),
    ('[[models]]\nname = "a"\npath = "x"\ndecoder = "ra"\n', "model 'a': field 'decoder': unknown decoder 'ra'"),
    ('[[models]]\nname = "a"\ndecoder = "ar"\n', "model 'a': field 'path' is missing"),
    ('[[models]]\nname = "a"\npath = "x"\ndecoder = "ar"\nknobs = { gen_length = [8] }\n',
     "model 'a': knobs.gen_length must be a number, true/false or a string"),
    ('[[models]]\nname = "q"\npath = "x"\ndecoder = "ar"\nchat_template_args = { enable_thinking = "false" }\n',
     "model 'q': chat_template_args: enable_thinking must be true or false, got 'false'"),
    ('[[models]]\nname = "a"\npreset = "ar"\n[[models]]\nname = "a"\npreset = "refusion"\n',
     "model name(s) used twice: a"),
    ('[[model]]\nname = "a"\n', "unknown top-level key 'model' (did you mean 'models'?)"),
    ('[[models]]\nname = "a"\npath = "x\n', "not valid TOML"),
])
def test_models_file_schema_errors_name_the_model_and_field(tmp_path, capsys, text, words):
    f = tmp_path / "m.toml"
    f.write_text(text)
    out = tmp_path / "out"
    err = _one_error(*_eval(capsys, "--task", "embedded", "--models-file", str(f), "--out", str(out)))
    assert words in err, err
    assert not out.exists()


def test_models_file_presets_and_relative_paths(tmp_path):
    f = tmp_path / "sub" / "m.toml"
    f.parent.mkdir()
    f.write_text('[[models]]\nname = "rf"\npreset = "refusion"\nknobs = { slot_size = 8 }\n'
                 '[[models]]\nname = "mine"\npath = "ck"\ndecoder = "ar"\nbase = "../b"\n')
    rf, mine = load_models_file(f)
    assert rf.decoder == "refusion" and rf.knobs["slot_size"] == 8 and rf.knobs["token_threshold"] == 0.3
    assert mine.checkpoint == str(f.parent / "ck") and mine.knobs == {"base": str(f.parent / "../b")}


def test_models_and_models_file_together_is_an_error(tmp_path, capsys):
    err = _one_error(*_eval(capsys, "--models", "ar", "--models-file", str(EXAMPLE), "--out", str(tmp_path / "o")))
    assert "either --models (MODELS) or --models-file (MODELS_FILE)" in err


@pytest.mark.slow
def test_the_table1_models_file_runs_the_nine_rows_and_fills_every_claim(tmp_path, monkeypatch, capsys):
    """README's Regenerate Table 1 step 3 as written (examples/table1_models.toml, --prompts paper, baseline
    qwen3), on the released layouts (Qwen3-8B's too) behind symlinks named like the downloads and one GSM8K
    item: every row runs in one run and speedup.md has our value beside every one of the paper's speedup claims."""
    from harness.report import paper_report

    models = _table1_setup(tmp_path, monkeypatch)
    out = tmp_path / "out"
    assert runner.main(["--task", "gsm8k_cot", "--limit", "1", "--models-file", str(models), "--out", str(out),
                        "--run-id", "table1", "--prompts", "paper", "--baseline", "qwen3", "--threads", "1"]) == 0
    assert "names its base" not in capsys.readouterr().err
    run = json.loads((out / "table1" / "run.json").read_text())
    assert [m["name"] for m in run["models"]] == [m.name for m in load_models_file(EXAMPLE)]
    assert paper_report.main(["--run", str(out / "table1"), "--out", str(tmp_path / "reports"), "--name", "t"]) == 0
    sp = (tmp_path / "reports" / "t" / "speedup.md").read_text()
    rows = sp.split("### The paper's speedup claims beside ours")[1].split("\n\n")[2].splitlines()[2:]
    assert len(rows) == 8, rows
    for ln in rows:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        assert re.fullmatch(r"\d+\.\d\d", cells[2]) and re.fullmatch(r"\d+\.\d\d", cells[4]), ln
        assert cells[6].startswith("refusion / "), ln


def test_the_readme_one_gpu_command_passes_the_dry_run(tmp_path, monkeypatch, capsys):
    """The README's ReFusion-vs-Qwen3-8B command on GSM8K, as written (its /ckpt folders standing for the
    released layouts, one GSM8K item as the data), passes the dry run: both folders, the data and the knobs."""
    import shlex

    readme = (REPO / "README.md").read_text()
    block = readme.split("## ReFusion against Qwen3-8B on GSM8K, on one GPU")[1].split("## Supported systems")[0]
    command = re.sub(r"\\\n\s*", "", block.split("```bash")[-1].split("```")[0])
    line = next(ln for ln in command.splitlines() if ln.strip().startswith("make eval"))
    make_vars = dict(word.split("=", 1) for word in shlex.split(line)[2:])
    assert set(make_vars) == {"TASK", "DTYPE", "OUT", "CHAT_TEMPLATE_ARGS", "MODELS", "EVAL_ARGS"}, make_vars
    ckpt = _ckpt_folders(tmp_path)
    data = tmp_path / "data" / "gsm8k"  # REFUSION_DATA_DIR with one GSM8K item
    data.mkdir(parents=True)
    (data / "test.jsonl").write_text(json.dumps({"question": "Tom has 3 apples and buys 4 more. How many?",
                                                 "answer": "3 + 4 = 7\n#### 7"}) + "\n")
    monkeypatch.setenv("REFUSION_DATA_DIR", str(tmp_path / "data"))
    out = tmp_path / "out"
    argv = ["--task", make_vars["TASK"], "--dtype", make_vars["DTYPE"], "--out", str(out),
            "--chat-template-args", make_vars["CHAT_TEMPLATE_ARGS"],
            "--models", make_vars["MODELS"].replace("=/ckpt/", f"={ckpt}/"), *shlex.split(make_vars["EVAL_ARGS"]),
            "--limit", "1", "--dry-run"]
    rc = runner.main(argv)
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "qwen3: decoder ar on " in captured.out and "refusion: decoder refusion on " in captured.out, captured.out
    assert "{'enable_thinking': False}" in captured.out and not out.exists()


def test_the_beyond_table1_models_file_is_the_nine_rows_then_beyond_ones():
    """examples/table1_beyond_models.toml: the nine Table 1 rows exactly as examples/table1_models.toml gives
    them, then DiffusionGemma, LLaDA2 and SDAR in their own section (no published numbers: `make report` puts it beyond Table 1)."""
    nine = load_models_file(EXAMPLE)
    both = load_models_file(REPO / "examples" / "table1_beyond_models.toml")
    assert [vars(m) for m in both[:9]] == [vars(m) for m in nine]
    assert [(m.name, m.decoder) for m in both[9:]] == [("diffusiongemma", "diffusion_gemma"), ("llada2_mini", "llada2"),
                                                      ("sdar", "sdar")]
    assert "# ---------------------------------------------------------------- beyond Table 1" in (
        REPO / "examples" / "table1_beyond_models.toml").read_text()


def test_the_block_diffusion_comparison_file_gives_each_row_its_authors_settings():
    """examples/refusion_vs_block_diffusion.toml (docs/reproduce-table1.md): the AR reference, ReFusion, SDAR and
    LLaDA2 with their decoders and chat-template settings as the page states them."""
    rows = load_models_file(REPO / "examples" / "refusion_vs_block_diffusion.toml")
    assert [(m.name, m.decoder) for m in rows] == [("qwen3", "ar"), ("refusion", "refusion"), ("sdar", "sdar"),
                                                   ("llada2_mini", "llada2")]
    args = {m.name: m.knobs.get("chat_template_args") for m in rows}
    assert args["qwen3"] == args["refusion"] == {"enable_thinking": False} and args["sdar"] == {}
    assert args["llada2_mini"] is None
