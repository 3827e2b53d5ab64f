"""The runtime's Prometheus metrics: the collector on a real status and a real ledger (written by
the runtime's own ledger writer), then the exposition as Prometheus's text parser reads it."""

from __future__ import annotations

import math
import socket
import urllib.request
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_guard.core.protocol import StatusSnapshot
from vllm_guard.runtime.ledger import RuntimeLedger
from vllm_guard.runtime.metrics import LedgerView, RuntimeCollector, RuntimeMetrics, sample_names

STATUS = {
    "state": "draining", "state_for_s": 12.5, "generation": 3, "pid": 7, "port": 8000, "model": "/m/tiny",
    "served_model": "tiny", "vllm_version": "0.32.0", "gpu_name": "NVIDIA H200",
    "requests": {"total": 120, "completed": 100, "failed": 15, "rejected": 5, "retried": 2, "client_disconnects": 5,
                 "in_flight": 3, "queued": 4, "generation": 40, "generation_limit": 50},
    "failures": 1, "recycles": 2,
    "ttft": {"samples": 10, "p50_s": 0.05, "p99_s": 0.4},
    "last_probe": {"at": "2026-01-01T00:00:00.000Z", "ok": False, "latency_s": 20.0, "engine_progress": True},
    "memory": {"warmup_requests": 20,
               "current": {"at": "2026-01-01T00:00:00.000Z", "requests": 40, "rss_mb": 900.0, "uss_mb": 800.0,
                           "gpu_mb": 1000.0, "per_process": [{"pid": 11, "role": "engine_core", "rss_mb": 700.0,
                                                               "uss_mb": 650.0, "gpu_mb": 1000.0}]},
               "growth": {"rss_mb": 30.0, "uss_mb": 20.0, "gpu_mb": 12.0}},
    "ledger": {"ok": True, "pending_writes": 2, "failed_writes": 1},
}


def make_ledger(state: Path) -> Path:
    """Three generations through the runtime's writer: a scheduled recycle, a crash, serving."""
    led = RuntimeLedger(state)
    g1 = led.generation_started(1, 100, 1.0, "tiny")
    led.generation_ready(g1, "0.32.0", "NVIDIA H200")
    led.recycle_started(1, "max_requests", "scheduled", 2, 0)
    led.generation_ended(g1, "max_requests", "scheduled", 50)
    g2 = led.generation_started(2, 101, 2.0, "tiny")
    led.generation_ready(g2, "0.32.0", "NVIDIA H200")
    led.failure(2, "crash", -9, "engine process died", "unplanned")
    led.generation_ended(g2, "crash", "unplanned", 30)
    g3 = led.generation_started(3, 102, 3.0, "tiny")
    led.generation_ready(g3, "0.32.0", "NVIDIA H200")
    led.recycle_started(3, "memory-forecast", "preventive", 0, 0)
    led.close()
    return state / "ledger.sqlite"


def values(registry_text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(registry_text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_collector_on_a_real_status_and_ledger(tmp_path: Path) -> None:
    db = make_ledger(tmp_path)
    m = RuntimeMetrics(db)
    m.snapshot = StatusSnapshot.from_json(STATUS)
    v = values(generate_latest(m.registry).decode())
    P = "vllm_guard_runtime_"
    assert v[(P + "requests_total", ())] == 120
    assert v[(P + "request_outcomes_total", (("outcome", "client_disconnect"),))] == 5
    assert v[(P + "request_outcomes_total", (("outcome", "rejected"),))] == 5
    assert v[(P + "requests_queued", ())] == 4 and v[(P + "requests_in_flight", ())] == 3
    assert v[(P + "generation", ())] == 3 and v[(P + "generation_limit", ())] == 50
    assert v[(P + "state", (("state", "draining"),))] == 1 and v[(P + "state", (("state", "serving"),))] == 0
    assert v[(P + "stall_seconds", ())] == 12.5  # not serving: the spell so far
    assert v[(P + "engine_progress", ())] == 1 and v[(P + "probe_ok", ())] == 0
    assert v[(P + "process_memory_mb", (("memory", "gpu"), ("pid", "11"), ("role", "engine_core")))] == 1000
    assert v[(P + "ledger_failed_writes_total", ())] == 1
    # from the ledger: every runtime's recycles and failures, the one MTBF
    assert v[(P + "recycles_total", (("class", "scheduled"), ("reason", "max_requests")))] == 1
    assert v[(P + "recycles_total", (("class", "preventive"), ("reason", "memory-forecast")))] == 1
    assert v[(P + "failures_total", (("class", "unplanned"), ("kind", "crash")))] == 1
    assert v[(P + "unplanned_events_total", ())] == 1 and v[(P + "generations_total", ())] == 3
    assert v[(P + "ledger_readable", ())] == 1
    assert math.isfinite(v[(P + "mtbf_hours", ())]) and v[(P + "served_requests_total", ())] == 80


def test_no_status_yet_and_an_unreadable_ledger_are_series_not_errors(tmp_path: Path) -> None:
    bad = tmp_path / "ledger.sqlite"
    bad.write_text("not a database\n" * 10)
    c = RuntimeCollector(lambda: None, LedgerView(bad))
    names = {(s.name, s.value) for fam in c.collect() for s in fam.samples}
    assert ("vllm_guard_runtime_status_available", 0.0) in names
    assert ("vllm_guard_runtime_ledger_readable", 0.0) in names


def test_served_over_http_on_loopback(tmp_path: Path) -> None:
    """The exporter the runtime starts: prometheus_client's HTTP server on its own registry."""
    from prometheus_client import start_http_server

    db = make_ledger(tmp_path)
    m = RuntimeMetrics(db)
    m.snapshot = StatusSnapshot.from_json({**STATUS, "state": "serving"})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server, thread = start_http_server(port, addr="127.0.0.1", registry=m.registry)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()
        thread.join(10)
    v = values(text)
    assert v[("vllm_guard_runtime_stall_seconds", ())] == 0  # serving
    assert "vllm_guard_runtime_recycles_total" in sample_names(m.registry)
