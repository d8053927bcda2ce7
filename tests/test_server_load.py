"""A bounded load test on loopback: 200 concurrent streaming completions over 56 adapters (and the
base model) against a live uvicorn server on the tiny model, from one asyncio client (httpx, up to
300 open connections). It must end with zero errors, every stream complete, the greedy tokens of one
wave equal to LLM.generate's, and no KV page leaked. It prints requests/s and latency percentiles.

All 200 requests are sent while the engine is paused and it resumes once every one of them is
queued, so that they run as 25 full waves of max_num_seqs = 8 (the step shapes test_server.py
compiles; see its docstring): on a CPU a partial wave would cost a fresh XLA compile of several
seconds and the figures would measure the compiler. Latencies are therefore counted from the
moment the engine resumes, with all 200 requests in flight at once.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest
from test_server import ALL_LINEAR, aligned, demo_dir, reference, start_server, text, wait_idle

N_REQUESTS = 200
N_ADAPTERS = 56
MAX_TOKENS = 8
TIME_LIMIT_S = 180


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    model_dir, paths = demo_dir(tmp_path_factory)
    st, srv = start_server(model_dir, {n: paths[n] for n in ALL_LINEAR[:N_ADAPTERS]})
    yield st, srv
    st.stop()


def model_of(i: int) -> str:
    """Request i's model: round robin over the base model and the 56 adapters, so that every wave of
    8 consecutive requests has 7 or 8 distinct adapters."""
    k = i % (N_ADAPTERS + 1)
    return "tiny" if k == N_ADAPTERS else ALL_LINEAR[k]


async def one(client: httpx.AsyncClient, i: int, t_resume: list) -> dict:
    body = {"model": model_of(i), "prompt": text(1000 + i), "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    ids, finish, first = [], None, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"i": i, "error": f"{r.status_code} {await r.aread()!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return {"i": i, "error": chunk["error"]["message"]}
            c = chunk["choices"][0]
            if first is None and c["token_ids"]:
                first = time.perf_counter()
            ids += c["token_ids"]
            finish = c["finish_reason"] or finish
    return {"i": i, "ids": ids, "finish": finish, "ttft": first - t_resume[0], "done": time.perf_counter() - t_resume[0]}


def test_200_concurrent_streams_over_56_adapters(live):
    st, srv = live
    wave = [(text(1000 + i), model_of(i)) for i in range(8)]
    want = reference(srv, [p for p, _ in wave], [None if m == "tiny" else m for _, m in wave], max_tokens=MAX_TOKENS)
    base = httpx.get(st.url + "/stats").json()
    t_resume = [0.0]

    async def run(gate: aligned):
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with httpx.AsyncClient(base_url=st.url, limits=limits, timeout=TIME_LIMIT_S) as client:
            t_send = time.perf_counter()
            tasks = [asyncio.ensure_future(one(client, i, t_resume)) for i in range(N_REQUESTS)]
            await asyncio.get_running_loop().run_in_executor(None, gate.wait)  # all 200 queued: resume
            t_resume[0] = time.perf_counter()
            results = await asyncio.wait_for(asyncio.gather(*tasks), TIME_LIMIT_S)
            return results, t_resume[0] - t_send

    with aligned(st.url, srv, N_REQUESTS) as gate:
        results, t_queue = asyncio.run(run(gate))

    errors = [r for r in results if "error" in r]
    assert not errors, errors[:5]
    assert all(r["finish"] == "length" and len(r["ids"]) == MAX_TOKENS for r in results)
    assert [r["ids"] for r in results[:8]] == [o.token_ids for o in want]
    assert len({model_of(i) for i in range(N_REQUESTS)} - {"tiny"}) >= 50

    done = np.array([r["done"] for r in results])
    ttft = np.array([r["ttft"] for r in results])
    wall = done.max()
    s = wait_idle(st.url)
    assert s["kv_pages"] == 0 and s["running"] == 0 and s["waiting"] == 0 and s["requests_in_flight"] == 0
    assert s["free_pages"] + s["adapter_pages"] + s["prefix_cache"]["cached_pages"] == s["total_pages"]
    print(f"\n[load] {N_REQUESTS} concurrent streaming requests over {N_ADAPTERS} adapters + base, "
          f"{MAX_TOKENS} tokens each: {N_REQUESTS / wall:.1f} requests/s, {N_REQUESTS * MAX_TOKENS / wall:.0f} "
          f"tokens/s over {wall:.2f} s; latency p50 {np.percentile(done, 50):.2f} s, p99 "
          f"{np.percentile(done, 99):.2f} s; TTFT p50 {np.percentile(ttft, 50):.2f} s, p99 "
          f"{np.percentile(ttft, 99):.2f} s; 0 errors; {s['steps'] - base['steps']} engine steps, "
          f"{s['evictions'] - base['evictions']} adapter evictions; queued all 200 in {t_queue:.2f} s")
