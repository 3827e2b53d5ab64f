"""GPU and kernel scenarios replayed through the whole watchdog loop (no GPU needed).

The NVML traces come from `python -m vllm_guard.watchdog.tracegen` (see docs/WATCHDOG.md);
the kernel logs are lines as the kernel and NVIDIA's driver print them. Actions travel over a
real unix admin socket in the core protocol (`watchdog_standin.StandInRuntime` answers it as
the runtime does), so no vLLM is started.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any, Callable

import pytest

from vllm_guard.core.config import WatchdogConfig, section_from_table
from vllm_guard.core.ledger import EndClass
from vllm_guard.core.protocol import Command, CommandRequest, ReplicaStatus, RuntimeState
from vllm_guard.core.vllm_api import EngineMetrics, ProbeResult
from vllm_guard.watchdog.base import CheckResult, Health, ReplicaReading, Sample
from vllm_guard.watchdog.loop import Watchdog
from vllm_guard.watchdog.trace import TraceWriter, read_trace
from watchdog_standin import StandInRuntime

FIX = Path(__file__).parent / "fixtures" / "watchdog"
OnTick = Callable[[Sample, list[CheckResult]], None]


def _incidents(state_dir: Path) -> list[dict[str, Any]]:
    conn = sqlite3.connect(state_dir / "ledger.sqlite")
    conn.row_factory = sqlite3.Row
    rows = [dict(r) for r in conn.execute("SELECT * FROM incidents ORDER BY id")]
    conn.close()
    for r in rows:
        r["data"] = json.loads(r["data"])
    return rows


async def _replay(state_dir: Path, table: dict[str, Any], runtime: StandInRuntime | None = None,
                  on_tick: OnTick | None = None) -> Watchdog:
    cfg: WatchdogConfig = section_from_table("watchdog", {"prometheus_port": 0, "kernel": "off", **table})
    if runtime is not None:
        await runtime.start()
    wd = Watchdog(cfg, state_dir)
    await wd.start()
    try:
        while not wd.replay_done():
            s, results = await wd.tick()
            if on_tick is not None:
                on_tick(s, results)
    finally:
        await wd.close()
        if runtime is not None:
            await runtime.stop()
    return wd


def _thermal(results: list[CheckResult]) -> CheckResult:
    return [r for r in results if r.name == "thermal"][0]


def test_thermal_trace_gives_the_generators_throttle_share(tmp_path: Path) -> None:
    meta, _ = read_trace(FIX / "nvml_thermal_4090.jsonl")
    story = meta["story"]
    want = {c["at_s"]: c["throttle_share"] for c in story["checkpoints"]}
    got: dict[float, float] = {}
    last: list[CheckResult] = []

    def on_tick(s: Sample, results: list[CheckResult]) -> None:
        th = _thermal(results)
        if "gpus" in th.data and s.t in want:
            got[s.t] = th.data["gpus"][0]["throttle_share"]
        if "gpus" in th.data:
            last[:] = [th]

    asyncio.run(_replay(tmp_path, {"nvml_trace": str(FIX / "nvml_thermal_4090.jsonl")}, on_tick=on_tick))
    assert got == pytest.approx(want, abs=1e-4)
    final = last[0].data["gpus"][0]
    assert final["throttle_share"] == pytest.approx(story["throttle_share_last_window"], abs=1e-4)
    assert final["thermal_share"] == final["throttle_share"] and final["power_capped_share"] == 0
    assert final["clock_drop_pct"] == pytest.approx((1 - story["final_sm_mhz"] / 2520) * 100, abs=1.0)
    assert final["margin_c"] == 90 - story["final_temp_c"]
    inc = [i for i in _incidents(tmp_path) if i["kind"] == "thermal"]
    assert len(inc) == 1 and inc[0]["class"] == "preventive"
    assert inc[0]["data"]["throttle_share"] >= 0.5  # opened when the window crossed the threshold
    assert inc[0]["action"] == "runtime unreachable:recycle"  # no runtime here: alert instead


def test_steady_h200_trace_no_thermal_incident(tmp_path: Path) -> None:
    asyncio.run(_replay(tmp_path, {"nvml_trace": str(FIX / "nvml_h200_steady.jsonl")}))
    assert [i for i in _incidents(tmp_path) if i["kind"] == "thermal"] == []


def _with_reasons(tmp_path: Path, name: str, bits: int) -> Path:
    """The steady H200 trace with every busy sample's clock-event reasons set to `bits`."""
    meta, samples = read_trace(FIX / "nvml_h200_steady.jsonl")
    out = tmp_path / name
    w = TraceWriter(out, meta)
    for rec in samples:
        for g in rec["gpus"]:
            g["clock_reasons"] = bits
        w.write(rec)
    w.close()
    return out


@pytest.mark.parametrize("bits,throttled", [(0x4, False), (0x80, True), (0x20, True)])
def test_throttled_means_heat_or_brake_never_the_power_cap(tmp_path: Path, bits: int, throttled: bool) -> None:
    """One throttle rule (core.gpu): a card held at its power cap (0x4) is power capped, not
    throttled, so it gets no thermal incident; power brake (0x80) and SW thermal (0x20) are."""
    trace = _with_reasons(tmp_path, f"reasons_{bits:x}.jsonl", bits)
    last: list[CheckResult] = []

    def on_tick(s: Sample, results: list[CheckResult]) -> None:
        last[:] = [_thermal(results)]

    wd = asyncio.run(_replay(tmp_path, {"nvml_trace": str(trace), "thermal_window": "10m"}, on_tick=on_tick))
    th = last[0]
    g = th.data["gpus"][0]
    assert (g["throttle_share"] == 1.0) is throttled and (g["throttle_share"] == 0.0) is not throttled
    assert g["power_capped_share"] == (1.0 if bits == 0x4 else 0.0)
    inc = [i for i in _incidents(tmp_path) if i["kind"] == "thermal"]
    assert bool(inc) is throttled
    if not throttled:
        assert th.health is not Health.UNHEALTHY and "power capped 100%" in th.reason
    assert wd.exporter is not None
    uuid = g["uuid"]
    assert wd.exporter.registry.get_sample_value("vllm_guard_thermal_throttle_share", {"gpu": uuid}) == \
        g["throttle_share"]
    assert wd.exporter.registry.get_sample_value("vllm_guard_power_capped_share", {"gpu": uuid}) == \
        g["power_capped_share"]


def test_thermal_recycles_through_admin_socket(tmp_path: Path) -> None:
    rt = StandInRuntime(tmp_path)
    asyncio.run(_replay(tmp_path, {"nvml_trace": str(FIX / "nvml_thermal_4090.jsonl")}, rt))
    assert rt.received == [CommandRequest(command=Command.RECYCLE, reason="thermal", cls=EndClass.PREVENTIVE)]
    inc = [i for i in _incidents(tmp_path) if i["kind"] == "thermal"]
    assert [i["action"] for i in inc] == ["recycle:ok"]


def test_a_refused_command_is_an_outcome_not_an_error(tmp_path: Path) -> None:
    rt = StandInRuntime(tmp_path, refuse=True)
    wd = asyncio.run(_replay(tmp_path, {"nvml_trace": str(FIX / "nvml_thermal_4090.jsonl")}, rt))
    assert [r.command for r in rt.received] == [Command.RECYCLE]
    inc = [i for i in _incidents(tmp_path) if i["kind"] == "thermal"]
    assert [i["action"] for i in inc] == ["recycle:refused: a recycle is already in progress"]
    assert wd.exporter is not None
    assert wd.exporter.registry.get_sample_value("vllm_guard_actions_total",
                                                 {"action": "recycle", "outcome": "refused"}) == 1.0


def test_xid79_holds_and_alerts_never_restarts(tmp_path: Path) -> None:
    rt = StandInRuntime(tmp_path)
    alerts = tmp_path / "alerts.jsonl"
    asyncio.run(_replay(tmp_path, {"nvml_trace": str(FIX / "nvml_h200_steady.jsonl"),
                                   "kernel": str(FIX / "kernel_xid79.log"),
                                   "alert_command": f"cat >> {alerts}; echo >> {alerts}"}, rt))
    assert [r.command for r in rt.received] == [Command.HOLD]
    assert rt.received[0].reason == "xid-79"
    inc = [i for i in _incidents(tmp_path) if i["kind"] == "xid_79"]
    assert len(inc) == 1 and inc[0]["data"]["catalog"] == "reboot" and inc[0]["action"] == "hold:ok"
    sent = [json.loads(x) for x in alerts.read_text().splitlines() if x.strip()]
    assert [a["kind"] for a in sent] == ["xid_79"]


def test_xid13_restarts_the_app_once(tmp_path: Path) -> None:
    rt = StandInRuntime(tmp_path)
    asyncio.run(_replay(tmp_path, {"nvml_trace": str(FIX / "nvml_h200_steady.jsonl"),
                                   "kernel": str(FIX / "kernel_xid13.log")}, rt))
    assert rt.received == [CommandRequest(command=Command.RESTART, reason="xid-13", cls=EndClass.UNPLANNED)]
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


def test_a_hung_replica_is_restarted_alone_and_its_incident_names_it(tmp_path: Path) -> None:
    """Two replicas; replica 1's tokens stop and its probes time out: the restart goes to
    replica 1 only (`CommandRequest.replica`), the incident and the samples carry its index,
    and the incident is restored once replica 1 serves a new generation."""
    reps = [ReplicaStatus(index=i, state=RuntimeState.SERVING, generation=3 + i, backend_url=f"http://127.0.0.1:{i + 1}")
            for i in (0, 1)]
    rt = StandInRuntime(tmp_path, replicas=reps)
    cfg: WatchdogConfig = section_from_table("watchdog", {"prometheus_port": 0, "kernel": "off", "hang_failures": 2,
                                                          "progress_window": "10s", "sample_every": "1h"})
    timeout = ProbeResult(False, 5.0, "timeout after 5.0s", timed_out=True)

    async def go() -> Watchdog:
        await rt.start()
        wd = Watchdog(cfg, tmp_path)
        try:
            for t in range(40):
                if t == 30:  # the runtime restarted replica 1: a new generation serves
                    rt.status = rt.status.model_copy(update={"replicas": [reps[0], reps[1].model_copy(
                        update={"generation": 9})]})
                st = rt.status
                probe = timeout if t in (20, 25) else None
                s = Sample(at=f"2026-12-01T00:00:{t:02d}.000Z", t=float(t), status=st, replicas=[
                    ReplicaReading(0, RuntimeState.SERVING, 3, "u0", float(t), EngineMetrics(generation_tokens=10.0 * t),
                                   None, probe),
                    ReplicaReading(1, RuntimeState.SERVING, st.replicas[1].generation, "u1", float(t),
                                   EngineMetrics(generation_tokens=500.0), None, probe)])
                await wd.judge(s)
        finally:
            await wd.close()
            await rt.stop()
        return wd

    asyncio.run(go())
    assert rt.received == [CommandRequest(command=Command.RESTART, reason="hang", cls=EndClass.UNPLANNED, replica=1)]
    inc = [i for i in _incidents(tmp_path) if i["kind"] == "hang"]
    assert [(i["replica"], i["action"]) for i in inc] == [(1, "restart:ok")] and inc[0]["restored_at"]
    conn = sqlite3.connect(tmp_path / "ledger.sqlite")
    rows = conn.execute("SELECT replica, data FROM samples WHERE source = 'replica' ORDER BY id").fetchall()
    conn.close()
    # one row per replica at the first tick (sample_every 1h) and at the tick the incident opened
    assert [(r, json.loads(d)["hang"]) for r, d in rows] == [(0, "unknown"), (1, "unknown"), (0, "degraded"),
                                                             (1, "unhealthy")]
