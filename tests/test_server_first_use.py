"""The server with `slora-jax serve`'s vLLM-compatible options, on a live uvicorn through the
official `openai` client: several served model names and API keys, a --chat-template, adapters
loaded on first use from --lora-search-dirs (once for concurrent first requests; invalid ones
refused with nothing registered), and streaming that decodes only the new tokens (streamed text
equals the non-streamed text and LLM.generate's, stop strings and UTF-8 split across tokens
included).

The model is the tiny demo model (byte-level tokenizer: a multi-byte UTF-8 character spans several
tokens) with the engine options of test_server.py, so the step shapes compiled are the same.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from test_server import ALL_LINEAR, ADAPTERS, OPTS, demo_dir, extra, text, wait_idle  # noqa: E402

from slora_jax import LLM, SamplingParams  # noqa: E402
from slora_jax.serve.app import build_app  # noqa: E402
from slora_jax.serve.async_engine import Delta  # noqa: E402
from slora_jax.serve.chat import ChatFormatter  # noqa: E402
from slora_jax.serve.cli import ServerThread  # noqa: E402
from slora_jax.serve.responses import Choice  # noqa: E402

KEYS = ["sk-one", "sk-two"]
H = {"Authorization": f"Bearer {KEYS[1]}"}
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}|{{ m['content'] }}>{% endfor %}[bot]"
SERVED = ADAPTERS[:2]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    model_dir, paths = demo_dir(tmp_path_factory)
    root = tmp_path_factory.mktemp("first_use")
    allowed, outside = root / "allowed", root / "outside"
    search = allowed / "search"
    search.mkdir(parents=True)
    outside.mkdir()
    good = paths[ALL_LINEAR[20]]
    for name in ("good", "org/nested", "fresh", "bad-config", "bad-weights", "no-weights", "file-link-out"):
        shutil.copytree(good, search / name)
    shutil.copytree(good, allowed / "beside-search")  # allowed, but not in a search directory
    shutil.copytree(good, outside / "elsewhere")
    (search / "bad-config" / "adapter_config.json").write_text("{not json")
    w = search / "bad-weights" / "adapter_model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    (search / "no-weights" / "adapter_model.safetensors").unlink()
    (search / "link-out").symlink_to(outside / "elsewhere", target_is_directory=True)
    (search / "file-link-out" / "adapter_model.safetensors").unlink()
    (search / "file-link-out" / "adapter_model.safetensors").symlink_to(
        outside / "elsewhere" / "adapter_model.safetensors")

    llm = LLM(model_dir, adapters={n: paths[n] for n in SERVED}, **OPTS)
    llm.generate([text(0)], SamplingParams(max_tokens=2, temperature=0.0), adapter=SERVED[0])
    app = build_app(llm, ["tiny", "tiny-alias"], api_key=KEYS, allowed_adapter_dirs=[str(allowed)],
                    lora_search_dirs=[str(search)], chat_template=TEMPLATE)
    st = ServerThread(app).start()
    yield st, app.state.server, search, good
    st.stop()


@pytest.fixture(scope="module")
def client(env):
    return openai.OpenAI(base_url=env[0].url + "/v1", api_key=KEYS[0], max_retries=0, timeout=300)


def reference(srv, prompts, adapters, max_tokens=6, stop=None):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop or [])
    return srv.engine.call_sync(lambda: srv.llm.generate(prompts, sp, adapter=adapters))


def served(url) -> list[str]:
    return [m["id"] for m in httpx.get(url + "/v1/models", headers=H).json()["data"]]


def test_names_keys_and_template(env, client):
    st, srv, _, _ = env
    assert served(st.url)[0] == "tiny" and "tiny-alias" not in served(st.url)
    want = reference(srv, [text(1)], [None])[0].token_ids
    for key in KEYS:
        for name in ("tiny", "tiny-alias"):
            r = httpx.post(st.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=300,
                           json={"model": name, "prompt": text(1), "max_tokens": 6, "temperature": 0,
                                 "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == want
    metrics = httpx.get(st.url + "/metrics").text  # the base model's requests count under its first name
    assert 'slora_requests_total{finish_reason="length",model="tiny"}' in metrics and "tiny-alias" not in metrics
    for bad in ("sk-three", "sk-one sk-two", "sk-one,sk-two"):
        r = httpx.get(st.url + "/v1/models", headers={"Authorization": f"Bearer {bad}"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(st.url + "/v1/load_lora_adapter", headers=H, json={"lora_name": "tiny-alias", "lora_path": "x"})
    assert r.status_code == 400 and "base model" in r.json()["error"]["message"]
    # --chat-template replaces the tokenizer's (here: the fallback "role: content" lines).
    messages = [{"role": "user", "content": "hi there 001"}]
    out = client.chat.completions.create(model="tiny-alias", messages=messages, max_tokens=2,
                                         extra_body={"return_token_ids": True})
    assert extra(out.choices[0], "prompt_token_ids") == srv.llm.tokenizer.encode("<user|hi there 001>[bot]",
                                                                                  add_special_tokens=False)
    wait_idle(st.url, headers=H)


def test_tokenizer_file_is_parsed_once(env, monkeypatch):
    """The server's chat template, token pieces and streaming decode use the LLM's tokenizer."""
    import tokenizers
    _, srv, _, _ = env

    class NoParse:
        @staticmethod
        def from_file(path):
            raise AssertionError(f"tokenizer.json parsed again: {path}")

    monkeypatch.setattr(tokenizers, "Tokenizer", NoParse)
    app = build_app(srv.llm, "tiny", chat_template=TEMPLATE)
    again = app.state.server
    assert again.chat.tokenizer is srv.llm.tokenizer and again.piece(5) == srv.llm.tokenizer.hf.id_to_token(5)
    assert again.chat.render([{"role": "user", "content": "x"}]) == "<user|x>[bot]"
    # LLM.chat builds one of these per call, with the LLM's tokenizer
    assert ChatFormatter(srv.llm.model, srv.llm.tokenizer).tokenizer is srv.llm.tokenizer


def test_adapter_loads_on_first_use(env, client):
    st, srv, search, _ = env
    for name in ("good", "org/nested"):
        assert name not in served(st.url)
        want = reference(srv, [text(2)], [SERVED[0]])[0]  # the first use registers it: compare after
        out = client.completions.create(model=name, prompt=text(2), max_tokens=6, temperature=0,
                                        extra_body={"return_token_ids": True})
        assert name in served(st.url)
        ref = reference(srv, [text(2)], [name])[0]
        assert extra(out.choices[0], "token_ids") == ref.token_ids != want.token_ids
    # Chat and streaming requests load on first use too; an adapter beside the search directory
    # (inside --allowed-adapter-dirs, but not searched) does not.
    shutil.copytree(search / "good", search / "for-chat")
    stream = client.chat.completions.create(model="for-chat", messages=[{"role": "user", "content": "hi there 002"}],
                                            max_tokens=3, stream=True)
    assert [c for c in stream] and "for-chat" in served(st.url)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="beside-search", prompt=text(2), max_tokens=2)
    wait_idle(st.url, headers=H)


def test_concurrent_first_requests_load_once(env):
    st, srv, _, _ = env
    loads = []
    original = srv.llm.load_adapter

    def counting_load(name, path):  # slow, so that every request arrives while the load runs
        loads.append(name)
        time.sleep(1.0)
        original(name, path)

    srv.llm.load_adapter = counting_load
    first_loads = []
    first_load = srv.first_use._load

    async def counting_first_load(name, path):  # one load in flight; the other requests wait on it
        first_loads.append(name)
        await first_load(name, path)

    srv.first_use._load = counting_first_load
    try:
        async def main():
            async with httpx.AsyncClient(timeout=300, headers=H) as c:
                return await asyncio.gather(*[
                    c.post(st.url + "/v1/completions", json={"model": "fresh", "prompt": text(3 + i), "max_tokens": 3,
                                                              "temperature": 0, "return_token_ids": True})
                    for i in range(6)])
        got = asyncio.run(main())
    finally:
        del srv.llm.load_adapter, srv.first_use._load
    assert [r.status_code for r in got] == [200] * 6, [r.text for r in got]
    assert loads == ["fresh"] and first_loads == ["fresh"]
    refs = reference(srv, [text(3 + i) for i in range(6)], ["fresh"] * 6, max_tokens=3)
    assert [r.json()["choices"][0]["token_ids"] for r in got] == [r.token_ids for r in refs]
    wait_idle(st.url, headers=H)


CASES = [  # (model, status, message, code)
    ("bad-config", 400, "not valid JSON", "invalid_adapter"),
    ("bad-weights", 400, "cannot read safetensors", "invalid_adapter"),
    ("no-weights", 400, "adapter_model.safetensors", "invalid_adapter"),
    ("link-out", 400, "not inside --allowed-adapter-dirs", "path_not_allowed"),
    ("file-link-out", 400, "links outside --allowed-adapter-dirs", "path_not_allowed"),
    ("nope", 404, "does not exist", "model_not_found"),
    ("../beside-search", 404, "does not exist", "model_not_found"),
    ("good/../../beside-search", 404, "does not exist", "model_not_found"),
    ("org/./nested", 404, "does not exist", "model_not_found"),
    ("/etc", 404, "does not exist", "model_not_found"),
]


@pytest.mark.parametrize("model,status,message,code", CASES, ids=[c[0] for c in CASES])
def test_invalid_first_use_is_refused(env, model, status, message, code):
    st, srv, search, _ = env
    before = served(st.url)
    for _ in range(2):  # refused again the same way: nothing was half-registered
        r = httpx.post(st.url + "/v1/completions", headers=H, timeout=300,
                       json={"model": model, "prompt": text(4), "max_tokens": 2})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["param"] == "model" and err["code"] == code and message in err["message"], err
        assert str(search.parent) not in err["message"]  # no server path in the answer
    assert served(st.url) == before and model not in srv.llm.store.entries
    r = httpx.post(st.url + "/v1/completions", headers=H, timeout=300,
                   json={"model": SERVED[1], "prompt": text(4), "max_tokens": 2})
    assert r.status_code == 200, r.text  # and the server still serves
    wait_idle(st.url, headers=H)


# -- streaming ---------------------------------------------------------------------------------


def test_choice_decodes_only_new_tokens(env):
    """Choice.feed on UTF-8 text cut into deltas at every kind of place (inside a multi-byte
    character too), with and without stop strings: what it sends adds up to the full decode (cut
    at the stop string), and it decodes in full once per request, at its end."""
    _, srv, _, _ = env
    tok = srv.llm.tokenizer
    body = "naïve café: 日本語 ✓ done. ünïcödé 🎉 end"
    ids = tok.encode(body, add_special_tokens=False)
    assert len(ids) > len(body)  # multi-byte characters span several tokens
    calls = []
    decode = tok.decode

    def counting_decode(*a, **k):
        calls.append(1)
        return decode(*a, **k)

    rng = random.Random(0)
    tok.decode = counting_decode
    try:
        for stop in ([], ["日本"], ["🎉"], ["é: ", "zz"], ["not there"]):
            for keep in (False, True):
                for trial in range(20):
                    c = Choice(0, None, tok, stop, None, keep)
                    sent, i = "", 0
                    calls.clear()
                    while i < len(ids) and not c.finished:
                        k = rng.randint(1, 5)
                        last = i + k >= len(ids)
                        d = Delta(ids[i:i + k], None, "length" if last else None)
                        sent += c.feed(d)[0]
                        i += k
                    want = body
                    hits = [(want.find(s), s) for s in stop if s in want]
                    if hits:
                        at, s = min(hits)
                        want = want[:at + len(s)] if keep else want[:at]
                    assert sent == want == c.text, (stop, keep, sent)
                    assert len(calls) <= 1
    finally:
        del tok.decode


def test_streamed_text_equals_non_streamed(env, client):
    """On the model's own output (random bytes from the tiny model: UTF-8 sequences cut short,
    replacement characters) and with stop strings: streamed == non-streamed == LLM.generate."""
    st, srv, _, _ = env
    prompts = [text(10 + i) for i in range(4)]
    adapters = [None, SERVED[0], SERVED[1], None]
    refs = [reference(srv, [p], [a], max_tokens=16)[0] for p, a in zip(prompts, adapters)]
    assert any(any(ord(ch) > 127 for ch in r.text) for r in refs), [r.text for r in refs]
    for p, a, r in zip(prompts, adapters, refs):
        stops = [[], [r.text[len(r.text) // 2:len(r.text) // 2 + 2]] if len(r.text) > 4 else []]
        for stop in stops:
            want = reference(srv, [p], [a], max_tokens=16, stop=stop)[0].text
            kw = dict(model=a or "tiny", prompt=p, max_tokens=16, temperature=0, stop=stop or None)
            full = client.completions.create(**kw).choices[0].text
            streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
            assert streamed == full == want, (stop, streamed, full, want)
    wait_idle(st.url, headers=H)
