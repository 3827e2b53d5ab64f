"""The runtime's own Prometheus metrics: what the fleet view and the alert rules read.

The watchdog exports what it measures (memory slopes, thermals, incidents); the runtime knows
what it served and why it recycled. A custom collector builds every series at scrape time from
two sources, so nothing here runs on the supervisor's loop and nothing can drift from them:
- the status snapshot, refreshed once a second by a task on the loop (`sup.status()` only
  assembles cached fields) and read by the exporter's thread: requests by outcome, queue, in
  flight, generation, state, TTFT, probe, memory growth, ledger health;
- the ledger, read-only, at most every `LEDGER_EVERY_S`: recycles by reason and class, failures
  by kind and class, downtime planned/unplanned, MTBF and availability (`core.reliability`, the
  one MTBF the report and the watchdog show).

For fleets, two more sources: request latency histograms per replica, fed by the proxy's
`RequestDone` records (`requestmetrics`), and each replica's own vLLM `/metrics`, fetched at
scrape time and labelled by replica (`reexport`).

Served on `[server] metrics_addr:metrics_port` (loopback, 9465 by default; 0 turns it off). A
port that cannot be bound is logged and the runtime serves on: metrics never stop serving.
"""

from __future__ import annotations

import asyncio
import math
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import structlog
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vllm_guard.core import ledger as L
from vllm_guard.core.config import ServerConfig
from vllm_guard.core.protocol import RuntimeState, StatusSnapshot
from vllm_guard.core.reliability import service_figures

from ..frontdoor.proxy import Proxy
from .reexport import Fetch, LoopFetch, VllmReexport
from .requestmetrics import RequestHistograms

log = structlog.get_logger("vllm_guard.metrics")

REFRESH_S = 1.0
LEDGER_EVERY_S = 10.0
P = "vllm_guard_runtime_"


class LedgerView:
    """The ledger's runtime tables as metric values, re-read at most every `every_s`."""

    def __init__(self, path: str | Path, every_s: float = LEDGER_EVERY_S) -> None:
        self.path = Path(path)
        self.every_s = every_s
        self._at = -math.inf
        self._lock = threading.Lock()
        self.ok = False
        self.error = ""
        self.recycles: dict[tuple[str, str], int] = {}
        self.failures: dict[tuple[str, str], int] = {}
        self.figures: dict[str, float] = {}

    def refresh(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            if now - self._at < self.every_s:
                return
            self._at = now
            try:
                conn = L.open_readonly(self.path)
                try:
                    h = L.read_runtime(conn)
                finally:
                    conn.close()
            except (L.LedgerError, sqlite3.Error) as e:
                self.ok, self.error = False, str(e)
                return
            rec: dict[tuple[str, str], int] = {}
            for r in h.recycles:
                rec[(r.trigger, r.cls)] = rec.get((r.trigger, r.cls), 0) + 1
            fail: dict[tuple[str, str], int] = {}
            for f in h.failures:
                fail[(f.kind, f.cls)] = fail.get((f.kind, f.cls), 0) + 1
            s = service_figures(h, time.time(), bounds=False)
            m = s.mtbf
            self.recycles, self.failures = rec, fail
            self.figures = {
                "generations": float(s.generations), "up_seconds": s.up_h * 3600.0,
                "downtime_planned": s.downtime_planned_s, "downtime_unplanned": s.downtime_unplanned_s,
                "availability": s.availability if s.availability is not None else math.nan,
                "mtbf_hours": m.mtbf_h if m is not None and m.mtbf_h is not None else math.nan,
                "unplanned": float(s.failures_unplanned), "served": float(s.requests_served),
            }
            self.ok, self.error = True, ""


class RuntimeCollector(Collector):
    """Every `vllm_guard_runtime_*` series, built at scrape time."""

    def __init__(self, status: Callable[[], StatusSnapshot | None], ledger: LedgerView,
                 ready: Callable[[], bool | None] = lambda: None) -> None:
        self.status = status
        self.ledger = ledger
        self.ready = ready

    def collect(self) -> Iterator[Metric]:
        st = self.status()
        yield from self._status(st)
        yield from self._ledger()

    def _status(self, st: StatusSnapshot | None) -> Iterator[Metric]:
        g = GaugeMetricFamily
        up = g(P + "status_available", "1 when the runtime has a status to export (0 before its first)")
        up.add_metric([], 0.0 if st is None else 1.0)
        yield up
        ready = self.ready()
        if ready is not None:
            m = g(P + "ready", "1 while the readiness endpoint answers 200 (a load balancer may send requests)")
            m.add_metric([], 1.0 if ready else 0.0)
            yield m
        if st is None:
            return
        info = g(P + "info", "the runtime and the vLLM it serves (value 1)", labels=["model", "vllm_version", "gpu"])
        info.add_metric([st.served_model or st.model, st.vllm_version or "", st.gpu_name or ""], 1.0)
        yield info
        r = st.requests
        v: Any
        total = CounterMetricFamily(P + "requests", "counted requests received by the proxy (this runtime process)")
        total.add_metric([], r.total)
        yield total
        out = CounterMetricFamily(P + "request_outcomes", "counted requests by outcome: each ends in one of "
                                  "completed, rejected, failed, client_disconnect (retried: attempts tried again)",
                                  labels=["outcome"])
        for name, v in (("completed", r.completed), ("failed", r.failed), ("rejected", r.rejected),
                        ("retried", r.retried), ("client_disconnect", r.client_disconnects)):
            out.add_metric([name], v)
        yield out
        rej = CounterMetricFamily(P + "requests_rejected", "rejected requests by reason (a client error, a bound, "
                                  "held or shutting down: the service did not fail them)", labels=["reason"])
        for reason, n in sorted(r.rejected_by.items()):
            rej.add_metric([reason.value], n)
        yield rej
        fail = CounterMetricFamily(P + "requests_failed", "failed requests by reason (what the service failed)",
                                   labels=["reason"])
        for reason_f, n in sorted(r.failed_by.items()):
            fail.add_metric([reason_f.value], n)
        yield fail
        for name, v, text in (("requests_not_forwarded", r.not_forwarded,
                               "requests the guard answered itself (not in the public API, body, admission)"),
                              ("client_connections_lost", r.connections_lost,
                               "requests whose client connection went away mid-request (left, half-closed, reset)"),
                              ("resumed_requests", r.resumed,
                               "streams that went on at another generation after their backend died"),
                              ("resumes", r.resumes,
                               "continuations sent for streams whose backend died or was handed over "
                               "(a stream may take several)"),
                              ("handed_over_requests", r.handed_over,
                               "streams an overlap's switch moved on to the new generation (not a failure)"),
                              ("unresumable_requests", r.unresumable,
                               "streams cut by a dead backend that could not go on (part of the failed outcome)")):
            c = CounterMetricFamily(P + name, text)
            c.add_metric([], v)
            yield c
        for name, v, text in (("requests_in_flight", r.in_flight, "requests a backend is answering now"),
                              ("requests_queued", r.queued, "requests waiting for a backend now"),
                              ("generation", st.generation, "number of the current vLLM generation"),
                              ("generation_requests", r.generation, "requests the current generation has taken"),
                              ("generation_limit", r.generation_limit if r.generation_limit is not None else math.nan,
                               "max_requests of the current generation (NaN: no limit)"),
                              ("state_seconds", st.state_for_s, "seconds in the current state"),
                              ("stall_seconds", 0.0 if st.state is RuntimeState.SERVING else st.state_for_s,
                               "seconds without a serving generation now (0 while serving)"),
                              ("held", 1.0 if st.hold else 0.0, "1 while an operator or the watchdog holds it"),
                              ("failures_process", st.failures, "unplanned failures since this runtime started"),
                              ("recycles_process", st.recycles, "recycles since this runtime started")):
            m = g(P + name, text)
            m.add_metric([], float(v))
            yield m
        state = g(P + "state", "1 for the current state", labels=["state"])
        for s in RuntimeState:
            state.add_metric([s.value], 1.0 if st.state is s else 0.0)
        yield state
        ttft = g(P + "ttft_seconds", "edge TTFT of recent requests (proxy)", labels=["quantile"])
        for q, v in (("0.5", st.ttft.p50_s), ("0.99", st.ttft.p99_s)):
            ttft.add_metric([q], v if v is not None else math.nan)
        yield ttft
        if st.last_probe is not None:
            p = st.last_probe
            for name, v, text in (("probe_ok", 1.0 if p.ok else 0.0, "1 when the last 1-token probe succeeded"),
                                  ("probe_latency_seconds", p.latency_s, "latency of the last probe"),
                                  ("engine_progress", {True: 1.0, False: 0.0, None: -1.0}[p.engine_progress],
                                   "tokens moved during the last probe window (1), not (0), unknown (-1)")):
                m = g(P + name, text)
                m.add_metric([], v)
                yield m
        if st.memory is not None and st.memory.growth is not None:
            mg = g(P + "memory_growth_mb", "growth of the generation's process tree since warm-up", labels=["memory"])
            gr = st.memory.growth
            for k, v in (("rss", gr.rss_mb), ("uss", gr.uss_mb), ("gpu", gr.gpu_mb)):
                if v is not None:
                    mg.add_metric([k], v)
            yield mg
        if st.memory is not None and st.memory.current is not None:
            pm = g(P + "process_memory_mb", "memory of each vLLM process", labels=["role", "pid", "memory"])
            for pr in st.memory.current.per_process:
                for k, v in (("rss", pr.rss_mb), ("uss", pr.uss_mb), ("gpu", pr.gpu_mb)):
                    if v is not None:
                        pm.add_metric([pr.role.value, str(pr.pid), k], v)
            yield pm
        yield from _replicas(st)
        lh = st.ledger
        for name, v, text in (("ledger_ok", 1.0 if lh.ok else 0.0, "1 while ledger writes succeed"),
                              ("ledger_pending_writes", lh.pending_writes, "ledger writes queued")):
            m = g(P + name, text)
            m.add_metric([], float(v))
            yield m
        fw = CounterMetricFamily(P + "ledger_failed_writes", "ledger writes that failed (this runtime process)")
        fw.add_metric([], lh.failed_writes)
        yield fw

    def _ledger(self) -> Iterator[Metric]:
        lv = self.ledger
        lv.refresh()
        ok = GaugeMetricFamily(P + "ledger_readable", "1 when the ledger could be read at the last refresh")
        ok.add_metric([], 1.0 if lv.ok else 0.0)
        yield ok
        if not lv.ok:
            return
        rec = CounterMetricFamily(P + "recycles", "recycles in the ledger by reason and class (all runtimes)",
                                  labels=["reason", "class"])
        for (reason, cls), n in sorted(lv.recycles.items()):
            rec.add_metric([reason, cls], n)
        yield rec
        fail = CounterMetricFamily(P + "failures", "failures in the ledger by kind and class (all runtimes)",
                                   labels=["kind", "class"])
        for (kind, cls), n in sorted(lv.failures.items()):
            fail.add_metric([kind, cls], n)
        yield fail
        f = lv.figures
        down = CounterMetricFamily(P + "downtime_seconds", "time no generation served, by class (ledger)",
                                   labels=["class"])
        down.add_metric(["planned"], f["downtime_planned"])
        down.add_metric(["unplanned"], f["downtime_unplanned"])
        yield down
        for name, key, text in (("up_seconds", "up_seconds", "serving time over all generations (ledger)"),
                                ("generations", "generations", "generations in the ledger"),
                                ("unplanned_events", "unplanned", "unplanned events counted against MTBF (ledger)"),
                                ("served_requests", "served", "requests the generations served (ledger)")):
            c = CounterMetricFamily(P + name, text)
            c.add_metric([], f[key])
            yield c
        for name, key, text in (("mtbf_hours", "mtbf_hours", "up time / unplanned events (ledger; NaN before the first)"),
                                ("availability", "availability", "share of observed time in service (ledger)")):
            m = GaugeMetricFamily(P + name, text)
            m.add_metric([], f[key])
            yield m


class RuntimeMetrics:
    """The registry, the cached status and readiness, the request histograms, the re-export of
    each replica's vLLM metrics (when given a fetch) and the refresh task of one runtime."""

    def __init__(self, ledger_path: str | Path, fetch: Fetch | None = None) -> None:
        self.snapshot: StatusSnapshot | None = None
        self.ready: bool | None = None
        self.registry = CollectorRegistry()
        self.collector = RuntimeCollector(lambda: self.snapshot, LedgerView(ledger_path), lambda: self.ready)
        self.registry.register(self.collector)
        self.requests = RequestHistograms(self.registry)
        if fetch is not None:
            self.registry.register(VllmReexport(self.backends, fetch))

    def backends(self) -> list[tuple[int, str | None]]:
        """Each replica and its serving generation's URL (None while it has none), from the status."""
        st = self.snapshot
        return [] if st is None else [(r.index, r.backend_url) for r in st.replicas]

    async def refresh(self, status: Callable[[], StatusSnapshot], ready: Callable[[], bool] | None = None) -> None:
        while True:
            try:
                self.snapshot = status()
                self.ready = ready() if ready is not None else None
            except Exception as e:  # noqa: BLE001 - a status that cannot be built must not end the exporter
                log.warning("metrics_status_failed", error=f"{type(e).__name__}: {e}")
            await asyncio.sleep(REFRESH_S)


def start(s: ServerConfig, state_dir: Path, status: Callable[[], StatusSnapshot],
          proxy: Proxy) -> asyncio.Task[None] | None:
    """Serve the runtime's metrics (from its loop): returns the task that refreshes them, None
    when off or the port is taken."""
    if not s.metrics_port:
        return None
    m = RuntimeMetrics(state_dir / L.LEDGER_NAME, fetch=LoopFetch(asyncio.get_running_loop()))
    try:
        start_http_server(s.metrics_port, addr=s.metrics_addr, registry=m.registry)
    except OSError as e:
        log.warning("metrics_port_unavailable", addr=s.metrics_addr, port=s.metrics_port, error=str(e))
        return None
    proxy.listeners.append(m.requests.observe)  # every request's end, into the histograms
    log.info("metrics_serving", addr=s.metrics_addr, port=s.metrics_port)
    return asyncio.create_task(m.refresh(status, lambda: proxy.readiness()[0]))


def sample_names(registry: Any) -> set[str]:
    """Every sample name a registry exposes (`_total` and all): what PromQL may select."""
    return {s.name for fam in registry.collect() for s in fam.samples}


def _replicas(st: StatusSnapshot) -> Iterator[Metric]:
    """Per replica (one vLLM server behind the proxy): its generation, load, state, successor."""
    if not st.replicas:
        return
    g = GaugeMetricFamily
    fams = {
        "replica_generation": g(P + "replica_generation", "generation new requests go to, per replica",
                                labels=["replica"]),
        "replica_in_flight": g(P + "replica_in_flight", "requests its generation is answering now", labels=["replica"]),
        "replica_served": g(P + "replica_served", "counted requests its current generation took", labels=["replica"]),
        "replica_serving": g(P + "replica_serving", "1 while the replica serves", labels=["replica"]),
        "replica_successor": g(P + "replica_successor", "1 while a successor starts beside it or is parked",
                               labels=["replica", "strategy"]),
        "replica_info": g(P + "replica_info", "the GPU model each replica runs on (value 1): join on (instance, "
                          "replica) for per-GPU-model views", labels=["replica", "gpu"]),
    }
    for r in st.replicas:
        i = str(r.index)
        fams["replica_generation"].add_metric([i], float(r.generation))
        fams["replica_in_flight"].add_metric([i], float(r.in_flight))
        fams["replica_served"].add_metric([i], float(r.served))
        fams["replica_serving"].add_metric([i], 1.0 if r.state is RuntimeState.SERVING else 0.0)
        fams["replica_successor"].add_metric([i, r.recycle_strategy or ""], 1.0 if r.next_generation else 0.0)
        fams["replica_info"].add_metric([i, r.gpu_name or st.gpu_name or ""], 1.0)
    yield from fams.values()
