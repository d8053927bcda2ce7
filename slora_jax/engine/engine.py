"""The paged engine: continuous batching over fixed-shape jitted steps and the unified pool.

Each step: the scheduler (scheduler.py, host only) decides the batch and its pages; the engine
writes newly paged-in adapters, builds the bucketed `StepInputs` (inputs.py), dispatches the
jitted step (step.py), and, while the device runs it, copies in the adapters the scheduler
predicts the next batch needs (S-LoRA's prefetch). Then it waits for the one results array and
hands it back for bookkeeping. With async scheduling the wait for step n comes after step n+1 is
dispatched: the host's work overlaps the device's.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.lora import (BLOCKS, block_schedule, decode_block_t, few_slots_bucket, fused_applies, fused_schedule,
                                 mbgmv_shrink, shrink_schedule)
from slora_jax.config import EngineConfig
from slora_jax.engine import step as paged
from slora_jax.engine import warmup as warmup_mod
from slora_jax.engine.adapter_store import AdapterEntry, AdapterStore
from slora_jax.engine.attention import QUERY_BLOCK
from slora_jax.engine.inputs import AdapterSlots, StepInputBuilder, group_by_adapter, pow2 as _pow2
from slora_jax.engine.metrics import EngineMetrics, PhaseTimer, StepCostModel
from slora_jax.engine.pool import RegionPool, UnifiedPool
from slora_jax.engine.scheduler import MAX_PREFILL_SEQS, Plan, Request, Scheduler
from slora_jax.model import tp as tp_mod
from slora_jax.model.config import ModelConfig
from slora_jax.model.layout import AdapterLayout, page_rows
from slora_jax.request import RequestOutput, new_request_id, stop_ids
from slora_jax.sampling import SamplingParams

__all__ = ["Engine", "Request", "LoraChoices"]

PHASES = ("schedule", "adapter_loads", "inputs", "dispatch", "prefetch", "device_wait", "complete")
CPU_POOL_BYTES = 2**30  # a device that reports no memory limit (the CPU) gets this much pool


def default_backends() -> tuple[str, str, str]:
    """(lora_backend, attention_backend, prefill_lora_backend) that "auto" resolves to: the
    fastest measured, or where not yet measured, the one whose cost has the right shape.

    GPU (H200, bench/results/README.md, one run at d63d250): the Pallas paged decode attention
    kernel took 26.2 ms against XLA's 46.2 ms at batch 256 (11.3 vs 17.0 ms at 64), so attention is
    "pallas". For decode LoRA the winner depends on how many distinct adapters a step holds, so it
    is "hybrid" (one-hot up to lora_hybrid_slots, the kernel above: see hybrid_slots, which
    session 22 lowered to 8 at max rank 64 from the 32 set here). With up to 32 adapters the
    engine's decode step paid less with the one-hot path (+1.0-1.7 ms against +3.2-6.1 ms at batch
    1-64; +3.8 vs +4.5 ms at 256 with 32 rank-32 adapters, session 4). The kernel micro-benchmark
    (same run, mixed ranks 8-64, one module of each llama-7b shape) puts the crossover there: at 8
    adapters one-hot is faster in all six cases, at 64 the kernel is, by 1.2-2x (the one-hot path
    gathers every slot at the max rank and multiplies every token by every slot; the kernel's time
    hardly grows with adapters). S2's decode steps hold 100-250 distinct adapters.
    Prefill LoRA is "pallas": the one-hot path multiplies every token by every slot's A and B
    (tokens x slots x rank work: 4096 tokens x 32 adapters at rank 64 is ~18 TFLOP a step on
    llama-7b), the segment kernel only by its own adapter's, and its empty slots cost nothing, so
    prefill steps can keep one slot bucket (fewer shapes to compile).
    CPU: "xla" for all (Pallas runs there only in interpret mode, for tests).
    """
    if jax.default_backend() == "gpu":
        return "hybrid", "pallas", "pallas"
    return "xla", "xla", "xla"


def hybrid_slots(max_lora_rank: int) -> int:
    """The most distinct adapters a "hybrid" decode step keeps on the one-hot path: while slots x
    max_lora_rank <= 512 (a power of two, 8 to 32). The one-hot path gathers and multiplies every
    slot at max_lora_rank, so its cost follows slots x max rank; the kernel's hardly moves with
    the adapters. H200, llama-7b decode step at context 430, max rank 64, device ms a step
    (bench/results/20261201-0e4a079/call2-*, call3-*): B 172, 8 adapters one-hot 20.94 / kernel
    21.36, 16: 21.80 / 21.42, 32: 24.27 / 21.60; B 32, 8: 8.75 / 8.74, 16: 9.41 / 8.80, 32:
    10.80 / 9.05. At max rank 16 one-hot still won at 32 slots (session 4, when the kernels were
    slower); nothing above 32 was measured, so 32 is the cap."""
    slots = 8
    while slots < 32 and 2 * slots * max_lora_rank <= 512:
        slots *= 2
    return slots


@dataclasses.dataclass(frozen=True)
class LoraChoices:
    """The per-step LoRA and attention settings the step builders read, resolved from an
    EngineConfig ("auto" included; see default_backends)."""
    lora_backend: str            # decode steps: "xla", "pallas" or "hybrid" (one-hot up to hybrid_slots)
    prefill_lora_backend: str    # "xla" or "pallas"
    attention_backend: str       # "xla" or "pallas"
    max_lora_rank: int
    lora_hybrid_slots: int
    prefill_lora_block_t: int = 16  # tokens per LoRA kernel block in prefill steps (bench/RESULTS.md)
    lora_group_qkv: bool = True     # q, k and v shrink in one kernel launch (they read the same x)
    max_prefill_seqs: int = MAX_PREFILL_SEQS

    @classmethod
    def resolve(cls, config: EngineConfig) -> "LoraChoices":
        auto_lora, auto_attention, auto_prefill = default_backends()
        if config.lora_backend == "ranksplit" and jax.default_backend() != "gpu":
            raise ValueError("lora_backend='ranksplit' runs the Triton rank-split kernel, which needs a GPU; "
                             "use 'auto', 'pallas' or 'xla'")
        # "ranksplit": the Pallas pair's decode steps take the rank-split kernel where it applies
        chosen = {"auto": None, "xla": "xla", "pallas": "pallas", "ranksplit": "pallas"}[config.lora_backend]
        attention = auto_attention if config.attention_backend == "auto" else config.attention_backend
        return cls(lora_backend=chosen or auto_lora, prefill_lora_backend=chosen or auto_prefill,
                   attention_backend=attention, max_lora_rank=config.max_lora_rank,
                   lora_hybrid_slots=hybrid_slots(config.max_lora_rank))


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


@dataclasses.dataclass
class _InFlight:
    """A dispatched step: its plan, its results (a device array), when it was dispatched, whether
    its shape was new (its time includes a compile), and how long its prefetch took."""
    plan: Plan
    results: jax.Array
    dispatched: float
    first_run: bool
    prefetch_s: float = 0.0


class Engine:
    """One model, its unified pool and its scheduler: `add_request`, then `step` until
    `has_unfinished()` is False. `mixed_steps`: see Scheduler."""

    def __init__(self, cfg: ModelConfig, params, dtype: str, store: AdapterStore, config: EngineConfig,
                 max_model_len: int, *, clock: Callable[[], float] = time.monotonic, mixed_steps: bool = False):
        self.cfg, self.params, self.dtype, self.store, self.config = cfg, params, jnp.dtype(dtype), store, config
        self.opts = LoraChoices.resolve(config)  # "auto" resolved: what steps run LoRA and attention on
        # Tensor parallel: the weights placed over the mesh, the pool split along W (slora_jax.model.tp).
        tp = config.tensor_parallel_size
        self.tp = tp_mod.TP.make(tp, cfg) if tp > 1 else None
        if self.tp is not None:
            if store.tp != tp:
                raise ValueError(f"the adapter store lays rows out for {store.tp} devices, the engine runs on "
                                 f"{tp} (AdapterStore(..., tp=tensor_parallel_size))")
            self.params = tp_mod.shard_params(params, self.tp)
        self.max_model_len = max_model_len
        # Not on the CPU: XLA:CPU's cached executables can crash the process that loads them (known
        # JAX bugs), and CPU compiles are short. GPU compiles are what the cache saves.
        if config.compilation_cache_dir and jax.config.jax_compilation_cache_dir is None and \
                jax.default_backend() != "cpu":
            jax.config.update("jax_compilation_cache_dir", config.compilation_cache_dir)
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
                               metrics=self.metrics, ready=store.ready, mixed_steps=mixed_steps)
        # Steps dispatched ahead of the one being completed: 1 with async scheduling (step n+1 is
        # dispatched before the host waits for step n), 0 without.
        overlap = config.async_scheduling if config.async_scheduling is not None else jax.default_backend() != "cpu"
        self.depth = 1 if overlap else 0
        self.slots = AdapterSlots(cfg, store, self.pool, self.ps, config.max_lora_rank, backends=self)
        self.builder = StepInputBuilder(cfg, self.pool, self.ps, self.opts.attention_backend,
                                        self.decode_page_floor(), self.slots, feed=self.depth > 0)
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
        self._in_flight: collections.deque[_InFlight] = collections.deque()
        self._last_done = 0.0

    def decode_page_floor(self) -> int:
        """The decode page-table bucket's floor: the Pallas kernel reads only each row's live pages,
        so its table is always as wide as max_model_len needs (one shape per batch bucket); XLA
        attention reads the whole table, so its bucket follows the longest context."""
        return _pow2(self.kv_pages_for(self.max_model_len)) if self.opts.attention_backend == "pallas" else 1

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
            slot = AdapterLayout.of(None, self.cfg, self.ps, self.config.max_lora_rank).pages
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
        kernels = {self.opts.lora_backend, self.opts.prefill_lora_backend, self.opts.attention_backend} != {"xla"}
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
        out = RequestOutput(rid, list(prompt), logprobs=[] if params.logprobs else None, adapter=adapter)
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
        self._write_adapters(self.sched.pop_loads())
        return ok

    def _grow(self, req: Request, n_tokens: int) -> bool:
        return self.sched.grow(req, n_tokens)

    def _release(self, req: Request) -> None:
        self.sched.release(req)

    def _write_adapters(self, loads: list[tuple[AdapterEntry, list[int]]], *, speculative: bool = False) -> None:
        """Scatter adapters' packed rows into their pages. The host->device copy is dispatched
        asynchronously; the scatter consumes the pool the in-flight step returns (donated), so it
        runs after that step and never under it. An adapter whose rows cannot be read (its
        directory is gone and the host cache dropped it) gets its pages freed and its requests
        aborted; the first such error is raised afterwards, unless the loads were a prefetch."""
        failed = []
        for entry, pages in loads:
            t = time.perf_counter()
            try:
                data = self.store.rows(entry)
            except Exception as e:  # noqa: BLE001 - any failure to read leaves the pages unfilled
                failed.append((entry, e))
                continue
            self.kv = paged.load_rows(self.kv, page_rows(pages, entry.layout.rows, self.ps), data)
            self.metrics.adapter_load_seconds.observe(time.perf_counter() - t)
            self.metrics.adapter_loads.inc()
        for entry, e in failed:
            self.sched.load_failed(entry, f"adapter {entry.name!r} could not be paged in: {e}")
        if failed and not speculative:
            raise failed[0][1]

    # -- the step loop -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and dispatch the next step, then complete the dispatched steps beyond the
        overlap depth (with nothing new to dispatch, all of them). Returns the requests that
        finished in the steps completed here (aborted ones included). Async scheduling (depth 1):
        a request that stops on a stop token may sit in one more step, whose token is dropped."""
        with self.timer.phase("schedule"):
            plan = self.sched.schedule()
        with self.timer.phase("adapter_loads"):
            self._write_adapters(plan.loads)
        if plan.chunks:
            self._in_flight.append(self._launch(plan))
        finished = list(plan.finished)
        depth = self.depth if plan.chunks else 0
        while len(self._in_flight) > depth:
            finished += self._complete(self._in_flight.popleft())
        if not plan.chunks:
            self.sched.refresh_gauges()
        return finished

    def _launch(self, plan: Plan) -> _InFlight:
        """Build the plan's inputs and dispatch its step; while the device runs it, prefetch the
        adapters the next batch is predicted to need, and apply what the step surely does."""
        with self.timer.phase("inputs"):
            inp, _ = self.builder.build(plan)
            shape = warmup_mod.shape_key(inp)
            first_run = shape not in self._shapes
            self._shapes.add(shape)
        dispatched = time.perf_counter()
        with self.timer.phase("dispatch"):
            results = self._dispatch(inp)
        with self.timer.phase("prefetch"):
            self._write_adapters(self.sched.prefetch(plan), speculative=True)
            self.sched.advance(plan)
        if self.depth:
            self.builder.feed_from(results, plan.pending)
        self.step_count += 1
        self._count_transition(plan.kind)
        return _InFlight(plan, results, dispatched, first_run, self.timer.last["prefetch"])

    def _complete(self, step: _InFlight) -> list[RequestOutput]:
        """Wait for a dispatched step's results and hand them to the scheduler. The device ran
        the step from its dispatch or the end of the step before, the later. A first run includes
        its compile, and a slow prefetch (disk) can outlast the step: neither is timed."""
        with self.timer.phase("device_wait"):
            results = np.asarray(step.results)
        done = time.perf_counter()
        seconds = done - max(step.dispatched, self._last_done)
        self._last_done = done
        timed = not step.first_run and step.prefetch_s < 0.5 * seconds
        with self.timer.phase("complete"):
            return self.sched.complete_overlapped(step.plan, results, seconds if timed else None)

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

    def _dispatch(self, inp: paged.StepInputs) -> jax.Array:
        """Run the step on the device (asynchronously): its results."""
        self.kv, results = paged.step(self.params, self.kv, inp, cfg=self.cfg, tp=self.tp)
        return results

    # -- warm-up -----------------------------------------------------------------------------

    def warmup_shapes(self, max_context: int | None = None, lora: bool = True) -> list[paged.StepInputs]:
        """See warmup.warmup_shapes."""
        return warmup_mod.warmup_shapes(self, max_context, lora)

    def warmup(self, max_context: int | None = None, progress: bool = True, lora: bool = True,
               workers: int | None = None) -> int:
        """Compile every shape of `warmup_shapes` with a progress bar (warmup.compile_shapes)."""
        return warmup_mod.compile_shapes(self, self.warmup_shapes(max_context, lora), progress, workers)

    def _slot_buckets(self, most: int, rows: int, decode: bool) -> list[int]:
        """Every slot bucket of a step of `rows` tokens with at most `most` distinct adapters."""
        return sorted({self._slot_bucket(n, rows, decode) for n in range(1, most + 1)})

    def _slot_bucket(self, n: int, rows: int, decode: bool) -> int:
        """Slots for n distinct adapters in a step of `rows` tokens. The one-hot path costs
        work per slot, so its bucket follows n (powers of two, at least 8, at most the batch); the
        kernels skip empty slots, so prefill under them keeps one bucket, and a hybrid decode step
        past lora_hybrid_slots takes the batch's own bucket (the kernel's; see _step_backend)."""
        if self._lora_slots:
            return self._lora_slots
        backend = self.opts.lora_backend if decode else self.opts.prefill_lora_backend
        if decode and backend == "hybrid" and n > self.opts.lora_hybrid_slots:
            return few_slots_bucket(n, _pow2(rows)) or _pow2(rows)
        if decode or backend == "xla":
            return min(_pow2(rows), max(8, _pow2(n)))
        return _pow2(max(n, self.opts.max_prefill_seqs))

    def _step_backend(self, slots: int, decode: bool) -> str:
        """The LoRA backend of a step with `slots` adapter slots. Under "hybrid" the slot bucket
        says which: one-hot buckets stay at or below lora_hybrid_slots (a power of two), kernel
        buckets are above it."""
        if not decode:
            return self.opts.prefill_lora_backend
        if self.opts.lora_backend == "hybrid":
            return "pallas" if slots > self.opts.lora_hybrid_slots else "xla"
        return self.opts.lora_backend

    def _make_lora_inputs(self, t: int, token_slot, seg_starts, rows: dict, ranks: dict,
                          backend: str, decode: bool) -> paged.LoraInputs:
        """LoraInputs of a step (live or null): q/k/v stacked for the grouped shrink, schedules."""
        group = self.opts.lora_group_qkv
        block_t = decode_block_t(backend) if decode else self.opts.prefill_lora_block_t
        shrink_bt = {}
        if decode and mbgmv_shrink(len(seg_starts) - 1, t):  # each shrink launch's (paged.pool_lora)
            for name in self._shrink_launch_names(ranks, group):
                bt = decode_block_t(backend, "shrink", self.cfg.kv_size,
                                    self.cfg.module_shape(paged.QKV[0] if name == "qkv" else name)[0])
                if bt != block_t:
                    shrink_bt[name] = bt
        split = {}  # the rank-split kernel's tables; the modules it serves need no pair schedules
        if decode and backend in ("pallas", "triton") and self.tp is None and paged.ranksplit.decode_takes(len(seg_starts) - 1):
            split = paged.ranksplit_plans(rows, ranks, seg_starts, t, self.cfg, self.opts.max_lora_rank, self.dtype)
        served = {m for m in ranks if "ranksplit:" + m in split}
        if not served >= {m for m in ranks if m in paged.QKV}:  # the pair's grouped q/k/v shrink keeps them all
            served -= set(paged.QKV)
        pair = {m: r for m, r in ranks.items() if m not in served}
        schedules = self._schedules(pair, seg_starts, t, backend, group, block_t, self.opts.max_lora_rank, shrink_bt)
        if decode and backend == "pallas" and self.tp is None and BLOCKS["onetrip"]["decode"]:
            schedules.update(paged.onetrip_plans({m: rows[m] for m in pair}, pair, seg_starts, t, self.cfg, group,
                                                 self.opts.max_lora_rank))
        if split:
            schedules = {**(schedules or {}), **split}
        rows, stacked = paged.stack_qkv(rows, ranks, backend, group)
        return paged.LoraInputs(token_slot=token_slot, seg_starts=seg_starts, rows=rows, ranks=ranks, **stacked,
                                max_rank=self.opts.max_lora_rank, backend=backend, group_qkv=group,
                                schedules=schedules, block_t=block_t, shrink_block_t=tuple(sorted(shrink_bt.items())))

    @staticmethod
    def _shrink_launch_names(modules, group_qkv: bool) -> list[str]:
        """The Pallas shrink launches of a step: one per module, q/k/v as one ("qkv") with
        group_qkv where the step carries two or more of them (paged.pool_lora)."""
        if group_qkv and sum(m in modules for m in paged.QKV) > 1:
            return [m for m in modules if m not in paged.QKV] + ["qkv"]
        return list(modules)

    @staticmethod
    def _shrink_launches(ranks: dict, group_qkv: bool) -> dict:
        """`_shrink_launch_names` with each launch's ranks ("qkv": each slot's largest of q/k/v)."""
        return {name: np.maximum.reduce([ranks[m] for m in paged.QKV if m in ranks]) if name == "qkv"
                else ranks[name] for name in Engine._shrink_launch_names(ranks, group_qkv)}

    @staticmethod
    def _schedules(ranks: dict, seg_starts: np.ndarray, t: int, backend: str, group_qkv: bool,
                   block_t: int, max_rank: int, shrink_block_t: dict | None = None) -> dict | None:
        """The kernels' schedules, built here on the host (one per distinct set of slots or ranks)
        instead of by small XLA ops at every kernel call; None for the one-hot path, which has
        none. schedules[module]: the module's block schedule (expand; the Triton kernels' shrink
        too). Under "pallas", schedules["shrink:" + module] for each shrink launch
        (shrink_schedule: with compact_tiles it depends on the ranks), and with group_qkv
        schedules["shrink:qkv"] for the grouped q/k/v shrink (each slot's largest rank of the three);
        where the fused kernel applies (pallas_kernels.lora.fused_applies), the same under "fused:"
        for its launches. shrink_block_t: {launch: block_t} of the Pallas shrink launches whose
        block_t differs (1: MBGMV)."""
        if backend not in ("pallas", "triton"):
            return None
        out, seen = {}, {}

        def once(kind, rk, build):
            key = (kind, rk.tobytes())
            if key not in seen:
                seen[key] = build()
            return seen[key]
        for module, rk in ranks.items():
            mask = (rk > 0).astype(np.int32)
            out[module] = once("plain", mask, lambda: block_schedule(mask, seg_starts, t, block_t))
        if backend == "pallas":
            # the launches that read A: one per module, q/k/v as one with group_qkv (paged.pool_lora)
            kind, build = ("fused", fused_schedule) if fused_applies(t) else ("shrink", shrink_schedule)
            for name, rk in Engine._shrink_launches(ranks, group_qkv).items():
                bt = block_t if kind == "fused" else (shrink_block_t or {}).get(name, block_t)
                rk = np.minimum(rk, max_rank).astype(np.int32)
                out[f"{kind}:{name}"] = once((kind, bt), rk,
                                             lambda: build(rk, seg_starts, t, bt, max_rank=max_rank))
        return out

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
                                                max_loras=n)
        self.sched.max_prefill_seqs = n
        try:
            plan = self.sched.schedule()
            self._write_adapters(plan.loads)
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
            "preempted": self.num_preempted, "steps": self.step_count,
            "adapter_disk_loads": self.store.disk_loads, "host_seconds": dict(self.timer.seconds),
            "host_by_transition": {k: list(v) for k, v in self.host_by_transition.items()},
        }
