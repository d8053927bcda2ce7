"""Fault isolation in the engine: one request's fault never reaches another request's output.

On the "tiny" model in float32 through LLM.generate, a batch of good requests runs beside one bad
request: a step that raises whenever the bad request's row is in it (a host error while its
inputs are built, an error from the jitted step), an adapter whose file is gone or corrupt after
registration, an adapter whose activations overflow (NaN logits, no logprobs asked). The bad
request ends with finish_reason "error", an error code and a message; every good request's greedy
tokens equal those of a run without the bad one; the pool ends idle; the engine serves on.

Faults are injected through one narrow seam each: the engine's input builder, or the jitted step
function, wrapped to raise for a request marked by its first prompt tokens.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from slora_jax import LLM, SamplingParams
from slora_jax.engine import step as paged
from slora_jax.model.config import load_model_config
from slora_jax.model.peft import random_peft_adapter

CFG = load_model_config("tiny")
SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
MARK = [CFG.vocab_size - 3] * 3  # a bad request's prompt starts with these tokens

_rng = np.random.default_rng(41)
GOOD = [[int(t) for t in _rng.integers(3, CFG.vocab_size - 3, n)] for n in (5, 9, 3, 12, 7)]
GOOD_ADAPTERS = ["a", None, "b", "a", None]
BAD = MARK + [11, 12, 13, 14]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("fault_adapters")
    out = {"a": random_peft_adapter(root / "a", CFG, rank=8, targets="all-linear", seed=1),
           "b": random_peft_adapter(root / "b", CFG, rank=4, targets=["q_proj", "v_proj"], seed=2)}
    # Finite weights of 1e30: registration takes them (they fit float32), the activations overflow.
    shutil.copytree(out["a"], root / "huge")
    f = root / "huge" / "adapter_model.safetensors"
    save_file({k: np.full_like(v, 1e30) for k, v in load_file(f).items()}, f)
    out["huge"] = str(root / "huge")
    return out


def make_llm(paths, async_scheduling: bool) -> LLM:
    return LLM("tiny", adapters={n: paths[n] for n in ("a", "b", "huge")}, dtype="float32", page_size=16,
               pool_pages=64, async_scheduling=async_scheduling)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request, paths):
    return make_llm(paths, request.param)


@pytest.fixture(scope="module")
def clean(llm):
    """The good requests' outputs in a run without faults."""
    return [o.token_ids for o in llm.generate(GOOD, SP, adapter=GOOD_ADAPTERS)]


def run_with_bad(llm, bad_prompt=BAD, bad_adapter=None, params=SP):
    """Generate the good requests with one bad one among them: (good outputs, bad output)."""
    prompts = GOOD[:2] + [bad_prompt] + GOOD[2:]
    outs = llm.generate(prompts, params, adapter=GOOD_ADAPTERS[:2] + [bad_adapter] + GOOD_ADAPTERS[2:])
    return outs[:2] + outs[3:], outs[2]


def assert_isolated(llm, clean, good, bad, code, match):
    assert bad.finish_reason == "error" and bad.error_code == code, (bad.finish_reason, bad.abort_reason)
    assert match in bad.abort_reason, bad.abort_reason
    assert [o.token_ids for o in good] == clean
    assert all(o.finish_reason == "length" for o in good)
    s = llm.stats()
    assert s["running"] == 0 and s["waiting"] == 0 and s["kv_pages"] == 0, s
    assert [o.token_ids for o in llm.generate(GOOD, SP, adapter=GOOD_ADAPTERS)] == clean  # serves on


def marked(chunks) -> bool:
    return any(req.tokens[:len(MARK)] == MARK for req, _, _ in chunks)


def test_host_error_while_building_inputs(llm, clean, monkeypatch):
    """The builder raises for the bad request's decode rows (its prefill went through): the
    decode steps are split until its row is alone."""
    build, calls = llm.engine.builder.build, []

    def faulty(plan):
        calls.append(len(plan.chunks))
        if marked([c for c in plan.chunks if c[1] >= c[0].prompt_len]):
            raise ValueError("injected host fault")
        return build(plan)
    monkeypatch.setattr(llm.engine.builder, "build", faulty)
    good, bad = run_with_bad(llm)
    assert len(bad.token_ids) == 1  # its prefill's token only
    monkeypatch.undo()
    assert_isolated(llm, clean, good, bad, "step_failed", "injected host fault")
    assert 1 in calls  # the bad row ran alone


def test_jitted_step_error(llm, clean, monkeypatch):
    """The jitted step raises whenever the bad prompt's tokens are among its inputs (prefill)."""
    step = paged.step

    def faulty(params, pool, inp, **kw):
        tokens = np.asarray(inp.tokens).tolist()
        if any(tokens[i:i + len(MARK)] == MARK for i in range(len(tokens))):
            raise RuntimeError("injected device fault")
        return step(params, pool, inp, **kw)
    monkeypatch.setattr(paged, "step", faulty)
    good, bad = run_with_bad(llm)
    monkeypatch.undo()
    assert bad.token_ids == []
    assert_isolated(llm, clean, good, bad, "step_failed", "injected device fault")


def test_every_row_failing_ends_every_request(llm, clean, monkeypatch):
    """A step that fails whatever it holds ends each request with an error; nothing hangs, nothing
    leaks, and the engine serves once the fault is gone."""
    def broken(*a, **kw):
        raise RuntimeError("injected: every step fails")
    monkeypatch.setattr(paged, "step", broken)
    outs = llm.generate(GOOD, SP, adapter=GOOD_ADAPTERS)
    monkeypatch.undo()
    assert [(o.finish_reason, o.error_code) for o in outs] == [("error", "step_failed")] * len(GOOD)
    s = llm.stats()
    assert s["running"] == 0 and s["kv_pages"] == 0, s
    assert [o.token_ids for o in llm.generate(GOOD, SP, adapter=GOOD_ADAPTERS)] == clean


@pytest.mark.parametrize("fault", ["gone", "corrupt"])
def test_adapter_unreadable_after_registration(llm, clean, paths, tmp_path, fault):
    """An adapter's weights vanish or are overwritten after registration while its rows are in
    neither the host cache nor the pool: its request alone fails, with its name in the message."""
    d = tmp_path / "vanishing"
    shutil.copytree(paths["b"], d)
    store = llm.store
    size, nbytes = store.host_cache_size, store.host_cache_bytes
    store.resize_host_cache(0)  # every page-in reads the disk
    try:
        llm.load_adapter("vanishing", str(d))
        f = d / "adapter_model.safetensors"
        if fault == "gone":
            f.unlink()
        else:
            f.write_bytes(b"\0" * 64)
        good, bad = run_with_bad(llm, GOOD[1], "vanishing")
    finally:
        store.resize_host_cache(size, nbytes)
    assert_isolated(llm, clean, good, bad, "adapter_unavailable", "adapter 'vanishing' could not be read")
    llm.unload_adapter("vanishing")  # nothing of it is left running


def test_non_finite_logits_without_logprobs(llm, clean):
    """An adapter whose activations overflow, its request asking for no logprobs: it ends with
    an error instead of tokens sampled from NaN logits."""
    good, bad = run_with_bad(llm, GOOD[0], "huge")
    assert bad.logprobs is None
    assert_isolated(llm, clean, good, bad, "non_finite_output", "not finite")


def test_lora_rows_past_rank_never_reach_a_token():
    """The xla LoRA backend reads each slot at the batch's max rank; the rows past a slot's own
    rank belong to whatever the pool holds there (a freed KV page of a request whose output
    overflowed holds NaN). They meet an xa of zero, and 0 * NaN must not reach the delta."""
    from slora_jax.lora import lora_xla
    rng = np.random.default_rng(0)
    w, rank, max_rank, t = 8, 2, 4, 5
    pool = rng.standard_normal((2, w)).astype(np.float32)
    pool = np.concatenate([pool[:1], pool[:1] * 0.5 + 1, np.full((2, w), np.nan, np.float32),     # A^T rows
                           pool[1:], pool[1:] - 1, np.full((2, w), np.nan, np.float32)])          # B rows
    x = rng.standard_normal((t, w)).astype(np.float32)
    delta = lora_xla(x, pool, np.array([[0, 1, 2, 3]]), np.array([[4, 5, 6, 7]]), np.array([rank]),
                     np.zeros(t, np.int32), max_rank, w, w)
    expected = x @ pool[:rank].T @ pool[4:4 + rank]
    np.testing.assert_allclose(np.asarray(delta), expected, rtol=1e-5, atol=1e-5)
