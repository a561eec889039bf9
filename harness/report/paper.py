"""The ReFusion paper's published Table 1 (arXiv 2512.13586) and the column layout of our tables.

The numbers live in ``harness/report/paper_table1.json`` (quality in percent, tokens/s as
published, source named in the file); this module only reads them and names the
columns: the paper's seven benchmarks and the embedded suite, each with its
lm-eval unit names, so a run's metrics files and the published rows line up.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from harness.run.store import read_json

DATA = Path(__file__).resolve().with_name("paper_table1.json")


@dataclass(frozen=True)
class Column:
    key: str  # the task name the published numbers use
    label: str
    tasks: tuple[str, ...]  # run units that fill this column, first present wins


@dataclass(frozen=True)
class Suite:
    name: str
    title: str
    columns: tuple[Column, ...]
    published: bool  # whether the paper has numbers for it


@functools.cache
def table1() -> dict:
    """The data file as is: ``source``, ``columns``, ``rows`` (model, kind, decoder, cells, average)."""
    return read_json(DATA)


def source() -> str:
    return table1()["source"]


def paper_suite() -> Suite:
    t = table1()
    aliases: dict[str, list[str]] = {}
    for alias, key in t.get("task_aliases", {}).items():
        aliases.setdefault(key, []).append(alias)
    cols = tuple(Column(c["task"], c["label"], (c["task"], *aliases.get(c["task"], ()))) for c in t["columns"])
    return Suite("paper", "The paper's seven benchmarks (Table 1 layout)", cols, True)


EMBEDDED = Suite("embedded", "Embedded synthetic suite (no published numbers)", (
    Column("embedded_math", "math", ("embedded_math",)),
    Column("embedded_code", "code", ("embedded_code",)),
    Column("embedded_choice", "choice", ("embedded_choice",)),
), False)


def suites() -> tuple[Suite, ...]:
    return (paper_suite(), EMBEDDED)


def published_rows() -> list[dict]:
    """One dict per published row: ``model``, ``kind`` (ar / mdm / refusion), ``decoder``, ``family`` (of the
    released checkpoint, harness/models/families.py: how our rows are matched to it),
    ``cells`` {task: {quality, tokens_per_s}} and the published ``average``."""
    return table1()["rows"]
