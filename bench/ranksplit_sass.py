"""What the H200 runs for the rank-split decode kernel, found on the CPU: registers, spills and
instruction counts by opcode for each setting at issue 4's point (64 tokens x 32 adapters, llama-7b
4096 -> 4096, bf16), compiled by Triton 3.6 for sm_90 as jax-triton builds it (16-byte aligned
pointers). No GPU and no device time.

    python bench/ranksplit_sass.py [--blocks 'JSON JSON ...'] [--probes] [--out sass.json]

Why: at one unit an SM the kernel's compute is issue-bound (session 28): each warp runs its
instructions once per unit, and an SM's four schedulers issue one a cycle, so a unit's compute
tail is about instructions x warps / 4 cycles. The counts say where those go (conversions,
products, shuffles of the reductions, spills). --probes adds ranksplit.PROBES' forms at the first
setting. The kernel's code appears twice (a program's first unit, then its loop), so counts are
about twice one unit's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from triton_kernels import ranksplit as rs  # noqa: E402

PTR_ARGS = ("total_ptr", "meta_ptr", "arid_ptr", "brid_ptr", "x_ptr", "rows_ptr", "_y_in_ptr", "y_ptr", "times_ptr")
KINDS = {"cvt": ("SHF", "PRMT", "F2F", "F2FP", "LOP3"), "math": ("FFMA", "FMUL", "FADD"),
         "reduce": ("SHFL", "LDS", "STS", "BAR"), "spill": ("LDL", "STL"), "memory": ("LDG", "STG", "REDG", "RED")}


def job(name: str, settings: dict, probe: str = "", t: int = 64, n: int = 32, fin: int = 4096) -> dict:
    ranks = np.array([(8, 16, 32, 64)[k % 4] for k in range(n)], np.int32)
    seg = np.arange(n + 1, dtype=np.int32) * (t // n)
    settings = rs.form(t, n, settings)
    table = rs.plan(ranks, np.zeros((n, 64), np.int32), np.zeros((n, 64), np.int32), seg, t, fin=fin, fout=fin,
                    width=fin, max_rank=64, settings=settings)
    arrays, const, _, options = rs.launch_args(jnp.zeros((t, fin), jnp.bfloat16), jnp.zeros((t, fin), jnp.bfloat16),
                                               jnp.zeros((8, fin), jnp.bfloat16), table, fin=fin, fout=fin,
                                               settings=settings, probe=probe)
    from test_triton_kernels import _TRITON_TYPE
    types = [_TRITON_TYPE[jnp.dtype(a.dtype)] for a in arrays] + ["*bf16", "*i32"]
    return dict(name=name, kernel="lora_ranksplit_kernel", const=const, options=options, sass=True,
                dtypes=dict(zip(PTR_ARGS, types)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default='{} {"ranksplit":{"rank_rows":4,"num_warps":8}}',
                    help="space-separated JSON settings merged into ranksplit.BLOCKS")
    ap.add_argument("--probes", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from test_triton_kernels import _clean_env, interpreter_python
    py = interpreter_python()
    if py is None:
        raise SystemExit("ranksplit_sass: no Python with triton (set SLORA_TRITON_PYTHON)")
    jobs, defaults = [], dict(rs.BLOCKS["ranksplit"])
    for i, blocks in enumerate(a.blocks.split()):
        s = {**defaults, **json.loads(blocks).get("ranksplit", {})}
        jobs.append(job(blocks, s))
        if a.probes and i == 0:
            jobs += [job(f"{blocks} probe {p}", s, p) for p in rs.PROBES if p]
    with tempfile.TemporaryDirectory() as d:
        Path(d, "jobs.json").write_text(json.dumps(jobs))
        p = subprocess.run([py, str(REPO / "tests" / "triton_compile.py"), str(Path(d, "jobs.json"))],
                           env=_clean_env(), capture_output=True, text=True, timeout=1200)
    if p.returncode:
        raise SystemExit(p.stderr[-4000:])
    rows = [json.loads(line[5:]) for line in p.stdout.splitlines() if line.startswith("sass ")]
    for r in rows:
        ops = r["opcodes"]
        kinds = {k: sum(ops.get(o, 0) for o in v) for k, v in KINDS.items()}
        r["kinds"] = kinds
        print(f"{r['name']:<48} regs {r['registers']:>3} stack {r['stack_bytes']:>4} B  instructions "
              f"{r['instructions']:>5}  " + "  ".join(f"{k} {v}" for k, v in kinds.items()))
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
