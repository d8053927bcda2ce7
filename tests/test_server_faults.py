"""Fault isolation at the server: one hostile request harms no one else.

On a live uvicorn on 127.0.0.1 with an API key and a short --request-timeout: values that would
overflow on the device (top_k past int32, seeds past int64, floats past a double) are 400s naming
the field; malformed Unicode and deep nesting are 400s; tokenizing a large body leaves /health
answering; the message count and a chat's characters (names and roles too) are bounded; a body
that stops half-way gets 408 within the timeout; every route but /health and /metrics wants the
key; no response shows an absolute server path; an adapter whose output overflows ends its own
request with an error and never puts NaN into JSON, logprobs asked or not; a step that fails
whenever one request's row is in it fails that request alone (the fault injected through the
engine's input builder); an adapter whose file is gone after registration fails only its own
requests. Each case ends with the server still serving and its engine idle with no KV page held.

The chaos run, which mixes all of these, is in test_server_chaos.py.

Also here: SIGTERM on `slora-jax serve` in a subprocess drains (new requests 503 + Retry-After,
running ones finish or end with an error event and [DONE], no traceback logged), and the demo's
cache survives a kill during its first start.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_server import (ALL_LINEAR, ADAPTERS, demo_dir, reference, start_cli_server, start_server, text,
                         wait_idle)

from slora_jax.demo import prepare
from slora_jax.serve.async_engine import EngineError
from slora_jax.serve.errors import from_engine_error, hide_paths
from slora_jax.serve.schema import MAX_MESSAGES

KEY = "sk-faults"
H = {"Authorization": f"Bearer {KEY}"}
SERVED = ADAPTERS[:2]
TIMEOUT = 2.0  # the server's --request-timeout here


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    model_dir, paths = demo_dir(tmp_path_factory)
    allowed = tmp_path_factory.mktemp("faults_allowed")
    shutil.copytree(paths[ALL_LINEAR[20]], allowed / "good")
    shutil.copytree(paths[ALL_LINEAR[20]], allowed / "no-weights")
    (allowed / "no-weights" / "adapter_model.safetensors").unlink()
    overflow(paths[ALL_LINEAR[21]], allowed / "huge")
    st, srv = start_server(model_dir, {n: paths[n] for n in SERVED}, api_key=KEY,
                           allowed_adapter_dirs=[str(allowed)], request_timeout=TIMEOUT)
    yield st, srv, allowed, model_dir
    st.stop()


def overflow(src, dst) -> Path:
    """A copy of adapter `src` whose weights are all 1e30: finite, so registration takes it, but its
    activations overflow."""
    import numpy as np
    from safetensors.numpy import load_file, save_file
    shutil.copytree(src, dst)
    f = Path(dst) / "adapter_model.safetensors"
    save_file({k: np.full_like(v, 1e30) for k, v in load_file(f).items()}, f)
    return Path(dst)


def post(url, path, body=None, *, content=None, headers=H, timeout=120):
    hdrs = {**headers, "Content-Type": "application/json"} if content is not None else headers
    return httpx.post(url + path, json=body if content is None else None, content=content, headers=hdrs,
                      timeout=timeout)


def assert_error(r, status, match, param="unset"):
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert match.lower() in err["message"].lower(), err["message"]
    if param != "unset":
        assert err["param"] == param, err
    return err


def assert_serves(url):
    r = post(url, "/v1/completions", {"model": SERVED[0], "prompt": text(3), "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    s = wait_idle(url, headers=H)
    assert s["kv_pages"] == 0 and s["running"] == 0


OK = {"model": SERVED[0], "prompt": text(2), "max_tokens": 3}

RANGE_CASES = [  # (id, body changes, message, param): every value that reaches the device
    ("top-k-past-int32", {"top_k": 2**31}, "top_k: Input should be less than or equal to 2147483647", "top_k"),
    ("top-k-huge", {"top_k": 10**30}, "top_k: Input should be less than or equal to", "top_k"),
    ("seed-past-int64", {"seed": 2**64}, "seed: Input should be less than or equal to", "seed"),
    ("seed-below-int64", {"seed": -(2**64)}, "seed: Input should be greater than or equal to", "seed"),
    ("temperature-past-double", {"temperature": 10**400}, "temperature: Input should be less than or equal to 2",
     "temperature"),
    ("top-p-past-double", {"top_p": -(10**400)}, "top_p: Input should be greater than 0", "top_p"),
    ("ttft-slo-past-double", {"ttft_slo": 10**400}, "ttft_slo: Input should be less than or equal to 3600",
     "ttft_slo"),
    ("logprobs-huge", {"logprobs": 2**40}, "logprobs: Input should be less than or equal to 20", "logprobs"),
    ("n-huge", {"n": 2**40}, "n: Input should be less than or equal to 16", "n"),
    ("stop-token-ids-many", {"stop_token_ids": [5] * 65}, "stop_token_ids: List should have at most 64 items",
     "stop_token_ids"),
    ("stop-token-id-negative", {"stop_token_ids": [-1]}, "stop_token_ids[0]: Input should be greater than or equal to 0",
     "stop_token_ids[0]"),
    ("stop-string-long", {"stop": "x" * 1025}, "stop: String should have at most 1024 characters", "stop"),
    ("stop-strings-many", {"stop": ["x"] * 17}, "stop: List should have at most 16 items", "stop"),
    ("max-tokens-past-int64", {"max_tokens": 2**70}, "maximum context length", "max_tokens"),
]


@pytest.mark.parametrize("change,match,param", [c[1:] for c in RANGE_CASES], ids=[c[0] for c in RANGE_CASES])
def test_device_values_range_checked(env, change, match, param):
    st = env[0]
    for stream in (False, True):
        assert_error(post(st.url, "/v1/completions", {**OK, **change, "stream": stream}), 400, match, param)
    assert_serves(st.url)


def test_non_finite_numbers_refused(env):
    """NaN and Infinity are not JSON; Python's parser takes them unless told not to."""
    st = env[0]
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        raw = b'{"model": "%s", "prompt": "hi", "max_tokens": 2, "temperature": %s}' % (SERVED[0].encode(), literal)
        assert_error(post(st.url, "/v1/completions", content=raw), 400, "not a JSON number")
    assert_serves(st.url)


SURROGATE_BODIES = [  # lone UTF-16 surrogates, escaped as JSON allows; no UTF-8 text holds them
    ("prompt", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "/v1/completions", "prompt"),
    ("prompt-list", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "/v1/completions", "prompt"),
    ("model", b'{"model": "\\ud800", "prompt": "hi", "max_tokens": 2}', "/v1/completions", "model"),
    ("chat-content", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', "/v1/chat/completions", "messages"),
    ("chat-part", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "/v1/chat/completions", "messages"),
    ("key", b'{"\\ud800": 1, "prompt": "hi"}', "/v1/completions", None),
    ("adapter-name", b'{"lora_name": "\\ud800", "lora_path": "good"}', "/v1/load_lora_adapter", "lora_name"),
]


@pytest.mark.parametrize("raw,route,param", [c[1:] for c in SURROGATE_BODIES], ids=[c[0] for c in SURROGATE_BODIES])
def test_lone_surrogates_refused(env, raw, route, param):
    st = env[0]
    err = assert_error(post(st.url, route, content=raw), 400, "lone UTF-16 surrogate")
    assert err["code"] == "invalid_unicode" and err["param"] == param
    assert_serves(st.url)


def test_deep_nesting_and_bad_utf8_refused(env):
    st = env[0]
    deep = b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert_error(post(st.url, "/v1/completions", content=deep), 400, "nested deeper than 32 levels")
    deep_obj = b'{"prompt": "hi", "x": ' + b'{"a": ' * 40 + b"1" + b"}" * 40 + b"}"
    assert_error(post(st.url, "/v1/completions", content=deep_obj), 400, "nested deeper than 32 levels")
    assert_error(post(st.url, "/v1/completions", content=b'{"prompt": "\xff\xfe"}'), 400, "not valid JSON")
    # A surrogate encoded as UTF-8 bytes (which Python's json decodes with surrogatepass).
    assert_error(post(st.url, "/v1/completions", content=b'{"prompt": "\xed\xa0\x80"}'), 400, "surrogate")
    assert_serves(st.url)


def health_latencies(url, work) -> tuple[float, object]:
    """Run `work()` on a thread; meanwhile poll /health. (The slowest /health answer, work's result.)"""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", work()))
    t.start()
    worst = 0.0
    with httpx.Client(timeout=60) as c:
        while t.is_alive():
            t0 = time.perf_counter()
            assert c.get(url + "/health").status_code == 200
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.01)
    t.join()
    return worst, out["r"]


def test_tokenizing_leaves_health_answering(env):
    """A 6 MB body of 100 long prompts takes seconds to tokenize; /health answers throughout."""
    st = env[0]
    prompts = ["ab cd " * 10_000] * 100  # each under the characters limit, 60k tokens each
    body = json.dumps({"model": SERVED[0], "prompt": prompts, "max_tokens": 2}).encode()
    t0 = time.perf_counter()
    worst, r = health_latencies(st.url, lambda: post(st.url, "/v1/completions", content=body))
    took = time.perf_counter() - t0
    assert_error(r, 400, "maximum context length is 1024", "prompt")
    assert worst < max(1.0, took / 3), (worst, took)
    assert_serves(st.url)


def test_message_count_and_chat_characters_bounded(env):
    """450k empty messages are refused before templating; names and roles count towards a chat's
    characters, not only the contents."""
    st = env[0]
    many = {"messages": [{"role": "user", "content": ""}] * 450_000 + [{"role": "user", "content": "hi"}]}
    t0 = time.perf_counter()
    worst, r = health_latencies(st.url, lambda: post(st.url, "/v1/chat/completions", many))
    took = time.perf_counter() - t0
    assert_error(r, 400, f"messages: List should have at most {MAX_MESSAGES} items", "messages")
    # a loaded machine slows the body's parse too: /health waits a third of the request at most
    assert worst < max(1.0, took / 3), (worst, took)
    named = {"messages": [{"role": "user", "name": "n" * 100, "content": ""}] * 1000 +
             [{"role": "user", "content": "hi"}]}
    assert_error(post(st.url, "/v1/chat/completions", named), 400, "far over the maximum context length", "messages")
    assert_serves(st.url)


def test_half_sent_body_times_out(env):
    """A client that sends 10 of 1000 body bytes gets 408 (or a closed connection) within
    --request-timeout; the others are served meanwhile."""
    st = env[0]
    socks = []
    for _ in range(5):
        s = socket.create_connection((st.host, st.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n" + b'{"prompt":')
        socks.append(s)
    t0 = time.monotonic()
    assert_serves(st.url)
    for s in socks:
        s.settimeout(TIMEOUT + 10)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except TimeoutError:
            pytest.fail("the half-sent request was still open after the timeout")
        finally:
            s.close()
        assert got == b"" or got.startswith(b"HTTP/1.1 408"), got[:200]
        if got:
            assert b'"code":"request_timeout"' in got.replace(b" ", b"")
    assert time.monotonic() - t0 < TIMEOUT + 10


def test_api_key_on_every_route_but_health_and_metrics(env):
    st = env[0]
    for path in ("/stats", "/openapi.json", "/v1/models", "/v1/adapters", "/nothing"):
        assert_error(httpx.get(st.url + path), 401, "missing API key")
        assert httpx.get(st.url + path, headers=H).status_code == (404 if path == "/nothing" else 200)
    assert httpx.get(st.url + "/health").status_code == 200
    assert httpx.get(st.url + "/metrics").status_code == 200


def test_no_server_path_in_responses(env):
    st, srv, allowed, model_dir = env
    roots = [str(Path(model_dir).parent), str(allowed), os.path.realpath(allowed), str(Path.home())]
    r = post(st.url, "/v1/load_lora_adapter", {"lora_name": "good", "lora_path": str(allowed / "good")})
    assert r.status_code == 200, r.text
    r = post(st.url, "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(allowed / "no-weights")})
    assert r.status_code == 400
    texts = [r.text, httpx.get(st.url + "/v1/models", headers=H).text,
             httpx.get(st.url + "/v1/adapters", headers=H).text]
    for t in texts:
        for root in roots:
            assert root not in t, (root, t[:400])
    models = {m["id"]: m for m in httpx.get(st.url + "/v1/models", headers=H).json()["data"]}
    assert models["good"]["root"] == "good"            # relative to its allowed directory
    assert models[SERVED[0]]["root"] == SERVED[0]      # registered at start: its name
    assert models["tiny"]["root"] == "tiny"
    adapters = {a["name"]: a for a in httpx.get(st.url + "/v1/adapters", headers=H).json()["data"]}
    assert adapters["good"]["path"] == "good" and adapters[SERVED[0]]["path"] == SERVED[0]
    assert post(st.url, "/v1/unload_lora_adapter", {"lora_name": "good"}).status_code == 200
    assert_serves(st.url)


def test_concurrent_first_loads_of_one_name_register_it_once(env):
    """Ten loads of one new name at once: one registers it (200), the other nine see it loaded
    (400 adapter_exists), as if they had come one after another; none silently replaces another."""
    st, srv, allowed, _ = env
    body = {"lora_name": "racer", "lora_path": str(allowed / "good")}
    newest = srv.llm.store._version  # the store's registration counter: one more per registration
    results: list = [None] * 10
    start = threading.Barrier(10)

    def load(i):
        start.wait()
        results[i] = post(st.url, "/v1/load_lora_adapter", body)
    threads = [threading.Thread(target=load, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results)
    assert codes == [200] + [400] * 9, [(r.status_code, r.text[:120]) for r in results]
    assert all(r.json()["error"]["code"] == "adapter_exists" for r in results if r.status_code == 400)
    assert srv.llm.store.entries["racer"].version == newest + 1  # one registration, never replaced
    assert post(st.url, "/v1/unload_lora_adapter", {"lora_name": "racer"}).status_code == 200
    assert_serves(st.url)


def test_engine_errors_name_no_path():
    """An engine failure (an adapter's files gone from disk) reaches the client without the path."""
    e = EngineError("engine step failed: [Errno 2] No such file or directory: "
                    "'/srv/cache/adapters/customer-001/adapter_model.safetensors'", 500)
    msg = from_engine_error(e).message
    assert "/srv" not in msg and "customer-001" not in msg and "adapter_model.safetensors" in msg
    assert hide_paths("cannot load '/a/b/allowed/x/y': bad", ["/a/b/allowed"]) == "cannot load 'x/y': bad"


# ---------------------------------------------------------------------------------------------
# SIGTERM drains


def test_sigterm_drains(tmp_path_factory):
    """SIGTERM: a short request finishes (200), a new one gets 503 + Retry-After, a long stream
    and a long non-stream request past --shutdown-timeout end with an error event + [DONE] and
    a 503; the process exits 0 and logs no traceback."""
    model_dir, paths = demo_dir(tmp_path_factory)
    p, url = start_cli_server(model_dir, ["--shutdown-timeout", "4", "--log-level", "info"], stderr=subprocess.PIPE)
    try:
        short = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0.0}
        long = {"prompt": [5, 6, 7], "max_tokens": 1000, "temperature": 0.0, "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=short, timeout=300).status_code == 200  # compiles
        results = {}

        def run(name, body, stream=False):
            with httpx.Client(timeout=120) as c:
                if stream:
                    with c.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
                        results[name] = (r.status_code, [ln for ln in r.iter_lines() if ln])
                else:
                    r = c.post(url + "/v1/completions", json=body)
                    results[name] = (r.status_code, r.json(), r.headers.get("Retry-After"))

        threads = [threading.Thread(target=run, args=a) for a in
                   (("long", long), ("long-stream", long, True))]
        for t in threads:
            t.start()
        time.sleep(1.0)
        p.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        threads.append(threading.Thread(target=run, args=("short-after", short)))
        threads[-1].start()
        for t in threads:
            t.join(120)
        status, body, retry = results["short-after"]
        assert status == 503 and body["error"]["code"] == "shutting_down" and int(retry) >= 1, results["short-after"]
        status, body, retry = results["long"]
        assert status == 503 and "shutting down" in body["error"]["message"] and int(retry) >= 1, body
        status, lines = results["long-stream"]
        assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
        err = json.loads(lines[-2][len("data: "):])
        assert "shutting down" in err["error"]["message"], err
        assert len(lines) > 3  # tokens streamed before the drain ended it
        assert p.wait(60) == 0
        log = p.stderr.read()
        assert "Traceback" not in log, log[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


# ---------------------------------------------------------------------------------------------
# the demo's cache


def test_a_stream_that_raises_midway_ends_with_an_error_event(env, monkeypatch):
    """An unexpected error while a stream is under way (here: building its second chunk) ends that
    stream with an internal_error event and [DONE], never a cut connection; pages come back and
    the server serves on."""
    st, srv = env[:2]
    calls = []
    real = srv.completion_logprobs

    def fails_on_second_chunk(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("planted")
        return real(*args)

    monkeypatch.setattr(srv, "completion_logprobs", fails_on_second_chunk)
    body = {**OK, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", st.url + "/v1/completions", json=body, headers=H, timeout=120) as r:
        raw = r.read()
    assert r.status_code == 200, raw[:300]
    events = [ln[len(b"data: "):] for ln in raw.split(b"\n") if ln.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", raw[-300:]
    parsed = [json.loads(e) for e in events[:-1]]
    assert "choices" in parsed[0] and parsed[-1]["error"]["code"] == "internal_error", parsed[-1]
    assert "planted" in parsed[-1]["error"]["message"]
    monkeypatch.undo()
    assert_serves(st.url)


def test_demo_rebuilds_half_written_cache(tmp_path):
    """A kill during the first start left an adapter directory with adapter_config.json and no
    weights, and a model directory with config.json only: the next start rebuilds both."""
    model_dir, adapters = prepare(tmp_path, 2, 0)
    weights = (Path(adapters["customer-001"]) / "adapter_model.safetensors").read_bytes()
    (Path(adapters["customer-001"]) / "adapter_model.safetensors").unlink()
    (model_dir / "model.safetensors").unlink()
    model_dir2, adapters2 = prepare(tmp_path, 2, 0)
    assert (model_dir2, adapters2) == (model_dir, adapters)
    assert (Path(adapters["customer-001"]) / "adapter_model.safetensors").read_bytes() == weights
    assert (model_dir / "model.safetensors").is_file() and (model_dir / "tokenizer.json").is_file()
    leftovers = [p.name for p in [*tmp_path.iterdir(), *(tmp_path / "adapters").iterdir()] if p.name.startswith(".")]
    assert leftovers == []


# ---------------------------------------------------------------------------------------------
# an adapter whose output is not finite


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory):
    """A server whose one adapter has finite weights of 1e30, so its activations overflow."""
    model_dir, paths = demo_dir(tmp_path_factory)
    bad = overflow(paths[ALL_LINEAR[21]], tmp_path_factory.mktemp("overflow") / "huge")
    st, srv = start_server(model_dir, {"huge": str(bad)}, api_key=KEY)
    yield st, srv
    st.stop()


def test_non_finite_output_ends_that_request_alone(overflowing):
    """Logprobs of an overflowing adapter never reach JSON as NaN: its non-stream request gets a
    500 of its own and its stream an error event and [DONE], both valid JSON; the server serves on."""
    st, srv = overflowing
    body = {"model": "huge", "prompt": text(4), "max_tokens": 4, "temperature": 0, "logprobs": 1}
    r = post(st.url, "/v1/completions", body)
    assert b"NaN" not in r.content and b"Infinity" not in r.content, r.content[:300]
    assert_error(r, 500, "not finite", None)
    assert r.json()["error"]["code"] == "non_finite_output"
    with httpx.stream("POST", st.url + "/v1/completions", json={**body, "stream": True}, headers=H, timeout=120) as r:
        raw = r.read()
    assert b"NaN" not in raw and b"Infinity" not in raw, raw[:300]
    if r.status_code == 200:
        events = [ln[len(b"data: "):] for ln in raw.split(b"\n") if ln.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        parsed = [json.loads(e) for e in events[:-1]]
        assert parsed[-1]["error"]["code"] == "non_finite_output", parsed[-1]
    else:
        assert_error(r, 500, "not finite", None)
    ok = post(st.url, "/v1/completions", {"prompt": text(5), "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    s = wait_idle(st.url, headers=H)
    assert s["kv_pages"] == 0 and srv.engine.in_flight == 0


def concurrently(*calls):
    """Run each zero-argument call on its own thread, all at once: their results, in order."""
    results: list = [None] * len(calls)
    start = threading.Barrier(len(calls))

    def run(i):
        start.wait()
        results[i] = calls[i]()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


def completion(url, model, prompt, max_tokens=4, **extra):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True, **extra}
    return post(url, "/v1/completions", {**body, **({"model": model} if model else {})})


def token_ids(r) -> list[int]:
    assert r.status_code == 200, r.text[:300]
    return r.json()["choices"][0]["token_ids"]


def test_non_finite_logits_without_logprobs_end_that_request_alone(overflowing):
    """The overflowing adapter's request asks for no logprobs: it still ends with a 500 of its
    own, not tokens sampled from NaN; base requests in the same steps answer as they do alone."""
    st, srv = overflowing
    prompts = [text(11), text(12)]
    *base, bad = concurrently(*[lambda p=p: completion(st.url, None, p) for p in prompts],
                              lambda: completion(st.url, "huge", text(13)))
    assert_error(bad, 500, "not finite", None)
    assert bad.json()["error"]["code"] == "non_finite_output"
    ref = reference(srv, prompts, [None, None], max_tokens=4)
    assert [token_ids(r) for r in base] == [o.token_ids for o in ref]
    s = wait_idle(st.url, headers=H)
    assert s["kv_pages"] == 0 and srv.engine.in_flight == 0


@pytest.fixture
def step_fault(env, monkeypatch):
    """The engine's input builder raises for every decode row of a request whose prompt starts
    with the returned token ids (its prefill goes through)."""
    srv = env[1]
    mark = [srv.llm.cfg.vocab_size - 3] * 3
    builder = srv.llm.engine.builder
    build = builder.build

    def faulty(plan):
        if any(req.tokens[:3] == mark and start >= req.prompt_len for req, start, _ in plan.chunks):
            raise ValueError("injected fault")
        return build(plan)
    monkeypatch.setattr(builder, "build", faulty)
    return mark


def assert_step_failed(r):
    """A request whose step failed: a 500 of its own, or (a stream that had sent tokens) an error
    event and [DONE]."""
    raw = r.content
    if r.status_code == 500:
        err = assert_error(r, 500, "injected fault", None)
        assert err["code"] == "step_failed"
        return
    assert r.status_code == 200, raw[:300]
    events = [ln[len(b"data: "):] for ln in raw.split(b"\n") if ln.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "step_failed" and "injected fault" in err["message"], err


def test_failing_step_fails_that_request_alone(env, step_fault):
    """A step that raises whenever one request's row is in it: that request gets a 500 (or, as a
    stream, an error event) of its own; the requests batched with it answer as they do alone."""
    st, srv = env[:2]
    models = [None, SERVED[0], SERVED[1]]
    prompts = [text(21), text(22), text(23)]
    bad = step_fault + [7, 8, 9]
    *good, bad1, bad2 = concurrently(
        *[lambda m=m, p=p: completion(st.url, m, p) for m, p in zip(models, prompts)],
        lambda: completion(st.url, None, bad),
        lambda: completion(st.url, SERVED[0], bad, stream=True))
    assert_step_failed(bad1)
    assert_step_failed(bad2)
    ref = reference(srv, prompts, models, max_tokens=4)
    assert [token_ids(r) for r in good] == [o.token_ids for o in ref]
    assert_serves(st.url)


def test_unreadable_adapter_fails_its_requests_alone(env):
    """A registered adapter's file disappears while its rows are in neither the host cache nor the
    pool: its requests get a 500 naming it (and no server path), the others answer."""
    st, srv, allowed = env[:3]
    shutil.copytree(allowed / "good", allowed / "vanishing")
    r = post(st.url, "/v1/load_lora_adapter", {"lora_name": "vanishing", "lora_path": str(allowed / "vanishing")})
    assert r.status_code == 200, r.text
    store = srv.llm.store
    size, nbytes = store.host_cache_size, store.host_cache_bytes
    srv.engine.call_sync(lambda: store.resize_host_cache(0))  # every page-in reads the disk
    try:
        (allowed / "vanishing" / "adapter_model.safetensors").unlink()
        models = [None, SERVED[0], SERVED[1]]
        prompts = [text(31), text(32), text(33)]
        *good, gone1, gone2 = concurrently(
            *[lambda m=m, p=p: completion(st.url, m, p) for m, p in zip(models, prompts)],
            lambda: completion(st.url, "vanishing", text(34)),
            lambda: completion(st.url, "vanishing", text(35), stream=True))
        ref = reference(srv, prompts, models, max_tokens=4)
    finally:
        srv.engine.call_sync(lambda: store.resize_host_cache(size, nbytes))
    for g in (gone1, gone2):
        err = assert_error(g, 500, "adapter 'vanishing' could not be read", None)
        assert err["code"] == "adapter_unavailable"
        assert str(allowed) not in g.text and str(Path.home()) not in g.text, g.text
    assert [token_ids(r) for r in good] == [o.token_ids for o in ref]
    assert post(st.url, "/v1/unload_lora_adapter", {"lora_name": "vanishing"}).status_code == 200
    shutil.rmtree(allowed / "vanishing")
    assert_serves(st.url)
