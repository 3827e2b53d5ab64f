"""New runtime failures between two status snapshots, with a bounded window.

The status carries only the last `RECENT` failures (`recent_failures`) plus the total
(`failures`). The number of new failures is the growth of the total, not of the list: once
the window is full the list stops growing while failures keep coming. New ones are the
newest entries of the window; any beyond the window are counted as `missed` (the ledger has
them). A different runtime process (pid) restarts its counters: then what the window holds
that was not seen before is new.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_guard.core.protocol import FailureSummary, StatusSnapshot


def failure_key(f: FailureSummary) -> tuple[int, str, str]:
    return (f.generation, f.at, f.kind)


@dataclass(frozen=True)
class NewFailures:
    failures: list[FailureSummary]  # oldest first
    missed: int  # new failures the status window no longer shows


class FailureFeed:
    def __init__(self) -> None:
        self.total: int | None = None
        self.pid: int | None = None
        self.seen: set[tuple[int, str, str]] = set()

    def update(self, st: StatusSnapshot) -> NewFailures:
        """What is new since the last call (nothing on the first: that is the baseline)."""
        window = sorted(st.recent_failures, key=lambda f: (f.at, f.generation))  # whatever order it came in
        unseen = [f for f in window if failure_key(f) not in self.seen]
        if self.total is None:
            new, missed = [], 0
        elif st.pid != self.pid or st.failures < self.total:
            new, missed = unseen, 0
        else:
            grew = st.failures - self.total
            new = unseen[len(unseen) - min(grew, len(unseen)):] if grew > 0 else []
            missed = max(0, grew - len(new))
        self.total, self.pid = st.failures, st.pid
        self.seen = {failure_key(f) for f in window}  # older keys cannot come back into the window
        return NewFailures(new, missed)
