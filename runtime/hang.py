"""Hung or starved? The engine's token progress over a window decides, not one probe's latency.

A probe that times out proves little on a busy box: a starved engine (two busy cores, a long
backlog, every sequence slot taken by long streams) makes a 1-token completion wait while it
keeps generating. A hung engine (SIGSTOPped, deadlocked) moves no token at all. So a failed
probe counts toward a hang only when vLLM's own counters (`vllm:prompt_tokens` +
`vllm:generation_tokens` from /metrics, sampled before and after each probe and while waiting)
did not move over the whole window: `[probe] progress_window`, or the probe's own duration if
longer. Pure: samples and times are passed in.

The window belongs to one generation (a new generation starts with an empty one), and a window
that this generation has not yet lived through is no evidence (`TOO_SHORT`): a generation that
comes up under a backlog is never declared hung by the backlog of its predecessor.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass


class Verdict(str, enum.Enum):
    MOVING = "moving"  # tokens advanced within the window: starved at worst, never a hang
    STALLED = "stalled"  # /metrics answered and no token moved over the whole window
    UNKNOWN = "unknown"  # /metrics did not answer within the window: neither probe nor metrics work
    TOO_SHORT = "too_short"  # the generation has not been watched for a whole window yet


@dataclass(frozen=True)
class Scrape:
    at: float  # monotonic seconds
    tokens: float | None  # prompt + generation tokens so far; None: the scrape failed


class ProgressWindow:
    """The recent /metrics scrapes of one generation; `keep` is the longest span asked about."""

    def __init__(self, keep: float) -> None:
        self.keep = keep
        self.scrapes: collections.deque[Scrape] = collections.deque(maxlen=4096)

    def add(self, at: float, tokens: float | None) -> None:
        self.scrapes.append(Scrape(at, tokens))
        # what is older than three windows can no longer be a window's baseline
        while len(self.scrapes) > 2 and self.scrapes[0].at < at - 3 * self.keep:
            self.scrapes.popleft()

    def verdict(self, now: float, span: float) -> Verdict:
        """Did the engine make progress during [now - span, now]?"""
        start = now - span
        if not self.scrapes or self.scrapes[0].at > start:
            ok = [s.tokens for s in self.scrapes if s.tokens is not None]
            if len(ok) >= 2 and ok[-1] > ok[0]:
                return Verdict.MOVING
            return Verdict.TOO_SHORT
        base: Scrape | None = None
        last: Scrape | None = None
        for s in self.scrapes:
            if s.tokens is None:
                continue
            if s.at <= start:
                base = s
            last = s
        if last is None or last.at <= start:
            return Verdict.UNKNOWN  # no successful scrape inside the window
        first_inside = next(s for s in self.scrapes if s.tokens is not None and s.at > start)
        ref = base if base is not None else first_inside
        if last.tokens is not None and ref.tokens is not None and last.tokens > ref.tokens:
            return Verdict.MOVING
        if base is None:
            return Verdict.UNKNOWN  # nothing proves the start of the window was already stalled
        return Verdict.STALLED


def miss_counts(verdict: Verdict) -> bool:
    """Whether a failed probe with this verdict counts toward `[probe] failures`.

    UNKNOWN counts: a server that answers neither a 1-token probe nor /metrics for a whole
    window serves no one, whatever its engine does. TOO_SHORT is decided later (the caller keeps
    sampling until the window is covered)."""
    return verdict in (Verdict.STALLED, Verdict.UNKNOWN)
