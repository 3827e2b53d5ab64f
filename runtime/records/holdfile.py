"""The hold: persisted in the state dir so a restarted runtime (or host) still does not start a
generation on a GPU that needs a reset, until an operator releases it.

Blocking file I/O: the supervisor calls `write` and `clear` through `asyncio.to_thread`. A
planted symlink is never followed (the temp file is created with O_NOFOLLOW | O_EXCL, the rename
replaces a link rather than writing through it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from vllm_guard.core.sanitize import one_line
from vllm_guard.core.timefmt import utcnow

NAME = "hold.json"


class HoldFile:
    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / NAME

    def read(self) -> str | None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError:
            return "unreadable hold file"  # fail safe: a hold we cannot read still holds
        try:
            with os.fdopen(fd) as f:
                data = json.loads(f.read())
        except (OSError, ValueError):
            return "unreadable hold file"
        reason = data.get("reason") if isinstance(data, dict) else None
        return one_line(str(reason)) if reason else "hold"  # it is echoed: status, logs, sd_notify

    def write(self, reason: str) -> None:
        """Raises OSError when the hold cannot be persisted (the caller still holds in memory)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{NAME}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o640)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"reason": reason, "at": utcnow()}) + "\n")
        os.replace(tmp, self.path)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
