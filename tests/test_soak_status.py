"""The soak's memory sampler reads the guard's status as a typed StatusSnapshot.

The peer is an admin socket (real unix socket, real HTTP) that answers `GET /status` with a
snapshot built from core.protocol's own model, so the soak decodes what the runtime sends; a
test renames one key to play a runtime of another version, which the real runtime cannot be
made to do. The load goes to the synthetic upstream. The real runtime's status is sampled in
tests/test_soak_real.py.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from aiohttp import web

from conftest import GUARD
from test_soak_client import Upstream, upstream_factory  # noqa: F401 - the fixture
from vllm_guard.core.protocol import StatusSnapshot
from vllm_guard.core.samples import SoakStatusRecord
from vllm_guard.core.timefmt import utcnow


class AdminSocket:
    """`<state dir>/admin.sock` answering GET /status with `body(n)` for the n-th request."""

    def __init__(self, state_dir: Path, body: Callable[[int], dict[str, Any]]) -> None:
        self.path, self.body, self.calls = state_dir / "admin.sock", body, 0
        state_dir.mkdir(parents=True, exist_ok=True)
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        assert self.ready.wait(30), "admin socket did not start"

    async def _status(self, _: web.Request) -> web.Response:
        self.calls += 1
        return web.json_response(self.body(self.calls))

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/status", self._status)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.UnixSite(self.runner, str(self.path)).start())
        self.ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def admin_factory() -> Iterator[Callable[..., AdminSocket]]:
    made: list[AdminSocket] = []

    def make(state_dir: Path, body: Callable[[int], dict[str, Any]]) -> AdminSocket:
        made.append(AdminSocket(state_dir, body))
        return made[-1]

    yield make
    for a in made:
        a.stop()


def snapshot(port: int, n: int) -> dict[str, Any]:
    """A serving guard's status, its memory reading refreshed on every call."""
    return StatusSnapshot.from_json({
        "state": "serving", "state_for_s": 10.0, "generation": 3, "pid": 99, "port": port, "model": "synthetic",
        "vllm_version": "0.32.0", "requests": {"total": 100 + n, "completed": 100 + n, "generation": 40 + n},
        "memory": {"warmup_requests": 20, "current": {
            "at": utcnow(), "requests": 40 + n, "rss_mb": 1300.0 + n, "uss_mb": None, "gpu_mb": None,
            "per_process": [{"pid": 11, "role": "api_server", "rss_mb": 600.0},
                            {"pid": 12, "role": "engine_core", "rss_mb": 700.0 + n, "uss_mb": 650.0}]}},
        "patches": {"12": {"process": "engine_core", "pid": 12,
                           "patches": {"idle-release": {"state": "applied", "reason": "ok"}}}},
    }).to_json()


def renamed(data: dict[str, Any]) -> dict[str, Any]:
    """The same status from a runtime that renamed `requests` (another version)."""
    out = dict(data)
    out["request_counters"] = out.pop("requests")
    return out


def soak(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GUARD, "soak", "--scenario", "custom", "--prompt-tokens", "16", "--output-tokens", "4",
                           "--no-progress", *args], capture_output=True, text=True, timeout=180)


def rows(db: Path, sql: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(db) as c:
        return c.execute(sql).fetchall()


def test_status_is_sampled_typed_and_gives_the_url(upstream_factory: Any, admin_factory: Any,  # noqa: F811
                                                    tmp_path: Path) -> None:
    """No --url: the soak finds the guard's port in its status; each new memory reading becomes
    one soak_samples row per process, and soak_status keeps the typed record."""
    up = upstream_factory()
    sd = tmp_path / "state"
    adm = admin_factory(sd, lambda n: snapshot(up.port, n))
    out = soak("--state-dir", str(sd), "--rate", "20", "--requests", "40", "--sample-interval", "0.2s")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["failed"] == 0 and up.stats()["posts"] == 40
    assert summary["status_protocol_errors"] == 0 and summary["memory_samples"] >= 3, summary
    db = sd / "ledger.sqlite"
    samples = rows(db, "SELECT generation, state, role, pid, rss_mb, uss_mb, requests_generation, requests_total "
                       "FROM soak_samples ORDER BY id")
    assert len(samples) == 2 * summary["memory_samples"] and adm.calls >= summary["memory_samples"]
    eng = [s for s in samples if s[2] == "engine_core"]
    assert all(s[:4] == (3, "serving", "engine_core", 12) and s[5] == 650.0 for s in eng)
    assert all(s[4] == 700.0 + (s[6] - 40) and s[7] == 100 + (s[6] - 40) for s in eng)
    recs = [SoakStatusRecord.model_validate_json(r[0]) for r in rows(db, "SELECT data FROM soak_status")]
    assert recs and recs[0].generation == 3 and recs[0].patches["12"].patches["idle-release"].state == "applied"
    params = json.loads(rows(db, "SELECT params FROM runs")[0][0])
    assert params["state_dir"] == str(sd) and params["url"] == up.url


def test_a_status_of_another_version_stops_the_soak_before_it_sends(upstream_factory: Any,  # noqa: F811
                                                                    admin_factory: Any, tmp_path: Path) -> None:
    up = upstream_factory()
    sd = tmp_path / "state"
    admin_factory(sd, lambda n: renamed(snapshot(up.port, n)))
    out = soak("--url", up.url, "--state-dir", str(sd), "--rate", "20", "--requests", "10")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "does not match this soak" in out.stderr and "request_counters" in out.stderr
    assert up.stats()["posts"] == 0


def test_a_status_that_stops_matching_mid_run_is_warned_and_counted(upstream_factory: Any,  # noqa: F811
                                                                    admin_factory: Any, tmp_path: Path) -> None:
    """The runtime is replaced by another version during the soak: the load goes on, the soak
    says once that memory samples stopped and why, and the summary counts the polls."""
    up = upstream_factory()
    sd = tmp_path / "state"
    admin_factory(sd, lambda n: snapshot(up.port, n) if n <= 3 else renamed(snapshot(up.port, n)))
    out = soak("--url", up.url, "--state-dir", str(sd), "--db", str(tmp_path / "l.sqlite"), "--rate", "20",
               "--requests", "40", "--sample-interval", "0.2s")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["failed"] == 0 and summary["status_protocol_errors"] >= 2 and summary["memory_samples"] >= 1
    warnings = [ln for ln in out.stderr.splitlines() if "does not match this soak's schema" in ln]
    assert len(warnings) == 1 and "request_counters" in warnings[0], out.stderr
