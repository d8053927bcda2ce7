"""LoRA shrink and expand for decode steps as Mosaic GPU kernels (Pallas:MGPU, Hopper and later):
S-LoRA's MBGMV, with each program's pool rows gathered by TMA.

Why a second pair. The Triton-lowered kernels (lora.py) are latency-bound in a decode step: each
program gathers its rows with ordinary loads in a loop, a few KB in flight at a time, and reaches
~2 TB/s over the S2 step's ~9.8 GB of adapter rows (bench/NOTES.md, sessions 12-15). Here one
thread of a program issues every row copy of its tile at once (TMA, `copy_gmem_to_smem`), so each
program has its whole tile (8 rows of A^T, 64 KB at W 4096; or up to max_rank rows of a column
tile of B) in flight before it computes anything.

Scope. Decode steps (the engine's block_t 1 launches). Two forms: one program per slot
block (`shrink_by_slot`, `expand_by_slot`; BLOCKS["mgpu"]["per_slot"], the default), which copies
the slot's rows once and loops over up to `slot_tokens` of the slot's tokens, so an adapter's
weights are read once a step for every block of its tokens; or one program per token (`shrink`,
`expand`), whose tokens of one adapter re-read its rows (from L2 after the first). The kernels
apply where one A^T row (shrink) or one B row (expand) is exactly one pool row, i.e. `in` == W or
`out` == W (llama-7b's q, k, v and o at W 4096: S-LoRA's S1-S4 adapters). Everything else takes lora.py's
kernels (`shrink_applies`, `expand_applies`; each launch decides alone, and either expand reads
either shrink's xa).

- shrink: grid (token, module, rank tile of n rows: BLOCKS["mgpu"]["shrink_rows"]). The program
  copies its n rows of A^T and x[t] into shared memory, then writes xa[t, g*Rw + k*n + j] =
  x[t] . A^T[j] for the live rows (j < rank), 0 for the rest and for base tokens. Modules that
  read the same x (q, k, v) share the launch (axis 1), as in lora.py.
- expand: grid (token, column tile of C). The program issues the copies of all its live rank
  tiles (ceil(rank / ROWS) tiles of ROWS rows x C columns, each on its own barrier), then adds
  xa[t, j] * B[j, cols] tile by tile into y[t, cols]. Every program writes its y tile, base tokens
  unchanged, so the output needs no aliasing.

A row index past the slot's rank still names some pool row ("unused entries may point at any
row", lora.py): its copy is made and its product multiplied by 0 (shrink: the result is replaced
by 0). Tiles past the rank are never copied and never read.

The bodies run in Mosaic GPU's interpreter on the CPU (tests) and lower to Mosaic GPU on a GPU.
Off in the engine by default (`lora.BLOCKS["mgpu"]`, whose comment has the H200's figures): on
the H200 the pair beats the Triton-lowered one where adapters hold ~1 token each (S2's decode
step, -5% of LoRA kernel time) and loses where they hold several (4 each: +12%).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.lora import _block_schedule

ROWS = 8          # rows a shrink program copies by default, and an expand rank tile's rows
COL_TILE = 512    # expand: columns a program owns (its shared memory: max_rank x COL_TILE x 2 B)
LANE = 256        # a TMA copy moves at most 256 elements along each dimension: rows are viewed
                  # as [W // LANE, LANE], so one copy still moves a whole row (or column tile)


def shrink_applies(width: int, fin: int) -> bool:
    """Whether the Mosaic GPU shrink can take a launch: one A^T row is one pool row."""
    return fin == width and width % LANE == 0


def expand_applies(width: int, fout: int, col_tile: int = COL_TILE) -> bool:
    """Whether the Mosaic GPU expand can take a launch: one B row is one pool row."""
    return fout == width and col_tile % LANE == 0 and width % col_tile == 0


def hopper() -> bool:
    """Whether the default device runs these kernels compiled: a GPU of compute capability 9.0 or
    later (TMA): what BLOCKS["mgpu"]["decode"] None means."""
    d = jax.devices()[0]
    if d.platform != "gpu":
        return False
    try:
        return float(getattr(d, "compute_capability", "0")) >= 9.0
    except ValueError:
        return False


def _interpret(interpret):
    if interpret is None:
        interpret = jax.devices()[0].platform != "gpu"
    return plgpu.InterpretGPUParams() if interpret else None


def _tiles(max_rank: int) -> int:
    return -(-max_rank // ROWS)


def _copy_a_rows(rows_ref, a_rows_ref, a_smem, bar, base, k, n_rows, ra):
    """Issue the copies of rank rows k*n_rows .. k*n_rows + n_rows - 1 of one A^T into a_smem."""
    for j in range(n_rows):
        row = a_rows_ref[base + jnp.minimum(k * n_rows + j, ra - 1)]
        plgpu.copy_gmem_to_smem(rows_ref.at[pl.ds(row, 1)], a_smem.at[pl.ds(j, 1)], bar)


def _store_dots(xa_ref, t, col, a_smem, xv, live, n_rows):
    """xa[t, col + j] = A^T row j . x[t] for the live rows j < live, 0 past them."""
    for j in range(n_rows):
        xa_ref[t, col + j] = jnp.where(j < live, jnp.sum(a_smem[j].astype(jnp.float32) * xv), 0.0)


def _store_zeros(xa_ref, t, col, n_rows):
    for j in range(n_rows):
        xa_ref[t, col + j] = jnp.float32(0.0)


def _shrink_body(slot_ref, ranks_ref, a_rows_ref, x_ref, rows_ref, xa_ref, a_smem, x_smem, bar, *,
                 n_slots, ra, rw, n_rows):
    t, g, k = (jax.lax.axis_index(n) for n in ("t", "g", "k"))
    s = slot_ref[t]
    sc = jnp.maximum(s, 0)
    r = jnp.where(s >= 0, ranks_ref[g * n_slots + sc], 0)
    live = r - k * n_rows  # rows of this tile below the rank
    col = g * rw + k * n_rows

    @pl.when(live > 0)
    def _():
        base = (g * n_slots + sc) * ra
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(t, 1)], x_smem, bar)  # [1, W // LANE, LANE]
        _copy_a_rows(rows_ref, a_rows_ref, a_smem, bar, base, k, n_rows, ra)
        plgpu.barrier_wait(bar)
        _store_dots(xa_ref, t, col, a_smem, x_smem[0].astype(jnp.float32), live, n_rows)

    @pl.when(live <= 0)
    def _():
        _store_zeros(xa_ref, t, col, n_rows)


@functools.partial(jax.jit, static_argnames=("max_rank", "rows_per_program", "interpret"))
def shrink(x, rows, a_rows, ranks, slot, *, max_rank: int, rows_per_program: int = ROWS, interpret=None):
    """xa [T, G * Rw] float32, Rw = rows_per_program * ceil(max_rank / rows_per_program): module g's
    xa in columns g * Rw on, xa[t, g*Rw + j] = x[t] . A^T_{g,s}[j] for token t of slot s and
    j < r_{g,s}, 0 elsewhere.

    x [T, W]; rows [N, W]; a_rows [G, Sa, RA] int32 (RA >= max_rank: row j of A^T is pool row
    a_rows[g, s, j]); ranks [G, Sa]; slot [T] int32 (token_slot: -1 for base tokens).
    rows_per_program: A^T rows a program copies and multiplies (its shared memory: that many
    rows of W, plus x's)."""
    t, w = x.shape
    g, sa, ra = a_rows.shape
    n = rows_per_program
    tiles = -(-max_rank // n)
    body = functools.partial(_shrink_body, n_slots=sa, ra=ra, rw=tiles * n, n_rows=n)
    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((t, g * tiles * n), jnp.float32), grid=(t, g, tiles),
        grid_names=("t", "g", "k"), kernel_name="lora_shrink_mgpu",
        scratch_types=[plgpu.SMEM((n, w // LANE, LANE), rows.dtype), plgpu.SMEM((1, w // LANE, LANE), x.dtype),
                       plgpu.Barrier(num_arrivals=n + 1)],
        interpret=_interpret(interpret))
    return kernel(slot, ranks.reshape(-1).astype(jnp.int32), a_rows.reshape(-1).astype(jnp.int32),
                  x.reshape(t, w // LANE, LANE), rows.reshape(rows.shape[0], w // LANE, LANE))


def _expand_body(slot_ref, ranks_ref, b_rows_ref, xa_ref, rows_ref, y_ref, out_ref, b_smem, bars, *,
                 rb, tiles, col_tile, xa_col):
    t, c = jax.lax.axis_index("t"), jax.lax.axis_index("c")
    s = slot_ref[t]
    sc = jnp.maximum(s, 0)
    r = jnp.where(s >= 0, ranks_ref[sc], 0)
    n_tiles = (r + ROWS - 1) // ROWS
    cols = pl.ds(c * (col_tile // LANE), col_tile // LANE)  # [col_tile // LANE, LANE] of a row
    _copy_b_tiles(rows_ref, b_rows_ref, b_smem, bars, sc * rb, rb, tiles, n_tiles, cols)
    acc = y_ref[t, cols].astype(jnp.float32)
    acc = _add_b_tiles(acc, xa_ref, b_smem, bars, t, r, n_tiles, tiles=tiles, xa_col=xa_col, wait=True)
    out_ref[t, cols] = acc.astype(out_ref.dtype)


def _copy_b_tiles(rows_ref, b_rows_ref, b_smem, bars, base, rb, tiles, n_tiles, cols):
    """Issue the copies of the first n_tiles rank tiles of B (ROWS rows x `cols` each, tile k on
    barrier k): all in flight before the first product."""
    for k in range(tiles):
        @pl.when(k < n_tiles)
        def _():
            for j in range(ROWS):
                row = b_rows_ref[base + min(k * ROWS + j, rb - 1)]
                plgpu.copy_gmem_to_smem(rows_ref.at[pl.ds(row, 1), cols], b_smem.at[k, pl.ds(j, 1)], bars.at[k])


def _add_b_tiles(acc, xa_ref, b_smem, bars, t, r, n_tiles, *, tiles, xa_col, wait: bool):
    """acc + sum over the live rank rows j < r of xa[t, xa_col + j] * B[j, cols], tile by tile (a
    tile's barrier waited first where `wait`)."""
    for k in range(tiles):
        def add(a, k=k):
            if wait:
                plgpu.barrier_wait(bars.at[k])
            for j in range(ROWS):
                wj = jnp.where(k * ROWS + j < r, xa_ref[t, xa_col + k * ROWS + j], 0.0)
                a = a + wj * b_smem[k, j].astype(jnp.float32)
            return a
        acc = jax.lax.cond(k < n_tiles, add, lambda a: a, acc)
    return acc


@functools.partial(jax.jit, static_argnames=("max_rank", "xa_col", "col_tile", "interpret"))
def expand(y, xa, rows, b_rows, ranks, slot, *, max_rank: int, xa_col: int = 0, col_tile: int = COL_TILE,
           interpret=None):
    """y + xa[:, xa_col:xa_col + r_s] @ B_s for each token of slot s, base tokens unchanged, in y's
    dtype. y [T, W]; xa [T, >= xa_col + max_rank] float32; b_rows [Sa, RB] int32 (RB >= max_rank:
    row j of scale*B is pool row b_rows[s, j]); ranks [Sa]; slot [T] (token_slot)."""
    t, w = y.shape
    sa, rb = b_rows.shape
    tiles = _tiles(max_rank)
    lanes = (w // LANE, LANE)
    body = functools.partial(_expand_body, rb=rb, tiles=tiles, col_tile=col_tile, xa_col=xa_col)
    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((t, *lanes), y.dtype), grid=(t, w // col_tile), grid_names=("t", "c"),
        kernel_name="lora_expand_mgpu",
        scratch_types=[plgpu.SMEM((tiles, ROWS, col_tile // LANE, LANE), rows.dtype),
                       plgpu.Barrier(num_arrivals=ROWS, num_barriers=tiles)],
        interpret=_interpret(interpret))
    out = kernel(slot, ranks.astype(jnp.int32), b_rows.reshape(-1).astype(jnp.int32), xa.astype(jnp.float32),
                 rows.reshape(rows.shape[0], *lanes), y.reshape(t, *lanes))
    return out.reshape(t, w)


# -- one program per slot block (BLOCKS["mgpu"]["per_slot"]): a slot's rows are copied once and
# serve up to `slot_tokens` of its tokens (issue 4: an adapter's weights read once a step for the
# tokens that use it). Grid axis 0 runs over the slot blocks of lora.py's block schedule
# (`_block_schedule` at block_t = slot_tokens, in the graph: it depends on seg_starts alone, so XLA
# computes it once a step), then ceil(T / BASE_ROWS) more rows for the base tokens
# [seg_starts[Sa], T), BASE_ROWS tokens a row, whose programs write xa's zeros and copy y through:
# every output row is written by exactly one program and no output aliasing is needed.
# Why blocks and base rows: a program's token loop is serial. With one program per slot, a decode
# step padded to its power-of-two bucket (B 172 in a 256-row step) had one program per column tile
# copy 84 rows of y one after another, ~60 us at the end of every expand launch (session 17: the
# pair took 8.7 ms of the S2 step against the Triton pair's 5.0), and an adapter holding most of a
# step's tokens would serialise the same way.

BASE_ROWS = 8     # base tokens a program row handles
SLOT_TOKENS = 4   # a slot block's tokens (BLOCKS["mgpu"]["slot_tokens"])


def _base_rows(t_total: int) -> int:
    return -(-t_total // BASE_ROWS)


def _slot_blocks(seg_starts, t: int, slot_tokens: int):
    """lora.py's block schedule of every slot with tokens (rank aside: a rank-0 slot's tokens still
    get their xa zeros): sched [3 * NB] (slot, first token, segment end; row-major), total [1]."""
    sa = seg_starts.shape[0] - 1
    sched, total, n = _block_schedule(jnp.ones((sa,), jnp.int32), seg_starts.astype(jnp.int32), t, slot_tokens)
    return sched.reshape(-1), total, n


def _segment(sched_ref, total_ref, seg_ref, i, *, n_items: int, n_slots: int, t_total: int, slot_tokens: int):
    """(slot, lo, hi) of program row i: slot block i's slot and tokens for i < n_items (no tokens
    past the live total), else base chunk i - n_items with slot n_slots (no adapter)."""
    ic = jnp.minimum(i, n_items - 1)
    live = i < total_ref[0]
    b_lo = sched_ref[n_items + ic]
    b_hi = jnp.minimum(b_lo + slot_tokens, sched_ref[2 * n_items + ic])
    base_lo = jnp.minimum(seg_ref[n_slots] + (i - n_items) * BASE_ROWS, t_total)
    is_item = i < n_items
    lo = jnp.where(is_item, jnp.where(live, b_lo, 0), base_lo)
    hi = jnp.where(is_item, jnp.where(live, b_hi, 0), jnp.minimum(base_lo + BASE_ROWS, t_total))
    return jnp.where(is_item, sched_ref[ic], n_slots), lo, hi


def _shrink_slot_body(sched_ref, total_ref, seg_ref, ranks_ref, a_rows_ref, x_ref, rows_ref, xa_ref, a_smem, bar, *,
                      n_slots, ra, rw, n_rows, t_total, n_items, slot_tokens):
    i, g, k = (jax.lax.axis_index(n) for n in ("s", "g", "k"))
    s, lo, hi = _segment(sched_ref, total_ref, seg_ref, i, n_items=n_items, n_slots=n_slots, t_total=t_total,
                         slot_tokens=slot_tokens)
    sc = jnp.minimum(s, n_slots - 1)
    r = jnp.where(s < n_slots, ranks_ref[g * n_slots + sc], 0)
    live = r - k * n_rows
    col = g * rw + k * n_rows

    @pl.when((live > 0) & (hi > lo))
    def _():
        base = (g * n_slots + sc) * ra
        _copy_a_rows(rows_ref, a_rows_ref, a_smem, bar, base, k, n_rows, ra)  # once a block
        plgpu.barrier_wait(bar)

        def token(t, carry):  # x[t] [W // LANE, LANE] straight from HBM
            _store_dots(xa_ref, t, col, a_smem, x_ref[t].astype(jnp.float32), live, n_rows)
            return carry
        jax.lax.fori_loop(lo, hi, token, 0)

    @pl.when(live <= 0)
    def _():
        def zeros(t, carry):
            _store_zeros(xa_ref, t, col, n_rows)
            return carry
        jax.lax.fori_loop(lo, hi, zeros, 0)


@functools.partial(jax.jit, static_argnames=("max_rank", "rows_per_program", "slot_tokens", "interpret"))
def shrink_by_slot(x, rows, a_rows, ranks, seg_starts, *, max_rank: int, rows_per_program: int = ROWS,
                   slot_tokens: int = SLOT_TOKENS, interpret=None):
    """`shrink` with one program per (slot block, module, rank tile) instead of per token: the same
    xa. seg_starts [Sa + 1] (seg_starts[0] == 0): slot s owns tokens [seg_starts[s], seg_starts[s+1]);
    a slot block is up to slot_tokens of them."""
    t, w = x.shape
    g, sa, ra = a_rows.shape
    n = rows_per_program
    tiles = -(-max_rank // n)
    sched, total, n_items = _slot_blocks(seg_starts, t, slot_tokens)
    body = functools.partial(_shrink_slot_body, n_slots=sa, ra=ra, rw=tiles * n, n_rows=n, t_total=t,
                             n_items=n_items, slot_tokens=slot_tokens)
    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((t, g * tiles * n), jnp.float32),
        grid=(n_items + _base_rows(t), g, tiles), grid_names=("s", "g", "k"), kernel_name="lora_shrink_mgpu",
        scratch_types=[plgpu.SMEM((n, w // LANE, LANE), rows.dtype), plgpu.Barrier(num_arrivals=n)],
        interpret=_interpret(interpret))
    return kernel(sched, total, seg_starts.astype(jnp.int32), ranks.reshape(-1).astype(jnp.int32),
                  a_rows.reshape(-1).astype(jnp.int32), x.reshape(t, w // LANE, LANE),
                  rows.reshape(rows.shape[0], w // LANE, LANE))


def _expand_slot_body(sched_ref, total_ref, seg_ref, ranks_ref, b_rows_ref, xa_ref, rows_ref, y_ref, out_ref, b_smem,
                      bars, *, n_slots, rb, tiles, col_tile, xa_col, t_total, n_items, slot_tokens):
    i, c = jax.lax.axis_index("s"), jax.lax.axis_index("c")
    s, lo, hi = _segment(sched_ref, total_ref, seg_ref, i, n_items=n_items, n_slots=n_slots, t_total=t_total,
                         slot_tokens=slot_tokens)
    sc = jnp.minimum(s, n_slots - 1)
    r = jnp.where(s < n_slots, ranks_ref[sc], 0)
    n_tiles = jnp.where(hi > lo, (r + ROWS - 1) // ROWS, 0)
    cols = pl.ds(c * (col_tile // LANE), col_tile // LANE)
    _copy_b_tiles(rows_ref, b_rows_ref, b_smem, bars, sc * rb, rb, tiles, n_tiles, cols)  # once a block
    for k in range(tiles):
        @pl.when(k < n_tiles)
        def _():
            plgpu.barrier_wait(bars.at[k])

    def token(t, carry):
        acc = y_ref[t, cols].astype(jnp.float32)
        acc = _add_b_tiles(acc, xa_ref, b_smem, bars, t, r, n_tiles, tiles=tiles, xa_col=xa_col, wait=False)
        out_ref[t, cols] = acc.astype(out_ref.dtype)
        return carry
    jax.lax.fori_loop(lo, hi, token, 0)


@functools.partial(jax.jit, static_argnames=("max_rank", "xa_col", "col_tile", "slot_tokens", "interpret"))
def expand_by_slot(y, xa, rows, b_rows, ranks, seg_starts, *, max_rank: int, xa_col: int = 0,
                   col_tile: int = COL_TILE, slot_tokens: int = SLOT_TOKENS, interpret=None):
    """`expand` with one program per (slot block, column tile) instead of per token: the same y."""
    t, w = y.shape
    sa, rb = b_rows.shape
    tiles = _tiles(max_rank)
    lanes = (w // LANE, LANE)
    sched, total, n_items = _slot_blocks(seg_starts, t, slot_tokens)
    body = functools.partial(_expand_slot_body, n_slots=sa, rb=rb, tiles=tiles, col_tile=col_tile, xa_col=xa_col,
                             t_total=t, n_items=n_items, slot_tokens=slot_tokens)
    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((t, *lanes), y.dtype), grid=(n_items + _base_rows(t), w // col_tile),
        grid_names=("s", "c"), kernel_name="lora_expand_mgpu",
        scratch_types=[plgpu.SMEM((tiles, ROWS, col_tile // LANE, LANE), rows.dtype),
                       plgpu.Barrier(num_arrivals=ROWS, num_barriers=tiles)],
        interpret=_interpret(interpret))
    out = kernel(sched, total, seg_starts.astype(jnp.int32), ranks.astype(jnp.int32),
                 b_rows.reshape(-1).astype(jnp.int32), xa.astype(jnp.float32), rows.reshape(rows.shape[0], *lanes),
                 y.reshape(t, *lanes))
    return out.reshape(t, w)
