"""Decoder knobs as frozen dataclasses (refusion/decoding/knobs.py): one source of names, defaults,
ranges and help; validated once, when built; printed by `python -m harness knobs` and MODELS=x:help."""

from __future__ import annotations

import dataclasses

import pytest

from refusion.decoding import DECODERS, get_decoder, make_knobs
from refusion.decoding.knobs import Knobs


def test_every_decoder_has_a_frozen_knob_class_with_help_for_every_field():
    for name, dec in DECODERS.items():
        assert issubclass(dec.knobs, Knobs) and dataclasses.is_dataclass(dec.knobs), name
        k = dec.knobs()  # the defaults are valid
        with pytest.raises(dataclasses.FrozenInstanceError):
            k.seed = 5
        for row in dec.knobs.describe():
            assert row["help"] and row["accepted"], (name, row)


def test_bad_values_and_names_raise_naming_the_knob():
    with pytest.raises(ValueError, match="slot_threshold must be a number in \\[0.0, 1.0\\], got 1.5"):
        make_knobs("refusion", {"slot_threshold": 1.5})
    with pytest.raises(ValueError, match="kv_layout must be one of \\['packed', 'replicated'\\]"):
        make_knobs("refusion", {"kv_layout": "copied"})
    with pytest.raises(ValueError, match="serial_num_blocks must divide the slot count 4"):
        make_knobs("refusion", {"gen_length": 32, "slot_size": 8, "serial_num_blocks": 3})
    with pytest.raises(ValueError, match="left_to_right must be true or false"):
        make_knobs("refusion", {"left_to_right": "yes"})
    with pytest.raises(ValueError, match="steps must be a multiple of the block count 4"):
        make_knobs("llada", {"gen_length": 128, "block_length": 32, "steps": 6})
    with pytest.raises(ValueError, match="unknown knob\\(s\\) on_commit for decoder 'refusion'; valid knobs: gen_length"):
        make_knobs("refusion", {"on_commit": 1})  # a test hook is not a knob
    with pytest.raises(ValueError, match="unknown decoder 'nope'; valid decoders: ar, d2f, diffusion_gemma, dream"):
        get_decoder("nope")


def test_a_built_knob_set_passes_through_unchanged():
    k = make_knobs("refusion", {"slot_size": 4})
    cls = DECODERS["refusion"].knobs
    assert cls.of(k) is k  # validated once, reused as is
    assert cls.of(k, {"slot_size": 8}).slot_size == 8 and k.slot_size == 4


def test_knobs_command_and_models_help(capsys):
    from harness.run import knobs, runner

    assert knobs.main(["refusion", "d2f"]) == 0
    out = capsys.readouterr().out
    assert "refusion (RefusionKnobs" in out and "slot_size" in out and "packed | replicated" in out
    assert "d2f (D2fKnobs" in out and "skip_threshold" in out
    assert knobs.main(["nope"]) == 2 and "unknown decoder 'nope'" in capsys.readouterr().err
    with pytest.raises(runner.KnobHelp) as e:
        runner.parse_models("ar,refusion:help")
    assert e.value.decoder == "refusion"
    assert runner.main(["--models", "llada:help"]) == 0
    assert "remasking" in capsys.readouterr().out
