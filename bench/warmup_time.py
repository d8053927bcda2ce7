"""How long `LLM.warmup` takes to compile every step bucket, and whether serving then compiles
anything: the start-up cost of a server, whole-model jit vs `compile_per_layer`.

    python bench/warmup_time.py --model tiny --layers 16 --per-layer 0   # CPU: a deep tiny model
    python bench/warmup_time.py --model llama-7b --per-layer 1 --workers 8 --out w.json   # GPU

The engine has S2's shape settings (page size 16, 256 sequences, 4096 prefill tokens, 32 prefill
sequences, max rank 64) unless --quick; adapters are rank-8 q,k,v,o PEFT directories. The
persistent compilation cache is off, so every bucket really compiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--per-layer", type=int, default=0, help="EngineOptions.compile_per_layer (0/1)")
    ap.add_argument("--workers", type=int, default=1, help="Engine.warmup compile threads")
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--quick", action="store_true", help="a small engine (16 sequences, 256 prefill tokens)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from jax import monitoring
    compiles: list[float] = []
    monitoring.register_event_duration_secs_listener(
        lambda e, d, **_: compiles.append(d) if e == COMPILE_EVENT else None)
    import jax
    from bench.provenance import git_commit
    from slora_jax import LLM, SamplingParams
    from slora_jax.model.peft import random_peft_adapter
    from slora_jax.model.config import load_model_config

    cfg = load_model_config(args.model)
    if args.layers:
        cfg = dataclasses.replace(cfg, num_hidden_layers=args.layers)
    path = random_peft_adapter(Path(tempfile.mkdtemp()) / "a", cfg, rank=8,
                               targets=["q_proj", "k_proj", "v_proj", "o_proj"], seed=1, std=0.02)
    sizes = (dict(max_num_seqs=16, max_prefill_tokens=256, max_prefill_seqs=8) if args.quick else
             dict(max_num_seqs=256, max_prefill_tokens=4096, max_prefill_seqs=32))
    llm = LLM(cfg, adapters={"a": path}, dtype=args.dtype, page_size=16, max_lora_rank=64,
              compilation_cache_dir=None, compile_per_layer=bool(args.per_layer), min_decode_batch=16,
              pool_pages=None if jax.default_backend() == "gpu" else 512, **sizes)
    t = time.perf_counter()
    shapes = llm.warmup(max_context=args.max_context, workers=args.workers)
    warm_s, warm_compiles = time.perf_counter() - t, len(compiles)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([[5, 6, 7, 8]] * 3, sp, adapter=["a", None, "a"])
    result = {"commit": git_commit(), "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "model": cfg.name,
              "layers": cfg.num_hidden_layers, "compile_per_layer": bool(args.per_layer), "workers": args.workers,
              "shapes": shapes, "warmup_s": warm_s, "backend_compiles": warm_compiles,
              "backend_compile_s": sum(compiles[:warm_compiles]),
              "compiles_after_warmup": len(compiles) - warm_compiles,  # adapter page-in scatters
              "first_generate_s": time.perf_counter() - t}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
