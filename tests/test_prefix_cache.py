"""Prefix caching (slora_jax/engine/prefix_cache.py, the pool's shared pages, the scheduler's
admission after cache hits) on the "tiny" model in float32.

Every engine test runs the same requests with caching off and on in one LLM (the scheduler's
config toggled, so the step shapes compile once) and asserts the outputs equal: identical greedy
tokens, logprobs within 1e-5. Caching off is the reference; the hit counters prove the cached run
did skip work, so a test cannot pass by never hitting. The pool tests drive the host allocator
alone, with planted bugs that its checks must catch.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slora_jax import LLM, SamplingParams
from slora_jax.engine import prefix_cache
from slora_jax.engine.pool import OutOfPages, RegionPool, UnifiedPool
from slora_jax.model.config import load_model_config
from slora_jax.model.peft import random_peft_adapter

CFG = load_model_config("tiny")
PS = 4
SP = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, ignore_eos=True)
_rng = np.random.default_rng(7)


def toks(n: int) -> list[int]:
    return [int(t) for t in _rng.integers(3, CFG.vocab_size, n)]


SYSTEM = toks(13)   # three full pages and one token at page size 4


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"a": random_peft_adapter(root / "a", CFG, rank=8, targets="all-linear", seed=1),
            "b": random_peft_adapter(root / "b", CFG, rank=4, targets=["q_proj", "v_proj"], seed=2),
            "a2": random_peft_adapter(root / "a2", CFG, rank=8, targets="all-linear", seed=11)}


def make_llm(paths, **options):
    options = {"page_size": PS, "pool_pages": 96, "max_num_batched_tokens": 64, **options}
    return LLM("tiny", adapters={"a": paths["a"], "b": paths["b"]}, dtype="float32",
               enable_prefix_caching=True, **options)


@pytest.fixture(scope="module")
def llm(paths):
    return make_llm(paths)


def caching(llm, on: bool) -> None:
    llm.engine.sched.config = llm.engine.config.replace(enable_prefix_caching=on)


def run(llm, prompts, names, on: bool, params=SP):
    caching(llm, on)
    try:
        outs = llm.generate(prompts, params, adapter=names)
    finally:
        caching(llm, True)
    llm.engine.pool.check()
    return outs


def hits(llm) -> tuple[float, float]:
    pc = llm.stats()["prefix_cache"]
    return pc["queries"], pc["hits"]


def assert_same(outs, expected):
    assert len(outs) == len(expected)
    for k, (o, r) in enumerate(zip(outs, expected)):
        assert o.token_ids == r.token_ids, f"request {k} (adapter {o.adapter})"
        np.testing.assert_allclose(o.logprobs, r.logprobs, atol=1e-5, rtol=0, err_msg=f"request {k}")


def assert_drained(llm):
    s = llm.stats()
    assert s["running"] == s["waiting"] == s["kv_pages"] == 0
    assert s["free_pages"] + s["adapter_pages"] + s["prefix_cache"]["cached_pages"] == s["total_pages"]
    llm.engine.pool.check()


def test_shared_system_prompt_mixed_batch(llm):
    """One system prompt under two adapters and the base, in mixed batches: the second batch
    serves each row's system prompt pages from its own adapter's cache."""
    names = ["a", None, "b", "a", None, "b"]
    first = [SYSTEM + toks(n) for n in (3, 5, 2, 6, 1, 4)]
    second = [SYSTEM + toks(n) for n in (4, 2, 7, 3, 5, 1)]
    expected = run(llm, first + second, names + names, on=False)
    q0, h0 = hits(llm)
    assert_same(run(llm, first, names, on=True), expected[:6])
    q1, h1 = hits(llm)
    assert q1 - q0 == sum(map(len, first))
    assert_same(run(llm, second, names, on=True), expected[6:])
    q2, h2 = hits(llm)
    assert h2 - h1 == 6 * (len(SYSTEM) // PS) * PS  # every row: its three full system pages
    assert_drained(llm)


def test_same_prompt_under_two_adapters_and_base_never_shares(llm):
    prompt = toks(17)
    expected = run(llm, [prompt] * 3, ["a", "b", None], on=False)
    _, h0 = hits(llm)
    for k, name in enumerate(["a", "b", None]):  # one at a time: each would hit the one before
        assert_same(run(llm, [prompt], [name], on=True), expected[k:k + 1])
    assert hits(llm)[1] == h0
    assert_same(run(llm, [prompt], ["b"], on=True), expected[1:2])  # now its own pages are there
    assert hits(llm)[1] == h0 + 16


def test_continued_conversation_hits_its_earlier_turn(llm):
    """The next turn's prompt is the earlier prompt, its answer and a new user turn: the pages of
    the answer (decoded tokens) are served from the cache too."""
    turn1 = toks(9)
    out1 = run(llm, [turn1], ["a"], on=True)[0]
    turn2 = turn1 + out1.token_ids + toks(5)
    expected = run(llm, [turn2], ["a"], on=False)
    _, h0 = hits(llm)
    assert_same(run(llm, [turn2], ["a"], on=True), expected)
    assert hits(llm)[1] - h0 == (len(turn1) + len(out1.token_ids) - 1) // PS * PS  # the last is not written
    assert_drained(llm)


@pytest.mark.parametrize("length", [8, 9])
def test_prompt_ending_on_a_page_boundary(llm, length):
    """A prompt of whole pages recomputes its last page (its last token samples the first new one),
    one a token longer hits every full page."""
    prompt = toks(length)
    expected = run(llm, [prompt], [None], on=False)
    run(llm, [prompt], [None], on=True)
    _, h0 = hits(llm)
    assert_same(run(llm, [prompt], [None], on=True), expected)
    assert hits(llm)[1] - h0 == (length - 1) // PS * PS


def test_same_prompt_many_times(llm):
    """n copies of one prompt (n > 1): the copies after the first batch share its pages, read-only."""
    prompt = toks(14)
    expected = run(llm, [prompt] * 3, ["a"] * 3, on=False)
    assert_same(run(llm, [prompt] * 3, ["a"] * 3, on=True), expected)
    _, h0 = hits(llm)
    assert_same(run(llm, [prompt] * 3, ["a"] * 3, on=True), expected)
    assert hits(llm)[1] - h0 == 3 * 12
    assert_drained(llm)


def test_replaced_adapter_never_serves_stale_pages(paths):
    llm = make_llm(paths)
    prompt = SYSTEM + toks(3)
    run(llm, [prompt], ["a"], on=True)
    assert llm.engine.pool.prefix.adapter_pages(llm.engine.store.entries["a"].key)
    old = llm.engine.store.entries["a"].key
    llm.load_adapter("a", paths["a2"])
    assert not llm.engine.pool.prefix.adapter_pages(old)  # retired with the version
    expected = run(llm, [prompt], ["a"], on=False)
    _, h0 = hits(llm)
    assert_same(run(llm, [prompt], ["a"], on=True), expected)
    assert hits(llm)[1] == h0
    fresh = LLM("tiny", adapters={"a": paths["a2"]}, dtype="float32", page_size=PS, pool_pages=96,
                max_num_batched_tokens=64)
    assert_same(fresh.generate([prompt], SP, adapter=["a"]), expected)  # the new weights' output
    assert_drained(llm)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain_steps", "async_scheduling"])
def test_eviction_and_preemption_under_pool_pressure(paths, overlap):
    """A pool too small for every sequence at once: cached pages are evicted for adapters and new
    KV, and running sequences that share pages are preempted and recomputed. Outputs equal the
    uncached run's, and the pool's invariants hold after every step. With async scheduling pages
    join the cache at dispatch, and a page with a token still on the device joins later."""
    llm = make_llm(paths, pool_pages=68, max_num_seqs=6, async_scheduling=overlap)
    names = ["a", "b", None, "a", "b", None, "a", "a"]
    prompts = [SYSTEM + toks(n) for n in (2, 5, 3, 1, 6, 4, 2, 7)]
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=True, ignore_eos=True)
    expected = run(make_llm(paths), prompts, names, on=False, params=params)
    engine = llm.engine
    step = engine.step

    def checked_step():
        out = step()
        engine.pool.check()
        return out
    engine.step = checked_step
    for _ in range(2):
        assert_same(run(llm, prompts, names, on=True, params=params), expected)
    assert engine.num_preempted > 0
    assert engine.pool.cached_evictions > 0
    assert hits(llm)[1] > 0
    assert_drained(llm)
    assert engine.pool.evict_idle() > 0
    assert engine.pool.free_pages == engine.pool.total_pages


def test_aborted_requests_leave_nothing_behind(llm):
    prompt = SYSTEM + toks(5)
    run(llm, [prompt], ["a"], on=True)
    outs = [llm.engine.add_request(prompt, SP, name, 0, ()) for name in ("a", "a", None)]
    llm.engine.step()
    assert max(llm.engine.pool.page_refs.values()) == 2  # the two "a" rows share the cached pages
    for o in outs:
        llm.engine.abort(o.request_id)
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.engine._drain()
    assert_drained(llm)


def test_stats_and_config(llm, paths):
    s = llm.stats()["prefix_cache"]
    assert set(s) == {"queries", "hits", "cached_pages"}
    assert s["cached_pages"] == llm.engine.pool.cached_pages
    snap = llm.stats()
    assert snap["prefix_cached_pages_base"] + snap["prefix_cached_pages_lora"] == len(llm.engine.pool.prefix)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM("tiny", dtype="float32", enable_prefix_caching="yes")


def test_openai_usage_reports_cached_prompt_tokens(paths):
    """`usage.prompt_tokens_details.cached_tokens`: 0 on a cold prompt, its cached full pages on
    a repeat."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from slora_jax.serve.app import build_app
    from slora_jax.serve.cli import ServerThread
    server = ServerThread(build_app(make_llm(paths), "tiny")).start()
    try:
        prompt = toks(11)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
        cached = [httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["usage"]
                  ["prompt_tokens_details"]["cached_tokens"] for _ in range(2)]
    finally:
        server.stop()
    assert cached == [0, (len(prompt) - 1) // PS * PS]


# ------------------------------------------------------------------------------------------------
# the host allocator alone


def keys_of(tokens, adapter, ps=2):
    return prefix_cache.extend_keys([], tokens, adapter, ps, len(tokens) // ps)


def test_keys_chain_the_prefix_and_the_adapter_version():
    a = keys_of([1, 2, 3, 4], ("a", 1))
    assert keys_of([1, 2, 3, 4], ("a", 1)) == a
    assert keys_of([9, 2, 3, 4], ("a", 1))[1] != a[1]     # an earlier page changes every later key
    assert keys_of([1, 2, 3, 5], ("a", 1))[1] != a[1]     # every token of the page is in its key
    assert keys_of([1, 2, 3, 4, 5, 6], ("a", 1))[:2] == a  # what follows changes nothing before it
    assert keys_of([1, 2, 3, 4], ("a", 2))[0] != a[0]     # another version of the adapter
    assert keys_of([1, 2, 3, 4], None)[0] != a[0]         # the base model
    assert len(keys_of([1, 2, 3], None)) == 1             # full pages only
    assert len(prefix_cache.extend_keys([], [1, 2, -1, 4], None, 2, 2, unknown=-1)) == 1


def filled(pool, rid, tokens, adapter, ps=2):
    """A request that computed `tokens` and offered its full pages to the cache."""
    keys = keys_of(tokens, adapter, ps)
    hit = pool.match_prefix(keys)
    pool.share_kv(rid, hit)
    pool.grow_kv(rid, -(-len(tokens) // ps) - len(hit))
    for i in range(len(hit), len(keys)):
        pool.cache_page(rid, i, keys[i])
    return hit


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["req", "finish", "adapter", "release", "drop"]),
                              st.integers(0, 3), st.integers(1, 9)), max_size=40))
def test_pool_with_sharing_keeps_its_invariants(ops):
    """Random requests over four prefixes under two adapter versions and the base, adapters
    acquired and released, versions dropped: the pool's check holds after every operation, a
    page in use is never evicted or handed out, and a dropped version is never hit."""
    pool = UnifiedPool(24)
    prefixes = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7], [8, 9, 8, 9], [5, 5, 5, 5, 5, 5, 5]]
    running: dict[int, list[int]] = {}
    adapters, held, dropped, rid = [("x", 1), ("x", 2), None], [], set(), 0
    for op, i, n in ops:
        if op == "req":
            adapter = adapters[i % 3]
            if adapter in dropped:
                continue
            tokens = prefixes[i] + [n] * (n % 3)
            try:
                filled(pool, rid, tokens, adapter)
            except OutOfPages:
                pool.free_kv(rid)
                continue
            for p in pool.kv[rid]:
                assert p not in pool._free and p not in pool._idle_pages
            running[rid] = list(pool.kv[rid])
            rid += 1
        elif op == "finish" and running:
            r = sorted(running)[n % len(running)]
            assert pool.kv[r] == running.pop(r)  # nothing it held moved
            pool.free_kv(r)
        elif op == "adapter":
            try:
                pool.acquire_adapter(("w", n), n % 4 + 1)
                held.append(("w", n))
            except OutOfPages:
                pass
        elif op == "release" and held:
            pool.release_adapter(held.pop(n % len(held)))
        elif op == "drop" and i < 2:
            pool.retire_prefix(adapters[i])
            dropped.add(adapters[i])
            assert not pool.prefix.adapter_pages(adapters[i])
        pool.check()
    for r in list(running):
        pool.free_kv(r)
    for key in held:
        pool.release_adapter(key)
    pool.evict_idle()
    pool.check()
    assert pool.free_pages == pool.total_pages


def test_shared_page_outlives_one_holder_and_idles_after_the_last():
    pool = UnifiedPool(10)
    assert filled(pool, 0, [1, 2, 3, 4, 5], None) == []
    hit = filled(pool, 1, [1, 2, 3, 4, 6, 7], None)
    assert hit == pool.kv[0][:2] and pool.page_refs[hit[0]] == 2
    pool.free_kv(0)
    assert pool.page_refs[hit[0]] == 1 and pool.cached_pages == 0
    pool.free_kv(1)
    assert pool.cached_pages == 3 and not pool.page_refs  # two shared pages and page [6, 7]
    pool.check()


def test_eviction_is_lru_over_adapters_and_cached_pages():
    pool = UnifiedPool(8)
    filled(pool, 0, [1, 2, 3, 4], None)
    pool.acquire_adapter("old", 2)
    pool.release_adapter("old")           # idle first
    pool.free_kv(0)                       # the request's pages idle after it
    assert pool.free_pages == 3 and pool.cached_pages == 2
    pool.grow_kv(9, 4)                    # one more than free: the least recently used goes first
    assert not pool.is_resident("old") and pool.cached_pages == 2
    pool.grow_kv(9, 2)                    # one more than free: the tail page of the cached sequence
    assert len(pool.match_prefix(keys_of([1, 2, 3, 4], None))) == 1
    pool.check()


def test_region_pool_evicts_cached_pages_for_kv_only():
    """The separate-regions baseline: cached pages live in the KV region; KV takes them back,
    adapters never do (they evict only idle adapters inside their region)."""
    pool = RegionPool(16, 5)
    pool.acquire_adapter("x", 3)
    pool.release_adapter("x")
    filled(pool, 0, [1, 2, 3, 4, 5, 6], None)
    pool.free_kv(0)
    assert pool.available() == 10 and pool.cached_pages == 3
    pool.grow_kv(1, 9)  # 7 free KV pages and two of the cached ones
    assert pool.cached_pages == 1 and pool.is_resident("x")
    with pytest.raises(OutOfPages):
        pool.acquire_adapter("y", 6)  # more than the region: the cached page is no adapter's
    pool.acquire_adapter("y", 4)      # evicts "x" inside the region
    assert not pool.is_resident("x") and pool.cached_pages == 1
    pool.check()


class _MissedDecrement(UnifiedPool):
    """Planted bug: a shared page's last holder is forgotten (a decrement missed on finish)."""

    def free_kv(self, rid):
        pages = self.kv.get(rid, [])
        if pages and pages[0] in self.page_refs and self.page_refs[pages[0]] > 1:
            self.kv.pop(rid)
            return
        super().free_kv(rid)


def test_planted_missed_decrement_is_caught():
    pool = _MissedDecrement(10)
    filled(pool, 0, [1, 2, 3, 4], None)
    filled(pool, 1, [1, 2, 3, 4, 5], None)
    pool.free_kv(1)
    with pytest.raises(AssertionError, match="references"):
        pool.check()


def test_planted_key_bugs_are_caught(monkeypatch):
    """Keys without the adapter version, chained off the wrong parent, or over a page's tokens
    off by one, hit pages they must not: the key test above fails on each."""
    def off_by_one(keys, tokens, adapter, page_size, limit, unknown=None):
        while len(keys) < limit and (len(keys) + 1) * page_size <= len(tokens):
            i = len(keys)
            keys.append(prefix_cache.page_key(keys[-1].key if keys else prefix_cache.ROOT, adapter,
                                              tokens[i * page_size:(i + 1) * page_size - 1]))
        return keys
    with monkeypatch.context() as m:
        m.setattr(prefix_cache, "extend_keys", off_by_one)
        with pytest.raises(AssertionError):
            test_keys_chain_the_prefix_and_the_adapter_version()
    good = prefix_cache.page_key
    monkeypatch.setattr(prefix_cache, "page_key", lambda parent, adapter, tokens: good(parent, None, tokens))
    with pytest.raises(AssertionError):
        test_keys_chain_the_prefix_and_the_adapter_version()
    monkeypatch.setattr(prefix_cache, "page_key", lambda parent, adapter, tokens: good(prefix_cache.ROOT, adapter,
                                                                                       tokens))
    with pytest.raises(AssertionError):
        test_keys_chain_the_prefix_and_the_adapter_version()


# ------------------------------------------------------------------------------------------------
# the multi-tenant trace (bench/trace.py)


def test_multi_tenant_trace_repeats_prefixes_as_configured():
    from bench.trace import generate, load_workload, system_prompt_lengths
    w = load_workload("multitenant", duration_s=600.0)
    trace = generate(w)
    assert generate(w).requests == trace.requests  # deterministic
    s = trace.stats()
    assert abs(s["continued"] / len(trace) - w.continue_share) < 0.05
    assert abs(s["top10_share"] - w.zipf_top_share) < 0.05
    prompts = trace.prompts(1000)
    systems = system_prompt_lengths(w)
    lo, hi = w.system_prompt_range
    assert lo <= systems.min() and systems.max() < hi
    first: dict[int, list[int]] = {}
    for i, (r, p) in enumerate(zip(trace, prompts)):
        assert len(p) == r.prompt_len and r.prompt_len + r.output_len <= w.max_context
        assert w.output_range[0] <= r.output_len < w.output_range[1]
        if r.parent < 0:
            turn = r.prompt_len - systems[r.adapter_id]
            head = p[:systems[r.adapter_id]]
            assert first.setdefault(r.adapter_id, head) == head  # one system prompt per adapter
        else:
            q = trace.requests[r.parent]
            assert r.parent < i and q.adapter_id == r.adapter_id
            assert p[:q.prompt_len] == prompts[r.parent]  # the conversation so far, then its answer
            turn = r.prompt_len - q.prompt_len - q.output_len
        assert w.input_range[0] <= turn < w.input_range[1]
