"""Prefill steps with context in the pool (a prompt after cached pages, a split prompt's later
chunk) on the "tiny" model in float32: their shapes, their warm-up, and the scheduler's limit on
the context one step reads (StepInputBuilder.context_bucket, warmup.warmup_shapes).

Such a step lists its sequences' context pages in one bucket (at least the pages of a step's token
budget), not rows times its longest context, so it has few shapes; under prefix caching, where
these steps are common, warm-up compiles them all, and a run with cache hits and chunked prompts
compiles no prefill step after warm-up. Caching off is the reference for the tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from slora_jax import LLM, SamplingParams
from slora_jax.engine.warmup import compile_shapes, shape_key
from slora_jax.model.config import load_model_config
from slora_jax.model.peft import random_peft_adapter

CFG = load_model_config("tiny")
SP = SamplingParams(max_tokens=4, temperature=0.0, logprobs=True, ignore_eos=True)
_rng = np.random.default_rng(3)


def toks(n: int) -> list[int]:
    return [int(t) for t in _rng.integers(3, CFG.vocab_size, n)]


LONG, SHORT = toks(30), toks(9)   # LONG: two chunks at 16 tokens a step
PREFIXES = [toks(12) for _ in range(4)]  # 3 full pages each: 12 pages of hits in all


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return random_peft_adapter(tmp_path_factory.mktemp("adapters") / "b", CFG, rank=4,
                               targets=["q_proj", "v_proj"], seed=2)


def make_llm(adapter, caching: bool) -> LLM:
    return LLM("tiny", adapters={"b": adapter}, dtype="float32", max_model_len=64, page_size=4,
               pool_pages=96, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=caching)


def generate(llm):
    """Prompts with context prefill: LONG split in two, then LONG again (its cached pages) beside
    SHORT under the adapter, then both prefixes continued; then four 12-token prefixes, and the
    same four again with one more token each, in one batch (12 pages of hits: more than a step's
    context bucket of 4 pages)."""
    outs = []
    for prompts, names in (([LONG], [None]), ([LONG, SHORT], [None, "b"]),
                           ([LONG[:8] + SHORT, SHORT + LONG[:3]], [None, "b"]),
                           (PREFIXES, [None] * 4), ([p + [5] for p in PREFIXES], [None] * 4)):
        outs += llm.generate(prompts, SP, adapter=names)
    return outs


def context_steps(seen):
    return [inp for inp in seen if not inp.decode and inp.prefill_context]


def spy(monkeypatch, eng, seen):
    dispatch = eng._dispatch
    monkeypatch.setattr(eng, "_dispatch", lambda inp: seen.append(inp) or dispatch(inp))


def test_warmup_covers_context_prefill_under_caching(adapter, monkeypatch):
    llm = make_llm(adapter, caching=True)
    eng = llm.engine
    assert eng.builder.context_pages == eng.sched.max_context_pages == 4  # 16 tokens a step at page size 4
    # The prefill shapes only (decode steps are not what caching changes): fewer compiles.
    warmed = [inp for inp in eng.warmup_shapes(llm.max_model_len) if not inp.decode]
    assert {inp.ctx_pages.shape[0] for inp in warmed if inp.prefill_context} == {4, 8, 16}  # up to 64 tokens
    assert any(not inp.prefill_context for inp in warmed)
    compile_shapes(eng, warmed, progress=False)
    warmed_keys = {shape_key(inp) for inp in warmed}
    assert eng._shapes == warmed_keys
    seen = []
    spy(monkeypatch, eng, seen)
    outs = generate(llm)
    assert llm.stats()["prefix_cache"]["hits"] >= 12 * 4
    context = context_steps(seen)
    assert len(context) >= 4 and any(inp.lora is not None for inp in context)
    assert {shape_key(inp) for inp in seen if not inp.decode} <= warmed_keys  # every prefill step was warmed up
    assert eng._shapes - {shape_key(inp) for inp in seen if inp.decode} == warmed_keys  # none compiled
    for inp in context:  # within the step's context bucket, unless one sequence alone has more
        seqs = set(np.asarray(inp.ctx_page_seq).tolist()) - {-1}
        live = int((np.asarray(inp.ctx_page_seq) >= 0).sum())
        assert live <= 4 or len(seqs) == 1, (live, seqs)
    # The four cached prefixes (12 pages) did not fit one step's context: they were split up.
    assert sum(1 for inp in context if len(set(np.asarray(inp.ctx_page_seq).tolist()) - {-1}) == 1) >= 2
    # Caching off: the same tokens and logprobs. Context shapes are warmed up only where prompts
    # can be longer than a step's 16 tokens.
    off = make_llm(adapter, caching=False)
    assert not any(inp.prefill_context for inp in off.engine.warmup_shapes(16) if not inp.decode)
    assert {inp.ctx_pages.shape[0] for inp in off.engine.warmup_shapes(64)
            if not inp.decode and inp.prefill_context} == {4, 8, 16}
    expected = generate(off)
    for o, r in zip(outs, expected, strict=True):
        assert o.token_ids == r.token_ids
        np.testing.assert_allclose(o.logprobs, r.logprobs, atol=1e-5, rtol=0)


def test_context_arrays_list_each_sequences_pages_in_turn(adapter):
    """A step's context pages: each chunk with context gets its pages up to its start, the last
    one partly filled, in row order; padding is the null page with row -1."""
    llm = make_llm(adapter, caching=False)
    b = llm.engine.builder

    class Req:
        def __init__(self, rid):
            self.rid = rid

    b.pool.kv.update({"x": [7, 9, 11], "y": [3, 5], "z": [2]})
    try:
        arrays = b.context_arrays([(Req("x"), 9, 12), (Req("z"), 0, 3), (Req("y"), 4, 6)])
    finally:
        for rid in "xyz":
            del b.pool.kv[rid]
    # x: 9 tokens of context in pages 7, 9, 11 (4 + 4 + 1); y: 4 tokens, page 3 (full); z: none.
    assert arrays["ctx_pages"].tolist() == [7, 9, 11, 3]
    assert arrays["ctx_page_seq"].tolist() == [0, 0, 0, 2]
    assert arrays["ctx_page_fill"].tolist() == [4, 4, 1, 4]


def test_prefill_kernel_reads_any_context_in_one_shape(adapter, monkeypatch):
    """Under attention_backend "pallas" packed prefill runs the Pallas prefill kernel (interpret
    mode on the CPU), whose work follows each row's own context: the scheduler sets no cap on a
    step's context, every prefill step lists its context (none for fresh prompts) in one bucket
    that holds every row at max_model_len, warm-up has one prefill shape per token bucket and
    LoRA bucket, and the four cached prefixes that the xla engine splits over steps go in one.
    The outputs are the xla engine's without caching."""
    llm = LLM("tiny", adapters={"b": adapter}, dtype="float32", max_model_len=64, page_size=4, pool_pages=96,
              max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=True, attention_backend="pallas")
    eng = llm.engine
    assert eng.builder.prefill_kernel and eng.sched.max_context_pages is None
    assert eng.builder.context_pages == 256  # 16 rows x 16 pages (64 tokens at page size 4)
    warmed = [inp for inp in eng.warmup_shapes(64) if not inp.decode]
    assert all(inp.prefill_context and inp.key_window == 0 for inp in warmed)
    assert {inp.ctx_pages.shape[0] for inp in warmed} == {256}
    off = make_llm(adapter, caching=False)
    fresh = [inp for inp in off.engine.warmup_shapes(16) if not inp.decode]
    assert len(warmed) == len(fresh) == len({shape_key(inp) for inp in warmed})
    compile_shapes(eng, warmed, progress=False)
    seen = []
    spy(monkeypatch, eng, seen)
    outs = generate(llm)
    prefill = [inp for inp in seen if not inp.decode]
    assert all(inp.prefill_context and inp.ctx_pages.shape[0] == 256 for inp in prefill)
    assert {shape_key(inp) for inp in prefill} <= {shape_key(inp) for inp in warmed}
    assert llm.stats()["prefix_cache"]["hits"] >= 12 * 4
    rows_over_context = [len(set(np.asarray(inp.ctx_page_seq).tolist()) - {-1}) for inp in prefill]
    assert max(rows_over_context) == 4  # the four cached prefixes, 12 pages, in one step
    expected = generate(off)
    for o, r in zip(outs, expected, strict=True):
        assert o.token_ids == r.token_ids
        np.testing.assert_allclose(o.logprobs, r.logprobs, atol=1e-5, rtol=0)
