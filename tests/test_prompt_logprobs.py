"""SamplingParams.prompt_logprobs: per prompt position the logprob of the prompt token given the
tokens before it, its rank and the top k, computed in the prefill steps on the device.

Every expectation comes from a full forward pass over the whole prompt in one step
(`LLM.prompt_logits`, the scoring step `step_all_logits`), and once from the transformers + peft
oracle, while the engine under test prefills the prompt in chunks of 32 tokens (async scheduling
on, so the next step is dispatched before a step's rows reach the host), beside rows that do not
ask. The model is the tiny demo model with a byte-level tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from slora_jax import LLM, SamplingParams
from slora_jax.demo import prepare
from slora_jax.model.peft import random_peft_adapter

TOL = 1e-5
OPTS = dict(dtype="float32", page_size=16, pool_pages=96, max_num_seqs=4, max_lora_rank=32,
            max_num_batched_tokens=32, async_scheduling=True)


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    model_dir, adapters = prepare(tmp_path_factory.mktemp("prompt_lp_demo"), 1, 0)
    name = next(iter(adapters))
    llm = LLM(model_dir, adapters={name: adapters[name]}, **OPTS)
    return llm, model_dir, name


def _prompt(llm, s: str) -> list[int]:
    return llm.tokenizer.encode(s)


def reference(llm, prompts: list[list[int]], adapters) -> list[np.ndarray]:
    """Per prompt [T, V] float64: log_softmax of the logits at every position (the last one's
    predicts the first generated token), all prompts in one full forward step."""
    return [np_log_softmax(x) for x in llm.prompt_logits(prompts, adapter=adapters)]


def check_against(ref: np.ndarray, prompt: list[int], out, k: int) -> None:
    lps, ranks = out.prompt_logprobs, out.prompt_ranks
    assert len(lps) == len(ranks) == len(prompt) and lps[0] is None and ranks[0] is None
    for q in range(1, len(prompt)):
        row, tok, entry = ref[q - 1], prompt[q], lps[q]
        assert entry[tok] == pytest.approx(row[tok], abs=TOL), q
        # its rank: 1 + the tokens more likely (ties within TOL either way)
        assert 1 + np.sum(row > row[tok] + TOL) <= ranks[q] <= 1 + np.sum(row > row[tok] - TOL), q
        top = sorted(entry.items(), key=lambda kv: -kv[1])
        others = [t for t, _ in top if t != tok]
        assert len(entry) in (k, k + 1) and len(others) >= k - 1
        best = np.sort(row)[::-1][:k]  # the top k values (robust to near-ties in the ids)
        np.testing.assert_allclose(sorted((v for _, v in top), reverse=True)[:k], best, atol=TOL)
        for t, v in entry.items():
            assert v == pytest.approx(row[t], abs=TOL), (q, t)


def test_chunked_prompt_logprobs_equal_a_full_forward_pass(demo):
    """Prefill steps of 32 tokens: the short plain prompt and long_a's first chunk share a step,
    long_b runs in two chunks; then all three decode together."""
    llm, _, name = demo
    short = _prompt(llm, "no scoring here")
    long_a = _prompt(llm, "a prompt long enough for two chunks of prefill")
    long_b = _prompt(llm, "another prompt, on the base model, also chunked")
    assert len(short) <= 16 and len(long_a) > 32 and len(long_b) > 32
    outs = llm.generate([short, long_a, long_b],
                        [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                         SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=3),
                         SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=0)],
                        adapter=[name, name, None])
    refs = reference(llm, [short, long_a, long_b], [name, name, None])
    check_against(refs[1][:-1], long_a, outs[1], 3)
    check_against(refs[2][:-1], long_b, outs[2], 0)
    assert outs[0].prompt_logprobs is None and outs[0].prompt_ranks is None
    # each row's first token is the greedy one of its prompt, scoring rows or not
    assert [o.token_ids[0] for o in outs] == [int(np.argmax(r[-1])) for r in refs]


def test_max_tokens_zero_ends_after_the_prefill(demo):
    llm, _, name = demo
    prompt = _prompt(llm, "score this prompt and generate nothing at all")
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    zero, beside = llm.generate([prompt, prompt[:9]], [SamplingParams(max_tokens=0, prompt_logprobs=2),
                                                       SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)],
                                adapter=name)
    assert zero.token_ids == [] and zero.text == "" and zero.finish_reason == "length"
    check_against(reference(llm, [prompt], name)[0][:-1], prompt, zero, 2)
    assert len(beside.token_ids) == 5 and beside.finish_reason == "length"
    alone = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0), adapter=name)[0]
    assert alone.finish_reason == "length" and alone.token_ids == []  # nothing else keeps the engine busy
    assert alone.prompt_ranks == zero.prompt_ranks
    assert llm.stats()["free_pages"] == llm.stats()["total_pages"] - llm.stats()["adapter_pages"] - llm.stats()["prefix_cache"]["cached_pages"]


def test_prefix_cache_is_bypassed_for_prompt_logprobs(demo):
    llm, model_dir, name = demo
    cached = LLM(model_dir, adapters={name: llm.store.entries[name].path}, enable_prefix_caching=True, **OPTS)
    prompt = _prompt(llm, "a shared prefix that fills two pages of sixteen")
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    first = cached.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), adapter=name)[0]
    scored = cached.generate([prompt], sp, adapter=name)[0]
    assert first.num_cached_tokens == 0 and scored.num_cached_tokens == 0   # every position computed
    hit = cached.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), adapter=name)[0]
    assert hit.num_cached_tokens >= 16  # the cache is live for the others
    without = llm.generate([prompt], sp, adapter=name)[0]
    assert scored.token_ids == without.token_ids
    for q in range(1, len(prompt)):
        assert scored.prompt_logprobs[q].keys() == without.prompt_logprobs[q].keys(), q
        np.testing.assert_allclose(list(scored.prompt_logprobs[q].values()),
                                   list(without.prompt_logprobs[q].values()), atol=TOL)
    assert scored.prompt_ranks == without.prompt_ranks


def test_a_non_finite_prompt_ends_its_request_alone(demo, tmp_path):
    """An adapter whose activations overflow (weights of 1e30): its scoring request ends with an
    error, nothing of it filed; the request beside it in the same step is scored as alone."""
    llm, _, name = demo
    d = Path(random_peft_adapter(tmp_path / "huge", llm.cfg, rank=8, targets="all-linear", seed=1))
    f = d / "adapter_model.safetensors"
    save_file({k: np.full_like(v, 1e30) for k, v in load_file(f).items()}, f)
    llm.load_adapter("huge", str(d))
    prompt = _prompt(llm, "overflowing scores")
    bad, ok = llm.generate([prompt, prompt], SamplingParams(max_tokens=0, prompt_logprobs=1), adapter=["huge", name])
    llm.unload_adapter("huge")
    assert (bad.finish_reason, bad.error_code) == ("error", "non_finite_output") and bad.prompt_logprobs == [None]
    assert ok.finish_reason == "length"
    check_against(reference(llm, [prompt], name)[0][:-1], prompt, ok, 1)


@pytest.mark.oracle
def test_prompt_logprobs_match_transformers_peft(oracle):
    """The oracle's logits at every prompt position give the prompt logprobs directly."""
    model = "mha"
    adapter = oracle.adapters(model)[0]
    llm = LLM(oracle.model_dir(model), adapters={adapter: oracle.adapter_dir(model, adapter)}, dtype="float32",
              max_num_batched_tokens=16)
    rows = [(p, a) for p in range(len(oracle.prompts)) if len(oracle.prompts[p]) > 16 for a in (adapter, None)]
    outs = llm.generate([oracle.prompts[p] for p, _ in rows],
                        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2), adapter=[a for _, a in rows])
    for (p, a), out in zip(rows, outs):
        prompt = oracle.prompts[p]
        ref = np_log_softmax(oracle.logits(model, a, p)[:-1])
        got = [out.prompt_logprobs[q][prompt[q]] for q in range(1, len(prompt))]
        np.testing.assert_allclose(got, ref[np.arange(len(prompt) - 1), prompt[1:]], atol=1e-3)
        for q in range(1, len(prompt)):
            best = np.sort(ref[q - 1])[::-1][:2]
            top = sorted(out.prompt_logprobs[q].values(), reverse=True)[:2]
            np.testing.assert_allclose(top, best, atol=1e-3)

