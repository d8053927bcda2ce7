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
from triton.language.extra import cuda as tl_cuda


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


# ---------------------------------------------------------------------------------------------
# Cooperative shrink + expand in one launch (lora_coop_apply). Each work item is one block of up
# to BLOCK_T tokens of one slot, run by NP programs. Program c < NCH shrinks chunk c (a rank tile
# of RANK_TILE A^T rows over one of N_KC parts of `in`) into a float32 partial plane and publishes
# it by counting it done; every program waits until all NCH chunks are done, then expands the
# item's output column tiles o = c, c + NP, ... from the sum of the planes. A chunk is claimed (a flag swapped to 1) before it
# is computed, and a program that has waited SPINS times computes the unclaimed chunks itself: a
# program only ever waits for chunks claimed by running programs, so the launch cannot deadlock,
# whatever the GPU runs at once (and Triton's interpreter, which runs programs one at a time, has
# the first program of an item compute every chunk).


@triton.jit
def _coop_chunk(q, i, s, r, t, t_live, x_ptr, rows_ptr, a_rows_ptr, part_ptr, BLOCK_T: tl.constexpr,
                RANK_TILE: tl.constexpr, K_TILE: tl.constexpr, N_KC: tl.constexpr, FIN: tl.constexpr,
                W: tl.constexpr, RA: tl.constexpr, R_PAD: tl.constexpr, F32_DOT: tl.constexpr):
    """Chunk q of item i: partial plane kc = q % N_KC, rank tile q // N_KC: x[t, part kc of in] .
    A^T[j, part kc]^T for the tile's rank rows j < r, stored as plane kc's columns j."""
    kc = q % N_KC
    j = (q // N_KC) * RANK_TILE + tl.arange(0, RANK_TILE)
    j_live = j < r
    first = tl.where(j_live, j, 0) * FIN
    n_sub = FIN // K_TILE
    cols = tl.arange(0, K_TILE)
    acc = tl.zeros((BLOCK_T, RANK_TILE), tl.float32)
    for u in range(kc * n_sub // N_KC, (kc + 1) * n_sub // N_KC):
        c0 = u * K_TILE
        at = _gather_tile(rows_ptr, a_rows_ptr, s, first + c0, j_live, RA, W, K_TILE)  # [RANK_TILE, K]
        xt = tl.load(x_ptr + t[:, None] * FIN + c0 + cols[None, :], mask=t_live[:, None], other=0)
        acc = tl.dot(xt, tl.trans(at.to(xt.dtype)), acc, input_precision=F32_DOT)
    rows = (i * N_KC + kc) * BLOCK_T + tl.arange(0, BLOCK_T)
    tl.store(part_ptr + rows[:, None] * R_PAD + j[None, :], acc, mask=j_live[None, :])


@triton.jit
def _now():
    """The global timer's low 32 bits (ns; differences within a launch, taken modulo 2**32)."""
    return (tl_cuda.globaltimer() & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def lora_coop_kernel(table_ptr, a_rows_ptr, b_rows_ptr, x_ptr, rows_ptr, _y_in_ptr, _cnt_in_ptr,
                     y_ptr, cnt_ptr, part_ptr, times_ptr, BLOCK_T: tl.constexpr, RANK_TILE: tl.constexpr,
                     K_TILE: tl.constexpr, N_KC: tl.constexpr, COL_TILE: tl.constexpr, FIN: tl.constexpr,
                     FOUT: tl.constexpr, W: tl.constexpr, RA: tl.constexpr, RB: tl.constexpr,
                     R_PAD: tl.constexpr, MAX_CH: tl.constexpr, SPINS: tl.constexpr, F32_DOT: tl.constexpr,
                     TIMING: tl.constexpr = 0):
    """y[t] += (x[t] @ A_s) @ B_s for the tokens of every live item; table [programs, 8] holds each
    program's (item, slot, first token, block end, rank, its index c among the item's programs, the
    item's chunk count NCH, the item's program count NP >= NCH), zeros past the live programs.
    Program c computes chunk c (c < NCH) and expands the output column
    tiles c, c + NP, ... cnt [items, 1 + MAX_CH] (zeros on entry; y_ptr and cnt_ptr alias
    _y_in_ptr and _cnt_in_ptr): chunks done, then each chunk's claim flag. part [items, N_KC,
    BLOCK_T, R_PAD] float32: the partial planes. TIMING (bench/coop_timing.py): times [programs, 8]
    int32 gets each program's global timer (_now) at its start, once its table row is read, once its claim
    is answered, after its own chunk, after the wait, at its end, and its SM."""
    p = tl.program_id(0)
    if TIMING:
        tl.store(times_ptr + p * 8, _now())
    rec = table_ptr + p * 8
    nch = tl.load(rec + 6)
    if nch > 0:  # a live program (the table's dead rows are zeros)
        if TIMING:
            tl.store(times_ptr + p * 8 + 1, _now())
            tl.store(times_ptr + p * 8 + 2, 0)  # stays 0 unless it computes its own chunk
            tl.store(times_ptr + p * 8 + 3, 0)
            tl.store(times_ptr + p * 8 + 6, tl_cuda.smid())
        i = tl.load(rec)
        s = tl.load(rec + 1)
        start = tl.load(rec + 2)
        end = tl.load(rec + 3)
        r = tl.load(rec + 4)
        c = tl.load(rec + 5)
        n_prog = tl.load(rec + 7)
        t = start + tl.arange(0, BLOCK_T)
        t_live = t < end
        done_ptr = cnt_ptr + i * (1 + MAX_CH)
        claimed = 1
        if c < nch:
            claimed = tl.atomic_xchg(done_ptr + 1 + c, 1)
        if claimed == 0:  # this program's own chunk, unless taken
            if TIMING:
                tl.store(times_ptr + p * 8 + 2, _now())
            _coop_chunk(c, i, s, r, t, t_live, x_ptr, rows_ptr, a_rows_ptr, part_ptr, BLOCK_T, RANK_TILE,
                        K_TILE, N_KC, FIN, W, RA, R_PAD, F32_DOT)
            tl.debug_barrier()  # every thread's stores before the count that publishes them
            tl.atomic_add(done_ptr, 1, sem="release")
            if TIMING:
                tl.store(times_ptr + p * 8 + 3, _now())
        spins = 0
        # (bounded, ~1 s: were the counters ever wrong, the launch ends with a wrong y instead of hanging)
        while (tl.atomic_add(done_ptr, 0, sem="acquire") < nch) & (spins < 1 << 20):
            spins += 1
            if spins > SPINS:  # the owners of the rest are not running: compute what nobody claimed
                for q in range(0, nch):
                    if tl.atomic_xchg(done_ptr + 1 + q, 1) == 0:
                        _coop_chunk(q, i, s, r, t, t_live, x_ptr, rows_ptr, a_rows_ptr, part_ptr, BLOCK_T,
                                    RANK_TILE, K_TILE, N_KC, FIN, W, RA, R_PAD, F32_DOT)
                        tl.debug_barrier()
                        tl.atomic_add(done_ptr, 1, sem="release")
        tl.debug_barrier()
        if TIMING:
            tl.store(times_ptr + p * 8 + 4, _now())
        tok = tl.arange(0, BLOCK_T)
        for o in range(c, FOUT // COL_TILE, n_prog):  # this program's output column tiles
            col = o * COL_TILE
            acc = tl.zeros((BLOCK_T, COL_TILE), tl.float32)
            for kt in range(0, tl.cdiv(r, RANK_TILE)):
                j = kt * RANK_TILE + tl.arange(0, RANK_TILE)
                j_live = j < r
                xat = tl.zeros((BLOCK_T, RANK_TILE), tl.float32)
                for kc in tl.static_range(N_KC):  # the sum of the partial planes (from L2)
                    plane = (i * N_KC + kc) * BLOCK_T + tok
                    xat += tl.load(part_ptr + plane[:, None] * R_PAD + j[None, :], mask=j_live[None, :], other=0,
                                   cache_modifier=".cg")
                bt = _gather_tile(rows_ptr, b_rows_ptr, s, tl.where(j_live, j, 0) * FOUT + col, j_live, RB, W,
                                  COL_TILE)  # [RANK_TILE, C]
                acc = tl.dot(xat.to(bt.dtype), bt, acc, input_precision=F32_DOT)
            tile = t[:, None] * FOUT + col + tl.arange(0, COL_TILE)[None, :]
            y = tl.load(y_ptr + tile, mask=t_live[:, None], other=0)
            tl.store(y_ptr + tile, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=t_live[:, None])
        if TIMING:
            tl.store(times_ptr + p * 8 + 5, _now())


# ---------------------------------------------------------------------------------------------
# The rank-split decode kernel (triton_kernels/ranksplit.py): a program per (token group of one slot,
# RC rank rows of its adapter) computes its rows' share of the shrink over all of `in` and their
# share of the expand over all of `out`, and adds it into y with fire-and-forget vector atomics.
# No program waits on another.


@triton.jit
def _rids(rid_ptr, u, ok, MP: tl.constexpr, RC: tl.constexpr):
    """[RC, MP]: unit u's pool row of each chunk of its rank rows' matrix rows (rid [U, MP, RC]); 0
    where not ok."""
    m = tl.arange(0, MP)
    return tl.load(rid_ptr + u * (MP * RC) + m[None, :] * RC + tl.arange(0, RC)[:, None], mask=ok, other=0)


@triton.jit
def _rows_tile(rows_ptr, rid, j, live, F: tl.constexpr, W: tl.constexpr, C: tl.constexpr,
               M: tl.constexpr, MP: tl.constexpr):
    """[RC, MP, C]: rank rows j's matrix rows (F elements each: M chunks of C, padded to MP) from the
    pool rows rid [RC, MP] (_rids). Rows not live and chunks past M read nothing (0)."""
    m = tl.arange(0, MP)
    off = rid.to(tl.int64) * W + (j[:, None] * F + m[None, :] * C) % W
    off = tl.multiple_of(off, [C, C])  # chunks start C-aligned: 16-byte loads
    mask = live[:, None, None] & (m < M)[None, :, None]
    return tl.load(rows_ptr + off[:, :, None] + tl.arange(0, C)[None, None, :], mask=mask, other=0)


@triton.jit
def _stamp_after(v, when, times_ptr, slot, TIMING: tl.constexpr):
    """TIMING: the global timer into times[slot] once v (a float32 tensor) is computed, if `when`."""
    if TIMING:
        if when & (tl.sum(v) != 3.25e38):  # (the sum: the branch waits for v)
            tl.store(times_ptr + slot, _now())


@triton.jit
def _add_into(ptr, v, mask, never, ADDS: tl.constexpr):
    """v into y at ptr: ADDS 0, relaxed vector atomic adds (the kernel); the probes of where the
    time goes (bench/ranksplit_timing.py --probe; wrong wherever units share y rows): 1, plain
    stores; 2 and 3, nothing written (`never`, a condition the compiler cannot fold, keeps v
    computed)."""
    if ADDS == 0:
        tl.atomic_add(ptr, v, mask=mask, sem="relaxed")
    elif ADDS == 1:
        tl.store(ptr, v, mask=mask)
    else:
        tl.store(ptr, v, mask=mask & never)


@triton.jit
def _unit_entry(u, ok, meta_ptr, arid_ptr, brid_ptr, RC: tl.constexpr, MAP: tl.constexpr, MBP: tl.constexpr):
    """Unit u's table entry: t0, t1 (its tokens), n (live rank rows), j0 (the first), and the pool
    rows of its A^T and B chunks ([RC, MAP], [RC, MBP]); a dead unit (n = 0) where not ok."""
    rec = meta_ptr + u * 4
    t0 = tl.load(rec, mask=ok, other=0)
    t1 = tl.load(rec + 1, mask=ok, other=0)
    n = tl.load(rec + 2, mask=ok, other=0)
    j0 = tl.load(rec + 3, mask=ok, other=0)
    return t0, t1, n, j0, _rids(arid_ptr, u, ok, MAP, RC), _rids(brid_ptr, u, ok, MBP, RC)


@triton.jit
def _unit_rows(t0, t1, n, j0, ra, rb, x_ptr, rows_ptr, RC: tl.constexpr, BLOCK_T: tl.constexpr,
               FIN: tl.constexpr, FOUT: tl.constexpr, W: tl.constexpr, CA: tl.constexpr, MA: tl.constexpr,
               MAP: tl.constexpr, CB: tl.constexpr, MB: tl.constexpr, MBP: tl.constexpr):
    """A unit's A^T rows [RC, MAP, CA], B rows [RC, MBP, CB] and its first step's x [BLOCK_T, MAP, CA]
    (the pool's and x's dtypes), in one trip; a dead unit reads nothing."""
    j = j0 + tl.arange(0, RC)
    live = tl.arange(0, RC) < n
    a = _rows_tile(rows_ptr, ra, j, live, FIN, W, CA, MA, MAP)
    b = _rows_tile(rows_ptr, rb, j, live, FOUT, W, CB, MB, MBP)
    return a, b, _x_step(x_ptr, t0, t1, n > 0, BLOCK_T, FIN, CA, MA, MAP)


@triton.jit
def _x_step(x_ptr, t_first, t1, ok, BLOCK_T: tl.constexpr, FIN: tl.constexpr, CA: tl.constexpr,
            MA: tl.constexpr, MAP: tl.constexpr):
    """x of tokens t_first .. t_first + BLOCK_T - 1 below t1, as [BLOCK_T, MAP, CA] (0 past them)."""
    tt = tl.arange(0, BLOCK_T)[:, None, None]
    ma = tl.arange(0, MAP)[:, None]
    xk = ma * CA + tl.arange(0, CA)[None, :]
    return tl.load(x_ptr + (t_first + tt) * FIN + xk[None, :, :],
                   mask=ok & (t_first + tt < t1) & (ma < MA)[None, :, :], other=0)


@triton.jit
def _unit_step(t_first, t1, n, a, b, x_step, y_ptr, times_ptr, slot, first, RC: tl.constexpr, BLOCK_T: tl.constexpr,
               FOUT: tl.constexpr, CB: tl.constexpr, MB: tl.constexpr, MBP: tl.constexpr,
               TIMING: tl.constexpr, ADDS: tl.constexpr):
    """One step of a unit's token loop: tokens t_first .. (BLOCK_T of them, below t1)' xa over the
    unit's rank rows and their deltas, added into y. At BLOCK_T 2 (decode's pairs) both tokens' xa
    come before both deltas; else a token at a time. TIMING: the step stamps times[slot + 2, 3] if
    `first` (the program's first unit's first step). x_step's token axis stays within each thread, so
    taking a token's row is free."""
    never = n > 1 << 20  # (the probes' store condition: n <= RC always)
    mb = tl.arange(0, MBP)[:, None]
    yk = mb * CB + tl.arange(0, CB)[None, :]
    tt = tl.arange(0, BLOCK_T)[:, None, None]
    rty = a.dtype
    x_all = x_step.to(tl.float32)
    if ADDS == 3:  # the reads-only probe: every load kept, almost no arithmetic
        v = tl.sum(a.to(tl.float32), axis=0) + tl.sum(b.to(tl.float32), axis=0) + tl.sum(x_all, axis=0)
        _add_into(y_ptr + yk, v.to(y_ptr.dtype.element_ty), mb < MB, never, ADDS)
    elif BLOCK_T == 2:
        af = a.to(tl.float32)
        xa0 = tl.sum(tl.sum(af * tl.sum(tl.where(tt == 0, x_all, 0.0), axis=0)[None, :, :], axis=2), axis=1)
        xa1 = tl.sum(tl.sum(af * tl.sum(tl.where(tt == 1, x_all, 0.0), axis=0)[None, :, :], axis=2), axis=1)
        xa0 = xa0.to(rty).to(tl.float32)                                   # [RC], as the pair stores xa
        xa1 = xa1.to(rty).to(tl.float32)
        _stamp_after(xa0 + xa1, first, times_ptr, slot + 2, TIMING)
        bf = b.to(tl.float32)
        d0 = tl.sum(xa0[:, None, None] * bf, axis=0)                       # [MBP, CB]
        d1 = tl.sum(xa1[:, None, None] * bf, axis=0)
        _stamp_after(d0 + d1, first, times_ptr, slot + 3, TIMING)
        _add_into(y_ptr + t_first * FOUT + yk, d0.to(y_ptr.dtype.element_ty), mb < MB, never, ADDS)
        _add_into(y_ptr + (t_first + 1) * FOUT + yk, d1.to(y_ptr.dtype.element_ty),
                  (t_first + 1 < t1) & (mb < MB), never, ADDS)
    else:
        for k in tl.static_range(BLOCK_T):
            xt = tl.sum(tl.where(tt == k, x_all, 0.0), axis=0)                          # [MAP, CA]
            xa = tl.sum(tl.sum(a.to(tl.float32) * xt[None, :, :], axis=2), axis=1).to(rty).to(tl.float32)
            if k == 0:
                _stamp_after(xa, first, times_ptr, slot + 2, TIMING)
            d = tl.sum(xa[:, None, None] * b.to(tl.float32), axis=0)                     # [MBP, CB]
            if k == 0:
                _stamp_after(d, first, times_ptr, slot + 3, TIMING)
            _add_into(y_ptr + (t_first + k) * FOUT + yk, d.to(y_ptr.dtype.element_ty),
                      (t_first + k < t1) & (mb < MB), never, ADDS)


@triton.jit
def _unit_compute(t0, t1, n, a, b, x0, x_ptr, y_ptr, times_ptr, slot, first, RC: tl.constexpr, BLOCK_T: tl.constexpr,
                  FIN: tl.constexpr, FOUT: tl.constexpr, CA: tl.constexpr, MA: tl.constexpr, MAP: tl.constexpr,
                  CB: tl.constexpr, MB: tl.constexpr, MBP: tl.constexpr, TIMING: tl.constexpr, ADDS: tl.constexpr):
    """A unit's token loop over its rows a, b: the first step on x0 (loaded with the rows), the others
    loading their x (loads do not pass the adds before them)."""
    _unit_step(t0, t1, n, a, b, x0, y_ptr, times_ptr, slot, first, RC, BLOCK_T, FOUT, CB, MB, MBP, TIMING, ADDS)
    for t_first in range(t0 + BLOCK_T, t1, BLOCK_T):
        x_step = _x_step(x_ptr, t_first, t1, n > 0, BLOCK_T, FIN, CA, MA, MAP)
        _unit_step(t_first, t1, n, a, b, x_step, y_ptr, times_ptr, slot, False, RC, BLOCK_T, FOUT, CB, MB, MBP, 0, ADDS)


@triton.jit
def _bits(v):
    """v's elements as integers of their width (a bitcast)."""
    if v.dtype.primitive_bitwidth == 16:
        r = v.to(tl.int16, bitcast=True)
    else:
        r = v.to(tl.int32, bitcast=True)
    return r


@triton.jit
def _after_all(v, z):
    """v unchanged (z is 0 when it runs), but each element now waits on z, which waits on every load
    behind it: ptxas otherwise starts the arithmetic on a tile's first loads before it issues the
    last ones, which then go out a trip late (its SASS for _unit_phased showed B's four 16-byte
    loads a thread issued in three rounds)."""
    return (_bits(v) + z.to(_bits(v).dtype)).to(v.dtype, bitcast=True)


@triton.jit
def _first_words(v):
    """int32 of v's shape: in each 16 bytes of a thread's elements (one vector load where v was loaded
    16-byte aligned), every element the first 32-bit word. Inline PTX (compiled only): copies that
    ptxas folds, so a sum of them costs an add a load, where _bits' costs one an element."""
    if v.dtype.primitive_bitwidth == 16:
        r = tl.inline_asm_elementwise("{ mov.b32 $0, $8; mov.b32 $1, $8; mov.b32 $2, $8; mov.b32 $3, $8; "
                                      "mov.b32 $4, $8; mov.b32 $5, $8; mov.b32 $6, $8; mov.b32 $7, $8; }",
                                      "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [v], dtype=tl.int32, is_pure=True, pack=8)
    else:
        r = tl.inline_asm_elementwise("{ mov.b32 $0, $4; mov.b32 $1, $4; mov.b32 $2, $4; mov.b32 $3, $4; }",
                                      "=r,=r,=r,=r,r,r,r,r", [v], dtype=tl.int32, is_pure=True, pack=4)
    return r


@triton.jit
def _after_words(v, z):
    """_after_all in inline PTX (compiled only): z (int32, 0 when it runs) added to each 32-bit word of
    v, one add a register where _after_all unpacks 16-bit elements (its SASS: ~200 instructions a
    warp a unit of the phased form, a quarter of them all)."""
    if v.dtype.primitive_bitwidth == 16:
        r = tl.inline_asm_elementwise("add.s32 $0, $1, $2;", "=r,r,r,r", [v, z], dtype=v.dtype, is_pure=True, pack=2)
    else:
        r = tl.inline_asm_elementwise("add.s32 $0, $1, $2;", "=r,r,r", [v, z], dtype=v.dtype, is_pure=True, pack=1)
    return r


@triton.jit
def _words(v, HOLD: tl.constexpr):
    """Integers of v's loads for a hold to sum: _first_words at HOLD 2, else _bits."""
    if HOLD == 2:
        r = _first_words(v)
    else:
        r = _bits(v)
    return r


@triton.jit
def _held(v, z, HOLD: tl.constexpr):
    """v waiting on z: _after_words at HOLD 2, else _after_all."""
    if HOLD == 2:
        r = _after_words(v, z)
    else:
        r = _after_all(v, z)
    return r


@triton.jit
def _f32(v, FAST: tl.constexpr):
    """v as float32. FAST (bf16 only, compiled only: the interpreter runs no PTX): two instructions a
    pair of elements (the low one shifted up, the high one masked) where ptxas's own conversion
    takes three (PRMT, SHF, IMAD.U32)."""
    if FAST and v.dtype == tl.bfloat16:
        r = tl.inline_asm_elementwise("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }", "=r,=r,r", [v],
                                      dtype=tl.float32, is_pure=True, pack=2)
    else:
        r = v.to(tl.float32)
    return r


@triton.jit
def _x_row(x_ptr, t, ok, FIN: tl.constexpr, CA: tl.constexpr, MA: tl.constexpr, MAP: tl.constexpr):
    """x[t] as [MAP, CA] (0 where not ok or past MA chunks)."""
    ma = tl.arange(0, MAP)[:, None]
    return tl.load(x_ptr + t * FIN + ma * CA + tl.arange(0, CA)[None, :], mask=ok & (ma < MA), other=0)


@triton.jit
def _unit_phased(u, meta_ptr, arid_ptr, brid_ptr, x_ptr, rows_ptr, y_ptr, RC: tl.constexpr, FIN: tl.constexpr,
                 FOUT: tl.constexpr, W: tl.constexpr, CA: tl.constexpr, MA: tl.constexpr, MAP: tl.constexpr,
                 CB: tl.constexpr, MB: tl.constexpr, MBP: tl.constexpr, ADDS: tl.constexpr, HOLD: tl.constexpr,
                 FAST_CVT: tl.constexpr):
    """Unit u (live, at most two tokens) in two trips: its A^T rows and x, their xa; then its B rows,
    the two deltas and their adds. One matrix is held at a time, so a program takes about half the
    registers of the one-trip form and several programs share an SM: one's trips overlap another's
    arithmetic (the PHASED form). HOLD: each trip's loads all go out before its first product
    (HOLD 1: _after_all; 2: _after_words, compiled only). FAST_CVT: _f32's inline PTX."""
    t0, t1, n, j0, ra, rb = _unit_entry(u, True, meta_ptr, arid_ptr, brid_ptr, RC, MAP, MBP)
    never = n > 1 << 20  # (n <= RC always: a condition the compiler cannot fold)
    j = j0 + tl.arange(0, RC)
    live = tl.arange(0, RC) < n
    a = _rows_tile(rows_ptr, ra, j, live, FIN, W, CA, MA, MAP)
    x0 = _x_row(x_ptr, t0, n > 0, FIN, CA, MA, MAP)
    x1 = _x_row(x_ptr, t0 + 1, (n > 0) & (t0 + 1 < t1), FIN, CA, MA, MAP)
    if HOLD:
        za = tl.where(never, tl.sum(_words(a, HOLD), axis=0) + _words(x0, HOLD) + _words(x1, HOLD)
                      + tl.sum(tl.sum(rb, axis=1), axis=0), 0)
        a = _held(a, za[None], HOLD)
        x0 = _held(x0, za, HOLD)
        x1 = _held(x1, za, HOLD)
    rty = a.dtype
    af = _f32(a, FAST_CVT)
    xa0 = tl.sum(tl.sum(af * _f32(x0, FAST_CVT)[None, :, :], axis=2), axis=1)
    xa1 = tl.sum(tl.sum(af * _f32(x1, FAST_CVT)[None, :, :], axis=2), axis=1)
    xa0 = xa0.to(rty).to(tl.float32)                                   # [RC], as the pair stores xa
    xa1 = xa1.to(rty).to(tl.float32)
    # B's trip after the shrink: a row's mask waits on its xa (a NaN xa reads no B, its deltas NaN still)
    b = _rows_tile(rows_ptr, rb, j, live & (xa0 + xa1 == xa0 + xa1), FOUT, W, CB, MB, MBP)
    if HOLD:
        b = _held(b, tl.where(never, tl.sum(_words(b, HOLD), axis=0), 0)[None], HOLD)
    bf = _f32(b, FAST_CVT)
    mb = tl.arange(0, MBP)[:, None]
    yk = mb * CB + tl.arange(0, CB)[None, :]
    d0 = tl.sum(xa0[:, None, None] * bf, axis=0)                       # [MBP, CB]
    d1 = tl.sum(xa1[:, None, None] * bf, axis=0)
    _add_into(y_ptr + t0 * FOUT + yk, d0.to(y_ptr.dtype.element_ty), mb < MB, never, ADDS)
    _add_into(y_ptr + (t0 + 1) * FOUT + yk, d1.to(y_ptr.dtype.element_ty), (t0 + 1 < t1) & (mb < MB), never, ADDS)


@triton.jit
def lora_ranksplit_kernel(total_ptr, meta_ptr, arid_ptr, brid_ptr, x_ptr, rows_ptr, _y_in_ptr, y_ptr, times_ptr,
                          RC: tl.constexpr, BLOCK_T: tl.constexpr, FIN: tl.constexpr, FOUT: tl.constexpr,
                          W: tl.constexpr, CA: tl.constexpr, MA: tl.constexpr, MAP: tl.constexpr,
                          CB: tl.constexpr, MB: tl.constexpr, MBP: tl.constexpr, N_PROGRAMS: tl.constexpr,
                          NU: tl.constexpr, PREFETCH: tl.constexpr = 0, TIMING: tl.constexpr = 0,
                          ADDS: tl.constexpr = 0, EMPTY: tl.constexpr = 0, PHASED: tl.constexpr = 0,
                          HOLD: tl.constexpr = 1, FAST_CVT: tl.constexpr = 0):
    """y[t] += (x[t] @ A_s[:, J]) @ B_s[J, :] for every unit (tokens [t0, t1) of slot s, its rank rows
    J = j0 .. j0 + n - 1): meta [NU, 4] = (t0, t1, n, j0), zeros past the total [1] live units; A^T
    rows from arid [NU, MAP, RC], B rows from brid [NU, MBP, RC]. y_ptr aliases _y_in_ptr. Program p
    takes unit p without waiting for the total (the grid is at most NU), then p + N_PROGRAMS, ...
    below it. A unit's loads are all issued before its first product (one trip after its table
    entry); xa stays in registers, rounded to the pool's dtype as the two-kernel pair stores it.
    PREFETCH: a program's next unit's rows (and x) are in flight while it computes a unit, and the
    table entry of the one after that: its loads overlap its arithmetic (two units' rows held).
    Without it a unit's rows are loaded when the unit before is done.
    TIMING (bench/ranksplit_timing.py): times [programs, 8] int32 gets the global timer (_now) at the
    program's start, once its first entry is read, once its first xa and its first delta are computed,
    at its end, then its SM and its unit count. ADDS (_add_into) and EMPTY (a program reads its
    first entry and ends) are probes of the launch's cost, never the engine's.
    PHASED (units of at most two tokens, BLOCK_T 2; no TIMING, no PREFETCH): each unit in two trips
    (_unit_phased), programs walking p, p + N_PROGRAMS, ... below the total only."""
    p = tl.program_id(0)
    if PHASED:
        for u in range(p, tl.load(total_ptr), N_PROGRAMS):
            _unit_phased(u, meta_ptr, arid_ptr, brid_ptr, x_ptr, rows_ptr, y_ptr, RC, FIN, FOUT, W, CA, MA, MAP,
                         CB, MB, MBP, ADDS, HOLD, FAST_CVT)
        return
    if TIMING:
        tl.store(times_ptr + p * 8, _now())
    if EMPTY:
        n = tl.load(meta_ptr + p * 4 + 2)
        tl.store(y_ptr + tl.arange(0, 2), tl.zeros([2], y_ptr.dtype.element_ty), mask=tl.arange(0, 2) < n - 1000)
        return
    t0, t1, n, j0, ra, rb = _unit_entry(p, p < NU, meta_ptr, arid_ptr, brid_ptr, RC, MAP, MBP)
    if PREFETCH:
        u1 = p + N_PROGRAMS
        t0n, t1n, nn, j0n, ran, rbn = _unit_entry(u1, u1 < NU, meta_ptr, arid_ptr, brid_ptr, RC, MAP, MBP)
    a, b, x0 = _unit_rows(t0, t1, n, j0, ra, rb, x_ptr, rows_ptr, RC, BLOCK_T, FIN, FOUT, W, CA, MA, MAP, CB, MB, MBP)
    if TIMING:
        if n >= 0:  # (always: the stamp waits for the entry)
            tl.store(times_ptr + p * 8 + 1, _now())
    total = tl.load(total_ptr)
    units = 0
    if PREFETCH:
        for u in range(p, total, N_PROGRAMS):
            an, bn, x0n = _unit_rows(t0n, t1n, nn, j0n, ran, rbn, x_ptr, rows_ptr, RC, BLOCK_T, FIN, FOUT, W, CA, MA,
                                     MAP, CB, MB, MBP)
            u2 = u + 2 * N_PROGRAMS
            t0f, t1f, nf, j0f, raf, rbf = _unit_entry(u2, u2 < NU, meta_ptr, arid_ptr, brid_ptr, RC, MAP, MBP)
            _unit_compute(t0, t1, n, a, b, x0, x_ptr, y_ptr, times_ptr, p * 8, u == p, RC, BLOCK_T, FIN, FOUT, CA, MA, MAP,
                          CB, MB, MBP, TIMING, ADDS)
            t0, t1, n, a, b, x0 = t0n, t1n, nn, an, bn, x0n
            t0n, t1n, nn, j0n, ran, rbn = t0f, t1f, nf, j0f, raf, rbf
            units += 1
    else:
        _unit_compute(t0, t1, n, a, b, x0, x_ptr, y_ptr, times_ptr, p * 8, True, RC, BLOCK_T, FIN, FOUT, CA, MA, MAP,
                      CB, MB, MBP, TIMING, ADDS)
        units = 1
        for u in range(p + N_PROGRAMS, total, N_PROGRAMS):
            t0, t1, n, j0, ra, rb = _unit_entry(u, True, meta_ptr, arid_ptr, brid_ptr, RC, MAP, MBP)
            a, b, x0 = _unit_rows(t0, t1, n, j0, ra, rb, x_ptr, rows_ptr, RC, BLOCK_T, FIN, FOUT, W, CA, MA, MAP,
                                  CB, MB, MBP)
            _unit_compute(t0, t1, n, a, b, x0, x_ptr, y_ptr, times_ptr, p * 8, False, RC, BLOCK_T, FIN, FOUT, CA, MA, MAP,
                          CB, MB, MBP, 0, ADDS)
            units += 1
    if TIMING:
        tl.store(times_ptr + p * 8 + 4, _now())
        tl.store(times_ptr + p * 8 + 5, tl_cuda.smid())
        tl.store(times_ptr + p * 8 + 6, units)
