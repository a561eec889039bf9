"""The memory pass of a run (harness/run/memory_pass.py): peak decode memory per (model, task) in the metrics,
the summary and make regress's figures; the same bytes every time; a leak caught on its decoder alone; a
mismatch and a fault handled. Runs on copies of the reference run (conftest ``runner_reference``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from harness.run import memory_pass, run_dir as run_dir_mod
from harness.run.finalize import finalize
from harness.speed import regress


def _copy(reference: Path, dst: Path) -> Path:
    shutil.copytree(reference, dst, ignore=shutil.ignore_patterns(".lock", ".tmp-*"))
    return dst


def test_a_run_records_the_decode_peak_of_every_model_and_task(runner_reference):
    cfg = json.loads((runner_reference / "run.json").read_text())
    got = json.loads((runner_reference / "memory.json").read_text())
    assert got["settings"] == {"items": memory_pass.DEFAULT_ITEMS, "batch_size": cfg["batch_size"]}
    summary = json.loads((runner_reference / "summary.json").read_text())
    assert summary["memory_pass"]["docs"] == got["docs"]
    for m in cfg["models"]:
        for u in cfg["units"]:
            per = got["models"][m["name"]][u["name"]]
            met = json.loads((runner_reference / "metrics" / f"{m['name']}__{u['name']}.json").read_text())
            mem = met["memory"]
            # the largest call's peak, its breakdown summing to it, the weights apart
            assert mem["decode_peak_bytes"] == max(c["peak_bytes"] for c in per["calls"]) > 0
            assert sum(mem["decode_breakdown"].values()) == mem["decode_peak_bytes"]
            assert mem["weights_bytes"] > mem["decode_peak_bytes"] and mem["decode_method"].startswith("dispatch")
            assert [tuple(i) for i in mem["decode_items"]][0] in {tuple(d) for d in got["docs"][u["name"]]}
            row = next(r for r in summary["rows"] if r["model"] == m["name"] and r["task"] == u["name"])
            assert row["decode_peak_bytes"] == mem["decode_peak_bytes"] and row["weights_bytes"] == mem["weights_bytes"]
            assert regress.figures(runner_reference)["deterministic"][f"{m['name']}/{u['name']}"][
                "decode_peak_bytes"] == mem["decode_peak_bytes"]
    md = (runner_reference / "summary.md").read_text()
    assert "decode peak MiB" in md and "weights MiB" in md and "Memory: decode peak = the largest" in md


def test_the_pass_gives_the_same_bytes_again(runner_reference, tmp_path):
    run = _copy(runner_reference, tmp_path / "run")
    before = json.loads((run / "memory.json").read_text())
    (run / "memory.json").unlink()
    assert memory_pass.main(["--run-dir", str(run), "--no-progress"]) == 0
    assert json.loads((run / "memory.json").read_text()) == before


def test_a_leak_in_one_decoder_fails_its_memory_figures_only(runner_reference, tmp_path, monkeypatch):
    """Every forward's logits kept until the call ends (the fault hook's leak): what the leaking model's calls
    leave live grows (its peak too, where the leak outgrows the prefill's transient), and make regress's
    comparison fails that model's memory figures alone."""
    run = _copy(runner_reference, tmp_path / "run")
    cfg = json.loads((run / "run.json").read_text())
    leaky = cfg["models"][0]
    monkeypatch.setenv("REFUSION_BENCH_FAULTS", json.dumps({"leak": {"decoders": [leaky["decoder"]]}}))
    (run / "memory.json").unlink()
    assert memory_pass.main(["--run-dir", str(run), "--no-progress"]) == 0
    finalize(run)
    base, now = regress.figures(runner_reference), regress.figures(run)
    bad = sorted(r["figure"] for r in regress.compare(base, now) if not r["ok"])
    mine = [f"{m['name']}/{u['name']}" for m in cfg["models"] if m["decoder"] == leaky["decoder"] for u in cfg["units"]]
    assert bad and all(f.split()[0] in mine and f.split()[1] in ("decode_peak_bytes", "decode_retained_bytes")
                       for f in bad)
    for k in mine:
        b, n = base["deterministic"][k], now["deterministic"][k]
        assert n["decode_retained_bytes"] > b["decode_retained_bytes"] and n["decode_peak_bytes"] >= b["decode_peak_bytes"]


def test_a_mismatch_is_an_error_and_a_fault_is_named_not_fatal(runner_reference, tmp_path, monkeypatch, capsys):
    run = _copy(runner_reference, tmp_path / "run")
    cfg = json.loads((run / "run.json").read_text())
    got = json.loads((run / "memory.json").read_text())
    unit = cfg["units"][0]["name"]
    leaf, doc = got["docs"][unit][0]
    # A fault on one memory item in every call that holds it: retried once, named, left out; exit 0.
    monkeypatch.setenv("REFUSION_BENCH_FAULTS", json.dumps({"nan": {"docs": [f"{leaf}:{doc}"], "forward": 1}}))
    (run / "memory.json").unlink()
    assert memory_pass.main(["--run-dir", str(run), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"warning: memory pass: model {cfg['models'][0]['name']!r}, items [['{leaf}', {doc}]]" in err
    per = json.loads((run / "memory.json").read_text())["models"][cfg["models"][0]["name"]][unit]
    assert [f["items"] for f in per["failed"]] == [[[leaf, doc]]] and len(per["calls"]) == len(got["docs"][unit]) - 1
    monkeypatch.delenv("REFUSION_BENCH_FAULTS")
    # A decode that gives other tokens than the decoding pass is an error naming the model and the document.
    p = run / "models" / cfg["models"][0]["name"] / "samples" / f"{unit}.jsonl"
    rows = [json.loads(x) for x in p.read_text().splitlines()]
    for r in rows:
        if r["task"] == leaf and r["doc_id"] == doc:
            r["tokens"] = r["tokens"][:-1] + [r["tokens"][-1] + 1]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "memory.json").unlink()
    assert memory_pass.main(["--run-dir", str(run), "--no-progress"]) == 1
    assert f"the memory decode of {leaf} document {doc} gave other tokens" in capsys.readouterr().err
    assert not (run / "memory.json").exists()


def test_memory_items_is_recorded_and_zero_turns_the_pass_off(runner_reference, tmp_path):
    run = _copy(runner_reference, tmp_path / "run")
    cfg = json.loads((run / "run.json").read_text())
    assert cfg["memory_pass"] == {"items": memory_pass.DEFAULT_ITEMS}
    assert "memory_pass" not in run_dir_mod.RESUME_KEYS  # a resumed run may measure memory with other settings
    cfg["memory_pass"] = {"items": 0}
    (run / "run.json").write_text(json.dumps(cfg))
    assert memory_pass.load_memory(run, cfg) is None  # other settings: the old memory.json is not this run's
    result = finalize(run)
    assert result["memory_pass"] is None and all(r["decode_peak_bytes"] is None for r in result["rows"])
    assert "no memory pass in this run" in (run / "summary.md").read_text()


def test_the_memory_figure_and_compare_show_the_decode_peak(runner_reference):
    """The report's memory figure draws the decode peak split into KV cache, logits and other, with the weights
    beside it; make compare's memory rows are the decode peak and the weights, not the process RSS."""
    from harness.report import compare, figures
    from harness.report.runset import load_runs

    rs = load_runs([runner_reference])
    mem = figures._memory(rs)
    assert mem["label"] == "decode peak" and mem["second_label"] == "weights"
    met = next(iter(rs.metrics.values()))
    assert mem["peak"][0] == met["memory"]["decode_peak_bytes"] and mem["breakdown"][0] == met["memory"]["decode_breakdown"]
    fig = figures.memory_bars("t", mem["names"], mem["peak"], mem["label"], mem["second"], None, mem["second_label"],
                              mem["breakdown"])
    assert [len(a.containers) for a in fig.axes] == [3, 1] and "decode peak" in fig.axes[0].get_xlabel()
    rows = {key: fn(met) for key, _, fn, _ in compare.FIGURES}
    assert rows["decode_peak_mib"] == met["memory"]["decode_peak_bytes"] / 2**20
    assert rows["weights_mib"] == met["memory"]["weights_bytes"] / 2**20


def test_the_report_has_a_memory_page_with_the_released_size_estimate(runner_reference, tmp_path):
    from harness.report.memory_report import memory_md, released_table
    from harness.report.runset import load_runs

    md = memory_md(load_runs([runner_reference]))
    met = json.loads(next((runner_reference / "metrics").glob("*.json")).read_text())
    assert f"| {met['model']} | {met['task']} | {met['memory']['decode_peak_bytes'] / 2**20:.2f} |" in md
    # the estimate beside the claim, ReFusion's peak over each MDM baseline's recomputed from the file
    fake = {"settings": {"batches": [1], "prompt": 8, "gen": 16},
            "models": {"r": {"weights_bytes": 2**30, "decoders": {"refusion": {"1": {"peak_bytes": 60}}}},
                       "l": {"weights_bytes": 2**30, "decoders": {"llada": {"1": {"peak_bytes": 100}}}}}}
    (tmp_path / "m.json").write_text(json.dumps(fake))
    text = "\n".join(released_table(tmp_path / "m.json"))
    assert "about 40% lower" in text and "- vs llada: batch 1: -40%" in text and "| r | refusion | 1.00 |" in text
    assert released_table(tmp_path / "none.json") == []


def test_a_compiled_model_off_cuda_is_skipped_with_its_reason(runner_reference, tmp_path, capsys):
    """On the CPU the tensor tracker cannot see compiled forwards (torch.compile skips frames under a dispatch
    mode): the pass names the compiled model as skipped, in memory.json and in one progress line, and exits 0,
    instead of failing on it (the reference run has one model)."""
    run = _copy(runner_reference, tmp_path / "run")
    cfg = json.loads((run / "run.json").read_text())
    before = json.loads((run / "memory.json").read_text())
    compiled = cfg["models"][0]
    compiled["knobs"] = {**compiled.get("knobs", {}), "compile": True}
    (run / "run.json").write_text(json.dumps(cfg))
    (run / "memory.json").unlink()
    assert memory_pass.main(["--run-dir", str(run)]) == 0
    got = json.loads((run / "memory.json").read_text())
    assert "tracker cannot see compiled forwards" in got["skipped"][compiled["name"]]
    assert compiled["name"] not in got["models"] and compiled["name"] in before["models"]
    assert all(got["models"][m["name"]] == before["models"][m["name"]] for m in cfg["models"][1:])
    assert f"memory pass: {compiled['name']} skipped" in capsys.readouterr().err
