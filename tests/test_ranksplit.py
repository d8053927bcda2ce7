"""The rank-split decode kernel (triton_kernels/ranksplit.py) against the jnp references.

The cases are tests/test_lora_kernels.py's: ranks {1, 8, 16, 64, 128} in one batch, odd segment
lengths, slots with no tokens, one slot taking the whole batch, base-token tails, each adapter's
rows scattered at random pool rows among garbage of magnitude ~1e3, W not dividing `in` (A^T rows
starting mid pool row), rows of a non-power-of-two count of chunks. Each runs at the defaults and
at a setting where programs walk several units, units hold fewer rank rows and several token
steps (`SMALL`).

TestInterpreter runs the @triton.jit body under Triton's interpreter on the CPU, in one subprocess
of a Python with triton and torch (tests/triton_interpret.py; skips without one). test_compiles_for_h200
compiles it for sm_90 down to a cubin on the CPU. TestRanksplitGPU runs the jax-triton wrapper
compiled, and skips unless JAX's default backend is a GPU and jax_triton imports.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import lora as ref
from test_lora_kernels import CASES, DTYPES, MAX_RANK, TOKENS, make_inputs, owner_rank, rel_err, seed_of
from test_triton_kernels import (HELPER, _TRITON_TYPE, _clean_env, _job, interpreter_python, llama_point,
                                 run_interpreter)
from triton_kernels import ranksplit as rs

R = dataclasses.replace

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def bf16_tol(settings) -> float:
    """bf16 y rounds once per unit that adds into it (ceil(128 / rank_rows) at MAX_RANK 128: 32 at
    4 rank rows) where the references round once. Each rounding errs by up to half an ulp, 2^-7 of
    y's largest values at most: as a random walk, sqrt(adds + 1) * 2^-7 / sqrt(12) of max |y| one
    standard deviation; over a case's thousands of elements the largest sits within 4.5 of them
    (0.058 at 4 rank rows). Never below the split-K pair's 2e-2."""
    adds = -(-MAX_RANK // settings.rank_rows)
    return max(2e-2, 4.5 * (adds + 1) ** 0.5 * 2 ** -7 / 12 ** 0.5)
DTYPE_ID = {jnp.float32: "f32", jnp.bfloat16: "bf16"}
DEFAULT = rs.RanksplitBlockSizes()  # phased or not by each case's size (rs.form)
ONETRIP = R(DEFAULT, phased=False)
# several units a program, 4 rank rows a unit, 2 steps of 2 tokens a unit
SMALL = R(ONETRIP, rank_rows=4, group_t=4, block_t=2, max_programs=5, num_warps=4)
# the two token forms: pairs (block_t 2: the defaults and SMALL), one by one (block_t 1 and 4)
SETTINGS = {"default": DEFAULT, "small": SMALL, "tokenwise": R(SMALL, block_t=1, group_t=3),
            "tokenwise4": R(SMALL, block_t=4, group_t=8, max_programs=132),
            # the next unit's rows in flight while a unit computes: 2-9 units a program, 2 steps a unit
            "prefetch": R(SMALL, prefetch=True, prefetch_programs=5, prefetch_warps=4),
            # each unit in two trips (A^T rows and x, then B rows), units of at most two tokens, 1-9 a
            # program; its hold and conversions in inline PTX (the defaults), which the interpreter
            # runs as their Triton twins (launch_args' interpret)
            "phased": R(SMALL, phased=True, group_t=2),
            # the same compiled with those twins, and with no hold (the interpreter ran both as "phased")
            "phased_twins": R(SMALL, phased=True, group_t=2, hold=True, fast_cvt=False),
            "phased_nohold": R(SMALL, phased=True, group_t=2, hold=False, fast_cvt=False)}
COMPILED_ONLY = ("phased_twins", "phased_nohold")
# the defaults and SMALL in both dtypes, the other forms in float32 (the interpreter's time on 2 cores)
INTERPRETED_DTYPES = {k: (jnp.float32, jnp.bfloat16) if k in ("default", "small", "phased") else
                      () if k in COMPILED_ONLY else (jnp.float32,) for k in SETTINGS}
PTR_ARGS_RS = ("total_ptr", "meta_ptr", "arid_ptr", "brid_ptr", "x_ptr", "rows_ptr", "_y_in_ptr", "y_ptr")


def inputs(name, dtype):
    """(case, (y, x, rows, a_rows, b_rows, ranks, seg_starts), seg, ranks)."""
    case = CASES[name]
    arr, *_, seg, ranks = make_inputs(case, dtype, seed_of("ranksplit", name, dtype))
    y = jnp.asarray(np.random.default_rng(seed_of("ranksplit-y", name)).normal(size=(TOKENS, case.fout)), dtype)
    return case, (y, arr["x"], arr["rows"], arr["a_rows"], arr["b_rows"], arr["ranks"], arr["seg_starts"]), seg, ranks


def want_of(case, args):
    y, x, rows, a_rows, b_rows, ranks, seg = args
    xa = ref.lora_shrink_reference(x, rows, a_rows, ranks, seg, max_rank=MAX_RANK, in_features=case.fin)
    return ref.lora_expand_reference(y, xa, rows, b_rows, ranks, seg, max_rank=MAX_RANK, out_features=case.fout)


def resolved(args, settings):
    """rs.form's settings for this case's launch (TOKENS over its slots): plan's and the launch's."""
    return rs.form(TOKENS, len(args[5]), settings)


def table_of(case, args, settings):
    y, x, rows, a_rows, b_rows, ranks, seg = args
    return rs.plan(ranks, a_rows, b_rows, seg, TOKENS, fin=case.fin, fout=case.fout, width=case.width,
                   max_rank=MAX_RANK, block_sizes=settings)


def check(got, case, args, seg, ranks, dtype, tol=None):
    y = args[0]
    want = want_of(case, args)
    assert got.shape == y.shape and got.dtype == y.dtype
    assert rel_err(got, want) < (tol or TOL[dtype]), rel_err(got, want)
    untouched = owner_rank(seg, ranks) == 0  # base tokens and tokens of rank-0 slots: y exactly
    np.testing.assert_array_equal(np.asarray(got)[untouched], np.asarray(y)[untouched])
    if (~untouched).any():  # a delta was added where one belongs
        assert rel_err(np.asarray(got)[~untouched], np.asarray(y)[~untouched]) > 0.05


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", list(CASES))
def test_plan_covers_every_rank_row_once(name, setting):
    """Each (token, rank row) of a live slot is in exactly one unit, every pool row named is the
    slot's own, and the table's tail past the live units is zeros."""
    case, args, seg, ranks = inputs(name, jnp.float32)
    s = resolved(args, SETTINGS[setting])
    total, meta, arid, brid = table_of(case, args, s)
    a_rows, b_rows = np.asarray(args[3]), np.asarray(args[4])
    u = int(total[0])
    assert meta.shape[0] == rs.bound_units(TOKENS, len(ranks), MAX_RANK, s) >= u
    assert not meta[u:].any() and not arid[u:].any() and not brid[u:].any()
    seen = np.zeros((TOKENS, MAX_RANK), int)
    slot_of = np.searchsorted(seg, np.arange(TOKENS), side="right") - 1
    _, _, mpa = rs._chunk(case.width, case.fin)
    for t0, t1, n, j0 in meta[:u]:
        assert 0 < n <= s.rank_rows and 0 < t1 - t0 <= s.group_t
        slot = slot_of[t0]
        assert (slot_of[t0:t1] == slot).all() and j0 + n <= ranks[slot]
        seen[t0:t1, j0:j0 + n] += 1
    want = np.arange(MAX_RANK)[None, :] < owner_rank(seg, ranks)[:, None]
    np.testing.assert_array_equal(seen, want.astype(int))
    for k, (t0, _, n, j0) in enumerate(meta[:u]):  # A^T row j0's first chunk: the slot's row
        flat = j0 * case.fin
        assert arid[k, 0, 0] == a_rows[slot_of[t0], flat // case.width]
        assert brid[k, 0, 0] == b_rows[slot_of[t0], j0 * case.fout // case.width]
    assert arid.shape[1] == mpa


def test_engine_tables_are_cached_by_their_inputs():
    """slora_jax.lora.ranksplit_tables gives the tables plan builds, reuses them while a step's inputs repeat
    (a decode batch that keeps its slots), and builds afresh when rows, ranks, tokens or settings change."""
    from slora_jax.lora import ranksplit_tables
    from slora_jax.model.config import load_model_config
    cfg = load_model_config("llama-7b")
    rng = np.random.default_rng(seed_of("plans-cache"))
    n, t = 16, 32
    ranks = rng.choice([8, 16, 32, 64], n).astype(np.int32)
    seg = np.arange(n + 1, dtype=np.int32) * (t // n)
    rows = {m: (rng.integers(0, 5000, (n, 64)).astype(np.int32), rng.integers(0, 5000, (n, 64)).astype(np.int32))
            for m in ("q_proj", "o_proj")}
    rk = {m: ranks for m in rows}
    first = ranksplit_tables(rows, rk, seg, t, cfg, 64, jnp.bfloat16, DEFAULT)
    for m, (a, b) in rows.items():
        want = rs.plan(ranks, a, b, seg, t, fin=4096, fout=4096, width=cfg.kv_size, max_rank=64)
        for got, w in zip(first["ranksplit:" + m], want):
            np.testing.assert_array_equal(got, w)
    again = ranksplit_tables({m: (a.copy(), b.copy()) for m, (a, b) in rows.items()}, rk, seg.copy(), t, cfg,
                             64, jnp.bfloat16, DEFAULT)
    assert all(again[k] is first[k] for k in first)                 # equal inputs: the same tables
    with pytest.raises(ValueError):
        first["ranksplit:q_proj"][1][0, 0] = 1                          # shared, so read-only
    moved = {m: (a.copy(), b.copy()) for m, (a, b) in rows.items()}
    moved["q_proj"][0][0, 0] += 1                                       # one A^T row moved in the pool
    changed = ranksplit_tables(moved, rk, seg, t, cfg, 64, jnp.bfloat16, DEFAULT)
    assert changed["ranksplit:o_proj"] is first["ranksplit:o_proj"]
    assert changed["ranksplit:q_proj"][2][0, 0, 0] == first["ranksplit:q_proj"][2][0, 0, 0] + 1
    seg2 = seg.copy()
    seg2[1:] -= 1                                                        # slot 0 holds one token fewer
    seg2[0] = 0
    fewer = ranksplit_tables(rows, rk, seg2, t, cfg, 64, jnp.bfloat16, DEFAULT)
    assert fewer["ranksplit:o_proj"][1][0, 1] == first["ranksplit:o_proj"][1][0, 1] - 1
    other = ranksplit_tables(rows, rk, seg, t, cfg, 64, jnp.bfloat16, R(DEFAULT, rank_rows=8))
    assert other["ranksplit:q_proj"][2].shape[2] == 8 and first["ranksplit:q_proj"][2].shape[2] == 4


def test_prefetch_form_by_table_size():
    """The prefetch form (its own warps and programs) from prefetch_units table entries on, unless
    forced on or off; the launch's options follow."""
    s = R(ONETRIP, prefetch=None, prefetch_units=768)
    assert not rs.takes_prefetch(767, s) and rs.takes_prefetch(768, s)
    assert rs.takes_prefetch(1, R(s, prefetch=True)) and not rs.takes_prefetch(10 ** 6, R(s, prefetch=False))
    case, args, *_ = inputs("decode", jnp.float32)
    for forced in (True, False):
        s2 = R(s, prefetch=forced)
        _, const, grid, opts = rs.launch_args(args[0], args[1], args[2], table_of(case, args, s2), fin=case.fin,
                                              fout=case.fout, block_sizes=s2)
        assert const["PREFETCH"] == int(forced)
        assert opts["num_warps"] == (s2.prefetch_warps if forced else s2.num_warps)
        assert grid[0] <= (s2.prefetch_programs if forced else s2.max_programs)


def test_phased_form_by_tokens_a_slot():
    """form: the phased form (units of two tokens, phased_programs programs, no prefetch) where a
    launch's tokens are at most phased_per_slot a slot on average, the one-trip settings above, an
    explicit phased as given. launch_args refuses an undecided form and gives the interpreter the
    inline-PTX forms' Triton twins."""
    s = R(DEFAULT, phased=None, phased_per_slot=2)
    at = rs.form(64, 32, s)
    assert at.phased and at.group_t == at.block_t == 2 and not at.prefetch
    assert at.max_programs == s.phased_programs
    above = rs.form(65, 32, s)
    assert above.phased is False and above.group_t == s.group_t and above.max_programs == s.max_programs
    assert rs.form(10 ** 4, 1, R(s, phased=True)).group_t == s.group_t
    with pytest.raises(ValueError, match="slots"):
        rs.form(64, None, s)
    case, args, *_ = inputs("decode", jnp.float32)
    with pytest.raises(ValueError, match="phased is None"):
        rs.launch_args(args[0], args[1], args[2], table_of(case, args, s), fin=case.fin, fout=case.fout,
                       block_sizes=s)
    r = resolved(args, R(s, phased_per_slot=10 ** 6))
    table = table_of(case, args, r)
    assert (table[1][:, 1] - table[1][:, 0] <= 2).all()
    for interpret, hold, fast in ((False, 2, 1), (True, 1, 0)):
        _, const, grid, _ = rs.launch_args(args[0], args[1], args[2], table, fin=case.fin, fout=case.fout,
                                           block_sizes=r, interpret=interpret)
        assert (const["PHASED"], const["HOLD"], const["FAST_CVT"], grid[0]) == (1, hold, fast, min(len(table[1]), 1024))


def test_block_sizes_are_frozen_data_per_device():
    """RanksplitBlockSizes is frozen (a static argument of the jitted launch); the H200's values come
    from configs/ranksplit.json; an unknown device falls back to the defaults."""
    from pathlib import Path
    h200 = rs.RanksplitBlockSizes.get_default("NVIDIA H200")
    with pytest.raises(dataclasses.FrozenInstanceError):
        h200.rank_rows = 8
    table = json.loads((Path(rs.__file__).parent / "configs" / "ranksplit.json").read_text())["NVIDIA H200"]
    assert dataclasses.asdict(h200) == {**dataclasses.asdict(rs.RanksplitBlockSizes()), **table}
    assert rs.RanksplitBlockSizes.get_default("Some Future Chip") == rs.RanksplitBlockSizes()
    assert hash(rs.form(64, 32, h200)) == hash(rs.form(64, 32, h200))


def test_applies():
    assert rs.applies(4096, 4096, 4096, jnp.bfloat16) and rs.applies(4096, 4096, 1024, jnp.float32)
    assert rs.applies(4096, 11008, 4096, padded=True)       # 43 chunks of 256, a tile of 64
    assert not rs.applies(4096, 11008, 4096) and not rs.applies(5120, 5120, 5120)  # padded tiles: not by default
    assert not rs.applies(4096, 4096, 4096, jnp.float16)
    assert not rs.applies(24, 4096, 4096)           # chunks of 8 elements
    assert rs._chunk(48, 160) == (16, 10, 16)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """Every launch below, run in one subprocess of Triton's interpreter: {job name: y}."""
    py = interpreter_python()
    if py is None:
        pytest.skip("no Python with triton and torch (set SLORA_TRITON_PYTHON)")
    jobs, arrays = [], {}
    for setting, s in SETTINGS.items():
        for name in CASES:
            for dtype in INTERPRETED_DTYPES[setting]:
                case, args, *_ = inputs(name, dtype)
                launch = rs.launch_args(args[0], args[1], args[2], table_of(case, args, s), fin=case.fin,
                                        fout=case.fout, block_sizes=resolved(args, s), interpret=True)
                jobs.append(_job(f"{setting}-{name}-{DTYPE_ID[dtype]}", "lora_ranksplit_kernel", launch, arrays))
    return run_interpreter(py, jobs, arrays, tmp_path_factory.mktemp("ranksplit_interpret"))


class TestInterpreter:
    @pytest.mark.parametrize("setting", list(SETTINGS))
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("name", list(CASES))
    def test_matches_reference(self, interpreted, name, dtype, setting):
        if dtype not in INTERPRETED_DTYPES[setting]:
            pytest.skip("this form runs in float32 under the interpreter (both dtypes on the GPU)"
                        if INTERPRETED_DTYPES[setting] else "the interpreter runs this form as 'phased'")
        case, args, seg, ranks = inputs(name, dtype)
        check(interpreted[f"{setting}-{name}-{DTYPE_ID[dtype]}"], case, args, seg, ranks, dtype,
              bf16_tol(SETTINGS[setting]) if dtype == jnp.bfloat16 else None)


def test_compiles_for_h200(tmp_path):
    """The kernel for sm_90 down to a cubin on the CPU (tests/triton_compile.py): the decode point's
    shape (4096 -> 4096, W 4096) in every form, GQA's k/v (4096 -> 1024), llama-7b's MLP (11008: 43
    chunks a row, padded to 64), y bf16 and float32."""
    py = interpreter_python()
    if py is None:
        pytest.skip("no Python with triton and torch (set SLORA_TRITON_PYTHON)")
    jobs = []
    forms = [((4096, 4096), jnp.bfloat16, DEFAULT), ((4096, 4096), jnp.bfloat16, ONETRIP),
             ((4096, 4096), jnp.bfloat16, SETTINGS["tokenwise"]), ((4096, 4096), jnp.float32, SETTINGS["tokenwise4"]),
             ((4096, 1024), jnp.float32, SMALL), ((4096, 11008), jnp.bfloat16, DEFAULT),
             ((11008, 4096), jnp.float32, SETTINGS["tokenwise"]),
             ((4096, 4096), jnp.bfloat16, R(ONETRIP, prefetch=True)),
             ((4096, 1024), jnp.float32, SETTINGS["phased_twins"])]
    for (fin, fout), ydt, s in forms:
        t, sa = 64, 32
        s = rs.form(t, sa, s)  # DEFAULT: phased at 64 x 32
        ranks = np.array([(8, 16, 32, 64)[k % 4] for k in range(sa)], np.int32)
        seg = np.arange(sa + 1, dtype=np.int32) * (t // sa)
        a_rows = np.zeros((sa, -(-64 * fin // 4096)), np.int32)
        b_rows = np.zeros((sa, -(-64 * fout // 4096)), np.int32)
        table = rs.plan(ranks, a_rows, b_rows, seg, t, fin=fin, fout=fout, width=4096, max_rank=64, block_sizes=s)
        arrays, const, _, options = rs.launch_args(jnp.zeros((t, fout), ydt), jnp.zeros((t, fin), jnp.bfloat16),
                                                   jnp.zeros((8, 4096), jnp.bfloat16), table, fin=fin,
                                                   fout=fout, block_sizes=s)
        types = [_TRITON_TYPE[jnp.dtype(a.dtype)] for a in arrays] + [_TRITON_TYPE[jnp.dtype(ydt)]]
        jobs.append(dict(kernel="lora_ranksplit_kernel", const=const, options=options,
                         dtypes=dict(zip(PTR_ARGS_RS, types))))
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    p = subprocess.run([py, str(HELPER.parent / "triton_compile.py"), str(tmp_path / "jobs.json")],
                       env=_clean_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-6000:]
    assert p.stdout.count("cubin") == len(jobs), p.stdout


def test_refuses_interpret_and_other_shapes():
    case, args, *_ = inputs("decode", jnp.float32)
    table = table_of(case, args, DEFAULT)
    with pytest.raises(ValueError, match="compiled only"):
        rs.ranksplit_apply(args[0], args[1], args[2], table, fin=case.fin, fout=case.fout, interpret=True)
    with pytest.raises(ValueError, match="does not apply"):
        rs.ranksplit_apply(args[0].astype(jnp.float16), args[1], args[2], table, fin=case.fin, fout=case.fout)


@pytest.mark.gpu
@pytest.mark.skipif(rs.unavailable_reason() is not None, reason=str(rs.unavailable_reason()))
class TestRanksplitGPU:
    TOL = {jnp.float32: 1e-2}  # float32: TF32-free, but the GPU's sum order differs; bf16: bf16_tol

    @pytest.mark.parametrize("setting", list(SETTINGS))
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("name", list(CASES))
    def test_matches_reference(self, name, dtype, setting):
        case, args, seg, ranks = inputs(name, dtype)
        got = rs.ranksplit_apply(args[0], args[1], args[2], table_of(case, args, SETTINGS[setting]),
                                 fin=case.fin, fout=case.fout, slots=len(ranks), block_sizes=SETTINGS[setting])
        check(got, case, args, seg, ranks, dtype,
              bf16_tol(SETTINGS[setting]) if dtype == jnp.bfloat16 else self.TOL[dtype])

    def test_llama_shape_repeated(self):
        """The decode point's shape (4096 -> 4096, 64 tokens over 32 adapters of ranks 8-64, W 4096), twenty
        calls in a row under jit: a float64 product of the un-paged matrices."""
        pool, x, y, a_idx, b_idx, ranks, seg, want = llama_point(11)
        t, fin = x.shape
        table = tuple(map(jnp.asarray, rs.plan(ranks, a_idx, b_idx, seg, t, fin=fin, fout=fin, width=fin, max_rank=64)))
        f = jax.jit(lambda y, x: rs.ranksplit_apply(y, x, pool, table, fin=fin, fout=fin, slots=len(ranks)))
        for _ in range(20):
            got = f(y, x)
        assert rel_err(got, want) < 2e-2, rel_err(got, want)
