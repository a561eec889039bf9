"""Every command of `python -m harness` answers `--help`, and every way the docs, the Makefile and the scripts
call the harness names a command or module that exists.

Nothing here loads a model or decodes: `--help` stops in argparse. The commands run in-process (the module
each one names is imported, as `python -m harness` does), and `python -m harness --help` and the lm-eval
wrapper once each in a real process.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import COMMANDS
from harness.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
COMMAND_CALL = re.compile(r"-m harness\s+([a-z][a-z0-9-]*)")  # `python -m harness <command>`
CALLERS = ["README.md", "docs/*.md", "tasks/README.md", "Makefile", "scripts/*.sh", "scripts/*.py", ".ci/run"]


def _callers() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text(encoding="utf-8").replace("\\\n", " ")
            for pattern in CALLERS for p in sorted(REPO.glob(pattern))}


def test_every_command_names_a_function_that_exists():
    for command, (target, _) in COMMANDS.items():
        module, _, func = target.partition(":")
        spec = importlib.util.find_spec(module)
        assert spec is not None, f"{command}: no module {module}"
        assert Path(spec.origin).resolve().is_relative_to(REPO), f"{command}: {module} found outside: {spec.origin}"
        assert callable(getattr(importlib.import_module(module), func or "main", None)), f"{command}: {target}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_answers_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main([command, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    assert out.startswith(f"usage: python -m harness {command} "), out[:200]


def test_the_command_list_names_every_command():
    p = subprocess.run([sys.executable, "-m", "harness", "--help"], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    for command in COMMANDS:
        assert re.search(rf"^  {re.escape(command)}\s", p.stdout, re.M), command


def test_the_lm_eval_wrapper_answers_help():
    """`python -m harness.lm_eval_cli` (README, accelerate launch) keeps its module path."""
    p = subprocess.run([sys.executable, "-m", "harness.lm_eval_cli", "run", "--help"], capture_output=True,
                       text=True, cwd=REPO, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "--model" in p.stdout


def test_docs_makefile_and_scripts_call_commands_and_modules_that_exist():
    """`python -m harness <command>` names a command; `-m harness.<module>` and `harness/<file>` exist."""
    seen, bad = set(), []
    for name, text in _callers().items():
        for command in COMMAND_CALL.findall(text):
            seen.add(command)
            if command not in COMMANDS:
                bad.append(f"{name}: python -m harness {command}: no such command")
        for module in re.findall(r"-m (harness(?:\.[a-z_]+)+)", text):
            if importlib.util.find_spec(module) is None:
                bad.append(f"{name}: python -m {module}: no such module")
        for path in re.findall(r"\bharness/[\w/]+\.(?:py|json)\b", text):
            if not (REPO / path).is_file():
                bad.append(f"{name}: {path}: no such file")
    assert not bad, "\n".join(bad)
    assert {"eval", "report", "knobs", "train-tiny", "curves", "regress"} <= seen  # the scan reads the callers


# make target -> (the variable that passes extra options, the command it runs)
MAKE_TARGETS = {
    "eval": ("EVAL_ARGS", "eval"), "report": ("REPORT_ARGS", "report"), "compare": ("REPORT_ARGS", "compare"),
    "sweep": ("SWEEP_ARGS", "sweep"), "frontier": ("FRONTIER_ARGS", "frontier"), "trace": ("TRACE_ARGS", "trace"), "train-tiny": ("TRAIN_ARGS", "train-tiny"),
    "curves": ("CURVES_ARGS", "curves"), "bench-kernels": ("BENCH_ARGS", "bench-kernels"),
}


@pytest.mark.parametrize("target", sorted(MAKE_TARGETS))
def test_make_targets_reach_their_command(target, fake_venv):
    """`make <target> <ARGS>=--help` runs the target's recipe down to the command's own help."""
    var, command = MAKE_TARGETS[target]
    p = subprocess.run(["make", "-s", target, f"VENV={fake_venv}", f"{var}=--help"], capture_output=True,
                       text=True, cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith(f"usage: python -m harness {command} "), p.stdout[:300]


def test_every_make_target_that_runs_the_harness_names_a_command():
    """The targets without an options variable (`make regress`, ...) call commands that exist, read from
    `make -n` (prints the recipe, runs nothing); a target that runs a script instead (`make side-by-side`)
    names one that exists."""
    targets = re.findall(r"^([a-z][a-z-]*):.*## ", (REPO / "Makefile").read_text(), re.M)
    commands = set()
    for target in targets:
        if target in ("setup", "lock", "clean", "browser-deps", "help"):  # pip, apt, make itself: no harness
            continue
        p = subprocess.run(["make", "-n", target, "VENV=/nonexistent-venv"], capture_output=True, text=True,
                           cwd=REPO, timeout=60)
        assert p.returncode == 0, (target, p.stderr[-500:])
        found = COMMAND_CALL.findall(p.stdout.replace("\\\n", " "))
        scripts = re.findall(r"\bscripts/\w+\.py\b", p.stdout)
        assert all((REPO / s).is_file() for s in scripts), (target, scripts)
        assert found or scripts or target in ("test", "test-slow"), (target, p.stdout[-500:])
        commands.update(found)
    assert commands <= set(COMMANDS), commands - set(COMMANDS)
    assert {"regress", "regress-update", "validate-tasks", "bench-decoders"} <= commands
