"""Paged attention for TPU (Mosaic) over the unified pool's pages, for decode and packed prefill.

A layer's pool is `[pages, 2, page_size, W]`: page p holds K rows [0] and V rows [1], W =
kv_heads * head_dim. The kernels take whole pages as blocks (the scalar-prefetched page table picks
each block's page, so Pallas double-buffers the page copies) and read KV head g as the lanes
[g * head_dim, (g + 1) * head_dim) of a row: with head_dim = 128 every head is one 128-lane tile,
and the pool keeps its shape. Softmax is online (flash) over the pages, in float32.

Decode: one query token per sequence; sequence s attends to its ctx_lens[s] pooled tokens and to
its own new K/V (this step's token, written to the pool after the step).
Packed prefill: the tokens of sequence s are seq_starts[s] .. seq_starts[s + 1] - 1, at positions
ctx_lens[s], ctx_lens[s] + 1, ...; tokens past seq_starts[-1] are padding. Each attends to its
sequence's pooled tokens and, causally, to its sequence's new tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu.lora import segment_plan

_MASKED = -1e30  # finite, so a row with no live key yet never computes inf - inf
_LANES = 128


@dataclasses.dataclass(frozen=True)
class PrefillBlocks:
    """Static block sizes of packed prefill: query tokens and new-key tokens per block (multiples
    of 16 keep bf16 tiles whole). Unmeasured: bench/RESULTS.md has no TPU row yet (docs/tpu.md)."""
    block_q: int = 128
    block_k: int = 128


def _online_softmax(m, l, acc, s, v):
    """One flash-attention step: state m, l [n, LANES] (lane-replicated), acc [n, d]; scores
    s [n, k] float32 (masked entries _MASKED); values v [k, d]. One key (k = 1) is a lane
    broadcast, not a matmul: Mosaic has no N = 1 dot."""
    m_prev = m[:, :1]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.exp(s - m_new)
    l_new = alpha * l[:, :1] + jnp.sum(p, axis=-1, keepdims=True)
    if v.shape[0] == 1:
        pv = p.astype(v.dtype).astype(jnp.float32) * v.astype(jnp.float32)
    else:
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return jnp.broadcast_to(m_new, m.shape), jnp.broadcast_to(l_new, l.shape), alpha * acc + pv


def _scores(q, k, scale):
    """q [n, d] . k [m, d]^T in float32, times scale; one key (m = 1) on the VPU."""
    if k.shape[0] == 1:
        prod = q.astype(jnp.float32) * k.astype(q.dtype).astype(jnp.float32)
        return jnp.sum(prod, axis=-1, keepdims=True) * scale
    return jax.lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32) * scale


def _check(pool_layer, head_dim: int, interpret=False):
    if head_dim % _LANES and not interpret:  # Mosaic's lane tile; interpret mode takes any width
        raise ValueError(f"head_dim {head_dim} must be a multiple of {_LANES}: each KV head is whole lane tiles")
    return pool_layer.shape[2]


def _interpret_arg(interpret):
    return pltpu.InterpretParams() if interpret is True else interpret


# ---------------------------------------------------------------------------------------------
# Decode: grid (sequence, page block). A block's pages are copied by hand (pool in HBM), each a
# whole [2, page_size, W] page, into one half of a VMEM buffer while the block before it in the
# same sequence computes on the other half. The chain restarts at each sequence, so sequences
# can run on separate cores ("parallel").


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
    """pages_per_block: pages copied and attended per grid step. One small page a step leaves the
    step's fixed cost larger than its copy. Unmeasured: bench/RESULTS.md has no TPU row yet."""
    pages_per_block: int = 8


def _copy_pages(page_table, pool_hbm, buf, sem, seq, block, used, half, *, per_block: int, wait: bool):
    """Start (or wait for) the copies of the pages of `block` of sequence `seq` below `used`."""
    def body(p, carry):
        j = block * per_block + p
        copy = pltpu.make_async_copy(pool_hbm.at[page_table[seq, j]], buf.at[half, p], sem.at[half])
        if wait:
            copy.wait()
        else:
            copy.start()
        return carry
    jax.lax.fori_loop(0, jnp.clip(used - block * per_block, 0, per_block), body, 0)


def _decode_kernel(page_table, ctx_lens, q_ref, k_new_ref, v_new_ref, pool_hbm, out_ref, buf, sem, m_ref, l_ref,
                   acc_ref, *, kv_heads: int, group: int, head_dim: int, page_size: int, per_block: int):
    s, b = pl.program_id(0), pl.program_id(1)
    ctx = ctx_lens[s]
    used = pl.cdiv(ctx, page_size)  # pages holding context
    half = jax.lax.rem(b, 2)
    scale = 1.0 / math.sqrt(head_dim)
    copies = functools.partial(_copy_pages, page_table, pool_hbm, buf, sem, s, used=used, per_block=per_block)

    @pl.when(b == 0)
    def _():
        m_ref[...] = jnp.full_like(m_ref, _MASKED)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)
        copies(b, half=half, wait=False)

    @pl.when(b + 1 < pl.num_programs(1))
    def _():
        copies(b + 1, half=1 - half, wait=False)

    copies(b, half=half, wait=True)

    def attend(keys_of, values_of, live):
        for g in range(kv_heads):
            heads = slice(g * group, (g + 1) * group)
            sc = jnp.where(live, _scores(q_ref[0, heads, :], keys_of(g), scale), _MASKED)
            m, l, acc = _online_softmax(m_ref[heads, :], l_ref[heads, :], acc_ref[heads, :], sc, values_of(g))
            m_ref[heads, :], l_ref[heads, :], acc_ref[heads, :] = m, l, acc

    lanes = lambda g: slice(g * head_dim, (g + 1) * head_dim)
    for p in range(per_block):  # pages past the context were not copied: skipped, never masked
        first = (b * per_block + p) * page_size

        @pl.when(first < ctx)
        def _():
            live = first + jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1) < ctx
            attend(lambda g: buf[half, p, 0, :, lanes(g)], lambda g: buf[half, p, 1, :, lanes(g)], live)

    @pl.when(b == pl.num_programs(1) - 1)
    def _():
        dt = buf.dtype
        attend(lambda g: k_new_ref[0, g:g + 1, :].astype(dt), lambda g: v_new_ref[0, g:g + 1, :].astype(dt),
               jnp.ones((1, 1), bool))
        out_ref[0] = (acc_ref[...] / l_ref[:, :1]).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def paged_decode_attention(q, k_new, v_new, pool_layer, page_table, ctx_lens, *,
                           blocks: DecodeBlocks = DecodeBlocks(), interpret=False):
    """q [S, H, d], k_new / v_new [S, KVH, d] (sequence s's token of this step), pool_layer
    [pages, 2, page_size, KVH * d], page_table [S, P], ctx_lens [S] -> [S, H, d] in q's dtype."""
    bsz, nh, d = q.shape
    kvh = k_new.shape[1]
    ps = _check(pool_layer, d, interpret)
    per_block = min(blocks.pages_per_block, page_table.shape[1])
    nb = pl.cdiv(page_table.shape[1], per_block)
    kernel = functools.partial(_decode_kernel, kv_heads=kvh, group=nh // kvh, head_dim=d, page_size=ps,
                               per_block=per_block)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(bsz, nb),
            in_specs=[pl.BlockSpec((1, nh, d), lambda s, b, *_: (s, 0, 0)),
                      pl.BlockSpec((1, kvh, d), lambda s, b, *_: (s, 0, 0)),
                      pl.BlockSpec((1, kvh, d), lambda s, b, *_: (s, 0, 0)),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((1, nh, d), lambda s, b, *_: (s, 0, 0)),
            scratch_shapes=[pltpu.VMEM((2, per_block) + pool_layer.shape[1:], pool_layer.dtype),
                            pltpu.SemaphoreType.DMA((2,)),
                            pltpu.VMEM((nh, _LANES), jnp.float32), pltpu.VMEM((nh, _LANES), jnp.float32),
                            pltpu.VMEM((nh, d), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=_interpret_arg(interpret),
    )(jnp.asarray(page_table, jnp.int32), jnp.asarray(ctx_lens, jnp.int32), q, k_new, v_new, pool_layer)


# ---------------------------------------------------------------------------------------------
# Packed prefill: grid (work item, key step). A work item is a (query block, sequence) pair that
# overlaps (segment_plan, with sequences for slots); its key steps are the sequence's pooled
# pages, then the query blocks of new tokens that can hold its keys.


def _prefill_kernel(item_block, item_seq, bounds, page_table, ctx_lens, q_ref, k_ref, v_ref, page_ref, out_ref,
                    m_ref, l_ref, acc_ref, *, kv_heads: int, group: int, head_dim: int, page_size: int,
                    pages: int, block_q: int, block_k: int):
    i, j = pl.program_id(0), pl.program_id(1)
    block, seq = item_block[i], item_seq[i]
    start, end = bounds[seq], bounds[seq + 1]
    real = seq < page_table.shape[0]  # the last segment is the padding tokens
    ctx = jnp.where(real, ctx_lens[jnp.minimum(seq, page_table.shape[0] - 1)], 0)
    scale = 1.0 / math.sqrt(head_dim)
    lanes = lambda h: slice(h * head_dim, (h + 1) * head_dim)
    tq = block * block_q + jax.lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full_like(m_ref, _MASKED)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    def attend(keys_of, values_of, live):
        for h in range(kv_heads * group):
            g = h // group
            sc = jnp.where(live, _scores(q_ref[:, lanes(h)], keys_of(g), scale), _MASKED)
            m, l, acc = _online_softmax(m_ref[h], l_ref[h], acc_ref[:, lanes(h)], sc, values_of(g))
            m_ref[h], l_ref[h], acc_ref[:, lanes(h)] = m, l, acc

    @pl.when(j * page_size < ctx)
    def _():
        live = j * page_size + jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1) < ctx
        attend(lambda g: page_ref[0, 0, :, lanes(g)], lambda g: page_ref[0, 1, :, lanes(g)], live)

    kb = start // block_k + (j - pages)  # the new-key block of this step

    @pl.when((j >= pages) & (kb * block_k < jnp.minimum(end, (block + 1) * block_q)) & real)
    def _():
        tk = kb * block_k + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        live = (start <= tk) & (tk < end) & (tk <= tq)
        dt = page_ref.dtype
        attend(lambda g: k_ref[:, lanes(g)].astype(dt), lambda g: v_ref[:, lanes(g)].astype(dt), live)

    first = (i == 0) | (item_block[jnp.maximum(i - 1, 0)] != block)

    @pl.when((j == 0) & first)
    def _():
        out_ref[...] = jnp.zeros_like(out_ref)

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        rows = (start <= tq) & (tq < end) & real
        for h in range(kv_heads * group):
            o = (acc_ref[:, lanes(h)] / l_ref[h][:, :1]).astype(out_ref.dtype)
            out_ref[:, lanes(h)] = jnp.where(rows, o, out_ref[:, lanes(h)])


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def paged_prefill_attention(q, k, v, pool_layer, page_table, ctx_lens, seq_starts, *,
                            blocks: PrefillBlocks = PrefillBlocks(), interpret=False):
    """q [T, H, d], k / v [T, KVH, d] (this step's tokens, grouped by sequence as seq_starts
    [S + 1] says), pool_layer [pages, 2, page_size, KVH * d], page_table [S, P], ctx_lens [S]
    -> [T, H, d] in q's dtype (zeros for padding tokens)."""
    t, nh, d = q.shape
    kvh = k.shape[1]
    ps = _check(pool_layer, d, interpret)
    p = page_table.shape[1]
    bq, bk = blocks.block_q, blocks.block_k
    if bq % bk:
        raise ValueError("block_q must be a multiple of block_k")
    tp = -(-t // bq) * bq
    pad = lambda a: jnp.pad(a.reshape(t, -1), ((0, tp - t), (0, 0)))
    item_block, item_seq, bounds = segment_plan(seq_starts, tp, bq)
    steps = p + tp // bk  # pooled pages, then every new-key block a sequence's queries can see
    pt = jnp.asarray(page_table, jnp.int32)
    ctx = jnp.asarray(ctx_lens, jnp.int32)
    s_rows = pt.shape[0]

    def page_index(i, j, ib, iseq, bd, pt, ctx):
        seq = jnp.minimum(iseq[i], s_rows - 1)
        live = iseq[i] < s_rows
        last = jnp.maximum(pl.cdiv(jnp.where(live, ctx[seq], 0), ps) - 1, 0)
        return jnp.where(live, pt[seq, jnp.minimum(j, last)], 0), 0, 0, 0

    def key_index(i, j, ib, iseq, bd, *_):
        lo = bd[iseq[i]] // bk
        hi = jnp.maximum(jnp.minimum(bd[iseq[i] + 1], (ib[i] + 1) * bq) - 1, bd[iseq[i]]) // bk
        return jnp.clip(lo + j - p, lo, jnp.minimum(hi, tp // bk - 1)), 0

    kernel = functools.partial(_prefill_kernel, kv_heads=kvh, group=nh // kvh, head_dim=d, page_size=ps,
                               pages=p, block_q=bq, block_k=bk)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5, grid=(item_block.shape[0], steps),
            in_specs=[pl.BlockSpec((bq, nh * d), lambda i, j, ib, *_: (ib[i], 0)),
                      pl.BlockSpec((bk, kvh * d), key_index),
                      pl.BlockSpec((bk, kvh * d), key_index),
                      pl.BlockSpec((1, 2, ps, pool_layer.shape[3]), page_index)],
            out_specs=pl.BlockSpec((bq, nh * d), lambda i, j, ib, *_: (ib[i], 0)),
            scratch_shapes=[pltpu.VMEM((nh, bq, _LANES), jnp.float32), pltpu.VMEM((nh, bq, _LANES), jnp.float32),
                            pltpu.VMEM((bq, nh * d), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((tp, nh * d), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=_interpret_arg(interpret),
    )(item_block, item_seq, bounds, pt, ctx, pad(q), pad(k), pad(v), pool_layer)
    return out[:t].reshape(t, nh, d)


# ---------------------------------------------------------------------------------------------
# References (plain jnp).


def _attend_reference(q, keys, vals, live):
    """q [n, H, d] against keys / vals [n, K, KVH, d] with live [n, K]."""
    n, nh, d = q.shape
    kvh = keys.shape[2]
    qg = q.reshape(n, kvh, nh // kvh, d)
    s = jnp.einsum("nkgd,nskd->nkgs", qg, keys.astype(q.dtype), preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST) / math.sqrt(d)
    w = jax.nn.softmax(jnp.where(live[:, None, None, :], s, -jnp.inf), axis=-1)
    o = jnp.einsum("nkgs,nskd->nkgd", w.astype(vals.dtype), vals, preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST)
    return o.reshape(n, nh, d).astype(q.dtype)


def _pooled(pool_layer, page_table, kvh: int, d: int):
    s, p = page_table.shape
    kv = pool_layer[page_table]  # [S, P, 2, ps, W]
    return kv[:, :, 0].reshape(s, -1, kvh, d), kv[:, :, 1].reshape(s, -1, kvh, d)


def paged_decode_attention_reference(q, k_new, v_new, pool_layer, page_table, ctx_lens):
    kvh, d = k_new.shape[1], k_new.shape[2]
    pk, pv = _pooled(pool_layer, page_table, kvh, d)
    dt = pool_layer.dtype
    keys = jnp.concatenate([pk, k_new[:, None].astype(dt)], axis=1)
    vals = jnp.concatenate([pv, v_new[:, None].astype(dt)], axis=1)
    c = pk.shape[1]
    live = jnp.concatenate([jnp.arange(c)[None, :] < ctx_lens[:, None], jnp.ones((q.shape[0], 1), bool)], axis=1)
    return _attend_reference(q, keys, vals, live)


def paged_prefill_attention_reference(q, k, v, pool_layer, page_table, ctx_lens, seq_starts):
    t = q.shape[0]
    kvh, d = k.shape[1], k.shape[2]
    s = page_table.shape[0]
    pk, pv = _pooled(pool_layer, page_table, kvh, d)
    c = pk.shape[1]
    idx = jnp.arange(t)
    seq = jnp.searchsorted(seq_starts, idx, side="right") - 1
    real = idx < seq_starts[-1]
    seq_c = jnp.clip(seq, 0, s - 1)
    dt = pool_layer.dtype
    keys = jnp.concatenate([pk[seq_c], jnp.broadcast_to(k.astype(dt), (t, t, kvh, d))], axis=1)
    vals = jnp.concatenate([pv[seq_c], jnp.broadcast_to(v.astype(dt), (t, t, kvh, d))], axis=1)
    live_ctx = jnp.arange(c)[None, :] < ctx_lens[seq_c][:, None]
    live_new = (seq[None, :] == seq[:, None]) & (idx[None, :] <= idx[:, None]) & real[None, :]
    live = jnp.concatenate([live_ctx, live_new], axis=1) & real[:, None]
    live = live.at[:, -1].set(live[:, -1] | ~real)  # padding rows: any live key, then zeroed
    out = _attend_reference(q, keys, vals, live)
    return jnp.where(real[:, None, None], out, 0).astype(q.dtype)
