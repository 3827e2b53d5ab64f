"""NVML: one session for the process, every call on one worker thread with a timeout.

The watchdog samples everything (one JSON-able record per tick, the schema the replay reads);
the runtime asks two questions (per-process memory, GPU names). Both go through `NvmlSession`.

Every NVML call runs on one worker thread with a timeout: a GPU that fell off the bus can
block a call for minutes, and the watchdog must keep watching everything else. A call that
answers NOT_SUPPORTED (common on GeForce) is recorded once as a missing capability and never
made again. NVML absent is a state (`available` False, one `error` line), not an exception.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import os
import time
from typing import Any, Callable

try:
    import pynvml
except ImportError:  # pragma: no cover - base dependency
    pynvml = None

SCHEMA = 1  # bump when a field changes meaning; the replay checks it
MIB = 2**20

# field name -> what it needs; the capability table lists these
FIELDS = (
    "memory", "processes", "temperature", "temp_thresholds", "sm_clock", "sm_clock_max",
    "clock_reasons", "power", "power_limit", "utilization", "ecc", "remapped_rows",
    "persistence", "xid_events",
)


class NvmlTimeout(RuntimeError):
    """An NVML call did not return in time (GPU lost, driver wedged)."""


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _err_name(e: BaseException) -> str:
    return type(e).__name__.replace("NVMLError_", "")


class NvmlSession:
    """Reads every GPU NVML shows; `sample()` returns one trace record (see docs/WATCHDOG.md)."""

    def __init__(self, timeout_s: float = 2.0, nvml: Any = None) -> None:
        self.timeout_s = timeout_s
        self.nv = nvml if nvml is not None else pynvml
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvml")
        self._busy: cf.Future[Any] | None = None
        self.available = False
        self.error = ""  # one clear line when NVML is absent or broken
        self.mismatch = False  # driver/library version mismatch: an incident of its own
        self.capabilities: dict[str, dict[str, bool]] = {}  # uuid -> field -> supported
        self.static: list[dict[str, Any]] = []
        self.driver = ""
        self.cuda_driver = ""
        self._handles: list[Any] = []
        self._events: Any = None
        self._init()

    # -- calls with a timeout ------------------------------------------------------------------
    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._busy is not None and not self._busy.done():
            raise NvmlTimeout("an earlier NVML call is still blocked")
        fut = self._pool.submit(fn, *args)
        self._busy = fut
        try:
            return fut.result(timeout=self.timeout_s)
        except cf.TimeoutError as e:
            raise NvmlTimeout(f"{getattr(fn, '__name__', fn)} took more than {self.timeout_s}s") from e

    def _init(self) -> None:
        if self.nv is None:
            self.error = "NVML unavailable: nvidia-ml-py is not installed"
            return
        try:
            self._call(self.nv.nvmlInit)
            count = self._call(self.nv.nvmlDeviceGetCount)
        except NvmlTimeout as e:
            self.error = f"NVML unavailable: {e}"
            return
        except Exception as e:  # LibraryNotFound, DriverNotLoaded, LibRmVersionMismatch, ...
            self.mismatch = _err_name(e) == "LibRmVersionMismatch"
            self.error = f"NVML unavailable: {e}"
            return
        self.driver = _text(self._safe(self.nv.nvmlSystemGetDriverVersion) or "")
        cuda = self._safe(self.nv.nvmlSystemGetCudaDriverVersion_v2)
        self.cuda_driver = f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else ""
        self._handles = [self._call(self.nv.nvmlDeviceGetHandleByIndex, i) for i in range(count)]
        for i, h in enumerate(self._handles):
            self.static.append(self._read_static(i, h))
        self._events = self._register_xid()
        self.available = bool(self._handles)
        if not self.available:
            self.error = "NVML found no GPU"

    def _safe(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return self._call(fn, *args)
        except Exception:
            return None

    def _read_static(self, i: int, h: Any) -> dict[str, Any]:
        nv = self.nv
        uuid = _text(self._call(nv.nvmlDeviceGetUUID, h))
        pci = self._safe(nv.nvmlDeviceGetPciInfo, h)
        self.capabilities[uuid] = {}
        info = {
            "index": i, "uuid": uuid, "name": _text(self._call(nv.nvmlDeviceGetName, h)),
            "pci_bus_id": _text(pci.busId) if pci is not None else "",
        }
        info["temp_slowdown_c"], info["temp_shutdown_c"] = self._field(uuid, "temp_thresholds", lambda: (
            self._call(nv.nvmlDeviceGetTemperatureThreshold, h, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
            self._call(nv.nvmlDeviceGetTemperatureThreshold, h, nv.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
        )) or (None, None)
        info["sm_clock_max_mhz"] = self._field(uuid, "sm_clock_max", lambda: self._call(
            nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM))
        # the card's size decides before any sample whether a weight holder fits beside vLLM
        mem = self._field(uuid, "memory", lambda: self._call(nv.nvmlDeviceGetMemoryInfo, h))
        info["mem_total_mb"] = round(mem.total / MIB, 1) if mem is not None else None
        return info

    def _register_xid(self) -> Any:
        nv = self.nv
        try:
            es = self._call(nv.nvmlEventSetCreate)
        except Exception:
            return None
        any_ok = False
        for s, h in zip(self.static, self._handles):
            ok = self._field(s["uuid"], "xid_events", functools.partial(self._register_one, h, es))
            any_ok = any_ok or bool(ok)
        return es if any_ok else None

    def _register_one(self, h: Any, es: Any) -> bool:
        self._call(self.nv.nvmlDeviceRegisterEvents, h, self.nv.nvmlEventTypeXidCriticalError, es)
        return True

    def _field(self, uuid: str, name: str, read: Callable[[], Any]) -> Any:
        """Read one field; NOT_SUPPORTED is remembered and the call never made again."""
        caps = self.capabilities.setdefault(uuid, {})
        if caps.get(name) is False:
            return None
        try:
            value = read()
        except NvmlTimeout:
            raise
        except Exception as e:
            if _err_name(e) in ("NotSupported", "FunctionNotFound", "NoPermission"):
                caps[name] = False
            return None
        caps[name] = True
        return value

    # -- one sample ----------------------------------------------------------------------------
    def sample(self) -> dict[str, Any]:
        """One record: {"kind": "sample", "at_s", "driver", "gpus": [...], "xids": [...]}."""
        rec: dict[str, Any] = {"kind": "sample", "at_s": round(time.time(), 3), "driver": self.driver,
                               "cuda_driver": self.cuda_driver, "gpus": [], "xids": [], "error": None}
        if not self.available:
            rec["error"] = self.error
            return rec
        try:
            for s, h in zip(self.static, self._handles):
                rec["gpus"].append(self._read_gpu(s, h))
            rec["xids"] = self._read_xids()
        except NvmlTimeout as e:
            rec["error"] = f"timeout: {e}"
        except Exception as e:  # GpuIsLost, Unknown: say so, keep the partial record
            rec["error"] = f"{_err_name(e)}: {e}"
        return rec

    def _read_gpu(self, s: dict[str, Any], h: Any) -> dict[str, Any]:
        nv, u, f = self.nv, s["uuid"], self._field
        g: dict[str, Any] = dict(s)
        mem = f(u, "memory", lambda: self._call(nv.nvmlDeviceGetMemoryInfo, h))
        g["mem_used_mb"] = round(mem.used / MIB, 1) if mem is not None else None
        g["mem_total_mb"] = round(mem.total / MIB, 1) if mem is not None else None
        procs = f(u, "processes", lambda: self._call(nv.nvmlDeviceGetComputeRunningProcesses, h)) or []
        g["processes"] = [{"pid": int(p.pid), "used_mb": round((p.usedGpuMemory or 0) / MIB, 1)
                           if isinstance(p.usedGpuMemory, int) else None} for p in procs]
        g["temp_c"] = f(u, "temperature", lambda: self._call(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU))
        g["sm_clock_mhz"] = f(u, "sm_clock", lambda: self._call(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM))
        g["clock_reasons"] = f(u, "clock_reasons", lambda: self._call(self._reasons_fn(), h))
        pw = f(u, "power", lambda: self._call(nv.nvmlDeviceGetPowerUsage, h))
        g["power_w"] = round(pw / 1000, 1) if pw is not None else None
        pl = f(u, "power_limit", lambda: self._call(nv.nvmlDeviceGetEnforcedPowerLimit, h))
        g["power_limit_w"] = round(pl / 1000, 1) if pl is not None else None
        ut = f(u, "utilization", lambda: self._call(nv.nvmlDeviceGetUtilizationRates, h))
        g["util_pct"] = ut.gpu if ut is not None else None
        g["ecc_uncorrected"] = f(u, "ecc", lambda: self._call(
            nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC))
        rr = f(u, "remapped_rows", lambda: self._call(nv.nvmlDeviceGetRemappedRows, h))
        g["remapped_rows"] = ({"correctable": rr[0], "uncorrectable": rr[1], "pending": bool(rr[2]),
                               "failure": bool(rr[3])} if rr is not None else None)
        g["persistence"] = f(u, "persistence", lambda: self._call(nv.nvmlDeviceGetPersistenceMode, h))
        return g

    def _reasons_fn(self) -> Callable[..., Any]:
        nv = self.nv
        return getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons

    def _read_xids(self) -> list[dict[str, Any]]:
        """Drain pending Xid events without blocking (wait 0 ms)."""
        if self._events is None:
            return []
        out = []
        by_handle = {id(h): s["uuid"] for s, h in zip(self.static, self._handles)}
        for _ in range(64):
            try:
                ev = self._call(self.nv.nvmlEventSetWait_v2, self._events, 0)
            except NvmlTimeout:
                raise
            except Exception:  # Timeout = nothing pending
                break
            out.append({"xid": int(ev.eventData), "uuid": by_handle.get(id(ev.device), "")})
        return out

    def names(self) -> list[str]:
        return [str(s["name"]) for s in self.static]

    def process_memory_mb(self) -> dict[int, float]:
        """Used GPU memory per pid (MiB), summed over GPUs; {} without NVML or on error."""
        if not self.available:
            return {}
        out: dict[int, float] = {}
        try:
            for h in self._handles:
                for p in self._call(self.nv.nvmlDeviceGetComputeRunningProcesses, h):
                    used = p.usedGpuMemory if isinstance(p.usedGpuMemory, int) else 0
                    out[int(p.pid)] = out.get(int(p.pid), 0.0) + used / MIB
        except Exception:  # noqa: BLE001 - a timeout or a lost GPU: what we have so far
            return out
        return out

    def device_memory_mb(self) -> dict[str, tuple[float, float]]:
        """{uuid: (used MiB, total MiB)} of every GPU; {} without NVML, a GPU that fails is left out."""
        out: dict[str, tuple[float, float]] = {}
        if not self.available:
            return out
        for s, h in zip(self.static, self._handles):
            try:
                mem = self._call(self.nv.nvmlDeviceGetMemoryInfo, h)
            except Exception:  # noqa: BLE001 - a timeout or a lost GPU: the others still answer
                continue
            out[str(s["uuid"])] = (mem.used / MIB, mem.total / MIB)
        return out

    def capability_table(self) -> dict[str, Any]:
        """Which fields each GPU supports (True/False; absent = not tried yet)."""
        return {"driver": self.driver, "cuda_driver": self.cuda_driver, "error": self.error or None,
                "gpus": {s["uuid"]: {"name": s["name"], **{k: self.capabilities.get(s["uuid"], {}).get(k)
                                                          for k in FIELDS}} for s in self.static}}

    def meta(self) -> dict[str, Any]:
        """The trace's first line: schema, host facts, capabilities."""
        return {"kind": "meta", "schema": SCHEMA, "host": os.uname().nodename, "at_s": round(time.time(), 3),
                **self.capability_table()}

    def close(self) -> None:
        if self.available and (self._busy is None or self._busy.done()):
            try:
                if self._events is not None:
                    self._call(self.nv.nvmlEventSetFree, self._events)
                self._call(self.nv.nvmlShutdown)
            except Exception:
                pass
        self._pool.shutdown(wait=False, cancel_futures=True)
