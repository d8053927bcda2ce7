#!/usr/bin/env bash
# Groups of trace runs that share one loaded model (bench/run.py --variant): the first variant
# pays for loading and compiling, the rest reuse the compiled steps, so a 10-minute call holds
# many runs. Resumable: a variant whose JSON is in the results folder is skipped.
#
#   SLORA_COMMIT=<sha> bash bench/gpu_variants.sh s2     # issue 5's scheduler runs + issue 7's S2 ratio
#   SLORA_COMMIT=<sha> bash bench/gpu_variants.sh s1     # issue 7: S1 n=2000 offered-rate sweep
#   SLORA_COMMIT=<sha> bash bench/gpu_variants.sh host   # issue 7: host time in the unified step
#   SLORA_COMMIT=<sha> bash bench/gpu_variants.sh trace  # issue 7: a device trace of S2 serving steps, unified and base
#   SLORA_COMMIT=<sha> BLOCKS_B='<json>' bash bench/gpu_variants.sh blocks  # LoRA kernel settings, same run
#   SLORA_COMMIT=<sha> bash bench/gpu_variants.sh nsweep # issue 7: S2 capacity over n = 1 ... 2000 and the base model
#   SLORA_COMMIT=<sha> bash bench/gpu_variants.sh table3-s1  # issue 7: the paper's Table 3 rows (also -s2, -s4), base beside
#   SLORA_COMMIT=<sha> bash bench/gpu_variants.sh alpha  # issue 7: S2 capacity over popularity skew alpha
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
group=${1:?usage: gpu_variants.sh s1|s2|s4|prefetch|host|capacity|trace|nsweep|table3-s1|table3-s2|table3-s4|alpha|blocks}
# RUN_ARGS: more run.py arguments for every variant, e.g. RUN_ARGS="--warmup-workers 8" (the
# first warm-up compiles every step bucket, whole-model jits: 77-88 s for S1/S2 with 8 threads).
RUN=(${PYTHON:-python3} bench/run.py --adapter-dir "${ADAPTER_DIR:-/tmp/slora-bench-adapters}" --out-dir "$RES"
     --budget-s "${BUDGET_S:-540}" ${RUN_ARGS:-})
# variants ARGS...: run.py with these arguments; its console, less XLA's log lines and the
# per-request rejections, is shown and kept in variants-<group><TAG>.log.
variants() {
  "${RUN[@]}" "$@" 2>&1 | grep --line-buffered -v "rejected:\|^W1\|^I1" | tee -a "$RES/variants-$group${TAG:-}.log"
}
# S2 at a saturating rate: 30 s traces, each run cut at 50 s, decode batches of at least 16 rows.
S2_SAT=(--workload "S2$WL" --duration-s 30 --max-wall-s 50 --engine min_decode_batch=16)
case $group in
  s2)
    # (run.py first compiles every step bucket of the base model and of the adapters' modules.)
    # 1-2: capacity: n = 1000 and the base model alone offered 40 req/s, well above what either
    #      serves; completed req/s is the capacity (issue 7's >= 0.9x is 1 / 2). Later rates are
    #      set from 1.
    #      (The engine's default whole-model jit: session 8 measured it 17% faster with adapters
    #      and 13% without than one decoder layer a jit, 19.1 / 26.0 req/s against 16.3 / 23.0.
    #      Pass RUN_ARGS="--warmup-workers 8": the first warm-up compiles 44 buckets, 77-88 s.)
    # 2a-2b: the same two without overlap_steps (on by default on a GPU since session 6: step n+1
    #      is dispatched before step n's tokens come back; its own warm-up: other step inputs).
    # 3-4: the same with decode LoRA through the one-hot path always ("xla", the default before
    #      session 4) and the kernel always ("pallas"); the default is "hybrid" (the kernel past 32
    #      distinct adapters): at S2's mixed ranks the one-hot path gathers every slot at rank 64.
    # 5-6: the paper's point (Table 3: R = 10, S-LoRA 6.69 req/s on an A100-80GB), and the base.
    # 7-8: prefetch on/off at 0.9x the capacity: TTFT of cold- vs warm-adapter requests (issue 5).
    #      (At half the capacity, session 5, nothing ever waited: every admission loaded its adapter
    #      at once, prefetch hits 0 of 196, and cold TTFT equalled warm with prefetch off too.
    #      A prefetch can only hit where requests queue.) Then the same pair with a host cache of
    #      16 adapters: cold adapters come from disk, a load costs milliseconds more, and what a
    #      prefetch hides shows (pool.adapter_disk_loads counts them).
    # 9-14: four times the capacity, cv 1/4/8, early abort vs FCFS: SLO attainment (issue 5).
    #      (At twice the capacity for 20 s every first token still came within 6 s: admission
    #      grows the batch and decode slows, so nothing separates the policies there.)
    # 15: mixed steps (decode tokens in chunked-prefill steps) at 0.9x capacity, against 7.
    # (Run order: 1, 2, 2a, 2b, 7-8 and their disk pair, 9-14, 15, then 5-6 and 3-4, which session 5
    # measured already.)
    cap="S2-unified-n1000-R40"
    short=(--warmup-s 5 --no-requests)
    variants "${S2_SAT[@]}" --n 1000 \
      --variant "$cap:--rate 40 ${short[*]}" \
      --variant "S2-base-R40:--mode base --rate 40 ${short[*]}" \
      --variant "S2-unified-n1000-R40-no-overlap:--rate 40 ${short[*]} --engine overlap_steps=false" \
      --variant "S2-base-R40-no-overlap:--mode base --rate 40 ${short[*]} --engine overlap_steps=false" \
      --variant "S2-n1000-prefetch-on-0.9:--rate-from $cap:0.9 --warmup-s 5" \
      --variant "S2-n1000-prefetch-off-0.9:--rate-from $cap:0.9 --warmup-s 5 --engine prefetch_adapters=0" \
      --variant "S2-n1000-prefetch-on-0.9-disk:--rate-from $cap:0.9 --warmup-s 5 --engine host_cache_size=16" \
      --variant "S2-n1000-prefetch-off-0.9-disk:--rate-from $cap:0.9 --warmup-s 5 --engine prefetch_adapters=0 --engine host_cache_size=16" \
      --variant "S2-n1000-overload-cv1-abort:--rate-from $cap:4 --cv 1 --duration-s 20 --early-abort --max-wall-s 30 ${short[*]}" \
      --variant "S2-n1000-overload-cv1-fcfs:--rate-from $cap:4 --cv 1 --duration-s 20 --no-early-abort --engine admission_order=fcfs --max-wall-s 30 ${short[*]}" \
      --variant "S2-n1000-overload-cv4-abort:--rate-from $cap:4 --cv 4 --duration-s 20 --early-abort --max-wall-s 30 ${short[*]}" \
      --variant "S2-n1000-overload-cv4-fcfs:--rate-from $cap:4 --cv 4 --duration-s 20 --no-early-abort --engine admission_order=fcfs --max-wall-s 30 ${short[*]}" \
      --variant "S2-n1000-overload-cv8-abort:--rate-from $cap:4 --cv 8 --duration-s 20 --early-abort --max-wall-s 30 ${short[*]}" \
      --variant "S2-n1000-overload-cv8-fcfs:--rate-from $cap:4 --cv 8 --duration-s 20 --no-early-abort --engine admission_order=fcfs --max-wall-s 30 ${short[*]}" \
      --variant "S2-n1000-mixed-steps-0.9:--rate-from $cap:0.9 --warmup-s 5 --engine mixed_steps=true" \
      --variant "S2-unified-n1000-R40-xla:--rate 40 ${short[*]} --engine lora_backend=xla" \
      --variant "S2-unified-n1000-R40-pallas:--rate 40 ${short[*]} --engine lora_backend=pallas" \
      --variant "S2-unified-n1000-R10:--rate 10 --duration-s 40 --max-wall-s 70 --warmup-s 5" \
      --variant "S2-base-R10:--mode base --rate 10 --duration-s 40 --max-wall-s 70 ${short[*]}"
    ;;
  host)
    # Issue 7: what S2's unified steps spend beyond the base model's. 1-2: capacity pair;
    # 3-4: the same with prefill_delay_factor=4 (new prompts wait ~4 prefill-step lengths while
    # requests decode: at S2's capacity the batch sits at max_num_seqs and each freed slot started
    # a prefill step of ~1.6 prompts, 608 of them in 45 s at 22.3 ms, each paying every weight read
    # and, with adapters, ~5.6 ms of LoRA launches; the mock-device simulation of this trace
    # (session 12) puts both engines 5-7% up); 5: prefill LoRA through the one-hot path (xla)
    # instead of the kernels (the kernels were chosen for prefill for their single slot bucket,
    # never timed against it); 6: async_results_copy (each step's results start their copy to the
    # host at dispatch). ~500 s with a cold cache.
    short=(--warmup-s 5 --no-requests --rate 40)
    variants "${S2_SAT[@]}" --n 1000 \
      --variant "S2-unified-n1000-R40:${short[*]}" \
      --variant "S2-base-R40:--mode base ${short[*]}" \
      --variant "S2-unified-n1000-R40-delay4:${short[*]} --engine prefill_delay_factor=4" \
      --variant "S2-base-R40-delay4:--mode base ${short[*]} --engine prefill_delay_factor=4" \
      --variant "S2-unified-n1000-R40-prefill-xla:${short[*]} --engine prefill_lora_backend=xla" \
      --variant "S2-unified-n1000-R40-async-copy:${short[*]} --engine async_results_copy=true"
    ;;
  prefetch)
    # Issue 5: how much of the cold-adapter cost a prefetch hides (bench/prefetch_report.py reads
    # the folder afterwards: per request, TTFT over the in-memory reference's, on against off).
    # S2, n = 1000 over 16 weight files per rank (64 files, ~4 GB), the engine's default jit.
    # Session 8 (22 req/s, host cache 8): from host memory a cold adapter cost nothing visible,
    # on or off; from disk the reads outran what 4 stage threads managed (~9 a second for the
    # ~15 asked), and prefetch hid 51% (mean) / 77% (median). So the rate here is one the disk
    # path can keep up with (~0.57 reads a request at a cache of 8 of 64 files: ~7 a second at 12).
    # Session 9 (12 and 16 req/s): prefetch hid 81% (mean) / 85% (median) at 12 with 4 stage
    # threads and 88% / 91% with 8, now the default on a host of 16+ cores.
    # 1-2: the references at both rates: prefetch on, every file in the host cache (S-LoRA's
    #      setting). They run first: a run after a host-cache-8 variant starts with 8 files cached
    #      and re-reads the rest from disk (session 9's R 16 reference read 18 files).
    # 3-4: a host cache of 8 files, prefetch on (reads start on arrival) and off (the step loop
    #      reads at admission).
    # 5: as 3 with 4 stage threads (the default before session 9).
    # 6-7: 3-4 at the second rate.
    r=${PREFETCH_RATE:-12}; r2=${PREFETCH_RATE2:-16}
    variants --workload "S2$WL" --n 1000 --distinct-files 16 --duration-s 30 \
      --max-wall-s 50 --warmup-s 5 --engine min_decode_batch=16 \
      --variant "S2-n1000-f16-prefetch-on-R$r:--rate $r" \
      --variant "S2-n1000-f16-prefetch-on-R$r2:--rate $r2" \
      --variant "S2-n1000-f16-prefetch-on-R$r-disk:--rate $r --engine host_cache_size=8" \
      --variant "S2-n1000-f16-prefetch-off-R$r-disk:--rate $r --engine prefetch_adapters=0 --engine host_cache_size=8" \
      --variant "S2-n1000-f16-prefetch-on-R$r-disk-w4:--rate $r --engine host_cache_size=8 --engine stage_workers=4" \
      --variant "S2-n1000-f16-prefetch-on-R$r2-disk:--rate $r2 --engine host_cache_size=8" \
      --variant "S2-n1000-f16-prefetch-off-R$r2-disk:--rate $r2 --engine prefetch_adapters=0 --engine host_cache_size=8"
    python3 bench/prefetch_report.py "$RES" --out "$RES/prefetch_report.json" | tee -a "$RES/variants-prefetch.log"
    ;;
  s4)
    # Issue 7's memory ablation, S4 (ranks 64, 32) at n = 400, R = 6 (paper, A100-80GB: unified
    # 4.06 req/s, separate region 2.64, padded batched matmul 0.17): the unified pool, then a
    # reserved adapter region (e) of S4_REGION_PAGES, then the base model. Padded slots (d) need a
    # run of their own (their engine has a fixed slot bucket): gpu_suite.sh S4-padded-n400-R6.
    variants --workload "S4$WL" --n 400 --rate 6 --duration-s 60 --max-wall-s 90 --warmup-s 5 \
      --variant "S4-unified-n400-R6" \
      --variant "S4-separate-n400-R6:--mode separate --adapter-region-pages ${S4_REGION_PAGES:-1024}" \
      --variant "S4-base-R6:--mode base --no-requests"
    ;;
  s1)
    # S1 (rank 8) at n = 2000: the offered rate up to where SLO attainment falls below 0.9 (target:
    # >= 25 req/s at >= 0.9), one minute each; the first also the paper's R = 10 point. Session 4:
    # attainment 1.00 at 10, 0.70 at 25, so 15 and 20 come next; the base model at 25 beside it.
    # Session 5 (hybrid decode LoRA): 1.00 at 20, 0.864 at 25. Session 6, overlap_steps (now the
    # GPU default): 0.883 at 25.
    variants --workload "S1$WL" --n 2000 --duration-s 60 --max-wall-s 90 --no-requests --warmup-s 5 \
      --engine min_decode_batch=16 \
      --variant "S1-unified-n2000-R25:--rate 25" \
      --variant "S1-unified-n2000-R30:--rate 30" \
      --variant "S1-unified-n2000-R20:--rate 20" \
      --variant "S1-unified-n2000-R10" \
      --variant "S1-unified-n2000-R15:--rate 15" \
      --variant "S1-base-R25:--mode base --rate 25" \
      --variant "S1-unified-n2000-R35:--rate 35"
    ;;
  capacity)
    # The S2 capacity pair alone (unified, base), its variant names tagged with TAG: for a pair
    # under other XLA_FLAGS, which need a process of their own (e.g. TAG=-concurrent with
    # XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT). ~200 s with a cold cache.
    short=(--warmup-s 5 --no-requests --rate 40)
    variants "${S2_SAT[@]}" --n 1000 \
      --variant "S2-unified-n1000-R40${TAG:-}:${short[*]}" \
      --variant "S2-base-R40${TAG:-}:--mode base ${short[*]}"
    ;;
  trace)
    # The S2 capacity pair with a device trace of 40 serving steps from 15 s on (~12 of them
    # prefill steps): where the unified engine's prefill steps spend ~7 ms more than the base
    # model's in serving (session 16: 23.9 against 16.8 ms) when a bare profile shows ~2.9.
    # pool.serving_trace: kernels summed a step, the device's idle time by host phase, and the
    # device tracks (by_stream: adapter rows' host->device copies, if they run off the compute
    # stream, show there). The trace slows the traced steps; compare the two variants, not the
    # untraced runs.
    short=(--warmup-s 5 --no-requests --rate 40 --trace-steps 40 --trace-after-s 15)
    variants "${S2_SAT[@]}" --n 1000 \
      --variant "S2-unified-n1000-R40-traced${TAG:-}:${short[*]}" \
      --variant "S2-base-R40-traced${TAG:-}:--mode base ${short[*]}"
    ;;
  nsweep)
    # Issue 7's sweep over n at a saturating rate: S2's capacity with n = 1 ... 2000 adapters and the
    # base model alone, one process (one compile). Throughput against n, each ratio to the base model
    # from the same call; bench/plots.py draws throughput_vs_n.png with the base model as a line.
    # ~55 s a variant after ~150 s of load and compile.
    short=(--warmup-s 5 --no-requests --rate 40)
    variants "${S2_SAT[@]}" --n 2000 \
      --variant "S2-unified-n1000-R40${TAG:-}:--n 1000 ${short[*]}" \
      --variant "S2-base-R40${TAG:-}:--mode base ${short[*]}" \
      --variant "S2-unified-n1-R40${TAG:-}:--n 1 ${short[*]}" \
      --variant "S2-unified-n10-R40${TAG:-}:--n 10 ${short[*]}" \
      --variant "S2-unified-n100-R40${TAG:-}:--n 100 ${short[*]}" \
      --variant "S2-unified-n2000-R40${TAG:-}:--n 2000 ${short[*]}" \
      --variant "S2-unified-n5-R40${TAG:-}:--n 5 ${short[*]}"
    ;;
  table3-s1|table3-s2|table3-s4)
    # The rest of the paper's Table 3 (S-LoRA on an A100-80GB at R = 10, S4 at R = 6; alpha 1,
    # cv 1) with the base model on the same trace, one process a workload. T3_DURATION_S (default
    # 40) s traces instead of the paper's 120 s, so that a workload fits one call (~65 s a variant
    # after ~100 s of load and compile); the table's earlier rows (S1 n = 2000, S2 n = 1000) came
    # from 40-120 s traces.
    t3=${T3_DURATION_S:-40}
    short=(--duration-s "$t3" --max-wall-s $((t3 + 20)) --warmup-s 5 --no-requests)
    case $group in
      table3-s1) variants --workload "S1$WL" --n 1000 --rate 10 "${short[@]}" \
        --variant "S1-unified-n5-R10-t3:--n 5" --variant "S1-unified-n100-R10-t3:--n 100" \
        --variant "S1-unified-n1000-R10-t3:--n 1000" --variant "S1-base-R10-t3:--mode base" ;;
      table3-s2) variants --workload "S2$WL" --n 2000 --rate 10 "${short[@]}" \
        --variant "S2-unified-n5-R10-t3:--n 5" --variant "S2-unified-n2000-R10-t3:--n 2000" \
        --variant "S2-base-R10-t3:--mode base" ;;
      table3-s4) variants --workload "S4$WL" --n 1000 --rate 6 "${short[@]}" \
        --variant "S4-unified-n2-R6-t3:--n 2" --variant "S4-unified-n1000-R6-t3:--n 1000" \
        --variant "S4-base-R6-t3:--mode base" ;;
    esac
    ;;
  alpha)
    # Popularity skew at S2's saturation (n = 1000, 40 req/s offered, 30 s): alpha below 1 puts
    # most requests on the first adapters (int(n * power(alpha))), so a decode step reads fewer
    # distinct adapters; alpha 1 (uniform) is the nsweep group's point. ~55 s a variant.
    variants "${S2_SAT[@]}" --n 1000 --rate 40 --warmup-s 5 --no-requests \
      --variant "S2-unified-n1000-R40-alpha0.1:--alpha 0.1" \
      --variant "S2-unified-n1000-R40-alpha0.3:--alpha 0.3" \
      --variant "S2-unified-n1000-R40-alpha0.6:--alpha 0.6" \
      --variant "S2-unified-n1000-R40-alpha1:--alpha 1" \
      --variant "S2-base-R40-alpha1:--mode base"
    ;;
  blocks)
    # Two LoRA kernel settings side by side in S2's capacity run: the defaults, the base model,
    # then BLOCKS_B (JSON merged into pallas_kernels.lora.BLOCKS for that variant alone, run.py
    # --lora-blocks; its engine recompiles every bucket first, ~90 s with 8 warm-up threads).
    # Session 15's case: prefill split-K won in a profile and lost in a serving run of its own.
    b=${BLOCKS_B:-'{"shrink":{"split_k_max_tokens":1024}}'}
    short=(--warmup-s 5 --no-requests --rate 40)
    variants "${S2_SAT[@]}" --n 1000 \
      --variant "S2-unified-n1000-R40:${short[*]}" \
      --variant "S2-base-R40:--mode base ${short[*]}" \
      --variant "S2-unified-n1000-R40-blocks-b:${short[*]} --lora-blocks '$b'"
    ;;
  *) echo "unknown group $group (s1, s2, s4, prefetch, host, capacity, trace, nsweep, table3-s1, table3-s2, table3-s4, alpha, blocks)"; exit 2 ;;
esac
# $OUT brings back at most 8 files: the results folder as one archive, its log beside it.
[[ -n ${OUT:-} ]] && mkdir -p "$OUT" && tar czf "$OUT/results-$group.tgz" -C "$RES" . && \
  cp "$RES"/variants-"$group"*.log "$OUT"/ && xla_cache_save
ls "$RES"
