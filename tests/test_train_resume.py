"""The trainer survives interruption (refusion/train.py): a run stopped after step k (in-process, or a
real subprocess killed with SIGKILL once its state file is there) and resumed ends with weights
bit-identical to an uninterrupted run's; a state from another configuration is never resumed
silently. Tiny model shape, a few rows, a few steps, one thread."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from refusion.train import ModelShape, StateMismatch, TrainConfig, prepare, train_one

REPO = Path(__file__).resolve().parents[1]
SHAPE = ModelShape(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
# Steps 0..5; open-ended, result and number items in the mixture so every draw path is covered too.
CFG = TrainConfig(steps=6, batch_size=4, lr=3e-3, warmup=2, threads=1, save_every=100, open_share=0.3,
                  result_share=0.3, number_share=0.2, refusion_init="scratch", mdm_init="scratch", snapshot_every=3)


def small_corpus() -> dict[str, list[dict]]:
    from harness.train.train_tiny import embedded_corpus

    return {k: v[:12] for k, v in embedded_corpus().items()}  # the trainer's rows, with their cut points


@pytest.fixture(scope="module")
def data():
    return prepare(CFG, small_corpus())


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), [k for k in wa if not torch.equal(wa[k], wb[k])]


@pytest.mark.parametrize("name", ["refusion", "mdm"])
def test_stopped_and_resumed_run_is_bit_identical(name, data, tmp_path):
    tok, examples = data
    full = train_one(name, tok, examples, CFG, SHAPE, tmp_path / "full", progress=False)
    assert train_one(name, tok, examples, CFG, SHAPE, tmp_path / "cut", progress=False, stop_after=4) is None
    state = tmp_path / "cut" / f".{name}.state.pt"
    assert state.is_file() and not (tmp_path / "cut" / name).exists()
    resumed = train_one(name, tok, examples, CFG, SHAPE, tmp_path / "cut", progress=False)
    assert_same_weights(full, resumed)
    assert not state.exists()
    # The resumed log continues the first one: one row per step, the same losses and tokens.
    log_full = (full / "train_log.csv").read_text().splitlines()
    log_cut = (resumed / "train_log.csv").read_text().splitlines()
    def no_time(rows):  # step, loss, lr, tokens; not the wall clock
        return [",".join(r.split(",")[:4]) for r in rows]
    assert len(log_full) == 1 + CFG.steps and no_time(log_full) == no_time(log_cut)
    # Weights-only snapshots at steps 3 and 6 in the resumed run too.
    snaps = sorted(p.name for p in (tmp_path / "cut" / ".snapshots" / name).glob("step-*.pt"))
    assert snaps == ["step-000003.pt", "step-000006.pt"]


# The subprocess builds the same corpus, config and shape (their reprs are evaluable) and trains ar.
SCRIPT = """
import sys
from pathlib import Path
from harness.train.train_tiny import embedded_corpus
from refusion.train import ModelShape, TrainConfig, prepare, train_one
rows = {{k: v[:12] for k, v in embedded_corpus().items()}}
tok, examples = prepare({cfg!r}, rows)
train_one("ar", tok, examples, {cfg!r}, {shape!r}, Path(sys.argv[1]), progress=False)
"""


def test_sigkilled_subprocess_resumes_bit_identical(data, tmp_path):
    """A real process, frozen by the trainer's test hook right after its state file at step 3, is killed
    with SIGKILL; resuming from that file gives the uninterrupted weights."""
    from refusion.train import PAUSE_ENV

    tok, examples = data
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(cfg=CFG, shape=SHAPE))
    out = tmp_path / "killed"
    env = {**os.environ, PAUSE_ENV: "3", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(script), str(out)], env=env, stderr=subprocess.PIPE, text=True)
    state = out / ".ar.state.pt"
    try:
        deadline = time.time() + 300
        while not state.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert state.exists(), f"no state file (exit {proc.poll()}): {proc.stderr.read() if proc.poll() else ''}"
        assert proc.poll() is None  # still running (paused), killed mid-run below
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL and not (out / "ar").exists()
    resumed = train_one("ar", tok, examples, CFG, SHAPE, out, progress=False)
    full = train_one("ar", tok, examples, CFG, SHAPE, tmp_path / "full", progress=False)
    assert_same_weights(full, resumed)


def test_state_of_another_config_is_refused(data, tmp_path):
    tok, examples = data
    train_one("ar", tok, examples, CFG, SHAPE, tmp_path, progress=False, stop_after=2)
    other = dataclasses.replace(CFG, lr=1e-3)
    with pytest.raises(StateMismatch, match=r"lr \(0\.003 in the state, 0\.001 now\).*--fresh"):
        train_one("ar", tok, examples, other, SHAPE, tmp_path, progress=False)
    # Operational fields (threads, how often it saves) may change on resume.
    assert train_one("ar", tok, examples, dataclasses.replace(CFG, save_every_s=1.0), SHAPE, tmp_path,
                     progress=False, stop_after=3) is None
    # fresh: the stale state is discarded (with a message) and the run starts over.
    path = train_one("ar", tok, examples, other, SHAPE, tmp_path, progress=False, fresh=True)
    assert_same_weights(path, train_one("ar", tok, examples, other, SHAPE, tmp_path / "ref", progress=False))


def test_cli_reports_a_mismatched_state_as_an_error(tmp_path, capsys):
    """Through the command line: a one-line `error:` naming the state file and --fresh (before any data work)."""
    from refusion import train

    (tmp_path / ".ar.state.pt").parent.mkdir(parents=True, exist_ok=True)
    torch.save({"config": {"lr": 1.0}, "shape": {}, "data": "x"}, tmp_path / ".ar.state.pt")
    rc = train.main(["--models", "ar", "--out", str(tmp_path), "--threads", "1", "--steps", "2"],
                    corpus=small_corpus, entry="harness.train.train_tiny")
    err = capsys.readouterr().err
    assert rc == 2 and "error:" in err and ".ar.state.pt" in err and "--fresh" in err


def test_state_without_a_later_added_field_resumes_as_its_default(data, tmp_path):
    """A state written before a TrainConfig field existed resumes when the run keeps that field's default."""
    tok, examples = data
    train_one("ar", tok, examples, CFG, SHAPE, tmp_path / "old", progress=False, stop_after=2)
    path = tmp_path / "old" / ".ar.state.pt"
    state = torch.load(path, weights_only=False)
    del state["config"]["suffix_share"]
    torch.save(state, path)
    resumed = train_one("ar", tok, examples, CFG, SHAPE, tmp_path / "old", progress=False)
    assert_same_weights(resumed, train_one("ar", tok, examples, CFG, SHAPE, tmp_path / "full", progress=False))
