"""The committed tiny checkpoints are `make train-tiny`'s recipe (refusion/train.py RECIPES; a model in PREVIOUS
still holds the weights of the recipe before issue #37, `--recipe previous`), and
the trainer's scheduler starts each model after the one it starts from (ar alone on every thread, then two
diffusion models at a time), resumes a run by keeping the models it finished, and never starts a model
whose start model failed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from refusion import train
from refusion.train import (MODEL_NAMES, OPERATIONAL, ModelShape, TrainConfig, committed_recipe, recipe,
                            recipe_fingerprint)

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "checkpoints" / "tiny"


def recorded(name: str) -> dict:
    return json.loads((TINY / name / "train_config.json").read_text())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_committed_folder_is_the_recipe(name):
    """What decided the committed weights (every non-operational config field and the shape) is what
    `make train-tiny` runs today (or, for a model still in PREVIOUS, `make train-tiny TRAIN_ARGS='--recipe
    previous'`); a folder that records its fingerprint records that one."""
    rec = recorded(name)
    want = recipe_fingerprint(committed_recipe(name), ModelShape())
    assert recipe_fingerprint(rec["train"], rec["shape"]) == want, (
        f"{TINY / name} was not trained with the recipe of refusion/train.py: retrain it with `make train-tiny`")
    if "recipe_fingerprint" in rec:
        assert rec["recipe_fingerprint"] == want
    table = train.PREVIOUS if name in train.PREVIOUS else train.RECIPES
    assert rec["train"]["steps"] == table[name]["steps"] and rec["train"]["lr"] == table[name]["lr"]


def test_recipe_37_same_mixture_and_tokens_for_the_diffusion_models():
    """Issue #37: every diffusion model trains on one mixture; refusion, mdm and dream see the same batches
    (same steps, batch size and seed), so the same tokens; ar keeps the faithful data and is not retrained."""
    cfgs = {n: recipe(n) for n in MODEL_NAMES}
    mix = {(c.open_share, c.result_share, c.number_share) for n, c in cfgs.items() if n != "ar"}
    assert mix == {(0.2, 0.4, 0.0)}
    assert (cfgs["ar"].open_share, cfgs["ar"].result_share) == (0.0, 0.0) and "ar" not in train.PREVIOUS
    same = {(c.steps, c.batch_size, c.seed, c.kind_weights) for n, c in cfgs.items() if n in ("refusion", "mdm", "dream")}
    assert len(same) == 1
    assert cfgs["d2f"].d2f_init == "mdm" and all(train.init_of(n, cfgs[n]) == "ar" for n in ("refusion", "mdm", "dream"))


def test_fingerprint_covers_the_recipe_not_the_operational_fields():
    cfg = recipe("refusion")
    fp = recipe_fingerprint(cfg, ModelShape())
    assert fp == recipe_fingerprint(json.loads(json.dumps(cfg.__dict__)), json.loads(json.dumps(ModelShape().__dict__)))
    for field in OPERATIONAL:
        other = {**cfg.__dict__, field: 7}
        assert recipe_fingerprint(other, ModelShape()) == fp
    for field, value in (("steps", 1), ("lr", 0.5), ("result_share", 0.3), ("refusion_init", "scratch")):
        assert recipe_fingerprint({**cfg.__dict__, field: value}, ModelShape()) != fp, field
    assert recipe_fingerprint(cfg, ModelShape(hidden_size=64)) != fp
    # A recorded config that lacks a later-added field counts it as TrainConfig's default.
    old = {k: v for k, v in cfg.__dict__.items() if k != "suffix_share"}
    assert recipe_fingerprint(old, ModelShape()) == fp and TrainConfig.suffix_share == 0.0


# A stand-in for `python -m harness train-tiny` as the scheduler starts it (one model per process): it logs
# when it starts and ends and with how many threads, and fails for the model named in FAIL.
FAKE = """
import os, sys, time
args = sys.argv[1:]
name, threads = args[args.index("--models") + 1], args[args.index("--threads") + 1]
log = os.environ["LOG"]
def note(what):
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, f"{what} {name} {threads} {'--child' in args}\\n".encode())
    os.close(fd)
note("start")
time.sleep(0.3)
if name == os.environ.get("FAIL"):
    sys.exit(3)
note("end")
"""


def run_schedule(tmp_path: Path, names: list[str], fail: str = "") -> tuple[int, list[list[str]]]:
    (tmp_path / "fake_trainer.py").write_text(textwrap.dedent(FAKE))
    log = tmp_path / "log.txt"
    a = train.argparse.Namespace(threads=2, out=str(tmp_path / "out"))
    env = {"LOG": str(log), "FAIL": fail, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        rc = train._schedule(names, TrainConfig(), a, ["--steps", "5", "--threads", "2", "--models", "x"],
                             "fake_trainer")
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return rc, [line.split() for line in log.read_text().splitlines()]


def test_scheduler_starts_each_model_after_its_start_model(tmp_path, capsys):
    rc, events = run_schedule(tmp_path, list(MODEL_NAMES))
    assert rc == 0
    at = {(e[0], e[1]): i for i, e in enumerate(events)}
    assert len(events) == 10 and all(e[3] == "True" for e in events)  # each a child of the run
    for n in MODEL_NAMES:
        start = train.init_of(n, TrainConfig())
        if start in MODEL_NAMES:
            assert at[("end", start)] < at[("start", n)], (n, events)
    threads = {e[1]: int(e[2]) for e in events if e[0] == "start"}
    assert threads["ar"] == 2  # alone on the machine
    assert threads["mdm"] == threads["refusion"] == 1  # side by side, mdm first (d2f waits on it)
    # Launch order as the scheduler prints it (the children's own log lines may race each other).
    launched = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if "training on" in line]
    assert launched[:3] == ["ar", "mdm", "refusion"] and sorted(launched) == sorted(MODEL_NAMES)
    running = 0
    for e in events:  # never more processes than threads
        running += 1 if e[0] == "start" else -1
        assert running <= 2


def test_scheduler_does_not_start_what_depends_on_a_failed_model(tmp_path, capsys):
    rc, events = run_schedule(tmp_path, ["refusion", "mdm", "dream", "d2f"], fail="mdm")
    assert rc == 3
    started = {e[1] for e in events if e[0] == "start"}
    assert started == {"refusion", "mdm", "dream"} and ("end", "mdm") not in {(e[0], e[1]) for e in events}
    err = capsys.readouterr().err
    assert "training mdm failed (exit 3)" in err and "d2f was not trained" in err


def test_a_rerun_keeps_only_models_this_run_finished(tmp_path):
    """A folder is kept on rerun only with this run's marker and the same recipe in both the marker and
    train_config.json; a fresh clone (no marker) retrains everything."""
    cfg = recipe("mdm")
    fp = recipe_fingerprint(cfg, ModelShape())
    (tmp_path / "mdm").mkdir()
    conf = {"train": cfg.__dict__, "shape": ModelShape().__dict__}
    (tmp_path / "mdm" / "train_config.json").write_text(json.dumps(conf))
    assert not train._finished(tmp_path, "mdm", cfg)  # committed folder, no marker
    train._done_marker(tmp_path, "mdm").write_text(fp)
    assert train._finished(tmp_path, "mdm", cfg)
    assert not train._finished(tmp_path, "mdm", recipe("mdm", steps=3))  # another recipe asked for
    (tmp_path / "mdm" / "train_config.json").write_text(json.dumps({**conf, "train": {**cfg.__dict__, "lr": 1.0}}))
    assert not train._finished(tmp_path, "mdm", cfg)  # the folder holds other weights


def test_gitignore_keeps_state_and_markers_out():
    for path in ("checkpoints/tiny/.ar.state.pt", "checkpoints/tiny/.ar.done", "checkpoints/tiny/.snapshots/ar/x.pt"):
        r = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO)
        assert r.returncode == 0, path
