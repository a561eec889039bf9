"""scripts/slurm_table1.sh, the README's Slurm recipe, through a stand-in `sbatch` (tests/slurm_standin/sbatch:
runs each job at once and splits `--export` at commas, as Slurm does): 3 shards of the tiny models on the
embedded suite, then the merge (submitted with --dependency=afterok) and the report, which must hold every
model and task. The stand-in's own behaviour (why the old `--export=ALL,T="$T"` recipe lost all but the first
task) is checked first, in a second."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STANDIN = REPO / "tests" / "slurm_standin"
SCRIPT = REPO / "scripts" / "slurm_table1.sh"


def _env(tmp_path: Path) -> dict:
    return {**os.environ, "PATH": f"{STANDIN}{os.pathsep}{os.environ['PATH']}", "FAKE_SLURM_STATE": str(tmp_path / "state")}


def _jobs(tmp_path: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((tmp_path / "state").glob("[0-9]*.json"))]


def test_the_standin_splits_export_at_commas_as_slurm_does(tmp_path):
    job = tmp_path / "job.sh"
    job.write_text('#!/bin/bash\n#SBATCH --array=1-2\necho "T=$T M=$M task=$SLURM_ARRAY_TASK_ID"\n')
    p = subprocess.run(["sbatch", "--parsable", "--export=ALL,T=mmlu_pro,gsm8k_cot,M=a=x:ar,b=y:ar",
                        f"--output={tmp_path}/%x-%a.log", str(job)], env=_env(tmp_path), capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 0 and p.stdout.strip() == "1000", p.stderr
    assert (tmp_path / "job.sh-2.log").read_text() == "T=mmlu_pro M=a=x:ar task=2\n"
    (job_record,) = _jobs(tmp_path)
    assert job_record["ok"] and job_record["tasks"]["1"]["env"]["T"] == "mmlu_pro"


def test_the_recipe_stops_before_submitting_on_bad_settings(tmp_path):
    settings = tmp_path / "settings.sh"
    settings.write_text(f"DATA_DIR={tmp_path}/nowhere\n")
    p = subprocess.run(["bash", str(SCRIPT), str(settings)], env=_env(tmp_path), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and p.stderr.strip() == f"error: DATA_DIR={tmp_path}/nowhere is not a folder " \
        "(the benchmark data, REFUSION_DATA_DIR)", p.stderr
    assert not (tmp_path / "state").exists()


def test_a_shard_warned_of_its_time_limit_stops_cleanly_and_requeues(tmp_path):
    """Slurm's `--signal=B:USR1@120` reaches the batch shell only: the shell passes it to the harness and, once
    the harness has stopped cleanly (exit 138), requeues the job. The harness is a stand-in here (a script that
    waits for SIGUSR1 and exits as the runner does); `scontrol` is a stand-in that records its arguments."""
    fake = tmp_path / "python"
    # The stand-in's whole body is parsed before it says "started": bash reads a script line by line, and a
    # trap that runs while it parses a command substitution (`$(seq 600)`) breaks the parse (CI saw
    # "unexpected EOF while looking for matching `)'" once).
    fake.write_text("#!/bin/bash\ntrap 'echo stopped; exit 138' USR1\n"
                    "main() { echo started; for ((i = 0; i < 600; i++)); do sleep 0.1; done; exit 0; }\nmain\n")
    fake.chmod(0o755)
    (tmp_path / "bin").mkdir()
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.write_text(f'#!/bin/bash\necho "$@" > {tmp_path}/scontrol.args\n')
    scontrol.chmod(0o755)
    settings = tmp_path / "settings.sh"
    settings.write_text(f"SHARDS=2\nRUN=t\nOUT={tmp_path}/out\nPYTHON={fake}\nDATA_DIR={tmp_path}\n")
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "SLURM_ARRAY_TASK_ID": "2",
           "SLURM_JOB_ID": "4242"}
    proc = subprocess.Popen(["bash", str(SCRIPT), "--shard", str(settings)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:  # wait until the harness stand-in runs: its trap is set by then
            lines.append(line)
            if line.strip() == "started":
                break
        proc.send_signal(10)  # SIGUSR1, to the batch shell only (B:)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + rest
    assert proc.returncode == 138, out
    assert "stopped" in out and "shard 2 stopped before its time limit; requeued" in out, out
    assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "4242"]


@pytest.mark.slow
def test_the_recipe_runs_three_shards_to_a_merged_report(tmp_path):
    models = tmp_path / "models.toml"
    models.write_text('[[models]]\nname = "ar"\npreset = "ar"\n\n[[models]]\nname = "rf"\npreset = "refusion"\n')
    (tmp_path / "data").mkdir()
    out, reports = tmp_path / "out", tmp_path / "reports"
    settings = tmp_path / "settings.sh"
    settings.write_text("\n".join([
        "SHARDS=3", "TASKS=embedded_math,embedded_code,embedded_choice", f"MODELS_FILE={models}",
        f"DATA_DIR={tmp_path / 'data'}", f"OUT={out}", f"REPORTS={reports}", "RUN=t1", "LIMIT=3", "DTYPE=auto",
        'EVAL_EXTRA="--threads 1 --device cpu"', f"PYTHON={sys.executable}", 'SBATCH_ARGS="--time=00:10:00"']) + "\n")
    p = subprocess.run(["bash", str(SCRIPT), str(settings)], env=_env(tmp_path), capture_output=True, text=True,
                       timeout=1500, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "all 3 shards:" in p.stdout and "submitted: array job 1000 (3 shards of run t1" in p.stdout, p.stdout
    array, merge = _jobs(tmp_path)
    logs = out / "slurm-t1" / "logs"
    assert array["options"]["array"] == "1-3" and array["options"]["requeue"] is True
    assert array["options"]["signal"] == "B:USR1@120" and array["options"]["chdir"] == str(REPO)
    assert sorted(Path(t["log"]).name for t in array["tasks"].values()) == ["shard-1.log", "shard-2.log", "shard-3.log"]
    assert array["ok"], {k: Path(t["log"]).read_text()[-2000:] for k, t in array["tasks"].items() if t["rc"]}
    assert merge["options"]["dependency"] == "afterok:1000"
    assert merge["ok"], (logs / "merge.log").read_text()[-3000:]
    assert "3 of 3 shard(s) done" in (logs / "merge.log").read_text()
    summary = json.loads((out / "t1" / "summary.json").read_text())
    cells = {(r["model"], r["task"]): r["samples"] for r in summary["rows"]}
    assert cells == {(m, t): 3 for m in ("ar", "rf") for t in ("embedded_math", "embedded_code", "embedded_choice")}
    assert "Merged from 3 shards" in (out / "t1" / "summary.md").read_text()
    table = (reports / "t1" / "table1.md").read_text()
    assert "| ar |" in table and "| rf |" in table, table
