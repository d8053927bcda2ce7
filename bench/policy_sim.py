"""Scheduling policies on S2's shape without a GPU: the real Scheduler and UnifiedPool driven by
the tests' mock device (tests/test_scheduler.Sim) with a llama-7b-sized step-cost model.

    python bench/policy_sim.py                                   # the default set below
    python bench/policy_sim.py unified:fcfs:1:0 base:fcfs:1:8    # mode:order:max_wait_s:prefill_delay_factor
    python bench/policy_sim.py unified:fcfs:1:0:mixed            # ... with mixed_steps

The cost model (seconds a step; constants from the H200 profiles and serving runs of sessions
11-12): decode = 4.5 ms + the KV bytes the batch reads at 3.0 TB/s + each distinct adapter's
rows (rank r: r/4 pages of 8 MB, q/k/v/o over 32 layers) at 1.75 TB/s; prefill = 4.5 ms +
28 us a token, + 3.5 ms with any adapter (with mixed_steps, plus its decode rows' reads). Calibration: at R = 40 it gives 27.7 / 21.8 req/s for
base / unified against the H200's 26.3 / 20.4 (0.787x against 0.777x), and ~176 rows on ~157
adapters a decode step against ~171 / 153. It models no host time and no overlap, so it ranks
policies; it does not replace the GPU run.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import numpy as np  # noqa: E402

from test_scheduler import Sim, trace  # noqa: E402

RANKS = (64, 32, 16, 8)  # adapter i has rank RANKS[i % 4], as S2 registers them
PAGE_BYTES = 8e6          # a llama-7b page: 16 tokens x 32 layers x K and V x 4096 x bf16


@dataclasses.dataclass
class Cost7B:
    kv_bw: float = 3.0e12
    lora_bw: float = 1.75e12
    load: float = 0.0005      # one adapter's host -> device copy (prefetched ones overlap the step)

    def step(self, plan) -> float:
        decoding = [r for r, s, e in plan.chunks if e - s == 1 and s > 0]  # one-token chunks: decode rows
        adapters = {r.adapter.key: r.adapter.layout.pages for r in decoding if r.adapter is not None}
        decode = sum(r.num_computed for r in decoding) * 524288 / self.kv_bw + \
            sum(adapters.values()) * PAGE_BYTES / self.lora_bw
        if plan.kind == "prefill":  # with mixed_steps, decode rows ride along: their KV and adapter reads
            tokens = sum(e - s for r, s, e in plan.chunks if not (e - s == 1 and s > 0))
            lora = any(r.adapter is not None for r, s, e in plan.chunks if not (e - s == 1 and s > 0))
            return 0.0045 + tokens * 28e-6 + (0.0035 if lora else 0.0) + decode
        return 0.0045 + decode


def run(mode: str, order: str = "fcfs", max_wait_s: float = 1.0, delay: float = 0.0, *, n: int = 1000,
        rate: float = 40.0, duration_s: float = 30.0, seed: int = 42, mixed: bool = False) -> dict:
    arrivals = trace(int(rate * duration_s), rate, adapters=n if mode == "unified" else 0, alpha=1.0,
                     prompt=(8, 512), output=(8, 512), seed=seed, slo=6.0)
    sim = Sim(pool_pages=12264, cost=Cost7B(), max_num_seqs=256, max_prefill_tokens=4096, max_prefill_seqs=32,
              max_adapters_per_batch=256, admission_order=order, max_wait_s=max_wait_s,
              prefill_delay_factor=delay, mixed_steps=mixed)
    for name in sorted({a.adapter for a in arrivals if a.adapter}):
        sim.register(name, RANKS[int(name[1:]) % 4] // 4)
    late = _count_late_misses(sim.sched)
    sim.run(arrivals)
    m = sim.sched.metrics
    done = [r for r in sim.requests if r.out.finish_reason != "abort"]
    decode = [(b, d) for kind, b, d in sim.batches if kind == "decode"]
    return {"mode": mode, "order": order, "max_wait_s": max_wait_s, "prefill_delay_factor": delay, "mixed_steps": mixed,
            "req_s": round(len(done) / sim.makespan(), 2), "slo_attainment": round(sim.attainment(6.0), 3),
            "prefill_steps": sum(kind == "prefill" for kind, _, _ in sim.batches), "decode_steps": len(decode),
            "rows_per_decode": round(float(np.mean([b for b, _ in decode])), 1),
            "adapters_per_decode": round(float(np.mean([d for _, d in decode])), 1),
            "prefetch_hits": m.prefetch_hits.value, "prefetch_misses": m.prefetch_misses.value,
            "misses_arrived_after_prefetch": late[0]}


def _count_late_misses(sched) -> list[int]:
    """[n]: admissions that loaded their adapter on the critical path (prefetch misses) for a
    request that was not yet waiting when the step before ran its prefetch: no prediction made at
    step boundaries could have brought those in (a copy started at the request's arrival could)."""
    seen, late = {"waiting": set()}, [0]
    prefetch, take = sched.prefetch, sched.take_adapter

    def prefetch_hook(plan=None):
        out = prefetch(plan)
        seen["waiting"] = {id(r) for r in sched.waiting}
        return out

    def take_hook(req):
        cold = req.adapter is not None and not sched.pool.is_resident(req.adapter.key)
        ok = take(req)
        if ok and cold and id(req) not in seen["waiting"]:
            late[0] += 1
        return ok
    sched.prefetch, sched.take_adapter = prefetch_hook, take_hook
    return late


DEFAULT = ["base:fcfs:1:0", "unified:fcfs:1:0", "unified:affinity:6:0", "base:fcfs:1:4", "unified:fcfs:1:4",
           "base:fcfs:1:8", "unified:fcfs:1:8"]

if __name__ == "__main__":
    for spec in sys.argv[1:] or DEFAULT:
        mode, order, wait, delay, *mixed = spec.split(":")
        print(json.dumps(run(mode, order, float(wait), float(delay), mixed=mixed == ["mixed"])), flush=True)
