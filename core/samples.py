"""The watchdog's sample records: what it writes to the ledger's `samples` table (one row
per source per tick, JSON in `data`) and what NVML trace files hold. The report, the replay
and the exporter read them through these models.

Box-wide sources (nvml, procs, host, status, verdicts) are rows with `replica` NULL; what the
watchdog reads of each replica (`REPLICA_SOURCES`: its /metrics counters, its hang verdict) is
one row per replica, `replica` = its index. Schema 1 had one `metrics` row for the one backend.

Readers ignore fields they do not know (a newer watchdog may add some) but every field they
rely on is required, so a renamed one fails loudly (ProtocolError) instead of reading as
absent. `SAMPLES_SCHEMA` is recorded in the ledger's meta table and in each trace's meta line.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .protocol import PatchProcessReport, RequestCounters, Role, RuntimeState, StatusSnapshot

SAMPLES_SCHEMA = 2
NVML_SCHEMA = 1


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class GpuProcess(_Record):
    pid: int
    used_mb: float | None


class RemappedRows(_Record):
    correctable: int
    uncorrectable: int
    pending: bool
    failure: bool


class GpuReading(_Record):
    index: int
    uuid: str
    name: str
    pci_bus_id: str = ""
    temp_slowdown_c: float | None = None
    temp_shutdown_c: float | None = None
    sm_clock_max_mhz: float | None = None
    mem_used_mb: float | None = None
    mem_total_mb: float | None = None
    processes: list[GpuProcess] = Field(default_factory=list)
    temp_c: float | None = None
    sm_clock_mhz: float | None = None
    clock_reasons: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    util_pct: float | None = None
    ecc_uncorrected: int | None = None
    remapped_rows: RemappedRows | None = None
    persistence: int | None = None


class XidEvent(_Record):
    xid: int
    uuid: str = ""


class NvmlRecord(_Record):
    """One NVML reading of every GPU (`kind` sample), as the live session and the replay give it."""

    kind: Literal["sample"] = "sample"
    at_s: float
    driver: str = ""
    cuda_driver: str = ""
    gpus: list[GpuReading] = Field(default_factory=list)
    xids: list[XidEvent] = Field(default_factory=list)
    error: str | None = None
    label: str | None = None


class ProcReading(_Record):
    role: Role
    rss_mb: float
    swap_mb: float | None = None
    uss_mb: float | None = None


class HostReading(_Record):
    mem_total_mb: float
    mem_available_mb: float
    swap_used_mb: float
    boot_id: str = ""


class StatusBrief(_Record):
    """The runtime's counters at the tick (from its StatusSnapshot)."""

    state: str
    generation: int
    requests_total: int
    requests_generation: int
    in_flight: int
    queued: int
    failures: int
    hold: str | None = None
    backend_url: str | None = None
    completed: int = 0
    failed: int = 0
    client_disconnects: int = 0
    # RequestCounters' token and stream counts; None: the runtime did not count them
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    streamed: int | None = None

    @classmethod
    def from_snapshot(cls, st: StatusSnapshot) -> StatusBrief:
        """The counters the watchdog keeps of a status, every tick."""
        r = st.requests
        return cls(state=st.state.value, generation=st.generation, requests_total=r.total,
                   requests_generation=r.generation, in_flight=r.in_flight, queued=r.queued, failures=st.failures,
                   hold=st.hold, backend_url=st.backend_url, completed=r.completed, failed=r.failed,
                   client_disconnects=r.client_disconnects, prompt_tokens=r.prompt_tokens,
                   output_tokens=r.output_tokens, streamed=r.streamed)


class ReplicaBrief(_Record):
    """One replica at the tick: what the runtime said of it and the watchdog's hang verdict."""

    state: str
    generation: int
    backend_url: str | None = None
    hang: str  # the hang detector's health for this replica (healthy, degraded, unhealthy, unknown)
    probe_misses: int = 0  # timed-out probes in a row with no progress over their window
    reason: str = ""


class ReplicaTick(_Record):
    """The per-replica sources of one tick (`samples` rows with `replica` = the index)."""

    metrics: dict[str, float | None] | None = None  # the replica's vLLM engine counters
    replica: ReplicaBrief | None = None


REPLICA_SOURCES = ("metrics", "replica")


class Tick(_Record):
    """One watchdog tick as read back from the ledger (every source optional)."""

    at: str
    nvml: NvmlRecord | None = None
    procs: dict[str, ProcReading] | None = None
    host: HostReading | None = None
    metrics: dict[str, float | None] | None = None  # schema 1 only: the one backend's counters
    status: StatusBrief | None = None
    verdicts: dict[str, str] | None = None
    replicas: dict[str, ReplicaTick] = Field(default_factory=dict)  # replica index (as text) -> its sources

    @classmethod
    def from_sources(cls, at: str, sources: dict[str, Any]) -> Tick:
        return cls.model_validate({"at": at, **sources})

    @classmethod
    def from_rows(cls, at: str, rows: list[tuple[str, int | None, Any]]) -> Tick:
        return cls.from_sources(at, tick_sources(rows))


def tick_sources(rows: list[tuple[str, int | None, Any]]) -> dict[str, Any]:
    """One tick's `(source, replica, data)` rows (`data` parsed JSON) as a `Tick`'s fields:
    box-wide rows (replica None) by source, the others under `replicas`."""
    sources: dict[str, Any] = {}
    for source, replica, data in rows:
        if replica is None:
            sources[source] = data
        else:
            sources.setdefault("replicas", {}).setdefault(str(replica), {})[source] = data
    return sources


class SoakStatusRecord(_Record):
    """What the load generator keeps of the runtime's status in `soak_status.data` (JSON), once
    per generation and every minute: the counters and the patch states the report lists. The
    load generator writes it, the report reads it; both through this model."""

    state: RuntimeState
    generation: int
    requests: RequestCounters
    failures: int
    recycles: int
    model: str
    vllm_version: str
    gpu_name: str | None
    patches: dict[str, PatchProcessReport]  # pid -> the plugin's report of that process

    @classmethod
    def from_snapshot(cls, st: StatusSnapshot) -> SoakStatusRecord:
        return cls(state=st.state, generation=st.generation, requests=st.requests, failures=st.failures,
                   recycles=st.recycles, model=st.model, vllm_version=st.vllm_version, gpu_name=st.gpu_name,
                   patches=dict(st.patches))
