"""GPU and kernel scenarios replayed through the whole watchdog loop (no GPU needed).

The NVML traces come from `python -m vllm_guard.watchdog.tracegen` (see docs/WATCHDOG.md);
the kernel logs are lines as the kernel and NVIDIA's driver print them. Actions travel over the
runtime's real admin socket (`vllm_guard.runtime.admin.start`), served here for a
supervisor-shaped stand-in that records the commands it receives, so no vLLM is started.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_guard.runtime import admin
from vllm_guard.watchdog.loop import Watchdog
from vllm_guard.watchdog.settings import from_table
from vllm_guard.watchdog.trace import read_trace

FIX = Path(__file__).parent / "fixtures" / "watchdog"


class StandInRuntime:
    """What admin.start needs from a Supervisor: status(), a command queue, wake()."""

    def __init__(self, state_dir: Path, state: str = "serving") -> None:
        self.state_dir = state_dir
        self.state = SimpleNamespace(value=state)
        self.generation = 3
        self.commands: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        self.cfg = SimpleNamespace(server=SimpleNamespace(admin_group="", admin_mode=0o660))
        self.received: list[tuple[str, dict[str, Any]]] = []

    def status(self) -> dict[str, Any]:
        return {"state": self.state.value, "generation": self.generation, "requests_total": 0,
                "requests_generation": 0, "in_flight": 0, "queued": 0, "failures": 0, "failure_log": [],
                "recycles": [], "hold": None, "backend_url": None, "children": [], "memory": {}, "pid": 1}

    def wake(self) -> None:
        while not self.commands.empty():
            self.received.append(self.commands.get_nowait())


def _incidents(state_dir: Path) -> list[dict[str, Any]]:
    conn = sqlite3.connect(state_dir / "ledger.sqlite")
    conn.row_factory = sqlite3.Row
    rows = [dict(r) for r in conn.execute("SELECT * FROM incidents ORDER BY id")]
    conn.close()
    for r in rows:
        r["data"] = json.loads(r["data"])
    return rows


async def _replay(state_dir: Path, table: dict[str, Any], runtime: StandInRuntime | None = None,
                  on_tick: Any = None) -> Watchdog:
    cfg, _ = from_table({"prometheus_port": 0, "kernel": "off", **table})
    runner = await admin.start(runtime) if runtime is not None else None  # type: ignore[arg-type]
    wd = Watchdog(cfg, state_dir)
    await wd.start()
    try:
        while not wd.replay_done():
            s, results = await wd.tick()
            if on_tick is not None:
                on_tick(s, results)
    finally:
        await wd.close()
        if runner is not None:
            await runner.cleanup()
    return wd


def test_thermal_trace_gives_the_generators_throttle_share(tmp_path: Path) -> None:
    meta, samples = read_trace(FIX / "nvml_thermal_4090.jsonl")
    story = meta["story"]
    want = {c["at_s"]: c["throttle_share"] for c in story["checkpoints"]}
    got: dict[float, float] = {}
    last: list[Any] = []

    def on_tick(s: dict[str, Any], results: list[Any]) -> None:
        th = [r for r in results if r.name == "thermal"][0]
        if th.data.get("gpus") and s["t"] in want:
            got[s["t"]] = th.data["gpus"][0]["throttle_share"]
        if th.data.get("gpus"):
            last[:] = [th]

    asyncio.run(_replay(tmp_path, {"nvml_trace": str(FIX / "nvml_thermal_4090.jsonl")}, on_tick=on_tick))
    assert got == pytest.approx(want, abs=1e-4)
    final = last[0].data["gpus"][0]
    assert final["throttle_share"] == pytest.approx(story["throttle_share_last_window"], abs=1e-4)
    assert final["clock_drop_pct"] == pytest.approx((1 - story["final_sm_mhz"] / 2520) * 100, abs=1.0)
    assert final["margin_c"] == 90 - story["final_temp_c"]
    inc = [i for i in _incidents(tmp_path) if i["kind"] == "thermal"]
    assert len(inc) == 1 and inc[0]["class"] == "preventive"
    assert inc[0]["data"]["throttle_share"] >= 0.5  # opened when the window crossed the threshold
    assert inc[0]["action"] == "runtime unreachable:recycle"  # no runtime here: alert instead


def test_steady_h200_trace_no_thermal_incident(tmp_path: Path) -> None:
    asyncio.run(_replay(tmp_path, {"nvml_trace": str(FIX / "nvml_h200_steady.jsonl")}))
    assert [i for i in _incidents(tmp_path) if i["kind"] == "thermal"] == []


def test_thermal_recycles_through_admin_socket(tmp_path: Path) -> None:
    rt = StandInRuntime(tmp_path)
    asyncio.run(_replay(tmp_path, {"nvml_trace": str(FIX / "nvml_thermal_4090.jsonl")}, rt))
    assert rt.received == [("recycle", {"reason": "thermal", "class": "preventive"})]


def test_xid79_holds_and_alerts_never_restarts(tmp_path: Path) -> None:
    rt = StandInRuntime(tmp_path)
    alerts = tmp_path / "alerts.jsonl"
    asyncio.run(_replay(tmp_path, {"nvml_trace": str(FIX / "nvml_h200_steady.jsonl"),
                                   "kernel": str(FIX / "kernel_xid79.log"),
                                   "alert_command": f"cat >> {alerts}; echo >> {alerts}"}, rt))
    assert [c for c, _ in rt.received] == ["hold"]
    assert rt.received[0][1]["reason"] == "xid-79"
    inc = [i for i in _incidents(tmp_path) if i["kind"] == "xid_79"]
    assert len(inc) == 1 and inc[0]["data"]["catalog"] == "reboot" and inc[0]["action"] == "hold:ok"
    sent = [json.loads(x) for x in alerts.read_text().splitlines() if x.strip()]
    assert [a["kind"] for a in sent] == ["xid_79"]


def test_xid13_restarts_the_app_once(tmp_path: Path) -> None:
    rt = StandInRuntime(tmp_path)
    asyncio.run(_replay(tmp_path, {"nvml_trace": str(FIX / "nvml_h200_steady.jsonl"),
                                   "kernel": str(FIX / "kernel_xid13.log")}, rt))
    assert rt.received == [("restart", {"reason": "xid-13", "class": "unplanned"})]
    inc = [i for i in _incidents(tmp_path) if i["kind"] == "xid_13"]
    assert [i["action"] for i in inc] == ["restart:ok", "cooldown:restart"]  # two lines, one fault
    assert all(i["restored_at"] for i in inc)  # the runtime serves again: the incident is over


def test_kernel_oom_both_formats_attributed_by_task_memcg(tmp_path: Path) -> None:
    asyncio.run(_replay(tmp_path, {"nvml_trace": str(FIX / "nvml_h200_steady.jsonl"),
                                   "kernel": str(FIX / "kernel_oom.log"),
                                   "service_cgroup": "/system.slice/vllm-guard.service"}))
    inc = [i for i in _incidents(tmp_path) if i["kind"] == "oom_kill"]
    assert sorted(i["data"]["pid"] for i in inc) == [48190, 48213]  # chrome (user.slice) is not ours
    assert {i["data"]["attributed_by"] for i in inc} == {"task_memcg"}
    assert all(i["class"] == "unplanned" for i in inc)


def test_alert_webhook_gets_the_incident(tmp_path: Path) -> None:
    from aiohttp import web

    got: list[dict[str, Any]] = []

    async def main() -> None:
        async def hook(request: web.Request) -> web.Response:
            got.append(await request.json())
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_post("/hook", hook)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            await _replay(tmp_path, {"nvml_trace": str(FIX / "nvml_h200_steady.jsonl"),
                                     "kernel": str(FIX / "kernel_xid79.log"),
                                     "alert_webhook": f"http://127.0.0.1:{port}/hook"}, StandInRuntime(tmp_path))
        finally:
            await runner.cleanup()

    asyncio.run(main())
    assert [(a["kind"], a["action"], a["data"]["catalog"]) for a in got] == [("xid_79", "hold", "reboot")]
