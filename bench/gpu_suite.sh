#!/usr/bin/env bash
# The benchmark suite on one H200, in parts that each fit in a 10-minute call; resumable.
#
#   SLORA_COMMIT=<sha> bash bench/gpu_suite.sh                 # every part not done yet, in order
#   SLORA_COMMIT=<sha> bash bench/gpu_suite.sh 's1-*' hf-mixed # only parts matching these patterns
#   bash bench/gpu_suite.sh --list                             # part names, estimates, and status
#
# Results: $RESULTS_DIR, else bench/results/<date>-<commit>/. Each part writes <part>.json and
# <part>.log there; a part whose JSON exists is skipped, and a part that failed leaves
# <part>.failed and is skipped too unless RETRY_FAILED=1. A call starts a part only while its
# estimate fits in what is left of SUITE_BUDGET_S (default 540 s), so one call stays under the
# 10-minute limit; call again to go on. With $OUT set, the results folder is copied into $OUT
# after every part: put those files back under the same results folder before the next call
# (the device gets a copy of the working tree, so they travel with it and count as done).
#
# Pairs whose ratio the issue asks for run one after the other: engine vs HF PEFT on the same
# fixed batch, and each workload's unified run vs its base-model run on the same trace.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}          # JAX (+ jax[cuda]) for run.py
HF_PY=${HF_PY:-python3}    # torch + transformers + peft for the HF baselines
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
commit=${SLORA_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo nogit)}
export SLORA_COMMIT=$commit
RES=${RESULTS_DIR:-bench/results/$(date +%Y%m%d)-${commit:0:7}}
BUDGET=${SUITE_BUDGET_S:-540}
SWEEP_RATE=${SWEEP_RATE:-20}   # the offered rate of the alpha and cv sweeps (req/s)
WL=${WL_SUFFIX:-}              # "-cpu": the miniatures, to try the script itself on a CPU
START=$(date +%s)
LIST=0
PATTERNS=()
for a in "$@"; do
  if [[ $a == --list ]]; then LIST=1; else PATTERNS+=("$a"); fi
done
mkdir -p "$RES"

selected() {
  (( ${#PATTERNS[@]} == 0 )) && return 0
  local p
  for p in "${PATTERNS[@]}"; do [[ $1 == $p ]] && return 0; done
  return 1
}

sync_out() {
  [[ -n ${OUT:-} ]] && mkdir -p "$OUT" && cp -r "$RES"/. "$OUT"/
  return 0
}

# part NAME ESTIMATE_S COMMAND... : the command gets `--out <file>` appended.
part() {
  local name=$1 est=$2; shift 2
  selected "$name" || return 0
  local json=$RES/$name.json
  if (( LIST )); then
    local st=todo
    [[ -f $json ]] && st=done
    [[ -f $RES/$name.failed ]] && st=failed
    printf '%-34s ~%4ss  %s\n' "$name" "$est" "$st"
    return 0
  fi
  [[ -f $json ]] && { echo "[suite] $name: done"; return 0; }
  if [[ -f $RES/$name.failed && ${RETRY_FAILED:-0} != 1 ]]; then
    echo "[suite] $name: failed before (see $RES/$name.failed); RETRY_FAILED=1 runs it again"; return 0
  fi
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if (( est > left )); then echo "[suite] $name: needs ~${est}s, ${left}s left in this call; later"; return 0; fi
  echo "[suite] $name: start (~${est}s, ${left}s left)"
  local t0=$(date +%s)
  timeout --signal=INT --kill-after=20 "$left" "$@" --out "$json.part" > "$RES/$name.log" 2>&1
  local rc=$?
  if (( rc == 0 )) && [[ -f $json.part ]]; then
    mv "$json.part" "$json"
    rm -f "$RES/$name.failed"
    echo "[suite] $name: done in $(( $(date +%s) - t0 ))s"
    grep -E '^\s+(throughput|generated|SLO|TTFT p99|completed)|tok/s' "$RES/$name.log" | head -12
  else
    # what a cut-short part saved (hf_peft.py writes its JSON after every row, marked incomplete)
    # is kept beside, not counted as done
    [[ -f $json.part ]] && mv "$json.part" "$RES/$name.partial.json"
    { echo "exit $rc after $(( $(date +%s) - t0 ))s: $*"; tail -30 "$RES/$name.log"; } > "$RES/$name.failed"
    echo "[suite] $name: FAILED (exit $rc); tail of the log:"; tail -8 "$RES/$name.log"
  fi
  sync_out
}

# attainment FILE: the run's SLO attainment (0 if unreadable).
attainment() {
  "$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["metrics"]["slo_attainment"])' "$1" 2>/dev/null || echo 0
}

if (( ! LIST )); then
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"; } \
    > "$RES/device.txt"
  "$PY" -m pip list 2>/dev/null | grep -iE "^(jax|jaxlib|flax|torch|transformers|peft|numpy) " > "$RES/versions.txt"
  echo "[suite] results in $RES, commit $commit, budget ${BUDGET}s"
fi

# Generated PEFT adapters are written once per machine and reused by every part.
ADIR=${ADAPTER_DIR:-/tmp/slora-bench-adapters}
# Every run.py first compiles all of its engine's step buckets (minutes on a 7B model; a cache load
# on a warm machine, see bench/NOTES.md). RUN_ARGS: more run.py arguments for every part, e.g.
# RUN_ARGS="--warmup-workers 8" (compiles the buckets 8 at a time).
RUN=("$PY" bench/run.py --adapter-dir "$ADIR" --no-requests ${RUN_ARGS:-})   # per-request records only
RUNR=("$PY" bench/run.py --adapter-dir "$ADIR" ${RUN_ARGS:-})                # where a TTFT CDF is drawn

# Most telling first: the headline targets, then the paper's Table 3 points, then sweeps.

# 1. Generated tok/s on one fixed batch (32 x 128 prompt + 128 new, 32 mixed rank-16 adapters):
#    the engine, then HF PEFT (b) and merged-weight swapping (c) on the same requests. Target: 50x.
part engine-fixed         300 "${RUN[@]}" --fixed-batch --mixed 0,1,8,32
part hf-mixed             480 "$HF_PY" bench/baselines/hf_peft.py --part mixed --mixed 1,8,32
part hf-merged            420 "$HF_PY" bench/baselines/hf_peft.py --part merged --merged-mixed 1,32

# 2. S1, n = 2000 (paper Table 3 at R = 10: 7.61 req/s on an A100-80GB), then the offered rate up
#    to where SLO attainment falls below 0.9. Target: >= 25 req/s at attainment >= 0.9.
part S1-unified-n2000-R10   360 "${RUNR[@]}" --workload S1$WL --n 2000 --rate 10
last_rate=10
for r in 15 20 25 30 35 40 50; do
  prev=$RES/S1-unified-n2000-R$last_rate.json
  if [[ -f $prev ]] && awk "BEGIN{exit !($(attainment "$prev") < 0.9)}"; then
    (( LIST )) || ! selected "S1-unified-n2000-R$r" || \
      echo "[suite] S1 rate sweep: attainment < 0.9 at R=$last_rate; higher rates skipped"
    break
  fi
  part "S1-unified-n2000-R$r" 330 "${RUN[@]}" --workload S1$WL --n 2000 --rate "$r" --duration-s 60
  last_rate=$r
done

# 3. S2, n = 1000 against the base model alone (a) on the same trace, at a rate that saturates
#    both (the engine, not the trace, bounds throughput). Target: >= 0.9x.
part S2-unified-n1000-R80   420 "${RUNR[@]}" --workload S2$WL --n 1000 --rate 80 --duration-s 40
part S2-base-R80            420 "${RUNR[@]}" --workload S2$WL --mode base --rate 80 --duration-s 40

# 4. The memory ablation, S4 at n = 400, R = 6 (paper, A100-80GB: unified 4.06, separate region
#    2.64, padded slots 0.17 req/s).
#    Region default 1024 pages of 16 = 32 rank-64 adapters on the 13B shape (~13 GB).
part S4-unified-n400-R6     360 "${RUNR[@]}" --workload S4$WL --n 400 --rate 6
part S4-separate-n400-R6    360 "${RUNR[@]}" --workload S4$WL --n 400 --rate 6 --mode separate \
  --baseline-size "${S4_REGION_PAGES:-1024}"
part S4-padded-n400-R6      360 "${RUNR[@]}" --workload S4$WL --n 400 --rate 6 --mode padded \
  --baseline-size "${S4_SLOTS:-32}"

# 5. The rest of Table 3 (R = 10, alpha = 1, cv = 1, 2 minutes) with base-model runs beside.
for n in 1000 100 5; do
  part "S1-unified-n$n-R10" 360 "${RUN[@]}" --workload S1$WL --n "$n" --rate 10
done
part S1-base-R10            330 "${RUN[@]}" --workload S1$WL --mode base --rate 10
for n in 1000 2000 5; do
  part "S2-unified-n$n-R10" 360 "${RUN[@]}" --workload S2$WL --n "$n" --rate 10
done
part S2-base-R10            330 "${RUN[@]}" --workload S2$WL --mode base --rate 10
part S4-unified-n1000-R6    360 "${RUN[@]}" --workload S4$WL --n 1000 --rate 6
part S4-unified-n2-R6       360 "${RUN[@]}" --workload S4$WL --n 2 --rate 6
part S4-base-R6             330 "${RUN[@]}" --workload S4$WL --mode base --rate 6

# 6. Popularity skew and burstiness: S1, n = 2000, at SWEEP_RATE, one minute each
#    (alpha = 1, cv = 1 is the rate sweep's point at that rate).
part "S1-unified-n2000-R$SWEEP_RATE" 330 "${RUN[@]}" --workload S1$WL --n 2000 --rate "$SWEEP_RATE" --duration-s 60
for a in 0.1 0.3 0.6; do
  part "S1-unified-n2000-R$SWEEP_RATE-alpha$a" 330 "${RUN[@]}" --workload S1$WL --rate "$SWEEP_RATE" \
    --alpha "$a" --duration-s 60
done
for cv in 2 4 8; do
  part "S1-unified-n2000-R$SWEEP_RATE-cv$cv" 390 "${RUN[@]}" --workload S1$WL --rate "$SWEEP_RATE" \
    --cv "$cv" --duration-s 60
done

# 7. The scheduler, S2 at n = 1000: TTFT of requests whose adapter was cold vs warm, with
#    prefetch on and off (target: prefetch hides >= 80% of the cold-load cost), then SLO attainment
#    under overload with early abort vs FCFS at cv = 1, 4, 8 (OVERLOAD_RATE: about twice what the
#    engine sustains on S2; the S2 parts above say what that is).
part S2-n1000-R$SWEEP_RATE-prefetch-on  330 "${RUN[@]}" --workload S2$WL --n 1000 --rate "$SWEEP_RATE" --duration-s 40
part S2-n1000-R$SWEEP_RATE-prefetch-off 330 "${RUN[@]}" --workload S2$WL --n 1000 --rate "$SWEEP_RATE" --duration-s 40 \
  --engine prefetch_adapters=0
OVERLOAD=${OVERLOAD_RATE:-60}
for cv in 1 4 8; do
  part "S2-n1000-R$OVERLOAD-cv$cv-abort" 330 "${RUN[@]}" --workload S2$WL --n 1000 --rate "$OVERLOAD" --cv "$cv" \
    --duration-s 30 --early-abort
  part "S2-n1000-R$OVERLOAD-cv$cv-fcfs"  330 "${RUN[@]}" --workload S2$WL --n 1000 --rate "$OVERLOAD" --cv "$cv" \
    --duration-s 30 --no-early-abort --engine admission_order=fcfs
done

# 8. Plots and the summary table, from whatever is there.
if (( ! LIST )) && selected plots; then
  "$PY" bench/plots.py "$RES" > "$RES/plots.log" 2>&1 || echo "[suite] plots failed: see $RES/plots.log"
  sync_out
fi
(( LIST )) || echo "[suite] call done in $(( $(date +%s) - START ))s; $(ls "$RES"/*.json 2>/dev/null | wc -l) JSONs in $RES"
