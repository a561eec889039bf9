#!/usr/bin/env bash
# One GPU check of the slot-attention kernels (refusion/kernels.py, refusion/triton_slot_attention.py),
# sized to finish in under 13 minutes on one GPU:
#   1. the CUDA correctness tests (`-m gpu` in tests/test_kernels.py: flex compiled on CUDA, float32;
#      the Triton kernel natively in float32 (<= 1e-5) and bfloat16, plus one tiny-model forward);
#   2. `make bench-kernels DEVICE=cuda`'s benchmark (float32 and bfloat16, sdpa / replicated / flex /
#      triton at Qwen3-8B shapes), which rewrites results/bench_kernels.json (with the device name and
#      the speed targets at prefix 4096, k = 8) and reports/kernels.png;
#   3. end to end at the real shape (`python -m harness bench-e2e`): a Qwen3-8B-shaped model with random
#      weights in bfloat16, ar vs refusion (attn sdpa / flex / triton) on 8 prompts of 700 tokens,
#      forward milliseconds per call kind and decode tokens/s, into results/gpu_check.json ("e2e").
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
t0=$SECONDS
timeout 200 "$PY" -m pytest -q -m gpu tests/test_kernels.py -p no:cacheprovider
echo "gpu tests: $((SECONDS - t0)) s"
t1=$SECONDS
timeout 270 "$PY" -m harness bench-kernels --device cuda --host "${BENCH_HOST:-idle GPU, gpu_check.sh}" "$@"
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
timeout 300 "$PY" -m harness bench-e2e --device cuda --dtype bfloat16 --prompts 8 --prompt-len 700 --gen-length 128 $E2E_ARGS
echo "bench-e2e (cuda): $((SECONDS - t2)) s; total $((SECONDS - t0)) s"
