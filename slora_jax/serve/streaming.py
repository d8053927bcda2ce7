"""Streaming pieces of the HTTP layer: server-sent events, and waiting on work while watching for
the client to go away (a disconnect aborts the request in the engine, which frees its pages)."""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi.responses import StreamingResponse

from slora_jax.serve.errors import ClientGone

log = logging.getLogger(__name__)

def sse_event(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def await_or_disconnect(request, awaitable, on_disconnect=None):
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


class SSEResponse(StreamingResponse):
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
