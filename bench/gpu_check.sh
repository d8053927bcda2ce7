#!/usr/bin/env bash
# One call on the GPU machine: the test suite under the image's own packages (the GPU-only kernel
# classes included), the kernel micro-benchmark, then the paged-engine benchmark on llama-7b dummy
# weights. Full logs and JSON go under $OUT; the console gets the short version. Each part runs
# under its own time limit (T_TESTS, T_KERNELS, T_BENCH seconds), so one slow part cannot take
# the others' results with it.
#   bash bench/gpu_check.sh [tests|kernels|bench|profile|compile|sweep|mgpu|onetrip|onetrip_profile|onetrip_sweep|ranksplit|dispatch|ncu|ncustep|all|comma list] [extra engine_bench.py args]
# (profile: bench/profile_step.py, a device trace of decode steps summed by kernel; compile:
# bench/warmup_time.py, the start-up compile cost per layer and whole; sweep: LoRA kernel block
# settings through bench/kernels.py --lora-blocks; mgpu: the Mosaic GPU decode pair's tests, issue 4's
# point and the S2 decode profile with it; onetrip: the one-trip decode pair's tests, issue 4's point
# and its neighbours; onetrip_profile: the S2 decode step with it off and on; onetrip_sweep: its
# settings at that point; ranksplit: the rank-split decode kernel's tests, issue 4's point and
# its settings; dispatch: bench/graph_dispatch.py under CUDA-graph
# concurrency; ncu: the LoRA pair's hardware counters (bench/ncu_lora.py under Nsight Compute);
# ncustep: the same for the LoRA kernels of a llama-7b decode step (profile_step.py); none of these
# is in "all")
set -uo pipefail
OUT=${OUT:-/tmp/slora-out}
mkdir -p "$OUT"
parts=${1:-all}; shift || true
[[ $parts == all ]] && parts=tests,kernels,bench
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 SLORA_ORACLE_PYTHON=python3
export SLORA_COMMIT=${SLORA_COMMIT:-unknown}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -m pip list 2>/dev/null | grep -iE "^(jax|jaxlib|flax|orbax-checkpoint|safetensors|torch|transformers|peft|triton|jax-triton|numpy) " \
  | tee "$OUT/versions.txt"
source bench/xla_cache.sh
# jax-triton (the Triton LoRA twins and their tests) from the carried wheel when the image lacks it.
if ! python3 -c "import jax_triton" 2>/dev/null && compgen -G ".whl/jax_triton*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-jt .whl/jax_triton*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site-jt
fi
rc=0
has() { [[ ",$parts," == *",$1,"* ]]; }
if has tests; then
  # float32 parity needs full-precision matmuls (XLA on GPU may otherwise use TF32).
  # PYTEST_WORKERS=N: N pytest-xdist workers (GPU pytest is compile-bound, one CPU core each), each
  # capped at a tenth of the GPU's memory; xdist comes from wheels in .whl/ if the image lacks it.
  xdist=()
  if [[ -n ${PYTEST_WORKERS:-} ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target /tmp/site-xdist .whl/*.whl  # jax-triton too: the Triton tests run
    # The parity LLMs take a tenth of a worker's slice for their pool. Each LLM sizes its pool
    # from the memory still free, and a parity module keeps one LLM per model alive while its
    # configuration tests build more; until session 11 those were built without these options
    # (85% of what was left): 16 (session 10) and 10 (session 11) parity tests ran out of memory in
    # jit_forward_sample (1.75-5.94 GiB), the kernel and engine tests passing beside them. The
    # tiny models need a few MiB of pool.
    xdist=(env PYTHONPATH=$PYTHONPATH:/tmp/site-xdist XLA_PYTHON_CLIENT_PREALLOCATE=false
           XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 SLORA_TEST_LLM_OPTIONS=${SLORA_TEST_LLM_OPTIONS:-'{"memory_fraction": 0.1}'})
  fi
  JAX_DEFAULT_MATMUL_PRECISION=highest "${xdist[@]}" timeout "${T_TESTS:-300}" python3 -m pytest -q -p no:cacheprovider \
    ${PYTEST_WORKERS:+-n "$PYTEST_WORKERS"} --durations=15 ${TESTS:-tests} > "$OUT/pytest.log" 2>&1
  rc=$?
  echo "pytest rc=$rc"
  grep -v "host_offloader\|^W1" "$OUT/pytest.log" | grep -E "passed|failed|error|FAILED|ERROR" | tail -25
fi
if has kernels; then
  timeout "${T_KERNELS:-240}" python3 bench/kernels.py --device-time --out "$OUT/kernels.json" ${KERNEL_ARGS:-} > "$OUT/kernels.log" 2>&1
  echo "kernels rc=$?"
  tail -40 "$OUT/kernels.log"
fi
if has bench; then
  timeout "${T_BENCH:-400}" python3 bench/engine_bench.py --model llama-7b --out "$OUT/engine_bench.json" "$@" \
    > "$OUT/engine_bench.log" 2>&1
  echo "engine_bench rc=$?"
  grep -E "^(decode|throughput)|Error|error" "$OUT/engine_bench.log" | tail -40
fi
if has compile; then
  # Start-up cost: every step bucket of an S2-sized llama-7b engine, one decoder layer per bucket,
  # then the whole unrolled model (bench/warmup_time.py; the persistent cache is off there).
  for pl in ${COMPILE_MODES:-1 0}; do
    env -u JAX_COMPILATION_CACHE_DIR timeout "${T_COMPILE:-280}" python3 bench/warmup_time.py --model llama-7b --per-layer $pl \
      --out "$OUT/warmup_time-per_layer$pl.json" > "$OUT/warmup_time-per_layer$pl.log" 2>&1
    echo "warmup_time per_layer=$pl rc=$?"
    grep -E '"(shapes|warmup_s|compiles_after_warmup)"' "$OUT/warmup_time-per_layer$pl.log"
  done
fi
if has sweep; then
  # LoRA kernel block settings (issue 4's bandwidth target), one kernels.py run each on the
  # decode shapes, H->H module, with device time; one JSON line per setting in sweep.jsonl.
  # SWEEP_BLOCKS: the list; SWEEP_VARIANTS: the kernel forms timed (default pallas; fused: the
  # one-launch kernel, e.g. SWEEP_BLOCKS='{"fused":{"n_split":1}} {"fused":{"n_split":4}}').
  sweep_blocks=${SWEEP_BLOCKS:-'{} {"expand":{"col_tile":512}} {"expand":{"rank_tile":64,"col_tile":256}} {"expand":{"col_tile":512,"num_warps":8}} {"expand":{"y_first":true}} {"shrink":{"rank_tile":64}} {"shrink":{"col_tile":512}} {"shrink":{"static_split":true}} {"shrink":{"num_stages":3}} {"shrink":{"rank_tile":32,"num_warps":8}}'}
  # SWEEP_REPEATS=n: the whole list n times, interleaved (A B C A B C): one run a setting carried
  # +-15-30% of noise between calls in session 9, more than most settings' effects.
  : > "$OUT/sweep.jsonl"
  for cfg in $(for _ in $(seq "${SWEEP_REPEATS:-1}"); do echo $sweep_blocks; done); do
    timeout "${T_SWEEP:-90}" python3 bench/kernels.py --skip attention --modules "${SWEEP_MODULES:-qkvo}" \
      --tokens "${SWEEP_TOKENS:-64,256}" --adapters "${SWEEP_ADAPTERS:-32,256}" --lora-variants "${SWEEP_VARIANTS:-pallas}" --lora-blocks "$cfg" --device-time ${SWEEP_ARGS:-} \
      --out /tmp/sweep.json >> "$OUT/sweep.log" 2>&1
    echo "sweep $cfg rc=$?"
    [[ -f /tmp/sweep.json ]] && python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))))' \
      /tmp/sweep.json >> "$OUT/sweep.jsonl" && rm -f /tmp/sweep.json
  done
  grep -E "^(qkvo|gate_up|down) |device time" "$OUT/sweep.log" | tail -40
fi
if has profile; then
  # PROFILE_BLOCKS: LoRA kernel settings (JSON merged into pallas_kernels.lora.BLOCKS through
  # SLORA_LORA_BLOCKS), one profile each, in one call: profile_step.json for the first (or the
  # defaults), profile_step-<i>.json for setting i > 0. PROFILE_PREFILL=N:L: packed prefill steps
  # of N prompts of L tokens instead of decode steps (profile_step --prefill); PROFILE_CONTEXT:
  # the decode rows' context (default 512). PROFILE_HLO=<regex>: the first setting's run also dumps
  # forward_sample's optimized HLO; hlo.json counts its entry instructions by kind and holds the
  # fused computations of those named like the regex (bench/hlo_commands.py).
  i=0
  for cfg in ${PROFILE_BLOCKS:-'{}'}; do
    tag=$([[ $i == 0 ]] && echo "" || echo "-$i")
    dump=""
    [[ $i == 0 && -n ${PROFILE_HLO:-} ]] && dump="--xla_dump_to=/tmp/slora-hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=forward_sample"
    flags="${XLA_FLAGS:-} $dump"; flags=${flags# }; flags=${flags% }  # XLA reads a blank value as a file name
    XLA_FLAGS=$flags SLORA_LORA_BLOCKS=$cfg timeout "${T_PROFILE:-240}" python3 bench/profile_step.py --model llama-7b --batch "${PROFILE_BATCH:-64}" \
      --adapters "${PROFILE_ADAPTERS:-32}" ${PROFILE_RANKS:+--ranks "$PROFILE_RANKS"} ${PROFILE_PREFILL:+--prefill "$PROFILE_PREFILL"} ${PROFILE_CONTEXT:+--context "$PROFILE_CONTEXT"} --backends "${PROFILE_BACKENDS:-xla/xla,pallas/pallas,triton/pallas}" --out "$OUT/profile_step$tag.json" \
      > "$OUT/profile_step$tag.log" 2>&1
    echo "profile_step $cfg rc=$?"
    if [[ -n $dump ]]; then
      python3 bench/hlo_commands.py /tmp/slora-hlo --show "$PROFILE_HLO" --limit "${PROFILE_HLO_LIMIT:-3}" > "$OUT/hlo.json"
      rm -rf /tmp/slora-hlo
    fi
    rm -rf /tmp/slora-prof-* /tmp/slora-trace-*  # a run killed by timeout leaves ~14 GB of adapters
    grep -v "^W1\|^I1" "$OUT/profile_step$tag.log" | grep -iE "lora|device|kernels" | tail -12
    i=$((i + 1))
  done
  grep -v "^W1\|^I1" "$OUT/profile_step.log" | tail -60
fi
if has mgpu; then
  # The Mosaic GPU decode pair (pallas_kernels/lora_mgpu.py, BLOCKS["mgpu"], session 16) in one
  # call: its compiled tests (-vv names a failure as it happens), issue 4's point through the
  # sweep part with each MGPU_BLOCKS setting against the defaults, then the S2 decode profile
  # with the first setting against the defaults. Each under its own limit; logs under $OUT/mgpu-*.
  mb=${MGPU_BLOCKS:-'{"mgpu":{"decode":true}} {"mgpu":{"decode":true,"per_slot":false}} {"mgpu":{"decode":true,"shrink_rows":4}} {"mgpu":{"decode":true,"col_tile":1024}}'}
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout "${T_MGPU_TESTS:-150}" python3 -m pytest -q -p no:cacheprovider -vv --tb=short \
    tests/test_lora_kernels.py tests/test_engine.py -k mgpu > "$OUT/mgpu-pytest.log" 2>&1
  echo "mgpu pytest rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/mgpu-pytest.log" | tail -20
  # the sweep and profile parts of this script, in folders of their own
  OUT=$OUT/mgpu-sweep SWEEP_MODULES=qkvo SWEEP_TOKENS=${MGPU_TOKENS:-64,256} SWEEP_ADAPTERS=${MGPU_ADAPTERS:-32,256} \
    SWEEP_VARIANTS=pallas T_SWEEP=${T_MGPU_SWEEP:-60} SWEEP_BLOCKS="{} $mb" PACK=0 XLA_CACHE_SAVE=0 bash "$0" sweep
  OUT=$OUT/mgpu-profile PROFILE_BATCH=172 PROFILE_CONTEXT=430 PROFILE_ADAPTERS=156 PROFILE_RANKS=64,32,16,8 \
    PROFILE_BACKENDS=hybrid/pallas/grouped T_PROFILE=${T_MGPU_PROFILE:-100} PROFILE_BLOCKS="{} ${mb%% *}" PACK=0 \
    XLA_CACHE_SAVE=0 bash "$0" profile
fi
if has onetrip; then
  # The one-trip decode pair (pallas_kernels/onetrip.py, BLOCKS["onetrip"], session 25) in one call:
  # its compiled tests and the oracle parity through LLM with it on; issue 4's point (qkvo, 64 x
  # 32) and its neighbours with lora.py's pair beside it and the read floor (the S2 decode step's
  # profile is the part onetrip_profile, its settings sweep onetrip_sweep). Logs and JSON are
  # packed into $OUT/onetrip.tgz at the end (a call returns at most 8 files); the console has the
  # figures. The one-launch form first, alone and briefly: if its programs did not start in index
  # order it would hang (then it is left out of what follows; onetrip_sweep tries its ticket form).
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout "${T_OT_ONE:-90}" python3 -m pytest -q -p no:cacheprovider --tb=short \
    tests/test_onetrip.py -k "GPU and one_launch" > "$OUT/onetrip-one-launch.log" 2>&1
  one=$?; echo "onetrip one-launch pytest rc=$one"; grep -E "passed|failed|FAILED" "$OUT/onetrip-one-launch.log" | tail -4
  ot_variants=${OT_VARIANTS:-$([[ $one == 0 ]] && echo pallas,onetrip,onetrip1 || echo pallas,onetrip)}
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout "${T_OT_TESTS:-180}" python3 -m pytest -q -p no:cacheprovider --tb=short \
    tests/test_onetrip.py tests/test_parity.py -k "(onetrip or Onetrip) and not one_launch" > "$OUT/onetrip-pytest.log" 2>&1
  echo "onetrip pytest rc=$?"; grep -E "passed|failed|FAILED|ERROR" "$OUT/onetrip-pytest.log" | tail -8
  timeout "${T_OT_KERNELS:-200}" python3 bench/kernels.py --skip attention --modules qkvo --tokens "${OT_TOKENS:-64,256}" \
    --adapters "${OT_ADAPTERS:-32,256}" --lora-variants "$ot_variants" --y-dtype bfloat16 \
    --device-time --read-floor --out "$OUT/onetrip-kernels.json" > "$OUT/onetrip-kernels.log" 2>&1
  echo "onetrip kernels rc=$?"; grep -E "^lora|device time|kernels \(us|read floor|PASS|FAIL|ERROR" "$OUT/onetrip-kernels.log" | tail -30
  (cd "$OUT" && tar czf onetrip.tgz onetrip-* && rm -rf onetrip-*.log onetrip-*.json)
fi
if has ranksplit; then
  # The rank-split decode kernel (triton_kernels/ranksplit.py, session 27) in one call: its compiled
  # tests, issue 4's point and its neighbours beside lora.py's pair and the one-trip pair (bf16 y,
  # device time, the read floor), then its settings at 64 x 32 (RS_BLOCKS). Packed into
  # $OUT/ranksplit.tgz. (sm_90 registers from Triton 3.6 on the CPU at 4096 -> 4096: rank_rows 8 in
  # 16 warps 128 with ~200 B of spills, 4 in 8 warps 167, 2 in 4 warps 168: one program an SM for
  # the first two, two for the third.)
  mkdir -p "$OUT/ranksplit"
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout "${T_RS_TESTS:-170}" python3 -m pytest -q -p no:cacheprovider \
    tests/test_ranksplit.py > "$OUT/ranksplit/pytest.log" 2>&1
  echo "ranksplit pytest rc=$?"; grep -E "passed|failed|FAILED|ERROR" "$OUT/ranksplit/pytest.log" | tail -8
  timeout "${T_RS_KERNELS:-200}" python3 bench/kernels.py --skip attention --modules qkvo --tokens "${RS_TOKENS:-64,256}" \
    --adapters "${RS_ADAPTERS:-32,256}" --lora-variants "${RS_VARIANTS:-pallas,onetrip,ranksplit}" --y-dtype bfloat16 \
    --device-time --read-floor --out "$OUT/ranksplit/kernels.json" > "$OUT/ranksplit/kernels.log" 2>&1
  echo "ranksplit kernels rc=$?"; grep -E "^lora|device time|kernels \(us|read floor|PASS|FAIL|ERROR|Error" "$OUT/ranksplit/kernels.log" | tail -30
  rb=${RS_BLOCKS:-'{"ranksplit":{"rank_rows":4,"num_warps":8}} {"ranksplit":{"rank_rows":2,"num_warps":4,"max_programs":264}} {"ranksplit":{"rank_rows":4,"num_warps":8,"max_programs":264}} {"ranksplit":{"max_programs":1024}}'}
  [[ $rb != none ]] && OUT=$OUT/ranksplit/sweep SWEEP_MODULES=qkvo SWEEP_TOKENS=64 SWEEP_ADAPTERS=32 SWEEP_VARIANTS=ranksplit \
    SWEEP_ARGS="--y-dtype bfloat16" T_SWEEP=${T_RS_SWEEP:-50} SWEEP_BLOCKS="$rb" XLA_CACHE_SAVE=0 PACK=0 bash "$0" sweep
  (cd "$OUT" && tar czf ranksplit.tgz ranksplit && rm -rf ranksplit)
fi
if has onetrip_profile; then
  # The S2 decode step (B 172 x 156 adapters, ranks 64/32/16/8) profiled with lora.py's pair, the
  # one-trip pair, and (OT_ONE_LAUNCH=0 to leave it out, where it hung) the one-launch form a
  # module; profile_step.json, -1, -2 in that order, packed into $OUT/onetrip-profile.tgz.
  pb="{} {\"onetrip\":{\"decode\":true}}"
  [[ ${OT_ONE_LAUNCH:-1} == 1 ]] && pb="$pb {\"onetrip\":{\"decode\":true,\"one_launch\":true}}"
  OUT=$OUT/onetrip-profile PROFILE_BATCH=172 PROFILE_CONTEXT=430 PROFILE_ADAPTERS=156 PROFILE_RANKS=64,32,16,8 \
    PROFILE_BACKENDS=hybrid/pallas/grouped T_PROFILE=${T_OT_PROFILE:-150} PROFILE_BLOCKS="$pb" XLA_CACHE_SAVE=0 \
    bash "$0" profile
  (cd "$OUT" && tar czf onetrip-profile.tgz onetrip-profile && rm -rf onetrip-profile)
fi
if has onetrip_sweep; then
  # The one-trip pair's settings at issue 4's point, one kernels.py run each (OT_BLOCKS; the
  # variants OT_SWEEP_VARIANTS: both forms, or onetrip alone where the one-launch form hung in the
  # onetrip part), then the one-launch form with tickets. Packed into $OUT/onetrip-sweep.tgz.
  # (registers on sm_90 from bench/kernel_sass.py --kernels onetrip at 64 x 32, shrink / expand:
  # defaults (gemv, k_tile 128 in 2 warps, block_t 2) 64 / 72; k_tile 256 in 4 warps 72; block_t 1:
  # 56 / 48; block_t 4: 80 / 96; col_tile 64: expand 56; the dot form: 92 / 63, but its two
  # operands' loads are two dependent trips; the wide shrink, k_tile 4096 (no split: no atomics,
  # no fence, no zeroed xa), rank_tile 8, 16 warps: 118, one program an SM, 120 programs at the
  # point, each reading 64 KB in one trip)
  ob=${OT_BLOCKS:-'{"onetrip":{"k_tile":256,"shrink_warps":4,"max_programs":1024}} {"onetrip":{"block_t":1}} {"onetrip":{"block_t":4}} {"onetrip":{"col_tile":64}} {"onetrip":{"tile_branches":false}} {"onetrip":{"form":"dot","block_t":16,"k_tile":256,"shrink_warps":4,"max_programs":1024}} {"onetrip":{"k_tile":4096,"rank_tile":8,"shrink_warps":16}}'}
  OUT=$OUT/onetrip-sweep SWEEP_MODULES=qkvo SWEEP_TOKENS=64 SWEEP_ADAPTERS=32 SWEEP_VARIANTS=${OT_SWEEP_VARIANTS:-onetrip,onetrip1} \
    T_SWEEP=${T_OT_SWEEP:-55} SWEEP_BLOCKS="{} $ob" XLA_CACHE_SAVE=0 bash "$0" sweep
  timeout "${T_OT_SWEEP:-60}" python3 bench/kernels.py --skip attention --modules qkvo --tokens 64 --adapters 32 \
    --lora-variants onetrip1 --lora-blocks '{"onetrip":{"ticket":true}}' --y-dtype bfloat16 --device-time \
    --out "$OUT/onetrip-sweep/ticket.json" > "$OUT/onetrip-sweep/ticket.log" 2>&1
  echo "onetrip ticket rc=$?"; grep -E "^lora|device time" "$OUT/onetrip-sweep/ticket.log" | tail -4
  (cd "$OUT" && tar czf onetrip-sweep.tgz onetrip-sweep && rm -rf onetrip-sweep)
fi
if has dispatch; then
  # Does a step's dispatch wait for the step before it under CUDA-graph concurrency (session 16),
  # and do two executables used in turn avoid it? bench/graph_dispatch.py, a stand-in step, with
  # and without CONCURRENT scheduling, one and two copies; one process each (flags at start-up).
  for mode in "" "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"; do
    for copies in 1 2; do
      tag=$([[ -n $mode ]] && echo concurrent || echo default)-c$copies
      XLA_FLAGS=$mode timeout "${T_DISPATCH:-60}" python3 bench/graph_dispatch.py --copies $copies \
        --out "$OUT/graph_dispatch-$tag.json" > "$OUT/graph_dispatch-$tag.log" 2>&1
      echo "graph_dispatch $tag rc=$?"
      grep -E '"(serial_us_per_step|overlapped_us_per_step|dispatch_us_median|distinct_executables)"' "$OUT/graph_dispatch-$tag.log"
    done
  done
fi
# Nsight Compute over a command (ncu and ncustep): the LoRA kernels' counters as CSV on stdout.
# Under ncu, JAX needs XLA's command buffers off (kernels inside CUDA graphs made ncu fail and
# hang), autotuning off and no preallocation (every module load and launch is intercepted):
# session 18. ncu_run SECONDS [ncu options] COMMAND...: under `timeout` (SIGINT first, so ncu can
# stop the program); NCU_KERNELS: the kernel-name regex.
ncu_run() {
  local t=$1; shift
  timeout -s INT -k 20 "$t" env XLA_FLAGS="--xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0" \
    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --target-processes application-only --kernel-name "regex:${NCU_KERNELS:-^lora}" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,gpu__time_duration.sum \
    --csv --page details --print-units base "$@"
}
if has ncu; then
  # Hardware counters of the LoRA pair (bench/ncu_lora.py): DRAM throughput, occupancy, warp
  # stalls. NCU_KERNELS "^lora|multiply" adds the same-bytes copy; NCU_BLOCKS: LoRA kernel
  # settings (SLORA_LORA_BLOCKS), a run each, "{}" the defaults; NCU_CASES: TOKENSxADAPTERS list,
  # each run NCU_REPS times; NCU_ARGS: more ncu_lora.py arguments (e.g. "--pool-rows 4194304
  # --page-rows 32": a 32 GB pool, rows placed in pages).
  i=0
  for cfg in ${NCU_BLOCKS:-'{}'}; do
    SLORA_LORA_BLOCKS=$cfg ncu_run "${T_NCU:-240}" --launch-count "${NCU_COUNT:-8}" \
      python3 bench/ncu_lora.py --cases "${NCU_CASES:-64x32,256x256}" --reps "${NCU_REPS:-2}" ${NCU_ARGS:-} \
      --out "$OUT/ncu_lora-$i.json" > "$OUT/ncu-$i.csv" 2> "$OUT/ncu-$i.log"
    echo "ncu setting $i ($cfg) rc=$?"; tail -5 "$OUT/ncu-$i.log"; grep -c '"' "$OUT/ncu-$i.csv"
    i=$((i + 1))
  done
fi
if has ncustep; then
  # The LoRA kernels of a real engine step: profile_step's decode step (PROFILE_* as for
  # "profile"; default S2's B 172 x 156 adapters, context 430), untraced. Its first NCU_SKIP
  # matching launches (default: two warm-up steps' 192 each) are skipped, the next NCU_COUNT
  # profiled: layer 0's q/k/v shrink, three expands, o shrink and expand, then layer 1's.
  # (The micro-benchmark's counters did not predict the engine step: session 18.)
  SLORA_LORA_BLOCKS=${NCU_STEP_BLOCKS:-'{}'} ncu_run "${T_NCU:-300}" \
    --launch-skip "${NCU_SKIP:-384}" --launch-count "${NCU_COUNT:-12}" \
    python3 bench/profile_step.py --model llama-7b --no-trace --steps 2 --batch "${PROFILE_BATCH:-172}" \
      --context "${PROFILE_CONTEXT:-430}" --adapters "${PROFILE_ADAPTERS:-156}" --ranks "${PROFILE_RANKS:-64,32,16,8}" \
      --backends "${PROFILE_BACKENDS:-hybrid/pallas/grouped}" > "$OUT/ncustep.csv" 2> "$OUT/ncustep.log"
  echo "ncustep rc=$?"; tail -5 "$OUT/ncustep.log"; grep -c '"' "$OUT/ncustep.csv"
fi
xla_cache_save  # skipped under XLA_CACHE_SAVE=0
# The device tool brings back at most 8 files from $OUT: a call with more (profiles of several
# settings write two each) packs them into one archive, $OUT/<parts>.tgz (PACK=0: never; 1: always).
n_files=$(find "$OUT" -type f | wc -l)
if [[ ${PACK:-auto} == 1 || ( ${PACK:-auto} == auto && $n_files -gt 6 ) ]]; then
  archive="/tmp/${parts//,/-}.tgz"
  tar czf "$archive" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$archive" "$OUT/" \
    && echo "packed $n_files files into $OUT/$(basename "$archive")"
fi
exit $rc
