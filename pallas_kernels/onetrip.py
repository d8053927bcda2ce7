"""A decode step's LoRA pair in programs of one memory trip each (S-LoRA's MBGMV, issue 4).

Why. In a decode step each adapter holds a token or two, so a LoRA program moves a few KB and its
time is its chain of dependent memory trips, not its bytes. lora.py's pair reads a schedule entry,
then the slot's rank and row indices, then the rows, and walks rank tiles or column chunks in a
loop: three or more trips before its first row arrives. Here the host builds, with the step's other
inputs, one table entry per unit of work that holds everything a program needs before its gather:
its token range, its count of live rows, its output column and the pool rows themselves
(`shrink_plan`, `expand_plan`; the row indices are the step's, the same in every layer, so one
table serves all layers). A program reads its entry and the live total (trip one), then all its
weight rows, x or xa, and y together (trip two), computes and stores.

Shrink (`onetrip_shrink`): a unit is (token block of block_t tokens, rank tile of rank_tile A^T
rows, split of k_tile `in` columns); xa[tokens, tile] += x[tokens, split] @ A^T[tile, split]^T. The
splits meet in a zeroed float32 xa by atomic adds (split-K gives a decode step enough programs of
one tile each); with one split (k_tile = in: the "wide" shrink) they are plain stores into an xa
nobody zeroed. Modules that read the same x (q, k, v) are one launch: a unit's xa column says
whose. Programs walk units p, p + P, ... below the live total (P <= max_programs), so a unit bound
that the ranks leave half empty costs no programs; `pipeline` runs a program's units in three
stages.

Expand (`onetrip_expand`): a unit is (token block, col_tile output columns); every rank tile of the
slot's B rows is gathered in the same trip (rows past the rank masked off: no traffic), and each
live tile's product is added under a branch (`tile_branches`), so compute on padding stays within
one rank tile whatever the batch's max rank. y += xa @ B in y's dtype, in place.

Forms (`form`): "gemv", S-LoRA's MBGMV, a token at a time with products by multiply and sum (the
default), or "dot", Triton dots of block_t >= 16 token rows. Compiled for sm_90, the dot form's
second operand is loaded only after the first went through shared memory behind a barrier, two
dependent trips; the gemv form issues all of a unit's loads first (bench/kernel_sass.py).

One launch (`onetrip_apply`): the shrink's programs first, then the expand's, which gather their B
and y tiles, wait on their block's counter, then read xa (see `_one_launch_kernel`).

Where: every A^T row (shrink) and every B row (expand) is a whole number of pool rows, i.e. the pool
width W divides `in` (`out`): q, k, v and o of Llama-family models at any GQA ratio. Other widths
(llama-7b's MLP, 11008) keep lora.py's pair (`applies`). References: lora.py's
lora_shrink_reference / lora_expand_reference on the same slots (tests/test_onetrip.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.lora import BLOCKS, _interpret

# The settings live in BLOCKS["onetrip"] (lora.py, where each is described; overridable by
# set_blocks / SLORA_LORA_BLOCKS), read when a kernel is traced.


def applies(width: int, features: int) -> bool:
    """Whether a matrix of `features` columns (A^T: in; B: out) is whole pool rows of width W."""
    return features % width == 0 and width % 16 == 0


def _settings() -> dict:
    return BLOCKS["onetrip"]


def _frozen() -> tuple:
    """The settings as a jit static argument: a change of BLOCKS["onetrip"] retraces the kernels."""
    _check(_settings())
    return tuple(sorted(_settings().items()))


def _tile(width: int, cap: int) -> int:
    """The largest power of two dividing W, at most cap: a tile never straddles two pool rows."""
    return min(width & -width, cap)


def _bound_blocks(t: int, slots: int, block_t: int) -> int:
    """The most token blocks `slots` segments of t tokens in all can need: sum ceil(len / block_t)."""
    return max(1, (t + slots * (block_t - 1)) // block_t)


def _token_blocks(seg_starts: np.ndarray, live: np.ndarray, block_t: int):
    """(slot, first token, segment end) of every block_t-token block of the live slots' segments."""
    lens = np.maximum(np.diff(seg_starts), 0)
    nblk = np.where(live, -(-lens // block_t), 0)
    slot = np.repeat(np.arange(len(lens)), nblk)
    local = np.arange(len(slot)) - np.repeat(np.cumsum(nblk) - nblk, nblk)
    return slot, seg_starts[slot] + local * block_t, seg_starts[slot + 1]


def shrink_plan(ranks, a_rows, seg_starts, t: int, *, fin: int, width: int, max_rank: int, settings=None):
    """The grouped shrink's table, on the host (numpy): (total [1], meta [U, 5], rid [U, m, RT])
    int32 for G modules reading one x. ranks [G, Sa] (0: no A for the module), a_rows [G, Sa, RA]
    the step's A^T row indices (lora.py's layout), seg_starts [Sa + 1]. Item i (a token block and
    a rank tile of one module's slot) has meta (first token, segment end, live rows, xa column,
    block: g * NB + the block's place in module g's expand_plan) and rid[i, c] its rank rows' pool rows for the c-th W columns of `in`; total = items * splits
    (the units). U bounds the items of any step of this shape."""
    s = settings or _settings()
    bt, rt = s["block_t"], s["rank_tile"]
    ranks = np.minimum(np.asarray(ranks, np.int32).reshape(-1, np.shape(ranks)[-1]), max_rank)
    a_rows = np.asarray(a_rows, np.int32).reshape(ranks.shape[0], ranks.shape[1], -1)
    seg_starts = np.asarray(seg_starts, np.int32)
    g_count, slots = ranks.shape
    m = fin // width
    tiles = -(-max_rank // rt)
    nb = _bound_blocks(t, slots, bt)
    bound = g_count * nb * tiles
    metas, rids = [], []
    for g in range(g_count):
        slot, tok0, tok1 = _token_blocks(seg_starts, ranks[g] > 0, bt)
        ntile = -(-ranks[g, slot] // rt)
        item_slot = np.repeat(slot, ntile)
        k = np.arange(len(item_slot)) - np.repeat(np.cumsum(ntile) - ntile, ntile)
        live = np.minimum(ranks[g, item_slot] - k * rt, rt)
        blk = g * nb + np.repeat(np.arange(len(slot)), ntile)   # the item's block in expand_plan's order
        metas.append(np.stack([np.repeat(tok0, ntile), np.repeat(tok1, ntile), live,
                               g * tiles * rt + k * rt, blk], axis=1))
        j = k[:, None] * rt + np.arange(rt)[None, :]                       # rank rows [items, RT]
        col = (j[:, None, :] * m + np.arange(m)[None, :, None])            # A^T row j's c-th pool row
        rid = a_rows[g, item_slot[:, None, None], np.minimum(col, a_rows.shape[-1] - 1)]
        rids.append(np.where((j < ranks[g, item_slot][:, None])[:, None, :], rid, 0))
    meta = np.concatenate(metas) if metas else np.zeros((0, 5), np.int32)
    rid = np.concatenate(rids) if rids else np.zeros((0, m, rt), np.int32)
    n = len(meta)
    assert n <= bound, (n, bound)
    meta_out = np.zeros((bound, 5), np.int32)
    rid_out = np.zeros((bound, m, rt), np.int32)
    meta_out[:n], rid_out[:n] = meta, rid
    splits = _splits(fin, width, s)
    return np.array([n * splits], np.int32), meta_out, rid_out


def expand_plan(ranks, b_rows, seg_starts, t: int, *, fout: int, width: int, max_rank: int, settings=None):
    """One module's expand table, on the host (numpy): (total [1], meta [NB, 4], rid [NB, m, Rw])
    int32. Block b (block_t tokens of one slot) has meta (first token, segment end, rank, 0) and
    rid[b, c] the slot's B rows' pool rows for the c-th W columns of `out` (rows past the rank: 0);
    total = the live blocks. Rw = max_rank in whole rank tiles."""
    s = settings or _settings()
    bt, rt = s["block_t"], s["rank_tile"]
    ranks = np.minimum(np.asarray(ranks, np.int32), max_rank)
    b_rows = np.asarray(b_rows, np.int32)
    seg_starts = np.asarray(seg_starts, np.int32)
    m = fout // width
    rw = -(-max_rank // rt) * rt
    bound = _bound_blocks(t, len(ranks), bt)
    slot, tok0, tok1 = _token_blocks(seg_starts, ranks > 0, bt)
    n = len(slot)
    j = np.arange(rw)
    col = np.minimum(j[None, :] * m + np.arange(m)[:, None], b_rows.shape[-1] - 1)   # [m, Rw]
    rid = np.where(j[None, None, :] < ranks[slot][:, None, None], b_rows[slot][:, col], 0)
    meta_out = np.zeros((bound, 4), np.int32)
    rid_out = np.zeros((bound, m, rw), np.int32)
    meta_out[:n] = np.stack([tok0, tok1, ranks[slot], np.zeros_like(slot)], axis=1)
    rid_out[:n] = rid
    return np.array([n], np.int32), meta_out, rid_out


def _check(s: dict) -> None:
    if s["form"] not in ("gemv", "dot"):
        raise ValueError(f'BLOCKS["onetrip"]["form"] must be "gemv" or "dot", got {s["form"]!r}')
    bt = s["block_t"]
    if bt < 1 or (s["form"] == "dot" and (bt < 16 or bt & (bt - 1))):
        raise ValueError(f'BLOCKS["onetrip"]["block_t"] {bt}: the dot form needs a power of two >= 16 '
                         "(Triton's dot sides), the gemv form any count >= 1")


def _splits(fin: int, width: int, s: dict) -> int:
    return fin // _tile(width, s["k_tile"])


def _shrink_options(s: dict, x, rows, interpret: bool, atomic: bool | None = None) -> dict:
    """_shrink_units' static options for x [T, in] over pool rows [N, W] (atomic None: where there
    are splits to meet)."""
    fin, width = x.shape[1], rows.shape[1]
    assert applies(width, fin), (width, fin)
    splits = _splits(fin, width, s)
    return dict(splits=splits, block_t=s["block_t"], rank_tile=s["rank_tile"], k_tile=_tile(width, s["k_tile"]),
                width=width, dtype=jnp.promote_types(x.dtype, rows.dtype),
                atomic=splits > 1 if atomic is None else atomic, interpret=interpret, pipeline=s["pipeline"],
                gemv=s["form"] == "gemv")


def _expand_options(s: dict, rows, fout: int, xa_col: int) -> dict:
    """_expand_unit's static options for an output of fout columns over pool rows [N, W]."""
    width = rows.shape[1]
    assert applies(width, fout), (width, fout)
    return dict(block_t=s["block_t"], rank_tile=s["rank_tile"], col_tile=_tile(width, s["col_tile"]), width=width,
                xa_col=xa_col, dtype=rows.dtype, branches=s["tile_branches"], gemv=s["form"] == "gemv")


def _shrink_programs(s: dict, meta, splits: int) -> int:
    """Programs of a shrink over a table of meta.shape[0] items: its unit bound, at most max_programs."""
    return max(1, min(meta.shape[0] * splits, s["max_programs"]))


def _params(interpret: bool, warps: int, stages: int):
    return None if interpret else plgpu.CompilerParams(num_warps=warps, num_stages=stages)


def _shrink_units(p, n_programs, total, meta_ref, rid_ref, x_ref, rows_ref, xa_ref, *, splits, block_t, rank_tile,
                  k_tile, width, dtype, atomic, interpret, pipeline=True, gemv=False, done=None):
    """Program p's shrink units p, p + n_programs, ... below total; with `pipeline` in three
    stages: a unit's entry is read two units ahead and its rows gathered one ahead of its product,
    so a program with several units (large decode steps) waits on about one trip a unit. An entry past
    the total is read as dead (no live rows or tokens): its gather is fully masked, no traffic.
    done(block): called after each unit's sums are in xa, with the unit's token block."""
    total_bound = meta_ref.shape[0] * splits

    def read(w):  # unit w's entry: item w // splits, split w % splits
        valid = w < total
        w = jnp.minimum(w, total_bound - 1)
        i, q = jax.lax.div(w, splits), jax.lax.rem(w, splits)
        c0 = q * k_tile
        tok0 = meta_ref[i, 0]
        return (tok0, jnp.where(valid, meta_ref[i, 1], tok0), jnp.where(valid, meta_ref[i, 2], 0), meta_ref[i, 3],
                meta_ref[i, 4], c0, rid_ref[i, jax.lax.div(c0, width)])

    def gather(ent):
        tok0, tok1, live, _, _, c0, rid = ent
        row_live = jnp.arange(rank_tile) < live
        cols = pl.multiple_of(jax.lax.rem(c0, width), k_tile) + jnp.arange(k_tile)
        at = plgpu.load(rows_ref.at[rid[:, None], cols[None, :]], mask=row_live[:, None], other=0)
        if gemv:  # a row of x per token (no dot: no layout conversion between the loads)
            return at, [plgpu.load(x_ref.at[tok0 + t, pl.ds(c0, k_tile)],
                                   mask=jnp.broadcast_to(tok0 + t < tok1, (k_tile,)), other=0)
                        for t in range(block_t)]
        tok_live = tok0 + jnp.arange(block_t) < tok1  # the dot form only: Triton's ranges are powers of two
        xt = plgpu.load(x_ref.at[pl.ds(tok0, block_t), pl.ds(c0, k_tile)], mask=tok_live[:, None], other=0)
        return at, xt

    def add_into(tile, acc, mask):
        if atomic:
            # interpret mode's atomic add takes no mask: dead entries add zero, xa has block_t spare rows
            plgpu.atomic_add(xa_ref, tile, jnp.where(mask, acc, 0.0), mask=None if interpret else mask)
        else:
            plgpu.store(xa_ref.at[tile], acc, mask=mask)

    def finish(ent, tiles):
        tok0, tok1, live, col, blk, _, _ = ent
        at, xt = tiles
        row_live = jnp.arange(rank_tile) < live
        if gemv:  # S-LoRA's MBGMV: for each token, a multiply and a sum over the split's columns
            a32 = at.astype(jnp.float32)
            for t, x_t in enumerate(xt):
                acc = jnp.sum(a32 * x_t.astype(dtype).astype(jnp.float32)[None, :], axis=1)
                add_into((tok0 + t, pl.ds(col, rank_tile)), acc, row_live & (tok0 + t < tok1))
        else:
            acc = jax.lax.dot_general(xt.astype(dtype), at.astype(dtype), (((1,), (1,)), ((), ())),
                                      preferred_element_type=jnp.float32)
            mask = (tok0 + jnp.arange(block_t) < tok1)[:, None] & row_live[None, :]
            add_into((pl.ds(tok0, block_t), pl.ds(col, rank_tile)), acc, mask)
        if done is not None:
            done(blk)

    trips = jax.lax.div(jnp.maximum(total - p + n_programs - 1, 0), n_programs)

    if not pipeline:  # entries one unit ahead only: half the tiles' registers
        def step1(k, ent):
            nxt = read(p + (k + 1) * n_programs)
            finish(ent, gather(ent))
            return nxt
        jax.lax.fori_loop(0, trips, step1, read(p))
        return

    def step(k, carry):
        ent, tiles, nxt = carry
        tiles_next = gather(nxt)                               # unit k + 1's rows
        ahead = read(p + (k + 2) * n_programs)                 # unit k + 2's entry
        finish(ent, tiles)                                     # unit k's product
        return nxt, tiles_next, ahead
    first = read(p)
    jax.lax.fori_loop(0, trips, step, (first, gather(first), read(p + n_programs)))


def _shrink_kernel(total_ref, meta_ref, rid_ref, x_ref, rows_ref, _xa_in, xa_ref, *, n_programs, **kw):
    _shrink_units(pl.program_id(0), n_programs, total_ref[0], meta_ref, rid_ref, x_ref, rows_ref, xa_ref, **kw)


def _expand_unit(b, c, total, meta_ref, rid_ref, xa_ref, rows_ref, y_ref, out_ref, *, block_t, rank_tile,
                 col_tile, width, xa_col, dtype, branches=True, gemv=False, wait=None):
    """Block b's column tile c: y + xa @ B. Every B tile and the y tile are loaded first (one trip),
    then, after wait(b, rank) if given (the one-launch form: until b's shrink units are in), xa."""
    tok0, tok1, r = meta_ref[b, 0], meta_ref[b, 1], meta_ref[b, 2]
    c0 = c * col_tile
    n_tiles = rid_ref.shape[-1] // rank_tile

    @pl.when(b < total)
    def _():
        cols = pl.multiple_of(jax.lax.rem(c0, width), col_tile) + jnp.arange(col_tile)
        u = jnp.arange(rank_tile)
        live = [kt * rank_tile + u < r for kt in range(n_tiles)]
        b_tiles = []
        for kt in range(n_tiles):  # every tile's loads issued before any product: one trip
            rid_k = rid_ref[b, jax.lax.div(c0, width), pl.ds(kt * rank_tile, rank_tile)]
            b_tiles.append(plgpu.load(rows_ref.at[rid_k[:, None], cols[None, :]], mask=live[kt][:, None], other=0))
        if gemv:
            _expand_gemv(b_tiles, live, tok0, tok1, r, c0, xa_ref, y_ref, out_ref, block_t=block_t,
                         rank_tile=rank_tile, col_tile=col_tile, xa_col=xa_col, dtype=dtype, branches=branches,
                         wait=wait, b=b)
            return
        tok_live = tok0 + jnp.arange(block_t) < tok1  # the dot form only: Triton's ranges are powers of two
        tile = (pl.ds(tok0, block_t), pl.ds(c0, col_tile))
        y = plgpu.load(y_ref.at[tile], mask=tok_live[:, None], other=0)
        if wait is not None:
            wait(b, r)
        xa_tiles = [plgpu.load(xa_ref.at[pl.ds(tok0, block_t), pl.ds(xa_col + kt * rank_tile, rank_tile)],
                               mask=tok_live[:, None] & live[kt][None, :], other=0,
                               volatile=wait is not None)  # from L2: sums another SM added this launch
                                                           # (JAX 0.11.2's lowering refuses ".cg")
                    for kt in range(n_tiles)]
        acc = jnp.zeros((block_t, col_tile), jnp.float32)
        for kt, (bt, xat) in enumerate(zip(b_tiles, xa_tiles)):
            def add(a, bt=bt, xat=xat):
                return a + jax.lax.dot_general(xat.astype(dtype), bt.astype(dtype), (((1,), (0,)), ((), ())),
                                               preferred_element_type=jnp.float32)
            if kt == 0 or not branches:  # without branches: dead tiles are masked zeros (no traffic)
                acc = add(acc)
            else:
                acc = jax.lax.cond(kt * rank_tile < r, add, lambda a: a, acc)
        plgpu.store(out_ref.at[tile], (y.astype(jnp.float32) + acc).astype(out_ref.dtype),
                    mask=tok_live[:, None])


def _expand_gemv(b_tiles, live, tok0, tok1, r, c0, xa_ref, y_ref, out_ref, *, block_t, rank_tile, col_tile, xa_col,
                 dtype, branches, wait, b):
    """_expand_unit's MBGMV form: a token at a time, y_t + sum_j xa_t[j] * B[j, cols] by a multiply
    and a sum over the rank rows (no dot, so no layout conversion orders the loads)."""
    ys = [plgpu.load(y_ref.at[tok0 + t, pl.ds(c0, col_tile)], mask=jnp.broadcast_to(tok0 + t < tok1, (col_tile,)),
                     other=0) for t in range(block_t)]
    if wait is not None:
        wait(b, r)
    xas = [[plgpu.load(xa_ref.at[tok0 + t, pl.ds(xa_col + kt * rank_tile, rank_tile)],
                       mask=live[kt] & (tok0 + t < tok1), other=0, volatile=wait is not None)
            for kt in range(len(b_tiles))] for t in range(block_t)]
    accs = tuple(y.astype(jnp.float32) for y in ys)
    for kt, bt in enumerate(b_tiles):  # tiles outer: one tile's float32 copy live at a time
        def add(accs, bt=bt, kt=kt):
            b32 = bt.astype(jnp.float32)
            return tuple(a + jnp.sum(b32 * xas[t][kt].astype(dtype).astype(jnp.float32)[:, None], axis=0)
                         for t, a in enumerate(accs))
        accs = add(accs) if kt == 0 or not branches else jax.lax.cond(kt * rank_tile < r, add, lambda a: a, accs)
    for t, acc in enumerate(accs):
        plgpu.store(out_ref.at[tok0 + t, pl.ds(c0, col_tile)], acc.astype(out_ref.dtype),
                    mask=jnp.broadcast_to(tok0 + t < tok1, (col_tile,)))


def _expand_kernel(total_ref, meta_ref, rid_ref, xa_ref, rows_ref, y_ref, out_ref, **kw):
    _expand_unit(pl.program_id(0), pl.program_id(1), total_ref[0], meta_ref, rid_ref, xa_ref, rows_ref, y_ref,
                 out_ref, **kw)


def _pad_rows(a, rows: int):
    return a if a.shape[0] >= rows else jnp.pad(a, [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1))


def onetrip_shrink(x, rows, plan, *, n_modules: int, max_rank: int, interpret: bool | None = None):
    """xa [T + block_t, G * Rw] float32 of G modules reading x [T, in] (module g's columns from
    g * Rw, Rw = max_rank in whole rank tiles; rows past T are padding), from shrink_plan's tables.
    rows [N, W]: one layer's pool as rows. interpret None: on the CPU."""
    return _shrink(x, rows, tuple(plan), n_modules=n_modules, max_rank=max_rank, interpret=_interpret(interpret),
                   settings=_frozen())


def onetrip_expand(y, xa, rows, plan, *, xa_col: int = 0, interpret: bool | None = None):
    """y + xa[:, xa_col:xa_col + r_s] @ B_s for the tokens of each slot s (others unchanged), in y's
    dtype, from expand_plan's tables. xa [>= T + block_t, ...] float32 from onetrip_shrink."""
    return _expand(y, xa, rows, tuple(plan), xa_col=xa_col, interpret=_interpret(interpret), settings=_frozen())


@functools.partial(jax.jit, static_argnames=("n_modules", "max_rank", "interpret", "settings"))
def _shrink(x, rows, plan, *, n_modules: int, max_rank: int, interpret: bool, settings: tuple):
    s = dict(settings)
    total, meta, rid = plan
    t, bt, rt = x.shape[0], s["block_t"], s["rank_tile"]
    kw = _shrink_options(s, x, rows, interpret)
    n_programs = _shrink_programs(s, meta, kw["splits"])
    rw = -(-max_rank // rt) * rt
    out = jax.ShapeDtypeStruct((t + bt, n_modules * rw), jnp.float32)
    if interpret:  # interpret mode clamps a block's slice at the end of x instead of masking it
        x = _pad_rows(x, t + bt)
    return pl.pallas_call(
        functools.partial(_shrink_kernel, n_programs=n_programs, **kw), grid=(n_programs,), out_shape=out,
        input_output_aliases={5: 0} if kw["atomic"] else {},
        interpret=interpret, compiler_params=_params(interpret, s["shrink_warps"], s["num_stages"]),
        name="lora_shrink_onetrip",
    )(total.astype(jnp.int32), meta.astype(jnp.int32), rid.astype(jnp.int32), x, rows,
      jnp.zeros(out.shape, jnp.float32) if kw["atomic"] else jnp.zeros((1, 1), jnp.float32))


@functools.partial(jax.jit, static_argnames=("xa_col", "interpret", "settings"))
def _expand(y, xa, rows, plan, *, xa_col: int, interpret: bool, settings: tuple):
    s = dict(settings)
    total, meta, rid = plan
    (t, fout), bt = y.shape, s["block_t"]
    kw = _expand_options(s, rows, fout, xa_col)
    assert rid.shape[-1] % kw["rank_tile"] == 0 and xa.shape[-1] >= xa_col + rid.shape[-1], (rid.shape, xa.shape, xa_col)
    y_in = _pad_rows(y, t + bt) if interpret else y
    out = pl.pallas_call(
        functools.partial(_expand_kernel, **kw), grid=(meta.shape[0], fout // kw["col_tile"]),
        out_shape=jax.ShapeDtypeStruct(y_in.shape, y.dtype),
        input_output_aliases={5: 0},  # base tokens keep y
        interpret=interpret, compiler_params=_params(interpret, s["expand_warps"], s["num_stages"]),
        name="lora_expand_onetrip",
    )(total.astype(jnp.int32), meta.astype(jnp.int32), rid.astype(jnp.int32), _pad_rows(xa, t + bt), rows, y_in)
    return out[:t] if interpret else out


# ---------------------------------------------------------------------------------------------
# One launch: the shrink's programs first, then the expand's, which gather their B and y tiles at
# once and wait only for their own block's sums.


def _one_launch_kernel(ts_ref, ms_ref, rs_ref, te_ref, me_ref, re_ref, x_ref, rows_ref, y_ref, _xa_in, _cnt_in,
                       out_ref, xa_ref, cnt_ref, *, n_shrink, n_col, splits, ticket, shrink_kw, expand_kw):
    # Programs [0, n_shrink) shrink: after each unit's atomic add into xa, one more on its block's
    # counter (acquire-release, so the sums are in L2 before the count says so). The rest expand a
    # (block, column tile) each: B and y are read first, so those bytes stream while the shrink
    # runs; then the program polls its block's counter by atomic reads (acquire: its xa loads cannot
    # pass them; the fence before the first also waits for the B and y loads, which the product
    # needs anyway) until all of the block's units (its rank tiles x splits) are in, and reads xa.
    # No expand program may wait on a shrink program that has not started (the launch would hang
    # once waiting programs filled the GPU). GPUs start a launch's programs in order of their
    # index, and the shrink's come first and wait on nothing; CUDA does not promise that order, so
    # with `ticket` each program takes its place from a counter instead (cnt[-1], one atomic add:
    # one more trip a program), which orders the places as the programs really started.
    # Interpret mode runs the programs one after another in index order, so every shrink unit is in
    # before the first expand program starts: no counters there (its discharge of a polling loop
    # inside a program fails); test_one_launch_counts_match_the_plans checks what the counts reach.
    rank_tile = expand_kw["rank_tile"]
    counted = not shrink_kw["interpret"]
    if ticket and counted:
        p = plgpu.atomic_add(cnt_ref, (cnt_ref.shape[0] - 1,), jnp.int32(1))
    else:
        p = pl.program_id(0)

    @pl.when(p < n_shrink)
    def _():
        def done(blk):
            plgpu.atomic_add(cnt_ref, (blk,), jnp.int32(1))
        _shrink_units(p, n_shrink, ts_ref[0], ms_ref, rs_ref, x_ref, rows_ref, xa_ref, done=done if counted else None,
                      **shrink_kw)

    @pl.when(p >= n_shrink)
    def _():
        e = p - n_shrink

        def wait(b, r):
            def poll(carry):  # an atomic read (add 0): acquire, so the xa loads below stay after it
                return plgpu.atomic_add(cnt_ref, (b,), jnp.int32(0)), carry[1]
            need = units_of_block(r, rank_tile, splits)  # carried: the cond closes over nothing
            jax.lax.while_loop(lambda carry: carry[0] < carry[1], poll, poll((0, need)))
        _expand_unit(jax.lax.div(e, n_col), jax.lax.rem(e, n_col), te_ref[0], me_ref, re_ref, xa_ref, rows_ref,
                     y_ref, out_ref, wait=wait if counted else None, **expand_kw)


def units_of_block(rank, rank_tile: int, splits: int):
    """The shrink units a token block of a slot of this (clamped) rank has: its rank tiles x splits
    (what the one-launch expand waits for; tests check it against shrink_plan's tables)."""
    return (rank + rank_tile - 1) // rank_tile * splits


def onetrip_apply(y, x, rows, shrink_plan_, expand_plan_, *, max_rank: int, interpret: bool | None = None):
    """y + (x @ A_s) @ B_s for the tokens of slot s (others unchanged), one module, in ONE launch
    (see _one_launch_kernel): shrink_plan's tables for the module alone (G = 1), expand_plan's."""
    return _one_launch(y, x, rows, tuple(shrink_plan_), tuple(expand_plan_), max_rank=max_rank,
                       interpret=_interpret(interpret), settings=_frozen())


@functools.partial(jax.jit, static_argnames=("max_rank", "interpret", "settings"))
def _one_launch(y, x, rows, splan, eplan, *, max_rank: int, interpret: bool, settings: tuple):
    s = dict(settings)
    (t, fout), bt = y.shape, s["block_t"]
    shrink_kw = _shrink_options(s, x, rows, interpret, atomic=True)   # xa is zeroed either way
    expand_kw = _expand_options(s, rows, fout, 0)
    n_shrink = _shrink_programs(s, splan[1], shrink_kw["splits"])
    nb, n_col = eplan[1].shape[0], fout // expand_kw["col_tile"]
    rw = -(-max_rank // s["rank_tile"]) * s["rank_tile"]
    if interpret:  # see _shrink, _expand
        x = _pad_rows(x, t + bt)
    y_in = _pad_rows(y, t + bt) if interpret else y
    kernel = functools.partial(_one_launch_kernel, n_shrink=n_shrink, n_col=n_col, splits=shrink_kw["splits"],
                               ticket=s["ticket"], shrink_kw=shrink_kw, expand_kw=expand_kw)
    xa = jax.ShapeDtypeStruct((t + bt, rw), jnp.float32)
    cnt = jax.ShapeDtypeStruct((nb + 1,), jnp.int32)  # a counter a block, and the ticket
    out, _, _ = pl.pallas_call(
        kernel, grid=(n_shrink + nb * n_col,),
        out_shape=(jax.ShapeDtypeStruct(y_in.shape, y.dtype), xa, cnt),
        input_output_aliases={8: 0, 9: 1, 10: 2},
        interpret=interpret, compiler_params=_params(interpret, s["expand_warps"], s["num_stages"]),
        name="lora_onetrip_one_launch",
    )(*(a.astype(jnp.int32) for a in (*splan, *eplan)), x, rows, y_in, jnp.zeros(xa.shape, jnp.float32),
      jnp.zeros(cnt.shape, jnp.int32))
    return out[:t] if interpret else out
