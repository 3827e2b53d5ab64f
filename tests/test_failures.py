"""Crashes and hangs of a real EngineCore become restarts; nothing waits forever, nothing is lost
that had not reached the client yet; a starved engine that still moves is never called hung.
One guarded server for the module: starved, crash, then hang."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from conftest import GuardServer
from streams import StreamResult, stream_completion

pytestmark = pytest.mark.slow

PROBE_INTERVAL, PROBE_TIMEOUT, PROGRESS_WINDOW = 3.0, 5.0, 5.0


@pytest.fixture(scope="module")
def srv(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuardServer]:
    state = tmp_path_factory.mktemp("failures")
    cfg = state / "guard.toml"
    # one failed probe with no token moved in 5 s is a hang here (the defaults are 2 and 30 s)
    cfg.write_text(f"[probe]\nfailures = 1\nprogress_window = '{PROGRESS_WINDOW}s'\n")
    # Two sequences at a time and 4000-token streams: the engine works through them in waves of
    # seconds, so a fault always finds some mid-way (with short streams the tiny model can
    # generate every token before the fault lands and leave only buffered output in flight).
    s = GuardServer(tiny_model, state, args=["--config", str(cfg), "--probe-interval", f"{PROBE_INTERVAL}s",
                                             "--probe-timeout", f"{PROBE_TIMEOUT}s"],
                    vllm_args=["--enforce-eager", "--max-model-len", "4096", "--max-num-seqs", "2"])
    s.start()
    try:
        s.wait_serving(1, 600)
        yield s
    finally:
        s.stop()


def engine_pid(status: dict[str, Any]) -> int:
    pids = [c["pid"] for c in status["children"] if c["role"] == "engine_core"]
    assert pids, status["children"]
    return pids[0]


async def storm(srv: GuardServer, n: int, max_tokens: int, fault: Any, after_fault: int) -> tuple[
        list[StreamResult], list[StreamResult], float]:  # (first, later, wall time of the fault)
    """`n` long streams; when they stream, inject `fault`; then `after_fault` more requests."""
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
        results = [StreamResult() for _ in range(n)]
        first = [asyncio.create_task(stream_completion(client, srv.url, srv.model, max_tokens, timeout=900, res=r))
                 for r in results]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and sum(r.chunks > 0 for r in results) < 2:
            await asyncio.sleep(0.05)  # fault only once some streams really stream
        assert sum(r.chunks > 0 for r in results) >= 2, "no stream started"
        t_fault = time.time()
        fault()
        later = [asyncio.create_task(stream_completion(client, srv.url, srv.model, 8, timeout=900))
                 for _ in range(after_fault)]
        return list(await asyncio.gather(*first)), list(await asyncio.gather(*later)), t_fault


def test_a_starved_engine_that_keeps_moving_is_not_a_hang(srv: GuardServer) -> None:
    """Every sequence slot taken by long streams: the 1-token probe waits behind them and times
    out, but vLLM's token counters move, so no probe counts toward a hang."""
    st = srv.status()
    gen = st["generation"]

    async def saturate() -> list[StreamResult]:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=16)) as client:
            return list(await asyncio.gather(*(stream_completion(client, srv.url, srv.model, 4000, timeout=900)
                                               for _ in range(4))))

    def starved_probes() -> list[dict[str, Any]]:  # timed out, but tokens moved or the server worked
        return [e for e in srv.events() if e.get("event") == "probe_failed" and e.get("generation") == gen
                and e.get("verdict") in ("moving", "busy")]

    rounds = 0
    while not starved_probes() and rounds < 6:  # until a probe timed out behind the streams
        results = asyncio.run(saturate())
        assert all(r.ok and r.completion_tokens == 4000 for r in results), [r.error for r in results]
        rounds += 1
    assert starved_probes(), "no probe ever waited behind the streams: the case was not exercised"
    st = srv.status()
    assert st["generation"] == gen and st["state"] == "serving" and st["failures"] == 0, st["recent_failures"]
    assert not [e for e in srv.events() if e.get("event") == "generation_failed"]


def test_kill_9_of_engine_core_restores_service_and_retries_unstarted_requests(srv: GuardServer) -> None:
    st = srv.status()
    gen, pid = st["generation"], engine_pid(st)
    first, later, _ = asyncio.run(storm(srv, 6, 4000, lambda: os.kill(pid, signal.SIGKILL), 6))
    # Requests sent after the crash had not reached the backend: the next generation serves them.
    assert all(r.ok and r.completion_tokens == 8 for r in later), [r.error for r in later]
    assert {r.generation for r in later} == {str(gen + 1)}
    # Every stream ends: complete, or cut by the crash with an error event; never a hang or a
    # silent truncation. (Whether any is mid-way at the kill depends on the box: on 2 cores
    # vLLM-CPU's spinning worker can starve its API server, which then delivers a whole stream
    # only once the engine is done.)
    for r in first:
        assert r.ok or (r.status == 200 and r.error is not None), r
    st = srv.wait_serving(gen + 1, 600)
    assert st["failures"] == 1
    f = st["recent_failures"][0]
    assert f["kind"] == "crash" and f["restored_at"] is not None
    db = sqlite3.connect(srv.state_dir / "ledger.sqlite")
    rows = db.execute("SELECT kind, class, restored_at FROM failures").fetchall()
    assert rows == [("crash", "unplanned", f["restored_at"])]
    end = db.execute("SELECT end_reason, end_class FROM generations WHERE generation = ?", (gen,)).fetchone()
    assert end == ("crash", "unplanned")
    assert not Path(f"/proc/{pid}").exists()


def test_sigstop_of_engine_core_is_a_hang_detected_by_the_probe(srv: GuardServer) -> None:
    st = srv.status()
    gen = st["generation"]
    pids = [c["pid"] for c in st["children"]]
    pid = engine_pid(st)
    first, later, t_fault = asyncio.run(storm(srv, 6, 4000, lambda: os.kill(pid, signal.SIGSTOP), 4))
    st = srv.wait_serving(gen + 1, 600)
    hang = [f for f in st["recent_failures"] if f["kind"] == "hang"]
    assert len(hang) == 1
    events = srv.events()
    detected = [e for e in events if e.get("event") == "generation_failed" and e.get("kind") == "hang"]
    assert detected
    # /health kept answering 200 all along; only the probe saw it, with /metrics showing no token
    # moved over the window. The probe in flight at the stop may still see the engine's last
    # tokens; the next one proves the stall: detection within two probe rounds (+ the /metrics
    # scrapes and a tick on busy cores).
    stopped_events = [e for e in events if e.get("event") == "probe_failed" and e.get("generation") == gen]
    assert stopped_events and stopped_events[-1]["engine_progress"] is False
    at = datetime.fromisoformat(detected[0]["timestamp"].replace("Z", "+00:00")).timestamp()
    assert at - t_fault <= 2 * (PROBE_INTERVAL + max(PROBE_TIMEOUT, PROGRESS_WINDOW)) + 10.0, at - t_fault
    # In-flight clients get an error, not a hang; unstarted ones are served by the next generation.
    # Streams still open when the hang was detected were stalled by it: they end, some in an error.
    at_mono = at - (time.time() - time.monotonic())
    stalled = [r for r in first if r.ended > at_mono]
    for r in first:
        assert r.ok or (r.status == 200 and r.error is not None), r
    # Streams open at the detection end within seconds of it: none hangs. Those of the hung
    # generation that were still being generated end in an error (one whose every token was
    # generated before the stop may still end well; see the crash test on vLLM-CPU's starving).
    hung = [r for r in stalled if r.generation == str(gen)]  # (others were retried: served later)
    assert all(r.ended <= at_mono + 30 for r in hung), hung
    cut = [r for r in hung if r.chunk_tokens < 4000]
    assert all(not r.ok for r in cut), cut
    assert all(r.ok for r in later), [r.error for r in later]
    # the whole old process group is gone (a stopped process dies only by SIGKILL), zombies
    # included: the runtime is the subreaper of orphaned grandchildren and reaps them
    end = time.monotonic() + 5
    while time.monotonic() < end and [p for p in pids if Path(f"/proc/{p}").exists()]:
        time.sleep(0.2)
    assert not [p for p in pids if Path(f"/proc/{p}").exists()]
    # a clean slate for the next generation: it comes up under the retried backlog on busy cores,
    # and its probes may time out while it works through it, but it is not hung
    time.sleep(3 * (PROBE_INTERVAL + PROBE_TIMEOUT))
    st = srv.status()
    assert st["state"] == "serving" and st["generation"] == gen + 1, st["recent_failures"]
    assert [f["kind"] for f in st["recent_failures"]].count("hang") == 1, st["recent_failures"]
