"""Paged decode attention (pallas_kernels/paged_attention.py) against its jnp reference and against
a float64 numpy softmax over each sequence's un-paged K/V.

Every case scatters each sequence's pages at random positions of a pool whose every other slot
(unused pages, the tails of partly used pages, the null page 0 that page-table padding points at)
holds garbage of magnitude ~1e3, so reading a wrong row fails loudly. Context lengths include 0, 1,
page and block boundaries, odd lengths and the full page table. CPU runs the kernel in interpret
mode; TestPagedAttentionGPU runs the same cases compiled through the Triton lowering and skips
without a GPU. TestTritonLowering lowers the kernel for an H200 on the CPU (no GPU needed), which
catches what the Triton lowering refuses.
"""

from __future__ import annotations

import dataclasses

import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as pa

HEAD_DIM = 32
CONTEXT = 96      # page-table capacity in tokens (P * page_size)
BLOCK = 16        # tokens per block in the matrix below: several blocks per sequence
SPARE_PAGES = 7   # garbage pages no sequence owns
HEADS = {"gqa": (8, 2), "mha": (4, 4)}  # (query heads, kv heads)
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
DTYPES = [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]


def seed_of(*key) -> int:
    return zlib.crc32(repr(key).encode())


def context_lengths(ps: int, rng) -> np.ndarray:
    lens = [0, 1, ps, ps + 1, 3 * ps - 1, BLOCK, BLOCK + 1, 37, CONTEXT - 1, CONTEXT]
    return rng.permutation(np.array(lens, np.int32))


def garbage(rng, shape):
    return rng.uniform(500, 1500, shape) * rng.choice([-1, 1], shape)


def make_inputs(ps: int, heads: str, dtype, seed: int, head_dim: int = HEAD_DIM):
    """Kernel arguments, and each sequence's K/V [2, ctx, kvh, d] as the kernel sees them (f64)."""
    rng = np.random.default_rng(seed)
    nh, kvh = HEADS[heads]
    d, w = head_dim, kvh * head_dim
    lens = context_lengths(ps, rng)
    bsz, p = len(lens), -(-CONTEXT // ps)
    n_pages = 1 + sum(-(-int(n) // ps) for n in lens) + SPARE_PAGES
    pool = garbage(rng, (n_pages, 2, ps, w))
    free = list(rng.permutation(np.arange(1, n_pages)))  # page 0 is the null page
    page_table = np.zeros((bsz, p), np.int32)
    kv = []
    for b, n in enumerate(lens):
        pages = [free.pop() for _ in range(-(-int(n) // ps))]
        page_table[b, :len(pages)] = pages
        seq = rng.normal(size=(2, n, w))  # K, V of the context, token by token
        for t in range(n):
            pool[pages[t // ps], :, t % ps] = seq[:, t]
        kv.append(seq)
    q = rng.normal(size=(bsz, nh, d)) * 2  # a peakier softmax than unit scores
    k_new, v_new = rng.normal(size=(2, bsz, kvh, d))
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    args = (cast(q), cast(k_new), cast(v_new), cast(pool), jnp.asarray(page_table),
            jnp.asarray(lens))
    as64 = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)  # noqa: E731
    seqs = [as64(s).reshape(2, -1, kvh, d) for s in kv]
    return args, seqs


def dense_attention(args, seqs) -> np.ndarray:
    """float64 softmax attention of each sequence's query over its context and new token."""
    q, k_new, v_new = (np.asarray(a.astype(jnp.float32), np.float64) for a in args[:3])
    bsz, nh, d = q.shape
    kvh = k_new.shape[1]
    out = np.zeros_like(q)
    for b, (k, v) in enumerate(seqs):
        k = np.concatenate([k, k_new[b][None]], 0)  # [n + 1, kvh, d]
        v = np.concatenate([v, v_new[b][None]], 0)
        for h in range(nh):
            s = k[:, h // (nh // kvh)] @ q[b, h] / np.sqrt(d)
            w = np.exp(s - s.max())
            out[b, h] = (w / w.sum()) @ v[:, h // (nh // kvh)]
    return out


def rel_err(got, want):
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want).astype(jnp.float32), np.float64)
    return np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)


class TestPagedAttention:
    INTERPRET = True

    def _check(self, args, seqs, dtype, **kw):
        got = pa.paged_decode_attention(*args, interpret=self.INTERPRET, **kw)
        want = pa.paged_decode_attention_reference(*args)
        assert got.shape == args[0].shape and got.dtype == args[0].dtype
        assert rel_err(got, want) < TOL[dtype], rel_err(got, want)
        assert rel_err(got, dense_attention(args, seqs)) < TOL[dtype]
        assert rel_err(want, dense_attention(args, seqs)) < TOL[dtype]  # the oracle itself
        # An empty context attends to the new token alone: its V, in every head.
        lens, v_new = np.asarray(args[5]), np.asarray(args[2].astype(jnp.float32))
        nh, kvh = args[0].shape[1], v_new.shape[1]
        empty = lens == 0
        np.testing.assert_allclose(np.asarray(got.astype(jnp.float32))[empty],
                                   np.repeat(v_new[empty], nh // kvh, axis=1), rtol=1e-6)

    # float32 runs one split per (sequence, kv head): the kernel normalises and writes the output.
    # bfloat16 leaves the split count to the wrapper: with these small batches it splits the
    # context (split-K), and the splits are merged after the kernel.
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("heads", list(HEADS))
    @pytest.mark.parametrize("ps", [1, 4, 16])
    def test_matches_reference(self, ps, heads, dtype):
        args, seqs = make_inputs(ps, heads, dtype, seed_of("ref", ps, heads, dtype))
        splits = 1 if dtype == jnp.float32 else None
        self._check(args, seqs, dtype, block_tokens=BLOCK, num_splits=splits)

    def test_block_inside_page(self):
        """Pages larger than a block: a block is a slice at an offset inside one page; the last
        page is partly used; three splits share uneven numbers of blocks."""
        args, seqs = make_inputs(32, "gqa", jnp.float32, seed_of("inside"))
        self._check(args, seqs, jnp.float32, block_tokens=BLOCK, num_splits=3)

    def test_default_blocks(self):
        """The table's block size (64 tokens for bf16): blocks span many pages, contexts end
        mid-block."""
        args, seqs = make_inputs(4, "gqa", jnp.bfloat16, seed_of("default"))
        self._check(args, seqs, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled kernels need a GPU")
class TestPagedAttentionGPU(TestPagedAttention):
    INTERPRET = False


def test_reference_matches_paged_attention_xla():
    """The reference is the decode branch of the engine's xla attention."""
    from slora_jax.engine.attention import paged_attention_xla
    from slora_jax.engine.step import StepInputs

    args, _ = make_inputs(4, "gqa", jnp.float32, seed_of("xla"))
    q, k_new, v_new, pool, page_table, lens = args
    zeros = jnp.zeros(len(lens), jnp.int32)
    inp = StepInputs(tokens=zeros, positions=lens, kv_slot=zeros, token_seq=jnp.arange(len(lens)),
                     page_table=page_table, ctx_lens=lens, sample_idx=zeros,
                     temperature=zeros, top_k=zeros, top_p=zeros, seeds=zeros, steps=zeros,
                     lora=None, decode=True)
    want = jax.jit(paged_attention_xla)(q, k_new, v_new, pool, inp)
    assert rel_err(pa.paged_decode_attention_reference(*args), want) < 1e-5


def test_small_head_dim_uses_reference():
    """head_dim 8: no Triton tile fits, so the wrapper falls back to the reference."""
    args, seqs = make_inputs(4, "gqa", jnp.float32, seed_of("small"), head_dim=8)
    got = pa.paged_decode_attention(*args)
    assert rel_err(got, dense_attention(args, seqs)) < 1e-5


def test_rejects_bad_block_tokens():
    args, _ = make_inputs(4, "gqa", jnp.float32, seed_of("bad"))
    with pytest.raises(ValueError, match="power of two"):
        pa.paged_decode_attention(*args, block_tokens=24)


def test_auto_splits():
    """Enough programs to fill an H200, never more splits than blocks or the cap."""
    blocks = pa.AttentionBlockSizes(min_programs=264, max_splits=16)
    assert pa._auto_splits(64, 8, 16, blocks) == 1     # 512 programs already
    assert pa._auto_splits(4, 8, 16, blocks) == 9      # 32 programs -> 288
    assert pa._auto_splits(1, 8, 4, blocks) == 4       # short contexts: one split per block
    assert pa._auto_splits(1, 1, 1000, blocks) == blocks.max_splits


def test_block_sizes_are_frozen_and_follow_the_pool_dtype():
    """Tiles of the same bytes for each pool dtype; the settings cannot be changed in place."""
    assert pa.AttentionBlockSizes.get_default(jnp.bfloat16).block_tokens == 64
    assert pa.AttentionBlockSizes.get_default(jnp.float32).block_tokens == 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        pa.AttentionBlockSizes().block_tokens = 16


class TestTritonLowering:
    """Lower the kernel for an H200 on the CPU: the Triton lowering runs, no GPU needed."""

    @pytest.mark.parametrize("bsz,nh,kvh,ps,splits,dtype", [
        (64, 32, 8, 16, None, jnp.bfloat16),   # Llama-3-8B, one split
        (64, 32, 8, 1, None, jnp.bfloat16),    # token-granular pool: gathered blocks
        (64, 32, 32, 4, None, jnp.float16),    # Llama-2-7B (MHA)
        (2, 32, 8, 128, None, jnp.float32),    # split-K, blocks inside pages, f32 (IEEE dots)
    ])
    def test_lowers_to_triton(self, bsz, nh, kvh, ps, splits, dtype):
        d, ctx = 128, 1024
        p = ctx // ps
        sds = jax.ShapeDtypeStruct
        device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                             platform="gpu")
        mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)

        def attn(*a):
            return pa.paged_decode_attention(*a, interpret=False, num_splits=splits)

        shapes = (sds((bsz, nh, d), dtype), sds((bsz, kvh, d), dtype), sds((bsz, kvh, d), dtype),
                  sds((bsz * p + 1, 2, ps, kvh * d), dtype), sds((bsz, p), jnp.int32),
                  sds((bsz,), jnp.int32))
        with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
            warnings.simplefilter("ignore", DeprecationWarning)  # the Triton backend's notice
            hlo = jax.jit(attn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
        assert hlo.count("__gpu$xla.gpu.triton") == 1  # the kernel, not the fallback


def test_xla_attention_ignores_whatever_masked_pages_hold():
    """Stale NaN or huge values in pool rows past a sequence's context (a reused page) never reach
    the output of the xla attention: the same output as with zeros there."""
    from slora_jax.model.llama import attention_scores_softmax
    rng = np.random.default_rng(3)
    b, t, s, nh, kvh, d = 2, 3, 8, 4, 2, 16
    q = jnp.asarray(rng.normal(size=(b, t, nh, d)).astype(np.float32))
    k = rng.normal(size=(b, s, kvh, d)).astype(np.float32)
    v = rng.normal(size=(b, s, kvh, d)).astype(np.float32)
    live = np.arange(s)[None, :] < np.array([[5], [2]])            # [B, S]
    mask = jnp.asarray(np.broadcast_to(live[:, None, :], (b, t, s)))
    clean_k, clean_v = np.where(live[..., None, None], k, 0), np.where(live[..., None, None], v, 0)
    want = attention_scores_softmax(q, jnp.asarray(clean_k), jnp.asarray(clean_v), mask)
    for junk in (np.nan, 1e30, -np.inf):
        dirty_k = np.where(live[..., None, None], k, junk).astype(np.float32)
        dirty_v = np.where(live[..., None, None], v, junk).astype(np.float32)
        got = attention_scores_softmax(q, jnp.asarray(dirty_k), jnp.asarray(dirty_v), mask)
        assert np.isfinite(np.asarray(got)).all(), junk
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
