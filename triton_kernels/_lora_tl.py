"""The @triton.jit bodies of the LoRA shrink and expand kernels (see triton_kernels/lora.py).

Pure Triton, no JAX: jax-triton compiles them on a GPU, and Triton's interpreter (TRITON_INTERPRET=1)
runs them on the CPU with torch tensors (tests/triton_interpret.py). Importing this module needs
`triton`; triton_kernels/lora.py imports it lazily.

Every size is a constexpr (JAX shapes are static anyway). Matrices are row-major and contiguous:
x [T, FIN], xa [T, MAX_RANK], y / out [T, FOUT], rows [N, W], a_rows [Sa, RA], b_rows [Sa, RB],
sched [3, NB] (slot, first token, segment end per block), total [1] (live blocks), ranks [Sa].
F32_DOT is tl.dot's input_precision for float32 operands ("tf32" or "ieee"); bf16 ignores it.
"""

import triton
import triton.language as tl


@triton.jit
def _gather_tile(rows_ptr, idx_ptr, s, flat, live, NIDX: tl.constexpr, W: tl.constexpr,
                 C: tl.constexpr):
    """[len(flat), C]: the C elements at each flat offset of slot s's row stream (0 where not
    live). C divides W and the matrix width, so a tile row never straddles two pool rows."""
    rid = tl.load(idx_ptr + s * NIDX + flat // W, mask=live, other=0).to(tl.int64)
    col = tl.multiple_of(flat % W, C)  # lets Triton vectorise the load
    ptrs = rows_ptr + rid[:, None] * W + col[:, None] + tl.arange(0, C)[None, :]
    return tl.load(ptrs, mask=live[:, None], other=0)


@triton.jit
def _block(sched_ptr, ranks_ptr, b, NB: tl.constexpr, BLOCK_T: tl.constexpr):
    """Block b of the schedule: its slot s, the slot's rank, its token indices and which are live."""
    s = tl.load(sched_ptr + b)
    start = tl.load(sched_ptr + NB + b)
    end = tl.load(sched_ptr + 2 * NB + b)
    t = start + tl.arange(0, BLOCK_T)
    return s, tl.load(ranks_ptr + s), t, t < end


@triton.jit
def lora_shrink_kernel(total_ptr, sched_ptr, ranks_ptr, a_rows_ptr, x_ptr, rows_ptr, _xa_in_ptr,
                       xa_ptr, NB: tl.constexpr, N_PROGRAMS: tl.constexpr, BLOCK_T: tl.constexpr,
                       RANK_TILE: tl.constexpr, COL_TILE: tl.constexpr, FIN: tl.constexpr,
                       W: tl.constexpr, RA: tl.constexpr, MAX_RANK: tl.constexpr,
                       F32_DOT: tl.constexpr):
    """xa[t, j] = x[t] . A^T_s[j] for j < r_s. Program (p, k): blocks p, p + N_PROGRAMS, ... and
    rank tile k. xa_ptr aliases _xa_in_ptr (zeros): only live entries are written."""
    p = tl.program_id(0)
    k = tl.program_id(1)
    total = tl.load(total_ptr)
    for b in range(p, total, N_PROGRAMS):
        s, r, t, t_live = _block(sched_ptr, ranks_ptr, b, NB, BLOCK_T)
        if k * RANK_TILE < r:
            j = k * RANK_TILE + tl.arange(0, RANK_TILE)          # A^T rows = rank columns of xa
            j_live = j < r
            first = tl.where(j_live, j, 0) * FIN                 # A^T row j starts at flat j*FIN
            cols = tl.arange(0, COL_TILE)
            acc = tl.zeros((BLOCK_T, RANK_TILE), tl.float32)
            for c in range(0, FIN, COL_TILE):
                at = _gather_tile(rows_ptr, a_rows_ptr, s, first + c, j_live, RA, W, COL_TILE)
                xt = tl.load(x_ptr + t[:, None] * FIN + c + cols[None, :], mask=t_live[:, None],
                             other=0)                             # [BLOCK_T, C]
                acc = tl.dot(xt, tl.trans(at.to(xt.dtype)), acc,  # [BLOCK_T, RANK_TILE]
                             input_precision=F32_DOT)
            tl.store(xa_ptr + t[:, None] * MAX_RANK + j[None, :], acc,
                     mask=t_live[:, None] & j_live[None, :])


@triton.jit
def lora_expand_kernel(total_ptr, sched_ptr, ranks_ptr, b_rows_ptr, xa_ptr, rows_ptr, y_ptr,
                       out_ptr, NB: tl.constexpr, N_PROGRAMS: tl.constexpr, BLOCK_T: tl.constexpr,
                       RANK_TILE: tl.constexpr, COL_TILE: tl.constexpr, FOUT: tl.constexpr,
                       W: tl.constexpr, RB: tl.constexpr, MAX_RANK: tl.constexpr,
                       F32_DOT: tl.constexpr):
    """out[t, cols] = y[t, cols] + xa[t, :r_s] @ B_s[:, cols]. Program (p, o): blocks p,
    p + N_PROGRAMS, ... and output column tile o. out_ptr aliases y_ptr: base tokens keep y."""
    p = tl.program_id(0)
    col = tl.program_id(1) * COL_TILE
    cols = col + tl.arange(0, COL_TILE)
    total = tl.load(total_ptr)
    for b in range(p, total, N_PROGRAMS):
        s, r, t, t_live = _block(sched_ptr, ranks_ptr, b, NB, BLOCK_T)
        acc = tl.zeros((BLOCK_T, COL_TILE), tl.float32)
        for kt in range(0, tl.cdiv(r, RANK_TILE)):              # ceil(r / RANK_TILE) rank tiles
            j = kt * RANK_TILE + tl.arange(0, RANK_TILE)         # B rows
            j_live = j < r
            bt = _gather_tile(rows_ptr, b_rows_ptr, s, tl.where(j_live, j, 0) * FOUT + col, j_live,
                              RB, W, COL_TILE)                    # [RANK_TILE, C]
            xat = tl.load(xa_ptr + t[:, None] * MAX_RANK + j[None, :],
                          mask=t_live[:, None] & j_live[None, :], other=0)
            acc = tl.dot(xat.to(bt.dtype), bt, acc, input_precision=F32_DOT)  # pool's dtype
        tile = t[:, None] * FOUT + cols[None, :]
        y = tl.load(y_ptr + tile, mask=t_live[:, None], other=0)
        tl.store(out_ptr + tile, (y.to(tl.float32) + acc).to(out_ptr.dtype.element_ty),
                 mask=t_live[:, None])
