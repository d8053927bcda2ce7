"""The TPU kernels (pallas_kernels/tpu) in TPU interpret mode against their jnp references, and
cross-lowered through Mosaic for TPU v5e and v6e at the llama-7b and llama-3-8b shapes.

Unused pool rows and pages hold large random values (never zeros), so a kernel that reads a row
outside an adapter's real rank, or a page outside a sequence's context, fails the comparison."""

from __future__ import annotations

import functools
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from pallas_kernels.tpu.lora import (LoraBlocks, lora_expand, lora_expand_reference, lora_shrink,
                                     lora_shrink_reference, segment_plan)
from pallas_kernels.tpu.paged_attention import (DecodeBlocks, PrefillBlocks, paged_decode_attention,
                                                paged_decode_attention_reference, paged_prefill_attention,
                                                paged_prefill_attention_reference)

GARBAGE = 1e3
TPU_KINDS = ("TPU v5 lite", "TPU v6 lite")  # v5e, v6e
TOL = {jnp.float32: dict(rtol=1e-4, atol=1e-4), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _np(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


# ---------------------------------------------------------------------------------------------
# LoRA


def _lora_case(rng, dtype, *, width=128, fin=256, fout=384, ranks=(1, 8, 0, 16, 64, 128), lens=(3, 17, 0, 1, 20, 5),
               base=7, max_rank=128):
    """A pool of garbage rows with each slot's A^T and B rows scattered through it. Each rank row is
    ceil(features / width) whole rows; where features is not a multiple of width, the columns of
    its last row past features hold garbage too (the wrappers' zero columns of x must meet them)."""
    ranks = np.asarray(ranks, np.int32)
    seg = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t = int(seg[-1]) + base
    ca, cb = -(-fin // width), -(-fout // width)
    need = int(sum(r * (ca + cb) for r in ranks))
    n = 2 * need + 64
    pool = rng.uniform(-GARBAGE, GARBAGE, size=(n, width)).astype(np.float32)
    free = rng.permutation(np.arange(1, n))
    a_rows = rng.integers(1, n, size=(len(ranks), max_rank * ca)).astype(np.int32)  # past rank: garbage
    b_rows = rng.integers(1, n, size=(len(ranks), max_rank * cb)).astype(np.int32)
    used = 0
    for s, r in enumerate(ranks):
        na, nb = r * ca, r * cb
        a_rows[s, :na], b_rows[s, :nb] = free[used:used + na], free[used + na:used + na + nb]
        used += na + nb
        for rows, c, f in ((a_rows[s, :na], ca, fin), (b_rows[s, :nb], cb, fout)):
            mat = pool[rows].reshape(r, c * width)  # garbage, then each rank row's features
            mat[:, :f] = rng.normal(size=(r, f)) * 0.1
            pool[rows] = mat.reshape(-1, width)
    x = jnp.asarray(rng.normal(size=(t, fin)), dtype)
    y = jnp.asarray(rng.normal(size=(t, fout)), dtype)
    return x, y, jnp.asarray(pool, dtype), a_rows, b_rows, ranks, seg


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lora_mixed_ranks_interpret(dtype):
    rng = np.random.default_rng(0)
    x, y, rows, a_rows, b_rows, ranks, seg = _lora_case(rng, dtype)
    blocks = LoraBlocks(block_t=16)
    xa = lora_shrink(x, rows, a_rows, ranks, seg, max_rank=128, blocks=blocks, interpret=True)
    xa_ref = lora_shrink_reference(x, rows, a_rows, ranks, seg, max_rank=128)
    np.testing.assert_allclose(_np(xa), _np(xa_ref), **TOL[dtype])
    assert not np.any(_np(xa)[seg[-1]:]), "base-model tokens get no delta"
    assert not np.any(_np(xa)[seg[1]:seg[2], 8:]), "nothing past the slot's rank"
    xa = xa_ref.astype(dtype)
    out = lora_expand(y, xa, rows, b_rows, ranks, seg, max_rank=128, blocks=blocks, interpret=True)
    ref = lora_expand_reference(y, xa, rows, b_rows, ranks, seg, max_rank=128)
    assert out.dtype == y.dtype
    np.testing.assert_allclose(_np(out), _np(ref), **TOL[dtype])
    np.testing.assert_array_equal(_np(out)[seg[-1]:], _np(y)[seg[-1]:])
    assert np.abs(_np(out) - _np(y))[:seg[-1]].max() > 0.1, "the delta is really added"


def test_lora_reference_is_the_one_hot_form():
    """The reference computes what the engine's jnp path does: every token against every slot's
    matrix, one-hot by slot and masked past the rank, [T, Sa, R] summed over slots."""
    rng = np.random.default_rng(1)
    x, y, rows, a_rows, b_rows, ranks, seg = _lora_case(rng, jnp.float32)
    sa, r = len(ranks), 128
    a = rows[a_rows].reshape(sa, -1)[:, :r * x.shape[1]].reshape(sa, r, x.shape[1])
    slot = np.full(x.shape[0], -1)
    for s in range(sa):
        slot[seg[s]:seg[s + 1]] = s
    sel = slot[:, None] == np.arange(sa)[None, :]
    live = np.arange(r)[None, :] < ranks[:, None]
    xa = jnp.einsum("ti,sri->tsr", x, a, precision="highest")
    xa = jnp.where(sel[:, :, None] & live[None], xa, 0.0)
    np.testing.assert_allclose(_np(lora_shrink_reference(x, rows, a_rows, ranks, seg, max_rank=r)),
                               _np(xa.sum(1)), rtol=1e-4, atol=1e-3)
    b = rows[b_rows].reshape(sa, -1)[:, :r * y.shape[1]].reshape(sa, r, y.shape[1])
    delta = jnp.einsum("tsr,sro->to", xa, b, precision="highest")
    np.testing.assert_allclose(_np(lora_expand_reference(y, xa.sum(1), rows, b_rows, ranks, seg, max_rank=r)),
                               _np(y + delta), rtol=1e-4, atol=1e-2)


def test_segment_plan_visits_every_block_once_in_order():
    seg = np.array([0, 3, 40, 40, 41, 64], np.int32)  # an empty segment, segments across blocks
    ib, islot, bounds = map(np.asarray, segment_plan(seg, 80, 16))
    assert len(ib) == 80 // 16 + 5
    assert np.all(np.diff(ib) >= 0) and set(ib) == set(range(5))
    pairs = {(b, s) for b, s in zip(ib, islot)}
    want = {(b, s) for s in range(6) for b in range(5) if max(bounds[s], 16 * b) < min(bounds[s + 1], 16 * b + 16)}
    assert want <= pairs and pairs - want <= {(4, 5)}  # the rest: padding items of the base segment


def test_lora_odd_tokens_large_block_no_races():
    """One block of 128 tokens with 37 in use, a wider row (two chunks each way), race detection on."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
    rng = np.random.default_rng(2)
    x, y, rows, a_rows, b_rows, ranks, seg = _lora_case(rng, jnp.float32, width=256, fin=512, fout=512,
                                                        ranks=(64, 8, 1), lens=(11, 0, 19), base=7, max_rank=64)
    params = pltpu.InterpretParams(detect_races=True)
    xa = lora_shrink(x, rows, a_rows, ranks, seg, max_rank=64, interpret=params)
    assert not tpu_interpret.races.races_found
    out = lora_expand(y, xa, rows, b_rows, ranks, seg, max_rank=64, interpret=params)
    assert not tpu_interpret.races.races_found
    ref = lora_expand_reference(y, lora_shrink_reference(x, rows, a_rows, ranks, seg, max_rank=64), rows, b_rows,
                                ranks, seg, max_rank=64)
    np.testing.assert_allclose(_np(out), _np(ref), rtol=1e-4, atol=1e-3)


def test_race_detector_sees_a_read_before_the_copy_lands():
    """The no-races assertions have teeth: reading a DMA's destination before its wait is a race."""
    from jax.experimental import pallas as pl
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

    def early_read(src_hbm, out_ref, buf, sem):
        copy = pltpu.make_async_copy(src_hbm, buf, sem.at[0])
        copy.start()
        out_ref[...] = buf[...]
        copy.wait()

    call = pl.pallas_call(early_read, in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                          out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                          scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA((1,))],
                          interpret=pltpu.InterpretParams(detect_races=True))
    jax.block_until_ready(call(jnp.ones((8, 128), jnp.float32)))
    assert tpu_interpret.races.races_found


def test_lora_bad_row_index_is_an_error():
    rng = np.random.default_rng(3)
    x, y, rows, a_rows, b_rows, ranks, seg = _lora_case(rng, jnp.float32)
    a_rows = a_rows.copy()
    a_rows[1, 3] = rows.shape[0] + 5  # slot 1 has rank 8: its row 3 is read
    with pytest.raises(Exception, match="Out-of-bounds"):
        jax.block_until_ready(lora_shrink(x, rows, a_rows, ranks, seg, max_rank=128, blocks=LoraBlocks(16),
                                          interpret=True))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lora_features_not_whole_rows_interpret(dtype):
    """fin 200 and fout 300 over 128-wide rows (as llama-7b's 11008 over 4096): each rank row is
    2 and 3 whole rows, padded with garbage past the features; x and y are padded with zero columns
    inside the wrappers, and the output keeps y's 300 columns."""
    rng = np.random.default_rng(10)
    x, y, rows, a_rows, b_rows, ranks, seg = _lora_case(rng, dtype, fin=200, fout=300, ranks=(8, 0, 16, 1),
                                                        lens=(5, 2, 20, 1), base=3, max_rank=16)
    blocks = LoraBlocks(block_t=16)
    xa = lora_shrink(x, rows, a_rows, ranks, seg, max_rank=16, blocks=blocks, interpret=True)
    xa_ref = lora_shrink_reference(x, rows, a_rows, ranks, seg, max_rank=16)
    np.testing.assert_allclose(_np(xa), _np(xa_ref), **TOL[dtype])
    xa = xa_ref.astype(dtype)
    out = lora_expand(y, xa, rows, b_rows, ranks, seg, max_rank=16, blocks=blocks, interpret=True)
    assert out.shape == y.shape
    np.testing.assert_allclose(_np(out), _np(lora_expand_reference(y, xa, rows, b_rows, ranks, seg, max_rank=16)),
                               **TOL[dtype])
    # the reference reads the same matrices as a dense A^T [r, 200] per slot
    a = _np(rows)[a_rows[2, :32]].reshape(16, 256)[:, :200]
    np.testing.assert_allclose(_np(xa_ref)[seg[2]:seg[3]], _np(x)[seg[2]:seg[3]] @ a.T, **TOL[dtype])


# ---------------------------------------------------------------------------------------------
# Paged attention


def _attention_case(rng, dtype, *, heads, kv_heads, ctx, page_size=16, d=128, spare_pages=9):
    """Pages scattered among garbage pages; page-table entries past a sequence's context point at
    garbage pages too."""
    ctx = np.asarray(ctx, np.int32)
    need = [-(-int(c) // page_size) for c in ctx]
    p = max(max(need), 1) + 2
    n = sum(need) + spare_pages
    pool = rng.uniform(-GARBAGE, GARBAGE, size=(n, 2, page_size, kv_heads * d)).astype(np.float32)
    pages = rng.permutation(np.arange(1, n))
    table = rng.integers(1, n, size=(len(ctx), p)).astype(np.int32)
    used = 0
    for s, k in enumerate(need):
        table[s, :k] = pages[used:used + k]
        used += k
        pool[table[s, :k]] = rng.normal(size=(k, 2, page_size, kv_heads * d))
    return jnp.asarray(pool, dtype), table, ctx


@pytest.mark.parametrize("dtype,heads,kv_heads,pages_per_block", [(jnp.float32, 4, 2, 3), (jnp.bfloat16, 4, 2, 8),
                                                                   (jnp.float32, 2, 2, 1)])
def test_decode_attention_interpret(dtype, heads, kv_heads, pages_per_block):
    rng = np.random.default_rng(4)
    pool, table, ctx = _attention_case(rng, dtype, heads=heads, kv_heads=kv_heads, ctx=[0, 17, 70, 16, 1])
    s = len(ctx)
    q = jnp.asarray(rng.normal(size=(s, heads, 128)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(s, kv_heads, 128)), dtype) for _ in range(2))
    assert table.shape[1] == 7  # 3 pages a block: a short last block
    out = paged_decode_attention(q, k, v, pool, table, ctx, blocks=DecodeBlocks(pages_per_block), interpret=True)
    ref = paged_decode_attention_reference(q, k, v, pool, table, ctx)
    np.testing.assert_allclose(_np(out), _np(ref), **TOL[dtype])
    np.testing.assert_allclose(_np(out)[0], _np(jnp.repeat(v[0], heads // kv_heads, 0)), **TOL[dtype])  # ctx 0


@pytest.mark.parametrize("dtype,blocks", [(jnp.float32, PrefillBlocks(16, 16)), (jnp.bfloat16, PrefillBlocks(32, 16))])
def test_prefill_attention_interpret(dtype, blocks):
    rng = np.random.default_rng(5)
    pool, table, ctx = _attention_case(rng, dtype, heads=4, kv_heads=2, ctx=[0, 21, 33, 5])
    seq_starts = np.array([0, 19, 19, 24, 40], np.int32)  # sequence 1 empty this step; 3 padding tokens
    t = 43
    q = jnp.asarray(rng.normal(size=(t, 4, 128)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(t, 2, 128)), dtype) for _ in range(2))
    out = paged_prefill_attention(q, k, v, pool, table, ctx, seq_starts, blocks=blocks, interpret=True)
    ref = paged_prefill_attention_reference(q, k, v, pool, table, ctx, seq_starts)
    np.testing.assert_allclose(_np(out), _np(ref), **TOL[dtype])
    assert not np.any(_np(out)[40:])


def test_decode_attention_no_races():
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
    rng = np.random.default_rng(6)
    pool, table, ctx = _attention_case(rng, jnp.float32, heads=2, kv_heads=1, ctx=[40, 3])
    q = jnp.asarray(rng.normal(size=(2, 2, 128)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 1, 128)), jnp.float32) for _ in range(2))
    out = paged_decode_attention(q, k, v, pool, table, ctx, blocks=DecodeBlocks(2),
                                 interpret=pltpu.InterpretParams(detect_races=True))
    assert not tpu_interpret.races.races_found
    np.testing.assert_allclose(_np(out), _np(paged_decode_attention_reference(q, k, v, pool, table, ctx)),
                               rtol=1e-4, atol=1e-4)


def test_decode_attention_bad_page_is_an_error():
    rng = np.random.default_rng(7)
    pool, table, ctx = _attention_case(rng, jnp.float32, heads=2, kv_heads=1, ctx=[40])
    table = table.copy()
    table[0, 1] = pool.shape[0] + 3
    q = jnp.asarray(rng.normal(size=(1, 2, 128)), jnp.float32)
    k = v = jnp.zeros((1, 1, 128), jnp.float32)
    with pytest.raises(Exception, match="(?i)out-of-bounds|out of bounds"):
        jax.block_until_ready(paged_decode_attention(q, k, v, pool, table, ctx, interpret=True))


# ---------------------------------------------------------------------------------------------
# Cross-lowering for TPU at real model shapes


def _model_shape(name: str) -> dict:
    root = Path(__file__).resolve().parent.parent / "configs" / "models"
    cfg = tomllib.loads((root / "base.toml").read_text())
    cfg.update(tomllib.loads((root / f"{name}.toml").read_text()))
    d = cfg["hidden_size"] // cfg["num_attention_heads"]
    return dict(hidden=cfg["hidden_size"], inter=cfg["intermediate_size"], heads=cfg["num_attention_heads"],
                kv_heads=cfg["num_key_value_heads"], head_dim=d, width=cfg["num_key_value_heads"] * d)


def _modules(m: dict) -> dict:
    kv = m["width"]
    return dict(q=(m["hidden"], m["hidden"]), k=(m["hidden"], kv), v=(m["hidden"], kv), o=(m["hidden"], m["hidden"]),
                gate=(m["hidden"], m["inter"]), up=(m["hidden"], m["inter"]), down=(m["inter"], m["hidden"]))


def _on_tpu(kind: str):
    return use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind=kind, num_cores=1, platform="tpu")))


def _lower(f, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("kind", TPU_KINDS)
@pytest.mark.parametrize("model", ["llama-7b", "llama-3-8b"])
def test_lora_lowers_for_tpu(kind, model):
    m = _model_shape(model)
    w, bf, i32 = m["width"], jnp.bfloat16, jnp.int32
    t, sa, r, pages = 256, 150, 64, 20000
    lowered = []
    with _on_tpu(kind):
        for module, (fin, fout) in _modules(m).items():  # llama-7b's MLP: 11008 is 2.69 rows of 4096
            rows, ca, cb = S((pages, w), bf), -(-fin // w), -(-fout // w)
            text = _lower(functools.partial(lora_shrink, max_rank=r), S((t, fin), bf), rows,
                          S((sa, r * ca), i32), S((sa,), i32), S((sa + 1,), i32))
            text += _lower(functools.partial(lora_expand, max_rank=r), S((t, fout), bf), S((t, r), bf), rows,
                           S((sa, r * cb), i32), S((sa,), i32), S((sa + 1,), i32))
            assert text.count("tpu_custom_call") >= 2
            lowered.append(module)
    assert len(lowered) == 7


def test_lowering_catches_tile_errors():
    """Cross-lowering has teeth: a 12-token block is not a whole (8, 128) tile."""
    with _on_tpu(TPU_KINDS[0]), pytest.raises(ValueError, match="divisible by 8 and 128"):
        _lower(functools.partial(lora_shrink, max_rank=16, blocks=LoraBlocks(12)), S((24, 256), jnp.bfloat16),
               S((64, 128), jnp.bfloat16), S((2, 32), jnp.int32), S((2,), jnp.int32), S((3,), jnp.int32))


@pytest.mark.parametrize("kind", TPU_KINDS)
@pytest.mark.parametrize("model,page_size", [("llama-7b", 16), ("llama-3-8b", 16), ("llama-3-8b", 1)])
def test_attention_lowers_for_tpu(kind, model, page_size):
    m = _model_shape(model)
    bf, i32 = jnp.bfloat16, jnp.int32
    h, kvh, d = m["heads"], m["kv_heads"], m["head_dim"]
    seqs, p, t = 64, 2048 // page_size, 512
    pool = S((8192, 2, page_size, kvh * d), bf)
    with _on_tpu(kind):
        text = _lower(paged_decode_attention, S((seqs, h, d), bf), S((seqs, kvh, d), bf), S((seqs, kvh, d), bf),
                      pool, S((seqs, p), i32), S((seqs,), i32))
        text += _lower(paged_prefill_attention, S((t, h, d), bf), S((t, kvh, d), bf), S((t, kvh, d), bf), pool,
                       S((seqs, p), i32), S((seqs,), i32), S((seqs + 1,), i32))
    assert text.count("tpu_custom_call") >= 2


@pytest.mark.parametrize("kind", TPU_KINDS)
def test_decode_layer_lowers_for_tpu(kind):
    """One llama-3-8b decode layer's kernels in one jit: q, k, v, o LoRA (shrink and expand) and
    paged decode attention, as the engine's step will compose them."""
    m = _model_shape("llama-3-8b")
    bf, i32 = jnp.bfloat16, jnp.int32
    h, kvh, d, w, hid = m["heads"], m["kv_heads"], m["head_dim"], m["width"], m["hidden"]
    seqs, sa, r, p, ps = 172, 156, 64, 128, 16
    a_rows = {mod: S((sa, r * hid // w), i32) for mod in "qkvo"}
    b_rows = {mod: S((sa, r * (hid if mod in "qo" else w) // w), i32) for mod in "qkvo"}

    def layer(x, pool_layer, a_rows, b_rows, ranks, seg_starts, page_table, ctx_lens):
        rows = pool_layer.reshape(-1, w)
        lora = functools.partial(lora_shrink, rows=rows, ranks=ranks, seg_starts=seg_starts, max_rank=r,
                                 blocks=LoraBlocks(16))
        out = {}
        for mod, fout in (("q", hid), ("k", w), ("v", w)):
            xa = lora(x, a_rows=a_rows[mod]).astype(bf)
            out[mod] = lora_expand(jnp.zeros((seqs, fout), bf), xa, rows, b_rows[mod], ranks, seg_starts,
                                   max_rank=r, blocks=LoraBlocks(16))
        o = paged_decode_attention(out["q"].reshape(seqs, h, d), out["k"].reshape(seqs, kvh, d),
                                   out["v"].reshape(seqs, kvh, d), pool_layer, page_table, ctx_lens)
        o = o.reshape(seqs, hid)
        xa = lora(o, a_rows=a_rows["o"]).astype(bf)
        return lora_expand(o, xa, rows, b_rows["o"], ranks, seg_starts, max_rank=r, blocks=LoraBlocks(16))

    with _on_tpu(kind):
        text = _lower(layer, S((seqs, hid), bf), S((20000, 2, ps, w), bf), a_rows, b_rows, S((sa,), i32),
                      S((sa + 1,), i32), S((seqs, p), i32), S((seqs,), i32))
    assert text.count("tpu_custom_call") >= 4  # one per distinct kernel and shape; nine calls


def test_prefill_attention_no_races():
    """Packed prefill with race detection on: three sequences, one with context across pages."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
    rng = np.random.default_rng(8)
    pool, table, ctx = _attention_case(rng, jnp.float32, heads=2, kv_heads=1, ctx=[0, 18, 3])
    seq_starts = np.array([0, 9, 21, 29], np.int32)
    t = 31  # odd, two padding tokens
    q = jnp.asarray(rng.normal(size=(t, 2, 128)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(t, 1, 128)), jnp.float32) for _ in range(2))
    out = paged_prefill_attention(q, k, v, pool, table, ctx, seq_starts, blocks=PrefillBlocks(16, 16),
                                  interpret=pltpu.InterpretParams(detect_races=True))
    assert not tpu_interpret.races.races_found
    ref = paged_prefill_attention_reference(q, k, v, pool, table, ctx, seq_starts)
    np.testing.assert_allclose(_np(out), _np(ref), rtol=1e-4, atol=1e-4)


def _engine_prefill(rng, *, chunks, page_size=16, heads=4, kv_heads=2, d=128, rows=8):
    """A packed prefill step as StepInputBuilder.prefill lays it out: chunks (ctx, n) in row order,
    tokens grouped by sequence, padding last (token_seq -1), and, when any chunk has context, the
    context pages of those sequences in turn, with padding (ctx_pages). Pages hold garbage past
    each context, and the pool holds garbage pages."""
    from slora_jax.engine.step import StepInputs
    pool, table, ctx = _attention_case(rng, jnp.float32, heads=heads, kv_heads=kv_heads, d=d,
                                       ctx=[c for c, _ in chunks], page_size=page_size)
    total = sum(n for _, n in chunks)
    t = max(16, 1 << (total - 1).bit_length())
    token_seq = np.full(t, -1, np.int32)
    positions = np.zeros(t, np.int32)
    at = 0
    for i, (c, n) in enumerate(chunks):
        token_seq[at:at + n], positions[at:at + n] = i, c + np.arange(n)
        at += n
    pages, seq, fill = [], [], []
    for i, (c, _) in enumerate(chunks):
        m = -(-c // page_size)
        pages += list(table[i, :m])
        seq += [i] * m
        fill += [page_size] * (m - 1) + [c - (m - 1) * page_size] * (m > 0)
    context = bool(pages)
    flat = {}
    if context:  # padded past the next power of two, so padding pages are always there
        k = 1 << len(pages).bit_length()
        pad = k - len(pages)
        flat = dict(ctx_pages=np.array(pages + [0] * pad, np.int32), ctx_page_seq=np.array(seq + [-1] * pad, np.int32),
                    ctx_page_fill=np.array(fill + [0] * pad, np.int32))
    z, zf = np.zeros(rows, np.int32), np.zeros(rows, np.float32)
    inp = StepInputs(tokens=np.zeros(t, np.int32), positions=positions, kv_slot=np.zeros(t, np.int32),
                     token_seq=token_seq, page_table=np.zeros((rows, 1), np.int32), ctx_lens=z, sample_idx=z,
                     temperature=zf, top_k=z, top_p=zf, seeds=z.astype(np.uint32), steps=z, lora=None, decode=False,
                     attention_backend="pallas_tpu", prefill_context=context, **flat)
    q = jnp.asarray(rng.normal(size=(t, heads, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(t, kv_heads, d)), jnp.float32) for _ in range(2))
    return q, k, v, pool, inp, total


@pytest.mark.parametrize("chunks", [[(0, 5), (21, 7), (0, 1), (33, 19)], [(0, 9), (0, 4), (0, 3)]],
                         ids=["context", "fresh"])
def test_prefill_kernel_through_the_step_tables(chunks):
    """The engine's packed prefill step (context pages, padding tokens, fresh prompts beside later
    chunks) through prefill_tables and the TPU kernel equals the step's xla attention."""
    from slora_jax.engine.attention import paged_attention_xla, tpu_prefill_blocks, prefill_tables
    rng = np.random.default_rng(9)
    q, k, v, pool, inp, total = _engine_prefill(rng, chunks=chunks)
    table, ctx, seq_starts = prefill_tables(inp)
    assert int(seq_starts[-1]) == total
    out = paged_prefill_attention(q, k, v, pool, table, ctx, seq_starts, blocks=tpu_prefill_blocks(q.shape[0]),
                                  interpret=True)
    ref = paged_attention_xla(q, k, v, pool, inp)
    np.testing.assert_allclose(_np(out)[:total], _np(ref)[:total], rtol=1e-4, atol=1e-4)
