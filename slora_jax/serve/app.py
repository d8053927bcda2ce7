"""`slora-jax serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one `LLM`.

Endpoints (vLLM's names and shapes where vLLM has them):

    POST /v1/completions          prompt: str | [str] | [int] | [[int]]; stream: true -> SSE
    POST /v1/chat/completions     messages through the chat template; stream: true -> SSE
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

`model` in a request is the base model's name (--served-model-name, default the --model argument) or
an adapter's name; omitted, it is the base model. With --api-key, every /v1 route wants
`Authorization: Bearer <key>`.

Sampling parameters: max_tokens (max_completion_tokens for chat), temperature [0, 2], top_p, seed,
stop (strings), logprobs (completions: int 0..5; chat: bool + top_logprobs 0..20), n=1, and vLLM's
extensions top_k, stop_token_ids, ignore_eos, return_token_ids (adds `token_ids` and
`prompt_token_ids` to each choice), and ttft_slo (seconds: the scheduler aborts the request, 503,
when its first token cannot come in time). Only the sampled token's logprob is computed: a `top_logprobs`
list holds that one token. Penalties, logit_bias, echo, best_of>1, suffix and tools are refused with
400 rather than silently ignored.

Chat prompts: the `chat_template` of the model directory's tokenizer_config.json, rendered with
jinja2 (sandboxed) as Hugging Face does (messages, add_generation_prompt=True, bos_token, eos_token),
and tokenized without adding special tokens. Without a template the fallback is one line per message,
"{role}: {content}\\n", then "assistant:", tokenized with the tokenizer's special tokens (BOS).

Errors come in OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 invalid input,
401 API key, 404 unknown model or route, 429 too many requests in flight (Retry-After), 503 a request
the engine aborted (no room, shutdown) or a dead engine (Retry-After), 500 an engine failure.

Threading: see async_engine.py. The engine runs on its own thread; HTTP handlers run on uvicorn's
event loop and never touch the engine except through `AsyncEngine`.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from slora_jax.serve.async_engine import AsyncEngine, Delta, EngineError, EngineMetrics, RequestHandle
from slora_jax.sampling import SamplingParams

log = logging.getLogger("slora_jax.serve.app")

MAX_STOP_STRINGS = 16
MAX_BATCH_PROMPTS = 256
MAX_BODY_BYTES = 16 << 20
CHARS_PER_TOKEN_LIMIT = 64   # text longer than max_model_len * this is refused before tokenizing
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+\-]{0,255}$")


# ---------------------------------------------------------------------------------------------
# errors

class APIError(Exception):
    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
             429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = \
            status, message, param, code, retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self):
        headers = {"Retry-After": str(int(max(1, round(self.retry_after))))} if self.retry_after else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


def from_engine_error(e: EngineError) -> APIError:
    code = {404: "model_not_found", 429: "rate_limit_exceeded", 503: "overloaded"}.get(e.status)
    return APIError(e.status, str(e), None, code, e.retry_after)


class ClientGone(Exception):
    """The client disconnected before we answered."""


# ---------------------------------------------------------------------------------------------
# request validation (plain JSON, checked by hand so every message names its parameter)

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _get_int(body: dict, name: str, lo: int | None = None, hi: int | None = None, default=None):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise bad(f"{name} must be an integer, got {json.dumps(v)}", name, "invalid_type")
    if lo is not None and v < lo:
        raise bad(f"{name} must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise bad(f"{name} must be <= {hi}, got {v}", name)
    return v


def _get_num(body: dict, name: str, lo: float, hi: float, default, lo_open: bool = False):
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v):
        raise bad(f"{name} must be a number, got {json.dumps(v)}", name, "invalid_type")
    v = float(v)
    if not (lo < v if lo_open else lo <= v) or not v <= hi:
        raise bad(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v:g}", name)
    return v


def _get_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{name} must be true or false, got {json.dumps(v)}", name, "invalid_type")
    return v


def _refuse_unsupported(body: dict) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        v = body.get(name)
        if v is not None and (not _is_num(v) or v != 0):
            raise bad(f"{name} is not supported (only 0)", name, "unsupported_parameter")
    v = body.get("repetition_penalty")
    if v is not None and (not _is_num(v) or v != 1):
        raise bad("repetition_penalty is not supported (only 1)", "repetition_penalty", "unsupported_parameter")
    if body.get("logit_bias"):
        raise bad("logit_bias is not supported", "logit_bias", "unsupported_parameter")
    if body.get("echo"):
        raise bad("echo is not supported", "echo", "unsupported_parameter")
    if body.get("suffix"):
        raise bad("suffix is not supported", "suffix", "unsupported_parameter")
    if body.get("best_of") not in (None, 1):
        raise bad("best_of is not supported (only 1)", "best_of", "unsupported_parameter")
    if body.get("tools"):
        raise bad("tools are not supported", "tools", "unsupported_parameter")
    n = _get_int(body, "n", 1, None, 1)
    if n != 1:
        raise bad(f"n={n} is not supported (only 1)", "n", "unsupported_parameter")


class _Limits:
    """What a request may ask for, from the model and the pool (immutable after start)."""

    def __init__(self, llm):
        self.max_model_len = llm.max_model_len
        self.vocab = llm.cfg.vocab_size
        self.pool = llm.engine.pool
        self.kv_pages_for = llm.engine.kv_pages_for
        self.store = llm.store

    def max_new_tokens(self, prompt_len: int, adapter: str | None) -> int:
        """The most tokens a prompt may ask for: the context length, and what fits the pool alone."""
        entry = self.store.entries.get(adapter) if adapter else None
        pages = self.pool.kv_capacity(entry.layout.pages if entry else 0)
        lo, hi = 0, max(self.max_model_len - prompt_len, 0)
        while lo < hi:  # the largest n with kv_pages_for(prompt_len + n) <= pages
            mid = (lo + hi + 1) // 2
            if self.kv_pages_for(prompt_len + mid) <= pages:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _sampling(body: dict, *, chat: bool, limits: _Limits, prompt_lens: list[int],
              adapter: str | None) -> tuple[SamplingParams, dict]:
    """SamplingParams for every prompt of the request, and the server-side extras."""
    _refuse_unsupported(body)
    if chat:
        mt_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    else:
        mt_name = "max_tokens"
    max_tokens = _get_int(body, mt_name, 1, None)
    longest = max(prompt_lens)
    ctx = limits.max_model_len
    if longest >= ctx:
        raise bad(f"This model's maximum context length is {ctx} tokens, but the prompt has {longest} tokens",
                  "messages" if chat else "prompt", "context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(16, ctx - longest) if not chat else limits.max_new_tokens(longest, adapter)
        if max_tokens < 1:
            raise bad(f"the prompt of {longest} tokens leaves no room to generate in the pool",
                      "messages" if chat else "prompt", "context_length_exceeded")
    elif longest + max_tokens > ctx:
        raise bad(f"This model's maximum context length is {ctx} tokens. However, you requested "
                  f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} for the "
                  f"completion). Please reduce the prompt or {mt_name}.", mt_name, "context_length_exceeded")
    temperature = _get_num(body, "temperature", 0.0, 2.0, 1.0)
    top_p = _get_num(body, "top_p", 0.0, 1.0, 1.0, lo_open=True)
    top_k = _get_int(body, "top_k", -1, None, 0)
    seed = _get_int(body, "seed")
    ignore_eos = _get_bool(body, "ignore_eos")
    ttft_slo = _get_num(body, "ttft_slo", 0.0, 3600.0, None, lo_open=True)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(_is_int(t) and 0 <= t < limits.vocab for t in stop_ids):
            raise bad(f"stop_token_ids must be a list of token ids in [0, {limits.vocab})", "stop_token_ids")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop must be a non-empty string or a list of non-empty strings", "stop", "invalid_type")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    if chat:
        want_lp = _get_bool(body, "logprobs")
        top_lp = _get_int(body, "top_logprobs", 0, 20)
        if top_lp is not None and not want_lp:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        lp = (top_lp or 0) if want_lp else None
    else:
        lp = _get_int(body, "logprobs", 0, 5)
    stream = _get_bool(body, "stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise bad("stream_options must be an object", "stream_options", "invalid_type")
    include_usage = bool(so and _get_bool(so, "include_usage"))
    try:
        sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop_token_ids=stop_ids, logprobs=lp is not None, ignore_eos=ignore_eos,
                            **({"ttft_slo": ttft_slo} if ttft_slo is not None else {}))
    except ValueError as e:  # anything the checks above missed
        raise bad(str(e)) from None
    return sp, dict(stop=stop, logprobs=lp, stream=stream, include_usage=include_usage,
                    return_token_ids=_get_bool(body, "return_token_ids"))


# ---------------------------------------------------------------------------------------------
# chat template

class ChatFormatter:
    """messages -> prompt token ids, through the model's chat template when it has one:
    tokenizer_config.json's chat_template, else a chat_template.jinja file beside it."""

    def __init__(self, model_dir: str | None, tokenizer):
        self.tokenizer = tokenizer
        self.template = None
        self.special: dict[str, str] = {}
        self._raw = None
        if model_dir is None or tokenizer is None:
            return
        cfg_file = Path(model_dir) / "tokenizer_config.json"
        jinja_file = Path(model_dir) / "chat_template.jinja"  # where newer checkpoints (Qwen3) keep it
        conf = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        tmpl = conf.get("chat_template")
        if isinstance(tmpl, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
            tmpl = named.get("default") or next(iter(named.values()), None)
        if not tmpl and jinja_file.is_file():
            tmpl = jinja_file.read_text()
        if not tmpl:
            return
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            v = conf.get(key)
            if isinstance(v, dict):
                v = v.get("content")
            if isinstance(v, str):
                self.special[key] = v
        self.template = self._compile(tmpl)
        from tokenizers import Tokenizer as HFTokenizer
        self._raw = HFTokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))

    @staticmethod
    def _compile(source: str):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        return env.from_string(source)

    def render(self, messages: list[dict]) -> str:
        if self.template is None:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        import jinja2
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.special)
        except jinja2.TemplateError as e:
            raise bad(f"the chat template refused these messages: {e}", "messages") from None

    def encode(self, messages: list[dict]) -> list[int]:
        text = self.render(messages)
        if self.template is None:
            return self.tokenizer.encode(text)
        return self._raw.encode(text, add_special_tokens=False).ids


def _parse_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages must be a non-empty list", "messages", "invalid_type")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", where, "invalid_type")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"{where}.role must be one of system, developer, user, assistant, tool; got "
                      f"{json.dumps(role)}", f"{where}.role")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise bad(f"{where}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                              "are supported", f"{where}.content", "invalid_type")
                parts.append(p["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad(f"{where}.content must be a string or a list of text parts", f"{where}.content",
                      "invalid_type")
        msg = {"role": role, "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    if all(not m["content"] for m in out):
        raise bad("messages are all empty", "messages")
    return out


# ---------------------------------------------------------------------------------------------
# detokenizing and stop strings

class _Choice:
    """One prompt of a request: what was generated, and the text sent so far."""

    def __init__(self, index: int, handle: RequestHandle, tokenizer, stop: list[str], logprobs: int | None):
        self.index, self.handle, self.tok, self.stop = index, handle, tokenizer, stop
        self.want_lp = logprobs
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.abort_reason: str | None = None
        self._hold = max((len(s) for s in stop), default=1) - 1

    def feed(self, d: Delta) -> tuple[str, list[int], list[float]]:
        """New text, token ids and logprobs to send for delta `d` (stop strings applied)."""
        n0, t0 = len(self.token_ids), len(self.text)
        self.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            self.logprobs.extend(d.logprobs)
        finished = d.finish_reason is not None
        if finished:
            self.finish_reason, self.abort_reason = d.finish_reason, d.abort_reason
        if self.tok is not None:
            # As LLM.generate: a stop token (EOS or stop_token_ids) ends the text, unshown.
            shown = self.token_ids[:-1] if d.finish_reason == "stop" else self.token_ids
            full = self.tok.decode(shown)
            end = len(full)
            if self.stop:
                hit = min(((i, s) for s in self.stop if (i := full.find(s, max(0, t0 - len(s)))) >= 0),
                          default=None)
                if hit is not None:
                    full, end = full[:hit[0]], hit[0]
                    self.finish_reason, finished = "stop", True
            if not finished:
                while end > t0 and full[end - 1] == "\ufffd":  # an incomplete UTF-8 sequence
                    end -= 1
                end = max(t0, min(end, len(full) - self._hold))
            self.text = full[:end]
        return self.text[t0:], self.token_ids[n0:], self.logprobs[n0:]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# ---------------------------------------------------------------------------------------------
# the app

class Server:
    """The state behind one FastAPI app: the LLM, its AsyncEngine, metrics and options."""

    def __init__(self, llm, served_model_name: str, api_key: str | None = None,
                 allowed_adapter_dirs: list[str] | None = None, max_in_flight: int | None = 4096):
        from prometheus_client import CollectorRegistry, Counter
        self.llm = llm
        self.base = served_model_name
        self.api_key = api_key
        self.allowed = [os.path.realpath(d) for d in (allowed_adapter_dirs or [])]
        self.registry = CollectorRegistry()
        self.metrics = EngineMetrics(self.registry, served_model_name)
        self.http_responses = Counter("slora_http_responses", "HTTP responses by status", ["status"],
                                      registry=self.registry)
        self.engine = AsyncEngine(llm, self.metrics, max_in_flight)
        self.registry.register(_EngineCollector(self))
        self.limits = _Limits(llm)
        self.chat = ChatFormatter(llm.model if Path(llm.model).is_dir() else None, llm.tokenizer)
        self.created = int(time.time())
        self._pieces = None
        if llm.tokenizer is not None and Path(llm.model).is_dir():
            from tokenizers import Tokenizer as HFTokenizer
            self._pieces = HFTokenizer.from_file(str(Path(llm.model) / "tokenizer.json"))

    # -- helpers -------------------------------------------------------------------------------

    def resolve_model(self, body: dict) -> str | None:
        """The adapter a request asks for (None: the base model); 404 for an unknown name."""
        model = body.get("model")
        if model is None or model == self.base:
            return None
        if not isinstance(model, str):
            raise bad(f"model must be a string, got {json.dumps(model)}", "model", "invalid_type")
        if model not in self.llm.store.entries:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
        return model

    def tokenize(self, prompt, param: str) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise bad("the prompt is empty", param)
            if self.llm.tokenizer is None:
                raise bad("this model has no tokenizer.json: send token ids", param)
            if len(prompt) > self.limits.max_model_len * CHARS_PER_TOKEN_LIMIT:
                raise bad(f"the prompt of {len(prompt)} characters is far over the maximum context length "
                          f"of {self.limits.max_model_len} tokens", param, "context_length_exceeded")
            return self.llm.tokenizer.encode(prompt)
        if not prompt:
            raise bad("the prompt is empty", param)
        if not all(_is_int(t) for t in prompt):
            raise bad("a token-id prompt must be a list of integers", param, "invalid_type")
        v = self.limits.vocab
        if not all(0 <= t < v for t in prompt):
            raise bad(f"token ids must be in [0, {v})", param)
        return list(prompt)

    def prompts(self, body: dict) -> list[list[int]]:
        p = body.get("prompt")
        if isinstance(p, str):
            return [self.tokenize(p, "prompt")]
        if isinstance(p, list) and p and all(_is_int(t) for t in p):
            return [self.tokenize(p, "prompt")]
        if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            if len(p) > MAX_BATCH_PROMPTS:
                raise bad(f"at most {MAX_BATCH_PROMPTS} prompts per request", "prompt")
            return [self.tokenize(x, f"prompt[{i}]") for i, x in enumerate(p)]
        if p is None:
            raise bad("prompt is required", "prompt", "missing_required_parameter")
        if isinstance(p, list) and not p:
            raise bad("the prompt is empty", "prompt")
        raise bad("prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                  "token ids", "prompt", "invalid_type")

    def piece(self, t: int) -> str:
        p = self._pieces.id_to_token(t) if self._pieces is not None else None
        return p if p is not None else f"token_id:{t}"

    def check_adapter_path(self, path: str) -> str:
        """The real path of an adapter directory inside an allowed directory; 400 otherwise."""
        if not self.allowed:
            raise bad("loading adapters at run time is disabled: start the server with --allowed-adapter-dirs",
                      "lora_path", "path_not_allowed")
        if "\x00" in path:
            raise bad("lora_path contains a NUL byte", "lora_path", "path_not_allowed")
        real = os.path.realpath(path)

        def inside(p: str) -> bool:
            return any(os.path.commonpath([p, root]) == root for root in self.allowed)

        if not inside(real):
            raise bad(f"lora_path {path!r} is not inside --allowed-adapter-dirs (symlinks and '..' are "
                      "resolved first)", "lora_path", "path_not_allowed")
        if not os.path.isdir(real):
            raise bad(f"lora_path {path!r} is not a directory", "lora_path", "invalid_adapter")
        for f in os.listdir(real):  # a file inside that links out is refused too
            if not inside(os.path.realpath(os.path.join(real, f))):
                raise bad(f"lora_path {path!r}: {f} links outside --allowed-adapter-dirs", "lora_path",
                          "path_not_allowed")
        return real

    # -- generation ----------------------------------------------------------------------------

    def submit(self, prompts: list[list[int]], sp: SamplingParams, adapter: str | None,
               extras: dict) -> list[_Choice]:
        q: asyncio.Queue = asyncio.Queue()
        choices = []
        try:
            for i, p in enumerate(prompts):
                h = self.engine.submit(p, sp, adapter, sp.seed, queue=q, index=i)
                choices.append(_Choice(i, h, self.llm.tokenizer, extras["stop"], extras["logprobs"]))
        except EngineError as e:
            for c in choices:
                self.engine.release(c.handle)
            raise from_engine_error(e) from None
        return choices

    async def events(self, choices: list[_Choice]):
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

    async def collect(self, choices: list[_Choice]) -> None:
        async for _ in self.events(choices):
            pass

    def check_aborted(self, choices: list[_Choice]) -> None:
        for c in choices:
            if c.finish_reason == "abort":
                raise APIError(503, f"the request was aborted: {c.abort_reason or 'no room'}; retry later",
                               None, "aborted", retry_after=1)

    def usage(self, choices: list[_Choice]) -> dict:
        p = sum(len(c.handle.prompt) for c in choices)
        g = sum(len(c.token_ids) for c in choices)
        return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}

    def completion_logprobs(self, c: _Choice, ids: list[int], lps: list[float], offset: int) -> dict | None:
        if c.want_lp is None:
            return None
        toks = [self.piece(t) for t in ids]
        offsets, at = [], offset
        for t in ids:
            offsets.append(at)
            at += len(self.llm.tokenizer.decode([t])) if self.llm.tokenizer else 0
        return {"tokens": toks, "token_logprobs": list(lps),
                "top_logprobs": [{tok: lp} for tok, lp in zip(toks, lps)] if c.want_lp > 0 else None,
                "text_offset": offsets}

    def chat_logprobs(self, c: _Choice, ids: list[int], lps: list[float]) -> dict | None:
        if c.want_lp is None:
            return None
        content = []
        for t, lp in zip(ids, lps):
            tok = self.piece(t)
            entry = {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}
            entry["top_logprobs"] = [dict(entry)] if c.want_lp > 0 else []
            content.append(entry)
        return {"content": content}


class _EngineCollector:
    """Gauges from the last Engine.stats() snapshot (refreshed by /metrics on the engine thread)."""

    def __init__(self, server: Server):
        self.server = server

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily
        s = self.server
        for key, value in sorted(s.engine.last_stats.items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                g = GaugeMetricFamily(f"slora_engine_{key}", f"Engine.stats()['{key}']")
                g.add_metric([], float(value))
                yield g
        phases = s.engine.last_stats.get("host_seconds") or {}
        if phases:
            from prometheus_client.core import CounterMetricFamily
            c = CounterMetricFamily("slora_engine_step_phase_seconds",
                                    "Seconds of engine steps by phase (host work vs device wait)", labels=["phase"])
            for phase, seconds in sorted(phases.items()):
                c.add_metric([phase], float(seconds))
            yield c
        g = GaugeMetricFamily("slora_requests_in_flight", "Requests accepted and not yet answered")
        g.add_metric([], float(s.engine.in_flight))
        yield g
        g = GaugeMetricFamily("slora_registered_adapters", "Adapters registered in the host store")
        g.add_metric([], float(len(s.llm.store.entries)))
        yield g
        g = GaugeMetricFamily("slora_engine_alive", "1 while the engine thread runs")
        g.add_metric([], 1.0 if s.engine.alive else 0.0)
        yield g


class _AuthAndCount:
    """ASGI middleware: the API key on /v1 routes, and a response counter by status."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server
        self.key = f"Bearer {server.api_key}".encode() if server.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        counter = self.server.http_responses

        async def counting_send(message):
            if message["type"] == "http.response.start":
                counter.labels(str(message["status"])).inc()
            await send(message)

        if self.key is not None and scope["path"].startswith("/v1"):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.key):
                msg = "missing API key: send Authorization: Bearer <key>" if not got else "invalid API key"
                err = APIError(401, msg, None, "invalid_api_key")
                return await err.response()(scope, receive, counting_send)
        return await self.app(scope, receive, counting_send)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _await_or_disconnect(request, awaitable, on_disconnect=None):
    """Await `awaitable` unless the client disconnects first (then cancel it and raise ClientGone)."""
    task = asyncio.ensure_future(awaitable)

    async def disconnected():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - cancelled on purpose
        pass
    if on_disconnect is not None:
        on_disconnect()
    raise ClientGone()


def build_app(llm, served_model_name: str | None = None, *, api_key: str | None = None,
              allowed_adapter_dirs: list[str] | None = None, max_in_flight: int | None = 4096):
    """The FastAPI app over `llm`. The engine thread starts and stops with the app's lifespan.

    `app.state.server` is the `Server` (its `.engine` is the AsyncEngine, `.llm` the LLM)."""
    import contextlib

    srv = Server(llm, served_model_name or Path(str(llm.model)).name, api_key, allowed_adapter_dirs,
                 max_in_flight)

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
        return APIError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error").response()

    async def json_body(request: Request) -> dict:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise bad(f"the request body is over {MAX_BODY_BYTES >> 20} MiB", None, "body_too_large")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise bad(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object", None, "invalid_json")
        return body

    # -- generation endpoints ------------------------------------------------------------------

    async def generate(request: Request, body: dict, prompts: list[list[int]], adapter: str | None,
                       chat: bool):
        sp, extras = _sampling(body, chat=chat, limits=srv.limits, prompt_lens=[len(p) for p in prompts],
                               adapter=adapter)
        model = body.get("model") or srv.base
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        choices = srv.submit(prompts, sp, adapter, extras)

        def release_all():
            for c in choices:
                srv.engine.release(c.handle)

        if not extras["stream"]:
            try:
                await _await_or_disconnect(request, srv.collect(choices), release_all)
            finally:
                release_all()
            srv.check_aborted(choices)
            out = []
            for c in choices:
                if chat:
                    ch = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                          "logprobs": srv.chat_logprobs(c, c.token_ids, c.logprobs),
                          "finish_reason": c.finish_reason}
                else:
                    ch = {"index": c.index, "text": c.text,
                          "logprobs": srv.completion_logprobs(c, c.token_ids, c.logprobs, 0),
                          "finish_reason": c.finish_reason}
                if extras["return_token_ids"]:
                    ch["token_ids"] = list(c.token_ids)
                    ch["prompt_token_ids"] = list(c.handle.prompt)
                out.append(ch)
            return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                 "created": created, "model": model, "choices": out,
                                 "usage": srv.usage(choices)})

        # Streaming: wait for the first event before answering, so that an engine error or an
        # abort before any token still gets its own status code.
        events = srv.events(choices)
        try:
            first = await _await_or_disconnect(request, events.__anext__(), release_all)
        except StopAsyncIteration:
            first = None
        except BaseException:
            release_all()
            raise
        if first is not None and first[0].finish_reason == "abort" and not first[2]:
            await events.aclose()
            release_all()
            srv.check_aborted([first[0]])

        text_offsets = {c.index: 0 for c in choices}

        def chunk(c: _Choice, text: str, ids: list[int], lps: list[float]) -> dict:
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
            if extras["return_token_ids"]:
                ch["token_ids"] = list(ids)
                if c.index not in sent_prompt:
                    sent_prompt.add(c.index)
                    ch["prompt_token_ids"] = list(c.handle.prompt)
            return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created, "model": model, "choices": [ch]}

        sent_role: set[int] = set()
        sent_prompt: set[int] = set()

        async def sse():
            try:
                if first is not None:
                    yield _sse(chunk(*first))
                    async for ev in events:
                        yield _sse(chunk(*ev))
                aborted = [c for c in choices if c.finish_reason == "abort"]
                if aborted:
                    err = APIError(503, f"the request was aborted: {aborted[0].abort_reason}", None, "aborted")
                    yield _sse(err.body())
                if extras["include_usage"]:
                    yield _sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                "created": created, "model": model, "choices": [], "usage": srv.usage(choices)})
                yield "data: [DONE]\n\n"
            except APIError as e:
                yield _sse(e.body())
                yield "data: [DONE]\n\n"
            finally:
                await events.aclose()
                release_all()

        return _SSEResponse(sse(), on_close=release_all)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await json_body(request)
        adapter = srv.resolve_model(body)
        return await generate(request, body, srv.prompts(body), adapter, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await json_body(request)
        adapter = srv.resolve_model(body)
        messages = _parse_messages(body)
        if srv.llm.tokenizer is None:
            raise bad("this model has no tokenizer.json, so it cannot chat; use /v1/completions with "
                      "token ids", "messages")
        text_len = sum(len(m["content"]) for m in messages)
        if text_len > srv.limits.max_model_len * CHARS_PER_TOKEN_LIMIT:
            raise bad(f"the messages' {text_len} characters are far over the maximum context length",
                      "messages", "context_length_exceeded")
        ids = srv.chat.encode(messages)
        return await generate(request, body, [ids], adapter, chat=True)

    # -- models and adapters -------------------------------------------------------------------

    @app.get("/v1/models")
    async def models():
        base = {"id": srv.base, "object": "model", "created": srv.created, "owned_by": "slora-jax",
                "root": srv.llm.model, "parent": None, "max_model_len": srv.limits.max_model_len}
        data = [base]
        for name, entry in sorted(dict(srv.llm.store.entries).items()):  # a copy: the engine thread may add
            data.append({"id": name, "object": "model", "created": srv.created, "owned_by": "slora-jax",
                         "root": entry.path, "parent": srv.base, "max_model_len": srv.limits.max_model_len})
        return {"object": "list", "data": data}

    @app.get("/v1/adapters")
    async def adapters():
        """Each adapter's place (device pool, host memory) and its running and waiting requests:
        for a router that sends a request where its adapter is already warm."""
        try:
            data = await srv.engine.call(srv.llm.adapter_status)
        except EngineError as e:
            raise from_engine_error(e) from None
        return {"object": "list", "data": [{"object": "lora_adapter", **a} for a in data]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await json_body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not ADAPTER_NAME.match(name):
            raise bad("lora_name must be a name of 1-256 characters: letters, digits and ._:/@+-",
                      "lora_name", "invalid_type" if not isinstance(name, str) else "invalid_value")
        if not isinstance(path, str) or not path:
            raise bad("lora_path must be a non-empty string", "lora_path", "invalid_type")
        if name == srv.base:
            raise bad(f"{name!r} is the base model's name", "lora_name")
        inplace = _get_bool(body, "load_inplace")
        if name in srv.llm.store.entries and not inplace:
            raise bad(f"The lora adapter '{name}' has already been loaded; pass load_inplace: true to "
                      "replace it", "lora_name", "adapter_exists")
        real = srv.check_adapter_path(path)
        try:
            await srv.engine.call(lambda: srv.llm.load_adapter(name, real))
        except EngineError as e:
            raise from_engine_error(e) from None
        except (ValueError, OSError) as e:
            raise bad(f"cannot load adapter {name!r}: {e}", "lora_path", "invalid_adapter") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await json_body(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise bad("lora_name must be a non-empty string", "lora_name", "invalid_type")
        if name == srv.base:
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


class _SSEResponse(StreamingResponse):
    """Server-sent events that stop (and abort the request) as soon as the client disconnects,
    whatever the ASGI spec version, and always close their generator."""

    def __init__(self, gen, on_close):
        super().__init__(gen, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.gen, self.on_close = gen, on_close

    async def __call__(self, scope, receive, send):
        async def pump():
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.gen:
                await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch():
            while True:
                if (await receive())["type"] == "http.disconnect":
                    return

        pump_t, watch_t = asyncio.ensure_future(pump()), asyncio.ensure_future(watch())
        try:
            await asyncio.wait({pump_t, watch_t}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (pump_t, watch_t):
                t.cancel()
            for t in (pump_t, watch_t):
                try:
                    await t
                except (asyncio.CancelledError, OSError):
                    pass
                except Exception:  # noqa: BLE001 - the client is gone; nothing to tell it
                    log.debug("stream ended with an error", exc_info=True)
            await self.gen.aclose()
            self.on_close()


# ---------------------------------------------------------------------------------------------
# running it

def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


class ServerThread:
    """Run an app with uvicorn on a background thread (tests, notebooks). port 0: a free port."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5,
                                                    timeout_keep_alive=30))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="slora-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()


def warmup(llm, workers: int = 1, lora: bool = True) -> None:
    """Compile before serving (Engine.warmup): every step bucket up to max_model_len, for the base
    model and, with `lora`, for batches of the adapters registered at start-up (their target
    modules, every slot bucket). Batches on other module sets compile on first use."""
    llm.warmup(max_context=llm.max_model_len, workers=workers, lora=lora)


def parse_lora_modules(items: list[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        if item.lstrip().startswith("{"):
            d = json.loads(item)
            out[d["name"]] = d["path"]
        elif "=" in item:
            name, path = item.split("=", 1)
            out[name] = path
        else:
            raise SystemExit(f"--lora-modules: expected name=path or a JSON object, got {item!r}")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="slora-jax serve", description="OpenAI-compatible server for one base "
                                 "model and many LoRA adapters. Without --model: the embedded default (the "
                                 "tiny demo model with generated adapters).")
    ap.add_argument("--model", default=None, help="HF model directory or a configs/models shape name")
    ap.add_argument("--served-model-name", default=None, help="the base model's name in the API "
                    "(default: --model as given; 'tiny' for the embedded default)")
    ap.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                    help="adapters registered at start-up: name=path or '{\"name\": ..., \"path\": ...}'")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="default bfloat16 (float32 for the embedded default)")
    ap.add_argument("--quantization", default=None, choices=["int8"],
                    help="int8: the base model's projection weights in int8 with per-row scales (half their "
                    "memory, which goes to the adapter/KV page pool); default: the model's dtype")
    ap.add_argument("--max-lora-rank", type=int, default=None, help="default 64 (32 for the embedded default)")
    ap.add_argument("--max-loras", type=int, default=64, help="distinct adapters per batch")
    ap.add_argument("--max-cpu-loras", type=int, default=256, help="adapters whose weights stay in host memory")
    ap.add_argument("--max-cpu-lora-gb", type=float, default=None,
                    help="GiB of adapter weights host memory may hold (default: 40%% of the machine's memory)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default 64 (16 for the embedded default)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="prefill tokens per step")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pool-pages", type=int, default=None, help="default: from --gpu-memory-utilization "
                    "(256 for the embedded default)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                    help="fraction of the device memory left after the weights that the pool takes")
    ap.add_argument("--max-queued-requests", type=int, default=4096,
                    help="requests in flight beyond --max-num-seqs before new ones get 429")
    ap.add_argument("--ttft-slo", type=float, default=None, help="default time-to-first-token objective "
                    "(s): queued requests that cannot meet it are aborted early (503)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=os.environ.get("SLORA_API_KEY"),
                    help="require Authorization: Bearer <key> on /v1 routes (env SLORA_API_KEY)")
    ap.add_argument("--allowed-adapter-dirs", nargs="+", default=None, metavar="DIR",
                    help="directories that /v1/load_lora_adapter may load from (default: none, loading "
                    "at run time is off)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-warmup", action="store_true", help="skip compiling the step shapes at start-up")
    ap.add_argument("--warmup-workers", type=int, default=1, help="threads compiling the step shapes")
    ap.add_argument("--compile-per-layer", action="store_true",
                    help="compile one decoder layer per step shape instead of the unrolled model (much "
                    "shorter start-up and first-use compiles, a dispatch per layer per step)")
    ap.add_argument("--overlap-steps", action=argparse.BooleanOptionalAction, default=None,
                    help="dispatch each step before the previous one's tokens reach the host, so "
                    "scheduling overlaps the device (default: on for a GPU, off on a CPU)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="devices the model is split over (Megatron weights, the page pool split along "
                    "its row width, S-LoRA's adapter layout; vLLM's flag name)")
    ap.add_argument("--log-level", default="warning", help="uvicorn's log level (info shows each request)")
    args = ap.parse_args(argv)

    from slora_jax import LLM

    model, adapters, name, dtype = args.model, parse_lora_modules(args.lora_modules), args.served_model_name, \
        args.dtype
    max_num_seqs, pool_pages, max_rank = args.max_num_seqs or 64, args.pool_pages, args.max_lora_rank or 64
    if model is None:  # the embedded default: what `make demo` runs
        from slora_jax.demo import prepare
        model_dir, demo_adapters = prepare(Path.home() / ".cache" / "slora_jax" / "demo", 32, 0)
        model, name, dtype = str(model_dir), name or "tiny", dtype or "float32"
        adapters = {**demo_adapters, **adapters}
        max_num_seqs, pool_pages, max_rank = args.max_num_seqs or 16, pool_pages or 256, args.max_lora_rank or 32
    llm = LLM(model, adapters=adapters, dtype=dtype or "bfloat16", seed=args.seed, quantization=args.quantization,
              max_model_len=args.max_model_len, page_size=args.page_size, pool_pages=pool_pages,
              memory_fraction=args.gpu_memory_utilization, max_num_seqs=max_num_seqs,
              max_prefill_tokens=args.max_num_batched_tokens, max_adapters_per_batch=args.max_loras,
              max_lora_rank=max_rank, host_cache_size=args.max_cpu_loras, host_cache_gb=args.max_cpu_lora_gb,
              compile_per_layer=args.compile_per_layer, overlap_steps=args.overlap_steps,
              tensor_parallel=args.tensor_parallel_size,
              **({"ttft_slo": args.ttft_slo} if args.ttft_slo is not None else {}))
    if not args.no_warmup:
        # The embedded default's adapters target mixed module sets, so few of its batches would
        # meet the union's LoRA buckets: its warm-up compiles the base model's (a CPU demo).
        warmup(llm, args.warmup_workers, lora=args.model is not None)
    app = build_app(llm, name or args.model, api_key=args.api_key, allowed_adapter_dirs=args.allowed_adapter_dirs,
                    max_in_flight=max_num_seqs + args.max_queued_requests)

    import uvicorn
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5))

    async def run():
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            shown = f"[{host}]" if ":" in host else host
            print(f"slora-jax: serving {app.state.server.base} + {len(llm.store.entries)} adapters on "
                  f"http://{shown}:{port} (OpenAI API at /v1, metrics at /metrics)", flush=True)
        await task

    asyncio.run(run())
