"""The admin protocol as the runtime serves it: a real `vllm-guard serve` held from the start
(a hold file in its state dir, so no vLLM is started) answers `GET /status` with a typed
StatusSnapshot and `POST /command` with CommandReply / 409 / 400, and the CLI turns each into
one line and the right exit code. Plus the human status format on snapshots of every shape."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import GUARD_CMD, free_port
from vllm_guard.core.ledger import EndClass
from vllm_guard.core.protocol import (
    RECENT, FailureSummary, LatencySummary, RecycleSummary, RequestCounters, RuntimeState, StatusSnapshot,
)
from vllm_guard.runtime.status.fmt import format_status


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GUARD_CMD, *args], capture_output=True, text=True, timeout=600)


def raw(sock: Path, method: str, path: str, body: bytes = b"") -> tuple[int, Any]:
    """One HTTP/1.0 request over the unix socket, no client library in between."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(15)
        s.connect(str(sock))
        s.sendall(f"{method} {path} HTTP/1.0\r\nHost: guard\r\nContent-Length: {len(body)}\r\n"
                  f"Content-Type: application/json\r\n\r\n".encode() + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    state = tmp_path_factory.mktemp("held")
    (state / "hold.json").write_text(json.dumps({"reason": "gpu needs reset"}))
    model = tmp_path_factory.mktemp("model")  # held: vLLM never starts, the path only has to exist
    log = open(state / "guard.log", "wb")
    proc = subprocess.Popen([*GUARD_CMD, "serve", "--state-dir", str(state), "--port", str(free_port()),
                             "--model", str(model)], stdout=log, stderr=subprocess.STDOUT)
    end = time.monotonic() + 120
    while not (state / "admin.sock").exists() and time.monotonic() < end:
        assert proc.poll() is None, (state / "guard.log").read_text()
        time.sleep(0.1)
    try:
        yield state, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        log.close()


def test_status_json_is_a_typed_snapshot(held: tuple[Path, subprocess.Popen[bytes]]) -> None:
    state, _ = held
    r = run("status", "--state-dir", str(state), "--json")
    assert r.returncode == 0, r.stderr
    snap = StatusSnapshot.from_json(json.loads(r.stdout))
    assert snap.state is RuntimeState.HELD and snap.hold == "gpu needs reset"
    assert snap.generation == 0 and snap.children == [] and snap.backend_url is None
    assert snap.ledger.ok and snap.ledger.pending_writes == 0
    code, data = raw(state / "admin.sock", "GET", "/status")
    assert code == 200 and data["schema"] == "vllm-guard-status/5"


def test_human_status_says_held_and_never_none(held: tuple[Path, subprocess.Popen[bytes]]) -> None:
    state, _ = held
    r = run("status", "--state-dir", str(state))
    assert r.returncode == 0, r.stderr
    assert "held" in r.stdout and "HOLD: gpu needs reset" in r.stdout and "None" not in r.stdout


@pytest.mark.parametrize("command", ["recycle", "restart"])
def test_a_command_that_does_not_apply_is_refused_with_the_reason(held: tuple[Path, subprocess.Popen[bytes]],
                                                                  command: str) -> None:
    state, _ = held
    r = run(command, "--state-dir", str(state), "--reason", "test")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{command} refused" in lines[0] and "held (gpu needs reset)" in lines[0], lines
    assert "accepted" not in r.stdout
    code, data = raw(state / "admin.sock", "POST", "/command", json.dumps({"command": command}).encode())
    assert code == 409 and data["accepted"] is False and "held" in data["detail"]


def test_hold_is_accepted_and_replaces_the_reason(held: tuple[Path, subprocess.Popen[bytes]]) -> None:
    state, _ = held
    r = run("hold", "--state-dir", str(state), "--reason", "xid 79 on GPU 0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("hold: accepted: held")
    assert json.loads((state / "hold.json").read_text())["reason"] == "xid 79 on GPU 0"
    r = run("status", "--state-dir", str(state), "--json")
    assert json.loads(r.stdout)["hold"] == "xid 79 on GPU 0"
    assert run("hold", "--state-dir", str(state), "--reason", "gpu needs reset").returncode == 0


@pytest.mark.parametrize("args, needle", [
    (["hold", "--reason", "maint\nWATCHDOG=trigger\nMAINPID=1"], "control characters"),
    (["hold", "--reason", "x" * 201], "at most 200"),
    (["recycle", "--class", "unplanned"], "class has value 'unplanned': recycle accepts scheduled, preventive"),
    (["restart", "--class", "sometimes"], "class has value 'sometimes'"),
])
def test_bad_command_input_is_one_line_and_exit_2(held: tuple[Path, subprocess.Popen[bytes]], args: list[str],
                                                  needle: str) -> None:
    state, _ = held
    r = run(*args, "--state-dir", str(state))
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines


@pytest.mark.parametrize("body, needle", [
    (b"not json", "body is not JSON"),
    (b'{"command": "hold", "reason": "a\\nb"}', "control characters"),
    (b'{"command": "reboot"}', "command"),
    (b'{"command": "recycle", "cls": "unplanned"}', "recycle accepts scheduled, preventive"),
    (b'{"command": "hold", "extra": 1}', "extra"),
    (b"[]", "CommandRequest"),
])
def test_the_socket_refuses_a_bad_body_with_400_and_one_line(held: tuple[Path, subprocess.Popen[bytes]],
                                                            body: bytes, needle: str) -> None:
    state, _ = held
    code, data = raw(state / "admin.sock", "POST", "/command", body)
    assert code == 400 and set(data) == {"error"}
    assert "\n" not in data["error"] and needle in data["error"], data


def test_sigterm_while_held_exits_0(held: tuple[Path, subprocess.Popen[bytes]]) -> None:
    state, proc = held
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, (state / "guard.log").read_text()[-2000:]


# -- the human format, pure -------------------------------------------------------------------
def snapshot(**kw: Any) -> StatusSnapshot:
    base: dict[str, Any] = {"schema": "vllm-guard-status/5", "state": RuntimeState.SERVING, "state_for_s": 245.0,
                            "generation": 3, "pid": 1, "port": 8000, "model": "m"}
    base.update(kw)
    return StatusSnapshot(**base)


def recycle(duration: float | None) -> RecycleSummary:
    return RecycleSummary(reason="max_requests", cls=EndClass.SCHEDULED, started="2026-11-30T10:00:00.000Z",
                          generation=2, in_flight=3, queued=5, duration_s=duration, downtime_s=duration)


def test_a_recycle_in_progress_prints_in_progress_not_took_none() -> None:
    rec = recycle(None)
    text = format_status(snapshot(state=RuntimeState.STARTING, recycles=1, recent_recycles=[rec],
                                  recycle_in_progress=rec))
    assert "None" not in text and "in progress" in text and "took" not in text
    assert "recycling   max_requests (scheduled) of generation 2" in text


def test_durations_and_latencies_are_human() -> None:
    text = format_status(snapshot(recycles=1, recent_recycles=[recycle(65.2)],
                                  ttft=LatencySummary(samples=12, p50_s=0.352, p99_s=1.5)))
    assert "for 4 m 05 s" in text and "took 1 m 05 s" in text
    assert "p50 352 ms, p99 1.5 s (12 recent requests)" in text


def test_failures_and_recycles_are_bounded_with_totals() -> None:
    fails = [FailureSummary(kind="crash", at=f"t{i}", exit_code=0, detail="engine died", restored_at=None,
                            generation=i) for i in range(RECENT)]
    text = format_status(snapshot(failures=25, recent_failures=fails, requests=RequestCounters(
        total=500, generation=70, generation_limit=60, generation_inherited=12)))
    assert f"failures    25 (last {RECENT})" in text
    assert "crash of generation 9 at t9, exit 0: engine died; not restored yet" in text
    assert "this generation 70 (limit 60), 12 of them inherited backlog" in text
    assert "None" not in text
