"""The LoRA kernels under Nsight Compute: a small driver that runs shrink + expand (the engine's
Pallas pair, one 4096 -> 4096 module at llama-7b width, ranks mixed 8-64 from pool rows in random
order, as bench/kernels.py builds them) and a copy of the same bytes, a few times each, so that
`ncu` can read their hardware counters: DRAM throughput, achieved occupancy, where warps stall.
bench/kernels.py says how long the pair takes; this says why.

    bash bench/gpu_check.sh ncu               # on the GPU: ncu over this, with the settings it needs
    python bench/ncu_summary.py <OUT>         # the counters, a table per setting
    python bench/ncu_lora.py --quick          # CPU: interpret mode, tiny shapes (the smoke test)

Under ncu, JAX needs XLA's autotuning and command buffers off and no preallocation, or ncu hangs
(gpu_check.sh sets them; session 18). Each case runs `--reps` times plus once to check the output
(its first call compiles); the copy (`a * 1.0001` over as many bytes as the case reads and writes)
runs after each case `--reps` times, profiled where the kernel filter takes "multiply". Under ncu
the kernels run one at a time with caches flushed between passes: the adapter rows come from HBM.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == REPO / "bench":
    sys.path[0] = str(REPO)  # run as a script: bench/trace.py must not shadow the stdlib's trace

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.kernels import FULL, QUICK, LoraPool  # noqa: E402
from pallas_kernels import lora as lora_kernels  # noqa: E402
from pallas_kernels.lora import lora_delta  # noqa: E402


def case_fn(pool: LoraPool, t: int, n: int, interpret: bool):
    """(jitted shrink + expand of one input set, its arguments, the bytes it must move)."""
    s = pool.sets(t, n, 1, seed=t * 1000 + n)[0]
    block_t = lora_kernels.decode_block_t("pallas")
    shrink_bt = lora_kernels.decode_block_t("pallas", "shrink", pool.width, pool.fin)

    @jax.jit
    def lora_pair(rows, x, a, b, r, seg, schedule, shrink_schedule):
        return lora_delta(x, rows, a, b, r, seg, backend="pallas", interpret=interpret, schedule=schedule,
                          shrink_schedule=shrink_schedule, block_t=block_t, shrink_block_t=shrink_bt,
                          max_rank=pool.max_rank, fin=pool.fin, fout=pool.fout)
    args = (pool.rows, s["x"], s["a_rows"], s["b_rows"], s["ranks"], s["seg"], s["pallas_schedule"],
            s["shrink_schedule"])
    return lora_pair, args, pool.bytes(t, n)["total"]


def _say(msg: str) -> None:
    """Progress on stderr: under ncu, stdout carries its CSV."""
    print(msg, file=sys.stderr, flush=True)


@jax.jit
def copy_kernel(a):
    return a * 1.0001


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="64x32,256x256", help="comma list of TOKENSxADAPTERS")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--pool-rows", type=int, default=None,
                    help="rows in the pool (default kernels.py's 32768, 256 MB at W 4096; the engine's "
                         "S2 pool is ~100 GB)")
    ap.add_argument("--page-rows", type=int, default=0,
                    help="place each adapter's rows in whole pages of this many rows, as the engine does "
                         "(32: page_size 16, K and V); 0: each row anywhere")
    ap.add_argument("--quick", action="store_true", help="tiny shapes in interpret mode (CPU)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    o = dict(QUICK if args.quick else FULL)
    if args.pool_rows:
        o["min_pool_rows"] = args.pool_rows
    o["page_rows"] = args.page_rows
    hidden = o["hidden"]
    pool = LoraPool("qkvo", hidden, hidden, o, seed=0)
    jax.block_until_ready(pool.rows)
    _say(f"pool ready: {pool.n_rows} rows of {pool.width}")
    interpret = jax.devices()[0].platform == "cpu"
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    if args.quick:
        cases = [(8, 2)]
    result = {"blocks": lora_kernels.BLOCKS, "pool_rows": pool.n_rows, "page_rows": args.page_rows, "cases": []}
    for t, n in cases:
        fn, fargs, nbytes = case_fn(pool, t, n, interpret)
        a = jax.random.normal(jax.random.PRNGKey(t + n), (max(1, nbytes // 4),), jnp.bfloat16)
        _say(f"case {t}x{n}: inputs ready")
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*fargs))
            times.append(time.perf_counter() - t0)
        for _ in range(args.reps):
            jax.block_until_ready(copy_kernel(a))
        out = jax.block_until_ready(fn(*fargs))
        assert bool(jnp.isfinite(out).all()), f"non-finite LoRA delta at {t}x{n}"
        result["cases"].append({"tokens": t, "adapters": n, "bytes": nbytes,
                                "wall_us_last": times[-1] * 1e6, "delta_abs_max": float(jnp.abs(out).max())})
        _say(f"case {t}x{n}: {nbytes / 1e6:.2f} MB, first call {times[0]:.1f} s, last {times[-1] * 1e6:.1f} us wall")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
