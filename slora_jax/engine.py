"""The paged engine: continuous batching over fixed-shape jitted steps and the unified pool.

Host side only (numpy): it admits requests FCFS under the pool budget, grows KV page tables,
preempts (and later recomputes) the newest request when pages run out, pages adapters in, builds
the bucketed `StepInputs`, and runs one step at a time. Prefill (possibly in chunks) and decode
never share a step, as in S-LoRA.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from slora_jax import paged
from slora_jax.adapter_store import AdapterEntry, AdapterStore
from slora_jax.config import TARGET_MODULES, ModelConfig
from slora_jax.layout import page_rows
from slora_jax.pool import NULL_PAGE, OutOfPages, UnifiedPool
from slora_jax.request import RequestOutput, new_request_id, stop_ids
from slora_jax.sampling import SamplingParams


@dataclasses.dataclass
class EngineOptions:
    page_size: int = 16
    pool_pages: int | None = None          # None: from memory_fraction of free device memory
    memory_fraction: float = 0.85          # of the device memory left after the weights
    max_num_seqs: int = 64
    max_prefill_tokens: int = 2048
    max_prefill_seqs: int = 16
    max_adapters_per_batch: int = 64
    max_lora_rank: int = 64
    lora_backend: str = "xla"
    attention_backend: str = "xla"
    host_cache_size: int = 256
    compilation_cache_dir: str | None = os.path.expanduser("~/.cache/slora_jax/xla")

    def __post_init__(self):
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        for name in ("lora_backend", "attention_backend"):
            if getattr(self, name) not in ("xla",):
                raise ValueError(f"{name}={getattr(self, name)!r}: only 'xla' is available yet")


@dataclasses.dataclass(eq=False)
class Request:
    rid: str
    tokens: list[int]                 # prompt + generated so far
    prompt_len: int
    params: SamplingParams
    seed: int
    adapter: AdapterEntry | None
    out: RequestOutput
    stops: frozenset
    arrival: float
    num_computed: int = 0             # tokens whose K/V are in the pool
    holds_adapter: bool = False       # has a reference on its adapter's pages

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


class Engine:
    def __init__(self, cfg: ModelConfig, params, dtype: str, store: AdapterStore, opts: EngineOptions,
                 max_model_len: int):
        self.cfg, self.params, self.dtype, self.store, self.opts = cfg, params, jnp.dtype(dtype), store, opts
        self.max_model_len = max_model_len
        if opts.compilation_cache_dir and jax.config.jax_compilation_cache_dir is None:
            jax.config.update("jax_compilation_cache_dir", opts.compilation_cache_dir)
        self.ps = opts.page_size
        num_pages = opts.pool_pages or self._pages_from_budget()
        self.pool = UnifiedPool(num_pages)
        self.kv = paged.empty_pool(cfg, num_pages, self.ps, self.dtype)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preempted = 0
        self.step_count = 0

    def _pages_from_budget(self) -> int:
        stats = jax.devices()[0].memory_stats() or {}
        limit, used = stats.get("bytes_limit"), stats.get("bytes_in_use", 0)
        # A device that reports no budget (the CPU) gets 1 GiB of pool.
        budget = (limit - used) * self.opts.memory_fraction if limit else 2**30
        return int(budget // paged.page_bytes(self.cfg, self.ps, self.dtype))

    # -- requests ----------------------------------------------------------------------------

    def kv_pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.ps)

    def add_request(self, prompt: list[int], params: SamplingParams, adapter: str | None, seed: int,
                    eos_ids: tuple[int, ...]) -> RequestOutput:
        entry = self.store.get(adapter) if adapter is not None else None
        need = self.kv_pages_for(len(prompt) + params.max_tokens) + (entry.layout.pages if entry else 0)
        if need > self.pool.total_pages:
            raise ValueError(f"request needs {need} pages (prompt {len(prompt)} + max_tokens "
                             f"{params.max_tokens}{' + adapter' if entry else ''}) but the pool has "
                             f"{self.pool.total_pages}; it can never run")
        rid = new_request_id()
        out = RequestOutput(rid, list(prompt), logprobs=[] if params.logprobs else None, adapter=adapter)
        self.waiting.append(Request(rid, list(prompt), len(prompt), params, seed, entry, out,
                                    stop_ids(params, eos_ids), time.monotonic()))
        return out

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def busy_adapters(self) -> set[str]:
        return {r.adapter.name for r in [*self.running, *self.waiting] if r.adapter is not None}

    # -- scheduling --------------------------------------------------------------------------

    def _admit(self, req: Request) -> bool:
        """Take the adapter and enough KV pages for the request's next prefill chunk."""
        newly = False
        if req.adapter is not None:
            try:
                pages, newly = self.pool.acquire_adapter(req.adapter.key, req.adapter.layout.pages)
            except OutOfPages:
                return False
            req.holds_adapter = True
            if newly:
                self._load_adapter(req.adapter, pages)
        return True

    def _load_adapter(self, entry: AdapterEntry, pages: list[int]) -> None:
        rows = page_rows(pages, entry.layout.rows, self.ps)
        self.kv = paged.load_rows(self.kv, rows, self.store.rows(entry))

    def _grow(self, req: Request, n_tokens: int) -> bool:
        need = self.kv_pages_for(n_tokens) - len(self.pool.kv.get(req.rid, ()))
        if need <= 0:
            return True
        try:
            self.pool.grow_kv(req.rid, need)
            return True
        except OutOfPages:
            return False

    def _release(self, req: Request) -> None:
        self.pool.free_kv(req.rid)
        if req.holds_adapter:
            self.pool.release_adapter(req.adapter.key)
            req.holds_adapter = False

    def _preempt(self, req: Request) -> None:
        """Give back everything and queue the request first in line; it is recomputed later."""
        self.running.remove(req)
        self._release(req)
        req.num_computed = 0
        self.waiting.appendleft(req)
        self.num_preempted += 1

    def _schedule_prefill(self) -> list[tuple[Request, int, int]]:
        budget = self.opts.max_prefill_tokens
        chunks = []
        # Requests part-way through a chunked prefill go first.
        for req in self.running:
            if req.num_computed < len(req.tokens) - 1 and budget > 0 and len(chunks) < self.opts.max_prefill_seqs:
                end = min(len(req.tokens), req.num_computed + budget)
                if not self._grow(req, end):
                    break
                chunks.append((req, req.num_computed, end))
                budget -= end - req.num_computed
        while self.waiting and budget > 0 and len(chunks) < self.opts.max_prefill_seqs \
                and len(self.running) < self.opts.max_num_seqs:
            req = self.waiting[0]
            end = min(len(req.tokens), budget)
            if not self._admit(req):
                break
            if not self._grow(req, end):
                self._release(req)
                break
            self.waiting.popleft()
            self.running.append(req)
            chunks.append((req, 0, end))
            budget -= end
        return chunks

    def _schedule_decode(self) -> list[Request]:
        batch = []
        for req in list(self.running):
            if req not in self.running or req.num_computed != len(req.tokens) - 1:
                continue  # preempted below to make room, or still in prefill
            while not self._grow(req, req.num_computed + 1):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req in self.running:
                batch.append(req)
        return batch

    # -- one step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one prefill or decode step; returns the requests that finished in it."""
        chunks = self._schedule_prefill()
        if chunks:
            inp, samplers = self._prefill_inputs(chunks)
        else:
            batch = self._schedule_decode()
            if not batch:
                return self._unstick()
            chunks = [(r, r.num_computed, r.num_computed + 1) for r in batch]
            inp, samplers = self._decode_inputs(batch)
        self.kv, results = paged.step(self.params, self.kv, inp, cfg=self.cfg)
        results = np.asarray(results)
        self.step_count += 1
        finished = []
        for i, (req, start, end) in enumerate(chunks):
            req.num_computed = end
            if i in samplers:
                self._append(req, int(results[i, 0]), float(results[i, 1]))
                if req.out.finished:
                    finished.append(req.out)
        return finished

    def _unstick(self) -> list[RequestOutput]:
        """Nothing could be scheduled: free pages by preempting, or abort what cannot run alone."""
        if len(self.running) > 1:
            self._preempt(self.running[-1])
            return []
        req = self.running[0] if self.running else self.waiting.popleft() if self.waiting else None
        if req is None:
            return []
        self._finish(req, "abort", "not enough free pages for this request even with nothing else running")
        return [req.out]

    def _append(self, req: Request, token: int, logprob: float) -> None:
        req.tokens.append(token)
        req.out.token_ids.append(token)
        if req.out.logprobs is not None:
            req.out.logprobs.append(logprob)
        if token in req.stops:
            self._finish(req, "stop")
        elif req.generated >= req.params.max_tokens:
            self._finish(req, "length")

    def _finish(self, req: Request, reason: str, why: str | None = None) -> None:
        req.out.finish_reason, req.out.abort_reason = reason, why
        if req in self.running:
            self.running.remove(req)
            self._release(req)

    def abort(self, rid: str, why: str = "aborted") -> None:
        for req in [*self.running, *self.waiting]:
            if req.rid == rid:
                if req in self.waiting:
                    self.waiting.remove(req)
                self._finish(req, "abort", why)

    # -- step inputs -------------------------------------------------------------------------

    def _page_table(self, reqs: list[Request], s: int) -> np.ndarray:
        p = _pow2(max(len(self.pool.kv[r.rid]) for r in reqs))
        table = np.full((s, p), NULL_PAGE, np.int32)
        for i, r in enumerate(reqs):
            pages = self.pool.kv[r.rid]
            table[i, :len(pages)] = pages
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

    def _lora_inputs(self, token_reqs: list[Request | None], t: int) -> paged.LoraInputs | None:
        entries = list({r.adapter.key: r.adapter for r in token_reqs if r is not None and r.adapter}.values())
        if not entries:
            return None
        sa = _pow2(len(entries))
        slot = {e.key: i for i, e in enumerate(entries)}
        token_slot = np.full(t, -1, np.int32)
        for i, r in enumerate(token_reqs):
            if r is not None and r.adapter is not None:
                token_slot[i] = slot[r.adapter.key]
        rank = self.opts.max_lora_rank
        width = self.cfg.kv_size
        rows, ranks = {}, {}
        for module in TARGET_MODULES:
            if not any(module in e.layout.modules for e in entries):
                continue
            fin, fout = self.cfg.module_shape(module)
            a = np.zeros((sa, paged.rows_needed(rank, fin, width)), np.int32)
            b = np.zeros((sa, paged.rows_needed(rank, fout, width)), np.int32)
            rk = np.zeros(sa, np.int32)
            for i, e in enumerate(entries):
                m = e.layout.modules.get(module)
                if m is None:
                    continue
                all_rows = page_rows(self.pool.adapters[e.key], e.layout.rows, self.ps)
                a[i, :m.a_rows] = all_rows[m.a_row:m.a_row + m.a_rows]
                b[i, :m.b_rows] = all_rows[m.b_row:m.b_row + m.b_rows]
                rk[i] = m.rank
            rows[module], ranks[module] = (a, b), rk
        return paged.LoraInputs(token_slot=token_slot, rows=rows, ranks=ranks, max_rank=rank)

    def _prefill_inputs(self, chunks):
        total = sum(end - start for _, start, end in chunks)
        t = _pow2(total, 16)
        s = _pow2(len(chunks))
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
        inp = paged.StepInputs(tokens=tokens, positions=positions, kv_slot=kv_slot, token_seq=token_seq,
                               page_table=self._page_table(reqs, s), ctx_lens=ctx_lens, sample_idx=sample_idx,
                               lora=self._lora_inputs(token_reqs, t), decode=False,
                               **self._sampling_arrays(reqs, s))
        return inp, samplers

    def _decode_inputs(self, batch: list[Request]):
        s = _pow2(len(batch))
        tokens = np.zeros(s, np.int32)
        positions = np.zeros(s, np.int32)
        kv_slot = np.zeros(s, np.int32)
        ctx_lens = np.zeros(s, np.int32)
        for i, req in enumerate(batch):
            tokens[i] = req.tokens[req.num_computed]
            positions[i] = req.num_computed
            kv_slot[i] = self._kv_slots(req, positions[i:i + 1])[0]
            ctx_lens[i] = req.num_computed
        inp = paged.StepInputs(tokens=tokens, positions=positions, kv_slot=kv_slot,
                               token_seq=np.arange(s, dtype=np.int32), page_table=self._page_table(batch, s),
                               ctx_lens=ctx_lens, sample_idx=np.arange(s, dtype=np.int32),
                               lora=self._lora_inputs(batch + [None] * (s - len(batch)), s), decode=True,
                               **self._sampling_arrays(batch, s))
        return inp, set(range(len(batch)))

    def prompt_logits(self, prompts: list[list[int]], adapters: list[str | None]) -> list[np.ndarray]:
        """Logits at every prompt position, all prompts in one prefill step (engine must be idle)."""
        if self.has_unfinished():
            raise RuntimeError("prompt_logits needs an idle engine")
        params = SamplingParams(max_tokens=1, temperature=0.0)
        for p, a in zip(prompts, adapters):
            self.add_request(p, params, a, 0, ())
        saved = self.opts.max_prefill_tokens, self.opts.max_prefill_seqs, self.opts.max_num_seqs
        self.opts.max_prefill_tokens = sum(map(len, prompts))
        self.opts.max_prefill_seqs = self.opts.max_num_seqs = len(prompts)
        try:
            chunks = self._schedule_prefill()
            if len(chunks) != len(prompts):
                raise ValueError("prompts do not fit in the pool together")
            inp, _ = self._prefill_inputs(chunks)
            self.kv, logits = paged.step_all_logits(self.params, self.kv, inp, cfg=self.cfg)
            logits = np.asarray(logits)
        finally:
            self.opts.max_prefill_tokens, self.opts.max_prefill_seqs, self.opts.max_num_seqs = saved
            for req in list(self.running) + list(self.waiting):
                self.abort(req.rid)
        out, at = [], 0
        for p in prompts:
            out.append(logits[at:at + len(p)])
            at += len(p)
        return out

    # -- introspection -----------------------------------------------------------------------

    def stats(self) -> dict:
        return {
            "total_pages": self.pool.total_pages, "free_pages": self.pool.free_pages,
            "kv_pages": self.pool.kv_pages, "adapter_pages": self.pool.adapter_pages,
            "resident_adapters": len(self.pool.adapters), "running": len(self.running),
            "waiting": len(self.waiting), "page_size": self.ps, "evictions": self.pool.evictions,
            "preempted": self.num_preempted, "steps": self.step_count,
            "adapter_disk_loads": self.store.disk_loads,
        }
