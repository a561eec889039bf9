"""The test suite's own structure: test modules share helpers only through conftest fixtures.

No tests/*.py imports another module of tests/ (test_* or conftest), and none edits sys.path to
make such an import work. Shared builders live in tests/conftest.py and reach tests as fixtures.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
LOCAL = {p.stem for p in TESTS.glob("*.py")} | {"tests", "conftest"}
SYS_PATH_EDITS = {"insert", "append", "extend", "remove", "pop", "clear", "__setitem__"}


def _dotted(node: ast.AST) -> str:
    """`a.b.c` for a Name/Attribute chain, else ''."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return ""


def _is_local(module: str) -> bool:
    top = module.split(".")[0]
    return top in LOCAL or top.startswith("test_")


def local_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for every import of a tests/ module: import/from statements (relative ones
    included) and importlib.import_module / __import__ calls with a literal name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _is_local(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                found.append((node.lineno, "." * node.level + (node.module or "")))
            elif node.module and _is_local(node.module):
                found.append((node.lineno, node.module))
        elif (isinstance(node, ast.Call) and _dotted(node.func) in ("importlib.import_module", "import_module",
                                                                      "__import__")
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and _is_local(node.args[0].value)):
            found.append((node.lineno, node.args[0].value))
    return sorted(found)


def sys_path_edits(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for every change to sys.path: sys.path.insert/append/..., assignments to
    sys.path or its items, `from sys import path`, and pytest's monkeypatch.syspath_prepend."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = _dotted(node.func.value)
            if target == "sys.path" and node.func.attr in SYS_PATH_EDITS:
                found.append((node.lineno, f"sys.path.{node.func.attr}"))
            elif node.func.attr == "syspath_prepend":
                found.append((node.lineno, "syspath_prepend"))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                base = t.value if isinstance(t, ast.Subscript) else t
                if _dotted(base) == "sys.path":
                    found.append((node.lineno, "sys.path assignment"))
        elif isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "path" for a in node.names):
            found.append((node.lineno, "from sys import path"))
    return sorted(found)


def _test_files() -> list[Path]:
    files = sorted(TESTS.glob("*.py"))
    assert Path(__file__).resolve() in files and len(files) > 5
    return files


def test_no_test_module_imports_another_test_module():
    bad = [f"{path.name}:{line}: imports {mod}" for path in _test_files()
           for line, mod in local_imports(ast.parse(path.read_text(), str(path)))]
    assert not bad, "share helpers through tests/conftest.py fixtures instead:\n" + "\n".join(bad)


def test_no_test_module_edits_sys_path():
    bad = [f"{path.name}:{line}: {what}" for path in _test_files()
           for line, what in sys_path_edits(ast.parse(path.read_text(), str(path)))]
    assert not bad, "tests must not edit sys.path:\n" + "\n".join(bad)


def test_structure_checks_catch_what_they_forbid():
    """The two checks above are not vacuous: each pattern they forbid is found, ordinary code is not."""
    imports = ast.parse("import test_adapter\nfrom test_adapter import make_checkpoint\nimport conftest\n"
                        "from . import helpers\nfrom tests.conftest import x\n"
                        "importlib.import_module('test_runner')\n"
                        "import os, torch\nfrom pathlib import Path\nfrom harness import runner\n")
    assert [line for line, _ in local_imports(imports)] == [1, 2, 3, 4, 5, 6]
    edits = ast.parse("import sys\nsys.path.insert(0, 'x')\nsys.path.append('x')\nsys.path[0] = 'x'\n"
                      "sys.path += ['x']\nmonkeypatch.syspath_prepend('x')\nfrom sys import path\n"
                      "print(sys.path)\nenv = {'PYTHONPATH': 'x'}\nrows.insert(0, 1)\n")
    assert [line for line, _ in sys_path_edits(edits)] == [2, 3, 4, 5, 6, 7]
