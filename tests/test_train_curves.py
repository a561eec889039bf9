"""Learning curves (harness/train/curves.py): in-process evaluation with the preset decoders, snapshots written
by the trainer evaluated after training, the JSON record and the figure."""

from __future__ import annotations

import json

import pytest

from harness.train import curves


def test_preset_of_every_objective_is_a_preset():
    from harness.run.presets import PRESETS
    from refusion.train import MODEL_NAMES

    assert set(curves.PRESET_OF) == set(MODEL_NAMES) and all(p in PRESETS for p in curves.PRESET_OF.values())


def test_refusion_batched_and_single_give_the_same_quality(tiny_checkpoint, one_thread):
    """The committed refusion checkpoint through its preset: batched calls score as batch 1 (same tokens)."""
    from harness.models.checkpoints import load_model

    loaded = load_model(tiny_checkpoint("refusion"))
    model, tok = loaded.model, loaded.tokenizer
    one = curves.evaluate(model, tok, "refusion", n=6, batch=1, kinds=("code", "choice"))
    many = curves.evaluate(model, tok, "refusion", n=6, batch=4, kinds=("code", "choice"))
    for kind in ("code", "choice"):
        assert one[kind]["items"] == 6 and 0 <= one[kind]["quality"] <= 1
        assert one[kind]["quality"] == many[kind]["quality"]
        assert one[kind]["generated_tokens"] == many[kind]["generated_tokens"]
        assert one[kind]["tpf"] > 1  # trained: more than one token per forward at batch 1
    assert one["choice"]["quality"] > 0.5  # the committed model answers these (98% on 100 items)


def test_snapshots_of_a_run_become_curve_points(tmp_path, one_thread):
    """A tiny ar run with snapshots every 3 steps; `harness.train.curves` evaluates steps 3 and 6 (and skips
    them on a second call), recording tokens seen, and draws the figure."""
    from refusion.train import ModelShape, TrainConfig, prepare, train_one
    from tasks.embedded import KINDS, load_split

    cfg = TrainConfig(steps=6, batch_size=4, lr=3e-3, warmup=2, threads=1, snapshot_every=3)
    tok, examples = prepare(cfg, {k: load_split(k, "train")[:8] for k in KINDS})
    shape = ModelShape(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    run = tmp_path / "run"
    train_one("ar", tok, examples, cfg, shape, run, progress=False)
    out = tmp_path / "curves"
    args = ["--root", str(run), "--models", "ar", "--n", "2", "--batch", "2", "--threads", "1",
            "--kinds", "math,choice", "--out", str(out)]
    assert curves.main(args) == 0
    data = json.loads((out / "curves.json").read_text())
    (key, rec), = data["runs"].items()
    assert key.endswith("/ar") and rec["preset"] == "ar"
    points = rec["points"]
    assert [p["step"] for p in points] == [3, 6]
    assert 0 < points[0]["tokens_seen"] < points[1]["tokens_seen"]
    assert points[1]["tokens_seen"] == json.loads((run / "ar" / "train_config.json").read_text())["tokens_seen"]
    for p in points:
        assert set(p["kinds"]) == {"math", "choice"}
        for k in p["kinds"].values():
            assert k["items"] == 2 and 0 <= k["quality"] <= 1 and k["nfe"] >= 1
    assert (out / "curves.png").stat().st_size > 0
    before = (out / "curves.json").read_text()
    assert curves.main(args) == 0 and (out / "curves.json").read_text() == before  # nothing new to evaluate
    assert all(0 <= p["kinds"]["math"]["probe_result_digits"] <= 1 for p in points)

    # A point recorded before the probe existed gets the probe only; its decoding figures stay.
    for p in data["runs"][key]["points"]:
        for field in ("probe_result_digits", "probe_first_digits"):
            del p["kinds"]["math"][field]
    (out / "curves.json").write_text(json.dumps(data))
    assert curves.main(args) == 0
    assert json.loads((out / "curves.json").read_text()) == json.loads(before)

    # A run continuing that ar checkpoint (--init-dir run --refusion-init ar) has it as its step 0.
    from dataclasses import replace

    cont = tmp_path / "cont"
    train_one("refusion", tok, examples, replace(cfg, steps=3, init_dir=str(run), refusion_init="ar"), shape, cont,
              progress=False)
    assert [step for step, _ in curves.sources(cont, "refusion")] == [0, 3]
    assert curves.sources(cont, "refusion")[0] == (0, run / "ar")
    assert curves.sources(run, "ar")[0][0] == 3  # trained from random weights: no step 0
    # ... and a run continuing that one reads as the same curve, its steps counted after the first's.
    more = tmp_path / "more"
    train_one("refusion", tok, examples, replace(cfg, steps=3, init_dir=str(cont), refusion_init="refusion"), shape,
              more, progress=False)
    assert [step for step, _ in curves.sources(more, "refusion")] == [3, 6]
    assert curves.sources(more, "refusion")[0] == (3, cont / "refusion")
    first_tokens = json.loads((cont / "refusion" / "train_config.json").read_text())["tokens_seen"]
    assert curves._start(more / "refusion", "refusion") == (cont / "refusion", 3, first_tokens)
    assert curves._start(cont / "refusion", "refusion") == (run / "ar", 0, 0)


def test_math_arithmetic_signals():
    """Equations checked against their own operands; the first result against the gold's first."""
    doc = {"response": "Ana starts with 90 apples.\nAfter getting 37: 90 + 37 = 127.\nAfter losing 4: 127 - 4 = 123."
                       "\n#### 123"}
    wrong_then_right = "Ana starts with 90 apples.\nAfter getting 37: 90 + 37 = 125.\nAfter losing 4: 125 - 4 = 121."
    assert curves.arithmetic([doc["response"]], [doc]) == {"arith_lines": 1.0, "first_result": 1.0}
    assert curves.arithmetic([wrong_then_right], [doc]) == {"arith_lines": 0.5, "first_result": 0.0}
    assert curves.arithmetic(["no equation"], [doc]) == {"arith_lines": 0.0, "first_result": 0.0}


def test_bad_arguments_are_one_line_errors(capsys):
    assert curves.main(["--models", "gpt"]) == 2
    assert "error:" in capsys.readouterr().err


def test_curves_during_training_need_snapshots():
    from harness.train import train_tiny

    with pytest.raises(SystemExit, match="--snapshot-every"):
        train_tiny.main(["--models", "ar", "--curves", "--out", "/nonexistent-out"])


def test_merge_adds_only_missing_points(tmp_path):
    def point(step, q):
        return {"step": step, "tokens_seen": None, "n_per_kind": 2, "batch": 1, "source": "x",
                "kinds": {"choice": {"quality": q, "tpf": 1.0}}}

    path = tmp_path / "curves.json"
    curves.merge(path, {"runs": {"r/ar": {"model": "ar", "preset": "ar", "points": [point(3, 0.5)]}}})
    other = {"runs": {"r/ar": {"model": "ar", "preset": "ar", "points": [point(6, 1.0), point(3, 0.0)]},
                      "s/mdm": {"model": "mdm", "preset": "llada", "points": [point(3, 0.25)]}}}
    assert curves.merge(path, other) == 2  # step 6 of r/ar and s/mdm; r/ar step 3 is kept as it was
    data = json.loads(path.read_text())
    assert [(p["step"], p["kinds"]["choice"]["quality"]) for p in data["runs"]["r/ar"]["points"]] == [(3, 0.5), (6, 1.0)]
    assert data["runs"]["s/mdm"]["preset"] == "llada"
    assert curves.merge(path, other) == 0
    assert curves.main(["--merge", str(tmp_path / "missing.json"), "--out", str(tmp_path)]) == 2


def test_curves_record_the_mixture_and_tokens_of_each_run(tmp_path):
    """Issue #37: a curves run carries its training mixture, budget and tokens seen, so curves of several
    models can be checked for the same mixture and tokens (read from train_config.json or a state file)."""
    import dataclasses

    import torch

    from harness.train import curves
    from refusion.train import recipe

    cfg = recipe("refusion")
    (tmp_path / "refusion").mkdir()
    (tmp_path / "refusion" / "train_config.json").write_text(json.dumps(
        {"train": dataclasses.asdict(cfg), "recipe_fingerprint": "abc", "tokens_seen": 123}))
    info = curves.train_info(tmp_path, "refusion")
    assert (info["open_share"], info["result_share"], info["steps"], info["tokens_seen"]) == (0.2, 0.4, 4000, 123)
    torch.save({"config": dataclasses.asdict(recipe("mdm"))}, tmp_path / ".mdm.state.pt")
    assert curves.train_info(tmp_path, "mdm")["in_progress"] and curves.train_info(tmp_path, "dream") is None
    path = tmp_path / "curves.json"
    path.write_text(json.dumps({"runs": {}}))
    curves.set_train(path, "x/refusion", "refusion", info)
    assert json.loads(path.read_text())["runs"]["x/refusion"]["train"] == json.loads(json.dumps(info))
