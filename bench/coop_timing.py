"""Where lora_coop_apply's launch spends its time, program by program (GPU only).

Runs the coop kernel at issue 4's point (llama-7b's 4096 -> 4096 module, 64 decode tokens over 32
adapters of ranks 8-64 cycling, A^T / B rows at random pool rows, bf16) with TIMING on: each program
stores the global timer at its start, once its table row is read, once its chunk claim is answered, after
its own chunk is published, after the wait for the others, and at its end (lora_coop_kernel's
docstring). Prints and writes (--out) the launch's span and each phase's spread over programs.

    python bench/coop_timing.py --out coop_timing.json [--tokens 64 --adapters 32 --calls 20]

The timed launch is the last of --calls (warm caches, as in a serving loop); BLOCKS["coop"] takes
SLORA_TRITON_BLOCKS. The timer stores add a few instructions a program: compare spans with the
untimed kernel's device time (bench/kernels.py --lora-variants coop), not absolute.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.provenance import git_commit  # noqa: E402
from triton_kernels import lora as tk  # noqa: E402

def inputs(t: int, n: int, fin: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    ranks = np.array([(8, 16, 32, 64)[s % 4] for s in range(n)], np.int32)
    seg = np.arange(n + 1, dtype=np.int32) * (t // n)
    n_rows = 2 * int(ranks.sum())
    place = rng.permutation(4 * n_rows)[:n_rows]  # rows scattered through a pool 4x their size
    pool = np.asarray(rng.normal(size=(4 * n_rows, fin)) / 32, np.float32)
    a_idx, b_idx = np.zeros((n, 64), np.int32), np.zeros((n, 64), np.int32)
    nxt = 0
    for s in range(n):
        for idx in (a_idx, b_idx):
            idx[s, :ranks[s]] = place[nxt:nxt + ranks[s]]
            nxt += ranks[s]
    x = jnp.asarray(rng.normal(size=(t, fin)), jnp.bfloat16)
    return (jnp.zeros((t, fin), jnp.bfloat16), x, jnp.asarray(pool, jnp.bfloat16), jnp.asarray(a_idx),
            jnp.asarray(b_idx), jnp.asarray(ranks), jnp.asarray(seg)), ranks, seg


def summarize(times: np.ndarray, live: int, table: np.ndarray) -> dict:
    tm = times[:live].astype(np.int64)
    rel = ((tm[:, :6] - tm[:, 0].min()) % (1 << 32)).astype(np.float64) / 1e3  # us from the first start
    owned = tm[:, 2] != 0  # programs that computed their own chunk
    phases = {"read table row": rel[:, 1] - rel[:, 0], "claim (table + atomic)": rel[owned, 2] - rel[owned, 1],
              "own chunk (rows, A, dot, publish)": rel[owned, 3] - rel[owned, 2],
              "wait": np.concatenate([rel[owned, 4] - rel[owned, 3], rel[~owned, 4] - rel[~owned, 1]]),
              "expand (planes, B, y)": rel[:, 5] - rel[:, 4]}
    rank = table[:live, 4]
    return {"programs": live, "owned_chunks": int(owned.sum()), "span_us": round(float(rel[:, 5].max()), 2),
            "last_start_us": round(float(rel[:, 0].max()), 2), "sms": int(len(np.unique(tm[:, 6]))),
            "phases_us": {k: {q: round(float(np.percentile(d, p)), 2) for q, p in
                              (("p10", 10), ("p50", 50), ("p90", 90), ("max", 100))} for k, d in phases.items()},
            "by_rank_us": {int(r): {"last_start": round(float(rel[rank == r, 0].max()), 2),
                                    "last_end": round(float(rel[rank == r, 5].max()), 2)} for r in np.unique(rank)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if tk.unavailable_reason():
        raise SystemExit(f"coop_timing: {tk.unavailable_reason()}")
    fin = 4096
    args, ranks, seg = inputs(a.tokens, a.adapters, fin)
    jax.block_until_ready(args)
    table, live = tk.coop_schedule(ranks, seg, a.tokens, max_rank=64, fout=fin, width=fin)
    schedule = (jnp.asarray(table), jnp.asarray(live))
    f = jax.jit(lambda *xs: tk._coop(*xs, schedule, max_rank=64, fin=fin, fout=fin, block_t=tk.BLOCK_T, timing=True))
    for _ in range(a.calls):
        y, times = f(*args)
    times = np.asarray(jax.block_until_ready(times))
    res = {"commit": git_commit(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "command": " ".join(sys.argv), "tokens": a.tokens, "adapters": a.adapters, "blocks": tk.BLOCKS["coop"],
           **summarize(times, int(live[0]), table)}
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
