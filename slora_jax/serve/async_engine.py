"""The engine behind the server: one thread owns the `LLM`/`Engine` and steps it.

The engine is not thread-safe, so exactly one thread, the engine thread, ever calls into it. Everyone
else talks to that thread through one command queue (a `queue.SimpleQueue`):

    asyncio side (HTTP handlers)                      engine thread
    ----------------------------                      -------------
    submit(prompt, params, adapter) ── ("add") ──────► engine.add_request
    abort(handle)                   ── ("abort") ────► engine.abort (pages freed at once)
    await call(fn)                  ── ("call") ─────► fn()  (load/unload adapter, stats, generate)
    pause() / resume()              ── ("pause") ────► stop/restart stepping (admin and tests)
                                                       loop: drain commands, engine.step(), publish
    handle.queue (asyncio.Queue) ◄── loop.call_soon_threadsafe ── new tokens / finish / error

After every step the engine thread compares each running request's `RequestOutput` (updated in
place by the engine) with what it already sent, and hands the new tokens to the asyncio loop in ONE
`call_soon_threadsafe` per step, whatever the batch size. While the engine has nothing to do, the
thread blocks on the command queue, so an idle server costs nothing and commands (stats, adapter
loads) are answered at once; while it is busy, commands are served between two steps, so they never
race a step.

The engine thread also measures what only it can see: step time, time to first token, end-to-end
latency, and counts finished requests per adapter (`EngineMetrics`, prometheus-client objects,
which are thread-safe).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import random
import threading
import time
from typing import Any, Callable

from slora_jax.request import RequestOutput
from slora_jax.sampling import SamplingParams

log = logging.getLogger(__name__)

_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineMetrics:
    """What the engine thread measures, on a prometheus_client registry (one per app)."""

    def __init__(self, registry, base_name: str):
        from prometheus_client import Counter, Histogram
        self.base_name = base_name
        self.requests = Counter("slora_requests", "Finished requests, by model (base or adapter) and finish "
                                "reason", ["model", "finish_reason"], registry=registry)
        self.prompt_tokens = Counter("slora_prompt_tokens", "Prompt tokens of admitted requests", ["model"],
                                     registry=registry)
        self.generation_tokens = Counter("slora_generation_tokens", "Generated tokens", ["model"],
                                         registry=registry)
        self.step_time = Histogram("slora_step_duration_seconds", "Wall time of one engine step "
                                   "(schedule + jitted step + bookkeeping)", buckets=_TIME_BUCKETS,
                                   registry=registry)
        self.ttft = Histogram("slora_time_to_first_token_seconds", "From submission to the first generated "
                              "token", buckets=_TIME_BUCKETS, registry=registry)
        self.e2e = Histogram("slora_e2e_request_latency_seconds", "From submission to the last token",
                             buckets=_TIME_BUCKETS, registry=registry)
        self.engine_errors = Counter("slora_engine_errors", "Engine steps that raised", registry=registry)

    def label(self, adapter: str | None) -> str:
        return self.base_name if adapter is None else adapter


@dataclasses.dataclass
class Delta:
    """New tokens of one request since the last delta; `finish_reason` is set on the last one."""
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None = None
    abort_reason: str | None = None
    error_code: str | None = None   # finish_reason "error": why the engine could not serve it
    top_logprobs: list[dict[int, float]] | None = None  # per token: its top k and itself (logprobs=k)


class EngineError(RuntimeError):
    """A request could not be served. `status` is the HTTP status the server maps it to."""

    def __init__(self, message: str, status: int = 500, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


@dataclasses.dataclass(eq=False)
class RequestHandle:
    prompt: list[int]
    params: SamplingParams
    adapter: str | None
    seed: int
    queue: asyncio.Queue   # receives (handle, Delta | EngineError)
    index: int = 0
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    # engine-thread side
    out: RequestOutput | None = None
    sent: int = 0
    first_token: float | None = None
    # asyncio side
    done: bool = False

    @property
    def request_id(self) -> str | None:
        return self.out.request_id if self.out is not None else None


class AsyncEngine:
    """Owns `llm` (an `slora_jax.LLM`) on a background thread; use it from one asyncio loop.

    max_in_flight: requests accepted at once (running + queued); beyond it `submit` raises an
    `EngineError` with status 429. None: no limit.
    """

    def __init__(self, llm, metrics: EngineMetrics | None = None, max_in_flight: int | None = None):
        self.llm = llm
        self.metrics = metrics
        self.max_in_flight = max_in_flight
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[int, RequestHandle] = {}   # engine thread only
        self._in_flight = 0                            # asyncio side only
        self._paused = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead: BaseException | None = None          # set if the engine thread itself died
        self.last_stats: dict = self._stats()
        self._rng = random.Random()
        # Called on the engine thread after every step with this AsyncEngine (instrumentation,
        # tests). A hook may call `pause_now()`.
        self.step_hooks: list[Callable[["AsyncEngine"], None]] = []

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; deltas are delivered on `loop` (default: the running loop)."""
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="slora-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything in flight (clients get 503) and stop the thread."""
        if self._thread is None:
            return
        self._cmds.put(("stop",))
        self._thread.join(timeout)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # -- asyncio-side API ----------------------------------------------------------------------

    def submit(self, prompt: list[int], params: SamplingParams, adapter: str | None,
               seed: int | None = None, queue: asyncio.Queue | None = None, index: int = 0) -> RequestHandle:
        """Queue one request; read its deltas with `stream(handle)`. Call from the event loop.

        Several requests may share one `queue` (the prompts of one HTTP request): read them
        together with `stream_many`."""
        if not self.alive:
            raise EngineError("the engine is not running", 503, retry_after=5)
        if self._stopping:
            raise EngineError("the server is shutting down", 503, retry_after=5)
        if self.max_in_flight is not None and self._in_flight >= self.max_in_flight:
            raise EngineError(f"the server is overloaded ({self._in_flight} requests in flight); retry later",
                              429, retry_after=1)
        seed = self._rng.getrandbits(31) if seed is None else seed
        h = RequestHandle(list(prompt), params, adapter, seed, queue or asyncio.Queue(), index)
        self._in_flight += 1
        self._cmds.put(("add", h))
        return h

    async def stream(self, h: RequestHandle):
        """Yield the request's `Delta`s until it finishes. Leaving early (a client gone, a
        cancellation, a stop string) aborts the request in the engine, which frees its pages."""
        async for _, delta in self.stream_many([h]):
            yield delta

    async def stream_many(self, handles: list[RequestHandle]):
        """Yield `(handle, Delta)` for requests sharing one queue until all have finished. An
        `EngineError` for any of them is raised; leaving early aborts those still running."""
        pending = set(handles)
        try:
            while pending:
                h, item = await handles[0].queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    pending.discard(h)
                    self.release(h, finished=True)
                yield h, item
        finally:
            for h in handles:
                self.release(h)

    def release(self, h: RequestHandle, finished: bool = False) -> None:
        """The consumer is done with `h`: abort it unless it `finished`. Idempotent."""
        if h.done:
            return
        h.done = True
        self._in_flight -= 1
        if not finished:
            self._cmds.put(("abort", h))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the engine thread, between two steps; return its result or raise."""
        return await asyncio.wrap_future(self.call_future(fn))

    def call_future(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            fut.set_exception(EngineError("the engine is not running", 503, retry_after=5))
            return fut
        self._cmds.put(("call", fn, fut))
        return fut

    def call_sync(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """`call` from a thread that is not the event loop (tests, admin scripts)."""
        return self.call_future(fn).result(timeout)

    def pause(self) -> None:
        """Stop stepping (requests queue up, nothing runs) until `resume`. Call from any thread
        but the event loop's (it waits for the engine thread to take the command)."""
        self.call_future(lambda: setattr(self, "_paused", True)).result()

    def pause_now(self) -> None:
        """`pause` from the engine thread itself (a step hook)."""
        self._paused = True

    def running_outputs(self) -> list[RequestOutput]:
        """The RequestOutputs of the requests in the engine (engine thread only: a step hook)."""
        return [h.out for h in self._active.values() if h.out is not None]

    def resume(self) -> None:
        self._cmds.put(("resume",))

    def abort_all(self, why: str = "aborted by the server") -> int:
        """Abort every request in flight (their clients get 503 + Retry-After); returns how many.
        Call from any thread but the event loop's."""
        return self.call_future(lambda: self._abort_all(why)).result()

    async def abort_in_flight(self, why: str) -> int:
        """`abort_all` from the event loop (a graceful shutdown's last step)."""
        return await self.call(lambda: self._abort_all(why))

    async def stats(self) -> dict:
        """Engine stats, read on the engine thread (exact: never in the middle of a step)."""
        return await self.call(self._stats)

    # -- engine thread -------------------------------------------------------------------------

    def _stats(self) -> dict:
        s = dict(self.llm.stats())
        self.last_stats = s
        return s

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - report, fail everything, die
            log.exception("the engine thread died")
            self.dead = e
            self._fail_all(EngineError(f"the engine thread died: {e!r}", 503, retry_after=5))

    def _serve(self) -> None:
        eng = self.llm.engine
        while True:
            idle = self._paused or not eng.has_unfinished()
            cmds = [self._cmds.get()] if idle else []
            while True:
                try:
                    cmds.append(self._cmds.get_nowait())
                except queue.Empty:
                    break
            for cmd in cmds:
                if cmd[0] == "stop":
                    self._stopping = True
                    self._abort_all("the server is shutting down")
                    return
                self._command(cmd)
            if self._paused or not eng.has_unfinished():
                self._publish()  # aborts and errors from the commands above
                continue
            t0 = time.perf_counter()
            try:
                eng.step()
            except Exception as e:  # noqa: BLE001 - a step failed: fail what ran, keep serving
                log.exception("engine step failed")
                if self.metrics:
                    self.metrics.engine_errors.inc()
                self._fail_all(EngineError(f"engine step failed: {e}", 500))
                continue
            if self.metrics:
                self.metrics.step_time.observe(time.perf_counter() - t0)
            self._publish()
            for hook in list(self.step_hooks):
                hook(self)

    def _command(self, cmd) -> None:
        kind = cmd[0]
        if kind == "add":
            h: RequestHandle = cmd[1]
            if h.done:  # released before it was ever added
                return
            try:
                h.out = self.llm.engine.add_request(h.prompt, h.params, h.adapter, h.seed,
                                                    self.llm.cfg.eos_token_ids)
            except KeyError:  # the adapter was unloaded after the HTTP layer checked it
                self._deliver([(h, EngineError(f"The model `{h.adapter}` does not exist.", 404))])
                return
            except ValueError as e:
                self._deliver([(h, EngineError(str(e), 400))])
                return
            self._active[id(h)] = h
            if self.metrics:
                self.metrics.prompt_tokens.labels(self.metrics.label(h.adapter)).inc(len(h.prompt))
        elif kind == "abort":
            h = cmd[1]
            if h.out is not None and not h.out.finished:
                self.llm.engine.abort(h.out.request_id, "the client went away")
        elif kind == "call":
            _, fn, fut = cmd
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
        elif kind == "resume":
            self._paused = False

    def _abort_all(self, why: str) -> int:
        n = 0
        for h in list(self._active.values()):
            if h.out is not None and not h.out.finished:
                self.llm.engine.abort(h.out.request_id, why)
                n += 1
        self._publish()
        return n

    def _fail_all(self, err: EngineError) -> None:
        batch = []
        for h in list(self._active.values()):
            try:
                if h.out is not None and not h.out.finished:
                    self.llm.engine.abort(h.out.request_id, str(err))
            except Exception:  # noqa: BLE001 - the engine is already in trouble
                log.exception("abort after a failed step")
            batch.append((h, err))
            self._active.pop(id(h), None)
        self._deliver(batch)

    def _publish(self) -> None:
        """Hand every request's new tokens (and finishes) to the event loop, in one call."""
        now = time.perf_counter()
        batch = []
        m = self.metrics
        for key, h in list(self._active.items()):
            out = h.out
            n = len(out.token_ids)
            if n == h.sent and not out.finished:
                continue
            if n > h.sent and h.first_token is None:
                h.first_token = now
                if m:
                    m.ttft.observe(now - h.submitted)
            lps = out.logprobs[h.sent:n] if out.logprobs is not None else None
            tops = out.top_logprobs[h.sent:n] if out.top_logprobs is not None else None
            batch.append((h, Delta(out.token_ids[h.sent:n], lps, out.finish_reason, out.abort_reason,
                                   out.error_code, tops)))
            if m and n > h.sent:
                m.generation_tokens.labels(m.label(h.adapter)).inc(n - h.sent)
            h.sent = n
            if out.finished:
                del self._active[key]
                if m:
                    m.requests.labels(m.label(h.adapter), out.finish_reason).inc()
                    m.e2e.observe(now - h.submitted)
        self._deliver(batch)

    def _deliver(self, batch: list[tuple[RequestHandle, Any]]) -> None:
        if not batch or self._loop is None or self._loop.is_closed():
            return

        def put_all():
            for h, item in batch:
                h.queue.put_nowait((h, item))
        try:
            self._loop.call_soon_threadsafe(put_all)
        except RuntimeError:  # the loop closed under us (shutdown)
            pass
