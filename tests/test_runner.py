"""`python -m harness eval`: bad input, kill -9 + resume, and a two-process accelerate run.

One uninterrupted single-process run is the reference; the resumed run and the
data-parallel run must reproduce its tokens, quality, NFE and TPF exactly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
N_DOCS = 6


@pytest.fixture(scope="module")
def setup(runner_setup):
    return runner_setup


def _cmd(s: dict, run_id: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "harness", "eval", "--task", "tiny_gen", "--models", s["models"],
            "--tasks-dir", str(s["tasks"]), "--out", str(s["out"]), "--run-id", run_id, "--threads", "1",
            "--no-chat-template", *extra]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}


def _run(s: dict, run_id: str, *extra: str, timeout: int = 900, env: dict | None = None
         ) -> subprocess.CompletedProcess:
    p = subprocess.run(_cmd(s, run_id, *extra), cwd=REPO, env={**_env(), **(env or {})}, capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def _deterministic(run_dir: Path) -> dict:
    """Everything that must not depend on timing, resumption or process count."""
    m = json.loads((run_dir / "metrics" / "a__tiny_gen.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "models" / "a" / "samples" / "tiny_gen.jsonl").open()]
    return {
        "quality": m["quality"], "nfe": m["speed"]["nfe"], "tpf": m["speed"]["tpf"],
        "generated": m["speed"]["generated_tokens"], "samples": m["speed"]["samples"],
        "rows": [(r["doc_id"], r["tokens"], r["response"], r["nfe"], r["metrics"]) for r in rows],
    }


@pytest.fixture(scope="module")
def reference(runner_reference):
    return runner_reference


def test_reference_run_records_everything(reference):
    m = json.loads((reference / "metrics" / "a__tiny_gen.json").read_text())
    assert m["speed"]["samples"] == N_DOCS and m["requests"]["generate"] == N_DOCS
    assert "exact_match,none" in m["quality"]
    lat = m["speed"]["latency_s"]
    assert 0 < lat["p50"] <= lat["p90"] and lat["mean"] > 0
    assert m["speed"]["tokens_per_s"]["ratio_of_sums"] > 0 and m["speed"]["tokens_per_s"]["mean_of_ratios"] > 0
    assert m["speed"]["nfe"]["total"] == m["speed"]["generated_tokens"]["total"]  # ar: one forward per token
    assert m["memory"]["peak_rss_bytes"] > 10 * 2**20 and m["memory"]["kv_peak_bytes"] > 0
    assert m["speedup"] == {"baseline": "a", "tokens_per_s": 1.0}
    # Wall-clock figures from the timed rounds (the default), the decoding pass's own kept beside them.
    t = m["speed"]["timing"]
    # 4 rounds, and every document timed: a task of fewer than 8 documents times them all (timing.items_auto)
    assert t["mode"] == "interleaved" and t["rounds"] == 4 and len(t["per_round_tokens_per_s"]) == 4
    assert t["items"] == N_DOCS
    assert m["speed"]["single_pass"]["tokens_per_s"] > 0 and m["intervals"]["tokens_per_s"]["lo"] > 0
    timed = json.loads((reference / "timing.json").read_text())
    assert timed["passes"][0]["sides"] == ["a"] and timed["memory"] == "all" and timed["passes"][0]["guard"]
    env = m["run"]["environment"]
    assert env["packages"]["lm-eval"] == "0.4.13" and env["seed"] == 1234 and env["threads_per_process"] == 1
    assert m["knobs"] == [{"gen_length": 24, "seed": 1234}]
    summary = json.loads((reference / "summary.json").read_text())
    assert [r["model"] for r in summary["rows"]] == ["a"]
    assert "| a | tiny_gen | 6 |" in (reference / "summary.md").read_text()
    assert (reference / "models" / "a" / "lm_eval_results.json").exists()


@pytest.mark.slow
def test_resume_after_kill_9(setup, reference):
    """The worker freezes itself after PAUSE_AT journaled samples (a test hook), so the kill lands
    at a chosen point by construction, however fast or slow the machine is."""
    from harness.run.lm_adapter import PAUSE_ENV

    pause_at = 2
    run_dir = setup["out"] / "killed"
    proc = subprocess.Popen(_cmd(setup, "killed"), cwd=REPO, env={**_env(), PAUSE_ENV: str(pause_at)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        # The pause notice is printed after the journal line is fsynced; stderr carries it.
        for line in proc.stderr:
            if f"paused after {pause_at}" in line:
                break
        else:
            pytest.fail(f"run ended (exit {proc.wait()}) without reaching the pause point")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the runner and its worker, mid-run
        proc.wait()
        proc.stderr.close()
    journal = run_dir / "models" / "a" / "journal" / "journal.rank0.jsonl"
    done_before = journal.read_text().count("\n")
    assert done_before == pause_at and not (run_dir / "summary.json").exists()

    _run(setup, "killed")
    finished = json.loads((run_dir / "models" / "a" / "done.json").read_text())
    assert finished["served_from_journal"] == done_before
    assert finished["computed"] == N_DOCS - done_before
    assert _deterministic(run_dir) == _deterministic(reference)


@pytest.mark.slow
def test_two_processes_match_one(setup, reference, tmp_path):
    # accelerate/torchrun create a torchelastic_* folder in TMPDIR: the runner gives each worker a
    # temp folder of its own inside the run folder and removes it, so the caller's TMPDIR stays empty.
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    _run(setup, "dp2", "--num-processes", "2", env={"TMPDIR": str(tmp)})
    run_dir = setup["out"] / "dp2"
    assert list(tmp.iterdir()) == [] and list(run_dir.glob(".tmp-*")) == []
    m = json.loads((run_dir / "metrics" / "a__tiny_gen.json").read_text())
    assert len(m["memory"]["peak_rss_by_rank"]) == 2
    ranks = {json.loads(line)["rank"] for line in (run_dir / "models" / "a" / "samples" / "tiny_gen.jsonl").open()}
    assert ranks == {0, 1}
    assert _deterministic(run_dir) == _deterministic(reference)


def test_bad_input_exits_2_with_one_line_and_writes_nothing(setup, tmp_path, capsys, monkeypatch):
    import re

    from harness.run import runner

    ck, tasks = setup["ckpt"], str(setup["tasks"])
    no_config = tmp_path / "noconfig"
    no_config.mkdir()
    out = tmp_path / "out"
    cases = [
        (["--task", "nope"], "unknown task 'nope'; valid tasks: .*tiny_gen"),
        (["--models", f"a={ck}:nope"], "unknown decoder 'nope'; valid decoders: .*ar"),
        (["--models", "nope"], "unknown model name 'nope'; valid names: ar, refusion"),
        (["--models", f"a={tmp_path}/missing:ar"], "checkpoint directory .*missing' does not exist"),
        (["--models", f"a={no_config}:ar"], "has no config.json"),
        (["--models", f"a={ck}:ar:slot_sise=3"], "unknown knob\\(s\\) slot_sise for decoder 'ar'; valid knobs: "),
        (["--models", f"a={ck}:ar:gen_length=-1"], "gen_length must be an integer"),
    ]
    for extra, pattern in cases:
        argv = ["--task", "tiny_gen", "--tasks-dir", tasks, "--models", f"a={ck}:ar", "--out", str(out),
                "--run-id", "x"] + extra
        assert runner.main(argv) == 2, extra
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: ") and re.search(pattern, err), err
        assert not out.exists(), extra

    # Missing benchmark data: the real gsm8k_cot task with an empty data folder.
    empty = tmp_path / "nodata"
    empty.mkdir()
    monkeypatch.setenv("REFUSION_DATA_DIR", str(empty))
    assert runner.main(["--task", "gsm8k_cot", "--models", f"a={ck}:ar", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "gsm8k_cot" in err and "no file at" in err, err
    assert not out.exists()

    # Through the real command line: exit status 2 and the same one line.
    p = subprocess.run([sys.executable, "-m", "harness", "eval", "--task", "nope", "--tasks-dir", tasks,
                        "--models", f"a={ck}:ar", "--out", str(out)], cwd=REPO, env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().startswith("error: unknown task 'nope'"), p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not out.exists()


def test_models_spec_parsing():
    from harness.run.model_list import InputError, parse_models

    ms = parse_models("a=ck/x:ar:gen_length=8,temperature=0.5,b=ck/y:refusion:slot_size=4,llada,refusion:slot_size=8")
    assert [(m.name, m.checkpoint, m.decoder, m.knobs) for m in ms] == [
        ("a", "ck/x", "ar", {"gen_length": 8, "temperature": 0.5}),
        ("b", "ck/y", "refusion", {"slot_size": 4}),
        ("llada", "checkpoints/tiny/mdm", "llada", {"block_length": 32, "remasking": "low_confidence"}),
        ("refusion", "checkpoints/tiny/refusion", "refusion",
         {"slot_size": 8, "serial_num_blocks": 1, "slot_threshold": 0.6, "token_threshold": 0.3}),
    ]
    with pytest.raises(InputError, match="used twice"):
        parse_models("ar,ar")
    with pytest.raises(InputError, match="expected name=checkpoint:decoder"):
        parse_models("a=onlypath")


def test_models_all_is_every_preset():
    from harness.run.presets import PRESETS
    from harness.run.model_list import InputError, parse_models

    assert [m.name for m in parse_models("all")] == list(PRESETS)
    assert {"dream", "dream_fast_dllm", "d2f"} <= set(PRESETS)
    assert [m.name for m in parse_models(" all ")] == list(PRESETS)
    with pytest.raises(InputError, match="used twice"):
        parse_models("all,ar")


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def _alive(pid: int) -> bool:
    try:
        return not Path(f"/proc/{pid}/status").read_text().split("State:")[1].strip().startswith("Z")
    except (OSError, IndexError):
        return False


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_runner_and_worker_and_run_resumes(setup, reference, sig):
    from harness.run.lm_adapter import PAUSE_ENV

    run_id = f"stopped-{sig.name}"
    run_dir = setup["out"] / run_id
    # The worker freezes after one journaled sample (test hook), so the signal lands mid-run by construction.
    proc = subprocess.Popen(_cmd(setup, run_id), cwd=REPO, env={**_env(), PAUSE_ENV: "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if "paused after 1" in line:
                break
        else:
            pytest.fail(f"run ended (exit {proc.wait()}) without reaching the pause point: {''.join(seen)[-2000:]}")
        workers = _children(proc.pid)
        proc.send_signal(sig)  # the runner only, as a service manager or a terminal would
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + sig, err[-2000:]
    assert f"--run-id {run_id}" in err.strip().splitlines()[-1]
    assert workers and not any(_alive(w) for w in workers)
    journal = run_dir / "models" / "a" / "journal" / "journal.rank0.jsonl"
    assert journal.read_text().count("\n") == 1
    _run(setup, run_id)
    assert _deterministic(run_dir) == _deterministic(reference)


@pytest.mark.slow
def test_worker_dies_with_its_runner(setup):
    from harness.run.lm_adapter import PAUSE_ENV

    run_id = "orphan"
    proc = subprocess.Popen(_cmd(setup, run_id), cwd=REPO, env={**_env(), PAUSE_ENV: "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in proc.stderr:  # the worker is alive and frozen mid-run once this line appears
            if "paused after 1" in line:
                break
        else:
            pytest.fail(f"run ended (exit {proc.wait()}) without reaching the pause point")
        workers = _children(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)  # the runner alone, with no chance to clean up
        proc.wait()
        end = time.time() + 60  # generous: only bounds a failure, a pass returns at once
        while time.time() < end and any(_alive(w) for w in workers):
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.stderr.close()
    assert workers and not any(_alive(w) for w in workers)


@pytest.mark.slow
def test_run_folder_is_locked(setup, tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys\nfrom pathlib import Path\n"
                               "from harness.run.run_dir import lock_run_dir\n"
                               f"lock_run_dir(Path({str(setup['out'] / 'busy')!r}))\n"
                               "print('locked', flush=True)\nsys.stdin.read()\n"],
                              cwd=REPO, env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        p = subprocess.run(_cmd(setup, "busy"), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    finally:
        holder.stdin.close()
        holder.wait()
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and f"pid {holder.pid}" in lines[0] and "in use" in lines[0]
    assert not (setup["out"] / "busy" / "run.json").exists()


def test_default_run_ids_are_unique_within_a_second():
    from harness.run.run_dir import default_run_id

    ids = {default_run_id() for _ in range(50)}
    assert len(ids) == 50


def test_result_files_are_group_readable(tmp_path):
    from harness.run.store import atomic_write_json

    old = os.umask(0o022)
    try:
        atomic_write_json(tmp_path / "m.json", {"a": 1})
    finally:
        os.umask(old)
    assert (tmp_path / "m.json").stat().st_mode & 0o777 == 0o644


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # 83 s; make test covers the several-machine arguments by dry run (tests/test_cluster.py)
def test_two_machine_accelerate_job_matches_one_process(setup, tmp_path):
    """`--num-machines 2` on localhost (CPU, gloo): two runners, machine ranks 0 and 1, one run folder, each
    machine one process of accelerate's job; started beside a single-process run of the same settings,
    whose per-sample outputs the two machines' must equal."""
    port = str(_free_port())
    two = ["--limit", "2", "--num-processes", "2", "--num-machines", "2", "--main-process-ip", "127.0.0.1",
           "--main-process-port", port]
    procs = [subprocess.Popen(_cmd(setup, "machines2", *two, "--machine-rank", str(rank)), cwd=REPO, env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    # The single-process run meanwhile, its runner in this process (one interpreter start less).
    from harness.run import runner

    assert runner.main(_cmd(setup, "single2", "--limit", "2")[4:]) == 0
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert "machine rank 1: every model done" in outs[1][1]
    run_dir = setup["out"] / "machines2"
    rows = [json.loads(line) for line in (run_dir / "models" / "a" / "samples" / "tiny_gen.jsonl").open()]
    assert {r["rank"] for r in rows} == {0, 1} and len(rows) == 2  # one document decoded on each machine
    assert sorted(p.name for p in (run_dir / "models" / "a" / "journal").iterdir()) == [
        "journal.rank0.jsonl", "journal.rank1.jsonl"]
    assert _deterministic(run_dir) == _deterministic(setup["out"] / "single2")
    assert list(run_dir.glob(".tmp-*")) == []


@pytest.mark.slow
def test_shards_merge_into_the_table_of_one_run(setup, reference, capsys):
    """Two `--shard` jobs (run side by side) merged: the same quality, NFE, TPF and per-sample outputs as the
    one run of every document; a missing shard is named."""
    procs = [subprocess.Popen(_cmd(setup, f"shard{i}", "--shard", f"{i}/2"), cwd=REPO, env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (1, 2)]
    for p in procs:
        assert p.wait(timeout=900) == 0, p.stderr.read()[-3000:]
        p.stdout.close()
        p.stderr.close()
    out = setup["out"]
    ids = [sorted(json.loads(line)["doc_id"] for line in (out / f"shard{i}" / "models" / "a" / "samples" /
                                                          "tiny_gen.jsonl").open()) for i in (1, 2)]
    assert ids == [[0, 2, 4], [1, 3, 5]]
    from harness.run import merge

    assert merge.main(["--run", "shard2", "--runs-root", str(out), "--run-id", "half"]) == 2
    assert "missing shard(s) 1/2 (given: 2/2 in shard2)" in capsys.readouterr().err
    assert not (out / "half").exists()
    assert merge.main(["--run", "shard1,shard2", "--runs-root", str(out), "--run-id", "merged"]) == 0
    assert _deterministic(out / "merged") == _deterministic(reference)
    summary = json.loads((out / "merged" / "summary.json").read_text())
    ref = json.loads((reference / "summary.json").read_text())
    pick = [{k: r.get(k) for k in ("model", "task", "quality", "nfe_mean", "tpf", "samples")} for r in summary["rows"]]
    assert pick == [{k: r.get(k) for k in ("model", "task", "quality", "nfe_mean", "tpf", "samples")}
                    for r in ref["rows"]]
