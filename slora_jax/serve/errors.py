"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, and what leaves the
server in them: `APIError` (status, message, the parameter at fault, a code), `bad` for a 400 that
names its parameter, `from_engine_error` for the engine's refusals, and `hide_paths`, through which
every message built from an exception goes, so no server path leaves the server.
"""

from __future__ import annotations

import os
import re

from fastapi.responses import JSONResponse

from slora_jax.serve.async_engine import EngineError


class APIError(Exception):
    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
             408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
             500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = \
            status, message, param, code, retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self):
        headers = {"Retry-After": str(int(max(1, round(self.retry_after))))} if self.retry_after else {}
        if self.status == 408:  # the rest of the body may still come: end the connection instead
            headers["Connection"] = "close"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


def from_engine_error(e: EngineError) -> APIError:
    code = {404: "model_not_found", 429: "rate_limit_exceeded", 503: "overloaded"}.get(e.status)
    return APIError(e.status, hide_paths(str(e)), None, code, e.retry_after)


ABSOLUTE_PATH = re.compile(r"(?<![\w.])/[^\s'\",:;()\[\]{}]+")


def hide_paths(message: str, roots: list[str] = ()) -> str:
    """`message` with no absolute server path: a path under one of `roots` (the allowed adapter
    directories) becomes relative to it, any other absolute path its last component. For messages
    built from exceptions, which may name files the client never sent."""
    for root in sorted(roots, key=len, reverse=True):
        message = message.replace(root.rstrip(os.sep) + os.sep, "")
    return ABSOLUTE_PATH.sub(lambda m: os.path.basename(m.group(0).rstrip("/")) or "<path>", message)


class ClientGone(Exception):
    """The client disconnected before the server answered."""
