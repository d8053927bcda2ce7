"""LoRA delta kernels over the unified pool in Triton, called through jax-triton: shrink (x @ A)
and expand (y += xa @ B), the twins of pallas_kernels/lora.py with the same signatures, semantics
and block schedule (see that module's docstring for the pool layout and the segment form).

Tokens arrive grouped by adapter slot: slot s owns tokens [seg_starts[s], seg_starts[s+1]); tokens
from seg_starts[Sa] on are base-model tokens. A^T [r, in] and scale*B [r, out] of each slot are read
straight from a layer's pool rows [N, W] through per-slot row indices.

Grid and tiling. The wrapper cuts every slot's segment into blocks of `block_t` tokens, back to back
(pallas_kernels.lora._plan_blocks, imported, not copied): at most T/block_t + Sa blocks, none for
base tokens, empty slots or slots of rank 0. The grid is static, (programs, column tiles), with
programs = min(blocks, max_programs); program p walks blocks p, p + programs, ... up to the live
total read from memory (a loop with a traced trip count), so padding costs one trivial pass.
  shrink: column tile k = rank tile k of xa (16 rank columns). A block loops over `in` in chunks of
          C columns: x tile [block_t, C] . A^T tile [16, C]^T, accumulated in float32; rank tiles at
          or past the slot's rank skip.
  expand: column tile o = C output columns. A block loops over ceil(r / 16) rank tiles: xa tile
          [block_t, 16] @ B tile [16, C], in the pool's dtype, accumulated in float32, then adds y.
C is the largest power of two dividing W and the matrix width (capped), so one rank row's tile lies
in one pool row: a tile of 16 rank rows is one 2-D gather (row index + column offset per rank row).
Widths with no such C >= 16 (Triton's smallest dot side) fall back to the jnp reference, as the
Pallas twin does. Padding is bounded by one tile: at most block_t - 1 dead token rows per block and
ceil(r / 16) rank tiles per slot of rank r, whatever the batch's max rank.

In place. Shrink writes into a zero [T, max_rank] buffer aliased to its output (input_output_aliases),
so dead entries stay exactly 0. Expand aliases y to its output and writes y + delta for the tokens
of live blocks only: base tokens and tokens of rank-0 slots keep y untouched, with no extra pass
over [T, out]. (Under jit, XLA copies y first unless the caller donates it.)

Precision. Float32 operands follow JAX's default matmul precision, as the Pallas twin's dots do:
TF32 by default, IEEE float32 under jax_default_matmul_precision "highest" / "float32" (what
float32 parity runs use). bf16 operands multiply exactly, accumulated in float32.

`jax_triton` and `triton` are imported lazily: neither imports on a CPU-only machine. The kernel
bodies live in triton_kernels/_lora_tl.py (pure Triton), which Triton's interpreter also runs on the
CPU (tests/test_triton_kernels.py). On the GPU this needs jax-triton 0.3.1 and triton 3.6.
"""

from __future__ import annotations

import functools
import importlib
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.lora import (BLOCK_T, MAX_PROGRAMS, _check_block_t, _merge_blocks, _plan_blocks,
                                 _col_tile, lora_expand_reference, lora_shrink_reference)

# Block sizes, as in the Pallas twin (not yet tuned on a GPU; col_tile is a cap).
BLOCKS = {
    "shrink": dict(rank_tile=16, col_tile=256, num_warps=4, num_stages=2),
    "expand": dict(rank_tile=16, col_tile=128, num_warps=4, num_stages=2),
    # lora_coop_apply: n_kc parts of `in` a rank tile's shrink is cut into (chunks of k_tile
    # columns), col_tile the expand's output columns a tile, spins the waits before a program
    # computes unclaimed chunks itself; programs: a token block's programs at least (its chunks
    # at least, its column tiles at most). H200, issue 4's point (64 x 32, 4096 -> 4096, bf16 y),
    # device µs (bench/results/20261130-1aac504/call4-coop-v2/): programs 4 / 8 / 16: 20.1 / 19.4 /
    # 29.6 (16: 512 programs at two an SM run in two waves); the Pallas pair 18.7.
    "coop": dict(rank_tile=16, k_tile=512, n_kc=4, col_tile=256, spins=256, num_warps=4, num_stages=2,
                 programs=8),
}
if os.environ.get("SLORA_TRITON_BLOCKS"):  # a benchmark's setting, as SLORA_LORA_BLOCKS for the Pallas twins
    _merge_blocks(os.environ["SLORA_TRITON_BLOCKS"], "SLORA_TRITON_BLOCKS", BLOCKS)


def unavailable_reason() -> str | None:
    """Why the triton backend cannot run here, or None when it can."""
    if jax.default_backend() != "gpu":
        return f"needs a GPU (JAX's default backend is {jax.default_backend()!r})"
    try:
        for module in ("triton", "jax_triton"):  # jax_triton raises ImportError without a GPU jaxlib
            importlib.import_module(module)
    except ImportError as e:
        return f"needs jax-triton 0.3.1 and triton ({type(e).__name__}: {e})"
    return None


def _f32_dot() -> str:
    """tl.dot's input_precision for float32 operands, from JAX's default matmul precision."""
    precision = str(jax.config.jax_default_matmul_precision or "").lower()
    return "ieee" if precision in ("highest", "float32", "f32_f32_f32") else "tf32"


# ---------------------------------------------------------------------------------------------
# Plans: the kernel's arrays, constexprs and grid, in plain JAX. The jax-triton wrappers launch them;
# the interpreter test ships them to a Triton interpreter as they are.


def shrink_plan(x, rows, a_rows, ranks, seg_starts, *, max_rank: int, in_features: int,
                block_t: int = BLOCK_T, max_programs: int = MAX_PROGRAMS, schedule=None):
    """(arrays, constexprs, grid, launch options) for lora_shrink_kernel; the last array is the
    zero xa buffer that the output aliases."""
    t, width = x.shape[0], rows.shape[1]
    blocks = BLOCKS["shrink"]
    rank_tile, col_tile = blocks["rank_tile"], _col_tile(width, in_features, blocks["col_tile"])
    ranks, sched, total, nb, n_programs = _plan_blocks(ranks, seg_starts, t, max_rank, block_t, max_programs,
                                                       schedule)
    x = x.astype(jnp.promote_types(x.dtype, rows.dtype))  # the kernel casts A tiles to x's dtype
    arrays = (total, sched, ranks, a_rows.astype(jnp.int32), x, rows,
              jnp.zeros((t, max_rank), jnp.float32))
    const = dict(NB=nb, N_PROGRAMS=n_programs, BLOCK_T=block_t, RANK_TILE=rank_tile,
                 COL_TILE=col_tile, FIN=in_features, W=width, RA=a_rows.shape[1],
                 MAX_RANK=max_rank, F32_DOT=_f32_dot())
    grid = (n_programs, -(-max_rank // rank_tile))
    return arrays, const, grid, dict(num_warps=blocks["num_warps"], num_stages=blocks["num_stages"])


def expand_plan(y, xa, rows, b_rows, ranks, seg_starts, *, max_rank: int, out_features: int,
                block_t: int = BLOCK_T, max_programs: int = MAX_PROGRAMS, schedule=None):
    """(arrays, constexprs, grid, launch options) for lora_expand_kernel; the last array is y,
    which the output aliases."""
    t, width = y.shape[0], rows.shape[1]
    blocks = BLOCKS["expand"]
    rank_tile, col_tile = blocks["rank_tile"], _col_tile(width, out_features, blocks["col_tile"])
    ranks, sched, total, nb, n_programs = _plan_blocks(ranks, seg_starts, t, max_rank, block_t, max_programs,
                                                       schedule)
    arrays = (total, sched, ranks, b_rows.astype(jnp.int32), xa.astype(jnp.float32), rows, y)
    const = dict(NB=nb, N_PROGRAMS=n_programs, BLOCK_T=block_t, RANK_TILE=rank_tile,
                 COL_TILE=col_tile, FOUT=out_features, W=width, RB=b_rows.shape[1],
                 MAX_RANK=max_rank, F32_DOT=_f32_dot())
    grid = (n_programs, out_features // col_tile)
    return arrays, const, grid, dict(num_warps=blocks["num_warps"], num_stages=blocks["num_stages"])


def coop_sizes(t: int, n_slots: int, *, max_rank: int, block_t: int = BLOCK_T) -> tuple[int, int, int]:
    """(items, chunks an item at most, programs) of lora_coop_apply's launch: items bound the
    token blocks (as the block schedule's), each item holds up to MAX_CH chunks (rank tiles x n_kc)
    and max(MAX_CH, BLOCKS["coop"]["programs"]) programs."""
    b = BLOCKS["coop"]
    items = max(1, (t + n_slots * (block_t - 1)) // block_t)
    max_ch = -(-max_rank // b["rank_tile"]) * b["n_kc"]
    return items, max_ch, items * max(max_ch, b["programs"])


def _n_col_tiles(fout: int, width: int) -> int:
    return fout // _col_tile(width, fout, BLOCKS["coop"]["col_tile"])


def coop_schedule(ranks, seg_starts, t: int, *, max_rank: int, fout: int, width: int, block_t: int = BLOCK_T):
    """lora_coop_apply's program table on the host (numpy), as the engine builds schedules:
    (table [programs, 8], live [1]) int32. Row p: (item, slot, first token, block end, rank, its
    index c among the item's programs, the item's chunk count NCH, its program count NP) for the
    live programs, which come first, item by item; zeros after. An item is a block of up to block_t
    tokens of a slot of rank > 0, with NCH = ceil(rank / rank_tile) x n_kc chunks and NP = max(NCH,
    min(BLOCKS["coop"]["programs"], the output's column tiles)) programs."""
    b = BLOCKS["coop"]
    ranks, seg = np.minimum(np.asarray(ranks, np.int64), max_rank), np.asarray(seg_starts, np.int64)
    _, _, programs = coop_sizes(t, len(ranks), max_rank=max_rank, block_t=block_t)
    least = min(b["programs"], _n_col_tiles(fout, width))
    table = np.zeros((programs, 8), np.int32)
    p = i = 0
    for s, r in enumerate(ranks):
        if r <= 0:
            continue
        nch = -(-int(r) // b["rank_tile"]) * b["n_kc"]
        n_prog = max(nch, least)
        for first in range(int(seg[s]), int(seg[s + 1]), block_t):
            end = min(first + block_t, seg[s + 1])
            table[p:p + n_prog] = [(i, s, first, end, r, c, nch, n_prog) for c in range(n_prog)]
            p, i = p + n_prog, i + 1
    return table, np.array([p], np.int32)


def _coop_schedule_jnp(ranks, seg_starts, t: int, *, max_rank: int, fout: int, width: int, block_t: int):
    """coop_schedule in the graph (the same table), for calls that pass none."""
    b = BLOCKS["coop"]
    n_items, _, programs = coop_sizes(t, ranks.shape[0], max_rank=max_rank, block_t=block_t)
    ranks, seg = jnp.minimum(ranks.astype(jnp.int32), max_rank), seg_starts.astype(jnp.int32)
    blocks = jnp.where(ranks > 0, -(-(seg[1:] - seg[:-1]) // block_t), 0)        # items of each slot
    k = jnp.arange(n_items)
    slot = jnp.repeat(jnp.arange(ranks.shape[0]), blocks, total_repeat_length=n_items)
    live_item = k < blocks.sum()
    first = seg[slot] + (k - (jnp.cumsum(blocks) - blocks)[slot]) * block_t
    r = ranks[slot]
    nch = -(-r // b["rank_tile"]) * b["n_kc"]
    n_prog = jnp.where(live_item, jnp.maximum(nch, min(b["programs"], _n_col_tiles(fout, width))), 0)
    item = jnp.repeat(k, n_prog, total_repeat_length=programs)
    p = jnp.arange(programs)
    live = n_prog.sum()
    c = p - (jnp.cumsum(n_prog) - n_prog)[item]
    rows = jnp.stack([item, slot[item], first[item], jnp.minimum(first + block_t, seg[slot + 1])[item], r[item], c,
                      nch[item], n_prog[item]], axis=1)
    return jnp.where((p < live)[:, None], rows, 0).astype(jnp.int32), live.reshape(1).astype(jnp.int32)


def coop_plan(y, x, rows, a_rows, b_rows, ranks, seg_starts, *, max_rank: int, fin: int, fout: int,
              block_t: int = BLOCK_T, schedule=None, timing: bool = False):
    """(arrays, constexprs, grid, launch options, outputs) for lora_coop_kernel: the arrays end
    with y and the zero counters, which outputs 0 and 1 alias; output 2 is the partial planes,
    output 3 the programs' timestamps (timing; else one unused entry)."""
    t, width = y.shape[0], rows.shape[1]
    b = BLOCKS["coop"]
    n_items, max_ch, programs = coop_sizes(t, ranks.shape[0], max_rank=max_rank, block_t=block_t)
    if schedule is None:
        table, live = _coop_schedule_jnp(ranks, seg_starts, t, max_rank=max_rank, fout=fout, width=width,
                                         block_t=block_t)
    else:
        table, live = (jnp.asarray(a, jnp.int32) for a in schedule)
        if table.shape != (programs, 8) or live.shape != (1,):
            raise ValueError(f"schedule shapes {table.shape}, {live.shape} are not coop_schedule's for {t} "
                             f"tokens, {ranks.shape[0]} slots, block_t {block_t}: {(programs, 8)}, (1,)")
    k_tile = _col_tile(width, fin, b["k_tile"])
    r_pad = -(-max_rank // b["rank_tile"]) * b["rank_tile"]
    x = x.astype(jnp.promote_types(x.dtype, rows.dtype))  # the kernel casts A tiles to x's dtype
    arrays = (table, a_rows.astype(jnp.int32), b_rows.astype(jnp.int32), x, rows, y,
              jnp.zeros((n_items, 1 + max_ch), jnp.int32))
    const = dict(BLOCK_T=block_t, RANK_TILE=b["rank_tile"], K_TILE=k_tile, N_KC=b["n_kc"],
                 COL_TILE=_col_tile(width, fout, b["col_tile"]), FIN=fin, FOUT=fout, W=width,
                 RA=a_rows.shape[1], RB=b_rows.shape[1], R_PAD=r_pad, MAX_CH=max_ch, SPINS=b["spins"],
                 F32_DOT=_f32_dot(), TIMING=int(timing))
    outs = (jax.ShapeDtypeStruct(y.shape, y.dtype), jax.ShapeDtypeStruct(arrays[-1].shape, jnp.int32),
            jax.ShapeDtypeStruct((n_items, b["n_kc"], block_t, r_pad), jnp.float32),
            jax.ShapeDtypeStruct((programs, 8) if timing else (1,), jnp.int32))
    return arrays, const, (programs,), dict(num_warps=b["num_warps"], num_stages=b["num_stages"]), outs


@functools.partial(jax.jit, static_argnames=("max_rank", "fin", "fout", "block_t", "timing"))
def _coop(y, x, rows, a_rows, b_rows, ranks, seg_starts, schedule, *, max_rank, fin, fout, block_t, timing=False):
    import jax_triton
    from triton_kernels import _lora_tl

    arrays, const, grid, opts, outs = coop_plan(y, x, rows, a_rows, b_rows, ranks, seg_starts, max_rank=max_rank,
                                                fin=fin, fout=fout, block_t=block_t, schedule=schedule,
                                                timing=timing)
    n = len(arrays)
    out = jax_triton.triton_call(*arrays, kernel=_lora_tl.lora_coop_kernel, out_shape=outs, grid=grid,
                                 name="lora_coop_triton", input_output_aliases={n - 2: 0, n - 1: 1}, **opts, **const)
    return (out[0], out[3]) if timing else out[0]


def lora_coop_apply(y, x, rows, a_rows, b_rows, ranks, seg_starts, *, max_rank: int, fin: int, fout: int,
                    interpret=None, block_t: int = BLOCK_T, schedule=None):
    """lora_apply in one launch (lora_coop_kernel): y + (x @ A_s) @ B_s for the tokens of slot s,
    base tokens unchanged, in y's dtype. The programs of a token block share its shrink through
    partial planes and counters in global memory, then each expands its share of the columns.
    schedule: coop_schedule's (table, live), else built in the graph."""
    _no_interpret(interpret)
    if min(_col_tile(rows.shape[1], fin, BLOCKS["coop"]["k_tile"]),
           _col_tile(rows.shape[1], fout, BLOCKS["coop"]["col_tile"])) < 16:
        xa = lora_shrink_reference(x, rows, a_rows, ranks, seg_starts, max_rank=max_rank, in_features=fin)
        return lora_expand_reference(y, xa, rows, b_rows, ranks, seg_starts, max_rank=max_rank, out_features=fout)
    _check_block_t(block_t)
    return _coop(y, x, rows, a_rows, b_rows, ranks, seg_starts, schedule, max_rank=max_rank, fin=fin, fout=fout,
                 block_t=block_t)


def _launch(kernel_name: str, plan, name: str):
    import jax_triton
    from triton_kernels import _lora_tl

    arrays, const, grid, opts = plan
    out = arrays[-1]
    return jax_triton.triton_call(
        *arrays, kernel=getattr(_lora_tl, kernel_name),
        out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype), grid=grid, name=name,
        input_output_aliases={len(arrays) - 1: 0}, **opts, **const)


@functools.partial(jax.jit, static_argnames=("max_rank", "in_features", "block_t", "max_programs"))
def _shrink(x, rows, a_rows, ranks, seg_starts, schedule, *, max_rank, in_features, block_t, max_programs):
    plan = shrink_plan(x, rows, a_rows, ranks, seg_starts, max_rank=max_rank,
                       in_features=in_features, block_t=block_t, max_programs=max_programs,
                       schedule=schedule)
    return _launch("lora_shrink_kernel", plan, "lora_shrink_triton")


@functools.partial(jax.jit, static_argnames=("max_rank", "out_features", "block_t", "max_programs"))
def _expand(y, xa, rows, b_rows, ranks, seg_starts, schedule, *, max_rank, out_features, block_t,
            max_programs):
    plan = expand_plan(y, xa, rows, b_rows, ranks, seg_starts, max_rank=max_rank,
                       out_features=out_features, block_t=block_t, max_programs=max_programs,
                       schedule=schedule)
    return _launch("lora_expand_kernel", plan, "lora_expand_triton")


# ---------------------------------------------------------------------------------------------
# Public wrappers: the signatures of pallas_kernels.lora's (`interpret` is accepted and must be
# falsy: the interpreter path is the test's, on torch tensors).


def _no_interpret(interpret):
    if interpret:
        raise ValueError("triton_kernels run compiled only; Triton's interpreter runs the kernel "
                         "bodies on torch tensors (tests/test_triton_kernels.py)")


def lora_shrink(x, rows, a_rows, ranks, seg_starts, *, max_rank: int, in_features: int,
                interpret=None, block_t: int = BLOCK_T, max_programs: int = MAX_PROGRAMS, schedule=None):
    """xa [T, max_rank] float32: xa[t, :r_s] = x[t] @ A_s for the tokens of slot s, 0 elsewhere.
    Arguments as pallas_kernels.lora.lora_shrink."""
    assert x.shape[1] == in_features, (x.shape, in_features)
    _no_interpret(interpret)
    if _col_tile(rows.shape[1], in_features, BLOCKS["shrink"]["col_tile"]) < 16:
        return lora_shrink_reference(x, rows, a_rows, ranks, seg_starts, max_rank=max_rank,
                                     in_features=in_features)
    _check_block_t(block_t)
    return _shrink(x, rows, a_rows, ranks, seg_starts, schedule, max_rank=max_rank, in_features=in_features,
                   block_t=block_t, max_programs=max_programs)


def lora_expand(y, xa, rows, b_rows, ranks, seg_starts, *, max_rank: int, out_features: int,
                interpret=None, block_t: int = BLOCK_T, max_programs: int = MAX_PROGRAMS, schedule=None):
    """y + xa[:, :r_s] @ B_s for the tokens of slot s (base tokens unchanged), in y's dtype,
    accumulated in place into (a copy of) y. Arguments as pallas_kernels.lora.lora_expand."""
    assert y.shape[1] == out_features and xa.shape[1] == max_rank, (y.shape, xa.shape, out_features)
    _no_interpret(interpret)
    if _col_tile(rows.shape[1], out_features, BLOCKS["expand"]["col_tile"]) < 16:
        return lora_expand_reference(y, xa, rows, b_rows, ranks, seg_starts, max_rank=max_rank,
                                     out_features=out_features)
    _check_block_t(block_t)
    return _expand(y, xa, rows, b_rows, ranks, seg_starts, schedule, max_rank=max_rank,
                   out_features=out_features, block_t=block_t, max_programs=max_programs)


def lora_apply(y, x, rows, a_rows, b_rows, ranks, seg_starts, *, max_rank: int, fin: int, fout: int,
               **kernel_options):
    """y + (x @ A_s) @ B_s for the tokens of slot s, base tokens unchanged, in y's dtype: shrink, then
    expand straight into y (no delta buffer, no separate add)."""
    xa = lora_shrink(x, rows, a_rows, ranks, seg_starts, max_rank=max_rank, in_features=fin, **kernel_options)
    return lora_expand(y, xa, rows, b_rows, ranks, seg_starts, max_rank=max_rank, out_features=fout,
                       **kernel_options)


def lora_delta(x, rows, a_rows, b_rows, ranks, seg_starts, *, max_rank: int, fin: int, fout: int,
               backend: str = "triton", **kernel_options):
    """The LoRA delta [T, fout] float32: (x @ A_s) @ B_s per token of slot s, 0 for base tokens.
    backend "pallas" and "xla" forward to pallas_kernels.lora.lora_delta."""
    if backend != "triton":
        from pallas_kernels import lora as pallas_lora
        return pallas_lora.lora_delta(x, rows, a_rows, b_rows, ranks, seg_starts, max_rank=max_rank,
                                      fin=fin, fout=fout, backend=backend, **kernel_options)
    return lora_apply(jnp.zeros((x.shape[0], fout), jnp.float32), x, rows, a_rows, b_rows, ranks,
                      seg_starts, max_rank=max_rank, fin=fin, fout=fout, **kernel_options)
