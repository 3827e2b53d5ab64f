"""The plugin's writer side of the report channel (the reader is `vllm_guard.core.plugin`).

The layout (one folder per generation, `<pid>.json` per process, `events.jsonl`,
`inject.jsonl`) and the env variables that name it are core.plugin's constants, so writer and
reader cannot drift apart. No vLLM or torch here; nothing here raises into vLLM except
OSError, which the callers catch and log.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from vllm_guard.core import plugin as contract
from vllm_guard.core.timefmt import utcnow


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


def generation_of(env: Mapping[str, str]) -> int:
    """The generation the runtime gave this process; 0 when unset or not a number (plain vLLM)."""
    text = env.get(contract.GENERATION_VAR, "").strip()
    return int(text) if text.isdigit() else 0


class Channel:
    """A vLLM process's writer; a no-op when the runtime gave no state dir (plain `vllm serve`)."""

    def __init__(self, state_dir: str | None, generation: int) -> None:
        self.dir = contract.gen_dir(state_dir, generation) if state_dir else None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Channel:
        return cls(env.get(contract.STATE_DIR_VAR) or None, generation_of(env))

    def report(self, data: Mapping[str, Any]) -> None:
        """This process's report (`PatchProcessReport` JSON), replaced atomically."""
        if self.dir is not None:
            write_json_atomic(self.dir / f"{os.getpid()}.json", data)

    def event(self, record: Mapping[str, Any]) -> None:
        if self.dir is not None:
            append_jsonl(self.dir / contract.EVENTS, record)

    def inject(self, record: Mapping[str, Any]) -> None:
        if self.dir is not None:
            append_jsonl(self.dir / contract.INJECT, record)
