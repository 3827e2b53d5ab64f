"""NVML trace files (JSONL): the live session writes them, the replay reads them back.

Line 1 is a `meta` record (schema, driver, capability table); every other line is a `sample`
record exactly as `NvmlSession.sample()` returns it (a `core.samples.NvmlRecord`), optionally
with a `label` (idle, load...). Every sample is validated through NvmlRecord when the trace
is read, so a bad trace fails at start naming the file and line, not mid-replay.

`ReplayNvml` offers NvmlSession's interface (`available`, `error`, `mismatch`, `static`,
`driver`, `sample()`, `names()`, `process_memory_mb()`, `capability_table()`, `meta()`,
`close()`), so a GPU scenario runs through the whole watchdog on a machine without one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Protocol, TextIO

from pydantic import ValidationError

from vllm_guard.core.nvml import SCHEMA
from vllm_guard.core.samples import NvmlRecord

STATIC_KEYS = ("index", "uuid", "name", "pci_bus_id", "temp_slowdown_c", "temp_shutdown_c", "sm_clock_max_mhz",
               "mem_total_mb")


class TraceError(ValueError):
    """The file is not an NVML trace this version can read."""


class NvmlSource(Protocol):
    """What the watchdog needs from NVML: the live `core.nvml.NvmlSession` or a replay."""

    available: bool
    error: str
    mismatch: bool
    static: list[dict[str, Any]]
    driver: str

    def sample(self) -> dict[str, Any]: ...

    def names(self) -> list[str]: ...

    def capability_table(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class TraceWriter:
    """Append records to a JSONL trace; flushed per line so a killed recorder keeps its lines."""

    def __init__(self, path: str | Path, meta: dict[str, Any]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: TextIO = open(self.path, "w")
        self.write(meta)

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def read_trace(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(meta, samples) of a trace file, each sample valid as an NvmlRecord; raises TraceError
    naming the file and line."""
    meta: dict[str, Any] | None = None
    samples: list[dict[str, Any]] = []
    try:
        fh = open(path)
    except OSError as e:
        raise TraceError(f"NVML trace {str(path)!r}: {e.strerror}") from e
    with fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{n}: not JSON ({e})") from e
            kind = rec["kind"] if isinstance(rec, dict) and "kind" in rec else None
            if kind == "meta":
                if rec.get("schema") != SCHEMA:
                    raise TraceError(f"{path}:{n}: schema {rec.get('schema')!r}, this version reads {SCHEMA}")
                meta = rec
            elif kind == "sample":
                try:
                    NvmlRecord.model_validate(rec)
                except ValidationError as e:
                    first = e.errors()[0]
                    where = ".".join(str(x) for x in first["loc"])
                    raise TraceError(f"{path}:{n}: not an NVML sample: {where}: {first['msg']}") from e
                samples.append(rec)
    if meta is None:
        raise TraceError(f"{path}: no meta line (is it an NVML trace?)")
    return meta, samples


class ReplayNvml:
    """Stands in for `NvmlSession`; hands out one recorded sample per call."""

    def __init__(self, path: str | Path, loop: bool = False) -> None:
        self.path = Path(path)
        self._meta, self.samples = read_trace(path)
        self.loop = loop
        self._pos = 0
        self.available = bool(self.samples)
        self.error = "" if self.samples else f"NVML trace {path} has no samples"
        self.mismatch = False
        first = NvmlRecord.model_validate(self.samples[0]).gpus if self.samples else []
        self.static: list[dict[str, Any]] = [g.model_dump(include=set(STATIC_KEYS)) for g in first]
        self.driver = str(self._meta.get("driver") or "")
        self.cuda_driver = str(self._meta.get("cuda_driver") or "")

    @property
    def exhausted(self) -> bool:
        """Every recorded sample has been handed out (never, with `loop`)."""
        return not self.loop and self._pos >= len(self.samples)

    def sample(self) -> dict[str, Any]:
        if self.samples and self.loop and self._pos >= len(self.samples):
            self._pos = 0
        if self._pos < len(self.samples):
            self._pos += 1
            return dict(self.samples[self._pos - 1])
        last = self.samples[-1]["at_s"] if self.samples else round(time.time(), 3)
        return {"kind": "sample", "at_s": last, "driver": self.driver, "cuda_driver": self.cuda_driver,
                "gpus": [], "xids": [], "error": self.error or "NVML trace replay exhausted"}

    def names(self) -> list[str]:
        return [str(s["name"]) for s in self.static]

    def process_memory_mb(self) -> dict[int, float]:
        """Used GPU memory per pid in the last sample handed out."""
        if not self._pos:
            return {}
        out: dict[int, float] = {}
        for g in NvmlRecord.model_validate(self.samples[self._pos - 1]).gpus:
            for p in g.processes:
                if p.used_mb is not None:
                    out[p.pid] = out.get(p.pid, 0.0) + p.used_mb
        return out

    def capability_table(self) -> dict[str, Any]:
        return {k: self._meta.get(k) for k in ("driver", "cuda_driver", "error", "gpus")}

    def meta(self) -> dict[str, Any]:
        return dict(self._meta)

    def close(self) -> None:
        return None
