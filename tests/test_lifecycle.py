"""The runtime's own end, planned or not, against a real vLLM: an exception in the supervisor
still kills the whole vLLM process group; a runtime killed with SIGKILL leaves a ledger whose
open generation kept its served count, and — when its keeper died with it, so vLLM was left
running — the next runtime kills the orphaned vLLM tree it finds there and continues the
generation numbers."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import GuardServer, processes_of
from streams import run_load, summarize

pytestmark = pytest.mark.slow


def keeper_of(state_dir: Path) -> list[int]:
    """The runtime's keeper process (runtime/child/keeper.py, told the state dir as its marker)."""
    marker = f"VLLM_GUARD_STATE_DIR={state_dir.resolve()}".encode()
    found = []
    for d in Path("/proc").iterdir():
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0") if d.name.isdigit() else []
        except OSError:
            continue
        if marker in argv and any(a.endswith(b"keeper.py") for a in argv):
            found.append(int(d.name))
    return found


def ledger_rows(state_dir: Path, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(state_dir / "ledger.sqlite")
    try:
        return [tuple(r) for r in db.execute(sql, params).fetchall()]
    finally:
        db.close()


def test_an_exception_in_the_supervisor_still_kills_the_vllm_group(guard_factory: Any) -> None:
    srv: GuardServer = guard_factory(env={"VLLM_GUARD_RUNTIME_FAULT": "ready"})
    assert srv.proc is not None
    rc = srv.proc.wait(600)
    assert rc == 1, srv.tail()
    events = [e["event"] for e in srv.events()]
    assert "generation_ready" in events and "runtime_crashed" in events, events
    assert "killing_generation_on_exit" in events
    end = time.monotonic() + 10
    while processes_of(srv.state_dir) and time.monotonic() < end:
        time.sleep(0.2)
    assert not processes_of(srv.state_dir), "vLLM processes of the crashed runtime survived"
    assert ledger_rows(srv.state_dir, "SELECT generation, end_reason, end_class FROM generations") == [
        (1, "runtime_error", "unplanned")]


def test_a_killed_runtime_leaves_served_counts_and_its_successor_reaps_the_orphans(
        tiny_model: str, tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "guard.toml").write_text("[recycle]\nmemory_interval = '1s'\n")
    first = GuardServer(tiny_model, state, args=["--config", str(state / "guard.toml")]).start()
    second = None
    try:
        first.wait_serving(1, 600)
        results = asyncio.run(run_load(first.url, first.model, 12, 4, 8))
        assert summarize(results, 8).ok == 12
        # the served count reaches the ledger while the generation serves
        end = time.monotonic() + 60
        while time.monotonic() < end and ledger_rows(state, "SELECT requests_served FROM generations") != [(12,)]:
            time.sleep(0.2)
        assert ledger_rows(state, "SELECT requests_served, ended_at FROM generations") == [(12, None)]
        vllm = processes_of(state)
        assert vllm
        assert first.proc is not None
        # The runtime's keeper kills vLLM when the runtime dies (test_faults_guard.py); here it
        # dies first (the OOM killer, `kill -9` of the whole unit's processes but vLLM's), so the
        # successor must find and kill what is left by itself.
        keepers = keeper_of(state)
        assert len(keepers) == 1, keepers
        os.kill(keepers[0], signal.SIGKILL)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(30)
        time.sleep(1)
        assert set(vllm) & set(processes_of(state)), "nothing was orphaned: the case was not exercised"

        second = GuardServer(tiny_model, state, args=["--config", str(state / "guard.toml")]).start()
        st = second.wait_serving(2, 600)
        assert st["generation"] == 2, "generation numbers restarted with the new runtime"
        killed = [e for e in second.events() if e.get("event") == "orphan_generation_killed"]
        assert killed and killed[0]["generation"] == 1
        assert not set(vllm) & set(processes_of(state)), "the orphaned generation still runs"
        (served, ready_at, updated_at, ended_at, reason, cls), = ledger_rows(
            state, "SELECT requests_served, ready_at, updated_at, ended_at, end_reason, end_class FROM generations "
                   "WHERE generation = 1")
        assert (served, reason, cls) == (12, "runtime_lost", "unplanned")
        assert ended_at == updated_at and ended_at > ready_at, (ready_at, updated_at, ended_at)
    finally:
        for s in (second, first):
            if s is not None:
                s.stop()
        for pid in processes_of(state):  # never leave vLLM behind, whatever failed above
            os.kill(pid, signal.SIGKILL)
