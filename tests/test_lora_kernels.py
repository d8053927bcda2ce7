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
import json
import warnings
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import lora, lora_schedule

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
    def test_mbgmv_block_t_1(self, name, dtype):
        """The shrink at block_t 1 (MBGMV: the engine's decode shrink where gemv_shrink holds): one
        token a block, products by multiply and sum. The shrink matches the reference (exact zeros
        past each rank and on base tokens); the engine's decode pair, the shrink at block_t 1 and the
        expands at BLOCK_T, adds the dense product, base rows bit for bit y, with the schedules built
        in the graph or on the host alike. The expand refuses block_t 1 (its products are dots)."""
        case = CASES[name]
        arr, a_mats, b_mats, seg, ranks = make_inputs(case, dtype, seed_of("mbgmv", name, dtype))
        args = (arr["x"], arr["rows"], arr["a_rows"], arr["ranks"], arr["seg_starts"])
        xa = lora.lora_shrink(*args, max_rank=MAX_RANK, in_features=case.fin, **self._kw(block_t=1))
        want_xa = lora.lora_shrink_reference(*args, max_rank=MAX_RANK, in_features=case.fin)
        assert rel_err(xa, want_xa) < TOL[dtype], rel_err(xa, want_xa)
        dead = np.arange(MAX_RANK)[None, :] >= owner_rank(seg, ranks)[:, None]
        assert not np.asarray(xa)[dead].any()
        y = jnp.asarray(np.random.default_rng(seed_of("mbgmv-y", name)).normal(size=(TOKENS, case.fout)), dtype)
        kw = dict(max_rank=MAX_RANK, fin=case.fin, fout=case.fout, block_t=lora.BLOCK_T, shrink_block_t=1,
                  **self._kw())
        mixed = lora.lora_apply(y, *delta_args(arr), **kw)
        assert_applied(mixed, y, arr, a_mats, b_mats, seg, ranks, case.fout, dtype)
        mixed_hosted = lora.lora_apply(
            y, *delta_args(arr), schedule=lora.block_schedule(ranks, seg, TOKENS, lora.BLOCK_T),
            shrink_schedule=lora.shrink_schedule(ranks, seg, TOKENS, 1, max_rank=MAX_RANK), **kw)
        np.testing.assert_array_equal(np.asarray(mixed_hosted), np.asarray(mixed))
        with pytest.raises(ValueError, match="block_t"):
            lora.lora_expand(y, xa, arr["rows"], arr["b_rows"], arr["ranks"], arr["seg_starts"], max_rank=MAX_RANK,
                             out_features=case.fout, block_t=1, **self._kw())

    def test_few_programs_small_max_rank(self):
        """Fewer programs than blocks, so each walks several (the persistent loop); and a max rank
        below one rank tile, so tiles are masked rather than padded into xa."""
        case = Case(ranks=(8, 1, 0, 4), lens=(9, 3, 2, 11))
        arr, a_mats, b_mats, seg, ranks = make_inputs(case, jnp.float32, seed_of("few"), max_rank=8)
        args = delta_args(arr)
        got = lora.lora_delta(*args, max_rank=8, fin=case.fin, fout=case.fout,
                              **self._kw(block_t=32, shrink_sizes=lora.ShrinkBlockSizes(max_programs=2),
                                         expand_sizes=lora.ExpandBlockSizes(max_programs=2)))
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
    sched, total, nb = lora_schedule._block_schedule(ranks, seg, 60, 16)
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
    def test_lowers_to_triton(self, fin, fout, width, dtype):
        t, sa, r, n = 40, 8, 64, 4096
        sds = jax.ShapeDtypeStruct
        i32 = jnp.int32
        device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                             platform="gpu")
        mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)

        def delta(x, rows, a_rows, b_rows, ranks, seg):
            kw = dict(max_rank=r, fin=fin, fout=fout, interpret=False, shrink_sizes=lora.ShrinkBlockSizes(),
                      expand_sizes=lora.ExpandBlockSizes())
            return lora.lora_delta(x, rows, a_rows, b_rows, ranks, seg, **kw)

        shapes = (sds((t, fin), dtype), sds((n, width), dtype),
                  sds((sa, -(-r * fin // width)), i32), sds((sa, -(-r * fout // width)), i32),
                  sds((sa,), i32), sds((sa + 1,), i32))
        with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
            warnings.simplefilter("ignore", DeprecationWarning)  # the Triton backend's notice
            hlo = jax.jit(delta).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
        # shrink and expand; not the fallback
        assert hlo.count("__gpu$xla.gpu.triton") == 2


def test_host_block_schedule_matches_the_graph_one():
    """block_schedule (numpy, built by the engine with a step's inputs) gives the same arrays as
    the in-graph _block_schedule, on random segments with empty slots and rank-0 slots; and the
    kernels give the same output with either."""
    from pallas_kernels.lora_schedule import _block_schedule, block_schedule
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


def test_host_shrink_schedule_matches_the_graph_one():
    """shrink_schedule (numpy: the live (block, rank tile) items) gives the same arrays
    as the in-graph _block_schedule with a rank tile, ranks past max_rank clamped; the shrink gives
    the same output given it as building its own; a schedule of the wrong shape is refused."""
    from pallas_kernels.lora_schedule import _block_schedule, block_schedule, shrink_schedule
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
    if True:
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


@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_shrink_split_k_matches_dense(split_k):
    """ShrinkBlockSizes.split_k: 1, one program walks the `in` columns and stores; > 1 (the default
    for decode-sized calls), the columns in split_k ranges (uneven with 3: the last split stores
    zeros) whose partial sums go to planes of xa that the expand adds. Either way the same delta as
    the dense product, and zeros past each token's rank."""
    case = dataclasses.replace(CASES["mixed"], fin=128)  # four 32-column chunks
    sizes = lora.ShrinkBlockSizes(split_k=split_k)
    arr, a_mats, b_mats, seg, ranks = make_inputs(case, jnp.float32, seed=seed_of("split", split_k))
    got = lora.lora_delta(*delta_args(arr), max_rank=MAX_RANK, fin=case.fin, fout=case.fout, interpret=True,
                          shrink_sizes=sizes)
    assert rel_err(got, dense_delta(arr["x"], a_mats, b_mats, seg, ranks, case.fout)) < TOL[jnp.float32]
    xa = lora.lora_shrink(arr["x"], arr["rows"], arr["a_rows"], arr["ranks"], arr["seg_starts"],
                          max_rank=MAX_RANK, in_features=case.fin, interpret=True, block_sizes=sizes)
    dead = np.arange(MAX_RANK)[None, :] >= owner_rank(seg, ranks)[:, None]
    assert not np.asarray(xa)[dead].any()


@pytest.mark.parametrize("shrink,expand,width", [
    (dict(rank_tile=32, split_k=2), dict(rank_tile=32), None),
    (dict(split_k=3), {}, None),                                 # the last split gets 0 chunks of 4 (2, 2, 0)
    (dict(split_k=1), {}, None),
    (dict(col_tile=32, split_k=3), {}, 128),                     # fin == width: an A^T row is one pool row
    (dict(max_programs=2, split_k=1), dict(max_programs=2), None),  # programs walk several items
    (dict(split_k=4, split_k_max_tokens=8), dict(col_tile=32), None),  # split-K off past its token bound
], ids=["rank_tile_32", "uneven_splits", "k1", "whole_rows", "many_trips", "no_split_past_bound"])
def test_block_sizes_match_dense(shrink, expand, width):
    """Settings other than the defaults compute the same delta as the dense product, and leave base
    tokens' y as it was."""
    case = dataclasses.replace(CASES["mixed"], fin=128, width=width or CASES["mixed"].width)
    arr, a_mats, b_mats, seg, ranks = make_inputs(case, jnp.float32, seed=seed_of("variant", str(shrink), str(expand)))
    got = lora.lora_delta(*delta_args(arr), max_rank=MAX_RANK, fin=case.fin, fout=case.fout, interpret=True,
                          shrink_sizes=lora.ShrinkBlockSizes(**shrink), expand_sizes=lora.ExpandBlockSizes(**expand))
    assert rel_err(got, dense_delta(arr["x"], a_mats, b_mats, seg, ranks, case.fout)) < TOL[jnp.float32]
    base = owner_rank(seg, ranks) == 0
    assert base.any() and not np.asarray(got)[base].any()


def test_split_planes():
    """Split-K: lora_shrink_group returns one plane of partial sums per split (their sum is xa),
    lora_shrink still returns xa with exact zeros past each token's rank, and lora_expand adds the
    planes as it reads them, reading nothing past the rank or on base tokens."""
    sizes = lora.ShrinkBlockSizes(split_k=4)
    case = dataclasses.replace(CASES["mixed"], fin=128)   # four 32-column chunks, one a split
    arr, *_, seg, ranks = make_inputs(case, jnp.float32, seed=seed_of("partials"))
    args = (arr["x"], arr["rows"], arr["a_rows"], arr["ranks"], arr["seg_starts"])
    want = lora.lora_shrink_reference(*args, max_rank=MAX_RANK, in_features=case.fin)
    planes = lora.lora_shrink_group(arr["x"], arr["rows"], (arr["a_rows"],), (arr["ranks"],), arr["seg_starts"],
                                    max_rank=MAX_RANK, in_features=case.fin, interpret=True, block_sizes=sizes)
    assert planes.ndim == 3 and planes.shape[0] == 4
    assert rel_err(planes.sum(0)[:TOKENS, :MAX_RANK], want) < TOL[jnp.float32]
    got = lora.lora_shrink(*args, max_rank=MAX_RANK, in_features=case.fin, interpret=True, block_sizes=sizes)
    assert got.shape == (TOKENS, MAX_RANK) and rel_err(got, want) < TOL[jnp.float32]
    dead = np.arange(MAX_RANK)[None, :] >= owner_rank(seg, ranks)[:, None]
    assert not np.asarray(got)[dead].any()
    # the expand from planes with garbage where xa must not be read
    rng = np.random.default_rng(seed_of("partials-y"))
    y = jnp.asarray(rng.normal(size=(TOKENS, case.fout)), jnp.float32)
    noisy = np.array(planes)
    noisy[:, :TOKENS, :MAX_RANK][:, dead] = 1e3
    eargs = (arr["rows"], arr["b_rows"], arr["ranks"], arr["seg_starts"])
    out = lora.lora_expand(y, jnp.asarray(noisy), *eargs, max_rank=MAX_RANK, out_features=case.fout, interpret=True)
    ref = lora.lora_expand_reference(y, want, *eargs, max_rank=MAX_RANK, out_features=case.fout)
    assert rel_err(out, ref) < TOL[jnp.float32]


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


@pytest.mark.parametrize("split_k", [1, 4], ids=["k1", "k4"])
def test_grouped_apply_matches_each_module(split_k):
    """lora_apply_group: q, k and v (one x; k and v narrower, GQA) with other ranks per module,
    a slot that only some modules have, one shrink launch: each y gets its own module's delta. The
    shrink's items are the live tiles of the modules' largest rank per slot, with no rank guard, so
    a module of smaller rank masks those tiles itself."""
    cases, made, x, seg, rows, a_rows, b_rows, ranks, union = group_inputs((128, 64, 64), "group")
    ys = [jnp.asarray(np.random.default_rng(i).normal(size=(TOKENS, c.fout)), jnp.float32)
          for i, c in enumerate(cases)]
    got = lora.lora_apply_group(ys, x, rows, a_rows, b_rows, ranks, made[0][0]["seg_starts"],
                                max_rank=MAX_RANK, fin=64, fouts=[c.fout for c in cases], interpret=True,
                                schedule=lora.block_schedule(union, seg, TOKENS),
                                shrink_sizes=lora.ShrinkBlockSizes(split_k=split_k))
    for i, (c, m) in enumerate(zip(cases, made)):
        want = np.asarray(ys[i], np.float64) + dense_delta(x, m[1], m[2], seg, m[4], c.fout)
        assert rel_err(got[i], want) < TOL[jnp.float32], i


@pytest.mark.parametrize("grouped", [False, True], ids=["shrink_then_expand", "grouped_apply"])
def test_max_rank_below_a_rank_tile_without_split_k(grouped):
    """A max rank below one rank tile (S1's rank-8 adapters) where the shrink does not split K
    (prefill calls past split_k_max_tokens): the expand's rank-tile slice of xa must stay inside
    xa (past a grouped xa's last module, start 16, size 16, width 24, the Triton lowering refuses
    the trace); lora_shrink's own xa ([T, max_rank]) is narrower still."""
    k1 = lora.ShrinkBlockSizes(split_k=1)
    if True:
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
                arr["seg_starts"], max_rank=8, fin=64, fouts=[c.fout for c in cases], interpret=True,
                shrink_sizes=k1)
        else:
            got = []
            for y, c, (a, *_) in zip(ys, cases, made):
                xa = lora.lora_shrink(x, a["rows"], a["a_rows"], a["ranks"], a["seg_starts"], max_rank=8,
                                      in_features=64, interpret=True, block_sizes=k1)
                assert xa.shape[1] == 8
                got.append(lora.lora_expand(y, xa, a["rows"], a["b_rows"], a["ranks"], a["seg_starts"], max_rank=8,
                                            out_features=c.fout, interpret=True))
        for i, (c, m) in enumerate(zip(cases, made)):
            assert_applied(got[i], ys[i], {**m[0], "x": x}, m[1], m[2], seg, m[4], c.fout, jnp.float32)


def test_gemv_shrink_where_its_column_tile_is_wide():
    """A decode shrink takes block_t 1 only where its column tile reaches gemv_col_tile (1024 by
    default): llama-7b's q/k/v/o (in 4096, rows of 4096) and llama-3-8b's (rows of 1024), not down
    (in 11008) nor rows of 512. Only the shrink accepts block_t 1."""
    assert lora.gemv_shrink(4096, 4096) and lora.gemv_shrink(1024, 4096)
    assert not lora.gemv_shrink(4096, 11008) and not lora.gemv_shrink(512, 4096)
    assert lora.gemv_shrink(512, 4096, lora.ShrinkBlockSizes(gemv_col_tile=512))
    lora._check_block_t(1, gemv=True)
    for bad, gemv in ((1, False), (8, True), (24, True)):
        with pytest.raises(ValueError, match="block_t"):
            lora._check_block_t(bad, gemv=gemv)


def test_block_sizes_are_frozen_data_per_device():
    """The settings are frozen (hashable: static arguments of the jitted kernels); the H200's come
    from configs/lora.json; an unknown device falls back to the defaults; an unknown setting in a
    config is refused."""
    from pallas_kernels.block_sizes import from_dict
    sizes = lora.ShrinkBlockSizes.get_default("NVIDIA H200")
    with pytest.raises(dataclasses.FrozenInstanceError):
        sizes.split_k = 1
    assert hash(sizes) == hash(lora.ShrinkBlockSizes.get_default("NVIDIA H200"))
    table = json.loads((Path(lora.__file__).parent / "configs" / "lora.json").read_text())["NVIDIA H200"]
    assert dataclasses.asdict(sizes) == {**dataclasses.asdict(lora.ShrinkBlockSizes()), **table["shrink"]}
    assert dataclasses.asdict(lora.ExpandBlockSizes.get_default("NVIDIA H200")) == \
        {**dataclasses.asdict(lora.ExpandBlockSizes()), **table["expand"]}
    assert lora.ShrinkBlockSizes.get_default("Some Future Chip") == lora.ShrinkBlockSizes()
    assert lora.ExpandBlockSizes.get_default("cpu") == lora.ExpandBlockSizes()
    with pytest.raises(ValueError, match="no_such_setting"):
        from_dict(lora.ShrinkBlockSizes, {"no_such_setting": 1})
