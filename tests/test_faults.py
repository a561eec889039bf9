"""Faults of a long run (docs/design.md "Faults"): out of memory, non-finite logits, a forward budget, stop
signals and a full disk, injected into real ``harness eval`` runs on tiny checkpoints through the test hook
``REFUSION_BENCH_FAULTS`` (harness/run/faults.py), so each lands at a chosen place however fast the machine is.

After each fault the results must equal an uninterrupted run's on every item the fault did not touch, the
touched items must be named, and every message the user sees must be one line.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
N_DOCS = 6
TASK = "tiny_gen"


@pytest.fixture(scope="module")
def setup(runner_setup):
    return runner_setup


def _cmd(s: dict, run_id: str, *extra: str, models: str | None = None) -> list[str]:
    return [sys.executable, "-m", "harness", "eval", "--task", TASK, "--models", models or s["models"],
            "--tasks-dir", str(s["tasks"]), "--out", str(s["out"]), "--run-id", run_id, "--threads", "1",
            "--no-chat-template", *extra]


def _env(faults: dict | None = None, **more: str) -> dict:
    from harness.run.faults import FAULTS_ENV

    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", **more}
    env.pop(FAULTS_ENV, None)
    if faults:
        env[FAULTS_ENV] = json.dumps(faults)
    return env


def _run(s: dict, run_id: str, *extra: str, faults: dict | None = None, models: str | None = None,
         expect: int = 0) -> subprocess.CompletedProcess:
    p = subprocess.run(_cmd(s, run_id, *extra, models=models), cwd=REPO, env=_env(faults), capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == expect, p.stderr[-4000:]
    return p


def _rows(run_dir: Path, model: str = "a") -> dict[int, tuple]:
    """Per document: what must not depend on faults elsewhere, batching or resumption."""
    rows = [json.loads(line) for line in (run_dir / "models" / model / "samples" / f"{TASK}.jsonl").open()]
    return {r["doc_id"]: (r.get("failed"), r.get("tokens"), r["response"], r.get("nfe"), r["metrics"]) for r in rows}


def _answers(rows: dict[int, tuple]) -> dict[int, tuple]:
    """``_rows`` without NFE, which a batch shares among its rows (a row's answer does not depend on its batch)."""
    return {d: (failed, tokens, response, metrics) for d, (failed, tokens, response, _, metrics) in rows.items()}


def _metrics(run_dir: Path, model: str = "a") -> dict:
    return json.loads((run_dir / "metrics" / f"{model}__{TASK}.json").read_text())


def _leftovers(run_dir: Path) -> list[Path]:
    """Temp files of atomic writes (``.name.*.tmp``) anywhere in the run folder."""
    return [p for p in run_dir.rglob(".*") if p.name.endswith(".tmp") or p.name.endswith(".tmp.png")]


@pytest.fixture(scope="module")
def reference(runner_reference):
    return runner_reference


# ---------------------------------------------------------------- the pieces, in process


def test_non_finite_logits_on_padding_queries_are_not_a_fault():
    from refusion.decoding.common import NonFiniteLogits, check_finite, real_queries

    logits = torch.zeros(2, 3, 5)
    logits[:, :, 4] = -float("inf")  # a token ruled out: not a fault
    logits[0, 0, 1] = float("nan")  # row 0's first query is left padding
    pad = torch.tensor([[0, 1, 1], [1, 1, 1]])
    check_finite(logits, real_queries(3, pad, None), forward_index=4)
    with pytest.raises(NonFiniteLogits, match="^non-finite logits at forward 4$") as e:
        check_finite(logits, None, forward_index=4)
    assert e.value.rows == [0]
    logits[1, 2, 0] = float("inf")
    with pytest.raises(NonFiniteLogits) as e:
        check_finite(logits, real_queries(3, pad, None), forward_index=2)
    assert e.value.rows == [1]
    logits[1, 2, 0] = 0.0
    logits[1, 1] = -float("inf")  # no token left to give
    with pytest.raises(NonFiniteLogits) as e:
        check_finite(logits, None, forward_index=1)
    assert e.value.rows == [0, 1]
    visible = torch.ones(2, 3, 7, dtype=torch.bool)
    visible[0, 0] = False  # a query that sees nothing is padding
    assert real_queries(3, None, visible).tolist() == [[False, True, True], [True, True, True]]


def _items(n: int) -> list[dict]:
    return [{"key": f"k{i}", "task": TASK, "doc_id": i, "idx": 0, "knobs": {"gen_length": 4}} for i in range(n)]


def test_a_faulty_batch_is_retried_in_halves_and_a_lone_failure_is_recorded(capsys):
    from harness.run.lm_records import Records
    from refusion.decoding.common import NonFiniteLogits

    calls = []

    def decode(items):
        calls.append([it["doc_id"] for it in items])
        if len(items) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory")
        if any(it["doc_id"] == 3 for it in items):
            raise NonFiniteLogits(2, [0])
        return [{"key": it["key"], "response": f"r{it['doc_id']}", "generated_tokens": 1, "decode_s": 0.1}
                for it in items]

    recs = Records(None, rank=0)
    out = recs.answer(_items(5), decode, batch_size=5, bar=lambda initial: _Bar())
    assert out == ["r0", "r1", "r2", "", "r4"]
    assert calls == [[0, 1, 2, 3, 4], [0, 1, 2], [0, 1], [2], [3, 4], [3], [4]]
    failed = recs.done["k3"]
    assert failed["failed"] == "non-finite logits at forward 2" and failed["response"] == ""
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: {TASK} document 3 failed: non-finite logits at forward 2 (counted as wrong)"]

    def bug(items):
        raise KeyError("a bug is not an item fault")

    with pytest.raises(KeyError):
        Records(None, rank=0).answer(_items(2), bug, batch_size=2, bar=lambda initial: _Bar())


def test_a_plain_resume_keeps_failed_items(tmp_path):
    from harness.run.lm_records import Records, failed_record

    first = Records(str(tmp_path), rank=0)
    first.record(failed_record(_items(1)[0], "out of memory", 0))
    first.journal.close()
    again = Records(str(tmp_path), rank=0)
    assert again.answer(_items(1), lambda items: pytest.fail("decoded again"), 1, lambda initial: _Bar()) == [""]
    retry = Records(str(tmp_path), rank=0, retry_failed=True)
    fresh = [{"key": "k0", "response": "r0", "generated_tokens": 1, "decode_s": 0.1}]
    assert retry.answer(_items(1), lambda items: fresh, 1, lambda initial: _Bar()) == ["r0"]
    assert Records(str(tmp_path), rank=0).done["k0"]["response"] == "r0"  # the later record wins on load


class _Bar:
    def update(self, n):
        pass

    def set_postfix(self, **kw):
        pass

    def close(self):
        pass


def test_a_decoder_that_never_commits_fails_its_item_not_the_run(monkeypatch, tmp_path, make_checkpoint):
    """A decoder that forwards for ever without committing (a bug, or confidences that never pass its rule and
    no fallback) is stopped by its forward budget; through the lm-eval model, that item fails and the rest go on."""
    from harness.run.lm_adapter import RefusionBenchLM
    from refusion.decoding import DECODERS, Decoder
    from refusion.decoding.common import Meter, forward
    from refusion.decoding.mdm import LladaKnobs

    def stuck(model, input_ids, attention_mask=None, knobs=None, *, eos_token_id=None, mask_token_id=None, **kw):
        k = LladaKnobs.of(knobs, kw, "stuck")
        meter = Meter(model, ("step",))
        meter.track(input_ids.shape[0], k.gen_length, input_ids.device)
        while True:  # never commits: only the budget ends this
            forward(model, meter, "step", input_ids)

    monkeypatch.setitem(DECODERS, "stuck", Decoder(name="stuck", fn=stuck, knobs=LladaKnobs, batched=True,
                                                   causal=True, masked_diffusion=False))
    ckpt = make_checkpoint(tmp_path / "ck")
    lm = RefusionBenchLM(pretrained=str(ckpt), decoder="stuck", batch_size=2, device="cpu", warmup=False,
                         journal_dir=str(tmp_path / "journal"), gen_length=8, block_length=8)
    reqs = [SimpleNamespace(args=("what is 1 plus 4 ?", {"until": ["."], "max_gen_toks": 8}), task_name=TASK,
                            doc_id=i, idx=0) for i in range(2)]
    assert lm.generate_until(reqs, disable_tqdm=True) == ["", ""]
    journal = lm.records.journal.load()
    assert sorted(r["failed"] for r in journal.values()) == ["forward budget exceeded (32 forwards)"] * 2


def test_disk_full_at_each_store_write_leaves_no_partial_file(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from harness.run import store
    from harness.run.faults import FAULTS_ENV, disk_full

    monkeypatch.setenv(FAULTS_ENV, json.dumps({"enospc": "full/"}))
    target = tmp_path / "full"
    target.mkdir()
    writes = {
        "a.txt": lambda p: store.atomic_write_text(p, "new text\n" * 50),
        "b.json": lambda p: store.atomic_write_json(p, {"x": list(range(50))}),
        "c.jsonl": lambda p: store.atomic_write_jsonl(p, [{"i": i} for i in range(50)]),
        "d.png": lambda p: store.atomic_save_figure(plt.figure(), p),
    }
    for name, write in writes.items():
        path = target / name
        path.write_text("old\n")
        with pytest.raises(OSError) as e:
            write(path)
        assert path.read_text() == "old\n", name  # the old file, whole
        assert [p.name for p in target.iterdir() if p.name.startswith(".")] == [], name  # no temp file left
        line = disk_full(e.value)
        assert line.startswith(f"no space left on the device writing {path} (") and "free there" in line, line
        assert "\n" not in line
    journal = store.Journal(target / "journal")
    with pytest.raises(OSError) as e:
        journal.append({"key": "k1", "v": 1})
    assert disk_full(e.value).startswith(f"no space left on the device writing {journal.path}")
    monkeypatch.delenv(FAULTS_ENV)
    assert journal.load() == {}  # the torn half line is dropped
    journal.append({"key": "k2", "v": 2})  # a resume: the torn line is cut off first
    assert journal.load() == {"k2": {"key": "k2", "v": 2}}
    assert journal.path.read_text().count("\n") == 1


def test_report_and_summary_show_failed_items_beside_n():
    from harness.report.paper_report import n_text
    from harness.run import summary

    assert n_text({"n": [6], "failed": 2}) == "6 (2 failed)" and n_text({"n": [6], "failed": 0}) == "6"
    row = {"model": "a", "task": TASK, "samples": 6, "failed": 1, "quality_metric": "exact_match,none",
           "failed_items": [{"task": TASK, "doc_id": 3, "reason": "out of memory"}]}
    s = {"rows": [row], "run_id": "r", "task": TASK, "limit": None, "baseline": None, "mean_speedup": {},
         "models": ["a"], "units": [TASK]}
    md = summary.markdown(s)
    assert "| a | tiny_gen | 6 (1 failed) |" in md and "document 3 (out of memory)" in md
    (line,) = summary.failed_lines(s, Path("/runs/r"))
    assert line == (f"warning: a on {TASK}: 1 failed item(s), counted as wrong: document 3 (out of memory); "
                    "retry them with --run-id r --retry-failed")


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=lambda s: s.name)
def test_a_stop_signal_stops_the_worker_and_unwinds_the_runner(sig):
    """The runner's side of a stop, in process (the real runs below are slow): the worker is terminated and
    waited for, and the signal unwinds the runner as ``Stopped``; the earlier handlers come back."""
    from harness.run import launch

    before = signal.getsignal(sig)
    # The worker stand-in signals the runner itself once started (the handlers are in place by then), then
    # would sleep for a minute: the runner must terminate it.
    child = f"import os, time; os.kill(os.getppid(), {int(sig)}); time.sleep(60)"
    with pytest.raises(launch.Stopped) as e:
        launch.run_worker([sys.executable, "-c", child], dict(os.environ))
    assert e.value.signum == sig and signal.getsignal(sig) is before


# ---------------------------------------------------------------- real runs


# The faults of the real run below: OOM on every call of 3 rows or more (batch 4 backs off to 2) and at batch 1
# on document 4, NaN logits at the first forward of every call holding document 2, and a never-ending sample on
# document 0 (a model whose confidences never pass a threshold, under a budget of 2 forwards a row).
FAULTY = {"oom": {"min_batch": 3, "docs": [f"{TASK}:4"]}, "nan": {"docs": [f"{TASK}:2"], "forward": 1},
          "stall": {"docs": [f"{TASK}:0"], "forwards": 2}}


def test_oom_nan_and_a_sample_that_never_ends_fail_only_their_items(setup, reference):
    """A real run at batch 4 with the faults of FAULTY: documents 0, 2 and 4 fail, each named with its reason;
    the others give the answers of the uninterrupted batch-1 run. (--retry-failed: the next test.)"""
    # The pass decides what is checked here: no timed rounds (a single pass) and no memory pass.
    p = _run(setup, "faulty", "--batch-size", "4", "--timing", "sequential", "--memory-items", "0", faults=FAULTY)
    run_dir = setup["out"] / "faulty"
    got, want = _answers(_rows(run_dir)), _answers(_rows(reference))
    assert got[0][:3] == ("forward budget exceeded (2 forwards)", [], "")
    assert got[2][:3] == ("non-finite logits at forward 1", [], "")
    assert got[4][:3] == ("out of memory", [], "")
    assert {d: r for d, r in got.items() if d not in (0, 2, 4)} == {
        d: r for d, r in want.items() if d not in (0, 2, 4)}
    m = _metrics(run_dir)
    assert m["failed"] == {"count": 3, "items": [
        {"task": TASK, "doc_id": 0, "reason": "forward budget exceeded (2 forwards)"},
        {"task": TASK, "doc_id": 2, "reason": "non-finite logits at forward 1"},
        {"task": TASK, "doc_id": 4, "reason": "out of memory"}]}
    assert m["speed"]["samples"] == N_DOCS - 3
    # Each decoded row names its call, so the single-pass intervals resample calls (harness/run/stats.py).
    logged = [json.loads(x) for x in (run_dir / "models" / "a" / "samples" / f"{TASK}.jsonl").open()]
    calls = {}
    for r in logged:
        if not r.get("failed"):
            calls.setdefault(r["batch_id"], []).append(r["doc_id"])
    assert sum(map(len, calls.values())) == N_DOCS - 3 and all(len(d) <= 2 for d in calls.values()), calls
    assert f"| a | {TASK} | {N_DOCS} (3 failed) |" in (run_dir / "summary.md").read_text()
    last = p.stderr.strip().splitlines()[-1]
    assert last == (f"warning: a on {TASK}: 3 failed item(s), counted as wrong: document 0 (forward budget exceeded "
                    f"(2 forwards)), 2 (non-finite logits at forward 1), 4 (out of memory); retry them with "
                    f"--run-id faulty --retry-failed")
    assert "Traceback" not in p.stderr


@pytest.mark.slow
def test_retry_failed_decodes_the_failed_items_again(setup, reference):
    """The faulty run above (run again here when it did not run first), resumed with --retry-failed and without
    the faults: the three failed documents are decoded, the rest served from the journal; every answer is then
    the uninterrupted run's. In process, tests/test_faults.py::test_a_plain_resume_keeps_failed_items covers the
    journal side in `make test`."""
    run_dir = setup["out"] / "faulty"
    if not (run_dir / "summary.json").exists():
        _run(setup, "faulty", "--batch-size", "4", faults=FAULTY)
    assert _metrics(run_dir)["failed"]["count"] == 3
    _run(setup, "faulty", "--batch-size", "4", "--retry-failed")  # without the faults now
    assert _answers(_rows(run_dir)) == _answers(_rows(reference))
    assert _metrics(run_dir)["failed"]["count"] == 0 and _metrics(run_dir)["quality"] == _metrics(reference)["quality"]
    done = json.loads((run_dir / "models" / "a" / "done.json").read_text())
    assert (done["computed"], done["served_from_journal"]) == (3, N_DOCS - 3)


@pytest.mark.slow
def test_a_full_disk_stops_the_run_with_one_line_and_a_resume_completes_it(setup, reference):
    run_dir = setup["out"] / "full"
    p = _run(setup, "full", faults={"enospc": "metrics/"}, expect=2)
    err = p.stderr.strip().splitlines()
    target = run_dir / "metrics" / f"a__{TASK}.json"
    assert len([x for x in err if x.startswith("error:")]) == 1 and "Traceback" not in p.stderr
    assert err[-1].startswith(f"error: model 'a': no space left on the device writing {target} ("), err[-1]
    assert err[-1].endswith("free some space (or raise the quota); fix it and rerun with --run-id full to resume")
    assert not target.exists() and _leftovers(run_dir) == []
    _run(setup, "full")
    assert _rows(run_dir) == _rows(reference) and _metrics(run_dir)["quality"] == _metrics(reference)["quality"]


def _stop_at(s: dict, run_id: str, env: dict, marker: str, sig: signal.Signals, group: bool) -> subprocess.Popen:
    """Start a run, wait for the test hook's pause notice ``marker`` on stderr, then send ``sig`` to the runner
    (as a terminal or a service manager would) or to its whole process group (as Slurm signals a job step)."""
    proc = subprocess.Popen(_cmd(s, run_id), cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if marker in line:
                break
        else:
            pytest.fail(f"run ended (exit {proc.wait()}) before {marker!r}: {''.join(seen)[-2000:]}")
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    proc.err = "".join(seen) + err
    return proc


def _check_stopped_then_resumed(s: dict, reference: Path, run_id: str, env: dict, marker: str,
                                sig: signal.Signals, group: bool) -> None:
    proc = _stop_at(s, run_id, env, marker, sig, group)
    assert proc.returncode == 128 + sig, proc.err[-2000:]
    last = proc.err.strip().splitlines()[-1]
    assert last == f"stopped by {sig.name}; rerun with --run-id {run_id} to resume", proc.err[-2000:]
    run_dir = s["out"] / run_id
    assert _leftovers(run_dir) == []
    _run(s, run_id)
    assert _rows(run_dir) == _rows(reference)
    assert _metrics(run_dir)["quality"] == _metrics(reference)["quality"]
    assert _metrics(run_dir)["speed"]["nfe"] == _metrics(reference)["speed"]["nfe"]


@pytest.mark.slow
def test_sigusr1_to_the_job_mid_run_stops_cleanly_and_the_run_resumes(setup, reference):
    from harness.run.lm_adapter import PAUSE_ENV

    _check_stopped_then_resumed(setup, reference, "usr1", _env(**{PAUSE_ENV: "2"}), "paused after 2",
                                signal.SIGUSR1, group=True)


@pytest.mark.slow
def test_signals_at_seeded_points_resume_to_the_uninterrupted_results(setup, reference):
    """Mid-batch (after k journaled samples), between the journal and the metrics, before the summary: each a
    seeded pick of signal and receiver; every resumed run equals the uninterrupted one field by field."""
    from harness.run.faults import FAULTS_ENV
    from harness.run.lm_adapter import PAUSE_ENV

    rng = random.Random(41)
    points = [({PAUSE_ENV: str(rng.randint(1, N_DOCS - 1))}, None), ({}, "results"), ({}, "finalize")]
    for i, (extra, pause) in enumerate(points):
        sig = rng.choice([signal.SIGTERM, signal.SIGUSR1])
        env = _env({"pause": pause} if pause else None, **extra)
        marker = f"{FAULTS_ENV}: paused at {pause}" if pause else f"paused after {extra[PAUSE_ENV]}"
        _check_stopped_then_resumed(setup, reference, f"seeded{i}", env, marker, sig, group=rng.random() < 0.5)


@pytest.mark.slow
def test_a_signal_during_report_leaves_the_old_report(setup, reference, tmp_path):
    from harness.run.faults import FAULTS_ENV

    out = tmp_path / "report"
    cmd = [sys.executable, "-m", "harness", "report", "--run", str(reference), "--out", str(tmp_path), "--name",
           "report"]
    first = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env({"pause": "report"}), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    for line in proc.stderr:
        if f"{FAULTS_ENV}: paused at report" in line:
            break
    os.killpg(proc.pid, signal.SIGUSR1)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGUSR1
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["report"]  # no temp folder left beside it


WRITE_SITES = ("run.json", "journal.rank0", "lm_eval_results", "samples/", "metrics/", "done.json", "summary.json",
               "summary.md")


@pytest.mark.slow
@pytest.mark.parametrize("site", WRITE_SITES)
def test_a_full_disk_at_each_write_site(setup, reference, site):
    run_id = "full-" + site.strip("/").replace(".", "-")
    run_dir = setup["out"] / run_id
    p = _run(setup, run_id, faults={"enospc": site}, expect=2)
    err = [x for x in p.stderr.strip().splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "no space left on the device writing" in err[0] and site in err[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr and (not run_dir.exists() or _leftovers(run_dir) == [])
    _run(setup, run_id)
    assert _rows(run_dir) == _rows(reference)


@pytest.mark.slow
def test_nan_at_one_forward_of_every_decoder_in_a_real_run(setup, make_checkpoint, tmp_path):
    """Every registered decoder, in one run (a worker each): NaN at the second forward of document 1's call fails
    that document only; the others equal the same run without the fault."""
    from refusion.decoding import DECODERS

    bidir = make_checkpoint(tmp_path / "bidir", causal=False)
    knobs = {"ar": "gen_length=8", "refusion": "gen_length=8,slot_size=4", "llada": "gen_length=8,block_length=8",
             "fast_dllm": "gen_length=8,block_length=8", "dream": "gen_length=8", "d2f": "gen_length=8,block_size=8",
             "diffusion_gemma": "gen_length=8,max_denoising_steps=4", "llada2": "gen_length=8,block_length=8",
             "sdar": "gen_length=8,block_length=4,denoising_steps=4"}
    assert set(knobs) == set(DECODERS), "a new decoder needs its knobs here"
    released = Path(__file__).parent / "fixtures" / "released"
    own = {"diffusion_gemma": released / "diffusiongemma", "llada2": released / "llada2"}  # Decoder.family
    models = ",".join(f"{n}={own.get(DECODERS[n].family) or (setup['ckpt'] if DECODERS[n].causal else bidir)}:{n}:{k}"
                      for n, k in knobs.items())
    _run(setup, "nan-clean", models=models)
    _run(setup, "nan-each", faults={"nan": {"docs": [f"{TASK}:1"], "forward": 2}}, models=models)
    for name in knobs:
        got, want = _rows(setup["out"] / "nan-each", name), _rows(setup["out"] / "nan-clean", name)
        assert got[1][0] == "non-finite logits at forward 2", (name, got[1])
        assert {d: r for d, r in got.items() if d != 1} == {d: r for d, r in want.items() if d != 1}, name


def test_the_slow_fault_adds_cpu_work_in_proportion_to_each_forward(monkeypatch):
    """``"slow"`` (make compare's calibration): after every forward of a named decoder's model, a busy loop of
    (factor - 1) x that forward's seconds; other decoders untouched, the output unchanged. A fake clock makes
    the seconds exact: the forward takes 1 s of it, each clock read 1 ms."""
    import time

    from harness.run import faults

    now = [0.0]

    def clock() -> float:
        now[0] += 0.001
        return now[0]

    class Forward(torch.nn.Module):
        def forward(self, x):
            now[0] += 1.0
            return x + 1

    monkeypatch.setattr(time, "perf_counter", clock)
    monkeypatch.setenv(faults.FAULTS_ENV, json.dumps({"slow": {"decoders": ["refusion"], "factor": 1.5}}))
    model, item = Forward(), [{"task": "t", "doc_id": 0}]
    for decoder, low, high in (("refusion", 1.5, 1.51), ("ar", 1.0, 1.01)):
        with faults.injected_decode_faults(model, item, decoder):
            start = now[0]
            assert model(torch.zeros(1)).item() == 1.0
            assert low <= now[0] - start < high, (decoder, now[0] - start)
    assert not model._forward_hooks and not model._forward_pre_hooks  # removed after the call
