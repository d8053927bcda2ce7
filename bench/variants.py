"""bench/run.py --variant: several traces served one after the other on one loaded model."""

from __future__ import annotations

import dataclasses
import json
import shlex
import time
from pathlib import Path

from bench.report import summarize, table
from bench.serving import (adapter_files, adapter_name, adapter_paths, adapter_root, build_llm, engine_options,
                           options_json, parse_kv, replay, warmup_trace)
from bench.trace import generate, load_workload
from slora_jax.config import EngineConfig


def _variant_args(args, spec: str, parse):
    name, _, extra = spec.partition(":")
    if not name or "/" in name:
        raise ValueError(f"--variant wants NAME:ARGS with a plain NAME, got {spec!r}")
    return name, parse([*args._argv_main, *shlex.split(extra)])


def run_variants(args, argv: list[str], parse, header) -> dict:
    """Serve several traces, one after the other, on one loaded model and one set of registered
    adapters: each variant gets a fresh engine (empty pool, fresh scheduler and metrics) on the same
    weights with the same pool size, so the compiled steps carry over and only the first variant
    pays for compiles. A variant changes the trace (--rate, --cv, --n, --alpha, --duration-s, ...),
    the mode (unified, base, separate), scheduler or engine options (--engine K=V, --early-abort).
    Variants whose NAME.json is already in --out-dir are skipped (resumable). `parse` reads a
    variant's arguments (bench/run.py's parser); `header` makes a JSON's provenance header."""
    if not args.out_dir:
        raise ValueError("--variant needs --out-dir")
    if args.http or args.fixed_batch:
        raise ValueError("--variant serves traces in-process; not with --http or --fixed-batch")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    variants = [_variant_args(args, spec, parse) for spec in args.variant]
    names_seen = [n for n, _ in variants]
    if len(set(names_seen)) != len(names_seen):
        raise ValueError(f"variant names repeat: {names_seen}")
    todo = [(n, v) for n, v in variants if not (out_dir / f"{n}.json").is_file()]
    if not todo:
        print("[variants] all done", flush=True)
        return {}
    for n, v in todo:
        if v.mode == "padded" or v.model != args.model:
            raise ValueError(f"variant {n}: --mode padded and --model need a run of their own")
    ws = {n: load_workload(v.workload, n=v.n, alpha=v.alpha, rate=v.rate, cv=v.cv, duration_s=v.duration_s,
                           num_requests=v.num_requests, seed=v.seed, distinct_files=v.distinct_files,
                           warmup_s=v.warmup_s, slo_s=v.slo_s, model=v.model, early_abort=v.early_abort)
          for n, v in todo}
    w0 = ws[todo[0][0]]
    from slora_jax.model.config import load_model_config
    cfg = load_model_config(w0.model)
    files = adapter_files(w0, cfg, adapter_root(args))
    n_max = max(w.n for w in ws.values())
    paths = adapter_paths(w0.replace(n=n_max), files)
    opts0 = engine_options(w0, "unified", overrides=parse_kv(args.engine))
    t = time.perf_counter()
    llm = build_llm(w0, opts0)
    load_s = time.perf_counter() - t
    num_pages = llm.engine.num_pages
    t = time.perf_counter()
    llm.load_adapters(paths)  # distinct files read side by side
    register_s = time.perf_counter() - t
    print(f"[variants] model loaded in {load_s:.1f} s, {len(paths)} adapters registered in {register_s:.1f} s, "
          f"{num_pages} pages", flush=True)
    t = time.perf_counter()
    shapes = llm.warmup(max_context=max(w.longest_context for w in ws.values()),
                        workers=args.warmup_workers)
    compile_s = time.perf_counter() - t
    print(f"[variants] warm-up compiled {shapes} step shapes in {compile_s:.0f} s", flush=True)
    for k, (name, v) in enumerate(todo):
        w = ws[name]
        if v.rate_from:
            ref, _, factor = v.rate_from.partition(":")
            ref_json = out_dir / f"{ref}.json"
            if not ref_json.is_file():
                print(f"[variants] {name}: skipped, --rate-from {ref} has no result yet", flush=True)
                continue
            got = json.loads(ref_json.read_text())["metrics"]["throughput_req_s"]
            if got <= 0:
                print(f"[variants] {name}: skipped, {ref} completed no request", flush=True)
                continue
            w = w.replace(rate=round(float(factor or 1) * got, 2))
        trace = generate(w)
        # warm-up trace + trace + drain (at most the cut-off); the step buckets are compiled already
        est = w.warmup_s + min(trace.span_s + 30.0, v.max_wall_s or 1e9)
        left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - t_start)
        if left is not None and est > left:
            print(f"[variants] {name}: needs ~{est:.0f} s, {left:.0f} s left; later", flush=True)
            continue
        try:
            llm = _run_variant(llm, name, v, w, trace, k, argv, out_dir, opts0, num_pages,
                               {"load_s": load_s, "register_s": register_s,
                                "warmup_shapes": shapes, "warmup_compile_s": compile_s},
                               header, workers=args.warmup_workers)
        except Exception:  # noqa: BLE001 - one failing variant must not take the others with it
            import traceback
            msg = traceback.format_exc()
            (out_dir / f"{name}.failed").write_text(msg)
            print(f"[variants] {name}: FAILED\n{msg}", flush=True)
            continue
    return {}


def _run_variant(llm, name, v, w, trace, k, argv, out_dir, opts0, num_pages, loads, header, workers=1):
    import gc
    import jax
    from slora_jax.engine.adapter_store import host_cache_bytes
    from slora_jax.engine.engine import Engine
    opts = engine_options(w, v.mode, v.baseline_size, parse_kv(v.engine))
    opts = {**opts, "pool_pages": num_pages}
    other_options = opts != {**opts0, "pool_pages": num_pages}
    if k > 0 or other_options:
        old, llm.engine = llm.engine, None
        if old is not None:  # None: the variant before failed while building it
            for a in jax.tree.leaves(old.kv):
                a.delete()
        del old
        gc.collect()
        llm.config = EngineConfig().replace(**opts)
        llm.engine = Engine(llm.cfg, llm.params, llm.dtype, llm.store, llm.config, llm.max_model_len)
        # The adapter store outlives the engine: its host cache takes this variant's size now
        # (a smaller cache drops files at once, so the variant's cold adapters come from disk).
        llm.store.resize_host_cache(llm.config.max_cpu_loras, host_cache_bytes(llm.config.max_cpu_lora_gb))
    variant_warmup = None
    if other_options:
        # Other engine options (a LoRA backend, slots, ...) may mean other step buckets: compile
        # them before serving; the ones the first warm-up compiled are in-memory cache hits.
        t = time.perf_counter()
        shapes = llm.warmup(max_context=w.longest_context, progress=False, workers=workers)
        variant_warmup = {"shapes": shapes, "seconds": time.perf_counter() - t}
        print(f"[variants] {name}: warm-up of its engine options, {shapes} shapes in "
              f"{variant_warmup['seconds']:.0f} s", flush=True)
    names = None if v.mode == "base" else [adapter_name(i) for i in range(w.n)]
    result = header([*argv, f"# variant {name}"])
    recorded = options_json(opts)
    result.update(kind="trace", variant=name, mode=v.mode, workload=w.to_dict(), trace=trace.stats(),
                  engine_options=recorded, baseline=recorded.get("baseline"), **loads, shared_process=k > 0,
                  rate_from=v.rate_from, variant_warmup=variant_warmup)
    t0 = time.perf_counter()
    result["pool_at_start"] = llm.stats()
    warmup_trace(llm, w, names, result)
    max_wall = v.max_wall_s if v.max_wall_s is not None else trace.span_s + 120.0
    recs, pool = replay(llm, trace, names, max_wall_s=max_wall, trace_steps=v.trace_steps,
                        trace_after_s=v.trace_after_s)
    result["pool"] = pool
    result["metrics"] = summarize(recs, w.slo_s, pool["wall_s"])
    if not v.no_requests:
        result["requests"] = [dataclasses.asdict(r) for r in recs]
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(f"[variants] {name}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    print(table(result), flush=True)
    return llm
