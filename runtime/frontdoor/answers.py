"""Every error the proxy writes itself, in OpenAI's shape: an HTTP answer while nothing has
reached the client, else one event in its stream (then `[DONE]`)."""

from __future__ import annotations

import json

from aiohttp import web

from vllm_guard.core import sse

from .resume import dumps

# the error's `type` in OpenAI's shape, by status
_ERROR_TYPE = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
               408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               502: "backend_error", 503: "service_unavailable"}


def answer(rid: str, status: int, message: str, code: str, param: str | None = None,
           retry_after: int | None = None) -> web.Response:
    """One error answer: `code` says which bound or failure, `param` which field."""
    body = {"error": {"message": message, "type": _ERROR_TYPE.get(status, "vllm_guard_error"),
                      "param": param, "code": code}}
    headers = {"X-Request-Id": rid}
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return web.json_response(body, status=status, headers=headers)


def error_event(message: str) -> bytes:
    """The one error a client gets when a stream the proxy follows cannot go on."""
    return sse.event(dumps({"error": {"message": message, "type": "vllm_guard_backend_failure", "param": None,
                                      "code": 502}}))


def backend_error_event(message: str, code: str) -> bytes:
    """The one error a client gets when a stream the proxy passes through breaks off."""
    event = {"error": {"message": message, "type": "backend_error", "param": None, "code": code}}
    return sse.event(json.dumps(event).encode())
