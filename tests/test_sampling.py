"""The vLLM-shaped Python surface: LoRARequest (registered on first use), RequestOutput.outputs,
n completions per prompt, stop strings, stop_reason and LLM.chat; and vLLM's sampling extras
(top-k logprobs, penalties, logit_bias, min_tokens, min_p) on the device, against numpy references
computed from the engine's own prompt logits.

Every expectation is computed by the engine itself through a second, plainer call (adapter= by
name, one seed per request, no stop strings), so each test checks that the vLLM form means the same
as the form it stands for. The model is the tiny demo model with a byte-level tokenizer.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from slora_jax import LLM, LoRARequest, SamplingParams
from slora_jax.demo import prepare

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    model_dir, adapters = prepare(tmp_path_factory.mktemp("sampling_demo"), 3, 0)
    llm = LLM(model_dir, dtype="float32", page_size=16, pool_pages=64, max_num_seqs=4, max_lora_rank=32)
    return llm, model_dir, adapters


def test_outputs_are_vllm_shaped(demo):
    llm, _, _ = demo
    out = llm.generate("hello pool", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True,
                                                     logprobs=True))[0]
    first = out.outputs[0]
    assert len(out.outputs) == 1 and first.index == 0
    assert first.token_ids is out.token_ids and len(first.token_ids) == 5
    assert first.text == out.text == llm.tokenizer.decode(out.token_ids)
    assert first.logprobs is out.logprobs and first.cumulative_logprob == pytest.approx(sum(out.logprobs))
    assert first.finish_reason == "length" and first.stop_reason is None
    assert out.prompt == "hello pool" and out.prompt_token_ids == llm.tokenizer.encode("hello pool")
    assert out.request_id.startswith("req-")


def test_lora_request_registers_on_first_use(demo):
    llm, _, adapters = demo
    (a, pa), (b, pb) = list(adapters.items())[:2]
    assert a not in llm.adapters
    got = llm.generate(["batch rank", "paged"], GREEDY,
                       lora_request=[LoRARequest(a, 1, pa), None])
    assert a in llm.adapters and got[0].lora_request.lora_name == a and got[1].lora_request is None
    want = llm.generate(["batch rank", "paged"], GREEDY, adapter=[a, None])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[0].token_ids != llm.generate("batch rank", GREEDY)[0].token_ids  # the adapter is applied
    # The same name with another path replaces the adapter: its output is then the other one's.
    moved = llm.generate("batch rank", GREEDY, lora_request=LoRARequest(a, 1, pb))[0]
    llm.load_adapter(b, pb)
    assert moved.token_ids == llm.generate("batch rank", GREEDY, adapter=b)[0].token_ids
    with pytest.raises(ValueError, match="not both"):
        llm.generate("x", GREEDY, adapter=a, lora_request=LoRARequest(a, 1, pa))
    with pytest.raises(ValueError, match="no lora_path"):
        llm.generate("x", GREEDY, lora_request=LoRARequest("nowhere", 2))
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest(a, 0, pa)


def test_n_completions_use_consecutive_seeds(demo):
    llm, _, _ = demo
    sp = dict(max_tokens=6, temperature=1.0, ignore_eos=True)
    outs = llm.generate(["serve jax", "pool"], [SamplingParams(n=3, seed=11, **sp), SamplingParams(n=2, seed=3, **sp)])
    assert len(outs) == 2 and [len(o.outputs) for o in outs] == [3, 2]
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    singles = [llm.generate("serve jax", SamplingParams(seed=11 + i, **sp))[0].token_ids for i in range(3)]
    assert [c.token_ids for c in outs[0].outputs] == singles
    assert outs[0].token_ids == singles[0]  # the flat fields are completion 0
    assert [c.token_ids for c in outs[1].outputs] == \
        [llm.generate("pool", SamplingParams(seed=3 + i, **sp))[0].token_ids for i in range(2)]
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)


def _stop_case(llm):
    """A prompt, its greedy 12-token completion, and a stop string: a printable character that the
    first 8 tokens' text holds past its start (dummy weights give mostly unprintable bytes)."""
    for prompt in ("lora token rank", "hello", "paged pool", "serve batch", "rank jax adapter"):
        full = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
        head = llm.tokenizer.decode(full.token_ids[:8])
        for i, ch in enumerate(head):
            if i > 0 and ch.isascii() and ch.isprintable():
                return prompt, full, ch
    pytest.fail("no prompt gave a printable character to stop on")


def test_stop_strings(demo):
    llm, _, _ = demo
    prompt, full, stop = _stop_case(llm)
    cut = full.text.find(stop)
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (full.text[:cut], "stop", stop)
    assert out.outputs[0].stop_reason == stop
    assert full.token_ids[:len(out.token_ids)] == out.token_ids and len(out.token_ids) <= 8
    kept = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=stop,
                                               include_stop_str_in_output=True))[0]
    assert kept.text == full.text[:cut + len(stop)]
    with pytest.raises(ValueError, match="stop must be"):
        SamplingParams(stop=[""])


def test_min_tokens_holds_stop_strings_back(demo):
    """As vLLM: a stop string ends the text only where it ends past the first min_tokens - 1 tokens."""
    llm, _, _ = demo
    prompt, full, stop = _stop_case(llm)
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop],
                                              min_tokens=8))[0]
    floor = len(llm.tokenizer.decode(full.token_ids[:7]))
    assert full.text.find(stop) + len(stop) <= floor  # without min_tokens it would stop earlier
    cut = full.text.find(stop, floor - len(stop) + 1)
    assert out.text == (full.text if cut < 0 else full.text[:cut]) and len(out.token_ids) >= 8


def test_stop_token_id_is_the_stop_reason(demo):
    llm, _, _ = demo
    full = llm.generate("adapter", GREEDY)[0]
    tok = full.token_ids[3]
    first = full.token_ids.index(tok)
    out = llm.generate("adapter", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                 stop_token_ids=[tok]))[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (full.token_ids[:first + 1], "stop", tok)


def test_chat_renders_like_the_server(demo):
    llm, _, adapters = demo
    name = list(adapters)[2]
    messages = [{"role": "user", "content": "hi there"}]
    got = llm.chat(messages, GREEDY, lora_request=LoRARequest(name, 3, adapters[name]))[0]
    want = llm.generate("user: hi there\nassistant:", GREEDY, adapter=name)[0]
    assert got.prompt_token_ids == want.prompt_token_ids and got.token_ids == want.token_ids
    templated = llm.chat([messages, messages], GREEDY,
                         chat_template="{% for m in messages %}<{{ m.content }}>{% endfor %}")
    assert templated[0].prompt_token_ids == llm.tokenizer.encode("<hi there>", add_special_tokens=False)
    with pytest.raises(ValueError, match="conversation"):
        llm.chat([{"role": "user"}])


# ---------------------------------------------------------------------------------------------
# vLLM's sampling extras on the device, against numpy references

def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def np_process(logits: np.ndarray, sp: SamplingParams, prompt: list[int], output: list[int],
               stops: tuple[int, ...] = ()) -> np.ndarray:
    """vLLM's logits processing of one row: logit_bias, min_tokens, then the penalties."""
    x = logits.astype(np.float64).copy()
    for t, b in (sp.logit_bias or {}).items():
        x[t] += b
    if len(output) < sp.min_tokens:
        x[list(stops)] = -np.inf
    seen = np.zeros(x.shape, bool)
    seen[list(prompt) + list(output)] = True
    x = np.where(seen, np.where(x > 0, x / sp.repetition_penalty, x * sp.repetition_penalty), x)
    counts = np.bincount(np.asarray(output, int), minlength=x.shape[0])[:x.shape[0]]
    return x - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0)


def np_greedy(llm, prompt: list[int], sp: SamplingParams, stops: tuple[int, ...] = ()) -> list[int]:
    """Greedy decoding with vLLM's logits processing on the engine's own prompt logits."""
    out: list[int] = []
    for _ in range(sp.max_tokens):
        logits = llm.prompt_logits([prompt + out])[0][-1]
        out.append(int(np.argmax(np_process(logits, sp, prompt, out, stops))))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The demo model with async scheduling on, so history tokens still on the device (FED) are read."""
    model_dir, _ = prepare(tmp_path_factory.mktemp("extras_demo"), 1, 0)
    return LLM(model_dir, dtype="float32", page_size=16, pool_pages=64, max_num_seqs=4, max_lora_rank=32,
               async_scheduling=True)


def test_top_logprobs_are_the_top_of_the_full_log_softmax(tiny):
    prompt = tiny.tokenizer.encode("top logprobs")
    sp = SamplingParams(max_tokens=5, temperature=1.0, seed=5, ignore_eos=True, logprobs=3)
    out = tiny.generate([prompt], sp)[0]
    assert len(out.top_logprobs) == 5 and out.outputs[0].top_logprobs is out.top_logprobs
    for j, (tok, top) in enumerate(zip(out.token_ids, out.top_logprobs)):
        full = np_log_softmax(tiny.prompt_logits([prompt + out.token_ids[:j]])[0][-1].astype(np.float64))
        want = np.argsort(-full)[:3]
        assert list(top)[:3] == want.tolist(), j
        np.testing.assert_allclose([top[t] for t in want], full[want], atol=1e-4)
        assert top[tok] == pytest.approx(full[tok], abs=1e-4) and tok in top   # the sampled token, always
        assert out.logprobs[j] == pytest.approx(full[tok], abs=1e-4)
    plain = tiny.generate([prompt], SamplingParams(max_tokens=5, temperature=1.0, seed=5, ignore_eos=True))[0]
    assert plain.token_ids == out.token_ids and plain.top_logprobs is None


def test_penalties_greedy_as_the_numpy_reference(tiny):
    prompt = tiny.tokenizer.encode("penalties again and again")
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.3,
                        frequency_penalty=0.6, presence_penalty=-1.5)
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    got = tiny.generate([prompt, prompt], [sp, plain])   # one batch: a penalized row beside a plain one
    assert got[0].token_ids == np_greedy(tiny, prompt, sp)
    assert got[1].token_ids == np_greedy(tiny, prompt, plain)
    assert got[0].token_ids != got[1].token_ids   # the penalties act


def test_logit_bias_forces_and_bans_a_token(tiny):
    prompt = tiny.tokenizer.encode("bias")
    plain = tiny.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids
    forced = tiny.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                    logit_bias={7: 100.0}))[0].token_ids
    assert forced == [7] * 6
    ban = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias={plain[0]: -100.0})
    banned = tiny.generate([prompt], ban)[0].token_ids
    assert plain[0] not in banned and banned == np_greedy(tiny, prompt, ban)


def test_min_tokens_holds_against_a_stop_token(tiny):
    prompt = tiny.tokenizer.encode("min tokens")
    plain = tiny.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids
    stop = plain[0]
    early = tiny.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                   stop_token_ids=[stop]))[0]
    assert early.token_ids == [stop] and early.finish_reason == "stop"
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, stop_token_ids=[stop], min_tokens=3)
    held = tiny.generate([prompt], sp)[0]
    want = np_greedy(tiny, prompt, sp, stops=(stop,))
    cut = next((j + 1 for j, t in enumerate(want) if t == stop and j >= 3), len(want))
    assert held.token_ids == want[:cut] and len(held.token_ids) >= 3 and stop not in held.token_ids[:3]


def test_min_p_keeps_only_tokens_above_the_bound(tiny):
    prompt = tiny.tokenizer.encode("min p")
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=9, ignore_eos=True, min_p=0.6)
    out = tiny.generate([prompt], sp)[0]
    for j, tok in enumerate(out.token_ids):
        p = np.exp(np_log_softmax(tiny.prompt_logits([prompt + out.token_ids[:j]])[0][-1].astype(np.float64)))
        assert p[tok] >= 0.6 * p.max() - 1e-6, j
    free = [tiny.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True))[0]
            for s in range(3)]
    assert not all(_all_above(tiny, prompt, o.token_ids, 0.6) for o in free)  # the bound binds


def _all_above(llm, prompt, tokens, min_p) -> bool:
    rows = llm.prompt_logits([prompt + tokens])[0][len(prompt) - 1:-1]
    p = np.exp(np_log_softmax(rows.astype(np.float64)))
    return bool(np.all(p[np.arange(len(tokens)), tokens] >= min_p * p.max(axis=-1) - 1e-6))


def test_a_batch_without_extras_runs_the_plain_step(tiny, monkeypatch):
    """Extras and prompt logprobs make their own step variants; a batch that uses none keeps the
    plain step's shape key and compiled function (the jit cache does not grow), and warm-up
    compiles only plain steps."""
    from slora_jax.engine import step as paged
    from slora_jax.engine.warmup import shape_key
    eng = tiny.engine
    prompt = tiny.tokenizer.encode("plain steps")
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True)
    seen, dispatch = [], eng._dispatch
    monkeypatch.setattr(eng, "_dispatch", lambda inp: seen.append(inp) or dispatch(inp))

    def keys_of(sp):
        seen.clear()
        out = tiny.generate([prompt], sp)[0]
        return out, {shape_key(inp) for inp in seen}, [inp.sampling for inp in seen]

    first, plain_keys, extras = keys_of(plain)
    assert extras and all(x is None for x in extras) and all(inp.prompt_logprobs is None for inp in seen)
    assert not any("SamplingExtras" in str(key) or "PromptLogprobInputs" in str(key) for key in plain_keys)
    top, top_keys, extras = keys_of(SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2))
    assert all(x is not None and x.top_logprobs == 4 for x in extras)
    assert all("SamplingExtras" in str(key) for key in top_keys) and not top_keys & plain_keys
    scored, scored_keys, _ = keys_of(SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True,
                                                    prompt_logprobs=1))
    assert [inp.prompt_logprobs is not None for inp in seen] == [not inp.decode for inp in seen]  # prefill only
    new = scored_keys - plain_keys
    assert new and all("PromptLogprobInputs" in str(key) for key in new) and scored.prompt_logprobs[0] is None
    compiled = paged.forward_sample._cache_size()
    again, again_keys, _ = keys_of(plain)
    assert again_keys == plain_keys and paged.forward_sample._cache_size() == compiled
    assert again.token_ids == first.token_ids == top.token_ids == scored.token_ids
    assert again.logprobs == first.logprobs and scored.logprobs == pytest.approx(first.logprobs, abs=1e-6)
    assert all(inp.sampling is None and inp.prompt_logprobs is None for inp in eng.warmup_shapes(max_context=32))


def test_sampler_extras_against_numpy_on_random_logits():
    """The device sampler itself: greedy after bias, min_tokens and penalties; min_p's kept set."""
    from slora_jax.engine.inputs import bias_arrays
    from slora_jax.sampling import FED, SamplingExtras, sample, top_logprobs
    rng = np.random.default_rng(0)
    s, v = 4, 64
    logits = rng.normal(size=(s, v)).astype(np.float32) * 3
    jlogits = jax.numpy.asarray(logits)
    prompts = [[1, 2, 3], [4, 4], [5], [6, 7]]
    outputs = [[8, 8, 9], [2], [], [7, 7]]
    sps = [SamplingParams(repetition_penalty=1.7, frequency_penalty=0.5, presence_penalty=0.3, logit_bias={10: 5.0}),
           SamplingParams(presence_penalty=-2.0, min_tokens=3), SamplingParams(logit_bias={11: -100.0}),
           SamplingParams(frequency_penalty=2.0)]
    stops = [(), (int(np.argmax(logits[1])),), (), ()]
    want = [int(np.argmax(np_process(logits[i], sps[i], prompts[i], outputs[i], stops[i]))) for i in range(s)]
    biases = [{**(p.logit_bias or {}), **{t: -np.inf for t in st}} for p, st in zip(sps, stops)]
    hist = np.full((s, 8), -1, np.int32)
    for i in range(s):
        toks = prompts[i] + outputs[i]
        hist[i, :len(toks)] = toks
    fed = np.array([hist[i, len(prompts[i] + outputs[i]) - 1] if outputs[i] else 0 for i in range(s)], np.int32)
    for i in range(s):  # the last generated token still on the device: FED stands for the row's input token
        if outputs[i]:
            hist[i, len(prompts[i] + outputs[i]) - 1] = FED
    extras = SamplingExtras(**bias_arrays(biases, s),
                            penalties=np.array([[p.presence_penalty, p.frequency_penalty, p.repetition_penalty]
                                                for p in sps], np.float32),
                            history=hist, prompt_lens=np.array([len(p) for p in prompts], np.int32))
    keys = jax.vmap(jax.random.PRNGKey)(np.arange(s))
    zero, ones = np.zeros(s, np.float32), np.ones(s, np.float32)
    tokens, lp = sample(jlogits, zero, np.zeros(s, np.int32), ones, keys, extras, fed)
    assert np.asarray(tokens).tolist() == want
    np.testing.assert_allclose(np.asarray(lp), np_log_softmax(logits)[np.arange(s), want], atol=1e-5)
    top = np.asarray(top_logprobs(jlogits, 4))
    assert top[:, 0].astype(int).tolist() == np.argsort(-logits, axis=-1)[:, :4].tolist()
    # min_p: every sampled token is within the bound, over many keys.
    min_p = SamplingExtras(min_p=np.full(s, 0.3, np.float32))
    temp = np.full(s, 1.5, np.float32)
    prob = np.exp(np_log_softmax(logits / 1.5))
    allowed = prob >= 0.3 * prob.max(axis=-1, keepdims=True)
    seen = set()
    for k in range(40):
        keys = jax.vmap(jax.random.PRNGKey)(np.arange(s) + 100 * k)
        toks, _ = sample(jlogits, temp, np.zeros(s, np.int32), ones, keys, min_p)
        toks = np.asarray(toks)
        assert allowed[np.arange(s), toks].all()
        seen.update(zip(range(s), toks.tolist()))
    assert len(seen) > s  # it does sample, not just the argmax
