"""The @triton.jit body of the rank-split LoRA kernel (see triton_kernels/ranksplit.py).

Pure Triton, no JAX: jax-triton compiles it on a GPU, and Triton's interpreter (TRITON_INTERPRET=1)
runs it on the CPU with torch tensors (tests/triton_interpret.py). Importing this module needs
`triton`; triton_kernels/ranksplit.py imports it lazily.

Every size is a constexpr (JAX shapes are static anyway). Matrices are row-major and contiguous:
x [T, FIN], y [T, FOUT], rows [N, W]; the unit table is ranksplit.plan's (total [1], meta [NU, 4],
arid [NU, MAP, RC], brid [NU, MBP, RC]).
"""

import triton
import triton.language as tl


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
def _add_into(ptr, v, mask):
    """v into y at ptr by relaxed vector atomic adds (fire and forget: no fence, no return)."""
    tl.atomic_add(ptr, v, mask=mask, sem="relaxed")


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
def _unit_step(t_first, t1, a, b, x_step, y_ptr, BLOCK_T: tl.constexpr, FOUT: tl.constexpr, CB: tl.constexpr,
               MB: tl.constexpr, MBP: tl.constexpr):
    """One step of a unit's token loop: tokens t_first .. (BLOCK_T of them, below t1)' xa over the
    unit's rank rows and their deltas, added into y. At BLOCK_T 2 (decode's pairs) both tokens' xa
    come before both deltas; else a token at a time. x_step's token axis stays within each thread, so
    taking a token's row is free."""
    mb = tl.arange(0, MBP)[:, None]
    yk = mb * CB + tl.arange(0, CB)[None, :]
    tt = tl.arange(0, BLOCK_T)[:, None, None]
    rty = a.dtype
    x_all = x_step.to(tl.float32)
    if BLOCK_T == 2:
        af = a.to(tl.float32)
        xa0 = tl.sum(tl.sum(af * tl.sum(tl.where(tt == 0, x_all, 0.0), axis=0)[None, :, :], axis=2), axis=1)
        xa1 = tl.sum(tl.sum(af * tl.sum(tl.where(tt == 1, x_all, 0.0), axis=0)[None, :, :], axis=2), axis=1)
        xa0 = xa0.to(rty).to(tl.float32)                                   # [RC], as the pair stores xa
        xa1 = xa1.to(rty).to(tl.float32)
        bf = b.to(tl.float32)
        d0 = tl.sum(xa0[:, None, None] * bf, axis=0)                       # [MBP, CB]
        d1 = tl.sum(xa1[:, None, None] * bf, axis=0)
        _add_into(y_ptr + t_first * FOUT + yk, d0.to(y_ptr.dtype.element_ty), mb < MB)
        _add_into(y_ptr + (t_first + 1) * FOUT + yk, d1.to(y_ptr.dtype.element_ty), (t_first + 1 < t1) & (mb < MB))
    else:
        for k in tl.static_range(BLOCK_T):
            xt = tl.sum(tl.where(tt == k, x_all, 0.0), axis=0)                          # [MAP, CA]
            xa = tl.sum(tl.sum(a.to(tl.float32) * xt[None, :, :], axis=2), axis=1).to(rty).to(tl.float32)
            d = tl.sum(xa[:, None, None] * b.to(tl.float32), axis=0)                     # [MBP, CB]
            _add_into(y_ptr + (t_first + k) * FOUT + yk, d.to(y_ptr.dtype.element_ty), (t_first + k < t1) & (mb < MB))


@triton.jit
def _unit_compute(t0, t1, n, a, b, x0, x_ptr, y_ptr, BLOCK_T: tl.constexpr, FIN: tl.constexpr, FOUT: tl.constexpr,
                  CA: tl.constexpr, MA: tl.constexpr, MAP: tl.constexpr, CB: tl.constexpr, MB: tl.constexpr,
                  MBP: tl.constexpr):
    """A unit's token loop over its rows a, b: the first step on x0 (loaded with the rows), the others
    loading their x (loads do not pass the adds before them)."""
    _unit_step(t0, t1, a, b, x0, y_ptr, BLOCK_T, FOUT, CB, MB, MBP)
    for t_first in range(t0 + BLOCK_T, t1, BLOCK_T):
        x_step = _x_step(x_ptr, t_first, t1, n > 0, BLOCK_T, FIN, CA, MA, MAP)
        _unit_step(t_first, t1, a, b, x_step, y_ptr, BLOCK_T, FOUT, CB, MB, MBP)


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
                 CB: tl.constexpr, MB: tl.constexpr, MBP: tl.constexpr, HOLD: tl.constexpr,
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
    _add_into(y_ptr + t0 * FOUT + yk, d0.to(y_ptr.dtype.element_ty), mb < MB)
    _add_into(y_ptr + (t0 + 1) * FOUT + yk, d1.to(y_ptr.dtype.element_ty), (t0 + 1 < t1) & (mb < MB))


@triton.jit
def lora_ranksplit_kernel(total_ptr, meta_ptr, arid_ptr, brid_ptr, x_ptr, rows_ptr, _y_in_ptr, y_ptr,
                          RC: tl.constexpr, BLOCK_T: tl.constexpr, FIN: tl.constexpr, FOUT: tl.constexpr,
                          W: tl.constexpr, CA: tl.constexpr, MA: tl.constexpr, MAP: tl.constexpr,
                          CB: tl.constexpr, MB: tl.constexpr, MBP: tl.constexpr, N_PROGRAMS: tl.constexpr,
                          NU: tl.constexpr, PREFETCH: tl.constexpr = 0, PHASED: tl.constexpr = 0,
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
    PHASED (units of at most two tokens, BLOCK_T 2; no PREFETCH): each unit in two trips
    (_unit_phased), programs walking p, p + N_PROGRAMS, ... below the total only."""
    p = tl.program_id(0)
    if PHASED:
        for u in range(p, tl.load(total_ptr), N_PROGRAMS):
            _unit_phased(u, meta_ptr, arid_ptr, brid_ptr, x_ptr, rows_ptr, y_ptr, RC, FIN, FOUT, W, CA, MA, MAP,
                         CB, MB, MBP, HOLD, FAST_CVT)
        return
    t0, t1, n, j0, ra, rb = _unit_entry(p, p < NU, meta_ptr, arid_ptr, brid_ptr, RC, MAP, MBP)
    if PREFETCH:
        u1 = p + N_PROGRAMS
        t0n, t1n, nn, j0n, ran, rbn = _unit_entry(u1, u1 < NU, meta_ptr, arid_ptr, brid_ptr, RC, MAP, MBP)
    a, b, x0 = _unit_rows(t0, t1, n, j0, ra, rb, x_ptr, rows_ptr, RC, BLOCK_T, FIN, FOUT, W, CA, MA, MAP, CB, MB, MBP)
    total = tl.load(total_ptr)
    if PREFETCH:
        for u in range(p, total, N_PROGRAMS):
            an, bn, x0n = _unit_rows(t0n, t1n, nn, j0n, ran, rbn, x_ptr, rows_ptr, RC, BLOCK_T, FIN, FOUT, W, CA, MA,
                                     MAP, CB, MB, MBP)
            u2 = u + 2 * N_PROGRAMS
            t0f, t1f, nf, j0f, raf, rbf = _unit_entry(u2, u2 < NU, meta_ptr, arid_ptr, brid_ptr, RC, MAP, MBP)
            _unit_compute(t0, t1, n, a, b, x0, x_ptr, y_ptr, BLOCK_T, FIN, FOUT, CA, MA, MAP, CB, MB, MBP)
            t0, t1, n, a, b, x0 = t0n, t1n, nn, an, bn, x0n
            t0n, t1n, nn, j0n, ran, rbn = t0f, t1f, nf, j0f, raf, rbf
    else:
        _unit_compute(t0, t1, n, a, b, x0, x_ptr, y_ptr, BLOCK_T, FIN, FOUT, CA, MA, MAP, CB, MB, MBP)
        for u in range(p + N_PROGRAMS, total, N_PROGRAMS):
            t0, t1, n, j0, ra, rb = _unit_entry(u, True, meta_ptr, arid_ptr, brid_ptr, RC, MAP, MBP)
            a, b, x0 = _unit_rows(t0, t1, n, j0, ra, rb, x_ptr, rows_ptr, RC, BLOCK_T, FIN, FOUT, W, CA, MA, MAP,
                                  CB, MB, MBP)
            _unit_compute(t0, t1, n, a, b, x0, x_ptr, y_ptr, BLOCK_T, FIN, FOUT, CA, MA, MAP, CB, MB, MBP)
