"""Regression check (`make regress`): comparison rules, bad baselines, update + history, on fake runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.run.presets import REGRESS_MODELS
from harness.speed import regress

TASKS = ("embedded_math", "embedded_code")


def fake_run(root: Path, tps: dict[str, float], nfe: int = 40, quality: float = 0.5) -> Path:
    """A finished run folder with the regression check's models: metrics files as the worker writes them."""
    run = root / "run"
    (run / "metrics").mkdir(parents=True)
    models = [{"name": m, "decoder": m} for m in REGRESS_MODELS]
    (run / "run.json").write_text(json.dumps({
        "models": models, "units": [{"name": t} for t in TASKS], "baseline": "ar", "limit": regress.LIMIT,
        "seed": regress.SEED, "threads": regress.THREADS}))
    for m in REGRESS_MODELS:
        for t in TASKS:
            gen = 100
            (run / "metrics" / f"{m}__{t}.json").write_text(json.dumps({
                "quality": {"exact_match,extract": quality}, "quality_primary": "exact_match,extract",
                "speed": {"generated_tokens": {"total": gen}, "nfe": {"total": nfe},
                          "tpf": {"ratio_of_sums": gen / nfe}, "tokens_per_s": {"ratio_of_sums": tps[m]}}}))
    return run


BASE_TPS = {"ar": 100.0, "refusion": 300.0, "llada": 20.0, "fast_dllm": 80.0, "dream": 20.0, "d2f": 250.0}


def test_figures_and_ratios(tmp_path):
    f = regress.figures(fake_run(tmp_path, BASE_TPS))
    assert f["deterministic"]["refusion/embedded_math"] == {"quality": 0.5, "generated_tokens": 100, "nfe": 40,
                                                            "tpf": 2.5}
    assert f["ratios"]["refusion/ar/embedded_code"] == 3.0
    assert f["ratios"]["fast_dllm/llada/embedded_math"] == 4.0
    assert "ar/ar/embedded_math" not in f["ratios"]


def test_compare_exact_and_ratio_tolerance(tmp_path):
    base = regress.figures(fake_run(tmp_path / "a", BASE_TPS))
    assert all(r["ok"] for r in regress.compare(base, base))
    # 15% slower refusion (within 20%) and a faster fast_dllm pass; one more forward fails exactly.
    slower = regress.figures(fake_run(tmp_path / "b", {**BASE_TPS, "refusion": 255.0, "fast_dllm": 200.0}))
    assert all(r["ok"] for r in regress.compare(base, slower))
    worse = regress.figures(fake_run(tmp_path / "c", {**BASE_TPS, "refusion": 230.0}, nfe=41))
    rows = regress.compare(base, worse)
    bad = [r["figure"] for r in rows if not r["ok"]]
    assert rows[: len(bad)] == [r for r in rows if not r["ok"]]  # failures first
    assert "refusion/ar/embedded_math tokens/s ratio" in bad and "ar/embedded_code nfe" in bad
    assert "ar/embedded_code tpf" in bad and "ar/embedded_code quality" not in bad
    text = regress.render(rows, tmp_path, tmp_path / "b.json")
    assert text.startswith("# Regression check: FAIL") and "| FAIL | refusion/ar/embedded_math" in text


def _main(*argv: str) -> int:
    return regress.main(list(argv))


def test_missing_and_corrupt_baseline_exit_2(tmp_path, capsys):
    run = fake_run(tmp_path, BASE_TPS)
    missing = tmp_path / "none.json"
    assert _main("--baseline", str(missing), "--run", str(run)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(missing) in err and "make regress-update" in err
    for text in ("{not json", "[]", json.dumps({"settings": {}})):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        assert _main("--baseline", str(bad), "--run", str(run)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "corrupt" in err and "make regress-update" in err, err


def test_update_then_check_then_mismatched_settings(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(regress, "TREND", tmp_path / "trend.png")
    base_path, report = tmp_path / "baseline" / "embedded.json", tmp_path / "regress.md"
    run = fake_run(tmp_path / "r1", BASE_TPS)
    assert regress.main_update(["--baseline", str(base_path), "--run", str(run), "--reason", "first"]) == 0
    hist = [json.loads(line) for line in (base_path.parent / "history.jsonl").read_text().splitlines()]
    assert len(hist) == 1 and hist[0]["reason"] == "first" and "refusion/embedded_math nfe" in hist[0]["changed"]
    assert (tmp_path / "trend.png").stat().st_size > 0

    assert _main("--baseline", str(base_path), "--run", str(run), "--report", str(report)) == 0
    assert report.read_text().startswith("# Regression check: OK")
    slow = fake_run(tmp_path / "r2", {**BASE_TPS, "refusion": 150.0})
    assert _main("--baseline", str(base_path), "--run", str(slow), "--report", str(report)) == 1
    assert "| FAIL | refusion/ar/embedded_code tokens/s ratio | 3 | 1.5 |" in report.read_text()

    # A second update records only what changed.
    assert regress.main_update(["--baseline", str(base_path), "--run", str(slow), "--reason", "slower"]) == 0
    hist = [json.loads(line) for line in (base_path.parent / "history.jsonl").read_text().splitlines()]
    assert hist[1]["changed"] == {"refusion/ar/embedded_code ratio": [3.0, 1.5],
                                  "refusion/ar/embedded_math ratio": [3.0, 1.5]}

    # Apples and oranges: another LIMIT or other checkpoint hashes are refused with exit 2.
    data = json.loads(base_path.read_text())
    data["settings"]["limit"] = 99
    base_path.write_text(json.dumps(data))
    capsys.readouterr()
    assert _main("--baseline", str(base_path), "--run", str(run)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "different limit" in err
    data["settings"]["limit"] = regress.LIMIT
    first = next(iter(data["settings"]["checkpoint_sha256"]))
    data["settings"]["checkpoint_sha256"][first]["model.safetensors"] = "0" * 64
    base_path.write_text(json.dumps(data))
    assert _main("--baseline", str(base_path), "--run", str(run)) == 2
    assert "different checkpoint_sha256" in capsys.readouterr().err


def test_slow_ratio_is_confirmed_by_a_second_run(tmp_path, capsys, monkeypatch):
    """A speed ratio below the line fails only when a second run confirms it."""
    monkeypatch.setattr(regress, "TREND", tmp_path / "trend.png")
    base_path, report = tmp_path / "embedded.json", tmp_path / "regress.md"
    assert regress.main_update(["--baseline", str(base_path), "--run", str(fake_run(tmp_path / "b", BASE_TPS)),
                                "--reason", "base"]) == 0
    slow = fake_run(tmp_path / "slow", {**BASE_TPS, "refusion": 150.0})
    fast = fake_run(tmp_path / "fast", BASE_TPS)
    monkeypatch.setattr(regress, "settings", lambda *a: json.loads(base_path.read_text())["settings"])
    monkeypatch.setattr(regress, "CONFIRM_PAUSE_S", 0)

    def runs(*dirs):
        it = iter(dirs)
        monkeypatch.setattr(regress, "run_eval", lambda cfg, out, run_id: next(it))
        return regress.main(["--baseline", str(base_path), "--report", str(report), "--out", str(tmp_path)])

    assert runs(slow, fast) == 0  # a one-off slow run is noise
    assert "confirming with a second run" in capsys.readouterr().err
    assert runs(slow, slow) == 1  # slow twice: a regression
    assert "| FAIL | refusion/ar/embedded_code tokens/s ratio" in report.read_text()
    worse = fake_run(tmp_path / "worse", {**BASE_TPS, "refusion": 150.0}, nfe=41)
    assert runs(worse, worse) == 1  # exact figures are never retried away


def test_committed_baseline_matches_committed_checkpoints():
    """The baseline CI compares against must describe the checkpoints and presets in the repo."""
    data = regress.load_baseline(regress.BASELINE)
    regress.check_settings(data["settings"], regress.settings(), regress.BASELINE)
    keys = {f"{m}/{t}" for m in REGRESS_MODELS for t in ("embedded_math", "embedded_code", "embedded_choice")}
    assert set(data["figures"]["deterministic"]) == keys


def test_bad_arguments(tmp_path, capsys):
    assert _main("--models", "ar,nope", "--run", str(tmp_path)) == 2
    assert "unknown preset(s) nope" in capsys.readouterr().err
    assert _main("--limit", "0") == 2
    assert "--limit must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        regress.main_update([])  # --reason is required


def test_committed_baseline_holds_every_diffusion_decoders_math_figure():
    """`make regress` runs every diffusion decoder (REGRESS_MODELS), and a changed math quality of any one
    of them, every other figure equal, fails the check."""
    from harness.run.presets import PRESETS, REGRESS_MODELS
    from refusion.decoding import DECODERS

    base = regress.load_baseline(regress.BASELINE)
    assert [m["name"] for m in base["settings"]["models"]] == list(REGRESS_MODELS)
    diffusion = {PRESETS[m].decoder for m in REGRESS_MODELS} - {"ar"}
    assert diffusion == {"refusion", "llada", "fast_dllm", "dream", "d2f"} and diffusion <= set(DECODERS)
    for m in REGRESS_MODELS:
        key = f"{m}/embedded_math"
        q = base["figures"]["deterministic"][key]["quality"]
        assert isinstance(q, float) and 0 <= q <= 1
        now = json.loads(json.dumps(base["figures"]))
        now["deterministic"][key]["quality"] = q + 0.05
        bad = [r["figure"] for r in regress.compare(base["figures"], now) if not r["ok"]]
        assert bad == [f"{key} quality"]
