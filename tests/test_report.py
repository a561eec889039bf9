"""`python -m harness report` and `python -m harness sweep`: tables, speedups and figures.

Runs are built as fake run folders (run.json + metrics JSON + sample logs), so these
tests are fast and deterministic; one end-to-end check runs a real tiny sweep.
"""

from __future__ import annotations

import csv
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.report import figures, paper, paper_report
from harness.report.paper_report import MISSING, NOT_MEASURED, main

REPO = Path(__file__).resolve().parents[1]

# The published Table 1 (ReFusion, arXiv 2512.13586), typed in independently of harness/report/paper_table1.json.
PUBLISHED = """\
| Llama-3-8B-Instruct | 35.23 / 32.07 | 82.76 / 44.12 | 75.13 / 42.81 | 25.48 / 19.73 | 29.46 / 42.00 | 46.34 / 42.26 | 53.00 / 41.68 | 49.63 / 37.81 |
| Qwen3-8B | 67.25 / 31.42 | 90.36 / 42.78 | 81.96 / 31.20 | 83.28 / 30.11 | 39.06 / 30.43 | 87.80 / 30.95 | 63.80 / 30.07 | 73.36 / 32.42 |
| LLaDA-8B-Instruct | 35.80 / 18.21 | 85.58 / 0.03 | 76.35 / 27.35 | 38.78 / 23.93 | 32.37 / 1.99 | 45.12 / 12.42 | 25.60 / 2.97 | 48.51 / 12.41 |
| LLaDA w/ Fast-dLLM | 35.02 / 39.81 | 82.85 / 0.86 | 76.27 / 73.07 | 38.58 / 52.23 | 28.35 / 17.54 | 37.80 / 62.52 | 24.80 / 37.19 | 46.24 / 40.46 |
| LLaDA w/ D2F | 22.84 / 44.54 | 84.13 / 3.70 | 39.04 / 82.59 | 23.68 / 59.48 | 31.25 / 23.84 | 36.59 / 96.90 | 35.20 / 53.85 | 38.96 / 52.13 |
| Dream-7B-Instruct | 40.05 / 15.98 | 88.31 / 0.06 | 76.42 / 20.30 | 46.60 / 18.99 | 30.36 / 1.81 | 56.71 / 3.51 | 50.40 / 1.23 | 55.55 / 8.84 |
| Dream w/ Fast-dLLM | 40.36 / 47.18 | 86.86 / 1.42 | 75.82 / 61.49 | 36.76 / 58.24 | 31.25 / 22.96 | 56.10 / 49.73 | 10.60 / 19.55 | 48.25 / 37.22 |
| Dream w/ D2F | 23.82 / 56.43 | 85.92 / 59.08 | 41.62 / 79.20 | 29.98 / 84.14 | 30.13 / 49.96 | 50.00 / 69.15 | 51.60 / 65.59 | 44.72 / 66.22 |
| ReFusion | 45.94 / 52.74 | 89.76 / 32.46 | 84.91 / 81.24 | 54.22 / 81.77 | 35.49 / 64.11 | 78.66 / 103.90 | 68.20 / 92.09 | 65.31 / 72.62 |
"""
# The project's unit for the GPQA column is gpqa_main_generative (the paper's lm-eval name is an alias).
PAPER_UNITS = ["mmlu_pro", "arc_challenge_chat", "gsm8k_cot", "minerva_math", "gpqa_main_generative",
               "humaneval_instruct", "mbpp"]
EMBEDDED = ["embedded_math", "embedded_code", "embedded_choice"]


FIRST = 4  # index of the first benchmark column of table1.md: Model, decoder, n, device come before it


def _published() -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in PUBLISHED.splitlines()]


def fake_run(root: Path, run_id: str, models: list[tuple], cells: dict[tuple[str, str], tuple],
             units: list[str], limit: int = 5, baseline: str | None = None, samples: bool = True,
             extra: dict | None = None) -> Path:
    """A run folder as `harness eval` leaves it; ``models`` = (name, decoder[, knobs]),
    ``cells[(model, unit)] = (quality 0..1, tok/s, tpf)``; ``extra`` is merged into run.json."""
    knobs = {m[0]: (m[2] if len(m) > 2 else {}) for m in models}
    models = [(m[0], m[1]) for m in models]
    d = root / run_id
    cfg = {"run_id": run_id, "task": ",".join(units), "limit": limit, "seed": 1234, "chat_template": True,
           "device": "cpu", "threads": 2, "num_processes": 1, "batch_size": 1, "bootstrap_iters": 0,
           "task_defaults": True, "created": "2026-01-01T00:00:00",
           "baseline": baseline if baseline is not None else next((m for m, dec in models if dec == "ar"), None),
           "units": [{"name": u, "leaves": [u], "primary": "exact_match,none"} for u in units],
           "models": [{"name": m, "checkpoint": f"/ckpt/{m}", "decoder": dec, "knobs": knobs[m], "task_knobs": {}}
                      for m, dec in models],
           "environment": {"git_commit": "abc", "git_dirty": False, "device": "cpu", "cpu": "test cpu",
                           "cpu_count": 2, "packages": {"torch": "x", "lm-eval": "0.4.13"}, "python": "3.11"},
           **(extra or {})}
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps(cfg))
    (d / "metrics").mkdir()
    for (m, u), (q, tps, tpf) in cells.items():
        dec = dict(models)[m]
        met = {"model": m, "task": u, "decoder": dec, "leaves": [u], "quality": {"exact_match,none": q},
               "quality_primary": "exact_match,none",
               "speed": {"samples": 3, "tokens_per_s": {"ratio_of_sums": tps, "mean_of_ratios": tps},
                         "tpf": {"ratio_of_sums": tpf, "mean_of_ratios": tpf}, "nfe": {"mean": 4.0},
                         "generated_tokens": {"total": 30}, "latency_s": {"mean": 0.1, "p50": 0.1, "p90": 0.2}},
               "memory": {"peak_rss_bytes": (100 + len(m)) * 2**20, "kv_peak_bytes": 4096 * len(m)}}
        (d / "metrics" / f"{m}__{u}.json").write_text(json.dumps(met))
        if samples:
            sd = d / "models" / m / "samples"
            sd.mkdir(parents=True, exist_ok=True)
            with open(sd / f"{u}.jsonl", "w") as f:
                for i in range(3):
                    f.write(json.dumps({"task": u, "doc_id": i, "decode_s": 0.01 * (i + 1) * (1 + len(m))}) + "\n")
    return d


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


@pytest.fixture()
def paper_run(tmp_path) -> Path:
    """The published numbers fed back as one run: one model per published row."""
    decoders = {r["model"]: r["decoder"] for r in paper.published_rows()}
    models, cells = [], {}
    for row in _published():
        name = _slug(row[0])
        dec = decoders[row[0]] if decoders[row[0]] in ("ar", "refusion", "llada", "fast_dllm") else "llada"
        models.append((name, dec))
        for unit, cell in zip(PAPER_UNITS, row[1:8]):
            q, t = (float(x) for x in cell.split("/"))
            cells[(name, unit)] = (q / 100, t, 1.0)
    return fake_run(tmp_path / "runs", "paper", models, cells, PAPER_UNITS, baseline="Qwen3_8B")


def _md_section(text: str, heading: str) -> list[list[str]]:
    """Rows (cells) of the first Markdown table after ``heading``."""
    lines = text.splitlines()
    i = next(k for k, line in enumerate(lines) if line.strip() == heading)
    rows, started = [], False
    for line in lines[i + 1:]:
        if line.startswith("|"):
            started = True
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif started:
            break
    return [r for r in rows[2:]]  # drop header and separator


def test_published_numbers_fed_back_reproduce_table1(paper_run, tmp_path):
    out = tmp_path / "reports"
    assert main(["--run", str(paper_run), "--out", str(out), "--name", "r"]) == 0
    md = (out / "r" / "table1.md").read_text()
    ours = _md_section(md, "### This run")
    published = _published()
    assert len(ours) == len(published) == 9
    for got, want in zip(ours, published):
        assert got[0] == _slug(want[0])
        assert got[FIRST:] == want[1:], got[0]  # every benchmark cell and the average, as printed in the paper
        assert got[2:FIRST] == ["3", "cpu (2 threads)"]  # n and device of every row
    # The data file's published rows print the same table.
    pub = _md_section(md, f"### Published ({paper.source()})")
    assert [[r[0], *r[FIRST:]] for r in pub] == published
    assert all(r[2:FIRST] == [paper_report.PUBLISHED_N, paper_report.PUBLISHED_DEVICE] for r in pub)
    assert "arXiv 2512.13586" in paper.source()
    # The headline: ReFusion 2.33x faster than Qwen3-8B (mean of per-task ratios), 2.24x as a ratio of averages.
    sp = (out / "r" / "speedup.md").read_text()
    row = next(r for r in _md_section(sp, "### vs Qwen3_8B (AR baseline)") if r[0] == "ReFusion")
    assert row[-2:] == ["2.33", "2.24"]
    pub_sp = next(r for r in _md_section(sp, f"### Published speedups of ReFusion, for reference "
                                             f"({paper.source()})") if r[1] == "Qwen3-8B")
    assert pub_sp[-2:] == ["2.33", "2.24"]
    # No embedded task in the run: no embedded table (it would be all n/m).
    assert paper.EMBEDDED.title not in md
    tex = (out / "r" / "table1.tex").read_text()
    assert "65.31 / 72.62" in tex and "arXiv 2512.13586" in tex


def _mixed_run(root: Path, name: str = "mixed", seed: int = 0, **kw) -> Path:
    rng = random.Random(seed)
    models = [("ar", "ar"), ("refusion", "refusion"), ("llada", "llada"), ("fast_dllm", "fast_dllm")]
    units = EMBEDDED + ["gsm8k_cot", "mbpp"]
    cells = {(m, u): (rng.random(), rng.uniform(5, 900), rng.uniform(1, 6)) for m, _ in models for u in units}
    return fake_run(root, name, models, cells, units, **kw)


def check_table_against_metrics(md: str, run: Path, suites: dict[str, paper.Suite]) -> int:
    """Every ours-cell and average of table1.md equals the run's metrics JSON (2 decimals); returns cells seen."""
    checked = 0
    for heading, suite in suites.items():
        part = md.split(heading)[1]
        for row in _md_section(part, "### This run"):
            model = row[0]
            qs, ts = [], []
            for col, cell in zip(suite.columns, row[FIRST:-1]):
                unit = next((t for t in col.tasks if (run / "metrics" / f"{model}__{t}.json").exists()), None)
                if unit is None:
                    assert cell == NOT_MEASURED
                    continue
                met = json.loads((run / "metrics" / f"{model}__{unit}.json").read_text())
                q, t = 100 * met["quality"][met["quality_primary"]], met["speed"]["tokens_per_s"]["ratio_of_sums"]
                # a real run's cells carry their 95% intervals: the figures are what precedes them
                assert _no_intervals(cell) == f"{q:.2f} / {t:.2f}", (model, unit)
                qs.append(q)
                ts.append(t)
                checked += 1
            if not qs:
                assert row[-1] == NOT_MEASURED
                continue
            avg = f"{sum(qs) / len(qs):.2f} / {sum(ts) / len(ts):.2f}"
            n = len(suite.columns)
            assert _no_intervals(row[-1]) == (avg if len(qs) == n else f"{avg} ({len(qs)}/{n})")
    return checked


def _no_intervals(cell: str) -> str:
    return re.sub(r" \[[^\]]*\]", "", cell)


def test_every_number_in_table1_comes_from_the_metrics(tmp_path):
    run = _mixed_run(tmp_path / "runs")
    out = tmp_path / "reports"
    assert main(["--run", str(run), "--out", str(out), "--name", "m"]) == 0
    md = (out / "m" / "table1.md").read_text()
    suites = {"## " + paper.paper_suite().title: paper.paper_suite(), "## " + paper.EMBEDDED.title: paper.EMBEDDED}
    assert check_table_against_metrics(md, run, suites) == 4 * 5
    # The CSV holds the same numbers unrounded (to 6 places).
    rows = list(csv.DictReader(open(out / "m" / "table1.csv")))
    r = next(x for x in rows if x["model"] == "refusion" and x["suite"] == "embedded")
    met = json.loads((run / "metrics" / "refusion__embedded_code.json").read_text())
    assert float(r["embedded_code_tokens_per_s"]) == pytest.approx(met["speed"]["tokens_per_s"]["ratio_of_sums"],
                                                                   abs=1e-6)
    assert next(x for x in rows if x["model"] == "ar" and x["suite"] == "paper")["mmlu_pro_quality"] == NOT_MEASURED
    # speedup.md: per-task ratios of the same run's tokens/s.
    sp = (out / "m" / "speedup.md").read_text()
    part = sp.split("## " + paper.EMBEDDED.title)[1]
    row = next(x for x in _md_section(part, "### vs ar (AR baseline)") if x[0] == "refusion")
    tps = {m: json.loads((run / "metrics" / f"{m}__embedded_math.json").read_text())["speed"]["tokens_per_s"][
        "ratio_of_sums"] for m in ("ar", "refusion")}
    assert row[2] == f"{tps['refusion'] / tps['ar']:.2f}"
    assert "### vs llada (MDM baseline)" in sp and "### vs fast_dllm (MDM baseline)" in sp
    index = (out / "m" / "index.md").read_text()
    for link in ("table1.md", "table1.csv", "table1.tex", "speedup.md", "latency.png", "memory.png"):
        assert f"({link})" in index
    assert "commit abc" in index and "limit 5" in index


def test_figures_have_the_expected_series(tmp_path):
    run = _mixed_run(tmp_path / "runs")
    rs = paper_report.load_runs([run])
    data = paper_report.build(rs)
    figs = figures.build_all(rs, data)
    n_pub = len(paper.published_rows())
    expected = {f"pareto_{u}.png" for u in EMBEDDED + ["gsm8k_cot", "mbpp"]} | {
        "pareto_avg_paper.png", "pareto_avg_embedded.png", "speedup_paper.png", "speedup_embedded.png",
        "tpf_paper.png", "tpf_embedded.png", "latency.png", "memory.png"}
    assert set(figs) == expected

    def ax(name):
        return figs[name][0].axes[0]

    assert len(ax("pareto_embedded_math.png").collections) == 4  # one marker per model, no published points
    assert len(ax("pareto_gsm8k_cot.png").collections) == 4 + n_pub  # ours + every published row
    # Averages: the embedded suite is complete for all 4 models; no model measured all 7 benchmarks.
    assert len(ax("pareto_avg_embedded.png").collections) == 4 + n_pub
    assert len(ax("pareto_avg_paper.png").collections) == n_pub
    assert len(ax("speedup_embedded.png").containers) == 3  # every model but the AR baseline
    assert len(ax("speedup_embedded.png").containers[0]) == 3 + 1  # 3 tasks + the mean of ratios
    assert len(ax("tpf_embedded.png").containers) == 4
    assert len(ax("latency.png").lines) == 4
    mem = figs["memory.png"][0]
    # runs without a memory pass: the process's peak RSS beside the KV cache, one bar each
    assert [len(a.containers) for a in mem.axes] == [1, 1] and len(mem.axes[0].containers[0]) == 4
    assert "peak RSS (process)" in mem.axes[0].get_xlabel()
    for fig, _ in figs.values():
        for a in fig.axes:
            assert a.get_xlabel() and a.get_ylabel()
        assert any(a.get_title() for a in fig.axes) or fig.get_suptitle()
    made = figures.save_all(figs, tmp_path)
    for name in made:
        assert (tmp_path / name).stat().st_size > 1000
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys):
    runs, out = tmp_path / "runs", tmp_path / "reports"
    assert main(["--run", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert "nope" in _one_error(capsys) and not out.exists()
    assert main(["--runs-root", str(runs), "--out", str(out)]) == 2  # no run at all
    assert str(runs) in _one_error(capsys) and not out.exists()

    run = _mixed_run(runs)
    (run / "metrics" / "llada__mbpp.json").unlink()
    assert main(["--run", str(run), "--out", str(out)]) == 2
    err = _one_error(capsys)
    assert str(run) in err and "llada__mbpp.json" in err and "--allow-partial" in err and not out.exists()

    # The same run twice, a label that is no plain name, a label used twice.
    other = _mixed_run(runs, "other", limit=9)
    for spec, what in ((f"{run},mixed", "run given twice"), (f"a/b={run}", "run label 'a/b'"),
                       (f"x={run},x={other}", "run label given twice")):
        assert main(["--run", spec, "--runs-root", str(runs), "--out", str(out), "--allow-partial"]) == 2
        assert what in _one_error(capsys) and not out.exists()

    # --allow-partial: the missing cell is marked, everything else reported.
    assert main(["--run", "mixed", "--runs-root", str(runs), "--out", str(out), "--allow-partial"]) == 0
    md = (out / "mixed" / "table1.md").read_text()
    row = next(r for r in _md_section(md, "### This run") if r[0] == "llada")
    assert row[-2] == MISSING and row[-1].endswith("(1/7)")
    assert "Partial:" in (out / "mixed" / "index.md").read_text()
    capsys.readouterr()


def test_failure_leaves_the_previous_report_untouched(tmp_path, monkeypatch):
    run = _mixed_run(tmp_path / "runs")
    out = tmp_path / "reports"
    assert main(["--run", str(run), "--out", str(out), "--name", "x"]) == 0
    before = {p.name: p.read_bytes() for p in (out / "x").iterdir()}

    def boom(*a, **k):
        raise RuntimeError("figure failed")

    monkeypatch.setattr(figures, "build_all", boom)
    with pytest.raises(RuntimeError):
        main(["--run", str(run), "--out", str(out), "--name", "x"])
    assert {p.name: p.read_bytes() for p in (out / "x").iterdir()} == before
    assert sorted(p.name for p in out.iterdir()) == ["x"]  # no temp folder left behind


def test_merged_runs_and_newest_default(tmp_path):
    runs = tmp_path / "runs"
    a = fake_run(runs, "a", [("ar", "ar"), ("refusion", "refusion")],
                 {("ar", "embedded_math"): (0.5, 100.0, 1.0), ("refusion", "embedded_math"): (0.4, 300.0, 3.0)},
                 ["embedded_math"])
    b = fake_run(runs, "b", [("ar", "ar"), ("refusion", "refusion")],
                 {("ar", "embedded_code"): (0.2, 50.0, 1.0), ("refusion", "embedded_code"): (0.3, 200.0, 4.0)},
                 ["embedded_code"])
    cfg = json.loads((b / "run.json").read_text())
    (b / "run.json").write_text(json.dumps({**cfg, "created": "2026-02-01T00:00:00"}))
    out = tmp_path / "reports"
    assert main(["--run", "a,b", "--runs-root", str(runs), "--out", str(out)]) == 0
    md = (out / "a+b" / "table1.md").read_text()
    assert md.startswith("# Table 1: runs a, b") and "### This run" not in md
    row = next(r for r in _md_section(md.split("## " + paper.EMBEDDED.title)[1], "### These runs")
               if r[0] == "refusion")
    assert row[2:] == ["3", "cpu (2 threads)", "40.00 / 300.00", "30.00 / 200.00", NOT_MEASURED,
                       "35.00 / 250.00 (2/3)"]
    sp = (out / "a+b" / "speedup.md").read_text()
    row = next(r for r in _md_section(sp.split("## " + paper.EMBEDDED.title)[1], "### vs ar (AR baseline)")
               if r[0] == "refusion")
    assert row[2:] == ["3.00", "4.00", "3.50", "3.33"]  # per task, mean of ratios, ratio of averages (250/75)
    # Without --run: the newest run (by its creation time) is reported.
    assert main(["--runs-root", str(runs), "--out", str(out)]) == 0
    assert (out / "b" / "table1.md").is_file()


@pytest.mark.slow
def test_sweep_end_to_end_on_a_tiny_model(make_checkpoint, write_task, tmp_path):
    """A real two-point sweep plus the two references on a random tiny checkpoint (slow-ish: 4 workers)."""
    ckpt = make_checkpoint(tmp_path / "ckpt")
    tasks = write_task(tmp_path / "tasks", "tiny_gen", n=2)
    cmd = [sys.executable, "-m", "harness", "sweep", "--grid", "slot_size=2,4", "--limit", "2",
           "--task", "tiny_gen", "--refusion", str(ckpt), "--ar", str(ckpt), "--out", str(tmp_path / "runs"),
           "--reports", str(tmp_path / "reports"), "--tasks-dir", str(tasks), "--threads", "1",
           "--no-chat-template"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "reports" / "sweep" / "sweep.json").read_text())
    names = sorted(x["name"] for x in res["points"])
    assert names == ["ar", "refusion", "refusion_left_to_right", "rf_slot_size_2"]
    assert all(x["tokens_per_s"] > 0 and x["quality"] is not None for x in res["points"])
    assert (tmp_path / "reports" / "sweep" / "sweep.png").stat().st_size > 1000
    # The report of that real run: every number from its metrics files, every figure written.
    run = next((tmp_path / "runs").iterdir())
    assert main(["--run", str(run), "--out", str(tmp_path / "reports"), "--name", "real"]) == 0
    rep = tmp_path / "reports" / "real"
    other = paper.Suite("other", "", (paper.Column("tiny_gen", "tiny_gen", ("tiny_gen",)),), False)
    assert check_table_against_metrics((rep / "table1.md").read_text(), run,
                                       {"## Other tasks (no published numbers)": other}) == 4
    pngs = sorted(p.name for p in rep.glob("*.png"))
    assert pngs == ["latency.png", "memory.png", "pareto_avg_other.png", "pareto_tiny_gen.png",
                    "speedup_items_other.png", "speedup_other.png", "tpf_other.png"]
    assert "(speedup_items_other.png)" in (rep / "index.md").read_text()
    # Same settings again: the run is resumed, nothing recomputed.
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0 and p.stderr.count("already finished, skipped") == 4, p.stderr[-3000:]


def test_sweep_figure_series_and_grid_errors(capsys):
    from harness.report import sweep

    grid = sweep.parse_grid("slot_threshold=0.3,0.6;slot_size=2,4,8")
    base = {"slot_size": 4, "slot_threshold": 0.6, "token_threshold": 0.3}
    pts = sweep.variants(grid, base)
    assert [p["name"] for p in pts] == ["refusion", "rf_slot_threshold_0.3", "rf_slot_size_2", "rf_slot_size_8"]
    pts += [{"name": "ar", "knob": None, "value": None, "knobs": {}},
            {"name": "refusion_left_to_right", "knob": None, "value": None, "knobs": {**base, "left_to_right": True}}]
    for i, p in enumerate(pts):
        p.update(quality=10.0 + i, tokens_per_s=100.0 + 10 * i)
    fig = sweep.figure(pts, grid, "t")
    ax = fig.axes[0]
    assert len(ax.lines) == 2 and len(ax.collections) == 2  # one curve per knob, two reference points
    assert [len(line.get_xdata()) for line in ax.lines] == [2, 3]
    assert ax.get_xlabel() and ax.get_ylabel()
    assert sweep.main(["--grid", "slot_sise=1"]) == 2
    assert "unknown refusion knob(s) slot_sise (did you mean 'slot_size'?); valid knobs:" in _one_error(capsys)
    assert sweep.main(["--grid", "slot_size"]) == 2
    assert "expected knob=value" in _one_error(capsys)


# ---------------------------------------------------------------- what a new user trips over


def test_latency_figure_counts_each_decoded_sample_once(tmp_path):
    """gsm8k_cot logs two rows per document (strict-match and flexible-extract): n is the documents."""
    run = fake_run(tmp_path / "runs", "r", [("ar", "ar"), ("refusion", "refusion")],
                   {("ar", "gsm8k_cot"): (0.5, 100.0, 1.0), ("refusion", "gsm8k_cot"): (0.4, 300.0, 3.0)},
                   ["gsm8k_cot"])
    for m in ("ar", "refusion"):
        with open(run / "models" / m / "samples" / "gsm8k_cot.jsonl", "w") as f:
            for doc in range(3):
                for flt in ("strict-match", "flexible-extract"):
                    f.write(json.dumps({"task": "gsm8k_cot", "doc_id": doc, "filter": flt,
                                        "decode_s": 0.1 * (doc + 1)}) + "\n")
    rs = paper_report.load_runs([run])
    lat = figures._latencies(rs)
    assert {m: sorted(v) for m, v in lat.items()} == {m: [0.1, 0.2, 0.30000000000000004] for m in ("ar", "refusion")}
    fig = figures.build_all(rs, paper_report.build(rs))["latency.png"][0]
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert labels == ["ar (n=3)", "refusion (n=3)"]  # the metrics' sample count, not 6
    figures.plt.close("all")
    met = json.loads((run / "metrics" / "ar__gsm8k_cot.json").read_text())
    assert met["speed"]["samples"] == 3


def test_merged_runs_show_both_prompt_variants_and_never_mix_them(tmp_path):
    runs = tmp_path / "runs"
    fake_run(runs, "stock", [("ar", "ar"), ("refusion", "refusion")],
             {("ar", "gsm8k_cot"): (0.5, 100.0, 1.0), ("refusion", "gsm8k_cot"): (0.4, 300.0, 3.0)}, ["gsm8k_cot"])
    fake_run(runs, "paperp", [("ar", "ar"), ("refusion", "refusion")],
             {("ar", "gsm8k_cot_paper"): (0.7, 110.0, 1.0), ("refusion", "gsm8k_cot_paper"): (0.6, 330.0, 3.0),
              ("ar", "mbpp_paper"): (0.3, 90.0, 1.0), ("refusion", "mbpp_paper"): (0.2, 450.0, 5.0)},
             ["gsm8k_cot_paper", "mbpp_paper"], extra={"prompts": "paper"})
    out = tmp_path / "reports"
    assert main(["--run", "stock,paperp", "--runs-root", str(runs), "--out", str(out), "--name", "m"]) == 0
    md = (out / "m" / "table1.md").read_text()
    assert md.startswith("# Table 1: runs stock, paperp")
    rows = {r[0]: r for r in _md_section(md, "### These runs")}
    assert set(rows) == {"ar", "refusion", "ar [paper prompts]", "refusion [paper prompts]"}
    labels = [c.label for c in paper.paper_suite().columns]
    gsm, mbpp = labels.index("GSM8K") + FIRST, labels.index("MBPP") + FIRST
    assert rows["refusion"][gsm] == "40.00 / 300.00" and rows["refusion"][mbpp] == NOT_MEASURED
    assert rows["refusion"][-1] == "40.00 / 300.00 (1/7)"  # stock GSM8K only
    p = rows["refusion [paper prompts]"]
    assert p[gsm] == "60.00 / 330.00" and p[mbpp] == "20.00 / 450.00"
    assert p[-1] == "40.00 / 390.00 (2/7)"  # paper GSM8K with paper MBPP, never with the stock GSM8K
    assert "rows marked `[paper prompts]`" in md
    sp = (out / "m" / "speedup.md").read_text()
    row = next(r for r in _md_section(sp, "### vs ar [paper prompts] (AR baseline)")
               if r[0] == "refusion [paper prompts]")
    assert row[2:4] == ["3.00", "5.00"]  # GSM8K and MBPP, each against the same run's paper-prompt AR
    row = next(r for r in _md_section(sp, "### vs ar (AR baseline)") if r[0] == "refusion [paper prompts]")
    assert row[2:4] == [NOT_MEASURED, NOT_MEASURED]  # never a paper-prompt run against the stock-prompt AR
    # One run with --prompts paper alone: plain names, the prompts named once.
    assert main(["--run", "paperp", "--runs-root", str(runs), "--out", str(out), "--name", "p"]) == 0
    md = (out / "p" / "table1.md").read_text()
    assert {r[0] for r in _md_section(md, "### This run")} == {"ar", "refusion"}
    assert "Prompts: the ReFusion authors' variants" in md


def test_same_model_with_other_knobs_in_two_runs_is_one_row_per_run(tmp_path):
    runs = tmp_path / "runs"
    cells = {("ar", "embedded_math"): (0.5, 100.0, 1.0), ("refusion", "embedded_math"): (0.4, 300.0, 3.0)}
    fake_run(runs, "a", [("ar", "ar"), ("refusion", "refusion")], cells, ["embedded_math"])
    fake_run(runs, "b", [("ar", "ar"), ("refusion", "refusion", {"slot_size": 8})],
             {("ar", "embedded_math"): (0.5, 120.0, 1.0), ("refusion", "embedded_math"): (0.3, 600.0, 6.0)},
             ["embedded_math"])
    out = tmp_path / "reports"
    assert main(["--run", "a,b", "--runs-root", str(runs), "--out", str(out)]) == 0
    md = (out / "a+b" / "table1.md").read_text()
    part = md.split("## " + paper.EMBEDDED.title)[1]
    rows = {r[0]: r[FIRST] for r in _md_section(part, "### These runs")}
    assert rows == {"ar@a": "50.00 / 100.00", "refusion@a": "40.00 / 300.00", "ar@b": "50.00 / 120.00",
                    "refusion@b": "30.00 / 600.00"}
    assert "refusion is reported per run (refusion@a, refusion@b): other settings (knobs)" in md
    sp = (out / "a+b" / "speedup.md").read_text().split("## " + paper.EMBEDDED.title)[1]
    assert next(r for r in _md_section(sp, "### vs ar@a (AR baseline)") if r[0] == "refusion@a")[2] == "3.00"
    assert next(r for r in _md_section(sp, "### vs ar@b (AR baseline)") if r[0] == "refusion@b")[2] == "5.00"
    # Labels per run instead of run ids.
    assert main(["--run", "base=a,new=b", "--runs-root", str(runs), "--out", str(out), "--name", "l"]) == 0
    part = (out / "l" / "table1.md").read_text().split("## " + paper.EMBEDDED.title)[1]
    assert {r[0] for r in _md_section(part, "### These runs")} == {"ar@base", "refusion@base", "ar@new",
                                                                    "refusion@new"}


def spread_file(path: Path, values: dict[str, list[float]], rounds: int = 9, items: int = 1,
                flagged: int = 0) -> Path:
    """A spread file as `make spread` writes it: quiet idle runs with each (model/task) speedup, the timing
    settings and the statistic they were made with; ``flagged`` more runs on a busy machine (left out)."""
    from harness.run import timing

    n = len(next(iter(values.values())))
    runs = [{"run": f"spread-x-{i + 1:02d}", "machine": "busy" if i >= n else "quiet", "rounds": rounds,
             "timed_items": items, "rows": {k: {"speedup": (v[i] if i < n else 99.0), "interval": None}
                                            for k, v in values.items()}} for i in range(n + flagged)]
    path.write_text(json.dumps({"command": "harness eval --task embedded", "statistic": timing.RATIO_STATISTIC,
                                "runs": runs}))
    return path


def test_compare_prints_the_speed_rule_it_applies(tmp_path):
    """The between-runs speed rule printed in compare.md is timing.spread_rule of the constants the verdict uses
    (its quantile and minimum read back), and applied by hand (Student's t on the spread file's log speedups) it
    decides as compare does, on ratios on both sides of the threshold. Without a spread file compare says it
    cannot tell; a file of another statistic, or with too few quiet runs, is one error line."""
    import math
    import statistics

    from scipy.stats import t as student

    from harness.report import compare
    from harness.run import timing

    runs, out = tmp_path / "runs", tmp_path / "reports"
    spread = [2.0, 2.1, 1.95, 2.2, 2.05, 2.1]
    sd = statistics.stdev(math.log(v) for v in spread)
    thr = math.exp(student.ppf(1 - timing.SPREAD_ALPHA / 2, len(spread) - 1) * sd * math.sqrt(2))
    for i, ratio in enumerate((thr * 1.02, thr * 0.98, 1 / (thr * 1.02))):
        runs = tmp_path / f"runs{i}"
        for name, sp in (("a", 2.0), ("b", 2.0 * ratio)):
            fake_run(runs, name, [("ar", "ar"), ("refusion", "refusion")],
                     {("ar", "embedded_math"): (0.5, 100.0, 1.0), ("refusion", "embedded_math"): (0.5, 100.0, 2.0)},
                     ["embedded_math"])
            path = runs / name / "metrics" / "refusion__embedded_math.json"
            met = json.loads(path.read_text())
            met["speed"]["timing"] = {"mode": "interleaved", "rounds": 9, "items": 1,
                                      "per_round_tokens_per_s": [100.0] * 9}
            met["speedup"] = {"baseline": "ar", "tokens_per_s": sp, "per_pair": [sp] * 4}
            path.write_text(json.dumps(met))
        file = spread_file(tmp_path / "spread.json", {"refusion/embedded_math": spread}, flagged=2)
        assert compare.main(["--run", "a,b", "--runs-root", str(runs), "--out", str(out), "--name", "c",
                             "--spread", str(file)]) == 0
        md = (out / "c" / "compare.md").read_text()
        m = re.search(r"at least (\d+) runs\), t Student's two-sided ([0-9.]+) quantile", md)
        assert m and timing.spread_rule() in md, md[:3000]
        assert (int(m.group(1)), 1 - float(m.group(2))) == (timing.MIN_SPREAD_RUNS, pytest.approx(timing.SPREAD_ALPHA))
        by_hand = abs(math.log(ratio)) > math.log(thr)
        differ = [d for d in json.loads((out / "c" / "compare.json").read_text())["differ"] if d["figure"] == "speedup"]
        assert bool(differ) == by_hand, (ratio, thr, differ)
        assert "6 quiet idle runs" in md  # the 2 busy runs of the file are left out
    # without a spread file: it cannot tell, and says why
    assert compare.main(["--run", "a,b", "--runs-root", str(runs), "--out", str(out), "--name", "c"]) == 0
    md = (out / "c" / "compare.md").read_text()
    assert compare.NO_SPREAD in md and "cannot tell" in md
    assert not [d for d in json.loads((out / "c" / "compare.json").read_text())["differ"] if d["figure"] == "speedup"]
    # refused spread files: one error line, exit 2
    for bad, words in ((spread_file(tmp_path / "few.json", {"refusion/embedded_math": spread[:4]}), "at least 5"),
                       (tmp_path / "none.json", "not a spread file")):
        assert compare.main(["--run", "a,b", "--runs-root", str(runs), "--out", str(out), "--name", "d",
                             "--spread", str(bad)]) == 2
    old = json.loads((tmp_path / "spread.json").read_text())
    del old["statistic"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert compare.main(["--run", "a,b", "--runs-root", str(runs), "--out", str(out), "--name", "d",
                         "--spread", str(tmp_path / "old.json")]) == 2
    assert not (out / "d").exists()


def test_compare_writes_each_figure_side_by_side_with_ratios(tmp_path, capsys):
    runs, out = tmp_path / "runs", tmp_path / "reports"
    fake_run(runs, "a", [("ar", "ar"), ("refusion", "refusion")],
             {("ar", "embedded_math"): (0.5, 100.0, 1.0), ("refusion", "embedded_math"): (0.4, 300.0, 3.0),
              ("refusion", "gsm8k_cot"): (0.2, 50.0, 2.0), ("ar", "gsm8k_cot"): (0.3, 20.0, 1.0)},
             ["embedded_math", "gsm8k_cot"])
    fake_run(runs, "b", [("ar", "ar"), ("refusion", "refusion", {"slot_size": 8})],
             {("ar", "embedded_math"): (0.5, 120.0, 1.0), ("refusion", "embedded_math"): (0.3, 600.0, 6.0),
              ("refusion", "gsm8k_cot_paper"): (0.3, 75.0, 2.5), ("ar", "gsm8k_cot_paper"): (0.3, 25.0, 1.0)},
             ["embedded_math", "gsm8k_cot_paper"], extra={"created": "2026-03-01T00:00:00", "prompts": "paper",
                                                          "device": "cuda",
                                                          "environment": {"gpu": "NVIDIA H200", "device": "cuda"}})
    from harness.report import compare
    from harness.cli import main as cli_main

    assert cli_main(["compare", "--run", "a,b", "--runs-root", str(runs), "--out", str(out)]) == 0
    folder = out / "compare-a-vs-b"
    md = (folder / "compare.md").read_text()
    tps_rows = {(r[0], r[1]): r[2:5] for r in _md_section(md, "## tokens/s (ratio of sums)")}
    assert tps_rows[("refusion", "embedded_math")] == ["300.00", "600.00", "2.00"]
    assert tps_rows[("ar", "embedded_math")] == ["100.00", "120.00", "1.20"]
    assert tps_rows[("refusion", "gsm8k_cot")] == ["50.00", "75.00", "1.50"]  # stock vs paper prompt of GSM8K
    # These runs kept no per-item logs and no timed rounds: no interval, no test, and no row said to differ.
    assert _md_section(md, "## tokens/s (ratio of sums)")[0][5:] == ["-", "-", "not testable: one timed pass per run"]
    assert "None: no figure differs by more than chance" in md
    tasks = {(r[0], r[1]): r[2:4] for r in _md_section(md, "## Tasks and samples")}
    assert tasks[("refusion", "gsm8k_cot")] == ["gsm8k_cot", "gsm8k_cot_paper"]
    q = {(r[0], r[1]): r[2:5] for r in _md_section(md, "## quality (%, accuracy or pass@1)")}
    assert q[("refusion", "embedded_math")] == ["40.00", "30.00", "0.75"]
    diffs = _md_section(md, "## Model settings that differ")
    assert diffs == [["refusion", "knobs", "-", "slot_size=8"]]
    settings = {r[0]: r[1:] for r in _md_section(md, "## Runs")}
    assert settings["**prompts** (differs)"] == ["stock", "paper"]
    assert settings["**device** (differs)"] == ["cpu (2 threads)", "NVIDIA H200"]
    rows = list(csv.DictReader(open(folder / "compare.csv")))
    r = next(x for x in rows if x["model"] == "refusion" and x["benchmark"] == "embedded_math"
             and x["figure"] == "tpf")
    assert (float(r["value_a"]), float(r["value_b"]), float(r["ratio_b_over_a"])) == (3.0, 6.0, 2.0)
    data = json.loads((folder / "compare.json").read_text())
    assert data["reference"] == "a" and len(data["rows"]) == 4
    assert (folder.stat().st_mode & 0o777) == (0o777 & ~compare_umask())
    # Labels, the default (two newest runs), and bad input.
    assert compare.main(["--run", "old=a,new=b", "--runs-root", str(runs), "--out", str(out)]) == 0
    assert "| new / old |" in (out / "compare-old-vs-new" / "compare.md").read_text()
    assert compare.main(["--runs-root", str(runs), "--out", str(out), "--name", "latest"]) == 0
    assert (out / "latest" / "compare.md").read_text().startswith("# Compare: a vs b")
    capsys.readouterr()
    assert compare.main(["--run", "a", "--runs-root", str(runs), "--out", str(out)]) == 2
    assert "two or more runs" in _one_error(capsys)
    (runs / "b" / "metrics" / "ar__embedded_math.json").unlink()
    assert compare.main(["--run", "a,b", "--runs-root", str(runs), "--out", str(out), "--name", "x"]) == 2
    assert "--allow-partial" in _one_error(capsys) and not (out / "x").exists()


def compare_umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_tables_and_figures_show_sample_count_and_device(tmp_path):
    run = _mixed_run(tmp_path / "runs")
    out = tmp_path / "reports"
    assert main(["--run", str(run), "--out", str(out), "--name", "m"]) == 0
    md = (out / "m" / "table1.md").read_text()
    head = next(line for line in md.splitlines() if line.startswith("| Model"))
    assert head.startswith("| Model | decoder | n | device |")
    assert all(r[2:FIRST] == ["3", "cpu (2 threads)"] for r in _md_section(md, "### This run"))
    assert "refusion & refusion & 3 & cpu (2 threads) & " in (out / "m" / "table1.tex").read_text()
    rows = list(csv.DictReader(open(out / "m" / "table1.csv")))
    ours = next(x for x in rows if x["model"] == "refusion" and x["suite"] == "embedded")
    assert ours["device"] == "cpu (2 threads)" and ours["embedded_math_n"] == "3"
    pub = next(x for x in rows if x["source"] == "published" and x["suite"] == "paper")
    assert pub["gsm8k_cot_n"] == paper_report.PUBLISHED_N and pub["device"] == paper_report.PUBLISHED_DEVICE
    rs = paper_report.load_runs([run])
    figs = figures.build_all(rs, paper_report.build(rs))
    labels = figs["pareto_gsm8k_cot.png"][0].axes[0].get_legend_handles_labels()[1]
    assert "refusion (this run, n=3, cpu (2 threads))" in labels
    assert any("published: full test sets, GPU" in x for x in labels)
    for name in ("latency.png", "tpf_embedded.png", "speedup_embedded.png"):
        assert "n=3 per task, cpu (2 threads)" in figs[name][0].axes[0].get_title()
    assert "n=3 per task, cpu (2 threads)" in figs["memory.png"][0].get_suptitle()
    figures.plt.close("all")


def test_reports_are_ignored_by_git_and_world_readable(tmp_path):
    """A report into a fresh folder leaves `git status` clean (only the committed examples are tracked)."""
    import shutil

    def git(*args: str, cwd: Path) -> str:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout

    repo = tmp_path / "clone"
    repo.mkdir()
    shutil.copy(REPO / ".gitignore", repo / ".gitignore")
    git("init", "-q", cwd=repo)
    git("-c", "user.email=t@t", "-c", "user.name=t", "add", ".gitignore", cwd=repo)
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init", cwd=repo)
    run = _mixed_run(repo / "results" / "runs", "20260101-000000-abcdef")
    old = os.umask(0o022)
    try:
        assert main(["--run", str(run), "--out", str(repo / "reports")]) == 0
        from harness.report import compare

        other = _mixed_run(repo / "results" / "runs", "other", seed=1)
        assert compare.main(["--run", f"{run},{other}", "--out", str(repo / "reports")]) == 0
    finally:
        os.umask(old)
    assert git("status", "--porcelain", "--untracked-files=all", cwd=repo) == ""
    folder = repo / "reports" / run.name
    assert folder.stat().st_mode & 0o777 == 0o755
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in folder.iterdir())
    # The committed examples stay tracked; every other report folder is ignored.
    for path, ignored in (("reports/example/index.md", False), ("reports/tiny-frontier/index.md", False),
                          ("reports/curves/curves.png", False), ("reports/example/trace/index.html", False),
                          ("reports/kernels.png", False), ("reports/trend.png", False),
                          ("reports/sweep/sweep.json", True), ("reports/tiny-frontier/trace/embedded_math/ar.png", True),
                          ("reports/20260101-000000-abcdef/index.md", True),
                          ("reports/compare-a-vs-b/compare.md", True), ("reports/regress.md", True)):
        rc = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO).returncode
        assert (rc == 0) == ignored, path
    tracked = git("ls-files", "reports", cwd=REPO).split()
    assert tracked and all(subprocess.run(["git", "check-ignore", "-q", "--no-index", p], cwd=REPO).returncode == 1
                           for p in tracked)


def test_resumed_runs_are_marked_in_the_report(tmp_path):
    sessions = [{"started": "2026-01-01T00:00:00", "models": ["ar", "refusion"]},
                {"started": "2026-01-02T00:00:00", "models": []},  # a finished run started again: not a session
                {"started": "2026-01-03T00:00:00", "models": ["refusion"]}]
    run = fake_run(tmp_path / "runs", "r", [("ar", "ar"), ("refusion", "refusion")],
                   {("ar", "embedded_math"): (0.5, 100.0, 1.0), ("refusion", "embedded_math"): (0.4, 300.0, 3.0)},
                   ["embedded_math"], extra={"sessions": sessions})
    out = tmp_path / "reports"
    assert main(["--run", str(run), "--out", str(out), "--name", "r"]) == 0
    note = ("Resumed run: measured in 2 sessions (started 2026-01-01T00:00:00, 2026-01-03T00:00:00): ar in "
            "session 1; refusion in sessions 1, 2.")
    for name in ("table1.md", "speedup.md", "index.md"):
        assert note in (out / "r" / name).read_text(), name
    assert "resumed: measured in 2 sessions" in (out / "r" / "index.md").read_text()
    # A run measured in one session says nothing of it.
    one = fake_run(tmp_path / "runs", "one", [("ar", "ar")], {("ar", "embedded_math"): (0.5, 100.0, 1.0)},
                   ["embedded_math"])
    assert main(["--run", str(one), "--out", str(out), "--name", "one"]) == 0
    assert "Resumed" not in (out / "one" / "table1.md").read_text()


def _bars(ax) -> dict[str, list[float]]:
    return {c.get_label(): [b.get_height() for b in c] for c in ax.containers}


def test_merge_with_two_baselines_draws_each_baseline_its_own_series(tmp_path):
    """A two-run split (qwen3 + refusion, then llama3 + an MDM row, as README's recipe once was): each AR baseline gets its own
    speedup figure titled by it with the right ratios, a model keeps one colour in every figure, a model a
    figure cannot show is named in its title, and no table is printed without data."""
    runs = tmp_path / "runs"
    units = ["gsm8k_cot", "mbpp"]
    qwen = fake_run(runs, "qwen3", [("qwen3", "ar"), ("refusion", "refusion")],
                    {("qwen3", "gsm8k_cot"): (0.8, 30.0, 1.0), ("qwen3", "mbpp"): (0.6, 40.0, 1.0),
                     ("refusion", "gsm8k_cot"): (0.85, 90.0, 3.0), ("refusion", "mbpp"): (0.7, 120.0, 4.0)},
                    units, baseline="qwen3")
    # Another machine: cross-run ratios (refusion over llama3) are not comparable and must not be drawn.
    others = fake_run(runs, "others", [("llama3", "ar"), ("llada", "llada")],
                      {("llama3", "gsm8k_cot"): (0.7, 40.0, 1.0), ("llama3", "mbpp"): (0.5, 50.0, 1.0),
                       ("llada", "gsm8k_cot"): (0.6, 10.0, 1.5), ("llada", "mbpp"): (0.4, 20.0, 2.0)},
                      units, baseline="llama3", extra={"environment": {"cpu": "other cpu", "device": "cpu"}})
    rs = paper_report.load_runs([qwen, others])
    data = paper_report.build(rs)
    figs = figures.build_all(rs, data)
    assert "speedup_paper.png" not in figs
    vs_qwen = figs["speedup_paper_vs_qwen3.png"][0].axes[0]
    vs_llama = figs["speedup_paper_vs_llama3.png"][0].axes[0]
    assert vs_qwen.get_title().startswith("Speedup vs qwen3") and vs_llama.get_title().startswith("Speedup vs llama3")
    assert _bars(vs_qwen) == {"refusion": pytest.approx([3.0, 3.0, 3.0])}  # 90/30, 120/40, their mean
    assert _bars(vs_llama) == {"llada": pytest.approx([0.25, 0.4, 0.325])}
    assert "not shown: qwen3, refusion" in vs_llama.get_title()
    # One colour per model, whatever the figure.
    colors = figures.model_colors([m["name"] for m in rs.models])
    assert len(set(colors.values())) == 4
    for name in ("pareto_gsm8k_cot.png", "pareto_mbpp.png"):
        ax = figs[name][0].axes[0]
        ours = {c.get_label().split(" (")[0]: tuple(c.get_facecolor()[0]) for c in ax.collections
                if "published" not in c.get_label()}
        assert ours == {m: tuple(colors[m]) for m in ("qwen3", "refusion", "llama3", "llada")}
    for name, ax in (("vs qwen3", vs_qwen), ("vs llama3", vs_llama), ("tpf", figs["tpf_paper.png"][0].axes[0])):
        for c in ax.containers:
            assert tuple(c.patches[0].get_facecolor()) == tuple(colors[c.get_label()]), name
    for line in figs["latency.png"][0].axes[0].lines:
        assert tuple(line.get_color()) == tuple(colors[line.get_label().split(" (")[0]])
    # The average view cannot place rows that measured 2 of 7 benchmarks: it says so.
    avg = figs["pareto_avg_paper.png"]
    assert "not shown: qwen3, refusion, llama3, llada (not every task measured)" in avg[0].axes[0].get_title()
    assert "not shown (not every task measured)" in avg[1]
    figures.plt.close("all")
    # No embedded task in these runs: no embedded table, figure or speedup section.
    out = tmp_path / "reports"
    assert main(["--run", f"{qwen},{others}", "--out", str(out), "--name", "t"]) == 0
    for f in ("table1.md", "speedup.md", "table1.csv", "table1.tex"):
        assert "embedded" not in (out / "t" / f).read_text().lower(), f
    assert not any("embedded" in p.name for p in (out / "t").iterdir())


def test_a_suite_the_runs_did_not_measure_has_no_table_of_ours(tmp_path):
    run = fake_run(tmp_path / "runs", "emb", [("ar", "ar"), ("refusion", "refusion")],
                   {("ar", "embedded_math"): (0.5, 100.0, 1.0), ("refusion", "embedded_math"): (0.4, 300.0, 3.0)},
                   ["embedded_math"])
    out = tmp_path / "reports"
    assert main(["--run", str(run), "--out", str(out), "--name", "e"]) == 0
    md = (out / "e" / "table1.md").read_text()
    paper_part = md.split("## " + paper.paper_suite().title)[1].split("## " + paper.EMBEDDED.title)[0]
    assert "This run measured none of these tasks." in paper_part
    assert _md_section(paper_part, "### Published (" + paper.source() + ")")  # the published rows stay
    assert "| ar | ar |" not in paper_part and NOT_MEASURED + " | " + NOT_MEASURED not in paper_part.split("### Published")[0]
    rows = list(csv.DictReader(open(out / "e" / "table1.csv")))
    assert not [r for r in rows if r["suite"] == "paper" and r["source"] != "published"]


def test_report_names_the_base_an_adapter_ran_on(tmp_path):
    run = fake_run(tmp_path / "runs", "d", [("ar", "ar"), ("d2f", "d2f")],
                   {("ar", "embedded_math"): (0.5, 100.0, 1.0), ("d2f", "embedded_math"): (0.4, 300.0, 3.0)},
                   ["embedded_math"])
    cfg = json.loads((run / "run.json").read_text())
    cfg["models"][1]["base"] = "/ckpt/Dream-v0-Base-7B"  # as the runner records it, given or found beside
    cfg["models"][0]["chat_template_args"] = {"enable_thinking": False}  # a model's own template arguments
    (run / "run.json").write_text(json.dumps(cfg))
    rs = paper_report.load_runs([run])
    index = paper_report.index_md(rs, paper_report.build(rs), {})
    assert "| d2f | d2f | `/ckpt/d2f` + base `/ckpt/Dream-v0-Base-7B` |" in index
    assert "| ar | ar | `/ckpt/ar` | chat_template_args={'enable_thinking': False} |" in index


NINE = [("llama3", "ar", "llama"), ("qwen3", "ar", "qwen3"), ("llada", "llada", "llada"),
        ("llada_fast_dllm", "fast_dllm", "llada"), ("llada_d2f", "d2f", "llada"), ("dream", "dream", "dream"),
        ("dream_fast_dllm", "fast_dllm", "dream"), ("dream_d2f", "d2f", "dream"), ("refusion", "refusion", "refusion")]


def _with_families(run: Path) -> Path:
    cfg = json.loads((run / "run.json").read_text())
    fam = {n: f for n, _, f in NINE}
    for m in cfg["models"]:
        m["family"] = fam[m["name"]]
    (run / "run.json").write_text(json.dumps(cfg))
    return run


def _speedup_md(runs: list[Path]) -> str:
    """speedup.md of the runs, without drawing the figures (the claims are in the text only)."""
    rs = paper_report.load_runs(runs)
    return paper_report.speedup_md(rs, paper_report.build(rs))


def _claims(sp: str) -> dict[str, list[str]]:
    return {r[0]: r for r in _md_section(sp, f"### The paper's speedup claims beside ours ({paper.source()})")}


def test_published_claims_are_filled_from_one_or_two_comparable_runs(tmp_path):
    """The nine Table 1 rows: every published claim (ReFusion over each AR, MDM and accelerated MDM row) has
    our value beside it, from one run or from two runs on the same hardware and dtype; runs on other
    hardware are refused with the reason."""
    units = ["gsm8k_cot", "mbpp"]
    tps = {name: 10.0 + 5 * i for i, (name, _, _) in enumerate(NINE)}
    cells = {(n, u): (0.5, tps[n] * (2 if u == "mbpp" else 1), 1.0) for n, _, _ in NINE for u in units}
    one = _with_families(fake_run(tmp_path / "runs", "all", [(n, d) for n, d, _ in NINE], cells, units,
                                  baseline="qwen3"))
    got = _claims(_speedup_md([one]))
    assert len(got) == 8 and all(r[2] != NOT_MEASURED and r[4] != NOT_MEASURED for r in got.values()), got
    row = got["ReFusion over Qwen3-8B"]
    assert row[1:] == ["2.33", f"{tps['refusion'] / tps['qwen3']:.2f}", "2.24", f"{tps['refusion'] / tps['qwen3']:.2f}",
                       "2", "refusion / qwen3"]
    assert got["ReFusion over Dream w/ D2F"][-1] == "refusion / dream_d2f"
    # Split over two runs as the old recipe did: the same answers when the hardware and dtype match.
    first = {"qwen3", "refusion"}
    a = _with_families(fake_run(tmp_path / "runs", "a", [(n, d) for n, d, _ in NINE if n in first],
                                {k: v for k, v in cells.items() if k[0] in first}, units, baseline="qwen3"))
    b = _with_families(fake_run(tmp_path / "runs", "b", [(n, d) for n, d, _ in NINE if n not in first],
                                {k: v for k, v in cells.items() if k[0] not in first}, units, baseline="llama3"))
    assert _claims(_speedup_md([a, b])) == got
    # Other hardware: refused, with the reason, in the claims and under the speedup table.
    cfg = json.loads((b / "run.json").read_text())
    cfg["environment"]["gpu"], cfg["device"], cfg["dtype"] = "NVIDIA H100", "cuda", "bfloat16"
    (b / "run.json").write_text(json.dumps(cfg))
    sp = _speedup_md([a, b])
    refused = _claims(sp)["ReFusion over LLaDA-8B-Instruct"]
    assert refused[2] == NOT_MEASURED and "runs a and b differ in hardware" in refused[-1], refused
    assert "dtype float32 vs bfloat16" in refused[-1]
    assert _claims(sp)["ReFusion over Qwen3-8B"][2] == got["ReFusion over Qwen3-8B"][2]  # the same run: kept
    assert "Not divided (qwen3, refusion): runs a and b differ in hardware" in sp


def test_report_marks_models_decoded_compiled(tmp_path):
    """A model decoded with the knob compile: a "yes" cell with its compilations in the runs table, and a note
    that its rows are compiled while the published numbers are eager; an eager model says "no"."""
    run = fake_run(tmp_path / "runs", "c", [("ar", "ar"), ("arc", "ar", {"compile": True})],
                   {("ar", "embedded_math"): (0.5, 100.0, 1.0), ("arc", "embedded_math"): (0.5, 150.0, 1.0)},
                   ["embedded_math"], extra={"compile": {"ar": False, "arc": True}})
    path = run / "metrics" / "arc__embedded_math.json"
    met = json.loads(path.read_text())
    met["speed"]["compile"] = {"compiled": True, "compilations": 3, "compile_s": 1.5}
    met["run"] = {"run_id": "c"}
    path.write_text(json.dumps(met))
    rs = paper_report.load_runs([run])
    index = paper_report.index_md(rs, paper_report.build(rs), {})
    assert "| knobs used per task (resolved) | compiled |" in index
    assert re.search(r"^\| arc \| ar \| .* \| yes: 3 compilation\(s\), 1\.5 s \|$", index, re.M), index
    assert re.search(r"^\| ar \| ar \| .* \| no \|$", index, re.M), index
    assert any("arc decoded compiled" in n and "published numbers, are eager" in n for n in paper_report.run_notes(rs))


# ---------------------------------------------------------------- 95% intervals and paired tests


def item_run(root: Path, run_id: str, items: dict[tuple[str, str], list[tuple]], **kw) -> Path:
    """A run whose per-sample logs carry every item: ``items[(model, unit)]`` = [(score, tokens, seconds, nfe)];
    models are named after their decoder; the metrics are those items' figures."""
    models = list(dict.fromkeys((m, m) for m, _ in items))
    units = list(dict.fromkeys(u for _, u in items))
    cells = {k: (sum(x[0] for x in v) / len(v), sum(x[1] for x in v) / sum(x[2] for x in v),
                 sum(x[1] for x in v) / sum(x[3] for x in v)) for k, v in items.items()}
    d = fake_run(root, run_id, models, cells, units, samples=False, **kw)
    for (m, u), rows in items.items():
        (d / "models" / m / "samples").mkdir(parents=True, exist_ok=True)
        (d / "models" / m / "samples" / f"{u}.jsonl").write_text("".join(
            json.dumps({"task": u, "doc_id": i, "filter": "none", "metrics": {"exact_match": float(sc)},
                        "generated_tokens": t, "decode_s": sec, "nfe": n}) + "\n" for i, (sc, t, sec, n) in enumerate(rows)))
        path = d / "metrics" / f"{m}__{u}.json"
        met = json.loads(path.read_text())
        met["speed"]["samples"] = len(rows)
        path.write_text(json.dumps(met))
    return d


# ar: 8 of 10 right at 100 tok/s on every item; refusion: 2 of 10 (right only where ar is) at 400 tok/s.
AR_ITEMS = [(1, 10, 0.1, 10)] * 8 + [(0, 10, 0.1, 10)] * 2
RF_ITEMS = [(1, 10, 0.025, 5)] * 2 + [(0, 10, 0.025, 5)] * 8


def test_summary_and_table1_carry_95_percent_intervals(tmp_path):
    from harness.run import runner

    run = item_run(tmp_path / "runs", "iv", {("ar", "embedded_math"): AR_ITEMS, ("refusion", "embedded_math"): RF_ITEMS})
    runner.finalize(run)
    md = (run / "summary.md").read_text()
    # Wilson: 8/10 -> [0.490, 0.943], 2/10 -> [0.057, 0.510]; every item at the same speed: degenerate intervals.
    assert "| ar | embedded_math | 10 | 0.800 [0.490, 0.943] | 100.0 [100.0, 100.0] | 1.00 | 1.00 [1.00, 1.00] |" in md
    assert "| refusion | embedded_math | 10 | 0.200 [0.057, 0.510] | 400.0 [400.0, 400.0] | 4.00 [4.00, 4.00] |" in md
    assert "Mean per-task speedup [95% CI]: ar 1.00x, refusion 4.00x [4.00, 4.00]" in md and "Wilson" in md
    s = json.loads((run / "summary.json").read_text())
    row = next(r for r in s["rows"] if r["model"] == "refusion")
    assert row["quality_ci"]["method"] == "wilson" and row["speedup_p"] == 0.0
    assert row["latency_p90_s_ci"] == {"lo": 0.025, "hi": 0.025, "method": "bootstrap over 10 items (2000 resamples)"}
    # The report: every cell of ours with its interval, the quality in %.
    out = tmp_path / "reports"
    assert main(["--run", str(run), "--out", str(out), "--name", "iv"]) == 0
    table = _md_section((out / "iv" / "table1.md").read_text().split("## " + paper.EMBEDDED.title)[1], "### This run")
    cells = {r[0]: r for r in table}
    assert cells["ar"][FIRST] == "80.00 [49.02, 94.33] / 100.00 [100.00, 100.00]"
    assert cells["refusion"][FIRST] == "20.00 [5.67, 50.98] / 400.00 [400.00, 400.00]"
    avg = cells["ar"][-1]  # the Avg of one measured column: a stratified bootstrap, tokens/s degenerate
    assert avg.startswith("80.00 [") and avg.endswith("/ 100.00 [100.00, 100.00] (1/3)")
    rows = list(csv.DictReader(open(out / "iv" / "table1.csv")))
    r = next(x for x in rows if x["model"] == "ar" and x["suite"] == "embedded")
    assert float(r["embedded_math_quality_lo"]) == pytest.approx(49.016247, abs=1e-5)
    # speedup.md: the per-task speedup with its paired interval and p-value, and McNemar on the answers:
    # 6 items right in ar only, none in refusion only: p = 2 / 2^6 = 0.031 < 0.05, so it differs.
    sp = (out / "iv" / "speedup.md").read_text().split("## " + paper.EMBEDDED.title)[1]
    row = next(x for x in _md_section(sp, "### vs ar (AR baseline)") if x[0] == "refusion")
    assert row[2] == "4.00 [4.00, 4.00], p <0.001: differs" and row[3] == "4.00 [4.00, 4.00]"
    q = next(x for x in _md_section(sp, "Quality against ar, item by item (points, McNemar's exact test):")
             if x[0] == "refusion")
    assert q[2] == "-60.00 pp, p 0.031: differs"
    # The figures draw the intervals: error bars on each of our points and on each speedup bar.
    from matplotlib.container import ErrorbarContainer

    rs = paper_report.load_runs([run])
    figs = figures.build_all(rs, paper_report.build(rs))
    bars = [c for c in figs["pareto_embedded_math.png"][0].axes[0].containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 2
    ax = figs["speedup_embedded.png"][0].axes[0]
    assert any(isinstance(c, ErrorbarContainer) for c in ax.containers)


def test_compare_names_the_rows_that_differ_with_p_values(tmp_path, capsys):
    from harness.report import compare

    runs, out = tmp_path / "runs", tmp_path / "reports"
    item_run(runs, "a", {("ar", "embedded_math"): AR_ITEMS, ("refusion", "embedded_math"): RF_ITEMS})
    # b: ar answers as before but half as fast; refusion gets 2 more right (1 vs 0 discordant: p 1 for 1 vs 3).
    slow = [(sc, t, 2 * sec, n) for sc, t, sec, n in AR_ITEMS]
    better = RF_ITEMS[:2] + [(1, 10, 0.025, 5)] * 2 + RF_ITEMS[4:]
    item_run(runs, "b", {("ar", "embedded_math"): slow, ("refusion", "embedded_math"): better},
             extra={"created": "2026-03-01T00:00:00"})
    # Single passes: the wall-clock figures are not testable between the runs, whatever their ratio.
    assert compare.main(["--run", "a,b", "--runs-root", str(runs), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tokens_per_s" not in printed and "latency" not in printed
    tps = {r[0]: r for r in _md_section((out / "compare-a-vs-b" / "compare.md").read_text(),
                                        "## tokens/s (ratio of sums)")}
    assert tps["ar"][4] == "0.50" and tps["ar"][5:] == ["-", "-", "not testable: one timed pass per run"]
    # Timed rounds in both runs: the speedups are judged against a spread file's between-run spread (idle runs
    # of identical code); absolute figures are shown with their ratio, not judged.
    from harness.run import timing

    jitter = [1 + 0.01 * ((j * 7) % 9 - 4) for j in range(9)]
    for run_id, model, tps_, lat in (("a", "ar", 100.0, 0.1), ("b", "ar", 50.0, 0.2), ("a", "refusion", 400.0, 0.025),
                                     ("b", "refusion", 400.0, 0.025)):
        path = runs / run_id / "metrics" / f"{model}__embedded_math.json"
        met = json.loads(path.read_text())
        met["speed"]["timing"] = {"mode": "interleaved", "rounds": 9, "items": 1,
                                  "per_round_tokens_per_s": [tps_ * j for j in jitter[::-1 if run_id == "b" else 1]],
                                  "per_round_latency_p50_s": [lat / j for j in jitter],
                                  "per_round_latency_p90_s": [lat / j for j in jitter]}
        path.write_text(json.dumps(met))
        # speedup over ar in its own run's rounds: refusion 4x in a, 8x in b (ar twice as slow there)
        if model == "refusion":
            met["speedup"] = {"baseline": "ar", "tokens_per_s": 4.0 * (2 if run_id == "b" else 1),
                              "per_pair": [4.0 * (2 if run_id == "b" else 1) * j for j in jitter[:4]]}
            path.write_text(json.dumps(met))
    quiet = spread_file(tmp_path / "spread.json", {"refusion/embedded_math": [4.0, 4.2, 3.9, 4.1, 4.0, 4.3]})
    assert compare.main(["--run", "a,b", "--runs-root", str(runs), "--out", str(out), "--spread", str(quiet)]) == 0
    printed = capsys.readouterr().out
    # Absolute tokens/s of two runs: the ratio, not judged (the machine between runs is in neither run).
    assert "tokens_per_s" not in printed and "latency" not in printed
    factor = timing.spread_factor([4.0, 4.2, 3.9, 4.1, 4.0, 4.3])["factor"]
    test = f"beyond the between-run spread: x{factor:.2f} either way (6 idle runs)"
    assert f"differs: refusion embedded_math speedup in b ({test}, 6 idle runs)" in printed, printed
    md = (out / "compare-a-vs-b" / "compare.md").read_text()
    differ = _md_section(md, "## Rows that differ")
    assert ["refusion", "embedded_math", "speedup over the run's own AR model (x)", "b", "x2.00", test, "-",
            "6 idle runs"] in differ
    tps = {r[0]: r for r in _md_section(md, "## tokens/s (ratio of sums)")}
    assert tps["ar"][5:] == ["x0.50", "-", compare.NOT_JUDGED]
    assert not any(r[0] == "refusion" and r[2].startswith("quality") for r in differ)  # 2 vs 0 discordant: p 0.5
    q = {r[0]: r for r in _md_section(md, "## quality (%, accuracy or pass@1)")}
    assert q["refusion"][2:] == ["20.00 [5.67, 50.98]", "40.00 [16.82, 68.73]", "2.00",
                                 "+20.00 pp [+0.00, +50.00]", "0.500", "no difference shown (10 items)"]
    assert q["ar"][5:] == ["+0.00 pp [+0.00, +0.00]", "1.000", "no difference shown (10 items)"]
    data = json.loads((out / "compare-a-vs-b" / "compare.json").read_text())
    assert [(d["model"], d["figure"]) for d in data["differ"]] == [("refusion", "speedup")]
    # A machine whose idle runs spread more (make spread) sets a wider threshold: 2x is then within it.
    loose = spread_file(tmp_path / "loose.json", {"refusion/embedded_math": [4.0, 6.0, 3.0, 5.0, 2.5, 7.0]})
    assert timing.spread_factor([4.0, 6.0, 3.0, 5.0, 2.5, 7.0])["factor"] > 2
    assert compare.main(["--run", "a,b", "--runs-root", str(runs), "--out", str(out), "--spread", str(loose)]) == 0
    assert "differs: refusion" not in capsys.readouterr().out
    # A spread timed with other settings than the runs': not judged, and it says so.
    other = spread_file(tmp_path / "other.json", {"refusion/embedded_math": [4.0, 4.2, 3.9, 4.1, 4.0]}, rounds=4,
                        items=8)
    assert compare.main(["--run", "a,b", "--runs-root", str(runs), "--out", str(out), "--spread", str(other)]) == 0
    assert "differs: refusion" not in capsys.readouterr().out
    md = (out / "compare-a-vs-b" / "compare.md").read_text()
    assert "not judged: the runs were timed with other rounds or timed items than other.json's" in md


def test_a_system_beyond_table1_has_its_own_section_and_is_measured_against_the_references(tmp_path):
    """A row whose decoder no published row ran (DiffusionGemma) sits under "Beyond Table 1" in table1.md (its
    note, tex and csv too), and speedup.md measures it against the AR baseline and the MDM rows like any row."""
    runs = tmp_path / "runs"
    cells = {(m, "embedded_math"): v for m, v in {"ar": (0.5, 100.0, 1.0), "llada": (0.3, 20.0, 1.0),
                                                   "refusion": (0.4, 300.0, 3.0), "dg": (0.45, 150.0, 2.0)}.items()}
    fake_run(runs, "b", [("ar", "ar"), ("llada", "llada"), ("refusion", "refusion"), ("dg", "diffusion_gemma")],
             cells, ["embedded_math"])
    out = tmp_path / "reports"
    assert main(["--run", "b", "--runs-root", str(runs), "--out", str(out), "--name", "b", "--no-traces"]) == 0
    md = (out / "b" / "table1.md").read_text().split("## " + paper.EMBEDDED.title)[1]
    assert [r[0] for r in _md_section(md, "### This run")] == ["ar", "llada", "refusion"]
    assert [r[:2] for r in _md_section(md, "### Beyond Table 1")] == [["dg", "diffusion_gemma"]]
    assert "compare accuracy-parallelism frontiers" in md
    assert "Beyond Table 1 (no published numbers)" in (out / "b" / "table1.tex").read_text()
    rows = {r["model"]: r["section"] for r in csv.DictReader(open(out / "b" / "table1.csv")) if r["source"] != "published"}
    assert rows == {"ar": "table 1", "llada": "table 1", "refusion": "table 1", "dg": "beyond table 1"}
    sp = (out / "b" / "speedup.md").read_text().split("## " + paper.EMBEDDED.title)[1]
    assert next(r for r in _md_section(sp, "### vs ar (AR baseline)") if r[0] == "dg")[2] == "1.50"
    assert next(r for r in _md_section(sp, "### vs llada (MDM baseline)") if r[0] == "dg")[2] == "7.50"


def test_an_avg_without_an_interval_says_why():
    """A row's Avg tokens/s gets no interval when its columns cannot be resampled together, and says why instead of
    falling back silently: columns timed in different runs (their rounds do not pair), or timed and single-pass
    columns mixed."""
    apart = {"a": {"task": "a", "quality": 50.0, "tokens_per_s": 10.0, "timed": True, "_run_dir": "/r1",
                   "model_in_run": "m"},
             "b": {"task": "b", "quality": 40.0, "tokens_per_s": 20.0, "timed": True, "_run_dir": "/r2",
                   "model_in_run": "m"}}
    avg = paper_report._average(apart, 2, {})
    assert avg["tokens_per_s"] == 15.0 and avg["tokens_per_s_ci"] is None
    assert "timed in different runs" in avg["tokens_per_s_ci_why"]
    mixed = {**apart, "b": {**apart["b"], "timed": False, "_run_dir": "/r1"}}
    assert "single pass" in paper_report._average(mixed, 2, {})["tokens_per_s_ci_why"]
