#!/usr/bin/env bash
# Learning curves of the five objectives continued from the committed tiny checkpoints on one shared
# training mixture (reports/curves/: the figure and JSON in the repository were made by this script).
#
#   scripts/curves_continuation.sh [runs-folder]      (default runs-exp; rerunning resumes every step)
#
# Every diffusion model continues its checkpoint in checkpoints/tiny for 1200 steps (peak lr 1e-3, 50
# warm-up steps, cosine decay) on the result mixture: 20% of math items cut open-ended after an
# intermediate result, 40% replaced by a result item (docs/tiny-models.md, Training runs), the rest as they
# are; ar, already at 95% on math, for 600 steps on the same mixture. Two models train at a time, one
# thread each (about 25 min per 1200-step model on a 2-core CPU; llada's and dream's curve points take
# 3-4 min each). The result-mixture refusion run is then continued at peak lr 5e-4 for 1200 and 1500
# more steps, dream for 1200; two more refusion runs show what else was tried: the open-ended mixture
# alone (60%) and 600 steps on a mixture with number items (20% open-ended, 20% result, 30% number). Then `make curves`
# evaluates every snapshot on the first 100 test items per kind (batch 16) and draws one figure.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-runs-exp}
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
mkdir -p "$RUNS"

run() {  # run <name> <model> [train-tiny options...]: one continuation, logged to $RUNS/<name>.log
  local name=$1 model=$2; shift 2
  "$PY" -m harness train-tiny --models "$model" --out "$RUNS/$name" --init-dir checkpoints/tiny \
    --"$model"-init "$model" --steps 1200 --lr 1e-3 --warmup 50 --threads 1 --snapshot-every 300 "$@" \
    > "$RUNS/$name.log" 2>&1
}
MIX=(--open-share 0.2 --result-share 0.4)
more() {  # more <name> <model> <run it continues> <steps>: the same mixture at peak lr 5e-4
  "$PY" -m harness train-tiny --models "$2" --out "$RUNS/$1" --init-dir "$3" --"$2"-init "$2" "${MIX[@]}" \
    --steps "$4" --lr 5e-4 --warmup 50 --threads 1 --snapshot-every 300 > "$RUNS/$1.log" 2>&1
}

{ run refusion-result refusion "${MIX[@]}"
  more refusion-result2 refusion "$RUNS/refusion-result" 1200
  more refusion-result3 refusion "$RUNS/refusion-result2" 1500
  run refusion-number refusion --open-share 0.2 --result-share 0.2 --number-share 0.3 --steps 600
  run d2f d2f "${MIX[@]}"
  run ar ar "${MIX[@]}" --steps 600; } &
{ run refusion-faith refusion --open-share 0.6
  run mdm mdm "${MIX[@]}"
  run dream dream "${MIX[@]}"
  more dream2 dream "$RUNS/dream" 1200; } &
wait

roots=()
for r in refusion-result refusion-result2 refusion-result3 refusion-number refusion-faith mdm dream dream2 d2f ar
do roots+=(--root "$RUNS/$r"); done
"$PY" -m harness curves "${roots[@]}" --batch 16 --threads 2 --out reports/curves
