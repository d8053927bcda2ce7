"""LoRA shrink/expand kernels (pallas_kernels/lora.py) against their jnp reference, and both
against a dense numpy product of the un-paged A and B.

Every case scatters each adapter's A^T and B rows at random positions of a pool whose other rows
are garbage of magnitude ~1e3, and points unused row indices at random rows, so reading a wrong row
fails loudly. CPU runs the kernels in interpret mode; TestLoraKernelsGPU runs the same cases
compiled through the Triton lowering and skips without a GPU. TestTritonLowering lowers both kernels for an
H200 on the CPU (no GPU needed), which catches what the Triton lowering refuses.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import lora

SLOTS = 6         # every case pads to this many slots (rank 0, no tokens): fewer compilations
MAX_RANK = 128
TOKENS = 37
POOL_ROWS = 2048
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    ranks: tuple          # per slot; 0: the slot's adapter does not target this module
    lens: tuple           # tokens per slot; the rest of the TOKENS are base tokens
    fin: int = 64
    fout: int = 160
    width: int = 32


CASES = {
    # ranks {1, 8, 16, 64, 128} in one batch, a slot with no tokens, a rank-0 slot with tokens,
    # odd segment lengths and a base tail
    "mixed": Case(ranks=(1, 8, 16, 64, 128, 0), lens=(1, 5, 0, 13, 9, 3)),
    "whole_batch": Case(ranks=(0, 64), lens=(0, TOKENS)),
    "base_only": Case(ranks=(8, 16), lens=(0, 0)),
    "decode": Case(ranks=(8, 128, 1, 16, 64), lens=(1, 1, 1, 1, 1)),
    # GQA-like (out = W, as for k and v), in > out, and W does not divide in: rank rows of A^T
    # start at different columns of their pool rows
    "gqa_w_not_dividing": Case(ranks=(8, 64, 1, 128, 16), lens=(3, 17, 2, 6, 0), fin=160, fout=48,
                               width=48),
}


def _pack(rng, mat, width, free, n_index, n_rows):
    """Place a flattened matrix at random free rows; unused index entries point anywhere."""
    flat = mat.reshape(-1)
    used = -(-flat.size // width)
    ids = np.array([free.pop() for _ in range(used)], np.int64)
    idx = rng.integers(0, n_rows, n_index)
    idx[:used] = ids
    padded = np.concatenate([flat, np.full(used * width - flat.size, 1e3, np.float32)])
    return idx, ids, padded.reshape(used, width)


def make_inputs(case: Case, dtype, seed: int, max_rank: int = MAX_RANK):
    rng = np.random.default_rng(seed)
    pad = SLOTS - len(case.ranks)
    ranks = np.array(case.ranks + (0,) * pad, np.int32)
    lens = np.array(case.lens + (0,) * pad, np.int32)
    seg = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    w = case.width
    rows = (rng.uniform(500, 1500, (POOL_ROWS, w)) * rng.choice([-1, 1], (POOL_ROWS, w)))
    rows = rows.astype(np.float32)
    free = list(rng.permutation(POOL_ROWS))
    ra, rb = -(-max_rank * case.fin // w), -(-max_rank * case.fout // w)
    a_rows = np.zeros((SLOTS, ra), np.int32)
    b_rows = np.zeros((SLOTS, rb), np.int32)
    a_mats, b_mats = [], []
    for s, r in enumerate(ranks):
        a_t = (rng.normal(size=(r, case.fin)) / np.sqrt(case.fin)).astype(np.float32)
        b = (rng.normal(size=(r, case.fout)) / np.sqrt(max(r, 1))).astype(np.float32)
        a_rows[s], ids, data = _pack(rng, a_t, w, free, ra, POOL_ROWS)
        rows[ids] = data
        b_rows[s], ids, data = _pack(rng, b, w, free, rb, POOL_ROWS)
        rows[ids] = data
        a_mats.append(a_t)
        b_mats.append(b)
    rows = jnp.asarray(rows, dtype)
    x = jnp.asarray(rng.normal(size=(TOKENS, case.fin)), dtype)
    # What the kernels see, for the dense product: the matrices rounded to the pool's dtype.
    a_mats = [np.asarray(jnp.asarray(a, dtype), np.float64) for a in a_mats]
    b_mats = [np.asarray(jnp.asarray(b, dtype), np.float64) for b in b_mats]
    arrays = dict(x=x, rows=rows, a_rows=jnp.asarray(a_rows), b_rows=jnp.asarray(b_rows),
                  ranks=jnp.asarray(ranks), seg_starts=jnp.asarray(seg))
    return arrays, a_mats, b_mats, seg, ranks


def delta_args(arr):
    return tuple(arr[k] for k in ("x", "rows", "a_rows", "b_rows", "ranks", "seg_starts"))


def dense_delta(x, a_mats, b_mats, seg, ranks, fout):
    x = np.asarray(x.astype(jnp.float32), np.float64)
    out = np.zeros((x.shape[0], fout))
    for s, r in enumerate(ranks):
        if r:
            t = slice(seg[s], seg[s + 1])
            out[t] = (x[t] @ a_mats[s].T) @ b_mats[s]
    return out


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)


def owner_rank(seg, ranks):
    """[T] the rank of each token's slot, 0 for base tokens."""
    slot = np.searchsorted(seg, np.arange(TOKENS), side="right") - 1
    return np.where((slot >= 0) & (slot < SLOTS), ranks[np.clip(slot, 0, SLOTS - 1)], 0)


def assert_applied(got, y, arr, a_mats, b_mats, seg, ranks, fout, dtype):
    """got is y + the dense product, in y's shape and dtype; base rows and rank-0 slots' rows are
    bit for bit y."""
    want = np.asarray(y, np.float64) + dense_delta(arr["x"], a_mats, b_mats, seg, ranks, fout)
    assert got.shape == y.shape and got.dtype == y.dtype
    assert rel_err(got, want) < (1e-5 if dtype == jnp.float32 else 2e-2), rel_err(got, want)
    untouched = owner_rank(seg, ranks) == 0
    np.testing.assert_array_equal(np.asarray(got)[untouched], np.asarray(y)[untouched])


def seed_of(*key) -> int:
    return zlib.crc32(repr(key).encode())


DTYPES = [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]


class TestLoraKernels:
    INTERPRET = True

    def _kw(self, **kw):
        return dict(interpret=self.INTERPRET, **kw)

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("name", list(CASES))
    def test_shrink(self, name, dtype):
        case = CASES[name]
        arr, *_, seg, ranks = make_inputs(case, dtype, seed_of("shrink", name, dtype))
        args = (arr["x"], arr["rows"], arr["a_rows"], arr["ranks"], arr["seg_starts"])
        got = lora.lora_shrink(*args, max_rank=MAX_RANK, in_features=case.fin, **self._kw())
        want = lora.lora_shrink_reference(*args, max_rank=MAX_RANK, in_features=case.fin)
        assert got.shape == (TOKENS, MAX_RANK) and got.dtype == jnp.float32
        assert rel_err(got, want) < TOL[dtype], rel_err(got, want)
        # exact zeros past each token's rank, and for base tokens
        dead = np.arange(MAX_RANK)[None, :] >= owner_rank(seg, ranks)[:, None]
        assert not np.asarray(got)[dead].any()

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("name", list(CASES))
    def test_expand(self, name, dtype):
        case = CASES[name]
        arr, *_, seg, ranks = make_inputs(case, dtype, seed_of("expand", name, dtype))
        rng = np.random.default_rng(seed_of("expand-y", name))
        y = jnp.asarray(rng.normal(size=(TOKENS, case.fout)), dtype)
        # garbage where xa must not be read: past each token's rank and on base tokens
        xa = rng.normal(size=(TOKENS, MAX_RANK))
        dead = np.arange(MAX_RANK)[None, :] >= owner_rank(seg, ranks)[:, None]
        xa = jnp.asarray(np.where(dead, 1e3, xa), jnp.float32)
        args = (y, xa, arr["rows"], arr["b_rows"], arr["ranks"], arr["seg_starts"])
        got = lora.lora_expand(*args, max_rank=MAX_RANK, out_features=case.fout, **self._kw())
        want = lora.lora_expand_reference(*args, max_rank=MAX_RANK, out_features=case.fout)
        assert got.shape == y.shape and got.dtype == y.dtype
        assert rel_err(got, want) < TOL[dtype], rel_err(got, want)
        untouched = owner_rank(seg, ranks) == 0  # base tokens and tokens of rank-0 slots
        np.testing.assert_array_equal(np.asarray(got)[untouched], np.asarray(y)[untouched])

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("name", list(CASES))
    def test_delta_matches_dense(self, name, dtype):
        case = CASES[name]
        arr, a_mats, b_mats, seg, ranks = make_inputs(case, dtype, seed_of("dense", name, dtype))
        args = delta_args(arr)
        want = dense_delta(arr["x"], a_mats, b_mats, seg, ranks, case.fout)
        tol = 1e-5 if dtype == jnp.float32 else 2e-2  # bf16: xa is rounded before B
        for backend, kw in (("pallas", self._kw()), ("xla", {})):
            got = lora.lora_delta(*args, max_rank=MAX_RANK, fin=case.fin, fout=case.fout,
                                  backend=backend, **kw)
            assert got.shape == (TOKENS, case.fout) and got.dtype == jnp.float32
            if not want.any():
                assert not np.asarray(got).any(), backend
            else:
                assert rel_err(got, want) < tol, (backend, rel_err(got, want))

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("name", list(CASES))
    def test_apply_adds_into_y(self, name, dtype):
        """lora_apply (the engine's path): y + the dense product, base rows bit-for-bit y."""
        case = CASES[name]
        arr, a_mats, b_mats, seg, ranks = make_inputs(case, dtype, seed_of("apply", name, dtype))
        y = jnp.asarray(np.random.default_rng(seed_of("apply-y", name)).normal(size=(TOKENS, case.fout)), dtype)
        got = lora.lora_apply(y, *delta_args(arr), max_rank=MAX_RANK, fin=case.fin, fout=case.fout, **self._kw())
        assert_applied(got, y, arr, a_mats, b_mats, seg, ranks, case.fout, dtype)

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("name", list(CASES))
    def test_fused_apply_matches_dense(self, name, dtype):
        """lora_fused_apply (shrink and expand in one launch): y + the dense product, base rows
        bit-for-bit y; with the schedule built on the host, the same."""
        case = CASES[name]
        arr, a_mats, b_mats, seg, ranks = make_inputs(case, dtype, seed_of("fused", name, dtype))
        y = jnp.asarray(np.random.default_rng(seed_of("fused-y", name)).normal(size=(TOKENS, case.fout)), dtype)
        kw = dict(max_rank=MAX_RANK, fin=case.fin, fout=case.fout, **self._kw())
        got = lora.lora_fused_apply(y, *delta_args(arr), **kw)
        assert_applied(got, y, arr, a_mats, b_mats, seg, ranks, case.fout, dtype)
        hosted = lora.lora_fused_apply(y, *delta_args(arr), schedule=lora.fused_schedule(
            ranks, seg, TOKENS, max_rank=MAX_RANK), **kw)
        np.testing.assert_allclose(np.asarray(hosted, np.float64), np.asarray(got, np.float64), rtol=1e-6,
                                   atol=1e-6 if dtype == jnp.float32 else 1e-2)

    @pytest.mark.parametrize("over", [dict(n_split=1), dict(n_split=3, prefetch_next=False),
                                      dict(n_split=8, b_col_tile=16, a_col_tile=32), dict(max_programs=2)],
                             ids=["split1", "split3_noprefetch", "split8_small_tiles", "two_programs"])
    def test_fused_block_variants(self, monkeypatch, over):
        """The fused kernel's settings: output columns over 1, 3 (more than some programs' share:
        empty ranges) and 8 programs, without the prefetch pipeline, and two programs walking
        every item (the persistent loop)."""
        monkeypatch.setitem(lora.BLOCKS, "fused", {**lora.BLOCKS["fused"], **over})
        case = CASES["mixed"]
        arr, a_mats, b_mats, seg, ranks = make_inputs(case, jnp.float32, seed_of("fused-var", str(over)))
        y = jnp.zeros((TOKENS, case.fout), jnp.float32)
        got = lora.lora_fused_apply(y, *delta_args(arr), max_rank=MAX_RANK, fin=case.fin, fout=case.fout,
                                    **self._kw())
        assert rel_err(got, dense_delta(arr["x"], a_mats, b_mats, seg, ranks, case.fout)) < 1e-5

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("name", list(CASES))
    def test_mbgmv_block_t_1(self, name, dtype):
        """block_t 1 (MBGMV: the engine's decode blocks where BLOCKS["mbgmv"] has them): one token
        a block, products by multiply and sum. The shrink matches the reference (exact zeros past
        each rank and on base tokens); apply adds the dense product, base rows bit for bit y; with
        the schedules built on the host, as the engine passes them, the same. The engine's default
        decode pair, the shrink at block_t 1 and the expands at BLOCK_T (each with its own
        schedule, or none), adds the same product too."""
        case = CASES[name]
        arr, a_mats, b_mats, seg, ranks = make_inputs(case, dtype, seed_of("mbgmv", name, dtype))
        args = (arr["x"], arr["rows"], arr["a_rows"], arr["ranks"], arr["seg_starts"])
        xa = lora.lora_shrink(*args, max_rank=MAX_RANK, in_features=case.fin, **self._kw(block_t=1))
        want_xa = lora.lora_shrink_reference(*args, max_rank=MAX_RANK, in_features=case.fin)
        assert rel_err(xa, want_xa) < TOL[dtype], rel_err(xa, want_xa)
        dead = np.arange(MAX_RANK)[None, :] >= owner_rank(seg, ranks)[:, None]
        assert not np.asarray(xa)[dead].any()
        y = jnp.asarray(np.random.default_rng(seed_of("mbgmv-y", name)).normal(size=(TOKENS, case.fout)), dtype)
        kw = dict(max_rank=MAX_RANK, fin=case.fin, fout=case.fout, **self._kw(block_t=1))
        got = lora.lora_apply(y, *delta_args(arr), **kw)
        assert_applied(got, y, arr, a_mats, b_mats, seg, ranks, case.fout, dtype)
        hosted = lora.lora_apply(y, *delta_args(arr), schedule=lora.block_schedule(ranks, seg, TOKENS, 1),
                                 shrink_schedule=lora.shrink_schedule(ranks, seg, TOKENS, 1, max_rank=MAX_RANK), **kw)
        np.testing.assert_array_equal(np.asarray(hosted), np.asarray(got))
        kw.update(block_t=lora.BLOCK_T, shrink_block_t=1)
        mixed = lora.lora_apply(y, *delta_args(arr), **kw)
        assert_applied(mixed, y, arr, a_mats, b_mats, seg, ranks, case.fout, dtype)
        mixed_hosted = lora.lora_apply(
            y, *delta_args(arr), schedule=lora.block_schedule(ranks, seg, TOKENS, lora.BLOCK_T),
            shrink_schedule=lora.shrink_schedule(ranks, seg, TOKENS, 1, max_rank=MAX_RANK), **kw)
        np.testing.assert_array_equal(np.asarray(mixed_hosted), np.asarray(mixed))

    @pytest.mark.parametrize("tiles", [(64, 8), (1024, 4), (16, 32)], ids=["c64r8", "c1024r4", "c16r32"])
    def test_mbgmv_expand_tiles(self, monkeypatch, tiles):
        """BLOCKS["mbgmv"]'s expand tiles (block_t 1 only): wide column tiles (capped by the
        widths), rank tiles below and above some ranks; apply adds the dense product, base rows
        keep y, and a block_t 16 call (prefill) ignores them."""
        col, rank = tiles
        monkeypatch.setitem(lora.BLOCKS, "mbgmv", {**lora.BLOCKS["mbgmv"], "expand_col_tile": col,
                                                   "expand_rank_tile": rank})
        lora._expand.clear_cache()
        case = CASES["mixed"]
        arr, a_mats, b_mats, seg, ranks = make_inputs(case, jnp.float32, seed_of("mbgmv-tiles", str(tiles)))
        y = jnp.asarray(np.random.default_rng(seed_of("mbgmv-tiles-y", str(tiles))).normal(size=(TOKENS, case.fout)),
                        jnp.float32)
        for block_t in (1, lora.BLOCK_T):
            got = lora.lora_apply(y, *delta_args(arr), max_rank=MAX_RANK, fin=case.fin, fout=case.fout,
                                  **self._kw(block_t=block_t))
            assert_applied(got, y, arr, a_mats, b_mats, seg, ranks, case.fout, jnp.float32)
        lora._expand.clear_cache()

    def test_few_programs_small_max_rank(self):
        """Fewer programs than blocks, so each walks several (the persistent loop); and a max rank
        below one rank tile, so tiles are masked rather than padded into xa."""
        case = Case(ranks=(8, 1, 0, 4), lens=(9, 3, 2, 11))
        arr, a_mats, b_mats, seg, ranks = make_inputs(case, jnp.float32, seed_of("few"), max_rank=8)
        args = delta_args(arr)
        got = lora.lora_delta(*args, max_rank=8, fin=case.fin, fout=case.fout,
                              **self._kw(block_t=32, max_programs=2))
        want = dense_delta(arr["x"], a_mats, b_mats, seg, ranks, case.fout)
        assert rel_err(got, want) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled kernels need a GPU")
class TestLoraKernelsGPU(TestLoraKernels):
    INTERPRET = False


def test_fallback_for_toy_widths():
    """W = 24 and in = 64 share no power-of-two factor >= 16: the wrappers use the reference."""
    case = Case(ranks=(8, 16), lens=(5, 20), width=24)
    arr, a_mats, b_mats, seg, ranks = make_inputs(case, jnp.float32, seed_of("fallback"))
    args = delta_args(arr)
    got = lora.lora_delta(*args, max_rank=MAX_RANK, fin=case.fin, fout=case.fout)
    assert rel_err(got, dense_delta(arr["x"], a_mats, b_mats, seg, ranks, case.fout)) < 1e-5


def test_block_schedule():
    """Blocks cover every adapter token once, skip base tokens, empty and rank-0 slots."""
    ranks = jnp.array([8, 16, 0, 4, 0], jnp.int32)
    seg = jnp.array([0, 17, 17, 20, 53, 53], jnp.int32)
    sched, total, nb = lora._block_schedule(ranks, seg, 60, 16)
    sched, total = np.asarray(sched), int(total[0])
    assert total == 2 + 0 + 0 + 3 and nb >= total
    covered = np.concatenate([np.arange(st, min(st + 16, en)) for _, st, en in sched.T[:total]])
    np.testing.assert_array_equal(covered, np.r_[0:17, 20:53])
    assert list(sched[0, :total]) == [0, 0, 3, 3, 3]


class TestTritonLowering:
    """Lower the kernels for an H200 on the CPU: the Triton lowering runs, no GPU needed."""

    @pytest.mark.parametrize("fin,fout,width", [(4096, 4096, 4096), (4096, 14336, 1024),
                                                (11008, 4096, 4096)])
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("form,launches", [("apart", 2), ("fused", 1), ("fused_group", 1)])
    def test_lowers_to_triton(self, fin, fout, width, dtype, form, launches):
        t, sa, r, n = 40, 8, 64, 4096
        sds = jax.ShapeDtypeStruct
        i32 = jnp.int32
        device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                             platform="gpu")
        mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)

        def delta(x, rows, a_rows, b_rows, ranks, seg):
            kw = dict(max_rank=r, fin=fin, fout=fout, interpret=False)
            if form == "fused":
                return lora.lora_fused_apply(jnp.zeros((t, fout), jnp.float32), x, rows, a_rows, b_rows, ranks,
                                             seg, **kw)
            if form == "fused_group":  # three modules sharing x (q, k, v) in one launch
                return lora.lora_fused_delta(x, rows, jnp.stack([a_rows] * 3), jnp.stack([b_rows] * 3),
                                             jnp.stack([ranks] * 3), seg, **kw)
            return lora.lora_delta(x, rows, a_rows, b_rows, ranks, seg, **kw)

        shapes = (sds((t, fin), dtype), sds((n, width), dtype),
                  sds((sa, -(-r * fin // width)), i32), sds((sa, -(-r * fout // width)), i32),
                  sds((sa,), i32), sds((sa + 1,), i32))
        with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
            warnings.simplefilter("ignore", DeprecationWarning)  # the Triton backend's notice
            hlo = jax.jit(delta).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
        # shrink and expand, or the one fused launch; not the fallback
        assert hlo.count("__gpu$xla.gpu.triton") == launches


def test_host_block_schedule_matches_the_graph_one():
    """block_schedule (numpy, built by the engine with a step's inputs) gives the same arrays as
    the in-graph _block_schedule, on random segments with empty slots and rank-0 slots; and the
    kernels give the same output with either."""
    from pallas_kernels.lora import _block_schedule, block_schedule
    rng = np.random.default_rng(3)
    for t, sa, block_t in ((64, 8, 16), (37, 5, 16), (256, 32, 32), (16, 1, 16)):
        for _ in range(5):
            lens = rng.multinomial(int(rng.integers(0, t + 1)), np.ones(sa) / sa)
            seg = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            ranks = rng.choice([0, 8, 16, 64], sa).astype(np.int32)
            got = block_schedule(ranks, seg, t, block_t)
            sched, total, _ = _block_schedule(jnp.asarray(ranks), jnp.asarray(seg), t, block_t)
            np.testing.assert_array_equal(got[0], np.asarray(sched))
            np.testing.assert_array_equal(got[1], np.asarray(total))
    arr, a_mats, b_mats, seg, ranks = make_inputs(CASES["mixed"], jnp.float32, seed=7)
    case = CASES["mixed"]
    kw = dict(max_rank=MAX_RANK, fin=case.fin, fout=case.fout, interpret=True)
    x, rows, a_rows, b_rows, rk, sg = delta_args(arr)
    y = jnp.zeros((TOKENS, case.fout), jnp.float32)
    plain = lora.lora_apply(y, x, rows, a_rows, b_rows, rk, sg, **kw)
    hosted = lora.lora_apply(y, x, rows, a_rows, b_rows, rk, sg, schedule=block_schedule(ranks, seg, TOKENS), **kw)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(hosted))
    assert rel_err(hosted, dense_delta(x, a_mats, b_mats, seg, ranks, case.fout)) < TOL[jnp.float32]
    with pytest.raises(ValueError, match="schedule shapes"):
        lora.lora_apply(y, x, rows, a_rows, b_rows, rk, sg, schedule=block_schedule(ranks, seg, 64), **kw)


def test_host_shrink_schedule_matches_the_graph_one(monkeypatch):
    """shrink_schedule (numpy; compact_tiles: the live (block, rank tile) items) gives the same arrays
    as the in-graph _block_schedule with a rank tile, ranks past max_rank clamped; the shrink gives
    the same output given it as building its own; a schedule of the wrong shape is refused."""
    from pallas_kernels.lora import _block_schedule, block_schedule, shrink_schedule
    rng = np.random.default_rng(5)
    for t, sa, block_t, rank_tile in ((64, 8, 16, 16), (37, 5, 16, 16), (256, 32, 32, 32), (16, 1, 16, 16)):
        for _ in range(5):
            lens = rng.multinomial(int(rng.integers(0, t + 1)), np.ones(sa) / sa)
            seg = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            ranks = rng.choice([0, 1, 8, 16, 40, 64, 128], sa).astype(np.int32)
            got = block_schedule(ranks, seg, t, block_t, rank_tile, MAX_RANK)
            sched, total, n = _block_schedule(jnp.asarray(ranks), jnp.asarray(seg), t, block_t, rank_tile, MAX_RANK)
            assert got[0].shape == (4, n)
            np.testing.assert_array_equal(got[0], np.asarray(sched))
            np.testing.assert_array_equal(got[1], np.asarray(total))
    monkeypatch.setitem(lora.BLOCKS, "shrink", {**lora.BLOCKS["shrink"], "compact_tiles": True})
    jax.clear_caches()  # BLOCKS is read at trace time
    try:
        case = CASES["mixed"]
        arr, a_mats, b_mats, seg, ranks = make_inputs(case, jnp.float32, seed=11)
        x, rows, a_rows, _, rk, sg = delta_args(arr)
        kw = dict(max_rank=MAX_RANK, in_features=case.fin, interpret=True)
        own = lora.lora_shrink(x, rows, a_rows, rk, sg, **kw)
        hosted = lora.lora_shrink(x, rows, a_rows, rk, sg, schedule=shrink_schedule(ranks, seg, TOKENS,
                                                                                    max_rank=MAX_RANK), **kw)
        np.testing.assert_array_equal(np.asarray(own), np.asarray(hosted))
        assert np.asarray(hosted).any()
        with pytest.raises(ValueError, match="shrink_schedule's"):  # the expand's plain schedule
            lora.lora_shrink(x, rows, a_rows, rk, sg, schedule=block_schedule(ranks, seg, TOKENS), **kw)
    finally:
        jax.clear_caches()


@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_shrink_split_k_matches_dense(monkeypatch, split_k):
    """BLOCKS["shrink"]["split_k"]: 1, one program walks the `in` columns and stores; > 1 (the
    default for decode-sized calls), the columns in split_k ranges (uneven with 3) whose partial
    products are added atomically into xa. Either way the same delta as the dense product."""
    case = dataclasses.replace(CASES["mixed"], fin=128)  # four 32-column chunks
    monkeypatch.setitem(lora.BLOCKS, "shrink", {**lora.BLOCKS["shrink"], "split_k": split_k})
    jax.clear_caches()  # BLOCKS is read at trace time
    try:
        arr, a_mats, b_mats, seg, ranks = make_inputs(case, jnp.float32, seed=seed_of("split", split_k))
        got = lora.lora_delta(*delta_args(arr), max_rank=MAX_RANK, fin=case.fin, fout=case.fout,
                              interpret=True)
        assert rel_err(got, dense_delta(arr["x"], a_mats, b_mats, seg, ranks, case.fout)) < TOL[jnp.float32]
        xa = lora.lora_shrink(arr["x"], arr["rows"], arr["a_rows"], arr["ranks"], arr["seg_starts"],
                              max_rank=MAX_RANK, in_features=case.fin, interpret=True)
        dead = np.arange(MAX_RANK)[None, :] >= owner_rank(seg, ranks)[:, None]
        assert not np.asarray(xa)[dead].any()  # zero past each token's rank, as with one split
    finally:
        jax.clear_caches()


@pytest.mark.parametrize("blocks", [
    {"shrink": {"split_k": 2, "static_split": True}},   # 4 chunks, 2 a split: the static loop
    {"shrink": {"split_k": 3, "static_split": True}},   # 3 does not divide 4: the traced loop
    {"expand": {"y_first": False}},
    {"shrink": {"rank_tile": 32, "split_k": 2, "static_split": True}, "expand": {"rank_tile": 32}},
    {"shrink": {"prefetch_next": True}, "expand": {"prefetch_next": True}},
    {"shrink": {"prefetch_next": True, "split_k": 3}},  # the last split gets 0 chunks of 4 (2, 2, 0)
    {"shrink": {"prefetch_next": True, "split_k": 1}},  # static bounds
    {"shrink": {"prefetch_next": True, "split_k": 2, "static_split": True}},
    # fin == width: an A^T row is one pool row, its indices read once per rank tile
    {"shrink": {"hoist_rows": True, "col_tile": 32}, "width": 128},
    {"shrink": {"hoist_rows": True, "col_tile": 32, "prefetch_next": True, "split_k": 3}, "width": 128},
    {"shrink": {"compact_tiles": True}},                # one program per live (block, rank tile)
    {"shrink": {"compact_tiles": True, "split_k": 1}},
    {"shrink": {"compact_tiles": True, "rank_tile": 32}, "expand": {"rank_tile": 32}},
    # the defaults before session 10: no software pipeline, one program per (block, every rank tile)
    {"shrink": {"prefetch_next": False, "compact_tiles": False}, "expand": {"prefetch_next": False}},
    {"shrink": {"prefetch_next": False, "compact_tiles": False, "split_k": 1}},
    # early_loads: schedule columns read a trip ahead, gathers indexed without waiting for the rank
    {"shrink": {"early_loads": True}, "expand": {"early_loads": True}},
    {"shrink": {"early_loads": True, "compact_tiles": False}, "expand": {"early_loads": True, "rank_tile": 32}},
    {"shrink": {"early_loads": True, "max_programs": 2, "split_k": 1}, "expand": {"early_loads": True,
                                                                                  "max_programs": 2}},
    {"shrink": {"early_loads": True, "hoist_rows": True, "col_tile": 32, "prefetch_next": False}, "width": 128},
    # split_partials: each split's partial sums in its own plane of xa, added by the expand
    {"shrink": {"split_partials": True}},
    {"shrink": {"split_partials": True, "split_k": 3}},  # uneven: the last split stores zeros
    {"shrink": {"split_partials": True, "early_loads": True, "compact_tiles": False}, "expand": {"early_loads": True}},
    # the defaults before session 14: split-K partial sums meet in xa by atomic adds
    {"shrink": {"split_partials": False, "early_loads": False}},
    {"shrink": {"split_partials": False, "early_loads": False, "split_k": 3}},
    # launch order: a block's splits (shrink) and column tiles (expand) side by side
    {"shrink": {"splits_first": True}, "expand": {"cols_first": True}},
    {"shrink": {"splits_first": True, "compact_tiles": False, "split_k": 3, "max_programs": 2},
     "expand": {"cols_first": True, "max_programs": 2}},
], ids=["static_split", "static_split_uneven", "y_last", "rank_tile_32", "prefetch_next", "prefetch_next_empty_split",
        "prefetch_next_k1", "prefetch_next_static", "hoist_rows", "hoist_rows_prefetch_next", "compact_tiles",
        "compact_tiles_k1", "compact_tiles_rank_tile_32", "plain", "plain_k1", "early_loads",
        "early_loads_full_schedule", "early_loads_many_trips", "early_loads_hoist_rows", "split_partials",
        "split_partials_uneven", "split_partials_early_loads", "atomic_adds", "atomic_adds_uneven",
        "splits_cols_first", "splits_cols_first_many_trips"])
def test_block_variants_match_dense(monkeypatch, blocks):
    """The kernel variants the GPU sweep times (BLOCKS options other than the defaults) compute the same
    delta as the dense product, and leave base tokens' y as it was."""
    blocks = dict(blocks)
    # four 32-column chunks (with width 128, a pool row holds an A^T row whole)
    case = dataclasses.replace(CASES["mixed"], fin=128, width=blocks.pop("width", CASES["mixed"].width))
    for kind, over in blocks.items():
        monkeypatch.setitem(lora.BLOCKS, kind, {**lora.BLOCKS[kind], **over})
    jax.clear_caches()  # BLOCKS is read at trace time
    try:
        arr, a_mats, b_mats, seg, ranks = make_inputs(case, jnp.float32, seed=seed_of("variant", str(blocks)))
        got = lora.lora_delta(*delta_args(arr), max_rank=MAX_RANK, fin=case.fin, fout=case.fout,
                              interpret=True)
        assert rel_err(got, dense_delta(arr["x"], a_mats, b_mats, seg, ranks, case.fout)) < TOL[jnp.float32]
        base = owner_rank(seg, ranks) == 0
        assert base.any() and not np.asarray(got)[base].any()
    finally:
        jax.clear_caches()


def test_split_partials_planes(monkeypatch):
    """split_partials: lora_shrink_group returns one plane of partial sums per split (their sum is
    xa), lora_shrink still returns xa with exact zeros past each token's rank, and lora_expand
    adds the planes as it reads them, reading nothing past the rank or on base tokens."""
    monkeypatch.setitem(lora.BLOCKS, "shrink", {**lora.BLOCKS["shrink"], "split_partials": True, "split_k": 4})
    jax.clear_caches()  # BLOCKS is read at trace time
    try:
        case = dataclasses.replace(CASES["mixed"], fin=128)   # four 32-column chunks, one a split
        arr, *_, seg, ranks = make_inputs(case, jnp.float32, seed=seed_of("partials"))
        args = (arr["x"], arr["rows"], arr["a_rows"], arr["ranks"], arr["seg_starts"])
        want = lora.lora_shrink_reference(*args, max_rank=MAX_RANK, in_features=case.fin)
        planes = lora.lora_shrink_group(arr["x"], arr["rows"], (arr["a_rows"],), (arr["ranks"],), arr["seg_starts"],
                                        max_rank=MAX_RANK, in_features=case.fin, interpret=True)
        assert planes.ndim == 3 and planes.shape[0] == 4
        assert rel_err(planes.sum(0)[:TOKENS, :MAX_RANK], want) < TOL[jnp.float32]
        got = lora.lora_shrink(*args, max_rank=MAX_RANK, in_features=case.fin, interpret=True)
        assert got.shape == (TOKENS, MAX_RANK) and rel_err(got, want) < TOL[jnp.float32]
        dead = np.arange(MAX_RANK)[None, :] >= owner_rank(seg, ranks)[:, None]
        assert not np.asarray(got)[dead].any()
        # the expand from planes with garbage where xa must not be read
        rng = np.random.default_rng(seed_of("partials-y"))
        y = jnp.asarray(rng.normal(size=(TOKENS, case.fout)), jnp.float32)
        noisy = np.array(planes)
        noisy[:, :TOKENS, :MAX_RANK][:, dead] = 1e3
        eargs = (arr["rows"], arr["b_rows"], arr["ranks"], arr["seg_starts"])
        out = lora.lora_expand(y, jnp.asarray(noisy), *eargs, max_rank=MAX_RANK, out_features=case.fout,
                               interpret=True)
        ref = lora.lora_expand_reference(y, want, *eargs, max_rank=MAX_RANK, out_features=case.fout)
        assert rel_err(out, ref) < TOL[jnp.float32]
    finally:
        jax.clear_caches()


def group_inputs(fouts, tag):
    """Three modules that read one x (q, k, v) with other ranks each and a slot only some have, in
    one pool (module i's rows from i * POOL_ROWS): (cases, made, x, seg, rows, a_rows, b_rows,
    ranks, each slot's largest rank), the per-module arrays as lists."""
    lens = (1, 5, 0, 13, 9, 3)
    cases = [Case(ranks=r, lens=lens, fout=f) for r, f in zip(
        [(1, 8, 16, 64, 128, 0), (8, 0, 16, 1, 128, 0), (64, 8, 0, 0, 16, 0)], fouts)]
    made = [make_inputs(c, jnp.float32, seed=seed_of(tag, i)) for i, c in enumerate(cases)]
    rows = jnp.concatenate([m[0]["rows"] for m in made])
    a_rows = [m[0]["a_rows"] + i * POOL_ROWS for i, m in enumerate(made)]
    b_rows = [m[0]["b_rows"] + i * POOL_ROWS for i, m in enumerate(made)]
    ranks = [m[0]["ranks"] for m in made]
    union = np.max([m[4] for m in made], axis=0)
    return cases, made, made[0][0]["x"], made[0][3], rows, a_rows, b_rows, ranks, union


@pytest.mark.parametrize("split_k,compact,early,partials", [
    (1, False, False, False), (4, False, False, False), (4, True, False, False), (4, True, True, False),
    (1, True, True, False), (4, True, True, True), (4, False, False, True)],
    ids=["k1", "k4", "k4_compact_tiles", "k4_compact_early", "k1_compact_early", "k4_compact_early_partials",
         "k4_partials"])
def test_grouped_apply_matches_each_module(monkeypatch, split_k, compact, early, partials):
    """lora_apply_group: q, k and v (one x; k and v narrower, GQA) with other ranks per module,
    a slot that only some modules have, one shrink launch: each y gets its own module's delta.
    compact_tiles: the shrink's items are the live tiles of the modules' largest rank per slot
    (early_loads: with no rank guard, so a module of smaller rank masks those tiles itself)."""
    monkeypatch.setitem(lora.BLOCKS, "shrink", {**lora.BLOCKS["shrink"], "split_k": split_k,
                                                "compact_tiles": compact, "early_loads": early,
                                                "split_partials": partials})
    monkeypatch.setitem(lora.BLOCKS, "expand", {**lora.BLOCKS["expand"], "early_loads": early})
    jax.clear_caches()  # BLOCKS is read at trace time
    try:
        cases, made, x, seg, rows, a_rows, b_rows, ranks, union = group_inputs((128, 64, 64), "group")
        ys = [jnp.asarray(np.random.default_rng(i).normal(size=(TOKENS, c.fout)), jnp.float32)
              for i, c in enumerate(cases)]
        got = lora.lora_apply_group(ys, x, rows, a_rows, b_rows, ranks, made[0][0]["seg_starts"],
                                    max_rank=MAX_RANK, fin=64, fouts=[c.fout for c in cases], interpret=True,
                                    schedule=lora.block_schedule(union, seg, TOKENS))
        for i, (c, m) in enumerate(zip(cases, made)):
            want = np.asarray(ys[i], np.float64) + dense_delta(x, m[1], m[2], seg, m[4], c.fout)
            assert rel_err(got[i], want) < TOL[jnp.float32], i
    finally:
        jax.clear_caches()


@pytest.mark.parametrize("grouped", [False, True], ids=["shrink_then_expand", "grouped_apply"])
def test_max_rank_below_a_rank_tile_without_split_k(monkeypatch, grouped):
    """A max rank below one rank tile (S1's rank-8 adapters) where the shrink does not split K
    (prefill calls past split_k_max_tokens): the expand's rank-tile slice of xa must stay inside
    xa. Once it ran past a grouped xa's last module (start 16, size 16, width 24) and the Triton
    lowering refused the trace; lora_shrink's own xa ([T, max_rank]) is narrower still."""
    monkeypatch.setitem(lora.BLOCKS, "shrink", {**lora.BLOCKS["shrink"], "split_k": 1})
    jax.clear_caches()  # BLOCKS is read at trace time
    try:
        cases = [Case(ranks=r, lens=(1, 5, 0, 13, 9, 3)) for r in [(8, 1, 4, 8, 2, 0), (0, 8, 8, 3, 1, 0),
                                                                   (4, 0, 8, 8, 8, 0)]]
        made = [make_inputs(c, jnp.float32, seed_of("rank8", i), max_rank=8) for i, c in enumerate(cases)]
        arr, seg = made[0][0], made[0][3]
        x, ys = arr["x"], [jnp.asarray(np.random.default_rng(i).normal(size=(TOKENS, c.fout)), jnp.float32)
                           for i, c in enumerate(cases)]
        if grouped:  # the modules in one pool, module i's rows from i * POOL_ROWS
            rows = jnp.concatenate([m[0]["rows"] for m in made])
            got = lora.lora_apply_group(
                ys, x, rows, [m[0]["a_rows"] + i * POOL_ROWS for i, m in enumerate(made)],
                [m[0]["b_rows"] + i * POOL_ROWS for i, m in enumerate(made)], [m[0]["ranks"] for m in made],
                arr["seg_starts"], max_rank=8, fin=64, fouts=[c.fout for c in cases], interpret=True)
        else:
            got = []
            for y, c, (a, *_) in zip(ys, cases, made):
                xa = lora.lora_shrink(x, a["rows"], a["a_rows"], a["ranks"], a["seg_starts"], max_rank=8,
                                      in_features=64, interpret=True)
                assert xa.shape[1] == 8
                got.append(lora.lora_expand(y, xa, a["rows"], a["b_rows"], a["ranks"], a["seg_starts"], max_rank=8,
                                            out_features=c.fout, interpret=True))
        for i, (c, m) in enumerate(zip(cases, made)):
            assert_applied(got[i], ys[i], {**m[0], "x": x}, m[1], m[2], seg, m[4], c.fout, jnp.float32)
    finally:
        jax.clear_caches()


@pytest.mark.parametrize("hosted", [False, True], ids=["graph_schedule", "host_schedule"])
def test_fused_group_matches_each_module(hosted):
    """lora_fused_delta: q, k and v (one x, one fout) with other ranks per module and a slot only
    some modules have, in one launch: each module's columns hold its own delta, 0 on base rows."""
    cases, made, x, seg, rows, a_rows, b_rows, ranks, union = group_inputs((96, 96, 96), "fused-group")
    a_rows, b_rows, ranks = jnp.stack(a_rows), jnp.stack(b_rows), jnp.stack(ranks)
    schedule = lora.fused_schedule(union, seg, TOKENS, max_rank=MAX_RANK) if hosted else None
    got = lora.lora_fused_delta(x, rows, a_rows, b_rows, ranks, made[0][0]["seg_starts"], max_rank=MAX_RANK,
                                fin=64, fout=96, interpret=True, schedule=schedule)
    assert got.shape[0] >= TOKENS and got.shape[1] == 3 * 96 and got.dtype == jnp.float32
    for i, (c, m) in enumerate(zip(cases, made)):
        delta = np.asarray(got[:TOKENS, i * 96:(i + 1) * 96])
        assert rel_err(delta, dense_delta(x, m[1], m[2], seg, m[4], c.fout)) < TOL[jnp.float32], i
        assert not delta[owner_rank(seg, m[4]) == 0].any()


def test_blocks_from_environment():
    """SLORA_LORA_BLOCKS (JSON) is merged into BLOCKS at import, so a benchmark can time a setting in
    a process it does not drive; an unknown setting fails loudly instead of timing the defaults."""
    import subprocess
    import sys
    code = "from pallas_kernels import lora; print(lora.BLOCKS['shrink']['static_split'], lora.BLOCKS['shrink']['split_k'])"
    env = {**os.environ, "SLORA_LORA_BLOCKS": '{"shrink": {"static_split": true}}', "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", str(lora.BLOCKS["shrink"]["split_k"])]
    env["SLORA_LORA_BLOCKS"] = '{"shrink": {"no_such_setting": 1}}'
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "no_such_setting" in bad.stderr


def test_decode_block_t(monkeypatch):
    """The engine's decode block_t, per kernel: 1 (MBGMV) where BLOCKS["mbgmv"] has it (the shrink's
    by default), for the Pallas pair only (the Triton twins' and the fused kernel's products are
    dots of 16 rows), which only the Pallas shrink and expand accept; else BLOCK_T."""
    monkeypatch.setitem(lora.BLOCKS, "mbgmv", {**lora.BLOCKS["mbgmv"], "shrink": True, "expand": False})
    assert (lora.decode_block_t("pallas", "shrink"), lora.decode_block_t("pallas")) == (1, lora.BLOCK_T)
    monkeypatch.setitem(lora.BLOCKS, "mbgmv", {**lora.BLOCKS["mbgmv"], "shrink": False, "expand": True})
    assert (lora.decode_block_t("pallas", "shrink"), lora.decode_block_t("pallas", "expand")) == (lora.BLOCK_T, 1)
    assert lora.decode_block_t("triton", "expand") == lora.BLOCK_T
    # the shrink of a module: block_t 1 only where its column tile reaches the MBGMV cap (1024):
    # llama-7b's q/k/v/o (in 4096, rows of 4096) and llama-3-8b's (rows of 1024), not down (in 11008)
    monkeypatch.setitem(lora.BLOCKS, "mbgmv", {**lora.BLOCKS["mbgmv"], "shrink": True, "col_tile": 1024})
    assert lora.decode_block_t("pallas", "shrink", 4096, 4096) == 1
    assert lora.decode_block_t("pallas", "shrink", 1024, 4096) == 1
    assert lora.decode_block_t("pallas", "shrink", 4096, 11008) == lora.BLOCK_T
    assert lora.decode_block_t("pallas", "shrink", 512, 4096) == lora.BLOCK_T
    monkeypatch.setitem(lora.BLOCKS, "fused", {**lora.BLOCKS["fused"], "decode": True})
    assert lora.decode_block_t("pallas", "expand") == lora.BLOCK_T
    lora._check_block_t(1, mbgmv=True)
    for bad, mbgmv in ((1, False), (8, True), (24, True)):
        with pytest.raises(ValueError, match="block_t"):
            lora._check_block_t(bad, mbgmv=mbgmv)


# -- the Mosaic GPU decode pair (pallas_kernels/lora_mgpu.py, BLOCKS["mgpu"]) ------------------
# One A^T / B row is one pool row there (fin = fout = W), rows are gathered by TMA. The CPU runs
# the kernels in Mosaic GPU's interpreter and lowers them for the GPU; a GPU compiles them.

MGPU_CASE = Case(ranks=(1, 8, 16, 64, 0, 24), lens=(1, 1, 2, 1, 1, 3), fin=256, fout=256, width=256)
MGPU_RANK = 64


def _mgpu_on(monkeypatch, col_tile=256):
    monkeypatch.setitem(lora.BLOCKS, "mgpu", {**lora.BLOCKS["mgpu"], "decode": True, "col_tile": col_tile})


@pytest.mark.parametrize("modules", [1, 2], ids=["single", "grouped"])
def test_mgpu_pair_matches_dense(monkeypatch, modules):
    """BLOCKS["mgpu"] on, a decode-shaped call (shrink_block_t 1): lora_apply_group goes through the
    Mosaic GPU pair (checked: the path is taken), and each module's y is y + the dense product,
    base tokens and rank-0 slots bit for bit y, over mixed ranks (1 to 64, one not a multiple of 8),
    slots of several tokens, a slot without a rank, a base tail and garbage past every rank."""
    from pallas_kernels import lora_mgpu
    _mgpu_on(monkeypatch)
    calls = []
    real = lora_mgpu.shrink_by_slot  # the default form (BLOCKS["mgpu"]["per_slot"])
    monkeypatch.setattr(lora_mgpu, "shrink_by_slot", lambda *a, **k: calls.append(1) or real(*a, **k))
    inputs = [make_inputs(MGPU_CASE, jnp.float32, seed=seed_of("mgpu", modules, g), max_rank=MGPU_RANK)
              for g in range(modules)]
    # one pool and one x for the group: module g's rows come from its own inputs, copied into pool 0
    arr0 = inputs[0][0]
    rows = np.asarray(arr0["rows"]).copy()
    a_rows, b_rows, ranks, mats = [], [], [], []
    for g, (arr, a_mats, b_mats, seg, rk) in enumerate(inputs):
        if g:  # module g's rows, moved to pool rows past module 0's pool: disjoint
            off = POOL_ROWS * g
            rows = np.concatenate([rows, np.asarray(arr["rows"])])
            a_rows.append(arr["a_rows"] + off)
            b_rows.append(arr["b_rows"] + off)
        else:
            a_rows.append(arr["a_rows"])
            b_rows.append(arr["b_rows"])
        ranks.append(arr["ranks"])
        mats.append((a_mats, b_mats, rk))
    ys = tuple(jnp.asarray(np.random.default_rng(g).normal(size=(TOKENS, MGPU_CASE.fout)), jnp.float32)
               for g in range(modules))
    got = lora.lora_apply_group(ys, arr0["x"], jnp.asarray(rows), tuple(a_rows), tuple(b_rows), tuple(ranks),
                                arr0["seg_starts"], max_rank=MGPU_RANK, fin=MGPU_CASE.fin,
                                fouts=(MGPU_CASE.fout,) * modules, shrink_block_t=1, interpret=True)
    assert calls, "the Mosaic GPU pair was not taken"
    seg = inputs[0][3]
    for g in range(modules):
        a_mats, b_mats, rk = mats[g]
        assert_applied(got[g], ys[g], arr0, a_mats, b_mats, seg, rk, MGPU_CASE.fout, jnp.float32)


@pytest.mark.parametrize("per_slot,slot_tokens", [(True, 4), (True, 2), (False, None)],
                         ids=["per_slot", "per_slot_blocks_of_2", "per_token"])
@pytest.mark.parametrize("rows_per_program", [8, 16])
def test_mgpu_kernels_alone(rows_per_program, per_slot, slot_tokens):
    """Each Mosaic GPU kernel on its own contract, in both forms (a program per slot block or per
    token; blocks of 2 split the case's 3-token slot over two programs, and its 28 base tokens take
    4 base rows).
    shrink: xa matches the reference for live rank
    columns and is exactly 0 past every token's rank and on base tokens (rows past a rank are read
    from the garbage the index points at). expand: reads nothing of xa past a token's rank (xa
    holds 1e3 there) and leaves base tokens' y bit for bit."""
    from pallas_kernels import lora_mgpu
    arr, a_mats, b_mats, seg, ranks = make_inputs(MGPU_CASE, jnp.float32, seed=seed_of("mgpu-alone"),
                                                  max_rank=MGPU_RANK)
    slot = lora.token_slot(arr["seg_starts"], TOKENS)
    if per_slot:
        xa = lora_mgpu.shrink_by_slot(arr["x"], arr["rows"], arr["a_rows"][None], arr["ranks"][None],
                                      arr["seg_starts"], max_rank=MGPU_RANK, rows_per_program=rows_per_program,
                                      slot_tokens=slot_tokens, interpret=True)
    else:
        xa = lora_mgpu.shrink(arr["x"], arr["rows"], arr["a_rows"][None], arr["ranks"][None], slot,
                              max_rank=MGPU_RANK, rows_per_program=rows_per_program, interpret=True)
    want = lora.lora_shrink_reference(arr["x"], arr["rows"], arr["a_rows"], arr["ranks"], arr["seg_starts"],
                                      max_rank=MGPU_RANK, in_features=MGPU_CASE.fin)
    assert xa.shape == (TOKENS, MGPU_RANK)
    assert rel_err(xa, want) < 1e-5
    dead = np.arange(MGPU_RANK)[None, :] >= owner_rank(seg, ranks)[:, None]
    assert dead.any() and not np.asarray(xa)[dead].any()
    noisy = jnp.where(jnp.asarray(dead), 1e3, want)
    y = jnp.asarray(np.random.default_rng(3).normal(size=(TOKENS, MGPU_CASE.fout)), jnp.float32)
    if per_slot:
        got = lora_mgpu.expand_by_slot(y, noisy, arr["rows"], arr["b_rows"], arr["ranks"], arr["seg_starts"],
                                       max_rank=MGPU_RANK, col_tile=256, slot_tokens=slot_tokens, interpret=True)
    else:
        got = lora_mgpu.expand(y, noisy, arr["rows"], arr["b_rows"], arr["ranks"], slot, max_rank=MGPU_RANK,
                               col_tile=256, interpret=True)
    assert_applied(got, y, arr, a_mats, b_mats, seg, ranks, MGPU_CASE.fout, jnp.float32)


def test_mgpu_pair_only_where_it_applies(monkeypatch):
    """The Mosaic GPU kernels take decode launches (shrink at block_t 1, expand with decode=True)
    whose A^T (shrink) or B (expand) rows are whole pool rows, each launch on its own; prefill
    launches and other widths keep the Triton-lowered kernels."""
    from pallas_kernels import lora_mgpu
    assert lora_mgpu.shrink_applies(4096, 4096) and lora_mgpu.expand_applies(4096, 4096)
    assert not lora_mgpu.shrink_applies(4096, 11008)     # down_proj's A^T rows span pool rows
    assert not lora_mgpu.expand_applies(4096, 11008)     # gate/up's B rows do too
    assert not lora_mgpu.expand_applies(384, 384, col_tile=256)
    assert not lora.mgpu_decode(256, 256, "shrink")      # off by default
    _mgpu_on(monkeypatch)
    assert lora.mgpu_decode(256, 256, "shrink") and lora.mgpu_decode(256, 256, "expand")
    assert not lora.mgpu_decode(256, 512, "shrink") and not lora.mgpu_decode(256, 512, "expand")


def test_mgpu_by_default_on_hopper_only(monkeypatch):
    """BLOCKS["mgpu"]["decode"] None ("auto"): the pair is taken on a GPU of compute capability
    9.0 or later (TMA), never on the CPU or an older GPU; True / False force it either way."""
    from pallas_kernels import lora_mgpu

    class Dev:
        def __init__(self, platform, cc=None):
            self.platform = platform
            if cc is not None:
                self.compute_capability = cc
    monkeypatch.setitem(lora.BLOCKS, "mgpu", {**lora.BLOCKS["mgpu"], "decode": None})
    for dev, want in ((Dev("cpu"), False), (Dev("gpu", "8.0"), False), (Dev("gpu", "9.0"), True),
                      (Dev("gpu", "10.0"), True), (Dev("gpu"), False)):
        monkeypatch.setattr(lora_mgpu.jax, "devices", lambda d=dev: [d])
        assert lora_mgpu.hopper() is want and lora.mgpu_decode(256, 256, "expand") is want, dev.__dict__
    monkeypatch.setitem(lora.BLOCKS, "mgpu", {**lora.BLOCKS["mgpu"], "decode": False})
    assert not lora.mgpu_decode(256, 256, "shrink")
    monkeypatch.setattr(lora_mgpu.jax, "devices", lambda: [Dev("cpu")])
    monkeypatch.setitem(lora.BLOCKS, "mgpu", {**lora.BLOCKS["mgpu"], "decode": True})
    assert lora.mgpu_decode(256, 256, "shrink")


@pytest.mark.parametrize("path", ["mgpu_shrink_triton_expand", "triton_shrink_mgpu_expand", "prefill"])
def test_mgpu_mixed_launches(monkeypatch, path):
    """Each launch decides alone and either expand reads either shrink's xa: a Mosaic GPU shrink
    (fin = W) with a Triton expand (fout != W), a Triton shrink (fin != W, its split planes) with a
    Mosaic GPU expand (fout = W), and a prefill-shaped call (block_t 16, decode off) that takes
    neither. Each gives y + the dense product; the Mosaic GPU kernels run exactly where expected."""
    from pallas_kernels import lora_mgpu
    _mgpu_on(monkeypatch)
    fin, fout = {"mgpu_shrink_triton_expand": (256, 64), "triton_shrink_mgpu_expand": (64, 256),
                 "prefill": (256, 256)}[path]
    case = dataclasses.replace(MGPU_CASE, fin=fin, fout=fout)
    arr, a_mats, b_mats, seg, ranks = make_inputs(case, jnp.float32, seed=seed_of("mgpu-mixed", path),
                                                  max_rank=MGPU_RANK)
    ran = []
    for name in ("shrink", "expand"):
        real = getattr(lora_mgpu, name + "_by_slot")
        monkeypatch.setattr(lora_mgpu, name + "_by_slot",
                            lambda *a, _r=real, _n=name, **k: ran.append(_n) or _r(*a, **k))
    y = jnp.asarray(np.random.default_rng(5).normal(size=(TOKENS, fout)), jnp.float32)
    bt = 16 if path == "prefill" else 1
    got = lora.lora_apply(y, arr["x"], arr["rows"], arr["a_rows"], arr["b_rows"], arr["ranks"], arr["seg_starts"],
                          max_rank=MGPU_RANK, fin=fin, fout=fout, shrink_block_t=bt, interpret=True)
    assert_applied(got, y, arr, a_mats, b_mats, seg, ranks, fout, jnp.float32)
    assert ran == {"mgpu_shrink_triton_expand": ["shrink"], "triton_shrink_mgpu_expand": ["expand"],
                   "prefill": []}[path]


@pytest.mark.parametrize("shrink_rows,col_tile,per_slot", [(8, 512, True), (8, 512, False), (16, 256, True),
                                                            (4, 1024, True)])
def test_mgpu_pair_lowers_for_gpu(shrink_rows, col_tile, per_slot):
    """Both kernels lower to Mosaic GPU at llama-7b's attention widths (W 4096, q/k/v grouped, ranks
    to 64) on the CPU, at the settings a GPU sweep tries: what Mosaic GPU's layout inference and
    copy rules refuse shows here."""
    from pallas_kernels import lora_mgpu
    t, w, g, sa, r = 16, 4096, 3, 6, 64
    x = jax.ShapeDtypeStruct((t, w), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((1024, w), jnp.bfloat16)
    a_rows = jax.ShapeDtypeStruct((g, sa, r), jnp.int32)
    ranks = jax.ShapeDtypeStruct((g, sa), jnp.int32)
    slot = jax.ShapeDtypeStruct((t,), jnp.int32)
    xa = jax.ShapeDtypeStruct((t, g * r), jnp.float32)
    # per slot, the last argument is seg_starts [Sa + 1] instead of token_slot [T]
    index = jax.ShapeDtypeStruct((sa + 1,), jnp.int32) if per_slot else slot
    shrink_fn, expand_fn = ((lora_mgpu.shrink_by_slot, lora_mgpu.expand_by_slot) if per_slot
                            else (lora_mgpu.shrink, lora_mgpu.expand))
    shrink = jax.jit(lambda *a: shrink_fn(*a, max_rank=r, rows_per_program=shrink_rows, interpret=False)).trace(
        x, rows, a_rows, ranks, index).lower(lowering_platforms=("cuda",)).as_text()
    expand = jax.jit(lambda *a: expand_fn(*a, max_rank=r, xa_col=r, col_tile=col_tile, interpret=False)).trace(
        x, xa, rows, jax.ShapeDtypeStruct((sa, r), jnp.int32), jax.ShapeDtypeStruct((sa,), jnp.int32), index).lower(
        lowering_platforms=("cuda",)).as_text()
    # named, so a device trace tells the shrink from the expand (bench/profile_step.py)
    for text, name in ((shrink, "lora_shrink_mgpu"), (expand, "lora_expand_mgpu")):
        assert "mosaic_gpu" in text and name in text, text[:2000]


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled kernels need a GPU")
@pytest.mark.parametrize("modules", [1, 2], ids=["single", "grouped"])
def test_mgpu_pair_compiled(monkeypatch, modules):
    """The same check as test_mgpu_pair_matches_dense, compiled by Mosaic GPU (lora._interpret
    answers False whatever the call asks)."""
    monkeypatch.setattr(lora, "_interpret", lambda interpret: False)
    test_mgpu_pair_matches_dense(monkeypatch, modules)
