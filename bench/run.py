"""Serve an S-LoRA trace with real arrival times and report what a user would feel.

    python bench/run.py --workload S1 --out s1.json                    # in-process, on the GPU
    python bench/run.py --workload S1-cpu                              # a miniature, CPU
    python bench/run.py --workload S2 --mode base --out base.json      # baseline (a): no adapters
    python bench/run.py --workload S1 --http http://127.0.0.1:8000     # an OpenAI-compatible server
    python bench/run.py --fixed-batch --out engine_fixed.json          # the HF PEFT comparison batch

Trace mode: requests join the engine when their arrival time has passed; the loop then runs one
engine step, and a request's first token counts at the end of the step that produced it. Latency
is from the arrival time in the trace, so time spent queued behind a running step counts.

Modes (what serves the trace):
  unified   the engine as it is: KV and adapters share one pool
  base      baseline (a): the same requests on the base model alone (adapter None)
  padded    baseline (d): AdapterMemoryBaseline("padded_slots", --baseline-size): that many adapter
            slots sized at the max rank, like vLLM --max-loras (default 8)
  separate  baseline (e): AdapterMemoryBaseline("separate", --baseline-size): adapters confined to
            that many reserved pages, KV to the rest (no unified pool)
The JSON labels a baseline run: `baseline` is {"kind", "size"}, null for the engine's own pool.

The job of each module: bench/serving.py runs the trace in-process (engine options, adapters,
replay), bench/report.py makes the metrics and the table, bench/http_client.py sends the trace
to a server, bench/variants.py serves several traces on one loaded model; this file is the CLI.

Metrics (JSON `metrics`, and a table):
  throughput_req_s   completed requests / wall time (first arrival to last finish)
  gen_tok_s          generated tokens (all requests) / wall time
  avg_latency_s      arrival to last token, completed requests
  ttft_p50/p99_s     arrival to first token, requests that got one
  slo_attainment     share of ALL requests whose first token came within slo_s; aborted,
                     rejected and cut-off requests count as misses
  resident_adapters_max, adapter_pool_share_mean/max   adapters in the pool, sampled every step
                     (share = adapter pages / all pool pages)

Adapters are generated PEFT directories, `distinct_files` per rank, registered under n names
`lora-{i}`: each name is its own adapter to the engine (own pages, own host->device load); only
the host cache shares the bytes. Adapter i has rank ranks[i % len(ranks)].
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if sys.path and Path(sys.path[0]).resolve() == REPO / "bench":
    sys.path[0] = str(REPO)  # run as a script: bench/trace.py must not shadow the stdlib's trace
elif str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from bench.provenance import git_commit  # noqa: E402
from bench.http_client import _http_replay, http_register  # noqa: E402,F401
from bench.report import summarize, table  # noqa: E402
from bench.serving import (BASELINES, MODES, TARGETS, adapter_files, adapter_name,  # noqa: E402,F401
                           adapter_paths, adapter_root, build_llm, engine_options, options_json, parse_kv,
                           replay, warmup_trace)
from bench.trace import FixedBatch, generate, load_workload  # noqa: E402
from bench.variants import run_variants  # noqa: E402

# -- environment ---------------------------------------------------------------------------------


def header(argv: list[str]) -> dict:
    d = {"commit": git_commit(), "command": " ".join([Path(sys.executable).name, "bench/run.py", *argv]),
         "python": platform.python_version(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
         "xla_flags": os.environ.get("XLA_FLAGS", "")}
    try:
        import jax
        dev = jax.devices()[0]
        d.update(device=str(dev.device_kind), platform=dev.platform, jax=jax.__version__)
        from pallas_kernels.lora import ExpandBlockSizes, ShrinkBlockSizes  # this device's tuned settings
        d["lora_block_sizes"] = {"shrink": dataclasses.asdict(ShrinkBlockSizes.get_default()),
                                 "expand": dataclasses.asdict(ExpandBlockSizes.get_default())}
    except Exception as e:  # noqa: BLE001 - an HTTP run needs no JAX
        d.update(device=f"unknown ({e})", platform="unknown")
    return d


# -- the fixed batch of the HF PEFT comparison ---------------------------------------------------


def fixed_batch(args, result: dict) -> None:
    """Generated tok/s of the engine on the FixedBatch requests, for each `mixed` count."""
    from slora_jax import SamplingParams
    from slora_jax.model.peft import random_peft_adapter
    counts = [int(x) for x in args.mixed.split(",")]
    fb0 = FixedBatch(args.batch, args.prompt_len, args.gen_len, 0, args.rank, args.seed or 0)
    opts = dict(max_num_seqs=args.batch, max_loras=args.batch,
                max_num_batched_tokens=args.batch * args.prompt_len, max_lora_rank=args.rank,
                page_size=16, **parse_kv(args.engine))
    from slora_jax import LLM
    t = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, **opts)
    result["load_s"] = time.perf_counter() - t
    root = adapter_root(args)
    for i in range(max(counts)):
        path = root / f"{llm.cfg.name}-{args.dtype}-fixed-r{args.rank}-{i}"
        if not (path / "adapter_model.safetensors").is_file():
            random_peft_adapter(path, llm.cfg, rank=args.rank, targets=list(TARGETS), seed=i, std=0.02,
                                dtype=args.dtype)
        llm.load_adapter(adapter_name(i), path)
    prompts = fb0.prompts(llm.cfg.vocab_size)
    sp = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
    rows = result["fixed_batch"] = []
    for k in counts:
        fb = dataclasses.replace(fb0, mixed=k)
        names = [None if a is None else adapter_name(a) for a in fb.adapter_ids()]
        llm.generate(prompts, sp, adapter=names)  # warm-up: compiles this batch's step shapes
        ts = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, adapter=names)
            ts.append(time.perf_counter() - t)
        n_tok = sum(len(o.token_ids) for o in outs)
        sec = float(np.median(ts))
        rows.append({"mixed_adapters": k, "batch": args.batch, "prompt_len": args.prompt_len,
                     "gen_len": args.gen_len, "generated_tokens": n_tok, "seconds": sec,
                     "gen_tok_s": n_tok / sec, "seconds_all": ts})
        print(f"engine fixed batch: {k:3d} mixed adapters  {n_tok / sec:9.1f} tok/s  ({sec:.2f} s)", flush=True)


# -- main ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--workload", default="S1-cpu", help="configs/workloads name or a TOML path")
    ap.add_argument("--mode", default="unified", choices=MODES)
    for f, t in (("n", int), ("alpha", float), ("rate", float), ("cv", float), ("duration-s", float),
                 ("num-requests", int), ("seed", int), ("distinct-files", int), ("warmup-s", float),
                 ("slo-s", float), ("model", str)):
        ap.add_argument(f"--{f}", type=t, default=None, help="override the workload's value")
    ap.add_argument("--early-abort", action=argparse.BooleanOptionalAction, default=None,
                    help="pass slo_s to the engine as SamplingParams.ttft_slo (S-LoRA's early abort)")
    ap.add_argument("--engine", action="append", metavar="KEY=VALUE", help="override an EngineConfig field")
    ap.add_argument("--baseline-size", type=int, default=None,
                    help="--mode padded: adapter slots, each sized at max_lora_rank (default 8); "
                         "--mode separate: pages reserved for adapters (required)")
    ap.add_argument("--max-wall-s", type=float, default=None,
                    help="stop after this many seconds (default: trace span + 120); the rest are cut off")
    ap.add_argument("--adapter-dir", default=None, help="where the generated PEFT directories go (reused)")
    ap.add_argument("--http", default=None, metavar="URL", help="send the trace to an OpenAI-compatible server")
    ap.add_argument("--http-base-model", default=None, help="--http with --mode base: the base model's name")
    ap.add_argument("--http-register", action="store_true",
                    help="--http: register the generated adapters through POST /v1/load_lora_adapter")
    ap.add_argument("--fixed-batch", action="store_true", help="the HF PEFT comparison batch instead of a trace")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--mixed", default="0,1,8,32", help="--fixed-batch: distinct adapters per batch")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", help="--fixed-batch dtype")
    ap.add_argument("--no-requests", action="store_true", help="leave per-request records out of the JSON")
    ap.add_argument("--trace-steps", type=int, default=0,
                    help="a device trace of this many serving steps, summed by kernel into pool.serving_trace")
    ap.add_argument("--trace-after-s", type=float, default=10.0, help="--trace-steps: start this far into the trace")
    ap.add_argument("--out", default=None, help="JSON file")
    ap.add_argument("--warmup-workers", type=int, default=1,
                    help="threads that compile the step buckets before serving (Engine.warmup)")
    ap.add_argument("--variant", action="append", metavar="NAME:ARGS",
                    help="several traces on one loaded model, one after the other (see run_variants); "
                         "ARGS override the main arguments, e.g. 'fcfs:--cv 4 --engine admission_order=fcfs'")
    ap.add_argument("--out-dir", default=None, help="--variant: where NAME.json goes (a NAME.json there is done)")
    ap.add_argument("--rate-from", default=None, metavar="NAME:FACTOR",
                    help="--variant: the offered rate is FACTOR x the req/s that variant NAME completed")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="--variant: start a variant only if its trace span + drain fits in what is left")
    return ap


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args._tmp = None
    args._argv_main = _strip_variant_args(argv)
    try:
        return _main(args, argv)
    finally:
        if args._tmp:
            shutil.rmtree(args._tmp, ignore_errors=True)


def _strip_variant_args(argv: list[str]) -> list[str]:
    """The main arguments without --variant/--out-dir/--budget-s (the base every variant parses on)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--variant", "--out-dir", "--budget-s", "--out"):
            skip = True
            continue
        if a.split("=", 1)[0] in ("--variant", "--out-dir", "--budget-s", "--out"):
            continue
        out.append(a)
    return out


def _main(args, argv: list[str]) -> dict:
    result = header(argv)

    def save():
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))

    if args.variant:
        return run_variants(args, argv, build_parser().parse_args, header)
    if args.fixed_batch:
        args.model = args.model or "llama-7b"
        result.update(kind="fixed_batch", model=args.model, dtype=args.dtype, rank=args.rank)
        fixed_batch(args, result)
        save()
        return result

    w = load_workload(args.workload, n=args.n, alpha=args.alpha, rate=args.rate, cv=args.cv,
                      duration_s=args.duration_s, num_requests=args.num_requests, seed=args.seed,
                      distinct_files=args.distinct_files, warmup_s=args.warmup_s, slo_s=args.slo_s,
                      model=args.model, early_abort=args.early_abort)
    trace = generate(w)
    result.update(kind="trace", mode=args.mode, workload=w.to_dict(), trace=trace.stats())
    opts = None if args.http else engine_options(w, args.mode, args.baseline_size, parse_kv(args.engine))
    from slora_jax.model.config import load_model_config
    cfg = load_model_config(w.model)
    paths = {} if args.mode == "base" else adapter_paths(w, adapter_files(w, cfg, adapter_root(args)))
    names = None if args.mode == "base" else list(paths)
    max_wall = args.max_wall_s if args.max_wall_s is not None else trace.span_s + 120.0

    if args.http:
        if args.mode in BASELINES:
            raise ValueError(f"--mode {args.mode} configures the in-process engine; start the server that way")
        if args.mode == "base" and not args.http_base_model:
            raise ValueError("--http --mode base needs --http-base-model (the server's name for the base model)")
        result["http"] = args.http
        if args.http_register:
            t = time.perf_counter()
            http_register(args.http, paths)
            result["register_s"] = time.perf_counter() - t
        if w.warmup_s > 0:
            warm = generate(w.replace(duration_s=w.warmup_s), seed=w.seed + 1)
            asyncio.run(_http_replay(args.http, warm, names, args.http_base_model, cfg.vocab_size))
        recs, wall = asyncio.run(_http_replay(args.http, trace, names, args.http_base_model, cfg.vocab_size))
    else:
        result["engine_options"] = options_json(opts)
        result["baseline"] = result["engine_options"].get("baseline")
        t = time.perf_counter()
        llm = build_llm(w, opts)
        result["load_s"] = time.perf_counter() - t
        t = time.perf_counter()
        llm.load_adapters(paths)
        result["register_s"] = time.perf_counter() - t
        t = time.perf_counter()
        result["warmup_shapes"] = llm.warmup(max_context=w.longest_context,
                                             workers=args.warmup_workers)
        result["warmup_compile_s"] = time.perf_counter() - t
        result["pool_at_start"] = llm.stats()
        warmup_trace(llm, w, names, result)
        recs, pool = replay(llm, trace, names, max_wall_s=max_wall, trace_steps=args.trace_steps,
                            trace_after_s=args.trace_after_s)
        result["pool"] = pool
        wall = pool["wall_s"]
    result["metrics"] = summarize(recs, w.slo_s, wall)
    if not args.no_requests:
        result["requests"] = [dataclasses.asdict(r) for r in recs]
    save()
    print(table(result), flush=True)
    return result


if __name__ == "__main__":
    main()
