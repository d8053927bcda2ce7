"""Replicas on Ray Serve: N engines of one model behind one OpenAI endpoint, with adapter affinity.

Two deployments make the application:

    client ──HTTP──► Ingress (1 replica: ASGI, no engine) ──DeploymentHandle──► LLMServer × N
                     picks the multiplexed model id                              one LLM + the app of
                     "<adapter>@<version>" from the body's `model`               `slora-jax serve`

- `LLMServer` owns one `LLM` and the FastAPI app of serve/app.py (`build_app`), and runs each
  forwarded HTTP request through that app in process (`call_asgi`): every route, check and error
  of `slora-jax serve` is the same here, and the `openai` client works unchanged.
- Affinity is Ray Serve's model multiplexing. The ingress sends a request for adapter X with the
  multiplexed model id "X@<version>"; Serve's router prefers a replica that reports that id as
  loaded, spills over to another by queue length when those are full, and places a new id on the
  replica that holds the fewest. The replica's multiplexed loader (`LLMServer.adapter`) registers
  the adapter in its own engine; the engine's host store and unified pool then cache and page its
  weights. Base-model requests carry no id and go to the less loaded of two replicas.
- Adapters are registered lazily: POST /v1/load_lora_adapter loads the adapter on one replica (so a
  bad adapter fails the call with the replica's own 400) and records (path, version) at the
  ingress; other replicas register it on their first request for it. Loading a name again bumps
  its version, so its model id changes and no replica serves the old weights: a replica that still
  holds the old version re-registers from the new path before it serves the request. Unloading
  removes the name at the ingress (its requests get 404 at once), and every replica unregisters it
  at its next request (the ingress sends the unloaded names along with each request).
- Failure: Serve calls `check_health` on every replica and replaces one whose engine thread died or
  whose process is gone. A request whose replica fails before answering gets 503 (code
  replica_unavailable, Retry-After); a stream that already started ends with an error event and
  [DONE]. Nothing is retried once sent, so no request runs twice.
- Metrics: each replica's /metrics is its own registry (GET /metrics, /stats and /v1/adapters on
  the ingress reach one replica); every numeric field of Engine.stats() is also exported as a Ray
  metric `slora_engine_<field>`, which Ray tags with the deployment and replica.

Start it with `slora-jax serve --replicas N` (a local Ray instance), `serve run
slora_jax.serve.replicas:app model=... replicas=N`, or `serve deploy` with a configs/serve file.
docs/scale-out.md has the details.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
from pathlib import Path

from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse

from slora_jax.serve.errors import APIError, bad
from slora_jax.serve.protocol import MAX_BODY_BYTES, check_adapter_path, parse_json_body
from slora_jax.serve.schema import LoadAdapterRequest, UnloadAdapterRequest, validate_body

log = logging.getLogger(__name__)

GENERATE_ROUTES = ("/v1/completions", "/v1/chat/completions")
OPEN_ROUTES = ("/health", "/metrics")  # as in serve/app.py: no API key
REPLICA_UNAVAILABLE = APIError(503, "the replica serving this request is unavailable; retry", None,
                               "replica_unavailable", retry_after=1)


# ---------------------------------------------------------------------------------------------
# a forwarded HTTP request, run through an ASGI app in process

async def call_asgi(app, method: str, path: str, query: bytes, headers: list, body: bytes):
    """Run one HTTP request through `app`; yields (status, headers, body) once, then the further
    body chunks of a streamed (text/event-stream) response. A response that does not stream comes
    whole in the first item. Closing the generator tells the app that the client went away."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
             "root_path": "", "headers": [(bytes(k), bytes(v)) for k, v in headers],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        messages.put_nowait(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    start, parts, streaming = None, [], False
    try:
        while True:
            message = await messages.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                start = message
                streaming = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                for k, v in message.get("headers", []))
                continue
            chunk = message.get("body", b"")
            if streaming:
                if start is not None:
                    yield start["status"], list(start.get("headers", [])), chunk
                    start = None
                elif chunk:
                    yield chunk
            else:
                parts.append(chunk)
            if not message.get("more_body", False):
                break
        if task.done() and not task.cancelled() and task.exception() is not None and start is None:
            raise task.exception()
        if start is not None:
            yield start["status"], list(start.get("headers", [])), b"".join(parts)
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, timeout=5)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - the client is gone
                task.cancel()


# ---------------------------------------------------------------------------------------------
# the replica

class LLMServer:
    """One `LLM` and the app of `slora-jax serve` over it. Each Serve replica holds one."""

    def __init__(self, model: str, adapters: dict | None = None, served_model_name: str | None = None,
                 dtype: str = "bfloat16", engine: dict | None = None, llm_options: dict | None = None,
                 app_options: dict | None = None, warmup: dict | None = None):
        from slora_jax import LLM
        from slora_jax.serve.app import build_app
        self.llm = LLM(model, adapters=adapters or {}, dtype=dtype, **(llm_options or {}), **(engine or {}))
        if warmup is not None:
            self.llm.warmup(progress=False, **warmup)
        self.app = build_app(self.llm, served_model_name, **(app_options or {}))
        self.srv = self.app.state.server
        self.versions = {name: 0 for name in (adapters or {})}  # adapter -> ingress version registered
        self.paths: dict[str, str] = {}                         # model id -> path, set per request
        self.started = False
        self.gauges: dict = {}

    def ensure_started(self) -> None:
        """Start the engine thread on the loop that runs this replica's requests (its deltas are
        delivered there), and the Ray metrics export beside it."""
        if not self.started:
            self.started = True
            self.srv.engine.start(asyncio.get_running_loop())
            asyncio.ensure_future(self.export_metrics())

    async def adapter(self, model_id: str) -> str:
        """Serve's multiplexed loader: register adapter `name` of model id "name@version" in this
        replica's engine unless that version is already registered here. Wrapped by
        `serve.multiplexed` in `deployments` (the cache size is a deployment option)."""
        name, _, version = model_id.rpartition("@")
        version = int(version)
        if self.versions.get(name) != version:
            path = self.paths.pop(model_id, None)
            if path is None:
                raise APIError(503, f"no path for adapter {name!r} version {version}", None, "adapter_unknown")
            await self.srv.engine.call(lambda: self.llm.load_adapter(name, path))
            self.versions[name] = version
        return model_id

    async def drop(self, removed: dict[str, int]) -> None:
        """Unregister the adapters the ingress has unloaded ({name: last version}) that this replica
        still holds; one with requests running here stays until a later request finds it idle."""
        for name, version in removed.items():
            if name in self.versions and self.versions[name] <= version:
                try:
                    await self.srv.engine.call(lambda name=name: self.llm.unload_adapter(name))
                except (KeyError, RuntimeError):
                    continue
                del self.versions[name]

    async def handle(self, method: str, path: str, query: bytes, headers: list, body: bytes,
                     adapter_path: str | None = None, removed: dict | None = None):
        """One HTTP request through this replica's app (see `call_asgi` for what it yields).
        `removed`: adapters unloaded at the ingress, dropped here first (`drop`)."""
        self.ensure_started()
        if removed:
            await self.drop(removed)
        model_id = serve.get_multiplexed_model_id()
        if model_id:
            if adapter_path is not None:
                self.paths[model_id] = adapter_path
            try:
                await self.adapter(model_id)
            except APIError as e:
                yield e.status, [(b"content-type", b"application/json")], json.dumps(e.body()).encode()
                return
            except (ValueError, OSError) as e:
                err = bad(f"cannot load adapter: {e}", "lora_path", "invalid_adapter")
                yield 400, [(b"content-type", b"application/json")], json.dumps(err.body()).encode()
                return
        async for item in call_asgi(self.app, method, path, query, headers, body):
            yield item

    async def stats(self) -> dict:
        """This replica's id, Engine.stats() and the adapters it has registered (tests, operators)."""
        self.ensure_started()
        s = await self.srv.engine.stats()
        return {"replica": serve.get_replica_context().replica_tag, "registered": sorted(self.llm.store.entries),
                **s}

    def __del__(self):
        """Serve's graceful shutdown (after in-flight requests had graceful_shutdown_timeout_s to
        finish): stop the engine thread; requests still running get 503."""
        srv = getattr(self, "srv", None)
        if srv is not None and self.started:
            srv.engine.shutdown(timeout=10)

    def check_health(self) -> None:
        """Serve's health check: fails once the engine thread has died (Serve then replaces us)."""
        if self.started and not self.srv.engine.alive:
            raise RuntimeError(f"the engine thread is not running: {self.srv.engine.dead!r}")

    async def export_metrics(self, period_s: float = 5.0) -> None:
        """Every numeric Engine.stats() field as a Ray gauge `slora_engine_<field>` (Ray tags each
        with the deployment and replica), refreshed every `period_s` seconds."""
        from ray.serve.metrics import Gauge
        while self.srv.engine.alive:
            try:
                s = await self.srv.engine.stats()
            except Exception:  # noqa: BLE001 - the engine is stopping; the next check stops too
                s = {}
            for key, value in s.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    if key not in self.gauges:
                        self.gauges[key] = Gauge(f"slora_engine_{key}", description=f"Engine.stats()['{key}']")
                    self.gauges[key].set(float(value))
            await asyncio.sleep(period_s)


# ---------------------------------------------------------------------------------------------
# the ingress

class Ingress:
    """The HTTP entry: picks each request's multiplexed model id and forwards it to an LLMServer
    replica; answers adapter load/unload and /v1/models itself from its adapter registry."""

    def __init__(self, replicas, served_model_name: str, adapters: dict | None = None,
                 api_key: str | None = None, allowed_adapter_dirs: list[str] | None = None):
        self.replicas = replicas
        self.base = served_model_name
        self.key = f"Bearer {api_key}".encode() if api_key else None
        self.allowed = [os.path.realpath(d) for d in (allowed_adapter_dirs or [])]
        # name -> (path, version): the adapters this application serves
        self.registry: dict[str, tuple[str, int]] = {n: (str(p), 0) for n, p in (adapters or {}).items()}
        # name -> its last version: unloaded adapters, sent along with every request so that each
        # replica drops them (a restarted replica too, which starts with the start-up adapters)
        self.removed: dict[str, int] = {}
        self.lock = asyncio.Lock()

    def __serve_build_asgi_app__(self):
        return _ASGI(self.asgi)

    async def asgi(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].rsplit(".", 1)[-1]
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        try:
            response = await self.route(request)
        except APIError as e:
            response = e.response()
        if response is not None:
            await response(scope, receive, send)

    async def route(self, request: Request):
        path, method = request.url.path, request.method
        if self.key is not None and path not in OPEN_ROUTES:
            got = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(got, self.key):
                raise APIError(401, "invalid API key" if got else "missing API key: send Authorization: "
                               "Bearer <key>", None, "invalid_api_key")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise bad(f"the request body is over {MAX_BODY_BYTES >> 20} MiB", None, "body_too_large")
        body = await request.body()
        if method == "POST" and path == "/v1/load_lora_adapter":
            return await self.load_adapter(request, body)
        if method == "POST" and path == "/v1/unload_lora_adapter":
            return self.unload_adapter(body)
        model_id = adapter_path = None
        if method == "POST" and path in GENERATE_ROUTES:
            model = body_field(body, "model")
            if isinstance(model, str) and model != self.base:
                if model not in self.registry:
                    raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
                adapter_path, version = self.registry[model]
                model_id = f"{model}@{version}"
        forward = self.forward(method, path, request.url.query.encode(), list(request.headers.raw), body,
                               model_id, adapter_path)
        if method == "GET" and path == "/v1/models":
            return await self.models(forward)
        return await forward

    async def forward(self, method: str, path: str, query: bytes, headers: list, body: bytes,
                      model_id: str | None = None, adapter_path: str | None = None) -> "_Relay":
        """Send a request to a replica and relay its answer: a 503 if the replica fails before
        answering; a stream that fails after its start ends with an error event and [DONE]."""
        handle = self.replicas.options(stream=True, **({"multiplexed_model_id": model_id} if model_id else {}))
        gen = handle.handle.remote(method, path, query, headers, body, adapter_path, dict(self.removed) or None)
        try:
            status, headers, first = await gen.__anext__()
        except Exception as e:  # noqa: BLE001 - a dead or unreachable replica
            log.warning("replica failed before answering: %s", e)
            gen.cancel()
            raise REPLICA_UNAVAILABLE from None
        return _Relay(status, headers, first, gen)

    async def models(self, forward) -> JSONResponse:
        """A replica's /v1/models with this application's adapters in place of the replica's."""
        relay = await forward
        if relay.status != 200:
            return relay
        base = json.loads(relay.first)["data"][0]
        data = [base] + [{**base, "id": name, "root": name, "parent": base["id"]} for name in sorted(self.registry)]
        return JSONResponse({"object": "list", "data": data})

    async def load_adapter(self, request: Request, body: bytes):
        """Register (or with load_inplace, replace) an adapter: one replica loads it now, the
        others on their first request for it."""
        req = validate_body(LoadAdapterRequest, parse_json_body(body))
        name = req.lora_name
        if name == self.base:
            raise bad(f"{name!r} is the base model's name", "lora_name")
        real = check_adapter_path(req.lora_path, self.allowed)
        async with self.lock:
            if name in self.registry and not req.load_inplace:
                raise bad(f"The lora adapter '{name}' has already been loaded; pass load_inplace: true to "
                          "replace it", "lora_name", "adapter_exists")
            version = max((v for _, v in self.registry.values()), default=0) + 1
            relay = await self.forward("GET", "/stats", b"", list(request.headers.raw), b"",
                                       f"{name}@{version}", real)
            if relay.status != 200:
                return relay
            self.registry[name] = (real, version)
            self.removed.pop(name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    def unload_adapter(self, body: bytes):
        name = validate_body(UnloadAdapterRequest, parse_json_body(body)).lora_name
        if name not in self.registry:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name", "model_not_found")
        self.removed[name] = self.registry.pop(name)[1]
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


class _ASGI:
    """An ASGI 3 app calling `fn` (uvicorn tells ASGI 3 from ASGI 2 by an async __call__)."""

    def __init__(self, fn):
        self.fn = fn

    async def __call__(self, scope, receive, send):
        await self.fn(scope, receive, send)


class _Relay:
    """An ASGI response that relays a replica's answer (see `Ingress.forward`)."""

    def __init__(self, status: int, headers: list, first: bytes, gen):
        self.status, self.headers, self.first, self.gen = status, headers, first, gen

    async def __call__(self, scope, receive, send):
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.first, "more_body": True})
        try:
            async for chunk in self.gen:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (asyncio.CancelledError, OSError):
            self.gen.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - the replica died mid-stream: no retry, say so
            log.warning("replica failed mid-stream: %s", e)
            if any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in self.headers):
                err = json.dumps(REPLICA_UNAVAILABLE.body(), separators=(",", ":"))
                await send({"type": "http.response.body", "body": f"data: {err}\n\ndata: [DONE]\n\n".encode(),
                            "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def body_field(body: bytes, key: str):
    """body[key] of a JSON object body, else None (the replica answers a malformed body itself)."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return obj.get(key) if isinstance(obj, dict) else None


# ---------------------------------------------------------------------------------------------
# the application

def build(model: str, replicas: int = 2, adapters: dict | None = None, served_model_name: str | None = None,
          dtype: str = "bfloat16", engine: dict | None = None, llm_options: dict | None = None,
          api_key: str | None = None, allowed_adapter_dirs: list[str] | None = None, warmup: dict | None = None,
          num_cpus: float = 1.0, num_gpus: float | None = None, max_ongoing_requests: int | None = None,
          health_check_period_s: float = 10.0, health_check_timeout_s: float = 30.0):
    """The Serve application: an Ingress in front of `replicas` LLMServer replicas of `model`.

    engine: EngineConfig fields (checked here, before any replica starts); llm_options: the other
    LLM arguments (seed, quantization, max_model_len); warmup: LLM.warmup's arguments, or None for
    no warm-up. num_gpus per replica: default tensor_parallel_size, or 0 when JAX_PLATFORMS is cpu.
    max_ongoing_requests per replica (default 2 x max_num_seqs): what Serve sends one replica
    before it spills a request for that replica's adapters over to another."""
    from slora_jax.config import EngineConfig
    engine = dict(engine or {})
    cfg = EngineConfig(**engine)
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    adapters = {str(n): str(p) for n, p in (adapters or {}).items()}
    name = served_model_name or Path(str(model)).name
    if num_gpus is None:
        num_gpus = 0 if os.environ.get("JAX_PLATFORMS", "") == "cpu" else cfg.tensor_parallel_size

    class Replica(LLMServer):
        # The multiplexed "model" is an adapter handle; the engine's host store holds up to
        # max_cpu_loras adapters' rows, so a replica reports that many as loaded.
        # Serve finds the method by the loader's own name, so the wrapper takes the same name.
        adapter = serve.multiplexed(max_num_models_per_replica=cfg.max_cpu_loras)(LLMServer.adapter)

    replica = serve.deployment(
        Replica, name="LLMServer", num_replicas=replicas,
        max_ongoing_requests=max_ongoing_requests or 2 * cfg.max_num_seqs,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        health_check_period_s=health_check_period_s, health_check_timeout_s=health_check_timeout_s)
    ingress = serve.deployment(serve.ingress()(Ingress), name="Ingress", max_ongoing_requests=100_000,
                               ray_actor_options={"num_cpus": 0})
    app_options = {"api_key": api_key, "allowed_adapter_dirs": allowed_adapter_dirs}
    return ingress.bind(replica.bind(model, adapters, name, dtype, engine, llm_options, app_options, warmup),
                        name, adapters, api_key, allowed_adapter_dirs)


def from_cli(args, model: str, name: str | None, dtype: str, adapters: dict, engine: dict):
    """`build` from `slora-jax serve`'s parsed flags (serve/cli.py)."""
    # A replica joins Serve's router only once its constructor returns, so "background" and
    # "before-serving" both compile there: traffic never reaches a replica still compiling.
    warmup = None if args.warmup == "off" else {"max_context": args.max_model_len, "workers": args.warmup_workers,
                                                "lora": args.model is not None}
    llm_options = {"seed": args.seed, "quantization": args.quantization, "max_model_len": args.max_model_len}
    api_key = (args.api_key or [None])[0]  # cli.check_args allows one with --replicas
    return build(model, args.replicas, adapters, name or args.model, dtype, engine, llm_options, api_key,
                 args.allowed_adapter_dirs, warmup)


def app(args: dict):
    """The builder of `serve run slora_jax.serve.replicas:app model=... replicas=N key=value ...`
    and of a Serve config's `args`: every `slora-jax serve` flag is a key (dashes or underscores);
    lora_modules and allowed_adapter_dirs are space-separated lists; an on/off flag takes true or
    false."""
    import argparse

    from slora_jax.serve.cli import build_parser, engine_options, parse_lora_modules
    argv = []
    for key, value in args.items():
        name = key.replace("_", "-")
        if str(value).lower() in ("true", "false"):
            on = str(value).lower() == "true"
            if on or not name.startswith("no-"):
                argv.append(f"--{name}" if on else f"--no-{name}")
        elif name in ("lora-modules", "allowed-adapter-dirs"):
            argv += [f"--{name}", *str(value).split()]
        else:
            argv += [f"--{name}", str(value)]
    parser = build_parser()
    parser.exit_on_error = False
    try:
        parsed, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ValueError(f"slora_jax.serve.replicas:app: {e}") from None
    if unknown:
        raise ValueError(f"slora_jax.serve.replicas:app: unknown arguments {unknown}; the keys are "
                         "slora-jax serve's flags")
    from slora_jax.serve.cli import check_args
    check_args(parsed)  # raises ValueError naming the flag
    if parsed.model is None or parsed.replicas is None:
        raise ValueError("slora_jax.serve.replicas:app needs model=<HF directory or configs/models shape> "
                         "and replicas=<N>")
    return from_cli(parsed, parsed.model, (parsed.served_model_name or [None])[0], parsed.dtype or "bfloat16",
                    parse_lora_modules(parsed.lora_modules), engine_options(parsed))


def serve_forever(application, host: str, port: int, replicas: int, base: str) -> None:
    """Start a local Ray instance and Serve on host:port, run `application` until SIGINT/SIGTERM."""
    import signal
    import threading

    import ray
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application, name="slora-jax", route_prefix="/")
        shown = f"[{host}]" if ":" in host else host
        print(f"slora-jax: serving {base} with {replicas} replicas on http://{shown}:{port} (OpenAI API at /v1, "
              f"Ray Serve)", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
