"""Compile triton_kernels/_ranksplit_tl.py's kernel for an H200 (sm_90) on the CPU: Triton's own
front end, optimiser and the ptxas it ships, no GPU and no JAX. What the interpreter cannot catch
(types, layouts, loop bounds, shared memory) fails here. tests/test_ranksplit.py runs it:

  python tests/triton_compile.py JOBS.json      # [{"kernel", "dtypes": {arg: "*bf16"}, "const"}]

A job with "sass": true is compiled as jax-triton builds it (every pointer declared 16-byte
aligned, tt.divisibility 16) and gets one more line, "sass {json}": its registers, spills, shared
memory and instruction counts by opcode from the cubin (cuobjdump, nvdisasm: Triton ships both);
bench/ranksplit_sass.py prints those. Without it the pointers carry no alignment, so vector
atomics and 16-byte gathers compile to narrower forms than run on the GPU.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from triton_kernels import _ranksplit_tl  # noqa: E402


def main(jobs_path: str) -> None:
    for job in json.loads(Path(jobs_path).read_text()):
        fn = getattr(_ranksplit_tl, job["kernel"])
        names = fn.arg_names
        signature = {n: job["dtypes"].get(n, "constexpr") for n in names}
        constexprs = {(names.index(k),): v for k, v in job["const"].items()}
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in job["dtypes"]} if job.get("sass") else None
        kernel = triton.compile(ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                target=GPUTarget("cuda", 90, 32), options=job["options"])
        print(job["kernel"], "shared", kernel.metadata.shared,
              "cubin", len(kernel.asm["cubin"]), flush=True)
        if os.environ.get("SLORA_DUMP_ASM"):  # a folder: the job's TTGIR, PTX and SASS, for reading layouts
            out = Path(os.environ["SLORA_DUMP_ASM"])
            out.mkdir(parents=True, exist_ok=True)
            stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", job.get("name", job["kernel"]))[:80]
            for kind in ("ttgir", "ptx"):
                (out / f"{stem}.{kind}").write_text(kernel.asm[kind])
            (out / f"{stem}.cubin").write_bytes(kernel.asm["cubin"])
        if job.get("sass"):
            print("sass", json.dumps({"name": job.get("name", job["kernel"]), "shared": kernel.metadata.shared,
                                      **sass_summary(kernel.asm["cubin"])}), flush=True)


def sass_summary(cubin: bytes) -> dict:
    """Registers, spill bytes and instruction counts by opcode (whole kernel) of a cubin."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        Path(path).write_bytes(cubin)
        res = subprocess.run([str(tools / "cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tools / "nvdisasm"), "-c", path], capture_output=True, text=True).stdout
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass, re.M)
    regs = re.search(r"REG:(\d+)", res)
    spill = re.search(r"STACK:(\d+)", res)
    return {"registers": int(regs.group(1)) if regs else None, "stack_bytes": int(spill.group(1)) if spill else None,
            "instructions": len(ops), "opcodes": dict(collections.Counter(ops).most_common())}


if __name__ == "__main__":
    main(sys.argv[1])
