"""Paged-engine benchmark: decode step time against the roofline, and offline generation throughput.

    python bench/engine_bench.py --model llama-7b --out results.json            # on the GPU
    python bench/engine_bench.py --model tiny --quick                           # smoke test, CPU

decode: B requests of context `--context` sit in the pool (random KV), and one jitted decode
step is timed without adapters and with min(B, 32) distinct rank-16 adapters, two ways: `ms`, the
median of `--iters` steps each waited for (host dispatch included), and `ms_back_to_back`,
`--iters` steps dispatched back to back as the serving loop does (device time, where the host
keeps ahead). Roofline = (weights + KV read + distinct adapters' weights) / measured copy bandwidth.
dense: the dense floor at the same batches and context: the engine's own model with a contiguous
KV cache, no pages and no LoRA (bench_dense_floor), measured last, with the engine's page pool
freed.

throughput: `--requests` requests (prompt and output lengths from `--prompt-len`,
`--max-tokens`, ignore_eos) over n rank-16 adapters (n=0: base model only), through
`LLM.generate`. Adapters are `--distinct-files` PEFT directories registered under n names: each
name is its own adapter to the engine (own pages, own host->device load); only the host cache
shares the bytes.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == REPO / "bench":
    sys.path[0] = str(REPO)  # run as a script: bench/trace.py must not shadow the stdlib's trace

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.provenance import git_commit  # noqa: E402
from slora_jax import LLM, SamplingParams  # noqa: E402
from slora_jax.engine import step as paged  # noqa: E402
from slora_jax.engine.inputs import group_by_adapter  # noqa: E402
from slora_jax.model.peft import random_peft_adapter  # noqa: E402
from slora_jax.request import Request, RequestOutput  # noqa: E402


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Bytes read + written per second by an on-device elementwise copy."""
    x = jax.random.normal(jax.random.PRNGKey(0), (nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a * 1.0001)
    f(x).block_until_ready()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t)
    return 2 * nbytes / float(np.median(ts))


def mem(tag: str) -> dict:
    """Device memory at a phase of the run (GPU only), printed and kept in the JSON."""
    st = jax.devices()[0].memory_stats() or {}
    row = {k: round(st[k] / 2**30, 2) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in st}
    print(f"memory {tag}: {row} GiB", flush=True)
    return {"phase": tag, **row}


def tree_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def randomize_pool(llm: LLM) -> None:
    """Random KV in every page (timing on all-zero data is not allowed). The new values are added to
    the donated pool so the output aliases it: a fill that ignores its input would not be donated
    (JAX drops unused arguments) and would briefly hold the pool twice. One layer at a time."""
    keys = jax.random.split(jax.random.PRNGKey(1), len(llm.engine.kv))
    fill = jax.jit(lambda k, a: a + (0.5 * jax.random.normal(k, a.shape, a.dtype)), donate_argnums=1)
    kv = llm.engine.kv
    for i, k in enumerate(keys):
        kv[i] = fill(k, kv[i])
        kv[i].block_until_ready()


def set_backends(llm: LLM, pair: str) -> tuple[str, str]:
    """"lora/attention": the backends the next steps run on (EngineConfig.lora_backend and
    attention_backend, resolved), set on the running engine so one process times every pair."""
    parts = pair.split("/")
    if len(parts) != 2:
        raise ValueError(f"backend pair {pair!r}: give lora/attention, e.g. pallas/pallas")
    lora, attn = parts
    eng = llm.engine
    eng.opts = dataclasses.replace(eng.opts, lora_backend=lora, attention_backend=attn)
    eng.builder.attention_backend = attn
    eng.builder.decode_page_floor = eng.decode_page_floor()
    return lora, attn


_ANALYZED: set = set()  # decode steps (with adapters or not) whose memory analysis was printed


def register_mixed_ranks(llm: LLM, count: int, ranks: list[int], root: Path, distinct_files: int = 4) -> list[str]:
    """Register adapters lora-0 .. lora-{count-1} on q, k, v and o: adapter i has rank
    ranks[i % len] and its weights from one of `distinct_files` random files of that rank, written
    under root. Every name has pages of its own in the pool (the store keys pages by name), so the
    kernels read each adapter's rows separately whatever file they came from; fewer files than
    names saves writing GBs of adapters. Returns the names."""
    files, names = {}, []
    for i in range(count):
        rank, f = ranks[i % len(ranks)], (i // len(ranks)) % distinct_files
        if (rank, f) not in files:
            files[rank, f] = random_peft_adapter(root / f"r{rank}-{f}", llm.cfg, rank=rank, std=0.02,
                                                 targets=["q_proj", "k_proj", "v_proj", "o_proj"], seed=len(files))
        llm.load_adapter(f"lora-{i}", files[rank, f])
        names.append(f"lora-{i}")
    return names


def decode_batch(llm: LLM, batch: int, context: int, adapters: list[str]) -> tuple[list, object]:
    """`batch` requests of `context` tokens (random KV) admitted into the pool, in the engine's
    adapter-grouped order, and the device inputs of their decode step. Release the requests with
    `llm.engine._release` when done."""
    reqs = _admitted(llm, batch, context, adapters, decode=True)
    inp, _ = llm.engine.builder.decode(reqs)
    return reqs, jax.device_put(inp)


def _admitted(llm: LLM, n: int, length: int, adapters: list, decode: bool) -> list:
    """n requests of `length` random tokens, request i on adapters[i % len] (None or no list: the
    base model), admitted into the pool with pages for every token, in the engine's order (each
    adapter's requests contiguous, base last). decode: the last token is the one to compute (its
    context is in the pool, as random KV); else a fresh prompt, greedy, one token to generate."""
    eng = llm.engine
    reqs = []
    rng = np.random.default_rng(n)
    for i in range(n):
        name = adapters[i % len(adapters)] if adapters else None
        entry = eng.store.get(name) if name else None
        tokens = rng.integers(3, llm.cfg.vocab_size, length).tolist()
        rid = f"bench-{'decode' if decode else 'prefill'}-{n}-{i}"
        params = SamplingParams(max_tokens=1 << 20) if decode else SamplingParams(max_tokens=1, temperature=0.0)
        req = Request(rid, tokens, length - 1 if decode else length, params, i, entry, RequestOutput(rid, tokens),
                      frozenset(), 0.0, num_computed=length - 1 if decode else 0)
        if not (eng._admit(req) and eng._grow(req, length)):
            for r in reqs:
                eng._release(r)
            raise RuntimeError(f"pool too small for {n} benchmark requests of {length} tokens")
        reqs.append(req)
    chunks = [(r, 0, 0) for r in reqs]
    group_by_adapter(chunks)
    return [c[0] for c in chunks]


def prefill_batch(llm: LLM, prompts: int, prompt_len: int, adapters: list[str]) -> tuple[list, object]:
    """`prompts` fresh prompts of `prompt_len` tokens (random ids), prompt i on adapter i mod
    len(adapters), admitted with their pages, and the inputs of the one packed prefill step that
    runs them all (the engine's order: each adapter's tokens contiguous). Release the requests with
    `llm.engine._release` when done."""
    eng = llm.engine
    reqs = _admitted(llm, prompts, prompt_len, adapters, decode=False)
    inp, _ = eng.builder.prefill([(r, 0, prompt_len) for r in reqs])
    if eng.depth:  # under async scheduling the engine's steps take the fed-token inputs too
        t = inp.tokens.shape[0]
        inp = inp.replace(token_src=np.full(t, -1, np.int32), prev_results=eng.builder.prev_results)
    return reqs, jax.device_put(inp)


def bench_decode(llm: LLM, batch: int, context: int, adapters: list[str], iters: int, bw: float) -> dict:
    eng = llm.engine
    reqs, inp = decode_batch(llm, batch, context, adapters)
    try:
        t0 = time.perf_counter()
        if batch == 1 and eng.opts.lora_backend == "xla" and bool(adapters) not in _ANALYZED:
            ma = paged.forward_sample.lower(llm.params, eng.kv, inp, cfg=llm.cfg).compile().memory_analysis()
            if ma is not None:
                print(f"  forward_sample B={batch}: temp {ma.temp_size_in_bytes / 2**30:.2f} GiB, "
                      f"args {ma.argument_size_in_bytes / 2**30:.2f} GiB, out {ma.output_size_in_bytes / 2**30:.2f} GiB "
                      f"(compile {time.perf_counter() - t0:.1f} s)", flush=True)
            _ANALYZED.add(bool(adapters))
        t = time.perf_counter()
        eng.kv, res = paged.step(llm.params, eng.kv, inp, cfg=llm.cfg)
        res.block_until_ready()
        first_s = time.perf_counter() - t  # compile (or a compilation-cache load) + one step
        eng.kv, res = paged.step(llm.params, eng.kv, inp, cfg=llm.cfg)
        res.block_until_ready()
        ts = []
        for _ in range(iters):
            t = time.perf_counter()
            eng.kv, res = paged.step(llm.params, eng.kv, inp, cfg=llm.cfg)
            res.block_until_ready()
            ts.append(time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(iters):  # dispatched back to back, as the serving loop does
            eng.kv, res = paged.step(llm.params, eng.kv, inp, cfg=llm.cfg)
        res.block_until_ready()
        pipelined_s = (time.perf_counter() - t) / iters
    finally:
        for r in reqs:
            eng._release(r)
    distinct = {r.adapter.key: r.adapter for r in reqs if r.adapter}
    cfg = llm.cfg
    itemsize = jnp.dtype(llm.dtype).itemsize
    kv_bytes = batch * context * cfg.num_hidden_layers * 2 * cfg.kv_size * itemsize
    ad_bytes = sum(e.layout.rows for e in distinct.values()) * cfg.kv_size * cfg.num_hidden_layers * itemsize
    w_bytes = tree_bytes(llm.params)
    roof = (w_bytes + kv_bytes + ad_bytes) / bw
    ms = float(np.median(ts)) * 1e3
    return {"batch": batch, "context": context, "distinct_adapters": len(distinct), "ms": ms,
            "ms_back_to_back": pipelined_s * 1e3,
            "lora_backend": eng.opts.lora_backend, "attention_backend": eng.opts.attention_backend,
            "first_call_s": first_s,
            "roofline_ms": roof * 1e3, "x_roofline": ms / (roof * 1e3),
            "bytes": {"weights": w_bytes, "kv": kv_bytes, "adapters": ad_bytes}}


def bench_dense_floor(llm: LLM, batch: int, context: int, iters: int, bw: float) -> dict:
    """The dense floor of a decode step: the engine's own model (slora_jax.model.llama through
    slora_jax.model.reference.dense_step) with a contiguous KV cache [B, context + 1] of random
    values, no pages and no LoRA, one token a row at position `context`, timed as bench_decode."""
    from slora_jax.model import reference
    cfg = llm.cfg
    cache = reference.empty_cache(cfg, batch, context + 1, llm.dtype)
    keys = jax.random.split(jax.random.PRNGKey(2), len(cache))
    fill = jax.jit(lambda k, a: a + 0.5 * jax.random.normal(k, a.shape, a.dtype), donate_argnums=1)
    cache = [(fill(k, kc), fill(jax.random.fold_in(k, 1), vc)) for k, (kc, vc) in zip(keys, cache)]
    rng = np.random.default_rng(batch)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (batch, 1)), jnp.int32)
    positions = jnp.full((batch, 1), context, jnp.int32)
    zeros = jnp.zeros(batch, jnp.int32)
    args = (tokens, positions, zeros, zeros, jnp.zeros(batch, jnp.float32), zeros, jnp.ones(batch, jnp.float32),
            zeros, zeros)

    def run(cache):
        tok, _, cache = reference.dense_step(llm.params, cfg, None, cache, *args)
        tok.block_until_ready()
        return cache

    t = time.perf_counter()
    cache = run(cache)
    first_s = time.perf_counter() - t
    cache = run(cache)
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        cache = run(cache)
        ts.append(time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(iters):  # dispatched back to back
        tok, _, cache = reference.dense_step(llm.params, cfg, None, cache, *args)
    tok.block_until_ready()
    pipelined_s = (time.perf_counter() - t) / iters
    itemsize = jnp.dtype(llm.dtype).itemsize
    kv_bytes = batch * context * cfg.num_hidden_layers * 2 * cfg.kv_size * itemsize
    w_bytes = tree_bytes(llm.params)
    roof = (w_bytes + kv_bytes) / bw
    ms = float(np.median(ts)) * 1e3
    del cache
    return {"batch": batch, "context": context, "distinct_adapters": 0, "ms": ms, "ms_back_to_back": pipelined_s * 1e3,
            "kind": "dense_floor",
            "first_call_s": first_s, "roofline_ms": roof * 1e3, "x_roofline": ms / (roof * 1e3),
            "bytes": {"weights": w_bytes, "kv": kv_bytes, "adapters": 0}}


def bench_throughput(llm: LLM, n_adapters: int, names: list[str], args) -> dict:
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, llm.cfg.vocab_size, int(rng.integers(*args.prompt_len))).tolist()
               for _ in range(args.requests)]
    chosen = [names[int(i)] for i in rng.integers(0, n_adapters, args.requests)] if n_adapters else None
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    before = llm.stats()
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, adapter=chosen)
    dt = time.perf_counter() - t
    after = llm.stats()
    n_tok = sum(len(o.token_ids) for o in outs)
    return {"adapters": n_adapters, "requests": len(outs),
            "lora_backend": llm.engine.opts.lora_backend, "attention_backend": llm.engine.opts.attention_backend, "generated_tokens": n_tok, "seconds": dt,
            "tok_per_s": n_tok / dt, "distinct_in_batch": len(set(chosen or [])),
            "steps": after["steps"] - before["steps"], "evictions": after["evictions"] - before["evictions"],
            "preempted": after["preempted"] - before["preempted"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-7b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pool-pages", type=int, default=None)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--adapter-counts", default="0,1,100,1000")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", default="64,192")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--distinct-files", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--ranks", default=None,
                    help="comma list: adapter file i has rank ranks[i %% len] (S2: 64,32,16,8); "
                         "max_lora_rank becomes their max (overrides --rank)")
    ap.add_argument("--decode-adapters", default="32",
                    help="comma list: distinct adapters in the decode rows (each capped at the batch)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: decode,dense,throughput")
    ap.add_argument("--backends", default="xla/xla",
                    help="comma list of lora/attention backend pairs, each timed in this one run, "
                         "e.g. xla/xla,pallas/pallas,ranksplit/pallas (ratios between them come from one process)")
    ap.add_argument("--throughput-backends", default=None, help="pairs for the throughput part (default: --backends)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.7,
                    help="EngineConfig.gpu_memory_utilization, a share of the device's total memory "
                         "(JAX preallocates 75%% by default: keep this under it, or raise XLA_PYTHON_CLIENT_MEM_FRACTION)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a CPU smoke run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.batches, args.context, args.iters = "1,4", 32, 3
        args.adapter_counts, args.requests, args.max_tokens, args.prompt_len = "0,3", 8, 8, "4,12"
        args.pool_pages = args.pool_pages or 512
    args.prompt_len = tuple(int(x) for x in args.prompt_len.split(","))
    skip = set(filter(None, args.skip.split(",")))

    result = {"commit": git_commit(), "device": str(jax.devices()[0].device_kind),
              "platform": jax.devices()[0].platform, "jax": jax.__version__, "python": platform.python_version(),
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "model": args.model,
              "dtype": args.dtype, "page_size": args.page_size}
    t0 = time.perf_counter()
    max_seqs = max(args.requests, *(int(b) for b in args.batches.split(",")))
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else [args.rank]
    decode_counts = [int(n) for n in args.decode_adapters.split(",")]
    llm = LLM(args.model, dtype=args.dtype, page_size=args.page_size, pool_pages=args.pool_pages,
              max_num_seqs=max_seqs, max_lora_rank=max(ranks), max_num_batched_tokens=2048,
              gpu_memory_utilization=args.gpu_memory_utilization, max_loras=max_seqs)
    result["load_s"] = time.perf_counter() - t0
    result["memory"] = [mem("after LLM()")]
    result["copy_bandwidth_GBps"] = copy_bandwidth() / 1e9 if result["platform"] != "cpu" else None
    bw = (result["copy_bandwidth_GBps"] or 50.0) * 1e9
    randomize_pool(llm)
    result["pool"] = llm.stats()
    result["memory"].append(mem("after pool fill"))
    print("pool", result["pool"], flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="slora-bench-"))
    atexit.register(shutil.rmtree, tmp, True)  # adapters of GBs: a warm machine's disk fills
    files = [random_peft_adapter(tmp / f"a{i}", llm.cfg, rank=ranks[i % len(ranks)],
                                 targets=["q_proj", "k_proj", "v_proj", "o_proj"], seed=i, std=0.02)
             for i in range(args.distinct_files)]
    n_max = max(int(n) for n in args.adapter_counts.split(","))
    t0 = time.perf_counter()
    names = []
    for i in range(max(n_max, *decode_counts)):
        llm.load_adapter(f"lora-{i}", files[i % len(files)])
        names.append(f"lora-{i}")
    result["register_s"] = time.perf_counter() - t0

    def save():
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))

    pairs = args.backends.split(",")
    if "decode" not in skip:
        rows = result["decode"] = []
        for pair in pairs:
            set_backends(llm, pair)
            for b in (int(x) for x in args.batches.split(",")):
                for ads in ([], *(names[:k] for k in sorted({min(b, n) for n in decode_counts}))):
                    try:
                        r = bench_decode(llm, b, args.context, ads, args.iters, bw)
                    except Exception as e:  # noqa: BLE001 - a backend that fails is recorded, the rest still run
                        rows.append({"batch": b, "backends": pair, "error": f"{type(e).__name__}: {e}"[:2000]})
                        save()
                        print(f"decode {pair:13s} B={b:4d} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                        break
                    rows.append(r)
                    save()
                    print(f"decode {pair:13s} B={b:4d} adapters={r['distinct_adapters']:3d}  {r['ms']:8.2f} ms  "
                          f"(back to back {r['ms_back_to_back']:7.2f} ms)  "
                          f"roofline {r['roofline_ms']:7.2f} ms  x{r['x_roofline']:.2f}  "
                          f"(first call {r['first_call_s']:.1f} s)", flush=True)
    if "throughput" not in skip:
        rows = result["throughput"] = []
        for pair in (args.throughput_backends or args.backends).split(","):
            set_backends(llm, pair)
            for n in (int(x) for x in args.adapter_counts.split(",")):
                bench_throughput(llm, n, names[:n], args)  # warm-up: compiles this workload's buckets
                r = bench_throughput(llm, n, names[:n], args)
                rows.append(r)
                save()
                print(f"throughput {pair:13s} n={n:5d}  {r['tok_per_s']:9.1f} tok/s  ({r['seconds']:.1f} s, "
                      f"{r['steps']} steps, {r['evictions']} evictions, {r['preempted']} preempted)", flush=True)
        for r in rows:
            base = next((b for b in rows if b["adapters"] == 0 and b["lora_backend"] == r["lora_backend"]
                         and b["attention_backend"] == r["attention_backend"]), None)
            r["vs_base"] = r["tok_per_s"] / base["tok_per_s"] if base else None
    if "dense" not in skip:
        # Last, on the engine's weights with its page pool freed: a contiguous cache of B 256 x 513
        # tokens (69 GB for llama-7b) does not fit beside a pool sized for B 256.
        for layer in llm.engine.kv:
            layer.delete()
        rows = result["dense_floor"] = []
        for b in (int(x) for x in args.batches.split(",")):
            r = bench_dense_floor(llm, b, args.context, args.iters, bw)
            rows.append(r)
            save()
            print(f"dense floor         B={b:4d}              {r['ms']:8.2f} ms  "
                  f"(back to back {r['ms_back_to_back']:7.2f} ms)  roofline {r['roofline_ms']:7.2f} ms  "
                  f"x{r['x_roofline']:.2f}", flush=True)
    save()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
