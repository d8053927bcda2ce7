"""What the GPU runs for a plain step: the StableHLO of `forward_sample` lowered for an H200 on the
CPU (no GPU needed), at llama-7b's shapes, one sha256 per step shape.

    PYTHONPATH=TREE JAX_PLATFORMS=cpu python bench/step_hlo.py [--out hashes.json]

A plain step carries no adapters and no sampling extras (`StepInputs.sampling` None), with the
Pallas decode and prefill kernels as on a GPU. Run with PYTHONPATH at two trees of the code to
tell whether a change alters the device program of a plain step: equal hashes, the same program,
so the same device time. The Triton kernels' IR records its source file's path, so export both trees to paths
of the same length (`git archive C | tar -x -C /tmp/tree-C`) before comparing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import warnings

import jax
import jax.numpy as jnp

import pallas_kernels.paged_attention as decode_kernel
import pallas_kernels.prefill_attention as prefill_kernel
from slora_jax.engine.step import StepInputs, forward_sample
from slora_jax.model.config import load_model_config
from slora_jax.model.weights import _abstract_params

SHAPES = {"decode B1": (1, 1, 256), "decode B64": (64, 64, 256), "prefill 512": (16, 512, 1)}  # rows, tokens, pages


def step_hlo(cfg, rows: int, tokens: int, pages: int, decode: bool) -> str:
    s, i32, f32 = jax.ShapeDtypeStruct, jnp.int32, jnp.float32
    inp = StepInputs(tokens=s((tokens,), i32), positions=s((tokens,), i32), kv_slot=s((tokens,), i32),
                     token_seq=s((tokens,), i32), page_table=s((rows, pages), i32), ctx_lens=s((rows,), i32),
                     sample_idx=s((rows,), i32), temperature=s((rows,), f32), top_k=s((rows,), i32),
                     top_p=s((rows,), f32), seeds=s((rows,), jnp.uint32), steps=s((rows,), i32), lora=None,
                     decode=decode, attention_backend="pallas", prefill_context=decode)
    pool = [s((4096, 2, 16, cfg.kv_size), jnp.bfloat16)] * cfg.num_hidden_layers
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
        warnings.simplefilter("ignore", DeprecationWarning)  # the Triton backend's notice
        lowered = forward_sample.trace(_abstract_params(cfg, jnp.bfloat16), pool, inp, cfg=cfg).lower(
            lowering_platforms=("cuda",))
    return re.sub(r"loc\([^)]*\)", "", lowered.as_text(debug_info=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON of the hashes")
    args = ap.parse_args()
    for kernel in (decode_kernel, prefill_kernel):  # the Triton kernels, not their CPU interpreter
        kernel._interpret = lambda interpret: False
    cfg = load_model_config("llama-7b")
    hashes = {}
    for name, (rows, tokens, pages) in SHAPES.items():
        text = step_hlo(cfg, rows, tokens, pages, decode=name.startswith("decode"))
        hashes[name] = hashlib.sha256(text.encode()).hexdigest()
        print(f"{name:12s} {hashes[name]}  ({len(text)} chars, {text.count('xla.gpu.triton')} Triton calls)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": "llama-7b", "dtype": "bfloat16", "platform": "cuda (lowered on the CPU)",
                       "jax": jax.__version__, "hashes": hashes}, f, indent=1)


if __name__ == "__main__":
    main()
