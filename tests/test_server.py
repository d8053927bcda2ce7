"""The OpenAI-compatible server against a live uvicorn on 127.0.0.1, through the official `openai`
client: completions and chat, streamed and not, several adapters and the base model at once, runtime
adapter loading, client disconnects, /metrics, and the `serve` command line.

Every generated token is checked against `LLM.generate` on the server's own LLM (run on the engine
thread through `AsyncEngine.call_sync`, between steps), for the same greedy request.

The model is the tiny demo model (`slora_jax.demo.prepare`: byte-level tokenizer, generated PEFT
adapters). On a CPU, XLA compiles dominate the run time (seconds per step shape), so the three server
test modules keep to a few step shapes and share them (same engine options, one process):
- every prompt is 17..32 tokens (one prefill bucket) and fits one 64-token page with its completion;
  the adapters all target every linear layer (one LoRA module set);
- requests run either one at a time (batch 1) or in "waves" of exactly max_num_seqs = 8 requests over
  6-8 distinct adapters, lined up by pausing the engine until all of them are queued (one prefill and
  one decode shape). The load test's 200 requests are 25 such waves.
The helpers below are imported by test_server_bad_input.py and test_server_load.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

# The server's dependencies (and the OpenAI client the tests talk through) are CPU-side; an image
# without them (the GPU machine's) skips the server tests instead of failing to collect them.
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

import slora_jax  # noqa: E402
from slora_jax import LLM, SamplingParams  # noqa: E402
from slora_jax.demo import prepare  # noqa: E402
from slora_jax.serve.app import build_app  # noqa: E402
from slora_jax.serve.chat import ChatFormatter  # noqa: E402
from slora_jax.serve.cli import ServerThread  # noqa: E402

OPTS = dict(dtype="float32", page_size=64, pool_pages=256, max_num_seqs=8, max_lora_rank=32)
ALL_LINEAR = [f"customer-{i:03d}" for i in range(2, 200, 3)]  # demo.prepare: every third is all-linear
N_DEMO_ADAPTERS = 170                                          # 56 of them all-linear
ADAPTERS = ALL_LINEAR[:7]
MT = 6


def demo_dir(tmp_path_factory):
    """The demo model and adapters, written once per pytest session (shared by the server modules)."""
    return prepare(tmp_path_factory.getbasetemp() / "server_demo", N_DEMO_ADAPTERS, 0)


def text(i: int) -> str:
    """A completion prompt of 21 bytes (22 tokens with BOS)."""
    return f"prompt {i:05d} for lora"


def chat_text(i: int) -> str:
    """A chat message whose fallback-template prompt is 24 tokens."""
    return f"hi there {i:03d}"


class aligned:
    """Pause the engine; `wait()` waits until `n` requests are queued in it, then resumes it, so that
    they run as one wave (the same batch shapes every time)."""

    def __init__(self, url, srv, n, headers=None):
        self.url, self.srv, self.n, self.headers = url, srv, n, headers

    def __enter__(self):
        self.srv.engine.pause()
        return self

    def wait(self, timeout=120.0):
        t0 = time.monotonic()
        try:
            while httpx.get(self.url + "/stats").json()["waiting"] < self.n:
                assert time.monotonic() - t0 < timeout, "the requests did not arrive"
                time.sleep(0.02)
        finally:
            self.srv.engine.resume()

    def __exit__(self, *exc):
        self.srv.engine.resume()



def start_cli_server(model_dir, extra: list[str], stderr=subprocess.DEVNULL) -> tuple[subprocess.Popen, str]:
    """`slora-jax serve` on the tiny demo model in a subprocess on a free port: (process, its URL)."""
    cmd = [sys.executable, "-m", "slora_jax", "serve", "--model", str(model_dir), "--served-model-name", "base",
           "--dtype", "float32", "--pool-pages", "64", "--max-lora-rank", "32", "--port", "0", "--warmup", "off", *extra]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    line = p.stdout.readline()
    m = re.search(r" on (http://127\.0\.0\.1:\d+) ", line)
    assert m, (line, p.poll())
    return p, m.group(1)

def wait_idle(url, timeout=30.0, headers=None) -> dict:
    """/stats once nothing runs, waits or holds KV pages (fails after `timeout`)."""
    t0 = time.monotonic()
    while True:
        s = httpx.get(url + "/stats", headers=headers).json()
        if s["running"] == 0 and s["waiting"] == 0 and s["kv_pages"] == 0 and s["requests_in_flight"] == 0:
            return s
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"the server did not go idle: {s}")
        time.sleep(0.05)


def reference(srv, prompts, adapters, max_tokens=MT):
    """LLM.generate on the server's LLM, run on its engine thread (between steps)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=True)
    return srv.engine.call_sync(lambda: srv.llm.generate(prompts, sp, adapter=adapters))


def start_server(model_dir, adapters: dict, **app_options):
    """An LLM with OPTS over `adapters` behind a live server on a free port: (ServerThread, Server).

    One adapter request runs first: the engine's pool arrays start uncommitted and become committed
    at the first adapter load, and jit compiles each step shape once per state, so starting with an
    adapter keeps it to one compile per shape."""
    llm = LLM(model_dir, adapters=adapters, **OPTS)
    llm.generate([text(0)], SamplingParams(max_tokens=2, temperature=0.0), adapter=next(iter(adapters)))
    app = build_app(llm, "tiny", **app_options)
    return ServerThread(app).start(), app.state.server


def extra(obj, name):
    return (obj.model_extra or {}).get(name)


# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return demo_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def live(demo):
    model_dir, paths = demo
    st, srv = start_server(model_dir, {n: paths[n] for n in ADAPTERS},
                           allowed_adapter_dirs=[str(Path(paths[ADAPTERS[0]]).parent)])
    yield st, srv
    st.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live[0].url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_and_health(live, client):
    st, srv = live
    assert [m.id for m in client.models.list().data] == ["tiny", *ADAPTERS]
    assert httpx.get(st.url + "/health").status_code == 200


def test_adapter_status_endpoint(live, client):
    """GET /v1/adapters lists every adapter with where its weights are and its requests; an adapter
    that just served a request is resident in the device pool."""
    st, srv = live
    client.completions.create(model=ADAPTERS[1], prompt=text(0), max_tokens=2, temperature=0)
    r = httpx.get(st.url + "/v1/adapters")
    assert r.status_code == 200
    data = {a["name"]: a for a in r.json()["data"]}
    assert list(data) == sorted(ADAPTERS)
    for name, a in data.items():
        assert a["object"] == "lora_adapter" and a["pages"] > 0 and a["ranks"], a
        assert a["running"] == a["waiting"] == 0, a  # nothing in flight between requests
    assert data[ADAPTERS[1]]["resident"], data[ADAPTERS[1]]
    # The path is shown relative to its --allowed-adapter-dirs entry, never as a server path.
    expect = {a["name"]: {"object": "lora_adapter", **a, "path": a["name"]} for a in srv.llm.adapter_status()}
    assert data == expect


def test_completions_match_generate(live, client):
    st, srv = live
    for i, m in enumerate([None, ADAPTERS[0], ADAPTERS[3]]):
        p = text(i)
        r = reference(srv, [p], [m])[0]
        kw = dict(model=m or "tiny", prompt=p, max_tokens=MT, temperature=0, logprobs=0,
                  extra_body={"return_token_ids": True})
        out = client.completions.create(**kw)
        ch = out.choices[0]
        assert extra(ch, "token_ids") == r.token_ids
        assert extra(ch, "prompt_token_ids") == srv.llm.tokenizer.encode(p)
        assert ch.text == r.text and ch.finish_reason == r.finish_reason
        assert ch.logprobs.token_logprobs == pytest.approx(r.logprobs, abs=1e-5)
        assert out.usage.completion_tokens == len(r.token_ids)
        assert out.model == (m or "tiny")

        ids, got, lps, finish = [], "", [], None
        for chunk in client.completions.create(stream=True, **kw):
            c = chunk.choices[0]
            ids += extra(c, "token_ids")
            got += c.text
            lps += c.logprobs.token_logprobs
            finish = c.finish_reason or finish
        assert ids == r.token_ids and got == r.text and finish == r.finish_reason
        assert lps == pytest.approx(r.logprobs, abs=1e-5)
    # A token-id prompt is taken as is.
    ids = [1] + [40 + k for k in range(20)]
    r = reference(srv, [ids], [ADAPTERS[1]])[0]
    out = client.completions.create(model=ADAPTERS[1], prompt=ids, max_tokens=MT, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert extra(out.choices[0], "prompt_token_ids") == ids
    assert extra(out.choices[0], "token_ids") == r.token_ids


def test_chat_fallback_template(live, client):
    """The demo tokenizer has no chat template: 'role: content' lines, then 'assistant:'."""
    st, srv = live
    messages = [{"role": "user", "content": chat_text(0)}]
    prompt = f"user: {chat_text(0)}\nassistant:"
    r = reference(srv, [prompt], [ADAPTERS[2]])[0]
    kw = dict(model=ADAPTERS[2], messages=messages, max_tokens=MT, temperature=0, logprobs=True,
              extra_body={"return_token_ids": True})
    out = client.chat.completions.create(**kw)
    ch = out.choices[0]
    assert out.object == "chat.completion"
    assert extra(ch, "prompt_token_ids") == srv.llm.tokenizer.encode(prompt)
    assert extra(ch, "token_ids") == r.token_ids
    assert ch.message.role == "assistant" and ch.message.content == r.text
    assert [t.logprob for t in ch.logprobs.content] == pytest.approx(r.logprobs, abs=1e-5)

    ids, got, roles, finish, usage = [], "", [], None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            ids += extra(c, "token_ids") or []
            got += c.delta.content or ""
            roles += [c.delta.role] if c.delta.role else []
            finish = c.finish_reason or finish
    assert ids == r.token_ids and got == r.text and finish == r.finish_reason
    assert roles == ["assistant"]
    assert usage.completion_tokens == len(r.token_ids)
    assert usage.prompt_tokens == len(srv.llm.tokenizer.encode(prompt))


def test_chat_template_from_tokenizer_config(live, client, tmp_path):
    """A chat_template in tokenizer_config.json is rendered with jinja2 and tokenized without adding
    special tokens (the template writes its own BOS)."""
    st, srv = live
    shutil.copy(Path(srv.llm.model) / "tokenizer.json", tmp_path / "tokenizer.json")
    template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
                "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    fmt = ChatFormatter(str(tmp_path), srv.llm.tokenizer)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "more"}]
    assert fmt.render(messages) == "<s>[user] hi</s>[assistant] yo</s>[user] more</s>[assistant] "
    ids = fmt.encode(messages)
    assert ids.count(1) == 1 and ids[0] == 1 and ids.count(2) == 3  # one BOS, three EOS

    one = [{"role": "user", "content": "hi"}]
    ids = fmt.encode(one)
    assert 17 <= len(ids) <= 32 and ids[0] == 1 and ids.count(1) == 1
    # Newer checkpoints keep the template in chat_template.jinja, beside a tokenizer_config.json
    # without one: the same rendering.
    jinja_dir = tmp_path / "jinja"
    jinja_dir.mkdir()
    shutil.copy(tmp_path / "tokenizer.json", jinja_dir / "tokenizer.json")
    (jinja_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (jinja_dir / "chat_template.jinja").write_text(template)
    assert ChatFormatter(str(jinja_dir), srv.llm.tokenizer).encode(one) == ids
    saved, srv.chat = srv.chat, fmt
    try:
        r = reference(srv, [ids], [None])[0]
        out = client.chat.completions.create(model="tiny", messages=one, max_tokens=MT, temperature=0,
                                             extra_body={"return_token_ids": True})
        assert extra(out.choices[0], "prompt_token_ids") == ids
        assert extra(out.choices[0], "token_ids") == r.token_ids
        # A template that raises refuses the request with 400.
        srv.chat = ChatFormatter(str(tmp_path), srv.llm.tokenizer)
        srv.chat.template = ChatFormatter.compile_template("{{ raise_exception('roles must alternate') }}")
        with pytest.raises(openai.BadRequestError, match="roles must alternate"):
            client.chat.completions.create(model="tiny", messages=one, max_tokens=MT)
    finally:
        srv.chat = saved


def test_concurrent_adapters_and_base(live):
    """The base model and six adapters in one batch, chat and completions, streamed and not, and one
    request with two token-id prompts: each answer equals LLM.generate's for the same request."""
    st, srv = live
    ids_prompts = [[1] + [100 + k for k in range(18)], [1] + [200 + k % 7 for k in range(25)]]
    reqs = [  # (model, prompt, chat?, stream?)
        (ADAPTERS[0], ids_prompts, False, False),
        (None, text(10), False, True),
        (ADAPTERS[1], chat_text(11), True, True),
        (ADAPTERS[2], text(12), False, False),
        (ADAPTERS[3], chat_text(13), True, False),
        (ADAPTERS[4], text(14), False, True),
        (ADAPTERS[5], text(15), False, True),
    ]
    flat, flat_models, sizes = [], [], []
    for m, p, chat, _ in reqs:
        ps = p if isinstance(p[0], list) else [f"user: {p}\nassistant:" if chat else p]
        flat += ps
        flat_models += [m] * len(ps)
        sizes.append(len(ps))
    assert len(flat) == OPTS["max_num_seqs"]
    ref = iter(reference(srv, flat, flat_models))
    want = [[next(ref).token_ids for _ in range(n)] for n in sizes]

    async def one(aclient, model, prompt, chat, stream):
        kw = dict(model=model or "tiny", max_tokens=MT, temperature=0, extra_body={"return_token_ids": True})
        if chat:
            res = await aclient.chat.completions.create(messages=[{"role": "user", "content": prompt}],
                                                        stream=stream, **kw)
        else:
            res = await aclient.completions.create(prompt=prompt, stream=stream, **kw)
        if not stream:
            return [extra(c, "token_ids") for c in sorted(res.choices, key=lambda c: c.index)]
        ids = {}
        async for chunk in res:
            for c in chunk.choices:
                ids.setdefault(c.index, []).extend(extra(c, "token_ids") or [])
        return [ids[k] for k in sorted(ids)]

    async def main(wave):
        aclient = openai.AsyncOpenAI(base_url=st.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            tasks = [asyncio.ensure_future(one(aclient, *r)) for r in reqs]
            await asyncio.get_running_loop().run_in_executor(None, wave.wait)
            return await asyncio.gather(*tasks)
        finally:
            await aclient.close()

    with aligned(st.url, srv, len(flat)) as wave:
        got = asyncio.run(main(wave))
    assert got == want
    wait_idle(st.url)


def test_stop_strings(live, client):
    st, srv = live
    for i in range(20, 40):
        prompt = text(i)
        r = reference(srv, [prompt], [None], max_tokens=12)[0]
        if len(r.text) >= 3:
            break
    stop = r.text[1:3]
    want = r.text[:r.text.find(stop)]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    assert out.choices[0].text == want and out.choices[0].finish_reason == "stop"
    got = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, stop=stop, stream=True))
    assert got == want
    wait_idle(st.url)


def test_disconnect_mid_stream_frees_pages(live):
    """A client that goes away mid-stream: its request is aborted at once and its KV pages freed.
    The engine is paused (by a step hook) right after the first token, so the request cannot
    finish on its own meanwhile."""
    st, srv = live
    eng = srv.engine

    def pause_after_first_token(ae):
        if any(out.token_ids for out in ae.running_outputs()):
            ae.pause_now()
            ae.step_hooks.remove(pause_after_first_token)

    eng.step_hooks.append(pause_after_first_token)
    body = {"model": ADAPTERS[4], "prompt": text(50), "max_tokens": 10, "temperature": 0, "stream": True,
            "ignore_eos": True}
    try:
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", st.url + "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()  # kept: a dropped iterator closes the connection
                first = next(line for line in lines if line.startswith("data: "))
                assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
                s = httpx.get(st.url + "/stats").json()
                assert s["running"] == 1 and s["kv_pages"] >= 1
        # The connection is closed: the server aborts the request while the engine is still paused.
        s = wait_idle(st.url)
        assert s["kv_pages"] == 0
        assert eng.metrics.requests.labels(ADAPTERS[4], "abort")._value.get() == 1
    finally:
        eng.resume()


def test_disconnect_while_queued(live):
    """A non-streamed request whose client times out while it is still queued is dropped."""
    st, srv = live
    srv.engine.pause()
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(st.url + "/v1/completions", json={"model": "tiny", "prompt": text(51), "max_tokens": 4},
                       timeout=0.5)
        wait_idle(st.url)
    finally:
        srv.engine.resume()


def test_runtime_load_and_unload(live, client, demo):
    st, srv = live
    model_dir, paths = demo
    name = "hot-swap"
    r = httpx.post(st.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": paths[ALL_LINEAR[10]]})
    assert r.status_code == 200, r.text
    assert name in [m.id for m in client.models.list().data]
    ref = reference(srv, [text(60)], [name])[0]
    out = client.completions.create(model=name, prompt=text(60), max_tokens=MT, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert extra(out.choices[0], "token_ids") == ref.token_ids
    # Replaced in place: the new weights serve under the same name.
    r = httpx.post(st.url + "/v1/load_lora_adapter",
                   json={"lora_name": name, "lora_path": paths[ALL_LINEAR[11]], "load_inplace": True})
    assert r.status_code == 200, r.text
    ref2 = reference(srv, [text(60)], [name])[0]
    assert ref2.token_ids != ref.token_ids
    out = client.completions.create(model=name, prompt=text(60), max_tokens=MT, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert extra(out.choices[0], "token_ids") == ref2.token_ids
    r = httpx.post(st.url + "/v1/unload_lora_adapter", json={"lora_name": name})
    assert r.status_code == 200, r.text
    assert name not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=name, prompt=text(60), max_tokens=2)


def test_metrics_parse(live, client):
    from prometheus_client.parser import text_string_to_metric_families
    st, srv = live
    client.completions.create(model=ADAPTERS[5], prompt=text(70), max_tokens=2)
    r = httpx.get(st.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("slora_requests", "slora_prompt_tokens", "slora_generation_tokens", "slora_engine_kv_pages",
                 "slora_engine_free_pages", "slora_engine_total_pages", "slora_engine_running",
                 "slora_step_duration_seconds", "slora_time_to_first_token_seconds",
                 "slora_e2e_request_latency_seconds", "slora_requests_in_flight", "slora_http_responses"):
        assert name in fams, name
    per_model = {s.labels["model"] for s in fams["slora_requests"].samples if s.name == "slora_requests_total"}
    assert {"tiny", ADAPTERS[5]} <= per_model
    assert fams["slora_engine_kv_pages"].samples[0].value == 0
    assert fams["slora_step_duration_seconds"].type == "histogram"
    phases = {s.labels["phase"]: s.value for s in fams["slora_engine_step_phase_seconds"].samples}
    assert {"schedule", "inputs", "device_wait", "complete"} <= set(phases), phases
    assert phases["device_wait"] > 0 and all(v >= 0 for v in phases.values()), phases


def test_cli_engine_flags(capsys, monkeypatch):
    """Every EngineConfig field but the benchmark baseline is a flag, vLLM's name where vLLM has one;
    the flags given reach LLM by their EngineConfig field names, and no others; a bad value is a
    one-line error with exit code 2, before anything loads."""
    from slora_jax.config import EngineConfig
    from slora_jax.serve import cli
    assert set(cli.ENGINE_FLAGS) == set(EngineConfig.field_names()) - {"baseline"}
    ap = cli.build_parser()
    usage = ap.format_help()
    for flag in ("--max-num-seqs", "--max-num-batched-tokens", "--max-loras", "--max-lora-rank", "--max-cpu-loras",
                 "--gpu-memory-utilization", "--tensor-parallel-size", "--async-scheduling", "--no-async-scheduling",
                 "--early-abort-ttft", "--max-cpu-lora-gb", "--compilation-cache-dir"):
        assert flag in usage, flag
    args = ap.parse_args(["--max-loras", "3", "--no-async-scheduling", "--lora-backend", "xla",
                          "--early-abort-ttft", "0.5", "--compilation-cache-dir", "", "--max-cpu-lora-gb", "2"])
    assert cli.engine_options(args) == {"max_loras": 3, "async_scheduling": False, "lora_backend": "xla",
                                        "early_abort_ttft": 0.5, "compilation_cache_dir": None,
                                        "max_cpu_lora_gb": 2.0}
    assert cli.engine_options(ap.parse_args([])) == {}

    class Built(Exception):
        pass

    def llm(model, **kwargs):  # stands in for LLM: what the command line builds it with
        raise Built(model, kwargs)

    monkeypatch.setattr(slora_jax, "LLM", llm)
    with pytest.raises(Built) as built:
        cli.main(["--model", "tiny", "--max-loras", "3", "--early-abort-ttft", "0.5", "--no-async-scheduling"])
    assert built.value.args == ("tiny", {"adapters": {}, "dtype": "bfloat16", "seed": 0, "quantization": None,
                                         "max_model_len": None, "max_loras": 3, "early_abort_ttft": 0.5,
                                         "async_scheduling": False})
    for argv, message in [(["--page-size", "0"], "--page-size must be a positive integer, got 0"),
                          (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
                          (["--max-num-seqs", "many"], "invalid int value: 'many'"),
                          (["--lora-backend", "triton"], "invalid choice: 'triton'"),
                          (["--compile-per-layer"], "unrecognized arguments: --compile-per-layer"),
                          (["--overlap-steps"], "unrecognized arguments: --overlap-steps"),
                          (["--lora-modules", "nameonly"], "expected name=path or a JSON object"),
                          (["--port", "-1"], "must be >= 0")]:
        with pytest.raises(SystemExit) as exit_:
            cli.main(["--model", "tiny", *argv])
        assert exit_.value.code == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("slora-jax serve: error: ") and message in err[-1], (argv, err)
        assert not any("Traceback" in line for line in err)


def test_cli_serve(demo):
    """`python -m slora_jax serve` starts, prints one line saying where it listens, and serves at
    once while its step buckets compile in the background (the default), saying when all are."""
    model_dir, paths = demo
    p, url = start_cli_server(model_dir, ["--lora-modules", f"a={paths[ADAPTERS[0]]}",
                                          json.dumps({"name": "b", "path": paths[ADAPTERS[1]]}), "--api-key", "sk-cli",
                                          "--warmup", "background", "--max-model-len", "64", "--max-num-seqs", "2"])
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)
    reader.start()
    try:
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 401
        auth = {"Authorization": "Bearer sk-cli"}
        models = httpx.get(url + "/v1/models", headers=auth).json()
        assert [d["id"] for d in models["data"]] == ["base", "a", "b"]
        done = httpx.post(url + "/v1/completions", headers=auth, timeout=300,  # compiles its step shapes
                          json={"model": "a", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0.0}).json()
        assert done["usage"]["completion_tokens"] == 3, done
        deadline = time.monotonic() + 600
        while not any("every step bucket compiled" in ln for ln in lines) and time.monotonic() < deadline:
            time.sleep(0.2)
        started = [ln for ln in lines if "step buckets in the background" in ln]
        finished = [ln for ln in lines if "every step bucket compiled" in ln]
        assert started and finished, lines
        assert re.search(r"compiling (\d+) step", started[0]).group(1) == re.search(r"\((\d+) in", finished[0]).group(1)
    finally:
        p.terminate()
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
