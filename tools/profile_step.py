"""Where a decode step's time goes: a device trace of a few steps, summed by kernel.

    python tools/profile_step.py --model llama-7b --batch 64 --adapters 32 --backends xla/xla,pallas/pallas
    python tools/profile_step.py --model tiny --batch 4 --adapters 2 --steps 2      # CPU smoke run

For each lora/attention backend pair, `--steps` decode steps of `--batch` requests (context
`--context`, `--adapters` distinct rank-16 q,k,v,o adapters) run under `jax.profiler.trace`. The
Perfetto trace it writes is read back here: device-side events (the GPU's streams; on a CPU, the
XLA client's threads) are summed by name and by kind (matmul, our LoRA kernels, attention,
gather/scatter, other fusions), per step. It answers what the step-time benchmark cannot: how many
kernels a step launches, and which ones pay for the adapters.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == REPO / "bench":
    sys.path[0] = str(REPO)  # run as a script: bench/trace.py must not shadow the stdlib's trace

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.device_trace import busy_span, trace_events, traced  # noqa: E402
from bench.engine_bench import (decode_batch, prefill_batch, randomize_pool, register_mixed_ranks,  # noqa: E402
                                set_backends)
from bench.provenance import git_commit  # noqa: E402
from pallas_kernels import lora as lora_kernels  # noqa: E402
from slora_jax import LLM
from slora_jax.engine import step as paged  # noqa: E402
from triton_kernels import ranksplit  # noqa: E402

KINDS = (  # first match wins; names as XLA and the Triton/Pallas lowerings print them
    ("lora kernel", ("shrink", "expand", "lora_fused", "ranksplit")),
    ("sort (sampler)", ("sort",)),
    ("attention kernel", ("paged_decode", "attention")),
    ("matmul", ("gemm", "cublas", "cutlass", "matmul", "dot", "sm90_xmma", "nvjet")),
    ("gather/scatter", ("gather", "scatter", "dynamic-slice", "dynamic_update")),
    ("copy/transpose", ("copy", "transpose", "memcpy", "memset")),
    ("reduce", ("reduce", "softmax")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other fusion"


def host_phases(trace_dir: str) -> list[dict]:
    """The engine's host phases in the trace (slora_jax.engine.engine._phase: `slora.<name>` events)."""
    return [e for e in trace_events(trace_dir) if e.get("ph") == "X" and str(e.get("name", "")).startswith("slora.")]


def idle_by_phase(device: list[dict], phases: list[dict], steps: int, min_gap_us: float = 50.0) -> dict:
    """Where the device's idle time went: each gap of at least min_gap_us between the device's
    kernels (within the traced span) split among the host phases that overlapped it, in
    microseconds a step; "no phase": host time outside every phase. Shorter gaps (launch latency
    between a step's own kernels) are summed apart, as "short gaps"."""
    iv = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in device if "ts" in e)
    merged: list[list[float]] = []
    for a, b in iv:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    ph = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e["name"][len("slora."):])
                for e in phases)
    out = collections.defaultdict(float)
    for (_, a), (b, _) in zip(merged, merged[1:]):
        if b - a < min_gap_us:
            out["short gaps"] += b - a
            continue
        covered = 0.0
        for s, e, name in ph:
            if s >= b:
                break
            o = min(b, e) - max(a, s)
            if o > 0:
                out[name] += o
                covered += o
        out["no phase"] += max(0.0, (b - a) - covered)
    return {k: v / steps for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def by_stream(events: list[dict], steps: int, top: int = 3) -> dict:
    """Events a step by device track (a GPU stream: the trace's thread id), each with its busiest
    names: which work ran off the compute stream (host->device copies of adapter rows, say) and
    how long it took."""
    streams = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
    for e in events:
        v = streams[str(e.get("tid", "?"))][e.get("name", "?")]
        v[0] += 1
        v[1] += float(e.get("dur", 0.0))
    out = {}
    for tid, names in sorted(streams.items(), key=lambda kv: -sum(v[1] for v in kv[1].values())):
        busiest = sorted(names.items(), key=lambda kv: -kv[1][1])[:top]
        out[tid] = {"per_step": sum(v[0] for v in names.values()) / steps,
                    "us_per_step": sum(v[1] for v in names.values()) / steps,
                    "top": [{"name": n[:80], "per_step": c / steps, "us_per_step": us / steps}
                            for n, (c, us) in busiest]}
    return out


def summarize(events: list[dict], steps: int, top: int) -> dict:
    by_name = collections.defaultdict(lambda: [0, 0.0])
    by_kind = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        name = e.get("name", "?")
        dur = float(e.get("dur", 0.0))  # microseconds
        by_name[name][0] += 1
        by_name[name][1] += dur
        by_kind[kind_of(name)][0] += 1
        by_kind[kind_of(name)][1] += dur
    total = sum(v[1] for v in by_kind.values())
    names = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    busy, span = busy_span(events)
    return {
        "device_us_per_step": total / steps, "kernels_per_step": sum(v[0] for v in by_kind.values()) / steps,
        # The traced window from the first kernel's start to the last one's end, and the part of it
        # in which some kernel ran: busy < span means the device waited (on the host's launches).
        "span_us_per_step": span / steps, "busy_us_per_step": busy / steps,
        "by_kind": {k: {"per_step": n / steps, "us_per_step": us / steps, "share": us / total if total else 0.0}
                    for k, (n, us) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])},
        "top": [{"name": n[:160], "per_step": c / steps, "us_per_step": us / steps} for n, (c, us) in names],
        "by_stream": by_stream(events, steps),
    }


def _numpy_and_device(llm, inp):
    """A step's inputs as the engine builds them (numpy; decode_batch puts them), the same already
    on the device, and the seconds that device_put took."""
    inp = jax.tree_util.tree_map(np.asarray, inp)
    t0 = time.perf_counter()
    dinp = jax.block_until_ready(jax.device_put(inp, llm.engine.kv[0].sharding))
    return inp, dinp, time.perf_counter() - t0


def dispatch_costs(llm, inp, reps: int = 7) -> dict:
    """Host time of one paged.step call (whole-model jit), median of `reps`, in microseconds:
    with the device idle and right behind another step (busy), with the step's inputs as the host
    built them (numpy) and already on the device. If the busy numpy call takes much longer than
    the others, the call waits for the device (e.g. its host-to-device copies behind the running
    step) and an overlapped serving loop cannot hide its host work; `leaves` counts the copies."""
    eng = llm.engine
    inp, dinp, put_s = _numpy_and_device(llm, inp)
    leaves = jax.tree_util.tree_leaves(inp)
    out = {"leaves": len(leaves), "leaf_bytes": sum(x.nbytes for x in leaves), "device_put_us": put_s * 1e6}

    def call(x):
        a = time.perf_counter()
        eng.kv, res = paged.step(llm.params, eng.kv, x, cfg=llm.cfg)
        return res, time.perf_counter() - a
    for name, x in (("numpy", inp), ("device", dinp)):
        idle, busy = [], []
        for _ in range(reps):
            jax.block_until_ready(eng.kv)
            res, dt = call(x)
            idle.append(dt)
            res2, dt = call(x)  # dispatched while the first runs
            busy.append(dt)
            res2.block_until_ready()
        out[f"idle_{name}_us"] = float(np.median(idle)) * 1e6
        out[f"busy_{name}_us"] = float(np.median(busy)) * 1e6
    return out


def dispatch_sequence(llm, inp, calls: int = 6, gap_s: float = 0.03) -> dict:
    """Host time of each of the two jits a whole-model step makes (forward_sample, then
    commit_kv, which donates the pool), call by call, in microseconds: `calls` steps back to back
    after the device went idle, then `calls` steps each `gap_s` apart (the device idles between
    them but the host does not wait for it), with numpy and on-device inputs. Says whether a
    call's host time is a fixed cost, a cost paid only behind a running step, or a first-call cost."""
    eng = llm.engine
    inp, dinp, _ = _numpy_and_device(llm, inp)
    out = {}

    def call(x):
        a = time.perf_counter()
        new_kv, res = paged.forward_sample(llm.params, eng.kv, x, cfg=llm.cfg)
        b = time.perf_counter()
        eng.kv = paged.commit_kv(eng.kv, new_kv, x.kv_slot)
        c = time.perf_counter()
        return res, (round((b - a) * 1e6), round((c - b) * 1e6))
    for name, x in (("numpy", inp), ("device", dinp)):
        for mode in ("burst", "gap"):
            jax.block_until_ready(eng.kv)
            times = []
            for _ in range(calls):
                res, dt = call(x)
                times.append(dt)
                if mode == "gap":
                    time.sleep(gap_s)
            res.block_until_ready()
            out[f"{name}_{mode}"] = times
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-7b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--adapters", default="32",
                    help="comma list: distinct adapters in the batch, each profiled (0: base only)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--ranks", default=None, help="comma list: adapter i has rank ranks[i %% len] (overrides --rank)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--backends", default="xla/xla,pallas/pallas")
    ap.add_argument("--pool-pages", type=int, default=None)
    ap.add_argument("--distinct-files", type=int, default=4,
                    help="weight files written per rank, shared by the adapter names (each name still has "
                         "its own pages); more names than files saves the writing of GBs of adapters")
    ap.add_argument("--prefill", default=None, metavar="N:L",
                    help="profile packed prefill steps of N fresh prompts of L tokens (prompt i on adapter "
                         "i mod --adapters) instead of decode steps")
    ap.add_argument("--no-trace", action="store_true",
                    help="run the warm-up and --steps untraced steps only: for running under Nsight Compute "
                         "(bench/gpu_check.sh ncustep), whose counters and the JAX profiler's would collide")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    counts = [int(n) for n in str(args.adapters).split(",")]
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else [args.rank]

    prefill = tuple(int(v) for v in args.prefill.split(":")) if args.prefill else None
    seqs = max(args.batch, prefill[0] if prefill else 1, 1)
    extra = dict(max_num_batched_tokens=max(4096, prefill[0] * prefill[1])) if prefill else {}
    llm = LLM(args.model, dtype=args.dtype, pool_pages=args.pool_pages, max_num_seqs=seqs,
              max_lora_rank=max(ranks), gpu_memory_utilization=0.7, max_loras=seqs, **extra)
    randomize_pool(llm)
    tmp = Path(tempfile.mkdtemp(prefix="slora-prof-"))
    atexit.register(shutil.rmtree, tmp, True)  # adapters of GBs: a warm machine's disk fills
    names = register_mixed_ranks(llm, max(counts), ranks, tmp, args.distinct_files)
    result = {"commit": git_commit(), "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "model": args.model,
              "batch": args.batch, "context": args.context, "adapters": counts, "ranks": ranks,
              "lora_block_sizes": {"shrink": dataclasses.asdict(lora_kernels.ShrinkBlockSizes.get_default()),
                                   "expand": dataclasses.asdict(lora_kernels.ExpandBlockSizes.get_default())},
              "ranksplit_block_sizes": dataclasses.asdict(ranksplit.RanksplitBlockSizes.get_default()),
              "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "runs": []}
    result["prefill"] = prefill

    @contextlib.contextmanager
    def batch_of(adapters):
        """A step's inputs over `adapters` (decode or --prefill), its requests released after."""
        reqs, inp = prefill_batch(llm, *prefill, adapters) if prefill else \
            decode_batch(llm, args.batch, args.context, adapters)
        try:
            yield inp
        finally:
            for r in reqs:
                llm.engine._release(r)
    for pair, n in [(pair, n) for pair in args.backends.split(",") for n in counts]:
        set_backends(llm, pair)
        eng = llm.engine
        with batch_of(names[:n]) as inp:
            for _ in range(2):  # compile and warm up outside the trace
                eng.kv, res = paged.step(llm.params, eng.kv, inp, cfg=llm.cfg)
            res.block_until_ready()
            # Untraced: wall time a step, and how long the host takes to dispatch one (the calls
            # return before the device is done, up to the client's cap on queued executions).
            t0 = time.perf_counter()
            for _ in range(args.steps):
                eng.kv, res = paged.step(llm.params, eng.kv, inp, cfg=llm.cfg)
            t1 = time.perf_counter()
            res.block_until_ready()
            t2 = time.perf_counter()
            if args.no_trace:
                print(f"{pair}, {n} adapters: untraced wall {(t2 - t0) * 1e3 / args.steps:.2f} ms a step", flush=True)
                continue
            with traced() as events:
                for _ in range(args.steps):
                    eng.kv, res = paged.step(llm.params, eng.kv, inp, cfg=llm.cfg)
                res.block_until_ready()
        s = summarize(events, args.steps, args.top)
        s.update(wall_us_per_step=(t2 - t0) * 1e6 / args.steps, dispatch_us_per_step=(t1 - t0) * 1e6 / args.steps)
        with batch_of(names[:n]) as inp:
            s["dispatch_costs_us"] = dc = dispatch_costs(llm, inp)
            s["dispatch_sequence_us"] = ds = dispatch_sequence(llm, inp)
        print(f"{pair}, {n} adapters, host time of one step call (us): "
              + ", ".join(f"{k} {v:.0f}" for k, v in dc.items()), flush=True)
        for k, v in ds.items():
            print(f"{pair}, {n} adapters, (forward_sample, commit_kv) host us a call, {k}: {v}", flush=True)
        result["runs"].append({"backends": pair, "adapters": n, **s})
        print(f"{pair}, {n} adapters: {s['device_us_per_step'] / 1e3:.2f} ms of device time, "
              f"{s['kernels_per_step']:.0f} kernels per step; untraced wall {s['wall_us_per_step'] / 1e3:.2f} ms "
              f"(dispatch {s['dispatch_us_per_step'] / 1e3:.2f}); traced span {s['span_us_per_step'] / 1e3:.2f} ms, "
              f"busy {s['busy_us_per_step'] / 1e3:.2f}", flush=True)
        for k, v in s["by_kind"].items():
            print(f"  {k:18s} {v['per_step']:7.0f} kernels {v['us_per_step'] / 1e3:8.3f} ms  {v['share']:5.1%}")
        for t in s["top"][:10]:
            print(f"    {t['us_per_step'] / 1e3:8.3f} ms  x{t['per_step']:<5.0f} {t['name'][:90]}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
