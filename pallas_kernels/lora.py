"""LoRA delta kernels over the unified pool: shrink (x @ A) and expand (y += xa @ B).

S-LoRA's MBGMM (prefill) and MBGMV (decode) in one pair of Pallas kernels. Tokens arrive grouped
by adapter slot: slot s owns tokens [seg_starts[s], seg_starts[s+1]); tokens from seg_starts[Sa] on
are base-model tokens. A^T [r, in] and scale*B [r, out] of each slot are read straight from a
layer's pool rows [N, W] through per-slot row indices (see slora_jax/model/layout.py); no per-token
copy of A or B exists.

Grid. The Triton lowering has neither scalar prefetch nor dynamic grid bounds, so the grid is static
and everything data-dependent is read inside the kernel. The host (or the graph, when no schedule is
passed) cuts every slot's segment into blocks of `block_t` tokens and lists them back to back
(lora_schedule.py): at most T/block_t + Sa blocks, none for base tokens, none for empty slots or
slots of rank 0. The shrink lists (block, rank tile) items of live rank tiles only, so no program
exists for a dead tile. Each program walks the list with stride `programs`, a loop whose trip count
is traced, so base tokens and empty slots cost at most one trivial pass per program. A slot's weight
tile is read by each of its blocks; concurrent programs work on consecutive blocks, i.e. on the
same slot, so it comes from HBM once and from L2 after.

Block_t 1 (the decode shrink where its column tile reaches gemv_col_tile, S-LoRA's MBGMV) gives each
decode token its own block, and the products become a multiply and a sum instead of dots of 16 rows
(Triton's smallest), so x and the accumulators are one row: fewer registers a program, more
programs an SM. The expand always takes dots of block_t >= 16 rows; xa is indexed by token, not by
block, so the shrink and the expand of one step may take different block_t.

Latency. The kernels are latency-bound per program, so each loop is a manual two-stage pipeline (the
next trip's gathers issued before this trip's product, `_loop`); the shrink reads its first schedule
column beside the live total and indexes its first tiles from max_rank, so its first gathers wait on
one round trip, not three; the expand loads its y tile before the rank loop.

Split-K (decode-sized calls, at most split_k_max_tokens tokens): the shrink's `in` columns are cut
into split_k ranges, each its own program, each storing its partial sums in its own plane of xa
([split_k, T', cols]); the expand adds the planes as it reads them. More programs in flight for a
decode step's few tokens per adapter, and no atomic adds.

Columns. Row j of A^T starts at flat element j*in of the slot's row stream, i.e. at row
a_rows[s, (j*in) // W], column (j*in) % W. A column tile is C columns with C a power of two dividing
both W and `in` (`out` for B), so a tile of one A^T row never straddles two pool rows, and a tile of
rank rows j..j+15 is one 2-D gather: a row index and a column offset per rank row. Widths whose
common power-of-two factor is below 16 (Triton's smallest dot side) fall back to the jnp reference.

Groups. Modules that read the same x (q, k and v) shrink in one launch (`lora_shrink_group`): grid
axis 1 walks modules, module g's A rows and ranks are row block g of the stacked arrays, and its xa
columns start at g * Rw. Each module then expands from its own columns
(`lora_expand(..., xa_col=g * Rw)`).

Settings: `ShrinkBlockSizes` and `ExpandBlockSizes`, frozen, passed as `block_sizes=` (static), tuned
per device kind in configs/lora.json. The same kernel bodies run in interpret mode (CPU) and
through the Triton lowering (GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.fuser  # noqa: F401 (see below)
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.block_sizes import device_kind, from_dict, load_tuned
from pallas_kernels.lora_schedule import BLOCK_T, block_schedule, plan_blocks, shrink_schedule  # noqa: F401

# `_fuser`: interpreting a pallas_call imports the fuser lazily, which adds a config to JAX's trace
# context, so every jit traced before the first kernel call would miss its cache once and compile
# twice. Importing it up front keeps the trace context fixed.

__all__ = ["BLOCK_T", "ShrinkBlockSizes", "ExpandBlockSizes", "block_schedule", "shrink_schedule",
           "gemv_shrink", "lora_shrink", "lora_shrink_group", "lora_expand", "lora_apply", "lora_apply_group",
           "lora_delta", "lora_shrink_reference", "lora_expand_reference", "token_slot"]

_CONFIGS = Path(__file__).parent / "configs" / "lora.json"


@dataclasses.dataclass(frozen=True)
class ShrinkBlockSizes:
    """The shrink's settings (the H200 values: bench/RESULTS.md, "lora kernels"). Triton wants
    power-of-two dot operands of at least 16 on every side. rank_tile: A^T rows a program;
    col_tile: a cap on the column tile (the tile is the largest power of two dividing W and `in`,
    at most the cap); gemv_col_tile: the cap at block_t 1, and the column tile a decode shrink must
    reach to take block_t 1 (gemv_shrink); split_k: column ranges of a call of at most
    split_k_max_tokens tokens (1: none); max_programs: programs walking the item list."""
    rank_tile: int = 16
    col_tile: int = 256
    gemv_col_tile: int = 1024
    num_warps: int = 4
    num_stages: int = 2
    split_k: int = 4
    split_k_max_tokens: int = 256
    max_programs: int = 256

    @classmethod
    def get_default(cls, device_kind_: str | None = None) -> "ShrinkBlockSizes":
        """The tuned settings of this device kind (the first JAX device's when None), else the defaults."""
        return from_dict(cls, load_tuned(_CONFIGS, device_kind(device_kind_)).get("shrink", {}))


@dataclasses.dataclass(frozen=True)
class ExpandBlockSizes:
    """The expand's settings (see ShrinkBlockSizes): rank_tile B rows a trip of the rank loop,
    col_tile a cap on the output columns a program."""
    rank_tile: int = 16
    col_tile: int = 128
    num_warps: int = 4
    num_stages: int = 2
    max_programs: int = 256

    @classmethod
    def get_default(cls, device_kind_: str | None = None) -> "ExpandBlockSizes":
        """The tuned settings of this device kind (the first JAX device's when None), else the defaults."""
        return from_dict(cls, load_tuned(_CONFIGS, device_kind(device_kind_)).get("expand", {}))


# ---------------------------------------------------------------------------------------------
# Kernels.


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


def _loop(lo, hi, load, use, acc):
    """acc after acc = use(load(i), acc) for i in [lo, hi), as a two-stage pipeline: the loads of
    i + 1 are issued before the product of i and carried into the next trip, so their latency
    overlaps it (load(lo) is issued even for an empty range: load must accept lo then)."""
    def trip(i, carry):
        a, cur = carry
        nxt = load(i + 1)
        return use(cur, a), nxt

    acc2, cur = jax.lax.fori_loop(lo, hi - 1, trip, (acc, load(lo)))
    return jnp.where(hi > lo, use(cur, acc2), acc2)


def _gather_tile(rows_ref, idx_ref, s, flat, width, col_tile):
    """[len(flat), C]: the C elements at each flat offset of slot s's row stream. C divides W and
    the matrix width, so a tile never straddles two pool rows."""
    rid = idx_ref[s, jax.lax.div(flat, width)]
    first_col = pl.multiple_of(jax.lax.rem(flat, width), col_tile)  # lets Triton vectorise the load
    cols = first_col[:, None] + jnp.arange(col_tile)[None, :]
    return rows_ref[rid[:, None], cols]


def _shrink_tiles(rows_ref, a_rows_ref, x_ref, s, first, col, start, j_live, tok_live, *, width, col_tile,
                  block_t, dtype):
    """One column chunk of a shrink: the A^T tile [rank_tile, C] of slot s's rank rows (flat offsets
    `first` + col; rows past the rank zeroed) and the x tile [block_t, C] (dead tokens zeroed)."""
    at = _gather_tile(rows_ref, a_rows_ref, s, first + col, width, col_tile)
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
                   n_programs, block_t, rank_tile, col_tile, fin, width, dtype, split_k, slots, module_cols,
                   max_rank):
    # Grid (program, module g, split q). The schedule lists live (block, rank tile) items (row 3:
    # the tile) of each slot's largest rank over the modules; module g's A rows and ranks are row
    # block g of a_rows and ranks ([G * Sa, ...]) and its xa columns start at g * module_cols.
    p, g, q = pl.program_id(0), pl.program_id(1), pl.program_id(2)  # q: this program's `in` columns
    n_chunks = fin // col_tile
    per_split = -(-n_chunks // split_k)

    def block(col):
        s0, start, end, k = col
        s = g * slots + s0                       # module g's row of slot s0
        r = jnp.minimum(ranks_ref[s], max_rank)  # clamped here, not by an XLA op per call
        tok_live = start + jnp.arange(block_t) < end
        j = k * rank_tile + jnp.arange(rank_tile)   # A^T rows (rank columns of xa)
        j_live = j < r
        # Rows past the rank read row max_rank - 1's indices (in bounds, a valid row; the tile is
        # zeroed there), so the first gathers need not wait for the rank's read.
        first = jnp.minimum(j, max_rank - 1) * fin

        def load(c):  # an empty split's first load reads the last chunk (not used)
            c = jnp.minimum(c, n_chunks - 1)
            return _shrink_tiles(rows_ref, a_rows_ref, x_ref, s, first, c * col_tile, start, j_live, tok_live,
                                 width=width, col_tile=col_tile, block_t=block_t, dtype=dtype)

        zero = jnp.zeros((block_t, rank_tile), jnp.float32)
        lo = q * per_split
        acc = _loop(lo, jnp.minimum(lo + per_split, n_chunks), load, _shrink_step, zero)
        cols = pl.ds(g * module_cols + k * rank_tile, rank_tile)
        mask = tok_live[:, None] & j_live[None, :]
        if split_k == 1:
            plgpu.store(xa_ref.at[pl.ds(start, block_t), cols], acc, mask=mask)
        else:  # split q's partial sums in its own plane of xa, summed by the expand
            plgpu.store(xa_ref.at[q, pl.ds(start, block_t), cols], acc, mask=mask)

    _blocks(p, n_programs, total_ref, sched_ref, block, early=True)


def _expand_kernel(total_ref, sched_ref, ranks_ref, b_rows_ref, xa_ref, rows_ref, y_ref, out_ref, *,
                   n_programs, block_t, rank_tile, col_tile, fout, width, dtype, xa_col, max_rank):
    # Grid (program, output column tile o). xa_col: where this module's columns start in xa (a
    # grouped shrink's xa holds several).
    p, o = pl.program_id(0), pl.program_id(1)
    col = o * col_tile

    def block(col_):
        s, start, end = col_[0], col_[1], col_[2]
        r = jnp.minimum(ranks_ref[s], max_rank)
        tok_live = start + jnp.arange(block_t) < end

        def load(kt):  # rank tile kt; rows past the rank are zeroed after the loads
            j = kt * rank_tile + jnp.arange(rank_tile)         # B rows
            j_live = j < r
            bt = _gather_tile(rows_ref, b_rows_ref, s, jnp.where(j_live, j, 0) * fout + col, width, col_tile)
            bt = jnp.where(j_live[:, None], bt, 0).astype(dtype)                # [rank_tile, C]
            xa_mask = tok_live[:, None] & j_live[None, :]
            xa_tile = (pl.ds(start, block_t), pl.ds(xa_col + kt * rank_tile, rank_tile))
            if len(xa_ref.shape) == 3:  # [S, T', cols]: S planes of split-K partial sums, added here
                xat = sum(plgpu.load(xa_ref.at[(jnp.int32(i),) + xa_tile], mask=xa_mask, other=0)
                          for i in range(xa_ref.shape[0]))
            else:
                xat = plgpu.load(xa_ref.at[xa_tile], mask=xa_mask, other=0)
            return bt, xat.astype(dtype)

        def use(tiles, acc):
            bt, xat = tiles
            return acc + jax.lax.dot_general(xat, bt, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

        tile = (pl.ds(start, block_t), pl.ds(col, col_tile))
        y = plgpu.load(y_ref.at[tile], mask=tok_live[:, None], other=0)  # before the rank loop: overlaps its gathers
        trips = jax.lax.div(r + rank_tile - 1, rank_tile)
        acc = _loop(0, trips, load, use, jnp.zeros((block_t, col_tile), jnp.float32))
        plgpu.store(out_ref.at[tile], (y.astype(jnp.float32) + acc).astype(out_ref.dtype),
                    mask=tok_live[:, None])

    _blocks(p, n_programs, total_ref, sched_ref, block)


# ---------------------------------------------------------------------------------------------
# Builders: the grid and the pallas_call.


def _col_tile(width: int, features: int, cap: int) -> int:
    g = math.gcd(width, features)
    return min(g & -g, cap)  # the largest power of two dividing W and the features, capped


def gemv_shrink(width: int, features: int, block_sizes: ShrinkBlockSizes | None = None) -> bool:
    """Whether a decode step's shrink of a module of `features` inputs on a pool of row width `width`
    takes block_t 1 (MBGMV): where its column tile reaches gemv_col_tile (below it, block_t 1 loses:
    e.g. llama-7b's down projection, 11008 = 43 * 256)."""
    cap = (block_sizes or ShrinkBlockSizes()).gemv_col_tile
    return _col_tile(width, features, cap) >= cap


def _compiler_params(interpret: bool, block_sizes):
    if interpret:
        return None
    return plgpu.CompilerParams(num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages)


def _check_block_t(block_t: int, gemv: bool = False):
    """block_t: a power of two >= 16 (Triton's dot sides); gemv (the shrink): or 1."""
    if not (gemv and block_t == 1) and (block_t < 16 or block_t & (block_t - 1)):
        raise ValueError(f"block_t must be {'1 (MBGMV) or ' if gemv else ''}a power of two >= 16 "
                         f"(Triton dot sides), got {block_t}")


@functools.partial(jax.jit, static_argnames=("max_rank", "in_features", "interpret", "block_t", "block_sizes"))
def _shrink(x, rows, a_rows, ranks, seg_starts, schedule, *, max_rank, in_features, interpret, block_t,
            block_sizes):
    """xa of one module (a_rows [Sa, RA], ranks [Sa]) or of G modules sharing x (a_rows [G, Sa, RA],
    ranks [G, Sa]): [T', G * Rw], or [split_k, T', G * Rw] with split-K, module g's columns from
    g * Rw; Rw is max_rank padded to whole rank tiles, T' >= T. The schedule covers the slots live in
    any module (each slot's largest rank over them)."""
    t, width = x.shape[0], rows.shape[1]
    bs = block_sizes
    rank_tile = bs.rank_tile
    col_tile = _col_tile(width, in_features, bs.gemv_col_tile if block_t == 1 else bs.col_tile)
    a_rows, ranks = (a_rows, ranks) if a_rows.ndim == 3 else (a_rows[None], ranks[None])
    n_modules, slots = ranks.shape
    live = ranks[0] if schedule is not None or n_modules == 1 else ranks.max(axis=0)
    _, sched, total, _, n_programs = plan_blocks(live, seg_starts, t, max_rank, block_t, bs.max_programs, schedule,
                                                 clamp=False, rank_tile=rank_tile)
    ranks = ranks.astype(jnp.int32).reshape(-1)  # clamped in the kernel
    split_k = bs.split_k if t <= bs.split_k_max_tokens else 1
    split_k = max(1, min(split_k, in_features // col_tile))
    # Each module's columns padded to whole rank tiles, so that an expand's tile loads stay inside
    # xa (a max rank below one tile included); split_k > 1: the rows too, one plane per split.
    module_cols = pl.cdiv(max_rank, rank_tile) * rank_tile
    rows_out = t if split_k == 1 else t + block_t
    shape = (split_k, rows_out, n_modules * module_cols) if split_k > 1 else (rows_out, n_modules * module_cols)
    kernel = functools.partial(
        _shrink_kernel, n_programs=n_programs, block_t=block_t, rank_tile=rank_tile, col_tile=col_tile,
        fin=in_features, width=width, dtype=jnp.promote_types(x.dtype, rows.dtype), split_k=split_k,
        slots=slots, module_cols=module_cols, max_rank=max_rank)
    return pl.pallas_call(
        kernel,
        grid=(n_programs, n_modules, split_k),
        out_shape=jax.ShapeDtypeStruct(shape, jnp.float32),
        input_output_aliases={6: 0},  # written only where live: the rest stays zero
        interpret=interpret,
        compiler_params=_compiler_params(interpret, bs),
        name="lora_shrink",
    )(total, sched, ranks, a_rows.reshape(n_modules * slots, -1).astype(jnp.int32), x, rows,
      jnp.zeros(shape, jnp.float32))


@functools.partial(jax.jit, static_argnames=("max_rank", "out_features", "interpret", "block_t", "block_sizes",
                                             "xa_col"))
def _expand(y, xa, rows, b_rows, ranks, seg_starts, schedule, *, max_rank, out_features, interpret, block_t,
            block_sizes, xa_col=0):
    t, width = y.shape[0], rows.shape[1]
    bs = block_sizes
    rank_tile, col_tile = bs.rank_tile, _col_tile(width, out_features, bs.col_tile)
    short = xa_col + pl.cdiv(max_rank, rank_tile) * rank_tile - xa.shape[-1]
    if short > 0:  # a rank tile's static slice must lie inside xa (masked columns read as zero)
        xa = jnp.pad(xa, [(0, 0)] * (xa.ndim - 1) + [(0, short)])
    ranks, sched, total, _, n_programs = plan_blocks(ranks, seg_starts, t, max_rank, block_t, bs.max_programs,
                                                     schedule, clamp=False)
    kernel = functools.partial(
        _expand_kernel, n_programs=n_programs, block_t=block_t, rank_tile=rank_tile, col_tile=col_tile,
        fout=out_features, width=width, dtype=rows.dtype, xa_col=xa_col, max_rank=max_rank)
    return pl.pallas_call(
        kernel,
        grid=(n_programs, out_features // col_tile),
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        input_output_aliases={6: 0},  # base tokens keep y
        interpret=interpret,
        compiler_params=_compiler_params(interpret, bs),
        name="lora_expand",
    )(total, sched, ranks, b_rows.astype(jnp.int32), xa.astype(jnp.float32), rows, y)


# ---------------------------------------------------------------------------------------------
# Public wrappers.


def _interpret(interpret):
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def lora_shrink(x, rows, a_rows, ranks, seg_starts, *, max_rank: int, in_features: int, interpret=None,
                block_t: int = BLOCK_T, schedule=None, block_sizes: ShrinkBlockSizes | None = None):
    """xa [T, max_rank] float32: xa[t, :r_s] = x[t] @ A_s for the tokens of slot s, 0 elsewhere.

    x [T, in]; rows [N, W] (one layer's pool as rows); a_rows [Sa, RA] int32, RA =
    ceil(max_rank*in/W): row indices of A^T_s [r_s, in] flattened; ranks [Sa] (0: the slot has no A
    for this module); seg_starts [Sa+1]. Unused entries of a_rows may point at any row.
    schedule: shrink_schedule(ranks, seg_starts, T, block_t, max_rank=max_rank), built on the
    host; None: in the graph.
    """
    xa = lora_shrink_group(x, rows, (a_rows,), (ranks,), seg_starts, max_rank=max_rank, in_features=in_features,
                           interpret=interpret, block_t=block_t, schedule=schedule, block_sizes=block_sizes)
    if xa.ndim == 3:  # split-K: the splits' planes
        xa = xa.sum(0)
    return xa[:x.shape[0], :max_rank]


def lora_shrink_group(x, rows, a_rows, ranks, seg_starts, *, max_rank: int, in_features: int, interpret=None,
                      block_t: int = BLOCK_T, schedule=None, block_sizes: ShrinkBlockSizes | None = None):
    """lora_shrink for G modules that read the same x (q, k and v), in one launch: a_rows and ranks
    are sequences of G per-module arrays, or already stacked [G, Sa, RA] and [G, Sa] (the engine
    stacks q, k and v on the host once a step: no stacking op in every layer). Returns xa
    [T', G * Rw] float32, module g's columns from g * Rw (Rw = xa.shape[-1] // G >= max_rank,
    T' >= T); pass it to lora_expand with xa_col = g * Rw. With split-K: [split_k, T', G * Rw],
    each split's partial sums in its own plane, which lora_expand adds as it reads them; sum(0)
    gives the xa above. schedule: shrink_schedule of each slot's largest rank over the modules."""
    assert x.shape[1] == in_features, (x.shape, in_features)
    bs = block_sizes or ShrinkBlockSizes.get_default()

    def stack(v):
        if not isinstance(v, (list, tuple)):
            return v if v.shape[0] > 1 else v[0]  # stacked by the caller
        return jnp.stack([jnp.asarray(a) for a in v]) if len(v) > 1 else v[0]
    if _col_tile(rows.shape[1], in_features, bs.col_tile) < 16:
        # No column tile of >= 16 (Triton's smallest dot side) divides both W and `in`: toy widths.
        if not isinstance(a_rows, (list, tuple)):
            a_rows, ranks = list(a_rows.reshape(-1, *a_rows.shape[-2:])), list(ranks.reshape(-1, ranks.shape[-1]))
        return jnp.concatenate([lora_shrink_reference(x, rows, a, r, seg_starts, max_rank=max_rank,
                                                      in_features=in_features) for a, r in zip(a_rows, ranks)], 1)
    _check_block_t(block_t, gemv=True)
    return _shrink(x, rows, stack(a_rows), stack(ranks), seg_starts, schedule, max_rank=max_rank,
                   in_features=in_features, interpret=_interpret(interpret), block_t=block_t, block_sizes=bs)


def lora_expand(y, xa, rows, b_rows, ranks, seg_starts, *, max_rank: int, out_features: int, interpret=None,
                block_t: int = BLOCK_T, schedule=None, xa_col: int = 0, block_sizes: ExpandBlockSizes | None = None):
    """y + xa[:, xa_col:xa_col + r_s] @ B_s for the tokens of slot s (base tokens unchanged), in
    y's dtype.

    y [T, out]; xa [T' >= T, >= xa_col + max_rank] float32 (from lora_shrink, or lora_shrink_group
    with xa_col = g * Rw), or [S, T', ...]: S planes of partial sums, added as they are read;
    b_rows [Sa, RB] int32 row indices of scale*B_s [r_s, out] flattened. The product runs in the
    pool's dtype, accumulated in float32. schedule: block_schedule (None: in the graph).
    """
    assert y.shape[1] == out_features and xa.shape[-2] >= y.shape[0] and xa.shape[-1] >= xa_col + max_rank, \
        (y.shape, xa.shape, out_features, xa_col)
    bs = block_sizes or ExpandBlockSizes.get_default()
    if _col_tile(rows.shape[1], out_features, bs.col_tile) < 16:
        # See lora_shrink_group.
        xa2 = xa.sum(0) if xa.ndim == 3 else xa
        return lora_expand_reference(y, xa2[:y.shape[0], xa_col:xa_col + max_rank], rows, b_rows, ranks, seg_starts,
                                     max_rank=max_rank, out_features=out_features)
    _check_block_t(block_t)
    return _expand(y, xa, rows, b_rows, ranks, seg_starts, schedule, max_rank=max_rank, out_features=out_features,
                   interpret=_interpret(interpret), block_t=block_t, block_sizes=bs, xa_col=xa_col)


def lora_apply(y, x, rows, a_rows, b_rows, ranks, seg_starts, *, max_rank: int, fin: int, fout: int,
               **kernel_options):
    """y + (x @ A_s) @ B_s for the tokens of slot s, base tokens unchanged, in y's dtype: shrink, then
    expand straight into y (no delta buffer, no separate add)."""
    return lora_apply_group((y,), x, rows, (a_rows,), (b_rows,), (ranks,), seg_starts, max_rank=max_rank,
                            fin=fin, fouts=(fout,), **kernel_options)[0]


def lora_apply_group(ys, x, rows, a_rows, b_rows, ranks, seg_starts, *, max_rank: int, fin: int, fouts,
                     schedule=None, shrink_schedule=None, block_t: int = BLOCK_T, shrink_block_t: int | None = None,
                     interpret=None, shrink_sizes: ShrinkBlockSizes | None = None,
                     expand_sizes: ExpandBlockSizes | None = None):
    """lora_apply for G modules that read the same x: one shrink launch (lora_shrink_group), then
    one expand per module into its own y. ys, a_rows, b_rows, ranks, fouts: one per module.
    schedule= (block_schedule) goes to the expands, shrink_schedule= (shrink_schedule) to the
    shrink; either None: built in the graph. shrink_block_t: the shrink's block_t where it
    differs from the expands' (block_t=), e.g. 1 (MBGMV) for a decode step's shrink."""
    xa = lora_shrink_group(x, rows, a_rows, ranks, seg_starts, max_rank=max_rank, in_features=fin,
                           interpret=interpret, block_t=block_t if shrink_block_t is None else shrink_block_t,
                           schedule=shrink_schedule, block_sizes=shrink_sizes)
    cols = xa.shape[-1] // len(ys)
    return tuple(lora_expand(y, xa, rows, b, r, seg_starts, max_rank=max_rank, out_features=f, xa_col=g * cols,
                             interpret=interpret, block_t=block_t, schedule=schedule, block_sizes=expand_sizes)
                 for g, (y, b, r, f) in enumerate(zip(ys, b_rows, ranks, fouts)))


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
