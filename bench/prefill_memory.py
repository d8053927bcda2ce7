"""Temporary memory of one compiled prefill step, by shape and query block (no device needed).

    python bench/prefill_memory.py --model llama-7b --layers 1 --blocks 512,1000000

Compiles `forward_sample` for null prefill inputs of (tokens, sequences, pages per sequence) and
prints XLA's memory analysis: the temporaries a step needs besides weights and pool. A block at
least the token count is the unblocked attention (all queries against all keys at once).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == REPO / "bench":
    sys.path[0] = str(REPO)

import jax  # noqa: E402

from slora_jax import LLM

from slora_jax.engine import step as paged  # noqa: E402
from slora_jax.model.config import load_model_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-7b")
    ap.add_argument("--layers", type=int, default=1, help="layers to build (temporaries repeat per layer)")
    ap.add_argument("--shapes", default="2048x16x16,4096x32x32", help="tokens x sequences x pages")
    ap.add_argument("--blocks", default="512,1048576", help="prefill_query_block values")
    args = ap.parse_args()
    cfg = dataclasses.replace(load_model_config(args.model), num_hidden_layers=args.layers)
    print(f"{args.model} ({args.layers} layer(s)) on {jax.devices()[0].device_kind}")
    for block in (int(b) for b in args.blocks.split(",")):
        llm = LLM(cfg, dtype="bfloat16", pool_pages=4, max_num_seqs=64, prefill_query_block=block)
        for shape in args.shapes.split(","):
            t, s, p = (int(x) for x in shape.split("x"))
            inp = llm.engine._null_inputs(t, s, p, decode=False)
            ma = paged.forward_sample.lower(llm.params, llm.engine.kv, inp, cfg=cfg).compile().memory_analysis()
            print(f"  query block {block:8d}  {t:5d} tokens x {s:3d} seqs x {p:3d} pages: "
                  f"temp {ma.temp_size_in_bytes / 2**30:6.2f} GiB")


if __name__ == "__main__":
    main()
