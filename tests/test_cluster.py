"""A run spread over a cluster (harness/run/cluster.py, harness/run/merge.py): shards, the dry run's
budget and device-hours, accelerate's multi-node options passed through, and the merge's refusals.
Fast: no model decodes here (the real two-machine job and shard merge are in tests/test_runner.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.run import cluster, launch, merge, runner


@pytest.fixture(scope="module")
def setup(write_task, tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    # The committed tiny checkpoint: only checked here, never decoded.
    ckpt = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny" / "ar"
    return {"ckpt": ckpt, "tasks": write_task(root / "tasks", "tiny_gen", n=5)}


def test_shards_are_disjoint_cover_everything_and_refuse_empty_shares():
    assert cluster.parse_shard("2/3") == {"index": 2, "count": 3} and cluster.parse_shard(None) is None
    for bad in ("0/3", "4/3", "x", "1/0"):
        with pytest.raises(ValueError, match="expected I/N"):
            cluster.parse_shard(bad)
    shares = [cluster.shard_docs(10, {"index": i, "count": 3}) for i in (1, 2, 3)]
    assert shares == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    units = [{"name": "t", "leaves": ["t"], "docs": {"t": 2}, "samples": 2}]
    assert cluster.apply_shard(units, {"index": 2, "count": 2})[0]["samples"] == 1
    with pytest.raises(ValueError, match="task 't' has only 2 document"):
        cluster.apply_shard(units, {"index": 3, "count": 3})


def test_dry_run_prints_requests_budget_and_device_hours(setup, tmp_path, capsys):
    args = ["--task", "tiny_gen", "--tasks-dir", str(setup["tasks"]), "--out", str(tmp_path / "out"), "--dry-run",
            "--models", f"a={setup['ckpt']}:ar:gen_length=20,b={setup['ckpt']}:refusion"]
    assert runner.main([*args, "--shard", "1/2", "--rate", "10"]) == 0
    out = capsys.readouterr().out
    assert "budget of shard 1/2 (requests x generated-token budget per request):" in out
    assert "  a: tiny_gen 3 x 20 = 60 tokens, 0.00167 device-hours at 10 tokens/s" in out, out
    budget = next(ln for ln in out.splitlines() if ln.startswith("  b: "))
    per = int(budget.split(" x ")[1].split(" ")[0])  # the task's own max_gen_toks: no gen_length given
    assert f"= {3 * per} tokens" in budget
    assert f"  total: {60 + 3 * per} tokens" in out
    # One shard's dry run also sizes the whole array: every document of the 5, both shards.
    assert f"  all 2 shards: {100 + 5 * per} tokens, {(100 + 5 * per) / 10 / 3600:.3g} device-hours" in out, out
    # An earlier run's pace per model: budget tokens over its decode seconds.
    earlier = tmp_path / "earlier"
    (earlier / "metrics").mkdir(parents=True)
    cfg = runner.build_config(runner._parser().parse_args([a for a in args if a != "--dry-run"]))
    (earlier / "run.json").write_text(json.dumps(cfg))
    (earlier / "metrics" / "a__tiny_gen.json").write_text(json.dumps(
        {"speed": {"samples": 5, "latency_s": {"total": 4.0}}}))
    assert cluster.paces(earlier) == {"a": 5 * 20 / 4.0}
    assert runner.main([*args, "--rate", str(earlier)]) == 0
    out = capsys.readouterr().out
    assert "  a: tiny_gen 5 x 20 = 100 tokens, 0.00111 device-hours at 25 tokens/s" in out, out
    # b has no pace in the earlier run: estimated at the others' mean (a's), marked, and counted in the total.
    b_line = next(ln for ln in out.splitlines() if ln.startswith("  b: "))
    assert b_line.endswith("device-hours at 25 tokens/s (estimated: no pace of its own, the others' mean)"), b_line
    assert "device-hours (estimated for b)" in out and "note:" not in out
    assert not (tmp_path / "out").exists()
    # A pace measured on another device or dtype is flagged, on stderr and in the budget.
    assert runner.main([*args, "--rate", str(earlier), "--dtype", "bfloat16"]) == 0
    cap = capsys.readouterr()
    words = f"--rate {earlier}: its paces were measured on cpu in float32, this run decodes on cpu in bfloat16"
    assert words in cap.out and words in cap.err, cap
    assert cluster.rate_remark("40", cfg) is None and cluster.rate_remark(str(earlier), cfg) is None


def test_multi_node_options_pass_through_to_accelerate(setup, tmp_path, capsys):
    opts = {"num_machines": 2, "machine_rank": 1, "main_process_ip": "10.0.0.1", "main_process_port": 29600}
    cmd = launch.worker_command(tmp_path, "a", 4, 1234, launch=opts)
    joined = " ".join(cmd)
    assert "accelerate.commands.launch" in joined and "--num_processes 4 --num_machines 2" in joined
    assert "--main_process_port 29600" in joined and "--machine_rank 1 --main_process_ip 10.0.0.1" in joined
    conf = tmp_path / "acc.yaml"
    conf.write_text("machine_rank: 3\nnum_machines: 4\n")
    cmd = launch.worker_command(tmp_path, "a", 1, 1234, launch={"accelerate_config": str(conf)})
    assert cmd[cmd.index("--config_file") + 1] == str(conf)
    assert cluster.machine_rank({"accelerate_config": str(conf)}) == 3
    assert launch.worker_command(tmp_path, "a", 1, 1234, launch={})[1:3] == ["-m", "harness.run.worker"]
    base = ["--task", "tiny_gen", "--tasks-dir", str(setup["tasks"]), "--models", f"a={setup['ckpt']}:ar",
            "--out", str(tmp_path / "out")]
    for extra, words in ((["--num-machines", "2", "--main-process-ip", "h", "--num-processes", "2"], "needs --run-id"),
                         (["--num-machines", "2", "--machine-rank", "2", "--run-id", "r"], "need 0 <= rank"),
                         (["--num-machines", "2", "--num-processes", "3", "--main-process-ip", "h", "--run-id", "r"],
                          "not a multiple"),
                         (["--num-machines", "2", "--num-processes", "2", "--run-id", "r"], "--main-process-ip")):
        assert runner.main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: ") and words in err, err
    assert not (tmp_path / "out").exists()


def _shard(root: Path, name: str, index: int, count: int, seed: int = 1234, sha: str = "abc", hardware: str = "cpu",
           commit: str = "c0") -> Path:
    d = root / name
    (d / "metrics").mkdir(parents=True)
    cfg = {"run_id": name, "task": "t", "units": [{"name": "t", "leaves": ["t"], "docs": {"t": 4}, "samples": 2,
                                                   "data_sha256": sha}],
           "models": [{"name": "a", "decoder": "ar", "checkpoint": "/c", "knobs": {}}], "limit": 4, "seed": seed,
           "shard": {"index": index, "count": count}, "environment": {"hardware": hardware, "git_commit": commit}}
    (d / "run.json").write_text(json.dumps(cfg))
    (d / "metrics" / "a__t.json").write_text("{}")
    return d


@pytest.mark.parametrize("shards, words", [
    ([(1, 2), (1, 2)], "overlapping shards: shard 1/2 given twice (s0, s1)"),
    ([(1, 3), (3, 3)], "missing shard(s) 2/3 (given: 1/3 in s0, 3/3 in s1)"),
    ([(1, 2), (2, 3)], "shards of different N"),
])
def test_merge_names_missing_and_overlapping_shards(tmp_path, capsys, shards, words):
    for i, (index, count) in enumerate(shards):
        _shard(tmp_path, f"s{i}", index, count)
    assert merge.main(["--run", "s0,s1", "--runs-root", str(tmp_path), "--run-id", "m"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {words}" if words.startswith("overlapping") else words in err, err
    assert not (tmp_path / "m").exists()


def test_merge_refuses_shards_of_other_settings_or_data(tmp_path, capsys):
    _shard(tmp_path, "s0", 1, 2)
    _shard(tmp_path, "s1", 2, 2, seed=7)
    _shard(tmp_path, "s2", 2, 2, sha="other")
    for other, what in (("s1", "(seed)"), ("s2", "(data (documents or their hash))")):
        assert merge.main(["--run", f"s0,{other}", "--runs-root", str(tmp_path), "--run-id", "m"]) == 2
        err = capsys.readouterr().err.strip()
        assert f"shards s0 and {other} have different settings {what}" in err, err
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "run.json").write_text(json.dumps({"run_id": "plain", "models": [], "units": []}))
    assert merge.main(["--run", "s0,plain", "--runs-root", str(tmp_path), "--run-id", "m"]) == 2
    assert "not a shard" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_report_of_shards_asks_for_the_merge(tmp_path, capsys):
    from harness.report import paper_report

    d = _shard(tmp_path, "s0", 1, 2)
    assert paper_report.main(["--run", str(d), "--out", str(tmp_path / "reports")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {d} is shard 1/2 of a run: join the shards first (`make merge") and "\n" not in err
    assert not (tmp_path / "reports").exists()


def test_merge_refuses_mixed_hardware_or_commits_unless_allowed(tmp_path, capsys):
    _shard(tmp_path, "s0", 1, 2, hardware="NVIDIA A100")
    _shard(tmp_path, "s1", 2, 2, hardware="NVIDIA H100")
    _shard(tmp_path, "s2", 2, 2, hardware="NVIDIA A100", commit="c1")
    for other, words in (("s1", "the shards ran on different hardware (NVIDIA A100 (s0); NVIDIA H100 (s1))"),
                         ("s2", "the shards ran on different commits (c0 (s0); c1 (s2))")):
        assert merge.main(["--run", f"s0,{other}", "--runs-root", str(tmp_path), "--run-id", "m"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {words}") and "--allow-mixed" in err and "\n" not in err, err
    assert not (tmp_path / "m").exists()
    runs = merge.check_shards([tmp_path / "s0", tmp_path / "s1"], allow_mixed=True)
    assert [d.name for d, _ in runs] == ["s0", "s1"]
    # The report names the mixed hardware for every row of such a merged run.
    from harness.report.runset import device_text, speed_setting

    cfg = {"device": "cuda", "environment": {"hardware": f"mixed: {merge.mixed_text(runs)}", "gpu": "NVIDIA A100"}}
    assert device_text(cfg) == "mixed: NVIDIA A100 (s0); NVIDIA H100 (s1)"
    assert speed_setting(cfg)["hardware"] == device_text(cfg)


def test_shards_status_lists_every_shard(tmp_path, capsys):
    _shard(tmp_path, "s1", 1, 4)
    (_shard(tmp_path, "s2", 2, 4) / "metrics" / "a__t.json").unlink()
    _shard(tmp_path, "s4", 4, 4)
    assert merge.main(["--run", "s1,s2,s3,s4", "--runs-root", str(tmp_path), "--status"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "s1: shard 1/4, done",
        "s2: shard 2/4, unfinished (0/1 (model, task) done; next: a__t); resume it with its --run-id",
        f"s3: missing (no run folder with a run.json at {tmp_path / 's3'})",
        "s4: shard 4/4, done",
        "shard 3/4: missing (none of the given runs)",
        "2 of 4 shard(s) done; not ready to merge"]
    (tmp_path / "s2" / "metrics" / "a__t.json").write_text("{}")
    _shard(tmp_path, "s3", 3, 4)
    assert merge.main(["--run", "s1,s2,s3,s4", "--runs-root", str(tmp_path), "--status"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "4 of 4 shard(s) done"


def test_a_merged_run_says_merged_from_n_shards():
    from harness.run import summary

    ss = [{"started": "t", "models": ["a", "b"], "merged": 32}]
    assert summary.session_note(ss).startswith("Merged from 32 shards (--shard I/32")
    assert summary.resumed(ss) == 1
