"""The FastAPI app of `slora-jax serve`: OpenAI-compatible routes over one `LLM`.

Routes (vLLM's names and shapes where vLLM has them):

    POST /v1/completions          prompt: str | [str] | [int] | [[int]]; stream: true -> SSE
    POST /v1/chat/completions     messages through the chat template (chat.py); stream: true -> SSE
    GET  /v1/models               the base model and every registered adapter
    GET  /v1/adapters             per adapter: ranks, pages, resident in the device pool, cached in
                                  host memory, running and waiting requests (for routers)
    POST /v1/load_lora_adapter    {"lora_name", "lora_path", "load_inplace"?}; paths must be under
                                  --allowed-adapter-dirs (after resolving symlinks)
    POST /v1/unload_lora_adapter  {"lora_name"}; refused (400) while the adapter has requests
    GET  /health                  200 while the engine thread is alive, else 503
    GET  /metrics                 Prometheus text: engine gauges (every field of Engine.stats()),
                                  requests and tokens per adapter, TTFT / latency / step histograms,
                                  seconds of steps by phase (slora_engine_step_phase_seconds)
    GET  /stats                   Engine.stats() as JSON, read on the engine thread

`model` in a request is one of the base model's names (--served-model-name) or an adapter's name
(with --lora-search-dirs, loaded on first use: first_use.py); omitted, it is the base model. With
API keys, every route wants `Authorization: Bearer <key>` (any of the keys) except
/health and /metrics, which stay open for probes and scrapers, as in vLLM. /metrics labels its
counters by adapter name, as vLLM does: a scraper sees which adapters are in use. No response holds
an absolute server path: adapters show their path relative to their --allowed-adapter-dirs entry,
or their name.

Errors come in OpenAI's shape (errors.py): 400 invalid input, 401 API key, 404 unknown model or
route, 429 too many requests in flight (Retry-After), 503 a request the engine aborted (no room,
shutdown) or a dead engine (Retry-After), 500 an engine failure or a request the engine could not
serve (code non_finite_output: its output is not finite; adapter_unavailable: its adapter's files
cannot be read; step_failed: a step fails whenever its row is in it; that request alone ends; a
stream ends with an error event and [DONE], finish_reason "error"), 408 a body that does not arrive
within --request-timeout. Limits, checked before any tokenizing: the body's size and nesting
(protocol.py: MAX_BODY_BYTES, MAX_JSON_DEPTH); then its shape, types and static bounds against its
pydantic model (schema.py: prompts and messages a request, MAX_BATCH_PROMPTS and MAX_MESSAGES; stop
strings and stop token ids; every number that reaches the device, top_k within int32, seed within
int64); then (protocol.py) the characters of a prompt or chat (CHARS_PER_TOKEN_LIMIT per token of
context), token ids within the vocabulary, and prompt + max_tokens within the model's context
length. Malformed Unicode (lone surrogates) and NaN or Infinity are 400s.

Shutdown: `drain()` (the CLI calls it on SIGTERM) answers new requests 503 + Retry-After, lets those
in flight finish for --shutdown-timeout seconds, then aborts the rest: a stream ends with an error
event and [DONE], any other request gets 503.

Threading: see async_engine.py. The engine runs on its own thread; HTTP handlers run on uvicorn's
event loop and reach the engine only through `AsyncEngine`. Body parsing, tokenizing and chat
templating run in worker threads (asyncio.to_thread), so a large body never stalls the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from slora_jax.sampling import SamplingParams
from slora_jax.serve.async_engine import AsyncEngine, EngineError, EngineMetrics
from slora_jax.serve.chat import ChatFormatter
from slora_jax.serve.collector import EngineCollector
from slora_jax.serve.first_use import FirstUseLoader
from slora_jax.serve.scoring import PromptPart, text_offsets
from slora_jax.serve.schema import (ChatCompletionRequest, CompletionRequest, LoadAdapterRequest,
                                    UnloadAdapterRequest, request_body, validate_body)
from slora_jax.serve.streaming import SSEResponse, await_or_disconnect, sse_event
from slora_jax.serve.errors import APIError, ClientGone, bad, from_engine_error, hide_paths
from slora_jax.serve.protocol import (CHARS_PER_TOKEN_LIMIT, MAX_BODY_BYTES, Limits, chat_messages, check_adapter_path,
                                      message_chars, parse_json_body, prompt_ids, sampling_params)
from slora_jax.serve.responses import Choice, chat_logprobs, completion_logprobs, usage

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# the app

class Server:
    """The state behind one FastAPI app: the LLM, its AsyncEngine, metrics and options."""

    def __init__(self, llm, served_model_name: str | list[str] | None, api_key: str | list[str] | None = None,
                 allowed_adapter_dirs: list[str] | None = None, max_in_flight: int | None = 4096,
                 request_timeout: float = 30.0, lora_search_dirs: list[str] | None = None,
                 chat_template: str | None = None):
        from prometheus_client import CollectorRegistry, Counter
        self.llm = llm
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
        names = names or [Path(str(llm.model)).name]
        self.base, self.base_names = names[0], set(names)  # the name reported; every name accepted
        self.api_keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        self.request_timeout = request_timeout
        self.draining = False  # set by drain(): new requests get 503
        self.allowed = [os.path.realpath(d) for d in (allowed_adapter_dirs or [])]
        self.registry = CollectorRegistry()
        self.metrics = EngineMetrics(self.registry, self.base)
        self.http_responses = Counter("slora_http_responses", "HTTP responses by status", ["status"],
                                      registry=self.registry)
        self.engine = AsyncEngine(llm, self.metrics, max_in_flight)
        self.first_use = FirstUseLoader(llm, self.engine, self.allowed, lora_search_dirs or [])
        self.registry.register(EngineCollector(self))
        self.limits = Limits(llm)
        self.chat = ChatFormatter(llm.model if Path(llm.model).is_dir() else None, llm.tokenizer, chat_template)
        self.created = int(time.time())

    # -- helpers -------------------------------------------------------------------------------

    async def resolve_model(self, model: str | None) -> str | None:
        """The adapter a request's `model` asks for (None: the base model); an unregistered name is
        loaded from --lora-search-dirs (first_use.py), else 404."""
        if model is None or model in self.base_names:
            return None
        if model not in self.llm.store.entries:
            await self.first_use.load(model)
        return model

    def shown_path(self, path: str, name: str) -> str:
        """An adapter's directory as a client may see it: relative to its allowed directory, else
        the adapter's name (a server path never leaves the server)."""
        real = os.path.realpath(path)
        for root in self.allowed:
            if os.path.commonpath([real, root]) == root:
                return os.path.relpath(real, root)
        return name

    async def drain(self, timeout: float, grace: float = 5.0) -> None:
        """Graceful shutdown: refuse new requests (503), let those in flight finish for `timeout`
        seconds, then abort the rest (streams end with an error event and [DONE], other requests
        get 503) and wait up to `grace` seconds for their answers to go out."""
        self.draining = True
        loop = asyncio.get_running_loop()
        for wait in (timeout, grace):
            end = loop.time() + wait
            while self.engine.in_flight and loop.time() < end:
                await asyncio.sleep(0.02)
            if not self.engine.in_flight or not self.engine.alive:
                return
            if wait is timeout:
                await self.engine.abort_in_flight("the server is shutting down")

    def piece(self, t: int) -> str:
        tok = self.llm.tokenizer
        p = tok.hf.id_to_token(t) if tok is not None else None
        return p if p is not None else f"token_id:{t}"

    # -- generation ----------------------------------------------------------------------------

    def submit(self, prompts: list[list[int]], sp: SamplingParams, adapter: str | None,
               extras: dict) -> list[Choice]:
        if self.draining:
            raise SHUTTING_DOWN
        q: asyncio.Queue = asyncio.Queue()
        choices = []
        try:
            n = extras["n"]
            for i, p in enumerate(prompts):
                for j in range(n):  # completion j of a prompt: seed + j, as LLM.generate's n
                    seed = None if sp.seed is None else (sp.seed + j + 2**63) % 2**64 - 2**63
                    h = self.engine.submit(p, sp, adapter, seed, queue=q, index=i * n + j)
                    c = Choice(i * n + j, h, self.llm.tokenizer, extras["stop"], extras["logprobs"],
                               extras["include_stop_str_in_output"], extras["skip_special_tokens"], sp.min_tokens)
                    c.first_of_prompt = j == 0
                    choices.append(c)
        except EngineError as e:
            for c in choices:
                self.engine.release(c.handle)
            raise from_engine_error(e) from None
        return choices

    async def events(self, choices: list[Choice]):
        """(choice, text, token_ids, logprobs) as tokens arrive; stop strings end a choice early."""
        by_handle = {c.handle: c for c in choices}
        try:
            async for h, d in self.engine.stream_many([c.handle for c in choices]):
                c = by_handle[h]
                if c.finished:  # ended by a stop string; the engine's late tokens are dropped
                    continue
                text, ids, lps = c.feed(d)
                if c.finished and d.finish_reason is None:  # a stop string: abort it in the engine
                    self.engine.release(h)
                yield c, text, ids, lps
                if all(x.finished for x in choices):
                    return
        except EngineError as e:
            raise from_engine_error(e) from None

    async def collect(self, choices: list[Choice]) -> None:
        async for _ in self.events(choices):
            pass

    def check_failed(self, choices: list[Choice]) -> None:
        """503 for a choice the engine aborted, 500 for one whose output was not finite."""
        for c in choices:
            if c.finish_reason == "abort":
                raise APIError(503, f"the request was aborted: {c.abort_reason or 'no room'}; retry later",
                               None, "aborted", retry_after=1)
            if c.finish_reason == "error":
                raise APIError(500, c.error, None, c.error_code)

    def completion_logprobs(self, c: Choice, ids: list[int], lps: list[float], offset: int) -> dict | None:
        return completion_logprobs(c, [self.piece(t) for t in ids], lps, text_offsets(self.llm.tokenizer, ids, offset),
                                   c.tops(len(ids), self.piece))

    def chat_logprobs(self, c: Choice, ids: list[int], lps: list[float]) -> dict | None:
        return chat_logprobs(c, [self.piece(t) for t in ids], lps, c.tops(len(ids), self.piece))


SHUTTING_DOWN = APIError(503, "the server is shutting down; retry on another replica", None, "shutting_down",
                         retry_after=5)
OPEN_ROUTES = ("/health", "/metrics")  # answered without the API key, and during a drain


class _AuthAndCount:
    """ASGI middleware: the API key on every route but OPEN_ROUTES, 503 for new requests while the
    server drains, and a response counter by status."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server
        self.keys = [f"Bearer {k}".encode() for k in server.api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        counter = self.server.http_responses

        async def counting_send(message):
            if message["type"] == "http.response.start":
                counter.labels(str(message["status"])).inc()
            await send(message)

        open_route = scope["path"] in OPEN_ROUTES
        if self.keys and not open_route:
            got = dict(scope["headers"]).get(b"authorization", b"")
            # every key is compared, so the time taken does not tell which one nearly matched
            if not sum(hmac.compare_digest(got, key) for key in self.keys):
                msg = "missing API key: send Authorization: Bearer <key>" if not got else "invalid API key"
                err = APIError(401, msg, None, "invalid_api_key")
                return await err.response()(scope, receive, counting_send)
        if self.server.draining and not open_route:
            return await SHUTTING_DOWN.response()(scope, receive, counting_send)
        return await self.app(scope, receive, counting_send)


def build_app(llm, served_model_name: str | list[str] | None = None, *, api_key: str | list[str] | None = None,
              allowed_adapter_dirs: list[str] | None = None, max_in_flight: int | None = 4096,
              request_timeout: float = 30.0, lora_search_dirs: list[str] | None = None,
              chat_template: str | None = None):
    """The FastAPI app over `llm`. The engine thread starts and stops with the app's lifespan.

    `app.state.server` is the `Server` (its `.engine` is the AsyncEngine, `.llm` the LLM).
    served_model_name and api_key: one or several (the first name is reported; any name and key is
    accepted). lora_search_dirs: adapters on first use. chat_template: a Jinja source in place of
    the tokenizer's. request_timeout: seconds a client has to send a request body (then 408)."""

    srv = Server(llm, served_model_name, api_key, allowed_adapter_dirs, max_in_flight, request_timeout,
                 lora_search_dirs, chat_template)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        srv.engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, srv.engine.shutdown)

    app = FastAPI(title="slora-jax", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = srv

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return e.response()

    @app.exception_handler(ClientGone)
    async def _gone(request, e):
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e):
        return APIError(400, str(e)).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e):
        code = "not_found" if e.status_code == 404 else None
        return APIError(e.status_code, str(e.detail), None, code).response()

    @app.exception_handler(Exception)
    async def _internal(request, e):
        log.exception("unhandled error")
        return APIError(500, hide_paths(f"internal error: {type(e).__name__}: {e}", srv.allowed), None,
                        "internal_error").response()

    too_large = bad(f"the request body is over {MAX_BODY_BYTES >> 20} MiB", None, "body_too_large")

    async def json_body(request: Request, model: type[BaseModel]) -> BaseModel:
        """The body as `model`, read within --request-timeout, parsed as JSON (parse_json_body's
        checks first) and validated off the event loop."""
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise too_large

        async def read() -> bytes:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise too_large
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            raw = await asyncio.wait_for(read(), srv.request_timeout)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within --request-timeout "
                           f"({srv.request_timeout:g} s)", None, "request_timeout") from None
        return await asyncio.to_thread(lambda: validate_body(model, parse_json_body(raw)))

    # -- generation endpoints ------------------------------------------------------------------

    async def generate(request: Request, req: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]],
                       adapter: str | None, chat: bool):
        sp, extras = sampling_params(req, chat=chat, limits=srv.limits, prompt_lens=[len(p) for p in prompts],
                                     adapter=adapter)
        model = req.model or srv.base
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        choices = srv.submit(prompts, sp, adapter, extras)
        part = PromptPart(srv, None if chat else req.prompt, prompts, extras)  # echo and prompt_logprobs

        def release_all():
            for c in choices:
                srv.engine.release(c.handle)

        if not extras["stream"]:
            try:
                await await_or_disconnect(request, srv.collect(choices), release_all)
            finally:
                release_all()
            srv.check_failed(choices)
            out, top = [], {}
            for c in choices:
                if chat:
                    ch = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                          "logprobs": srv.chat_logprobs(c, c.token_ids, c.logprobs),
                          "finish_reason": c.finish_reason}
                else:
                    ch = {"index": c.index, "text": c.text,
                          "logprobs": srv.completion_logprobs(c, c.token_ids, c.logprobs, part.offset(c)),
                          "finish_reason": c.finish_reason}
                top = part.first(c, ch, chat) or top  # chat: one prompt, one prompt_logprobs
                if extras["return_token_ids"]:
                    ch["token_ids"] = list(c.token_ids)
                    ch["prompt_token_ids"] = list(c.handle.prompt)
                out.append(ch)
            return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                 "created": created, "model": model, "choices": out,
                                 "usage": usage(choices), **top})

        # Streaming: wait for the first event before answering, so that an engine error or an
        # abort before any token still gets its own status code.
        events = srv.events(choices)
        try:
            first = await await_or_disconnect(request, events.__anext__(), release_all)
        except StopAsyncIteration:
            first = None
        except BaseException:
            release_all()
            raise
        if first is not None and first[0].finish_reason in ("abort", "error") and not first[2]:
            await events.aclose()
            release_all()
            srv.check_failed([first[0]])

        text_offsets = {c.index: part.offset(c) for c in choices}

        def chunk(c: Choice, text: str, ids: list[int], lps: list[float]) -> dict:
            if chat:
                delta = {"content": text} if text or c.finished else {}
                if c.index not in sent_role:
                    sent_role.add(c.index)
                    delta = {"role": "assistant", **delta, "content": text}
                ch = {"index": c.index, "delta": delta, "logprobs": srv.chat_logprobs(c, ids, lps),
                      "finish_reason": c.finish_reason}
            else:
                ch = {"index": c.index, "text": text,
                      "logprobs": srv.completion_logprobs(c, ids, lps, text_offsets[c.index]),
                      "finish_reason": c.finish_reason}
                text_offsets[c.index] += len(text)
            top = part.first(c, ch, chat) if c.index not in part.sent else {}
            if extras["return_token_ids"]:
                ch["token_ids"] = list(ids)
                if c.index not in sent_prompt:
                    sent_prompt.add(c.index)
                    ch["prompt_token_ids"] = list(c.handle.prompt)
            return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created, "model": model, "choices": [ch], **top}

        sent_role: set[int] = set()
        sent_prompt: set[int] = set()

        async def sse():
            try:
                if first is not None:
                    yield sse_event(chunk(*first))
                    async for ev in events:
                        yield sse_event(chunk(*ev))
                aborted = [c for c in choices if c.finish_reason == "abort"]
                if aborted:
                    err = APIError(503, f"the request was aborted: {aborted[0].abort_reason}", None, "aborted")
                    yield sse_event(err.body())
                failed = [c for c in choices if c.finish_reason == "error"]
                if failed:
                    yield sse_event(APIError(500, failed[0].error, None, failed[0].error_code).body())
                if extras["include_usage"]:
                    yield sse_event({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                "created": created, "model": model, "choices": [], "usage": usage(choices)})
                yield "data: [DONE]\n\n"
            except APIError as e:
                yield sse_event(e.body())
                yield "data: [DONE]\n\n"
            except Exception as e:  # noqa: BLE001 - a stream under way ends with an error event, never cut
                log.exception("unhandled error in a stream")
                yield sse_event(APIError(500, hide_paths(f"internal error: {type(e).__name__}: {e}", srv.allowed),
                                         None, "internal_error").body())
                yield "data: [DONE]\n\n"
            finally:
                await events.aclose()
                release_all()

        return SSEResponse(sse(), on_close=release_all)

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request):
        req = await json_body(request, CompletionRequest)
        adapter = await srv.resolve_model(req.model)
        prompts = await asyncio.to_thread(prompt_ids, req, srv.llm.tokenizer, srv.limits)
        return await generate(request, req, prompts, adapter, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        req = await json_body(request, ChatCompletionRequest)
        adapter = await srv.resolve_model(req.model)
        messages = chat_messages(req)
        if srv.llm.tokenizer is None:
            raise bad("this model has no tokenizer.json, so it cannot chat; use /v1/completions with "
                      "token ids", "messages")
        text_len = message_chars(messages)
        if text_len > srv.limits.max_model_len * CHARS_PER_TOKEN_LIMIT:
            raise bad(f"the messages' {text_len} characters (roles and template included) are far over "
                      f"the maximum context length of {srv.limits.max_model_len} tokens", "messages",
                      "context_length_exceeded")
        ids = await asyncio.to_thread(srv.chat.encode, messages)
        return await generate(request, req, [ids], adapter, chat=True)

    # -- models and adapters -------------------------------------------------------------------

    @app.get("/v1/models")
    async def models():
        base = {"id": srv.base, "object": "model", "created": srv.created, "owned_by": "slora-jax",
                "root": srv.base, "parent": None, "max_model_len": srv.limits.max_model_len}
        data = [base]
        for name, entry in sorted(dict(srv.llm.store.entries).items()):  # a copy: the engine thread may add
            data.append({"id": name, "object": "model", "created": srv.created, "owned_by": "slora-jax",
                         "root": srv.shown_path(entry.path, name), "parent": srv.base,
                         "max_model_len": srv.limits.max_model_len})
        return {"object": "list", "data": data}

    @app.get("/v1/adapters")
    async def adapters():
        """Each adapter's place (device pool, host memory) and its running and waiting requests:
        for a router that sends a request where its adapter is already warm."""
        try:
            data = await srv.engine.call(srv.llm.adapter_status)
        except EngineError as e:
            raise from_engine_error(e) from None
        for a in data:
            if "path" in a:
                a["path"] = srv.shown_path(a["path"], a.get("name", ""))
        return {"object": "list", "data": [{"object": "lora_adapter", **a} for a in data]}

    @app.post("/v1/load_lora_adapter", openapi_extra=request_body(LoadAdapterRequest))
    async def load_lora_adapter(request: Request):
        req = await json_body(request, LoadAdapterRequest)
        name, inplace = req.lora_name, bool(req.load_inplace)
        if name in srv.base_names:
            raise bad(f"{name!r} is the base model's name", "lora_name")
        exists = bad(f"The lora adapter '{name}' has already been loaded; pass load_inplace: true to "
                     "replace it", "lora_name", "adapter_exists")
        if name in srv.llm.store.entries and not inplace:
            raise exists
        real = check_adapter_path(req.lora_path, srv.allowed)

        def load():
            # Checked again on the engine thread, where loads run one at a time: of several
            # concurrent first loads of one name, one registers it and the others see it loaded,
            # exactly as if they had come one after another.
            if name in srv.llm.store.entries and not inplace:
                raise exists
            srv.llm.load_adapter(name, real)
        try:
            await srv.engine.call(load)
        except APIError:
            raise
        except EngineError as e:
            raise from_engine_error(e) from None
        except (ValueError, OSError) as e:
            raise bad(hide_paths(f"cannot load adapter {name!r}: {e}", srv.allowed), "lora_path",
                      "invalid_adapter") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", openapi_extra=request_body(UnloadAdapterRequest))
    async def unload_lora_adapter(request: Request):
        name = (await json_body(request, UnloadAdapterRequest)).lora_name
        if name in srv.base_names:
            raise bad("the base model cannot be unloaded", "lora_name")
        try:
            await srv.engine.call(lambda: srv.llm.unload_adapter(name))
        except KeyError:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name",
                           "model_not_found") from None
        except RuntimeError as e:
            if isinstance(e, EngineError):
                raise from_engine_error(e) from None
            raise bad(str(e), "lora_name", "adapter_busy") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    # -- operations ----------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if srv.draining:
            return SHUTTING_DOWN.response()
        if not srv.engine.alive:
            return APIError(503, "the engine is not running", None, "engine_dead", retry_after=5).response()
        return Response(status_code=200)

    @app.get("/stats")
    async def stats():
        try:
            s = await srv.engine.stats()
        except EngineError as e:
            raise from_engine_error(e) from None
        return {**s, "requests_in_flight": srv.engine.in_flight}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        if srv.engine.alive:
            try:
                await asyncio.wait_for(srv.engine.stats(), timeout=5)
            except (asyncio.TimeoutError, EngineError):
                pass  # serve the last snapshot
        return Response(generate_latest(srv.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(_AuthAndCount, server=srv)
    return app
