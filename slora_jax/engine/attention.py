"""Attention over the unified pool, and the writes of each step's new K/V into it.

`paged_attend(inp)` is the attention callback the model runs in every layer: under
attention_backend "pallas" decode steps take the Pallas paged decode kernel
(pallas_kernels.paged_attention) and packed prefill steps the Pallas prefill kernel
(pallas_kernels.prefill_attention); under "pallas_tpu" both take the Mosaic TPU kernels
(pallas_kernels.tpu.paged_attention); "xla" runs `paged_attention_xla`, the plain-jnp reference
beside them. `prefill_tables` gives the prefill kernels each sequence's context. Attention only
reads the pool; `commit_kv` writes the step's K/V afterwards, in a jit of its own.

`inp` is the step's StepInputs (slora_jax.engine.step).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention import paged_decode_attention
from pallas_kernels.prefill_attention import paged_prefill_attention
from pallas_kernels.tpu import interpret_mode
from pallas_kernels.tpu import paged_attention as tpu_attention
from slora_jax.model import llama as model
from slora_jax.model import tp as tp_mod

# Queries per block of the xla packed prefill attention: bounds the live scores [heads, block,
# keys] (at 4096 tokens x 32 sequences x 32 pages, every query at once takes 20 GiB).
QUERY_BLOCK = 512


def paged_attention_xla(q, k, v, pool_layer, inp):
    """q, k, v [T, heads, d]: this step's tokens. Each token attends to its sequence's context
    already in the pool and, causally, to this step's tokens of the same sequence. Decode reads
    each row's pages through the page table; packed prefill reads the step's context pages
    (ctx_pages), every sequence's in turn. The pool is only read here: the step writes this step's
    K/V after every read, so the donated pool is updated in place (see commit_kv)."""
    ps = pool_layer.shape[2]
    kvh, d = k.shape[1], k.shape[2]
    if inp.decode:  # token i is sequence i
        s, p = inp.page_table.shape
        kv = pool_layer[inp.page_table]  # [S, P, 2, ps, W]
        pk = kv[:, :, 0].reshape(s, p * ps, kvh, d)
        pv = kv[:, :, 1].reshape(s, p * ps, kvh, d)
        in_ctx = jnp.arange(p * ps)[None, :] < inp.ctx_lens[:, None]  # [S, C]
        keys = jnp.concatenate([pk, k[:, None]], axis=1)
        vals = jnp.concatenate([pv, v[:, None]], axis=1)
        mask = jnp.concatenate([in_ctx, jnp.ones((s, 1), bool)], axis=1)[:, None, :]
        return model.attention_scores_softmax(q[:, None], keys, vals, mask)[:, 0]
    # Packed prefill: every token against the step's pooled context and every new token, masked
    # to its own sequence (and causally among the new tokens). Pooled keys are left out when no
    # sequence has context yet. The queries go in blocks of QUERY_BLOCK (a loop), so one block's
    # scores are alive at a time, and with a key window a block reads only the new tokens that can
    # be in its sequences: [start - key_window, end).
    t = q.shape[0]
    tb = min(t, QUERY_BLOCK)
    if t % tb:
        tb = t
    span = tb + inp.key_window
    windowed = 0 < inp.key_window and tb < t and span < t
    if inp.prefill_context:
        n = inp.ctx_pages.shape[0] * ps
        kv = pool_layer[inp.ctx_pages]  # [K, 2, ps, W]
        pooled_k, pooled_v = kv[:, 0].reshape(n, kvh, d), kv[:, 1].reshape(n, kvh, d)
        live = jnp.arange(ps)[None, :] < inp.ctx_page_fill[:, None]  # [K, ps]
        # Each pooled key's sequence row; -1 past a context (padding queries may read those:
        # their outputs are never used).
        pooled_seq = jnp.where(live, inp.ctx_page_seq[:, None], -1).reshape(n)

    def block(args):
        qb, seq_b, pos_b, b = args
        if windowed:
            lo = jnp.clip(b * tb - inp.key_window, 0, t - span)
            kn, vn = jax.lax.dynamic_slice_in_dim(k, lo, span), jax.lax.dynamic_slice_in_dim(v, lo, span)
            seq_k = jax.lax.dynamic_slice_in_dim(inp.token_seq, lo, span)
            pos_k = jax.lax.dynamic_slice_in_dim(inp.positions, lo, span)
        else:
            kn, vn, seq_k, pos_k = k, v, inp.token_seq, inp.positions
        mask = (seq_b[:, None] == seq_k[None, :]) & (pos_k[None, :] <= pos_b[:, None])  # [B, keys]
        keys, vals = kn, vn
        if inp.prefill_context:
            mask = jnp.concatenate([seq_b[:, None] == pooled_seq[None, :], mask], axis=1)
            keys, vals = jnp.concatenate([pooled_k, kn], axis=0), jnp.concatenate([pooled_v, vn], axis=0)
        return model.attention_scores_softmax(qb[None], keys[None], vals[None], mask[None])[0]

    if tb == t:
        return block((q, inp.token_seq, inp.positions, 0))
    nb = t // tb
    out = jax.lax.map(block, (q.reshape(nb, tb, *q.shape[1:]), inp.token_seq.reshape(nb, tb),
                              inp.positions.reshape(nb, tb), jnp.arange(nb)))
    return out.reshape(q.shape)


def prefill_tables(inp):
    """The prefill kernels' (page_table [S, K], ctx_lens [S], seq_starts [S + 1]) of a packed
    prefill step: row s is sequence s. The step's tokens are already grouped by sequence in row
    order with the padding last (StepInputBuilder.prefill), so seq_starts counts them; the step's
    context pages (ctx_pages, each sequence's in turn) are scattered into a table as wide as all
    of them, of which the kernel reads only each row's live pages."""
    s = inp.sample_idx.shape[0]
    seq = jnp.where(inp.token_seq < 0, s, inp.token_seq)  # padding after every sequence
    seq_starts = jnp.searchsorted(seq, jnp.arange(s + 1), side="left").astype(jnp.int32)
    if not inp.prefill_context:  # fresh prompts: no pooled page is read
        return jnp.zeros((s, 1), jnp.int32), jnp.zeros((s,), jnp.int32), seq_starts
    k = inp.ctx_pages.shape[0]
    rows = jnp.where(inp.ctx_page_seq < 0, s, inp.ctx_page_seq)  # padding pages fall off the end
    first = jax.ops.segment_min(jnp.arange(k), rows, num_segments=s + 1)  # each sequence's first page
    cols = jnp.arange(k) - first[rows]
    table = jnp.zeros((s, k), jnp.int32).at[rows, cols].set(inp.ctx_pages, mode="drop")
    ctx = jax.ops.segment_sum(inp.ctx_page_fill, rows, num_segments=s + 1)[:s]
    return table, ctx.astype(jnp.int32), seq_starts


def tpu_prefill_blocks(t: int) -> tpu_attention.PrefillBlocks:
    """Query and key blocks of a packed prefill step of t tokens (a power of two, at least 16):
    the kernel's default, or one block for a shorter step."""
    default = tpu_attention.PrefillBlocks()
    return tpu_attention.PrefillBlocks(min(default.block_q, t), min(default.block_k, t))


def write_kv(pool_layer, k, v, kv_slot):
    ps = pool_layer.shape[2]
    page, off = kv_slot // ps, kv_slot % ps
    pool_layer = pool_layer.at[page, 0, off].set(k.reshape(k.shape[0], -1).astype(pool_layer.dtype))
    return pool_layer.at[page, 1, off].set(v.reshape(v.shape[0], -1).astype(pool_layer.dtype))


def paged_attend(inp):
    """Attention reads the pool; each layer's new K/V is returned and written by `commit_kv`."""
    if not inp.decode and inp.attention_backend in ("pallas", "pallas_tpu"):
        tables = prefill_tables(inp)  # once a step, shared by every layer

    def attend(layer, q, k, v, state):
        pool, pending = state
        if inp.decode and inp.attention_backend == "pallas":
            o = paged_decode_attention(q, k, v, pool[layer], inp.page_table, inp.ctx_lens)
        elif inp.decode and inp.attention_backend == "pallas_tpu":
            o = tpu_attention.paged_decode_attention(q, k, v, pool[layer], inp.page_table, inp.ctx_lens,
                                                     interpret=interpret_mode())
        elif inp.attention_backend == "pallas":  # packed prefill
            o = paged_prefill_attention(q, k, v, pool[layer], *tables)
        elif inp.attention_backend == "pallas_tpu":  # packed prefill
            o = tpu_attention.paged_prefill_attention(q, k, v, pool[layer], *tables,
                                                      blocks=tpu_prefill_blocks(q.shape[0]),
                                                      interpret=interpret_mode())
        else:
            o = paged_attention_xla(q, k, v, pool[layer], inp)
        return o, (pool, pending + ((k, v),))
    return attend


def _write_kv_all(pool: list[jax.Array], new_kv, kv_slot: jax.Array) -> list[jax.Array]:
    return [write_kv(pl, k, v, kv_slot) for pl, (k, v) in zip(pool, new_kv)]


@functools.partial(jax.jit, donate_argnums=0)
def commit_kv(pool: list[jax.Array], new_kv, kv_slot: jax.Array) -> list[jax.Array]:
    """Write every layer's new K/V [T, kv_heads, d] at kv_slot [T]. A jit of its own that only
    scatters into the donated pool, so XLA updates it in place on every backend; inside the
    step, where the same buffers are also gathered from, XLA on GPU copies them instead."""
    return _write_kv_all(pool, new_kv, kv_slot)


@functools.partial(jax.jit, static_argnames=("tp",), donate_argnums=0)
def commit_kv_tp(pool: list[jax.Array], new_kv, kv_slot: jax.Array, *, tp) -> list[jax.Array]:
    """commit_kv on each device's columns of the pool and its heads' K/V."""
    specs, kv = [tp_mod.POOL] * len(pool), tuple((tp_mod.KV, tp_mod.KV) for _ in pool)
    return jax.shard_map(_write_kv_all, mesh=tp.mesh, in_specs=(specs, kv, tp_mod.REPLICATED), out_specs=specs,
                         check_vma=False)(pool, new_kv, kv_slot)
