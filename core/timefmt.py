"""Time as the ledger stores it (ISO 8601 UTC text) and as people read it.

Ledger times are sortable text with milliseconds and a `Z`; durations are seconds. The
human formats pick a unit a reader can take in at a glance: `850 ms`, `12.3 s`, `4 m 05 s`,
`2.5 h`, `3.2 d`.
"""

from __future__ import annotations

import datetime as _dt
import math


def utcnow() -> str:
    """Now as ISO 8601 UTC with milliseconds (`2026-11-29T21:19:20.123Z`)."""
    return iso(_dt.datetime.now(_dt.timezone.utc))


def iso(t: _dt.datetime) -> str:
    return t.astimezone(_dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def iso_from_epoch(t: float | None) -> str | None:
    if t is None:
        return None
    return iso(_dt.datetime.fromtimestamp(t, _dt.timezone.utc))


def parse_iso(text: str) -> _dt.datetime:
    return _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def epoch(value: object) -> float | None:
    """Seconds since the epoch from ledger text or a number; None when absent or unreadable."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value:
        try:
            return parse_iso(value).timestamp()
        except ValueError:
            return None
    return None


def human_duration(seconds: float | None) -> str:
    """`850 ms`, `12.3 s`, `4 m 05 s`, `2.5 h`, `3.2 d`; `-` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = abs(seconds)
    sign = "-" if seconds < 0 else ""
    if s < 1:
        return f"{sign}{s * 1000:.0f} ms"
    if s < 60:
        return f"{sign}{s:.1f} s"
    if s < 3600:
        m, rest = divmod(int(round(s)), 60)
        return f"{sign}{m} m {rest:02d} s"
    if s < 86400 * 2:
        return f"{sign}{s / 3600:.1f} h"
    return f"{sign}{s / 86400:.1f} d"


def human_latency(seconds: float | None) -> str:
    """A latency: `1.42 ms`, `352 ms`, `68.5 s`; `-` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 0.01:
        return f"{seconds * 1000:.2f} ms"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    return human_duration(seconds)
