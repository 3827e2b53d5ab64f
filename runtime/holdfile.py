"""The hold: persisted in the state dir so a restarted runtime (or host) still does not start a
generation on a GPU that needs a reset, until an operator releases it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .ledger import utcnow


class HoldFile:
    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / "hold.json"

    def read(self) -> str | None:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return "unreadable hold file"  # fail safe: a corrupt hold still holds
        return str(data.get("reason") or "hold")

    def write(self, reason: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"reason": reason, "at": utcnow()}) + "\n")
        os.replace(tmp, self.path)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
