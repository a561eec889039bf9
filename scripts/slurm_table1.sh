#!/bin/bash
# Table 1 on a Slurm cluster: an array of SHARDS one-GPU jobs (`harness eval --shard I/SHARDS`, one run folder
# each), then the merge and the report, submitted with --dependency=afterok on the whole array.
#
#   scripts/slurm_table1.sh [SETTINGS]        # submit (on the login node, in the repository)
#
# SETTINGS is a bash file of the assignments below (any of them; the rest keep these defaults), e.g.
#   SHARDS=32
#   DATA_DIR=/data/refusion-bench
#   MODELS_FILE=/home/me/table1_models.toml
# The lists (tasks, models) never travel through `sbatch --export` (Slurm splits its value at commas): the
# submit step writes every setting to OUT/slurm-RUN/settings.sh and each job reads that file.
#
# Each job: --chdir to this repository, REFUSION_DATA_DIR set, one log per shard (OUT/slurm-RUN/logs/
# shard-<I>.log), --requeue (a preempted or failed-node job runs again with the same --run-id and resumes:
# finished samples are kept) and --signal=B:USR1@120 (SIGUSR1 to the batch shell 120 s before the time
# limit; the shell passes it to the harness, which stops cleanly with exit 138, and then requeues the job
# with `scontrol requeue`, so it resumes where it stopped; docs/design.md "Faults"). `make shards-status OUT=... RUN=<the shard run ids>` lists each shard as done, unfinished or
# missing; the merge job prints the same when a shard is not done.
#
# Internal modes (what the submitted jobs run): --shard SETTINGS_FILE, --merge SETTINGS_FILE.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# ---- defaults (docs/reproduce-table1.md "Spread Table 1 over a cluster")
SHARDS=32
TASKS=mmlu_pro,arc_challenge_chat,gsm8k_cot,minerva_math,gpqa_main_generative_n_shot,humaneval_instruct,mbpp
MODELS_FILE=$REPO/examples/table1_models.toml
DATA_DIR=${REFUSION_DATA_DIR:-$REPO/data}
OUT=$REPO/results/table1
REPORTS=$REPO/reports
RUN=table1
LIMIT=
DTYPE=bfloat16
EVAL_EXTRA="--prompts paper --baseline qwen3"
SBATCH_ARGS="--gres=gpu:1 --cpus-per-task=8 --time=24:00:00"
MERGE_SBATCH_ARGS="--cpus-per-task=2 --time=01:00:00"
PYTHON=$REPO/.venv/bin/python

die() { echo "error: $*" >&2; exit 2; }

shard_ids() { seq -s, -f "${RUN}-shard%g" 1 "$SHARDS"; }

harness() {  # the harness as `make eval` runs it (offline), replacing this shell: signals reach it directly
    cd "$REPO"
    export REFUSION_DATA_DIR=$DATA_DIR HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
    exec "$PYTHON" -m harness "$@"
}

case "${1:-}" in
--shard)
    # shellcheck source=/dev/null
    source "$2"
    I=${SLURM_ARRAY_TASK_ID:?not inside a Slurm array job}
    echo "shard $I/$SHARDS of run $RUN on $(hostname), job ${SLURM_JOB_ID:-?}, restart ${SLURM_RESTART_COUNT:-0}"
    read -r -a extra <<< "$EVAL_EXTRA"
    # In the background, so this shell can pass Slurm's warning on and requeue the job after a clean stop.
    # The traps are set first and a signal that comes before the harness has a pid is kept and passed on
    # once it has one: a warning is never lost, however early it comes.
    pid='' pending=''
    pass_on() { if [ -n "$pid" ]; then kill "-$1" "$pid" 2> /dev/null || true; else pending=$1; fi; }
    trap 'pass_on USR1' USR1
    trap 'pass_on TERM' TERM
    (trap - USR1 TERM
     harness eval --task "$TASKS" --models-file "$MODELS_FILE" --dtype "$DTYPE" --out "$OUT" \
        ${LIMIT:+--limit "$LIMIT"} --shard "$I/$SHARDS" --run-id "$RUN-shard$I" "${extra[@]}") &
    pid=$!
    if [ -n "$pending" ]; then kill "-$pending" "$pid" 2> /dev/null || true; fi
    rc=0
    wait "$pid" || rc=$?
    while kill -0 "$pid" 2> /dev/null; do  # a trapped signal ends `wait` early: wait for the harness itself
        rc=0
        wait "$pid" || rc=$?
    done
    if [ "$rc" -eq 138 ]; then  # stopped cleanly by SIGUSR1 (the time limit is near): run again, resuming
        echo "shard $I stopped before its time limit; requeued (finished samples are kept)"
        scontrol requeue "${SLURM_JOB_ID:?}"
    fi
    exit "$rc"
    ;;
--merge)
    # shellcheck source=/dev/null
    source "$2"
    cd "$REPO"
    "$PYTHON" -m harness merge --status --run "$(shard_ids)" --runs-root "$OUT" || die "not every shard is done"
    "$PYTHON" -m harness merge --run "$(shard_ids)" --runs-root "$OUT" --run-id "$RUN"
    harness report --run "$RUN" --runs-root "$OUT" --out "$REPORTS" --name "$RUN"
    ;;
--*)
    die "unknown option $1 (usage: scripts/slurm_table1.sh [SETTINGS])"
    ;;
*)
    if [ -n "${1:-}" ]; then
        [ -f "$1" ] || die "settings file $1 does not exist"
        # shellcheck source=/dev/null
        source "$1"
    fi
    [[ $SHARDS =~ ^[1-9][0-9]*$ ]] || die "SHARDS=$SHARDS: expected a number >= 1"
    [ -d "$DATA_DIR" ] || die "DATA_DIR=$DATA_DIR is not a folder (the benchmark data, REFUSION_DATA_DIR)"
    [ -f "$MODELS_FILE" ] || die "MODELS_FILE=$MODELS_FILE does not exist"
    [ -x "$PYTHON" ] || die "PYTHON=$PYTHON is not executable (run \`make setup\` first)"
    command -v sbatch > /dev/null || die "sbatch not found: run this on a Slurm login node"
    case $OUT in /*) ;; *) OUT=$REPO/$OUT ;; esac
    case $MODELS_FILE in /*) ;; *) MODELS_FILE=$REPO/$MODELS_FILE ;; esac
    # Everything checked before anything is submitted: one shard's dry run (models file, checkpoints, tasks, data).
    JOBS=$OUT/slurm-$RUN
    mkdir -p "$JOBS/logs"
    read -r -a extra <<< "$EVAL_EXTRA"
    (cd "$REPO" && REFUSION_DATA_DIR=$DATA_DIR HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 "$PYTHON" -m harness eval \
        --dry-run --task "$TASKS" --models-file "$MODELS_FILE" --dtype "$DTYPE" --out "$OUT" ${LIMIT:+--limit "$LIMIT"} \
        --shard "1/$SHARDS" "${extra[@]}" > "$JOBS/dry-run.txt" 2>&1) \
        || { tail -n 5 "$JOBS/dry-run.txt" >&2; die "the dry run of shard 1/$SHARDS failed ($JOBS/dry-run.txt)"; }
    grep -E '^  (total|all [0-9]+ shards):' "$JOBS/dry-run.txt" || true
    SETTINGS=$JOBS/settings.sh
    declare -p SHARDS TASKS MODELS_FILE DATA_DIR OUT REPORTS RUN LIMIT DTYPE EVAL_EXTRA PYTHON > "$SETTINGS"
    read -r -a sb <<< "$SBATCH_ARGS"
    read -r -a msb <<< "$MERGE_SBATCH_ARGS"
    array=$(sbatch --parsable --array="1-$SHARDS" --job-name="$RUN" --chdir="$REPO" --requeue \
        --signal=B:USR1@120 --output="$JOBS/logs/shard-%a.log" "${sb[@]}" \
        "$REPO/scripts/slurm_table1.sh" --shard "$SETTINGS")
    array=${array%%;*}
    merge=$(sbatch --parsable --dependency="afterok:$array" --job-name="$RUN-merge" --chdir="$REPO" \
        --output="$JOBS/logs/merge.log" "${msb[@]}" "$REPO/scripts/slurm_table1.sh" --merge "$SETTINGS")
    merge=${merge%%;*}
    echo "submitted: array job $array ($SHARDS shards of run $RUN, logs in $JOBS/logs/), merge job $merge"
    echo "progress:  make shards-status OUT=$OUT RUN=$(shard_ids)"
    echo "report:    $REPORTS/$RUN/ once job $merge has finished"
    ;;
esac
