"""The one-trip decode pair (pallas_kernels/onetrip.py) against the dense product of the un-paged A
and B, and its shrink against lora.py's jnp reference.

Inputs come from test_lora_kernels.make_inputs: each adapter's A^T and B rows at random rows of a
pool whose other rows are garbage of magnitude ~1e3, unused row indices pointing at random rows, so
a wrong row fails loudly. Every case runs with small tiles and few programs, so a step has several
splits, rank tiles and column tiles, and programs walk several units. CPU: interpret mode;
TestOnetripGPU: the same cases through the Triton lowering (skips without a GPU);
test_lowers_to_triton: both kernels lowered for an H200 on the CPU.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import lora, onetrip
from test_lora_kernels import (DTYPES, MAX_RANK, TOKENS, Case, assert_applied, dense_delta, make_inputs,
                               owner_rank, rel_err, seed_of)

CASES = {
    # ranks {1, 8, 16, 64, 128} in one batch, a slot with no tokens, a rank-0 slot with tokens,
    # odd segment lengths (13 and 9: blocks of 16 with dead rows) and a base tail; A^T rows of two
    # pool rows each, B rows of three
    "mixed": Case(ranks=(1, 8, 16, 64, 128, 0), lens=(1, 5, 0, 13, 9, 3), fin=64, fout=96),
    # one adapter takes the whole batch: three token blocks, the last partly dead
    "whole_batch": Case(ranks=(0, 64), lens=(0, TOKENS), fin=64, fout=96),
    "base_only": Case(ranks=(8, 16), lens=(0, 0), fin=64, fout=96),
    "decode": Case(ranks=(8, 128, 1, 16, 64), lens=(1, 1, 1, 1, 1), fin=64, fout=96),
    # GQA's k and v: in = 4 W, out = W
    "gqa_kv": Case(ranks=(8, 64, 1, 128, 16), lens=(3, 17, 2, 6, 0), fin=128, fout=32),
    # in = W with SMALL's k_tile at W: one split, plain stores into an xa nobody zeroed (the wide
    # shrink's form)
    "one_split": Case(ranks=(8, 64, 1, 128, 16, 0), lens=(3, 17, 2, 6, 0, 4), fin=32, fout=64),
}
SMALL = dict(k_tile=16, col_tile=16, max_programs=5)  # W = 32: 2 splits a pool row, 2 column tiles
FORMS = {"gemv": dict(form="gemv", block_t=3), "dot": dict(form="dot", block_t=16)}


@pytest.fixture
def saved_blocks():
    """BLOCKS["onetrip"] as it was, after the test."""
    saved = dict(lora.BLOCKS["onetrip"])
    yield lora.BLOCKS["onetrip"]
    lora.BLOCKS["onetrip"] = saved


@pytest.fixture
def small_tiles(saved_blocks):
    saved_blocks.update(SMALL)


def _plans(arr, ranks, seg, case, t=TOKENS, max_rank=MAX_RANK):
    kw = dict(width=case.width, max_rank=max_rank)
    sp = onetrip.shrink_plan(ranks[None], np.asarray(arr["a_rows"])[None], seg, t, fin=case.fin, **kw)
    ep = onetrip.expand_plan(ranks, np.asarray(arr["b_rows"]), seg, t, fout=case.fout, **kw)
    return tuple(map(jnp.asarray, sp)), tuple(map(jnp.asarray, ep))


@pytest.mark.usefixtures("small_tiles")
class TestOnetrip:
    INTERPRET = True

    @pytest.mark.parametrize("form", FORMS)
    @pytest.mark.parametrize("branches", [True, False], ids=["branches", "masked_tiles"])
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("name", list(CASES))
    def test_apply(self, name, dtype, branches, form):
        """The pair, in both forms (gemv: a token at a time, blocks of 3 tokens; dot: blocks of 16);
        the expand's rank tiles past the first under branches on the rank, and without
        (BLOCKS["onetrip"]["tile_branches"]: every tile's product on masked zeros)."""
        lora.BLOCKS["onetrip"].update(tile_branches=branches, **FORMS[form])
        case = CASES[name]
        if name == "one_split":
            lora.BLOCKS["onetrip"]["k_tile"] = case.width
        arr, a_mats, b_mats, seg, ranks = make_inputs(case, dtype, seed_of("onetrip", name, dtype))
        sp, ep = _plans(arr, ranks, seg, case)
        xa = onetrip.onetrip_shrink(arr["x"], arr["rows"], sp, n_modules=1, max_rank=MAX_RANK,
                                    interpret=self.INTERPRET)
        want = lora.lora_shrink_reference(arr["x"], arr["rows"], arr["a_rows"], arr["ranks"], arr["seg_starts"],
                                          max_rank=MAX_RANK, in_features=case.fin)
        assert xa.shape[0] >= TOKENS and xa.dtype == jnp.float32
        dead = np.arange(MAX_RANK)[None, :] >= owner_rank(seg, ranks)[:, None]
        got = np.asarray(xa[:TOKENS, :MAX_RANK])
        assert rel_err(np.where(dead, 0, got), want) < (1e-5 if dtype == jnp.float32 else 1e-2)
        # with splits: nothing past a token's rank nor on base tokens (the expand masks there, but
        # the shrink must not add into columns it does not own); one split stores into an xa that
        # nobody zeroed (interpret mode fills it with NaN), which the expand must never read
        if case.fin // lora.BLOCKS["onetrip"]["k_tile"] > 1:
            assert not got[dead].any()
        rng = np.random.default_rng(seed_of("onetrip-y", name))
        y = jnp.asarray(rng.normal(size=(TOKENS, case.fout)), dtype)
        got = onetrip.onetrip_expand(y, xa, arr["rows"], ep, interpret=self.INTERPRET)
        assert_applied(got, y, arr, a_mats, b_mats, seg, ranks, case.fout, dtype)

    @pytest.mark.parametrize("form", FORMS)
    @pytest.mark.parametrize("ticket", [False, True], ids=["index", "ticket"])
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("name", ["mixed", "whole_batch", "gqa_kv"])
    def test_one_launch(self, name, dtype, ticket, form):
        """onetrip_apply: shrink and expand in one launch, the expand's programs waiting on their
        block's counter, each program's place its index or a ticket (in interpret mode the
        programs run in index order, no counters: the ticket is the GPU's)."""
        if ticket and self.INTERPRET:
            pytest.skip("interpret mode runs programs in index order: no ticket")
        lora.BLOCKS["onetrip"].update(ticket=ticket, **FORMS[form])
        case = CASES[name]
        arr, a_mats, b_mats, seg, ranks = make_inputs(case, dtype, seed_of("onetrip-1", name, dtype))
        sp, ep = _plans(arr, ranks, seg, case)
        y = jnp.asarray(np.random.default_rng(seed_of("onetrip-1-y", name)).normal(size=(TOKENS, case.fout)), dtype)
        got = onetrip.onetrip_apply(y, arr["x"], arr["rows"], sp, ep, max_rank=MAX_RANK, interpret=self.INTERPRET)
        assert_applied(got, y, arr, a_mats, b_mats, seg, ranks, case.fout, dtype)

    @pytest.mark.parametrize("pipeline", [False, True], ids=["one_ahead", "pipelined"])
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_grouped_modules(self, dtype, pipeline):
        """q, k and v shrink in one launch, each slot with its own rank in each module (0: the
        adapter does not target it); each expands from its own xa columns. The shrink's programs
        walk many units each, their entries one unit ahead, or in the three-stage pipeline."""
        lora.BLOCKS["onetrip"]["pipeline"] = pipeline
        base = CASES["mixed"]
        module_ranks = [base.ranks, (128, 0, 8, 1, 16, 64), (8, 8, 0, 16, 0, 1)]
        cases = [Case(ranks=r, lens=base.lens, fin=base.fin, fout=base.fout) for r in module_ranks]
        mods = [make_inputs(c, dtype, seed_of("onetrip-group", g, dtype)) for g, c in enumerate(cases)]
        case, x = base, mods[0][0]["x"]
        mod_ranks = [m[4] for m in mods]
        # module g's rows in its own copy of the pool, the copies stacked: one pool
        n = mods[0][0]["rows"].shape[0]
        pool = jnp.concatenate([m[0]["rows"] for m in mods])
        a_rows = np.stack([np.asarray(m[0]["a_rows"]) + g * n for g, m in enumerate(mods)])
        seg = mods[0][3]
        kw = dict(width=case.width, max_rank=MAX_RANK)
        sp = tuple(map(jnp.asarray, onetrip.shrink_plan(np.stack(mod_ranks), a_rows, seg, TOKENS, fin=case.fin,
                                                        **kw)))
        xa = onetrip.onetrip_shrink(x, pool, sp, n_modules=3, max_rank=MAX_RANK, interpret=self.INTERPRET)
        cols = xa.shape[1] // 3
        y = jnp.zeros((TOKENS, case.fout), dtype)
        for g, (arr, a_mats, b_mats, _, _) in enumerate(mods):
            ep = tuple(map(jnp.asarray, onetrip.expand_plan(mod_ranks[g], np.asarray(arr["b_rows"]) + g * n, seg,
                                                            TOKENS, fout=case.fout, **kw)))
            got = onetrip.onetrip_expand(y, xa, pool, ep, xa_col=g * cols, interpret=self.INTERPRET)
            want = dense_delta(x, a_mats, b_mats, seg, mod_ranks[g], case.fout)
            assert rel_err(got, want) < (1e-5 if dtype == jnp.float32 else 2e-2), (g, rel_err(got, want))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled kernels need a GPU")
class TestOnetripGPU(TestOnetrip):
    INTERPRET = False


def test_plan_lists_live_units_only():
    """The shrink's units are its live (token block, rank tile) items times its splits, the
    expand's its live token blocks; both tables fit the shape's bound, rows past a rank are 0."""
    s = dict(lora.BLOCKS["onetrip"], block_t=16, rank_tile=16, k_tile=256)
    ranks = np.array([8, 0, 64, 33, 16, 128], np.int32)
    lens = np.array([2, 5, 0, 40, 1, 1])
    seg = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    a_rows = np.arange(6 * 128, dtype=np.int32).reshape(6, 128) + 1
    total, meta, rid = onetrip.shrink_plan(ranks[None], a_rows[None], seg, 64, fin=4096, width=4096, max_rank=64,
                                           settings=s)
    blocks = np.where((ranks > 0) & (lens > 0), -(-lens // 16), 0)
    tiles = -(-np.minimum(ranks, 64) // 16)
    assert total[0] == int((blocks * tiles).sum()) * 16       # 16 splits of 256 columns
    items = total[0] // 16
    assert (meta[:items, 2] > 0).all() and (meta[:items, 2] <= 16).all()
    assert rid.shape[1:] == (1, 16) and not rid[items:].any()
    # slot 3 (rank 33, 40 tokens): 3 blocks x 3 tiles, the last tile one live row
    live = meta[:items][meta[:items, 0] >= 7]
    assert sorted(live[:, 2].tolist())[:3] == [1, 1, 1]
    total, meta, rid = onetrip.expand_plan(ranks, a_rows, seg, 64, fout=4096, width=4096, max_rank=64, settings=s)
    assert total[0] == int(blocks.sum())
    assert (rid[:total[0]] > 0).sum() == sum(min(r, 64) * b for r, b in zip(ranks, blocks))


def test_one_launch_counts_match_the_plans():
    """What the one-launch expand of block b waits for (units_of_block of its rank) is exactly the
    number of shrink units whose meta names b: else it would read xa early, or never start."""
    s = dict(lora.BLOCKS["onetrip"], block_t=16, rank_tile=16, k_tile=256)
    ranks = np.array([8, 0, 64, 33, 16, 128, 1], np.int32)
    lens = np.array([2, 5, 0, 40, 1, 17, 3])
    seg = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    rows = np.arange(7 * 128, dtype=np.int32).reshape(7, 128)
    kw = dict(width=4096, max_rank=64, settings=s)
    total, meta, _ = onetrip.shrink_plan(ranks[None], rows[None], seg, 80, fin=4096, **kw)
    n_blocks, emeta, _ = onetrip.expand_plan(ranks, rows, seg, 80, fout=4096, **kw)
    splits = 4096 // 256
    blocks = meta[np.arange(total[0]) // splits, 4]                # each unit's block
    counts = np.bincount(blocks, minlength=emeta.shape[0])
    need = onetrip.units_of_block(emeta[:, 2], 16, splits)
    np.testing.assert_array_equal(counts[:n_blocks[0]], need[:n_blocks[0]])
    assert not counts[n_blocks[0]:].any() and (need[:n_blocks[0]] > 0).all()
    # a block's units cover its tokens: the meta's token range is the block's
    for b in range(n_blocks[0]):
        assert (meta[np.arange(total[0]) // splits][blocks == b, :2] == emeta[b, :2]).all()


@pytest.mark.parametrize("kernel_form", FORMS)
@pytest.mark.parametrize("form,launches", [("pair", 2), ("one_launch", 1), ("one_launch_ticket", 1)])
@pytest.mark.parametrize("fin,fout,width", [(4096, 4096, 4096), (4096, 1024, 1024)])
def test_lowers_to_triton(fin, fout, width, form, launches, kernel_form, saved_blocks):
    """The pair, and the one-launch form, lower for an H200 on the CPU (llama-7b's q/k/v/o; GQA's
    k/v at W 1024)."""
    saved_blocks.update(FORMS[kernel_form])
    t, sa, r, n = 64, 32, 64, 4096
    sds = jax.ShapeDtypeStruct
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    ranks = np.tile(np.array([8, 16, 32, 64], np.int32), sa // 4)
    seg = (np.arange(sa + 1) * 2).astype(np.int32)
    rows_a = np.zeros((sa, r * fin // width), np.int32)
    rows_b = np.zeros((sa, r * fout // width), np.int32)
    sp = onetrip.shrink_plan(ranks[None], rows_a[None], seg, t, fin=fin, width=width, max_rank=r)
    ep = onetrip.expand_plan(ranks, rows_b, seg, t, fout=fout, width=width, max_rank=r)

    def pair(x, rows, sp, ep):
        if form.startswith("one_launch"):
            lora.BLOCKS["onetrip"]["ticket"] = form.endswith("ticket")
            return onetrip.onetrip_apply(jnp.zeros((t, fout), jnp.bfloat16), x, rows, sp, ep, max_rank=r,
                                         interpret=False)
        xa = onetrip.onetrip_shrink(x, rows, sp, n_modules=1, max_rank=r, interpret=False)
        return onetrip.onetrip_expand(jnp.zeros((t, fout), jnp.bfloat16), xa, rows, ep, interpret=False)

    shapes = (sds((t, fin), jnp.bfloat16), sds((n, width), jnp.bfloat16),
              tuple(sds(a.shape, jnp.int32) for a in sp), tuple(sds(a.shape, jnp.int32) for a in ep))
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
        warnings.simplefilter("ignore", DeprecationWarning)
        hlo = jax.jit(pair).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("__gpu$xla.gpu.triton") == launches
