#!/usr/bin/env bash
# Groups of trace runs that share one loaded model (bench/run.py --variant): the first variant
# pays for loading and compiling, the rest reuse the compiled steps, so a 10-minute call holds
# many runs. Resumable: a variant whose JSON is in the results folder is skipped.
#
#   SLORA_COMMIT=<sha> bash bench/gpu_variants.sh s2     # issue 5's scheduler runs + issue 7's S2 ratio
#   SLORA_COMMIT=<sha> bash bench/gpu_variants.sh s1     # issue 7: S1 n=2000 offered-rate sweep
#
# Results: $RESULTS_DIR, else bench/results/<date>-<commit>/ (the folder gpu_suite.sh uses), copied
# to $OUT after the call. BUDGET_S (default 540): no variant starts that would not end in time.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
commit=${SLORA_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo nogit)}
export SLORA_COMMIT=$commit
RES=${RESULTS_DIR:-bench/results/$(date +%Y%m%d)-${commit:0:7}}
WL=${WL_SUFFIX:-}   # "-cpu": the miniatures, to try this script on a CPU
mkdir -p "$RES"
source bench/xla_cache.sh
group=${1:?usage: gpu_variants.sh s1|s2}
# RUN_ARGS: more run.py arguments for every variant, e.g.
# RUN_ARGS="--engine compile_per_layer=true --warmup-workers 8"
RUN=(python3 bench/run.py --adapter-dir "${ADAPTER_DIR:-/tmp/slora-bench-adapters}" --out-dir "$RES"
     --budget-s "${BUDGET_S:-540}" ${RUN_ARGS:-})
case $group in
  s2)
    # (run.py first compiles every step bucket of the base model and of the adapters' modules.)
    # 1-2: the paper's point (Table 3: R = 10, S-LoRA 6.69 req/s on an A100-80GB): n = 1000 and
    #      the base model alone on the same trace.
    # 3: offered well above capacity: the completed req/s is the capacity later rates are set from.
    # 4-5: prefetch on/off at half that capacity: TTFT of cold- vs warm-adapter requests (issue 5).
    # 6-11: twice the capacity, cv 1/4/8, early abort vs FCFS: SLO attainment (issue 5).
    # 12: the base model at the same overload as 3 (capacity ratio, issue 7's >= 0.9x).
    # 13: mixed steps (decode tokens in chunked-prefill steps) at half capacity, against 4.
    cap="S2-unified-n1000-R40"
    short=(--warmup-s 5 --no-requests)
    "${RUN[@]}" --workload "S2$WL" --n 1000 --duration-s 40 --max-wall-s 70 --engine min_decode_batch=16 \
      --variant "S2-unified-n1000-R10:--rate 10 --warmup-s 5" \
      --variant "S2-base-R10:--mode base --rate 10 ${short[*]}" \
      --variant "$cap:--rate 40 --duration-s 30 --max-wall-s 50 ${short[*]}" \
      --variant "S2-n1000-prefetch-on:--rate-from $cap:0.5 --duration-s 30 --warmup-s 5" \
      --variant "S2-n1000-prefetch-off:--rate-from $cap:0.5 --duration-s 30 --warmup-s 5 --engine prefetch_adapters=0" \
      --variant "S2-n1000-overload-cv1-abort:--rate-from $cap:2 --cv 1 --duration-s 20 --early-abort --max-wall-s 30 ${short[*]}" \
      --variant "S2-n1000-overload-cv1-fcfs:--rate-from $cap:2 --cv 1 --duration-s 20 --no-early-abort --engine admission_order=fcfs --max-wall-s 30 ${short[*]}" \
      --variant "S2-n1000-overload-cv4-abort:--rate-from $cap:2 --cv 4 --duration-s 20 --early-abort --max-wall-s 30 ${short[*]}" \
      --variant "S2-n1000-overload-cv4-fcfs:--rate-from $cap:2 --cv 4 --duration-s 20 --no-early-abort --engine admission_order=fcfs --max-wall-s 30 ${short[*]}" \
      --variant "S2-n1000-overload-cv8-abort:--rate-from $cap:2 --cv 8 --duration-s 20 --early-abort --max-wall-s 30 ${short[*]}" \
      --variant "S2-n1000-overload-cv8-fcfs:--rate-from $cap:2 --cv 8 --duration-s 20 --no-early-abort --engine admission_order=fcfs --max-wall-s 30 ${short[*]}" \
      --variant "S2-base-R40:--mode base --rate 40 --duration-s 30 --max-wall-s 50 ${short[*]}" \
      --variant "S2-n1000-mixed-steps:--rate-from $cap:0.5 --duration-s 30 --warmup-s 5 --engine mixed_steps=true" \
      2>&1 | grep -v "rejected:\|^W1\|^I1" | tee -a "$RES/variants-s2.log"
    ;;
  s1)
    # S1 (rank 8) at n = 2000: the offered rate up to where SLO attainment falls below 0.9 (target:
    # >= 25 req/s at >= 0.9), one minute each; the first also the paper's R = 10 point.
    "${RUN[@]}" --workload "S1$WL" --n 2000 --duration-s 60 --max-wall-s 90 --no-requests --warmup-s 5 \
      --engine min_decode_batch=16 \
      --variant "S1-unified-n2000-R10" \
      --variant "S1-unified-n2000-R25:--rate 25" \
      --variant "S1-unified-n2000-R35:--rate 35" \
      --variant "S1-base-R35:--mode base --rate 35" \
      --variant "S1-unified-n2000-R50:--rate 50" \
      2>&1 | grep -v "rejected:\|^W1\|^I1" | tee -a "$RES/variants-s1.log"
    ;;
  *) echo "unknown group $group (s1, s2)"; exit 2 ;;
esac
# $OUT brings back at most 8 files: the results folder as one archive, its log beside it.
[[ -n ${OUT:-} ]] && mkdir -p "$OUT" && tar czf "$OUT/results-$group.tgz" -C "$RES" . && \
  cp "$RES/variants-$group.log" "$OUT"/ && xla_cache_save
ls "$RES"
