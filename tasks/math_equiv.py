"""MATH answer extraction, normalisation and equivalence (docs/design.md §5, minerva_math).

Follows the rules of lm-eval's minerva_math task (Lewkowycz et al. 2022,
appendix D): the gold answer is the last ``\\boxed{...}`` of the solution; the
model's answer is what follows "Final Answer: The final answer is" up to
". I hope it is correct."; both are normalised (units and text wrappers
dropped, shorthand ``\\frac12`` / ``\\sqrt2`` expanded, thousands separators
removed) and compared: equal strings match, otherwise both are turned into sympy
expressions and their difference is simplified. lm-eval uses
``sympy.parsing.latex.parse_latex`` (needs antlr4, not installed here); we use
a small LaTeX-to-sympy translation of the forms MATH answers use instead.
"""

from __future__ import annotations

import re

INVALID = "[invalidanswer]"

# Unit words and wrappers removed from final answers (Minerva appendix D list).
_UNITS = ("square", "ways", "integers", "dollars", "mph", "inches", "ft", "hours", "km", "units",
          "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds",
          "meters", "meals", "edges", "students", "childrentickets", "multiples")
_SYMBOLS = ("\\ldots", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
            "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots")
_REPLACE = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
            (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))


def last_boxed(text: str) -> str | None:
    """The last ``\\boxed{...}`` (or ``\\fbox{...}`` / ``\\boxed x``) span of `text`, braces balanced."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return None


def unbox(span: str | None) -> str | None:
    """Content of a ``\\boxed{...}`` span; None when there is no well-formed box."""
    if span is None:
        return None
    if span.startswith("\\boxed "):
        return span[len("\\boxed "):]
    for head in ("\\boxed{", "\\fbox{"):
        if span.startswith(head) and span.endswith("}"):
            return span[len(head):-1]
    return None


def gold_answer(solution: str) -> str:
    """Normalised gold answer of a MATH solution."""
    content = unbox(last_boxed(solution))
    return normalize(content) if content is not None else INVALID


def final_answer_text(response: str) -> str:
    """The Minerva-format answer of a response, unnormalised, or INVALID."""
    m = re.search(r"Final Answer: The final answer is(.*?). I hope it is correct.",
                  response + "I hope it is correct.")
    return m.group(1).strip() if m else INVALID


def _drop_units(s: str) -> str:
    for unit in _UNITS:  # whole words first, never inside a LaTeX command
        s = re.sub(rf"(?<!\\)\b{unit}\b", "", s)
    for old, new in _REPLACE:
        s = s.replace(old, new)
    for unit in _UNITS:  # then glued units, skipping command names like \left
        parts = re.split(r"(\\[a-zA-Z]+)", s)
        s = "".join(p if i % 2 else p.replace(unit, "") for i, p in enumerate(parts))
    for sym in _SYMBOLS:
        s = s.replace(sym, "")
    return s


def normalize(answer: str) -> str:
    """Normalise a final answer string (Minerva rules)."""
    s = _drop_units(answer.split("=")[-1])
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", s)
    for wrapper in ("text", "textbf", "overline"):
        s = re.sub(rf"(\\{wrapper}\{{)(.*?)(\}})", "\\2", s)
    s = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", s)
    s = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", s)
    s = re.sub(r"(sqrt)(\[[^\]]*\])(\w)", "\\1\\2{\\3}", s)
    s = re.sub(r"(sqrt)(?!\[)([^{])", "sqrt{\\2}", s)
    s = s.replace("$", "")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+", s):
        s = s.replace(",", "")
    return s


def _brace_arg(s: str, i: int) -> tuple[str, int]:
    """The `{...}` group starting at s[i] and the index after it."""
    if i >= len(s) or s[i] != "{":
        raise ValueError("expected {")
    depth = 0
    for j in range(i, len(s)):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return s[i + 1:j], j + 1
    raise ValueError("unbalanced braces")


def latex_to_sympy_text(s: str) -> str:
    """Translate the LaTeX subset of MATH answers into sympy-parsable text (ValueError if unknown)."""
    out, i = [], 0
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\cdot", "*").replace("\\times", "*")
    while i < len(s):
        if s.startswith("\\frac", i):
            num, i = _brace_arg(s, i + 5)
            den, i = _brace_arg(s, i)
            out.append(f"(({latex_to_sympy_text(num)})/({latex_to_sympy_text(den)}))")
        elif s.startswith("\\sqrt[", i):
            close = s.index("]", i)
            idx = s[i + 6:close]
            arg, i = _brace_arg(s, close + 1)
            out.append(f"(({latex_to_sympy_text(arg)})**(1/({latex_to_sympy_text(idx)})))")
        elif s.startswith("\\sqrt", i):
            arg, i = _brace_arg(s, i + 5)
            out.append(f"sqrt({latex_to_sympy_text(arg)})")
        elif s.startswith("\\pi", i):
            out.append("pi")
            i += 3
        elif s[i] == "\\":
            raise ValueError(f"unsupported LaTeX command in {s!r}")
        elif s[i] == "^":
            out.append("**")
            i += 1
        elif s[i] in "{}":
            out.append("(" if s[i] == "{" else ")")
            i += 1
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def is_equiv(a: str, b: str) -> bool:
    """Two normalised answers are equal as strings or as sympy expressions.

    Deviation from lm-eval: a trailing period is ignored on both sides (one MATH
    gold answer, "\\frac{7}{5}+\\frac{1}{5}i.", has it inside its box).
    """
    a, b = a.rstrip("."), b.rstrip(".")
    if a == b:
        return a != INVALID
    if INVALID in (a, b) or len(a) > 80 or len(b) > 80:
        return False
    import sympy
    from sympy.parsing.sympy_parser import (implicit_multiplication_application, parse_expr,
                                            standard_transformations)

    transforms = standard_transformations + (implicit_multiplication_application,)
    try:
        ea = parse_expr(latex_to_sympy_text(a), transformations=transforms, evaluate=True)
        eb = parse_expr(latex_to_sympy_text(b), transformations=transforms, evaluate=True)
        if isinstance(ea, tuple) or isinstance(eb, tuple):
            if not (isinstance(ea, tuple) and isinstance(eb, tuple)) or len(ea) != len(eb):
                return False
            return all(sympy.simplify(x - y) == 0 for x, y in zip(ea, eb))
        return bool(sympy.simplify(ea - eb) == 0)
    except Exception:  # noqa: BLE001 - any parse/simplify failure means "not shown equal"
        return False


def score_response(response: str, gold_normalized: str) -> float:
    """1.0 when the response's Minerva-format final answer is equivalent to the gold."""
    return 1.0 if is_equiv(normalize(final_answer_text(response)), gold_normalized) else 0.0
