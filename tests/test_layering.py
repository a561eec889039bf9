"""The packages depend one way: harness -> tasks -> nothing of ours; harness -> refusion -> nothing
of ours. Read from the source with `ast` (every import statement at any depth, relative ones
resolved), not by importing anything."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OURS = ("refusion", "harness", "tasks")
# package -> packages of ours it may import (itself always)
ALLOWED = {"refusion": set(), "tasks": set(), "harness": {"refusion", "tasks"}}


def imported_packages(source: str, parts: tuple[str, ...]) -> dict[str, int]:
    """Top-level packages of ours other than parts[0] imported by one module's source -> first line.

    ``parts``: the module's dotted path, e.g. ("refusion", "decoding", "mdm")."""
    tree = ast.parse(source)
    package = parts[0]
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = parts[: len(parts) - node.level]
                if node.module:
                    names = [".".join(base + (node.module,))]
                else:  # `from .. import x`: x is a module of the resolved package
                    names = [".".join(base + (a.name,)) for a in node.names]
            elif node.module:
                names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if top in OURS and top != package:
                found.setdefault(top, node.lineno)
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_one_way(package):
    bad = []
    for path in sorted((REPO / package).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        for top, line in imported_packages(path.read_text(encoding="utf-8"), parts).items():
            if top not in ALLOWED[package]:
                bad.append(f"{path.relative_to(REPO)}:{line} imports {top}")
    assert not bad, "\n".join(bad)


def test_the_parser_sees_relative_and_nested_imports():
    """The checker itself: nested, relative and `from .. import` forms that leave the package are seen."""
    here = ("refusion", "decoding", "probe")
    assert imported_packages("def f():\n    from harness import runner\n", here) == {"harness": 2}
    assert imported_packages("from ...tasks import info\n", here) == {"tasks": 1}
    assert imported_packages("import os\nfrom ... import tasks\n", here) == {"tasks": 2}
    assert imported_packages("from . import common\nfrom ..objective import Example\n", here) == {}
    assert imported_packages("import tasks.info as ti\n", ("harness", "x")) == {"tasks": 1}
