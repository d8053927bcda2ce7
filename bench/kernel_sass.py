"""What the H200 would run for the Pallas LoRA kernels, found on the CPU: registers, shared memory,
programs an SM holds, software-pipeline copies, and the global loads, stores, atomics and fences
in the machine code, for a decode shape and a BLOCKS setting. No GPU and no device time.

    python bench/kernel_sass.py [--tokens 172 --adapters 156] [--blocks JSON] [--keep DIR]

How: the kernels are lowered through Pallas's Triton lowering for sm_90 (JAX on the CPU,
cross-platform lowering, with the GPU query answered), their Triton IR is compiled by Triton's own
compiler in a Python that has triton (SLORA_TRITON_PYTHON, else SLORA_ORACLE_PYTHON, else
.venv-oracle), and the PTX goes through the ptxas and nvdisasm Triton ships. XLA's embedded Triton
is not the same build as that one, so counts can differ slightly from what XLA compiles; the
kernel's structure (how many registers, whether loads are vectorised or pipelined, whether an
atomic carries a fence) is what this is for. Session 13 found with it that the split-K shrink's
atomic adds lower to acq_rel atomics, each behind a MEMBAR.ALL.GPU and followed by an L1
invalidate (hence BLOCKS["shrink"]["split_partials"]), and that the shrink's 120-odd registers
leave an SM four programs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# H100 / H200 (sm_90) per-SM limits.
SM_REGS, SM_SHARED, SM_THREADS, SM_BLOCKS = 65536, 228 * 1024, 2048, 32


def programs_per_sm(regs: int, shared: int, num_warps: int) -> int:
    """Resident programs (CTAs) an SM holds: registers (allocated per warp in units of 256),
    shared memory, threads and the block limit."""
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = SM_REGS // (per_warp * num_warps)
    by_shared = SM_SHARED // shared if shared else SM_BLOCKS
    return max(0, min(by_regs, by_shared, SM_THREADS // (32 * num_warps), SM_BLOCKS))


@contextlib.contextmanager
def _triton_modules():
    """Yields a list that collects the Triton IR text of every pallas_call lowered inside, for an
    H200 (sm_90), on a machine without a GPU (the lowering's GPU query answered)."""
    from jax._src.pallas.triton import lowering as triton_lowering
    from jax._src.pallas.triton import pallas_call_registration as registration

    class _H200:
        compute_capability = 90

    gpu_info = registration.gpu_info_lib.get_gpu_info
    registration.gpu_info_lib.get_gpu_info = lambda: _H200()  # no GPU here: answer the query
    modules = []
    real = triton_lowering.lower_jaxpr_to_triton_module

    def keep(*args, **kw):
        result = real(*args, **kw)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result
    registration.lowering.lower_jaxpr_to_triton_module = keep
    try:
        yield modules
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = real
        registration.gpu_info_lib.get_gpu_info = gpu_info


def lower(tokens: int, adapters: int, max_rank: int, width: int, features: int, out_dir: Path,
          y_dtype: str = "bfloat16") -> dict:
    """Lower the shrink and the expand for a decode step (tokens spread over adapters of rank
    max_rank // 4) to Triton IR files in out_dir; returns {name: (path, num_warps, num_stages)}."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from pallas_kernels import lora

    with _triton_modules() as modules:
        x = jnp.zeros((tokens, features), jnp.bfloat16)
        rows = jnp.zeros((4096, width), jnp.bfloat16)
        a_rows = jnp.zeros((adapters, -(-max_rank * features // width)), jnp.int32)
        ranks = jnp.full((adapters,), max(1, max_rank // 4), jnp.int32)
        seg = jnp.asarray(np.linspace(0, tokens, adapters + 1).astype(np.int32))
        # each kernel's decode block_t: 1 where BLOCKS["mbgmv"] has it
        block_t = lora.decode_block_t("pallas", "expand")
        shrink_bt = lora.decode_block_t("pallas", "shrink", width, features)
        sched = tuple(map(jnp.asarray, lora.shrink_schedule(np.asarray(ranks), np.asarray(seg), tokens, shrink_bt,
                                                            max_rank=max_rank)))
        cpu = jax.devices("cpu")[0]
        with jax.default_device(cpu):
            jax.jit(lambda *a: lora._shrink(*a, max_rank=max_rank, in_features=features, interpret=False,
                                            block_t=shrink_bt, max_programs=lora.BLOCKS["shrink"]["max_programs"])
                    ).trace(x, rows, a_rows, ranks, seg, sched).lower(lowering_platforms=("cuda",))
            xa_shape = jax.eval_shape(lambda *a: lora._shrink(
                *a, max_rank=max_rank, in_features=features, interpret=True, block_t=shrink_bt,
                max_programs=lora.BLOCKS["shrink"]["max_programs"]), x, rows, a_rows, ranks, seg, sched)
            xa = jnp.zeros(xa_shape.shape, xa_shape.dtype)
            y = jnp.zeros((tokens, features), y_dtype)  # the engine's: bf16; bench/kernels.py's default: f32
            bsched = tuple(map(jnp.asarray, lora.block_schedule(np.asarray(ranks), np.asarray(seg), tokens, block_t)))
            jax.jit(lambda *a: lora._expand(*a, max_rank=max_rank, out_features=features, interpret=False,
                                            block_t=block_t, max_programs=lora.BLOCKS["expand"]["max_programs"])
                    ).trace(y, xa, rows, a_rows, ranks, seg, bsched).lower(lowering_platforms=("cuda",))
    out = {}
    for name, text in zip(("lora_shrink", "lora_expand"), [m for m in modules if "tt.func" in m]):
        path = out_dir / f"{name}.ttir"
        path.write_text(text)
        blocks = lora.BLOCKS["shrink" if name == "lora_shrink" else "expand"]
        out[name] = (str(path), blocks["num_warps"], blocks["num_stages"])
    return out


def lower_onetrip(tokens: int, adapters: int, max_rank: int, width: int, features: int, out_dir: Path) -> dict:
    """The one-trip pair (pallas_kernels/onetrip.py) and its one-launch form, lowered the same way,
    for a decode step of tokens spread over adapters with ranks cycling max_rank / 8, / 4, / 2, / 1
    (issue 4's mix at max rank 64); returns {name: (path, num_warps, num_stages)}."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from pallas_kernels import lora, onetrip

    with _triton_modules() as modules:
        ranks = np.array([max(1, max_rank // d) for d in (8, 4, 2, 1)] * -(-adapters // 4), np.int32)[:adapters]
        seg = np.linspace(0, tokens, adapters + 1).astype(np.int32)
        kw = dict(width=width, max_rank=max_rank)
        a_rows = np.zeros((1, adapters, max_rank * features // width), np.int32)
        b_rows = np.zeros((adapters, max_rank * features // width), np.int32)
        sp = tuple(map(jnp.asarray, onetrip.shrink_plan(ranks[None], a_rows, seg, tokens, fin=features, **kw)))
        ep = tuple(map(jnp.asarray, onetrip.expand_plan(ranks, b_rows, seg, tokens, fout=features, **kw)))
        x = jnp.zeros((tokens, features), jnp.bfloat16)
        rows = jnp.zeros((4096, width), jnp.bfloat16)
        with jax.default_device(jax.devices("cpu")[0]):
            xa = jax.eval_shape(lambda: onetrip.onetrip_shrink(x, rows, sp, n_modules=1, max_rank=max_rank,
                                                               interpret=True))
            for fn, args in ((lambda x, rows, sp: onetrip.onetrip_shrink(x, rows, sp, n_modules=1, max_rank=max_rank,
                                                                          interpret=False), (x, rows, sp)),
                             (lambda y, xa, rows, ep: onetrip.onetrip_expand(y, xa, rows, ep, interpret=False),
                              (x, jnp.zeros(xa.shape, xa.dtype), rows, ep)),
                             (lambda y, x, rows, sp, ep: onetrip.onetrip_apply(y, x, rows, sp, ep, max_rank=max_rank,
                                                                               interpret=False), (x, x, rows, sp, ep))):
                jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    s = lora.BLOCKS["onetrip"]
    warps = {"onetrip_shrink": s["shrink_warps"], "onetrip_expand": s["expand_warps"],
             "onetrip_one_launch": s["expand_warps"]}
    out = {}
    for name, text in zip(warps, [m for m in modules if "tt.func" in m]):
        path = out_dir / f"{name}.ttir"
        path.write_text(text)
        out[name] = (str(path), warps[name], s["num_stages"])
    return out


def triton_python() -> str | None:
    for py in (os.environ.get("SLORA_TRITON_PYTHON"), os.environ.get("SLORA_ORACLE_PYTHON"),
               str(REPO / ".venv-oracle" / "bin" / "python")):
        if py and Path(py).exists():
            return py
    return None


def compile_all(jobs: dict, py: str) -> dict:
    """Run bench/_sass_compile.py in the Triton Python on the lowered files."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    p = subprocess.run([py, str(REPO / "bench" / "_sass_compile.py"), json.dumps(jobs)], env=env,
                       capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"compiling the Triton IR failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=172, help="decode rows (S2's decode steps: ~172)")
    ap.add_argument("--adapters", type=int, default=156, help="distinct adapters (S2: ~156)")
    ap.add_argument("--max-rank", type=int, default=64)
    ap.add_argument("--width", type=int, default=4096, help="pool row width W")
    ap.add_argument("--features", type=int, default=4096, help="the module's in (shrink) and out (expand)")
    ap.add_argument("--blocks", default="", help="JSON merged into pallas_kernels.lora.BLOCKS")
    ap.add_argument("--y-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="the expand's y (the engine adds into bf16 projection outputs; bench/kernels.py's "
                         "delta form is float32)")
    ap.add_argument("--keep", default="", help="a folder for the .ttir / .ptx / .sass files")
    ap.add_argument("--kernels", default="lora", choices=("lora", "onetrip"),
                    help="lora.py's pair, or onetrip.py's pair and one-launch form (the features go to in and out)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from pallas_kernels import lora
    if args.blocks:
        lora._merge_blocks(args.blocks)
    py = triton_python()
    if py is None:
        raise SystemExit("no Python with triton: set SLORA_TRITON_PYTHON (make oracle builds .venv-oracle)")
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.keep or tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        if args.kernels == "onetrip":
            jobs = lower_onetrip(args.tokens, args.adapters, args.max_rank, args.width, args.features, out_dir)
        else:
            jobs = lower(args.tokens, args.adapters, args.max_rank, args.width, args.features, out_dir, args.y_dtype)
        result = compile_all(jobs, py)
    for name, r in result.items():
        r["programs_per_sm"] = programs_per_sm(r["registers"], r["shared"], r["num_warps"])
    if args.json:
        print(json.dumps(result))
    else:
        print(f"T={args.tokens} adapters={args.adapters} W={args.width} features={args.features} "
              f"BLOCKS {args.blocks or '(defaults)'}")
        for name, r in result.items():
            print(f"  {name:<12} {r['registers']:>3} registers, {r['shared']:>6} B shared, "
                  f"{r['programs_per_sm']} programs/SM ({r['num_warps']} warps), "
                  f"{r['async_copies']} cp.async, {r['fences']} MEMBAR; " +
                  ", ".join(f"{k} x{v}" for k, v in sorted(r["ops"].items())))
    return result


if __name__ == "__main__":
    main()
