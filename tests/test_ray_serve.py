"""Replicas on Ray Serve (slora_jax/serve/replicas.py): a local Ray instance, 2 replicas of the tiny
demo model behind the ingress, driven through the official `openai` client.

- 200 requests over 20 adapters and the base model (a fifth of them streamed) end with 0 errors,
  and every greedy completion equals `LLM.generate` on one LLM of the same model and adapters.
- Affinity, from the replicas' own counters (Engine.stats()['adapter_loads']): after a warm-up
  round, at least 90% of the adapter requests run on a replica that already holds their adapter,
  and no adapter is written into both replicas' pools.
- An adapter loaded at run time, replaced (never served stale), and unloaded through the ingress
  (then gone from every replica).
- Each replica's engine gauges in Ray's metrics export, tagged by replica.
- A replica killed mid-run: every request completes or gets a 503, and Serve brings the
  application back to 2 healthy replicas.

One Ray instance serves the whole module (starting Ray and two replicas costs most of its time).
Prompts are 6 tokens with BOS and completions 6 tokens, with max_num_seqs = 4 and a 32-token
prefill budget, so each replica warms up a few step shapes only.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from ray import serve  # noqa: E402
from test_server import ALL_LINEAR, demo_dir  # noqa: E402

from slora_jax import LLM, SamplingParams  # noqa: E402
from slora_jax.serve.replicas import build  # noqa: E402

ENGINE = dict(page_size=64, pool_pages=256, max_num_seqs=4, max_lora_rank=32, max_num_batched_tokens=32)
ADAPTERS = ALL_LINEAR[:20]
MODELS = [*ADAPTERS, "tiny"]
MT = 6
APP = "slora-jax"


def prompt(i: int) -> str:
    return f"q{i:04d}"  # 5 bytes: 6 tokens with BOS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model_dir, paths = demo_dir(tmp_path_factory)
    adapters = {n: paths[n] for n in ADAPTERS}
    port = free_port()
    t0 = time.monotonic()
    metrics_port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _metrics_export_port=metrics_port)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        application = build(str(model_dir), replicas=2, adapters=adapters, served_model_name="tiny",
                            dtype="float32", engine=ENGINE, warmup={"max_context": 16},
                            allowed_adapter_dirs=[str(model_dir.parent)], num_cpus=1, num_gpus=0,
                            max_ongoing_requests=32, health_check_period_s=1.0, health_check_timeout_s=60.0)
        serve.run(application, name=APP, route_prefix="/")
        print(f"Ray + 2 replicas up in {time.monotonic() - t0:.1f} s")
        yield f"http://127.0.0.1:{port}", model_dir, paths, metrics_port
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def single(cluster):
    """One LLM of the same model and adapters in this process: the reference."""
    _, model_dir, paths, _ = cluster
    return LLM(model_dir, adapters={n: paths[n] for n in ADAPTERS}, dtype="float32", **ENGINE)


def expected(llm, prompts, models):
    outs = llm.generate(prompts, SamplingParams(max_tokens=MT, temperature=0.0),
                        adapter=[None if m == "tiny" else m for m in models])
    return [list(o.token_ids) for o in outs]


async def complete(client, model: str, text: str, stream: bool) -> list[int]:
    """The generated token ids of one greedy completion (raises openai's errors)."""
    kw = dict(model=model, prompt=text, max_tokens=MT, temperature=0, extra_body={"return_token_ids": True,
                                                                                  "ignore_eos": True})
    if not stream:
        r = await client.completions.create(**kw)
        return list(r.choices[0].model_extra["token_ids"])
    ids = []
    async for chunk in await client.completions.create(stream=True, **kw):
        if chunk.choices:
            ids += chunk.choices[0].model_extra.get("token_ids") or []
    return ids


async def run_all(url: str, jobs: list[tuple[str, str, bool]], concurrency: int = 16, done: list | None = None) -> list:
    """Each (model, prompt, stream) through AsyncOpenAI; a result is token ids or the exception.
    `done`, if given, gets one item per finished request as it finishes."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    gate = asyncio.Semaphore(concurrency)

    async def one(job):
        async with gate:
            try:
                return await complete(client, *job)
            except Exception as e:  # noqa: BLE001 - the test inspects it
                return e
            finally:
                if done is not None:
                    done.append(job)

    try:
        return await asyncio.gather(*(one(j) for j in jobs))
    finally:
        await client.close()


def llm_replicas() -> list[str]:
    """The actor names of the LLMServer replicas."""
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if "LLMServer" in a["name"] and a["namespace"] == "serve")


def replica_stats(timeout: float = 60.0) -> dict[str, dict]:
    """Engine.stats() of every running LLMServer replica, by replica id (asked through the
    deployment handle until each replica has answered)."""
    handle = serve.get_deployment_handle("LLMServer", APP)
    want = serve.status().applications[APP].deployments["LLMServer"].replica_states.get("RUNNING", 0)
    seen: dict[str, dict] = {}
    t0 = time.monotonic()
    while len(seen) < want:
        assert time.monotonic() - t0 < timeout, f"only {len(seen)} of {want} replicas answered"
        for r in [handle.stats.remote() for _ in range(8)]:
            s = r.result(timeout_s=timeout)
            seen[s["replica"]] = s
    return seen


def test_serve_config_builds_the_application():
    """configs/serve/llama-7b.yaml is a valid Serve config whose args build the application (no
    Ray needed); bad args are clear errors."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from slora_jax.serve.replicas import app
    config = yaml.safe_load((Path(__file__).resolve().parent.parent / "configs/serve/llama-7b.yaml").read_text())
    args = ServeDeploySchema.model_validate(config).applications[0].args
    assert isinstance(app(args), serve.Application)
    assert isinstance(app({**args, "async_scheduling": "false", "warmup": "off"}), serve.Application)
    assert isinstance(app({**args, "warmup": "before-serving"}), serve.Application)
    for bad_args, message in [({**args, "replicas": 0}, "--replicas"), ({**args, "max_num_seqs": "many"}, "many"),
                              ({**args, "color": "red"}, "unknown arguments"), ({"replicas": 2}, "needs model")]:
        with pytest.raises(ValueError, match=message):
            app(bad_args)


def test_200_requests_match_one_llm_with_affinity(cluster, single):
    url = cluster[0]
    warm = [(m, prompt(9000 + k), False) for k, m in enumerate(MODELS)]
    assert all(isinstance(r, list) for r in asyncio.run(run_all(url, warm))), "warm-up failed"
    time.sleep(2.0)  # replicas report their multiplexed ids to the routers
    before = replica_stats()

    jobs = [(MODELS[i % len(MODELS)], prompt(i), i % 5 == 0) for i in range(200)]
    t0 = time.monotonic()
    results = asyncio.run(run_all(url, jobs))
    took = time.monotonic() - t0
    errors = [(j, r) for j, r in zip(jobs, results) if not isinstance(r, list)]
    assert not errors, errors[:3]
    ref = expected(single, [p for _, p, _ in jobs], [m for m, _, _ in jobs])
    assert results == ref

    after = replica_stats()
    assert set(after) == set(before)
    loads = sum(after[r]["adapter_loads"] - before[r]["adapter_loads"] for r in after)
    lora_requests = sum(m != "tiny" for m, _, _ in jobs)
    affinity = 1 - loads / lora_requests
    print(f"200 requests in {took:.1f} s; adapter loads after warm-up {loads}; affinity {affinity:.3f}")
    assert affinity >= 0.9
    # Each adapter went into one replica's pool: round robin would write every adapter into both.
    evictions = sum(s["evictions"] for s in after.values())
    assert sum(s["adapter_loads"] for s in after.values()) <= len(ADAPTERS) + evictions + 2


def test_engine_metrics_reach_ray_export_by_replica(cluster):
    """Each replica's Engine.stats() gauges, in Ray's Prometheus export, tagged by replica."""
    import httpx
    url = f"http://127.0.0.1:{cluster[3]}/metrics"
    t0, replicas = time.monotonic(), set()
    while len(replicas) < 2:
        assert time.monotonic() - t0 < 60, f"replicas seen in Ray's metrics: {replicas}"
        time.sleep(2.0)
        try:
            text = httpx.get(url, timeout=10).text
        except httpx.HTTPError:
            continue
        replicas = set(re.findall(r'^ray_slora_engine_requests_finished\{[^}]*replica="([^"]+)"', text, re.M))


def test_load_replace_unload_through_ingress(cluster, single):
    import httpx
    url, model_dir, paths, _ = cluster
    first, second = ALL_LINEAR[30], ALL_LINEAR[31]
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": paths[first]}, timeout=120)
    assert r.status_code == 200, r.text
    got = asyncio.run(run_all(url, [("late", prompt(1), False)]))[0]
    single.load_adapter("late", paths[first])
    assert got == expected(single, [prompt(1)], ["late"])[0]

    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": paths[second]}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "adapter_exists"
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": paths[second],
                                                        "load_inplace": True}, timeout=120)
    assert r.status_code == 200, r.text
    single.load_adapter("late", paths[second])
    want = expected(single, [prompt(2)], ["late"])[0]
    got = asyncio.run(run_all(url, [("late", prompt(2), k % 2 == 0) for k in range(4)]))
    assert got == [want] * 4  # the replaced weights on whichever replica serves it

    ids = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    assert ids[0] == "tiny" and "late" in ids and set(ADAPTERS) <= set(ids)
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 200, r.text
    err = asyncio.run(run_all(url, [("late", prompt(3), False)]))[0]
    assert isinstance(err, openai.NotFoundError)
    # Every replica unregisters it at its next request.
    t0 = time.monotonic()
    while any("late" in s["registered"] for s in replica_stats().values()):
        assert time.monotonic() - t0 < 60, {r: "late" in s["registered"] for r, s in replica_stats().items()}
        asyncio.run(run_all(url, [("tiny", prompt(4), False)] * 4))


def test_replica_killed_mid_run(cluster, single):
    url = cluster[0]
    jobs = [(MODELS[i % len(MODELS)], prompt(500 + i), i % 3 == 0) for i in range(120)]
    ref = expected(single, [p for _, p, _ in jobs], [m for m, _, _ in jobs])
    names = llm_replicas()
    assert len(names) == 2, names

    async def run_and_kill():
        done: list = []
        task = asyncio.ensure_future(run_all(url, jobs, concurrency=8, done=done))
        while len(done) < 10:
            await asyncio.sleep(0.01)
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        killed_at = len(done)
        return await asyncio.wait_for(task, timeout=300), killed_at

    (results, killed_at) = asyncio.run(run_and_kill())
    assert killed_at < len(jobs) - 8, "the run ended before the kill"
    unavailable = 0
    for r, want in zip(results, ref):
        if isinstance(r, list):
            assert r == want
        else:
            assert isinstance(r, openai.APIError), repr(r)
            # a 503 before the answer started; a stream already under way ends with an error
            # event of the same code instead (its status line was sent)
            assert getattr(r, "status_code", None) == 503 or getattr(r, "code", None) == "replica_unavailable" \
                or "replica_unavailable" in str(r), (repr(r), getattr(r, "body", None))
            unavailable += 1
    print(f"killed a replica after {killed_at} of {len(jobs)} requests: {len(jobs) - unavailable} completed, "
          f"{unavailable} got 503")

    t0 = time.monotonic()
    while True:
        now = llm_replicas()
        states = serve.status().applications[APP].deployments["LLMServer"].replica_states
        if names[0] not in now and len(now) == 2 and states.get("RUNNING", 0) == 2 and len(states) == 1:
            break
        assert time.monotonic() - t0 < 240, (now, states)
        time.sleep(1.0)
    print(f"2 healthy replicas again {time.monotonic() - t0:.1f} s after the run")
    again = asyncio.run(run_all(url, jobs[:8]))
    assert again == ref[:8]
