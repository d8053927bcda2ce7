"""Which requests run in the next step, under the unified pool's budget (host only: no JAX).

One `Scheduler` drives the steps of the engine, or of a mock step with a simulated clock
(tests/test_scheduler.py): `plan = schedule()` (early aborts, admissions, KV growth,
preemption); the caller writes plan.loads into the pool and dispatches the step; while the device
runs it, it fills the pages of `prefetch(plan)`; then `complete(plan, results, seconds)`.
The engine instead calls `advance(plan)` right after the dispatch, which applies what the step
surely does (its K/V, a PENDING token per sampling chunk), and `complete_overlapped` once the
results are on the host, which puts the real tokens in. With async scheduling the next step is
scheduled and dispatched in between, and requests finish one step late.

Policies (fields of `EngineConfig`):
- Admission under the pool budget. A request is admitted when the KV pages of its first prefill
  chunk and its adapter's pages (nothing if the adapter is resident and held: each distinct
  adapter counts once) fit in the pages free or evictable now. When decode runs out of pages the
  newest request is preempted and recomputed later. With a `RegionPool` (the benchmark's memory
  baselines) adapter pages must fit the adapter region and KV pages the KV region (`pool.budget`).
- Order. Preempted requests first, then requests waiting past `max_wait_s` (oldest first), then
  by arrival ("fcfs", S-LoRA) or ("affinity") adapters the running batch already reads, resident
  adapters, larger adapter groups, age. A request of the first two kinds, or any under "fcfs",
  that does not fit stops admission for the step: its wait is bounded.
- Clustering. At most `max_loras` distinct adapters in the running batch; a younger request for
  another adapter waits, an older one (past max_wait_s) blocks admission until the batch drains.
- Early abort. A queued request with a time-to-first-token objective (`SamplingParams.ttft_slo`,
  else `early_abort_ttft`) is aborted at once, finish_reason "abort", when even its next possible
  prefill (predicted by the step-cost model) would end past its deadline.
- Prefetch. While a step runs, `prefetch` predicts the next admissions (a dry run of the
  admission walk) and pins their adapters (loading at most `prefetch_adapters` cold ones a step,
  from pages the next decode step does not need) until a request uses them or a schedule drops them.
- Adapter versions. A request binds to the version registered under its name when admitted, so
  a re-registered adapter's stale pages serve no later request; they are freed after their users.
- Prefix caching (`enable_prefix_caching`, prefix_cache.py). Admission starts a request's page
  table with its cached pages and its prefill after them; the budget counts only the pages it
  still takes. Its full pages join the cache as their K/V is dispatched.
- Chunked prefill. A prompt longer than a step's token budget (`max_num_batched_tokens`) is
  prefilled in chunks over consecutive steps, ahead of new admissions. A prompt that fits a step
  of its own is not split to fill what is left of a step's budget: it starts the next step whole.
  Prefill and decode do not share a step (S-LoRA).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import time
from typing import Callable

from slora_jax.config import EngineConfig
from slora_jax.engine.metrics import EngineMetrics, StepCostModel
from slora_jax.engine.pool import OutOfPages, UnifiedPool
from slora_jax.engine.prefetch import AdapterPrefetch
from slora_jax.engine.prefix_cache import cached_prefix, offer_pages
from slora_jax.request import Plan, Request, RequestOutput, top_dict

__all__ = ["Scheduler", "Request", "Plan", "StepCostModel", "PENDING", "MAX_PREFILL_SEQS"]

MAX_PREFILL_SEQS = 16  # sequences a prefill step packs at most (the prefill row bucket)
PENDING = -1  # overlapped steps: a token sampled by a step whose results are still on the device
LOOKAHEAD = 512  # waiting requests an admission walk considers, in service order


class Scheduler(AdapterPrefetch):
    """config: the EngineConfig (its scheduling fields)."""

    def __init__(self, pool: UnifiedPool, config: EngineConfig, page_size: int,
                 resolve: Callable[[str], object | None], *, clock: Callable[[], float] = time.monotonic,
                 cost: StepCostModel | None = None, metrics: EngineMetrics | None = None,
                 ready: Callable[[object], bool] | None = None):
        self.pool, self.config, self.ps, self.resolve, self.clock = pool, config, page_size, resolve, clock
        self.max_prefill_seqs = MAX_PREFILL_SEQS
        # Context pages a prefill step reads at most, unless one sequence alone has more (the
        # engine sets it to its step builder's context bucket).
        self.max_context_pages: int | None = None
        # ready(entry): False while the adapter is still read from disk; its request waits
        self.ready = ready or (lambda entry: True)
        self.cost = cost or StepCostModel()
        self.metrics = metrics or EngineMetrics()
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preempted = 0
        self.steps = 0
        self._loads: list[tuple[object, list[int]]] = []
        AdapterPrefetch.__init__(self)

    def kv_pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.ps)

    def add(self, req: Request) -> None:
        slo = req.params.ttft_slo if req.params.ttft_slo is not None else self.config.early_abort_ttft
        req.deadline = req.arrival + slo if slo is not None else None
        self.waiting.append(req)
        self.metrics.requests_added.inc()

    def abort(self, rid: str, why: str = "aborted", *, count: bool = True) -> list[RequestOutput]:
        out = []
        for req in [*self.running, *self.waiting]:
            if req.rid == rid:
                if req in self.waiting:
                    self.waiting.remove(req)
                self._finish(req, "abort", why, count=count)
                out.append(req.out)
        return out

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ----------------------------------------------------------------------------

    def schedule(self) -> Plan:
        """Decide the next step: a prefill step if anything can be (or is being) prefilled, else
        a decode step of every running request; allocate its pages."""
        self.steps += 1
        self._expire_pins()
        finished = self._early_abort()
        chunks = self._schedule_prefill(finished)
        kind = "prefill"
        if not chunks:
            kind = "decode"
            chunks = [(r, r.num_computed, r.num_computed + 1) for r in self._schedule_decode()]
        if not chunks:
            kind = "idle"
            if not any(map(self._awaited, self.running)):  # else a completion frees pages
                finished += self._unstick()
        return Plan(kind, chunks, self.pop_loads(), finished)

    @staticmethod
    def _awaited(req: Request) -> bool:
        """Overlapped steps: its last step is still on the device (a PENDING token, or the end of
        the prefill of a request that generates nothing)."""
        return req.tokens[-1] == PENDING or (not req.params.max_tokens and req.num_computed == len(req.tokens))

    @staticmethod
    def _done(req: Request) -> bool:
        """Its last token is sampled (overlapped steps: still in flight, so it is not finished yet)."""
        return req.generated >= req.params.max_tokens

    def advance(self, plan: Plan) -> None:
        """Overlapped steps: apply, as the step is dispatched, what it surely does. Every chunk's
        K/V is then in the pool, and a chunk that ends its request's known tokens samples one: a
        PENDING placeholder, which the next step reads from this step's results on the device.
        `complete_overlapped` puts the real tokens in and finishes requests afterwards."""
        for i, (req, start, end) in enumerate(plan.chunks):
            if req.out.finished:
                continue
            req.num_computed = end
            self._cache_pages(req)
            if end == len(req.tokens) and req.params.max_tokens:
                plan.pending.append((i, req, len(req.tokens)))
                req.tokens.append(PENDING)

    def complete_overlapped(self, plan: Plan, results, seconds: float | None, top=None) -> list[RequestOutput]:
        """`complete` for a step that went through `advance`: its PENDING tokens become the
        sampled ones (top: the step's top logprobs [S, 2, k], or None). A request that stops here
        may already sit in the next step (dispatched): that step's token for it is dropped. One
        preempted meanwhile keeps its token."""
        self._observe(plan, seconds)
        finished = self._prefilled_only(plan)
        results = results.tolist() if hasattr(results, "tolist") else results
        now = self.clock()
        for i, req, idx in plan.pending:
            if req.out.finished:  # aborted, or stopped by the step before
                continue
            token = int(results[i][0])
            req.tokens[idx] = token
            self._first_token(req, now)
            self._emit(req, token, float(results[i][1]), top[i] if top is not None else None)
            if req.resumed and req not in self.running and self._ends(req, token, idx + 1 - req.prompt_len):
                self.waiting.remove(req)  # preempted while this step ran, and done now
            self._finish_if_done(req, token, idx + 1 - req.prompt_len)
            if req.out.finished:
                finished.append(req.out)
        self.refresh_gauges()
        return finished

    def complete(self, plan: Plan, results, seconds: float | None, top=None) -> list[RequestOutput]:
        """Bookkeeping after the step: results[i] = (token, logprob) of chunk i (used where the
        chunk ends its request's known tokens), top[i] its top logprobs (None: not asked for);
        `seconds` feeds the cost model (None: skip)."""
        self._observe(plan, seconds)
        finished = []
        now = self.clock()
        results = results.tolist() if hasattr(results, "tolist") else results  # Python floats, once
        for i, (req, start, end) in enumerate(plan.chunks):
            if req.out.finished:  # aborted during the step
                continue
            req.num_computed = end
            self._cache_pages(req)
            if end == len(req.tokens) and not req.params.max_tokens:
                self._finish(req, "length")
                finished.append(req.out)
            elif end == len(req.tokens):
                self._first_token(req, now)
                self._append(req, int(results[i][0]), float(results[i][1]), top[i] if top is not None else None)
                if req.out.finished:
                    finished.append(req.out)
        self.refresh_gauges()
        return finished

    def _prefilled_only(self, plan: Plan) -> list[RequestOutput]:
        """Finish the requests of max_tokens=0 (prompt scoring) whose prefill ends in this step."""
        done = [req for req, _, end in plan.chunks
                if not req.params.max_tokens and end == len(req.tokens) and not req.out.finished]
        for req in done:
            if req in self.waiting:  # preempted while this step ran
                self.waiting.remove(req)
            self._finish(req, "length")
        return [req.out for req in done]

    def _observe(self, plan: Plan, seconds: float | None) -> None:
        """A completed step's metrics, and the cost model's sample."""
        m = self.metrics
        tokens = sum(end - start for _, start, end in plan.chunks)
        if seconds is not None:
            self.cost.observe(plan.kind, tokens, len(plan.chunks), seconds)
            (m.prefill_step_seconds if plan.kind == "prefill" else m.decode_step_seconds).observe(seconds)
            if plan.kind == "prefill" and plan.loads:  # an adapter's copy and scatter ran on this step's critical path
                m.prefill_load_step_seconds.observe(seconds)
        adapters = len({r.adapter.key for r in plan.requests if r.adapter is not None})
        m.batch_size.observe(len(plan.chunks))
        m.batch_adapters.observe(adapters)
        if plan.kind == "decode":
            m.decode_batch_size.observe(len(plan.chunks))
            m.decode_batch_adapters.observe(adapters)
        else:
            m.prefill_tokens.observe(tokens)
            m.prefill_context_rows.observe(sum(start > 0 for _, start, _ in plan.chunks))

    def _first_token(self, req: Request, now: float) -> None:
        if req.first_token_at is None:
            m = self.metrics
            req.first_token_at = now
            m.ttft_seconds.observe(now - req.arrival)
            if req.deadline is not None:
                (m.ttft_slo_met if now <= req.deadline else m.ttft_slo_missed).inc()

    def refresh_gauges(self) -> None:
        m, pool = self.metrics, self.pool
        kv, ad = pool.kv_pages, pool.adapter_pages
        m.queue_length.set(len(self.waiting))
        m.running.set(len(self.running))
        m.resident_adapters.set(len(pool.adapters))
        m.adapter_pages.set(ad)
        m.kv_pages.set(kv)
        m.free_pages.set(pool.free_pages)
        m.adapter_page_share.set(ad / (ad + kv) if ad + kv else 0.0)
        m.evictions.set(pool.evictions)
        base = len(pool.prefix.by_adapter.get(None, ()))
        m.prefix_cached_pages_base.set(base)
        m.prefix_cached_pages_lora.set(len(pool.prefix) - base)

    def _early_abort(self) -> list[RequestOutput]:
        """Abort the queued requests whose first token, were they admitted now, would come past
        their deadline. The next prefill step is predicted to hold the prompts of the queue's
        head, as many as there are free seats (within the step's token budget); a prompt over
        the budget takes several steps."""
        o, now = self.config, self.clock()
        seats = max(1, min(self.max_prefill_seqs, o.max_num_seqs - len(self.running)))
        head = sum(len(r.tokens) for r in itertools.islice(self.waiting, seats))
        finished, keep = [], []
        for req in self.waiting:
            if req.deadline is not None and req.first_token_at is None:
                steps = -(-len(req.tokens) // o.max_num_batched_tokens)
                eta = steps * self.cost.prefill_seconds(min(max(head, len(req.tokens)), o.max_num_batched_tokens))
                if now + eta > req.deadline:
                    slo = req.deadline - req.arrival
                    self._finish(req, "abort", f"early abort: the first token cannot come within the "
                                 f"{slo:.3g} s objective (waited {now - req.arrival:.3g} s; prefill "
                                 f"needs ~{eta:.3g} s)", early=True)
                    finished.append(req.out)
                    continue
            keep.append(req)
        if finished:
            self.waiting.clear()
            self.waiting.extend(keep)
        return finished

    # -- admission ---------------------------------------------------------------------------

    def _order(self, now: float) -> list[Request]:
        """The first LOOKAHEAD waiting requests in service order (admission looks no further)."""
        if self.config.admission_order == "fcfs":
            return list(itertools.islice(self.waiting, LOOKAHEAD))  # preempted ones are in front
        groups = collections.Counter(r.adapter_name for r in self.waiting)
        oldest: dict = {}
        for r in self.waiting:
            oldest.setdefault(r.adapter_name, r.arrival)
        batch = {r.adapter_name for r in self.running}
        resident = {name: name is None or self._resident(name) for name in groups}
        old = now - self.config.max_wait_s

        def key(r: Request):
            if r.resumed:
                return (0, 0, 0, 0, 0.0, "", r.arrival)
            if r.arrival <= old:
                return (1, 0, 0, 0, 0.0, "", r.arrival)
            n = r.adapter_name
            # groups stay together; base-model requests read no adapter, so they count as in the batch
            return (2, n is not None and n not in batch, not resident[n], -groups[n], oldest[n], n or "",
                    r.arrival)
        return heapq.nsmallest(LOOKAHEAD, self.waiting, key=key)

    def _resident(self, name: str) -> bool:
        entry = self.resolve(name)
        return entry is not None and self.pool.is_resident(entry.key)

    def _urgent(self, req: Request, now: float) -> bool:
        return req.resumed or now - req.arrival >= self.config.max_wait_s

    def _need(self, entry, end: int, hits: list[int], claimed: set) -> tuple[int, int]:
        """(KV pages, adapter pages) that admitting a request with this adapter, these cached
        pages and first chunk takes from the pool's budget: a hit on a page another request holds
        costs nothing, one on an idle cached page costs that page (it is no longer evictable)."""
        shared = self.pool.page_refs
        kv = self.kv_pages_for(end) - sum(1 for p in hits if p in shared)
        if entry is not None and entry.key not in claimed and \
                (not self.pool.is_resident(entry.key) or self.pool.is_idle(entry.key)):
            return kv, entry.layout.pages  # taken, or no longer evictable
        return kv, 0

    def _hits(self, req: Request, entry) -> list[int]:
        if not self.config.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position's logits: nothing is skipped
        return cached_prefix(self.pool, req, entry.key if entry is not None else None, self.ps, PENDING)

    def _cache_pages(self, req: Request) -> None:
        if self.config.enable_prefix_caching:
            offer_pages(self.pool, req, req.adapter.key if req.adapter is not None else None, self.ps, PENDING)

    def _context_fits(self, used: int, pages: int) -> bool:
        """Whether a chunk after `pages` pages of pooled context joins a prefill step whose chunks
        already read `used`: within max_context_pages, or the step's first context."""
        cap = self.max_context_pages
        return pages == 0 or used == 0 or cap is None or used + pages <= cap

    def _admissions(self, budget: int, nseqs: int, dry: bool, finished: list[RequestOutput] | None = None,
                    leaving: list[Request] = (), context: int = 0) -> list[tuple[Request, object, int]]:
        """Walk the queue in service order; admit what fits this step (dry: only predict it, as
        if the `leaving` requests had finished). `context`: pages of pooled context the step's
        chunks read already."""
        o, pool, now = self.config, self.pool, self.clock()
        fcfs = o.admission_order == "fcfs"
        gone_ids = set(map(id, leaving))
        staying = [r for r in self.running if id(r) not in gone_ids]
        batch = {r.adapter.key for r in staying if r.adapter is not None}
        claimed: set = set()            # dry run: adapters already counted
        avail = pool.budget(sum(len(pool.kv.get(r.rid, ())) for r in leaving))
        running = len(staying)
        out, gone = [], []
        for req in self._order(now):
            if budget <= 0 or nseqs >= self.max_prefill_seqs or running >= o.max_num_seqs:
                break
            urgent = self._urgent(req, now)
            name = req.adapter_name
            entry = self.resolve(name) if name is not None else None
            if name is not None and entry is None:
                if not dry:
                    self._finish(req, "abort", f"adapter {name!r} was unloaded")
                    finished.append(req.out)
                    gone.append(req)
                continue
            key = entry.key if entry is not None else None
            if key is not None and (staying or out) and not pool.is_resident(key) and not self.ready(entry):
                continue  # its disk read is still running: the step goes on without it
            if key is not None and key not in batch and len(batch) >= o.max_loras:
                if urgent:
                    break  # the batch drains until this request's adapter fits
                continue
            hits = self._hits(req, entry)
            if not self._context_fits(context, len(hits)):
                break  # its cached prefix would widen the step's context: it starts the next step
            start = len(hits) * self.ps
            end = min(len(req.tokens), start + budget)
            if end < len(req.tokens) and (out or nseqs) and len(req.tokens) - start <= o.max_num_batched_tokens:
                break  # a prompt that fits a step of its own starts the next one, whole
            kv, ad = self._need(entry, end, hits, claimed)
            fits = avail.fits(kv, ad)
            if not fits and not dry and (fcfs or urgent) and self.drop_pins():
                avail = pool.budget()
                kv, ad = self._need(entry, end, hits, claimed)
                fits = avail.fits(kv, ad)
            if not fits:
                if fcfs or urgent:
                    break  # nobody younger takes the pages this request waits for
                continue
            if dry:
                avail.take(kv, ad)
                claimed.add(key)
            else:
                req.adapter = entry
                pool.share_kv(req.rid, hits)  # first: the loads below may evict idle cached pages
                req.num_computed, req.pages_cached = start, len(hits)
                if not self.take_adapter(req) or not self.grow(req, end):
                    self.release(req)
                    req.num_computed = 0
                    break
                if req.out.num_cached_tokens is None:  # a preempted request keeps its first count
                    req.out.num_cached_tokens = start
                if o.enable_prefix_caching:
                    self.metrics.prefix_cache_queries.inc(len(req.tokens))
                    self.metrics.prefix_cache_hits.inc(start)
                avail = pool.budget()
            if key is not None:
                batch.add(key)
            budget -= end - start
            context += len(hits)
            nseqs += 1
            running += 1
            out.append((req, entry, end))
        if not dry and (out or gone):
            taken = {id(r) for r, _, _ in out} | {id(r) for r in gone}
            keep = [r for r in self.waiting if id(r) not in taken]
            self.waiting.clear()
            self.waiting.extend(keep)
            for req, _, _ in out:
                self.running.append(req)
        return out

    def _schedule_prefill(self, finished: list[RequestOutput]) -> list[tuple[Request, int, int]]:
        """Prefill chunks for this step, within its token budget."""
        budget = self.config.max_num_batched_tokens
        chunks = []
        stuck = False
        context = 0  # pages of pooled context the step's chunks read
        # Requests part-way through a chunked prefill go first.
        for req in self.running:
            if req.num_computed < len(req.tokens) - 1 and budget > 0 and len(chunks) < self.max_prefill_seqs:
                pages = self.kv_pages_for(req.num_computed)
                if not self._context_fits(context, pages):
                    continue  # it goes on in the next step
                end = min(len(req.tokens), req.num_computed + budget)
                if not self.grow(req, end):
                    stuck = True
                    break
                chunks.append((req, req.num_computed, end))
                budget -= end - req.num_computed
                context += pages
        if not stuck and self.waiting:
            chunks += [(req, req.num_computed, end)  # num_computed: the tokens served from the cache
                       for req, _, end in self._admissions(budget, len(chunks), False, finished, context=context)]
        return chunks

    def _schedule_decode(self) -> list[Request]:
        batch = []
        running = set(map(id, self.running))
        for req in list(self.running):
            if id(req) not in running or req.num_computed != len(req.tokens) - 1 or self._done(req):
                continue  # preempted below to make room, still in prefill, or sampling its last token
            while not self.grow(req, req.num_computed + 1):
                if self.drop_pins():
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                running.discard(id(victim))
                if victim is req:
                    break
            if id(req) in running:
                batch.append(req)
        return batch

    def _unstick(self) -> list[RequestOutput]:
        """Nothing could be scheduled: free pages (prefetch pins, then the newest request), or
        abort what cannot run even alone."""
        if not self.waiting and not self.running:
            return []
        if self.drop_pins():
            return []
        if len(self.running) > 1:
            self._preempt(self.running[-1])
            return []
        if self.running:
            req = self.running[0]
        else:
            req = self._order(self.clock())[0]
            self.waiting.remove(req)
        self._finish(req, "abort", "not enough free pages for this request even with nothing else running")
        return [req.out]

    # -- pages -------------------------------------------------------------------------------

    def take_adapter(self, req: Request) -> bool:
        """Take a reference on the request's adapter, allocating (and queuing a load of) its
        pages if it is not resident."""
        if req.adapter is None:
            return True
        key = req.adapter.key
        try:
            pages, newly = self.pool.acquire_adapter(key, req.adapter.layout.pages)
        except OutOfPages:
            return False
        req.holds_adapter = True
        self._prefetched.pop(key, None)  # its pin passed to this request
        if newly:
            self._loads.append((req.adapter, pages))
            self.metrics.prefetch_misses.inc()
            self._prefetch_loaded.discard(key)
        elif key in self._prefetch_loaded:
            self._prefetch_loaded.discard(key)
            self.metrics.prefetch_hits.inc()
        return True

    def load_failed(self, entry, why: str) -> list[RequestOutput]:
        """An adapter's pages could not be filled: abort the requests that took it (they were
        admitted with the load), drop a prefetch pin, and free the unfilled pages so that the
        next request for it loads it afresh."""
        key = entry.key
        out = []
        for req in [r for r in self.running if r.holds_adapter and r.adapter.key == key]:
            self._finish(req, "abort", why)
            out.append(req.out)
        if key in self._prefetched:
            self._prefetched.pop(key)
            self.pool.unpin_adapter(key)
        self._prefetch_loaded.discard(key)
        if self.pool.is_resident(key) and not self.pool.refs.get(key):
            self.pool.discard_adapter(key)
        return out

    def pop_loads(self) -> list[tuple[object, list[int]]]:
        loads, self._loads = self._loads, []
        return loads

    def grow(self, req: Request, n_tokens: int) -> bool:
        need = self.kv_pages_for(n_tokens) - len(self.pool.kv.get(req.rid, ()))
        if need <= 0:
            return True
        try:
            self.pool.grow_kv(req.rid, need)
            return True
        except OutOfPages:
            return False

    def release(self, req: Request) -> None:
        self._cache_pages(req)
        self.pool.free_kv(req.rid)
        req.pages_cached = 0
        if req.holds_adapter:
            self.pool.release_adapter(req.adapter.key)
            req.holds_adapter = False

    def _preempt(self, req: Request) -> None:
        """Give back everything and queue the request first in line; it is recomputed later."""
        self.running.remove(req)
        self.release(req)
        req.num_computed = 0
        req.resumed = True
        self.waiting.appendleft(req)
        self.num_preempted += 1
        self.metrics.requests_preempted.inc()

    def _append(self, req: Request, token: int, logprob: float, top=None) -> None:
        req.tokens.append(token)
        self._emit(req, token, logprob, top)
        self._finish_if_done(req, token, req.generated)

    @staticmethod
    def _ends(req: Request, token: int, generated: int) -> bool:
        return token in req.stops or generated >= req.params.max_tokens

    def _finish_if_done(self, req: Request, token: int, generated: int) -> None:
        """Finish a request whose `generated`-th token is `token`, if that ends it."""
        if self._ends(req, token, generated):
            self._finish(req, "stop" if token in req.stops else "length")

    def _emit(self, req: Request, token: int, logprob: float, top=None) -> None:
        req.out.token_ids.append(token)
        self.metrics.tokens_generated.inc()
        if req.out.logprobs is not None:
            req.out.logprobs.append(logprob)
        if req.out.top_logprobs is not None and top is not None:
            req.out.top_logprobs.append(top_dict(top, req.params.num_top_logprobs, token, logprob))

    def _finish(self, req: Request, reason: str, why: str | None = None, *, early: bool = False,
                count: bool = True) -> None:
        req.out.finish_reason, req.out.abort_reason = reason, why
        if req in self.running:
            self.running.remove(req)
            self.release(req)
        if not count:
            return
        m = self.metrics
        m.requests_finished.inc()
        if reason == "abort":
            m.requests_aborted.inc()
            if early:
                m.requests_early_aborted.inc()
            if req.deadline is not None and req.first_token_at is None:
                m.ttft_slo_missed.inc()
