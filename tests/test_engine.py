"""The paged engine through the public LLM API, on the "tiny" model in float32, against the dense
reference path (slora_jax.engine.reference_engine), which shares the weights but has no pool, no paging,
no scheduler.

Compiles dominate the run time on a CPU (a few seconds per step shape), so the workloads are chosen
to reuse step shapes: one standard mixed batch W (every prompt + 8 new tokens fits one 16-token
page), one reference run of W (and of W with adapter "a" replaced), and LLM configurations that
repeat each other's pool shapes where the tests allow it.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from slora_jax import LLM, AdapterMemoryBaseline, EngineConfig, SamplingParams
from slora_jax.lora import qkv_group

from slora_jax.engine import step as paged
from slora_jax.engine.scheduler import PENDING

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # as bench/run.py counts them
from slora_jax.model.peft import AdapterError, load_peft_adapter, random_peft_adapter
from slora_jax.model.config import load_model_config
from slora_jax.model.layout import AdapterLayout
from slora_jax.engine.reference_engine import ReferenceEngine

CFG = load_model_config("tiny")
MAX_TOKENS = 8
SP = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True, ignore_eos=True)
BIG = 64  # pool pages for page_size 16: room for every adapter and every request of W at once

# The standard mixed batch: adapters of different ranks and targets, and base rows.
_rng = np.random.default_rng(1234)
LENGTHS = [5, 8, 1, 7, 3, 8, 6, 4]
W_PROMPTS = [[int(t) for t in _rng.integers(3, CFG.vocab_size, n)] for n in LENGTHS]
W_NAMES = ["a", "b", None, "c", "d", "a", "a", "c"]
ADAPTERS = {  # name: (rank, targets, seed)
    "a": (8, "all-linear", 1),
    "b": (4, ["q_proj", "v_proj"], 2),
    "c": (16, ["gate_proj", "up_proj", "down_proj"], 3),
    "d": (2, ["k_proj", "o_proj"], 4),
    "a2": (8, "all-linear", 11),  # same shape as "a", other weights: the replacement
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: random_peft_adapter(root / name, CFG, rank=r, targets=t, seed=s)
            for name, (r, t, s) in ADAPTERS.items()}


def make_llm(paths, names=("a", "b", "c", "d"), max_prefill_seqs=None, **options):
    """An LLM on "tiny"; max_prefill_seqs goes to its scheduler (a constant, not an EngineConfig
    field)."""
    llm = LLM("tiny", adapters={n: paths[n] for n in names}, dtype="float32", **options)
    if max_prefill_seqs is not None:
        llm.engine.sched.max_prefill_seqs = max_prefill_seqs
    return llm


@pytest.fixture(scope="module")
def llm(paths):
    """The shared engine: page size 16, a pool with room for everything. Tests leave it drained."""
    return make_llm(paths, page_size=16, pool_pages=BIG)


@pytest.fixture(scope="module")
def ref(paths, llm):
    """Reference outputs of W with the original adapters ("old") and with "a" replaced ("new")."""
    loaded = {n: load_peft_adapter(p, CFG) for n, p in paths.items()}
    engine = ReferenceEngine(CFG, llm.params, "float32")
    n = len(W_PROMPTS)

    def run(names):
        return engine.generate(W_PROMPTS, [SP] * n, [0] * n,
                               [loaded[a] if a else None for a in names], CFG.eos_token_ids)
    return {"old": run(W_NAMES), "new": run(["a2" if a == "a" else a for a in W_NAMES])}


def assert_same(outs, expected, lengths=None, tol=1e-5):
    """Greedy tokens equal to the reference's (its first lengths[k] tokens), logprobs within tol."""
    assert len(outs) == len(expected)
    for k, (o, r) in enumerate(zip(outs, expected)):
        m = len(r.token_ids) if lengths is None else lengths[k]
        assert o.token_ids == r.token_ids[:m], f"request {k} (adapter {o.adapter})"
        assert o.finish_reason == "length"
        assert o.logprobs is not None and r.logprobs is not None
        np.testing.assert_allclose(o.logprobs, r.logprobs[:m], atol=tol, rtol=0, err_msg=f"request {k}")


def assert_drained(llm):
    st = llm.stats()
    assert st["running"] == 0 and st["waiting"] == 0 and not llm.engine.has_unfinished()
    assert st["kv_pages"] == 0
    assert st["free_pages"] == st["total_pages"] - st["adapter_pages"] - st["prefix_cache"]["cached_pages"]
    llm.engine.pool.check()


def pages_of(paths, name, page_size):
    return AdapterLayout.of(load_peft_adapter(paths[name], CFG), CFG, page_size).pages


def kv_pages(n_tokens, page_size):
    return -(-n_tokens // page_size)


def tight_pool(paths, page_size=4):
    """Every adapter of W and every prompt fit, but not every sequence's full length: decode runs
    out of KV pages and must preempt (and recompute) some requests."""
    adapters = sum(pages_of(paths, n, page_size) for n in "abcd")
    prompts = sum(kv_pages(n, page_size) for n in LENGTHS)
    full = sum(kv_pages(n + MAX_TOKENS - 1, page_size) for n in LENGTHS)
    pool = 1 + adapters + prompts + 10
    assert pool < 1 + adapters + full
    return pool


def small_pool(paths):
    """Page size 16: two requests of W on adapter "a" fit together, but "a" and its same-shaped
    twin "a2" never do (nor do all the adapters)."""
    a, a2 = pages_of(paths, "a", 16), pages_of(paths, "a2", 16)
    usable = a + 2 * kv_pages(max(LENGTHS) + MAX_TOKENS, 16)
    assert a + a2 > usable and sum(pages_of(paths, n, 16) for n in ADAPTERS) > usable
    return 1 + usable


# ------------------------------------------------------------------------------------------------
# parity with the reference


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_mixed_batch_matches_reference(paths, llm, ref, page_size):
    if page_size == 16:
        engine = llm
    elif page_size == 4:
        engine = make_llm(paths, page_size=4, pool_pages=tight_pool(paths))  # also preempts
    else:
        engine = make_llm(paths, page_size=1, pool_pages=1 + sum(pages_of(paths, n, 1) for n in "abcd")
                          + sum(n + MAX_TOKENS for n in LENGTHS))
    before = engine.stats()
    outs = engine.generate(W_PROMPTS, SP, adapter=W_NAMES)
    assert_same(outs, ref["old"])
    assert_drained(engine)
    # every dispatched step is counted once, under its kind and the kind of the step before it
    after = engine.stats()
    moved = {k: n - before["host_by_transition"].get(k, [0])[0] for k, (n, _, _) in after["host_by_transition"].items()}
    assert sum(moved.values()) == after["steps"] - before["steps"] > 0
    assert moved.get("prefill>decode", 0) >= 1 and all(k.split(">")[1] in ("prefill", "decode") for k in moved)


def test_kv_starved_pool_preempts(paths, ref):
    engine = make_llm(paths, page_size=4, pool_pages=tight_pool(paths))
    outs = engine.generate(W_PROMPTS, SP, adapter=W_NAMES)
    st = engine.stats()
    assert st["preempted"] > 0, st
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref["old"]]
    assert_same(outs, ref["old"])
    assert_drained(engine)


# Requests on "a" and on "a2" (same shape, other weights), alternating: (W row, adapter, reference).
ALTERNATING = [(0, "a", "old"), (0, "a2", "new"), (5, "a", "old"), (5, "a2", "new"), (6, "a", "old")]


def run_alternating(engine, ref):
    outs = engine.generate([W_PROMPTS[i] for i, _, _ in ALTERNATING], SP,
                           adapter=[name for _, name, _ in ALTERNATING])
    assert_same(outs, [ref[which][i] for i, _, which in ALTERNATING])


def test_pool_too_small_for_all_adapters_evicts_and_reloads(paths, ref):
    engine = make_llm(paths, ADAPTERS, page_size=16, pool_pages=small_pool(paths))
    run_alternating(engine, ref)  # every switch evicts the other twin and loads it (again)
    st = engine.stats()
    assert st["evictions"] >= 4, st
    assert_drained(engine)
    assert st["adapter_pages"] == pages_of(paths, "a", 16)  # the last one used stays cached


def test_more_requests_than_max_num_seqs(paths, ref):
    engine = make_llm(paths, page_size=16, pool_pages=small_pool(paths), max_num_seqs=2)
    # Rows of W on adapter "a" with different lengths: requests join and leave mid-decode.
    rows = [0, 5, 6, 0, 6, 5, 0]
    lengths = [8, 3, 6, 2, 8, 5, 4]
    params = [SamplingParams(max_tokens=m, temperature=0.0, logprobs=True, ignore_eos=True) for m in lengths]
    running = []
    step = engine.engine.step

    def counting_step():
        finished = step()
        running.append(len(engine.engine.running))
        return finished
    engine.engine.step = counting_step
    outs = engine.generate([W_PROMPTS[i] for i in rows], params, adapter="a")
    assert max(running) == 2, running  # never more than two at once, and two most of the time
    assert [len(o.token_ids) for o in outs] == lengths
    assert_same(outs, [ref["old"][i] for i in rows], lengths)
    assert_drained(engine)


# ------------------------------------------------------------------------------------------------
# refusals and bookkeeping


def test_request_that_can_never_fit_is_refused(llm, ref):
    total = llm.stats()["total_pages"]
    prompt = [7] * (total * 16 - 4)  # + 8 or 20 new tokens: one page more than the whole pool
    assert len(prompt) + 20 <= llm.max_model_len
    with pytest.raises(ValueError, match="can never run"):
        llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0))
    # All or nothing: a batch holding one impossible request runs none of them.
    with pytest.raises(ValueError, match="can never run"):
        llm.generate(W_PROMPTS + [prompt], SP, adapter=W_NAMES + [None])
    assert_drained(llm)
    outs = llm.generate(W_PROMPTS, SP, adapter=W_NAMES)  # and the engine still serves
    assert_same(outs, ref["old"])
    assert_drained(llm)


def test_unknown_adapter(llm):
    with pytest.raises(KeyError):
        llm.unload_adapter("nope")
    with pytest.raises(ValueError, match="unknown adapter"):
        llm.generate(W_PROMPTS[:2], SP, adapter=["a", "nope"])
    assert_drained(llm)
    assert llm.adapters == ["a", "b", "c", "d"]


def test_failed_reregistration_changes_nothing(llm, ref, tmp_path):
    key = llm.store.get("a").key
    with pytest.raises(AdapterError):
        llm.load_adapter("a", tmp_path / "missing")
    assert llm.store.get("a").key == key
    outs = llm.generate(W_PROMPTS, SP, adapter=W_NAMES)
    assert_same(outs, ref["old"])
    assert_drained(llm)


def test_host_cache_miss_rereads_adapter_from_disk(paths, ref):
    # One adapter's rows in host memory: every load of the other twin goes back to disk. Prefetch
    # off: its reads start on worker threads as requests arrive, and how many of them a later load
    # finds still cached depended on thread timing (3 disk loads in one CI run on a busy machine).
    engine = make_llm(paths, ADAPTERS, page_size=16, pool_pages=small_pool(paths), max_cpu_loras=1,
                      prefetch_adapters=0)
    run_alternating(engine, ref)
    st = engine.stats()
    assert st["adapter_disk_loads"] >= 4 and st["evictions"] >= 4, st
    assert_drained(engine)


def test_names_sharing_files_register_without_rereading(paths, monkeypatch):
    """Many names over a few files (bench traces register 1000 names over 64 files) with a host
    cache smaller than the file count: each file is read once at registration, not once a name.
    Re-registering a name still reads its file again."""
    from slora_jax.engine import adapter_store
    reads = []
    real = adapter_store.load_peft_adapter

    def load(path, *a, **k):
        reads.append(str(path))
        return real(path, *a, **k)
    monkeypatch.setattr(adapter_store, "load_peft_adapter", load)
    store = adapter_store.AdapterStore(CFG, np.float32, page_size=16, max_rank=16, host_cache_size=1)
    files = [paths["a"], paths["b"], paths["c"]]
    for i in range(12):
        store.register(f"n{i}", files[i % 3])
    assert sorted(reads) == sorted(str(f) for f in files), reads
    assert store.get("n4").layout == store.get("n1").layout != store.get("n0").layout
    store.register("n4", files[1])
    assert reads[-1] == str(files[1]) and len(reads) == 4
    assert len(store._rows) == 1  # the cache still holds one file
    store.resize_host_cache(3)
    store.rows(store.get("n0"))
    store.rows(store.get("n2"))
    assert len(store._rows) == 3 and store.disk_loads == 2
    store.resize_host_cache(1)  # drops the two least recently used at once
    assert list(store._rows) == [store.get("n2").file_id]


def test_register_many_reads_files_side_by_side_all_or_nothing(paths, tmp_path, monkeypatch):
    """register_many reads each distinct file once, on its worker threads; one bad adapter among
    them raises (the first bad one in the caller's order) and registers no name at all."""
    import threading
    from slora_jax.engine import adapter_store
    reads = []
    real = adapter_store.load_peft_adapter

    def load(path, *a, **k):
        reads.append((str(path), threading.current_thread().name))
        return real(path, *a, **k)
    monkeypatch.setattr(adapter_store, "load_peft_adapter", load)
    store = adapter_store.AdapterStore(CFG, np.float32, page_size=16, max_rank=16, host_cache_size=2)
    too_big = random_peft_adapter(tmp_path / "r32", CFG, rank=32, targets=["q_proj"], seed=9)
    bad_cfg = tmp_path / "not-an-adapter"
    bad_cfg.mkdir()
    many = {f"n{i}": paths["abc"[i % 3]] for i in range(9)}
    with pytest.raises(AdapterError, match="exceeds max_rank"):
        store.register_many({**many, "big": too_big, "nothing": bad_cfg}, workers=3)
    assert not store.entries  # nothing registered
    reads.clear()
    entries = store.register_many(many, workers=3)
    assert [e.name for e in entries] == list(many) and set(store.entries) == set(many)
    assert reads == [], reads  # validated by the failed call: not read again
    assert store.get("n3").layout == store.get("n0").layout
    assert len(store._rows) <= 2  # the host cache stays bounded while the threads fill it
    store.register_many({"n0": paths["b"], "fresh": paths["d"]}, workers=2)  # n0 re-registered: read
    assert sorted(p for p, _ in reads) == sorted([str(paths["b"]), str(paths["d"])])
    assert all(t.startswith("slora-adapter-register") for _, t in reads), reads
    assert store.get("n0").layout == store.get("n1").layout  # now b's
    # cached in the caller's order, whichever thread finished first: as one by one
    assert list(store._rows) == [store.get("n0").file_id, store.get("fresh").file_id]


def test_stage_workers_read_that_many_files_at_once(paths, monkeypatch):
    """`stage` reads up to stage_workers files at once: three reads that each wait for the other
    two (a barrier of 3) all pass with 3 threads, and break the barrier with 2 (the third read
    only starts after one of the first two gives up). set_stage_workers applies from the next
    stage on; fewer than one thread is refused."""
    import threading
    from slora_jax.engine import adapter_store
    real = adapter_store.load_peft_adapter
    barrier = threading.Barrier(3, timeout=5.0)

    def load(path, *a, **k):
        barrier.wait()  # raises BrokenBarrierError unless all three reads run at once
        return real(path, *a, **k)
    store = adapter_store.AdapterStore(CFG, np.float32, page_size=16, max_rank=16, host_cache_size=1,
                                       stage_workers=2)
    for name in "abc":
        store.register(name, paths[name])
    store.resize_host_cache(1, None)
    store.set_stage_workers(3)
    monkeypatch.setattr(adapter_store, "load_peft_adapter", load)
    store._rows.clear()
    futures = []
    for name in "abc":
        assert store.stage(store.get(name))
        futures.append(store._staging[store.get(name).file_id])
    for f in futures:
        f.result(timeout=30)  # raises if the barrier broke
    assert store.disk_loads == 3
    store.set_stage_workers(2)
    barrier.reset()
    store._rows.clear()
    futures = [(store.stage(store.get(n)), store._staging[store.get(n).file_id])[1] for n in "abc"]
    errors = [f.exception(timeout=30) for f in futures]
    assert any(isinstance(e, threading.BrokenBarrierError) for e in errors), errors
    with pytest.raises(ValueError, match="stage_workers"):
        store.set_stage_workers(0)


def test_host_cache_byte_cap(paths):
    """The host cache drops least recently used files past its byte cap as well as its file
    count, keeps the newest file even when it alone is over the cap, and counts the bytes it
    holds exactly; LLM's max_cpu_lora_gb sets the cap."""
    from slora_jax.engine import adapter_store
    store = adapter_store.AdapterStore(CFG, np.float32, page_size=16, max_rank=16, host_cache_size=10)
    for name in "abcd":
        store.register(name, paths[name])
    sizes = {n: store._rows[store.get(n).file_id].nbytes for n in "abcd"}
    assert store._cached_bytes == sum(sizes.values())
    store.resize_host_cache(10, sizes["c"] + sizes["d"])  # room for the two newest
    assert list(store._rows) == [store.get("c").file_id, store.get("d").file_id]
    store.rows(store.get("a"))  # read again: "a" is the newest; "c" goes, and "d" too if still over
    want = ["d", "a"] if sizes["d"] + sizes["a"] <= sizes["c"] + sizes["d"] else ["a"]
    assert list(store._rows) == [store.get(n).file_id for n in want], (sizes, want)
    assert store._cached_bytes == sum(r.nbytes for r in store._rows.values())
    store.resize_host_cache(10, 1)  # below one file: the newest stays
    assert list(store._rows) == [store.get("a").file_id] and store._cached_bytes == sizes["a"]
    llm = make_llm(paths, ("a",), page_size=16, pool_pages=BIG, max_cpu_lora_gb=0.5)
    assert llm.store.host_cache_bytes == 2**29
    with pytest.raises(ValueError, match="max_cpu_lora_gb"):
        make_llm(paths, ("a",), page_size=16, pool_pages=BIG, max_cpu_lora_gb=0)


@pytest.mark.parametrize("prefetch", [8, 0], ids=["staged_on_arrival", "read_at_admission"])
def test_cold_adapter_disk_read_runs_off_the_step_loop(paths, ref, monkeypatch, prefetch):
    """A request for an adapter whose rows left the host cache starts the disk read when it
    arrives, on the store's worker thread; the step that admits it finds the rows cached. With
    prefetch off the step loop reads the disk itself. Outputs equal the reference either way."""
    import threading
    from slora_jax.engine import adapter_store
    engine = make_llm(paths, page_size=16, pool_pages=BIG, max_cpu_loras=1, prefetch_adapters=prefetch)
    threads = []
    real = adapter_store.load_peft_adapter

    def load(*a, **k):
        threads.append(threading.current_thread().name)
        return real(*a, **k)
    monkeypatch.setattr(adapter_store, "load_peft_adapter", load)
    store = engine.store
    assert store.get("d").file_id in store._rows and store.get("a").file_id not in store._rows
    outs = engine.generate([W_PROMPTS[0]], SP, adapter="a")
    assert_same(outs, [ref["old"][0]])
    assert engine.stats()["adapter_disk_loads"] == 1
    if prefetch:
        assert len(threads) == 1 and threads[0].startswith("slora-adapter-stage"), threads
    else:
        assert threads == [threading.main_thread().name], threads
    assert not store._staging or all(f.done() for f in store._staging.values())
    assert_drained(engine)


def test_cold_adapter_read_does_not_stall_running_requests(paths, ref, monkeypatch):
    """While a cold adapter's staged disk read is still running, the requests already running
    keep stepping; its request waits, is admitted once the read is done, and every output is the
    reference's."""
    import threading
    from slora_jax.engine import adapter_store
    engine = make_llm(paths, page_size=16, pool_pages=BIG, max_cpu_loras=1)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True, ignore_eos=True)
    eng = engine.engine
    running = eng.add_request(W_PROMPTS[1], sp, "b", 0, CFG.eos_token_ids)
    eng.step()  # its prefill (nothing else runs: it waits for b's read): "b" is resident now
    release, real = threading.Event(), adapter_store.load_peft_adapter

    def slow_load(*a, **k):
        assert release.wait(30), "the test never released the read"
        return real(*a, **k)
    monkeypatch.setattr(adapter_store, "load_peft_adapter", slow_load)
    assert engine.store.get("a").file_id not in engine.store._rows  # host cache of 1: "d" holds it
    cold = eng.add_request(W_PROMPTS[0], sp, "a", 0, CFG.eos_token_ids)  # "a" left the host cache
    assert not engine.store.ready(engine.store.get("a"))
    before = len(running.token_ids)
    for _ in range(3):
        eng.step()  # "b" decodes; "a" waits for its read
    assert len(running.token_ids) == before + 3 and cold.token_ids == []
    release.set()
    while eng.has_unfinished():
        eng.step()
    assert_same([running, cold], [ref["old"][1], ref["old"][0]])
    assert engine.stats()["adapter_disk_loads"] == 2  # b's and a's: the host cache holds one file
    assert_drained(engine)


def test_reregistered_adapter_serves_new_weights(paths, ref):
    engine = make_llm(paths, page_size=16, pool_pages=BIG)
    outs = engine.generate(W_PROMPTS, SP, adapter=W_NAMES)
    assert_same(outs, ref["old"])
    a_pages = pages_of(paths, "a", 16)
    assert engine.engine.pool.is_resident(engine.store.get("a").key)  # the old version is cached
    before = engine.stats()["adapter_pages"]
    engine.load_adapter("a", paths["a2"])
    assert engine.stats()["adapter_pages"] == before - a_pages  # the idle stale version is gone
    outs = engine.generate(W_PROMPTS, SP, adapter=W_NAMES)
    assert_same(outs, ref["new"])
    assert any(ref["new"][i].token_ids != ref["old"][i].token_ids for i, n in enumerate(W_NAMES) if n == "a"), \
        "the replacement should change some greedy tokens, or this test proves nothing"
    assert_drained(engine)
    # Unloading frees the (idle) pages at once; the name is then unknown.
    before = engine.stats()["adapter_pages"]
    engine.unload_adapter("a")
    assert engine.stats()["adapter_pages"] == before - a_pages
    with pytest.raises(ValueError, match="unknown adapter"):
        engine.generate(W_PROMPTS[:1], SP, adapter="a")
    assert_drained(engine)


# ------------------------------------------------------------------------------------------------
# sampling


SEEDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=20, top_p=0.9, seed=4321, ignore_eos=True)


def test_seeded_sampling_is_batch_invariant(paths, llm):
    # Alone (on an engine of its own: a small pool, where only one-row steps run) ...
    single = make_llm(paths, page_size=16, pool_pages=small_pool(paths), max_num_seqs=1)
    alone = single.generate([W_PROMPTS[0]], SEEDED, adapter="a")[0]
    assert len(alone.token_ids) == MAX_TOKENS
    assert single.generate([W_PROMPTS[0]], SEEDED, adapter="a")[0].token_ids == alone.token_ids
    # ... and as row 0 of the mixed batch W, next to other sampled and greedy rows.
    other = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=s, ignore_eos=True) for s in range(4)]
    params = [SEEDED] + other + [SP] * (len(W_PROMPTS) - 5)
    mixed = llm.generate(W_PROMPTS, params, adapter=W_NAMES)
    assert mixed[0].token_ids == alone.token_ids
    assert_drained(llm)
    assert_drained(single)


def test_stop_token_ids(llm, ref):
    row = 2  # the base row
    toks = ref["old"][row].token_ids
    k = next(i for i in range(1, len(toks)) if toks[i] not in toks[:i])
    params = [SP] * len(W_PROMPTS)
    params[row] = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[toks[k]],
                                 ignore_eos=True, logprobs=True)
    outs = llm.generate(W_PROMPTS, params, adapter=W_NAMES)
    assert outs[row].finish_reason == "stop"
    assert outs[row].token_ids == toks[:k + 1] and outs[row].token_ids[-1] == toks[k]
    assert len(outs[row].logprobs) == k + 1
    others = [i for i in range(len(W_PROMPTS)) if i != row]
    assert_same([outs[i] for i in others], [ref["old"][i] for i in others])
    assert_drained(llm)


# ------------------------------------------------------------------------------------------------
# An adapter replaced while requests for it are queued. LLM.generate runs to completion, so this is
# the Engine API a server drives: add_request, load_adapter between steps, step. (Regressions: an
# engine that binds the adapter version at add_request instead of at admission serves a queued
# request the replaced weights, or crashes in pool.acquire_adapter with KeyError.)


def _run(llm):
    while llm.engine.has_unfinished():
        llm.engine.step()


def _add(llm, row, max_tokens=MAX_TOKENS):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=True, ignore_eos=True)
    return llm.engine.add_request(W_PROMPTS[row], sp, "a", 0, CFG.eos_token_ids)


def test_queued_request_after_replace_gets_new_weights(paths, ref):
    llm = make_llm(paths, page_size=16, pool_pages=small_pool(paths), max_num_seqs=1)
    x, y = _add(llm, 0), _add(llm, 5)
    llm.engine.step()  # x runs (prefill), y waits: max_num_seqs=1
    llm.load_adapter("a", paths["a2"])
    _run(llm)
    assert_same([x], [ref["old"][0]])  # x started on the old version and keeps it
    assert_drained(llm)
    assert_same([y], [ref["new"][5]])  # y had not started: it must not see the replaced weights


def test_queued_request_while_replaced_version_still_runs(paths, ref):
    llm = make_llm(paths, page_size=16, pool_pages=small_pool(paths), max_num_seqs=2)
    x, w, y = _add(llm, 0), _add(llm, 6, max_tokens=2), _add(llm, 5)
    llm.engine.step()  # x and w run, y waits
    llm.load_adapter("a", paths["a2"])
    _run(llm)  # w finishes first; y is admitted while x still holds the old version
    assert_same([x, w], [ref["old"][0], ref["old"][6]], [MAX_TOKENS, 2])
    assert_same([y], [ref["new"][5]])
    assert_drained(llm)


def test_reregister_same_path_rewritten_in_place(paths, ref, tmp_path):
    d = tmp_path / "x"
    random_peft_adapter(d, CFG, rank=8, targets="all-linear", seed=ADAPTERS["a"][2])  # = "a"
    llm = make_llm(paths, page_size=16, pool_pages=small_pool(paths))
    llm.load_adapter("a", d)
    out = llm.generate([W_PROMPTS[0]], SP, adapter="a")
    assert_same(out, [ref["old"][0]])
    f = d / "adapter_model.safetensors"
    st = os.stat(f)
    random_peft_adapter(d, CFG, rank=8, targets="all-linear", seed=ADAPTERS["a2"][2])  # = "a2"
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: new weights
    llm.load_adapter("a", d)
    out = llm.generate([W_PROMPTS[0]], SP, adapter="a")
    assert_same(out, [ref["new"][0]])


# ------------------------------------------------------------------------------------------------
# An adapter whose weights cannot be read when it is paged in (host cache miss, directory gone).


def _failed_load(paths):
    """An engine whose first request for "a" fails to page it in (it ends with an error): a's
    rows are not in the host cache (size 1) and its directory is gone at that moment."""
    engine = make_llm(paths, ADAPTERS, page_size=16, pool_pages=small_pool(paths), max_cpu_loras=1)
    moved = str(paths["a"]) + ".moved"
    os.rename(paths["a"], moved)
    try:
        out = engine.generate([W_PROMPTS[0]], SP, adapter="a")[0]
        assert out.finish_reason == "error" and "not found" in out.abort_reason, out
    finally:
        os.rename(moved, paths["a"])
    return engine


def test_failed_adapter_load_is_retried_not_served_unfilled(paths, ref):
    engine = _failed_load(paths)
    out = engine.generate([W_PROMPTS[0]], SP, adapter="a")
    assert_same(out, [ref["old"][0]])


def test_failed_adapter_load_leaves_nothing_behind(paths):
    engine = _failed_load(paths)
    assert not engine.engine.has_unfinished()
    assert_drained(engine)


# ------------------------------------------------------------------------------------------------
# The benchmark's memory baselines (EngineConfig.baseline; bench/RESULTS.md, "Engine hooks"):
# "padded_slots" (fixed slots at max_lora_rank, like vLLM --max-loras) and "separate" (an adapter
# region and a KV region). Same tokens as the reference; different memory behaviour.

PADDED_RANK = 16  # the largest rank of W's adapters ("c")


def padded_slot_pages(page_size):
    return AdapterLayout.of(None, CFG, page_size, PADDED_RANK).pages


def watch_pool(engine, check):
    """Run check(engine) after every step (and pool.check())."""
    step = engine.engine.step

    def checked_step():
        finished = step()
        engine.engine.pool.check()
        check(engine.engine)
        return finished
    engine.engine.step = checked_step


def test_padded_slots_fewer_than_adapters_match_reference(paths, ref):
    # Two slots for W's four adapters: requests wait for a slot, idle slots are evicted.
    slots = 2
    engine = make_llm(paths, page_size=16, pool_pages=BIG, max_lora_rank=PADDED_RANK,
                      baseline=AdapterMemoryBaseline("padded_slots", slots), max_num_seqs=2)  # few shapes
    region = slots * padded_slot_pages(16)
    seen = []

    def check(e):
        pool = e.pool
        seen.append(len(pool.adapters))
        assert len(pool.adapters) <= slots
        assert all(len(p) == padded_slot_pages(16) for p in pool.adapters.values())
        assert all(p > region for pages in pool.kv.values() for p in pages)
        assert len({r.adapter.key for r in e.running if r.adapter is not None}) <= slots
    watch_pool(engine, check)
    # Every adapter is laid out at the max rank on every module, whatever its own rank.
    layout = engine.store.get("d").layout
    assert set(layout.modules) == set(engine.store.get("c").layout.modules) and \
        {m.rank for m in layout.modules.values()} == {PADDED_RANK}
    outs = engine.generate(W_PROMPTS, SP, adapter=W_NAMES)
    assert_same(outs, ref["old"])
    st = engine.stats()
    assert max(seen) == slots and st["evictions"] >= 2, (seen, st)
    assert st["adapter_pages"] == region and st["total_pages"] == BIG - 1
    assert_drained(engine)


def test_padded_slots_lora_runs_over_every_slot_at_max_rank(paths):
    engine = make_llm(paths, page_size=16, pool_pages=BIG, max_lora_rank=PADDED_RANK,
                      baseline=AdapterMemoryBaseline("padded_slots", 3))
    e = engine.engine
    e.add_request(W_PROMPTS[1], SP, "b", 0, ())
    plan = e.sched.schedule()
    e._write_adapters(plan.loads)
    lora = e.slots.lora_inputs([plan.requests[0]] * 2, 2, decode=True)
    assert set(lora.rows) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    for module, (a, b) in lora.rows.items():
        if a is None:  # q, k, v under the grouped Pallas shrink: A rows stacked (lora.stack_qkv)
            a = lora.qkv_a_rows[qkv_group(lora.rows).index(module)]
        assert a.shape[0] == b.shape[0] == 3  # the bucket is every slot, one adapter or not
        assert list(lora.ranks[module]) == [PADDED_RANK, 0, 0]
    assert lora.max_rank == PADDED_RANK
    for req in list(e.running):
        e.abort(req.rid)


def test_separate_region_kv_preempts_never_evicts(paths, ref):
    # tight_pool's pages, of which the adapters' region holds all four adapters: KV pressure
    # preempts requests (as in test_kv_starved_pool_preempts) and never touches the region.
    region = sum(pages_of(paths, n, 4) for n in "abcd")
    engine = make_llm(paths, page_size=4, pool_pages=tight_pool(paths), baseline=AdapterMemoryBaseline("separate", region))
    watch_pool(engine, lambda e: None)
    outs = engine.generate(W_PROMPTS, SP, adapter=W_NAMES)
    assert_same(outs, ref["old"])
    st = engine.stats()
    assert st["preempted"] > 0 and st["evictions"] == 0, st
    assert st["adapter_pages"] == region and st["free_pages"] == st["total_pages"] - region - st["prefix_cache"]["cached_pages"]
    assert_drained(engine)


def test_separate_small_region_evicts_idle_adapters_only(paths, ref):
    # small_pool's pages (as test_pool_too_small_for_all_adapters_evicts_and_reloads), the region
    # with room for one of the twins "a" and "a2" and the rest for KV: a request for the other twin
    # waits for the region, idle twins are evicted; one in use never is, and KV never takes a
    # region page.
    region = pages_of(paths, "a", 16)
    engine = make_llm(paths, ADAPTERS, page_size=16, pool_pages=small_pool(paths), baseline=AdapterMemoryBaseline("separate", region))
    held: dict = {}

    def check(e):
        pool = e.pool
        assert pool.resident_pages <= region and len(pool.adapters) <= 1
        assert all(p > region for ps in pool.kv.values() for p in ps)
        for r in e.running:
            if r.holds_adapter:  # the pages it was admitted with are still its adapter's
                pages = held.setdefault(r.rid, list(pool.adapters[r.adapter.key]))
                assert pool.adapters[r.adapter.key] == pages, f"{r.adapter.key} moved while in use"
    watch_pool(engine, check)
    run_alternating(engine, ref)
    st = engine.stats()
    assert st["evictions"] >= 4, st
    assert_drained(engine)
    # An adapter bigger than the whole region can never run.
    with pytest.raises(ValueError, match="can never run"):
        engine.generate(W_PROMPTS[:1], SP, adapter="c")
    assert_drained(engine)


@pytest.mark.parametrize("kind, size, match", [
    ("paged", 4, "baseline kind must be one of"),
    ("padded_slots", 0, "baseline size must be a positive integer"),
    ("separate", -3, "baseline size must be a positive integer"),
    ("separate", 2.5, "baseline size must be a positive integer"),
])
def test_bad_baselines(kind, size, match):
    with pytest.raises(ValueError, match=match):
        AdapterMemoryBaseline(kind, size)
    with pytest.raises(ValueError, match="baseline must be an AdapterMemoryBaseline"):
        EngineConfig(baseline=("separate", 8))


def test_adapter_regions_that_leave_no_kv_are_refused(paths):
    with pytest.raises(ValueError, match="leave no KV page"):
        make_llm(paths, (), page_size=16, pool_pages=10, baseline=AdapterMemoryBaseline("separate", 9))
    with pytest.raises(ValueError, match="leave no KV page"):
        make_llm(paths, (), page_size=16, pool_pages=BIG, max_lora_rank=PADDED_RANK,
                 baseline=AdapterMemoryBaseline("padded_slots", 4))  # 4 * 18 pages > 63


@pytest.mark.parametrize("overlap,background", [(False, False), (True, False), (False, True)],
                         ids=["plain_steps", "async_scheduling", "background"])
def test_warmup_compiles_the_base_buckets_and_changes_no_output(paths, llm, overlap, background):
    """After warmup (before serving, or on a background thread), a base-model request of any length
    up to max_context meets no new step shape and no backend compile, and outputs are the shared
    engine's. Without prefix caching (the shapes with context: tests/test_context_warmup.py)."""
    from jax import monitoring
    eng = make_llm(paths, names=(), page_size=4, pool_pages=64, max_num_seqs=2, max_num_batched_tokens=32,
                   async_scheduling=overlap, enable_prefix_caching=False)
    if background:
        done = []
        eng.engine.warmup_in_background(max_context=32, on_done=lambda count, _: done.append(count)).join(120)
        n = done[0]
    else:
        n = eng.warmup(max_context=32, progress=False)
    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda event, duration, **_: compiles.append(event) if event == COMPILE_EVENT else None)
    # decode: batches 1, 2 x page tables of 1, 2, 4, 8 pages (one, max_model_len's, under the Pallas
    # kernel: the GPU default); prefill of fresh prompts: 16 or 32 tokens (no page table read).
    tables = 1 if eng.engine.opts.attention_backend == "pallas" else 4
    assert n == 2 * tables + 2
    assert len(eng.engine._shapes) == n
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
    prompts = [[7] * 3, list(range(3, 29))]
    for prompt in prompts:
        eng.generate([prompt], sp)
        assert len(eng.engine._shapes) == n, "a warmed-up base shape compiled again"
    assert compiles == [], "a step compiled after warmup"
    assert_same(eng.generate(prompts, sp), llm.generate(prompts, sp))
    assert_drained(eng)


def test_background_warmup_waits_while_a_step_compiles_on_first_use(paths, monkeypatch):
    """A step of a new shape clears Engine.compile_gate for its dispatch (a waiting request's compile
    goes first); a step of a known shape leaves it set; and the background warm-up starts no shape
    while the gate is clear, then compiles every one once it opens."""
    eng = make_llm(paths, names=(), page_size=4, pool_pages=64, max_num_seqs=2, max_num_batched_tokens=32)
    engine = eng.engine
    gate_at_dispatch = []
    dispatch = engine._dispatch
    monkeypatch.setattr(engine, "_dispatch", lambda inp: (gate_at_dispatch.append(engine.compile_gate.is_set()),
                                                          dispatch(inp))[1])
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    eng.generate([[7] * 3], sp)
    first = list(gate_at_dispatch)
    assert first[0] is False and engine.compile_gate.is_set()  # the first step compiled behind a closed gate
    gate_at_dispatch.clear()
    eng.generate([[7] * 3], sp)
    assert gate_at_dispatch == [True] * len(first)  # the same shapes again: nothing compiles
    engine.compile_gate.clear()
    before = set(engine._shapes)
    done = []
    thread = engine.warmup_in_background(max_context=32, on_done=lambda count, _: done.append(count))
    thread.join(1.0)
    assert thread.is_alive() and not done and engine._shapes == before
    engine.compile_gate.set()
    thread.join(120)
    assert done and done[0] > 0 and len(engine._shapes) >= done[0]


def test_warmup_takes_each_kinds_smallest_shape_first(paths):
    """first_use_order: decode and prefill shapes in turn, each kind smallest first, so a first
    request's two steps (a short prompt's prefill, then decode at batch 1) load before the rest."""
    from slora_jax.engine.warmup import first_use_order, shape_key
    eng = make_llm(paths, names=(), page_size=4, pool_pages=64, max_num_seqs=4, max_num_batched_tokens=32)
    shapes = eng.engine.warmup_shapes(max_context=32)
    ordered = first_use_order(shapes)
    assert sorted(map(repr, map(shape_key, ordered))) == sorted(map(repr, map(shape_key, shapes)))
    n_decode = sum(inp.decode for inp in shapes)
    assert 0 < n_decode < len(shapes)
    k = 2 * min(n_decode, len(shapes) - n_decode)
    assert [inp.decode for inp in ordered[:k]] == [False, True] * (k // 2)  # in turn
    first_prefill, first_decode = ordered[0], ordered[1]
    assert first_prefill.tokens.shape[0] == min(inp.tokens.shape[0] for inp in shapes if not inp.decode)
    assert first_decode.tokens.shape[0] == 1
    assert first_decode.page_table.shape[1] == min(inp.page_table.shape[1] for inp in shapes if inp.decode)
    for decode in (False, True):
        sizes = [inp.tokens.shape[0] * (inp.page_table.shape[1] if decode else  # tokens x pages read
                                        1 + (inp.ctx_pages.shape[0] if inp.prefill_context else 0))
                 for inp in ordered if inp.decode == decode]
        assert sizes == sorted(sizes)


def small_query_blocks(monkeypatch, block=16):
    """The xla packed prefill attention in blocks of `block` queries (attention.QUERY_BLOCK is read
    when a step traces: the compiled steps of other blocks are dropped)."""
    from slora_jax.engine import attention
    monkeypatch.setattr(attention, "QUERY_BLOCK", block)
    jax.clear_caches()


def test_prefill_attention_in_query_blocks_matches_reference(paths, ref, monkeypatch):
    """The xla prefill attention in blocks of 16 queries (W's prefill packs 42 tokens into 64)."""
    small_query_blocks(monkeypatch)
    engine = make_llm(paths, page_size=16, pool_pages=BIG)
    assert_same(engine.generate(W_PROMPTS, SP, adapter=W_NAMES), ref["old"])
    assert_drained(engine)
    jax.clear_caches()


def test_prefill_key_window_and_context_free_steps_match_reference(paths, monkeypatch):
    """Packed prefill in blocks of 16 queries with a key window: steps of fresh prompts (no pooled
    keys at all) whose prompts are not split to fill a step, as the reference."""
    from slora_jax.engine import step as paged
    small_query_blocks(monkeypatch)
    engine = make_llm(paths, page_size=16, pool_pages=BIG, max_num_batched_tokens=64)
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(3, CFG.vocab_size, 10)] for _ in range(12)]
    names = ["a", None, "b", "c"] * 3
    seen, step = [], paged.step

    def spy(params, pool, inp, **kw):
        if not inp.decode:
            seen.append((inp.prefill_context, inp.key_window, inp.tokens.shape[0], inp.page_table.shape[0]))
            assert inp.sample_idx.shape[0] == 16
        return step(params, pool, inp, **kw)
    monkeypatch.setattr(paged, "step", spy)
    outs = engine.generate(prompts, SP, adapter=names)
    # 120 prompt tokens, 64 a step: 6 prompts, then 6 more, both fresh (60 tokens in 64). 16
    # sequence rows.
    assert seen == [(False, 16, 64, 16), (False, 16, 64, 16)], seen
    loaded = {n: load_peft_adapter(paths[n], CFG) for n in ("a", "b", "c")}
    want = ReferenceEngine(CFG, engine.params, "float32").generate(
        prompts, [SP] * 12, [0] * 12, [loaded[a] if a else None for a in names], CFG.eos_token_ids)
    assert_same(outs, want)
    assert_drained(engine)
    jax.clear_caches()


def test_prefill_and_decode_lora_buckets_are_chosen_apart(paths, ref, monkeypatch):
    """lora_backend="pallas": prefill steps carry the kernel's fixed slot bucket (max_prefill_seqs),
    decode steps a bucket that follows their adapters, and the tokens are the reference's."""
    from slora_jax.engine import step as paged
    engine = make_llm(paths, page_size=16, pool_pages=BIG, lora_backend="pallas")
    seen, step = set(), paged.step

    def spy(params, pool, inp, **kw):
        if inp.lora is not None:
            seen.add((inp.decode, inp.lora.backend, inp.lora.token_slot.shape[0] and len(inp.lora.seg_starts) - 1))
        return step(params, pool, inp, **kw)
    monkeypatch.setattr(paged, "step", spy)
    assert_same(engine.generate(W_PROMPTS, SP, adapter=W_NAMES), ref["old"])
    assert seen == {(False, "pallas", 16), (True, "pallas", 8)}, seen  # 4 adapters: the decode bucket is >= 8
    assert_drained(engine)


def test_auto_lora_backend_switches_on_distinct_adapters(paths, monkeypatch):
    """lora_backend="auto" as on a GPU (slora_jax.lora.select with platform "gpu"; the kernels still
    run in interpret mode here, and the rank-split kernel is unavailable): a decode step with at
    most hybrid_slots(max_lora_rank) distinct adapters takes the one-hot path at its bucket, one
    with more the Pallas kernel at the batch's bucket; prefill takes the kernel. Twelve names over
    three adapter files (each name its own pages), then four: the tokens are the reference's both ways."""
    from slora_jax import lora as lora_select
    from slora_jax.engine import engine as engine_mod
    from slora_jax.engine import step as paged
    # the switch follows the one-hot path's slots x max rank: 8 slots at rank 64, 32 at rank 16 and below
    assert [lora_select.hybrid_slots(r) for r in (8, 16, 32, 64, 128)] == [32, 32, 16, 8, 8]

    def on_gpu(fn):
        return lambda *a, platform=None, **k: fn(*a, platform="gpu", **k)
    monkeypatch.setattr(engine_mod, "slot_bucket", on_gpu(lora_select.slot_bucket))
    monkeypatch.setattr(engine_mod, "step_backend", lambda opt, decode, slots, t, rank, platform, **k:
                        lora_select.step_backend(opt, decode, slots, t, rank, "gpu", **k))
    files = ["a", "b", "c"]
    names = [f"{files[i % 3]}{i}" for i in range(12)]
    engine = LLM("tiny", adapters={n: paths[n[0]] for n in names}, dtype="float32", page_size=16,
                 pool_pages=BIG * 2, lora_backend="auto", max_lora_rank=64, max_num_seqs=16)
    seen, step = set(), paged.step

    def spy(params, pool, inp, **kw):
        if inp.lora is not None:
            seen.add((inp.decode, inp.lora.backend, len(inp.lora.seg_starts) - 1))
        return step(params, pool, inp, **kw)
    monkeypatch.setattr(paged, "step", spy)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, CFG.vocab_size, n)] for n in rng.integers(2, 9, 12)]
    loaded = {n: load_peft_adapter(paths[n], CFG) for n in files}
    reference = ReferenceEngine(CFG, engine.params, "float32")
    for k in (12, 4):
        seen.clear()
        outs = engine.generate(prompts[:k], SP, adapter=names[:k])
        want = reference.generate(prompts[:k], [SP] * k, [0] * k, [loaded[n[0]] for n in names[:k]],
                                  CFG.eos_token_ids)
        assert_same(outs, want)
        decode = {x for x in seen if x[0]}
        assert decode == ({(True, "pallas", 16)} if k == 12 else {(True, "xla", 4)}), seen  # 4 rows
        assert {x[1] for x in seen if not x[0]} == {"pallas"}, seen
    assert_drained(engine)


def test_warmup_with_adapters_covers_the_lora_buckets(paths, ref):
    """With adapters registered, warmup also compiles every LoRA slot bucket on their modules: the
    mixed batch W then runs without a new step shape, and as the reference. Without prefix caching
    (its shapes with context: tests/test_context_warmup.py)."""
    eng = make_llm(paths, page_size=16, pool_pages=BIG, max_num_seqs=8, max_num_batched_tokens=64,
                   enable_prefix_caching=False)
    n = eng.warmup(max_context=16, progress=False, workers=2)  # two compile threads
    # decode: batches 1, 2, 4, 8 (one page), each base and LoRA at its one slot bucket (at least 8,
    # at most the batch); prefill of 16, 32, 64 tokens (up to MAX_PREFILL_SEQS = 16 sequences),
    # base and LoRA at 8 and 16 slots; LoRA on two module sets (the registered adapters' attention
    # modules, and all seven).
    assert n == 4 * (1 + 2) + 3 * (1 + 2 * 2)
    assert_same(eng.generate(W_PROMPTS, SP, adapter=W_NAMES), ref["old"])
    assert len(eng.engine._shapes) == n, "a warmed-up LoRA shape compiled again"
    assert_drained(eng)


def test_batches_of_adapters_with_other_targets_share_a_module_set(paths, ref, monkeypatch):
    """A batch carries the smallest of the registered adapters' module sets (attention, or all)
    that holds its adapters' modules, so "b" (q, v) alone and "d" (k, o) alone run the same
    LoRA step shape, an MLP adapter takes the full set, and the outputs are the reference's."""
    from slora_jax.engine import step as paged
    engine = make_llm(paths, page_size=16, pool_pages=BIG)
    seen, step = [], paged.step

    def spy(params, pool, inp, **kw):
        if inp.lora is not None:
            seen.append(tuple(inp.lora.rows))
        return step(params, pool, inp, **kw)
    monkeypatch.setattr(paged, "step", spy)
    attention, every = ("q_proj", "k_proj", "v_proj", "o_proj"), tuple(engine.engine.slots.module_sets()[-1])
    for k, want in ((1, attention), (4, attention), (3, every)):  # W rows: "b", "d", "c"
        seen.clear()
        assert_same(engine.generate([W_PROMPTS[k]], SP, adapter=W_NAMES[k]), [ref["old"][k]])
        assert set(seen) == {want}, (W_NAMES[k], set(seen))
    assert len(every) == 7
    assert_drained(engine)


def test_long_prompt_chunks_beside_fresh_prompts_match_reference(paths, monkeypatch):
    """A prompt longer than a step's budget is chunked; its later chunks (pooled context, their own
    page-table row) share steps with fresh prompts. Every output is the reference's."""
    from slora_jax.engine import step as paged
    engine = make_llm(paths, page_size=4, pool_pages=BIG * 4, max_num_batched_tokens=16, max_prefill_seqs=4)
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(3, CFG.vocab_size, n)] for n in (40, 5, 7, 3)]
    names = ["a", None, "b", "c"]
    rows, step = [], paged.step

    def spy(params, pool, inp, **kw):
        if not inp.decode and inp.prefill_context:
            rows.append(len(set(np.asarray(inp.ctx_page_seq).tolist()) - {-1}))
        return step(params, pool, inp, **kw)
    monkeypatch.setattr(paged, "step", spy)
    outs = engine.generate(prompts, SP, adapter=names)
    assert rows and max(rows) == 1, rows  # only the long prompt ever has context
    loaded = {n: load_peft_adapter(paths[n], CFG) for n in ("a", "b", "c")}
    want = ReferenceEngine(CFG, engine.params, "float32").generate(
        prompts, [SP] * 4, [0] * 4, [loaded[a] if a else None for a in names], CFG.eos_token_ids)
    assert_same(outs, want)
    assert_drained(engine)


# ------------------------------------------------------------------------------------------------
# Async scheduling: step n+1 is dispatched before step n's tokens reach the host; its input tokens
# come from step n's results on the device. Outputs must be those of the plain step loop.


def _spy_fed_tokens(monkeypatch):
    """Record, per dispatched step, how many of its tokens were fed from the device."""
    fed = []
    real = paged.step

    def spy(params, pool, inp, **kw):
        assert inp.token_src is not None and inp.prev_results is not None
        fed.append(int((np.asarray(inp.token_src) >= 0).sum()))
        return real(params, pool, inp, **kw)
    monkeypatch.setattr(paged, "step", spy)
    return fed


@pytest.mark.parametrize("case", ["plain", "preempting"])
def test_overlapped_steps_match_reference(paths, ref, monkeypatch, case):
    options = {"plain": dict(page_size=16, pool_pages=BIG),
               "preempting": dict(page_size=4, pool_pages=tight_pool(paths))}[case]
    engine = make_llm(paths, async_scheduling=True, **options)
    fed = _spy_fed_tokens(monkeypatch)
    outs = engine.generate(W_PROMPTS, SP, adapter=W_NAMES)
    assert_same(outs, ref["old"])
    # Every token after a request's first was sampled by the step just before the one that reads
    # it, so it comes from the device; with preemption, some come back through a prefill instead.
    decode_tokens = len(W_PROMPTS) * (MAX_TOKENS - 1)
    if case == "preempting":
        assert decode_tokens / 2 < sum(fed) < decode_tokens, fed
    else:
        assert sum(fed) == decode_tokens, fed
    if case == "plain":
        assert fed == [0] + [len(W_PROMPTS)] * (MAX_TOKENS - 1)  # the prefill step, then all rows
    st = engine.stats()
    if case == "preempting":
        assert st["preempted"] > 0, st
    assert st["tokens_generated"] == len(W_PROMPTS) * MAX_TOKENS  # no token of a dropped row counted
    assert_drained(engine)


def test_overlapped_steps_stop_tokens_and_seeded_sampling_match_plain_steps(paths, llm, ref, monkeypatch):
    """A row that stops on a stop token while its next step is already dispatched: that step's
    token is dropped, the pages come back, and every other row (seeded sampling included) gets
    the plain loop's tokens."""
    toks = ref["old"][2].token_ids
    k = next(i for i in range(1, len(toks)) if toks[i] not in toks[:i])
    params = [SEEDED, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7, ignore_eos=True)] + \
        [SP] * (len(W_PROMPTS) - 2)
    params[2] = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[toks[k]],
                               ignore_eos=True, logprobs=True)
    plain = llm.generate(W_PROMPTS, params, adapter=W_NAMES)
    engine = make_llm(paths, page_size=16, pool_pages=BIG, async_scheduling=True)
    _spy_fed_tokens(monkeypatch)
    outs = engine.generate(W_PROMPTS, params, adapter=W_NAMES)
    assert outs[2].finish_reason == "stop" and outs[2].token_ids == toks[:k + 1]
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in plain]
    assert_drained(engine)
    assert_drained(llm)


def test_overlapped_steps_abort_in_flight(paths, ref):
    """A request aborted while a step holding it is on the device: nothing of it comes back after
    the abort, the others are unchanged, and the pool drains."""
    engine = make_llm(paths, page_size=16, pool_pages=BIG, async_scheduling=True)
    eng = engine.engine
    rids = [eng.add_request(p, SP, a, 0, CFG.eos_token_ids).request_id for p, a in zip(W_PROMPTS, W_NAMES)]
    outs = {}
    for _ in range(3):  # the prefill step, then decode steps in flight
        for o in eng.step():
            outs[o.request_id] = o
    victim = eng.sched.running[0]
    assert victim.tokens[-1] == PENDING  # its token of the in-flight step is not on the host yet
    eng.abort(victim.rid)
    kept = len(victim.out.token_ids)
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert victim.out.finish_reason == "abort" and len(victim.out.token_ids) == kept
    rows = [i for i, r in enumerate(rids) if r != victim.rid]
    assert_same([outs[rids[i]] for i in rows], [ref["old"][i] for i in rows])
    assert_drained(engine)


@pytest.mark.parametrize("pallas", [False, True], ids=["xla", "pallas"])
def test_overlapped_steps_equal_plain_steps_on_a_random_workload(paths, pallas):
    """Random lengths, max_tokens from 1, stop tokens, greedy and seeded rows, four adapters and the
    base model, in a pool so tight that it preempts requests and evicts adapters: the overlapped
    loop gives the plain loop's tokens, finish reasons and logprobs. pallas: both on the Pallas
    kernels (whose schedules are inputs too)."""
    rng = np.random.default_rng(11)
    n = 12
    prompts = [[int(t) for t in rng.integers(3, CFG.vocab_size, int(rng.integers(1, 12)))] for _ in range(n)]
    names = [[None, "a", "b", "c", "d"][int(rng.integers(0, 5))] for _ in range(n)]
    lengths = [1 if i == 1 else int(rng.integers(1, MAX_TOKENS + 1)) for i in range(n)]

    def sampling(i, stops=None):
        return SamplingParams(max_tokens=lengths[i], ignore_eos=True, logprobs=True, stop_token_ids=stops,
                              **(dict(temperature=0.9, seed=i) if i % 2 else dict(temperature=0.0)))
    kv = 5  # KV pages of 4 tokens: one row at its full length (up to 5 pages) fills them
    options = dict(page_size=4, pool_pages=1 + sum(pages_of(paths, a, 4) for a in "abcd") + kv, max_num_seqs=6,
                   max_num_batched_tokens=8, max_prefill_seqs=3,
                   **(dict(lora_backend="pallas") if pallas else {}))
    reference = make_llm(paths, **options)
    # Every third row stops on its own third token (seen in a first run without stops).
    first = reference.generate(prompts, [sampling(i) for i in range(n)], adapter=names)
    params = [sampling(i, [first[i].token_ids[2]]) if i % 3 == 0 and len(first[i].token_ids) > 3 else sampling(i)
              for i in range(n)]
    plain = reference.generate(prompts, params, adapter=names)
    engine = make_llm(paths, async_scheduling=True, **options)
    outs = engine.generate(prompts, params, adapter=names)
    assert any(o.finish_reason == "stop" for o in plain) and any(len(o.token_ids) == 1 for o in plain)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in plain]
    for o, p in zip(outs, plain):
        np.testing.assert_allclose(o.logprobs, p.logprobs, atol=1e-5, rtol=0)
    st = engine.stats()
    assert st["tokens_generated"] == sum(len(o.token_ids) for o in plain)
    assert st["preempted"] > 0 and st["evictions"] > 0, st  # pages reused under a step in flight
    assert_drained(engine)


def test_grouped_qkv_shrink_changes_no_output(paths, ref, monkeypatch):
    """Pallas LoRA with q, k and v in one shrink launch: the reference's tokens, and the grouped
    launch is really taken, on q, k and v rows stacked on the host (no stacking op in the layer)."""
    from slora_jax.lora import backends
    groups, host_stacked = [], []
    real = backends.lora_shrink_group

    def spy(x, rows, a_rows, *args, **kw):
        groups.append(len(a_rows))
        host_stacked.append(not isinstance(a_rows, (list, tuple)))  # lora.stack_qkv's [G, Sa, RA]
        return real(x, rows, a_rows, *args, **kw)
    monkeypatch.setattr(backends, "lora_shrink_group", spy)
    rows = [0, 1, 3, 5]  # adapters a, b, c (q, k, v among their targets) and a again
    sp = SamplingParams(max_tokens=3, temperature=0.0, logprobs=True, ignore_eos=True)
    engine = make_llm(paths, page_size=16, pool_pages=BIG, lora_backend="pallas")
    outs = engine.generate([W_PROMPTS[i] for i in rows], sp, adapter=[W_NAMES[i] for i in rows])
    assert_same(outs, [ref["old"][i] for i in rows], lengths=[3] * len(rows))
    assert max(groups, default=0) == 3, groups
    assert all(st == (g > 1) for g, st in zip(groups, host_stacked)), (groups, host_stacked)
    assert_drained(engine)


def generates_reference_tokens(paths, ref):
    """A Pallas-backend LLM under the kernel settings a test set: four adapters' greedy tokens are
    the reference's and the engine drains. The jit caches are cleared before (no step traced by an
    earlier test) and after. Returns the LLM."""
    rows = [0, 1, 3, 5]
    sp = SamplingParams(max_tokens=3, temperature=0.0, logprobs=True, ignore_eos=True)
    jax.clear_caches()
    try:
        engine = make_llm(paths, page_size=16, pool_pages=BIG, lora_backend="pallas")
        outs = engine.generate([W_PROMPTS[i] for i in rows], sp, adapter=[W_NAMES[i] for i in rows])
        assert_same(outs, [ref["old"][i] for i in rows], lengths=[3] * len(rows))
        assert_drained(engine)
        return engine
    finally:
        jax.clear_caches()


def test_split_planes_change_no_output(paths, ref, monkeypatch):
    """Split-K shrink partial sums in planes of xa, added by the expand: the reference's tokens, and
    the planes really reach the expands (16-column chunks, so the tiny model's width splits; at its
    own default chunk the tiny model's shrink does not split)."""
    from pallas_kernels.lora import ShrinkBlockSizes
    from slora_jax.lora import backends
    monkeypatch.setitem(backends.BACKENDS, "pallas",
                        backends.PallasBackend(shrink_sizes=ShrinkBlockSizes(col_tile=16, split_k=4)))
    planes = []
    real = backends.lora_expand

    def spy(y, xa, *args, **kw):
        planes.append(xa.shape[0] if xa.ndim == 3 else 1)
        return real(y, xa, *args, **kw)
    monkeypatch.setattr(backends, "lora_expand", spy)
    generates_reference_tokens(paths, ref)
    assert 4 in planes, planes


def test_mbgmv_decode_changes_no_output(paths, ref, monkeypatch):
    """The Pallas decode steps' shrinks in blocks of one token (multiply-and-sum products) where
    their column tile reaches gemv_col_tile: the reference's tokens, and block_t 1 really reaches
    the decode steps' shrinks, and only those (expands and prefill steps keep BLOCK_T)."""
    from pallas_kernels.lora import BLOCK_T, ShrinkBlockSizes
    from slora_jax.lora import backends
    # gemv_col_tile 16: the tiny models' widths do not reach the default 1024
    monkeypatch.setitem(backends.BACKENDS, "pallas",
                        backends.PallasBackend(shrink_sizes=ShrinkBlockSizes(gemv_col_tile=16)))
    seen = {"shrink": [], "expand": []}

    def spy(name, real):
        def wrapped(*args, **kw):
            seen[name].append(kw["block_t"])
            return real(*args, **kw)
        return wrapped
    monkeypatch.setattr(backends, "lora_expand", spy("expand", backends.lora_expand))
    monkeypatch.setattr(backends, "lora_shrink_group", spy("shrink", backends.lora_shrink_group))
    generates_reference_tokens(paths, ref)
    assert set(seen["shrink"]) == {1, BLOCK_T}, seen["shrink"]
    assert set(seen["expand"]) == {BLOCK_T}, seen["expand"]


def test_adapter_status_for_routers(paths):
    """LLM.adapter_status (the server's GET /v1/adapters): each adapter's ranks and pages, whether
    it is resident in the device pool and cached in host memory, and its running and waiting
    requests, as a request for it waits, runs and finishes."""
    from slora_jax.model.config import TARGET_MODULES
    engine = make_llm(paths, page_size=16, pool_pages=BIG, max_cpu_loras=1)
    status = {a["name"]: a for a in engine.adapter_status()}
    assert list(status) == ["a", "b", "c", "d"]
    assert status["a"]["ranks"] == {m: 8 for m in TARGET_MODULES}
    assert status["b"]["ranks"] == {"q_proj": 4, "v_proj": 4}
    assert status["c"]["pages"] > status["d"]["pages"] > 0
    assert not any(a["resident"] or a["running"] or a["waiting"] for a in status.values())
    assert sum(a["host_cached"] for a in status.values()) == 1  # a host cache of one file

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    eng = engine.engine
    out = eng.add_request(W_PROMPTS[1], sp, "b", 0, CFG.eos_token_ids)
    b = {a["name"]: a for a in engine.adapter_status()}["b"]
    assert (b["running"], b["waiting"]) == (0, 1)
    while not out.token_ids:
        eng.step()
    status = {a["name"]: a for a in engine.adapter_status()}
    assert (status["b"]["running"], status["b"]["waiting"]) == (1, 0)
    assert status["b"]["resident"] and status["b"]["host_cached"]
    while eng.has_unfinished():
        eng.step()
    status = {a["name"]: a for a in engine.adapter_status()}
    assert status["b"]["resident"] and status["b"]["running"] == 0  # idle in the pool until evicted
    assert [n for n, a in status.items() if a["resident"]] == ["b"]
    assert_drained(engine)


def test_step_temporaries_do_not_grow_with_the_pool(paths):
    """A step reads its pages where they lie: the compiled step's temporaries stay the same when
    the pool grows 8x (a copy of a pool layer, reshaped for a kernel or gathered whole, would grow
    them by a layer). On a GPU this checks the platform's own backends."""
    temps, layer_bytes = {}, {}
    for pages in (256, 2048):
        llm = make_llm(paths, page_size=16, pool_pages=pages)
        eng = llm.engine
        layer_bytes[pages] = eng.kv[0].nbytes
        shapes = eng.warmup_shapes(max_context=64)
        for decode in (True, False):
            inp = next(s for s in shapes if s.decode == decode and s.lora is not None)
            compiled = paged.forward_sample.lower(llm.params, eng.kv, inp, cfg=llm.cfg).compile()
            temps[pages, decode] = compiled.memory_analysis().temp_size_in_bytes
    growth = layer_bytes[2048] - layer_bytes[256]
    for decode in (True, False):
        assert abs(temps[2048, decode] - temps[256, decode]) < growth // 4, (decode, temps, growth)


@pytest.mark.parametrize("page_size,tp", [(1, 1), (16, 1), (16, 2)])
def test_max_pool_pages_keeps_a_layer_in_int32_offsets(page_size, tp):
    """The cap is the most pages whose layer (as empty_pool shapes it, 1/tp of it a device) stays
    below 2**31 elements, the int32 offsets of the Triton kernels."""
    pages = paged.max_pool_pages(CFG, page_size, tp)
    per_page = 2 * page_size * CFG.kv_size // tp   # empty_pool's (num_pages, 2, page_size, kv_size)
    assert pages * per_page < 2**31 <= (pages + 1) * per_page


def test_pool_sized_from_memory_is_capped_and_an_explicit_oversize_refused_on_gpu(paths, monkeypatch):
    """A pool sized from device memory stops at paged.max_pool_pages (a small model on a large GPU
    would size a layer past int32 offsets); pool_pages past the cap is refused where the GPU
    kernels would address it, and kept on the xla backends."""
    from slora_jax.engine import engine as engine_mod
    monkeypatch.setattr(paged, "max_pool_pages", lambda cfg, ps, tp=1: 40)
    monkeypatch.setattr(engine_mod, "pool_bytes", lambda stats, share, working: 10**12)
    engine = make_llm(paths, ("a",), page_size=16).engine
    assert engine.num_pages == 40 and len(engine.kv) == CFG.num_hidden_layers and engine.kv[0].shape[0] == 40

    def sized(**options):
        config = EngineConfig(page_size=16, **options)
        stub = SimpleNamespace(config=config, opts=engine_mod.LoraChoices.resolve(config), cfg=CFG, ps=16,
                               dtype=np.dtype("float32"))
        return engine_mod.Engine._pool_pages(stub)
    assert sized() == 40
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert sized(pool_pages=40, lora_backend="xla", attention_backend="xla") == 40
    with pytest.raises(ValueError, match="at most 40 pages"):
        sized(pool_pages=41, attention_backend="pallas", lora_backend="xla")
    assert sized(pool_pages=41, attention_backend="xla", lora_backend="xla") == 41
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")   # interpret mode: no int32 limit
    assert sized(pool_pages=41, attention_backend="pallas") == 41


def test_gpu_memory_utilization_is_a_share_of_total_memory(paths, monkeypatch):
    """gpu_memory_utilization has vLLM's meaning: the engine may use that share of the device's
    TOTAL memory for weights, pool and working memory. With a fake device of 8 GiB, 1 GiB in use
    (the weights), the pool gets share * 8 GiB - 1 GiB - the step's working memory; a share below
    what is in use leaves no pool; a device without a limit (the CPU) gets 1 GiB."""
    from slora_jax.engine import engine as engine_mod
    gib = 2**30
    monkeypatch.setattr(engine_mod, "_memory_stats", lambda: {"bytes_limit": 8 * gib, "bytes_in_use": gib})
    for share in (0.5, 0.9):
        engine = make_llm(paths, ("a",), page_size=16, gpu_memory_utilization=share).engine
        working = engine_mod.activation_bytes(CFG, engine.config, "float32")
        assert 0 < working < gib
        page = paged.page_bytes(CFG, 16, "float32")
        assert engine.num_pages == (int(share * 8 * gib) - gib - working) // page
        assert engine.num_pages * page + gib + working <= share * 8 * gib < (engine.num_pages + 1) * page + gib + working
    assert engine_mod.pool_bytes({"bytes_limit": 8 * gib, "bytes_in_use": 4 * gib}, 0.5, working) == 0
    assert engine_mod.pool_bytes({}, 0.9, working) == engine_mod.CPU_POOL_BYTES == gib
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(gpu_memory_utilization=1.5)


@pytest.mark.parametrize("field, value", [
    ("page_size", 0), ("max_num_seqs", -1), ("max_num_batched_tokens", 1.5), ("max_loras", True),
    ("max_lora_rank", 0), ("max_cpu_loras", 0), ("tensor_parallel_size", 0), ("pool_pages", 0),
    ("gpu_memory_utilization", 0.0), ("max_cpu_lora_gb", -1.0), ("max_wait_s", -0.5),
    ("early_abort_ttft", 0), ("prefetch_adapters", -1), ("admission_order", "lifo"),
    ("lora_backend", "triton"), ("attention_backend", "cuda"),
])
def test_engine_config_refuses_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_llm_refuses_unknown_options_naming_the_valid_ones(paths):
    """A name that is not an EngineConfig field (an old name included) is refused before any
    weight is loaded, and the message lists the fields; a config and fields combine."""
    for bad in ("max_prefill_tokens", "overlap_steps", "stable_buffers"):
        with pytest.raises(ValueError, match=f"unknown option {bad}") as err:
            LLM("tiny", dtype="float32", **{bad: 1})
        assert all(name in str(err.value) for name in EngineConfig.field_names())
    assert len(EngineConfig.field_names()) + len(dataclasses.fields(AdapterMemoryBaseline)) <= 24
    llm = make_llm(paths, ("a",), config=EngineConfig(page_size=4, max_num_seqs=3), pool_pages=BIG)
    assert (llm.config.page_size, llm.config.max_num_seqs, llm.config.pool_pages) == (4, 3, BIG)
    assert llm.engine.config is llm.config and llm.engine.sched.config is llm.config


@pytest.mark.parametrize("env,kept", [({}, 0.0), ({"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "2.5"}, 2.5)])
def test_compilation_cache_keeps_every_executable_unless_told(tmp_path, env, kept):
    """enable_compilation_cache (in a fresh interpreter, so this one's JAX config stays as it is):
    the cache directory, and a compile-time threshold of 0, so a restart compiles nothing small
    again; the environment's threshold wins where it is set."""
    import subprocess
    import sys
    code = ("import jax; from slora_jax.engine.engine import enable_compilation_cache as e; "
            f"e({str(tmp_path)!r}); "
            "print(jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)")
    base = {k: v for k, v in os.environ.items() if k != "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"}
    out = subprocess.run([sys.executable, "-c", code], env={**base, "JAX_PLATFORMS": "cpu", **env},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(tmp_path), str(kept)]
