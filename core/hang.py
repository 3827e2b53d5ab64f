"""Hung or starved? The one hang rule, applied by the runtime's probe and the watchdog's alike.

A probe that times out proves little on a busy box: a starved engine (two busy cores, a long
backlog, every sequence slot taken by long streams) makes a 1-token completion wait while it
keeps generating. A hung engine (SIGSTOPped, deadlocked) moves no token at all. So:

- only a probe that got *no answer in time* asks the question: an HTTP error (401 for a wrong
  API key, 503) is an answer, and a refused connection is a dead server, not a hung one;
- it counts as a miss only when nothing progressed over the whole window (`progress_window`,
  or the probe's own duration if longer; `span`):
  - vLLM's token counters (`vllm:prompt_tokens` + `vllm:generation_tokens` from /metrics) did
    not move: STALLED, a hang;
  - /metrics itself did not answer inside the window: the API server's own CPU time decides.
    It used CPU: alive and starved (BUSY; measured under load on 2 cores: /metrics silent for
    9 s while streaming), never a hang. It used none: stopped or deadlocked (SILENT), a hang.
    No CPU reading either: nothing proves a hang (UNKNOWN);
- `failures` misses in a row make the hang (`HangRule`); an answer, or a probe that timed out
  while the engine progressed, starts the count again.

Pure: scrapes and times are passed in. A window belongs to one generation (a new one starts
empty) and a window the generation has not lived through yet is no evidence (TOO_SHORT: judge
again once it is covered), so a generation that comes up under its predecessor's backlog is
never called hung for it.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass

from .vllm_api import ProbeResult


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
WHY: dict[Verdict, str] = {Verdict.STALLED: "no token moved",
                           Verdict.SILENT: "neither /metrics answered nor the API server used CPU"}


@dataclass(frozen=True)
class Scrape:
    at: float  # monotonic seconds
    tokens: float | None  # prompt + generation tokens so far; None: /metrics did not answer
    cpu_s: float | None = None  # CPU seconds the API server has used; None: unknown


def asks_window(probe: ProbeResult) -> bool:
    """Only a probe that got no answer in time is judged by the window."""
    return not probe.ok and probe.timed_out


def span(progress_window: float, probe: ProbeResult) -> float:
    """The window a timed-out probe is judged over: at least as long as the probe waited."""
    return max(progress_window, probe.latency_s)


def keep(progress_window: float, probe_timeout: float, probe_interval: float) -> float:
    """How far back a window must keep scrapes for every span it will be asked about."""
    return max(progress_window, probe_timeout) + probe_interval


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


class Judgement(str, enum.Enum):
    ANSWERED = "answered"  # ok, or an HTTP error: an answer, the count starts again
    STARVED = "starved"  # timed out, but nothing proves a hang (MOVING, BUSY, UNKNOWN): starts again
    WAIT = "wait"  # timed out, the window is not covered yet: judge again with a later verdict
    MISS = "miss"  # timed out with no progress over the window, fewer than `failures` in a row
    HUNG = "hung"  # the `failures`-th miss in a row


@dataclass
class HangRule:
    """Misses in a row of one generation's probes; `failures` of them make a hang."""

    failures: int
    misses: int = 0

    def judge(self, probe: ProbeResult, verdict: Verdict | None = None) -> Judgement:
        """Count one probe; `verdict` is the window's over `span(...)`, needed only when
        `asks_window(probe)` (None then means: not judged yet, WAIT)."""
        if not asks_window(probe):
            self.misses = 0
            return Judgement.ANSWERED
        if verdict is None or verdict is Verdict.TOO_SHORT:
            return Judgement.WAIT
        if verdict not in HANG:
            self.misses = 0
            return Judgement.STARVED
        self.misses += 1
        return Judgement.HUNG if self.misses >= self.failures else Judgement.MISS


def _grew(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and b > a


def _last_at_or_before(scrapes: list[Scrape], t: float) -> Scrape | None:
    found = None
    for s in scrapes:
        if s.at > t:
            break
        found = s
    return found
