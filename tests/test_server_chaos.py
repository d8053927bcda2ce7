"""The chaos run: for CHAOS_SECONDS, four clients at once send good requests beside hostile bodies,
requests whose steps fail, requests for a vanished adapter and for an overflowing one, streams
dropped after their first chunk, and adapter loads and unloads, to one live server (the fault
tests' server, test_server_faults.env). The good answers equal LLM.generate's, every bad one fails
alone with its own code, and the engine ends idle with no KV page held."""

from __future__ import annotations

import collections
import json
import shutil
import threading
import time

import httpx
from test_server import text, wait_idle
import test_server_faults as faults
from test_server_faults import H, SERVED, post

from slora_jax import SamplingParams

env, step_fault = faults.env, faults.step_fault  # the fault tests' fixtures: their server, their seam


CHAOS_SECONDS = 60  # as long as the fault-isolation goal asks for
HOSTILE = [  # raw bodies that must each get a 4xx and harm no one else
    json.dumps({"prompt": "x", "top_k": 2**31}).encode(),
    json.dumps({"prompt": "x", "seed": 2**70, "max_tokens": 2}).encode(),
    b'{"prompt": "a\\ud800", "max_tokens": 2}',
    b'{"model": "\\udfff", "prompt": "x"}',
    b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"prompt": "x", "temperature": NaN}',
    b'{"prompt": "x", "temperature": 1e999}',
    b"{not json",
    json.dumps({"model": "nope", "prompt": "x"}).encode(),
    json.dumps({"prompt": [1, 10**6]}).encode(),
]


def test_chaos_good_outputs_unchanged(env, step_fault):
    """For CHAOS_SECONDS, four clients at once: good greedy requests (streamed or not, base model and
    adapters), hostile bodies, requests whose steps fail, requests for an adapter whose file is gone
    and for one whose output overflows, streams dropped after their first chunk, and loads and
    unloads of a spare adapter. Every good answer equals LLM.generate's, every hostile one is a 4xx,
    every failing one a 500 (or an error event) with its own code, and the engine ends idle with no
    KV page held."""
    import random
    st, srv, allowed = env[:3]
    shutil.copytree(allowed / "good", allowed / "gone")
    for name in ("gone", "huge"):
        r = post(st.url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(allowed / name)})
        assert r.status_code == 200, r.text
    (allowed / "gone" / "adapter_model.safetensors").unlink()
    store = srv.llm.store
    size, nbytes = store.host_cache_size, store.host_cache_bytes
    srv.engine.call_sync(lambda: store.resize_host_cache(0))  # "gone" can never come from memory
    good, errors, failed = [], [], collections.Counter()
    stop_at = time.monotonic() + CHAOS_SECONDS

    def expect_failure(r, code):
        raw = r.read()
        if r.status_code == 500:
            err = json.loads(raw)["error"]
        else:  # a stream that had sent tokens: an error event, then [DONE]
            assert r.status_code == 200, raw[:300]
            events = [ln[len(b"data: "):] for ln in raw.split(b"\n") if ln.startswith(b"data: ")]
            assert events[-1] == b"[DONE]", events[-3:]
            err = json.loads(events[-2])["error"]
        assert err["code"] == code and "/" not in err["message"], err
        failed[code] += 1

    def client(seed: int):
        rng = random.Random(seed)
        with httpx.Client(base_url=st.url, headers=H, timeout=120) as c:
            i = 0
            while time.monotonic() < stop_at:
                i += 1
                kind = rng.choice(["good", "good", "good", "hostile", "drop", "adapter", "fault", "gone", "nan"])
                try:
                    if kind == "good":
                        model, n = rng.choice([None, *SERVED]), seed * 1000 + i
                        body = {"prompt": text(n), "max_tokens": 6, "temperature": 0, "return_token_ids": True,
                                **({"model": model} if model else {})}
                        if rng.random() < 0.5:
                            r = c.post("/v1/completions", json=body)
                            assert r.status_code == 200, r.text
                            ids = r.json()["choices"][0]["token_ids"]
                        else:
                            ids = []
                            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                                assert r.status_code == 200
                                for ln in r.iter_lines():
                                    if ln.startswith("data: {"):
                                        ids += json.loads(ln[6:])["choices"][0]["token_ids"]
                        good.append((model, text(n), ids))
                    elif kind == "hostile":
                        r = c.post("/v1/completions", content=rng.choice(HOSTILE),
                                   headers={"Content-Type": "application/json"})
                        assert 400 <= r.status_code < 500 and "error" in r.json(), r.text[:300]
                    elif kind == "drop":
                        with c.stream("POST", "/v1/completions", json={"prompt": text(i), "max_tokens": 6,
                                                                        "stream": True, "model": SERVED[1]}) as r:
                            next(r.iter_lines())
                    elif kind in ("fault", "gone", "nan"):
                        prompt = step_fault + [i % 50 + 3] if kind == "fault" else text(i)
                        model = {"fault": rng.choice([None, *SERVED]), "gone": "gone", "nan": "huge"}[kind]
                        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": rng.random() < 0.5,
                                **({"model": model} if model else {})}
                        with c.stream("POST", "/v1/completions", json=body) as r:
                            expect_failure(r, {"fault": "step_failed", "gone": "adapter_unavailable",
                                               "nan": "non_finite_output"}[kind])
                    else:
                        r = c.post("/v1/load_lora_adapter", json={"lora_name": "spare", "lora_path":
                                                                  str(allowed / "good"), "load_inplace": True})
                        assert r.status_code == 200, r.text
                        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "spare"})
                        assert r.status_code in (200, 400, 404), r.text
                except Exception as e:  # noqa: BLE001 - collected and reported below
                    errors.append(f"{kind}: {e!r}")

    try:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(CHAOS_SECONDS + 300)
    finally:
        srv.engine.call_sync(lambda: store.resize_host_cache(size, nbytes))
    assert not errors, errors[:5]
    assert len(good) >= 8 and all(failed[k] >= 1 for k in ("step_failed", "adapter_unavailable",
                                                             "non_finite_output")), (len(good), failed)
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    ref = srv.engine.call_sync(lambda: srv.llm.generate([p for _, p, _ in good], sp,
                                                        adapter=[m for m, _, _ in good]))
    assert [ids for _, _, ids in good] == [o.token_ids for o in ref]
    s = wait_idle(st.url, headers=H)
    assert s["kv_pages"] == 0 and srv.engine.in_flight == 0
    for name in ("spare", "gone", "huge"):
        httpx.post(st.url + "/v1/unload_lora_adapter", headers=H, json={"lora_name": name})
    shutil.rmtree(allowed / "gone")
