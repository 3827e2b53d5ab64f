"""Hung or starved? Progress over a window decides, not one probe's latency.

A probe that times out proves little on a busy box: a starved engine (two busy cores, a long
backlog, every sequence slot taken by long streams) makes a 1-token completion wait while it
keeps generating. A hung engine (SIGSTOPped, deadlocked) moves no token at all. So a failed
probe counts toward a hang only when there was no progress over the whole window
(`[probe] progress_window`, or the probe's own duration if longer):

- vLLM's token counters (`vllm:prompt_tokens` + `vllm:generation_tokens` from /metrics, scraped
  before and after each probe and while waiting) did not move: STALLED, a hang;
- /metrics itself did not answer inside the window: then the API server's own CPU time decides.
  It used CPU: it is alive and starved (BUSY, measured under load on 2 cores: /metrics silent for
  9 s while streaming), never a hang. It used none: stopped or deadlocked (SILENT), a hang.

Pure: scrapes and times are passed in. The window belongs to one generation (a new one starts
empty) and a window the generation has not lived through yet is no evidence (TOO_SHORT), so a
generation that comes up under its predecessor's backlog is never called hung for it.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass


class Verdict(str, enum.Enum):
    MOVING = "moving"  # tokens advanced within the window: starved at worst
    STALLED = "stalled"  # /metrics answered and no token moved over the whole window
    BUSY = "busy"  # /metrics did not answer, but the API server kept using CPU: starved
    SILENT = "silent"  # /metrics did not answer and the API server used no CPU: stopped or deadlocked
    UNKNOWN = "unknown"  # no answer and no CPU reading: nothing proves a hang
    TOO_SHORT = "too_short"  # the generation has not been watched for a whole window yet


HANG = frozenset({Verdict.STALLED, Verdict.SILENT})
# what a verdict says of the engine's progress (status `last_probe.engine_progress`)
ENGINE_PROGRESS: dict[Verdict, bool | None] = {Verdict.MOVING: True, Verdict.STALLED: False}


@dataclass(frozen=True)
class Scrape:
    at: float  # monotonic seconds
    tokens: float | None  # prompt + generation tokens so far; None: /metrics did not answer
    cpu_s: float | None = None  # CPU seconds the API server has used; None: unknown


def miss_counts(verdict: Verdict) -> bool:
    """Whether a failed probe with this verdict counts toward `[probe] failures` (TOO_SHORT is
    decided later: the caller keeps sampling until the window is covered)."""
    return verdict in HANG


class ProgressWindow:
    """The recent scrapes of one generation; `keep` is the longest span asked about."""

    def __init__(self, keep: float) -> None:
        self.keep = keep
        self.scrapes: collections.deque[Scrape] = collections.deque(maxlen=4096)

    def add(self, at: float, tokens: float | None, cpu_s: float | None = None) -> None:
        self.scrapes.append(Scrape(at, tokens, cpu_s))
        # what is older than three windows can no longer be a window's baseline
        while len(self.scrapes) > 2 and self.scrapes[0].at < at - 3 * self.keep:
            self.scrapes.popleft()

    def verdict(self, now: float, span: float) -> Verdict:
        """Was there progress during [now - span, now]?"""
        start = now - span
        tokens = [s for s in self.scrapes if s.tokens is not None]
        if not self.scrapes or self.scrapes[0].at > start:
            if len(tokens) >= 2 and _grew(tokens[0].tokens, tokens[-1].tokens):
                return Verdict.MOVING
            return Verdict.TOO_SHORT
        base = _last_at_or_before(tokens, start)
        if tokens and tokens[-1].at > start:  # /metrics answered inside the window
            first_inside = next(s for s in tokens if s.at > start)
            if _grew((base or first_inside).tokens, tokens[-1].tokens):
                return Verdict.MOVING
            if base is not None:
                return Verdict.STALLED
        return self._by_cpu(start)

    def _by_cpu(self, start: float) -> Verdict:
        cpu = [s for s in self.scrapes if s.cpu_s is not None]
        base = _last_at_or_before(cpu, start)
        if base is None or cpu[-1].at <= start:
            return Verdict.UNKNOWN
        return Verdict.BUSY if _grew(base.cpu_s, cpu[-1].cpu_s) else Verdict.SILENT


def _grew(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and b > a


def _last_at_or_before(scrapes: list[Scrape], t: float) -> Scrape | None:
    found = None
    for s in scrapes:
        if s.at > t:
            break
        found = s
    return found
