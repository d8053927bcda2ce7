"""Fuzzing the live server with schemathesis over its own OpenAPI schema (/openapi.json).

schemathesis generates requests for every route from the schema's request bodies (schema.py):
bodies that fit the schema (positive) and bodies that break it (negative), a bounded number of each.
Every answer must be below 500, every error OpenAI-shaped, every stream valid JSON events ending
in [DONE]; afterwards the engine is idle with no KV page held. A second test runs random sequences
of adapter loads, unloads and requests against a model of what should be registered.

Completions are capped at two tokens, so the run is about the API, not decoding, and stays within
a few minutes on two CPU cores.
"""

from __future__ import annotations

import collections
import json
import shutil

import httpx
import pytest
from test_server import ALL_LINEAR, ADAPTERS, demo_dir, start_server, text, wait_idle

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

KEY = "sk-fuzz"
H = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = 100  # per generation mode
STEPS = 12      # operations per stateful sequence
SEQUENCES = 8
VOCAB = 512     # the tiny model's


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    model_dir, paths = demo_dir(tmp_path_factory)
    allowed = tmp_path_factory.mktemp("fuzz_allowed")
    for name in ALL_LINEAR[20:22]:
        shutil.copytree(paths[name], allowed / name)
    st_, srv = start_server(model_dir, {ADAPTERS[0]: paths[ADAPTERS[0]]}, api_key=KEY,
                            allowed_adapter_dirs=[str(allowed)], request_timeout=10.0)
    yield st_, srv, allowed
    st_.stop()


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def tame(body):
    """At most two new tokens a request, since the fuzzing is about the API, not decoding time;
    token ids folded into the model's vocabulary, which the static schema cannot state."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        if is_int(body.get(key)) and body[key] > 2:
            body[key] = 2
    p = body.get("prompt")
    if isinstance(p, list) and p and all(is_int(t) for t in p):
        body["prompt"] = [t % VOCAB if t >= 0 else t for t in p]
    elif isinstance(p, list):
        body["prompt"] = [[t % VOCAB if is_int(t) and t >= 0 else t for t in x] if isinstance(x, list) else x
                          for x in p]


def strict_json(raw: bytes):
    """Parses JSON, refusing NaN and Infinity, which are not JSON (a string that spells them is fine)."""
    def refuse(name):
        raise AssertionError(f"non-JSON constant {name} in {raw[:300]!r}")
    return json.loads(raw, parse_constant=refuse)


def check_answer(status: int, content_type: str, raw: bytes, what: str, slo: bool = False) -> None:
    """No server error; an OpenAI-shaped error; a stream of JSON events ending in [DONE]. With
    `slo` (the request set ttft_slo) a 503 whose code is "aborted" is the answer the API promises."""
    if slo and status == 503:
        assert strict_json(raw)["error"]["code"] == "aborted", (what, raw[:500])
    else:
        assert status < 500, (what, status, raw[:500])
    if status >= 400:
        err = strict_json(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"}, (what, err)
        assert isinstance(err["message"], str) and err["message"], (what, err)
    elif content_type.startswith("text/event-stream"):
        events = [ln[len(b"data: "):] for ln in raw.split(b"\n") if ln.startswith(b"data: ")]
        assert events and events[-1] == b"[DONE]", (what, raw[-300:])
        for e in events[:-1]:
            code = (strict_json(e).get("error") or {}).get("code")
            assert code != "internal_error", (what, e[:500])  # a server error inside a stream
    elif content_type.startswith("application/json"):
        strict_json(raw)


def test_schemathesis_no_server_errors(env):
    st_, srv = env[:2]
    spec = httpx.get(st_.url + "/openapi.json", headers=H).json()
    assert "requestBody" in spec["paths"]["/v1/completions"]["post"]
    schema = schemathesis.openapi.from_dict(spec)
    if hasattr(schema.config, "max_stream_events"):
        schema.config.max_stream_events = 100_000  # read each stream to its end (the default keeps 20 events)
    seen = collections.Counter()
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=schema.as_strategy(mode))
        def fuzz(case):
            tame(case.body)
            r = case.call(base_url=st_.url, headers=H, timeout=120)
            seen[(mode.value, case.path, r.status_code)] += 1
            assert not getattr(r, "stream_cut_short", False), f"schemathesis kept only part of {case.path}'s stream"
            ctype = r.headers.get("content-type") or [""]  # schemathesis: a list per header
            slo = isinstance(case.body, dict) and case.body.get("ttft_slo") is not None
            check_answer(r.status_code, ctype[0], r.content, f"{case.method} {case.path} {case.body!r:.300}", slo)

        fuzz()
    total = sum(seen.values())
    slo_aborts = sum(n for (_, _, status), n in seen.items() if status == 503)
    print(f"\nschemathesis: {total} requests, no server error ({slo_aborts} early aborts: 503 for a ttft_slo "
          f"the request set); by (mode, route, status): {dict(seen)}")
    assert total >= EXAMPLES
    assert any(status == 200 and path == "/v1/completions" for _, path, status in seen)
    s = wait_idle(st_.url, headers=H)
    assert s["running"] == 0 and s["waiting"] == 0 and s["kv_pages"] == 0 and srv.engine.in_flight == 0


OPERATIONS = st.lists(st.tuples(st.sampled_from(["load", "load_inplace", "unload", "complete"]),
                                st.sampled_from(ALL_LINEAR[20:22] + ["missing"])), min_size=1, max_size=STEPS)


def test_adapter_load_unload_sequences(env):
    """Random sequences of loads, replaces, unloads and requests: each answer is the one a model of
    the registry predicts, and the served set always equals the model's."""
    st_, srv, allowed = env

    def served():
        return {m["id"] for m in httpx.get(st_.url + "/v1/models", headers=H).json()["data"]} - {"tiny", ADAPTERS[0]}

    @settings(max_examples=SEQUENCES, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(ops=OPERATIONS)
    def run(ops):
        registered = served()
        for op, name in ops:
            path = str(allowed / name)
            if op in ("load", "load_inplace"):
                r = httpx.post(st_.url + "/v1/load_lora_adapter", headers=H, timeout=120,
                               json={"lora_name": name, "lora_path": path, "load_inplace": op == "load_inplace"})
                if name == "missing":
                    expect = 400
                else:
                    expect = 400 if (name in registered and op == "load") else 200
                    registered.add(name)
            elif op == "unload":
                r = httpx.post(st_.url + "/v1/unload_lora_adapter", headers=H, json={"lora_name": name}, timeout=120)
                expect = 200 if name in registered else 404
                registered.discard(name)
            else:
                r = httpx.post(st_.url + "/v1/completions", headers=H, timeout=120,
                               json={"model": name, "prompt": text(7), "max_tokens": 2, "temperature": 0})
                expect = 200 if name in registered else 404
            check_answer(r.status_code, r.headers.get("content-type", ""), r.content, f"{op} {name}")
            assert r.status_code == expect, (op, name, r.status_code, r.text[:300])
            assert served() == registered
        for name in list(registered):
            assert httpx.post(st_.url + "/v1/unload_lora_adapter", headers=H, json={"lora_name": name},
                              timeout=120).status_code == 200

    run()
    s = wait_idle(st_.url, headers=H)
    assert s["kv_pages"] == 0 and srv.engine.in_flight == 0
