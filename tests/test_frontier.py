"""`make frontier` (harness/report/frontier.py; its report part, harness/report/aup.py): the grids in the decoder
registry, the points of a run, d3LLM's AUP against values worked by hand, and a decoder registered here (not in
harness/) getting its frontier and AUP.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.report import aup, frontier, paper_report
from refusion.decoding import knobs
from refusion.decoding.knobs import Knobs
from harness.run.presets import ModelSpec

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- AUP, worked by hand


def test_aup_of_a_single_point_is_its_unweighted_area():
    # rho_1 y_1 whatever y_max: the first point's term is not weighted
    assert aup.aup([(1.0, 80.0)], y_max=90.0) == 80.0
    assert aup.aup([(2.5, 40.0)], y_max=95.0) == 100.0


def test_aup_trapezoids_with_full_weight_at_y_max():
    # 1 x 80 + (3 - 1) (80 x 1 + 80 x 1) / 2 = 80 + 160
    assert aup.aup([(3.0, 80.0), (1.0, 80.0)], y_max=80.0) == pytest.approx(240.0)  # sorted by rho first


def test_aup_y_max_normalisation():
    # W(60) at y_max 80 = exp(-3 (1 - 60/80)) = exp(-0.75) = 0.4723665527; 60 + (2 - 1)(60 W + 60 W) / 2
    assert aup.weight(60.0, 80.0) == pytest.approx(0.4723665527)
    assert aup.aup([(1.0, 60.0), (2.0, 60.0)], y_max=80.0) == pytest.approx(60 + 60 * 0.4723665527)
    # The same points when they are the best on the task: W = 1
    assert aup.aup([(1.0, 60.0), (2.0, 60.0)], y_max=60.0) == pytest.approx(120.0)
    assert aup.weight(90.0, 80.0) == 1.0  # capped at 1


def test_aup_drops_points_past_the_offset():
    # first point 80: the floor is 75; 74.9 is dropped, 75.0 kept. W(76) = exp(-0.15) = 0.8607079764.
    pts = [(1.0, 80.0), (2.0, 76.0), (4.0, 74.9)]
    assert aup.kept_points(pts) == [(1.0, 80.0), (2.0, 76.0)]
    assert aup.aup(pts, y_max=80.0) == pytest.approx(80 + 0.5 * 1 * (76 * 0.8607079764 + 80))
    assert aup.kept_points([(1.0, 80.0), (2.0, 75.0)]) == [(1.0, 80.0), (2.0, 75.0)]
    # A point below the floor between two kept ones is dropped too: W(78) = exp(-0.075) = 0.9277434863.
    assert aup.aup([(1.0, 80.0), (2.0, 70.0), (3.0, 78.0)], y_max=80.0) == pytest.approx(
        80 + 0.5 * 2 * (78 * 0.9277434863 + 80))


def test_aup_refuses_no_points_and_non_positive_tpf():
    with pytest.raises(ValueError, match="at least one"):
        aup.aup([], 50.0)
    with pytest.raises(ValueError, match="TPF > 0"):
        aup.aup([(0.0, 50.0)], 50.0)


def test_pareto_set():
    pts = [{"name": "a", "tpf": 1.0, "quality": 90.0}, {"name": "b", "tpf": 2.0, "quality": 80.0},
           {"name": "c", "tpf": 2.0, "quality": 70.0}, {"name": "d", "tpf": 4.0, "quality": 80.0},
           {"name": "e", "tpf": None, "quality": 99.0}]
    assert aup.pareto(pts, "tpf") == ["a", "d"]


# ---------------------------------------------------------------- the grids and the points


def test_every_registered_decoder_has_a_documented_grid():
    from refusion.decoding import DECODERS

    for name, entry in DECODERS.items():
        assert entry.grid is not None and entry.grid.doc, name
    assert [dict(p) for p in DECODERS["ar"].grid.points] == [{}]
    assert DECODERS["fast_dllm"].grid.varied() == ["threshold"]
    assert DECODERS["llada"].grid.varied() == DECODERS["dream"].grid.varied() == ["tokens_per_step"]


def test_points_of_the_default_models():
    from harness.run.model_list import parse_models

    groups = frontier.plan(parse_models("ar,refusion,llada,fast_dllm"))
    names = [[p["name"] for p in g.points] for g in groups]
    assert names == [["ar"], ["refusion.st0.9-tt0.6", "refusion.st0.8-tt0.4", "refusion", "refusion.st0.4-tt0.1"],
                     ["llada", "llada.tps2", "llada.tps4", "llada.tps8"],
                     ["fast_dllm.t0.95", "fast_dllm", "fast_dllm.t0.7", "fast_dllm.t0.5"]]
    # The MODELS string of the eval run reads back to the same models and knobs.
    back = {m.name: m for m in parse_models(frontier.models_text(groups))}
    assert back["fast_dllm.t0.5"].knobs == {"block_length": 32, "threshold": 0.5, "cache": "dual"}
    assert back["llada.tps4"].knobs == {"block_length": 32, "remasking": "low_confidence", "tokens_per_step": 4}
    assert back["refusion"].knobs == {"slot_size": 4, "serial_num_blocks": 1, "slot_threshold": 0.6,
                                      "token_threshold": 0.3}


def test_tokens_per_step_sets_llada_and_dream_steps():
    from refusion.decoding import make_knobs
    from refusion.decoding.mdm import block_schedule, steps_of

    k = make_knobs("llada", {"gen_length": 96, "block_length": 32, "tokens_per_step": 4})
    assert steps_of(k) == 24 and block_schedule(k) == (3, [4] * 8)
    assert steps_of(make_knobs("dream", {"gen_length": 32, "tokens_per_step": 8, "steps": 5})) == 4  # replaces steps
    with pytest.raises(ValueError, match="tokens_per_step must divide block_length 32, got 3"):
        make_knobs("llada", {"gen_length": 96, "tokens_per_step": 3})


# ---------------------------------------------------------------- a decoder registered outside harness/


@dataclass(frozen=True)
class ToyKnobs(Knobs):
    """The knobs of the test's toy decoder: a budget and one threshold."""
    gen_length: int = knobs.gen_length(32)
    threshold: float = knobs.knob(0.9, "a confidence threshold", low=0.0, high=1.0)


@pytest.fixture()
def toy_decoder():
    """A decoder registered the way docs/extending.md does it, with a grid of its own; removed afterwards."""
    from refusion.decoding import DECODERS, Grid, register
    from refusion.decoding.ar import ar

    register("toy_thr", lambda model, ids, mask=None, knobs=None, **kw: ar(model, ids, mask), ToyKnobs, batched=True,
             causal=True, masked_diffusion=True,
             grid=Grid.over("threshold", (0.9, 0.5, 0.1), "threshold 0.9 (own), 0.5, 0.1"))
    try:
        yield "toy_thr"
    finally:
        DECODERS.pop("toy_thr")


def test_a_bad_grid_fails_at_registration():
    from refusion.decoding import Decoder, Grid
    from refusion.decoding.ar import ArKnobs, ar

    with pytest.raises(ValueError, match="grid point {'threshold': 0.5}: unknown knob"):
        Decoder(name="x", fn=ar, knobs=ArKnobs, batched=True, causal=True, masked_diffusion=False,
                grid=Grid.over("threshold", (0.5,), "d"))
    with pytest.raises(ValueError, match="appears twice"):
        Grid(points=({}, {}), doc="d")


# Per point: (decoder, per-item scores, tokens per item, forwards per item) on one task of 4 items.
TOY = {"ar": ("ar", [1, 1, 1, 1], 4, 4), "toy": ("toy_thr", [1, 1, 1, 0], 4, 2),
       "toy.t0.5": ("toy_thr", [1, 1, 0, 1], 4, 1), "toy.t0.1": ("toy_thr", [0, 0, 0, 1], 8, 1)}


def _frontier_run(root: Path, groups: list, toy: dict | None = None) -> Path:
    """A finished run folder of the points of ``groups`` as `harness frontier` leaves it (run.json, metrics, the
    per-sample logs, the plan), with the per-item values of ``toy`` (default ``TOY``)."""
    toy = TOY if toy is None else toy
    engines = {g.model: g.engine for g in groups if g.engine}
    d = root / "frontier-toy"
    (d / "metrics").mkdir(parents=True)
    cfg = {"run_id": d.name, "task": "tiny", "limit": 4, "seed": 1, "chat_template": True, "device": "cpu",
           "threads": 1, "num_processes": 1, "batch_size": 1, "task_defaults": True, "baseline": "ar",
           "created": "2026-01-01T00:00:00", "units": [{"name": "tiny", "leaves": ["tiny"], "primary": "exact_match,none"}],
           "models": [{"name": n, "checkpoint": "/ckpt", "decoder": dec, "knobs": {},
                       **({"engine": {"name": engines[n]}} if n in engines else {})} for n, (dec, *_) in toy.items()],
           "environment": {"git_commit": "abc", "device": "cpu", "cpu": "test cpu"}}
    (d / "run.json").write_text(json.dumps(cfg))
    for name, (dec, scores, toks, nfe) in toy.items():
        rows = [{"task": "tiny", "doc_id": i, "filter": "none", "metrics": {"exact_match": float(s)},
                 "generated_tokens": toks, "nfe": nfe, "decode_s": 0.01 * nfe} for i, s in enumerate(scores)]
        (d / "models" / name / "samples").mkdir(parents=True)
        (d / "models" / name / "samples" / "tiny.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        met = {"model": name, "task": "tiny", "decoder": dec, "quality": {"exact_match,none": sum(scores) / 4},
               "quality_primary": "exact_match,none",
               "speed": {"samples": 4, "tokens_per_s": {"ratio_of_sums": toks / (0.01 * nfe)},
                         "tpf": {"ratio_of_sums": toks / nfe}, "nfe": {"mean": nfe}, "generated_tokens": {"total": 4 * toks},
                         "latency_s": {"mean": 0.01 * nfe, "p50": 0.01 * nfe, "p90": 0.01 * nfe}},
               "memory": {"peak_rss_bytes": 2**20, "kv_peak_bytes": 1024}}
        (d / "metrics" / f"{name}__tiny.json").write_text(json.dumps(met))
    (d / aup.PLAN_FILE).write_text(json.dumps({"groups": [g.to_dict() for g in groups]}))
    return d


def test_a_decoder_registered_with_a_grid_gets_its_frontier_and_aup(toy_decoder, tmp_path):
    groups = frontier.plan([ModelSpec("ar", "/ckpt", "ar"), ModelSpec("toy", "/ckpt", toy_decoder, {"threshold": 0.9})])
    assert [[p["name"] for p in g.points] for g in groups] == [["ar"], ["toy", "toy.t0.5", "toy.t0.1"]]
    assert frontier.models_text(groups) == ("ar=/ckpt:ar,toy=/ckpt:toy_thr:threshold=0.9,"
                                            "toy.t0.5=/ckpt:toy_thr:threshold=0.5,toy.t0.1=/ckpt:toy_thr:threshold=0.1")
    run = _frontier_run(tmp_path / "runs", groups)
    out = tmp_path / "reports"
    assert paper_report.main(["--run", str(run), "--out", str(out), "--name", "f"]) == 0
    data = json.loads((out / "f" / "frontier.json").read_text())
    (task,) = data["tasks"]
    assert task["y_max"] == 100.0 and task["y_max_point"] == "ar"
    # toy: (TPF 2, 75%), (4, 75%), (8, 25%); the last is below 75 - 5 and dropped.
    # AUP = 2 x 75 + (4 - 2)(75 W(75) + 75 W(75)) / 2, W(75) = exp(-3 (1 - 75/100)) = exp(-0.75)
    toy = task["models"]["toy"]
    assert toy["aup"] == pytest.approx(150 + 2 * 75 * math.exp(-0.75))
    assert toy["kept"] == ["toy", "toy.t0.5"] and toy["dropped"] == ["toy.t0.1"]
    assert task["models"]["ar"]["aup"] == pytest.approx(100.0)  # one point at TPF 1
    lo, hi = toy["aup_ci"]["lo"], toy["aup_ci"]["hi"]
    assert lo <= toy["aup"] <= hi
    assert task["pareto"]["tpf"] == ["ar", "toy.t0.5", "toy.t0.1"]
    aup_md = (out / "f" / "aup.md").read_text()
    row = next(line for line in aup_md.splitlines() if line.startswith("| toy |"))
    assert row.startswith(f"| toy | toy_thr | {toy['aup']:.1f} [") and row.endswith("(2/3) |")
    assert "Dropped (below the model's first point minus the offset): toy.t0.1 on tiny" in aup_md
    for png in ("frontier_tiny_tpf.png", "frontier_tiny_tps.png", "frontier_tiny_speedup_ar.png"):
        assert (out / "f" / png).stat().st_size > 1000
    # tokens/s per item: ar 4 / 0.04 s, toy 4 / 0.02, toy.t0.5 4 / 0.01, toy.t0.1 8 / 0.01: speedups 1, 2, 4, 8
    assert task["baselines"] == ["ar"]
    got = {p["name"]: p["speedup:ar"] for p in task["points"]}
    assert got == pytest.approx({"ar": 1.0, "toy": 2.0, "toy.t0.5": 4.0, "toy.t0.1": 8.0})
    for p in task["points"]:
        iv = p["speedup:ar_ci"]
        assert (iv is None) == (p["name"] == "ar")
        assert iv is None or (iv["lo"] <= p["speedup:ar"] <= iv["hi"] and "paired bootstrap" in iv["method"])
    assert task["pareto"]["speedup:ar"] == task["pareto"]["tokens_per_s"]
    assert "| speedup over ar [95% CI] |" in aup_md
    index = (out / "f" / "index.md").read_text()
    assert "(aup.md)" in index and "(frontier_tiny_tpf.png)" in index
    # A frontier's other grid points are rows of the report, not speedup references.
    sp = (out / "f" / "speedup.md").read_text()
    assert "### vs toy (MDM baseline)" in sp and "### vs toy.t0.5" not in sp


def test_an_engine_row_is_a_second_baseline_of_the_frontier(toy_decoder, tmp_path):
    """ar and ar@vllm in one frontier run: the engine row keeps its engine in the eval's MODELS string, and every
    point gets its speedup over each of the two, with a figure per baseline."""
    from harness.run.model_list import parse_models

    groups = frontier.plan([ModelSpec("ar", "/ckpt", "ar"), ModelSpec("vllm", "/ckpt", "ar", engine="vllm"),
                            ModelSpec("toy", "/ckpt", toy_decoder, {"threshold": 0.9})])
    text = frontier.models_text(groups)
    assert text.startswith("ar=/ckpt:ar,vllm=/ckpt:ar@vllm,toy=/ckpt:toy_thr:")
    assert [m.engine for m in parse_models(text)][:2] == [None, "vllm"]
    assert "vllm (ar@vllm): " in frontier.describe_plan(groups)
    toy = {**TOY, "vllm": ("ar", [1, 1, 1, 1], 4, 2)}  # 200 tokens/s, twice ar's
    run = _frontier_run(tmp_path / "runs", groups, toy)
    out = tmp_path / "reports"
    assert paper_report.main(["--run", str(run), "--out", str(out), "--name", "f"]) == 0
    (task,) = json.loads((out / "f" / "frontier.json").read_text())["tasks"]
    assert task["baselines"] == ["ar", "vllm"]
    by = {p["name"]: p for p in task["points"]}
    assert by["toy.t0.5"]["speedup:ar"] == pytest.approx(4.0)
    assert by["toy.t0.5"]["speedup:vllm"] == pytest.approx(2.0) and by["vllm"]["speedup:vllm"] == 1.0
    assert by["ar"]["speedup:vllm"] == pytest.approx(0.5)
    for png in ("frontier_tiny_speedup_ar.png", "frontier_tiny_speedup_vllm.png"):
        assert (out / "f" / png).stat().st_size > 1000
    assert "| speedup over ar [95% CI] | speedup over vllm [95% CI] |" in (out / "f" / "aup.md").read_text()


def test_frontier_figure_series(toy_decoder, tmp_path):
    groups = frontier.plan([ModelSpec("ar", "/ckpt", "ar"), ModelSpec("toy", "/ckpt", toy_decoder, {"threshold": 0.9})])
    rs = paper_report.load_runs([_frontier_run(tmp_path, groups)])
    (task,) = aup.build(rs)["tasks"]
    fig = aup.figure(task, "tpf", "TPF", "n=4", {})
    ax = fig.axes[0]
    assert len(ax.containers) == 2  # one error-bar line per model
    assert [len(c.lines[0].get_xdata()) for c in ax.containers] == [1, 3]
    labels = ax.get_legend_handles_labels()[1]
    assert "Pareto set" in labels and any(lab.startswith("toy (toy_thr), AUP ") for lab in labels)


# ---------------------------------------------------------------- the command


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_bad_input_is_one_line(capsys, tmp_path):
    assert frontier.main(["--limit", "0", "--out", str(tmp_path)]) == 2
    assert "--limit must be >= 1" in _one_error(capsys)
    assert frontier.main(["--models", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown model name 'nope'" in _one_error(capsys)
    assert frontier.main(["--models", "ar", "--models-file", "x.toml", "--out", str(tmp_path)]) == 2
    assert "not both" in _one_error(capsys)
    assert not any(tmp_path.iterdir())


def test_dry_run_prints_the_points_and_the_budget(make_checkpoint, write_task, tmp_path, capsys):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    tasks = write_task(tmp_path / "tasks", "tiny_gen", n=3)
    rc = frontier.main(["--task", "tiny_gen", "--tasks-dir", str(tasks), "--models", f"a={ckpt}:ar,r={ckpt}:refusion",
                        "--out", str(tmp_path / "runs"), "--dry-run", "--limit", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "frontier: 5 point(s) of 2 model(s)" in out
    assert "  r.st0.4-tt0.1: slot_threshold=0.4, token_threshold=0.1" in out
    assert "  a: its own setting" in out
    assert "budget" in out and "total:" in out
    assert not (tmp_path / "runs").exists()


def test_diffusion_gemma_frontier_is_its_entropy_bound(tmp_path, capsys):
    """The models file beyond Table 1 on the fixtures: DiffusionGemma's points are its entropy bound's grid."""
    from refusion.decoding import DECODERS

    assert DECODERS["diffusion_gemma"].grid.varied() == ["entropy_bound"]
    models = Path(__file__).resolve().parents[1] / "examples" / "beyond_table1_fixtures.toml"
    rc = frontier.main(["--task", "embedded_code", "--models-file", str(models), "--out", str(tmp_path / "runs"),
                        "--dry-run", "--limit", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for value in ("0.02", "0.1", "0.5", "2.0"):
        assert f"  diffusiongemma.eb{value}: entropy_bound={value}" in out, out
    for value in ("0.95", "0.9", "0.7", "0.5"):  # LLaDA2 over its threshold
        assert f"  llada2.t{value}: threshold={value}" in out, out
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_frontier_end_to_end_on_a_tiny_model(make_checkpoint, write_task, tmp_path):
    """A real frontier (AR and ReFusion's grid: 5 points) on a random tiny checkpoint, its report, then a resume."""
    ckpt = make_checkpoint(tmp_path / "ckpt")
    tasks = write_task(tmp_path / "tasks", "tiny_gen", n=2)
    cmd = [sys.executable, "-m", "harness", "frontier", "--task", "tiny_gen", "--tasks-dir", str(tasks),
           "--models", f"a={ckpt}:ar,r={ckpt}:refusion", "--limit", "2", "--out", str(tmp_path / "runs"),
           "--reports", str(tmp_path / "reports"), "--name", "f", "--threads", "1", "--no-chat-template"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = tmp_path / "reports" / "f"
    data = json.loads((rep / "frontier.json").read_text())
    (task,) = data["tasks"]
    assert sorted(p["name"] for p in task["points"]) == ["a", "r.st0.4-tt0.1", "r.st0.6-tt0.3", "r.st0.8-tt0.4",
                                                         "r.st0.9-tt0.6"]
    assert all(p["tpf"] > 0 and p["quality_ci"] is not None for p in task["points"])
    assert set(task["models"]) == {"a", "r"}
    assert (rep / "aup.md").is_file() and (rep / "frontier_tiny_gen_tpf.png").is_file()
    run = next((tmp_path / "runs").iterdir())
    assert run.name.startswith("frontier-") and (run / aup.PLAN_FILE).is_file()
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0 and p.stderr.count("already finished, skipped") == 5, p.stderr[-3000:]
