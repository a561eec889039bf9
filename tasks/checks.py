"""Checks any lm-eval task's documents must pass, built-in or custom (docs/extending.md): used by the
runner before anything runs (harness/run/runner.py ``check_docs``) and by ``validate-tasks``.

lm-eval itself renders only the first document when it builds a task, and a ``doc_to_target`` that
names a field the row lacks is not an error there: the name is rendered as a template, so the gold
answer silently becomes the field's *name* (a run then scores every response against the string
``'answer'``). ``target_problem`` catches that, and a null or empty target, per row.
"""

from __future__ import annotations

import functools
from typing import Any


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip()) or (
        isinstance(value, (list, tuple, dict)) and not value)


@functools.lru_cache(maxsize=256)
def _template_fields(template: str) -> frozenset[str]:
    """The names a Jinja template reads from the document (its undeclared variables); parsed once per template,
    as a run checks every document of a task against the same one."""
    from jinja2 import Environment, meta

    try:
        return frozenset(meta.find_undeclared_variables(Environment().parse(template)))
    except Exception:  # noqa: BLE001 - a template Jinja cannot parse fails when rendered, with its own message
        return frozenset()


def target_problem(task, doc: dict) -> str | None:
    """What is wrong with one document's gold answer under ``task`` (an lm-eval Task), or None.

    - ``doc_to_target`` a plain field name: the row must have that field, not null or empty;
    - a template: every field it reads that the row has must not be null (a null renders as "None"),
      and the rendered target must not be empty;
    - a function (``!function``) or an index: its value must not be None.
    """
    spec = getattr(task.config, "doc_to_target", None)
    if isinstance(spec, str) and spec.isidentifier():
        if spec not in doc:
            return f"no target field {spec!r} (the task's doc_to_target); every row needs it"
        if _empty(doc[spec]):
            return f"target field {spec!r} is {'null' if doc[spec] is None else 'empty'}"
        return None
    if isinstance(spec, str):
        nulls = sorted(f for f in _template_fields(spec) if f in doc and doc[f] is None)
        if nulls:
            return f"field {nulls[0]!r}, read by the task's doc_to_target, is null"
    target = task.doc_to_target(doc)
    if target is None or (isinstance(target, str) and not target.strip()):
        return "the task's doc_to_target gives an empty gold answer"
    return None
