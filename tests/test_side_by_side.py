"""scripts/side_by_side_authors.py without the authors' code: its pure pieces (token counting, ABBA order,
knob mapping, the target table), the prompts and knobs it sends, and its one-line errors. No timing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "side_by_side_authors.py"


@pytest.fixture(scope="module")
def sbs():
    spec = importlib.util.spec_from_file_location("side_by_side_authors", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_tokens_are_counted_up_to_and_including_the_first_eos(sbs):
    assert sbs.cut_at_eos([5, 6, 2, 7, 2], 2) == [5, 6, 2]
    assert sbs.count_tokens([5, 6, 2, 7, 2], 2) == 3
    assert sbs.count_tokens([5, 6, 7], 2) == 3
    assert sbs.count_tokens([5, 6, 7], -1) == 3  # no EOS: every token
    assert sbs.count_tokens([], 2) == 0


def test_abba_order_balances_every_side(sbs):
    sides = sbs.side_names(["eager", "compiled"])
    assert sides == ["ours_eager", "ours_compiled", "theirs"]
    order = sbs.abba(sides)
    assert order == ["ours_eager", "ours_compiled", "theirs", "theirs", "ours_compiled", "ours_eager"]
    mean_slot = {s: sum(i for i, x in enumerate(order) if x == s) / order.count(s) for s in sides}
    assert len(set(mean_slot.values())) == 1 and all(order.count(s) == 2 for s in sides)
    assert sbs.abba(sbs.side_names(["eager"])) == ["ours_eager", "theirs", "theirs", "ours_eager"]


def test_knobs_map_onto_their_arguments(sbs):
    knobs = {"gen_length": 96, "slot_size": 4, "serial_num_blocks": 1, "slot_threshold": 0.6,
             "token_threshold": 0.3}
    assert sbs.theirs_kwargs(knobs, mask_id=3) == {**knobs, "temperature": 0.0, "mask_id": 3}
    with pytest.raises(ValueError, match="left_to_right"):
        sbs.theirs_kwargs({**knobs, "left_to_right": True}, mask_id=3)
    with pytest.raises(ValueError, match="greedy"):
        sbs.theirs_kwargs({**knobs, "temperature": 0.5}, mask_id=3)


def test_first_difference_and_median_ratio(sbs):
    assert sbs.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert sbs.first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert sbs.first_difference([1, 2, 3], [1, 2]) == 2
    assert sbs.median_ratio([30.0, 20.0, 10.0], [10.0, 10.0, 10.0]) == 2.0
    assert sbs.median_ratio([None], [10.0]) is None


def test_the_table_holds_four_cells_with_value_target_and_met(sbs):
    cells = sbs.table({"eager": {"short": 1.25, "long": 1.9}}, {"eager": {"short": True, "long": True}},
                      {"compiled": sbs.NO_COMPILE})
    assert set(cells) == {"eager", "compiled"} and all(set(row) == {"short", "long"} for row in cells.values())
    assert cells["eager"]["short"] == {"value": 1.25, "target": ">= 1.2", "met": True, "same_tokens": True}
    assert cells["eager"]["long"]["met"] is False and cells["eager"]["long"]["target"] == ">= 2.0"
    for s, target in (("short", ">= 2.0"), ("long", ">= 3.0")):
        c = cells["compiled"][s]
        assert c["value"] is None and c["met"] is None and c["target"] == target
        assert c["note"] == "not available (no compile knob)"
    # a ratio over different tokens never meets its target
    other = sbs.table({"eager": {"short": 5.0}}, {"eager": {"short": False}})
    assert other["eager"]["short"]["met"] is False and other["eager"]["long"]["note"] == "not measured"


class _FakeWorker:
    """Answers decode requests with fixed tokens and seconds, and logs the calls."""

    def __init__(self, name, calls, tokens, seconds):
        self.name, self.calls, self.tokens, self.seconds = name, calls, tokens, seconds

    def ask(self, **req):
        side = "theirs" if self.name == "theirs" else f"ours_{req['variant']}"
        self.calls.append((side, tuple(req["ids"])))
        if self.name == "theirs":
            assert req["kwargs"]["mask_id"] == 3 and "eos" in req
        return {"tokens": list(self.tokens(side, req["ids"])), "seconds": self.seconds[side], "cpu_seconds": 0.0}


def test_measure_set_interleaves_counts_and_flags_a_mismatch(sbs):
    calls = []

    def tokens(side, ids):
        if side == "ours_compiled" and ids == [20, 21]:
            return [7, 8, 2, 9]  # differs from theirs after the EOS-cut
        return [7, 2, 5, 5] if ids == [20, 21] else [4, 4, 4]

    seconds = {"ours_eager": 1.0, "ours_compiled": 0.5, "theirs": 2.0}
    workers = {"ours": _FakeWorker("ours", calls, tokens, seconds),
               "theirs": _FakeWorker("theirs", calls, tokens, seconds)}
    knobs = {"gen_length": 4, "slot_size": 2, "serial_num_blocks": 1, "slot_threshold": 0.5, "token_threshold": 0.5}
    prompts = [{"kind": "math", "index": 0, "ids": [10, 11], "knobs": knobs},
               {"kind": "code", "index": 0, "ids": [20, 21], "knobs": knobs}]
    sides = sbs.side_names(["eager", "compiled"])
    r = sbs.measure_set("short", prompts, 2, 3, workers, sides, 2, lambda msg: None)
    warmup = [(s, (10, 11)) for s in sides]
    one_rep = [(s, tuple(p["ids"])) for p in prompts for s in sbs.abba(sides)]
    assert calls == warmup + one_rep + one_rep
    assert r["sides"]["theirs"]["tokens_per_rep"] == [2 * (3 + 2)] * 2  # [4,4,4] no EOS, [7,2] cut after the EOS
    assert r["sides"]["ours_compiled"]["tokens_per_rep"] == [2 * (3 + 3)] * 2
    assert r["ratios"]["eager"]["median"] == 2.0
    assert r["same_tokens"] == {"eager": True, "compiled": False}
    (m,) = r["mismatches"]
    assert (m["variant"], m["prompt"], m["first_difference"]) == ("compiled", 1, 1)
    assert r["per_prompt"][0]["same_tokens_eager"] and not r["per_prompt"][1]["same_tokens_compiled"]
    assert r["nondeterministic"] == []


def test_the_git_blob_id_is_gits(sbs, tmp_path):
    f = tmp_path / "x.py"
    f.write_bytes(b"print('x')\n")
    want = subprocess.run(["git", "hash-object", str(f)], capture_output=True, text=True, check=True).stdout.strip()
    assert sbs.git_blob_id(f) == want


def test_short_prompts_are_chat_templated_with_the_runs_knobs(sbs):
    from transformers import AutoTokenizer

    from harness.run.presets import PRESETS
    from tasks.embedded import load_split
    from tasks.info import TASKS

    tok = AutoTokenizer.from_pretrained(str(REPO / sbs.CHECKPOINT))
    prompts = sbs.short_prompts(tok, 1)
    assert [p["kind"] for p in prompts] == ["math", "code", "choice"]
    for p in prompts:
        assert p["knobs"] == {**PRESETS["refusion"].knobs, "gen_length": TASKS[f"embedded_{p['kind']}"].gen_length}
        text = tok.decode(p["ids"])
        assert load_split(p["kind"], "test")[0]["query"] in text and text.startswith(tok.bos_token)
    eos, mask = sbs.checkpoint_ids(REPO / sbs.CHECKPOINT, tok)
    assert (eos, mask) == (tok.eos_token_id, tok.convert_tokens_to_ids("<|mask|>"))


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO, timeout=120)


@pytest.mark.parametrize("args, says", [
    ((), "--theirs-python is required"),
    (("--theirs-python", "/nonexistent/python"), "--theirs-python /nonexistent/python: not an executable file"),
    (("--theirs-python", sys.executable), "--refusion-repo is required"),
    (("--theirs-python", sys.executable, "--refusion-repo", "/nonexistent-repo"), "no generate.py"),
])
def test_a_missing_side_is_one_error_line_and_exit_2(args, says):
    p = _run(*args)
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("error: ") and says in p.stderr


def test_help_and_the_make_target(fake_venv):
    p = _run("--help")
    assert p.returncode == 0 and "--theirs-python" in p.stdout and "--refusion-repo" in p.stdout
    # the variables reach the script: its own error about the python it was given
    m = subprocess.run(["make", "-s", "side-by-side", f"VENV={fake_venv}", "AUTHORS_PY=/nonexistent dir/python",
                        "REFUSION_REPO=/r"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert m.returncode != 0
    assert "error: --theirs-python /nonexistent dir/python: not an executable file" in m.stderr
