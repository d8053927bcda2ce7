"""Scheduling policies (slora_jax/engine/scheduler.py), driven by a mock step on a simulated clock.

No accelerator and no device work: `Sim` plays the device. It owns a `Scheduler` over a real
`UnifiedPool`, charges each step a time from a step-cost model (prefill: per token; decode: per
sequence and per distinct adapter read; an adapter load on the critical path adds its copy time,
a prefetched one overlaps the step), remembers which adapter version every page holds, and
checks on every step that each request reads pages holding exactly the version it was admitted
with. Workloads are S-LoRA-style traces (power-law adapter popularity, gamma arrivals) from a
fixed seed, so every number here is deterministic.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from slora_jax.engine.adapter_store import AdapterEntry
from slora_jax.model.layout import AdapterLayout
from slora_jax.engine.pool import UnifiedPool
from slora_jax.request import RequestOutput
from slora_jax.sampling import SamplingParams
from slora_jax.config import EngineConfig
from slora_jax.engine.scheduler import Request, Scheduler, StepCostModel

PAGE = 16


@dataclasses.dataclass
class Cost:
    """The mock device: seconds per step."""
    prefill_base: float = 0.010
    prefill_token: float = 0.0001
    decode_base: float = 0.010
    decode_seq: float = 0.0005
    decode_adapter: float = 0.001   # each distinct adapter's weights are read once per step
    load: float = 0.030             # one adapter's host->device copy

    def step(self, plan) -> float:
        if plan.kind == "prefill":
            return self.prefill_base + self.prefill_token * sum(e - s for _, s, e in plan.chunks)
        adapters = {r.adapter.key for r in plan.requests if r.adapter is not None}
        return self.decode_base + self.decode_seq * len(plan.chunks) + self.decode_adapter * len(adapters)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclasses.dataclass
class Arrival:
    t: float
    prompt: int
    output: int
    adapter: str | None
    slo: float | None = None


class Sim:
    def __init__(self, pool_pages=4096, adapters=(), adapter_pages=4, cost=None, **opts):
        self.clock = Clock()
        self.cost = cost or Cost()
        self.pool = UnifiedPool(pool_pages)
        self.entries: dict[str, AdapterEntry] = {}
        self.version = 0
        for name in adapters:
            self.register(name, adapter_pages)
        self.sched = Scheduler(self.pool, EngineConfig(**opts), PAGE, self.entries.get,
                               clock=self.clock, cost=StepCostModel())
        self.page_holds: dict[int, tuple] = {}     # what the mock device's pages hold
        self.bound: dict[int, tuple] = {}          # id(request) -> adapter key it was admitted with
        self.requests: list[Request] = []
        self.batches: list = []                    # (kind, n seqs, distinct adapters)
        self.prefill_load_steps = 0                # prefill steps that paged an adapter in first
        self.hook = None                           # called after each prefetch (mid-step)

    def register(self, name: str, pages: int = 4) -> AdapterEntry:
        """Register (or re-register: a new version) like LLM.load_adapter does."""
        self.version += 1
        old = self.entries.get(name)
        entry = AdapterEntry(name, f"/mock/{name}", self.version, AdapterLayout({}, pages * 2 * PAGE, pages),
                             ("mock", name, self.version))
        self.entries[name] = entry
        if old is not None:
            self.pool.drop_adapter(old.key)
        return entry

    def add(self, a: Arrival) -> Request:
        params = SamplingParams(max_tokens=a.output, temperature=0.0, ignore_eos=True, ttft_slo=a.slo)
        rid = f"r{len(self.requests)}"
        prompt = [3 + len(self.requests)] + [1] * (a.prompt - 1)  # distinct first tokens: no shared prefix
        req = Request(rid, list(prompt), a.prompt, params, 0, self.entries[a.adapter] if a.adapter else None,
                      RequestOutput(rid, prompt, adapter=a.adapter), frozenset(), self.clock())
        req.cold = a.adapter is not None and not self.pool.is_resident(self.entries[a.adapter].key)
        self.sched.add(req)
        self.requests.append(req)
        return req

    def _write(self, loads):
        for entry, pages in loads:
            for p in pages:
                self.page_holds[p] = entry.key

    def step(self) -> None:
        s = self.sched
        plan = s.schedule()
        self._write(plan.loads)
        if not plan.chunks:
            return
        for r, start, _ in plan.chunks:
            if r.adapter is None:
                continue
            if start == 0:  # (re-)admitted by this schedule: bound to the version registered now
                assert r.adapter.key == self.entries[r.adapter_name].key, f"{r.rid} admitted on a stale version"
                self.bound[id(r)] = r.adapter.key
            assert r.adapter.key == self.bound[id(r)], "a request changed adapter version mid-flight"
            held = [self.page_holds.get(p) for p in self.pool.adapters[r.adapter.key]]
            assert held == [r.adapter.key] * len(held), f"{r.rid} reads {held}, wants {r.adapter.key}"
        self.batches.append((plan.kind, len(plan.chunks),
                             len({r.adapter.key for r in plan.requests if r.adapter is not None})))
        self.prefill_load_steps += plan.kind == "prefill" and bool(plan.loads)
        busy = self.cost.step(plan)
        critical = self.cost.load * len(plan.loads)    # loaded before the step could start
        pre = s.prefetch(plan)
        self._write(pre)
        if self.hook:
            self.hook(self)
        overlapped = self.cost.load * len(pre)         # copies run beside the step
        self.clock.t += critical + max(busy, overlapped)
        results = np.ones((len(plan.chunks), 2), np.float32)
        s.complete(plan, results, busy)
        if len(self.batches) % 32 == 0:
            self.pool.check()

    def run(self, arrivals: list[Arrival], max_steps: int = 200_000) -> "Sim":
        arrivals = sorted(arrivals, key=lambda a: a.t)
        i = 0
        for _ in range(max_steps):
            while i < len(arrivals) and arrivals[i].t <= self.clock.t:
                self.add(arrivals[i])
                i += 1
            if self.sched.has_unfinished():
                self.step()
            elif i < len(arrivals):
                self.clock.t = arrivals[i].t
            else:
                break
        else:
            raise AssertionError("the simulation did not finish")
        for r in self.requests:
            assert r.out.finished, r.rid
        self.pool.check()
        assert not self.pool.kv and not any(self.pool.refs.values())
        return self

    # -- measures ------------------------------------------------------------------------------

    def ttft(self, r: Request) -> float | None:
        return None if r.first_token_at is None else r.first_token_at - r.arrival

    def attainment(self, slo: float) -> float:
        ok = [r for r in self.requests if r.out.finish_reason != "abort" and self.ttft(r) <= slo]
        return len(ok) / len(self.requests)

    def makespan(self) -> float:
        return self.clock.t


def trace(n, rate, *, cv=1.0, adapters=0, alpha=1.0, prompt=(8, 64), output=(8, 32), seed=0, slo=None):
    """S-LoRA's trace shape: adapter int(n * power(alpha)), uniform lengths, gamma arrivals."""
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(1 / cv**2, cv**2 / rate, n)
    t = np.cumsum(gaps) - gaps[0]
    ids = (adapters * rng.power(alpha, n)).astype(int) if adapters else [None] * n
    return [Arrival(float(t[i]), int(rng.integers(*prompt)), int(rng.integers(*output)),
                    None if ids[i] is None else f"a{ids[i]}", slo) for i in range(n)]


# --------------------------------------------------------------------------------------------
# early abort


SLO = 1.0


@functools.lru_cache
def capacity(max_num_seqs: int) -> float:
    """Requests per second the mock serves when saturated (everything queued at t=0)."""
    sim = Sim(max_num_seqs=max_num_seqs).run([dataclasses.replace(a, t=0.0) for a in trace(200, 1.0, seed=1)])
    return len(sim.requests) / sim.makespan()


@pytest.mark.parametrize("cv", [1.0, 4.0, 8.0])
def test_early_abort_keeps_slo_attainment_under_2x_overload(cv):
    arrivals = trace(400, 2 * capacity(16), cv=cv, seed=2)
    fcfs = Sim(max_num_seqs=16).run(arrivals)
    abort = Sim(max_num_seqs=16, early_abort_ttft=SLO).run(arrivals)
    a_fcfs, a_abort = fcfs.attainment(SLO), abort.attainment(SLO)
    assert a_abort > 2 * a_fcfs, (a_abort, a_fcfs)
    if cv == 1.0:  # at 2x overload about half the requests can be served at all
        assert a_fcfs < 0.3 and a_abort > 0.45, (a_abort, a_fcfs)
    aborted = [r for r in abort.requests if r.out.finish_reason == "abort"]
    assert aborted and all(r.out.abort_reason.startswith("early abort") for r in aborted)
    assert all(r.first_token_at is None for r in aborted)
    assert abort.sched.metrics.requests_early_aborted.value == len(aborted)
    # What the engine still serves, it serves in time.
    served = [r for r in abort.requests if r.out.finish_reason != "abort"]
    assert sum(abort.ttft(r) <= SLO for r in served) / len(served) > 0.95


def test_no_abort_without_overload():
    sim = Sim(max_num_seqs=16, early_abort_ttft=SLO).run(trace(200, 0.5 * capacity(16), seed=3))
    assert sim.attainment(SLO) > 0.97
    assert sim.sched.metrics.requests_aborted.value <= 3


def test_request_objective_overrides_engine_default():
    sim = Sim(max_num_seqs=1, early_abort_ttft=100.0)
    arrivals = [Arrival(0.0, 32, 200, None), Arrival(0.0, 32, 8, None, slo=0.5), Arrival(0.0, 32, 8, None)]
    sim.run(arrivals)
    reasons = [r.out.finish_reason for r in sim.requests]
    assert reasons == ["length", "abort", "length"]
    # Aborted as soon as its deadline could no longer be met, not when the queue reached it.
    assert sim.requests[1].out.abort_reason and sim.sched.metrics.ttft_slo_missed.value == 1


# --------------------------------------------------------------------------------------------
# clustering and order


def test_clustering_lowers_distinct_adapters_per_batch():
    arrivals = [dataclasses.replace(a, t=0.0) for a in trace(200, 1.0, adapters=32, alpha=1.0, seed=4)]
    names = sorted({a.adapter for a in arrivals})

    def run(cap, order):
        return Sim(adapters=names, max_num_seqs=16, max_loras=cap, admission_order=order,
                   max_wait_s=1e9).run(arrivals)

    def distinct(sim):
        return np.mean([d for kind, _, d in sim.batches if kind == "decode"])

    free = run(64, "fcfs")
    for order in ("fcfs", "affinity"):
        capped = run(2, order)
        assert max(d for _, _, d in capped.batches) <= 2
        assert distinct(capped) < 0.5 * distinct(free), (distinct(capped), distinct(free))
        # The batch stays full: reading fewer adapters per step costs little throughput here.
        assert capped.makespan() < 1.3 * free.makespan()
    # Affinity groups requests for the same adapter: fewer adapter loads than FCFS.
    small_pool = dict(pool_pages=1 + 16 * 4 + 16 * 6, adapters=names, max_num_seqs=16)
    f = Sim(**small_pool, admission_order="fcfs").run(arrivals)
    a = Sim(**small_pool, admission_order="affinity", max_wait_s=1e9).run(arrivals)
    assert a.sched.metrics.prefetch_misses.value + a.sched.metrics.prefetch_hits.value \
        < f.sched.metrics.prefetch_misses.value + f.sched.metrics.prefetch_hits.value


@pytest.mark.parametrize("order", ["fcfs", "affinity"])
def test_no_starvation_with_one_adapter_slot(order):
    """A stream for adapter "hot" keeps the one adapter slot busy; one request for "cold" still
    gets in within about max_wait_s (plus draining the batch), not after the stream ends."""
    stream = [Arrival(0.1 * i, 16, 24, "hot") for i in range(150)]
    lone = Arrival(0.55, 16, 8, "cold")

    def run(max_wait):
        sim = Sim(adapters=["hot", "cold"], max_num_seqs=8, max_loras=1,
                  admission_order=order, max_wait_s=max_wait).run(stream + [lone])
        return sim, next(r for r in sim.requests if r.adapter_name == "cold")

    drain = 24 * 0.015 + 0.1  # the longest running request's decode steps, and a prefill
    sim, cold = run(1.0)
    assert 1.0 <= sim.ttft(cold) < 1.0 + drain, sim.ttft(cold)
    assert max(sim.ttft(r) for r in sim.requests) < 1.0 + drain
    starved, cold = run(1e9)
    assert starved.ttft(cold) > 10.0  # without the bound it waits for the whole stream


def test_affinity_prefers_the_batch_then_resident_then_larger_groups_then_age():
    sim = Sim(adapters=["w", "x", "y", "z"], max_num_seqs=1, admission_order="affinity", max_wait_s=1e9)
    done = sim.add(Arrival(0, 8, 1, "w"))
    sim.step()  # "w" ran and finished: resident (cached), not in the batch
    assert done.out.finished and sim.pool.is_resident(sim.entries["w"].key)
    first = sim.add(Arrival(0, 8, 4, "z"))
    sim.step()  # "z" is now resident and running
    order = [sim.add(Arrival(0, 8, 4, n)) for n in ["x", "w", "y", "x", "y", "y", "z", None]]
    sim.clock.t = 0.01
    ranked = sim.sched._order(sim.clock())
    assert first not in ranked
    # the batch's adapter and the base model (no adapter to read) first, then the resident "w"
    # (older than "z"'s request: by residency alone it would go first), then groups by size
    assert [r.adapter_name for r in ranked] == [None, "z", "w", "y", "y", "y", "x", "x"]
    assert ranked[3:6] == [order[2], order[4], order[5]]  # by age within a group


# --------------------------------------------------------------------------------------------
# memory budget


def test_admission_on_pages_needed_now_preempts_on_shortage_and_finishes_all():
    """Admission takes the pages a request needs now, not its worst case: a small pool admits more
    than it can grow, decode preempts (and later recomputes) the newest, and every request ends."""
    arrivals = [dataclasses.replace(a, t=0.0) for a in trace(100, 1.0, adapters=4, prompt=(16, 128),
                                                            output=(16, 96), seed=5)]
    names = sorted({a.adapter for a in arrivals})
    pages = 1 + 4 * 4 + 40  # adapters + about 8 requests' worst case
    sim = Sim(pool_pages=pages, adapters=names, max_num_seqs=32).run(arrivals)
    assert sim.sched.num_preempted > 0
    assert all(r.out.finish_reason == "length" for r in sim.requests)


def test_admission_counts_each_distinct_adapter_once():
    # Room for one adapter (8 pages) and four single-page requests: the four requests for "a"
    # are admitted together; a request for "b" (8 more pages) is not.
    sim = Sim(pool_pages=1 + 8 + 4, adapters=["a", "b"], adapter_pages=8, max_num_seqs=8, prefetch_adapters=0)
    for n in ["a", "a", "b", "a", "a"]:
        sim.add(Arrival(0, 8, 4, n))
    plan = sim.sched.schedule()
    assert [r.adapter_name for r in plan.requests] == ["a", "a"]  # FCFS: "b" blocks the rest
    sim2 = Sim(pool_pages=1 + 8 + 4, adapters=["a", "b"], adapter_pages=8, max_num_seqs=8,
               admission_order="affinity", max_wait_s=1e9)
    for n in ["a", "a", "b", "a", "a"]:
        sim2.add(Arrival(0, 8, 4, n))
    plan = sim2.sched.schedule()
    assert [r.adapter_name for r in plan.requests] == ["a"] * 4
    assert len(plan.loads) == 1


def test_chunked_prefill_splits_long_prompts():
    sim = Sim(max_num_batched_tokens=64, max_num_seqs=4)
    sim.run([Arrival(0, 200, 4, None), Arrival(0, 10, 4, None)])
    prefills = [n for kind, n, _ in sim.batches if kind == "prefill"]
    assert len(prefills) >= 4  # 200 tokens in chunks of <= 64
    assert all(r.out.finish_reason == "length" and r.generated == 4 for r in sim.requests)


def test_prompts_that_fit_a_step_are_not_split():
    """Prompts of 40, 40 and 100 tokens, 64 a step. The second 40 starts the next step whole (its
    remaining 24 tokens of budget stay unused) and only the 100, longer than any step, is chunked."""
    sim = Sim(max_num_batched_tokens=64, max_num_seqs=4)
    for n in (40, 40, 100):
        sim.add(Arrival(0, n, 2, None))
    chunks = []
    for _ in range(100):
        if not sim.sched.has_unfinished():
            break
        plan = sim.sched.schedule()
        if plan.kind == "prefill":
            chunks.append([(len(r.tokens), a, b) for r, a, b in plan.chunks])
        sim.sched.complete(plan, np.zeros((len(plan.chunks), 2), np.float32), None)
    assert chunks[:4] == [[(40, 0, 40)], [(40, 0, 40), (100, 0, 24)], [(100, 24, 88)], [(100, 88, 100)]]


def test_never_hangs_under_heavy_overload():
    arrivals = trace(800, 500.0, cv=8.0, adapters=64, alpha=0.5, prompt=(8, 256), output=(8, 128), seed=6,
                     slo=0.5)
    sim = Sim(pool_pages=1 + 64 + 200, adapters=sorted({a.adapter for a in arrivals}), adapter_pages=4,
              max_num_seqs=32, max_loras=8, admission_order="affinity").run(arrivals)
    reasons = {r.out.finish_reason for r in sim.requests}
    assert reasons <= {"length", "abort"} and "abort" in reasons


# --------------------------------------------------------------------------------------------
# prefetch


def test_prefetch_hides_cold_load_time():
    arrivals = trace(400, 0.9 * capacity(16), adapters=200, alpha=0.3, seed=7)
    names = sorted({a.adapter for a in arrivals})
    opts = dict(pool_pages=1 + 40 * 4 + 200, adapters=names, max_num_seqs=16)
    off = Sim(**opts, prefetch_adapters=0).run(arrivals)
    on = Sim(**opts).run(arrivals)
    m = on.sched.metrics
    assert m.prefetch_hits.value > 0.3 * (m.prefetch_hits.value + m.prefetch_misses.value)
    assert off.sched.metrics.prefetch_hits.value == 0

    def cold_ttft(sim):
        return np.mean([sim.ttft(r) for r in sim.requests if r.cold])
    def warm_ttft(sim):
        return np.mean([sim.ttft(r) for r in sim.requests if not r.cold])
    assert cold_ttft(on) < 0.8 * cold_ttft(off)
    assert cold_ttft(on) < 1.2 * warm_ttft(on)  # cold stays close to warm
    assert on.makespan() <= off.makespan()


def test_prefetched_adapter_is_not_evicted_until_used():
    sim = Sim(pool_pages=1 + 3 * 4 + 8, adapters=["a", "b", "c"], max_num_seqs=1)
    sim.add(Arrival(0, 8, 3, "a"))
    sim.add(Arrival(0, 8, 3, "b"))
    s = sim.sched
    plan = s.schedule()                             # "a" runs, "b" waits for the one seat
    assert [r.adapter_name for r in plan.requests] == ["a"]
    assert [e.name for e, _ in s.prefetch(plan)] == []   # "a" does not finish in this step
    s.complete(plan, np.ones((1, 2)), 0.01)
    plan = s.schedule()
    assert [e.name for e, _ in s.prefetch(plan)] == []
    s.complete(plan, np.ones((1, 2)), 0.01)
    plan = s.schedule()                             # "a"'s last token: "b" is predicted next
    pre = s.prefetch(plan)
    assert [e.name for e, _ in pre] == ["b"]
    b = sim.entries["b"].key
    assert b in sim.pool.pins and not sim.pool.is_idle(b)
    assert sim.pool.evictable_pages() == 0          # "b" is pinned, "a" is held
    sim._write(pre)
    s.complete(plan, np.ones((1, 2)), 0.01)
    assert sim.pool.evictable_pages() == 4          # "a" is idle now; "b" still pinned
    plan = s.schedule()
    assert [r.adapter_name for r in plan.requests] == ["b"] and not plan.loads
    assert not sim.pool.pins and s.metrics.prefetch_hits.value == 1


def test_prefetch_never_serves_stale_weights_after_reregistration():
    """Re-register adapters while their prefetch copies are in flight (between prefetch and the
    end of the step): the requests admitted afterwards bind to the new version and read pages
    holding it; running requests keep the version they started with; every stale page is freed."""
    arrivals = trace(300, 1.2 * capacity(8), adapters=40, alpha=0.5, seed=8)
    names = sorted({a.adapter for a in arrivals})
    sim = Sim(pool_pages=1 + 15 * 4 + 60, adapters=names, max_num_seqs=8)  # room for 15 adapters
    rereg = []

    def hook(s):
        pinned = [k for k in s.pool.pins if s.entries[k[0]].key == k and k in s.sched._prefetch_loaded]
        if pinned and len(rereg) < 40:
            name = pinned[0][0]
            rereg.append((s.entries[name].key, s.register(name).key))

    sim.hook = hook
    sim.run(arrivals)  # Sim.step checks every admission's version and every page read
    assert len(rereg) == 40
    stale = {old for old, _ in rereg}
    assert not (stale & set(sim.pool.adapters)), "a stale version still holds pages"
    on_new = [r for r in sim.requests if sim.bound.get(id(r)) in {new for _, new in rereg}]
    assert len(on_new) >= 40, "requests waiting for a re-registered adapter ran on its new version"
    assert not sim.pool.pins
    assert sim.sched.metrics.prefetch_dropped.value >= len(rereg)


# --------------------------------------------------------------------------------------------
# metrics


def test_metrics_count_what_happened():
    arrivals = trace(120, 2 * capacity(8), adapters=8, seed=9, slo=0.5)
    sim = Sim(pool_pages=1 + 4 * 4 + 40, adapters=sorted({a.adapter for a in arrivals}), max_num_seqs=8).run(arrivals)
    m, reqs = sim.sched.metrics, sim.requests
    aborted = [r for r in reqs if r.out.finish_reason == "abort"]
    assert m.requests_added.value == m.requests_finished.value == len(reqs)
    assert m.requests_aborted.value == m.requests_early_aborted.value == len(aborted) > 0
    assert m.tokens_generated.value == sum(len(r.out.token_ids) for r in reqs)
    assert m.ttft_seconds.count == len(reqs) - len(aborted)
    assert m.ttft_slo_met.value + m.ttft_slo_missed.value == len(reqs)
    assert m.requests_preempted.value == sim.sched.num_preempted
    assert m.batch_size.count == len(sim.batches)
    assert m.queue_length.value == m.running.value == m.kv_pages.value == 0
    assert m.evictions.value == sim.pool.evictions > 0
    assert m.prefetch_hits.value + m.prefetch_misses.value > 0
    assert 0 < m.prefill_load_step_seconds.count == sim.prefill_load_steps < m.prefill_step_seconds.count
    snap = m.snapshot()
    assert snap["ttft_seconds_count"] == m.ttft_seconds.count and snap["ttft_seconds_p50"] <= snap["ttft_seconds_p99"]
    assert all(isinstance(v, (int, float)) for v in snap.values())


def test_prefill_metrics_count_prompt_tokens_and_rows_after_context():
    """prefill_tokens sums every prompt token computed (each once: no preemption, no cache);
    prefill_context_rows counts the chunks that start after context in the pool, here the later
    chunks of prompts longer than a step's token budget."""
    arrivals = [dataclasses.replace(a, t=0.0) for a in trace(24, 1.0, prompt=(8, 90), seed=4)]
    sim = Sim(max_num_seqs=8, max_num_batched_tokens=64)
    plans, schedule = [], sim.sched.schedule
    sim.sched.schedule = lambda: plans.append(schedule()) or plans[-1]
    sim.run(arrivals)
    m = sim.sched.metrics
    later = sum(start > 0 for p in plans if p.kind == "prefill" for _, start, _ in p.chunks)
    assert m.prefill_tokens.sum == sum(a.prompt for a in arrivals) and sim.sched.num_preempted == 0
    assert m.prefill_context_rows.sum == later > 0
    assert m.prefill_tokens.count == m.prefill_context_rows.count == sum(p.kind == "prefill" for p in plans)


def test_histogram_buckets():
    from slora_jax.engine.metrics import Histogram
    h = Histogram("x", (1.0, 2.0, 4.0))
    for v in (0.5, 1.0, 1.5, 3.0, 10.0):
        h.observe(v)
    assert h.cumulative() == [(1.0, 2), (2.0, 3), (4.0, 4), (float("inf"), 5)]
    assert h.quantile(0.5) == 2.0 and h.quantile(1.0) == float("inf") and h.mean == 3.2


