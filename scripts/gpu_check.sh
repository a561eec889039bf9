#!/usr/bin/env bash
# One GPU check of the slot-attention kernels (refusion/kernels.py, refusion/triton_slot_attention.py) and of
# compiled decoding (the decoder knob `compile`, refusion/decoding/compiled.py), sized to finish in under
# 8 minutes on one GPU (each stage has its own timeout; they add up to 470 s):
#   1. the CUDA correctness tests (`-m gpu` in tests/test_kernels.py: flex compiled on CUDA, float32;
#      the Triton kernel natively in float32 (<= 1e-5) and bfloat16, plus one tiny-model forward);
#   2. `make bench-kernels DEVICE=cuda`'s benchmark, trimmed to prefixes 1024 / 4096 and 1 / 8 slots (float32
#      and bfloat16, sdpa / replicated / flex / triton at Qwen3-8B shapes), which rewrites
#      results/bench_kernels.json (with the device name and the speed targets at prefix 4096, k = 8) and
#      reports/kernels.png;
#   3. end to end at the real shape (`python -m harness bench-e2e`): a Qwen3-8B-shaped model with random
#      weights in bfloat16, ar vs refusion (attn sdpa / flex / triton) on 3 prompts of 700 tokens (64 new),
#      forward milliseconds per call kind and decode tokens/s, into results/gpu_check.json ("e2e");
#   4. eager vs compiled decoding (`python -m harness bench-compile`): ar and refusion on the Qwen3-8B shape,
#      llada and fast_dllm on the LLaDA-8B shape, random weights in bfloat16, every per-layer shape and the
#      vocabulary of the 8B models but COMPILE_LAYERS (default 8) layers, so that compiling every shape bucket
#      fits the budget (COMPILE_LAYERS=0: the full 36 / 32); tokens/s eager and compiled (mode
#      "reduce-overhead": CUDA graphs), whether the tokens are equal, NFE, compilations and compile seconds,
#      into results/gpu_check.json ("compile"); decoders left when its 120 s budget is spent are recorded as
#      skipped.
# The benchmark is run as `python -m harness bench-kernels --device cuda` rather than through make, so
# a machine whose Python already has a CUDA torch is not re-set-up by `make setup`.
#
#   scripts/gpu_check.sh                  # PY=<python with a CUDA torch and triton> to choose the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PY:-}" ]]; then
  PY=python3
  [[ -x .venv/bin/python ]] && .venv/bin/python -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' \
    2>/dev/null && PY=.venv/bin/python
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
"$PY" - <<'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"error: this torch ({torch.__version__}) sees no CUDA device")
import triton
print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}", flush=True)
PYEOF
E2E_ARGS=${E2E_ARGS:-}
COMPILE_ARGS=${COMPILE_ARGS:-}
# A benchmark stage that runs out of its time says so and the check goes on (what it wrote stays); any other
# failure ends the check.
bench_stage() {
  local secs=$1 rc=0
  shift
  timeout "$secs" "$@" || rc=$?
  if [[ $rc == 124 ]]; then echo "warning: $4 stopped at its ${secs} s timeout; later stages still run"
  elif [[ $rc != 0 ]]; then exit "$rc"; fi
}
t0=$SECONDS
timeout 110 "$PY" -m pytest -q -m gpu tests/test_kernels.py -p no:cacheprovider
echo "gpu tests: $((SECONDS - t0)) s"
t1=$SECONDS
timeout 100 "$PY" -m harness bench-kernels --device cuda --prefixes 1024,4096 --slots 1,8 --repeats 10 \
  --host "${BENCH_HOST:-idle GPU, gpu_check.sh}" "$@"
echo "bench-kernels (cuda): $((SECONDS - t1)) s; total $((SECONDS - t0)) s"
"$PY" - <<'PYEOF'
import json
r = json.load(open("results/bench_kernels.json"))
print("device:", r["env"]["device_name"])
for t in r["targets"]:
    print(f"  {t['dtype']:<9} P={t['prefix']} k={t['slots']} L={t['slot_len']:<3} flex x{t['flex_speedup_vs_replicated']:.2f}"
          f"  triton x{t['triton_speedup_vs_replicated']:.2f} vs replicated; triton/flex time "
          f"{1 / t['triton_vs_flex']:.2f}  met={t['met']}")
PYEOF
t2=$SECONDS
bench_stage 100 "$PY" -m harness bench-e2e --device cuda --dtype bfloat16 --prompts 3 --prompt-len 700 --gen-length 64 \
  $E2E_ARGS
echo "bench-e2e (cuda): $((SECONDS - t2)) s; total $((SECONDS - t0)) s"
t3=$SECONDS
bench_stage 160 "$PY" -m harness bench-compile --device cuda --dtype bfloat16 --layers "${COMPILE_LAYERS:-8}" --prompts 2 \
  --prompt-len 128 --gen-length 32 --budget-s 120 $COMPILE_ARGS
echo "bench-compile (cuda): $((SECONDS - t3)) s; total $((SECONDS - t0)) s"
