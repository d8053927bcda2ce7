"""The Triton side of the LoRA kernels: availability, the engine's refusal of "ranksplit" where
it cannot run, and the helpers tests/test_ranksplit.py uses to run the @triton.jit body.

TestInterpreter-style tests run the raw @triton.jit body under Triton's interpreter on the CPU:
JAX builds every launch (arrays, constexprs, grid) here; tests/triton_interpret.py launches them
in one subprocess of an interpreter that has triton and torch: $SLORA_TRITON_PYTHON, else the
oracle's ($SLORA_ORACLE_PYTHON or .venv-oracle) when triton imports there. They skip when there
is none. tests/triton_compile.py compiles for sm_90 down to a cubin on the CPU through the same
Python.
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

from triton_kernels import ranksplit as rs

REPO = Path(__file__).resolve().parent.parent
HELPER = Path(__file__).resolve().parent / "triton_interpret.py"
_TRITON_TYPE = {jnp.dtype(jnp.float32): "*fp32", jnp.dtype(jnp.bfloat16): "*bf16",
                jnp.dtype(jnp.int32): "*i32"}


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


def llama_point(seed: int, t: int = 64, n: int = 32, fin: int = 4096):
    """The kernels' decode micro-benchmark point (bench/kernels.py) with real rows: (pool [N, fin] bf16, x, y [t, fin] bf16, a_idx, b_idx [n, 64],
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


def test_unavailable_on_cpu():
    """Off a GPU the rank-split kernel says why it cannot run, and nothing imports jax-triton."""
    if jax.default_backend() == "cpu":
        assert "GPU" in rs.unavailable_reason()
        assert "jax_triton" not in sys.modules


def test_engine_options():
    """lora_backend "ranksplit" needs a GPU with jax-triton: refused elsewhere with the reason when
    the engine resolves its backends; "hybrid" and "triton" are no backend names; "auto" is the
    default; there is no Triton attention."""
    from slora_jax import EngineConfig
    from slora_jax.engine.engine import LoraChoices
    config = EngineConfig(lora_backend="ranksplit")
    if rs.unavailable_reason() is not None:
        with pytest.raises(ValueError, match="lora_backend='ranksplit' needs"):
            LoraChoices.resolve(config)
    else:
        assert LoraChoices.resolve(config).lora_backend == "ranksplit"
    for gone in ("hybrid", "triton", "cuda"):
        with pytest.raises(ValueError, match="must be one of"):
            EngineConfig(lora_backend=gone)
    assert EngineConfig().lora_backend == "auto"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="triton")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
