"""Mixed-rank LoRA shrink and expand for TPU (Mosaic), reading adapters straight from the pool.

A layer's pool, seen as rows, is `rows [N, W]` (W = kv_heads * head_dim). One rank row of an
adapter's A^T [r, fin] (or B [r, fout]) is `chunks = ceil(fin / W)` whole pool rows: row j of A^T
is the rows `a_rows[slot, j * chunks + k]`, k < chunks, each W columns of it. Where fin is not a
multiple of W (llama-7b's MLP: 11008 against 4096) the last chunk's columns past fin are padding
(zeros in the engine's layout, slora_jax/model/layout.py); the wrappers pad x (and y) with zero
columns to whole chunks, so that padding never reaches a result. The kernels copy only the `rank`
rows of chunk k that the slot's real rank needs, so HBM traffic is rank * features, never
max_rank * features.

Tokens are grouped by slot: slot s owns tokens [seg_starts[s], seg_starts[s + 1]); tokens past
seg_starts[-1] are base-model tokens (no delta). `segment_plan` turns that into work items, one per
(token block, slot) pair that overlaps, in token order; the grid walks the items, so an output
block stays in VMEM while its items run, and each item writes only its slot's rows.

Every grid step copies its rows from HBM into one half of a VMEM buffer while the step before it
computes on the other half (manual double buffering: pltpu.make_async_copy and a semaphore per
half), so the steps run in order ("arbitrary" on every grid axis).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_LANES = 128


@dataclasses.dataclass(frozen=True)
class LoraBlocks:
    """Static block sizes. block_t: tokens per work item (the matmul's M side), a multiple of 16
    so bf16 token tiles are whole (16 sublanes). A decode step, with a token or two per adapter,
    wants the smallest (16); the default suits prefill. Unmeasured: bench/RESULTS.md has no TPU
    row yet (docs/tpu.md)."""
    block_t: int = 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


def segment_plan(seg_starts, num_tokens: int, block_t: int):
    """Work items for `num_tokens` tokens (a multiple of block_t) grouped as seg_starts [Sa + 1]
    says: (item_block [G], item_slot [G], bounds [Sa + 2]) with G = blocks + Sa, a static bound.
    Slot Sa stands for the base-model tokens [seg_starts[Sa], num_tokens): it has rank 0, so its
    items only make sure every output block is visited. Items past the real ones repeat the last
    block with slot Sa (they add nothing). Plain jnp: it runs inside the caller's jit."""
    seg_starts = jnp.asarray(seg_starts, jnp.int32)
    sa = seg_starts.shape[0] - 1
    blocks = num_tokens // block_t
    bounds = jnp.concatenate([seg_starts, jnp.full((1,), num_tokens, jnp.int32)])
    start, end = bounds[:-1], bounds[1:]
    first = start // block_t
    count = jnp.where(end > start, (end - 1) // block_t - first + 1, 0)
    ends = jnp.cumsum(count)
    items = jnp.arange(blocks + sa, dtype=jnp.int32)
    seg = jnp.searchsorted(ends, items, side="right").astype(jnp.int32)
    real = seg <= sa
    seg_c = jnp.minimum(seg, sa)
    block = first[seg_c] + items - (ends[seg_c] - count[seg_c])
    item_block = jnp.where(real, block, blocks - 1).astype(jnp.int32)
    item_slot = jnp.where(real, seg_c, sa).astype(jnp.int32)
    return item_block, item_slot, bounds


def _copy_rows(rows_ref, pool_hbm, buf, sem, slot, rank, chunk, chunks, half, *, wait: bool):
    """Start (or wait for) the copies of rank rows of `chunk` of `slot` into buf[half]."""
    def body(j, carry):
        row = rows_ref[slot, j * chunks + chunk]
        copy = pltpu.make_async_copy(pool_hbm.at[pl.ds(row, 1)], buf.at[half, pl.ds(j, 1)], sem.at[half])
        if wait:
            copy.wait()
        else:
            copy.start()
        return carry
    jax.lax.fori_loop(0, rank, body, 0)


def _pipeline(rows_ref, pool_hbm, buf, sem, item_slot, ranks, *, step, steps, item_chunk, chunks):
    """Wait for this step's rows; before that, start the next step's. Returns this step's half."""
    half = jax.lax.rem(step, 2)  # lax.rem/div: step >= 0, and Mosaic has no sign op on every chip

    def copies(s, h, wait):
        i, k = item_chunk(s)
        slot = item_slot[i]
        _copy_rows(rows_ref, pool_hbm, buf, sem, slot, ranks[slot], k, chunks, h, wait=wait)

    @pl.when(step == 0)
    def _():
        copies(step, half, False)

    @pl.when(step + 1 < steps)
    def _():
        copies(step + 1, 1 - half, False)

    copies(step, half, True)
    return half


def _live_rows(bounds, slot, block, block_t: int, rank, buf_half):
    """(row mask [block_t, 1] of the block's tokens in slot's segment, buf with rows >= rank zeroed)."""
    t = block * block_t + jax.lax.broadcasted_iota(jnp.int32, (block_t, 1), 0)
    rows = (bounds[slot] <= t) & (t < bounds[slot + 1])
    j = jax.lax.broadcasted_iota(jnp.int32, buf_half.shape, 0)
    return rows, jnp.where(j < rank, buf_half, jnp.zeros_like(buf_half))


def _shrink_kernel(item_block, item_slot, bounds, ranks, a_rows, x_ref, pool_hbm, out_ref, buf, sem,
                   *, chunks: int, block_t: int):
    i, k = pl.program_id(0), pl.program_id(1)
    steps = pl.num_programs(0) * chunks
    half = _pipeline(a_rows, pool_hbm, buf, sem, item_slot, ranks, step=i * chunks + k, steps=steps,
                     item_chunk=lambda s: (jax.lax.div(s, chunks), jax.lax.rem(s, chunks)), chunks=chunks)
    block, slot = item_block[i], item_slot[i]
    first = (i == 0) | (item_block[jnp.maximum(i - 1, 0)] != block)

    @pl.when(first & (k == 0))
    def _():
        out_ref[...] = jnp.zeros_like(out_ref)

    rows, a = _live_rows(bounds, slot, block, block_t, ranks[slot], buf[half])
    x = x_ref[:, pl.ds(pl.multiple_of(k * a.shape[1], _LANES), a.shape[1])]  # chunk k: whole lane tiles
    part = jax.lax.dot_general(x, a.astype(x.dtype), (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)  # [block_t, R]
    out_ref[...] = jnp.where(rows, out_ref[...] + part, out_ref[...])


def _expand_kernel(item_block, item_slot, bounds, ranks, b_rows, xa_ref, y_ref, pool_hbm, out_ref, buf, sem,
                   *, chunks: int, block_t: int, items: int):
    k, i = pl.program_id(0), pl.program_id(1)
    half = _pipeline(b_rows, pool_hbm, buf, sem, item_slot, ranks, step=k * items + i, steps=chunks * items,
                     item_chunk=lambda s: (jax.lax.rem(s, items), jax.lax.div(s, items)), chunks=chunks)
    block, slot = item_block[i], item_slot[i]
    first = (i == 0) | (item_block[jnp.maximum(i - 1, 0)] != block)

    @pl.when(first)
    def _():
        out_ref[...] = y_ref[...]

    rows, b = _live_rows(bounds, slot, block, block_t, ranks[slot], buf[half])
    xa = xa_ref[...]
    part = jnp.dot(xa, b.astype(xa.dtype), preferred_element_type=jnp.float32)  # [block_t, W]
    out = out_ref[...]
    out_ref[...] = jnp.where(rows, (out.astype(jnp.float32) + part).astype(out.dtype), out)


def _chunks(rows, features: int) -> int:
    """Pool rows per rank row of a [r, features] matrix: each rank row is whole rows."""
    return _cdiv(features, rows.shape[1])


def _interpret_arg(interpret):
    return pltpu.InterpretParams() if interpret is True else interpret


@functools.partial(jax.jit, static_argnames=("max_rank", "blocks", "interpret"))
def lora_shrink(x, rows, a_rows, ranks, seg_starts, *, max_rank: int, blocks: LoraBlocks = LoraBlocks(),
                interpret=False):
    """xa [T, max_rank] float32: each token's x @ A of its slot's adapter at the slot's rank (zero
    past the rank and for base tokens). x [T, fin]; rows [N, W] the layer's pool rows;
    a_rows [Sa, >= max_rank * ceil(fin / W)] int32; ranks [Sa]; seg_starts [Sa + 1].
    interpret: False on a TPU; True (TPU interpret mode on any backend) or an InterpretParams."""
    t, fin = x.shape
    w = rows.shape[1]
    chunks = _chunks(rows, fin)
    if w % _LANES and not interpret:  # Mosaic's lane tile; interpret mode (tests' tiny models) takes any width
        raise ValueError(f"the pool's row width {w} must be a multiple of {_LANES} lanes")
    bt = blocks.block_t
    tp, rp = _round_up(t, bt), _round_up(max_rank, 16)
    x = jnp.pad(x, ((0, tp - t), (0, chunks * w - fin)))  # zero columns: the rows' padding meets zeros
    item_block, item_slot, bounds = segment_plan(seg_starts, tp, bt)
    ranks_ext = jnp.concatenate([jnp.asarray(ranks, jnp.int32), jnp.zeros((1,), jnp.int32)])
    grid = (item_block.shape[0], chunks)
    kernel = functools.partial(_shrink_kernel, chunks=chunks, block_t=bt)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5, grid=grid,
            # x's whole rows: consecutive items of one block share one copy of it across chunks
            in_specs=[pl.BlockSpec((bt, chunks * w), lambda i, k, ib, *_: (ib[i], 0)),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((bt, rp), lambda i, k, ib, *_: (ib[i], 0)),
            scratch_shapes=[pltpu.VMEM((2, rp, w), rows.dtype), pltpu.SemaphoreType.DMA((2,))]),
        out_shape=jax.ShapeDtypeStruct((tp, rp), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=_interpret_arg(interpret),
    )(item_block, item_slot, bounds, ranks_ext, jnp.asarray(a_rows, jnp.int32), x, rows)
    return out[:t, :max_rank]


@functools.partial(jax.jit, static_argnames=("max_rank", "blocks", "interpret"))
def lora_expand(y, xa, rows, b_rows, ranks, seg_starts, *, max_rank: int, blocks: LoraBlocks = LoraBlocks(),
                interpret=False):
    """y [T, fout] + xa [T, max_rank] @ B of each token's slot at its rank, added in float32 and
    cast to y's dtype once. xa in the activations' dtype; b_rows [Sa, >= max_rank * ceil(fout / W)]."""
    t, fout = y.shape
    w = rows.shape[1]
    chunks = _chunks(rows, fout)
    bt = blocks.block_t
    tp, rp = _round_up(t, bt), _round_up(max_rank, 16)
    y_p = jnp.pad(y, ((0, tp - t), (0, chunks * w - fout)))  # the padding columns are dropped after
    xa = jnp.pad(xa, ((0, tp - t), (0, rp - xa.shape[1])))
    item_block, item_slot, bounds = segment_plan(seg_starts, tp, bt)
    ranks_ext = jnp.concatenate([jnp.asarray(ranks, jnp.int32), jnp.zeros((1,), jnp.int32)])
    items = item_block.shape[0]
    kernel = functools.partial(_expand_kernel, chunks=chunks, block_t=bt, items=items)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5, grid=(chunks, items),
            in_specs=[pl.BlockSpec((bt, rp), lambda k, i, ib, *_: (ib[i], 0)),
                      pl.BlockSpec((bt, w), lambda k, i, ib, *_: (ib[i], k)),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((bt, w), lambda k, i, ib, *_: (ib[i], k)),
            scratch_shapes=[pltpu.VMEM((2, rp, w), rows.dtype), pltpu.SemaphoreType.DMA((2,))]),
        out_shape=jax.ShapeDtypeStruct((tp, chunks * w), y.dtype),
        input_output_aliases={6: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=_interpret_arg(interpret),
    )(item_block, item_slot, bounds, ranks_ext, jnp.asarray(b_rows, jnp.int32), xa, y_p, rows)
    return out[:t, :fout]


def _slot_matrix(rows, slot_rows, max_rank: int, features: int):
    """[Sa, max_rank, features]: each slot's A^T (or B) from its rows, rank row j = rows j*c..j*c+c-1
    (c = ceil(features / W); the columns past features are padding)."""
    chunks = _chunks(rows, features)
    sa = slot_rows.shape[0]
    return rows[slot_rows[:, :max_rank * chunks]].reshape(sa, max_rank, chunks * rows.shape[1])[:, :, :features]


def _token_slot(seg_starts, t: int):
    """Each token's slot, -1 past seg_starts[-1] (base-model tokens)."""
    slot = jnp.searchsorted(seg_starts, jnp.arange(t), side="right") - 1
    return jnp.where(jnp.arange(t) < seg_starts[-1], slot, -1)


def lora_shrink_reference(x, rows, a_rows, ranks, seg_starts, *, max_rank: int):
    """lora_shrink in plain jnp: gather each token's slot's A^T, mask past its rank."""
    t, fin = x.shape
    a = _slot_matrix(rows, a_rows, max_rank, fin)
    slot = _token_slot(seg_starts, t)
    live = (slot[:, None] >= 0) & (jnp.arange(max_rank)[None, :] < ranks[jnp.maximum(slot, 0)][:, None])
    xa = jnp.einsum("ti,tri->tr", x, a[jnp.maximum(slot, 0)].astype(x.dtype), preferred_element_type=jnp.float32)
    return jnp.where(live, xa, 0.0)


def lora_expand_reference(y, xa, rows, b_rows, ranks, seg_starts, *, max_rank: int):
    """lora_expand in plain jnp."""
    t, fout = y.shape
    b = _slot_matrix(rows, b_rows, max_rank, fout)
    slot = _token_slot(seg_starts, t)
    live = (slot[:, None] >= 0) & (jnp.arange(max_rank)[None, :] < ranks[jnp.maximum(slot, 0)][:, None])
    b_tok = jnp.where(live[:, :, None], b[jnp.maximum(slot, 0)], 0).astype(xa.dtype)
    delta = jnp.einsum("tr,tro->to", xa, b_tok, preferred_element_type=jnp.float32)
    return (y.astype(jnp.float32) + delta).astype(y.dtype)
