"""Packed prefill attention (pallas_kernels/prefill_attention.py) against its jnp reference and
against a float64 numpy softmax over each sequence's un-paged context and new tokens.

A step packs sequences whose chunks have 1 to 70 new tokens (one and several query blocks, block
boundaries) over contexts of 0 to 90 tokens (page boundaries, a context that is a page exactly),
with empty rows and padding tokens after the last chunk. The pool's every slot no sequence owns
(spare pages, the tails of partly used pages, the null page 0) holds garbage of magnitude ~1e3, so
a wrong row read fails loudly. CPU runs the kernel in interpret mode; TestPrefillAttentionGPU runs
the same cases through the Triton lowering and skips without a GPU; test_lowers_to_triton lowers
it for an H200 on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import prefill_attention as pf

HEAD_DIM = 32
HEADS = {"gqa": (8, 2), "mha": (4, 4)}
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
SIZES = pf.PrefillBlockSizes(block_q=16, block_k=16)
# (new tokens, context tokens) per sequence, in row order; rows past them are empty.
CHUNKS = [(5, 0), (1, 37), (16, 16), (33, 90), (70, 3), (17, 0), (2, 64)]
ROWS = 8
PADDING = 9


def garbage(rng, shape):
    return rng.uniform(500, 1500, shape) * rng.choice([-1, 1], shape)


def make_step(ps: int, heads: str, dtype, seed: int, chunks=CHUNKS, rows=ROWS, padding=PADDING):
    """The kernel's arguments, and each sequence's (q, keys, values) in float64 for numpy."""
    rng = np.random.default_rng(seed)
    nh, kvh = HEADS[heads]
    d, w = HEAD_DIM, kvh * HEAD_DIM
    t = sum(n for n, _ in chunks) + padding
    p = max(-(-c // ps) for _, c in chunks) + 1
    n_pages = 1 + sum(-(-c // ps) for _, c in chunks) + 5
    pool = garbage(rng, (n_pages, 2, ps, w))
    free = list(rng.permutation(np.arange(1, n_pages)))
    page_table = np.zeros((rows, p), np.int32)
    q = rng.normal(size=(t, nh, d))
    k, v = rng.normal(size=(t, kvh, d)), rng.normal(size=(t, kvh, d))
    starts, ctx_lens, seqs, at = [0], np.zeros(rows, np.int32), [], 0
    for s, (n, c) in enumerate(chunks):
        ctx_k, ctx_v = rng.normal(size=(c, kvh, d)), rng.normal(size=(c, kvh, d))
        for i in range(-(-c // ps)):
            page = free.pop()
            page_table[s, i] = page
            part = slice(i * ps, min(c, (i + 1) * ps))
            pool[page, 0, :part.stop - part.start] = ctx_k[part].reshape(-1, w)
            pool[page, 1, :part.stop - part.start] = ctx_v[part].reshape(-1, w)
        ctx_lens[s] = c
        new = slice(at, at + n)
        seqs.append((q[new], np.concatenate([ctx_k, k[new]]), np.concatenate([ctx_v, v[new]]), c))
        at += n
        starts.append(at)
    starts += [at] * (rows - len(chunks))
    args = (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(pool, dtype),
            jnp.asarray(page_table), jnp.asarray(ctx_lens), jnp.asarray(np.array(starts, np.int32)))
    return args, seqs


def numpy_attention(seqs, nh: int, kvh: int):
    """Each sequence's new tokens against its context and, causally, its new tokens (float64)."""
    out = []
    for q, keys, vals, c in seqs:
        n, d = q.shape[0], q.shape[2]
        g = nh // kvh
        kk, vv = np.repeat(keys, g, axis=1), np.repeat(vals, g, axis=1)  # [c + n, nh, d]
        s = np.einsum("thd,khd->htk", q, kk) / np.sqrt(d)
        live = np.arange(c + n)[None, :] <= c + np.arange(n)[:, None]
        s = np.where(live[None], s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        out.append(np.einsum("htk,khd->thd", w, vv))
    return np.concatenate(out)


def seed_of(*key) -> int:
    return zlib.crc32(repr(key).encode())


class TestPrefillAttention:
    INTERPRET = True

    @pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")])
    @pytest.mark.parametrize("heads", sorted(HEADS))
    @pytest.mark.parametrize("ps", [1, 4, 16, 32])
    def test_matches_numpy_and_reference(self, ps, heads, dtype):
        args, seqs = make_step(ps, heads, dtype, seed_of(ps, heads, str(dtype)))
        nh, kvh = HEADS[heads]
        got = np.asarray(pf.paged_prefill_attention(*args, interpret=self.INTERPRET, sizes=SIZES), np.float64)
        ref = np.asarray(pf.paged_prefill_attention_reference(*args), np.float64)
        as_kernel_sees = lambda a: np.asarray(jnp.asarray(a, dtype), np.float64)  # rounded to dtype
        want = numpy_attention([(as_kernel_sees(q), as_kernel_sees(k), as_kernel_sees(v), c) for q, k, v, c in seqs],
                               nh, kvh)
        n = want.shape[0]
        tol = TOL[dtype]
        np.testing.assert_allclose(got[:n], want, rtol=tol, atol=tol)
        np.testing.assert_allclose(ref[:n], want, rtol=tol, atol=tol)
        assert not got[n:].any() and not ref[n:].any()  # padding tokens: zeros

    @pytest.mark.parametrize("sizes", [SIZES, pf.PrefillBlockSizes()], ids=["blocks16", "blocks64"])
    def test_one_sequence_without_context_is_causal_attention(self, sizes):
        """A fresh prompt alone: plain causal self-attention, over several query blocks, or in one
        block larger than the step (48 tokens under 64-token blocks)."""
        args, seqs = make_step(16, "mha", jnp.float32, seed_of("fresh"), chunks=[(48, 0)], rows=1, padding=0)
        got = np.asarray(pf.paged_prefill_attention(*args, interpret=self.INTERPRET, sizes=sizes))
        np.testing.assert_allclose(got, numpy_attention(seqs, 4, 4), rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("block_q,block_k", [(16, 32), (32, 16), (64, 64)])
    def test_block_sizes(self, block_q, block_k):
        args, seqs = make_step(16, "gqa", jnp.float32, seed_of("blocks", block_q, block_k))
        got = np.asarray(pf.paged_prefill_attention(*args, interpret=self.INTERPRET,
                                                    sizes=pf.PrefillBlockSizes(block_q, block_k)))
        want = numpy_attention(seqs, *HEADS["gqa"])
        np.testing.assert_allclose(got[:want.shape[0]], want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
class TestPrefillAttentionGPU(TestPrefillAttention):
    INTERPRET = False


def test_query_blocks_cover_every_token_once():
    starts = jnp.array([0, 5, 5, 40, 41, 41], jnp.int32)  # rows of 5, 0, 35, 1, 0 tokens
    row, first = pf.query_blocks(starts, num_blocks=48 // 16 + 5, block_q=16)
    got = [(int(r), int(f)) for r, f in zip(row, first) if r < 5]
    assert got == [(0, 0), (2, 5), (2, 21), (2, 37), (3, 40)]
    assert all(int(r) == 5 and int(f) == 0 for r, f in zip(row, first) if r >= 5)


def test_rejects_bad_block_sizes():
    args, _ = make_step(16, "mha", jnp.float32, 0)
    with pytest.raises(ValueError, match="powers of two"):
        pf.paged_prefill_attention(*args, sizes=pf.PrefillBlockSizes(block_q=24))


@pytest.mark.parametrize("nh,kvh,ps,dtype", [
    (32, 32, 16, jnp.bfloat16),   # Llama-2-7B: tiles gathered from 16-token pages
    (32, 8, 64, jnp.bfloat16),    # GQA, tiles inside pages
    (32, 8, 1, jnp.float32),      # token-granular pool, f32 (IEEE dots)
])
def test_lowers_to_triton(nh, kvh, ps, dtype):
    """Lower the kernel for an H200 on the CPU: the Triton lowering runs, no GPU needed."""
    t, s, d, p = 2048, 16, 128, 4096 // ps
    sds = jax.ShapeDtypeStruct
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)

    def attn(*a):
        return pf.paged_prefill_attention(*a, interpret=False)

    shapes = (sds((t, nh, d), dtype), sds((t, kvh, d), dtype), sds((t, kvh, d), dtype),
              sds((s * p + 1, 2, ps, kvh * d), dtype), sds((s, p), jnp.int32), sds((s,), jnp.int32),
              sds((s + 1,), jnp.int32))
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
        warnings.simplefilter("ignore", DeprecationWarning)
        hlo = jax.jit(attn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("__gpu$xla.gpu.triton") == 1


def test_bench_script_checks_the_kernel_against_the_xla_attention(tmp_path):
    """bench/prefill_attention.py --quick on the CPU: every case's kernel output equals the engine's
    xla attention on the same step inputs, and the JSON records what was run."""
    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "pa.json"
    subprocess.run([sys.executable, str(repo / "bench" / "prefill_attention.py"), "--quick", "--iters", "1",
                    "--sizes", "16x32", "--out", str(out)], check=True, cwd=repo, capture_output=True,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})
    res = json.loads(out.read_text())
    assert res["commit"] and res["platform"] == "cpu" and len(res["cases"]) == 2
    for case in res["cases"]:
        assert set(case["ms"]) == {"xla", "kernel", "kernel 16x32"}
        assert max(case["max_rel_err"].values()) < 1e-5, case
