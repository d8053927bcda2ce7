"""Decode attention over the unified pool: one new token per sequence, GQA, flash-decoding.

Sequence b has ctx_lens[b] tokens in the pool (slora_jax/model/layout.py: a layer is [pages, 2, page_size,
W], W = kv_heads * head_dim; token t's K row is pool[page_table[b, t // ps], 0, t % ps], its V row
the same at [.., 1, ..]) and attends to all of them plus this step's token, whose K/V are passed in
(the step writes them into the pool after every read, see slora_jax/engine/step.py).

Grid (batch, kv head, split). A program owns one kv head of one sequence and all nh/kvh query
heads of that group, so one read of a K/V tile serves the whole group (GQA): the group's queries
are the M side of the two dots, padded to 16 rows (Triton's smallest dot side). The context is cut
into blocks of `block_tokens` tokens; split s takes blocks s, s + S, s + 2S, ... below
ceil(ctx_len / block_tokens), a loop whose trip count is traced, so only the valid pages of each
sequence are read, and a split past the context reads nothing. The loop is the online softmax
(running max, running sum, f32 accumulator). The new token is the loop's initial state (in split
0), so a sequence with an empty context reads nothing from the pool. With one split the program
normalises and writes the output; with S > 1 (split-K flash decoding, for batches whose
batch * kv_heads programs cannot fill the GPU) each split writes its unnormalised accumulator,
max and sum in f32, and a small jnp pass merges the splits.

Pages. The pool is seen as rows [pages * 2 * ps, W]. When page_size is a multiple of the block, a
block lies inside one page: one page-table entry, then a contiguous [block, head_dim] slice for K
and one for V. Otherwise (page_size 1, S-LoRA's token-granular pool, or any page smaller than a
block) the block is a gather: one page-table entry per token, and K and V as a 2-D gather of
`block_tokens` rows (each a contiguous head_dim run, so the column side still vectorises). Tokens
past the context in the last block are clamped onto the last valid token, so no page-table entry
past the sequence's pages (they point at the null page) is ever followed; they are masked out of
the softmax.

The same kernel body runs in interpret mode (CPU) and through the Triton lowering (GPU). The
Triton backend has neither scalar prefetch nor dynamic grid bounds, hence the static grid and the
in-kernel reads of ctx_lens and the page table.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.fuser  # noqa: F401 (see pallas_kernels/lora.py)
from jax.experimental.pallas import triton as plgpu

@dataclasses.dataclass(frozen=True)
class AttentionBlockSizes:
    """The decode kernel's settings. block_tokens: tokens per K/V tile (a power of two >= 16, the
    dots' N and K sides; K and V tiles of 16 KiB each at head_dim 128, so two pipeline stages leave
    room for a few programs per SM); min_programs: the auto split count aims for at least this
    many programs (two per SM of an H200's 132); max_splits caps it. Not yet tuned on a GPU."""
    block_tokens: int = 64
    num_warps: int = 4
    num_stages: int = 2
    min_programs: int = 264
    max_splits: int = 16

    @classmethod
    def get_default(cls, dtype) -> "AttentionBlockSizes":
        """Tiles of the same bytes for every pool dtype: 64 tokens at 2 bytes, 32 at 4."""
        return cls(block_tokens=64 if jnp.dtype(dtype).itemsize <= 2 else 32)


MIN_DOT = 16  # Triton's smallest dot side: the query group is padded to this many rows


# ---------------------------------------------------------------------------------------------
# Kernel.


def _decode_kernel(ctx_ref, pt_ref, q_ref, k_new_ref, v_new_ref, rows_ref, *out_refs, group,
                   group_pad, head_dim, page_size, block_tokens, num_splits, precision):
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    d, bt, ps = head_dim, block_tokens, page_size
    scale = 1.0 / math.sqrt(d)
    ctx = ctx_ref[b]
    head_live = jnp.arange(group_pad) < group
    heads = pl.ds(h * group, group_pad)
    cols = pl.ds(pl.multiple_of(h * d, d), d)
    q = plgpu.load(q_ref.at[b, heads, :], mask=head_live[:, None], other=0)  # [G, d]
    q = q.astype(rows_ref.dtype)

    # The new token opens split 0's online softmax: max = its score, sum = 1, acc = its V.
    k_new = k_new_ref[b, h, :].astype(jnp.float32)
    v_new = v_new_ref[b, h, :].astype(jnp.float32)
    s_new = jnp.sum(q.astype(jnp.float32) * k_new[None, :], axis=1) * scale
    first = s == 0
    zeros = jnp.zeros((group_pad,), jnp.float32)
    m0 = jnp.where(first, s_new, zeros - jnp.inf)
    l0 = jnp.where(first, zeros + 1.0, zeros)
    acc0 = jnp.where(first, jnp.broadcast_to(v_new[None, :], (group_pad, d)), zeros[:, None])

    def block(i, carry):
        m, l, acc = carry
        start = (s + i * num_splits) * bt
        tok = start + jnp.arange(bt)
        live = tok < ctx
        if ps % bt == 0:  # the block lies inside one page
            page = pt_ref[b, jax.lax.div(start, ps)]
            row = pl.multiple_of(page * (2 * ps) + jax.lax.rem(start, ps), bt)
            k = rows_ref[pl.ds(row, bt), cols]
            v = rows_ref[pl.ds(row + ps, bt), cols]
        else:  # a gather of rows from several pages (page_size 1: one page per token)
            tok_c = jnp.minimum(tok, ctx - 1)
            page = pt_ref[b, jax.lax.div(tok_c, ps)]
            row = page * (2 * ps) + jax.lax.rem(tok_c, ps)
            col = h * d + jnp.arange(d)
            k = rows_ref[row[:, None], col[None, :]]
            v = rows_ref[(row + ps)[:, None], col[None, :]]
        v = jnp.where(live[:, None], v, 0)  # dead rows may hold anything
        scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32) * scale  # [G, bt]
        scores = jnp.where(live[None, :], scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(scores - m_new[:, None])
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 precision=precision, preferred_element_type=jnp.float32)
        return m_new, corr * l + jnp.sum(p, axis=1), corr[:, None] * acc + pv

    n_blocks = jax.lax.div(ctx + bt - 1, bt)
    trips = jax.lax.div(jnp.maximum(n_blocks - s + num_splits - 1, 0), num_splits)
    m, l, acc = jax.lax.fori_loop(0, trips, block, (m0, l0, acc0))

    if num_splits == 1:
        (o_ref,) = out_refs
        plgpu.store(o_ref.at[b, heads, :], (acc / l[:, None]).astype(o_ref.dtype),
                    mask=head_live[:, None])
    else:
        acc_ref, m_ref, l_ref = out_refs
        plgpu.store(acc_ref.at[s, b, heads, :], acc, mask=head_live[:, None])
        plgpu.store(m_ref.at[s, b, heads], m, mask=head_live)
        plgpu.store(l_ref.at[s, b, heads], l, mask=head_live)


# ---------------------------------------------------------------------------------------------
# Builder: grid, split count and the pallas_call; then the merge of the splits.


def _auto_splits(batch: int, kv_heads: int, max_blocks: int, sizes: AttentionBlockSizes) -> int:
    want = -(-sizes.min_programs // (batch * kv_heads))
    return max(1, min(want, max_blocks, sizes.max_splits))


@functools.partial(jax.jit, static_argnames=("interpret", "block_tokens", "num_splits", "sizes"))
def _decode(q, k_new, v_new, pool_layer, page_table, ctx_lens, *, interpret, block_tokens,
            num_splits, sizes: AttentionBlockSizes):
    bsz, nh, d = q.shape
    kvh = k_new.shape[1]
    num_pages, _, ps, width = pool_layer.shape
    group = nh // kvh
    group_pad = max(MIN_DOT, pl.next_power_of_2(group))
    kernel = functools.partial(
        _decode_kernel, group=group, group_pad=group_pad, head_dim=d, page_size=ps,
        block_tokens=block_tokens, num_splits=num_splits,
        precision=jax.lax.Precision.HIGHEST if pool_layer.dtype == jnp.float32 else None)
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        out_shape = (jax.ShapeDtypeStruct((num_splits, bsz, nh, d), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, bsz, nh), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, bsz, nh), jnp.float32))
    compiler_params = None if interpret else plgpu.CompilerParams(
        num_warps=sizes.num_warps, num_stages=sizes.num_stages)
    out = pl.pallas_call(
        kernel,
        grid=(bsz, kvh, num_splits),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=compiler_params,
        name="paged_decode_attention",
    )(ctx_lens.astype(jnp.int32), page_table.astype(jnp.int32), q, k_new.astype(pool_layer.dtype),
      v_new.astype(pool_layer.dtype), pool_layer.reshape(num_pages * 2 * ps, width))
    if num_splits == 1:
        return out
    acc, m, l = out  # split 0 always holds the new token, so every max is finite
    w = jnp.exp(m - jnp.max(m, axis=0))
    o = jnp.sum(acc * w[..., None], axis=0) / jnp.sum(l * w, axis=0)[..., None]
    return o.astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# Public wrapper.


def _interpret(interpret):
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def _pow2_at_least_16(n: int) -> bool:
    return n >= MIN_DOT and n & (n - 1) == 0


def paged_decode_attention(q, k_new, v_new, pool_layer, page_table, ctx_lens, *, interpret=None,
                           block_tokens: int | None = None, num_splits: int | None = None,
                           block_sizes: AttentionBlockSizes | None = None):
    """Attention of one new token per sequence over its context in the pool and itself.

    q [B, nh, d]; k_new, v_new [B, kvh, d]: this step's token (not yet in the pool); pool_layer
    [pages, 2, page_size, kvh * d]; page_table [B, P] int32 (entries past a sequence's pages are
    never read); ctx_lens [B] int32: tokens already in the pool (0 allowed, at most P * page_size).
    Returns [B, nh, d] in q's dtype; scale 1/sqrt(d), f32 accumulation, dots in the pool's dtype.
    num_splits: programs per (sequence, kv head) along the context (None: enough to fill the GPU).
    block_sizes: the kernel's settings (None: AttentionBlockSizes.get_default for the pool's dtype).
    """
    bsz, nh, d = q.shape
    kvh = k_new.shape[1]
    assert nh % kvh == 0 and pool_layer.shape[3] == kvh * d, (q.shape, k_new.shape,
                                                              pool_layer.shape)
    sizes = block_sizes or AttentionBlockSizes.get_default(pool_layer.dtype)
    block_tokens = sizes.block_tokens if block_tokens is None else block_tokens
    if not _pow2_at_least_16(block_tokens):
        raise ValueError(f"block_tokens must be a power of two >= 16, got {block_tokens}")
    if not _pow2_at_least_16(d):
        # Triton tiles are powers of two, dot sides >= 16: toy head sizes use the reference.
        return paged_decode_attention_reference(q, k_new, v_new, pool_layer, page_table, ctx_lens)
    interpret = _interpret(interpret)
    if not interpret and pool_layer.size >= 2**31:
        # The Triton lowering computes element offsets in int32.
        raise ValueError(f"a pool layer of {pool_layer.size} elements is past int32 offsets; "
                         "use fewer pages per layer")
    max_blocks = -(-page_table.shape[1] * pool_layer.shape[2] // block_tokens)
    if num_splits is None:
        num_splits = _auto_splits(bsz, kvh, max_blocks, sizes)
    num_splits = max(1, min(int(num_splits), max_blocks))
    return _decode(q, k_new, v_new, pool_layer, page_table, ctx_lens,
                   interpret=interpret, block_tokens=block_tokens,
                   num_splits=num_splits, sizes=sizes)


# ---------------------------------------------------------------------------------------------
# Reference (plain jnp): the oracle for the kernel; the math of paged_attention_xla's decode branch.


@jax.jit
def paged_decode_attention_reference(q, k_new, v_new, pool_layer, page_table, ctx_lens):
    bsz, nh, d = q.shape
    kvh = k_new.shape[1]
    p = page_table.shape[1]
    ps = pool_layer.shape[2]
    kv = pool_layer[page_table]  # [B, P, 2, ps, W]
    keys = jnp.concatenate([kv[:, :, 0].reshape(bsz, p * ps, kvh, d),
                            k_new[:, None].astype(pool_layer.dtype)], axis=1)
    vals = jnp.concatenate([kv[:, :, 1].reshape(bsz, p * ps, kvh, d),
                            v_new[:, None].astype(pool_layer.dtype)], axis=1)
    live = jnp.arange(p * ps + 1)[None, :] < ctx_lens[:, None]
    live = live.at[:, -1].set(True)  # the new token
    qg = q.reshape(bsz, kvh, nh // kvh, d)
    s = jnp.einsum("bkgd,bskd->bkgs", qg, keys, preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST) / math.sqrt(d)
    s = jnp.where(live[:, None, None, :], s, -jnp.inf)
    w = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgs,bskd->bkgd", w.astype(vals.dtype), vals,
                   preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    return o.reshape(bsz, nh, d).astype(q.dtype)
