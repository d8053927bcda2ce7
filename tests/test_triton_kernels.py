"""Triton LoRA shrink/expand kernels (triton_kernels/) against the jnp references of pallas_kernels.

The cases are tests/test_lora_kernels.py's: ranks {1, 8, 16, 64, 128} in one batch, odd segment
lengths, slots with no tokens, one slot taking the whole batch, base-token tails, each adapter's
rows scattered at random pool rows among garbage of magnitude ~1e3, W not dividing `in`.

TestInterpreter runs the raw @triton.jit bodies under Triton's interpreter on the CPU. JAX builds
every launch (triton_kernels.lora.shrink_plan / expand_plan: the block schedule, constexprs, grid)
here; tests/triton_interpret.py launches them in one subprocess of an interpreter that has triton
and torch: $SLORA_TRITON_PYTHON, else the oracle's ($SLORA_ORACLE_PYTHON or .venv-oracle) when
triton imports there. Skips when there is none.

test_compiles_for_h200 compiles both kernels for sm_90 with Triton's compiler (to a cubin, on the
CPU) through the same Python. TestTritonGPU runs the jax-triton wrappers, compiled, against the same
references; it skips unless
JAX's default backend is a GPU and jax_triton imports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import lora as ref
from test_lora_kernels import (CASES, DTYPES, MAX_RANK, TOKENS, Case, delta_args, dense_delta,
                               make_inputs, owner_rank, rel_err, seed_of)
from triton_kernels import lora as tk

REPO = Path(__file__).resolve().parent.parent
HELPER = Path(__file__).resolve().parent / "triton_interpret.py"
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
DTYPE_ID = {jnp.float32: "f32", jnp.bfloat16: "bf16"}


def shrink_inputs(name, dtype):
    case = CASES[name]
    arr, *_, seg, ranks = make_inputs(case, dtype, seed_of("shrink", name, dtype))
    args = (arr["x"], arr["rows"], arr["a_rows"], arr["ranks"], arr["seg_starts"])
    return case, args, seg, ranks


def expand_inputs(name, dtype):
    case = CASES[name]
    arr, *_, seg, ranks = make_inputs(case, dtype, seed_of("expand", name, dtype))
    rng = np.random.default_rng(seed_of("expand-y", name))
    y = jnp.asarray(rng.normal(size=(TOKENS, case.fout)), dtype)
    # garbage where xa must not be read: past each token's rank and on base tokens
    dead = np.arange(MAX_RANK)[None, :] >= owner_rank(seg, ranks)[:, None]
    xa = jnp.asarray(np.where(dead, 1e3, rng.normal(size=(TOKENS, MAX_RANK))), jnp.float32)
    return case, (y, xa, arr["rows"], arr["b_rows"], arr["ranks"], arr["seg_starts"]), seg, ranks


def check_shrink(got, args, case, seg, ranks, dtype, tol=None):
    want = ref.lora_shrink_reference(*args, max_rank=MAX_RANK, in_features=case.fin)
    assert got.shape == (TOKENS, MAX_RANK) and got.dtype == jnp.float32
    assert rel_err(got, want) < (tol or TOL[dtype]), rel_err(got, want)
    dead = np.arange(MAX_RANK)[None, :] >= owner_rank(seg, ranks)[:, None]
    assert not np.asarray(got)[dead].any()  # exact zeros past each token's rank, base tokens


def check_expand(got, args, case, seg, ranks, dtype, tol=None):
    y = args[0]
    want = ref.lora_expand_reference(*args, max_rank=MAX_RANK, out_features=case.fout)
    assert got.shape == y.shape and got.dtype == y.dtype
    assert rel_err(got, want) < (tol or TOL[dtype]), rel_err(got, want)
    untouched = owner_rank(seg, ranks) == 0  # base tokens and tokens of rank-0 slots
    np.testing.assert_array_equal(np.asarray(got)[untouched], np.asarray(y)[untouched])


# ---------------------------------------------------------------------------------------------
# The interpreter.


def _clean_env() -> dict:
    env = dict(os.environ)
    for k in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"):
        env.pop(k, None)
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return env


def interpreter_python() -> str | None:
    """A Python with triton and torch, or None."""
    explicit = os.environ.get("SLORA_TRITON_PYTHON")
    candidates = [explicit] if explicit else [
        os.environ.get("SLORA_ORACLE_PYTHON"), str(REPO / ".venv-oracle" / "bin" / "python")]
    for py in candidates:
        if not py:
            continue
        path = Path(py) if Path(py).is_absolute() else REPO / py
        if not path.exists():
            continue
        probe = subprocess.run([str(path), "-c", "import triton, torch"], env=_clean_env(),
                               capture_output=True, text=True, timeout=120)
        if probe.returncode == 0:
            return str(path)
        if explicit:
            pytest.fail(f"SLORA_TRITON_PYTHON={py}: {probe.stderr[-2000:]}", pytrace=False)
    return None


def _wire(key: str, a) -> tuple[str, np.ndarray]:
    a = np.asarray(a)
    if a.dtype == jnp.bfloat16:
        return key + "@bf16", a.view(np.uint16)
    return key, a


def _job(name: str, kernel: str, plan, arrays: dict) -> dict:
    arrs, const, grid, _ = plan
    keys = []
    for i, a in enumerate(arrs):
        key, value = _wire(f"{name}/{i}", a)
        arrays[key] = value
        keys.append(key)
    return dict(name=name, kernel=kernel, arrays=keys, const=const, grid=list(grid))


def coop_inputs(name, dtype):
    """(case, (y, x, rows, a_rows, b_rows, ranks, seg_starts)) for lora_coop_apply."""
    case = CASES[name]
    arr, *_ = make_inputs(case, dtype, seed_of("coop", name, dtype))
    y = jnp.asarray(np.random.default_rng(seed_of("coop-y", name)).normal(size=(TOKENS, case.fout)), dtype)
    return case, (y, *delta_args(arr))


def coop_want(case, args):
    y, x, rows, a_rows, b_rows, ranks, seg = args
    xa = ref.lora_shrink_reference(x, rows, a_rows, ranks, seg, max_rank=MAX_RANK, in_features=case.fin)
    return ref.lora_expand_reference(y, xa, rows, b_rows, ranks, seg, max_rank=MAX_RANK, out_features=case.fout)


def _coop_job(name: str, case, args, arrays: dict) -> dict:
    """The coop kernel's launch with its host-built schedule; the partial planes start as NaN, so a
    read of an entry no chunk wrote shows. Few spins: the interpreter runs one program at a time,
    so the first program of each item computes its other chunks after waiting SPINS times."""
    y, x, rows, a_rows, b_rows, ranks, seg = args
    schedule = tk.coop_schedule(ranks, seg, TOKENS, max_rank=MAX_RANK, fout=case.fout, width=case.width)
    arrs, const, grid, _, outs = tk.coop_plan(*args, max_rank=MAX_RANK, fin=case.fin, fout=case.fout,
                                              schedule=schedule)
    job = _job(name, "lora_coop_kernel", (arrs, {**const, "SPINS": 4}, grid, None), arrays)
    job["outs"] = [["alias", len(arrs) - 2], ["alias", len(arrs) - 1], ["new", list(outs[2].shape), "float32", "nan"],
                   ["new", [1], "int32", 0]]
    return job


FEW = Case(ranks=(8, 1, 0, 4), lens=(9, 3, 2, 11))  # see test_few_programs_small_max_rank
FEW_KW = dict(block_t=32, max_programs=2)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """Every launch of the class below, run in one subprocess: {job name: output}."""
    py = interpreter_python()
    if py is None:
        pytest.skip("no Python with triton and torch (set SLORA_TRITON_PYTHON)")
    jobs, arrays = [], {}
    for name in CASES:
        for dtype in (jnp.float32, jnp.bfloat16):
            case, args, *_ = shrink_inputs(name, dtype)
            plan = tk.shrink_plan(*args, max_rank=MAX_RANK, in_features=case.fin)
            jobs.append(_job(f"shrink-{name}-{DTYPE_ID[dtype]}", "lora_shrink_kernel", plan, arrays))
            case, args, *_ = expand_inputs(name, dtype)
            plan = tk.expand_plan(*args, max_rank=MAX_RANK, out_features=case.fout)
            jobs.append(_job(f"expand-{name}-{DTYPE_ID[dtype]}", "lora_expand_kernel", plan, arrays))
    arr, *_ = make_inputs(FEW, jnp.float32, seed_of("few"), max_rank=8)
    x, rows, a_rows, b_rows, ranks, seg = delta_args(arr)
    plan = tk.shrink_plan(x, rows, a_rows, ranks, seg, max_rank=8, in_features=FEW.fin, **FEW_KW)
    jobs.append(_job("few-shrink", "lora_shrink_kernel", plan, arrays))

    for name in CASES:
        for dtype in (jnp.float32, jnp.bfloat16):
            jobs.append(_coop_job(f"coop-{name}-{DTYPE_ID[dtype]}", *coop_inputs(name, dtype), arrays))

    return run_interpreter(py, jobs, arrays, tmp_path_factory.mktemp("triton_interpret"))


def run_interpreter(py: str, jobs: list, arrays: dict, work: Path, timeout: int = 900) -> dict:
    """The jobs (see _job) in one subprocess of tests/triton_interpret.py: {job name: output}."""
    (work / "jobs.json").write_text(json.dumps(jobs))
    np.savez(work / "arrays.npz", **arrays)
    cmd = [py, str(HELPER), str(work / "jobs.json"), str(work / "arrays.npz"), str(work / "out.npz")]
    p = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        pytest.fail(f"the Triton interpreter failed: {' '.join(cmd)}\n{p.stdout[-3000:]}\n"
                    f"{p.stderr[-6000:]}", pytrace=False)
    out = {}
    with np.load(work / "out.npz") as z:
        for k in z.files:
            v = z[k]
            out[k.removesuffix("@bf16")] = jnp.asarray(v.view(jnp.bfloat16) if k.endswith("@bf16") else v)
    return out


class TestInterpreter:
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("name", list(CASES))
    def test_shrink(self, interpreted, name, dtype):
        case, args, seg, ranks = shrink_inputs(name, dtype)
        check_shrink(interpreted[f"shrink-{name}-{DTYPE_ID[dtype]}"], args, case, seg, ranks, dtype)

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("name", list(CASES))
    def test_expand(self, interpreted, name, dtype):
        case, args, seg, ranks = expand_inputs(name, dtype)
        check_expand(interpreted[f"expand-{name}-{DTYPE_ID[dtype]}"], args, case, seg, ranks, dtype)

    def test_few_programs_small_max_rank(self, interpreted):
        """Fewer programs than blocks (each walks several) and max rank 8 < one rank tile."""
        arr, *_ = make_inputs(FEW, jnp.float32, seed_of("few"), max_rank=8)
        x, rows, a_rows, _, ranks, seg = delta_args(arr)
        want = ref.lora_shrink_reference(x, rows, a_rows, ranks, seg, max_rank=8,
                                         in_features=FEW.fin)
        assert rel_err(interpreted["few-shrink"], want) < 1e-5


    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("name", list(CASES))
    def test_coop(self, interpreted, name, dtype):
        """Shrink and expand in one launch (lora_coop_kernel), each token block's chunks shared
        through partial planes and counters: the references' y + x A B."""
        case, args = coop_inputs(name, dtype)
        got = interpreted[f"coop-{name}-{DTYPE_ID[dtype]}"]
        assert rel_err(got, coop_want(case, args)) < TOL[dtype] * 2, rel_err(got, coop_want(case, args))
        if name != "base_only":  # a delta was added, not y handed back
            assert rel_err(got, args[0]) > 0.1, rel_err(got, args[0])


@pytest.mark.parametrize("name", list(CASES))
def test_coop_schedule_host_matches_graph(name):
    """coop_schedule (numpy, as the engine builds schedules) and the in-graph table agree, and the
    live programs cover each live token block's chunks once."""
    case, (y, x, rows, a_rows, b_rows, ranks, seg) = coop_inputs(name, jnp.bfloat16)
    table, live = tk.coop_schedule(ranks, seg, TOKENS, max_rank=MAX_RANK, fout=case.fout, width=case.width)
    g_table, g_live = tk._coop_schedule_jnp(ranks, seg, TOKENS, max_rank=MAX_RANK, fout=case.fout,
                                            width=case.width, block_t=ref.BLOCK_T)
    np.testing.assert_array_equal(table, np.asarray(g_table))
    np.testing.assert_array_equal(live, np.asarray(g_live))
    r = np.minimum(np.asarray(ranks), MAX_RANK)
    least = min(tk.BLOCKS["coop"]["programs"], case.fout // tk._col_tile(case.width, case.fout, 256))
    nch = [-(-int(r[s]) // 16) * tk.BLOCKS["coop"]["n_kc"] for s in range(len(r))]
    want = sum(-(-(int(seg[s + 1]) - int(seg[s])) // ref.BLOCK_T) * max(nch[s], least)
               for s in range(len(r)) if r[s] > 0)
    assert live[0] == want
    rows_ = table[:live[0]]
    assert len({(i, c) for i, c in rows_[:, [0, 5]]}) == len(rows_)  # each (item, program) once
    assert (rows_[:, 5] < rows_[:, 7]).all() and (rows_[:, 6] <= rows_[:, 7]).all() and (table[live[0]:] == 0).all()
    for i in np.unique(rows_[:, 0]):  # an item's programs are c = 0 .. NP - 1: chunks 0 .. NCH - 1 all owned
        mine = rows_[rows_[:, 0] == i]
        assert sorted(mine[:, 5]) == list(range(mine[0, 7])) and mine[0, 6] == nch[mine[0, 1]]


_TRITON_TYPE = {jnp.dtype(jnp.float32): "*fp32", jnp.dtype(jnp.bfloat16): "*bf16",
                jnp.dtype(jnp.int32): "*i32"}
PTR_ARGS = {"lora_shrink_kernel": ("total_ptr", "sched_ptr", "ranks_ptr", "a_rows_ptr", "x_ptr",
                                   "rows_ptr", "_xa_in_ptr", "xa_ptr"),
            "lora_coop_kernel": ("table_ptr", "a_rows_ptr", "b_rows_ptr", "x_ptr", "rows_ptr",
                                 "_y_in_ptr", "_cnt_in_ptr", "y_ptr", "cnt_ptr", "part_ptr", "times_ptr"),
            "lora_expand_kernel": ("total_ptr", "sched_ptr", "ranks_ptr", "b_rows_ptr", "xa_ptr",
                                   "rows_ptr", "y_ptr", "out_ptr")}


def test_compiles_for_h200(tmp_path, fin=11008, fout=14336, width=1024):
    """The kernels (shrink, expand, coop), bf16 and float32 (TF32 and IEEE dots), through Triton's compiler for sm_90
    down to a cubin, on the CPU (tests/triton_compile.py). MLP widths, W not dividing `in`."""
    py = interpreter_python()
    if py is None:
        pytest.skip("no Python with triton and torch (set SLORA_TRITON_PYTHON)")
    t, sa, r, n = 40, 8, 64, 256
    jobs = []
    for dtype in (jnp.bfloat16, jnp.float32):
        for precision in ("default", "highest"):
            with jax.default_matmul_precision(precision):
                x, rows = jnp.zeros((t, fin), dtype), jnp.zeros((n, width), dtype)
                a_rows = jnp.zeros((sa, -(-r * fin // width)), jnp.int32)
                b_rows = jnp.zeros((sa, -(-r * fout // width)), jnp.int32)
                ranks, seg = jnp.full((sa,), r, jnp.int32), jnp.arange(sa + 1, dtype=jnp.int32)
                plans = {
                    "lora_shrink_kernel": tk.shrink_plan(x, rows, a_rows, ranks, seg, max_rank=r,
                                                         in_features=fin),
                    "lora_expand_kernel": tk.expand_plan(jnp.zeros((t, fout), dtype),
                                                         jnp.zeros((t, r), jnp.float32), rows,
                                                         b_rows, ranks, seg, max_rank=r,
                                                         out_features=fout)}
                coop = tk.coop_plan(jnp.zeros((t, fout), dtype), x, rows, a_rows, b_rows, ranks, seg, max_rank=r,
                                    fin=fin, fout=fout)
            for kernel, (arrays, const, _, options, *outs) in [*plans.items(), ("lora_coop_kernel", coop)]:
                types = [_TRITON_TYPE[jnp.dtype(a.dtype)] for a in arrays]
                if outs:  # the coop kernel's outputs: y and the counters (aliased), the partial planes
                    types += [_TRITON_TYPE[jnp.dtype(o.dtype)] for o in outs[0]]
                else:
                    types.append(types[-1])  # the output aliases the last input
                jobs.append(dict(kernel=kernel, const=const, options=options,
                                 dtypes=dict(zip(PTR_ARGS[kernel], types))))
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    p = subprocess.run([py, str(HELPER.parent / "triton_compile.py"), str(tmp_path / "jobs.json")],
                       env=_clean_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-6000:]
    assert p.stdout.count("cubin") == len(jobs), p.stdout


# ---------------------------------------------------------------------------------------------
# Compiled, through jax-triton.


def llama_point(seed: int, t: int = 64, n: int = 32, fin: int = 4096):
    """Issue 4's point with real rows: (pool [N, fin] bf16, x, y [t, fin] bf16, a_idx, b_idx [n, 64],
    ranks [n], seg [n + 1], want [t, fin] float32), adapters of ranks 8-64 cycling, every A^T / B row
    at a random pool row (W = fin), want = y + x A B per slot in float64."""
    rng = np.random.default_rng(seed)
    ranks = np.array([(8, 16, 32, 64)[s % 4] for s in range(n)], np.int32)
    seg = np.arange(n + 1, dtype=np.int32) * (t // n)
    mats = [m for r in ranks for m in (rng.normal(size=(r, fin)) / 64, rng.normal(size=(r, fin)) / 8)]
    place = rng.permutation(sum(len(m) for m in mats))
    pool = np.zeros((len(place), fin))
    pool[place] = np.concatenate(mats)
    a_idx, b_idx, nxt = np.zeros((n, 64), np.int32), np.zeros((n, 64), np.int32), 0
    for s in range(n):
        for idx in (a_idx, b_idx):
            idx[s, :ranks[s]] = place[nxt:nxt + ranks[s]]
            nxt += ranks[s]
    pool = jnp.asarray(pool, jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(t, fin)), jnp.bfloat16)
    y = jnp.asarray(rng.normal(size=(t, fin)), jnp.bfloat16)
    xf = np.asarray(x, np.float64)
    want = np.asarray(y, np.float64).copy()
    for s in range(n):
        tok = slice(seg[s], seg[s + 1])
        want[tok] += xf[tok] @ np.asarray(pool[a_idx[s, :ranks[s]]], np.float64).T @ \
            np.asarray(pool[b_idx[s, :ranks[s]]], np.float64)
    return pool, x, y, a_idx, b_idx, ranks, seg, jnp.asarray(want, jnp.float32)


@pytest.mark.gpu
@pytest.mark.skipif(tk.unavailable_reason() is not None, reason=str(tk.unavailable_reason()))
class TestTritonGPU:
    # float32 operands go through TF32 on the GPU unless JAX's default matmul precision is
    # "highest" (bench/gpu_check.sh sets it), as for the Pallas twin
    TOL = {jnp.float32: 1e-2, jnp.bfloat16: 1e-2}

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("name", list(CASES))
    def test_shrink(self, name, dtype):
        case, args, seg, ranks = shrink_inputs(name, dtype)
        got = tk.lora_shrink(*args, max_rank=MAX_RANK, in_features=case.fin)
        check_shrink(got, args, case, seg, ranks, dtype, self.TOL[dtype])

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("name", list(CASES))
    def test_expand(self, name, dtype):
        case, args, seg, ranks = expand_inputs(name, dtype)
        got = tk.lora_expand(*args, max_rank=MAX_RANK, out_features=case.fout)
        check_expand(got, args, case, seg, ranks, dtype, self.TOL[dtype])

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("name", list(CASES))
    def test_delta_matches_dense(self, name, dtype):
        case = CASES[name]
        arr, a_mats, b_mats, seg, ranks = make_inputs(case, dtype, seed_of("dense", name, dtype))
        got = tk.lora_delta(*delta_args(arr), max_rank=MAX_RANK, fin=case.fin, fout=case.fout)
        want = dense_delta(arr["x"], a_mats, b_mats, seg, ranks, case.fout)
        assert got.shape == (TOKENS, case.fout) and got.dtype == jnp.float32
        if not want.any():
            assert not np.asarray(got).any()
        else:
            assert rel_err(got, want) < 2e-2, rel_err(got, want)

    def test_few_programs_small_max_rank(self):
        arr, a_mats, b_mats, seg, ranks = make_inputs(FEW, jnp.float32, seed_of("few"), max_rank=8)
        got = tk.lora_delta(*delta_args(arr), max_rank=8, fin=FEW.fin, fout=FEW.fout, **FEW_KW)
        assert rel_err(got, dense_delta(arr["x"], a_mats, b_mats, seg, ranks, FEW.fout)) < 1e-2

    @pytest.mark.parametrize("host_schedule", [True, False], ids=["host", "graph"])
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("name", list(CASES))
    def test_coop(self, name, dtype, host_schedule):
        """lora_coop_apply compiled, its programs running at once (the interpreter runs them in
        turn), with the schedule built on the host or in the graph."""
        case, args = coop_inputs(name, dtype)
        y, x, rows, a_rows, b_rows, ranks, seg = args
        schedule = tk.coop_schedule(ranks, seg, TOKENS, max_rank=MAX_RANK, fout=case.fout,
                                    width=case.width) if host_schedule else None
        got = tk.lora_coop_apply(*args, max_rank=MAX_RANK, fin=case.fin, fout=case.fout, schedule=schedule)
        assert rel_err(got, coop_want(case, args)) < self.TOL[dtype], rel_err(got, coop_want(case, args))

    def test_coop_llama_shapes(self):
        """The coop launch at issue 4's shape (4096 -> 4096, 64 tokens over 32 adapters of ranks
        8-64, W 4096), many times in a row (the counters start from zero each call): the dense product."""
        pool, x, y, a_idx, b_idx, ranks, seg, want = llama_point(7)
        t, fin = x.shape
        schedule = tuple(map(jnp.asarray, tk.coop_schedule(ranks, seg, t, max_rank=64, fout=fin, width=fin)))
        f = jax.jit(lambda y, x: tk.lora_coop_apply(y, x, pool, jnp.asarray(a_idx), jnp.asarray(b_idx),
                                                    jnp.asarray(ranks), jnp.asarray(seg), max_rank=64, fin=fin,
                                                    fout=fin, schedule=schedule))
        for _ in range(20):
            got = f(y, x)
        assert rel_err(got, want) < 2e-2, rel_err(got, want)

    def test_inside_jit_with_donated_y(self):
        """Expand under jit, y donated: the alias lets XLA update y in place."""
        case, args, seg, ranks = expand_inputs("mixed", jnp.bfloat16)
        want = ref.lora_expand_reference(*args, max_rank=MAX_RANK, out_features=case.fout)
        f = jax.jit(lambda y, *rest: tk.lora_expand(y, *rest, max_rank=MAX_RANK,
                                                    out_features=case.fout), donate_argnums=0)
        got = f(jnp.array(args[0]), *args[1:])
        assert rel_err(got, want) < 1e-2


def test_f32_dot_follows_jax_precision():
    with jax.default_matmul_precision("highest"):
        case, args, *_ = shrink_inputs("decode", jnp.float32)
        assert tk.shrink_plan(*args, max_rank=MAX_RANK, in_features=case.fin)[1]["F32_DOT"] == "ieee"
    with jax.default_matmul_precision("default"):
        assert tk.shrink_plan(*args, max_rank=MAX_RANK, in_features=case.fin)[1]["F32_DOT"] == "tf32"


def test_engine_options():
    from slora_jax.engine.engine import EngineOptions
    if tk.unavailable_reason() is not None:
        with pytest.raises(ValueError, match="lora_backend='triton' needs"):
            EngineOptions(lora_backend="triton")
    else:
        assert EngineOptions(lora_backend="triton").lora_backend == "triton"
    with pytest.raises(ValueError, match="no Triton attention"):
        EngineOptions(attention_backend="triton")
    with pytest.raises(ValueError, match="must be"):
        EngineOptions(lora_backend="cuda")


def test_wrappers_refuse_interpret():
    case, args, *_ = shrink_inputs("decode", jnp.float32)
    with pytest.raises(ValueError, match="compiled only"):
        tk.lora_shrink(*args, max_rank=MAX_RANK, in_features=case.fin, interpret=True)


def test_unavailable_on_cpu():
    if jax.default_backend() == "cpu":
        assert "GPU" in tk.unavailable_reason()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
