# The rank-split decode kernel's settings side by side on the GPU, in one call (session 29 on):
#   1. device µs a launch of each RS_BLOCKS setting at each RS_POINTS point (tokens x adapters),
#      all settings of a point in one process (bench/ranksplit_timing.py --probe --probes kernel,
#      input sets in rotation so the rows come from HBM), each checked against the jnp reference;
#   2. its compiled tests (tests/test_ranksplit.py -k GPU, every SETTINGS form), under xdist when
#      the carried wheels have it;
#   3. RS_PROFILE: the llama-7b decode step (bench/profile_step.py, B 64 x 32 adapters, ranks
#      64/32/16/8, context 512, pallas/pallas) once with the defaults and once with each setting
#      in RS_PROFILE (JSON, space-separated), all in one process each;
#   4. RS_KERNELS: bench/kernels.py at issue 4's point (qkvo, 64 x 32, bf16 y, device time) once
#      with each --lora-blocks setting in it (JSON, space-separated).
# Everything goes under $OUT/ranksplit-check/ (logs, JSON), with a summary printed last.
#   SLORA_COMMIT=$(git rev-parse --short HEAD) bash bench/ranksplit_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/slora-out}
D=$OUT/ranksplit-check
mkdir -p "$D"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_CACHE_SAVE=${XLA_CACHE_SAVE:-0}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-rs .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site-rs
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$D/device.txt"
echo "commit ${SLORA_COMMIT:-unknown}" | tee -a "$D/device.txt"
source bench/xla_cache.sh
BLOCKS=${RS_BLOCKS:-'{}'}
for point in ${RS_POINTS:-64x32}; do
  t=${point%x*}; n=${point#*x}
  timeout "${T_RS_PROBE:-150}" python3 bench/ranksplit_timing.py --probe --probes kernel --tokens "$t" --adapters "$n" \
    --probe-blocks "$BLOCKS" --out "$D/probe-$point.json" > "$D/probe-$point.log" 2>&1
  echo "probe $point rc=$?"
done
if [[ ${RS_TESTS:-1} == 1 ]]; then
  xd=()
  python3 -c "import xdist" 2>/dev/null && xd=(-n "${PYTEST_WORKERS:-8}")
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 JAX_DEFAULT_MATMUL_PRECISION=highest timeout "${T_RS_TESTS:-200}" \
    python3 -m pytest -q -p no:cacheprovider "${xd[@]}" tests/test_ranksplit.py -k GPU > "$D/pytest.log" 2>&1
  echo "pytest rc=$?"
fi
if [[ -n ${RS_PROFILE:-} ]]; then
  i=0
  for b in '{}' $RS_PROFILE; do
    SLORA_RANKSPLIT_BLOCKS=$b timeout "${T_RS_PROFILE:-110}" python3 bench/profile_step.py --model llama-7b --batch 64 \
      --adapters 32 --ranks 64,32,16,8 --context 512 --backends pallas/pallas --steps 4 \
      --out "$D/profile-$i.json" > "$D/profile-$i.log" 2>&1
    echo "profile $i ($b) rc=$?"
    i=$((i + 1))
  done
fi
if [[ -n ${RS_KERNELS:-} ]]; then  # bench/kernels.py at issue 4's point, once a setting (JSON, space-separated)
  i=0
  for b in $RS_KERNELS; do
    timeout "${T_RS_KERNELS:-150}" python3 bench/kernels.py --skip attention --modules qkvo --tokens 64 --adapters 32 \
      --lora-variants pallas,ranksplit --y-dtype bfloat16 --device-time --lora-blocks "$b" \
      --out "$D/kernels-$i.json" > "$D/kernels-$i.log" 2>&1
    echo "kernels $i ($b) rc=$?"
    i=$((i + 1))
  done
fi
echo "=== summary"
for f in "$D"/probe-*.json; do
  [[ -f $f ]] && python3 -c "
import json, sys
r = json.load(open('$f'))
for s in r['settings']:
    print(r['tokens'], 'x', r['adapters'], s['blocks'], 'units', s['live_units'], 'us', s['probes'].get('kernel'), 'err', round(s.get('rel_err', -1), 4))"
done
grep -hE "passed|failed" "$D/pytest.log" 2>/dev/null | tail -2
for f in "$D"/profile-*.json; do
  [[ -f $f ]] && python3 -c "
import json
r = json.load(open('$f'))
for run in r['runs']:
    lk = run['by_kind'].get('lora kernel', {})
    print('$f'.rsplit('/', 1)[-1], r.get('ranksplit_blocks'), 'device ms a step',
          round(run['device_us_per_step'] / 1e3, 3), 'lora kernels ms', round(lk.get('us_per_step', 0) / 1e3, 3))"
done
for f in "$D"/kernels-*.log; do
  [[ -f $f ]] && { echo "${f##*/}"; grep -E "copy bandwidth|device time a call" "$f"; }
done
