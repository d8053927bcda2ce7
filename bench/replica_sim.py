"""A discrete-event simulation of N engine replicas behind a router: affinity vs round robin.

    python bench/replica_sim.py [--replicas 1 2 4 8] [--adapters 1000 10000] [--rate-per-replica 20]
                                [--duration-s 60] [--out bench/results/<date>-sim/replica_sim.json]

The trace is S2's (bench/trace.py: adapter ranks {64, 32, 16, 8}, uniform popularity, Poisson
arrivals, prompts and outputs uniform over [8, 512)), at `rate_per_replica` x N requests per second.

Each replica is S-LoRA's continuous batching on one GPU, with step times from measured runs
(`measured_costs`: lines fitted to the H200 runs in bench/results/, read from their JSON):
- a prefill step admits waiting requests up to max_num_batched_tokens and MAX_PREFILL_SEQS rows,
  and costs p0 + p_tok x tokens + d_adapter x its distinct adapters, plus every adapter it pages
  in: its host->device bytes at H2D_BYTES_PER_S and the measured host time per load;
- otherwise a decode step over every running request costs d0 + d_seq x sequences + d_adapter x
  distinct adapters;
- the pool keeps adapters as an LRU cache of POOL_ADAPTER_BYTES (the adapter share measured at
  n = 1000-2000); KV memory is not modelled beyond max_num_seqs.

Routers:
- round_robin: request i goes to replica i mod N;
- affinity: rendezvous hashing ranks the replicas per adapter (the same for every router, no shared
  state); a request goes to its adapter's first replica unless that one has SPILL_OVER more
  requests in flight than the least loaded replica, which then takes it (what Ray Serve's
  multiplexed routing does: prefer a replica holding the adapter, fall back by queue length).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import heapq
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.trace import generate, load_workload  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# The measured runs the step costs come from (llama-7b, bf16, H200, S2 trace, page_size 16).
COST_RUNS = {
    "base_r10": "20261201-3c9e15e/call1-table3-s2/S2-base-R10-t3.json",
    "unified_r10": "20261201-3c9e15e/call1-table3-s2/S2-unified-n2000-R10-t3.json",
    "base_r40": "20261201-0e4a079/call1-s2-nsweep/S2-base-R40.json",
    "unified_r40": "20261201-0e4a079/call1-s2-nsweep/S2-unified-n1000-R40.json",
}
HIDDEN, LAYERS, TARGETS = 4096, 32, 4          # llama-7b; S2's adapters target q, k, v, o
BYTES_PER_RANK = LAYERS * TARGETS * 2 * HIDDEN * 2  # A and B, bf16: 2 MiB per unit of rank
H2D_BYTES_PER_S = 25e9                          # pinned host -> H200 over PCIe 5 x16, half its peak
MAX_PREFILL_SEQS = 32                           # the measured runs' max_prefill_seqs
SPILL_OVER = 64                                 # in-flight requests over the least loaded replica
ASSUMPTIONS = [
    "S2 trace (bench/trace.py), rate_per_replica x replicas req/s, uniform adapter popularity, ranks 64/32/16/8",
    "one replica = one H200 running llama-7b bf16; step costs are lines fitted to the COST_RUNS JSONs",
    "prefill: fixed cost = the decode intercept, per-token slope fitted to the two base runs; "
    "every distinct adapter in a step adds decode_per_adapter_s",
    "an adapter page-in costs its bytes (2 MiB per rank unit: q,k,v,o of 32 layers, bf16) at 25 GB/s "
    "plus the measured host time per load, on the critical path of its prefill step (no prefetch overlap)",
    "the pool keeps adapters in an LRU cache of the largest adapter share measured (480 adapters of mean rank)",
    "KV memory is not modelled beyond max_num_seqs; no early abort, no preemption; FCFS admission",
    "the router sees each replica's in-flight count at once (no reporting delay)",
]


def _read(rel: str) -> dict:
    return json.loads((RESULTS / rel).read_text())


def measured_costs() -> dict:
    """Step-cost lines fitted to the measured runs (see COST_RUNS), in seconds."""
    runs = {k: _read(v) for k, v in COST_RUNS.items()}

    def kinds(k):
        return runs[k]["pool"]["steps_by_kind"]

    # decode: d0 + d_seq * B from the two base runs, then d_adapter from the unified run at R40
    (b1, t1), (b2, t2) = [(kinds(k)["decode_seqs_per_step_mean"], kinds(k)["decode_step_s_mean"])
                          for k in ("base_r10", "base_r40")]
    d_seq = (t2 - t1) / (b2 - b1)
    d0 = t1 - d_seq * b1
    u = kinds("unified_r40")
    d_adapter = ((u["decode_step_s_mean"] - d0 - d_seq * u["decode_seqs_per_step_mean"])
                 / u["decode_adapters_per_step_mean"])

    # prefill: p0 + p_tok * tokens; tokens per step from the trace's prompt tokens of finished requests
    def prefill_point(k):
        r = runs[k]
        done = r["metrics"]["completed"] / r["metrics"]["num_requests"]
        return r["trace"]["prompt_tokens"] * done / kinds(k)["prefill_steps"], kinds(k)["prefill_step_s_mean"]

    # The fixed cost of a step (the weights read once) is the decode line's intercept; the
    # per-token slope is the least-squares fit through the two base runs with that intercept.
    points = [prefill_point(k) for k in ("base_r10", "base_r40")]
    p0 = d0
    p_tok = sum(x * (y - p0) for x, y in points) / sum(x * x for x, _ in points)
    un = runs["unified_r40"]
    loads = un["pool"]["evictions"] + un["pool"]["resident_adapters_max"]
    ranks = un["workload"]["ranks"]
    return {"decode_s": d0, "decode_per_seq_s": d_seq, "decode_per_adapter_s": max(0.0, d_adapter),
            "prefill_s": p0, "prefill_per_token_s": p_tok,
            "load_host_s": un["pool"]["step_seconds"]["adapter_loads"] / loads,
            "pool_adapter_bytes": max(r["pool"]["resident_adapters_max"] for r in (un, runs["unified_r10"]))
            * BYTES_PER_RANK * float(np.mean(ranks)),
            "h2d_bytes_per_s": H2D_BYTES_PER_S, "bytes_per_rank": BYTES_PER_RANK,
            "max_num_seqs": un["engine_options"]["max_num_seqs"],
            "max_num_batched_tokens": un["engine_options"]["max_prefill_tokens"], "sources": COST_RUNS}


class Replica:
    """One engine: FCFS queue, continuous batching, an LRU adapter cache in its pool."""

    def __init__(self, costs: dict, rank_of):
        self.c, self.rank_of = costs, rank_of
        self.t = 0.0
        self.waiting: collections.deque = collections.deque()   # (arrival, adapter, prompt, output)
        self.running = 0
        self.finish_heap: list = []                               # (decode index it ends at, adapter)
        self.decodes = 0
        self.adapters: collections.Counter = collections.Counter()  # running requests per adapter
        self.cache: collections.OrderedDict = collections.OrderedDict()  # adapter -> bytes (LRU)
        self.cached_bytes = 0
        self.loads = self.load_bytes = 0
        self.ttft: list[float] = []
        self.finished, self.tokens, self.last_finish = 0, 0, 0.0

    @property
    def in_flight(self) -> int:
        return len(self.waiting) + self.running

    def page_in(self, a: int) -> float:
        if a in self.cache:
            self.cache.move_to_end(a)
            return 0.0
        size = self.rank_of(a) * self.c["bytes_per_rank"]
        while self.cached_bytes + size > self.c["pool_adapter_bytes"] and self.cache:
            _, b = self.cache.popitem(last=False)
            self.cached_bytes -= b
        self.cache[a] = size
        self.cached_bytes += size
        self.loads += 1
        self.load_bytes += size
        return size / self.c["h2d_bytes_per_s"] + self.c["load_host_s"]

    def step(self) -> bool:
        """Run one step at self.t; False when there is nothing to run."""
        c = self.c
        if self.waiting and self.waiting[0][0] <= self.t and self.running < c["max_num_seqs"]:
            tokens, admitted, cost, distinct = 0, [], 0.0, set()
            while (self.waiting and self.waiting[0][0] <= self.t and len(admitted) < MAX_PREFILL_SEQS
                   and self.running + len(admitted) < c["max_num_seqs"]
                   and (not admitted or tokens + self.waiting[0][2] <= c["max_num_batched_tokens"])):
                r = self.waiting.popleft()
                admitted.append(r)
                tokens += r[2]
                distinct.add(r[1])
                cost += self.page_in(r[1])
            self.t += (c["prefill_s"] + c["prefill_per_token_s"] * tokens + c["decode_per_adapter_s"] * len(distinct)
                       + cost)
            for arrival, a, _, out in admitted:
                self.ttft.append(self.t - arrival)
                self.tokens += 1
                self.running += 1
                self.adapters[a] += 1
                heapq.heappush(self.finish_heap, (self.decodes + out - 1, a))
            return True
        if self.running:
            self.t += (c["decode_s"] + c["decode_per_seq_s"] * self.running
                       + c["decode_per_adapter_s"] * len(self.adapters))
            self.decodes += 1
            self.tokens += self.running
            while self.finish_heap and self.finish_heap[0][0] <= self.decodes:
                _, a = heapq.heappop(self.finish_heap)
                self.running -= 1
                self.finished += 1
                self.adapters[a] -= 1
                if not self.adapters[a]:
                    del self.adapters[a]
                self.last_finish = self.t
            return True
        return False

    def advance(self, until: float) -> None:
        """Run steps that start before `until`; an idle replica waits for its next arrival."""
        while self.t < until:
            if not self.step():
                if self.waiting and self.waiting[0][0] < until:
                    self.t = max(self.t, self.waiting[0][0])
                else:
                    self.t = max(self.t, until)
                    return


def rendezvous(adapter: int, n: int) -> list[int]:
    """Replicas ranked for `adapter` by highest random weight (the same on every router)."""
    def weight(r):
        return hashlib.blake2b(f"{adapter}:{r}".encode(), digest_size=8).digest()
    return sorted(range(n), key=weight, reverse=True)


def simulate(n_replicas: int, n_adapters: int, policy: str, rate_per_replica: float, duration_s: float,
             costs: dict, seed: int = 42) -> dict:
    w = load_workload("S2", n=n_adapters, rate=rate_per_replica * n_replicas, duration_s=duration_s, seed=seed)
    trace = generate(w)
    reps = [Replica(costs, w.rank_of) for _ in range(n_replicas)]
    ranked: dict[int, list[int]] = {}
    t_wall = time.perf_counter()
    for i, r in enumerate(trace.requests):
        for rep in reps:
            rep.advance(r.arrival_s)
        if policy == "round_robin":
            k = i % n_replicas
        else:
            order = ranked.setdefault(r.adapter_id, rendezvous(r.adapter_id, n_replicas))
            least = min(rep.in_flight for rep in reps)
            k = next((j for j in order if reps[j].in_flight <= least + SPILL_OVER), order[0])
        reps[k].waiting.append((r.arrival_s, r.adapter_id, r.prompt_len, r.output_len))
    for rep in reps:
        while rep.step() or rep.waiting:
            if rep.waiting and not rep.running and rep.waiting[0][0] > rep.t:
                rep.t = rep.waiting[0][0]
    end = max(rep.last_finish for rep in reps)
    ttft = np.concatenate([rep.ttft for rep in reps])
    loads = sum(rep.loads for rep in reps)
    load_bytes = sum(rep.load_bytes for rep in reps)
    return {"replicas": n_replicas, "adapters": n_adapters, "policy": policy, "offered_req_s": w.rate,
            "requests": len(trace), "makespan_s": end, "throughput_req_s": sum(rep.finished for rep in reps) / end,
            "tokens_s": sum(rep.tokens for rep in reps) / end, "adapter_loads": loads, "adapter_loads_s": loads / end,
            "h2d_bytes": load_bytes, "h2d_gb_s": load_bytes / end / 1e9,
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "sim_wall_s": time.perf_counter() - t_wall}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--adapters", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--rate-per-replica", type=float, nargs="+", default=[20.0])
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--out", type=Path, default=None, help="write the rows, costs and command as JSON")
    args = ap.parse_args(argv)
    costs = measured_costs()
    rows = []
    print("| rate/replica | replicas | adapters | policy | req/s | tok/s | loads/s | H2D GB/s | TTFT p50 s | TTFT p99 s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rate in args.rate_per_replica:
        for n in args.adapters:
            for r in args.replicas:
                for policy in ("round_robin", "affinity"):
                    row = simulate(r, n, policy, rate, args.duration_s, costs)
                    rows.append(row)
                    print(f"| {rate:g} | {r} | {n} | {policy} | {row['throughput_req_s']:.1f} | {row['tokens_s']:.0f} | "
                          f"{row['adapter_loads_s']:.1f} | {row['h2d_gb_s']:.2f} | {row['ttft_p50_s']:.3f} | "
                          f"{row['ttft_p99_s']:.3f} |", flush=True)
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": "python bench/replica_sim.py " + " ".join(argv or sys.argv[1:]),
                                        "commit": commit, "assumptions": ASSUMPTIONS, "costs": costs, "spill_over": SPILL_OVER,
                                        "max_prefill_seqs": MAX_PREFILL_SEQS, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
