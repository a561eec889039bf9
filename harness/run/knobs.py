"""`python -m harness knobs [decoder ...]`: every decoder's knobs with defaults, accepted values and
help, read from the decoders' knob dataclasses (refusion/decoding). `make eval MODELS=refusion:help`
prints the same for one model."""

from __future__ import annotations

import argparse
import sys


def describe(decoder: str) -> str:
    """The knob table of one decoder as plain text."""
    from refusion.decoding import get_decoder

    d = get_decoder(decoder)
    rows = d.knobs.describe()
    w = max(len(r["name"]) for r in rows)
    wd = max(len(repr(r["default"])) for r in rows)
    wa = max(len(r["accepted"]) for r in rows)
    lines = [f"{decoder} ({d.knobs.__name__}; {'batched rows' if d.batched else 'one row at a time'}):"]
    lines += [f"  {r['name']:<{w}}  {r['default']!r:<{wd}}  {r['accepted']:<{wa}}  {r['help']}" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from refusion.decoding import DECODERS

    p = argparse.ArgumentParser(prog="python -m harness knobs", description=__doc__.split("\n\n")[0])
    p.add_argument("decoders", nargs="*", help=f"decoder names (default: all of {', '.join(DECODERS)})")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        print("\n\n".join(describe(d) for d in (a.decoders or list(DECODERS))))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
