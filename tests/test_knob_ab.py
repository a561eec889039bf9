"""harness.speed.knob_ab: a knob value against the preset's knobs, in process, by the timing protocol."""

import json

import pytest

from harness.speed import knob_ab

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("text,want", [("logits_chunk=none", ("logits_chunk", None)), ("compile=true", ("compile", True)),
                                       ("slot_size=4", ("slot_size", 4)), ("token_threshold=0.5",
                                                                          ("token_threshold", 0.5)),
                                       ("attn=flex", ("attn", "flex"))])
def test_knob_values(text, want):
    assert knob_ab.knob_value(text) == want


def test_writes_one_row_per_kind_with_its_interval(tmp_path, capsys):
    out = tmp_path / "ab.json"
    assert knob_ab.main(["--knob", "logits_chunk=none", "--presets", "refusion", "--limit", "1", "--rounds", "2",
                         "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["knob"] == "logits_chunk" and got["value"] is None and got["rounds"] == 2
    assert sorted(r["kind"] for r in got["rows"]) == ["choice", "code", "math"]
    for r in got["rows"]:
        assert r["preset"] == "refusion" and r["same_tokens"] is True  # the knob keeps refusion's tokens
        assert r["lo"] <= r["ratio"] <= r["hi"] and r["current_tps"] > 0 and r["baseline_tps"] > 0
    assert "refusion/embedded_math tokens/s" in capsys.readouterr().out


@pytest.mark.parametrize("argv,words", [(["--knob", "logits_chunk=none", "--presets", "ar"], "have no knob"),
                                        (["--knob", "logits_chunk=none", "--presets", "nope"], "unknown preset"),
                                        (["--knob", "logits_chunk"], "expected name=value"),
                                        (["--knob", "no_such_knob=1"], "no preset of `make regress` has")])
def test_bad_input_is_one_line(argv, words, capsys, tmp_path):
    assert knob_ab.main([*argv, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and words in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x.json").exists()
