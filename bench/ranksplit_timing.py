"""Where the rank-split kernel's launch spends its time, program by program (GPU only).

Runs triton_kernels/ranksplit.py at issue 4's point (llama-7b's 4096 -> 4096 module, 64 decode
tokens over 32 adapters of ranks 8-64 cycling, A^T / B rows at random pool rows, bf16) with TIMING
on: each program stores the global timer at its start, once its first table entry is read, once its
first xa and its first delta are computed (so after its A^T rows and x, then its B rows, arrived),
and at its end (lora_ranksplit_kernel's docstring). Prints and writes (--out) the launch's span and
each phase's spread over the live programs.

    python bench/ranksplit_timing.py --out ranksplit_timing.json [--blocks JSON] [--calls 20]

The timed launch is the last of --calls. The stamps add a few instructions and two reductions a
program: compare spans with the untimed kernel's device time (bench/kernels.py --lora-variants
ranksplit), not absolute.
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

from bench.coop_timing import inputs  # noqa: E402
from bench.provenance import git_commit  # noqa: E402
from triton_kernels import lora as tk  # noqa: E402
from triton_kernels import ranksplit as rs  # noqa: E402


def summarize(times: np.ndarray, meta: np.ndarray) -> dict:
    """Phases in µs from the launch's first start, over the programs whose first unit was live."""
    tm = times.astype(np.int64)
    rel = ((tm[:, :5] - tm[:, 0].min()) % (1 << 32)).astype(np.float64) / 1e3
    live = meta[:len(tm), 2] > 0
    r = rel[live]
    phases = {"start": r[:, 0], "entry read (after start)": r[:, 1] - r[:, 0],
              "A^T + x in, xa (after entry)": r[:, 2] - r[:, 1], "B in, delta (after xa)": r[:, 3] - r[:, 2],
              "adds and the rest (after delta)": r[:, 4] - r[:, 3], "end": r[:, 4]}
    return {"programs": int(len(tm)), "live_first_units": int(live.sum()), "span_us": round(float(rel[:, 4].max()), 2),
            "dead_end_us": round(float(rel[~live, 4].max()), 2) if (~live).any() else None,
            "sms": int(len(np.unique(tm[:, 5]))), "units_max": int(tm[:, 6].max()),
            "phases_us": {k: {q: round(float(np.percentile(d, p)), 2) for q, p in
                              (("min", 0), ("p10", 10), ("p50", 50), ("p90", 90), ("max", 100))}
                          for k, d in phases.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--blocks", default=None, help='JSON merged into ranksplit.BLOCKS, e.g. {"ranksplit": {"rank_rows": 4}}')
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if tk.unavailable_reason():
        raise SystemExit(f"ranksplit_timing: {tk.unavailable_reason()}")
    rs.set_blocks(a.blocks)
    fin = 4096
    (y, x, pool, a_idx, b_idx, ranks_j, seg_j), ranks, seg = inputs(a.tokens, a.adapters, fin)
    table = rs.plan(ranks, np.asarray(a_idx), np.asarray(b_idx), seg, a.tokens, fin=fin, fout=fin, width=fin,
                    max_rank=64)
    dev_table = tuple(map(jnp.asarray, table))
    f = jax.jit(lambda y, x, pool: rs._apply(y, x, pool, dev_table, fin=fin, fout=fin, settings=rs._frozen(),
                                             timing=True))
    for _ in range(a.calls):
        out, times = f(y, x, pool)
    times = np.asarray(jax.block_until_ready(times))
    res = {"commit": git_commit(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "command": " ".join(sys.argv), "tokens": a.tokens, "adapters": a.adapters,
           "blocks": rs.BLOCKS["ranksplit"], "live_units": int(table[0][0]), **summarize(times, table[1])}
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
