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
  padded    baseline (d): `adapter_slots` adapter slots sized at the max rank, like vLLM --max-loras
  separate  baseline (e): adapters confined to a reserved region, KV to the rest (no unified pool)
(d) and (e) need engine options that do not exist yet; the run stops with a ValueError naming them.

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
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if sys.path and Path(sys.path[0]).resolve() == REPO / "bench":
    sys.path[0] = str(REPO)  # run as a script: bench/trace.py must not shadow the stdlib's trace
elif str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from bench.provenance import git_commit  # noqa: E402
from bench.trace import FixedBatch, Trace, Workload, generate, load_workload, prompt_tokens  # noqa: E402

MODES = ("unified", "base", "padded", "separate")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # S-LoRA's dummy adapters
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

# The engine hooks baselines (d) and (e) need (see bench/RESULTS.md, "Engine hooks").
MODE_HOOKS = {
    "padded": ("adapter_memory", "padded_slots", ("adapter_slots",)),
    "separate": ("adapter_memory", "separate", ("adapter_region_pages",)),
}


@dataclasses.dataclass
class Record:
    index: int
    arrival_s: float
    adapter: str | None
    prompt_len: int
    output_len: int
    first_token_s: float | None = None   # since the start of the trace
    finish_s: float | None = None
    tokens: int = 0
    finish_reason: str | None = None     # length | stop | abort | rejected | cutoff
    cold: bool | None = None             # its adapter was not resident in the pool when it arrived

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def latency(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s


# -- environment ---------------------------------------------------------------------------------


def header(argv: list[str]) -> dict:
    d = {"commit": git_commit(), "command": " ".join([Path(sys.executable).name, "bench/run.py", *argv]),
         "python": platform.python_version(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
         "xla_flags": os.environ.get("XLA_FLAGS", "")}
    try:
        import jax
        dev = jax.devices()[0]
        d.update(device=str(dev.device_kind), platform=dev.platform, jax=jax.__version__)
        from pallas_kernels.lora import BLOCKS  # the kernel settings, SLORA_LORA_BLOCKS merged in
        d["lora_blocks"] = BLOCKS
    except Exception as e:  # noqa: BLE001 - an HTTP run needs no JAX
        d.update(device=f"unknown ({e})", platform="unknown")
    return d


# -- the engine side -------------------------------------------------------------------------------


def engine_options(w: Workload, mode: str, adapter_slots: int | None = None,
                   adapter_region_pages: int | None = None, overrides: dict | None = None) -> dict:
    """LLM(**options) for `mode`; raises ValueError if the engine lacks the mode's hook."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    opts = {**w.engine_options, **(overrides or {})}
    if mode in MODE_HOOKS:
        from slora_jax.engine.engine import EngineOptions
        field, value, extra = MODE_HOOKS[mode]
        have = {f.name for f in dataclasses.fields(EngineOptions)}
        missing = [f for f in (field, *extra) if f not in have]
        if missing:
            raise ValueError(f"engine option {value} not available yet: --mode {mode} needs "
                             f"EngineOptions.{field}={value!r} and {', '.join('EngineOptions.' + e for e in extra)} "
                             f"(missing: {', '.join(missing)}); see bench/RESULTS.md, 'Engine hooks'")
        opts[field] = value
        if mode == "padded":
            opts["adapter_slots"] = adapter_slots or opts.get("adapter_slots") or 8
        else:
            if adapter_region_pages is None and "adapter_region_pages" not in opts:
                raise ValueError("--mode separate needs --adapter-region-pages (pages reserved for adapters)")
            opts["adapter_region_pages"] = adapter_region_pages or opts["adapter_region_pages"]
    return opts


def adapter_files(w: Workload, cfg, root: Path) -> dict[int, list[str]]:
    """`distinct_files` random PEFT directories per rank, written once under root."""
    from slora_jax.model.peft import random_peft_adapter
    files = {}
    for r in sorted(set(w.ranks)):
        files[r] = []
        for k in range(w.distinct_files):
            path = root / f"{cfg.name}-{w.dtype}-r{r}-{k}"
            if not (path / "adapter_model.safetensors").is_file():
                random_peft_adapter(path, cfg, rank=r, targets=list(TARGETS), seed=1000 * r + k, std=0.02,
                                    dtype=w.dtype)  # stored as served: half the bytes of float32 for bf16
            files[r].append(str(path))
    return files


def adapter_name(i: int) -> str:
    return f"lora-{i}"


def adapter_paths(w: Workload, files: dict[int, list[str]]) -> dict[str, str]:
    """{name: directory} for adapters 0..n-1: adapter i has rank ranks[i % len(ranks)]."""
    return {adapter_name(i): files[w.rank_of(i)][(i // len(w.ranks)) % w.distinct_files] for i in range(w.n)}


def build_llm(w: Workload, opts: dict):
    from slora_jax import LLM
    return LLM(w.model, dtype=w.dtype, **opts)


def _sampling(w: Workload, output_len: int):
    from slora_jax import SamplingParams
    kw = dict(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    if w.early_abort:
        if "ttft_slo" not in {f.name for f in dataclasses.fields(SamplingParams)}:
            raise ValueError("early_abort needs SamplingParams.ttft_slo, which this engine lacks")
        kw["ttft_slo"] = w.slo_s
    return SamplingParams(**kw)


class _CompileCounter:
    """Backend compilations (and their seconds) while active: a compile inside a timed run shows up."""

    def __init__(self):
        self.count, self.seconds, self.active = 0, 0.0, False
        from jax import monitoring
        monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event: str, duration: float, **_) -> None:
        if self.active and event == COMPILE_EVENT:
            self.count += 1
            self.seconds += duration


_counter: _CompileCounter | None = None


def compile_counter() -> _CompileCounter:
    global _counter
    if _counter is None:
        _counter = _CompileCounter()
    return _counter


def _phase(name: str):
    """This loop's own host work between engine steps, named in a serving trace beside the
    engine's phases (slora_jax.engine.engine._phase) as `slora.bench_<name>`."""
    import jax
    return jax.profiler.TraceAnnotation(f"slora.bench_{name}")


def _pool_sample(llm) -> tuple[int, int, int, int]:
    """(resident adapters, adapter pages, KV pages, all pages), cheaply: Engine.stats() also
    summarizes histograms, too much to call after every step."""
    p = getattr(llm.engine, "pool", None)
    try:
        return len(p.adapters), p.adapter_pages, p.kv_pages, p.total_pages
    except AttributeError:
        st = llm.stats()
        return st["resident_adapters"], st["adapter_pages"], st["kv_pages"], st["total_pages"]


class ServingTrace:
    """A device trace of `steps` serving steps, from the first step at or after `after_s` seconds
    into the trace, summed by kernel as tools/profile_step.py sums a bare step: device time and
    kernels a step, the traced span against the time some kernel ran (busy < span: the device
    waited for the host), beside the host's wall time a step in the same window."""

    def __init__(self, llm, steps: int, after_s: float):
        self.llm, self.want, self.after_s = llm, steps, after_s
        self.steps, self.active, self.done = 0, False, False

    def maybe_start(self, now: float) -> None:
        if self.active or self.done or now < self.after_s:
            return
        import jax
        self.dir = tempfile.mkdtemp(prefix="slora-serve-trace-")
        self.before = self.llm.stats()
        jax.profiler.start_trace(self.dir, create_perfetto_trace=True)
        self.active, self.t0 = True, time.perf_counter()

    def stepped(self) -> None:
        if self.active:
            self.steps += 1
            if self.steps >= self.want:
                self.stop()

    def stop(self) -> None:
        if not self.active:
            return
        import jax
        for a in jax.tree.leaves(self.llm.engine.kv):  # the last dispatched step ends inside the trace
            a.block_until_ready()
        self.wall_s = time.perf_counter() - self.t0
        jax.profiler.stop_trace()
        self.after = self.llm.stats()
        self.active, self.done = False, True

    def summary(self, top: int = 60) -> dict | None:
        # top 60 kernels by time: session 9 kept 15, too few to name the ~0.8 ms of glue a
        # unified step spends beyond the base step (the trace files stay on the device)
        if not self.done or not self.steps:
            return None
        from bench.device_trace import device_events
        from tools.profile_step import host_phases, idle_by_phase, summarize as sum_kernels
        device = device_events(self.dir)
        out = sum_kernels(device, self.steps, top)
        # the device's idle gaps by the engine's host phase that overlapped them (us a step)
        out["idle_by_host_phase_us"] = idle_by_phase(device, host_phases(self.dir), self.steps)
        out.update(steps=self.steps, after_s=self.after_s, wall_us_per_step=self.wall_s * 1e6 / self.steps,
                   steps_by_kind=_steps_by_kind(self.before, self.after), trace_dir=self.dir)
        return out


def replay(llm, trace: Trace, names: list[str] | None, *, max_wall_s: float | None = None,
           trace_steps: int = 0, trace_after_s: float = 10.0) -> tuple[list[Record], dict]:
    """Serve `trace` in real time on `llm.engine`. names[adapter_id] (None: base model).
    trace_steps > 0: a device trace of that many steps from trace_after_s on (ServingTrace),
    summed into the returned pool stats' "serving_trace"."""
    w = trace.workload
    eng, vocab, eos = llm.engine, llm.cfg.vocab_size, llm.cfg.eos_token_ids
    recs = [Record(i, r.arrival_s, names[r.adapter_id] if names else None, r.prompt_len, r.output_len)
            for i, r in enumerate(trace)]
    prompts = [prompt_tokens(i, r.prompt_len, vocab, w.seed) for i, r in enumerate(trace)]
    reqs = trace.requests
    no_token: dict[int, object] = {}   # waiting for a first token
    live: dict[int, object] = {}       # not finished
    samples = []
    before = llm.stats()
    counter = compile_counter()
    counter.count, counter.seconds, counter.active = 0, 0.0, True
    index: dict[str, int] = {}         # request id -> trace index
    nxt, cut, steps = 0, False, 0
    tracer = ServingTrace(llm, trace_steps, trace_after_s) if trace_steps > 0 else None
    t0 = time.perf_counter()
    try:
        while True:
            now = time.perf_counter() - t0
            with _phase("arrivals"):
                while nxt < len(reqs) and reqs[nxt].arrival_s <= now:
                    rec = recs[nxt]
                    if rec.adapter is not None:
                        entry = eng.store.entries.get(rec.adapter)
                        rec.cold = entry is None or entry.key not in eng.pool.adapters
                    try:
                        out = eng.add_request(prompts[nxt], _sampling(w, rec.output_len), rec.adapter, nxt, eos)
                        no_token[nxt] = live[nxt] = out
                        index[out.request_id] = nxt
                    except ValueError as e:
                        rec.finish_reason, rec.finish_s = "rejected", now
                        print(f"request {nxt} rejected: {e}", file=sys.stderr)
                    nxt += 1
            if max_wall_s is not None and now > max_wall_s:
                cut = True
                break
            if eng.has_unfinished():
                if tracer is not None:
                    tracer.maybe_start(now)
                finished = eng.step()
                if tracer is not None:
                    tracer.stepped()
                now = time.perf_counter() - t0
                steps += 1
                # Only running requests get tokens, and step() returns what finished (aborts
                # included): no scan of a long queue after every step. A full sweep now and then
                # catches whatever an engine change might stop reporting.
                with _phase("outputs"):
                    running = getattr(eng, "running", None)
                    fresh = [r.out for r in running] if running is not None and steps % 64 else list(live.values())
                    for out in [*finished, *fresh]:
                        i = index.get(out.request_id)
                        if i is None:
                            continue
                        if i in no_token and out.token_ids:
                            recs[i].first_token_s = now
                            del no_token[i]
                        if out.finished and i in live:
                            del live[i]
                            no_token.pop(i, None)
                            recs[i].finish_s, recs[i].finish_reason = now, out.finish_reason
                            recs[i].tokens = len(out.token_ids)
                    samples.append(_pool_sample(llm))
            elif nxt >= len(reqs):
                for i, out in list(live.items()):  # finished without being reported (see above)
                    recs[i].finish_s, recs[i].finish_reason = now, out.finish_reason
                    recs[i].tokens = len(out.token_ids)
                    if out.token_ids and recs[i].first_token_s is None:
                        recs[i].first_token_s = now
                    del live[i]
                break
            else:
                with _phase("wait_for_arrivals"):  # nothing to run until the next request comes
                    time.sleep(max(0.0, reqs[nxt].arrival_s - (time.perf_counter() - t0)))
    finally:
        counter.active = False
        if tracer is not None:
            tracer.stop()
    wall = time.perf_counter() - t0
    if cut:
        for i, out in live.items():
            eng.abort(out.request_id, "benchmark cut-off")
            recs[i].finish_reason, recs[i].tokens = "cutoff", len(out.token_ids)
        for rec in recs[nxt:]:
            rec.finish_reason = "cutoff"
    else:
        wall = max([r.finish_s for r in recs if r.finish_s is not None] or [wall])
    after = llm.stats()
    s = np.array(samples, dtype=np.float64).reshape(-1, 4)
    total = np.maximum(s[:, 3], 1)
    pool = {
        "steps": after["steps"] - before["steps"],
        "evictions": after["evictions"] - before["evictions"],
        "preempted": after["preempted"] - before["preempted"],
        "adapter_disk_loads": after["adapter_disk_loads"] - before["adapter_disk_loads"],
        "resident_adapters_max": int(s[:, 0].max()) if len(s) else 0,
        "resident_adapters_mean": float(s[:, 0].mean()) if len(s) else 0.0,
        "adapter_pool_share_mean": float((s[:, 1] / total).mean()) if len(s) else 0.0,
        "adapter_pool_share_max": float((s[:, 1] / total).max()) if len(s) else 0.0,
        "kv_pool_share_mean": float((s[:, 2] / total).mean()) if len(s) else 0.0,
        "total_pages": int(after["total_pages"]), "page_size": after["page_size"],
        "compiles": counter.count, "compile_s": counter.seconds, "wall_s": wall, "cut_off": cut,
        # the engine's step phases over the run (Engine.host_seconds): host work vs device wait
        "step_seconds": {k: after["host_seconds"][k] - before["host_seconds"].get(k, 0.0)
                         for k in after.get("host_seconds", {})},
        "steps_by_kind": _steps_by_kind(before, after),
        "host_ms_by_transition": _host_by_transition(before, after),
    }
    if tracer is not None:
        pool["serving_trace"] = tracer.summary()
    return recs, pool


def _host_by_transition(before: dict, after: dict) -> dict:
    """Engine.host_by_transition between two stats() snapshots: steps, and the host's mean input
    building and dispatch milliseconds a step, by step kind and the kind of the step before."""
    out = {}
    for key, (n, inputs, dispatch) in after.get("host_by_transition", {}).items():
        n0, i0, d0 = before.get("host_by_transition", {}).get(key, (0, 0.0, 0.0))
        if n > n0:
            out[key] = {"steps": n - n0, "inputs_ms": round((inputs - i0) * 1e3 / (n - n0), 3),
                        "dispatch_ms": round((dispatch - d0) * 1e3 / (n - n0), 3)}
    return out


def _steps_by_kind(before: dict, after: dict) -> dict:
    """From two Engine.stats() snapshots: prefill and decode steps (timed ones: a first run of a
    shape is not timed), their mean seconds, and the mean sequences and distinct adapters a step,
    plus prefetch hits and misses: what a run's throughput is made of."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in (
        "prefill_step_seconds_count", "prefill_step_seconds_sum", "decode_step_seconds_count",
        "decode_step_seconds_sum", "batch_size_count", "batch_size_sum", "batch_adapters_count",
        "batch_adapters_sum", "decode_batch_size_count", "decode_batch_size_sum", "decode_batch_adapters_count",
        "decode_batch_adapters_sum", "prefetch_hits", "prefetch_misses", "mixed_steps",
        "prefill_load_step_seconds_count", "prefill_load_step_seconds_sum")}

    def mean(total, n):
        return d[total] / d[n] if d[n] else None
    return {"prefill_steps": d["prefill_step_seconds_count"], "decode_steps": d["decode_step_seconds_count"],
            "prefill_step_s_mean": mean("prefill_step_seconds_sum", "prefill_step_seconds_count"),
            # of those, the ones that paged an adapter in first (its copy and scatter on their path)
            "prefill_steps_with_loads": d["prefill_load_step_seconds_count"],
            "prefill_step_with_loads_s_mean": mean("prefill_load_step_seconds_sum", "prefill_load_step_seconds_count"),
            "decode_step_s_mean": mean("decode_step_seconds_sum", "decode_step_seconds_count"),
            "seqs_per_step_mean": mean("batch_size_sum", "batch_size_count"),
            "adapters_per_step_mean": mean("batch_adapters_sum", "batch_adapters_count"),
            "decode_seqs_per_step_mean": mean("decode_batch_size_sum", "decode_batch_size_count"),
            "decode_adapters_per_step_mean": mean("decode_batch_adapters_sum", "decode_batch_adapters_count"),
            "prefetch_hits": d["prefetch_hits"], "prefetch_misses": d["prefetch_misses"],
            "mixed_steps": d["mixed_steps"]}


# -- metrics -------------------------------------------------------------------------------------


def summarize(recs: list[Record], slo_s: float, wall_s: float) -> dict:
    done = [r for r in recs if r.finish_reason in ("length", "stop")]
    aborted = [r for r in recs if r.finish_reason in ("abort", "rejected")]
    ttfts = np.array([r.ttft for r in recs if r.ttft is not None and r.finish_reason not in ("abort", "rejected")])
    lat = np.array([r.latency for r in done])
    hits = sum(1 for r in recs if r.ttft is not None and r.ttft <= slo_s
               and r.finish_reason not in ("abort", "rejected"))
    gen = sum(r.tokens for r in recs)

    def pct(a, q):
        return float(np.percentile(a, q)) if len(a) else None

    return {
        "num_requests": len(recs), "completed": len(done), "aborted": len(aborted),
        "unfinished": len(recs) - len(done) - len(aborted), "wall_s": wall_s,
        "throughput_req_s": len(done) / wall_s if wall_s > 0 else 0.0,
        "generated_tokens": gen, "gen_tok_s": gen / wall_s if wall_s > 0 else 0.0,
        "avg_latency_s": float(lat.mean()) if len(lat) else None,
        "avg_latency_per_token_s": float(np.mean([r.latency / max(r.tokens, 1) for r in done])) if done else None,
        "ttft_avg_s": float(ttfts.mean()) if len(ttfts) else None,
        "ttft_p50_s": pct(ttfts, 50), "ttft_p90_s": pct(ttfts, 90), "ttft_p99_s": pct(ttfts, 99),
        "slo_s": slo_s, "slo_attainment": hits / len(recs) if recs else 0.0,
        **cold_warm_ttft(recs),
    }


def warmup_trace(llm, w: Workload, names: list[str] | None, result: dict) -> None:
    """Serve w.warmup_s seconds of another seed's trace first (a steady pool; compiles that the
    bucket warm-up missed): result["warmup"] says how it went."""
    if w.warmup_s <= 0:
        return
    t = time.perf_counter()
    warm = generate(w.replace(duration_s=w.warmup_s), seed=w.seed + 1)
    _, wp = replay(llm, warm, names, max_wall_s=w.warmup_s + 120.0)
    result["warmup"] = {"requests": len(warm), "wall_s": time.perf_counter() - t,
                        "compiles": wp["compiles"], "compile_s": wp["compile_s"]}


def cold_warm_ttft(recs: list[Record]) -> dict:
    """TTFT of adapter requests split by whether their adapter was resident when they arrived
    (warm) or had to be paged in (cold): prefetch exists to bring the cold ones close to warm."""
    out = {}
    for name, want in (("cold", True), ("warm", False)):
        t = np.array([r.ttft for r in recs if r.cold is want and r.ttft is not None
                      and r.finish_reason not in ("abort", "rejected")])
        out[f"ttft_{name}_n"] = int(len(t))
        out[f"ttft_{name}_p50_s"] = float(np.percentile(t, 50)) if len(t) else None
        out[f"ttft_{name}_p99_s"] = float(np.percentile(t, 99)) if len(t) else None
    return out


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def table(result: dict) -> str:
    """A few lines a person reads: setting, then the numbers."""
    w, m, p = result["workload"], result["metrics"], result.get("pool", {})
    head = (f"{w['name']} mode={result['mode']} model={w['model']} n={w['n']} ranks={w['ranks']} "
            f"alpha={w['alpha']} R={w['rate']} cv={w['cv']} requests={m['num_requests']} "
            f"on {result.get('device', '?')}")
    rows = [("throughput req/s", m["throughput_req_s"]), ("generated tok/s", m["gen_tok_s"]),
            ("avg latency s", m["avg_latency_s"]), ("TTFT p50 s", m["ttft_p50_s"]),
            ("TTFT p99 s", m["ttft_p99_s"]), (f"SLO attainment (<= {m['slo_s']} s)", m["slo_attainment"]),
            ("completed / aborted / unfinished", f"{m['completed']} / {m['aborted']} / {m['unfinished']}"),
            ("wall s", m["wall_s"])]
    for kind in ("cold", "warm"):
        if m.get(f"ttft_{kind}_n"):
            rows.append((f"TTFT {kind} adapter p50 / p99 s (n)",
                         f"{m[f'ttft_{kind}_p50_s']:.3f} / {m[f'ttft_{kind}_p99_s']:.3f} ({m[f'ttft_{kind}_n']})"))
    if "resident_adapters_max" in p:
        rows += [("resident adapters max / mean", f"{p['resident_adapters_max']} / {p['resident_adapters_mean']:.1f}"),
                 ("pool share of adapters mean / max",
                  f"{p['adapter_pool_share_mean']:.3f} / {p['adapter_pool_share_max']:.3f}"),
                 ("steps / evictions / preempted", f"{p['steps']} / {p['evictions']} / {p['preempted']}"),
                 ("compiles during run (s)", f"{p['compiles']} ({p['compile_s']:.1f})"),
                 ("adapter reads from disk", p.get("adapter_disk_loads", "-"))]
        k = p.get("steps_by_kind")
        if k:
            ms = lambda v: f"{v * 1e3:.1f}" if v is not None else "-"  # noqa: E731
            num = lambda v: f"{v:.1f}" if v is not None else "-"  # noqa: E731
            rows += [("prefill / decode steps (ms each)", f"{k['prefill_steps']} ({ms(k['prefill_step_s_mean'])}) / "
                                                          f"{k['decode_steps']} ({ms(k['decode_step_s_mean'])})"),
                     ("sequences / adapters a step", f"{num(k['seqs_per_step_mean'])} / {num(k['adapters_per_step_mean'])}"),
                     ("sequences / adapters a decode step",
                      f"{num(k.get('decode_seqs_per_step_mean'))} / {num(k.get('decode_adapters_per_step_mean'))}"),
                     ("prefill steps that paged an adapter in first (ms each)",
                      f"{k.get('prefill_steps_with_loads', '-')} ({ms(k.get('prefill_step_with_loads_s_mean'))})"),
                     ("prefetch hits / misses", f"{k['prefetch_hits']} / {k['prefetch_misses']}")]
        ph = p.get("step_seconds")
        if ph and p.get("steps"):
            # "dispatch" is the jitted calls' own time, which on a GPU may include waiting for the
            # device (a limit on computations in flight); "wait" holds the prefetch, which runs
            # while the device computes; before (schedule, loads, inputs) and after (completion)
            # are host work while the device idles.
            each = lambda *names: f"{sum(ph.get(n, 0.0) for n in names) * 1e3 / p['steps']:.1f}"  # noqa: E731
            rows.append(("before / dispatch / wait / after ms a step",
                         f"{each('schedule', 'adapter_loads', 'inputs')} / {each('dispatch')} / "
                         f"{each('prefetch', 'device_wait')} / {each('complete')}"))
        st = p.get("serving_trace")
        if st:
            rows.append((f"traced steps ({st['steps']}): device / busy / span / wall ms, kernels a step",
                         f"{st['device_us_per_step'] / 1e3:.1f} / {st['busy_us_per_step'] / 1e3:.1f} / "
                         f"{st['span_us_per_step'] / 1e3:.1f} / {st['wall_us_per_step'] / 1e3:.1f}, "
                         f"{st['kernels_per_step']:.0f}"))
            idle = st.get("idle_by_host_phase_us") or {}
            if idle:
                rows.append(("traced device idle by host phase, ms a step",
                             ", ".join(f"{k} {v / 1e3:.2f}" for k, v in idle.items())))
            streams = st.get("by_stream") or {}
            if len(streams) > 1:  # work off the compute stream (adapter rows' host->device copies)
                rows.append(("traced device tracks, ms a step (busiest name)",
                             ", ".join(f"{tid}: {v['us_per_step'] / 1e3:.2f} ({v['top'][0]['name'][:24]})"
                                       for tid, v in streams.items())))
    width = max(len(k) for k, _ in rows)
    return "\n".join([head, *(f"  {k:<{width}}  {_fmt(v)}" for k, v in rows)])


# -- HTTP ----------------------------------------------------------------------------------------


async def _http_one(client, url: str, rec: Record, prompt: list[int], model: str, t0: float,
                    slo_abort: float | None) -> None:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, rec.arrival_s - (loop.time() - t0)))
    body = {"model": model, "prompt": prompt, "max_tokens": rec.output_len, "temperature": 0.0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    if slo_abort is not None:
        body["ttft_slo"] = slo_abort
    chunks, usage, reason = 0, None, None
    try:
        async with client.stream("POST", url.rstrip("/") + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                # 503: the server aborted it (early abort: the first token could not come in time)
                rec.finish_reason = "abort" if resp.status_code == 503 else "rejected"
                rec.finish_s = loop.time() - t0
                print(f"request {rec.index}: HTTP {resp.status_code} {resp.text[:200]}", file=sys.stderr)
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("usage"):
                    usage = msg["usage"]
                for choice in msg.get("choices") or []:
                    if rec.first_token_s is None:
                        rec.first_token_s = loop.time() - t0
                    chunks += 1
                    reason = choice.get("finish_reason") or reason
    except Exception as e:  # noqa: BLE001 - a dropped connection is an aborted request
        rec.finish_reason, rec.finish_s = "abort", loop.time() - t0
        print(f"request {rec.index}: {type(e).__name__}: {e}", file=sys.stderr)
        return
    rec.finish_s = loop.time() - t0
    rec.tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else chunks
    rec.finish_reason = reason or "length"


async def _http_replay(url: str, trace: Trace, names: list[str] | None, base_model: str | None,
                       vocab: int) -> tuple[list[Record], float]:
    import httpx
    w = trace.workload
    recs = [Record(i, r.arrival_s, names[r.adapter_id] if names else None, r.prompt_len, r.output_len)
            for i, r in enumerate(trace)]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        t0 = asyncio.get_running_loop().time()
        await asyncio.gather(*(
            _http_one(client, url, rec, prompt_tokens(rec.index, rec.prompt_len, vocab, w.seed),
                      rec.adapter or base_model, t0, w.slo_s if w.early_abort else None)
            for rec in recs))
        wall = asyncio.get_running_loop().time() - t0
    wall = max([r.finish_s for r in recs if r.finish_s is not None] or [wall])
    return recs, wall


def http_register(url: str, paths: dict[str, str]) -> None:
    """Register adapters on the server (vLLM-style POST /v1/load_lora_adapter)."""
    import httpx
    with httpx.Client(timeout=60.0) as c:
        for name, path in paths.items():
            r = c.post(url.rstrip("/") + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
            if r.status_code != 200:
                raise RuntimeError(f"registering {name} on {url}: HTTP {r.status_code} {r.text[:200]}")


# -- the fixed batch of the HF PEFT comparison ---------------------------------------------------


def fixed_batch(args, result: dict) -> None:
    """Generated tok/s of the engine on the FixedBatch requests, for each `mixed` count."""
    from slora_jax import SamplingParams
    from slora_jax.model.peft import random_peft_adapter
    counts = [int(x) for x in args.mixed.split(",")]
    fb0 = FixedBatch(args.batch, args.prompt_len, args.gen_len, 0, args.rank, args.seed or 0)
    opts = dict(max_num_seqs=args.batch, max_prefill_seqs=args.batch, max_adapters_per_batch=args.batch,
                max_prefill_tokens=args.batch * args.prompt_len, max_lora_rank=args.rank,
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


def parse_kv(items: list[str] | None) -> dict:
    """["max_num_seqs=128", "page_size=1"] -> {...}, values parsed as JSON where they can be."""
    out = {}
    for item in items or []:
        k, _, v = item.partition("=")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


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
    ap.add_argument("--engine", action="append", metavar="KEY=VALUE", help="override an EngineOptions field")
    ap.add_argument("--adapter-slots", type=int, default=None,
                    help="--mode padded: GPU adapter slots, each sized at max_lora_rank (default 8)")
    ap.add_argument("--adapter-region-pages", type=int, default=None, help="--mode separate: reserved pages")
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
    ap.add_argument("--lora-blocks", default=None, metavar="JSON",
                    help="LoRA kernel settings merged into pallas_kernels.lora.BLOCKS for this run, or for "
                         "one --variant (its engine then recompiles its steps), e.g. "
                         "'{\"shrink\":{\"split_k_max_tokens\":1024}}'")
    ap.add_argument("--variant", action="append", metavar="NAME:ARGS",
                    help="several traces on one loaded model, one after the other (see run_variants); "
                         "ARGS override the main arguments, e.g. 'fcfs:--cv 4 --engine admission_order=fcfs'")
    ap.add_argument("--out-dir", default=None, help="--variant: where NAME.json goes (a NAME.json there is done)")
    ap.add_argument("--rate-from", default=None, metavar="NAME:FACTOR",
                    help="--variant: the offered rate is FACTOR x the req/s that variant NAME completed")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="--variant: start a variant only if its trace span + drain fits in what is left")
    return ap


def adapter_root(args) -> Path:
    """--adapter-dir (kept, reused by later runs), else a temporary folder removed at the end."""
    if args.adapter_dir:
        return Path(args.adapter_dir)
    if getattr(args, "_tmp", None) is None:
        args._tmp = tempfile.mkdtemp(prefix="slora-bench-")
    return Path(args._tmp)


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args._tmp = None
    args._argv_main = _strip_variant_args(argv)
    blocks = args.lora_blocks or any("--lora-blocks" in v for v in args.variant or ())
    if args.lora_blocks:  # before anything is traced (the kernels read BLOCKS then)
        from pallas_kernels.lora import set_blocks
        set_blocks(args.lora_blocks)
    try:
        return _main(args, argv)
    finally:
        if args._tmp:
            shutil.rmtree(args._tmp, ignore_errors=True)
        if blocks:  # BLOCKS as at import again, and nothing traced under the run's settings kept
            import jax
            from pallas_kernels.lora import set_blocks
            set_blocks()
            jax.clear_caches()


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
        return run_variants(args, argv)
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
    opts = None if args.http else engine_options(w, args.mode, args.adapter_slots, args.adapter_region_pages,
                                                 parse_kv(args.engine))  # fails fast on a missing hook
    from slora_jax.model.config import load_model_config
    cfg = load_model_config(w.model)
    paths = {} if args.mode == "base" else adapter_paths(w, adapter_files(w, cfg, adapter_root(args)))
    names = None if args.mode == "base" else list(paths)
    max_wall = args.max_wall_s if args.max_wall_s is not None else trace.span_s + 120.0

    if args.http:
        if args.mode in MODE_HOOKS:
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
        result["engine_options"] = opts
        t = time.perf_counter()
        llm = build_llm(w, opts)
        result["load_s"] = time.perf_counter() - t
        t = time.perf_counter()
        llm.load_adapters(paths)
        result["register_s"] = time.perf_counter() - t
        t = time.perf_counter()
        result["warmup_shapes"] = llm.warmup(max_context=w.input_range[1] + w.output_range[1],
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


# -- several traces on one loaded model ---------------------------------------------------------


def _variant_args(args, spec: str):
    name, _, extra = spec.partition(":")
    if not name or "/" in name:
        raise ValueError(f"--variant wants NAME:ARGS with a plain NAME, got {spec!r}")
    return name, build_parser().parse_args([*args._argv_main, *shlex.split(extra)])


def run_variants(args, argv: list[str]) -> dict:
    """Serve several traces, one after the other, on one loaded model and one set of registered
    adapters: each variant gets a fresh engine (empty pool, fresh scheduler and metrics) on the same
    weights with the same pool size, so the compiled steps carry over and only the first variant
    pays for compiles. A variant changes the trace (--rate, --cv, --n, --alpha, --duration-s, ...),
    the mode (unified, base, separate), scheduler or engine options (--engine K=V, --early-abort).
    Variants whose NAME.json is already in --out-dir are skipped (resumable)."""
    if not args.out_dir:
        raise ValueError("--variant needs --out-dir")
    if args.http or args.fixed_batch:
        raise ValueError("--variant serves traces in-process; not with --http or --fixed-batch")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    variants = [_variant_args(args, spec) for spec in args.variant]
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
    shapes = llm.warmup(max_context=max(w.input_range[1] + w.output_range[1] for w in ws.values()),
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
                               workers=args.warmup_workers)
        except Exception:  # noqa: BLE001 - one failing variant must not take the others with it
            import traceback
            msg = traceback.format_exc()
            (out_dir / f"{name}.failed").write_text(msg)
            print(f"[variants] {name}: FAILED\n{msg}", flush=True)
            continue
    return {}


def _run_variant(llm, name, v, w, trace, k, argv, out_dir, opts0, num_pages, loads, workers=1):
    import gc
    import jax
    from slora_jax.engine.adapter_store import host_cache_bytes
    from slora_jax.engine.engine import Engine, EngineOptions
    from pallas_kernels import lora as lora_kernels
    opts = engine_options(w, v.mode, None, v.adapter_region_pages, parse_kv(v.engine))
    opts = {**opts, "pool_pages": num_pages}
    # --lora-blocks of this variant (the main one's unless it gives its own): a change drops every
    # traced step, so this variant's engine compiles its buckets under the new settings
    # BLOCKS is what every step traced so far was traced under (only set_blocks changes it here)
    before = json.dumps(lora_kernels.BLOCKS, sort_keys=True)
    new_blocks = json.dumps(lora_kernels.set_blocks(v.lora_blocks), sort_keys=True) != before
    if new_blocks:
        jax.clear_caches()
    if k > 0 or new_blocks or opts != {**opts0, "pool_pages": num_pages}:
        old, llm.engine = llm.engine, None
        if old is not None:  # None: the variant before failed while building it
            for a in jax.tree.leaves(old.kv):
                a.delete()
        del old
        gc.collect()
        llm.options = EngineOptions(**opts)
        llm.engine = Engine(llm.cfg, llm.params, llm.dtype, llm.store, llm.options, llm.max_model_len)
        # The adapter store outlives the engine: its host cache takes this variant's size now
        # (a smaller cache drops files at once, so the variant's cold adapters come from disk).
        llm.store.resize_host_cache(llm.options.host_cache_size, host_cache_bytes(llm.options.host_cache_gb))
        llm.store.set_stage_workers(llm.options.stage_workers)
    variant_warmup = None
    if new_blocks or opts != {**opts0, "pool_pages": num_pages}:
        # Other engine options (a LoRA backend, slots, ...) may mean other step buckets: compile
        # them before serving; the ones the first warm-up compiled are in-memory cache hits.
        t = time.perf_counter()
        shapes = llm.warmup(max_context=w.input_range[1] + w.output_range[1], progress=False, workers=workers)
        variant_warmup = {"shapes": shapes, "seconds": time.perf_counter() - t}
        print(f"[variants] {name}: warm-up of its engine options, {shapes} shapes in "
              f"{variant_warmup['seconds']:.0f} s", flush=True)
    names = None if v.mode == "base" else [adapter_name(i) for i in range(w.n)]
    result = header([*argv, f"# variant {name}"])
    result.update(kind="trace", variant=name, mode=v.mode, workload=w.to_dict(), trace=trace.stats(),
                  engine_options=opts, **loads, shared_process=k > 0, rate_from=v.rate_from,
                  variant_warmup=variant_warmup)
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


if __name__ == "__main__":
    main()
