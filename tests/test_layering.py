"""Imports point one way, read from the source with `ast` (every import statement at any depth, relative
ones resolved), never by importing anything.

- Between the packages: harness -> tasks -> nothing of ours; harness -> refusion -> nothing of ours.
- Inside harness, by floor: the entry points at the top (cli.py, __main__.py, lm_eval_cli.py) -> speed/,
  report/, train/ -> run/ -> models/. A sub-package imports its own modules and those of lower floors
  only: never one above it, never one beside it; no module imports harness's entry points, and the
  modules of harness import each other without a cycle.
- harness/ itself holds the five sub-packages and the entry points only; no function of harness is
  longer than 80 lines, and the lm-eval model class (RefusionBenchLM) is a page: at most 150 lines, no
  method over 60.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OURS = ("refusion", "harness", "tasks")
# package -> packages of ours it may import (itself always)
ALLOWED = {"refusion": set(), "tasks": set(), "harness": {"refusion", "tasks"}}
# harness's sub-packages by floor: a module may import harness modules of a lower floor and of its own
# sub-package. The modules at the top of harness/ are the entry points, above every sub-package.
FLOORS = {"models": 0, "run": 1, "report": 2, "speed": 2, "train": 2}
ENTRY_FLOOR = 3
TOP_FILES = {"__init__.py", "__main__.py", "cli.py", "lm_eval_cli.py"}
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = {"RefusionBenchLM": 150}  # the lm-eval model: a page
MAX_METHOD_LINES = 60  # each method of such a class


def imported_names(source: str, parts: tuple[str, ...]) -> list[tuple[str, int]]:
    """(dotted name, line) of every import in one module's source, relative ones resolved.

    ``parts``: the module's dotted path, e.g. ("refusion", "decoding", "mdm"); a package's
    ``__init__`` is its folder's path. ``from x import a`` gives ``x.a`` (a may be a module or a name
    in x: the caller resolves it against the modules that exist)."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = parts[: len(parts) - node.level] if node.level else ()  # relative: against this package
            module = ".".join(base + ((node.module,) if node.module else ()))
            found += [(f"{module}.{a.name}".lstrip(".") if a.name != "*" else module, node.lineno)
                      for a in node.names]
    return found


def imported_packages(source: str, parts: tuple[str, ...]) -> dict[str, int]:
    """Top-level packages of ours other than parts[0] imported by one module's source -> first line."""
    found: dict[str, int] = {}
    for name, line in imported_names(source, parts):
        top = name.split(".")[0]
        if top in OURS and top != parts[0]:
            found.setdefault(top, line)
    return found


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py below root/package (``a/__init__.py`` is ``a``)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _resolve(name: str, known: set[str]) -> str | None:
    """The longest known module that `name` names or lies in (``harness.run.store.read_json`` ->
    ``harness.run.store``); None when it is none of them."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path, package: str = "harness") -> dict[str, dict[str, int]]:
    """Module -> {module of the same package it imports: first line}, over every module of the package
    under root. The package's own ``__init__`` is left out (every import of the package runs it)."""
    files = module_files(root, package)
    known = set(files)
    graph: dict[str, dict[str, int]] = {}
    for mod, path in files.items():
        parts = tuple(mod.split(".")) + (("__init__",) if path.name == "__init__.py" else ())
        edges: dict[str, int] = {}
        for name, line in imported_names(path.read_text(encoding="utf-8"), parts):
            target = _resolve(name, known) if name.split(".")[0] == package else None
            if target and target not in (mod, package):
                edges.setdefault(target, line)
        graph[mod] = edges
    return graph


def floor(module: str) -> tuple[str, int]:
    """(sub-package, or module at the top of harness/, and its floor) of a harness module."""
    where = (module.split(".") + ["__init__"])[1]
    return where, FLOORS.get(where, ENTRY_FLOOR)


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import, by a module of a sub-package, of an entry point or of another sub-package on the same
    or a higher floor, as `module:line imports target (why)`. The entry points may import anything."""
    bad = []
    for mod, edges in sorted(graph.items()):
        where, level = floor(mod)
        for target, line in sorted(edges.items()):
            t_where, t_level = floor(target)
            if level == ENTRY_FLOOR or t_where == where or t_level < level:
                continue
            why = ("an entry point" if t_level == ENTRY_FLOOR
                   else f"{t_where}/ is above {where}/" if t_level > level else f"{t_where}/ is beside {where}/")
            bad.append(f"{mod}:{line} imports {target} ({why})")
    return bad


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The cycles of the graph, one per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def long_definitions(root: Path, package: str = "harness") -> list[str]:
    """Functions over MAX_FUNCTION_LINES lines, classes named in MAX_CLASS_LINES over their limit and their
    methods over MAX_METHOD_LINES."""
    bad = []
    for path in sorted((root / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            n = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and n > MAX_FUNCTION_LINES:
                bad.append(f"{where} {node.name}: {n} lines > {MAX_FUNCTION_LINES}")
            elif isinstance(node, ast.ClassDef) and node.name in MAX_CLASS_LINES:
                if n > MAX_CLASS_LINES[node.name]:
                    bad.append(f"{where} class {node.name}: {n} lines > {MAX_CLASS_LINES[node.name]}")
                bad += [f"{path.relative_to(root)}:{f.lineno} {node.name}.{f.name}: {f.end_lineno - f.lineno + 1} "
                        f"lines > {MAX_METHOD_LINES}" for f in node.body
                        if isinstance(f, ast.FunctionDef) and f.end_lineno - f.lineno + 1 > MAX_METHOD_LINES]
    return bad


# ---------------------------------------------------------------- the repository


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_one_way(package):
    bad = []
    for path in sorted((REPO / package).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        for top, line in imported_packages(path.read_text(encoding="utf-8"), parts).items():
            if top not in ALLOWED[package]:
                bad.append(f"{path.relative_to(REPO)}:{line} imports {top}")
    assert not bad, "\n".join(bad)


def test_harness_floors_point_down():
    graph = import_graph(REPO)
    assert {"harness.run.runner", "harness.models.checkpoints", "harness.report.paper_report"} <= set(graph)
    assert "harness.run.launch" in graph["harness.run.runner"]  # the graph is not empty
    bad = upward_imports(graph)
    assert not bad, "harness imports go entry -> speed/report/train -> run -> models:\n" + "\n".join(bad)


def test_harness_modules_have_no_import_cycle():
    cycles = import_cycles(import_graph(REPO))
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_harness_top_holds_the_sub_packages_and_entry_points_only():
    top = REPO / "harness"
    files = {p.name for p in top.iterdir() if p.is_file() and p.suffix == ".py"}
    folders = {p.name for p in top.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert files <= TOP_FILES, f"modules at the top of harness/: {sorted(files - TOP_FILES)}; move them to a sub-package"
    assert folders == set(FLOORS), f"harness/ sub-packages {sorted(folders)} != the floors {sorted(FLOORS)}"
    assert all((top / f / "__init__.py").is_file() for f in folders)


def test_harness_definitions_fit_a_page():
    bad = long_definitions(REPO)
    assert not bad, "\n".join(bad)


def test_the_code_map_names_every_harness_module():
    """docs/development.md's code map ("Code layout") follows the code: it names every module of harness."""
    text = (REPO / "docs" / "development.md").read_text(encoding="utf-8")
    code_map = text[text.index("## Code layout"):text.index("## Adding a test")]
    missing = [str(p.relative_to(REPO)) for p in sorted((REPO / "harness").rglob("*.py"))
               if p.name not in ("__init__.py", "__main__.py") and f"`{p.name}`" not in code_map
               and f"harness/{p.name}" not in code_map]
    assert not missing, f"docs/development.md's code map does not name: {missing}"


# ---------------------------------------------------------------- the checkers themselves


def test_the_parser_sees_relative_and_nested_imports():
    """The checker itself: nested, relative and `from .. import` forms that leave the package are seen."""
    here = ("refusion", "decoding", "probe")
    assert imported_packages("def f():\n    from harness import runner\n", here) == {"harness": 2}
    assert imported_packages("from ...tasks import info\n", here) == {"tasks": 1}
    assert imported_packages("import os\nfrom ... import tasks\n", here) == {"tasks": 2}
    assert imported_packages("from . import common\nfrom ..objective import Example\n", here) == {}
    assert imported_packages("import tasks.info as ti\n", ("harness", "x")) == {"tasks": 1}


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


SOUND = {
    "harness/__init__.py": "",
    "harness/cli.py": "import importlib\n",
    "harness/models/__init__.py": "",
    "harness/models/families.py": "import os\n",
    "harness/models/checkpoints.py": "from harness.models.families import x\n",
    "harness/run/__init__.py": "",
    "harness/run/store.py": "",
    "harness/run/runner.py": "from harness.run import store\nfrom ..models import checkpoints\n",
    "harness/report/__init__.py": "",
    "harness/report/paper.py": "def f():\n    from harness.run.runner import main\n",
    "harness/speed/__init__.py": "",
    "harness/speed/bench.py": "import harness.run.store\nfrom harness.models.checkpoints import load\n",
}


def test_the_floor_check_fails_on_an_upward_import(tmp_path):
    """A synthetic harness tree: sound as written, then each forbidden import alone is caught."""
    root = _tree(tmp_path / "sound", SOUND)
    graph = import_graph(root)
    assert graph["harness.run.runner"] == {"harness.run.store": 1, "harness.models.checkpoints": 2}
    assert graph["harness.report.paper"] == {"harness.run.runner": 2}
    assert upward_imports(graph) == [] and import_cycles(graph) == []

    cases = {  # file -> (added source, the one line the check must print)
        "harness/models/checkpoints.py": (
            "def f():\n    from harness.run.runner import main\n",
            "harness.models.checkpoints:3 imports harness.run.runner (run/ is above models/)"),
        "harness/run/store.py": ("from ..report import paper\n",
                                 "harness.run.store:1 imports harness.report.paper (report/ is above run/)"),
        "harness/speed/bench.py": ("import harness.report.paper as p\n",
                                   "harness.speed.bench:3 imports harness.report.paper (report/ is beside speed/)"),
        "harness/report/paper.py": ("from harness import cli\n",
                                    "harness.report.paper:3 imports harness.cli (an entry point)"),
    }
    for i, (rel, (added, expected)) in enumerate(cases.items()):
        files = dict(SOUND)
        files[rel] = SOUND[rel] + added
        assert upward_imports(import_graph(_tree(tmp_path / f"bad{i}", files))) == [expected], rel


def test_the_cycle_check_finds_a_cycle(tmp_path):
    files = dict(SOUND)
    files["harness/run/store.py"] = "def f():\n    from harness.run import runner\n"  # runner -> store -> runner
    graph = import_graph(_tree(tmp_path, files))
    assert upward_imports(graph) == []  # same floor: only the cycle check sees it
    assert import_cycles(graph) == [["harness.run.runner", "harness.run.store"]]


def test_the_length_check_finds_a_long_function(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    method = "".join(f"        x{i} = {i}\n" for i in range(MAX_METHOD_LINES))
    root = _tree(tmp_path, {"harness/run/long.py": "def fits():\n" + body[: -len("    x79 = 79\n")]
                            + "\n\ndef too_long():\n" + body
                            + "\n\nclass RefusionBenchLM:\n    def too_long(self):\n" + method})
    assert long_definitions(root) == [
        f"harness/run/long.py:{MAX_FUNCTION_LINES + 3} too_long: {MAX_FUNCTION_LINES + 1} lines > {MAX_FUNCTION_LINES}",
        f"harness/run/long.py:{2 * MAX_FUNCTION_LINES + 7} RefusionBenchLM.too_long: {MAX_METHOD_LINES + 1} lines > "
        f"{MAX_METHOD_LINES}"]
