"""The recipes run as written: every command of the README and of docs/reproduce-table1.md names an executable
that exists, a make target and variables the Makefile has, and options the command accepts.

Commands are read from the pages' fenced shell blocks (```bash, ```sh, plain ```), line continuations
joined and heredoc bodies skipped, and from the inline code of their numbered recipe steps that starts like
a command (`make ...`, `.venv/bin/...`, `python ...`, `hf ...`). Nothing is run for real: no download, no
model, no GPU. Each command is checked:

- the executable: `.venv/bin/X` must exist in the venv of this interpreter (`Path(sys.executable).parent`,
  so `make test` checks `.venv`), a path must be a file of the repository, and anything else must be an
  allowed system command (make, python3 -m venv, export, git, sbatch, ...); a bare `python`, `pip`,
  `refusion-bench` or `huggingface-cli` is reported, as it assumes an activated venv or a tool the venv
  lacks;
- `make TARGET VAR=value`: the target is a rule of the Makefile (`^name:`), the variable one the Makefile
  reads (`$(VAR)`, `${VAR}`, `$$VAR` in a recipe, `VAR ?=` ...), and the options inside a `*_ARGS` variable
  are those of the harness command the target's recipe runs with it (`make eval EVAL_ARGS=...` ->
  `python -m harness eval`);
- `.venv/bin/python -m harness CMD ...` and `.venv/bin/refusion-bench CMD ...`: CMD is a command of
  `harness.cli.COMMANDS` and every option is one its argparse parser defines, exactly (no abbreviation).
  The eval parser is `harness.run.runner._parser()`; any other command's parser is caught as its `main()`
  hands it to argparse (`parse_args` / `parse_known_args` replaced by a stop that carries the parser), so
  the command itself never runs. A command that parses with `parse_known_args` (sweep, frontier) passes the
  rest to `harness eval`, so eval's options count for it too;
- `.venv/bin/hf download ...`: the options are those `hf download --help` lists (only `--help` runs).

A negative test runs the same checker on a synthetic page naming an option, a target and a variable that
do not exist.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import pytest

from harness.cli import COMMANDS

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent  # the venv this suite runs in: `make test` runs .venv/bin/python
PAGES = ("README.md", "docs/reproduce-table1.md")

# Commands a page may use besides the venv's executables and the repository's scripts.
SYSTEM_COMMANDS = {"make", "python3", "export", "git", "sbatch", "scontrol", "squeue", "scancel", "cat", "cd",
                   "ls", "mkdir", "ln", "cp", "seq", "echo", "nvidia-smi", "chmod"}
SEPARATORS = {"&&", "||", ";", "|", "&"}
SHELL_FENCES = {"", "bash", "sh"}
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)\s*$")
STEP = re.compile(r"^(\d+)\.\s")
INLINE_COMMAND = re.compile(r"^(?:make|python3?|pip3?|hf|huggingface-cli|refusion-bench)\s+\S|^\.venv/")  # a bare name is no command
HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1")


@dataclass
class Command:
    where: str  # page:line
    text: str


# ---------------------------------------------------------------- reading commands from a page


def _fences(lines: list[str]):
    """(first line index, language, body lines) of every fenced block, and the set of line indexes inside
    fences (the fence lines included)."""
    blocks, inside, i = [], set(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:j]]
        blocks.append((i + 1, lang.lower(), body))
        inside.update(range(i, min(j, len(lines) - 1) + 1))
        i = j + 1
    return blocks, inside


def _strip_comment(line: str) -> str:
    """The line without a shell comment (a `#` outside quotes at a word's start)."""
    quote = None
    for k, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k]
    return line


def shell_commands(body: list[str], first: int, page: str) -> list[Command]:
    """The commands of a shell block: continuations joined, comments dropped, heredoc bodies skipped."""
    out, k = [], 0
    while k < len(body):
        start, line = k, body[k]
        while line.rstrip().endswith("\\") and k + 1 < len(body):
            k += 1
            line = line.rstrip()[:-1] + " " + body[k].strip()
        k += 1
        line = _strip_comment(line)
        heredoc = HEREDOC.search(line)
        if heredoc:
            line = line[:heredoc.start()] + line[heredoc.end():]
            while k < len(body) and body[k].strip() != heredoc.group(2):
                k += 1
            k += 1
        if line.strip():
            out.append(Command(f"{page}:{first + start + 1}", line.strip()))
    return out


def numbered_steps(lines: list[str], inside: set[int]) -> list[tuple[int, list[int]]]:
    """(first line index, line indexes) of every numbered step: `1. ...` and the lines after it that are
    blank, indented or fenced, up to the next step or the first unindented line."""
    steps: list[tuple[int, list[int]]] = []
    current: list[int] | None = None
    for i, ln in enumerate(lines):
        if i not in inside and STEP.match(ln):
            current = [i]
            steps.append((i, current))
        elif current is not None and (i in inside or not ln.strip() or ln[:1].isspace()):
            current.append(i)
        else:
            current = None
    return steps


def _inline_commands(lines: list[str], step: list[int], inside: set[int], page: str) -> list[Command]:
    out = []
    prose = [i for i in step if i not in inside]
    text, starts = "", []
    for i in prose:
        starts.append((len(text), i))
        text += lines[i].strip() + " "
    for m in re.finditer(r"`([^`]+)`", text):
        span = m.group(1).strip()
        if INLINE_COMMAND.match(span):
            line = max(i for offset, i in starts if offset <= m.start())
            out.append(Command(f"{page}:{line + 1}", span))
    return out


def page_commands(text: str, page: str) -> list[Command]:
    """Every command of a page: its fenced shell blocks, then the inline commands of its numbered steps."""
    lines = text.splitlines()
    blocks, inside = _fences(lines)
    out = [c for first, lang, body in blocks if lang in SHELL_FENCES for c in shell_commands(body, first, page)]
    for _, step in numbered_steps(lines, inside):
        out += _inline_commands(lines, step, inside, page)
    return out


# ---------------------------------------------------------------- what the Makefile and the commands accept


@dataclass
class Makefile:
    targets: set[str] = field(default_factory=set)
    reads: set[str] = field(default_factory=set)
    recipes: dict[str, str] = field(default_factory=dict)

    def harness_command(self, target: str) -> str | None:
        found = set(re.findall(r"-m harness\s+([a-z][\w-]*)", self.recipes.get(target, "")))
        return found.pop() if len(found) == 1 else None


def parse_makefile(text: str) -> Makefile:
    mk = Makefile()
    current: list[str] | None = None
    for line in text.replace("\\\n", " ").splitlines():
        if line.startswith("\t"):
            for t in current or ():
                mk.recipes[t] += line + "\n"
            continue
        rule = re.match(r"^([A-Za-z0-9_][\w.-]*(?:[ \t]+[A-Za-z0-9_][\w.-]*)*)\s*:(?![=:])", line)
        if rule:
            current = rule.group(1).split()
            mk.targets.update(current)
            for t in current:
                mk.recipes.setdefault(t, "")
        elif line.strip() and not line.lstrip().startswith("#"):
            current = None
    mk.reads |= set(re.findall(r"\$[({](\w+)[)}]", text))
    mk.reads |= set(re.findall(r"\$\((?:value|origin|flavor|strip)\s+(\w+)\)", text))
    mk.reads |= set(re.findall(r"\$\$\{?(\w+)", text))  # a recipe reading an exported variable
    mk.reads |= set(re.findall(r"^(?:override\s+|export\s+)?(\w+)\s*(?:\?|::|:|\+|!)?=", text, re.M))
    for names in re.findall(r"^export\s+([\w \t]+)", text, re.M):
        mk.reads |= set(names.split())
    return mk


class _Parsed(BaseException):  # BaseException: no `except Exception` in a command's main swallows it
    def __init__(self, parser: argparse.ArgumentParser, known: bool):
        super().__init__(parser.prog)
        self.parser, self.known = parser, known


def parser_of(command: str) -> tuple[argparse.ArgumentParser, bool]:
    """The argparse parser of `python -m harness <command>` and whether it passes unknown options on (parses
    with parse_known_args). Never runs the command: its main() stops where it would parse."""
    if command == "eval":
        from harness.run.runner import _parser

        return _parser(), False
    module, _, func = COMMANDS[command][0].partition(":")
    main = getattr(importlib.import_module(module), func or "main")

    def strict(self, args=None, namespace=None):
        raise _Parsed(self, False)

    def known(self, args=None, namespace=None):
        raise _Parsed(self, True)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", strict), \
            mock.patch.object(argparse.ArgumentParser, "parse_known_args", known):
        try:
            main([])
        except _Parsed as got:
            return got.parser, got.known
    raise AssertionError(f"harness {command}: main() returned without parsing its options")


@functools.lru_cache(maxsize=None)
def harness_options(command: str) -> frozenset[str]:
    """Every option string `python -m harness <command>` accepts; eval's too when it passes the rest on."""
    parser, passes_on = parser_of(command)
    options = set(parser._option_string_actions)  # argparse's table of option strings (-h, --help, ...)
    if passes_on and command != "eval":
        options |= harness_options("eval")
    return frozenset(options)


@functools.lru_cache(maxsize=None)
def hf_options(subcommand: str) -> frozenset[str] | None:
    """The options `hf <subcommand> --help` lists (only --help runs: nothing is downloaded); None when the
    venv's hf has no such subcommand."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "NO_COLOR": "1",
           "TERM": "dumb", "COLUMNS": "200"}
    p = subprocess.run([str(VENV_BIN / "hf"), subcommand, "--help"], capture_output=True, text=True, env=env,
                       timeout=120, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        return None
    return frozenset(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", p.stdout))


# ---------------------------------------------------------------- the checker


class Checker:
    def __init__(self, makefile: Makefile, venv_bin: Path = VENV_BIN, repo: Path = REPO):
        self.mk, self.venv_bin, self.repo = makefile, venv_bin, repo

    def check(self, cmd: Command) -> list[str]:
        try:
            words = list(_split(cmd.text))
        except ValueError as e:
            return [f"{cmd.where}: `{cmd.text}`: cannot be read as a shell command ({e})"]
        problems, simple = [], []
        for w in [*words, ";"]:
            if w in SEPARATORS:
                problems += [f"{cmd.where}: `{cmd.text}`: {p}" for p in self._simple(simple)]
                simple = []
            else:
                simple.append(w)
        return problems

    def _simple(self, words: list[str]) -> list[str]:
        words = _without_redirections(words)
        while words and re.match(r"^[A-Za-z_]\w*=", words[0]):  # VAR=value before a command, or alone
            words = words[1:]
        if not words:
            return []
        exe, args = words[0], words[1:]
        if exe.startswith(".venv/bin/"):
            name = exe.removeprefix(".venv/bin/")
            if not (self.venv_bin / name).exists():
                return [f"{exe}: the venv has no `{name}` ({self.venv_bin})"]
            if name.startswith("python"):
                return self._python(args)
            if name == "refusion-bench":
                return self._harness(args, "refusion-bench")
            if name == "hf":
                return self._hf(args)
            return []
        if exe == "make":
            return self._make(args)
        if exe in ("python", "python3") and args[:2] != ["-m", "venv"]:
            return [f"`{exe}`: use the venv's interpreter, .venv/bin/python (a bare {exe} assumes an activated venv)"]
        if "/" in exe:
            return [] if (self.repo / exe).is_file() else [f"{exe}: no such file in the repository"]
        if exe in SYSTEM_COMMANDS:
            return []
        return [f"`{exe}`: not an executable of .venv/bin, a repository script or an allowed system command "
                f"({', '.join(sorted(SYSTEM_COMMANDS))})"]

    def _python(self, args: list[str]) -> list[str]:
        if not args or args[0] == "-c":
            return []
        if args[0] == "-m" and len(args) > 1:
            if args[1] == "harness":
                return self._harness(args[2:], "python -m harness")
            return [] if importlib.util.find_spec(args[1]) else [f"python -m {args[1]}: no such module"]
        return [] if (self.repo / args[0]).is_file() else [f"python {args[0]}: no such file in the repository"]

    def _harness(self, args: list[str], prog: str) -> list[str]:
        if not args or args[0] in ("-h", "--help"):
            return []
        if args[0] not in COMMANDS:
            return [f"{prog} {args[0]}: no such command (harness.cli.COMMANDS)"]
        return self._options(args[0], args[1:], f"{prog} {args[0]}")

    def _options(self, command: str, args: list[str], label: str) -> list[str]:
        accepted = harness_options(command)
        return [f"{label}: no option {flag} (`python -m harness {command} --help`)" for flag in _flags(args)
                if flag not in accepted]

    def _hf(self, args: list[str]) -> list[str]:
        if not args or args[0].startswith("-"):
            return []
        accepted = hf_options(args[0])
        if accepted is None:
            return [f"hf {args[0]}: the venv's hf has no such command"]
        return [f"hf {args[0]}: no option {flag} (`hf {args[0]} --help`)" for flag in _flags(args[1:])
                if flag not in accepted]

    def _make(self, args: list[str]) -> list[str]:
        problems = []
        targets = [a for a in args if not a.startswith("-") and "=" not in a]
        variables = dict(a.split("=", 1) for a in args if re.match(r"^[A-Za-z_]\w*=", a))
        for t in targets:
            if t not in self.mk.targets:
                problems.append(f"make {t}: no such target in the Makefile")
        for var, value in variables.items():
            if var not in self.mk.reads:
                problems.append(f"make {var}=...: the Makefile reads no variable {var}")
                continue
            if not var.endswith("_ARGS"):
                continue
            for t in (t for t in targets if t in self.mk.targets):
                if not re.search(rf"\$\$\{{?{var}\b", self.mk.recipes.get(t, "")):
                    problems.append(f"make {t}: its recipe does not read {var}")
                    continue
                command = self.mk.harness_command(t)
                if command is not None:
                    try:
                        words = shlex.split(value)
                    except ValueError as e:
                        problems.append(f"{var} of make {t}: cannot be split ({e})")
                        continue
                    problems += self._options(command, words, f"{var} of make {t} (python -m harness {command})")
        return problems


def _split(text: str):
    lex = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    lex.commenters = ""
    return lex


def _without_redirections(words: list[str]) -> list[str]:
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w in (">", ">>", "<", "2>"):
            skip = True
        elif not re.match(r"^\d*>", w):
            out.append(w)
    return out


def _flags(args: list[str]) -> list[str]:
    """The option names among a command's words (`--x=1` -> `--x`), up to `--`; negative numbers are values."""
    out = []
    for a in args:
        if a == "--":
            break
        if a.startswith("-") and a != "-" and not re.match(r"^-\d", a):
            out.append(a.split("=", 1)[0])
    return out


@pytest.fixture(scope="module")
def checker() -> Checker:
    return Checker(parse_makefile((REPO / "Makefile").read_text(encoding="utf-8")))


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize("page", PAGES)
def test_every_command_of_the_recipe_exists_as_written(page, checker):
    commands = page_commands((REPO / page).read_text(encoding="utf-8"), page)
    texts = [c.text for c in commands]
    # The scan sees the recipe: the download, the dry run, the run and its report.
    assert any(t.startswith(".venv/bin/hf download ") for t in texts), texts
    assert any(t.startswith("make eval ") and "--dry-run" in t for t in texts), texts
    assert any(t.startswith("make report ") for t in texts), texts
    problems = [p for c in commands for p in checker.check(c)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page, section", [("README.md", "## ReFusion against Qwen3-8B on GSM8K, on one GPU"),
                                           ("docs/reproduce-table1.md", "## Regenerate Table 1")])
def test_every_recipe_step_has_its_command_in_order(page, section):
    """Each numbered step of the one-GPU recipes holds its own command, and the dry run comes before the run."""
    text = (REPO / page).read_text(encoding="utf-8")
    body = section + text.split(section, 1)[1].split("\n## ", 1)[0]
    lines = body.splitlines()
    blocks, inside = _fences(lines)
    steps = numbered_steps(lines, inside)
    assert len(steps) >= 4, [lines[i] for i, _ in steps]
    order = []
    for first, step in steps:
        block_cmds = [c for start, lang, b in blocks if lang in SHELL_FENCES and start - 1 in step
                      for c in shell_commands(b, start, page)]
        cmds = block_cmds + _inline_commands(lines, step, inside, page)
        assert cmds, f"{page}: step {lines[first].strip()[:60]!r} has no command"
        order += [c.text for c in cmds]
    evals = [t for t in order if t.startswith("make eval ")]
    assert "--dry-run" in evals[0] and "--dry-run" not in evals[-1], evals


def test_the_makefile_reading_sees_targets_and_variables(checker):
    mk = checker.mk
    assert {"setup", "eval", "report", "merge", "test", "docs", "help"} <= mk.targets
    assert not {".PHONY", "override", "$(STAMP)"} & mk.targets
    assert {"TASK", "MODELS", "MODELS_FILE", "EVAL_ARGS", "OUT", "RUN", "NAME", "DTYPE", "CHAT_TEMPLATE_ARGS",
            "REASON", "VENV", "TEST_WORKERS"} <= mk.reads
    assert mk.harness_command("eval") == "eval" and mk.harness_command("compare") == "compare"
    assert mk.harness_command("setup") is None


def test_parsers_are_caught_without_running_the_command():
    assert {"--run-id", "--dry-run", "--timing-items", "--timing", "--busy-share"} <= harness_options("eval")
    assert {"--run", "--name", "--runs-root"} <= harness_options("report")
    assert "--status" in harness_options("merge")
    assert harness_options("data") == {"-h", "--help"}
    # frontier parses what it knows and hands the rest to eval
    assert {"--reports", "--timing-items"} <= harness_options("frontier")


SYNTHETIC = """# A page with mistakes

1. **Download.** `huggingface-cli download GSAI-ML/ReFusion --local-dir /ckpt/ReFusion`, then look:
   `python -m harness data`.
2. **Run.**

   ```bash
   make eval TASK=gsm8k_cot EVAL_ARGS="--run-id x --no-such-flag"
   .venv/bin/python -m harness eval --task gsm8k_cot --no-such-flag
   .venv/bin/refusion-bench report --run x --no-such-report-flag
   make no-such-target NO_SUCH_VAR=1
   .venv/bin/hf download Qwen/Qwen3-8B --no-such-hf-option --local-dir /ckpt/Qwen3-8B
   .venv/bin/no-such-tool --help
   ```
"""

GOOD = """1. **Run.**

   ```bash
   export REFUSION_DATA_DIR=/data/x
   make eval TASK=gsm8k_cot OUT=results/x \\
       EVAL_ARGS="--run-id x --timing-items 4 --timing sequential --dry-run"   # a comment --not-a-flag
   .venv/bin/python -m harness eval --task gsm8k_cot --timing-rounds 5 && .venv/bin/refusion-bench data
   .venv/bin/hf download Qwen/Qwen3-8B --local-dir /ckpt/Qwen3-8B
   cat > settings <<'END'
   --this-is-heredoc-text
   END
   scripts/slurm_table1.sh settings
   ```
"""


def test_the_checker_reports_what_does_not_exist(checker):
    problems = [p for c in page_commands(SYNTHETIC, "SYNTHETIC.md") for p in checker.check(c)]
    text = "\n".join(problems)
    expected = [
        "EVAL_ARGS of make eval (python -m harness eval): no option --no-such-flag",
        "python -m harness eval: no option --no-such-flag",
        "refusion-bench report: no option --no-such-report-flag",
        "make no-such-target: no such target in the Makefile",
        "make NO_SUCH_VAR=...: the Makefile reads no variable NO_SUCH_VAR",
        "hf download: no option --no-such-hf-option",
        "the venv has no `no-such-tool`",
        "`huggingface-cli`: not an executable of .venv/bin",
        "`python`: use the venv's interpreter",
    ]
    for piece in expected:
        assert piece in text, f"not reported: {piece}\n{text}"
    assert len(problems) == len(expected), text
    assert all(re.match(r"SYNTHETIC\.md:\d+: `", p) for p in problems), text


def test_the_checker_accepts_a_correct_page(checker):
    commands = page_commands(GOOD, "GOOD.md")
    assert [c.text.split()[0] for c in commands] == ["export", "make", ".venv/bin/python", ".venv/bin/hf", "cat",
                                                      "scripts/slurm_table1.sh"]
    problems = [p for c in commands for p in checker.check(c)]
    assert not problems, "\n".join(problems)
