"""The paged engine: continuous batching over fixed-shape jitted steps and the unified pool.

Each step: the scheduler (scheduler.py, host only) decides the batch and its pages; the engine
writes newly paged-in adapters, builds the bucketed `StepInputs` (inputs.py), dispatches the
jitted step (step.py), and, while the device runs it, copies in the adapters the scheduler
predicts the next batch needs (S-LoRA's prefetch). Then it waits for the one results array and
hands it back for bookkeeping. With async scheduling the wait for step n comes after step n+1 is
dispatched: the host's work overlaps the device's.

One request never takes the others down. A step that raises while its inputs are built or it is
dispatched is run again in halves until the rows that fail it are alone; those requests end with
finish_reason "error" and the others go on as if nothing happened (`_isolate`). An adapter whose
rows cannot be read fails only the requests that took it, and a row whose sampled logprob is not
finite (an adapter whose activations overflow) ends its own request with an error.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from slora_jax.config import EngineConfig
from slora_jax.lora.selection import tpu_unavailable
from slora_jax.lora import LoraInputs, check_backend, plan as plan_lora, slot_bucket, step_backend, whole_rows_layout
from slora_jax.engine import prompt_logprobs as prompt_lp
from slora_jax.engine import step as paged
from slora_jax.engine import warmup as warmup_mod
from slora_jax.engine.adapter_store import AdapterEntry, AdapterStore
from slora_jax.engine.attention import QUERY_BLOCK
from slora_jax.engine.inputs import AdapterSlots, StepInputBuilder, group_by_adapter, pow2 as _pow2
from slora_jax.engine.metrics import EngineMetrics, PhaseTimer, StepCostModel
from slora_jax.engine.pool import RegionPool, UnifiedPool
from slora_jax.engine.scheduler import MAX_PREFILL_SEQS, Plan, Request, Scheduler
from slora_jax.model import tp as tp_mod
from slora_jax.model.config import TARGET_MODULES, ModelConfig
from slora_jax.model.layout import AdapterLayout, page_rows
from slora_jax.request import RequestOutput, new_request_id, stop_ids
from slora_jax.sampling import SamplingParams

__all__ = ["Engine", "Request", "LoraChoices"]

log = logging.getLogger(__name__)

PHASES = ("schedule", "adapter_loads", "inputs", "dispatch", "prefetch", "device_wait", "complete")
CPU_POOL_BYTES = 2**30  # a device that reports no memory limit (the CPU) gets this much pool


def enable_compilation_cache(path: str) -> None:
    """XLA's persistent compilation cache in `path`, keeping every executable: JAX's default keeps
    only those that took a second or more to compile, so a restart would compile each step bucket's
    small K/V commit again. JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS in the environment still
    sets that threshold."""
    jax.config.update("jax_compilation_cache_dir", path)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


@dataclasses.dataclass(frozen=True)
class LoraChoices:
    """What a step runs LoRA and attention on. The LoRA option stays as configured ("auto":
    slora_jax.lora.select picks per step); attention's "auto" is the Pallas paged decode kernel on
    a GPU (bench/RESULTS.md, "attention backend"), XLA elsewhere (Pallas runs there only in
    interpret mode, for tests)."""
    lora_backend: str        # "auto", "xla", "pallas" or "ranksplit"
    attention_backend: str   # "xla" or "pallas"
    max_lora_rank: int
    platform: str            # JAX's backend ("gpu", "cpu", "tpu"): what "auto" selects for
    max_prefill_seqs: int = MAX_PREFILL_SEQS

    @classmethod
    def resolve(cls, config: EngineConfig) -> "LoraChoices":
        platform = jax.default_backend()
        check_backend(config.lora_backend, platform)
        attention = config.attention_backend
        if attention == "auto":
            attention = {"gpu": "pallas", "tpu": "pallas_tpu"}.get(platform, "xla")
        elif attention == "pallas_tpu" and (reason := tpu_unavailable(platform)) is not None:
            raise ValueError(f"attention_backend='pallas_tpu' {reason}; use 'auto', 'pallas' or 'xla'")
        return cls(lora_backend=config.lora_backend, attention_backend=attention,
                   max_lora_rank=config.max_lora_rank, platform=platform)

    @property
    def kernels(self) -> bool:
        """Whether any step may run a GPU kernel (the pool's int32 offsets matter then)."""
        return self.lora_backend != "xla" or self.attention_backend != "xla"


def activation_bytes(cfg: ModelConfig, config: EngineConfig, dtype, tp: int = 1) -> int:
    """A bound on one device's working memory of a step beyond weights and pool: the largest
    step's activations, its new K/V of every layer (alive until commit_kv), the packed prefill
    attention's scores of one query block, and the sampled rows' float32 logits."""
    item = jnp.dtype(dtype).itemsize
    rows = max(_pow2(config.max_num_batched_tokens, 16), _pow2(config.max_num_seqs))
    per_token = (6 * cfg.hidden_size + 3 * cfg.intermediate_size // tp) * item
    new_kv = cfg.num_hidden_layers * 2 * cfg.kv_size // tp * item
    scores = cfg.num_attention_heads // tp * min(rows, QUERY_BLOCK) * rows * 4
    logits = 2 * max(MAX_PREFILL_SEQS, _pow2(config.max_num_seqs)) * cfg.vocab_size * 4
    return rows * (per_token + new_kv) + scores + logits


def pool_bytes(stats: dict, utilization: float, working_bytes: int) -> int:
    """Bytes the pool may take on a device with these memory_stats: `utilization` of its total
    memory (bytes_limit), less what is in use already (the weights) and the step's working
    memory; CPU_POOL_BYTES on a device that reports no limit."""
    limit = stats.get("bytes_limit")
    if not limit:
        return CPU_POOL_BYTES
    return max(0, int(limit * utilization) - stats.get("bytes_in_use", 0) - working_bytes)


def _memory_stats() -> dict:
    return jax.devices()[0].memory_stats() or {}


def _mark_error(out: RequestOutput, code: str) -> RequestOutput:
    """A request the engine could not serve: finish_reason "error", `code` saying why (an OpenAI
    error code; abort_reason holds the message)."""
    out.finish_reason, out.error_code = "error", code
    return out


@dataclasses.dataclass
class _InFlight:
    """A dispatched step: its plan, its results (a device array), when it was dispatched, whether
    its shape was new (its time includes a compile), and how long its prefetch took."""
    plan: Plan
    results: jax.Array
    dispatched: float
    first_run: bool
    prefetch_s: float = 0.0
    top: jax.Array | None = None     # top logprobs [S, 2, k] of a step that returns them
    prompt: jax.Array | None = None  # prompt logprobs [R, 2 + 2k] of a step that returns them


class Engine:
    """One model, its unified pool and its scheduler: `add_request`, then `step` until
    `has_unfinished()` is False."""

    def __init__(self, cfg: ModelConfig, params, dtype: str, store: AdapterStore, config: EngineConfig,
                 max_model_len: int, *, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.params, self.dtype, self.store, self.config = cfg, params, jnp.dtype(dtype), store, config
        self.opts = LoraChoices.resolve(config)  # "auto" resolved: what steps run LoRA and attention on
        whole = whole_rows_layout(config.lora_backend, self.opts.platform)
        if store.whole_rows != whole and any(f % cfg.kv_size for m in TARGET_MODULES for f in cfg.module_shape(m)):
            raise ValueError(f"lora_backend={config.lora_backend!r} reads adapters laid out "
                             f"{'with each rank row on whole pool rows' if whole else 'flat'}; the store lays them "
                             f"out otherwise (AdapterStore(..., whole_rows={whole}))")
        # Tensor parallel: the weights placed over the mesh, the pool split along W (slora_jax.model.tp).
        tp = config.tensor_parallel_size
        self.tp = tp_mod.TP.make(tp, cfg) if tp > 1 else None
        if self.tp is not None:
            if store.tp != tp:
                raise ValueError(f"the adapter store lays rows out for {store.tp} devices, the engine runs on "
                                 f"{tp} (AdapterStore(..., tp=tensor_parallel_size))")
            self.params = tp_mod.shard_params(params, self.tp)
        else:
            # Committed to the device, as the pool is: a step that reads no pool page (a fresh
            # prompt) then still returns committed K/V, so each step shape compiles once, warm-up
            # included (no copy: the arrays are on the device already).
            self.params = jax.device_put(params, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        self.max_model_len = max_model_len
        # Not on the CPU: XLA:CPU's cached executables can crash the process that loads them (known
        # JAX bugs), and CPU compiles are short. GPU compiles are what the cache saves.
        if config.compilation_cache_dir and jax.config.jax_compilation_cache_dir is None and \
                jax.default_backend() != "cpu":
            enable_compilation_cache(config.compilation_cache_dir)
        self.ps = config.page_size
        self.num_pages = self._pool_pages()
        self.pool = self._make_pool(self.num_pages)
        # padded_slots: the LoRA step's distinct-adapter bucket is always every slot.
        baseline = config.baseline
        self._lora_slots = baseline.size if baseline is not None and baseline.kind == "padded_slots" else None
        self.kv = paged.empty_pool(cfg, self.num_pages, self.ps, self.dtype, self.tp)
        self.clock = clock
        self.metrics = EngineMetrics()
        self.sched = Scheduler(self.pool, config, self.ps, store.entries.get, clock=clock, cost=StepCostModel(),
                               metrics=self.metrics, ready=store.ready)
        # Steps dispatched ahead of the one being completed: 1 with async scheduling (step n+1 is
        # dispatched before the host waits for step n), 0 without.
        overlap = config.async_scheduling if config.async_scheduling is not None else jax.default_backend() != "cpu"
        self.depth = 1 if overlap else 0
        self.slots = AdapterSlots(cfg, store, self.pool, self.ps, config.max_lora_rank, backends=self)
        self.builder = StepInputBuilder(cfg, self.pool, self.ps, self.opts.attention_backend,
                                        self.decode_page_floor(), self.slots, feed=self.depth > 0,
                                        context_pages=self.context_pages())
        self.sched.max_context_pages = None if self.builder.prefill_kernel else self.builder.context_pages
        if self.depth:  # a step's results have these rows, so the next step can read them
            rows = _pow2(config.max_num_seqs + MAX_PREFILL_SEQS)
            self.builder.prev_results = jax.device_put(np.zeros((rows, 2), np.float32), self._replicated)
        self.step_count = 0
        self.timer = PhaseTimer(PHASES)  # host seconds of the step loop by phase (see stats())
        # Host seconds of input building and dispatch by step transition ("decode>prefill": a
        # prefill step dispatched after a decode step): [steps, inputs, dispatch].
        self.host_by_transition: dict[str, list] = {}
        self._last_kind = "none"
        self._shapes: set = set()   # step input shapes run before (a first run includes its compile)
        # Clear while a step compiles on its first use: a background warm-up waits before its next
        # shape, so a waiting request's compile (or load from the persistent cache) does not share
        # the interpreter with warm-up's lowering (warmup.lower_step).
        self.compile_gate = threading.Event()
        self.compile_gate.set()
        self._in_flight: collections.deque[_InFlight] = collections.deque()
        self._last_done = 0.0

    def decode_page_floor(self) -> int:
        """The decode page-table bucket's floor: the Pallas kernel reads only each row's live pages,
        so its table is always as wide as max_model_len needs (one shape per batch bucket); XLA
        attention reads the whole table, so its bucket follows the longest context."""
        return _pow2(self.kv_pages_for(self.max_model_len)) if self.opts.attention_backend == "pallas" else 1

    def context_pages(self) -> int:
        """The context-page bucket of prefill steps with context. The xla attention reads every
        pooled key of the step for every new token, so the scheduler keeps a step's context within
        this bucket (unless one sequence alone has more): the pages of a step's token budget (or
        of max_model_len, if less), so the pooled keys a step reads are at most about its new
        ones. The Pallas prefill kernel reads each row's own pages only, so its one bucket holds
        every row at max_model_len."""
        if self.opts.attention_backend == "pallas":
            return _pow2(self.opts.max_prefill_seqs * self.kv_pages_for(self.max_model_len))
        return _pow2(self.kv_pages_for(min(self.config.max_num_batched_tokens, self.max_model_len)))

    def _make_pool(self, num_pages: int) -> UnifiedPool:
        baseline = self.config.baseline
        if baseline is None:
            return UnifiedPool(num_pages)
        if baseline.kind == "separate":
            region, slot = baseline.size, None
        else:
            if self.store.pad_rank != self.config.max_lora_rank:
                raise ValueError("the padded_slots baseline needs an AdapterStore that lays adapters out at "
                                 "max_lora_rank (AdapterStore(..., pad_to_max_rank=True))")
            slot = AdapterLayout.of(None, self.cfg, self.ps, self.config.max_lora_rank, self.store.whole_rows).pages
            region = baseline.size * slot
        if region > num_pages - 2:
            what = f"{baseline.size} slots of {slot} pages" if slot else f"{region} adapter pages"
            raise ValueError(f"baseline {baseline.kind!r}: {what} leave no KV page in a pool of "
                             f"{num_pages - 1} usable pages")
        return RegionPool(num_pages, region, slot_pages=slot)

    def _pool_pages(self) -> int:
        """config.pool_pages, or the pages of gpu_memory_utilization's budget (`pool_bytes`), capped
        at paged.max_pool_pages (int32 element offsets in the kernels); an explicit size past the
        cap is refused where the GPU kernels would run on it."""
        c, tp = self.config, self.config.tensor_parallel_size
        cap = paged.max_pool_pages(self.cfg, self.ps, tp)
        if c.pool_pages is None:
            working = activation_bytes(self.cfg, c, self.dtype, tp)
            per_page = paged.page_bytes(self.cfg, self.ps, self.dtype) // tp  # a device holds 1/tp of a page
            return min(pool_bytes(_memory_stats(), c.gpu_memory_utilization, working) // per_page, cap)
        kernels = self.opts.kernels
        if c.pool_pages > cap and jax.default_backend() == "gpu" and kernels:
            raise ValueError(f"pool_pages={c.pool_pages}: a layer of the pool would hold past 2**31 elements, "
                             f"which the GPU kernels address in int32; use at most {cap} pages, or the xla "
                             "backends")
        return c.pool_pages

    @property
    def _replicated(self):
        """Where a step's small replicated arrays live: the pool's device, or every device of the mesh."""
        return self.tp.sharding(tp_mod.REPLICATED) if self.tp is not None else self.kv[0].sharding

    @property
    def running(self) -> list[Request]:
        return self.sched.running

    @property
    def waiting(self):
        return self.sched.waiting

    @property
    def num_preempted(self) -> int:
        return self.sched.num_preempted

    # -- requests ----------------------------------------------------------------------------

    def kv_pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.ps)

    def add_request(self, prompt: list[int], params: SamplingParams, adapter: str | None, seed: int,
                    eos_ids: tuple[int, ...]) -> RequestOutput:
        if params.logit_bias and max(params.logit_bias) >= self.cfg.vocab_size:
            raise ValueError(f"logit_bias token ids must be below the vocabulary size {self.cfg.vocab_size}")
        entry = self.store.get(adapter) if adapter is not None else None
        kv, ad = self.kv_pages_for(len(prompt) + params.max_tokens), (entry.layout.pages if entry else 0)
        if kv > self.pool.kv_capacity(ad):
            room = self.pool.total_pages if self.config.baseline is None else \
                f"{self.pool.kv_capacity(0)} KV pages and {self.pool.adapter_pages} adapter pages"
            raise ValueError(f"request needs {kv + ad} pages (prompt {len(prompt)} + max_tokens "
                             f"{params.max_tokens}{' + adapter' if entry else ''}) but the pool has "
                             f"{room}; it can never run")
        if entry is not None and self.config.prefetch_adapters and not self.pool.is_resident(entry.key):
            self.store.stage(entry)  # a cold adapter's disk read starts now, off the step loop
        rid = new_request_id()
        scored = params.prompt_logprobs is not None
        out = RequestOutput(rid, list(prompt), logprobs=[] if params.wants_logprobs else None, adapter=adapter,
                            top_logprobs=[] if params.num_top_logprobs else None,
                            prompt_logprobs=[None] if scored else None, prompt_ranks=[None] if scored else None)
        self.sched.add(Request(rid, list(prompt), len(prompt), params, seed, entry, out,
                               stop_ids(params, eos_ids), self.clock()))
        return out

    def has_unfinished(self) -> bool:
        return self.sched.has_unfinished()

    def busy_adapters(self) -> set[str]:
        return {r.adapter_name for r in [*self.running, *self.waiting] if r.adapter_name is not None}

    def adapter_status(self) -> list[dict]:
        """Each registered adapter, by name: where its weights are (in the device pool, in host
        memory) and how many requests for it run and wait. What a router needs to send a request
        where its adapter is warm."""
        running = collections.Counter(r.adapter_name for r in self.running)
        waiting = collections.Counter(r.adapter_name for r in self.waiting)
        return [{"name": name, "version": e.version, "path": e.path,
                 "ranks": {m: slot.rank for m, slot in e.layout.modules.items()}, "pages": e.layout.pages,
                 "resident": self.pool.is_resident(e.key), "host_cached": self.store.in_host_cache(e),
                 "running": running[name], "waiting": waiting[name]}
                for name, e in sorted(self.store.entries.items())]

    def abort(self, rid: str, why: str = "aborted") -> None:
        self.sched.abort(rid, why)

    # -- pages (also used by bench/engine_bench.py to seat requests by hand) -----------------

    def _admit(self, req: Request) -> bool:
        """Take the request's adapter (`req.adapter` as given), loading it if not resident."""
        ok = self.sched.take_adapter(req)
        if failed := self._write_adapters(self.sched.pop_loads()):
            raise RuntimeError(failed[0].abort_reason)
        return ok

    def _grow(self, req: Request, n_tokens: int) -> bool:
        return self.sched.grow(req, n_tokens)

    def _release(self, req: Request) -> None:
        self.sched.release(req)

    def _write_adapters(self, loads: list[tuple[AdapterEntry, list[int]]]) -> list[RequestOutput]:
        """Scatter adapters' packed rows into their pages. The host->device copy is dispatched
        asynchronously; the scatter consumes the pool the in-flight step returns (donated), so it
        runs after that step and never under it. An adapter whose rows cannot be read (its files
        gone or corrupt since registration, a disk error) gets its pages freed and the requests
        that took it end with an error; the others are untouched. Returns those requests."""
        failed = []
        for entry, pages in loads:
            t = time.perf_counter()
            try:
                data = self.store.rows(entry)
                self.kv = paged.load_rows(self.kv, page_rows(pages, entry.layout.rows, self.ps), data)
            except Exception as e:  # noqa: BLE001 - any failure to read leaves the pages unfilled
                log.warning("adapter %r could not be paged in: %s", entry.name, e)
                failed.append((entry, e))
                continue
            self.metrics.adapter_load_seconds.observe(time.perf_counter() - t)
            self.metrics.adapter_loads.inc()
        outs = []
        for entry, e in failed:
            for out in self.sched.load_failed(entry, f"adapter {entry.name!r} could not be read: {e}"):
                outs.append(_mark_error(out, "adapter_unavailable"))
        return outs

    def _fail(self, req: Request, why: str, code: str) -> RequestOutput:
        """End one request with finish_reason "error" (its pages freed at once)."""
        self.sched.abort(req.rid, why)
        return _mark_error(req.out, code)

    # -- the step loop -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and dispatch the next step, then complete the dispatched steps beyond the
        overlap depth (with nothing new to dispatch, all of them). Returns the requests that
        finished in the steps completed here (aborted and failed ones included). Async
        scheduling (depth 1): a request that stops on a stop token may sit in one more step,
        whose token is dropped."""
        with self.timer.phase("schedule"):
            plan = self.sched.schedule()
        finished = list(plan.finished)
        with self.timer.phase("adapter_loads"):
            finished += self._write_adapters(plan.loads)
        plan.chunks = [c for c in plan.chunks if not c[0].out.finished]  # not those whose adapter failed
        if plan.chunks:
            try:
                self._in_flight.append(self._launch(plan))
            except Exception as e:  # noqa: BLE001 - find the rows that fail it, run the rest
                finished += self._isolate(plan, e)
        depth = self.depth if plan.chunks else 0
        while len(self._in_flight) > depth:
            finished += self._complete(self._in_flight.popleft())
        if not plan.chunks:
            self.sched.refresh_gauges()
        return finished

    def _isolate(self, plan: Plan, error: Exception) -> list[RequestOutput]:
        """`plan` raised before its step ran (building its inputs or dispatching it): run it again
        in halves, each completed before the next, down to single rows; a row that fails alone
        ends its request with an error. The steps in flight are completed first, so every
        sub-step reads its tokens from the host."""
        log.warning("a step of %d rows failed (%s: %s); finding the rows that fail it",
                    len(plan.chunks), type(error).__name__, error)
        finished = self._drain()
        todo = [plan.chunks]
        while todo:
            chunks = [c for c in todo.pop() if not c[0].out.finished]  # finished by the drain, or below
            if not chunks:
                continue
            try:
                step = self._launch(Plan(plan.kind, chunks, [], []))
            except Exception as e:  # noqa: BLE001 - split further, or fail the one row
                if len(chunks) == 1:
                    req = chunks[0][0]
                    log.warning("request %s fails its step alone; it ends with an error", req.rid)
                    finished.append(self._fail(req, f"the engine step failed for this request: "
                                                    f"{type(e).__name__}: {e}", "step_failed"))
                else:
                    half = len(chunks) // 2
                    todo += [chunks[half:], chunks[:half]]  # the first half runs first
                continue
            finished += self._complete(step)
        return finished

    def _launch(self, plan: Plan) -> _InFlight:
        """Build the plan's inputs and dispatch its step; while the device runs it, prefetch the
        adapters the next batch is predicted to need, and apply what the step surely does. A
        prefetch that cannot read an adapter fails nobody (the admission that needs it does)."""
        with self.timer.phase("inputs"):
            inp, _ = self.builder.build(plan)
            shape = warmup_mod.shape_key(inp)
            first_run = shape not in self._shapes
            self._shapes.add(shape)
        dispatched = time.perf_counter()
        with self.timer.phase("dispatch"):
            if first_run:
                self.compile_gate.clear()
            try:
                results, top, prompt = self._dispatch(inp)
            finally:
                self.compile_gate.set()
        with self.timer.phase("prefetch"):
            self._write_adapters(self.sched.prefetch(plan))
            self.sched.advance(plan)
        if self.depth:
            self.builder.feed_from(results, plan.pending)
        self.step_count += 1
        self._count_transition(plan.kind)
        return _InFlight(plan, results, dispatched, first_run, self.timer.last["prefetch"], top, prompt)

    def _complete(self, step: _InFlight) -> list[RequestOutput]:
        """Wait for a dispatched step's results and hand them to the scheduler. The device ran
        the step from its dispatch or the end of the step before, the later. A first run includes
        its compile, and a slow prefetch (disk) can outlast the step: neither is timed."""
        with self.timer.phase("device_wait"):
            results = np.asarray(step.results)
            top = np.asarray(step.top) if step.top is not None else None
            prompt = np.asarray(step.prompt) if step.prompt is not None else None
        failed = self._non_finite(step.plan, results)
        done = time.perf_counter()
        seconds = done - max(step.dispatched, self._last_done)
        self._last_done = done
        timed = not step.first_run and step.prefetch_s < 0.5 * seconds
        with self.timer.phase("complete"):
            if prompt is not None:  # before the requests that end with their prefill finish
                failed += [self._fail(req, "the model's output is not finite in the prompt; the adapter's weights "
                                      "may overflow", "non_finite_output")
                           for req in prompt_lp.deliver(step.plan.chunks, prompt)]
            return failed + self.sched.complete_overlapped(step.plan, results, seconds if timed else None, top)

    def _non_finite(self, plan: Plan, results: np.ndarray) -> list[RequestOutput]:
        """End each request whose token sampled in this step has a non-finite logprob (its
        logits hold NaN or infinity: an adapter whose activations overflow); nothing of that
        row reaches its output."""
        bad = np.flatnonzero(~np.isfinite(results[:len(plan.chunks), 1]))
        if not bad.size:
            return []
        sampled = {i for i, _, _ in plan.pending}
        out = []
        for i in bad.tolist():
            req = plan.chunks[i][0]
            if i in sampled and not req.out.finished:
                out.append(self._fail(req, f"the model's output is not finite after {req.generated - 1} "
                                           "tokens; the adapter's weights may overflow", "non_finite_output"))
        return out

    def _drain(self) -> list[RequestOutput]:
        finished = []
        while self._in_flight:
            finished += self._complete(self._in_flight.popleft())
        return finished

    def _count_transition(self, kind: str) -> None:
        row = self.host_by_transition.setdefault(f"{self._last_kind}>{kind}", [0, 0.0, 0.0])
        row[0] += 1
        row[1] += self.timer.last["inputs"]
        row[2] += self.timer.last["dispatch"]
        self._last_kind = kind

    def _dispatch(self, inp: paged.StepInputs) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
        """Run the step on the device (asynchronously): its results, its top logprobs and its
        prompt logprobs (each None unless the step returns them)."""
        self.kv, results = paged.step(self.params, self.kv, inp, cfg=self.cfg, tp=self.tp)
        return results if isinstance(results, tuple) else (results, None, None)

    # -- warm-up -----------------------------------------------------------------------------

    def warmup_shapes(self, max_context: int | None = None, lora: bool = True) -> list[paged.StepInputs]:
        """See warmup.warmup_shapes."""
        return warmup_mod.warmup_shapes(self, max_context, lora)

    def warmup(self, max_context: int | None = None, progress: bool = True, lora: bool = True,
               workers: int | None = None) -> int:
        """Compile every shape of `warmup_shapes` with a progress bar (warmup.compile_shapes)."""
        return warmup_mod.compile_shapes(self, self.warmup_shapes(max_context, lora), progress, workers)

    def warmup_in_background(self, max_context: int | None = None, lora: bool = True, workers: int | None = None,
                             on_done=None):
        """The same shapes compiled on a thread while the engine serves (warmup.compile_in_background)."""
        return warmup_mod.compile_in_background(self, self.warmup_shapes(max_context, lora), workers, on_done)

    def _slot_buckets(self, most: int, rows: int, decode: bool) -> list[int]:
        """Every slot bucket of a step of `rows` tokens with at most `most` distinct adapters."""
        return sorted({self._slot_bucket(n, rows, decode) for n in range(1, most + 1)})

    def _slot_bucket(self, n: int, rows: int, decode: bool) -> int:
        """Slots for n distinct adapters in a step of `rows` tokens (slora_jax.lora.slot_bucket)."""
        if self._lora_slots:
            return self._lora_slots
        return slot_bucket(n, rows, decode=decode, option=self.opts.lora_backend, max_rank=self.opts.max_lora_rank,
                           platform=self.opts.platform, prefill_slots=self.opts.max_prefill_seqs)

    def _step_backend(self, slots: int, decode: bool) -> str:
        """The LoRA backend of a step with `slots` adapter slots (slora_jax.lora.step_backend)."""
        return step_backend(self.opts.lora_backend, decode, slots, 0, self.opts.max_lora_rank, self.opts.platform,
                            sharded=self.tp is not None)

    def _make_lora_inputs(self, t: int, token_slot, seg_starts, rows: dict, ranks: dict,
                          backend: str, decode: bool) -> LoraInputs:
        """LoraInputs of a step (live or null): the backend's host tables (slora_jax.lora.plan)."""
        return plan_lora(backend, t=t, token_slot=token_slot, seg_starts=seg_starts, rows=rows, ranks=ranks,
                         decode=decode, cfg=self.cfg, max_rank=self.opts.max_lora_rank, dtype=self.dtype)

    def prompt_logits(self, prompts: list[list[int]], adapters: list[str | None]) -> list[np.ndarray]:
        """Logits at every prompt position, all prompts in one prefill step (engine must be idle)."""
        if self.has_unfinished():
            raise RuntimeError("prompt_logits needs an idle engine")
        self._drain()
        params = SamplingParams(max_tokens=1, temperature=0.0)
        rids = [self.add_request(p, params, a, 0, ()).request_id for p, a in zip(prompts, adapters)]
        for req in self.waiting:
            req.deadline = None  # no early abort here
        self.sched.drop_pins()
        n = len(prompts)
        self.sched.config = self.config.replace(max_num_batched_tokens=sum(map(len, prompts)), max_num_seqs=n,
                                                max_loras=n, enable_prefix_caching=False)  # every position
        self.sched.max_prefill_seqs = n
        try:
            plan = self.sched.schedule()
            if failed := self._write_adapters(plan.loads):
                raise RuntimeError(failed[0].abort_reason)
            if plan.kind != "prefill" or len(plan.chunks) != n:
                raise ValueError("prompts do not fit in the pool together")
            group_by_adapter(plan.chunks)
            inp, _ = self.builder.prefill(plan.chunks)
            self.kv, logits = paged.step_all_logits(self.params, self.kv, inp, cfg=self.cfg, tp=self.tp)
            logits = np.asarray(logits)
            at, where = 0, {}  # the scheduler may order the chunks differently from the prompts
            for req, start, end in plan.chunks:
                where[req.rid] = logits[at:at + end - start]
                at += end - start
        finally:
            self.sched.config, self.sched.max_prefill_seqs = self.config, MAX_PREFILL_SEQS
            for req in list(self.running) + list(self.waiting):
                self.sched.abort(req.rid, "prompt_logits done", count=False)
        return [where[rid] for rid in rids]

    # -- introspection -----------------------------------------------------------------------

    def stats(self) -> dict:
        self.sched.refresh_gauges()
        return {
            **self.metrics.snapshot(),
            "total_pages": self.pool.total_pages, "free_pages": self.pool.free_pages,
            "kv_pages": self.pool.kv_pages, "adapter_pages": self.pool.adapter_pages,
            "resident_adapters": len(self.pool.adapters), "running": len(self.running),
            "waiting": len(self.waiting), "page_size": self.ps, "evictions": self.pool.evictions,
            "prefix_cache": {"queries": self.metrics.prefix_cache_queries.value,
                             "hits": self.metrics.prefix_cache_hits.value, "cached_pages": self.pool.cached_pages},
            "preempted": self.num_preempted, "steps": self.step_count,
            "adapter_disk_loads": self.store.disk_loads, "host_seconds": dict(self.timer.seconds),
            "host_by_transition": {k: list(v) for k, v in self.host_by_transition.items()},
        }
