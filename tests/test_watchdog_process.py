"""The watchdog as a process: light (never imports vllm or torch), one-line config errors,
and a ledger that survives 50 random kill -9s while incidents pour in."""

from __future__ import annotations

import json
import random
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import GUARD

FIX = Path(__file__).parent / "fixtures" / "watchdog"


def test_once_json_never_imports_vllm_or_torch(tmp_path: Path) -> None:
    code = (
        "import sys, json\n"
        "from vllm_guard.runtime.cli import main\n"
        f"rc = main(['watchdog', '--once', '--json', '--state-dir', {str(tmp_path)!r}, '--kernel', "
        f"{str(FIX / 'kernel_xid13.log')!r}, '--nvml-trace', {str(FIX / 'nvml_thermal_4090.jsonl')!r}])\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))\n"
        "print('MODULES', json.dumps(bad), rc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    head, _, tail = out.stdout.rpartition("MODULES ")
    assert tail.split() == ["[]", "0"]
    doc = json.loads(head)
    names = [v["name"] for v in doc["verdicts"]]
    assert names == ["memory_drift", "thermal", "oom", "hang", "xid", "host_reboot"]
    assert doc["sample"]["nvml"]["gpus"][0]["name"] == "NVIDIA GeForce RTX 4090"
    xid = [v for v in doc["verdicts"] if v["name"] == "xid"][0]
    assert xid["health"] == "unhealthy" and xid["suggested_action"] == "restart"
    # the profile chosen from the NVML name goes into the ledger's meta (what reports label by)
    meta = dict(sqlite3.connect(tmp_path / "ledger.sqlite").execute("SELECT key, value FROM meta"))
    assert json.loads(meta["watchdog.gpu_profile"]) == "rtx4090"
    assert json.loads(meta["watchdog.gpu_names"]) == ["NVIDIA GeForce RTX 4090"]


def test_config_error_is_one_line_exit_2(tmp_path: Path) -> None:
    cfg = tmp_path / "guard.toml"
    cfg.write_text('[watchdog]\ninterval = "fast"\n')
    out = subprocess.run([GUARD, "watchdog", "--config", str(cfg), "--once"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "vllm-guard: error: [watchdog] interval has value 'fast': not a duration (use e.g. 90s, 30m, 24h, 1d)"]


def _acked(proc: subprocess.Popen[str], acks: list[int]) -> None:
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.startswith("{"):
            ev = json.loads(line)
            if ev.get("event") == "incident":
                acks.append(int(ev["id"]))


def _one_life(cmd: list[str], wait_s: float) -> tuple[list[int], bool]:
    """Start a watchdog, let it acknowledge incidents, kill -9 it at a random moment."""
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    acks: list[int] = []
    reader = threading.Thread(target=_acked, args=(p, acks))
    reader.start()
    deadline = time.monotonic() + 60
    while not acks and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.005)
    time.sleep(wait_s)
    killed = p.poll() is None
    if killed:
        p.kill()
    p.wait()
    reader.join()
    return acks, killed


def test_ledger_survives_50_kill9_under_load(tmp_path: Path) -> None:
    """Five watchdogs at a time write the same ledger (samples every tick, a thousand Xid
    incidents per tick) and are killed at random: 10 rounds, 50 kill -9s."""
    klog = tmp_path / "xids.log"
    klog.write_text("".join(f"[{i}.000001] NVRM: Xid (PCI:0000:18:00): 999, pid={i}, name=x, Unknown fault {i}\n"
                            for i in range(20000)))
    rng = random.Random(50)
    cmd = [sys.executable, "-m", "vllm_guard.watchdog", "--state-dir", str(tmp_path), "--interval", "0.01s",
           "--kernel", str(klog), "--nvml-trace", str(FIX / "nvml_h200_steady.jsonl"), "--prometheus-port", "0"]
    acked: list[int] = []
    kills = 0
    for _ in range(10):
        lives: list[tuple[list[int], bool]] = []
        threads = [threading.Thread(target=lambda w=rng.uniform(0.0, 0.3): lives.append(_one_life(cmd, w)))
                   for _ in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for acks, killed in lives:
            acked += acks
            kills += killed
    conn = sqlite3.connect(tmp_path / "ledger.sqlite")
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    have = {r[0] for r in conn.execute("SELECT id FROM incidents WHERE kind = 'xid_999'")}
    conn.close()
    assert kills >= 45 and len(acked) > 50 * 10
    assert set(acked) <= have, f"{len(set(acked) - have)} acknowledged incidents lost"
