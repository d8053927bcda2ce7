#!/usr/bin/env bash
# One call on the GPU machine: the test suite under the image's own packages, then the paged-engine
# benchmark on llama-7b dummy weights. Writes logs and JSON under $OUT.
#   bash bench/gpu_check.sh [tests|bench|all] [extra engine_bench.py args]
set -uo pipefail
OUT=${OUT:-/tmp/slora-out}
mkdir -p "$OUT"
part=${1:-all}; shift || true
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SLORA_ORACLE_PYTHON=python3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -m pip list 2>/dev/null | grep -iE "^(jax|jaxlib|flax|orbax-checkpoint|safetensors|torch|transformers|peft|triton|numpy) " \
  | tee "$OUT/versions.txt"
rc=0
if [[ $part == tests || $part == all ]]; then
  # float32 parity needs full-precision matmuls (XLA on GPU may otherwise use TF32).
  JAX_DEFAULT_MATMUL_PRECISION=highest python3 -m pytest -q -x -p no:cacheprovider ${TESTS:-tests} 2>&1 | tee "$OUT/pytest.log"
  rc=${PIPESTATUS[0]}
fi
if [[ $part == bench || $part == all ]]; then
  python3 bench/engine_bench.py --model llama-7b --out "$OUT/engine_bench.json" "$@" 2>&1 | grep -v '^  ' | tee "$OUT/engine_bench.log"
fi
exit $rc
