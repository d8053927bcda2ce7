"""Attention over the unified pool, and the writes of each step's new K/V into it.

`paged_attend(inp)` is the attention callback the model runs in every layer: decode steps take
the Pallas paged decode kernel (pallas_kernels.paged_attention) under attention_backend
"pallas", the Mosaic TPU decode kernel (pallas_kernels.tpu.paged_attention) under
"pallas_tpu", everything else `paged_attention_xla`, the plain-jnp reference beside it. Attention
only reads the pool; `commit_kv` writes the step's K/V afterwards, in a jit of its own.

`inp` is the step's StepInputs (slora_jax.engine.step).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention import paged_decode_attention
from pallas_kernels.tpu import interpret_mode
from pallas_kernels.tpu import paged_attention as tpu_attention
from slora_jax.model import llama as model
from slora_jax.model import tp as tp_mod

# Queries per block of the xla packed prefill attention: bounds the live scores [heads, block,
# keys] (at 4096 tokens x 32 sequences x 32 pages, every query at once takes 20 GiB).
QUERY_BLOCK = 512


def paged_attention_xla(q, k, v, pool_layer, inp):
    """q, k, v [T, heads, d]: this step's tokens. Each token attends to its sequence's context
    already in the pool (positions < ctx_lens) and, causally, to this step's tokens of the same
    sequence. The pool is only read here: the step writes this step's K/V after every read, so
    the donated pool is updated in place (see commit_kv)."""
    s, p = inp.page_table.shape
    ps = pool_layer.shape[2]
    kvh, d = k.shape[1], k.shape[2]
    if inp.decode or inp.prefill_context:  # a fresh-prompt prefill step reads no pooled page
        kv = pool_layer[inp.page_table]  # [S, P, 2, ps, W]
        pk = kv[:, :, 0].reshape(s, p * ps, kvh, d)
        pv = kv[:, :, 1].reshape(s, p * ps, kvh, d)
        in_ctx = jnp.arange(p * ps)[None, :] < inp.ctx_lens[:, None]  # [S, C]
    if inp.decode:  # token i is sequence i
        keys = jnp.concatenate([pk, k[:, None]], axis=1)
        vals = jnp.concatenate([pv, v[:, None]], axis=1)
        mask = jnp.concatenate([in_ctx, jnp.ones((s, 1), bool)], axis=1)[:, None, :]
        return model.attention_scores_softmax(q[:, None], keys, vals, mask)[:, 0]
    # Packed prefill: every token against every sequence's pooled context and every new token,
    # masked to its own sequence (and causally among the new tokens).
    # The queries go in blocks of QUERY_BLOCK (a loop), so one block's scores are alive at a time.
    # Pooled keys are left out when no sequence has context yet, and with a key window a block
    # reads only the new tokens that can be in its sequences: [start - key_window, end).
    t = q.shape[0]
    tb = min(t, QUERY_BLOCK)
    if t % tb:
        tb = t
    span = tb + inp.key_window
    windowed = 0 < inp.key_window and tb < t and span < t
    ctx_keys = s * p * ps if inp.prefill_context else 0
    if inp.prefill_context:
        pooled_k, pooled_v = pk.reshape(ctx_keys, kvh, d), pv.reshape(ctx_keys, kvh, d)

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
            rows = jnp.arange(s) if inp.ctx_seq is None else inp.ctx_seq
            same = seq_b[:, None] == rows[None, :]                                       # [B, S]
            ctx_mask = (same[:, :, None] & in_ctx[None]).reshape(qb.shape[0], ctx_keys)
            mask = jnp.concatenate([ctx_mask, mask], axis=1)
            keys, vals = jnp.concatenate([pooled_k, kn], axis=0), jnp.concatenate([pooled_v, vn], axis=0)
        return model.attention_scores_softmax(qb[None], keys[None], vals[None], mask[None])[0]

    if tb == t:
        return block((q, inp.token_seq, inp.positions, 0))
    nb = t // tb
    out = jax.lax.map(block, (q.reshape(nb, tb, *q.shape[1:]), inp.token_seq.reshape(nb, tb),
                              inp.positions.reshape(nb, tb), jnp.arange(nb)))
    return out.reshape(q.shape)


def write_kv(pool_layer, k, v, kv_slot):
    ps = pool_layer.shape[2]
    page, off = kv_slot // ps, kv_slot % ps
    pool_layer = pool_layer.at[page, 0, off].set(k.reshape(k.shape[0], -1).astype(pool_layer.dtype))
    return pool_layer.at[page, 1, off].set(v.reshape(v.shape[0], -1).astype(pool_layer.dtype))


def paged_attend(inp):
    """Attention reads the pool; each layer's new K/V is returned and written by `commit_kv`."""
    def attend(layer, q, k, v, state):
        pool, pending = state
        if inp.decode and inp.attention_backend == "pallas":
            o = paged_decode_attention(q, k, v, pool[layer], inp.page_table, inp.ctx_lens)
        elif inp.decode and inp.attention_backend == "pallas_tpu":
            o = tpu_attention.paged_decode_attention(q, k, v, pool[layer], inp.page_table, inp.ctx_lens,
                                                     interpret=interpret_mode())
        else:  # packed prefill has no kernel: xla
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
