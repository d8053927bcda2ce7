"""The in-process side of bench/run.py: the engine options of each mode (the engine itself, or a
benchmark baseline), the generated adapters, and `replay`, which serves a trace in real time and
samples the pool after every step."""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.trace import Trace, Workload, generate

MODES = ("unified", "base", "padded", "separate")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # S-LoRA's dummy adapters
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

# The benchmark baselines that give adapters memory apart from the unified pool:
# mode -> (AdapterMemoryBaseline kind, its default size; None: the run must give one).
BASELINES = {"padded": ("padded_slots", 8), "separate": ("separate", None)}


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
    # seconds between the steps that gave it tokens, one entry per token after the first
    token_gaps: list[float] = dataclasses.field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def latency(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s


# -- the engine side -------------------------------------------------------------------------------


def engine_options(w: Workload, mode: str, baseline_size: int | None = None,
                   overrides: dict | None = None) -> dict:
    """LLM(**options) for `mode`: the workload's EngineConfig fields, then `overrides`; a baseline
    mode adds `baseline=AdapterMemoryBaseline(kind, size)` (padded: size adapter slots, default 8;
    separate: size pages reserved for adapters, required)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    opts = {**w.engine_options, **(overrides or {})}
    if mode in BASELINES:
        from slora_jax.config import AdapterMemoryBaseline
        kind, default = BASELINES[mode]
        size = baseline_size or default
        if size is None:
            raise ValueError(f"--mode {mode} needs --baseline-size (pages reserved for adapters)")
        opts["baseline"] = AdapterMemoryBaseline(kind, size)
    return opts


def options_json(opts: dict) -> dict:
    """`opts` as the JSON records it: a baseline as {"kind", "size"}."""
    return {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in opts.items()}


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
    engine's phases (slora_jax.engine.metrics.PhaseTimer) as `slora.bench_<name>`."""
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
        # the top 60 kernels by time: enough to name the small glue kernels a unified step runs
        # beyond the base step (the trace files stay on the device)
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
    prompts = trace.prompts(vocab)
    reqs = trace.requests
    no_token: dict[int, object] = {}   # waiting for a first token
    live: dict[int, object] = {}       # not finished
    samples = []
    before = llm.stats()
    counter = compile_counter()
    counter.count, counter.seconds, counter.active = 0, 0.0, True
    index: dict[str, int] = {}         # request id -> trace index
    last_token: dict[int, tuple[int, float]] = {}  # trace index -> (tokens seen, when)
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
                        seen, when = last_token.get(i, (0, now))
                        if len(out.token_ids) > seen:
                            if seen:
                                new = len(out.token_ids) - seen
                                recs[i].token_gaps += [(now - when) / new] * new
                            last_token[i] = (len(out.token_ids), now)
                        if out.finished and i in live:
                            del live[i]
                            no_token.pop(i, None)
                            recs[i].finish_s, recs[i].finish_reason = now, out.finish_reason
                            recs[i].tokens = len(out.token_ids)
                            last_token.pop(i, None)
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
        "prefix_cache": _prefix_cache(before, after),
        "host_ms_by_transition": _host_by_transition(before, after),
    }
    if tracer is not None:
        pool["serving_trace"] = tracer.summary()
    return recs, pool


def _prefix_cache(before: dict, after: dict) -> dict:
    """Prompt tokens looked up in the prefix cache and served from it over the run, and the
    cached pages left idle at its end."""
    q, h = (after["prefix_cache"][k] - before["prefix_cache"][k] for k in ("queries", "hits"))
    return {"queries": q, "hits": h, "hit_rate": h / q if q else 0.0,
            "cached_pages_end": after["prefix_cache"]["cached_pages"]}


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
    prompt tokens and rows over context a prefill step, plus prefetch hits and misses: what a run's
    throughput is made of."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in (
        "prefill_step_seconds_count", "prefill_step_seconds_sum", "decode_step_seconds_count",
        "decode_step_seconds_sum", "batch_size_count", "batch_size_sum", "batch_adapters_count",
        "batch_adapters_sum", "decode_batch_size_count", "decode_batch_size_sum", "decode_batch_adapters_count",
        "decode_batch_adapters_sum", "prefetch_hits", "prefetch_misses",
        "prefill_load_step_seconds_count", "prefill_load_step_seconds_sum", "prefill_tokens_count",
        "prefill_tokens_sum", "prefill_context_rows_count", "prefill_context_rows_sum")}

    def mean(total, n):
        return d[total] / d[n] if d[n] else None
    return {"prefill_steps": d["prefill_step_seconds_count"], "decode_steps": d["decode_step_seconds_count"],
            "prefill_step_s_mean": mean("prefill_step_seconds_sum", "prefill_step_seconds_count"),
            # of those, the ones that paged an adapter in first (its copy and scatter on their path)
            "prefill_steps_with_loads": d["prefill_load_step_seconds_count"],
            "prefill_step_with_loads_s_mean": mean("prefill_load_step_seconds_sum", "prefill_load_step_seconds_count"),
            "decode_step_s_mean": mean("decode_step_seconds_sum", "decode_step_seconds_count"),
            # prompt tokens computed and rows over pooled context (cache hits, later chunks) a prefill step
            "prefill_tokens_per_step_mean": mean("prefill_tokens_sum", "prefill_tokens_count"),
            "prefill_context_rows_per_step_mean": mean("prefill_context_rows_sum", "prefill_context_rows_count"),
            "seqs_per_step_mean": mean("batch_size_sum", "batch_size_count"),
            "adapters_per_step_mean": mean("batch_adapters_sum", "batch_adapters_count"),
            "decode_seqs_per_step_mean": mean("decode_batch_size_sum", "decode_batch_size_count"),
            "decode_adapters_per_step_mean": mean("decode_batch_adapters_sum", "decode_batch_adapters_count"),
            "prefetch_hits": d["prefetch_hits"], "prefetch_misses": d["prefetch_misses"]}


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


def parse_kv(items: list[str] | None) -> dict:
    """["max_num_seqs=128", "page_size=1"] -> {...}, values parsed as JSON where they can be."""
    import json
    out = {}
    for item in items or []:
        k, _, v = item.partition("=")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def adapter_root(args) -> Path:
    """--adapter-dir (kept, reused by later runs), else a temporary folder removed at the end."""
    if args.adapter_dir:
        return Path(args.adapter_dir)
    if getattr(args, "_tmp", None) is None:
        args._tmp = tempfile.mkdtemp(prefix="slora-bench-")
    return Path(args._tmp)
