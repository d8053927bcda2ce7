"""Where the rank-split kernel's launch spends its time, program by program (GPU only).

Runs triton_kernels/ranksplit.py at issue 4's point (llama-7b's 4096 -> 4096 module, 64 decode
tokens over 32 adapters of ranks 8-64 cycling, A^T / B rows at random pool rows, bf16) with TIMING
on: each program stores the global timer at its start, once its first table entry is read, once its
first xa and its first delta are computed (so after its A^T rows and x, then its B rows, arrived),
and at its end (lora_ranksplit_kernel's docstring). Prints and writes (--out) the launch's span and
each phase's spread over the live programs.

    python bench/ranksplit_timing.py --out ranksplit_timing.json [--blocks JSON] [--calls 20]

The timed launch is the last of --calls, which take --sets input sets in turn (so its rows come
from HBM, not from L2, as in a serving step; sessions before 28 timed one set: L2). The stamps add a few instructions and two reductions a
program: compare spans with the untimed kernel's device time (bench/kernels.py --lora-variants
ranksplit), not absolute.

    python bench/ranksplit_timing.py --probe [--probe-blocks 'JSON JSON ...'] --out probe.json

--probe times the untimed kernel instead (device µs of its launches, over --sets input sets in
turn so the rows come from HBM, not L2) for each setting in --probe-blocks and, at each, its probes
(ranksplit.PROBES: plain stores for the atomic adds, no output at all, programs that end after
their first entry): where the launch's time goes, by difference, in one process. --probes kernel
times the kernel alone: settings side by side in one process.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.coop_timing import inputs  # noqa: E402
from bench.device_trace import traced  # noqa: E402
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


def probe(a) -> dict:
    """Device µs a launch (median over rounds of --sets launches) of each setting and its probes."""
    fin = 4096
    sets = []
    for k in range(a.sets):
        (y, x, pool, a_idx, b_idx, _, _), ranks, seg = inputs(a.tokens, a.adapters, fin, seed=k)
        sets.append((y, x, pool, a_idx, b_idx, ranks, seg))
    out = {"commit": git_commit(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "command": " ".join(sys.argv), "tokens": a.tokens, "adapters": a.adapters, "sets": a.sets,
           "settings": []}
    defaults = dict(rs.BLOCKS["ranksplit"])
    for blocks in a.probe_blocks.split():
        rs.BLOCKS["ranksplit"] = dict(defaults)
        rs.set_blocks(blocks)
        tables = [tuple(map(jnp.asarray, rs.plan(r, np.asarray(ai), np.asarray(bi), sg, a.tokens, fin=fin, fout=fin,
                                                  width=fin, max_rank=64)))
                  for (_, _, _, ai, bi, r, sg) in sets]
        row = {"blocks": blocks, "live_units": int(tables[0][0][0]), "probes": {}}
        for name in [k for k in rs.PROBES if (k or "kernel") in a.probes.split(",")]:
            f = jax.jit(functools.partial(rs._apply, fin=fin, fout=fin, settings=rs._frozen(rs.form(a.tokens, a.adapters)),
                                          probe=name))
            try:
                outs = [f(s[0], s[1], s[2], t) for s, t in zip(sets, tables)]
                jax.block_until_ready(outs)
                if name == "":
                    want = rs.ranksplit_reference(sets[0][0], sets[0][1], sets[0][2], tables[0], fin=fin, fout=fin)
                    err = float(jnp.max(jnp.abs(outs[0].astype(jnp.float32) - want.astype(jnp.float32)))
                                / jnp.max(jnp.abs(want.astype(jnp.float32))))
                    row["rel_err"] = err
                for _ in range(3):
                    jax.block_until_ready([f(s[0], s[1], s[2], t) for s, t in zip(sets, tables)])
                per = []
                for _ in range(a.rounds):
                    with traced() as events:
                        jax.block_until_ready([f(s[0], s[1], s[2], t) for s, t in zip(sets, tables)])
                    mine = [float(e["dur"]) for e in events if "ranksplit" in e.get("name", "")]
                    per.append(sum(mine) / max(len(mine), 1))
                row["probes"][name or "kernel"] = round(float(np.median(per)), 2)
            except Exception as e:  # noqa: BLE001 - a probe that fails to build is reported, the rest go on
                row["probes"][name or "kernel"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)
        out["settings"].append(row)
    rs.BLOCKS["ranksplit"] = defaults
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--blocks", default=None, help='JSON merged into ranksplit.BLOCKS, e.g. {"ranksplit": {"rank_rows": 4}}')
    ap.add_argument("--out", default=None)
    ap.add_argument("--probe", action="store_true", help="device time of each --probe-blocks setting and its probes")
    ap.add_argument("--probe-blocks", default="{}", help="space-separated JSON settings (--probe)")
    ap.add_argument("--probes", default=",".join(k or "kernel" for k in rs.PROBES),
                    help="comma-separated forms to time at each setting (--probe): kernel and ranksplit.PROBES' names")
    ap.add_argument("--sets", type=int, default=6, help="input sets taken in turn (--probe)")
    ap.add_argument("--rounds", type=int, default=5, help="traced rounds of --sets launches (--probe)")
    a = ap.parse_args()
    if tk.unavailable_reason():
        raise SystemExit(f"ranksplit_timing: {tk.unavailable_reason()}")
    if a.probe:
        res = probe(a)
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1))
        return
    rs.set_blocks(a.blocks)
    if rs.BLOCKS["ranksplit"]["phased"] is None:  # the stamps are the one-trip form's
        rs.BLOCKS["ranksplit"]["phased"] = False
    fin = 4096
    runs = []  # --sets input sets in turn, so the timed launch's rows come from HBM (not L2)
    for k in range(a.sets):
        (y, x, pool, a_idx, b_idx, ranks_j, seg_j), ranks, seg = inputs(a.tokens, a.adapters, fin, seed=k)
        table = rs.plan(ranks, np.asarray(a_idx), np.asarray(b_idx), seg, a.tokens, fin=fin, fout=fin, width=fin,
                        max_rank=64)
        runs.append(((y, x, pool), tuple(map(jnp.asarray, table)), table))
    f = jax.jit(lambda y, x, pool, t: rs._apply(y, x, pool, t, fin=fin, fout=fin, settings=rs._frozen(), timing=True))
    for c in range(a.calls):
        args, dev_table, table = runs[c % len(runs)]
        out, times = f(*args, dev_table)
    times = np.asarray(jax.block_until_ready(times))
    res = {"commit": git_commit(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "command": " ".join(sys.argv), "tokens": a.tokens, "adapters": a.adapters,
           "blocks": rs.BLOCKS["ranksplit"], "live_units": int(table[0][0]), **summarize(times, table[1])}
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
