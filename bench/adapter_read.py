"""Host cost of reading one adapter from disk into pool rows (what AdapterStore does on a host-cache
miss, and what registration does once per weight file): load_peft_adapter, then pack_adapter.

    python bench/adapter_read.py --model llama-7b --rank 64 --repeats 6 [--dtype float32] [--out F]

--dtype float32 loads through float32 as the store did before session 7 (the default, None, keeps
the file's bfloat16). The file is written once under --dir (page-cached reads after the first).

    python bench/adapter_read.py --register 16 --workers 1,8     # AdapterStore.register_many

--register N: N distinct files (seeds differ) registered under N names, once per --workers count,
each time into a fresh store (host cache of N): the start-up of a server given N adapters.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-7b")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--dtype", default=None, help="load_peft_adapter's dtype (default: the file's)")
    ap.add_argument("--dir", default="/tmp/slora-adapter-read")
    ap.add_argument("--out", default=None)
    ap.add_argument("--register", type=int, default=0, help="time register_many over this many distinct files")
    ap.add_argument("--workers", default="1,8", help="comma list of register_many worker counts")
    args = ap.parse_args()

    import ml_dtypes
    import numpy as np
    from bench.provenance import git_commit
    from slora_jax.model.peft import load_peft_adapter, random_peft_adapter
    from slora_jax.model.config import load_model_config
    from slora_jax.model.layout import AdapterLayout, pack_adapter

    cfg = load_model_config(args.model)
    path = Path(args.dir) / f"{args.model}-r{args.rank}-{args.targets.replace(',', '-')}"
    if not (path / "adapter_model.safetensors").is_file():
        random_peft_adapter(path, cfg, rank=args.rank, targets=args.targets.split(","), seed=1, std=0.02,
                            dtype="bfloat16")
    load_s, pack_s = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        adapter = load_peft_adapter(path, cfg, max_rank=args.rank, dtype=args.dtype)
        t1 = time.perf_counter()
        rows = pack_adapter(adapter, AdapterLayout.of(adapter, cfg, 16), cfg, ml_dtypes.bfloat16)
        t2 = time.perf_counter()
        load_s.append(t1 - t)
        pack_s.append(t2 - t1)
        del adapter
    total = np.add(load_s, pack_s)
    result = {"commit": git_commit(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "file_MB": (path / "adapter_model.safetensors").stat().st_size / 1e6, "rows_MB": rows.nbytes / 1e6,
              "load_s_median": float(np.median(load_s)), "pack_s_median": float(np.median(pack_s)),
              "total_s_median": float(np.median(total)), "total_s_min": float(total.min()), "repeats": args.repeats}
    if args.register:
        from slora_jax.engine.adapter_store import AdapterStore
        names = {}
        for k in range(args.register):
            p = Path(args.dir) / f"{args.model}-r{args.rank}-{args.targets.replace(',', '-')}-{k}"
            if not (p / "adapter_model.safetensors").is_file():
                random_peft_adapter(p, cfg, rank=args.rank, targets=args.targets.split(","), seed=100 + k, std=0.02,
                                    dtype="bfloat16")
            names[f"a{k}"] = p
        result["register"] = {}
        for w in [int(x) for x in args.workers.split(",")]:
            store = AdapterStore(cfg, ml_dtypes.bfloat16, 16, args.rank, host_cache_size=args.register)
            t = time.perf_counter()
            store.register_many(names, workers=w)
            result["register"][f"workers={w}"] = time.perf_counter() - t
            del store
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
