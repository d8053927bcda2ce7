"""A decode step's LoRA shrink and expand in one launch with no program waiting on another (issue 4).

Why. In a decode step an adapter holds a token or two, so its LoRA work is a few hundred KB of A^T
and B rows and almost no arithmetic: the time is memory trips and launches. Two launches (shrink,
then expand) cannot go below ~9 µs at issue 4's point (64 tokens x 32 adapters, llama-7b q/k/v/o;
bench/read_floor.py), and the one-launch forms tried before (session 20's cooperative kernel,
pallas_kernels/onetrip.py's onetrip_apply) make expand programs wait for the shrink's partial sums,
which costs two chains of dependent trips (bench/NOTES.md, sessions 20 and 26).

How. Split the work by rank rows instead of by columns. (x @ A) @ B = sum over rank rows j of
(x . A[:, j]) B[j, :], so a program that owns RC rank rows of one adapter computes their part of xa
over all of `in` and their part of the delta over all of `out` by itself, and adds that part into
y with vector atomic adds (sm_90's REDG.ADD.BF16x8 / F32x4: fire and forget, no fence, no return).
Each A^T row and B row is read once a step, by one program, in the same trip as x; nothing is
published, counted or polled. The cost moved into the atomics: each of an adapter's ceil(r / RC)
programs adds a [tokens, out] part into y (at RC 8 and two tokens an adapter: 16 KB of bf16 adds
for 128 KB of rows read).

Units. The host builds the table with the step's inputs (`plan`): a unit is (up to group_t tokens of
one slot, RC rank rows of its adapter), with its tokens, its count of live rows, its first rank row
and the pool rows of its A^T rows and B rows. Programs walk units p, p + P, ... below the live total
(P <= max_programs; at the defaults a program of 16 warps holds its 4 rank rows' 64 KB of A^T and B
in registers, one program an SM at a time, two waves of 132 at most). In larger launches (the
prefetch form, from prefetch_units table entries on) each of 132 programs of 8 warps keeps its next
unit's rows in flight while it computes one, so its loads overlap its arithmetic (two units' rows
held in registers). A unit loops over its tokens block_t at a time with its rows held, so an
adapter's rows are read once for up to group_t tokens of its slot; base tokens and empty slots have
no units; padding is bounded by one unit's RC rows (rows past the rank are masked: no traffic, no
products that count).

The phased form (`form`: by default where a launch's tokens are at most two a slot on average,
decode over many adapters). Units of at most two tokens, one a program, each in two trips: its A^T
rows and x, their xa; then its B rows, the deltas and their adds. A program holds one matrix at a
time (60 registers in 16 warps: two programs an SM, so one's trip overlaps another's arithmetic),
and each trip's loads all go out before its first product (hold "asm": one add of inline PTX a
register ties every product to every load; ptxas interleaves them otherwise). Issue 4's point
8.05-8.2 µs a launch against the one-trip form's 8.3-8.4 (bench/NOTES.md, session 31).

Precision: products and sums in float32; xa is rounded to the pool's dtype before the expand, as the
two-kernel pair stores it. The atomic adds make y's last bits depend on the order the programs of
one adapter finish in (as every split-K kernel's do); in float32 that is ~1e-7 relative. In a bf16 y
each of an adapter's ceil(r / RC) adds rounds: at issue 4's point the largest error against the
XLA reference is 1.2e-2 of y's largest value at RC 4 and 7.8e-3 at RC 8, against 8e-4 for the
pair, which rounds once (bench/kernels.py, sessions 27-28). test_parity passes through it on the
H200.

Where: any module whose A^T and B rows fall in chunks of C >= 16 elements that never straddle a
pool row (C the largest power of two dividing both the pool width W and the row's length). A row of
M chunks is a tile of M rounded up to a power of two, the rest masked; the engine and kernels.py
take only rows whose M is a power of two (`applies`): q, k, v and o of llama-family models at any
GQA ratio hold whole chunks of C = W. y must be float32, or bfloat16 on sm_90 (the
bf16 vector atomics). Reference: lora.py's lora_shrink_reference then lora_expand_reference on the
same slots (tests/test_ranksplit.py: under Triton's interpreter on the CPU, and compiled on a GPU).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.lora import _merge_blocks

BLOCKS = {
    # rank_rows: RC, the rank rows of one adapter a program owns (a power of two); num_warps: its
    # warps (16 x 32 threads x 128 registers fills an SM's 64K registers at RC 8; RC 4 in 8 warps
    # takes 170 registers a thread, one program an SM resident at a time); block_t: tokens
    # a step of its token loop; group_t: most tokens of one slot a unit takes (a multiple of
    # block_t); max_programs: programs a launch at most (132: the H200's SMs). (Lost on the H200 at
    # issue 4's point and removed, session 27: a step's tokens in one 4-D product, 13.0 µs; a unit's
    # rows in two halves whose second's loads precede the first's products, 12.3; against 11.4-11.6.)
    # decode: the engine's decode steps take the kernel (paged.ranksplit_plans) where their slot
    # bucket is within [min_slots, max_slots] and jax-triton runs. H200, llama-7b, B 64 (session 27):
    # the step -5.8% at 32 adapters, -2% at 64, +2% at 8 (too few units to fill the GPU).
    # Session 28: rank_rows 4 in 8 warps, two programs an SM (264), replaced 8 in 16 warps (132):
    # ~1700 warp instructions a rank row against ~2100 and no spills (bench/ranksplit_sass.py);
    # issue 4's point 10.15-10.6 µs against 11.3-11.6 (five runs), the llama-7b B 64 x 32 decode
    # step 11.62 ms against 12.06 (LoRA kernels 1.270 against 1.445 ms).
    # Session 29 (bench/ranksplit_timing.py --probe, one process a point, device µs a launch; the
    # defaults then were rank_rows 4 in 8 warps, 264 programs, no prefetch):
    #   64 x 32: 8 warps 9.01-9.12, 16 warps (106 registers, one program an SM) 8.33-8.39,
    #            prefetch in 8 warps over 132 programs 8.71-8.97;
    #   256 x 32: 19.2-19.6 / 18.3-18.4 / 17.7-17.8;  256 x 256: 48.4-48.8 / 46.2 / 37.5-37.6.
    # prefetch: a program's next unit's rows and x in flight while it computes a unit (two units'
    # rows held: 247 registers in 8 warps; in 16 warps it spills). None: taken where the table's
    # bound (bound_units) is at least prefetch_units, with prefetch_warps and prefetch_programs in
    # place of num_warps and max_programs; True / False: always / never.
    # B 64 x 32 decode step (llama-7b, profile_step): 11.36 against 11.45 ms (LoRA 1.045 against 1.133).
    # max_slots stays 64. At 256 the S2 decode step's device time drops (B 172 x 156 adapters,
    # context 430, hybrid/pallas: 21.70 against 23.57 ms, LoRA kernels 3.19 against 5.05), but S2
    # serving did not move (20.72 against 20.59 req/s, decode steps 22.90 against 22.75 ms of wall
    # time, one call each beside the base model's 25.42): the tables' host time (plan, per module,
    # rebuilt as the batch changes) takes what the device saves. Cheaper tables first.
    # Lost and removed: rank_rows 2 (9.1-9.7 at 64 x 32), tiles laid out [vectors, rank rows, 8]
    # (8.49), the next unit's rows asked of L2 by prefetch.global.L2 instead of held (10.5).
    # phased (sessions 30-31): each unit (at most two tokens) in two trips, A^T rows and x then B
    # rows, so a program of 16 warps holds one matrix (60 registers: two programs an SM). None:
    # taken where a launch's tokens are at most phased_per_slot a slot on average (form), in units
    # of two tokens over phased_programs programs (one unit each at decode sizes). hold (phased
    # only): each trip's loads all issued before its first product, "asm" by an add a 32-bit
    # register of inline PTX (compiled only; True: the same in Triton, ~200 instructions a warp a
    # unit more; False: ptxas interleaves them), fast_cvt (phased only): bf16 to float32 in inline
    # PTX. H200, device µs a launch, one process a point (session 31, call 1):
    #   64 x 32: one-trip 8.32 / 8.35, phased (hold True) 8.33, hold "asm" 8.07, + fast_cvt 8.06;
    #   32 x 16: 7.39 / 7.25, 6.47, 5.96, 5.69;   64 x 64: 12.73 / 12.94, 13.02, 12.40, 12.07;
    #   256 x 32 (8 tokens a slot: phased reads each adapter's rows 4 times): 17.88 / 17.70, 21.08,
    #   19.42, 19.02. The one-trip form with its loads held the same way lost (9.96 at 64 x 32);
    #   B's rows asked of L2 by cp.async.bulk.prefetch as A's trip goes out lost (9.8; session 30).
    "ranksplit": dict(rank_rows=4, num_warps=16, num_stages=1, block_t=2, group_t=8, max_programs=264,
                      prefetch=None, prefetch_units=768, prefetch_warps=8, prefetch_programs=132,
                      decode=True, min_slots=16, max_slots=64, phased=None, phased_per_slot=2,
                      phased_programs=1024, hold="asm", fast_cvt=True),
}


if os.environ.get("SLORA_RANKSPLIT_BLOCKS"):  # a benchmark's setting, as SLORA_LORA_BLOCKS for the Pallas kernels
    _merge_blocks(os.environ["SLORA_RANKSPLIT_BLOCKS"], "SLORA_RANKSPLIT_BLOCKS", BLOCKS)


def decode_takes(slots: int) -> bool:
    """Whether a decode step of this slot bucket takes the kernel (BLOCKS["ranksplit"]: decode on,
    min_slots to max_slots slots) where it can run (a GPU with jax-triton)."""
    from triton_kernels.lora import unavailable_reason
    s = BLOCKS["ranksplit"]
    return bool(s["decode"]) and s["min_slots"] <= slots <= s["max_slots"] and unavailable_reason() is None


def set_blocks(over: str | dict | None = None) -> dict:
    """Merge a setting (JSON text or dict, e.g. {"ranksplit": {"rank_rows": 4}}) into BLOCKS."""
    if over:
        _merge_blocks(over, "ranksplit.set_blocks", BLOCKS)
    return BLOCKS


def form(t: int, slots: int | None, settings=None) -> dict:
    """The settings a launch of t tokens over `slots` slots takes: BLOCKS["ranksplit"] (or settings)
    with `phased` decided where it is None: the phased form where the launch's tokens are at most
    phased_per_slot a slot on average (decode over many adapters: units of two tokens read each
    adapter's rows once), with group_t and block_t 2, no prefetch and phased_programs programs.
    An explicit phased is taken as given (launch_args checks it)."""
    s = dict(settings or BLOCKS["ranksplit"])
    if s.get("phased") is None:
        if slots is None:
            raise ValueError('BLOCKS["ranksplit"]["phased"] is None (by size): pass the launch\'s slots')
        s["phased"] = t <= s["phased_per_slot"] * slots
        if s["phased"]:
            s.update(group_t=2, block_t=2, prefetch=False, max_programs=s["phased_programs"])
    return s


def _chunk(width: int, features: int) -> tuple[int, int, int]:
    """(C, M, MP): a matrix row of `features` elements as M chunks of C, C the largest power of two
    dividing W and features; MP: M rounded up to a power of two (the kernel's tile; chunks past M
    are masked). (0, 0, 0) where C < 16 (Triton's 16-byte loads want whole 8-element vectors)."""
    c = min(width & -width, features & -features)
    if c < 16:
        return 0, 0, 0
    m = features // c
    return c, m, 1 << (m - 1).bit_length()


def applies(width: int, fin: int, fout: int, y_dtype=None, padded: bool = False) -> bool:
    """Whether the kernel takes this module: both matrices in chunks of at least 16 elements that
    never straddle pool rows, and a y dtype the vector atomics add (float32; bfloat16 on sm_90).
    padded: also rows of a chunk count that is not a power of two (its tile padded, the padding's
    registers held anyway: llama-13b's 5120 as 8 chunks of 1024 doubles a program's registers, which
    spill). The engine and kernels.py take exact tiles only; the tests take both."""
    (ca, ma, mpa), (cb, mb, mpb) = _chunk(width, fin), _chunk(width, fout)
    if not (ca and cb) or (not padded and (ma != mpa or mb != mpb)):
        return False
    return y_dtype is None or jnp.dtype(y_dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def bound_units(t: int, slots: int, max_rank: int, settings=None) -> int:
    """Most units any step of t tokens over `slots` slots can need: its token groups (sum of
    ceil(len / group_t)) times ceil(max_rank / RC)."""
    s = form(t, slots, settings)
    g = s["group_t"]
    return max(1, (t + slots * (g - 1)) // g) * -(-max_rank // s["rank_rows"])


def plan(ranks, a_rows, b_rows, seg_starts, t: int, *, fin: int, fout: int, width: int, max_rank: int,
         settings=None):
    """The launch's table, on the host (numpy): (total [1], meta [U, 4], arid [U, MA, RC], brid
    [U, MB, RC]) int32, U = bound_units. Unit u has meta (first token, end token, live rank rows,
    first rank row j0) and arid[u, m, k] the pool row holding the m-th chunk of A^T row j0 + k (brid:
    of B row j0 + k); entries past the live rows are 0 and never read. ranks [Sa], a_rows / b_rows
    [Sa, RA] / [Sa, RB] the slots' pool row indices (lora.py's layout), seg_starts [Sa + 1].
    settings: form's for t tokens over Sa slots (the launch must take the same: ranksplit_apply's
    slots or settings)."""
    s = form(t, len(ranks), settings)
    rc, g = s["rank_rows"], s["group_t"]
    if g % s["block_t"]:
        raise ValueError(f'BLOCKS["ranksplit"]: group_t {g} is not a multiple of block_t {s["block_t"]}')
    ca, _, ma = _chunk(width, fin)
    cb, _, mb = _chunk(width, fout)
    ranks = np.minimum(np.asarray(ranks, np.int64), max_rank)
    a_rows, b_rows = np.asarray(a_rows, np.int64), np.asarray(b_rows, np.int64)
    seg = np.asarray(seg_starts, np.int64)
    lens = np.maximum(np.diff(seg), 0)
    groups = np.where(ranks > 0, -(-lens // g), 0)                 # token groups of each slot
    tiles = -(-ranks // rc)                                         # rank-row units of each group
    per_slot = groups * tiles
    slot = np.repeat(np.arange(len(ranks)), per_slot)
    k = np.arange(len(slot)) - np.repeat(np.cumsum(per_slot) - per_slot, per_slot)   # unit within its slot
    grp, tile = k // np.maximum(tiles[slot], 1), k % np.maximum(tiles[slot], 1)
    t0 = seg[slot] + grp * g
    t1 = np.minimum(t0 + g, seg[slot + 1])
    j0 = tile * rc
    n = np.minimum(ranks[slot] - j0, rc)
    bound = bound_units(t, len(ranks), max_rank, s)
    u = len(slot)
    assert u <= bound, (u, bound)

    def rids(rows, feat, c, m):
        j = j0[:, None, None] + np.arange(rc)[None, None, :]                 # [U, 1, RC]
        flat = j * feat + (np.arange(m) * c)[None, :, None]                  # [U, MP, RC]
        col = np.minimum(flat // width, rows.shape[1] - 1)
        live = (np.arange(rc)[None, None, :] < n[:, None, None]) & (np.arange(m) * c < feat)[None, :, None]
        out = np.zeros((bound, m, rc), np.int32)
        out[:u] = np.where(live, rows[slot[:, None, None], col], 0)
        return out

    meta = np.zeros((bound, 4), np.int32)
    meta[:u] = np.stack([t0, t1, n, j0], axis=1)
    return np.array([u], np.int32), meta, rids(a_rows, fin, ca, ma), rids(b_rows, fout, cb, mb)


PROBES = {"": (0, 0), "stores": (1, 0), "no_adds": (2, 0), "reads_only": (3, 0), "empty": (0, 1)}


def launch_args(y, x, rows, table, *, fin: int, fout: int, settings=None, timing: bool = False, probe: str = "",
                interpret: bool = False):
    """(arrays, constexprs, grid, launch options) for lora_ranksplit_kernel; the last array is y,
    which the output aliases (the kernel's next argument, times, is a second output: [programs, 8]
    int32 with timing, else one unused entry). table: plan's four arrays. probe (PROBES; bench/
    ranksplit_timing.py --probe only, its y is wrong): "stores", plain stores for the atomic adds;
    "no_adds", nothing written; "reads_only", every load but almost no arithmetic (at MAP == MBP,
    CA == CB only); "empty", each program reads its first entry and ends. settings: form's (phased
    decided). interpret (Triton's interpreter, which runs no PTX): the inline-PTX forms' Triton
    twins (hold "asm" as True, fast_cvt off: the same values, more instructions)."""
    s = settings or BLOCKS["ranksplit"]
    if s.get("phased") is None:
        raise ValueError('ranksplit.launch_args: phased is None; take form(t, slots, settings)\'s settings')
    width = rows.shape[1]
    total, meta, arid, brid = (jnp.asarray(a, jnp.int32) for a in table)
    ca, ma, map_ = _chunk(width, fin)
    cb, mb, mbp = _chunk(width, fout)
    if arid.shape[1:] != (map_, s["rank_rows"]) or brid.shape[1:] != (mbp, s["rank_rows"]):
        raise ValueError(f"ranksplit table shapes {arid.shape}, {brid.shape} are not plan's for in {fin}, "
                         f"out {fout}, width {width}, rank_rows {s['rank_rows']}")
    phased = bool(s.get("phased"))
    if phased and (s["block_t"] != 2 or s["group_t"] != 2 or s["prefetch"] or timing):
        raise ValueError('BLOCKS["ranksplit"]: the phased form takes block_t 2, group_t 2, no prefetch and '
                         f'no timing (got block_t {s["block_t"]}, group_t {s["group_t"]}, prefetch {s["prefetch"]})')
    prefetch = not phased and takes_prefetch(meta.shape[0], s)
    n_programs = max(1, min(meta.shape[0], s["prefetch_programs" if prefetch else "max_programs"]))
    x = x.astype(jnp.promote_types(x.dtype, rows.dtype))
    arrays = (total, meta, arid, brid, x, rows, y)
    const = dict(RC=s["rank_rows"], BLOCK_T=s["block_t"], FIN=fin, FOUT=fout, W=width, CA=ca, MA=ma, MAP=map_,
                 CB=cb, MB=mb, MBP=mbp, N_PROGRAMS=n_programs, NU=meta.shape[0], PREFETCH=int(prefetch),
                 TIMING=int(timing), ADDS=PROBES[probe][0],
                 EMPTY=PROBES[probe][1], PHASED=int(phased),
                 HOLD=(1 if interpret else 2) if s["hold"] == "asm" else int(bool(s["hold"])),
                 FAST_CVT=int(bool(s["fast_cvt"]) and not interpret))
    return arrays, const, (n_programs,), dict(num_warps=s["prefetch_warps" if prefetch else "num_warps"],
                                              num_stages=s["num_stages"])


def takes_prefetch(units: int, settings=None) -> bool:
    """Whether a launch whose table holds `units` entries (bound_units) takes the prefetch form:
    BLOCKS["ranksplit"]["prefetch"] where set, else from prefetch_units entries on."""
    s = settings or BLOCKS["ranksplit"]
    return bool(s["prefetch"]) if s["prefetch"] is not None else units >= s["prefetch_units"]


def ranksplit_reference(y, x, rows, table, *, fin: int, fout: int, slots=None, settings=None):
    """What the kernel computes, in jnp, from the same table: for each live unit, its tokens' x times
    its A^T rows (float32 sums, rounded to the pool's dtype), times its B rows, added into y. The
    table's check against lora.py's references and the kernel's stand-in off the GPU
    (tests/test_ranksplit.py), with ranksplit_apply's signature. A unit's tokens are [t0, t1): any
    group_t at least the table's covers them. With slots (or a decided phased) that is form's, the
    table's own; else BLOCKS' one-trip group_t, above the phased form's 2."""
    s = settings or BLOCKS["ranksplit"]
    if slots is not None or s["phased"] is not None:
        s = form(y.shape[0], slots, s)
    return _reference(y, x, rows, tuple(table), fin=fin, fout=fout, g=max(s["group_t"], 2))


@functools.partial(jax.jit, static_argnames=("fin", "fout", "g"))
def _reference(y, x, rows, table, *, fin: int, fout: int, g: int):
    total, meta, arid, brid = (jnp.asarray(a, jnp.int32) for a in table)
    width = rows.shape[1]
    t = y.shape[0]
    u = jnp.arange(meta.shape[0])
    rc = arid.shape[2]
    t0, t1, n, j0 = (meta[:, i] for i in range(4))
    live_u = u < total[0]

    def weights(rid, feat):                                   # [U, RC, feat]
        c, _, mp = _chunk(width, feat)
        j = j0[:, None, None] + jnp.arange(rc)[None, None, :]             # [U, 1, RC]
        col = (j * feat + (jnp.arange(mp) * c)[None, :, None]) % width    # [U, MP, RC]
        idx = rid[..., None] * width + col[..., None] + jnp.arange(c)     # [U, MP, RC, C]
        w = rows.reshape(-1)[idx].transpose(0, 2, 1, 3).reshape(len(u), rc, mp * c)[:, :, :feat]
        keep = live_u[:, None] & (jnp.arange(rc)[None, :] < n[:, None])
        return jnp.where(keep[:, :, None], w.astype(jnp.float32), 0)

    a, b = weights(arid, fin), weights(brid, fout)
    tok = t0[:, None] + jnp.arange(g)[None, :]                            # [U, G]
    tok_live = live_u[:, None] & (tok < t1[:, None])
    xs = jnp.where(tok_live[:, :, None], x[jnp.clip(tok, 0, t - 1)].astype(jnp.float32), 0)
    xa = jnp.einsum("ugi,uri->ugr", xs, a, precision=jax.lax.Precision.HIGHEST)
    xa = xa.astype(rows.dtype).astype(jnp.float32)
    d = jnp.einsum("ugr,uro->ugo", xa, b, precision=jax.lax.Precision.HIGHEST)
    d = jnp.where(tok_live[:, :, None], d, 0)
    delta = jnp.zeros((t, fout), jnp.float32).at[jnp.where(tok_live, tok, t).reshape(-1)].add(
        d.reshape(-1, fout), mode="drop")
    return (y.astype(jnp.float32) + delta).astype(y.dtype)


def _frozen(settings=None) -> tuple:
    return tuple(sorted((settings or BLOCKS["ranksplit"]).items()))


@functools.partial(jax.jit, static_argnames=("fin", "fout", "settings", "timing", "probe"))
def _apply(y, x, rows, table, *, fin, fout, settings, timing=False, probe=""):
    """y after the launch; with timing, (y, times [programs, 8]). probe: launch_args'."""
    import jax_triton
    from triton_kernels import _lora_tl

    arrays, const, grid, opts = launch_args(y, x, rows, table, fin=fin, fout=fout, settings=dict(settings),
                                            timing=timing, probe=probe)
    outs = (jax.ShapeDtypeStruct(y.shape, y.dtype), jax.ShapeDtypeStruct((grid[0], 8) if timing else (1,), jnp.int32))
    y, times = jax_triton.triton_call(*arrays, kernel=_lora_tl.lora_ranksplit_kernel, out_shape=outs, grid=grid,
                                      name="lora_ranksplit_triton", input_output_aliases={len(arrays) - 1: 0},
                                      **opts, **const)
    return (y, times) if timing else y


def ranksplit_apply(y, x, rows, table, *, fin: int, fout: int, slots: int | None = None, settings=None,
                    interpret=None):
    """y + (x @ A_s) @ B_s for the tokens of every slot s in `table` (plan's), base tokens unchanged,
    in y's dtype: one launch, in form(y's tokens, slots, settings)'s form (plan's for the same t,
    slots and settings). Compiled on a GPU only (Triton's interpreter runs the kernel body on torch
    tensors in tests/test_triton_kernels.py)."""
    if interpret:
        raise ValueError("triton_kernels run compiled only; Triton's interpreter runs the kernel "
                         "bodies on torch tensors (tests/test_triton_kernels.py)")
    if not applies(rows.shape[1], fin, fout, y.dtype, padded=True):
        raise ValueError(f"ranksplit does not apply to in {fin}, out {fout}, pool width {rows.shape[1]}, "
                         f"y {y.dtype} (see ranksplit.applies)")
    return _apply(y, x, rows, tuple(table), fin=fin, fout=fout, settings=_frozen(form(y.shape[0], slots, settings)))
