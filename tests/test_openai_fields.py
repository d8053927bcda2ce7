"""Fields of vLLM's CompletionRequest and ChatCompletionRequest through the official `openai`
client on a live server. Supported ones (include_stop_str_in_output, skip_special_tokens, n) are
checked against LLM.generate on the server's own LLM; the sampling extras (top-k logprobs,
penalties, logit_bias, min_tokens, min_p) against numpy references on the server's own prompt
logits (tests/test_sampling.py's), and their out-of-range values get a 400 naming them. echo and
prompt_logprobs are checked against LLM.generate(..., SamplingParams(prompt_logprobs=k)). Every field
that this server does not implement: set to its "off" value it is accepted and changes nothing (the
output equals the same request without it); set to anything else it gets a 400 whose `param` names
it. The refused fields and their off values are slora_jax.serve.fields.REFUSED_FIELDS;
docs/openai-api.md lists them beside vLLM's.
"""

from __future__ import annotations

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from slora_jax import SamplingParams  # noqa: E402
from slora_jax.serve.fields import REFUSED_FIELDS, SUPPORTED_FIELDS  # noqa: E402
from test_sampling import np_log_softmax, np_process  # noqa: E402
from test_server import ADAPTERS, chat_text, demo_dir, start_server, text  # noqa: E402

# One value per refused field that is not its off value.
ON = {
    "use_beam_search": True, "length_penalty": 0.5,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 5, "allowed_token_ids": [5, 6], "bad_words": ["ab"],
    "response_format": {"type": "json_object"}, "guided_json": {"type": "object"}, "guided_regex": "a+",
    "guided_choice": ["a", "b"], "guided_grammar": "root ::= \"a\"", "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ", "structural_tag": "{}", "structured_outputs": {"regex": "a+"},
    "priority": 1, "logits_processors": ["pkg.proc"], "return_tokens_as_token_ids": True, "cache_salt": "s",
    "kv_transfer_params": {"k": 1}, "vllm_xargs": {"k": 1}, "prompt_embeds": "AAAA",
    "add_special_tokens": None,  # per endpoint below: the opposite of its default
    "add_generation_prompt": False, "continue_final_message": True, "documents": [{"title": "t"}],
    "chat_template": "{{ messages }}", "chat_template_kwargs": {"k": 1}, "mm_processor_kwargs": {"k": 1},
    "tool_choice": "auto", "parallel_tool_calls": True, "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto", "reasoning_effort": "low", "include_reasoning": False,
}
ON_SPECIAL = {"completions": False, "chat": True}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    model_dir, paths = demo_dir(tmp_path_factory)
    st, srv = start_server(model_dir, {ADAPTERS[0]: paths[ADAPTERS[0]]})
    yield openai.OpenAI(base_url=st.url + "/v1", api_key="unused", max_retries=0, timeout=120), srv
    st.stop()


@pytest.fixture(scope="module")
def client(live):
    return live[0]


def _reference(srv, prompt, **sp):
    """LLM.generate on the server's LLM, between engine steps, for the same greedy request."""
    params = SamplingParams(max_tokens=12, temperature=0.0, **sp)
    return srv.engine.call_sync(lambda: srv.llm.generate(prompt, params, adapter=ADAPTERS[0]))[0]


def test_stop_string_kept_and_special_tokens_as_llm_generate(live):
    client, srv = live
    for i in range(10):
        plain = _reference(srv, text(i))
        stop = next((ch for j, ch in enumerate(plain.text[:-1]) if j and ch.isascii() and ch.isprintable()), None)
        if stop is not None:
            break
    else:
        pytest.fail("no prompt gave a printable character to stop on")
    for keep in (False, True):
        want = _reference(srv, text(i), stop=[stop], include_stop_str_in_output=keep)
        got = client.completions.create(model=ADAPTERS[0], prompt=text(i), max_tokens=12, temperature=0, stop=[stop],
                                        extra_body={"include_stop_str_in_output": keep})
        assert (got.choices[0].text, got.choices[0].finish_reason) == (want.text, "stop"), keep
        assert got.choices[0].text.endswith(stop) == keep
    want = _reference(srv, text(i), skip_special_tokens=False)
    got = client.completions.create(model=ADAPTERS[0], prompt=text(i), max_tokens=12, temperature=0,
                                    extra_body={"skip_special_tokens": False})
    assert got.choices[0].text == want.text


def _send(client, kind, extra):
    if kind == "chat":
        return client.chat.completions.create(model=ADAPTERS[0], messages=[{"role": "user", "content": chat_text(1)}],
                                              max_tokens=3, temperature=0, extra_body=extra)
    return client.completions.create(model=ADAPTERS[0], prompt=text(1), max_tokens=3, temperature=0,
                                     extra_body=extra)


def test_every_refused_field_has_a_value_to_send():
    for kind, refused in REFUSED_FIELDS.items():
        assert set(refused) <= set(ON), sorted(set(refused) - set(ON))
        assert not set(refused) & SUPPORTED_FIELDS[kind]


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_refused_fields_name_themselves(client, kind):
    for name in REFUSED_FIELDS[kind]:
        value = ON_SPECIAL[kind] if name == "add_special_tokens" else ON[name]
        with pytest.raises(openai.BadRequestError) as e:
            _send(client, kind, {name: value})
        assert e.value.body["param"] == name, (name, e.value.body)
        assert name in e.value.body["message"] and e.value.body["code"] == "unsupported_parameter"


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_off_values_change_nothing(client, kind):
    off = {name: vals[0] if vals else None for name, vals in REFUSED_FIELDS[kind].items()}
    plain, with_off = _send(client, kind, {}), _send(client, kind, off)
    pick = (lambda r: r.choices[0].message.content) if kind == "chat" else (lambda r: r.choices[0].text)
    assert pick(with_off) == pick(plain) and with_off.usage == plain.usage
    assert with_off.choices[0].finish_reason == plain.choices[0].finish_reason


def test_n_choices_as_llm_generate(live):
    """n completions of one prompt: choice j is LLM.generate's j-th of SamplingParams(n=..., seed=...),
    and the prompt counts once in usage."""
    client, srv = live
    got = client.completions.create(model=ADAPTERS[0], prompt=text(3), max_tokens=6, temperature=1.0, seed=7,
                                    n=3, extra_body={"ignore_eos": True, "return_token_ids": True})
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    want = srv.engine.call_sync(lambda: srv.llm.generate(text(3), params, adapter=ADAPTERS[0]))[0]
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in got.choices] == [o.token_ids for o in want.outputs]
    assert len({tuple(o.token_ids) for o in want.outputs}) > 1
    assert got.usage.prompt_tokens == len(want.prompt_token_ids) and got.usage.completion_tokens == 18


# ---------------------------------------------------------------------------------------------
# the sampling extras


def _logits(srv, ids: list[int]) -> np.ndarray:
    """The server's LLM's logits after `ids` (the adapter's), between engine steps."""
    return srv.engine.call_sync(lambda: srv.llm.prompt_logits([ids], adapter=ADAPTERS[0]))[0][-1].astype(np.float64)


def _complete(client, prompt: str, **extra):
    got = client.completions.create(model=ADAPTERS[0], prompt=prompt, max_tokens=extra.pop("max_tokens", 6),
                                    temperature=extra.pop("temperature", 0), seed=extra.pop("seed", None),
                                    logprobs=extra.pop("logprobs", None),
                                    extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
    c = got.choices[0]
    return c, c.model_extra["prompt_token_ids"], c.model_extra["token_ids"]


def test_completion_top_logprobs_are_the_top_of_the_full_log_softmax(live):
    client, srv = live
    c, prompt, ids = _complete(client, text(4), temperature=1.0, seed=3, logprobs=3)
    assert len(c.logprobs.top_logprobs) == len(ids) == 6
    for j, tok in enumerate(ids):
        full = np_log_softmax(_logits(srv, prompt + ids[:j]))
        want = {srv.piece(int(t)): full[t] for t in [*np.argsort(-full)[:3], tok]}
        got = c.logprobs.top_logprobs[j]
        assert got.keys() == want.keys() and 3 <= len(got) <= 4, j
        assert all(abs(got[k] - want[k]) < 1e-4 for k in want)
        assert abs(c.logprobs.token_logprobs[j] - full[tok]) < 1e-4


def test_streamed_top_logprobs_as_the_whole_response(client):
    whole = _complete(client, text(4), logprobs=2)[0].logprobs
    chunks = client.completions.create(model=ADAPTERS[0], prompt=text(4), max_tokens=6, temperature=0, logprobs=2,
                                       stream=True, extra_body={"ignore_eos": True})
    tops = [t for ch in chunks for c in ch.choices if c.logprobs for t in c.logprobs.top_logprobs]
    assert tops == whole.top_logprobs and all(len(t) >= 2 for t in tops)


def test_chat_top_logprobs_are_the_top_k(live):
    client, srv = live
    got = client.chat.completions.create(model=ADAPTERS[0], messages=[{"role": "user", "content": chat_text(2)}],
                                         max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
    prompt, ids = got.choices[0].model_extra["prompt_token_ids"], got.choices[0].model_extra["token_ids"]
    for j, entry in enumerate(got.choices[0].logprobs.content):
        full = np_log_softmax(_logits(srv, prompt + ids[:j]))
        best = np.argsort(-full)[:2]
        assert [t.token for t in entry.top_logprobs] == [srv.piece(int(t)) for t in best]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(full[best].tolist(), abs=1e-4)


def test_penalties_greedy_as_the_numpy_reference(live):
    client, srv = live
    pen = dict(presence_penalty=-1.5, frequency_penalty=0.5, repetition_penalty=1.4)
    c, prompt, ids = _complete(client, text(5), max_tokens=8, **pen)
    sp = SamplingParams(max_tokens=8, **pen)
    want: list[int] = []
    for _ in range(8):
        want.append(int(np.argmax(np_process(_logits(srv, prompt + want), sp, prompt, want))))
    assert ids == want
    assert ids != _complete(client, text(5), max_tokens=8)[2]   # the penalties act


def test_logit_bias_forces_and_bans_a_token(live):
    client, _ = live
    plain = _complete(client, text(6))[2]
    assert _complete(client, text(6), logit_bias={"7": 100})[2] == [7] * 6
    banned = _complete(client, text(6), logit_bias={str(plain[0]): -100})[2]
    assert banned[0] != plain[0] and plain[0] not in banned


def test_min_tokens_holds_against_a_stop_token(live):
    client, srv = live
    plain = _complete(client, text(7))[2]
    stop = plain[0]
    early, _, ids = _complete(client, text(7), stop_token_ids=[stop])
    assert ids == [stop] and early.finish_reason == "stop"
    held, _, ids = _complete(client, text(7), stop_token_ids=[stop], min_tokens=3)
    want = srv.engine.call_sync(lambda: srv.llm.generate(text(7), SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, stop_token_ids=[stop], min_tokens=3), adapter=ADAPTERS[0]))[0]
    assert ids == want.token_ids and len(ids) >= 3 and stop not in ids[:3]


def test_min_p_as_llm_generate_and_within_its_bound(live):
    client, srv = live
    _, prompt, ids = _complete(client, text(8), temperature=1.0, seed=4, min_p=0.5)
    want = srv.engine.call_sync(lambda: srv.llm.generate(text(8), SamplingParams(
        max_tokens=6, temperature=1.0, seed=4, ignore_eos=True, min_p=0.5), adapter=ADAPTERS[0]))[0]
    assert ids == want.token_ids
    assert _within_min_p(srv, prompt, ids, 0.5)
    free = _complete(client, text(8), temperature=1.0, seed=4)[2]
    assert not _within_min_p(srv, prompt, free, 0.5)   # the same seed leaves the bound without min_p


def _within_min_p(srv, prompt: list[int], ids: list[int], min_p: float) -> bool:
    for j, tok in enumerate(ids):
        p = np.exp(np_log_softmax(_logits(srv, prompt + ids[:j])))
        if p[tok] < min_p * p.max() - 1e-6:
            return False
    return True


@pytest.mark.parametrize("field,value", [
    ("min_p", 1.5), ("min_tokens", 7), ("min_tokens", -1), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("repetition_penalty", 0), ("repetition_penalty", 11), ("logit_bias", {"99999": 1}), ("logit_bias", {"5": 101}),
    ("logit_bias", {"x": 1}), ("logit_bias", [1]), ("logprobs", 21), ("prompt_logprobs", -1),
    ("prompt_logprobs", 21), ("prompt_logprobs", "1"), ("prompt_logprobs", 1.5), ("echo", 1)])
def test_out_of_range_extras_name_themselves(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=ADAPTERS[0], prompt=text(1), max_tokens=6, extra_body={field: value})
    assert e.value.body["param"] == field, e.value.body


def test_chat_top_logprobs_past_the_limit(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=ADAPTERS[0], messages=[{"role": "user", "content": chat_text(1)}],
                                       max_tokens=6, logprobs=True, top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs"


# ---------------------------------------------------------------------------------------------
# echo and prompt_logprobs (scoring)

def _scored(srv, prompt, k: int, **sp):
    """LLM.generate with prompt_logprobs=k on the server's LLM, greedy, for the same request."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, prompt_logprobs=k, **sp)
    return srv.engine.call_sync(lambda: srv.llm.generate(prompt, params, adapter=ADAPTERS[0]))[0]


def _prompt_part(want) -> list[float]:
    ids = want.prompt_token_ids
    return [want.prompt_logprobs[q][ids[q]] for q in range(1, len(ids))]


def test_echo_returns_the_prompt_then_the_completion(live):
    client, srv = live
    got = client.completions.create(model=ADAPTERS[0], prompt=text(3), max_tokens=3, temperature=0, logprobs=2,
                                    echo=True, extra_body={"ignore_eos": True})
    want = _scored(srv, text(3), 2, max_tokens=3, logprobs=2)
    c, ids, n = got.choices[0], want.prompt_token_ids, len(want.prompt_token_ids)
    assert c.text == text(3) + want.text and c.finish_reason == "length"
    lp = c.logprobs
    assert lp.tokens == [srv.piece(t) for t in ids + want.token_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None   # nothing comes before it
    assert lp.token_logprobs[1:n] == pytest.approx(_prompt_part(want), abs=1e-5)
    assert lp.token_logprobs[n:] == pytest.approx(want.logprobs, abs=1e-5)
    for q in range(1, n):
        best = sorted(want.prompt_logprobs[q].items(), key=lambda kv: -kv[1])[:2]
        assert set(lp.top_logprobs[q]) == {srv.piece(t) for t, _ in best} | {srv.piece(ids[q])}, q
    assert lp.text_offset[0] == 0 and lp.text_offset[n] == len(text(3))  # the completion starts after the prompt


def test_echo_with_max_tokens_zero_returns_only_the_prompt(live):
    client, srv = live
    got = client.completions.create(model=ADAPTERS[0], prompt=[text(4), text(5)], max_tokens=0, echo=True,
                                    logprobs=1)
    assert got.usage.completion_tokens == 0 and len(got.choices) == 2
    for c in got.choices:
        want = _scored(srv, text(4 + c.index), 1, max_tokens=0)
        assert c.text == text(4 + c.index) and c.finish_reason == "length"
        assert len(c.logprobs.tokens) == len(want.prompt_token_ids)
        assert c.logprobs.token_logprobs[1:] == pytest.approx(_prompt_part(want), abs=1e-5)
    plain = client.completions.create(model=ADAPTERS[0], prompt=text(4), max_tokens=0, echo=True)
    assert plain.choices[0].text == text(4) and plain.choices[0].logprobs is None


def test_streamed_echo_as_the_whole_response(client):
    kw = dict(model=ADAPTERS[0], prompt=text(6), max_tokens=4, temperature=0, logprobs=1, echo=True,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    chunks = [c for ch in client.completions.create(stream=True, **kw) for c in ch.choices]
    assert chunks[0].text.startswith(text(6))   # the prompt comes in the first chunk
    assert "".join(c.text for c in chunks) == whole.text
    got = [c.logprobs for c in chunks if c.logprobs]
    assert [x for lp in got for x in lp.token_logprobs] == whole.logprobs.token_logprobs
    first = got[0].text_offset  # the prompt's tokens, at the same offsets
    assert len(first) > len(text(6)) // 2 and first == whole.logprobs.text_offset[:len(first)]


def _same_prompt_logprobs(srv, got: list, want, k: int) -> None:
    ids = want.prompt_token_ids
    assert got[0] is None and len(got) == len(ids)
    for q in range(1, len(ids)):
        entry = {int(t): v for t, v in got[q].items()}
        assert entry.keys() == want.prompt_logprobs[q].keys(), q
        for t, v in entry.items():
            assert v["logprob"] == pytest.approx(want.prompt_logprobs[q][t], abs=1e-5)
            assert v["decoded_token"] == srv.piece(t) and (t == ids[q] or 1 <= v["rank"] <= k)
        assert entry[ids[q]]["rank"] == want.prompt_ranks[q]


def test_prompt_logprobs_on_completions_and_chat(live):
    """On each choice for completions, at the response's top level for chat (vLLM's places)."""
    client, srv = live
    got = client.completions.create(model=ADAPTERS[0], prompt=text(7), max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 2, "ignore_eos": True})
    _same_prompt_logprobs(srv, got.choices[0].model_extra["prompt_logprobs"], _scored(srv, text(7), 2, max_tokens=2), 2)
    chat = client.chat.completions.create(model=ADAPTERS[0], messages=[{"role": "user", "content": chat_text(3)}],
                                          max_tokens=1, temperature=0,
                                          extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    prompt = chat.choices[0].model_extra["prompt_token_ids"]
    _same_prompt_logprobs(srv, chat.model_extra["prompt_logprobs"], _scored(srv, [prompt], 1, max_tokens=1), 1)


def test_bad_scoring_requests_name_their_field_and_the_server_serves_on(client):
    for kind, extra, param in (("chat", {"echo": True}, "echo"), ("chat", {"prompt_logprobs": -2}, "prompt_logprobs"),
                               ("completions", {"max_tokens": 0}, "max_tokens")):
        with pytest.raises(openai.BadRequestError) as e:
            if kind == "chat":
                client.chat.completions.create(model=ADAPTERS[0], messages=[{"role": "user", "content": chat_text(1)}],
                                               extra_body=extra)
            else:
                client.completions.create(model=ADAPTERS[0], prompt=text(1), **extra)
        assert e.value.body["param"] == param, e.value.body
    assert _send(client, "completions", {"prompt_logprobs": 0}).choices[0].model_extra["prompt_logprobs"][0] is None
