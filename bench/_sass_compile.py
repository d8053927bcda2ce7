"""bench/kernel_sass.py's second half, run in a Python that has triton (not JAX's): compile each
Triton IR file for sm_90 with Triton's compiler, then the PTX with the ptxas Triton ships (-v: its
register count) and the cubin through nvdisasm. Prints one JSON line:
{name: {registers, shared, num_warps, async_copies, fences, ops: {global op form: count}}}.

    python bench/_sass_compile.py '{"lora_shrink": ["k.ttir", 4, 2], ...}'
"""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
_GLOBAL = re.compile(r"\b((?:LDG|STG|ATOMG|REDG|RED)\.[\w.]*)")


def sass_facts(ptx: str) -> tuple[int, collections.Counter, int]:
    """(registers, global op forms in the SASS, MEMBAR count) of a PTX module."""
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        v = subprocess.run([str(BIN / "ptxas"), "-arch=sm_90a", "-v", str(src), "-o", str(cubin)],
                           capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([str(BIN / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    regs = int(re.search(r"Used (\d+) registers", v).group(1))
    ops = collections.Counter(m.group(1).replace(".E.", ".").replace(".E", "") for m in _GLOBAL.finditer(sass))
    return regs, ops, sass.count("MEMBAR")


def main(jobs: dict) -> None:
    out = {}
    for name, (path, num_warps, num_stages) in jobs.items():
        k = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": num_warps, "num_stages": num_stages})
        regs, ops, fences = sass_facts(k.asm["ptx"])
        Path(path).with_suffix(".ptx").write_text(k.asm["ptx"])
        out[name] = dict(registers=regs, shared=int(k.metadata.shared), num_warps=num_warps,
                         async_copies=k.asm["ttgir"].count("async_copy_global_to_local"), fences=fences,
                         ops=dict(ops))
    print(json.dumps(out))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
