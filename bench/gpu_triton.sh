#!/usr/bin/env bash
# On the GPU machine: install jax-triton 0.3.1 from the wheel in .whl/ (no index, no deps: the image
# has jax, triton 3.6 and absl-py; the script says if one is missing) into /tmp/site, then run
#   tests:   tests/test_triton_kernels.py (the jax-triton wrappers, compiled; the interpreter class
#            too, through the image's python3 with torch) and the GPU class of tests/test_lora_kernels.py
#   parity:  tests/test_parity.py with every LLM on lora_backend="triton" (needs the oracle in python3)
#   kernels: bench/kernels.py with the triton column filled
# Full logs under $OUT; the console gets the tails.
#   bash bench/gpu_triton.sh [tests|parity|kernels|all]     (default: tests)
set -uo pipefail
OUT=${OUT:-/tmp/slora-out}
mkdir -p "$OUT"
part=${1:-tests}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl || { echo "jax-triton wheel install failed (is .whl/ carried?)"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export SLORA_ORACLE_PYTHON=python3 SLORA_TRITON_PYTHON=python3
# float32 parity needs full-precision matmuls; the Triton kernels then use IEEE float32 dots too.
export JAX_DEFAULT_MATMUL_PRECISION=highest
python3 - <<'PY' 2>&1 | tee "$OUT/triton_versions.txt"
import importlib
for m in ("jax", "jaxlib", "triton", "absl", "jax_triton", "torch"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "ok"))
    except Exception as e:  # noqa: BLE001
        print(m, "MISSING:", type(e).__name__, e)
import jax
from triton_kernels.lora import unavailable_reason
print("backend", jax.default_backend(), "| triton backend:", unavailable_reason() or "available")
PY
rc=0
if [[ $part == tests || $part == all ]]; then
  python3 -m pytest -q -rs -p no:cacheprovider tests/test_triton_kernels.py \
    tests/test_lora_kernels.py::TestLoraKernelsGPU > "$OUT/triton_pytest.log" 2>&1
  rc=$?
  grep -v "host_offloader\|^W1" "$OUT/triton_pytest.log" | tail -30
fi
if [[ $part == parity || $part == all ]]; then
  SLORA_TEST_LLM_OPTIONS='{"lora_backend": "triton"}' python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_parity.py > "$OUT/triton_parity.log" 2>&1
  prc=$?; [[ $rc == 0 ]] && rc=$prc
  grep -v "host_offloader\|^W1" "$OUT/triton_parity.log" | tail -15
fi
if [[ $part == kernels || $part == all ]]; then
  python3 bench/kernels.py --out "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
  tail -30 "$OUT/kernels.log"
fi
exit $rc
