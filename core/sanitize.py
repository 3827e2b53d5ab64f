"""Operator text that the guard echoes (hold reasons, recycle reasons): one printable line.

Such text reaches the sd_notify STATUS datagram (where a newline would add a field), the
ledger, logs and status output. Control characters are refused at the edge rather than
silently rewritten, so the operator learns what was wrong.
"""

from __future__ import annotations

import re

MAX_REASON = 200
_CONTROL = re.compile(r"[\x00-\x1f\x7f\u0080-\u009f\u2028\u2029]")


def check_reason(text: object, what: str = "reason", max_len: int = MAX_REASON) -> str:
    """The text if it is one printable line of at most `max_len` characters; else ValueError."""
    if not isinstance(text, str):
        raise ValueError(f"{what} has value {text!r}: not a string")
    if _CONTROL.search(text):
        raise ValueError(f"{what} has value {text[:60]!r}: control characters (newline, tab, ...) are not allowed")
    if len(text) > max_len:
        raise ValueError(f"{what} is {len(text)} characters long: at most {max_len}")
    return text


def one_line(text: str, max_len: int = MAX_REASON) -> str:
    """For text we did not get from an operator (a vLLM log line): control characters become
    spaces and the result is cut to `max_len`."""
    flat = _CONTROL.sub(" ", text).strip()
    return flat if len(flat) <= max_len else flat[: max_len - 1] + "…"
