"""Packed prefill attention, one llama-7b layer: the Pallas kernel against the engine's xla path.

    python bench/prefill_attention.py --out bench/results/prefill-attention-h200.json   # GPU, ~1 min
    JAX_PLATFORMS=cpu python bench/prefill_attention.py --quick                          # smoke test

Each case is a packed prefill step as the engine builds it (StepInputBuilder): `rows` chunks of
`new` tokens each over `context` tokens in the pool, in a token bucket of pow2(rows * new) and a
context-page bucket of pow2(rows * context / page_size), pages in random order. The xla path is
`paged_attention_xla` on those StepInputs (a dense masked attention over the whole step's context,
key windows for fresh prompts); the kernel is `paged_prefill_attention` on `prefill_tables` of the
same inputs, the engine's wiring. Both outputs are checked against each other on the real tokens
before timing; time = median over --iters of one call's wall time (block_until_ready), and per new
token. `--sizes 64x64,128x64` times the kernel at each (block_q x block_k) too.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == REPO / "bench":
    sys.path[0] = str(REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.provenance import git_commit  # noqa: E402
from pallas_kernels.prefill_attention import PrefillBlockSizes, paged_prefill_attention  # noqa: E402
from slora_jax.engine import attention  # noqa: E402
from slora_jax.engine.inputs import pow2, xla_key_window  # noqa: E402
from slora_jax.engine.step import StepInputs  # noqa: E402

# (name, rows, new tokens a row, context tokens a row). The engine's xla attention keeps a step's
# context near a token budget's pages (256 at llama-7b's 4096), about 3 rows over 1,300 cached
# tokens; the kernel reads each row's own context, so a step may take 16 such rows.
CASES = [("cached prompts, xla cap", 3, 100, 1300), ("cached prompts, 16 rows", 16, 100, 1300),
         ("continued chats", 8, 200, 2000), ("fresh prompts", 16, 256, 0), ("one long chunk", 1, 2048, 2048)]
QUICK = [("cached prompts", 4, 20, 70), ("fresh prompts", 4, 32, 0)]


def step_inputs(rows: int, new: int, context: int, ps: int, rng) -> tuple[StepInputs, int]:
    t = pow2(rows * new, 16)
    per_row = -(-context // ps)
    k = pow2(max(rows * per_row, 1))
    pages = rng.permutation(np.arange(1, rows * per_row + 1)).astype(np.int32)
    token_seq = np.full(t, -1, np.int32)
    token_seq[:rows * new] = np.repeat(np.arange(rows), new)
    positions = np.zeros(t, np.int32)
    positions[:rows * new] = np.tile(context + np.arange(new), rows)
    ctx_pages, ctx_seq, ctx_fill = np.zeros(k, np.int32), np.full(k, -1, np.int32), np.zeros(k, np.int32)
    if context:
        ctx_pages[:rows * per_row] = pages
        ctx_seq[:rows * per_row] = np.repeat(np.arange(rows), per_row)
        fill = np.full(per_row, ps)
        fill[-1] = context - (per_row - 1) * ps
        ctx_fill[:rows * per_row] = np.tile(fill, rows)
    s = pow2(rows, 16)
    zeros_s = np.zeros(s, np.int32)
    inp = StepInputs(tokens=np.zeros(t, np.int32), positions=positions, kv_slot=np.zeros(t, np.int32),
                     token_seq=token_seq, page_table=np.zeros((s, 1), np.int32), ctx_lens=zeros_s,
                     sample_idx=zeros_s, temperature=zeros_s.astype(np.float32), top_k=zeros_s,
                     top_p=zeros_s.astype(np.float32), seeds=zeros_s.astype(np.uint32), steps=zeros_s,
                     lora=None, decode=False, attention_backend="xla", prefill_context=context > 0,
                     key_window=0 if context else xla_key_window(t, new),
                     ctx_pages=ctx_pages if context else None, ctx_page_seq=ctx_seq if context else None,
                     ctx_page_fill=ctx_fill if context else None)
    return jax.tree.map(jnp.asarray, inp), rows * per_row + 1


def timed(fn, args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes (CPU smoke test)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument("--sizes", default="", help="kernel block sizes to time too: comma list of QxK")
    args = ap.parse_args()
    nh, kvh, d, ps = (4, 2, 16, 4) if args.quick else (32, 32, 128, 16)
    dtype = jnp.float32 if args.quick else jnp.bfloat16
    rng = np.random.default_rng(0)
    results = []
    for name, rows, new, context in (QUICK if args.quick else CASES):
        inp, n_pages = step_inputs(rows, new, context, ps, rng)
        t = inp.tokens.shape[0]
        key = jax.random.PRNGKey(len(results))
        kq, kk, kv, kp = jax.random.split(key, 4)
        q = jax.random.normal(kq, (t, nh, d), dtype)
        k = jax.random.normal(kk, (t, kvh, d), dtype)
        vv = jax.random.normal(kv, (t, kvh, d), dtype)
        pool = jax.random.normal(kp, (n_pages, 2, ps, kvh * d), dtype)
        real = rows * new

        def kernel_of(sizes=None):
            return jax.jit(lambda q, k, v, pool, inp: paged_prefill_attention(
                q, k, v, pool, *attention.prefill_tables(inp), sizes=sizes))
        variants = {"xla": jax.jit(attention.paged_attention_xla), "kernel": kernel_of()}
        for qk in filter(None, args.sizes.split(",")):
            bq, bk = map(int, qk.split("x"))
            variants[f"kernel {qk}"] = kernel_of(PrefillBlockSizes(bq, bk))
        outs = {v: np.asarray(f(q, k, vv, pool, inp)[:real], np.float32) for v, f in variants.items()}
        scale = max(np.abs(outs["xla"]).max(), 1e-9)
        row = {"case": name, "rows": rows, "new": new, "context": context, "tokens": t,
               "context_pages": int(inp.ctx_pages.shape[0]) if context else 0,
               "max_rel_err": {v: float(np.abs(o - outs["xla"]).max() / scale) for v, o in outs.items() if v != "xla"},
               "ms": {v: 1e3 * timed(f, (q, k, vv, pool, inp), args.iters) for v, f in variants.items()}}
        row["us_per_new_token"] = {v: 1e3 * ms / real for v, ms in row["ms"].items()}
        results.append(row)
        times = "  ".join(f"{v} {ms:8.3f} ms ({row['us_per_new_token'][v]:6.2f} us/token)" for v, ms in row["ms"].items())
        print(f"{name:24s} {rows:3d} x {new:4d} new over {context:5d}: {times}", flush=True)
    out = {"commit": git_commit(), "device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
           "jax": jax.__version__, "python": platform.python_version(), "command": " ".join(sys.argv),
           "layer": {"q_heads": nh, "kv_heads": kvh, "head_dim": d, "page_size": ps, "dtype": str(dtype.dtype)},
           "cases": results}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
