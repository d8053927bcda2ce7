"""LoRA delta kernels over the unified pool: shrink (x @ A) and expand (y += xa @ B).

S-LoRA's MBGMM (prefill) and MBGMV (decode) in one pair of Pallas kernels. Tokens arrive grouped
by adapter slot: slot s owns tokens [seg_starts[s], seg_starts[s+1]); tokens from seg_starts[Sa] on
are base-model tokens. A^T [r, in] and scale*B [r, out] of each slot are read straight from a
layer's pool rows [N, W] through per-slot row indices (see slora_jax/model/layout.py); no per-token copy
of A or B exists.

Grid. The Triton lowering has neither scalar prefetch nor dynamic grid bounds, so the grid is static
and everything data-dependent is read inside the kernel. A static (slot, token block) grid would
need Sa * T/block_t programs, nearly all empty. Instead the wrapper cuts every slot's segment into
blocks of `block_t` tokens and lists them back to back (`_block_schedule`): at most T/block_t + Sa
blocks, none for base tokens, none for empty slots or slots of rank 0. The grid is
(programs, column tiles): shrink's column tiles are rank tiles of xa, expand's are tiles of `out`.
Each program walks the block list with stride `programs`, a loop whose trip count is traced, so
base tokens and empty slots cost at most one trivial pass per program. A slot's weight tile is read
by each of its blocks; concurrent programs work on consecutive blocks, i.e. on the same slot, so
it comes from HBM once and from L2 after. A decode step has one block per slot; the engine may pass
a larger block_t for prefill to cut the re-reads (MBGMM). block_t 1 (BLOCKS["mbgmv"], S-LoRA's
MBGMV; the decode shrink's by default) gives each decode token its own block, and the products
become a multiply and a sum instead of dots of 16 rows (Triton's smallest), so x, y and the
accumulators are one row: fewer registers a program, more programs an SM. The shrink and the
expand of one step may take different block_t: xa is indexed by token, not by block.

Padding is bounded by one tile: a block computes at most block_t - 1 dead token rows, and a slot of
rank r computes ceil(r / rank_tile) rank tiles, whatever the batch's max rank (shrink: rank tiles at
or past r skip under `pl.when`; expand: a `fori_loop` with a traced trip count ceil(r / rank_tile)).

Columns. Row j of A^T starts at flat element j*in of the slot's row stream, i.e. at row
a_rows[s, (j*in) // W], column (j*in) % W. A column tile is C columns with C a power of two dividing
both W and `in` (`out` for B), so a tile of one A^T row never straddles two pool rows, and a tile of
rank rows j..j+15 is one 2-D gather: a row index and a column offset per rank row. When W divides
`in` every rank row has the same column offset (S-LoRA's layout for H and KV widths); the general
case covers MLP widths such as 11008 with W = 4096 (C = 256). Widths whose common power-of-two
factor is below 16 (Triton's smallest dot side) fall back to the jnp reference.

Groups. Modules that read the same x (q, k and v) shrink in one launch (`lora_shrink_group`): grid
axis 1 walks (module, rank tile) pairs, module g's A rows and ranks are row block g of the stacked
arrays, and its xa columns start at g * Rw. Each module then expands from its own columns
(`lora_expand(..., xa_col=g * Rw)`). One launch instead of three per layer, and expand reads
shrink's padded xa directly (no slice copy).

Fused (`lora_fused_apply`, BLOCKS["fused"]; off in the engine: slower on the H200, see BLOCKS). Shrink and
expand in one launch: a program per live (block, rank tile) item and share of the output columns
computes its xa tile over all of `in` in registers and adds xa @ B[tile] into a float32 delta by
atomic adds, which one XLA fusion adds to y. One launch and no xa round trip a module, against a
shrink and an expand with xa in HBM between them; the price is A re-read (from L2) by each of an
item's n_split programs, and atomic adds on the delta. Modules that read the same x and have the
same width (q, k and v of a multi-head model) go in one launch (`lora_fused_delta`, grid axis 2),
so with group_qkv an attention block costs 2 fused launches instead of 2 shrinks and 4 expands.

The same kernel bodies run in interpret mode (CPU) and through the Triton lowering (GPU).
"""

from __future__ import annotations

import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
import jax.experimental.pallas.fuser  # noqa: F401 (see below)
from jax.experimental.pallas import triton as plgpu

# `_fuser`: interpreting a pallas_call imports the fuser lazily, which adds a config to JAX's trace
# context, so every jit traced before the first kernel call would miss its cache once and compile
# twice. Importing it up front keeps the trace context fixed.

# Block sizes. Triton wants power-of-two dot operands of at least 16 on every side. Not yet tuned on
# a GPU: col_tile is a cap (the tile is the largest power of two dividing W, at most the cap).
# split_k > 1: shrink's `in` columns are cut into split_k ranges, each its own program, whose
# partial products meet in xa by atomic adds (more programs in flight for a decode step's few
# tokens per adapter); 1: one program walks all the columns and stores. It applies to calls of at
# most split_k_max_tokens tokens (decode steps); longer ones have programs enough and keep 1.
# Prefill with split-K (H200, session 15, bench/results/20261130-c9310a1/): a profiled prefill step
# of 2 prompts x 256 tokens on 2 adapters takes 2.24 ms of LoRA kernels with split_k_max_tokens
# 1024 instead of 2.65 (shrinks 1.60 -> 1.03, expands 1.05 -> 1.21: they add 4 planes), device
# step 17.07 -> 16.72 ms (split_k 8 there: 2.69, 16: 3.41). But in S2's serving run with it
# (bench/results/20261130-7fa70de/) the kernels' prefill steps took 24.6 ms against 22.3 for the
# one-hot path in the same run (session 14, without it: 22.1 against 22.7), so it stays at 256
# until a same-run pair says otherwise.
# split_k=4 from the H200 sweep (bench/results/20261129-46a45b4/sweep.jsonl, qkvo, decode):
# 64 tokens x 32 adapters 55.0 -> 43.6 us, 256 x 32 54.0 -> 31.7, 256 x 256 127.2 -> 122.9
# (split_k=16 was slower than 4 in all three). Prefill-sized calls were not timed with it.
# static_split (shrink, split_k > 1): each program's chunk loop has a static trip count when
# split_k divides the chunks (Triton can then pipeline its loads; the traced bounds it replaces
# may not be). y_first (expand): load the y tile before the rank loop, so its latency overlaps
# the B gathers instead of following them. y_first is on from the H200 sweep
# (bench/results/20261129-0de79dd/sweep.jsonl, qkvo, shrink + expand, median us, one run):
# 64 x 32 41.5 -> 38.9, 256 x 32 48.6 -> 35.6, 256 x 256 119.8 -> 115.5. static_split lost at
# 256 x 32 and 256 x 256 (45.1, 136.0) and stays off; so did shrink col_tile 512 at 256 x 256.
BLOCKS = {
    "shrink": dict(rank_tile=16, col_tile=256, num_warps=4, num_stages=2, split_k=4, split_k_max_tokens=256,
                   static_split=False, prefetch_next=True, hoist_rows=False, compact_tiles=True,
                   max_programs=256, early_loads=True, split_partials=True, splits_first=False),
    "expand": dict(rank_tile=16, col_tile=128, num_warps=4, num_stages=2, y_first=True, prefetch_next=True,
                   max_programs=256, early_loads=False, cols_first=False),
    # lora_fused_apply (off in the engine unless `decode` is on; H200, session 13: slower than the
    # shrink + expand pair everywhere, bench/results/20261130-eeb54fb/: the S2 decode step's LoRA
    # kernels 10.70 ms (n_split 2), 9.25 (n_split 1), 8.50 (b_col_tile 256) against the pair's
    # 5.75; issue 4's 64 x 32 point 46.8 us of device time against 20.4. A program's A walk (all
    # of `in`) and B walk run one after the other, so the long per-program chains that split-K
    # cut come back, with atomic adds on the delta on top): shrink and
    # expand in one launch for calls of at most max_tokens tokens. n_split: programs sharing one
    # (block, rank tile) item's output columns, each recomputing its xa tile (A re-read from L2).
    # max_programs: programs walking the item list (an H200 keeps ~1000 of these small programs in
    # flight; the split kernels' 256 would leave S2's ~300 items a decode step looping twice).
    "fused": dict(decode=False, max_tokens=256, rank_tile=16, a_col_tile=256, b_col_tile=128, n_split=2,
                  max_programs=1024, num_warps=4, num_stages=2, prefetch_next=True),
    # mbgmv: the engine's Pallas decode steps in blocks of one token (decode_block_t), per kernel.
    # A block's products are then a multiply and a sum (S-LoRA's MBGMV) instead of Triton dots of
    # 16 rows, of which a decode step's blocks fill ~1: x and the accumulators are one row each, so
    # a program holds fewer registers and an SM more programs (the kernels are latency-bound per
    # program: session 13's profiles). An adapter with several tokens in the step is read once per
    # token (from L2 after the first). col_tile: the shrink's column tile at block_t 1 (its own:
    # the dot form's 256 stays for prefill). H200, session 15, S2's decode step (B 172 x 156
    # adapters, bench/results/20261130-c9310a1/): the shrinks 2.52 -> 2.14 ms a step with the shrink
    # at block_t 1 and col_tile 1024 (1.81 + 0.71 -> 1.50 + 0.64), 2.34 + 0.98 with col_tile 256;
    # the expands at block_t 1 lose (0.72 -> 0.82 ms each, early_loads or one warp 0.77-0.85), so
    # the expand keeps its dots. As the default (shrink at 1, expands at 16, bench/results/
    # 20261130-7fa70de/): the step's LoRA kernels 5.43 -> 5.03 ms, device step 23.93 -> 23.56.
    # Issue 4's 64 x 32 point (2 tokens an adapter) moves the other way: shrink 9.6 -> 10.1-10.4 us,
    # shrink + expand 19.1 -> 19.7-20.0 us of device time (bench/results/20261130-9c2b778/).
    # expand_col_tile / expand_rank_tile: the expand's tiles at block_t 1 (None: BLOCKS["expand"]'s,
    # sized for dots of 16 rows). Nsight Compute on the H200 (session 18, bench/ncu_lora.py at
    # 256 tokens x 256 adapters): the dot expand runs 8192 programs of one [16, 128] column tile
    # each, ~7.5 KB of B a program, at 29% occupancy (93 registers) and 32% of DRAM bandwidth.
    # Wider tiles at block_t 1 cost registers (col 512-2048: 174-255, 6-12% occupancy, slower);
    # col 256 / rank 8 took that micro case 46.5 -> 33.5 us, but the S2 decode step's LoRA kernels
    # 5.05 -> 5.12 ms (bench/results/20261130-4d56af6/): the micro's counters do not carry over
    # to the engine step, so the expand stays a dot of 16 rows by default.
    # few_slots (None: off): block_t 1 reads an adapter's A once per token, so it only pays where
    # adapters hold ~1 token each (S2 at n = 1000). A kernel decode step with at most few_slots
    # distinct adapters in a batch bucket of at least 4 x few_slots rows takes a slot bucket of its
    # own and shrinks in the dot form (block_t 16; `mbgmv_shrink`): one more step shape per batch
    # bucket. H200, session 22 (bench/results/20261201-0e4a079/call2-*): at B 172 the q/k/v shrink
    # at block_t 1 costs ~1.1 ms a step with 8 adapters as with 32 (21 and 5 tokens an adapter).
    # Not yet timed on.
    "mbgmv": dict(shrink=True, expand=False, col_tile=1024, expand_col_tile=None, expand_rank_tile=None,
                  few_slots=None),
    # mgpu (off): a decode step's shrink (block_t 1) and its expands as the Mosaic GPU pair of
    # lora_mgpu.py, each program's pool rows gathered by TMA, where one A^T / B row is one pool row
    # (q, k, v, o of llama-7b at W 4096). decode: True / False, or None for "on Hopper and later
    # GPUs" (lora_mgpu.hopper); col_tile: the expand's columns a program; shrink_rows: A^T rows a
    # shrink program copies (8 KB each at W 4096); per_slot: one program per slot block of up to
    # slot_tokens tokens, its rows copied once for them (False: one per token). H200, session 17
    # (bench/results/20261130-0901b06/), LoRA kernels of a llama-7b decode step, ms, Triton pair /
    # this pair: S2's B 172 x 156 adapters (~1.1 tokens an adapter) 5.00-5.04 / 4.79 (-5%, device
    # step -0.5%); B 256 x 64 adapters (4 an adapter) 4.01 / 4.47 (+12%, device step +2%). Issue
    # 4's point (64 x 32, us of device time): 19.7 / 19.8 + 4.7 of schedule ops; 256 x 256: 71.8 /
    # 52.5 + 8. Settings (S2 step): shrink_rows 8 / 4 and col_tile 512 / 256: 4.75-4.76 / 4.66-4.69;
    # slot blocks of 4 tokens cost 0.13 ms there and save 11 us of 46 at 256 x 32. It loses where
    # adapters hold several tokens each (its dots are full reductions, one per A^T row and token),
    # so it stays off; the engine would need the step's tokens-per-adapter to pick per step.
    "mgpu": dict(decode=False, col_tile=256, shrink_rows=4, per_slot=True, slot_tokens=4),
    # onetrip (pallas_kernels/onetrip.py): a decode step's shrink and expand as programs of one
    # memory trip each, their tables built on the host (shrink_plan / expand_plan), where the pool
    # width divides the module's in (shrink) / out (expand). decode: the engine's decode steps use it.
    # block_t: tokens a block (the dots' M side); rank_tile: A^T rows a shrink unit and the expand's
    # rank tile; k_tile: `in` columns a shrink unit (splits = in / k_tile, met by atomic adds);
    # max_programs: the shrink's programs (each walks units p, p + P, ...); col_tile: the expand's
    # output columns a program; tile_branches: the expand adds each rank tile past the first under
    # a branch on the rank (compute on padding within one tile), else every tile's dot runs on
    # masked zeros (no memory traffic; in case the compiler sinks the branch's loads into it,
    # which would chain the tiles' trips again). ticket (onetrip_apply, the one-launch form): each
    # program takes its place from an atomic counter instead of its index (see _one_launch_kernel).
    # pipeline: a shrink program's units in three stages (entries two ahead, rows one ahead), for
    # programs with several units; off: entries one ahead. Off by default: at issue 4's point each
    # program has one unit, and the pipeline's registers (bench/kernel_sass.py --kernels onetrip,
    # sm_90: 111 against 92) leave an SM 4 programs instead of 5. one_launch: the
    # engine runs each such module's decode LoRA as onetrip_apply (one launch a
    # module: q, k, v and o in 4 launches a layer) instead of the pair (the grouped q/k/v shrink and
    # 4 expands: 5).
    # form: "gemv" (S-LoRA's MBGMV: a token at a time, products by multiply and sum; block_t any)
    # or "dot" (Triton dots of block_t >= 16 token rows). Compiled for sm_90 (bench/kernel_sass.py),
    # the dot form's loads are two dependent trips: Triton converts the first operand's tile into
    # shared memory (behind a barrier) before it issues the second operand's loads; the gemv form
    # has no conversion between them.
    # Off: on the H200 (session 26, bench/results/20261202-04d6171/) the pair took 20.4-20.8 us at
    # qkvo 64 x 32 against lora.py's 18.6 (shrink 8.1-8.6 against 10.2, expand 12.2 against 8.4),
    # the one launch 20.0-24.0, and 51.1 against 28.8 at 256 x 32.
    # Defaults from the compiled kernels' registers (sm_90, bench/kernel_sass.py --kernels onetrip,
    # 64 tokens x 32 adapters): the shrink at k_tile 128 in 2 warps takes 64 registers, so
    # an SM holds 16 programs and the point's 2048 units (64 items x 32 splits) run in one wave of
    # 2048 programs (k_tile 256 in 4 warps: 72 registers, 7 programs an SM, 1024 units in 1.1
    # waves); the expand at 128 columns in 4 warps takes 72 (7 an SM).
    "onetrip": dict(decode=False, form="gemv", block_t=2, rank_tile=16, k_tile=128, max_programs=2048, col_tile=128,
                    shrink_warps=2, expand_warps=4, num_stages=1, tile_branches=True, ticket=False,
                    one_launch=False, pipeline=False),
}
# Tried and dropped (H200 sweep, bench/results/20261130-8f52164/sweep.jsonl, qkvo, shrink + expand,
# median us at 64 x 32 / 256 x 32 / 256 x 256, defaults 35.9 / 44.8 / 122.1): a shrink program
# looping over its slot's live rank tiles instead of one program per (slot block, rank tile)
# (68.7 / 56.0 / 142.2; with rank_tile 32: 44.3 / 42.1 / 130.0), and reading A^T's row indices once
# per rank tile where fin == W (53.1 / 58.2 / 127.1; kept as `hoist_rows`, off: the micro sweep's
# noise, +-15-30% between calls, is too large to judge it, and the engine profile has not timed it
# alone). In the engine's step (B 128 x 110 adapters) both together took the q/k/v shrink from
# 2.07 to 2.18 ms and the o shrink from 0.84 to 1.20.

# splits_first (shrink) / cols_first (expand), off: the launch order (`_grid`). By default a
# decode step's programs side by side are different adapters at the same split or column tile:
# each reads 256-2048 B stretches of many scattered pool rows. With these on, one block's splits
# or column tiles launch one after another and read its rows' consecutive stretches (an A or B
# row is 8 KB of one page at W 4096). kernel_sass at the S2 shape: shrink 56 -> 48 registers (9 ->
# 10 programs an SM), expand unchanged (78, 6). H200, session 16, the S2 decode step (B 172 x 156
# adapters, bench/results/20261130-6b5d62b/profile-launch-order/): LoRA kernels 5.00 ms with
# cols_first, 5.00 with both, against 5.01 at the defaults: no effect.
# A shrink on a second XLA GPU stream (jax compute_on "gpu_stream:N", beside the base model's
# projection of the same x), session 15-16: XLA 0.11.2 with
# --xla_gpu_experimental_stream_annotation rejects the annotated call at run time, alone in a jit
# (the kernel's own jnp ops are nested calls) and inside the engine's step ("No ExecutionStreamId
# found ... only reachable through embedded calls"): removed. XLA's CUDA-graph data-flow
# concurrency (--xla_gpu_command_buffer_scheduling_mode=CONCURRENT) does run the LoRA kernels
# beside the base matmuls: the S2 decode step's traced span 23.59 -> 22.56 ms (the base model's
# 18.53 -> 18.49), but in serving each step's dispatch then waits for the step before, and S2's
# unified req/s went 20.53 -> 19.77 (bench/results/20261130-5fbfb6a/s2-capacity-flags/). Why the
# dispatch waits is not yet known; bench/graph_dispatch.py tests whether two executables used in
# turn avoid it (one graph's launches are ordered behind each other).
# prefetch_next (shrink and expand; on): a manual two-stage pipeline in the column-chunk (shrink) and
# rank-tile (expand) loops, the next trip's gathers issued before this trip's product (`_loop`).
# compact_tiles (shrink; on): one program per live (block, rank tile) item instead of one per
# (block, every rank tile), about half of which exit at once with ranks 8-64 (the engine builds
# that schedule on the host, `shrink_schedule`; the profile below built it in the graph). Both from the H200 engine-step profile
# (bench/results/20261130-bf56a12/profile-a, -b: llama-7b decode, B 128 x 110 adapters, ranks
# 64/32/16/8, LoRA kernels in ms a step; the defaults measured 5.22-5.31 over four runs):
#   before (both off)                        5.24  (q/k/v shrink 2.08, o shrink 0.84, expands ~0.58)
#   prefetch_next, shrink and expand         4.37  (1.59, 0.64, 0.52-0.55)
#   compact_tiles alone                      4.98  (1.95, 0.70, ~0.58)
#   both                                     4.26  (1.51, 0.62, 0.52-0.55)
# Why they help: the kernels are latency-bound per program (fewer, longer programs lost above;
# y_first, which moves a load ahead, won): prefetch_next overlaps a program's loads with its dots,
# compact_tiles launches no program that only exits.

# Session 13 (H200, device time, bench/results/20261130-eeb54fb/; the S2 decode step, B 172 x 156
# adapters, ranks 64-8, context 430: LoRA kernels 5.75-5.81 ms at the defaults over four profiles,
# q/k/v shrink 2.10-2.12, o shrink 0.84-0.85, expands 0.68-0.73):
#   expand col_tile 256 6.25; num_warps 2 (both) 10.68; shrink split_k 8 6.09; shrink
#   max_programs 512 / 1024 / 128 5.72 / 5.84 / 5.88: no gain.
#   early_loads (both) 5.87 (q/k/v shrink 2.07, o 0.82, expands 0.74-0.75: 69 -> 86 registers);
#   off.
#   shrink without prefetch_next, num_stages 4, hoist_rows, split_k 1 (Triton's cp.async
#   pipeline, no atomic adds): q/k/v shrink 1.85 and 1.91 in two profiles (-10 to -13%), o
#   shrink 0.88 (+4%): 5.58 / 5.74. Not default: it helps the grouped launch and hurts the single
#   one, and it has not run through the GPU tests.
#   split_partials (no atomic adds, split-K kept): written after the calls, timed in session 14.
#   bench/kernel_sass.py shows why it matters: each split-K atomic add is an acq_rel atomic,
#   a MEMBAR.ALL.GPU before it and an L1 invalidate after it in the SASS.
# Session 14 (same profile, bench/results/20261130-61e429f/): shrink split_partials and
# early_loads are the defaults from here on (the expand keeps early_loads off: session 13's
# +5% on the expands, from 69 to 86 registers).
#   defaults before                     5.74  (q/k/v shrink 2.10, o shrink 0.84, expands 0.68-0.72)
#   split_partials                      5.48  (1.86, 0.74, 0.71-0.73)
#   split_partials + early_loads        5.40 / 5.40 in two calls (1.81, 0.71, 0.71-0.73)
#   the same, split_k 2                 5.44;  max_programs 512: 5.37 (one call; not taken)
#   split_partials, cp.async pipeline, split_k 2 (with / without early_loads) 5.42 / 5.44
#   split_partials, expand col_tile 64  5.99 (expands 0.90)
# Issue 4's point: 20.4 -> 19.3 us (split_partials), 19.1 (both).
# Issue 4's 64 x 32 point (one 4096 -> 4096 module, device time) stays at 17.8-22.6 us whatever
# the setting (12 settings and 7 more in three sweeps; 9.1 us is 60%): each kernel takes >= 8.3 us.
# Session 14's split_partials settings: 18.7-19.3 us.

# Session 19 (H200, the S2 decode step, bench/results/20261130-66a79da/call6-profile-expand/; LoRA
# kernels 5.00 ms a step at the defaults, each expand 0.71-0.73): expand y_first off 5.03 (62
# registers by bench/kernel_sass.py against 78: 8 programs an SM against 6, no gain); y_first and
# prefetch_next off, so Triton pipelines the rank loop itself with cp.async (56 registers), 6.17,
# with num_stages 3 6.45; rank_tile 32 5.86. The q, k and v expands as one launch (a grid over
# (module, column tile), each program picking its module's y by masked loads and stores; commits
# 0d3beca and d5f5f54, reverted): 5.20 (bench/results/20261130-d5f5f54/). The expand is bound
# per program: Nsight Compute on the step's own launches (20261130-c856a28/) gives each expand
# 23 us for 40 MB at 64 registers, 43% occupancy, 38% of DRAM bandwidth, with an instruction
# issued on 54% of cycles. A float32 y (bench/kernels.py's default delta buffer) costs it ~17-30
# registers (held through the rank loop by y_first): kernels.py --y-dtype bfloat16 times the
# engine's form. Also lost (commit 28909b0, reverted; 20261130-28909b0/): "one_pass", each program
# running its one block with no loop and no read of the live total where the grid covers every
# block (a decode step's expand): each expand 0.72 -> 0.93 ms in the step, 8.2 -> 9.2 us at
# issue 4's point (registers unchanged by kernel_sass; the loop-free body compiles slower).

# SLORA_LORA_BLOCKS: JSON merged into BLOCKS at import (a benchmark's way to time a setting in a
# process it does not drive itself, e.g. bench/gpu_check.sh's PROFILE_BLOCKS).
def _merge_blocks(over: str | dict, source: str = "SLORA_LORA_BLOCKS", into: dict = BLOCKS) -> None:
    for kind, kv in (json.loads(over) if isinstance(over, str) else over).items():
        if kind not in into or not isinstance(kv, dict) or not set(kv) <= set(into[kind]):
            raise ValueError(f"{source}: unknown setting {kind}: {kv}; BLOCKS = {into}")
        into[kind] = {**into[kind], **kv}


if os.environ.get("SLORA_LORA_BLOCKS"):
    _merge_blocks(os.environ["SLORA_LORA_BLOCKS"])
_IMPORTED_BLOCKS = {kind: dict(kv) for kind, kv in BLOCKS.items()}  # the defaults, SLORA_LORA_BLOCKS merged in


def set_blocks(over: str | dict | None = None) -> dict:
    """BLOCKS as at import (the defaults with SLORA_LORA_BLOCKS merged in), then `over` (JSON text
    or a dict of the same form) merged in; returns BLOCKS. The kernels read BLOCKS when they are
    traced, so a caller that changes it must drop what was traced before (jax.clear_caches()):
    bench/run.py's per-variant --lora-blocks, which times settings side by side in one process.
    A setting BLOCKS does not have raises and leaves BLOCKS as it was."""
    new = {kind: dict(kv) for kind, kv in _IMPORTED_BLOCKS.items()}
    if over:
        _merge_blocks(over, "lora blocks", into=new)
    BLOCKS.update(new)
    return BLOCKS
BLOCK_T = 16          # tokens per block (the dot's M side); the engine may pass more for prefill
MAX_PROGRAMS = 256    # programs walking the block list; more blocks than this loop inside a program
# (the Triton twins' default; the Pallas shrink and expand take BLOCKS[kind]["max_programs"] when
# the caller passes none)


# ---------------------------------------------------------------------------------------------
# Kernels.


def _grid(grid: tuple, last_first: bool) -> tuple:
    """The launch grid: (programs, ...) as given, or with its last axis moved to the front. The GPU
    launches grid axis 0 fastest, so by default the programs running side by side walk different
    blocks (in a decode step: different adapters) at the same column tile or split, each reading a
    short stretch of many pool rows. Moved to the front, the column tiles (expand) or splits
    (shrink) of one block launch one after another and read its rows' consecutive stretches."""
    return (grid[-1], *grid[:-1]) if last_first else grid


def _program_ids(ndim: int, last_first: bool) -> tuple:
    """The program ids in the kernel's own axis order (programs, ...) under `_grid`'s layout."""
    ids = [pl.program_id(i) for i in range(ndim)]
    return (*ids[1:], ids[0]) if last_first else tuple(ids)


def _blocks(p, n_programs, total_ref, sched_ref, body, early: bool = False):
    """Run body(col) for blocks b = p, p + n_programs, ... below the schedule's live total, col
    being the schedule's column b (a tuple of its rows). early: each column is read one trip
    ahead, the first beside the total (p < n_programs <= the schedule's length, so it is in
    bounds; later reads clamp to the last column), so a program's first loads wait on one round
    trip to memory, not two (most decode programs have exactly one block); else each column is
    read in its own trip, after the total."""
    n_rows, n_cols = sched_ref.shape
    total = total_ref[0]
    trips = jax.lax.div(jnp.maximum(total - p + n_programs - 1, 0), n_programs)

    def read(b):
        return tuple(sched_ref[i, b] for i in range(n_rows))

    if not early:
        def one(i, carry):
            body(read(p + i * n_programs))
            return carry
        jax.lax.fori_loop(0, trips, one, 0)
        return

    def ahead(i, col):
        nxt = read(jnp.minimum(p + (i + 1) * n_programs, n_cols - 1))
        body(col)
        return nxt
    jax.lax.fori_loop(0, trips, ahead, read(p))


def _loop(lo, hi, load, use, acc, prefetch: bool):
    """acc after acc = use(load(i), acc) for i in [lo, hi). prefetch: a manual two-stage pipeline,
    the loads of i + 1 issued before the product of i and carried into the next trip, so their
    latency overlaps it (load(lo) is issued even for an empty range: load must accept lo then)."""
    if not prefetch:
        return jax.lax.fori_loop(lo, hi, lambda i, a: use(load(i), a), acc)

    def trip(i, carry):
        a, cur = carry
        nxt = load(i + 1)
        return use(cur, a), nxt

    acc2, cur = jax.lax.fori_loop(lo, hi - 1, trip, (acc, load(lo)))
    return jnp.where(hi > lo, use(cur, acc2), acc2)


def _gather_tile(rows_ref, idx_ref, s, flat, width, col_tile, rid=None):
    """[len(flat), C]: the C elements at each flat offset of slot s's row stream. C divides W and
    the matrix width, so a tile never straddles two pool rows. rid: the offsets' pool rows, if the
    caller has them."""
    if rid is None:
        rid = idx_ref[s, jax.lax.div(flat, width)]
    first_col = pl.multiple_of(jax.lax.rem(flat, width), col_tile)  # lets Triton vectorise the load
    cols = first_col[:, None] + jnp.arange(col_tile)[None, :]
    return rows_ref[rid[:, None], cols]


def _shrink_tiles(rows_ref, a_rows_ref, x_ref, s, first, col, start, j_live, tok_live, *, width, col_tile,
                  block_t, dtype, rid=None):
    """One column chunk of a shrink: the A^T tile [rank_tile, C] of slot s's rank rows (flat offsets
    `first` + col; rows past the rank zeroed) and the x tile [block_t, C] (dead tokens zeroed)."""
    at = _gather_tile(rows_ref, a_rows_ref, s, first + col, width, col_tile, rid=rid)
    at = jnp.where(j_live[:, None], at, 0).astype(dtype)
    xt = plgpu.load(x_ref.at[pl.ds(start, block_t), pl.ds(col, col_tile)], mask=tok_live[:, None],
                    other=0).astype(dtype)
    return at, xt


def _shrink_step(tiles, acc):
    """acc [block_t, rank_tile] += x tile @ A^T tile^T, in float32. block_t 1 (MBGMV): a multiply
    and a sum over the columns instead of a dot (Triton's dot needs 16 rows)."""
    at, xt = tiles
    if acc.shape[0] == 1:
        return acc + jnp.sum(at.astype(jnp.float32) * xt.astype(jnp.float32), axis=1)[None, :]
    return acc + jax.lax.dot_general(xt, at, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _shrink_kernel(total_ref, sched_ref, ranks_ref, a_rows_ref, x_ref, rows_ref, _xa_in, xa_ref, *,
                   n_programs, block_t, rank_tile, col_tile, fin, width, dtype, split_k, interpret,
                   slots, tiles, module_cols, max_rank, static_split=False, prefetch_next=False,
                   hoist_rows=False, compact_tiles=False, early_loads=False, partials=False,
                   splits_first=False):
    # Grid axis 1 walks (module, rank tile) pairs: a grouped call (modules sharing x, e.g. q, k, v)
    # shrinks every module in one launch; module g's A rows and ranks are row block g of a_rows
    # and ranks ([G * Sa, ...]) and its xa columns start at g * module_cols.
    # compact_tiles: the schedule lists (block, rank tile) items of live tiles only (row 3: the
    # tile, `_block_schedule` with rank_tile) and axis 1 walks modules: no program exists for a dead tile.
    # splits_first: the grid is (split, program, module...) instead, so the programs launched one
    # after another read consecutive column ranges of the same A rows (see `_grid`).
    p, gk, q = _program_ids(3, splits_first)   # q: this program's share of the `in` columns
    if compact_tiles:
        g, k_fixed = gk, None
    else:
        g, k_fixed = jax.lax.div(gk, tiles), jax.lax.rem(gk, tiles)  # this program's rank tile of module g
    n_chunks = fin // col_tile
    per_split = -(-n_chunks // split_k)

    def block(col):
        s0, start, end = col[0], col[1], col[2]
        k = col[3] if compact_tiles else k_fixed
        s = g * slots + s0                     # module g's row of slot s0
        r = jnp.minimum(ranks_ref[s], max_rank)  # clamped here, not by an XLA op per call

        # early_loads: the compact schedule lists only live items (of each slot's largest rank
        # over the modules), so no guard: the first loads need not wait for the rank (a module of
        # smaller rank masks its dead rows below). Else dead rank tiles are skipped.
        @_when(None if compact_tiles and early_loads else k * rank_tile < r)
        def _():
            tok_live = start + jnp.arange(block_t) < end
            j = k * rank_tile + jnp.arange(rank_tile)          # A^T rows (rank columns of xa)
            j_live = j < r
            # A^T row j starts at flat j * fin. Rows past the rank read another row's indices (in
            # bounds, a valid row: the tile is zeroed there); early_loads: row max_rank - 1's, so
            # the gathers do not wait for the rank either.
            jc = jnp.minimum(j, max_rank - 1) if early_loads else jnp.where(j_live, j, 0)
            first = jc * fin
            # hoist_rows, where fin == W: A^T row j is pool row a_rows[s, j] whole, so its row
            # indices are read once here instead of once per column chunk
            rid = a_rows_ref[s, jc] if hoist_rows and fin == width else None

            def load(c):
                if prefetch_next:  # an empty split's first load reads the last chunk (not used)
                    c = jnp.minimum(c, n_chunks - 1)
                return _shrink_tiles(rows_ref, a_rows_ref, x_ref, s, first, c * col_tile, start, j_live, tok_live,
                                     width=width, col_tile=col_tile, block_t=block_t, dtype=dtype, rid=rid)

            use = _shrink_step
            zero = jnp.zeros((block_t, rank_tile), jnp.float32)
            if split_k == 1:  # static bounds: the loop the kernel had before split_k
                acc = _loop(0, n_chunks, load, use, zero, prefetch_next)
            elif static_split and n_chunks % split_k == 0:  # static trip count, traced offset
                acc = _loop(0, per_split, lambda c: load(q * per_split + c), use, zero, prefetch_next)
            else:
                lo = q * per_split
                acc = _loop(lo, jnp.minimum(lo + per_split, n_chunks), load, use, zero, prefetch_next)
            cols = pl.ds(g * module_cols + k * rank_tile, rank_tile)
            mask = tok_live[:, None] & j_live[None, :]
            if split_k == 1:
                plgpu.store(xa_ref.at[pl.ds(start, block_t), cols], acc, mask=mask)
            elif partials:  # split q's partial sums in its own plane of xa, summed by the expand
                plgpu.store(xa_ref.at[q, pl.ds(start, block_t), cols], acc, mask=mask)
            else:  # partial sums over column ranges meet in the zeroed xa (padded to whole
                # tiles, so no block's tile runs past it); dead entries add zero
                acc = jnp.where(mask, acc, 0.0)
                plgpu.atomic_add(xa_ref, (pl.ds(start, block_t), cols), acc,
                                 mask=None if interpret else mask)  # interpret mode: no masks

    _blocks(p, n_programs, total_ref, sched_ref, block, early=early_loads)


def _when(cond):
    """pl.when(cond), or run the body unconditionally when cond is None."""
    if cond is None:
        return lambda body: body()
    return pl.when(cond)


def _expand_kernel(total_ref, sched_ref, ranks_ref, b_rows_ref, xa_ref, rows_ref, y_ref, out_ref, *,
                   n_programs, block_t, rank_tile, col_tile, fout, width, dtype, xa_col, max_rank, y_first=False,
                   prefetch_next=False, early_loads=False, cols_first=False):
    # xa_col: where this module's columns start in xa (a grouped shrink's xa holds several).
    # cols_first: the grid is (column tile, program) instead (see `_grid`).
    p, o = _program_ids(2, cols_first)         # o: this program's output column tile
    col = o * col_tile

    def block(col_):
        s, start, end = col_[0], col_[1], col_[2]
        r = jnp.minimum(ranks_ref[s], max_rank)
        tok_live = start + jnp.arange(block_t) < end

        def load(kt):  # rank tile kt; rows past the rank are zeroed after the loads
            j = kt * rank_tile + jnp.arange(rank_tile)         # B rows
            j_live = j < r
            # early_loads: index and mask from max_rank, not from the rank, so the first tile's
            # gathers (issued before the rank loop) need not wait for the rank's read.
            jc = jnp.minimum(j, max_rank - 1) if early_loads else jnp.where(j_live, j, 0)
            bt = _gather_tile(rows_ref, b_rows_ref, s, jc * fout + col, width, col_tile)  # [rank_tile, C]
            bt = jnp.where(j_live[:, None], bt, 0).astype(dtype)
            xa_mask = tok_live[:, None] & ((j < max_rank) if early_loads else j_live)[None, :]
            xa_tile = (pl.ds(start, block_t), pl.ds(xa_col + kt * rank_tile, rank_tile))
            if len(xa_ref.shape) == 3:  # [S, T', cols]: S planes of split-K partial sums, added here
                xat = sum(plgpu.load(xa_ref.at[(jnp.int32(i),) + xa_tile], mask=xa_mask, other=0)
                          for i in range(xa_ref.shape[0]))
            else:
                xat = plgpu.load(xa_ref.at[xa_tile], mask=xa_mask, other=0)
            xat = jnp.where(j_live[None, :], xat, 0).astype(dtype) if early_loads else xat.astype(dtype)
            return bt, xat

        def use(tiles, acc):
            bt, xat = tiles
            if block_t == 1:  # MBGMV: a multiply and a sum over the rank rows (see _shrink_step)
                return acc + jnp.sum(bt.astype(jnp.float32) * xat.astype(jnp.float32).T, axis=0)[None, :]
            return acc + jax.lax.dot_general(xat, bt, (((1,), (0,)), ((), ())),
                                             preferred_element_type=jnp.float32)

        tile = (pl.ds(start, block_t), pl.ds(col, col_tile))
        if y_first:
            y = plgpu.load(y_ref.at[tile], mask=tok_live[:, None], other=0)
        trips = jax.lax.div(r + rank_tile - 1, rank_tile)
        acc = _loop(0, trips, load, use, jnp.zeros((block_t, col_tile), jnp.float32), prefetch_next)
        if not y_first:
            y = plgpu.load(y_ref.at[tile], mask=tok_live[:, None], other=0)
        plgpu.store(out_ref.at[tile], (y.astype(jnp.float32) + acc).astype(out_ref.dtype),
                    mask=tok_live[:, None])

    _blocks(p, n_programs, total_ref, sched_ref, block, early=early_loads)


def _fused_kernel(total_ref, sched_ref, ranks_ref, a_rows_ref, b_rows_ref, x_ref, rows_ref, _d_in, d_ref, *,
                  n_programs, block_t, rank_tile, a_col_tile, b_col_tile, fin, fout, width, dtype, n_split,
                  max_rank, prefetch_next, interpret, slots):
    # One program per live (token block, rank tile) item of the compact schedule, share q of the
    # output column tiles and module g (grid axis 2: modules that read the same x, e.g. q, k, v,
    # each with its own rows of the stacked ranks / A rows / B rows and its own fout columns of d):
    # xa = x @ A^T[tile]^T over all of `in` (kept in registers, never stored), then for each of its
    # output tiles d[tokens, cols] += xa @ B[tile, cols] by atomic adds (a slot's rank tiles, and
    # blocks sharing a token, meet there).
    p, q, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n_a, n_b = fin // a_col_tile, fout // b_col_tile
    per = -(-n_b // n_split)

    def block(col):
        s0, start, end, k = col
        s = g * slots + s0                     # module g's row of slot s0
        r = jnp.minimum(ranks_ref[s], max_rank)

        @pl.when(k * rank_tile < r)
        def _():
            tok_live = start + jnp.arange(block_t) < end
            j = k * rank_tile + jnp.arange(rank_tile)
            j_live = j < r
            j0 = jnp.where(j_live, j, 0)

            def load_a(c):
                if prefetch_next:
                    c = jnp.minimum(c, n_a - 1)
                return _shrink_tiles(rows_ref, a_rows_ref, x_ref, s, j0 * fin, c * a_col_tile, start, j_live,
                                     tok_live, width=width, col_tile=a_col_tile, block_t=block_t, dtype=dtype)

            xa = _loop(0, n_a, load_a, _shrink_step, jnp.zeros((block_t, rank_tile), jnp.float32), prefetch_next)
            xa = jnp.where(tok_live[:, None] & j_live[None, :], xa, 0.0).astype(dtype)
            lo = q * per
            hi = jnp.minimum(lo + per, n_b)

            def load_b(o):
                if prefetch_next:
                    o = jnp.minimum(o, n_b - 1)
                bt = _gather_tile(rows_ref, b_rows_ref, s, j0 * fout + o * b_col_tile, width, b_col_tile)
                return jnp.where(j_live[:, None], bt, 0).astype(dtype)              # [rank_tile, Cb]

            def add_b(o, bt):
                part = jax.lax.dot_general(xa, bt, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
                part = jnp.where(tok_live[:, None], part, 0.0)  # dead rows add zero (no mask in interpret mode)
                plgpu.atomic_add(d_ref, (pl.ds(start, block_t), pl.ds(g * fout + o * b_col_tile, b_col_tile)), part,
                                 mask=None if interpret else jnp.broadcast_to(tok_live[:, None], part.shape))

            if not prefetch_next:
                jax.lax.fori_loop(lo, hi, lambda o, c: (add_b(o, load_b(o)), c)[1], 0)
            else:  # the next tile's gather is issued before this tile's product and atomic add
                def trip(o, cur):
                    nxt = load_b(o + 1)
                    add_b(o, cur)
                    return nxt
                last = jax.lax.fori_loop(lo, hi - 1, trip, load_b(lo))

                @pl.when(hi > lo)
                def _():
                    add_b(hi - 1, last)

    _blocks(p, n_programs, total_ref, sched_ref, block)


# ---------------------------------------------------------------------------------------------
# Builders: the block schedule, the grid and the pallas_call.


def _block_schedule(ranks, seg_starts, t: int, block_t: int, rank_tile: int | None = None,
                    max_rank: int | None = None, xp=jnp):
    """The token blocks of all slots, back to back: sched [3, NB] = (slot, first token, segment end)
    and total [1], the number of live blocks. NB = floor((T + Sa*(block_t-1)) / block_t) bounds
    sum_s ceil(len_s / block_t); blocks past `total` are never visited.

    With rank_tile (compact_tiles): the live (block, rank tile) items instead, a slot of rank r
    having ceil(min(r, max_rank) / rank_tile) tiles in each of its blocks: sched [4, NB * tiles],
    row 3 the rank tile. xp = jnp: in the graph (the kernels' fallback when no schedule is given);
    np: on the host (block_schedule, shrink_schedule, which the engine passes)."""
    sa = ranks.shape[0]
    seg_starts = xp.clip(seg_starts, 0, t)
    lens = xp.maximum(seg_starts[1:] - seg_starts[:-1], 0)
    nblk = xp.where(ranks > 0, (lens + block_t - 1) // block_t, 0)
    nb = max(1, (t + sa * (block_t - 1)) // block_t)
    if rank_tile is None:
        items, n = nblk, nb
    else:
        ntile = (xp.minimum(ranks, max_rank) + rank_tile - 1) // rank_tile
        items, n = nblk * ntile, nb * -(-max_rank // rank_tile)
    ends = xp.cumsum(items)
    i = xp.arange(n, dtype=xp.int32)
    if xp is jnp:
        slot = jnp.searchsorted(ends, i, side="right", method="compare_all")  # one fused op on GPU
    else:
        slot = np.searchsorted(ends, i, side="right")
    slot = xp.minimum(slot, sa - 1).astype(xp.int32)
    local = i - (ends[slot] - items[slot])  # this item's place among its slot's
    if rank_tile is None:
        rows = [slot, seg_starts[slot] + local * block_t, seg_starts[slot + 1]]
    else:
        per = xp.maximum(ntile[slot], 1)
        rows = [slot, seg_starts[slot] + (local // per) * block_t, seg_starts[slot + 1], local % per]
    return xp.stack(rows).astype(xp.int32), ends[-1:].astype(xp.int32), n


def block_schedule(ranks, seg_starts, t: int, block_t: int = BLOCK_T, rank_tile: int | None = None,
                   max_rank: int | None = None):
    """`_block_schedule` on the host (numpy): (sched, total [1]) int32, the same arrays. The engine
    builds it once per step and module while it builds the step's other inputs, and passes it as
    `schedule=`: the kernels then launch without the schedule's small XLA ops."""
    sched, total, _ = _block_schedule(np.asarray(ranks, np.int32), np.asarray(seg_starts, np.int32), t, block_t,
                                      rank_tile, max_rank, xp=np)
    return sched, total


def shrink_schedule(ranks, seg_starts, t: int, block_t: int = BLOCK_T, *, max_rank: int):
    """The schedule lora_shrink(_group) takes as `schedule=`, on the host: with compact_tiles (the
    default) the live (block, rank tile) items of the slots' ranks (a group's: the largest rank of
    each slot over its modules), else the plain block schedule. Read BLOCKS when the step is built,
    as the kernel reads it when traced."""
    compact = BLOCKS["shrink"].get("compact_tiles", False)
    return block_schedule(ranks, seg_starts, t, block_t, BLOCKS["shrink"]["rank_tile"] if compact else None,
                          max_rank)


def decode_block_t(backend: str, kernel: str = "expand", width: int | None = None,
                   features: int | None = None) -> int:
    """The block_t the engine gives a decode step's `kernel` ("shrink" or "expand") under
    `backend`: 1 (MBGMV) where BLOCKS["mbgmv"][kernel] is on, for the Pallas shrink and expand only
    (the Triton twins' and the fused kernel's products are dots of 16 rows); else BLOCK_T. For the
    shrink of a module of `features` inputs on a pool of row width `width` (both given): 1 only
    where its column tile reaches BLOCKS["mbgmv"]["col_tile"] (at 256, block_t 1 loses: llama-7b's
    down projection, in 11008 = 43 * 256, 15 -> 32 us at issue 4's point)."""
    if BLOCKS["mbgmv"][kernel] and backend == "pallas" and not BLOCKS["fused"]["decode"]:
        cap = BLOCKS["mbgmv"]["col_tile"]
        if kernel == "expand" or width is None or _col_tile(width, features, cap) >= cap:
            return 1
    return BLOCK_T


def few_slots_bucket(n: int, rows: int) -> int | None:
    """BLOCKS["mbgmv"]["few_slots"] where a kernel decode step of n distinct adapters in a batch
    bucket of `rows` takes that slot bucket (n <= few_slots, rows >= 4 x few_slots), else None."""
    few = BLOCKS["mbgmv"].get("few_slots")
    return few if few and n <= few and rows >= 4 * few else None


def mbgmv_shrink(slots: int, rows: int) -> bool:
    """Whether a kernel decode step of `slots` slots in a batch bucket of `rows` rows may shrink at
    block_t 1: not where few_slots_bucket applies (its adapters hold many tokens each)."""
    return few_slots_bucket(slots, rows) is None


def fused_applies(t: int) -> bool:
    """Whether the engine's Pallas LoRA path takes lora_fused_apply for a call of t tokens: with
    BLOCKS["fused"]["decode"] on, for calls of at most its max_tokens (decode steps)."""
    return bool(BLOCKS["fused"]["decode"]) and t <= BLOCKS["fused"]["max_tokens"]


def fused_schedule(ranks, seg_starts, t: int, block_t: int = BLOCK_T, *, max_rank: int):
    """The schedule lora_fused_apply takes as `schedule=`, on the host: the live (block, rank tile)
    items at BLOCKS["fused"]["rank_tile"]."""
    return block_schedule(ranks, seg_starts, t, block_t, BLOCKS["fused"]["rank_tile"], max_rank)


def _plan_blocks(ranks, seg_starts, t: int, max_rank: int, block_t: int, max_programs: int,
                 schedule=None, clamp: bool = True, rank_tile: int | None = None):
    """The launch schedule shared by every shrink and expand (Pallas and Triton): ranks clamped to
    max_rank (clamp=False: left to the kernel, which clamps each slot's rank as it reads it: no
    XLA op per call), the schedule and its live total (`schedule`, from block_schedule, or with
    rank_tile (compact_tiles) from shrink_schedule, if given), the item bound and the program count."""
    ranks = ranks.astype(jnp.int32)
    if clamp:
        ranks = jnp.minimum(ranks, max_rank)
    if schedule is None:
        sched, total, n = _block_schedule(ranks, seg_starts.astype(jnp.int32), t, block_t, rank_tile, max_rank)
    else:
        sched, total = schedule
        n = max(1, (t + ranks.shape[0] * (block_t - 1)) // block_t)
        shape, name = (3, n), "block_schedule"
        if rank_tile is not None:
            n *= -(-max_rank // rank_tile)
            shape, name = (4, n), "shrink_schedule"
        if sched.shape != shape or total.shape != (1,):
            raise ValueError(f"schedule shapes {sched.shape}, {total.shape} are not {name}'s for {t} tokens, "
                             f"{ranks.shape[0]} slots, block_t {block_t}: {shape}, (1,)")
        sched, total = sched.astype(jnp.int32), total.astype(jnp.int32)
    return ranks, sched, total, n, min(n, max_programs)


def _col_tile(width: int, features: int, cap: int) -> int:
    g = math.gcd(width, features)
    return min(g & -g, cap)  # the largest power of two dividing W and the features, capped


def _compiler_params(interpret: bool, blocks: dict):
    if interpret:
        return None
    return plgpu.CompilerParams(num_warps=blocks["num_warps"], num_stages=blocks["num_stages"])


def _check_block_t(block_t: int, mbgmv: bool = False):
    """block_t: a power of two >= 16 (Triton's dot sides); mbgmv (the Pallas shrink and expand): or 1."""
    if not (mbgmv and block_t == 1) and (block_t < 16 or block_t & (block_t - 1)):
        raise ValueError(f"block_t must be {'1 (MBGMV) or ' if mbgmv else ''}a power of two >= 16 "
                         f"(Triton dot sides), got {block_t}")


@functools.partial(jax.jit, static_argnames=("max_rank", "in_features", "interpret", "block_t",
                                             "max_programs"))
def _shrink(x, rows, a_rows, ranks, seg_starts, schedule, *, max_rank, in_features, interpret, block_t,
            max_programs):
    """xa of one module (a_rows [Sa, RA], ranks [Sa]) or of G modules sharing x (a_rows [G, Sa, RA],
    ranks [G, Sa]): [T', G * Rw], module g's columns from g * Rw; Rw is max_rank padded to whole rank
    tiles, T' >= T (padded to whole blocks with split_k > 1). The schedule covers the slots live in any module."""
    t, width = x.shape[0], rows.shape[1]
    blocks = BLOCKS["shrink"]
    cap = BLOCKS["mbgmv"]["col_tile"] if block_t == 1 else blocks["col_tile"]
    rank_tile, col_tile = blocks["rank_tile"], _col_tile(width, in_features, cap)
    grouped = a_rows.ndim == 3
    a_rows, ranks = (a_rows, ranks) if grouped else (a_rows[None], ranks[None])
    n_modules, slots = ranks.shape
    # The slots live in any module, with compact_tiles each slot's largest rank over them (a
    # reduction only where the schedule is built here).
    compact = blocks.get("compact_tiles", False)
    live = ranks[0] if schedule is not None or n_modules == 1 else ranks.max(axis=0)
    _, sched, total, _, n_programs = _plan_blocks(live, seg_starts, t, max_rank, block_t, max_programs, schedule,
                                                  clamp=False, rank_tile=rank_tile if compact else None)
    ranks = ranks.astype(jnp.int32).reshape(-1)  # clamped in the kernel
    split_k = blocks.get("split_k", 1) if t <= blocks.get("split_k_max_tokens", t) else 1
    split_k = max(1, min(split_k, in_features // col_tile))
    tiles = pl.cdiv(max_rank, rank_tile)
    # Each module's columns padded to whole rank tiles, so that an expand's tile loads stay inside
    # xa (a max rank below one tile included); split_k > 1: the rows too (atomic adds take no mask
    # in interpret mode); split_partials: one plane of partial sums per split, plain stores instead
    # of atomic adds
    rows_out, module_cols = (t if split_k == 1 else t + block_t), tiles * rank_tile
    partials = split_k > 1 and blocks.get("split_partials", False)
    kernel = functools.partial(
        _shrink_kernel, n_programs=n_programs, block_t=block_t, rank_tile=rank_tile,
        col_tile=col_tile, fin=in_features, width=width,
        dtype=jnp.promote_types(x.dtype, rows.dtype), split_k=split_k, interpret=interpret,
        slots=slots, tiles=tiles, module_cols=module_cols, max_rank=max_rank,
        static_split=blocks.get("static_split", False), prefetch_next=blocks.get("prefetch_next", False),
        hoist_rows=blocks.get("hoist_rows", False), compact_tiles=compact,
        early_loads=blocks.get("early_loads", False), partials=partials,
        splits_first=blocks.get("splits_first", False))
    shape = (split_k, rows_out, n_modules * module_cols) if partials else (rows_out, n_modules * module_cols)
    return pl.pallas_call(
        kernel,
        grid=_grid((n_programs, n_modules if compact else n_modules * tiles, split_k),
                   blocks.get("splits_first", False)),
        out_shape=jax.ShapeDtypeStruct(shape, jnp.float32),
        input_output_aliases={6: 0},  # written only where live: the rest stays zero
        interpret=interpret,
        compiler_params=_compiler_params(interpret, blocks),
        name="lora_shrink",
    )(total, sched, ranks, a_rows.reshape(n_modules * slots, -1).astype(jnp.int32), x, rows,
      jnp.zeros(shape, jnp.float32))


@functools.partial(jax.jit, static_argnames=("max_rank", "out_features", "interpret", "block_t",
                                             "max_programs", "xa_col"))
def _expand(y, xa, rows, b_rows, ranks, seg_starts, schedule, *, max_rank, out_features, interpret, block_t,
            max_programs, xa_col=0):
    t, width = y.shape[0], rows.shape[1]
    blocks = BLOCKS["expand"]
    rank_tile, col_cap = blocks["rank_tile"], blocks["col_tile"]
    if block_t == 1:  # MBGMV: the accumulator is one row, so wider tiles fit (BLOCKS["mbgmv"])
        rank_tile = BLOCKS["mbgmv"].get("expand_rank_tile") or rank_tile
        col_cap = BLOCKS["mbgmv"].get("expand_col_tile") or col_cap
    col_tile = _col_tile(width, out_features, col_cap)
    short = xa_col + pl.cdiv(max_rank, rank_tile) * rank_tile - xa.shape[-1]
    if short > 0:  # a rank tile's static slice must lie inside xa (masked columns read as zero)
        xa = jnp.pad(xa, [(0, 0)] * (xa.ndim - 1) + [(0, short)])
    ranks, sched, total, nb, n_programs = _plan_blocks(ranks, seg_starts, t, max_rank, block_t, max_programs,
                                                       schedule, clamp=False)
    kernel = functools.partial(
        _expand_kernel, n_programs=n_programs, block_t=block_t, rank_tile=rank_tile,
        col_tile=col_tile, fout=out_features, width=width, dtype=rows.dtype, xa_col=xa_col, max_rank=max_rank,
        y_first=blocks.get("y_first", False), prefetch_next=blocks.get("prefetch_next", False),
        early_loads=blocks.get("early_loads", False), cols_first=blocks.get("cols_first", False))
    return pl.pallas_call(
        kernel,
        grid=_grid((n_programs, out_features // col_tile), blocks.get("cols_first", False)),
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        input_output_aliases={6: 0},  # base tokens keep y
        interpret=interpret,
        compiler_params=_compiler_params(interpret, blocks),
        name="lora_expand",
    )(total, sched, ranks, b_rows.astype(jnp.int32), xa.astype(jnp.float32), rows, y)


@functools.partial(jax.jit, static_argnames=("max_rank", "fin", "fout", "interpret", "block_t", "max_programs"))
def _fused(x, rows, a_rows, b_rows, ranks, seg_starts, schedule, *, max_rank, fin, fout, interpret, block_t,
           max_programs):
    """The delta [T + block_t, G * fout] float32 of G modules that read x (a_rows [G, Sa, RA],
    b_rows [G, Sa, RB], ranks [G, Sa]), module g's in columns g * fout on; rows past T are
    padding. The schedule covers the slots live in any module (each slot's largest rank)."""
    t, width = x.shape[0], rows.shape[1]
    blocks = BLOCKS["fused"]
    rank_tile = blocks["rank_tile"]
    n_modules, slots = ranks.shape
    a_tile, b_tile = _col_tile(width, fin, blocks["a_col_tile"]), _col_tile(width, fout, blocks["b_col_tile"])
    live = ranks[0] if schedule is not None or n_modules == 1 else ranks.max(axis=0)
    _, sched, total, _, n_programs = _plan_blocks(live, seg_starts, t, max_rank, block_t, max_programs, schedule,
                                                  clamp=False, rank_tile=rank_tile)
    n_split = max(1, min(blocks["n_split"], fout // b_tile))
    kernel = functools.partial(
        _fused_kernel, n_programs=n_programs, block_t=block_t, rank_tile=rank_tile, a_col_tile=a_tile,
        b_col_tile=b_tile, fin=fin, fout=fout, width=width, dtype=jnp.promote_types(x.dtype, rows.dtype),
        n_split=n_split, max_rank=max_rank, prefetch_next=blocks.get("prefetch_next", False), interpret=interpret,
        slots=slots)
    shape = (t + block_t, n_modules * fout)  # padded: a block's atomic adds never run past the buffer
    return pl.pallas_call(
        kernel,
        grid=(n_programs, n_split, n_modules),
        out_shape=jax.ShapeDtypeStruct(shape, jnp.float32),
        input_output_aliases={7: 0},
        interpret=interpret,
        compiler_params=_compiler_params(interpret, blocks),
        name="lora_fused",
    )(total, sched, ranks.astype(jnp.int32).reshape(-1), a_rows.reshape(n_modules * slots, -1).astype(jnp.int32),
      b_rows.reshape(n_modules * slots, -1).astype(jnp.int32), x, rows, jnp.zeros(shape, jnp.float32))


# ---------------------------------------------------------------------------------------------
# Public wrappers.


def _interpret(interpret):
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def lora_shrink(x, rows, a_rows, ranks, seg_starts, *, max_rank: int, in_features: int,
                interpret=None, block_t: int = BLOCK_T, max_programs: int | None = None, schedule=None):
    """xa [T, max_rank] float32: xa[t, :r_s] = x[t] @ A_s for the tokens of slot s, 0 elsewhere.

    x [T, in]; rows [N, W] (one layer's pool as rows); a_rows [Sa, RA] int32, RA =
    ceil(max_rank*in/W): row indices of A^T_s [r_s, in] flattened; ranks [Sa] (0: the slot has no A
    for this module); seg_starts [Sa+1]. Unused entries of a_rows may point at any row.
    schedule: shrink_schedule(ranks, seg_starts, T, block_t, max_rank=max_rank), built on the
    host; None: in the graph.
    """
    xa = lora_shrink_group(x, rows, (a_rows,), (ranks,), seg_starts, max_rank=max_rank, in_features=in_features,
                           interpret=interpret, block_t=block_t, max_programs=max_programs, schedule=schedule)
    if xa.ndim == 3:  # split_partials: the splits' planes
        xa = xa.sum(0)
    return xa[:x.shape[0], :max_rank]


def lora_shrink_group(x, rows, a_rows, ranks, seg_starts, *, max_rank: int, in_features: int, interpret=None,
                      block_t: int = BLOCK_T, max_programs: int | None = None, schedule=None, token_slot=None):
    """lora_shrink for G modules that read the same x (q, k and v), in one launch: a_rows and ranks
    are sequences of G per-module arrays, or already stacked [G, Sa, RA] and [G, Sa] (the engine
    stacks q, k and v on the host once a step: no stacking op in every layer). Returns xa
    [T', G * Rw] float32, module g's columns from g * Rw (Rw = xa.shape[-1] // G >= max_rank,
    T' >= T: split-K pads both to whole tiles); pass it to lora_expand with xa_col = g * Rw.
    With split-K and BLOCKS["shrink"]["split_partials"]: [split_k, T', G * Rw], each split's
    partial sums in its own plane (plain stores, no atomic adds), which lora_expand adds as it
    reads them; sum(0) gives the xa above.
    schedule: shrink_schedule of each slot's largest rank over the modules. token_slot: [T] each
    token's slot (-1: base), for the Mosaic GPU kernels (None: from seg_starts)."""
    assert x.shape[1] == in_features, (x.shape, in_features)

    def stack(v):
        if not isinstance(v, (list, tuple)):
            return v if v.shape[0] > 1 else v[0]  # stacked by the caller
        return jnp.stack([jnp.asarray(a) for a in v]) if len(v) > 1 else v[0]
    if block_t == 1 and mgpu_decode(rows.shape[1], in_features, "shrink"):  # a decode step's (MBGMV)
        from pallas_kernels import lora_mgpu
        a, r = stack(a_rows), stack(ranks)  # to [G, Sa, RA] and [G, Sa], G = 1 included
        a, r = a.reshape(-1, *a.shape[-2:]), r.reshape(-1, r.shape[-1])
        opts = dict(max_rank=max_rank, rows_per_program=BLOCKS["mgpu"]["shrink_rows"], interpret=_interpret(interpret))
        if BLOCKS["mgpu"]["per_slot"]:
            return lora_mgpu.shrink_by_slot(x, rows, a, r, seg_starts, slot_tokens=BLOCKS["mgpu"]["slot_tokens"],
                                            **opts)
        return lora_mgpu.shrink(x, rows, a, r, _slots(token_slot, seg_starts, x.shape[0]), **opts)
    if _col_tile(rows.shape[1], in_features, BLOCKS["shrink"]["col_tile"]) < 16:
        # No column tile of >= 16 (Triton's smallest dot side) divides both W and `in`: toy widths.
        return jnp.concatenate([lora_shrink_reference(x, rows, a, r, seg_starts, max_rank=max_rank,
                                                      in_features=in_features) for a, r in zip(a_rows, ranks)], 1)
    _check_block_t(block_t, mbgmv=True)
    shrink = functools.partial(_shrink, max_rank=max_rank, in_features=in_features, interpret=_interpret(interpret),
                               block_t=block_t, max_programs=max_programs or BLOCKS["shrink"]["max_programs"])
    return shrink(x, rows, stack(a_rows), stack(ranks), seg_starts, schedule)


def lora_expand(y, xa, rows, b_rows, ranks, seg_starts, *, max_rank: int, out_features: int,
                interpret=None, block_t: int = BLOCK_T, max_programs: int | None = None, schedule=None,
                xa_col: int = 0, decode: bool = False, token_slot=None):
    """y + xa[:, xa_col:xa_col + r_s] @ B_s for the tokens of slot s (base tokens unchanged), in
    y's dtype. decode: a decode step's call (its shrink ran at block_t 1), which the Mosaic GPU
    expand takes where BLOCKS["mgpu"] says so (mgpu_decode; token_slot as for lora_shrink_group).

    y [T, out]; xa [T' >= T, >= xa_col + max_rank] float32 (from lora_shrink, or lora_shrink_group
    with xa_col = g * Rw), or [S, T', ...]: S planes of partial sums, added as they are read;
    b_rows [Sa, RB] int32 row indices of scale*B_s [r_s, out] flattened. The product runs in the
    pool's dtype, accumulated in float32.
    """
    assert y.shape[1] == out_features and xa.shape[-2] >= y.shape[0] and xa.shape[-1] >= xa_col + max_rank, \
        (y.shape, xa.shape, out_features, xa_col)
    if decode and mgpu_decode(rows.shape[1], out_features, "expand"):
        from pallas_kernels import lora_mgpu
        xa2 = xa.sum(0) if xa.ndim == 3 else xa  # a Triton shrink's split planes
        opts = dict(max_rank=max_rank, xa_col=xa_col, col_tile=BLOCKS["mgpu"]["col_tile"],
                    interpret=_interpret(interpret))
        if BLOCKS["mgpu"]["per_slot"]:
            return lora_mgpu.expand_by_slot(y, xa2[:y.shape[0]], rows, b_rows, ranks, seg_starts,
                                            slot_tokens=BLOCKS["mgpu"]["slot_tokens"], **opts)
        return lora_mgpu.expand(y, xa2[:y.shape[0]], rows, b_rows, ranks, _slots(token_slot, seg_starts, y.shape[0]),
                                **opts)
    if _col_tile(rows.shape[1], out_features, BLOCKS["expand"]["col_tile"]) < 16:
        # See lora_shrink.
        xa2 = xa.sum(0) if xa.ndim == 3 else xa
        return lora_expand_reference(y, xa2[:y.shape[0], xa_col:xa_col + max_rank], rows, b_rows, ranks, seg_starts,
                                     max_rank=max_rank, out_features=out_features)
    _check_block_t(block_t, mbgmv=True)
    return _expand(y, xa, rows, b_rows, ranks, seg_starts, schedule, max_rank=max_rank,
                   out_features=out_features, interpret=_interpret(interpret), block_t=block_t,
                   max_programs=max_programs or BLOCKS["expand"]["max_programs"], xa_col=xa_col)


def lora_apply(y, x, rows, a_rows, b_rows, ranks, seg_starts, *, max_rank: int, fin: int, fout: int,
               **kernel_options):
    """y + (x @ A_s) @ B_s for the tokens of slot s, base tokens unchanged, in y's dtype: shrink, then
    expand straight into y (no delta buffer, no separate add)."""
    return lora_apply_group((y,), x, rows, (a_rows,), (b_rows,), (ranks,), seg_starts, max_rank=max_rank,
                            fin=fin, fouts=(fout,), **kernel_options)[0]


def _shrink_options(kernel_options: dict, shrink_schedule, shrink_block_t) -> dict:
    """The shrink's options: its own schedule if given; else the expand's (block_schedule) where
    the shrink takes that one too (compact_tiles off, same block_t); else None (built in the
    graph). Its own block_t if given."""
    schedule = kernel_options.get("schedule")
    own_bt = shrink_block_t is not None and shrink_block_t != kernel_options.get("block_t", BLOCK_T)
    if shrink_schedule is None and schedule is not None and (BLOCKS["shrink"].get("compact_tiles", False) or own_bt):
        schedule = None
    out = {**kernel_options, "schedule": schedule if shrink_schedule is None else shrink_schedule}
    if shrink_block_t is not None:
        out["block_t"] = shrink_block_t
    return out


def lora_apply_group(ys, x, rows, a_rows, b_rows, ranks, seg_starts, *, max_rank: int, fin: int, fouts,
                     shrink_schedule=None, shrink_block_t: int | None = None, **kernel_options):
    """lora_apply for G modules that read the same x: one shrink launch (lora_shrink_group), then
    one expand per module into its own y. ys, a_rows, b_rows, ranks, fouts: one per module.
    schedule= (block_schedule) goes to the expands, shrink_schedule= (shrink_schedule) to the
    shrink; either None: built in the graph. shrink_block_t: the shrink's block_t where it
    differs from the expands' (block_t=), e.g. 1 (MBGMV) for a decode step's shrink."""
    xa = lora_shrink_group(x, rows, a_rows, ranks, seg_starts, max_rank=max_rank, in_features=fin,
                           **_shrink_options(kernel_options, shrink_schedule, shrink_block_t))
    cols = xa.shape[-1] // len(ys)
    return tuple(lora_expand(y, xa, rows, b, r, seg_starts, max_rank=max_rank, out_features=f, xa_col=g * cols,
                             decode=shrink_block_t == 1, **kernel_options)
                 for g, (y, b, r, f) in enumerate(zip(ys, b_rows, ranks, fouts)))


def mgpu_decode(width: int, features: int, kind: str) -> bool:
    """BLOCKS["mgpu"]: whether a decode step's shrink (features: its `in`) or expand (its `out`)
    goes to the Mosaic GPU pair (lora_mgpu.py): where one A^T / B row is one pool row."""
    from pallas_kernels import lora_mgpu
    blocks = BLOCKS["mgpu"]
    if not (blocks["decode"] if blocks["decode"] is not None else lora_mgpu.hopper()):
        return False
    return lora_mgpu.shrink_applies(width, features) if kind == "shrink" else \
        lora_mgpu.expand_applies(width, features, blocks["col_tile"])


def lora_fused_apply(y, x, rows, a_rows, b_rows, ranks, seg_starts, *, max_rank: int, fin: int, fout: int,
                     **kernel_options):
    """lora_apply in one launch (BLOCKS["fused"]): y + (x @ A_s) @ B_s for the tokens of slot s, base
    tokens unchanged, in y's dtype. xa never leaves the program that computes it; the delta is
    summed by atomic adds into a float32 buffer that one XLA fusion adds to y. schedule: the
    compact (block, rank tile) items at BLOCKS["fused"]["rank_tile"] (fused_schedule); None: built
    in the graph."""
    d = lora_fused_delta(x, rows, a_rows[None], b_rows[None], ranks[None], seg_starts, max_rank=max_rank, fin=fin,
                         fout=fout, **kernel_options)
    return (y.astype(jnp.float32) + d[:y.shape[0]]).astype(y.dtype)


def lora_fused_delta(x, rows, a_rows, b_rows, ranks, seg_starts, *, max_rank: int, fin: int, fout: int,
                     interpret=None, block_t: int = BLOCK_T, max_programs: int | None = None, schedule=None):
    """The LoRA deltas of G modules that read the same x and have the same fout (q, k and v of a
    multi-head model) in one fused launch: [T' >= T, G * fout] float32, module g's in columns
    g * fout on, 0 for base tokens. a_rows [G, Sa, RA], b_rows [G, Sa, RB], ranks [G, Sa];
    schedule: fused_schedule of each slot's largest rank over the modules (None: in the graph)."""
    blocks = BLOCKS["fused"]
    if min(_col_tile(rows.shape[1], fin, blocks["a_col_tile"]), _col_tile(rows.shape[1], fout, blocks["b_col_tile"])) < 16:
        # toy widths: the reference (see lora_shrink)
        return jnp.concatenate([lora_delta(x, rows, a, b, r, seg_starts, max_rank=max_rank, fin=fin, fout=fout,
                                           backend="xla") for a, b, r in zip(a_rows, b_rows, ranks)], axis=1)
    _check_block_t(block_t)
    return _fused(x, rows, a_rows, b_rows, ranks, seg_starts, schedule, max_rank=max_rank, fin=fin, fout=fout,
                  interpret=_interpret(interpret), block_t=block_t,
                  max_programs=blocks["max_programs"] if max_programs is None else max_programs)


def lora_delta(x, rows, a_rows, b_rows, ranks, seg_starts, *, max_rank: int, fin: int, fout: int,
               backend: str = "pallas", **kernel_options):
    """The LoRA delta [T, fout] float32: (x @ A_s) @ B_s per token of slot s, 0 for base tokens.
    Under "pallas" the expand reads the shrink's padded xa as it comes (as in the engine: no slice)."""
    if backend == "pallas":
        return lora_apply(jnp.zeros((x.shape[0], fout), jnp.float32), x, rows, a_rows, b_rows, ranks, seg_starts,
                          max_rank=max_rank, fin=fin, fout=fout, **kernel_options)
    if backend != "xla":
        raise ValueError(f"unknown LoRA backend {backend!r} (pallas | xla)")
    xa = lora_shrink_reference(x, rows, a_rows, ranks, seg_starts, max_rank=max_rank, in_features=fin)
    y = jnp.zeros((x.shape[0], fout), jnp.float32)
    return lora_expand_reference(y, xa, rows, b_rows, ranks, seg_starts, max_rank=max_rank, out_features=fout)


# ---------------------------------------------------------------------------------------------
# References (plain jnp): the correctness oracle for the kernels, and the "xla" backend.


_EXACT = jax.lax.Precision.HIGHEST  # an oracle: no TF32 for float32 inputs on GPU


def token_slot(seg_starts, t: int):
    """[T] the slot owning each token, -1 for base tokens."""
    sa = seg_starts.shape[0] - 1
    slot = jnp.searchsorted(seg_starts, jnp.arange(t), side="right") - 1
    return jnp.where((slot >= 0) & (slot < sa), slot, -1).astype(jnp.int32)


def _slots(given, seg_starts, t: int):
    """token_slot, given (the engine's, built on the host) or from seg_starts."""
    return token_slot(seg_starts, t) if given is None else jnp.asarray(given, jnp.int32)


def _pool_weights(rows, idx, ranks, max_rank: int, features: int):
    """[Sa, max_rank, features]: each slot's flattened matrix from its rows, rows >= rank zeroed."""
    sa = idx.shape[0]
    w = rows[idx].reshape(sa, -1)[:, :max_rank * features].reshape(sa, max_rank, features)
    live = jnp.arange(max_rank)[None, :] < ranks[:, None]
    return jnp.where(live[:, :, None], w, 0)


def _one_hot(seg_starts, ranks, t: int, max_rank: int):
    """[T, Sa, R]: token t belongs to slot s and rank column j < r_s."""
    sel = token_slot(seg_starts, t)[:, None] == jnp.arange(ranks.shape[0])[None, :]
    return sel[:, :, None] & (jnp.arange(max_rank)[None, None, :] < ranks[None, :, None])


@functools.partial(jax.jit, static_argnames=("max_rank", "in_features"))
def lora_shrink_reference(x, rows, a_rows, ranks, seg_starts, *, max_rank: int, in_features: int):
    dtype = jnp.promote_types(x.dtype, rows.dtype)
    a = _pool_weights(rows, a_rows, ranks, max_rank, in_features).astype(dtype)  # A^T [Sa, R, in]
    xa = jnp.einsum("ti,sri->tsr", x.astype(dtype), a, preferred_element_type=jnp.float32,
                    precision=_EXACT)
    keep = _one_hot(seg_starts, ranks, x.shape[0], max_rank)
    return jnp.where(keep, xa, 0).sum(axis=1)


@functools.partial(jax.jit, static_argnames=("max_rank", "out_features"))
def lora_expand_reference(y, xa, rows, b_rows, ranks, seg_starts, *, max_rank: int,
                          out_features: int):
    b = _pool_weights(rows, b_rows, ranks, max_rank, out_features)  # [Sa, R, out]
    keep = _one_hot(seg_starts, ranks, y.shape[0], max_rank)
    xa = jnp.where(keep, xa.astype(jnp.float32)[:, None, :], 0).astype(rows.dtype)
    delta = jnp.einsum("tsr,sro->to", xa, b, preferred_element_type=jnp.float32, precision=_EXACT)
    return (y.astype(jnp.float32) + delta).astype(y.dtype)
