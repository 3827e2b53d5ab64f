"""Policy: which suggested actions are taken. Pure and clock-injected, so tests drive time.

Rules: an action needs the runtime (for a finding about one replica: that replica) in a state
that can take it (`core.protocol` RECYCLABLE, RESTARTABLE: the runtime's own rule); each
(action, kind, replica) has a cooldown; at most `max_actions` actions in `action_window`, then escalate: stop acting and
alert until the window clears. `hold` is never rate-limited (it stops restarts, it cannot loop),
and a held runtime gets no restart or recycle at all. Dry-run decides but never acts.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from vllm_guard.core.config import WatchdogConfig
from vllm_guard.core.protocol import RECYCLABLE, RESTARTABLE, RuntimeState

from .base import Action, Finding


@dataclass(frozen=True)
class Decision:
    finding: Finding
    action: Action  # what to do now (NONE when suppressed)
    why: str  # "act", "dry-run", "cooldown", "escalated", "runtime <state>", ...


class Policy:
    def __init__(self, cfg: WatchdogConfig) -> None:
        self.cfg = cfg
        self.recent: collections.deque[float] = collections.deque()
        self.last: dict[tuple[Action, str, int | None], float] = {}
        self.escalated = False

    def decide(self, f: Finding, now: float, runtime_state: RuntimeState | None, held: bool) -> Decision:
        """`runtime_state`: the state of the finding's replica (of the runtime when it has none);
        None: the runtime did not answer."""
        a = f.action
        if a in (Action.NONE, Action.ALERT):
            return Decision(f, a, "record")
        if runtime_state is None:
            return Decision(f, Action.ALERT, "runtime unreachable")
        if a is Action.HOLD:
            return Decision(f, Action.NONE if held else a, "already held" if held else self._mode())
        if held:
            return Decision(f, Action.NONE, "runtime held")
        where = "runtime" if f.replica is None else f"replica {f.replica}"
        if a is Action.RECYCLE and runtime_state not in RECYCLABLE:
            return Decision(f, Action.NONE, f"{where} {runtime_state.value}")
        if a is Action.RESTART and runtime_state not in RESTARTABLE:
            return Decision(f, Action.NONE, f"{where} {runtime_state.value}")
        while self.recent and now - self.recent[0] > self.cfg.action_window:
            self.recent.popleft()
        self.escalated = len(self.recent) >= self.cfg.max_actions
        if self.escalated:
            return Decision(f, Action.ALERT, f"escalated: {len(self.recent)} actions in "
                                             f"{self.cfg.action_window:.0f}s")
        last = self.last.get((a, f.kind, f.replica))
        if last is not None and now - last < self.cfg.cooldown:
            return Decision(f, Action.NONE, "cooldown")
        if not self.cfg.dry_run:
            self.recent.append(now)
            self.last[(a, f.kind, f.replica)] = now
        return Decision(f, a, self._mode())

    def _mode(self) -> str:
        return "dry-run" if self.cfg.dry_run else "act"
