"""Where the host time of a whole-model step call goes, in a serving-like loop (GPU).

The S2 capacity runs put the unified engine's jitted step call at 7-13 ms of host time (prefill
steps 11-13, decode 7-8.5) against the base model's 4.7-6.4 (run.py's host_ms_by_transition).
This builds S2's decode step (B x context on n adapters) and a packed prefill step, with and
without adapters, and runs them in a fixed pattern of decode (D) and prefill (P) steps with one
step in flight, as the engine's overlapped loop does:

- untraced: the host milliseconds of each paged.step call, by transition (D>P: a prefill call
  after a decode call), per variant;
- traced (jax.profiler): the host events inside those calls, summed by name a call (CUDA driver
  calls such as graph launches and updates, XLA's thunk and command-buffer spans), so the cost
  can be named.

Run one process per XLA_FLAGS setting and compare:

    python3 bench/dispatch_probe.py --out probe.json
    XLA_FLAGS="--xla_gpu_enable_command_buffer_va_remapping=true \
      --xla_gpu_command_buffer_update_mode=SKIP_TEMP" python3 bench/dispatch_probe.py --out probe-va.json
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.device_trace import trace_events  # noqa: E402
from bench.engine_bench import (decode_batch, prefill_batch, randomize_pool, register_mixed_ranks,  # noqa: E402
                                set_backends)
from bench.provenance import git_commit  # noqa: E402
from slora_jax import LLM
from slora_jax.engine import step as paged  # noqa: E402


def one_step(llm, inp, buffers=None):
    """Dispatch one step as the engine does (paged.step, or paged.step_packed through `buffers`):
    its results, still on the device."""
    eng = llm.engine
    if buffers is None:
        eng.kv, res = paged.step(llm.params, eng.kv, inp, cfg=llm.cfg)
    else:
        eng.kv, res = paged.step_packed(llm.params, eng.kv, buffers.stage(inp), buffers, cfg=llm.cfg)
    return res


def run_pattern(llm, steps: dict, pattern: str, first: dict, bad: collections.Counter,
                buffers=None) -> list[tuple[str, float]]:
    """Dispatch steps[c] for each c of pattern, one step in flight (dispatch the next, then wait
    for the one before): [(transition, host seconds of the call)]. Each step's results (sampled
    token and logprob a row) must equal the first results of its kind (`first`, filled on first
    sight): the same inputs every time, so a command buffer replayed with stale addresses shows
    as a mismatch, counted in `bad` by kind."""
    prev, last, out = None, "-", []

    def check(c, res):
        got = np.asarray(res)
        if c not in first:
            first[c] = got
        elif not np.array_equal(got, first[c], equal_nan=True):
            bad[c] += 1
    for c in pattern:
        t = time.perf_counter()
        res = one_step(llm, steps[c], buffers)
        out.append((f"{last}>{c}", time.perf_counter() - t))
        if prev is not None:
            check(last, prev)
        prev, last = res, c
    check(last, prev)
    return out


def by_transition(calls: list[tuple[str, float]]) -> dict:
    acc = collections.defaultdict(list)
    for k, s in calls:
        acc[k].append(s * 1e3)
    return {k: {"calls": len(v), "mean_ms": round(sum(v) / len(v), 3), "min_ms": round(min(v), 3),
                "max_ms": round(max(v), 3)} for k, v in sorted(acc.items())}


def host_events(trace_dir: str, top: int) -> dict:
    """Host-side complete events inside the traced paged.step calls (`probe.call` spans), summed by
    name: total ms and count a call, the `top` names by time."""
    ev = trace_events(trace_dir)
    calls = [e for e in ev if e.get("ph") == "X" and e.get("name") == "probe.call"]
    if not calls:
        return {}
    tid = {(c["pid"], c.get("tid")) for c in calls}
    spans = sorted((float(c["ts"]), float(c["ts"]) + float(c["dur"])) for c in calls)
    acc = collections.defaultdict(lambda: [0.0, 0])
    for e in ev:
        if e.get("ph") != "X" or e.get("name") == "probe.call" or (e["pid"], e.get("tid")) not in tid:
            continue
        a = float(e["ts"])
        if any(s <= a < f for s, f in spans):
            acc[e["name"]][0] += float(e.get("dur", 0.0))
            acc[e["name"]][1] += 1
    n = len(calls)
    rows = sorted(acc.items(), key=lambda kv: -kv[1][0])[:top]
    return {"calls": n, "call_ms": round(sum(f - s for s, f in spans) / n / 1e3, 3),
            "events": [{"name": k[:120], "ms_a_call": round(v[0] / n / 1e3, 4), "count_a_call": round(v[1] / n, 1)}
                       for k, v in rows]}


def traced_pass(llm, steps, pattern: str, buffers, top: int) -> dict:
    """The pattern's calls once more under the profiler, one step in flight: host_events of them."""
    trace_dir = tempfile.mkdtemp(prefix="slora-probe-trace-")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        prev = None
        for c in pattern:
            with jax.profiler.TraceAnnotation("probe.call"):
                res = one_step(llm, steps[c], buffers)
            if prev is not None:
                prev.block_until_ready()
            prev = res
        prev.block_until_ready()
    try:
        return host_events(trace_dir, top)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-7b")
    ap.add_argument("--batch", type=int, default=172)
    ap.add_argument("--context", type=int, default=430)
    ap.add_argument("--adapters", type=int, default=156)
    ap.add_argument("--ranks", default="64,32,16,8")
    ap.add_argument("--prefill", default="2:256", metavar="N:L")
    ap.add_argument("--pattern", default="DDDDPDDPPDDDPDPDDDDP")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--traced-reps", type=int, default=1)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--variants", default="unified,base", help="comma list of unified (adapters), base")
    ap.add_argument("--modes", default="plain,buffers",
                    help="comma list: plain (fresh inputs and outputs every step, the engine before "
                         "StepBuffers), buffers (paged.step_packed: inputs packed into one buffer refilled "
                         "in place, K/V into a persistent buffer)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    n_pre, len_pre = (int(v) for v in args.prefill.split(":"))
    llm = LLM(args.model, dtype="bfloat16", max_num_seqs=2 * args.batch + 2 * n_pre, max_lora_rank=max(ranks),
              memory_fraction=0.7, max_adapters_per_batch=args.batch, max_prefill_seqs=32, max_prefill_tokens=4096)
    randomize_pool(llm)
    set_backends(llm, "hybrid/pallas/grouped")
    tmp = Path(tempfile.mkdtemp(prefix="slora-probe-"))
    atexit.register(shutil.rmtree, tmp, True)
    names = register_mixed_ranks(llm, args.adapters, ranks, tmp)
    result = {"commit": git_commit(), "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "pattern": args.pattern, "reps": args.reps, "variants": {}}
    eng = llm.engine
    rows = max(args.batch, n_pre * len_pre)
    runs = [(v, m) for v in ("unified", "base") if v in args.variants.split(",")
            for m in ("plain", "buffers") if m in args.modes.split(",")]
    made, firsts = {}, {}
    for variant, mode in runs:
        adapters = names if variant == "unified" else []
        if variant not in made:  # host (numpy) inputs, as the engine builds them every step
            _, dec = decode_batch(llm, args.batch, args.context, adapters)
            _, pre = prefill_batch(llm, n_pre, len_pre, adapters[:n_pre])
            made[variant] = {"D": jax.tree.map(np.asarray, dec), "P": jax.tree.map(np.asarray, pre)}
        steps = made[variant]
        buffers = paged.StepBuffers.create(llm.cfg, rows, eng._result_rows, eng.dtype, eng.kv[0].sharding) \
            if mode == "buffers" else None
        first, bad = {}, collections.Counter()
        t0 = time.perf_counter()
        run_pattern(llm, steps, "DDPP", first, bad, buffers)  # compile both and warm up
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        calls = run_pattern(llm, steps, args.pattern * args.reps, first, bad, buffers)
        wall = time.perf_counter() - t0
        host = traced_pass(llm, steps, args.pattern * args.traced_reps, buffers, args.top) if args.traced_reps else None
        v = {"compile_s": round(compile_s, 1), "wall_ms_a_step": round(wall * 1e3 / len(calls), 3),
             "host_ms_by_transition": by_transition(calls), "traced_host": host,
             "results_mismatched": dict(bad), "results_checked": len(calls) + 4}
        if variant in firsts:  # the same steps' results under the mode before (exactly equal expected)
            other = firsts[variant][1]
            v["results_equal_to_" + firsts[variant][0]] = all(
                np.array_equal(first[c], other[c], equal_nan=True) for c in first)
            # where not: how many sampled tokens differ, and the largest logprob difference
            v["results_diff_to_" + firsts[variant][0]] = {
                c: {"tokens_differ": int(np.sum(first[c][:, 0] != other[c][:, 0])), "rows": int(first[c].shape[0]),
                    "logprob_max_abs": float(np.max(np.abs(first[c][:, 1] - other[c][:, 1])))} for c in first}
        else:
            firsts[variant] = (mode, first)
        result["variants"][f"{variant}/{mode}"] = v
        print(f"{variant}/{mode}: wall {v['wall_ms_a_step']} ms a step; results differing from the first of their kind: "
              f"{dict(bad) or 'none'} of {len(calls) + 4}"
              + "".join(f"; {k}: {x}" for k, x in v.items() if k.startswith("results_equal"))
              + "; host ms a call by transition:", flush=True)
        for k, r in v["host_ms_by_transition"].items():
            print(f"  {k}: {r}")
        if host:
            print(f"  traced: {host['calls']} calls, {host['call_ms']} ms a call; host events a call:")
            for e in host["events"]:
                print(f"    {e['ms_a_call']:8.3f} ms  x{e['count_a_call']:<7} {e['name']}")
        jax.block_until_ready(llm.engine.kv)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    jnp.zeros(1)  # the backend up before the model loads
    main()
