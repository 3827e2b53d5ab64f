"""Request bodies, bounded because the port is public.

A body is refused (413) before it is read when it is declared too large, cut at the limit when
it comes chunked, dropped (408) when it stalls, and the bodies held at once (queued and in
flight) stay under a budget (503). A refused request's small body is read and dropped, so a
client still sending it reads the answer instead of a reset.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from vllm_guard.core.protocol import RejectReason

DISCARD_MAX = 64 << 10  # a refused (404/405) request's body up to this is read and dropped, not left unread
DISCARD_WAIT_S = 2.0


class Refused(Exception):
    """Answered by the proxy itself before any backend was involved (413, 408, 503)."""

    def __init__(self, status: int, message: str, cause: RejectReason) -> None:
        super().__init__(message)
        self.status = status
        self.cause = cause


class Bodies:
    """The bytes of request bodies held now, against `budget`; each at most `max_body`."""

    def __init__(self, max_body: int, budget: int, idle_timeout: float) -> None:
        self.max_body = max_body
        self.budget = budget
        self.idle_timeout = idle_timeout
        self.held = 0  # request bodies buffered now (queued and in flight)

    def give_back(self, n: int) -> None:
        """A request that held `n` bytes of the budget ended."""
        self.held -= n

    async def read(self, request: web.Request) -> tuple[bytes, int]:
        """The whole body, at most max_body bytes, each read within idle_timeout; Refused else.
        Returns it with the bytes it holds of the budget (the caller gives them back)."""
        declared = request.content_length
        if declared is not None and declared > self.max_body:
            raise Refused(413, f"request body of {declared} bytes is larger than {self.max_body} "
                               f"([server] max_body_mb)", RejectReason.BODY_TOO_LARGE)
        held = declared or 0
        if self.held + held > self.budget:
            raise Refused(503, "the guard is holding too many request bodies: retry later",
                          RejectReason.BODY_BUFFER_FULL)
        self.held += held
        if request.headers.get("Expect", "").lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0
        buf = bytearray()
        try:
            while True:
                try:
                    chunk = await asyncio.wait_for(request.content.readany(), self.idle_timeout)
                except asyncio.TimeoutError as e:
                    raise Refused(408, f"request body stalled for {self.idle_timeout:g} s",
                                  RejectReason.BODY_STALLED) from e
                if not chunk:
                    return bytes(buf), held
                if len(buf) + len(chunk) > self.max_body:
                    raise Refused(413, f"request body larger than {self.max_body} bytes ([server] max_body_mb)",
                                  RejectReason.BODY_TOO_LARGE)
                buf += chunk
                if len(buf) > held:  # no (or a wrong) Content-Length: grow the reservation as it comes
                    if self.held + len(buf) - held > self.budget:
                        raise Refused(503, "the guard is holding too many request bodies: retry later",
                                      RejectReason.BODY_BUFFER_FULL)
                    self.held += len(buf) - held
                    held = len(buf)
        except BaseException:  # refused, or the client left: give the reservation back
            self.held -= held
            raise


async def discard(request: web.Request) -> bool:
    """Read and drop a refused request's body when it is small and comes at once, so the
    client, still sending it, reads the answer instead of a reset. False: left unread."""
    if (request.content_length or 0) > DISCARD_MAX:
        return False
    seen = 0
    try:
        while seen <= DISCARD_MAX:
            chunk = await asyncio.wait_for(request.content.readany(), DISCARD_WAIT_S)
            if not chunk:
                return True
            seen += len(chunk)
    except (asyncio.TimeoutError, aiohttp.ClientError, ConnectionError):
        pass
    return False
