"""The server against bad input, on a live uvicorn on 127.0.0.1: every case gets the right status and
an OpenAI-shaped error ({"error": {"message", "type", "param", "code"}}) with a message that says
what is wrong; after every case the server still serves, and its engine is idle with no KV page
leaked (`kv_pages == 0`, nothing running, waiting or in flight).

Covered: API key (401), unknown model (404), invalid parameters (400: negative, zero, huge or
mistyped max_tokens; temperature and top_p out of range; empty, over-long and mistyped prompts and
messages; malformed bodies; strict JSON types, so true is not an integer and "0.5" not a number,
with the path of a nested field at fault as the error's param), adapters refused at load (400:
outside --allowed-adapter-dirs, '..' traversal, symlinks out, corrupt or mismatched weights, a rank
above max_lora_rank; the served set is unchanged), unloading a busy adapter (400), overload (429 + Retry-After), and requests the engine
aborts before their first token (503 + Retry-After).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
from pathlib import Path

import httpx
import pytest
from test_server import ALL_LINEAR, ADAPTERS, demo_dir, start_server, text, wait_idle

from slora_jax.model.peft import random_peft_adapter
from slora_jax.model.config import load_model_config

KEY = "sk-test-key"
H = {"Authorization": f"Bearer {KEY}"}
SERVED = ADAPTERS[:3]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    model_dir, paths = demo_dir(tmp_path_factory)
    root = tmp_path_factory.mktemp("adapter_dirs")
    allowed, outside = root / "allowed", root / "outside"
    allowed.mkdir()
    outside.mkdir()
    good = ALL_LINEAR[20]
    shutil.copytree(paths[good], allowed / "good")
    shutil.copytree(paths[good], outside / "elsewhere")
    (allowed / "link-out").symlink_to(outside / "elsewhere", target_is_directory=True)
    (allowed / "file-link-out").mkdir()
    shutil.copy(Path(paths[good]) / "adapter_config.json", allowed / "file-link-out")
    (allowed / "file-link-out" / "adapter_model.safetensors").symlink_to(
        outside / "elsewhere" / "adapter_model.safetensors")
    shutil.copytree(paths[good], allowed / "corrupt-config")
    (allowed / "corrupt-config" / "adapter_config.json").write_text("{not json")
    shutil.copytree(paths[good], allowed / "corrupt-weights")
    w = allowed / "corrupt-weights" / "adapter_model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    cfg = load_model_config("tiny")
    random_peft_adapter(allowed / "mismatched", dataclasses.replace(cfg, hidden_size=96, head_dim=0), rank=8)
    random_peft_adapter(allowed / "rank-too-big", cfg, rank=64)

    st, srv = start_server(model_dir, {n: paths[n] for n in SERVED}, api_key=KEY,
                           allowed_adapter_dirs=[str(allowed)], max_in_flight=1)
    yield st, srv, allowed, outside
    st.stop()


def post(url, path, body=None, *, content=None, headers=H, timeout=60):
    return httpx.post(url + path, json=body if content is None else None, content=content, headers=headers,
                      timeout=timeout)


def assert_error(r, status, match, param=None):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert match.lower() in err["message"].lower(), err["message"]
    if param is not None:
        assert err["param"] == param, err
    if status in (429, 503):
        assert int(r.headers["Retry-After"]) >= 1
    return err


def assert_serves(url):
    """The server still answers a request, and once idle holds no KV pages."""
    r = post(url, "/v1/completions", {"model": SERVED[0], "prompt": text(1), "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["text"]) >= 0 and r.json()["usage"]["completion_tokens"] >= 1
    s = wait_idle(url, headers=H)
    assert s["kv_pages"] == 0


def served(url):
    return [m["id"] for m in httpx.get(url + "/v1/models", headers=H).json()["data"]]


OK = {"model": SERVED[0], "prompt": text(2), "max_tokens": 3}
LONG_TEXT = "a" * 1100           # 1101 tokens with BOS: over max_model_len = 1024
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

COMPLETION_CASES = [  # (id, body changes, status, message, param)
    ("unknown-model", {"model": "nope"}, 404, "The model `nope` does not exist", "model"),
    ("model-not-a-string", {"model": 5}, 400, "model: Input should be a valid string", "model"),
    ("model-a-list", {"model": []}, 400, "model: Input should be a valid string", "model"),
    ("model-an-object", {"model": {"a": 1}}, 400, "model: Input should be a valid string", "model"),
    ("max-tokens-negative", {"max_tokens": -1}, 400, "max_tokens: Input should be greater than or equal to 0",
     "max_tokens"),
    ("max-tokens-zero", {"max_tokens": 0}, 400, "max_tokens must be >= 1", "max_tokens"),
    ("max-tokens-huge", {"max_tokens": 10**9}, 400, "maximum context length is 1024", "max_tokens"),
    ("max-tokens-string", {"max_tokens": "5"}, 400, "max_tokens: Input should be a valid integer", "max_tokens"),
    ("max-tokens-float", {"max_tokens": 1.5}, 400, "max_tokens: Input should be a valid integer", "max_tokens"),
    ("max-tokens-bool", {"max_tokens": True}, 400, "max_tokens: Input should be a valid integer", "max_tokens"),
    ("temperature-negative", {"temperature": -0.5}, 400, "temperature: Input should be greater than or equal to 0",
     "temperature"),
    ("temperature-huge", {"temperature": 2.5}, 400, "temperature: Input should be less than or equal to 2",
     "temperature"),
    ("temperature-string", {"temperature": "hot"}, 400, "temperature: Input should be a valid number", "temperature"),
    ("top-p-zero", {"top_p": 0}, 400, "top_p: Input should be greater than 0", "top_p"),
    ("top-p-big", {"top_p": 1.5}, 400, "top_p: Input should be less than or equal to 1", "top_p"),
    ("top-k-negative", {"top_k": -5}, 400, "top_k: Input should be greater than or equal to -1", "top_k"),
    ("seed-string", {"seed": "x"}, 400, "seed: Input should be a valid integer", "seed"),
    ("n-zero", {"n": 0}, 400, "n: Input should be greater than or equal to 1", "n"),
    ("stream-string", {"stream": "yes"}, 400, "stream: Input should be a valid boolean", "stream"),
    ("stop-int", {"stop": 5}, 400, "stop: Input should be a string or a list of strings", "stop"),
    ("logprobs-big", {"logprobs": 21}, 400, "logprobs: Input should be less than or equal to 20", "logprobs"),
    ("penalty", {"presence_penalty": 2.5}, 400, "presence_penalty: Input should be less than or equal to 2",
     "presence_penalty"),
    ("logit-bias-range", {"logit_bias": {"5": -101}}, 400,
     'logit_bias["5"]: Input should be greater than or equal to -100', "logit_bias"),
    ("stop-token-ids", {"stop_token_ids": [99999]}, 400, "stop_token_ids must be", "stop_token_ids"),
    ("ttft-slo-negative", {"ttft_slo": -1}, 400, "ttft_slo: Input should be greater than 0", "ttft_slo"),
    ("prompt-empty-string", {"prompt": ""}, 400, "prompt: String should have at least 1 character", "prompt"),
    ("prompt-empty-list", {"prompt": []}, 400, "prompt: List should have at least 1 item", "prompt"),
    ("prompt-empty-in-batch", {"prompt": [[]]}, 400, "prompt[0]: List should have at least 1 item", "prompt[0]"),
    ("prompt-too-long-text", {"prompt": LONG_TEXT}, 400, "maximum context length is 1024", "prompt"),
    ("prompt-too-long-ids", {"prompt": [5] * 1024}, 400, "maximum context length is 1024", "prompt"),
    ("prompt-fills-context", {"prompt": [5] * 1020, "max_tokens": 10}, 400, "1030 tokens", "max_tokens"),
    ("prompt-far-too-long", {"prompt": "a" * (1024 * 64 + 1)}, 400, "far over the maximum context", "prompt"),
    ("prompt-int", {"prompt": 123}, 400, "prompt: Input should be a string, a list of strings", "prompt"),
    ("prompt-object", {"prompt": {"x": 1}}, 400, "prompt: Input should be a string, a list of strings", "prompt"),
    ("prompt-mixed-list", {"prompt": [1, "a"]}, 400, "prompt: Input should be a string, a list of strings", "prompt"),
    ("prompt-token-out-of-range", {"prompt": [1, 100000]}, 400, "token ids must be in [0, 512)", "prompt"),
    ("prompt-missing", {"prompt": None}, 400, "prompt: Field required", "prompt"),
]


@pytest.mark.parametrize("change,status,match,param", [c[1:] for c in COMPLETION_CASES],
                         ids=[c[0] for c in COMPLETION_CASES])
def test_completion_errors(env, change, status, match, param):
    st = env[0]
    body = {**OK, **change}
    body = {k: v for k, v in body.items() if v is not None}
    for stream in (False, True):
        assert_error(post(st.url, "/v1/completions", {**body, "stream": stream}
                          if "stream" not in change else body), status, match, param)
    assert_serves(st.url)


CHAT_CASES = [
    ("unknown-model", {"model": "nope"}, 404, "does not exist", "model"),
    ("model-a-list", {"model": []}, 400, "model: Input should be a valid string", "model"),
    ("messages-string", {"messages": "hi"}, 400, "messages: Input should be a valid list", "messages"),
    ("messages-empty", {"messages": []}, 400, "messages: List should have at least 1 item", "messages"),
    ("messages-missing", {"messages": None}, 400, "messages: Field required", "messages"),
    ("message-not-object", {"messages": ["hi"]}, 400, "messages[0]: Input should be a valid dictionary",
     "messages[0]"),
    ("role-unknown", {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages[0].role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool'", "messages[0].role"),
    ("content-int", {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content: Input should be a string or a list of text parts", "messages[0].content"),
    ("content-image", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content[0].type: Input should be 'text'", "messages[0].content[0].type"),
    ("content-all-empty", {"messages": [{"role": "user", "content": ""}]}, 400, "messages are all empty", "messages"),
    ("content-too-long", {"messages": [{"role": "user", "content": LONG_TEXT}]}, 400,
     "maximum context length is 1024", "messages"),
    ("max-completion-tokens-huge", {"max_completion_tokens": 5000}, 400, "maximum context length",
     "max_completion_tokens"),
    ("top-logprobs-without-logprobs", {"top_logprobs": 2}, 400, "top_logprobs needs logprobs", "top_logprobs"),
    ("tools", {"tools": [{"type": "function"}]}, 400, "tools are not supported", "tools"),
    ("temperature", {"temperature": 3}, 400, "temperature: Input should be less than or equal to 2", "temperature"),
]


@pytest.mark.parametrize("change,status,match,param", [c[1:] for c in CHAT_CASES], ids=[c[0] for c in CHAT_CASES])
def test_chat_errors(env, change, status, match, param):
    st = env[0]
    body = {k: v for k, v in {**CHAT, **change}.items() if v is not None}
    for stream in (False, True):
        assert_error(post(st.url, "/v1/chat/completions", {**body, "stream": stream}), status, match, param)
    assert_serves(st.url)


STRICT_CASES = [  # (id, route, body, message, param, code): the body's model, strict as JSON's types are
    ("bool-for-int", "/v1/completions", {**OK, "n": True}, "n: Input should be a valid integer", "n", "invalid_type"),
    ("string-for-int", "/v1/completions", {**OK, "top_k": "5"}, "top_k: Input should be a valid integer", "top_k",
     "invalid_type"),
    ("float-for-int", "/v1/completions", {**OK, "seed": 1.0}, "seed: Input should be a valid integer", "seed",
     "invalid_type"),
    ("bool-for-number", "/v1/completions", {**OK, "temperature": False}, "temperature: Input should be a valid number",
     "temperature", "invalid_type"),
    ("string-for-number", "/v1/completions", {**OK, "top_p": "0.5"}, "top_p: Input should be a valid number", "top_p",
     "invalid_type"),
    ("int-for-bool", "/v1/completions", {**OK, "echo": 1}, "echo: Input should be a valid boolean", "echo",
     "invalid_type"),
    ("int-past-double", "/v1/completions", {**OK, "min_p": 10**400}, "min_p: Input should be less than or equal to 1",
     "min_p", "invalid_value"),
    ("token-id-bool", "/v1/completions", {**OK, "prompt": [1, True]}, "prompt[1]: Input should be a valid integer",
     "prompt[1]", "invalid_type"),
    ("token-id-in-batch", "/v1/completions", {**OK, "prompt": ["a", [1, -2]]},
     "prompt[1][1]: Input should be greater than or equal to 0", "prompt[1][1]", "invalid_value"),
    ("nested-object-field", "/v1/completions", {**OK, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage: Input should be a valid boolean", "stream_options.include_usage", "invalid_type"),
    ("map-value", "/v1/completions", {**OK, "logit_bias": {"7": "x"}}, 'logit_bias["7"]: Input should be a valid number',
     "logit_bias", "invalid_type"),
    ("prompt-missing", "/v1/completions", {"max_tokens": 3}, "prompt: Field required", "prompt",
     "missing_required_parameter"),
    ("role-in-second-message", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "hi"}]},
     "messages[1].role: Input should be", "messages[1].role", "invalid_value"),
    ("role-missing", "/v1/chat/completions", {**CHAT, "messages": [{"content": "hi"}]}, "messages[0].role: Field required",
     "messages[0].role", "missing_required_parameter"),
    ("part-text-int", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text",
                                                                                                 "text": 5}]}]},
     "messages[0].content[0].text: Input should be a valid string", "messages[0].content[0].text", "invalid_type"),
    ("user-without-content", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]},
     "messages[0].content: only an assistant message may have no content", "messages[0].content",
     "missing_required_parameter"),
    ("logprobs-int-in-chat", "/v1/chat/completions", {**CHAT, "logprobs": 2}, "logprobs: Input should be a valid boolean",
     "logprobs", "invalid_type"),
    ("load-inplace-string", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "good", "load_inplace": "yes"},
     "load_inplace: Input should be a valid boolean", "load_inplace", "invalid_type"),
    ("unload-name-int", "/v1/unload_lora_adapter", {"lora_name": 5}, "lora_name: Input should be a valid string",
     "lora_name", "invalid_type"),
]


@pytest.mark.parametrize("route,body,match,param,code", [c[1:] for c in STRICT_CASES], ids=[c[0] for c in STRICT_CASES])
def test_strict_types_and_paths(env, route, body, match, param, code):
    """A body that does not fit its model is a 400 (never FastAPI's 422, never a 500) whose message
    names the field's path in the body and whose param is that path."""
    st = env[0]
    err = assert_error(post(st.url, route, body), 400, match, param)
    assert err["code"] == code, err
    assert_serves(st.url)


def test_integers_for_numbers_and_an_assistant_without_content(env):
    """An integer is a number; an assistant message may leave out its content (null or omitted)."""
    st = env[0]
    r = post(st.url, "/v1/completions", {**OK, "temperature": 1, "top_p": 1, "presence_penalty": -2,
                                         "logit_bias": {"5": 100}, "ttft_slo": 60})
    assert r.status_code == 200, r.text
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant"}, {"role": "assistant", "content": None},
                {"role": "user", "content": [{"type": "text", "text": "more"}]}]
    r = post(st.url, "/v1/chat/completions", {**CHAT, "messages": messages})
    assert r.status_code == 200, r.text
    assert_serves(st.url)


def test_malformed_bodies_and_routes(env):
    st = env[0]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert_error(post(st.url, path, content=b"{not json", headers={**H, "Content-Type": "application/json"}),
                     400, "not valid JSON")
        assert_error(post(st.url, path, content=b"[1, 2]", headers={**H, "Content-Type": "application/json"}),
                     400, "must be a JSON object")
        assert_error(post(st.url, path, content=b"\xff\xfe", headers=H), 400, "not valid JSON")
    assert_error(post(st.url, "/v1/completions", content=b" " * (17 << 20), headers=H), 400, "over 16 MiB")
    err = assert_error(httpx.get(st.url + "/v1/nothing", headers=H), 404, "not found")
    assert err["code"] == "not_found"
    assert_serves(st.url)


def test_api_key(env):
    st = env[0]
    assert_error(post(st.url, "/v1/completions", OK, headers={}), 401, "missing API key")
    assert_error(post(st.url, "/v1/completions", OK, headers={"Authorization": "Bearer wrong"}), 401,
                 "invalid API key")
    assert_error(post(st.url, "/v1/completions", OK, headers={"Authorization": KEY}), 401, "invalid API key")
    assert_error(httpx.get(st.url + "/v1/models"), 401, "missing API key")
    assert_error(post(st.url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/"}, headers={}), 401,
                 "missing API key")
    assert_error(httpx.get(st.url + "/stats"), 401, "missing API key")
    # Health and metrics stay open, like vLLM's.
    assert httpx.get(st.url + "/health").status_code == 200
    assert httpx.get(st.url + "/metrics").status_code == 200
    assert_serves(st.url)


def adapter_cases(allowed: Path, outside: Path):
    return [  # (id, body, status, message, param)
        ("outside", {"lora_name": "x", "lora_path": str(outside / "elsewhere")}, 400, "not inside --allowed-adapter-dirs",
         "lora_path"),
        ("traversal", {"lora_name": "x", "lora_path": f"{allowed}/../outside/elsewhere"}, 400,
         "not inside --allowed-adapter-dirs", "lora_path"),
        ("traversal-deep", {"lora_name": "x", "lora_path": f"{allowed}/good/../../../../../../etc"}, 400,
         "not inside --allowed-adapter-dirs", "lora_path"),
        ("symlink-out", {"lora_name": "x", "lora_path": str(allowed / "link-out")}, 400,
         "not inside --allowed-adapter-dirs", "lora_path"),
        ("file-symlink-out", {"lora_name": "x", "lora_path": str(allowed / "file-link-out")}, 400,
         "links outside --allowed-adapter-dirs", "lora_path"),
        ("missing", {"lora_name": "x", "lora_path": str(allowed / "nope")}, 400, "is not a directory", "lora_path"),
        ("corrupt-config", {"lora_name": "x", "lora_path": str(allowed / "corrupt-config")}, 400, "not valid JSON",
         "lora_path"),
        ("corrupt-weights", {"lora_name": "x", "lora_path": str(allowed / "corrupt-weights")}, 400,
         "cannot read safetensors", "lora_path"),
        ("mismatched", {"lora_name": "x", "lora_path": str(allowed / "mismatched")}, 400, "has shape", "lora_path"),
        ("rank-too-big", {"lora_name": "x", "lora_path": str(allowed / "rank-too-big")}, 400, "exceeds max_rank=32",
         "lora_path"),
        ("replace-with-corrupt", {"lora_name": SERVED[1], "lora_path": str(allowed / "corrupt-weights"),
                                  "load_inplace": True}, 400, "cannot read safetensors", "lora_path"),
        ("name-missing", {"lora_path": str(allowed / "good")}, 400, "lora_name: Field required", "lora_name"),
        ("name-int", {"lora_name": 5, "lora_path": str(allowed / "good")}, 400, "lora_name: Input should be a valid string",
         "lora_name"),
        ("name-spaces", {"lora_name": "a b", "lora_path": str(allowed / "good")}, 400,
         "lora_name: String should match pattern", "lora_name"),
        ("name-is-base", {"lora_name": "tiny", "lora_path": str(allowed / "good")}, 400, "base model", "lora_name"),
        ("name-taken", {"lora_name": SERVED[0], "lora_path": str(allowed / "good")}, 400, "already been loaded",
         "lora_name"),
        ("path-missing", {"lora_name": "x"}, 400, "lora_path: Field required", "lora_path"),
        ("path-nul", {"lora_name": "x", "lora_path": str(allowed) + "/a\x00b"}, 400, "NUL", "lora_path"),
    ]


CASE_IDS = [c[0] for c in adapter_cases(Path("/a"), Path("/b"))]


@pytest.mark.parametrize("case", CASE_IDS)
def test_load_adapter_refused(env, case):
    st, srv, allowed, outside = env
    _, body, status, match, param = next(c for c in adapter_cases(allowed, outside) if c[0] == case)
    before = served(st.url)
    want = post(st.url, "/v1/completions", {"model": SERVED[1], "prompt": text(3), "max_tokens": 3,
                                            "temperature": 0, "return_token_ids": True}).json()
    assert_error(post(st.url, "/v1/load_lora_adapter", body), status, match, param)
    assert served(st.url) == before  # the served set is unchanged
    got = post(st.url, "/v1/completions", {"model": SERVED[1], "prompt": text(3), "max_tokens": 3,
                                           "temperature": 0, "return_token_ids": True}).json()
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]  # and serves the same weights
    assert_serves(st.url)


def test_unload_errors(env):
    st = env[0]
    assert_error(post(st.url, "/v1/unload_lora_adapter", {"lora_name": "nope"}), 404, "cannot be found",
                 "lora_name")
    assert_error(post(st.url, "/v1/unload_lora_adapter", {"lora_name": "tiny"}), 400, "base model cannot be unloaded",
                 "lora_name")
    assert_error(post(st.url, "/v1/unload_lora_adapter", {}), 400, "lora_name: Field required", "lora_name")
    assert_serves(st.url)


def in_background(fn):
    """Run fn() on a thread; return a getter for its result."""
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", fn()), daemon=True)
    t.start()

    def result(timeout=120):
        t.join(timeout)
        assert not t.is_alive()
        return box["r"]
    return result


def wait_queued(url, n=1, timeout=30):
    import time
    t0 = time.monotonic()
    while httpx.get(url + "/stats", headers=H).json()["waiting"] < n:
        assert time.monotonic() - t0 < timeout
        time.sleep(0.02)


def test_unload_busy_adapter_is_refused(env):
    """Unloading an adapter with a request in flight is refused; once it is done, unloading works."""
    st, srv, allowed, _ = env
    r = post(st.url, "/v1/load_lora_adapter", {"lora_name": "busy", "lora_path": str(allowed / "good")})
    assert r.status_code == 200, r.text
    srv.engine.pause()
    try:
        res = in_background(lambda: post(st.url, "/v1/completions", {"model": "busy", "prompt": text(4),
                                                                     "max_tokens": 3}))
        wait_queued(st.url)
        assert_error(post(st.url, "/v1/unload_lora_adapter", {"lora_name": "busy"}), 400, "in flight",
                     "lora_name")
    finally:
        srv.engine.resume()
    assert res().status_code == 200
    assert post(st.url, "/v1/unload_lora_adapter", {"lora_name": "busy"}).status_code == 200
    assert "busy" not in served(st.url)
    assert_serves(st.url)


def test_overload_429(env):
    """max_in_flight=1: while one request is in flight, the next gets 429 with Retry-After."""
    st, srv = env[:2]
    srv.engine.pause()
    try:
        first = in_background(lambda: post(st.url, "/v1/completions", OK))
        wait_queued(st.url)
        for path, body in (("/v1/completions", OK), ("/v1/chat/completions", CHAT),
                           ("/v1/completions", {**OK, "stream": True})):
            err = assert_error(post(st.url, path, body), 429, "overloaded")
            assert err["code"] == "rate_limit_exceeded"
    finally:
        srv.engine.resume()
    assert first().status_code == 200
    assert_serves(st.url)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_early_abort_503(env, stream):
    """A request the scheduler aborts before its first token (its TTFT objective cannot be met any
    more) gets 503 with Retry-After, streamed or not."""
    import time
    st, srv = env[:2]
    srv.engine.pause()
    try:
        res = in_background(lambda: post(st.url, "/v1/completions", {**OK, "ttft_slo": 0.05, "stream": stream}))
        wait_queued(st.url)
        time.sleep(0.2)  # past its deadline while queued
    finally:
        srv.engine.resume()
    err = assert_error(res(), 503, "early abort")
    assert err["code"] == "aborted"
    assert_serves(st.url)


def test_aborted_by_server_503(env):
    """Requests the server aborts (as at shutdown) get 503 with Retry-After."""
    st, srv = env[:2]
    srv.engine.pause()
    try:
        res = in_background(lambda: post(st.url, "/v1/chat/completions", CHAT))
        wait_queued(st.url)
        assert srv.engine.abort_all("draining for a test") == 1
    finally:
        srv.engine.resume()
    assert_error(res(), 503, "draining for a test")
    assert_serves(st.url)


def test_no_leaks_at_the_end(env):
    st, srv = env[:2]
    s = wait_idle(st.url, headers=H)
    assert s["kv_pages"] == 0 and s["free_pages"] + s["adapter_pages"] + s["prefix_cache"]["cached_pages"] == s["total_pages"]
    assert srv.engine.in_flight == 0
    assert os.path.isdir(env[2])  # nothing outside was touched
    assert json.loads((env[2] / "good" / "adapter_config.json").read_text())["peft_type"] == "LORA"
