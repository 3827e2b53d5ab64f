"""systemd notify protocol through `sdnotify`: READY, WATCHDOG, STATUS, EXTEND_TIMEOUT, STOPPING.

Everything is a no-op without `NOTIFY_SOCKET`, so the same code runs under systemd, in a
terminal and in tests (which bind a real AF_UNIX datagram socket and point NOTIFY_SOCKET at it).
"""

from __future__ import annotations

import os
import time

import sdnotify

from .sanitize import one_line

# Variables that belong to this process only; the vLLM child must not see them.
SYSTEMD_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Notifier:
    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._n = sdnotify.SystemdNotifier() if self.enabled else None
        self.watchdog_interval = self._watchdog_interval()
        self._last_ping = 0.0
        self._last_status = ""
        self.ready_sent = False

    @staticmethod
    def _watchdog_interval() -> float | None:
        """Half of WATCHDOG_USEC, as sd_watchdog_enabled(3) recommends; None if not for us."""
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if not usec or (pid and pid.isdigit() and int(pid) != os.getpid()):
            return None
        try:
            return max(int(usec) / 2e6, 0.05)
        except ValueError:
            return None

    def _send(self, msg: str) -> None:
        """sdnotify encodes as Latin-1 and drops, silently, a message it cannot encode (a reason
        in another script, the "…" of a shortened line): hand it UTF-8 bytes as Latin-1 text."""
        if self._n is not None:
            self._n.notify(msg.encode("utf-8").decode("latin-1"))

    def ready(self, status: str) -> None:
        self.ready_sent = True
        status = one_line(status, 400)
        self._send(f"READY=1\nSTATUS={status}")
        self._last_status = status

    def status(self, line: str) -> None:
        """Send STATUS= only when it changed (systemctl status shows the latest). The line is
        flattened: a newline in it would add a field of the caller's choosing to the datagram."""
        line = one_line(line, 400)
        if line != self._last_status:
            self._last_status = line
            self._send(f"STATUS={line}")

    def extend_timeout(self, seconds: float) -> None:
        """Ask for more start (or stop) time; used while the first model loads."""
        self._send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def stopping(self) -> None:
        self._send("STOPPING=1")

    def watchdog_due(self, now: float | None = None) -> bool:
        if self.watchdog_interval is None:
            return False
        now = time.monotonic() if now is None else now
        return now - self._last_ping >= self.watchdog_interval

    def watchdog(self, now: float | None = None) -> None:
        self._last_ping = time.monotonic() if now is None else now
        self._send("WATCHDOG=1")
