"""Error messages that point at the fix: a "did you mean" for a misspelt name, a short line of valid
names instead of every one, and what exactly changed when a run cannot be resumed.

Plain functions of strings and dicts (no I/O); the runner, the merge and the models file use them in
their one-line ``error:`` messages.
"""

from __future__ import annotations

import difflib
import json
from typing import Any, Iterable


def did_you_mean(word: str, valid: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the valid name closest to ``word``, or "" when none is close."""
    choices = sorted(set(valid))
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if not close:  # a prefix or a name inside the word: "gsm8" -> gsm8k_cot, "refusion_x" -> refusion
        close = [c for c in choices if word and (c.startswith(word) or word.startswith(c))][:1]
    return f" (did you mean {close[0]!r}?)" if close else ""


def short_list(valid: Iterable[str], groups: Iterable[str] = (), limit: int = 16, lister: str | None = None) -> str:
    """The valid names as one short line: a member ``<group>_...`` of a group is counted under it, not
    listed; past ``limit`` names the rest is a count, and ``lister`` (a command) is named for the whole list."""
    names = list(dict.fromkeys(valid))
    groups = [g for g in set(groups) if g in names]
    members = {g: [n for n in names if n != g and n.startswith(g + "_")] for g in groups}
    hidden = {n for ms in members.values() for n in ms}
    shown = [n + (f" (+{len(members[n])} subtasks)" if members.get(n) else "") for n in names if n not in hidden]
    text = ", ".join(shown[:limit]) + (f", ... ({len(shown) - limit} more)" if len(shown) > limit else "")
    return text + (f"; `{lister}` lists every one" if lister and (hidden or len(shown) > limit) else "")


def unknown(what: str, word: str, valid: Iterable[str], groups: Iterable[str] = (), lister: str | None = None,
            label: str | None = None) -> str:
    """``unknown <what> 'word' (did you mean 'x'?); valid <what>s: a, b, ...``: the message of a bad name,
    its valid names as one short line (``label``: what that list is called, default ``<what>s``)."""
    valid = list(valid)
    return (f"unknown {what} {word!r}{did_you_mean(word, valid)}; valid {label or what + 's'}: "
            f"{short_list(valid, groups, lister=lister)}")


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def models_change(old: list[dict], new: list[dict]) -> str:
    """What differs between two runs' model lists, per model and field: ``model 'a' knob slot_size 8 -> 4;
    model 'b' added``; "" when they are equal."""
    before = {m.get("name"): m for m in old if isinstance(m, dict)}
    after = {m.get("name"): m for m in new if isinstance(m, dict)}
    out = [f"model {n!r} added" for n in after if n not in before]
    out += [f"model {n!r} removed" for n in before if n not in after]
    for n in (n for n in after if n in before):
        a, b = before[n], after[n]
        for key in sorted(set(a) | set(b)):
            if a.get(key) == b.get(key):
                continue
            if isinstance(a.get(key), dict) and isinstance(b.get(key), dict):
                for k in sorted(set(a[key]) | set(b[key])):
                    if a[key].get(k) != b[key].get(k):
                        out.append(f"model {n!r} {key} {k}: {_short(a[key].get(k, '(unset)'))} -> "
                                   f"{_short(b[key].get(k, '(unset)'))}")
            else:
                out.append(f"model {n!r} {key}: {_short(a.get(key, '(unset)'))} -> {_short(b.get(key, '(unset)'))}")
    if not out and [m.get("name") for m in old] != [m.get("name") for m in new]:
        out.append("the models' order")
    return "; ".join(out)
