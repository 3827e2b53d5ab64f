"""NVML trace files (JSONL): the live sampler writes them, the replay reads them back.

Line 1 is a `meta` record (schema, driver, capability table); every other line is a `sample`
record exactly as `NvmlSampler.sample()` returns it, optionally with a `label` (idle, load...).
A replay source hands out one sample per call, so a GPU scenario runs on a machine without one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, TextIO

from .nvml import SCHEMA


class TraceError(ValueError):
    """The file is not an NVML trace this version can read."""


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
    """(meta, samples) of a trace file; raises TraceError naming the file and line."""
    meta: dict[str, Any] | None = None
    samples: list[dict[str, Any]] = []
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{n}: not JSON ({e})") from e
            if rec.get("kind") == "meta":
                if rec.get("schema") != SCHEMA:
                    raise TraceError(f"{path}:{n}: schema {rec.get('schema')!r}, this version reads {SCHEMA}")
                meta = rec
            elif rec.get("kind") == "sample":
                samples.append(rec)
    if meta is None:
        raise TraceError(f"{path}: no meta line (is it an NVML trace?)")
    return meta, samples


class ReplayNvml:
    """Stands in for `NvmlSampler`: same `sample()`, `available`, `static`, `capability_table()`."""

    def __init__(self, path: str | Path, loop: bool = False) -> None:
        self.path = Path(path)
        self.meta, self.samples = read_trace(path)
        self.loop = loop
        self._it: Iterator[dict[str, Any]] = iter(self.samples)
        self.available = bool(self.samples)
        self.error = "" if self.samples else f"trace {path} has no samples"
        self.mismatch = False
        first = self.samples[0]["gpus"] if self.samples else []
        keep = ("index", "uuid", "name", "pci_bus_id", "temp_slowdown_c", "temp_shutdown_c", "sm_clock_max_mhz")
        self.static = [{k: g.get(k) for k in keep} for g in first]
        self.driver = str(self.meta.get("driver", ""))
        self.exhausted = False

    def sample(self) -> dict[str, Any]:
        try:
            return dict(next(self._it))
        except StopIteration:
            if self.loop and self.samples:
                self._it = iter(self.samples)
                return dict(next(self._it))
            self.exhausted = True
            return {"kind": "sample", "at_s": None, "gpus": [], "xids": [], "error": "replay exhausted"}

    def capability_table(self) -> dict[str, Any]:
        return {k: self.meta.get(k) for k in ("driver", "cuda_driver", "error", "gpus")}

    def close(self) -> None:
        return None
