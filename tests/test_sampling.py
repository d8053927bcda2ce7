"""The vLLM-shaped Python surface: LoRARequest (registered on first use), RequestOutput.outputs,
n completions per prompt, stop strings, stop_reason and LLM.chat.

Every expectation is computed by the engine itself through a second, plainer call (adapter= by
name, one seed per request, no stop strings), so each test checks that the vLLM form means the same
as the form it stands for. The model is the tiny demo model with a byte-level tokenizer.
"""

from __future__ import annotations

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
    outs = llm.generate("serve jax", SamplingParams(n=3, seed=11, **sp))
    assert len(outs) == 3
    singles = [llm.generate("serve jax", SamplingParams(seed=11 + i, **sp))[0].token_ids for i in range(3)]
    assert [o.token_ids for o in outs] == singles
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
