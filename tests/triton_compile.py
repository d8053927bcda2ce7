"""Compile triton_kernels/_lora_tl.py's kernels for an H200 (sm_90) on the CPU: Triton's own
front end, optimiser and the ptxas it ships, no GPU and no JAX. What the interpreter cannot catch
(types, layouts, loop bounds, shared memory) fails here. tests/test_triton_kernels.py runs it:

  python tests/triton_compile.py JOBS.json      # [{"kernel", "dtypes": {arg: "*bf16"}, "const"}]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from triton_kernels import _lora_tl  # noqa: E402


def main(jobs_path: str) -> None:
    for job in json.loads(Path(jobs_path).read_text()):
        fn = getattr(_lora_tl, job["kernel"])
        names = fn.arg_names
        signature = {n: job["dtypes"].get(n, "constexpr") for n in names}
        constexprs = {(names.index(k),): v for k, v in job["const"].items()}
        kernel = triton.compile(ASTSource(fn, signature=signature, constexprs=constexprs),
                                target=GPUTarget("cuda", 90, 32), options=job["options"])
        print(job["kernel"], job["const"].get("F32_DOT"), "shared", kernel.metadata.shared,
              "cubin", len(kernel.asm["cubin"]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
