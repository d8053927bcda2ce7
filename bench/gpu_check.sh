#!/usr/bin/env bash
# One call on the GPU machine: the test suite under the image's own packages (the GPU-only kernel
# classes included), the kernel micro-benchmark, then the paged-engine benchmark on llama-7b dummy
# weights. Full logs and JSON go under $OUT; the console gets the short version.
#   bash bench/gpu_check.sh [tests|kernels|bench|all] [extra engine_bench.py args]
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
  JAX_DEFAULT_MATMUL_PRECISION=highest python3 -m pytest -q -x -p no:cacheprovider ${TESTS:-tests} \
    > "$OUT/pytest.log" 2>&1
  rc=$?
  grep -v "host_offloader\|^W1" "$OUT/pytest.log" | tail -25
fi
if [[ $part == kernels || $part == all ]]; then
  python3 bench/kernels.py --out "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
  tail -30 "$OUT/kernels.log"
fi
if [[ $part == bench || $part == all ]]; then
  python3 bench/engine_bench.py --model llama-7b --out "$OUT/engine_bench.json" "$@" > "$OUT/engine_bench.log" 2>&1
  grep -E "^(decode|throughput)|Error|error" "$OUT/engine_bench.log" | tail -30
fi
exit $rc
