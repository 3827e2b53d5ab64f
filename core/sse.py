"""Server-sent events, read and written in one place: bytes as they come off a socket, events out.

A socket gives a body in whatever pieces it likes (a piece may hold half an event, or several).
The splitter hands out only whole events, so a reader never looks at half of one: the proxy
follows a stream it may have to resume event by event (and knows exactly which events reached
its client), and the clients that time streams (the soak, the demo, the benchmarks) count each
event once, when it is complete.

vLLM writes one `data: <json>` line per event and a blank line after it; the splitter also
takes CRLF line ends and several `data:` lines per event (joined with newlines, as the SSE
specification says), and ignores comments and other fields. An event still incomplete when the
body ends is not an event (the specification drops it too): `pending` shows it.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


class Event(NamedTuple):
    raw: bytes  # the event as it came, its terminating blank line included
    data: bytes | None  # the `data` field (lines joined with b"\n"); None: the event had none

    @property
    def done(self) -> bool:
        """vLLM's (and OpenAI's) end-of-stream marker."""
        return self.data == b"[DONE]"


class Splitter:
    """Feed it bytes; it returns the events they complete, and keeps the rest."""

    def __init__(self, max_event: int = 64 << 20) -> None:
        self._buf = b""
        self.max_event = max_event  # a backend that never ends an event cannot grow this forever

    def feed(self, chunk: bytes) -> list[Event]:
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" not in buf:  # vLLM's framing: split once, in C
            *whole, rest = buf.split(b"\n\n")
            self._buf = rest
            if len(rest) > self.max_event:
                raise ValueError(f"a server-sent event longer than {self.max_event} bytes")
            return [Event(w + b"\n\n", w[6:] if w.startswith(b"data: ") and b"\n" not in w else _data(w))
                    for w in whole]
        events: list[Event] = []
        start = 0
        while True:
            m = _END.search(buf, start)
            if m is None:
                break
            events.append(Event(buf[start:m.end()], _data(buf[start:m.start()])))
            start = m.end()
        self._buf = buf[start:]
        if len(self._buf) > self.max_event:
            raise ValueError(f"a server-sent event longer than {self.max_event} bytes")
        return events

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet complete (what a stream that broke off left behind)."""
        return self._buf


def _data(block: bytes) -> bytes | None:
    """The data field of one event's lines (the blank line already cut off)."""
    if block.startswith(b"data: ") and b"\n" not in block and b"\r" not in block:
        return block[6:]  # vLLM's shape: one line, one space (the fast path)
    parts: list[bytes] = []
    for line in re.split(rb"\r\n|\n|\r", block):
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
        elif line == b"data":
            parts.append(b"")
    return b"\n".join(parts) if parts else None


def event(data: bytes) -> bytes:
    """One event carrying `data` (a single line: JSON never holds a raw newline)."""
    return b"data: " + data + b"\n\n"


DONE = event(b"[DONE]")
