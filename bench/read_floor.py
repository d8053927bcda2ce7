"""What reading an adapter's rows from the pool costs, with nothing else: a floor for the LoRA pair.

The LoRA kernels are judged by the share of copy bandwidth they reach at 64 tokens x 32 adapters
(their bytes over their device-busy time). Whatever the kernels compute, they must gather each adapter's A^T
rows and B rows from pool rows at random places, through their row indices, and the expand cannot
start before the shrink has ended. This module's kernel does only that gather: each program reads
`tile_rows` row indices, then those rows' columns of its split, chunk by chunk (the same two-stage
prefetch as the LoRA kernels), and sums them into one float per row and split (so nothing it
loads is dead). `bench/kernels.py --read-floor` times it beside the pair on the case's own rows:

- one launch reading the A and the B rows: the floor of any one-launch shrink + expand;
- two launches, A rows then B rows: the floor of a two-launch pair (the expand waits);
- the same two launches with one more dependent trip before each program's gather (it reads its
  tile's place from a table first, as the LoRA kernels read their schedule): what a trip costs.

Each is the best over a few tilings. `read_reference` is its jnp twin (tests/test_bench.py checks
the kernel against it in interpret mode).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.lora import _loop

TILE_ROWS = 16
TILINGS = ((256, 1), (256, 4), (256, 16), (512, 1), (512, 4), (512, 8))  # (col_tile, splits)


def _read_kernel(order_ref, idx_ref, rows_ref, out_ref, *, tile_rows, col_tile, chunks, hops):
    p, q = pl.program_id(0), pl.program_id(1)
    # hops 2: the program first reads which tile of indices is its own (as the LoRA kernels first
    # read their schedule's entry), one more memory trip before the gather can start
    tile = order_ref[p] if hops == 2 else p
    rid = idx_ref[pl.ds(tile * tile_rows, tile_rows)]

    def load(c):
        c = jnp.minimum(c, chunks - 1)  # the prefetch past the last chunk re-reads it (unused)
        cols = (q * chunks + c) * col_tile + jnp.arange(col_tile)
        return rows_ref[rid[:, None], cols[None, :]]

    acc = _loop(0, chunks, load, lambda t, a: a + t.astype(jnp.float32),
                jnp.zeros((tile_rows, col_tile), jnp.float32))
    out_ref[pl.ds(p, 1), pl.ds(q * tile_rows, tile_rows)] = jnp.sum(acc, axis=1)[None, :]


@functools.partial(jax.jit, static_argnames=("col_tile", "splits", "interpret"))
def paged_read(rows, idx, order=None, *, col_tile: int, splits: int, interpret: bool = False):
    """[len(idx) / TILE_ROWS, splits * TILE_ROWS] float32: out[p, q * TILE_ROWS + i] = the sum of
    pool row idx[order[p] * TILE_ROWS + i] (order None: p) over the columns of split q. len(idx) is
    a multiple of TILE_ROWS; splits * col_tile divides the width. order (a permutation of the index
    tiles, [len(idx) / TILE_ROWS] int32) makes each program read its tile's place first: two
    dependent trips before the rows instead of one."""
    width = rows.shape[1]
    assert idx.shape[0] % TILE_ROWS == 0 and width % (splits * col_tile) == 0, (idx.shape, width, splits, col_tile)
    n_prog = idx.shape[0] // TILE_ROWS
    hops = 1 if order is None else 2
    order = jnp.arange(n_prog, dtype=jnp.int32) if order is None else order.astype(jnp.int32)
    kernel = functools.partial(_read_kernel, tile_rows=TILE_ROWS, col_tile=col_tile,
                               chunks=width // (splits * col_tile), hops=hops)
    return pl.pallas_call(
        kernel, grid=(n_prog, splits),
        out_shape=jax.ShapeDtypeStruct((n_prog, splits * TILE_ROWS), jnp.float32),
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=2),
        name="paged_read",
    )(order, idx.astype(jnp.int32), rows)


def read_reference(rows, idx, order=None, *, splits: int):
    """paged_read in jnp."""
    n_prog = idx.shape[0] // TILE_ROWS
    if order is not None:
        idx = idx.reshape(n_prog, TILE_ROWS)[order].reshape(-1)
    g = rows[idx].astype(jnp.float32).reshape(n_prog, TILE_ROWS, splits, -1).sum(-1)
    return g.transpose(0, 2, 1).reshape(n_prog, splits * TILE_ROWS)


def live_rows(a_rows, b_rows, ranks, fin: int, fout: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The pool rows a case's slots must read: slot s's first ceil(r_s * fin / W) A^T rows and
    ceil(r_s * fout / W) B rows, each list padded to whole tiles with its own first row."""
    a_rows, b_rows, ranks = map(np.asarray, (a_rows, b_rows, ranks))

    def take(idx, f):
        out = np.concatenate([idx[s, :-(-int(r) * f // width)] for s, r in enumerate(ranks) if r > 0])
        pad = -len(out) % TILE_ROWS
        return np.concatenate([out, np.full(pad, out[0], out.dtype)]).astype(np.int32)
    return take(a_rows, fin), take(b_rows, fout)
