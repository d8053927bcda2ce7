"""A decode step's LoRA shrink and expand in one launch with no program waiting on another.

Why. In a decode step an adapter holds a token or two, so its LoRA work is a few hundred KB of A^T
and B rows and almost no arithmetic: the time is memory trips and launches. A shrink launch then an
expand launch pay two launches and two chains of dependent trips; a one-launch form where expand
programs wait for the shrink's partial sums pays the same chains inside one launch.

How. Split the work by rank rows instead of by columns. (x @ A) @ B = sum over rank rows j of
(x . A[:, j]) B[j, :], so a program that owns RC rank rows of one adapter computes their part of xa
over all of `in` and their part of the delta over all of `out` by itself, and adds that part into
y with vector atomic adds (sm_90's REDG.ADD.BF16x8 / F32x4: fire and forget, no fence, no return).
Each A^T row and B row is read once a step, by one program, in the same trip as x; nothing is
published, counted or polled. The cost moves into the atomics: each of an adapter's ceil(r / RC)
programs adds a [tokens, out] part into y.

Units. The host builds the table with the step's inputs (`plan`): a unit is (up to group_t tokens of
one slot, RC rank rows of its adapter), with its tokens, its count of live rows, its first rank row
and the pool rows of its A^T rows and B rows. Programs walk units p, p + P, ... below the live total
(P <= max_programs). In larger launches (the prefetch form, from prefetch_units table entries on)
each program keeps its next unit's rows in flight while it computes one, so its loads overlap its
arithmetic (two units' rows held in registers). A unit loops over its tokens block_t at a time with
its rows held, so an adapter's rows are read once for up to group_t tokens of its slot; base tokens
and empty slots have no units; padding is bounded by one unit's RC rows (rows past the rank are
masked: no traffic, no products that count).

The phased form (`form`: where a launch's tokens are at most phased_per_slot a slot on average,
i.e. decode over many adapters). Units of at most two tokens, one a program, each in two trips: its
A^T rows and x, their xa; then its B rows, the deltas and their adds. A program holds one matrix at
a time (fewer registers: two programs an SM, so one's trip overlaps another's arithmetic), and each
trip's loads all go out before its first product (hold "asm": one add of inline PTX a register ties
every product to every load; ptxas interleaves them otherwise).

Precision: products and sums in float32; xa is rounded to the pool's dtype before the expand, as the
two-kernel pair stores it. The atomic adds make y's last bits depend on the order the programs of
one adapter finish in (as every split-K kernel's do); in float32 that is ~1e-7 relative. In a bf16 y
each of an adapter's ceil(r / RC) adds rounds, so the error against the reference is about ten
times the pair's, which rounds once (tests/test_ranksplit.py's bf16_tol).

Where: any module whose A^T and B rows fall in chunks of C >= 16 elements that never straddle a
pool row (C the largest power of two dividing both the pool width W and the row's length). A row of
M chunks is a tile of M rounded up to a power of two, the rest masked; the engine takes only rows
whose M is a power of two (`applies`): q, k, v and o of llama-family models at any GQA ratio hold
whole chunks of C = W. y must be float32, or bfloat16 on sm_90 (the bf16 vector atomics).
Reference: `ranksplit_reference` (the same table in jnp), checked against lora.py's references
(tests/test_ranksplit.py: under Triton's interpreter on the CPU, and compiled on a GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.block_sizes import device_kind, from_dict, load_tuned

_CONFIGS = Path(__file__).parent / "configs" / "ranksplit.json"


@dataclasses.dataclass(frozen=True)
class RanksplitBlockSizes:
    """The rank-split kernel's launch settings (tuned per device in configs/ranksplit.json; the H200
    values: bench/RESULTS.md, "ranksplit").

    rank_rows: RC, the rank rows of one adapter a program owns (a power of two); num_warps,
    num_stages: a program's; block_t: tokens a step of a unit's token loop; group_t: most tokens of
    one slot a unit takes (a multiple of block_t); max_programs: programs a launch at most.
    prefetch: None, the prefetch form where the table's bound (bound_units) reaches prefetch_units,
    with prefetch_warps and prefetch_programs; True / False: always / never.
    phased: None, the phased form where a launch's tokens are at most phased_per_slot a slot on
    average, over phased_programs programs; True / False: always / never. hold (phased only):
    "asm" (inline PTX, compiled only), True (the same in Triton) or False (no hold); fast_cvt
    (phased only): bf16 to float32 in inline PTX."""
    rank_rows: int = 4
    num_warps: int = 16
    num_stages: int = 1
    block_t: int = 2
    group_t: int = 8
    max_programs: int = 264
    prefetch: bool | None = None
    prefetch_units: int = 768
    prefetch_warps: int = 8
    prefetch_programs: int = 132
    phased: bool | None = None
    phased_per_slot: int = 2
    phased_programs: int = 1024
    hold: str | bool = "asm"
    fast_cvt: bool = True

    @classmethod
    def get_default(cls, device_kind_: str | None = None) -> "RanksplitBlockSizes":
        """The tuned settings of this device kind (the first JAX device's when None), else the defaults."""
        return from_dict(cls, load_tuned(_CONFIGS, device_kind(device_kind_)))


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here (it needs a GPU and jax-triton), or None when it can."""
    if jax.default_backend() != "gpu":
        return f"needs a GPU (JAX's default backend is {jax.default_backend()!r})"
    try:
        for module in ("triton", "jax_triton"):  # jax_triton raises ImportError without a GPU jaxlib
            importlib.import_module(module)
    except ImportError as e:
        return f"needs jax-triton and triton ({type(e).__name__}: {e})"
    return None


def form(t: int, slots: int | None, block_sizes: RanksplitBlockSizes | None = None) -> RanksplitBlockSizes:
    """The settings a launch of t tokens over `slots` slots takes: block_sizes (the defaults when
    None) with `phased` decided where it is None: the phased form where the launch's tokens are at
    most phased_per_slot a slot on average (decode over many adapters: units of two tokens read each
    adapter's rows once), with group_t and block_t 2, no prefetch and phased_programs programs.
    An explicit phased is taken as given (launch_args checks it)."""
    s = block_sizes or RanksplitBlockSizes()
    if s.phased is None:
        if slots is None:
            raise ValueError("RanksplitBlockSizes.phased is None (by size): pass the launch's slots")
        phased = t <= s.phased_per_slot * slots
        s = dataclasses.replace(s, phased=phased)
        if phased:
            s = dataclasses.replace(s, group_t=2, block_t=2, prefetch=False, max_programs=s.phased_programs)
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


def bound_units(t: int, slots: int, max_rank: int, block_sizes: RanksplitBlockSizes | None = None) -> int:
    """Most units any step of t tokens over `slots` slots can need: its token groups (sum of
    ceil(len / group_t)) times ceil(max_rank / RC)."""
    s = form(t, slots, block_sizes)
    g = s.group_t
    return max(1, (t + slots * (g - 1)) // g) * -(-max_rank // s.rank_rows)


def plan(ranks, a_rows, b_rows, seg_starts, t: int, *, fin: int, fout: int, width: int, max_rank: int,
         block_sizes: RanksplitBlockSizes | None = None):
    """The launch's table, on the host (numpy): (total [1], meta [U, 4], arid [U, MA, RC], brid
    [U, MB, RC]) int32, U = bound_units. Unit u has meta (first token, end token, live rank rows,
    first rank row j0) and arid[u, m, k] the pool row holding the m-th chunk of A^T row j0 + k (brid:
    of B row j0 + k); entries past the live rows are 0 and never read. ranks [Sa], a_rows / b_rows
    [Sa, RA] / [Sa, RB] the slots' pool row indices (lora.py's layout), seg_starts [Sa + 1].
    block_sizes: decided by form for t tokens over Sa slots (the launch must take the same:
    ranksplit_apply's slots and block_sizes)."""
    s = form(t, len(ranks), block_sizes)
    rc, g = s.rank_rows, s.group_t
    if g % s.block_t:
        raise ValueError(f"RanksplitBlockSizes: group_t {g} is not a multiple of block_t {s.block_t}")
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


def launch_args(y, x, rows, table, *, fin: int, fout: int, block_sizes: RanksplitBlockSizes,
                interpret: bool = False):
    """(arrays, constexprs, grid, launch options) for lora_ranksplit_kernel; the last array is y,
    which the output aliases. table: plan's four arrays. block_sizes: form's (phased decided).
    interpret (Triton's interpreter, which runs no PTX): the inline-PTX forms' Triton twins (hold
    "asm" as True, fast_cvt off: the same values, more instructions)."""
    s = block_sizes
    if s.phased is None:
        raise ValueError("ranksplit.launch_args: phased is None; take form(t, slots, block_sizes)'s settings")
    width = rows.shape[1]
    total, meta, arid, brid = (jnp.asarray(a, jnp.int32) for a in table)
    ca, ma, map_ = _chunk(width, fin)
    cb, mb, mbp = _chunk(width, fout)
    if arid.shape[1:] != (map_, s.rank_rows) or brid.shape[1:] != (mbp, s.rank_rows):
        raise ValueError(f"ranksplit table shapes {arid.shape}, {brid.shape} are not plan's for in {fin}, "
                         f"out {fout}, width {width}, rank_rows {s.rank_rows}")
    if s.phased and (s.block_t != 2 or s.group_t != 2 or s.prefetch):
        raise ValueError("RanksplitBlockSizes: the phased form takes block_t 2, group_t 2 and no prefetch "
                         f"(got block_t {s.block_t}, group_t {s.group_t}, prefetch {s.prefetch})")
    prefetch = not s.phased and takes_prefetch(meta.shape[0], s)
    n_programs = max(1, min(meta.shape[0], s.prefetch_programs if prefetch else s.max_programs))
    x = x.astype(jnp.promote_types(x.dtype, rows.dtype))
    arrays = (total, meta, arid, brid, x, rows, y)
    const = dict(RC=s.rank_rows, BLOCK_T=s.block_t, FIN=fin, FOUT=fout, W=width, CA=ca, MA=ma, MAP=map_,
                 CB=cb, MB=mb, MBP=mbp, N_PROGRAMS=n_programs, NU=meta.shape[0], PREFETCH=int(prefetch),
                 PHASED=int(s.phased), HOLD=(1 if interpret else 2) if s.hold == "asm" else int(bool(s.hold)),
                 FAST_CVT=int(bool(s.fast_cvt) and not interpret))
    return arrays, const, (n_programs,), dict(num_warps=s.prefetch_warps if prefetch else s.num_warps,
                                              num_stages=s.num_stages)


def takes_prefetch(units: int, block_sizes: RanksplitBlockSizes | None = None) -> bool:
    """Whether a launch whose table holds `units` entries (bound_units) takes the prefetch form:
    block_sizes.prefetch where set, else from prefetch_units entries on."""
    s = block_sizes or RanksplitBlockSizes()
    return bool(s.prefetch) if s.prefetch is not None else units >= s.prefetch_units


def ranksplit_reference(y, x, rows, table, *, fin: int, fout: int, slots=None,
                        block_sizes: RanksplitBlockSizes | None = None):
    """What the kernel computes, in jnp, from the same table: for each live unit, its tokens' x times
    its A^T rows (float32 sums, rounded to the pool's dtype), times its B rows, added into y. The
    table's check against lora.py's references and the kernel's stand-in off the GPU
    (tests/test_ranksplit.py), with ranksplit_apply's signature. A unit's tokens are [t0, t1): any
    group_t at least the table's covers them. With slots (or a decided phased) that is form's, the
    table's own; else the one-trip group_t, above the phased form's 2."""
    s = block_sizes or RanksplitBlockSizes()
    if slots is not None or s.phased is not None:
        s = form(y.shape[0], slots, s)
    return _reference(y, x, rows, tuple(table), fin=fin, fout=fout, g=max(s.group_t, 2))


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


@functools.partial(jax.jit, static_argnames=("fin", "fout", "block_sizes"))
def _apply(y, x, rows, table, *, fin, fout, block_sizes):
    import jax_triton
    from triton_kernels import _ranksplit_tl

    arrays, const, grid, opts = launch_args(y, x, rows, table, fin=fin, fout=fout, block_sizes=block_sizes)
    return jax_triton.triton_call(*arrays, kernel=_ranksplit_tl.lora_ranksplit_kernel,
                                  out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype), grid=grid,
                                  name="lora_ranksplit_triton", input_output_aliases={len(arrays) - 1: 0},
                                  **opts, **const)


def ranksplit_apply(y, x, rows, table, *, fin: int, fout: int, slots: int | None = None,
                    block_sizes: RanksplitBlockSizes | None = None, interpret=None):
    """y + (x @ A_s) @ B_s for the tokens of every slot s in `table` (plan's), base tokens unchanged,
    in y's dtype: one launch, in form(y's tokens, slots, block_sizes)'s form (plan's for the same t,
    slots and block_sizes). Compiled on a GPU only (Triton's interpreter runs the kernel body on
    torch tensors in tests/test_ranksplit.py)."""
    if interpret:
        raise ValueError("triton_kernels run compiled only; Triton's interpreter runs the kernel "
                         "bodies on torch tensors (tests/test_ranksplit.py)")
    if not applies(rows.shape[1], fin, fout, y.dtype, padded=True):
        raise ValueError(f"ranksplit does not apply to in {fin}, out {fout}, pool width {rows.shape[1]}, "
                         f"y {y.dtype} (see ranksplit.applies)")
    return _apply(y, x, rows, tuple(table), fin=fin, fout=fout, block_sizes=form(y.shape[0], slots, block_sizes))
