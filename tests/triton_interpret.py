"""Run triton_kernels/_ranksplit_tl.py's kernel under Triton's interpreter, on the CPU, with torch.

Not a test: tests/test_ranksplit.py runs this in an interpreter that has triton and torch but
not necessarily JAX (the oracle's Python 3.11, for instance); JAX builds the kernels' inputs there,
and checks the outputs against the jnp references. Talks through files only:

  python tests/triton_interpret.py JOBS.json ARRAYS.npz OUT.npz

JOBS.json: [{"name", "kernel", "arrays": [npz keys, in kernel order], "const": {...}, "grid": [...]}].
The last array of a job is the buffer its output aliases (the zero xa, or y); the kernel writes it
in place, and OUT.npz holds it under the job's name. A job with "outs" lists its kernel's outputs
instead (["alias", i]: input i, written in place; ["new", shape, dtype, fill]: a fresh buffer) and
OUT.npz holds the first. bfloat16 arrays travel as uint16 with keys
ending in "@bf16".
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from triton_kernels import _ranksplit_tl  # noqa: E402


def _fix_scalar_index() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with int(<array of shape (1,)>),
    which NumPy >= 2.4 refuses: a loop bound loaded from memory (`range(p, total, ...)`) fails.
    Use .item() instead, which works with every NumPy."""
    from triton.runtime import interpreter
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))
    interpreter._patch_lang_tensor = patched


def _fix_bf16_dot() -> None:
    """Triton 3.6's interpreter keeps bfloat16 as uint16 and multiplies those integers in tl.dot.
    Widen bfloat16 operands to float32 first (exact), which is what the GPU's bf16 MMA with float32
    accumulation computes."""
    import triton.language as tl
    from triton.runtime import interpreter
    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        f32 = (h.data.astype(np.uint32) << 16).view(np.float32)
        return interpreter.TensorHandle(f32, tl.float32)

    def create_dot(self, a, b, d, *rest):
        return original(self, widen(a), widen(b), d, *rest)
    builder.create_dot = create_dot


def _fix_bf16_cast() -> None:
    """Triton 3.6's interpreter truncates float32 -> bfloat16 in `.to()`; the GPU rounds to
    nearest even (Triton's default rounding). Round to nearest even (finite values)."""
    import triton.language as tl
    from triton.runtime import interpreter
    builder = interpreter.InterpreterBuilder
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, np.float32).view(np.uint32).astype(np.uint64)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return interpreter.TensorHandle(bits.astype(np.uint16), tl.bfloat16)
        return original(self, src, dst_type)
    builder.cast_impl = cast_impl


def _fix_bf16_atomic_add() -> None:
    """Triton 3.6's interpreter has no bfloat16 atomics ("Unsupported data type"); the GPU adds
    bfloat16 in place (sm_90's REDG.ADD.BF16x8, rounding to nearest even). The interpreter runs one
    program at a time, so a plain read, add in float32, round and write per element is the same."""
    import ctypes

    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.runtime import interpreter
    builder = interpreter.InterpreterBuilder
    original = builder.create_atomic_rmw

    def create_atomic_rmw(self, rmwOp, ptr, val, mask, sem, scope):
        if val.dtype.scalar != tl.bfloat16 or rmwOp != ir.ATOMIC_OP.FADD:
            return original(self, rmwOp, ptr, val, mask, sem, scope)
        addrs = np.broadcast_to(ptr.data, val.data.shape).reshape(-1)
        vals = np.ascontiguousarray(val.data).reshape(-1)
        live = np.broadcast_to(mask.data, val.data.shape).reshape(-1)
        old = np.zeros(len(addrs), np.uint16)
        for i in np.flatnonzero(live):
            cell = ctypes.c_uint16.from_address(int(addrs[i]))
            old[i] = cell.value
            total = np.array([old[i], vals[i]], np.uint32) << 16
            f = np.float32(total[0:1].view(np.float32)[0] + total[1:2].view(np.float32)[0])
            bits = int(np.array([f], np.float32).view(np.uint32)[0])
            cell.value = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
        return interpreter.TensorHandle(old.reshape(val.data.shape), tl.bfloat16)
    builder.create_atomic_rmw = create_atomic_rmw


def to_torch(key: str, a: np.ndarray) -> torch.Tensor:
    if key.endswith("@bf16"):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def to_numpy(key: str, t: torch.Tensor) -> np.ndarray:
    if key.endswith("@bf16"):
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def main(jobs_path: str, arrays_path: str, out_path: str) -> None:
    _fix_scalar_index()
    _fix_bf16_dot()
    _fix_bf16_cast()
    _fix_bf16_atomic_add()
    jobs = json.loads(Path(jobs_path).read_text())
    with np.load(arrays_path) as z:
        arrays = {k: z[k] for k in z.files}
    out = {}
    for job in jobs:
        keys = job["arrays"]
        args = [to_torch(k, arrays[k].copy()) for k in keys]
        outs = job.get("outs")
        if outs is None:
            args.append(args[-1])  # the output aliases the last input
            first = len(keys) - 1
        else:  # ["alias", input index] or ["new", shape, torch dtype name, fill value]
            first = outs[0][1]
            args += [args[o[1]] if o[0] == "alias" else torch.full(o[1], float(o[3]), dtype=getattr(torch, o[2]))
                     for o in outs]
        getattr(_ranksplit_tl, job["kernel"])[tuple(job["grid"])](*args, **job["const"])
        out[job["name"] + ("@bf16" if keys[first].endswith("@bf16") else "")] = to_numpy(keys[first],
                                                                                         args[first])
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
