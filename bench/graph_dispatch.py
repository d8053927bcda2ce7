"""Does dispatching a step wait for the step before it? A question for XLA's GPU command buffers
(CUDA graphs), asked without the engine.

Session 16 (bench/NOTES.md): under `--xla_gpu_command_buffer_scheduling_mode=CONCURRENT` the S2
decode step's kernels overlapped (traced span 23.59 -> 22.56 ms), but serving got slower: each
step's dispatch waited for the step before, so the overlapped loop (dispatch step n+1, then read
step n's tokens) no longer hid the host's work. CUDA orders each launch of one executable graph
behind the graph's previous launch; if XLA also waits on the host (to update the graph for new
buffer addresses, say), two compiled copies of the step, used in turn, would each find their
previous launch finished.

This runs a stand-in step (per layer: a matmul, an elementwise fusion, and a small matmul beside
them, as a LoRA product runs beside the base projection; a donated state updated in place, as the
pool is) in the engine's overlapped pattern and reports the host's dispatch time a step and the
wall time a step, with one executable or `--copies 2` (distinct names, so XLA compiles two).
Run it once per XLA_FLAGS setting (flags are read at start-up):

  python bench/graph_dispatch.py --copies 1 --out a.json
  XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT python bench/graph_dispatch.py --copies 2 --out b.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.provenance import git_commit  # noqa: E402


def make_step(layers: int):
    """step(state, ws, vs, x) -> (state', row): `layers` blocks of x @ w (the base projection), a
    tanh fusion, and x @ v (a low-rank product beside it), added; the state's row i is set to the
    result's first row (the pool's in-place update); `row` is what the host reads back."""
    def step(state, ws, vs, x):
        for i in range(layers):
            lora = (x @ vs[i][0]) @ vs[i][1]
            x = jnp.tanh(x @ ws[i]) + 0.01 * lora
        state = state.at[0].set(x[0].astype(state.dtype))
        return state, x[:, :2].astype(jnp.float32)
    return step


def compiled_copies(step, copies: int, args):
    """`copies` executables of `step`: each wrapper gets its own name, so each lowers to its own
    module (two jits of one function share one executable)."""
    out = []
    for c in range(copies):
        def named(*a):
            return step(*a)
        named.__name__ = named.__qualname__ = f"stand_in_step_{c}"
        out.append(jax.jit(named, donate_argnums=0).lower(*args).compile())
    return out


def overlapped(fns, state, ws, vs, xs, iters: int):
    """The engine's overlapped loop: dispatch step i (with executable i mod copies), then read
    step i-1's rows. Host us a dispatch and wall us a step."""
    dispatch, prev = [], None
    t_start = time.perf_counter()
    for i in range(iters):
        t0 = time.perf_counter()
        state, rows = fns[i % len(fns)](state, ws, vs, xs[i % len(xs)])
        dispatch.append((time.perf_counter() - t0) * 1e6)
        if prev is not None:
            np.asarray(prev)
        prev = rows
    np.asarray(prev)
    return state, dispatch, (time.perf_counter() - t_start) * 1e6 / iters


def serial(fns, state, ws, vs, xs, iters: int):
    """Each step waited for before the next is dispatched: the device's time a step plus one
    round trip."""
    t_start = time.perf_counter()
    for i in range(iters):
        state, rows = fns[i % len(fns)](state, ws, vs, xs[i % len(xs)])
        np.asarray(rows)
    return state, (time.perf_counter() - t_start) * 1e6 / iters


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256)
    # llama-7b's width: ~1 GB of weights over 32 layers, a step of ~0.5 ms on an H200, long
    # against a graph launch's host cost, so a dispatch that waits for the step shows
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--copies", type=int, default=1, help="executables used in turn (distinct names)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    rng = np.random.default_rng(0)
    w, r, t = args.width, args.rank, args.tokens

    def normal(rows, cols):
        return jnp.asarray(rng.normal(size=(rows, cols)) / np.sqrt(rows), dtype)
    ws = [normal(w, w) for _ in range(args.layers)]
    vs = [(normal(w, r), normal(r, w)) for _ in range(args.layers)]
    xs = [jnp.asarray(rng.normal(size=(t, w)), dtype) for _ in range(4)]
    state = jnp.asarray(rng.normal(size=(64, w)), dtype)
    fns = compiled_copies(make_step(args.layers), args.copies, (state, ws, vs, xs[0]))
    state, _, _ = overlapped(fns, state, ws, vs, xs, 2 * args.copies + 2)  # first runs (graph capture)
    state, serial_us = serial(fns, state, ws, vs, xs, args.iters)
    state, dispatch, wall_us = overlapped(fns, state, ws, vs, xs, args.iters)
    out = dict(commit=git_commit(), device=str(jax.devices()[0].device_kind), jax=jax.__version__,
               command=" ".join(sys.argv), xla_flags=os.environ.get("XLA_FLAGS", ""),
               copies=args.copies, layers=args.layers, tokens=t, width=w, rank=r, iters=args.iters,
               serial_us_per_step=serial_us, overlapped_us_per_step=wall_us,
               dispatch_us_median=statistics.median(dispatch), dispatch_us_mean=statistics.fmean(dispatch),
               dispatch_us_p90=float(np.percentile(dispatch, 90)),
               distinct_executables=len({id(f.runtime_executable()) for f in fns}))
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
