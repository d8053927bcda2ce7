"""Packed prefill attention over the unified pool (GPU, Triton lowering): each new token attends to
its sequence's context in the pool and, causally, to the step's new tokens of its sequence.

A packed prefill step holds several sequences' chunks, one after another (seq_starts [S + 1] gives
each one's tokens, the padding comes last). Sequence s already has ctx_lens[s] tokens in the pool,
on the pages of page_table[s] (slora_jax/model/layout.py: a layer is [pages, 2, page_size, W], W =
kv_heads * head_dim). Work is proportional to what each sequence sees, sum over s of (its new
tokens) x (its context + its new tokens); the engine's xla attention is a dense masked attention
over the whole step, (all new tokens) x (all context + all new tokens), so the engine keeps a
step's context near a token budget's pages (Engine.context_pages), which with prefix caching
leaves room for few rows over long cached prefixes.

Grid (query block, query head). A query block is up to `block_q` new tokens of ONE sequence; the
blocks of every sequence are numbered one after another (`query_blocks`), so a static grid of
ceil(T / block_q) + S blocks covers any packing, and the blocks past the last one are idle. A
program loads its block's queries of one head, runs the online softmax (running max, sum, f32
accumulator) over the sequence's pooled context in tiles of `block_k` tokens (trip count traced:
only the sequence's pages are read), then over its new keys from the sequence's first token up
to the block's last query, masked causally, and stores its rows. K/V tiles of the pool are read
as decode attention reads them (pallas_kernels/paged_attention.py): one contiguous slice when a
tile lies inside a page, else a gather of one row per token.

Padding tokens come out as zeros, as from the reference. The same kernel body runs in interpret
mode (CPU) and through the Triton lowering (GPU). The engine's GPU prefill steps run the xla
attention (slora_jax/engine/attention.py) until this kernel measures faster on a GPU:
bench/prefill_attention.py times the two on the same step inputs.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_attention import MIN_DOT


@dataclasses.dataclass(frozen=True)
class PrefillBlockSizes:
    """block_q: new tokens per program (the dots' M side); block_k: keys per tile (N side);
    both powers of two >= 16. Not yet tuned on a GPU."""
    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2


def query_blocks(seq_starts, num_blocks: int, block_q: int):
    """(row, first token) of each of `num_blocks` query blocks: sequence s's tokens
    [seq_starts[s], seq_starts[s + 1]) in blocks of block_q, one sequence after another. Blocks
    past the last sequence's get row S (idle) and first token 0."""
    s = seq_starts.shape[0] - 1
    lens = seq_starts[1:] - seq_starts[:-1]
    per_row = (lens + block_q - 1) // block_q
    ends = jnp.cumsum(per_row)
    j = jnp.arange(num_blocks, dtype=jnp.int32)
    row = jnp.searchsorted(ends, j, side="right").astype(jnp.int32)
    rc = jnp.minimum(row, s - 1)
    first = seq_starts[rc] + (j - (ends[rc] - per_row[rc])) * block_q
    return row, jnp.where(row < s, first, 0).astype(jnp.int32)


def _online_softmax(carry, scores, v, precision):
    """One tile of the online softmax; scores [Q, K] with -inf where masked, v [K, d]."""
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(scores, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with nothing live yet: no inf - inf
    corr = jnp.exp(m - m_safe)
    p = jnp.exp(scores - m_safe[:, None])
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
    return m_new, corr * l + jnp.sum(p, axis=1), corr[:, None] * acc + pv


def _prefill_kernel(row_ref, first_ref, starts_ref, ctx_ref, pt_ref, q_ref, k_ref, v_ref, pool_ref, o_ref, *,
                    group, head_dim, page_size, block_q, block_k, precision):
    j, h = pl.program_id(0), pl.program_id(1)
    d, bq, bk, ps = head_dim, block_q, block_k, page_size
    s_rows = ctx_ref.shape[0]
    row = row_ref[j]
    idle = row >= s_rows
    rc = jnp.minimum(row, s_rows - 1)
    q0 = first_ref[j]
    start = starts_ref[rc]
    end = jnp.where(idle, q0, starts_ref[rc + 1])
    ctx = jnp.where(idle, 0, ctx_ref[rc])
    n_q = jnp.clip(end - q0, 0, bq)
    q_idx = q0 + jnp.arange(bq)
    scale = 1.0 / math.sqrt(d)
    q_cols = pl.ds(pl.multiple_of(h * d, d), d)
    kv_cols = pl.ds(pl.multiple_of((h // group) * d, d), d)
    q = q_ref[pl.ds(q0, bq), q_cols].astype(pool_ref.dtype)  # [bq, d]

    def attend(carry, k, v, key_live, live):
        v = jnp.where(key_live[:, None], v, 0)  # rows past the keys may hold anything
        scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32) * scale  # [bq, bk]
        return _online_softmax(carry, jnp.where(live, scores, -jnp.inf), v, precision)

    def pooled_tile(i, carry):
        tok = i * bk + jnp.arange(bk)
        if ps % bk == 0:  # the tile lies inside one page
            page = pt_ref[rc, jax.lax.div(i * bk, ps)]
            first_row = pl.multiple_of(page * (2 * ps) + jax.lax.rem(i * bk, ps), bk)
            k = pool_ref[pl.ds(first_row, bk), kv_cols]
            v = pool_ref[pl.ds(first_row + ps, bk), kv_cols]
        else:  # a gather of rows from several pages (page_size 1: one page per token)
            tok_c = jnp.minimum(tok, ctx - 1)
            page = pt_ref[rc, jax.lax.div(tok_c, ps)]
            rows = page * (2 * ps) + jax.lax.rem(tok_c, ps)
            col = (h // group) * d + jnp.arange(d)
            k = pool_ref[rows[:, None], col[None, :]]
            v = pool_ref[(rows + ps)[:, None], col[None, :]]
        key_live = tok < ctx
        return attend(carry, k, v, key_live, jnp.broadcast_to(key_live[None, :], (bq, bk)))

    def new_tile(i, carry):
        k0 = start + i * bk
        tok = k0 + jnp.arange(bk)
        k = k_ref[pl.ds(k0, bk), kv_cols].astype(pool_ref.dtype)
        v = v_ref[pl.ds(k0, bk), kv_cols].astype(pool_ref.dtype)
        key_live = tok < end
        return attend(carry, k, v, key_live, (tok[None, :] <= q_idx[:, None]) & key_live[None, :])

    zeros = jnp.zeros((bq,), jnp.float32)
    carry = (zeros - jnp.inf, zeros, jnp.zeros((bq, d), jnp.float32))
    carry = jax.lax.fori_loop(0, jax.lax.div(ctx + bk - 1, bk), pooled_tile, carry)
    carry = jax.lax.fori_loop(0, jax.lax.div(jnp.maximum(q0 + n_q - start, 0) + bk - 1, bk), new_tile, carry)
    _, l, acc = carry
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    plgpu.store(o_ref.at[pl.ds(q0, bq), q_cols], out.astype(o_ref.dtype),
                mask=(jnp.arange(bq) < n_q)[:, None])


@functools.partial(jax.jit, static_argnames=("interpret", "sizes"))
def _prefill(q, k, v, pool_layer, page_table, ctx_lens, seq_starts, *, interpret, sizes: PrefillBlockSizes):
    t, nh, d = q.shape
    kvh = k.shape[1]
    num_pages, _, ps, width = pool_layer.shape
    s = page_table.shape[0]
    bq, bk = min(sizes.block_q, pl.next_power_of_2(t)), sizes.block_k  # Triton tiles are powers of two
    num_blocks = -(-t // bq) + s
    seq_starts = seq_starts.astype(jnp.int32)
    row, first = query_blocks(seq_starts, num_blocks, bq)
    pad = lambda a, n: jnp.pad(a.reshape(t, -1), ((0, n), (0, 0)))  # a block may start at any token
    kernel = functools.partial(
        _prefill_kernel, group=nh // kvh, head_dim=d, page_size=ps, block_q=bq, block_k=bk,
        precision=jax.lax.Precision.HIGHEST if pool_layer.dtype == jnp.float32 else None)
    compiler_params = None if interpret else plgpu.CompilerParams(
        num_warps=sizes.num_warps, num_stages=sizes.num_stages)
    out = pl.pallas_call(
        kernel,
        grid=(num_blocks, nh),
        out_shape=jax.ShapeDtypeStruct((t + bq, nh * d), q.dtype),
        interpret=interpret,
        compiler_params=compiler_params,
        name="paged_prefill_attention",
    )(row, first, seq_starts, ctx_lens.astype(jnp.int32), page_table.astype(jnp.int32), pad(q, bq),
      pad(k, bk), pad(v, bk), pool_layer.reshape(num_pages * 2 * ps, width))
    real = jnp.arange(t) < seq_starts[-1]
    return jnp.where(real[:, None], out[:t], 0).reshape(t, nh, d)


def _interpret(interpret):
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def _pow2_at_least_16(n: int) -> bool:
    return n >= MIN_DOT and n & (n - 1) == 0


def paged_prefill_attention(q, k, v, pool_layer, page_table, ctx_lens, seq_starts, *, interpret=None,
                            sizes: PrefillBlockSizes | None = None):
    """q [T, nh, d], k / v [T, kvh, d]: the step's new tokens (not yet in the pool), grouped by
    sequence as seq_starts [S + 1] says, padding last; pool_layer [pages, 2, page_size, kvh * d];
    page_table [S, P] and ctx_lens [S]: each sequence's context in the pool (entries past its pages
    are never read). Returns [T, nh, d] in q's dtype, zeros for padding tokens; scale 1/sqrt(d), f32
    accumulation, dots in the pool's dtype."""
    t, nh, d = q.shape
    kvh = k.shape[1]
    assert nh % kvh == 0 and pool_layer.shape[3] == kvh * d, (q.shape, k.shape, pool_layer.shape)
    sizes = sizes or PrefillBlockSizes()
    if not (_pow2_at_least_16(sizes.block_q) and _pow2_at_least_16(sizes.block_k)):
        raise ValueError(f"block_q and block_k must be powers of two >= 16, got {sizes}")
    if not _pow2_at_least_16(d) or t < MIN_DOT:
        # Triton tiles are powers of two, dot sides >= 16: toy shapes use the reference.
        return paged_prefill_attention_reference(q, k, v, pool_layer, page_table, ctx_lens, seq_starts)
    interpret = _interpret(interpret)
    if not interpret and pool_layer.size >= 2**31:
        raise ValueError(f"a pool layer of {pool_layer.size} elements is past int32 offsets; "
                         "use fewer pages per layer")
    return _prefill(q, k, v, pool_layer, page_table, ctx_lens, seq_starts, interpret=interpret, sizes=sizes)


# ---------------------------------------------------------------------------------------------
# Reference (plain jnp): the oracle for the kernel. Memory grows as T x (P * page_size + T).


@jax.jit
def paged_prefill_attention_reference(q, k, v, pool_layer, page_table, ctx_lens, seq_starts):
    t, nh, d = q.shape
    kvh = k.shape[1]
    s, p = page_table.shape
    dt = pool_layer.dtype
    kv = pool_layer[page_table]  # [S, P, 2, ps, W]
    pooled_k, pooled_v = kv[:, :, 0].reshape(s, -1, kvh, d), kv[:, :, 1].reshape(s, -1, kvh, d)
    idx = jnp.arange(t)
    seq = jnp.searchsorted(seq_starts, idx, side="right") - 1
    real = idx < seq_starts[-1]
    seq_c = jnp.clip(seq, 0, s - 1)
    keys = jnp.concatenate([pooled_k[seq_c], jnp.broadcast_to(k.astype(dt), (t, t, kvh, d))], axis=1)
    vals = jnp.concatenate([pooled_v[seq_c], jnp.broadcast_to(v.astype(dt), (t, t, kvh, d))], axis=1)
    live_ctx = jnp.arange(pooled_k.shape[1])[None, :] < ctx_lens[seq_c][:, None]
    live_new = (seq[None, :] == seq[:, None]) & (idx[None, :] <= idx[:, None])
    live = jnp.concatenate([live_ctx, live_new], axis=1)  # a padding row sees itself at least
    qg = q.reshape(t, kvh, nh // kvh, d).astype(dt)
    scores = jnp.einsum("tkgd,tskd->tkgs", qg, keys, preferred_element_type=jnp.float32,
                        precision=jax.lax.Precision.HIGHEST) / math.sqrt(d)
    w = jax.nn.softmax(jnp.where(live[:, None, None, :], scores, -jnp.inf), axis=-1)
    o = jnp.einsum("tkgs,tskd->tkgd", w.astype(dt), vals, preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST)
    return jnp.where(real[:, None, None], o.reshape(t, nh, d), 0).astype(q.dtype)
