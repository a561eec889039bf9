"""Embedded synthetic task suite: small, seeded generators a tiny model can learn on a CPU.

Three kinds mirror the seven benchmarks (docs/design.md §5):

- ``math``   GSM8K / MATH style word problems; step-by-step solution ending in
             ``#### <integer>``; scored by exact match of the final integer.
- ``code``   HumanEval / MBPP style: write a small Python function from a
             description; scored pass@1 by assert-based tests in the sandbox.
- ``choice`` MMLU-Pro / ARC / GPQA style lettered multiple choice, answered
             ``The answer is (X)``.

Every item is a chat-style ``query`` / ``response`` pair (as in the ReFusion
authors' SFT data). Generation is a pure function of (kind, split, seed): the test
split is drawn first from its own seed and the training split skips every query
that occurs in the test split, so no test item is ever trained on.

    load_split("math", "test")  -> list[dict]   (deterministic, cached per process)
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Callable

KINDS = ("math", "code", "choice")
SPLIT_SIZES = {"train": 20000, "test": 400}
SPLIT_SEEDS = {"train": 1, "test": 2}

NAMES = ["Ana", "Ben", "Mia", "Leo", "Zoe", "Sam", "Ivy", "Max", "Eva", "Tom", "Lily", "Omar", "Nina", "Raj",
         "Kai", "Ada", "Noah", "Emma", "Liam", "Sara"]
OBJECTS = ["apples", "marbles", "stickers", "books", "coins", "pens", "cards", "shells", "stamps", "cookies",
           "beads", "toys", "flowers", "rocks", "pencils"]
WORDS = ["river", "cat", "mountain", "sun", "garden", "tree", "window", "bird", "planet", "cup", "ocean", "lamp",
         "forest", "dog", "castle", "key", "bridge", "star", "island", "hat", "pencil", "moon", "desert", "fox",
         "kettle", "cloud", "train", "rose", "valley", "book"]


# ---------------------------------------------------------------- math

# (verb phrase for the story, short phrase for the solution, sign)
GAINS = [("finds {d} more {obj}", "finding {d} more", 1), ("buys {d} more {obj}", "buying {d} more", 1),
         ("gets {d} {obj} from a friend", "getting {d}", 1), ("wins {d} {obj}", "winning {d}", 1)]
LOSSES = [("gives {d} {obj} to {other}", "giving {d} away", -1), ("loses {d} {obj}", "losing {d}", -1),
          ("sells {d} {obj}", "selling {d}", -1), ("uses {d} {obj}", "using {d}", -1)]


def _math_item(rng: random.Random) -> dict:
    name, other = rng.sample(NAMES, 2)
    obj = rng.choice(OBJECTS)
    value = rng.randint(10, 99)
    n_steps = rng.choice([2, 2, 2, 3])
    story = [f"{name} has {value} {obj}."]
    lines = [f"{name} starts with {value} {obj}."]
    for i in range(n_steps):
        # Keep every intermediate result in [0, 199] so the arithmetic stays 2-3 digits.
        if value > 20 and (value > 150 or rng.random() < 0.5):
            verb, short, sign = rng.choice(LOSSES)
            d = rng.randint(2, min(value - 1, 50))
        else:
            verb, short, sign = rng.choice(GAINS)
            d = rng.randint(2, 50)
        new = value + sign * d
        phrase = verb.format(d=d, obj=obj, other=other)
        story.append(f"{'Then ' if i else ''}{name} {phrase}.")
        op = "+" if sign > 0 else "-"
        lines.append(f"After {short.format(d=d)}: {value} {op} {d} = {new}.")
        value = new
    query = " ".join(story) + f" How many {obj} does {name} have now?"
    response = "\n".join(lines) + f"\n#### {value}"
    return {"query": query, "response": response, "answer": str(value)}


# ---------------------------------------------------------------- code

@dataclass(frozen=True)
class CodeTemplate:
    stem: str                      # function-name stem
    args: str                      # parameter list
    text: str                      # description, formatted with the constants
    expr: str                      # return expression, formatted with the constants
    fn: Callable                   # reference semantics: fn(consts, *inputs) -> output
    inputs: Callable               # rng -> tuple of call arguments


def _ints(rng):
    return (rng.randint(-20, 40),)


def _list(rng):
    return ([rng.randint(0, 30) for _ in range(rng.randint(3, 6))],)


def _word(rng):
    return ("".join(rng.choice("abcde") for _ in range(rng.randint(3, 8))),)


CODE_TEMPLATES = [
    CodeTemplate("scale", "x", "returns x multiplied by {a} plus {b}", "x * {a} + {b}",
                 lambda c, x: x * c["a"] + c["b"], _ints),
    CodeTemplate("shift", "x", "adds {a} to x and multiplies the result by {b}", "(x + {a}) * {b}",
                 lambda c, x: (x + c["a"]) * c["b"], _ints),
    CodeTemplate("wrap", "x", "returns the remainder of x plus {a} divided by {b}", "(x + {a}) % {b}",
                 lambda c, x: (x + c["a"]) % c["b"], _ints),
    CodeTemplate("is_multiple", "x", "returns True if x is divisible by {b}, else False", "x % {b} == 0",
                 lambda c, x: x % c["b"] == 0, _ints),
    CodeTemplate("sum_above", "xs", "returns the sum of the elements of xs that are greater than {a}",
                 "sum(v for v in xs if v > {a})", lambda c, xs: sum(v for v in xs if v > c["a"]), _list),
    CodeTemplate("count_below", "xs", "returns how many elements of xs are less than {a}",
                 "len([v for v in xs if v < {a}])", lambda c, xs: len([v for v in xs if v < c["a"]]), _list),
    CodeTemplate("times_all", "xs", "returns a list with every element of xs multiplied by {b}",
                 "[v * {b} for v in xs]", lambda c, xs: [v * c["b"] for v in xs], _list),
    CodeTemplate("max_plus", "xs", "returns the largest element of xs plus {a}", "max(xs) + {a}",
                 lambda c, xs: max(xs) + c["a"], _list),
    CodeTemplate("min_times", "xs", "returns the smallest element of xs times {b}", "min(xs) * {b}",
                 lambda c, xs: min(xs) * c["b"], _list),
    CodeTemplate("count_char", "s", "returns the number of times the letter '{ch}' appears in s",
                 "s.count('{ch}')", lambda c, s: s.count(c["ch"]), _word),
    CodeTemplate("repeat", "s", "returns s repeated {b} times", "s * {b}", lambda c, s: s * c["b"], _word),
    CodeTemplate("tail", "s", "returns the last {b} characters of s", "s[-{b}:]", lambda c, s: s[-c["b"]:], _word),
    CodeTemplate("add_suffix", "s", "returns s reversed followed by the letter '{ch}'", "s[::-1] + '{ch}'",
                 lambda c, s: s[::-1] + c["ch"], _word),
]


def _code_item(rng: random.Random) -> dict:
    t = rng.choice(CODE_TEMPLATES)
    consts = {"a": rng.randint(1, 30), "b": rng.randint(2, 9), "ch": rng.choice("abcde")}
    name = f"{t.stem}_{rng.randint(1, 99)}"
    entry = f"def {name}({t.args}):"
    query = f"Write a Python function `{name}({t.args})` that {t.text.format(**consts)}."
    response = f"{entry}\n    return {t.expr.format(**consts)}"
    tests = []
    for _ in range(3):
        args = t.inputs(rng)
        expected = t.fn(consts, *args)
        tests.append(f"assert {name}({', '.join(repr(a) for a in args)}) == {expected!r}")
    return {"query": query, "response": response, "answer": response, "entry_point": name, "tests": tests}


# ---------------------------------------------------------------- choice

LETTERS = "ABCDEFGHIJ"


CATEGORIES = {
    "an animal": ["cat", "dog", "horse", "tiger", "rabbit", "eagle", "shark", "frog"],
    "a fruit": ["apple", "banana", "cherry", "grape", "lemon", "mango", "peach", "plum"],
    "a color": ["red", "blue", "green", "yellow", "purple", "orange", "brown", "pink"],
    "a tool": ["hammer", "saw", "wrench", "drill", "shovel", "ladder", "needle", "axe"],
    "a country": ["France", "Japan", "Brazil", "Kenya", "Canada", "India", "Peru", "Egypt"],
}


def _choice_item(rng: random.Random) -> dict:
    qtype = rng.choice(["largest", "smallest", "longest", "category", "category"])
    if qtype in ("largest", "smallest"):
        opts = rng.sample(range(10, 100), rng.choice([3, 4]))
        best = max(opts) if qtype == "largest" else min(opts)
        question = f"Which number is the {qtype}?"
        reason = f"The {qtype} number is {best}."
        correct = opts.index(best)
    elif qtype == "longest":
        # All option words have distinct lengths so the answer is unique.
        by_len: dict[int, list[str]] = {}
        for w in WORDS:
            by_len.setdefault(len(w), []).append(w)
        lengths = rng.sample(sorted(by_len), rng.choice([3, 4, 5]))
        opts = [rng.choice(by_len[n]) for n in lengths]
        best = max(opts, key=len)
        question = "Which word has the most letters?"
        reason = f"The longest word is {best}."
        correct = opts.index(best)
    else:
        cat, *others = rng.sample(sorted(CATEGORIES), rng.choice([4, 5]))
        best = rng.choice(CATEGORIES[cat])
        opts = [best] + [rng.choice(CATEGORIES[o]) for o in others]
        rng.shuffle(opts)
        question = f"Which of these is {cat}?"
        reason = f"{best} is {cat}."
        correct = opts.index(best)
    letters = LETTERS[: len(opts)]
    listing = "\n".join(f"({letters[i]}) {o}" for i, o in enumerate(opts))
    query = f"{question}\n{listing}\nEnd with \"The answer is (X)\"."
    response = f"{reason}\nThe answer is ({letters[correct]})"
    return {"query": query, "response": response, "answer": letters[correct]}


GENERATORS: dict[str, Callable[[random.Random], dict]] = {"math": _math_item, "code": _code_item,
                                                           "choice": _choice_item}


def _generate(kind: str, split: str, n: int, seed: int, exclude: frozenset[str]) -> list[dict]:
    rng = random.Random(f"{kind}/{split}/{seed}")
    gen = GENERATORS[kind]
    rows, seen = [], set(exclude)
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 50 * n:
            raise RuntimeError(f"{kind}/{split}: cannot draw {n} distinct items")
        item = gen(rng)
        if item["query"] in seen:
            continue
        seen.add(item["query"])
        rows.append({"id": f"{kind}-{split}-{len(rows):05d}", "kind": kind, **item})
    return rows


@functools.lru_cache(maxsize=None)
def _cached(kind: str, split: str) -> tuple[dict, ...]:
    if kind not in GENERATORS:
        raise KeyError(f"unknown embedded task kind {kind!r}; known: {', '.join(KINDS)}")
    if split not in SPLIT_SIZES:
        raise KeyError(f"unknown split {split!r}; known: {', '.join(SPLIT_SIZES)}")
    exclude: frozenset[str] = frozenset()
    if split == "train":
        exclude = frozenset(r["query"] for r in _cached(kind, "test"))
    return tuple(_generate(kind, split, SPLIT_SIZES[split], SPLIT_SEEDS[split], exclude))


def load_split(kind: str, split: str) -> list[dict]:
    """All items of one embedded task split (fresh dicts; safe to mutate)."""
    return [dict(r) for r in _cached(kind, split)]
