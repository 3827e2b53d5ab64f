"""The watchdog as a process: light (never imports vllm or torch), a summary per detector,
one-line config errors for every section of guard.toml, the GPUs and API key of the service,
and a ledger that survives 50 random kill -9s while incidents pour in."""

from __future__ import annotations

import argparse
import json
import os
import random
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import GUARD_CMD
from vllm_guard.watchdog.trace import TraceWriter, read_trace

FIX = Path(__file__).parent / "fixtures" / "watchdog"


WATCHDOG = [sys.executable, "-m", "vllm_guard.watchdog"]  # the unit may use either entry
ENTRIES = {"python -m vllm_guard.watchdog": WATCHDOG, "vllm-guard watchdog": [*GUARD_CMD, "watchdog"]}


def test_once_json_never_imports_vllm_or_torch(tmp_path: Path) -> None:
    code = (
        "import sys, json\n"
        "from vllm_guard.watchdog.__main__ import main\n"
        f"rc = main(['--once', '--json', '--state-dir', {str(tmp_path)!r}, '--kernel', "
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
    assert doc["sample"]["collectors"]["nvml"]["ok"] is True
    xid = [v for v in doc["verdicts"] if v["name"] == "xid"][0]
    assert xid["health"] == "unhealthy" and xid["suggested_action"] == "restart"
    # the profile chosen from the NVML name goes into the ledger's meta (what reports label by)
    meta = dict(sqlite3.connect(tmp_path / "ledger.sqlite").execute("SELECT key, value FROM meta"))
    assert json.loads(meta["watchdog.gpu_profile"]) == "rtx4090"
    assert json.loads(meta["watchdog.gpu_names"]) == ["NVIDIA GeForce RTX 4090"]
    assert json.loads(meta["watchdog.gpu_cap_mb"]) == 0  # no injected budget: the card's own size


def test_an_injected_gpu_budget_is_the_card_size_the_watchdog_records(tmp_path: Path) -> None:
    """`[inject] gpu_memory_budget_gib` in the service's guard.toml: the watchdog reads the GPU's
    headroom against it, as the runtime does, and records it for the report."""
    cfg = tmp_path / "guard.toml"
    cfg.write_text('[watchdog]\nkernel = "off"\n[inject]\ngpu_memory_budget_gib = 12\n')
    out = subprocess.run([*WATCHDOG, "--config", str(cfg), "--once", "--state-dir", str(tmp_path),
                          "--nvml-trace", str(FIX / "nvml_thermal_4090.jsonl")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    meta = dict(sqlite3.connect(tmp_path / "ledger.sqlite").execute("SELECT key, value FROM meta"))
    assert json.loads(meta["watchdog.gpu_cap_mb"]) == 12288
    from vllm_guard.report.ledgerread import load

    assert load(tmp_path / "ledger.sqlite").watchdog_meta.gpu_cap_mb == 12288.0  # what the report reads


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_once_prints_one_line_per_detector(tmp_path: Path, entry: str) -> None:
    out = subprocess.run([*ENTRIES[entry], "--once", "--state-dir", str(tmp_path), "--kernel", "off",
                          "--nvml-trace", str(FIX / "nvml_thermal_4090.jsonl")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    rows = [ln.split(None, 2) for ln in lines[:6]]
    assert [r[0] for r in rows] == ["memory_drift", "thermal", "oom", "hang", "xid", "host_reboot"]
    assert all(r[1] in ("healthy", "degraded", "unhealthy", "initializing", "unknown") and r[2] for r in rows)
    assert rows[3][1] == "unknown" and "no runtime" in rows[3][2]  # no runtime in this state dir
    assert "sources that failed this tick:" in lines and any(ln.strip().startswith("status:") for ln in lines)
    assert not out.stdout.lstrip().startswith("{")


def test_once_without_nvml_says_so(tmp_path: Path) -> None:
    """On a box without NVML the collector fails with the error; with NVML it reads GPUs."""
    out = subprocess.run([*WATCHDOG, "--once", "--json", "--state-dir", str(tmp_path), "--kernel", "off"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    nv, col = doc["sample"]["nvml"], doc["sample"]["collectors"]["nvml"]
    if nv["error"]:
        assert col["ok"] is False and col["error"] == nv["error"]
        thermal = [v for v in doc["verdicts"] if v["name"] == "thermal"][0]
        assert thermal["health"] == "unknown" and nv["error"] in thermal["reason"]
    else:
        assert col["ok"] is True and nv["gpus"]


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_config_error_is_one_line_exit_2(tmp_path: Path, entry: str) -> None:
    cfg = tmp_path / "guard.toml"
    cfg.write_text('[watchdog]\ninterval = "fast"\n')
    out = subprocess.run([*ENTRIES[entry], "--config", str(cfg), "--once"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "vllm-guard: error: [watchdog] interval has value 'fast': not a duration (use e.g. 90s, 30m, 24h, 1d)"]


@pytest.mark.parametrize("text,line", [
    ('[install]\nuser = "Bad User"\n', "[install] user has value 'Bad User': not a valid system user name"),
    ("[server]\nport = 0\n", "[server] port has value 0: must be >= 1"),
    ('[recycle]\nmax_requests_jitter = 5\n', "[recycle] max_requests_jitter has value 5: needs max_requests > 0"),
    ('[soak]\nscenario = "S9"\n', "[soak] scenario has value 'S9': one of S1, S2, S3, S4, custom"),
])
def test_config_validates_every_section(tmp_path: Path, text: str, line: str) -> None:
    """The watchdog accepts and rejects exactly the files `serve` and `install` do."""
    cfg = tmp_path / "guard.toml"
    cfg.write_text("[watchdog]\nkernel = \"off\"\n" + text)
    out = subprocess.run([*WATCHDOG, "--config", str(cfg), "--once", "--state-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert (out.returncode, out.stderr.strip().splitlines()) == (2, [f"vllm-guard: error: {line}"])


@pytest.mark.parametrize("flag,value,line", [
    ("--interval", "soon", "[watchdog] interval has value 'soon': not a duration (use e.g. 90s, 30m, 24h, 1d)"),
    ("--prometheus-port", "http", "[watchdog] prometheus_port has value 'http': not an integer"),
    ("--prometheus-port", "70000", "[watchdog] prometheus_port has value 70000: must be <= 65535"),
])
def test_flags_go_through_the_same_schema(tmp_path: Path, flag: str, value: str, line: str) -> None:
    out = subprocess.run([*WATCHDOG, flag, value, "--once", "--state-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert (out.returncode, out.stderr.strip().splitlines()) == (2, [f"vllm-guard: error: {line}"])


# -- which GPUs the service sees (the one GPU-index rule) -----------------------------------------
A100, RTX = "GPU-a1000000-0000-0000-0000-000000000018", "GPU-40900000-0000-0000-0000-00000000003b"


def _mixed_trace(tmp_path: Path) -> Path:
    """Two cards, numbered by NVML in PCI bus order: 0 = the A100 at 18:00, 1 = the 4090 at 3B:00
    (CUDA's default order, fastest first, could number them the other way round)."""
    meta, samples = read_trace(FIX / "nvml_h200_steady.jsonl")
    out = tmp_path / "mixed.jsonl"
    w = TraceWriter(out, meta)
    for rec in samples[:3]:
        g = rec["gpus"][0]
        rec["gpus"] = [{**g, "index": 0, "uuid": A100, "name": "NVIDIA A100-SXM4-80GB", "pci_bus_id": "00000000:18:00.0"},
                       {**g, "index": 1, "uuid": RTX, "name": "NVIDIA GeForce RTX 4090", "pci_bus_id": "00000000:3B:00.0"}]
        w.write(rec)
    w.close()
    return out


def _watched(tmp_path: Path, env: dict[str, str], *extra: str) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    out = subprocess.run([*WATCHDOG, "--once", "--json", "--state-dir", str(tmp_path), "--kernel", "off",
                          "--nvml-trace", str(_mixed_trace(tmp_path)), *extra],
                         capture_output=True, text=True, timeout=120, env={**base, **env})
    assert out.returncode == 0, out.stderr
    return [g["uuid"] for g in json.loads(out.stdout)["sample"]["nvml"]["gpus"]]


def test_cuda_index_without_pci_bus_order_watches_every_gpu(tmp_path: Path) -> None:
    assert _watched(tmp_path, {"CUDA_VISIBLE_DEVICES": "1"}) == [A100, RTX]


def test_cuda_index_with_pci_bus_order_watches_that_gpu(tmp_path: Path) -> None:
    assert _watched(tmp_path, {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}) == [RTX]


def test_service_gpus_from_the_config(tmp_path: Path) -> None:
    """With --config, the service's GPUs are those `[server] gpus` gives the runtime's replicas
    (an index as `nvidia-smi` numbers them, whatever the CUDA order)."""
    cfg = tmp_path / "guard.toml"
    cfg.write_text('[server]\ngpus = ["1"]\n')
    assert _watched(tmp_path, {}, "--config", str(cfg)) == [RTX]
    cfg.write_text(f'[server]\ngpus = ["{A100}"]\n')
    assert _watched(tmp_path, {"CUDA_VISIBLE_DEVICES": "1"}, "--config", str(cfg)) == [A100]


# -- the probe's API key --------------------------------------------------------------------------
def _settings(tmp_path: Path, toml: str | None, env: dict[str, str]) -> Any:
    from vllm_guard.watchdog.cli import add_commands, build_settings

    p = argparse.ArgumentParser()
    add_commands(p.add_subparsers(dest="command"))
    argv = ["watchdog", "--state-dir", str(tmp_path)]
    if toml is not None:
        (tmp_path / "guard.toml").write_text(toml)
        argv += ["--config", str(tmp_path / "guard.toml")]
    old = dict(os.environ)
    os.environ.pop("VLLM_API_KEY", None)
    os.environ.update(env)
    try:
        return build_settings(p.parse_args(argv))
    finally:
        os.environ.clear()
        os.environ.update(old)


def test_api_key_comes_from_the_servers_config_or_env(tmp_path: Path) -> None:
    assert _settings(tmp_path, '[server]\nvllm_args = ["--api-key", "from-args"]\n', {}).api_key == "from-args"
    assert _settings(tmp_path, '[install]\nenv = { VLLM_API_KEY = "from-install" }\n', {}).api_key == "from-install"
    assert _settings(tmp_path, "", {"VLLM_API_KEY": "from-env"}).api_key == "from-env"
    assert _settings(tmp_path, None, {"VLLM_API_KEY": "own"}).api_key == "own"
    assert _settings(tmp_path, None, {}).api_key is None


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
