"""Where a step's wall time goes on the host: the engine's phases (Engine.timer.seconds) and the
Python functions under them, for S1/S2-sized batches (256 decode rows, 32-prompt prefill steps,
thousands of registered adapters) on the tiny model, so the device part is small and the host
part is what a 7B model's step pays too (it depends on rows, adapters and modules, not on width).

    python tools/host_profile.py --adapters 2000 --requests 1500 --steps 60
    python tools/host_profile.py --ranks 64,32,16,8 --adapters 1000 --profile   # + cProfile top 25

On a CPU, XLA may run a small computation inside the dispatching call, so the "dispatch" phase
there holds compute too; schedule, inputs and complete are pure host work anywhere.
"""

from __future__ import annotations

import argparse
import atexit
import cProfile
import dataclasses
import json
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapters", type=int, default=2000)
    ap.add_argument("--ranks", default="8", help="comma list, adapter i has rank ranks[i %% len]")
    ap.add_argument("--requests", type=int, default=1500, help="queued at once (an overloaded server)")
    ap.add_argument("--steps", type=int, default=60, help="measured steps, after the warm-up ones")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--layers", type=int, default=None, help="override the tiny model's num_hidden_layers")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="EngineConfig.async_scheduling (default: the engine's, off on a CPU)")
    ap.add_argument("--profile", action="store_true", help="also print cProfile's top functions")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import numpy as np
    from bench.provenance import git_commit
    from slora_jax import LLM, SamplingParams
    from slora_jax.model.peft import random_peft_adapter
    from slora_jax.model.config import load_model_config

    cfg = load_model_config("tiny")
    if args.layers:
        cfg = dataclasses.replace(cfg, num_hidden_layers=args.layers)
    ranks = [int(r) for r in args.ranks.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="slora-host-"))
    atexit.register(shutil.rmtree, tmp, True)  # adapters of GBs: a warm machine's disk fills
    files = [random_peft_adapter(tmp / f"r{r}", cfg, rank=r, targets=["q_proj", "k_proj", "v_proj", "o_proj"],
                                 seed=r) for r in ranks]
    llm = LLM(cfg, dtype="float32", async_scheduling=args.async_scheduling, page_size=16,
              pool_pages=20000, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=4096,
              max_loras=args.max_num_seqs, max_lora_rank=max(ranks))
    names = [f"lora-{i}" for i in range(args.adapters)]
    for i, n in enumerate(names):
        llm.load_adapter(n, files[i % len(files)])
    rng = np.random.default_rng(0)
    eng = llm.engine
    sp = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for i in range(args.requests):
        prompt = rng.integers(3, cfg.vocab_size, int(rng.integers(8, 512))).tolist()
        eng.add_request(prompt, sp, names[int(rng.integers(0, args.adapters))], i, ())
    while len(eng.running) < min(args.max_num_seqs, args.requests):  # fill the batch; compiles here
        eng.step()
    for _ in range(5):
        eng.step()
    before = dict(eng.timer.seconds)
    prof = cProfile.Profile() if args.profile else None
    t = time.perf_counter()
    if prof:
        prof.enable()
    for _ in range(args.steps):
        eng.step()
    if prof:
        prof.disable()
    wall = time.perf_counter() - t
    phases = {k: (eng.timer.seconds[k] - before[k]) * 1e3 / args.steps for k in before}
    result = {"commit": git_commit(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "adapters": args.adapters, "ranks": ranks, "layers": cfg.num_hidden_layers,
              "async_scheduling": bool(eng.depth), "running": len(eng.running),
              "waiting": len(eng.waiting), "steps": args.steps, "ms_per_step": wall * 1e3 / args.steps,
              "phase_ms_per_step": phases}
    print(json.dumps(result, indent=1))
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
