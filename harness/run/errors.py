"""One line for an error that is the user's data, files or knobs (a decoder's ``KnobLimit``): the message `harness
eval` prints instead of a traceback, found wherever it sits in an exception's chain."""

from __future__ import annotations


def _chain(exc: BaseException) -> list[BaseException]:
    out = [exc]
    while True:
        nxt = out[-1].__cause__ or out[-1].__context__
        if nxt is None or nxt in out:
            return out
        out.append(nxt)


def known_error(exc: BaseException) -> str | None:
    """One line for an error that is the user's data or files, wherever in the chain it sits; else None.

    lm-eval wraps what a dataset hook or a template raises, so the useful message is
    often several links down (and the outermost one names neither file nor field).
    """
    from tasks.data import DataError
    from harness.run.faults import disk_full
    from harness.run.engine import EngineError
    from harness.run.lm_adapter import CheckpointError
    from refusion.decoding.common import KnobLimit

    if (line := disk_full(exc)) is not None:
        return line
    for e in _chain(exc):
        if isinstance(e, (DataError, CheckpointError, EngineError, KnobLimit)):
            return str(e).replace("\n", " ")
    try:
        from jinja2.exceptions import UndefinedError
    except ImportError:
        return None
    for e in _chain(exc):
        if isinstance(e, UndefinedError):
            return (f"the task's template cannot use a document of its data ({e}); check that the rows "
                    "have the fields the task's YAML names").replace("\n", " ")
    return None


def root_message(exc: BaseException) -> str:
    known = known_error(exc)
    if known is not None:
        return known
    seen = _chain(exc)[-1]
    return f"{type(seen).__name__}: {seen}".replace("\n", " ")

