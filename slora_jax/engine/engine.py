"""The paged engine: continuous batching over fixed-shape jitted steps and the unified pool.

Each step: the scheduler (scheduler.py, host only) decides the batch and its pages; the engine
writes newly paged-in adapters, builds the bucketed `StepInputs`, dispatches the jitted step, and,
while the device runs it, copies in the adapters the scheduler predicts the next batch needs
(S-LoRA's prefetch). Then it waits for the one results array and hands it back for bookkeeping.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from slora_jax.lora import check_backend, hybrid_slots, plan as plan_lora, slot_bucket, step_backend  # noqa: F401
from slora_jax.engine import step as paged
from slora_jax.model import tp as tp_mod
from slora_jax.engine.adapter_store import STAGE_WORKERS, AdapterEntry, AdapterStore
from slora_jax.model.config import TARGET_MODULES, ModelConfig
from slora_jax.model.layout import AdapterLayout, page_rows
from slora_jax.engine.metrics import EngineMetrics
from slora_jax.engine.pool import NULL_PAGE, RegionPool, UnifiedPool
from slora_jax.request import RequestOutput, new_request_id, stop_ids
from slora_jax.sampling import SamplingParams
from slora_jax.engine.scheduler import PENDING, Plan, Request, Scheduler, SchedulerOptions, StepCostModel

__all__ = ["Engine", "EngineOptions", "Request"]

ADAPTER_MEMORY = ("unified", "padded_slots", "separate")
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def default_backends() -> tuple[str, str, str]:
    """(lora_backend, attention_backend, prefill_lora_backend) that "auto" resolves to. LoRA stays
    "auto": slora_jax.lora.select picks per step. Attention: the Pallas paged decode kernel on a GPU
    (bench/RESULTS.md, "attention backend"), XLA elsewhere (Pallas runs there only in interpret
    mode, for tests)."""
    return "auto", "pallas" if jax.default_backend() == "gpu" else "xla", "auto"


@dataclasses.dataclass
class EngineOptions(SchedulerOptions):
    """Scheduling options (max_num_seqs, admission_order, ttft_slo, prefetch_adapters, ...) are
    `SchedulerOptions`'; these are the engine's own."""
    page_size: int = 16
    pool_pages: int | None = None          # None: from memory_fraction of free device memory
    memory_fraction: float = 0.85          # of the device memory left after the weights
    max_lora_rank: int = 64
    prefill_query_block: int = 512         # xla prefill attention: queries per block (memory bound)
    lora_backend: str = "auto"             # "auto": see default_backends()
    attention_backend: str = "auto"
    prefill_lora_backend: str = "auto"     # "auto": lora_backend if that was given, else see above
    # lora_backend="hybrid": a decode step with at most this many distinct adapters takes the
    # one-hot path (xla), one with more the Pallas kernel. One-hot work grows with slots x batch
    # and gathers every slot at max_lora_rank; the kernel reads each adapter at its real rank once.
    # None: hybrid_slots(max_lora_rank), one-hot while slots x max_lora_rank <= 512, 8 to 32 slots.
    lora_hybrid_slots: int | None = None
    # Tokens per block of the LoRA kernels in prefill steps (a power of two >= 16; decode steps use
    # 16). A block is the dot's M side and re-reads its adapter's A and B tiles. Larger blocks
    # lost on the H200 (S2 capacity, bench/results/20261130-bf56a12/serving-pbt): a unified
    # prefill step took 23.1 ms at 16, 25.4 at 64 and 32.7 at 128 (base model: 17.0).
    prefill_lora_block_t: int = 16
    # Pallas LoRA: q, k and v shrink in one kernel launch (they read the same x); False: one each.
    # H200, engine decode step, ctx 512 (bench/results/20261129-ecdfac3): B 64 x 64 adapters
    # 16.73 -> 16.15 ms, B 256 x 256 38.25 -> 37.31 ms; the profile at B 128 x 110 adapters: LoRA
    # kernels 256 -> 192 launches a step, 3.78 -> 3.25 ms.
    lora_group_qkv: bool = True
    # Put a step's host-built input arrays on the device in one copy (paged.device_inputs) instead
    # of one per array inside the step's call. Off: timed on the H200 in S2 serving at capacity
    # (bench/results/20261130-417b14d/serving-host, one process) it changed nothing: 20.3 -> 20.3
    # req/s with adapters, 26.3 -> 26.4 without; the jitted call's host time 9.4 -> 9.3 ms a step.
    pack_inputs: bool = False
    # Whole-model steps through persistent device buffers (paged.StepBuffers): the host-built
    # inputs packed into one buffer and copied into a persistent one in place, the new K/V
    # written into one persistent donated buffer, the sampled rows into a persistent two-slot
    # buffer. XLA runs the step as CUDA graphs and updates every graph node whose buffers moved
    # since the last launch. H200, S2's decode step (B 172 x 156 adapters) and a 2 x 256 prefill in
    # a decode/prefill pattern (bench/dispatch_probe.py, bench/results/20261201-a5ce83a): the
    # unified step's host time a call 5.8-7.7 -> 2.5-4.4 ms, the base model's 3.0-3.1 -> 3.1-4.6
    # (two more small executables a step). In S2 serving the unified dispatch fell less (decode
    # after decode 6.5 -> 6.2 ms, prefill after prefill 10.5 -> 9.2) and throughput did not move
    # (20.39 req/s against 20.71 unbuffered, two calls; 20261201-84a4cae): the loop is device
    # bound there. Off until a run shows a gain. Costs the K/V buffer (max step tokens x layers x
    # 2 x kv width: 2 GiB for llama-7b at 4096 prefill tokens), taken before the pool is sized.
    stable_buffers: bool = False
    # Devices the model is split over (slora_jax.model.tp; DESIGN.md "Tensor parallelism"): Megatron
    # weights, the pool split along its row width, S-LoRA's adapter layout. The whole-model jit
    # only, under shard_map; LoRA backends xla and pallas.
    tensor_parallel: int = 1
    # One jit per decoder layer kind instead of one over the unrolled model (paged.layer_step): a
    # new step shape compiles one layer instead of num_hidden_layers, for a dispatch per layer.
    compile_per_layer: bool = False
    # With compile_per_layer: decoder layers one jit runs. The client queues at most 32
    # computations ahead of the device, and at 1 a step is 34 of them (embed, 32 layers, head):
    # the host can then not get a step ahead. k layers a call: 32/k + 2 dispatches a step, one
    # k-layer executable to compile per step shape. Not yet measured on a GPU; 1 keeps the
    # measured behaviour.
    layers_per_call: int = 1
    # Dispatch each step before waiting for the one before it: scheduling and input building
    # then run while the device computes. Tokens the host has not seen yet are read from the
    # previous step's results on the device; a request that stops on a stop token may sit in one
    # more step, whose token for it is dropped. None: on for a GPU, off on a CPU (where host work
    # and XLA's CPU compute share the cores). H200, S2 n = 1000 at 40 req/s offered, one process
    # (bench/results/20261129-3db7756): served 14.5 -> 17.9 req/s with adapters, 21.0 -> 25.0 for
    # the base model; the host's wait for a step's tokens fell from 9.9 to 1.7 ms a step.
    overlap_steps: bool | None = None
    # Overlapped steps: start copying a step's results to the host as soon as it is dispatched
    # (jax.Array.copy_to_host_async), so the transfer runs when the step ends instead of when the
    # host asks for the tokens one step later. Off until timed on a GPU (gpu_variants.sh host).
    async_results_copy: bool = False
    host_cache_size: int = 256
    # GiB of packed adapter rows host memory may hold (pinned where the platform has it), on top of
    # the file count: None, 40% of the machine's memory.
    host_cache_gb: float | None = None
    # Threads that read cold adapters from disk when their requests arrive (prefetch_adapters > 0).
    stage_workers: int = STAGE_WORKERS
    compilation_cache_dir: str | None = os.path.expanduser("~/.cache/slora_jax/xla")
    # Where adapter weights live (the benchmark's memory baselines; see bench/RESULTS.md):
    # "unified": one pool for KV and adapters at their real ranks (S-LoRA);
    # "padded_slots": `adapter_slots` slots of the pool sized at max_lora_rank on every target
    # module, the rest KV; the LoRA step always runs over all slots at max_lora_rank (vLLM
    # --max-loras);
    # "separate": `adapter_region_pages` pages for adapters (real ranks), the rest KV.
    adapter_memory: str = "unified"
    adapter_slots: int | None = None
    adapter_region_pages: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.prefill_query_block < 16 or self.prefill_query_block & (self.prefill_query_block - 1):
            raise ValueError(f"prefill_query_block must be a power of two >= 16, got {self.prefill_query_block}")
        auto_lora, auto_attention, auto_prefill = default_backends()
        if self.prefill_lora_backend == "auto":
            self.prefill_lora_backend = auto_prefill if self.lora_backend == "auto" else self.lora_backend
        if self.lora_backend == "auto":
            self.lora_backend = auto_lora
        if self.attention_backend == "auto":
            self.attention_backend = auto_attention
        if self.layers_per_call < 1:
            raise ValueError(f"layers_per_call must be >= 1, got {self.layers_per_call}")
        if self.overlap_steps is None:
            self.overlap_steps = jax.default_backend() != "cpu"
        if self.stable_buffers and (self.compile_per_layer or self.pack_inputs):
            raise ValueError("stable_buffers is for the whole-model jit and packs the inputs itself: set "
                             "stable_buffers=False with compile_per_layer or pack_inputs")
        tp = self.tensor_parallel
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel must be a positive integer, got {tp!r}")
        if tp > 1:
            unsupported = [name for name in ("compile_per_layer", "pack_inputs", "stable_buffers")
                           if getattr(self, name)]
            unsupported += [f"{name}='triton'" for name in ("lora_backend", "prefill_lora_backend")
                            if getattr(self, name) == "triton"]
            if unsupported:
                raise ValueError(f"tensor_parallel={tp} runs the whole-model jit with the xla or pallas LoRA "
                                 f"backends; not with {', '.join(unsupported)}")
        if self.attention_backend == "triton":
            raise ValueError("attention_backend='triton' is not available (no Triton attention "
                             "kernel); use 'pallas' or 'xla'")
        if self.attention_backend not in ("xla", "pallas"):
            raise ValueError(f"attention_backend must be 'xla' or 'pallas', got "
                             f"{self.attention_backend!r}")
        if self.prefill_lora_backend == "hybrid":  # the kernels skip empty slots: prefill needs no switch
            self.prefill_lora_backend = "pallas"
        if self.lora_hybrid_slots is None:
            self.lora_hybrid_slots = hybrid_slots(self.max_lora_rank)
        h = self.lora_hybrid_slots
        if isinstance(h, bool) or not isinstance(h, int) or h < 8 or h & (h - 1):
            raise ValueError(f"lora_hybrid_slots must be a power of two >= 8, got {h!r}")
        bt = self.prefill_lora_block_t
        if isinstance(bt, bool) or not isinstance(bt, int) or bt < 16 or bt & (bt - 1):
            raise ValueError(f"prefill_lora_block_t must be a power of two >= 16, got {bt!r}")
        for name in ("lora_backend", "prefill_lora_backend"):
            check_backend(getattr(self, name), jax.default_backend())  # slora_jax.lora: "ranksplit" needs a GPU
        mode = self.adapter_memory
        if mode not in ADAPTER_MEMORY:
            raise ValueError(f"adapter_memory must be one of {ADAPTER_MEMORY}, got {mode!r}")
        for name, owner in (("adapter_slots", "padded_slots"), ("adapter_region_pages", "separate")):
            value = getattr(self, name)
            if mode == owner:
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"adapter_memory={owner!r} needs {name} >= 1, got {value!r}")
            elif value is not None:
                raise ValueError(f"{name} is only for adapter_memory={owner!r}, "
                                 f"not adapter_memory={mode!r}")


def _phase(name: str):
    """A host phase of the step loop, named in device traces (jax.profiler) as `slora.<name>`, so a
    trace shows what the host was doing while the device waited (bench/profile_step.idle_by_phase).
    Without an active trace it costs about a microsecond."""
    return jax.profiler.TraceAnnotation(f"slora.{name}")


def _group_by_adapter(chunks: list) -> None:
    """Order a step's sequences so each adapter's tokens are contiguous and base-model tokens
    come last: the segment form the LoRA kernels read each adapter once for (stable otherwise)."""
    first: dict = {}
    for req, _, _ in chunks:
        if req.adapter is not None:
            first.setdefault(req.adapter.key, len(first))
    chunks.sort(key=lambda c: first[c[0].adapter.key] if c[0].adapter is not None else len(first))


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


@dataclasses.dataclass
class _InFlight:
    """An overlapped step on the device: its plan, its results (a device array) and when it was
    dispatched."""
    plan: object
    results: jax.Array
    dispatched: float
    first_run: bool


class Engine:
    def __init__(self, cfg: ModelConfig, params, dtype: str, store: AdapterStore, opts: EngineOptions,
                 max_model_len: int, *, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.params, self.dtype, self.store, self.opts = cfg, params, jnp.dtype(dtype), store, opts
        # Tensor parallel: the weights placed over the mesh, the pool split along W (slora_jax.model.tp).
        self.tp = tp_mod.TP.make(opts.tensor_parallel, cfg) if opts.tensor_parallel > 1 else None
        if self.tp is not None:
            if store.tp != self.tp.size:
                raise ValueError(f"the adapter store lays rows out for {store.tp} devices, the engine runs on "
                                 f"{self.tp.size} (AdapterStore(..., tp=tensor_parallel))")
            self.params = tp_mod.shard_params(params, self.tp)
        self.max_model_len = max_model_len
        # Not on the CPU: XLA:CPU's cached executables can crash the process that loads them (a
        # segfault inside the cache read, seen in this repository's suite on a warm cache; jax
        # issues 24982 and 28908), and CPU compiles are short. GPU compiles are what it saves.
        if opts.compilation_cache_dir and jax.config.jax_compilation_cache_dir is None and \
                jax.default_backend() != "cpu":
            jax.config.update("jax_compilation_cache_dir", opts.compilation_cache_dir)
        self.ps = opts.page_size
        self._result_rows = _pow2(max(opts.max_num_seqs + opts.max_prefill_seqs, opts.min_decode_batch))
        # before the pool is sized from the free memory: the K/V buffer is held for good
        self._buffers = paged.StepBuffers.create(
            cfg, self._step_rows(), self._result_rows, self.dtype,
            jax.sharding.SingleDeviceSharding(jax.devices()[0])) if opts.stable_buffers else None
        num_pages = self.num_pages = self._pool_pages()
        self.pool = self._make_pool(num_pages)
        # padded_slots: the LoRA step's distinct-adapter bucket is always every slot.
        self._lora_slots = opts.adapter_slots if opts.adapter_memory == "padded_slots" else None
        self.kv = paged.empty_pool(cfg, num_pages, self.ps, self.dtype, self.tp)
        self.clock = clock
        self.metrics = EngineMetrics()
        self.sched = Scheduler(self.pool, opts, self.ps, store.entries.get, clock=clock,
                               cost=StepCostModel(), metrics=self.metrics, ready=store.ready)
        self.step_count = 0
        # Seconds of the steps' wall time by phase: the host's (schedule, adapter page-ins, input
        # building, dispatch, prefetch, completion) run while the device idles, except prefetch
        # and what overlaps the device; device_wait is what is left of the step after dispatch.
        self.host_seconds = dict.fromkeys(
            ("schedule", "adapter_loads", "inputs", "dispatch", "prefetch", "device_wait", "complete"), 0.0)
        # Host seconds of input building and dispatch by step transition ("decode>prefill": a
        # prefill step dispatched after a decode step): [steps, inputs, dispatch]. Says whether a
        # kind of step, or a change of executable, costs the host more (bench/run.py reports it).
        self.host_by_transition: dict[str, list] = {}
        self._last_kind = "none"
        self._shapes: set = set()   # step input shapes run before (a first run includes its compile)
        self._rows: dict = {}       # adapter key -> its residency (see _residency)
        self._decode_pages = self.decode_page_floor()
        self._modules_key, self._union = None, set()  # the registered adapters' modules (cached)
        # Overlapped steps: the dispatched step not yet completed, where its sampled tokens are
        # (id(request) -> results row) and its results on the device; results have these rows.
        self._in_flight: _InFlight | None = None
        self._feed_rows: dict[int, int] = {}
        self._prev_results = jax.device_put(np.zeros((self._result_rows, 2), np.float32), self._replicated) \
            if opts.overlap_steps else None
        self._last_done = 0.0

    def _step_rows(self) -> int:
        """The most tokens a step has: a prefill step's bucket (prompts are chunked to
        max_prefill_tokens) or a decode step's."""
        o = self.opts
        return max(_pow2(o.max_prefill_tokens, 16), _pow2(max(o.max_num_seqs, o.min_decode_batch)))

    def decode_page_floor(self) -> int:
        """The decode page-table bucket's floor: the Pallas kernel reads only each row's live pages,
        so its table is always as wide as max_model_len needs (one shape per batch bucket); XLA
        attention reads the whole table, so its bucket follows the longest context."""
        return _pow2(self.kv_pages_for(self.max_model_len)) if self.opts.attention_backend == "pallas" else 1

    def _make_pool(self, num_pages: int) -> UnifiedPool:
        o = self.opts
        if o.adapter_memory == "unified":
            return UnifiedPool(num_pages)
        if o.adapter_memory == "separate":
            region, slot = o.adapter_region_pages, None
        else:
            if self.store.pad_rank != o.max_lora_rank:
                raise ValueError("adapter_memory='padded_slots' needs an AdapterStore that lays adapters "
                                 "out at max_lora_rank (AdapterStore(..., pad_to_max_rank=True))")
            slot = AdapterLayout.of(None, self.cfg, self.ps, o.max_lora_rank).pages
            region = o.adapter_slots * slot
        if region > num_pages - 2:
            what = f"{o.adapter_slots} slots of {slot} pages" if slot else f"{region} adapter pages"
            raise ValueError(f"adapter_memory={o.adapter_memory!r}: {what} leave no KV page in a pool of "
                             f"{num_pages - 1} usable pages")
        return RegionPool(num_pages, region, slot_pages=slot)

    def _pool_pages(self) -> int:
        """opts.pool_pages, or the memory budget's pages, capped at paged.max_pool_pages (int32
        element offsets in the kernels); an explicit size past the cap is refused where the GPU
        kernels would run on it."""
        o = self.opts
        cap = paged.max_pool_pages(self.cfg, self.ps, o.tensor_parallel)
        if o.pool_pages is None:
            return min(self._pages_from_budget(), cap)
        kernels = jax.default_backend() == "gpu" and \
            {o.attention_backend, o.lora_backend, o.prefill_lora_backend} != {"xla"}
        if o.pool_pages > cap and kernels:
            raise ValueError(f"pool_pages={o.pool_pages}: a layer of the pool would hold past 2**31 elements, "
                             f"which the GPU kernels address in int32; use at most {cap} pages, or the xla "
                             "backends")
        return o.pool_pages

    def _pages_from_budget(self) -> int:
        stats = jax.devices()[0].memory_stats() or {}
        limit, used = stats.get("bytes_limit"), stats.get("bytes_in_use", 0)
        # A device that reports no budget (the CPU) gets 1 GiB of pool.
        budget = (limit - used) * self.opts.memory_fraction if limit else 2**30
        # each device of a tensor-parallel mesh holds 1/tp of every page
        return int(budget // (paged.page_bytes(self.cfg, self.ps, self.dtype) // self.opts.tensor_parallel))

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

    @property
    def layers_per_call(self) -> int:
        """Decoder layers one jit runs (paged.step's per_layer); 0: one jit over the whole model."""
        return self.opts.layers_per_call if self.opts.compile_per_layer else 0

    # -- requests ----------------------------------------------------------------------------

    def kv_pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.ps)

    def add_request(self, prompt: list[int], params: SamplingParams, adapter: str | None, seed: int,
                    eos_ids: tuple[int, ...]) -> RequestOutput:
        entry = self.store.get(adapter) if adapter is not None else None
        kv, ad = self.kv_pages_for(len(prompt) + params.max_tokens), (entry.layout.pages if entry else 0)
        if kv > self.pool.kv_capacity(ad):
            room = self.pool.total_pages if self.opts.adapter_memory == "unified" else \
                f"{self.pool.kv_capacity(0)} KV pages and {self.pool.adapter_pages} adapter pages"
            raise ValueError(f"request needs {kv + ad} pages (prompt {len(prompt)} + max_tokens "
                             f"{params.max_tokens}{' + adapter' if entry else ''}) but the pool has "
                             f"{room}; it can never run")
        if entry is not None and self.opts.prefetch_adapters and not self.pool.is_resident(entry.key):
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

    # -- one step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one prefill or decode step; returns the requests that finished in it (aborted
        ones included). With overlap_steps: dispatch the next step, then complete the one before
        it; returns the requests that finished in that one."""
        if self.opts.overlap_steps:
            return self._step_overlapped()
        t0 = time.perf_counter()
        with _phase("schedule"):
            plan = self.sched.schedule()
        t1 = time.perf_counter()
        with _phase("adapter_loads"):
            self._write_adapters(plan.loads)
        if not plan.chunks:
            self.sched.refresh_gauges()
            return plan.finished
        t2 = time.perf_counter()
        results, first_run, t = self._launch(plan)
        # While the device runs the step: copy in what the next batch is predicted to need.
        t_pre = time.perf_counter()
        with _phase("prefetch"):
            self._write_adapters(self.sched.prefetch(plan), speculative=True)
        t_wait = time.perf_counter()
        t_pre = t_wait - t_pre
        with _phase("device_wait"):
            results = np.asarray(results)
        t_done = time.perf_counter()
        seconds = t_done - t
        self.step_count += 1
        # A first run includes its compile, and a slow prefetch (disk) can outlast the step:
        # neither says how long such a step takes.
        timed = not first_run and t_pre < 0.5 * seconds
        with _phase("complete"):
            finished = plan.finished + self.sched.complete(plan, results, seconds if timed else None)
        self._count_transition(plan.kind, t - t2, (t_wait - t) - t_pre)
        h = self.host_seconds  # where a step's wall time goes, summed (see stats())
        h["schedule"] += t1 - t0
        h["adapter_loads"] += t2 - t1
        h["inputs"] += t - t2
        h["dispatch"] += (t_wait - t) - t_pre
        h["prefetch"] += t_pre
        h["device_wait"] += t_done - t_wait
        h["complete"] += time.perf_counter() - t_done
        return finished

    def _step_overlapped(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        with _phase("schedule"):
            plan = self.sched.schedule()
        t1 = time.perf_counter()
        with _phase("adapter_loads"):
            self._write_adapters(plan.loads)
        t2 = t = t_pre = t_wait = time.perf_counter()
        launched = None
        if plan.chunks:
            results, first_run, t = self._launch(plan)
            t_pre = time.perf_counter()
            with _phase("prefetch"):
                self._write_adapters(self.sched.prefetch(plan), speculative=True)
                self.sched.advance(plan)
            t_wait = time.perf_counter()
            if self.opts.async_results_copy:
                results.copy_to_host_async()
            launched = _InFlight(plan, results, t, first_run)
            self.step_count += 1
            self._count_transition(plan.kind, t - t2, t_pre - t)
        finished = list(plan.finished)
        prev, self._in_flight = self._in_flight, launched
        t_done = t_wait
        if prev is not None:
            with _phase("device_wait"):
                results = np.asarray(prev.results)
            t_done = time.perf_counter()
            # The device ran prev from its dispatch or the end of the step before, the later.
            seconds = t_done - max(prev.dispatched, self._last_done)
            self._last_done = t_done
            with _phase("complete"):
                finished += self.sched.complete_overlapped(prev.plan, results, None if prev.first_run else seconds)
        elif not plan.chunks:
            self.sched.refresh_gauges()
        if launched is not None:
            self._feed_rows = {id(req): row for row, req, _ in launched.plan.pending}
            self._prev_results = launched.results
        else:
            self._feed_rows = {}
        h = self.host_seconds
        h["schedule"] += t1 - t0
        h["adapter_loads"] += t2 - t1
        h["inputs"] += t - t2
        h["dispatch"] += t_pre - t
        h["prefetch"] += t_wait - t_pre
        h["device_wait"] += t_done - t_wait
        h["complete"] += time.perf_counter() - t_done
        return finished

    def _count_transition(self, kind: str, inputs_s: float, dispatch_s: float) -> None:
        row = self.host_by_transition.setdefault(f"{self._last_kind}>{kind}", [0, 0.0, 0.0])
        row[0] += 1
        row[1] += inputs_s
        row[2] += dispatch_s
        self._last_kind = kind

    def _launch(self, plan) -> tuple[jax.Array, bool, float]:
        """Order the plan's sequences by adapter, build its inputs and dispatch the step: (its
        results, still on the device; whether its shape is new, i.e. it compiles; when the inputs
        were ready)."""
        with _phase("inputs"):
            _group_by_adapter(plan.chunks)
            inp, _ = self._inputs(plan)
            if self.opts.overlap_steps:
                inp = self._fed(inp, plan)
            shape = (plan.kind, jax.tree_util.tree_structure(inp),
                     tuple(np.shape(x) for x in jax.tree_util.tree_leaves(inp)))
            first_run = shape not in self._shapes
            self._shapes.add(shape)
        t = time.perf_counter()
        with _phase("dispatch"):
            results = self._dispatch(inp)
        return results, first_run, t

    def _dispatch(self, inp: paged.StepInputs) -> jax.Array:
        """Run the step on the device (asynchronously): its results."""
        if self._buffers is not None:
            self.kv, results = paged.step_packed(self.params, self.kv, self._buffers.stage(inp), self._buffers,
                                                 cfg=self.cfg)
        else:
            self.kv, results = paged.step(self.params, self.kv, self._device_inputs(inp), cfg=self.cfg,
                                          per_layer=self.layers_per_call, tp=self.tp)
        return results

    def _device_inputs(self, inp: paged.StepInputs) -> paged.StepInputs:
        return paged.device_inputs(inp, self.kv[0].sharding) if self.opts.pack_inputs else inp

    def _fed(self, inp: paged.StepInputs, plan) -> paged.StepInputs:
        """Overlapped steps: the tokens still on the device (PENDING on the host) are read from
        the in-flight step's results: token_src gives each one's results row."""
        tokens = inp.tokens
        src = np.full(tokens.shape, -1, np.int32)
        for t in np.flatnonzero(tokens == PENDING):
            req = plan.chunks[int(inp.token_seq[t])][0]
            src[t] = self._feed_rows[id(req)]
        tokens = np.where(src >= 0, 0, tokens).astype(np.int32)
        return inp.replace(tokens=tokens, token_src=src, prev_results=self._prev_results)

    def warmup_shapes(self, max_context: int | None = None, lora: bool = True) -> list[paged.StepInputs]:
        """Null step inputs for the buckets a server meets: decode at every batch bucket (powers of
        two from min_decode_batch up to max_num_seqs) times every page-table bucket up to
        max_context tokens (one, max_model_len's, under the Pallas kernel), and prefill of fresh
        prompts up to max_prefill_tokens. With `lora` and adapters registered, each again with
        LoRA at every slot bucket on each module set a step can carry (`_module_sets`). Every read
        and write of these inputs goes to the null page. Not covered (compiled on first use):
        prefill steps that continue a split prompt (pooled context), and mixed steps."""
        o = self.opts
        ctx = max_context or min(self.max_model_len, 4096)
        module_sets = self._module_sets() if lora else []
        shapes = []
        s = _pow2(o.min_decode_batch)
        while s <= _pow2(max(o.max_num_seqs, o.min_decode_batch)):
            p = self._decode_pages
            while p <= max(self._decode_pages, _pow2(self.kv_pages_for(ctx))):
                shapes.append(self._null_inputs(s, s, p, decode=True))
                shapes += [self._null_inputs(s, s, p, decode=True, lora=(modules, sa))
                           for modules in module_sets for sa in self._slot_buckets(s, s, decode=True)]
                p *= 2
            s *= 2
        # Fresh prompts (no context in the pool yet: a one-column page table) packed to n tokens in
        # all run at pow2(n, 16) tokens x the prefill row bucket, with every key window that
        # prompts of up to max_context tokens give.
        s = _pow2(o.max_prefill_seqs)
        for t in sorted({_pow2(n, 16) for n in range(1, o.max_prefill_tokens + 1)}):
            for w in sorted({self._key_window(t, n) for n in range(1, min(t, ctx) + 1)}):
                shapes.append(self._null_inputs(t, s, 1, decode=False, key_window=w))
                shapes += [self._null_inputs(t, s, 1, decode=False, lora=(modules, sa), key_window=w)
                           for modules in module_sets
                           for sa in self._slot_buckets(min(t, s), t, decode=False)]
        return shapes

    def _key_window(self, t: int, longest: int) -> int:
        """The key window of a packed prefill step of t tokens whose longest chunk has `longest`
        (0: none, every query block reads every new token)."""
        qb = min(t, self.opts.prefill_query_block)
        window = max(qb, _pow2(longest))
        return window if window + qb < t else 0

    def _module_sets(self) -> list[tuple[str, ...]]:
        """The module sets a LoRA step can carry: the registered adapters' modules within the
        attention projections, then all of them (one set when they are the same)."""
        key = (self.store._version, len(self.store.entries))
        if self._modules_key != key:
            union = {m for e in self.store.entries.values() for m in e.layout.modules}
            self._modules_key, self._union = key, union
        sets = []
        for group in (ATTENTION_MODULES, TARGET_MODULES):
            chosen = tuple(m for m in group if m in self._union)
            if chosen and chosen not in sets:
                sets.append(chosen)
        return sets

    def _step_modules(self, entries: list[AdapterEntry]) -> tuple[str, ...]:
        """The modules a LoRA step carries: the smallest set of `_module_sets` that holds every
        module of its adapters, not the exact set, so batches of adapters with different targets
        share step shapes (a module that no adapter of the batch targets has rank 0 in every
        slot: no work in the kernels, masked work in the one-hot path)."""
        have = {m for e in entries for m in e.layout.modules}
        for chosen in self._module_sets():
            if have <= set(chosen):
                return chosen
        return tuple(m for m in TARGET_MODULES if m in have | self._union)  # a replaced version's

    def _slot_buckets(self, most: int, rows: int, decode: bool) -> list[int]:
        """Every slot bucket of a step of `rows` tokens with at most `most` distinct adapters."""
        return sorted({self._slot_bucket(n, rows, decode) for n in range(1, most + 1)})

    def _slot_bucket(self, n: int, rows: int, decode: bool) -> int:
        """Slots for n distinct adapters in a step of `rows` tokens (slora_jax.lora.slot_bucket)."""
        if self._lora_slots:
            return self._lora_slots
        return slot_bucket(n, rows, decode=decode, option=self.opts.lora_backend, max_rank=self.opts.max_lora_rank,
                           platform=jax.default_backend(), prefill_slots=self.opts.max_prefill_seqs)

    def _step_backend(self, slots: int, decode: bool) -> str:
        """The LoRA backend of a step with `slots` adapter slots (slora_jax.lora.step_backend)."""
        return step_backend(self.opts.lora_backend, decode, slots, 0, self.opts.max_lora_rank, jax.default_backend(),
                            sharded=self.tp is not None)

    def _null_inputs(self, t: int, s: int, p: int, decode: bool, lora=None, key_window: int = 0
                     ) -> paged.StepInputs:
        """Step inputs whose every read and write goes to the null page (prefill: fresh prompts);
        lora = (modules, slots): LoRA inputs of that shape with no live slot."""
        zeros = np.zeros(t, np.int32)
        if lora is not None:
            modules, sa = lora
            arrays = {m: self._empty_lora_arrays(m, sa) for m in modules}
            seg_starts = np.zeros(sa + 1, np.int32)
            ranks = {m: rk for m, (_, _, rk) in arrays.items()}
            lora = self._make_lora_inputs(t, np.full(t, -1, np.int32), seg_starts,
                                          {m: (a, b) for m, (a, b, _) in arrays.items()}, ranks,
                                          self._step_backend(sa, decode), decode)
        fed = dict(token_src=np.full(t, -1, np.int32), prev_results=self._prev_results) \
            if self.opts.overlap_steps else {}
        return paged.StepInputs(tokens=zeros, positions=zeros, kv_slot=zeros, **fed,
                                token_seq=np.arange(s, dtype=np.int32) if decode else zeros,
                                page_table=np.full((s, p), NULL_PAGE, np.int32), ctx_lens=np.zeros(s, np.int32),
                                sample_idx=np.arange(s, dtype=np.int32) if decode else np.full(s, t - 1, np.int32),
                                lora=lora, decode=decode, attention_backend=self.opts.attention_backend,
                                query_block=self.opts.prefill_query_block, prefill_context=decode,
                                key_window=key_window, **self._sampling_arrays([], s))

    def warmup(self, max_context: int | None = None, progress: bool = True, lora: bool = True,
               workers: int | None = None) -> int:
        """Compile every shape of `warmup_shapes`, `workers` at a time (threads; default 1), with a
        progress bar; then run each once on the null page. With the persistent compilation cache
        a restart loads them instead. Returns how many.

        workers > 1 compiles shapes side by side (on a 2-core CPU, 43 shapes of an 8-layer model:
        123 s with 1, 106 s with 2; per layer, 29 shapes of the tiny model: 57.5 s with 1, 51.4 s
        with 2). With compile_per_layer the threads compile embed, the layer runs and the head
        (paged.compile_layer_steps); the steps run afterwards compile only commit_kv. More than
        one worker is not the default yet: on a GPU, XLA autotunes its GEMMs by timing them on the
        device, and concurrent compiles may time each other's kernels."""
        shapes = self.warmup_shapes(max_context, lora)
        workers = max(1, workers or 1)

        per_layer = self.layers_per_call

        def compile_one(inp):
            inp = self._device_inputs(inp)  # as the steps will pass them: the same jit cache entry
            if per_layer:
                paged.compile_layer_steps(self.params, self.kv, inp, cfg=self.cfg, layers_per_call=per_layer)
            elif self._buffers is not None:
                buf, device, spec = paged.pack_inputs(inp)
                b = self._buffers
                held = jax.device_put(np.append(buf, np.int32(0)), b.results.sharding)  # committed, as in steps
                paged.forward_sample_packed.lower(self.params, self.kv, held, device, b.kv_out, b.results,
                                                  cfg=self.cfg, spec=spec).compile()
            elif self.tp is not None:
                paged.forward_sample_tp.lower(self.params, self.kv, inp, cfg=self.cfg, tp=self.tp).compile()
            else:
                paged.forward_sample.lower(self.params, self.kv, inp, cfg=self.cfg).compile()
            kind = "decode" if inp.decode else "prefill"
            slots = f" lora x{len(inp.lora.seg_starts) - 1}" if inp.lora is not None else ""
            return f"{kind} {inp.tokens.shape[0]}x{inp.page_table.shape[1]}{slots}"

        bar = tqdm(total=len(shapes), desc="compiling step buckets", unit="shape", disable=not progress)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for done in concurrent.futures.as_completed([pool.submit(compile_one, inp) for inp in shapes]):
                bar.set_postfix_str(done.result())
                bar.update()
        for inp in shapes:  # now cache hits; commit_kv (small) compiles here
            results = self._dispatch(inp)
            self._shapes.add(("decode" if inp.decode else "prefill", jax.tree_util.tree_structure(inp),
                              tuple(np.shape(x) for x in jax.tree_util.tree_leaves(inp))))
        bar.close()
        if shapes:
            np.asarray(results)
        return len(shapes)

    def _inputs(self, plan: Plan):
        if plan.kind == "prefill":
            return self._prefill_inputs(plan.chunks)
        return self._decode_inputs(plan.requests)

    # -- step inputs -------------------------------------------------------------------------

    def _page_table(self, reqs: list[Request], s: int, floor: int = 1) -> np.ndarray:
        lists = [self.pool.kv[r.rid] for r in reqs]
        lens = np.array([len(pages) for pages in lists], np.int64)
        p = _pow2(max(floor, int(lens.max(initial=0))))
        table = np.full((s, p), NULL_PAGE, np.int32)
        if len(lists):  # one scatter of every page, not one row copy per sequence
            flat = np.fromiter(itertools.chain.from_iterable(lists), np.int32, int(lens.sum()))
            rows = np.repeat(np.arange(len(lists)), lens)
            cols = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)
            table[rows, cols] = flat
        return table

    def _sampling_arrays(self, reqs: list[Request], s: int) -> dict:
        def col(f, dtype, pad):
            a = np.full(s, pad, dtype)
            a[:len(reqs)] = [f(r) for r in reqs]
            return a
        return dict(temperature=col(lambda r: r.params.temperature, np.float32, 0.0),
                    top_k=col(lambda r: max(r.params.top_k, 0), np.int32, 0),
                    top_p=col(lambda r: r.params.top_p, np.float32, 1.0),
                    seeds=col(lambda r: r.seed % 2**32, np.uint32, 0),
                    steps=col(lambda r: r.generated, np.int32, 0))

    def _kv_slots(self, req: Request, positions: np.ndarray) -> np.ndarray:
        pages = np.asarray(self.pool.kv[req.rid], np.int32)
        return pages[positions // self.ps] * self.ps + positions % self.ps

    def _residency(self, entry: AdapterEntry) -> tuple:
        """(page list, row indices of its pages, {module set: slot record}) of a resident adapter,
        computed once per residency, not every step: a reload gets a new page list, so the entry
        is checked by identity."""
        pages = self.pool.adapters[entry.key]
        hit = self._rows.get(entry.key)
        if hit is None or hit[0] is not pages:
            if len(self._rows) > 4 * max(len(self.pool.adapters), 64):  # drop the evicted ones
                self._rows = {k: v for k, v in self._rows.items() if k in self.pool.adapters}
            hit = self._rows[entry.key] = (pages, page_rows(pages, entry.layout.rows, self.ps), {})
        return hit

    def _slot_record(self, entry: AdapterEntry, modules: tuple[str, ...]) -> np.ndarray:
        """One LoRA slot's inputs for a step carrying `modules`, flat: per module its A rows and
        B rows (padded with the null page's row 0 to max_lora_rank's row counts) and its rank
        (0 where the adapter does not target it). Cached per residency: a step stacks these."""
        _, all_rows, records = self._residency(entry)
        rec = records.get(modules)
        if rec is None:
            parts = []
            for module in modules:
                a, b, rk = self._empty_lora_arrays(module, 1)
                m = entry.layout.modules.get(module)
                if m is not None:
                    a[0, :m.a_rows] = all_rows[m.a_row:m.a_row + m.a_rows]
                    b[0, :m.b_rows] = all_rows[m.b_row:m.b_row + m.b_rows]
                    rk[0] = m.rank
                parts += [a[0], b[0], rk]
            rec = records[modules] = np.concatenate(parts)
        return rec

    def _lora_inputs(self, token_reqs: list[Request | None], t: int, *, decode: bool) -> paged.LoraInputs | None:
        entries = list({r.adapter.key: r.adapter for r in token_reqs if r is not None and r.adapter}.values())
        if not entries:
            return None
        sa = self._slot_bucket(len(entries), t, decode)
        backend = self._step_backend(sa, decode)
        assert len(entries) <= sa, (len(entries), sa)
        slot = {e.key: i for i, e in enumerate(entries)}
        token_slot = np.array([slot[r.adapter.key] if r is not None and r.adapter is not None else -1
                               for r in token_reqs], np.int32)
        # Tokens are grouped by slot (see _group_by_adapter): slot s owns [seg[s], seg[s+1]).
        live = token_slot[token_slot >= 0]
        if np.any(np.diff(live) < 0) or (len(live) and token_slot[:len(live)].min() < 0):
            raise AssertionError("LoRA tokens are not grouped by adapter; call _group_by_adapter")
        counts = np.bincount(live, minlength=sa)
        seg_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        modules = self._step_modules(entries)
        stacked = np.stack([self._slot_record(e, modules) for e in entries])
        table = np.zeros((sa, stacked.shape[1]), np.int32)  # empty slots: null page, rank 0
        table[:len(entries)] = stacked
        rows, ranks, at = {}, {}, 0
        for module in modules:
            ra, rb = self._lora_row_counts(module)
            rows[module] = (np.ascontiguousarray(table[:, at:at + ra]),
                            np.ascontiguousarray(table[:, at + ra:at + ra + rb]))
            ranks[module] = np.ascontiguousarray(table[:, at + ra + rb])
            at += ra + rb + 1
        return self._make_lora_inputs(t, token_slot, seg_starts, rows, ranks, backend, decode)

    def _make_lora_inputs(self, t: int, token_slot, seg_starts, rows: dict, ranks: dict,
                          backend: str, decode: bool) -> paged.LoraInputs:
        """LoraInputs of a step (live or null): the backend's host tables (slora_jax.lora.plan)."""
        return plan_lora(backend, t=t, token_slot=token_slot, seg_starts=seg_starts, rows=rows, ranks=ranks,
                         decode=decode, cfg=self.cfg, max_rank=self.opts.max_lora_rank, dtype=self.dtype)

    def _empty_lora_arrays(self, module: str, sa: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A module's (A rows [sa, RA], B rows [sa, RB], ranks [sa]) with every slot empty (the
        null page, rank 0), at max_lora_rank: what a step fills in for its adapters."""
        ra, rb = self._lora_row_counts(module)
        return np.zeros((sa, ra), np.int32), np.zeros((sa, rb), np.int32), np.zeros(sa, np.int32)

    def _lora_row_counts(self, module: str) -> tuple[int, int]:
        """Pool rows of a module's A^T and of its B at max_lora_rank (a slot's row-index widths)."""
        rank, width = self.opts.max_lora_rank, self.cfg.kv_size
        fin, fout = self.cfg.module_shape(module)
        return paged.rows_needed(rank, fin, width), paged.rows_needed(rank, fout, width)

    def _prefill_inputs(self, chunks):
        total = sum(end - start for _, start, end in chunks)
        t = _pow2(total, 16)
        s = _pow2(max(len(chunks), self.opts.max_prefill_seqs))  # one bucket: rows are cheap
        context = any(start > 0 for _, start, _ in chunks)
        longest = max(end - start for _, start, end in chunks)
        tokens = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        kv_slot = np.zeros(t, np.int32)
        token_seq = np.full(t, -1, np.int32)  # padding belongs to no sequence
        sample_idx = np.zeros(s, np.int32)
        ctx_lens = np.zeros(s, np.int32)
        token_reqs: list[Request | None] = [None] * t
        samplers = set()
        at = 0
        for i, (req, start, end) in enumerate(chunks):
            n = end - start
            pos = np.arange(start, end, dtype=np.int32)
            tokens[at:at + n] = req.tokens[start:end]
            positions[at:at + n] = pos
            kv_slot[at:at + n] = self._kv_slots(req, pos)
            token_seq[at:at + n] = i
            token_reqs[at:at + n] = [req] * n
            sample_idx[i] = at + n - 1
            ctx_lens[i] = start
            if end == len(req.tokens):
                samplers.add(i)
            at += n
        reqs = [c[0] for c in chunks]
        # Without context the page table is not read: one column keeps the shape fixed. With it,
        # only the sequences that have context get rows (a prompt's later chunk beside fresh
        # prompts reads its own pages, not every row's at its page count).
        table, ctx_seq = np.full((s, 1), NULL_PAGE, np.int32), None
        if context:
            rows = [i for i, (_, start, _) in enumerate(chunks) if start > 0]
            c = _pow2(len(rows))
            table = self._page_table([reqs[i] for i in rows], c)
            ctx_seq = np.full(c, -1, np.int32)
            ctx_seq[:len(rows)] = rows
            ctx_lens = np.zeros(c, np.int32)
            ctx_lens[:len(rows)] = [chunks[i][1] for i in rows]
        inp = paged.StepInputs(tokens=tokens, positions=positions, kv_slot=kv_slot, token_seq=token_seq,
                               page_table=table, ctx_lens=ctx_lens, sample_idx=sample_idx, ctx_seq=ctx_seq,
                               lora=self._lora_inputs(token_reqs, t, decode=False), decode=False,
                               attention_backend=self.opts.attention_backend,
                               query_block=self.opts.prefill_query_block, prefill_context=context,
                               key_window=self._key_window(t, longest),
                               **self._sampling_arrays(reqs, s))
        return inp, samplers

    def _decode_inputs(self, batch: list[Request]):
        s = _pow2(max(len(batch), self.opts.min_decode_batch))
        tokens = np.zeros(s, np.int32)
        positions = np.zeros(s, np.int32)
        kv_slot = np.zeros(s, np.int32)
        ctx_lens = np.zeros(s, np.int32)
        ps, kv, n = self.ps, self.pool.kv, len(batch)
        pos = [req.num_computed for req in batch]
        tokens[:n] = [req.tokens[p] for req, p in zip(batch, pos)]
        positions[:n] = ctx_lens[:n] = pos
        kv_slot[:n] = [kv[req.rid][p // ps] * ps + p % ps for req, p in zip(batch, pos)]
        table = self._page_table(batch, s, self._decode_pages)
        inp = paged.StepInputs(tokens=tokens, positions=positions, kv_slot=kv_slot,
                               token_seq=np.arange(s, dtype=np.int32), page_table=table,
                               ctx_lens=ctx_lens, sample_idx=np.arange(s, dtype=np.int32),
                               lora=self._lora_inputs(batch + [None] * (s - len(batch)), s, decode=True),
                               decode=True,
                               attention_backend=self.opts.attention_backend,
                               query_block=self.opts.prefill_query_block,
                               **self._sampling_arrays(batch, s))
        return inp, set(range(len(batch)))

    def prompt_logits(self, prompts: list[list[int]], adapters: list[str | None]) -> list[np.ndarray]:
        """Logits at every prompt position, all prompts in one prefill step (engine must be idle)."""
        if self.has_unfinished():
            raise RuntimeError("prompt_logits needs an idle engine")
        params = SamplingParams(max_tokens=1, temperature=0.0)
        rids = [self.add_request(p, params, a, 0, ()).request_id for p, a in zip(prompts, adapters)]
        for req in self.waiting:
            req.deadline = None  # no early abort here
        self.sched.drop_pins()
        o = self.opts
        saved = o.max_prefill_tokens, o.max_prefill_seqs, o.max_num_seqs, o.max_adapters_per_batch
        o.max_prefill_tokens = sum(map(len, prompts))
        o.max_prefill_seqs = o.max_num_seqs = o.max_adapters_per_batch = len(prompts)
        try:
            plan = self.sched.schedule()
            self._write_adapters(plan.loads)
            if plan.kind != "prefill" or len(plan.chunks) != len(prompts):
                raise ValueError("prompts do not fit in the pool together")
            _group_by_adapter(plan.chunks)
            inp, _ = self._prefill_inputs(plan.chunks)
            self.kv, logits = paged.step_all_logits(self.params, self.kv, inp, cfg=self.cfg, tp=self.tp)
            logits = np.asarray(logits)
            at, where = 0, {}  # the scheduler may order the chunks differently from the prompts
            for req, start, end in plan.chunks:
                where[req.rid] = logits[at:at + end - start]
                at += end - start
        finally:
            o.max_prefill_tokens, o.max_prefill_seqs, o.max_num_seqs, o.max_adapters_per_batch = saved
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
            "adapter_disk_loads": self.store.disk_loads, "host_seconds": dict(self.host_seconds),
            "host_by_transition": {k: list(v) for k, v in self.host_by_transition.items()},
        }
