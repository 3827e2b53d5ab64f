"""The plugin's own channel to the runtime: per-process JSON reports and JSONL event files.

Layout under the state dir (one folder per generation, so a recycle never mixes reports):
  patches/gen-<N>/<pid>.json   one per vLLM process, rewritten atomically (tmp + rename)
  patches/gen-<N>/events.jsonl patch events (orphans reclaimed, idle releases)
  patches/gen-<N>/inject.jsonl what the fault injector did (tests compare guards against it)
No vLLM or torch here: the runtime reads these files.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

EVENTS = "events.jsonl"
INJECT = "inject.jsonl"


def utcnow() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def gen_dir(state_dir: str | Path, generation: int) -> Path:
    return Path(state_dir) / "patches" / f"gen-{int(generation)}"


def write_json_atomic(path: Path, data: Mapping[str, Any]) -> None:
    """Readers never see half a file: write a sibling temp file, then rename over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, sort_keys=True))
    os.replace(tmp, path)


def append_jsonl(path: Path, record: Mapping[str, Any]) -> None:
    """One `write` on an O_APPEND fd per line, so several processes can share the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps({"ts": utcnow(), "pid": os.getpid(), **record}, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete line; a torn last line (process killed mid-write) is skipped."""
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_reports(state_dir: str | Path, generation: int) -> dict[str, dict[str, Any]]:
    """{pid: report} for the generation's processes; dead processes are marked, not dropped."""
    d = gen_dir(state_dir, generation)
    out: dict[str, dict[str, Any]] = {}
    if not d.is_dir():
        return out
    for p in sorted(d.glob("*.json")):
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        pid = p.stem
        data["alive"] = pid.isdigit() and _alive(int(pid))
        out[pid] = data
    return out


def summarize_events(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals for status: orphans reclaimed, idle releases and bytes, last event."""
    reclaimed = [r for r in records if r.get("event") == "orphans_reclaimed"]
    releases = [r for r in records if r.get("event") == "idle_release"]
    return {
        "orphan_events": len(reclaimed),
        "orphan_blocks_reclaimed": sum(len(r.get("block_ids", [])) for r in reclaimed),
        "idle_releases": len(releases),
        "idle_released_bytes": sum(int(r.get("released_bytes", 0)) for r in releases),
        "last": records[-1] if records else None,
    }


class Channel:
    """A vLLM process's writer; a no-op when the runtime gave no state dir (plain `vllm serve`)."""

    def __init__(self, state_dir: str | None, generation: str | None) -> None:
        self.dir = gen_dir(state_dir, int(generation or 0)) if state_dir else None
        self.started = time.time()

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Channel:
        return cls(env.get("VLLM_GUARD_STATE_DIR"), env.get("VLLM_GUARD_GENERATION"))

    def report(self, data: Mapping[str, Any]) -> None:
        if self.dir is not None:
            write_json_atomic(self.dir / f"{os.getpid()}.json", data)

    def event(self, record: Mapping[str, Any]) -> None:
        if self.dir is not None:
            append_jsonl(self.dir / EVENTS, record)

    def inject(self, record: Mapping[str, Any]) -> None:
        if self.dir is not None:
            append_jsonl(self.dir / INJECT, record)
