"""Pure parts of the watchdog on literal inputs: parsers, statistics, detectors, policy, config,
cgroup files, ledger downsampling, the NVML call timeout."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import random
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_guard.core import gpu, host
from vllm_guard.core.config import ConfigError, WatchdogConfig, from_data, section_from_table
from vllm_guard.core.ledger import EndClass
from vllm_guard.core.nvml import NvmlSession
from vllm_guard.core.protocol import ChildProcess, FailureSummary, RequestCounters, Role, RuntimeState, StatusSnapshot
from vllm_guard.core.samples import (
    SAMPLES_SCHEMA, GpuReading, HostReading, NvmlRecord, ProcReading, ReplicaBrief, StatusBrief, Tick,
)
from vllm_guard.core.stats import theil_sen, time_to_exhaust
from vllm_guard.core.vllm_api import EngineMetrics, ProbeResult
from vllm_guard.watchdog import kernel
from vllm_guard.watchdog.base import Action, CgroupReading, Finding, Health, ReplicaReading, Sample
from vllm_guard.watchdog.drift import DriftDetector
from vllm_guard.watchdog.feed import FailureFeed
from vllm_guard.watchdog.hang import HangDetector
from vllm_guard.watchdog.loop import Watchdog, summary_text
from vllm_guard.watchdog.oom import OomDetector
from vllm_guard.watchdog.policy import Policy
from vllm_guard.watchdog.profiles import apply_profile
from vllm_guard.watchdog.reboot import RebootDetector
from vllm_guard.watchdog.store import WatchdogLedger
from vllm_guard.watchdog.xid import catalog_class

FIX = Path(__file__).parent / "fixtures" / "watchdog"


def cfg_of(table: dict[str, Any] | None = None) -> WatchdogConfig:
    """A [watchdog] section validated by the core's one schema."""
    out: WatchdogConfig = section_from_table("watchdog", table or {})
    return out


def status(**kw: Any) -> StatusSnapshot:
    """A runtime status as the runtime sends it (the typed protocol model)."""
    base: dict[str, Any] = {"state": RuntimeState.SERVING, "state_for_s": 1.0, "generation": 1, "pid": 100,
                            "port": 8000, "model": "m"}
    return StatusSnapshot(**{**base, **kw})


def sample(t: float = 0.0, **kw: Any) -> Sample:
    return Sample(at="2026-11-29T00:00:00.000Z", t=t, **kw)


def failure(i: int, kind: str = "crash", generation: int | None = None) -> FailureSummary:
    return FailureSummary(kind=kind, at=f"2026-11-29T00:{i // 60:02d}:{i % 60:02d}.000Z", exit_code=-9,
                          detail=f"failure {i}", restored_at=None, generation=generation or i)


# -- kernel lines ---------------------------------------------------------------------------------
def test_parse_oom_context_line_with_task_memcg() -> None:
    ev = kernel.parse("[200000.100120] oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,"
                      "mems_allowed=0,oom_memcg=/system.slice/a.service,task_memcg=/system.slice/a.service/x,"
                      "task=VLLM::EngineCor,pid=48213,uid=998")
    assert ev is not None and ev.type == "oom_context"
    assert (ev.pid, ev.task, ev.task_memcg) == (48213, "VLLM::EngineCor", "/system.slice/a.service/x")


@pytest.mark.parametrize("line", [
    "3,91241,201000100110,-;Out of memory: Killed process 7777 (chrome) total-vm:5242880kB",
    "[  1.5] Memory cgroup out of memory: Killed process 7777 (chrome) total-vm:1kB",
    "Nov 29 22:10:01 box kernel: Out of memory: Killed process 7777 (chrome) total-vm:1kB",
])
def test_parse_killed_process_in_every_prefix(line: str) -> None:
    ev = kernel.parse(line)
    assert ev is not None and (ev.type, ev.pid, ev.task) == ("oom_killed", 7777, "chrome")


def test_parse_xid_lines() -> None:
    ev = kernel.parse("[ 3021.412345] NVRM: Xid (PCI:0000:18:00): 79, pid=48213, name=x, GPU has fallen off the bus.")
    assert ev is not None and (ev.xid, ev.pci, ev.pid) == (79, "0000:18:00", 48213)
    assert kernel.parse("[ 3021.4] NVRM: GPU 0000:18:00.0: GPU has fallen off the bus.") is None


def test_xid_catalog_classes() -> None:
    assert [catalog_class(x) for x in (13, 31, 94, 48, 62, 119, 79, 999)] == [
        "restart_app", "restart_app", "restart_app", "gpu_reset", "gpu_reset", "gpu_reset", "reboot", "unknown"]


def test_file_source_hands_out_lines_in_batches() -> None:
    src = kernel.FileSource(FIX / "kernel_oom.log", per_poll=3)
    got = [src.poll() for _ in range(4)]
    assert [len(g) for g in got] == [3, 3, 2, 0]


def test_auto_source_never_raises() -> None:
    src = kernel.open_source("auto")
    assert isinstance(src.poll(), list)
    assert src.active or src.error  # a source that delivers, or one line saying why not
    src.close()


# -- OOM attribution ------------------------------------------------------------------------------
def test_oom_attributed_by_pid_when_no_memcg_line() -> None:
    d = OomDetector()
    st = status(children=[ChildProcess(pid=4242, role=Role.ENGINE_CORE)])
    d.check(sample(status=st))
    ev = kernel.parse("Out of memory: Killed process 4242 (python3) total-vm:1kB")
    assert ev is not None
    res = d.check(sample(status=status(), kernel_events=[ev], kernel_source="kmsg"))
    assert res.health is Health.UNHEALTHY
    assert res.findings[0].data["attributed_by"] == "pid" and res.findings[0].data["role"] == "engine_core"


def test_oom_of_a_stranger_is_not_ours() -> None:
    ev = kernel.parse("Out of memory: Killed process 99 (chrome) total-vm:1kB")
    assert ev is not None
    res = OomDetector().check(sample(service_cgroup="/system.slice/a.service", kernel_events=[ev],
                                     kernel_source="kmsg"))
    assert res.health is Health.HEALTHY


def test_oom_without_any_source_is_unknown_not_healthy() -> None:
    assert OomDetector().check(sample()).health is Health.UNKNOWN


def test_cgroup_counter_rise_is_an_oom() -> None:
    d = OomDetector()
    assert d.check(sample(cgroup=CgroupReading("v2", 2, "x"))).health is Health.HEALTHY
    res = d.check(sample(cgroup=CgroupReading("v2", 3, "x")))
    assert res.findings[0].kind == "oom_kill" and "2 -> 3" in res.findings[0].cause


def test_cuda_oom_in_child_log() -> None:
    line = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    res = OomDetector().check(sample(child_log=["INFO fine", line]))
    assert [f.kind for f in res.findings] == ["cuda_oom"]


@pytest.mark.parametrize("version,expect", [("v1", 2), ("v2", 1)])
def test_cgroup_v1_and_v2_counters(version: str, expect: int) -> None:
    got = CgroupReading.from_host(host.oom_kills("/system.slice/vllm-guard.service", str(FIX / f"cgroup_{version}")))
    assert (got.version, got.oom_kill) == (version, expect)


def test_service_path_from_proc_cgroup(tmp_path: Path) -> None:
    (tmp_path / "12").mkdir()
    (tmp_path / "12" / "cgroup").write_text(
        "12:memory:/system.slice/vllm-guard.service\n1:name=systemd:/system.slice/vllm-guard.service\n")
    assert host.service_path(12, str(tmp_path)) == "/system.slice/vllm-guard.service"
    (tmp_path / "12" / "cgroup").write_text("0::/system.slice/vllm-guard.service\n")
    assert host.service_path(12, str(tmp_path)) == "/system.slice/vllm-guard.service"


# -- the runtime's failures through its bounded status --------------------------------------------
def test_feed_counts_new_failures_by_the_total_when_the_window_is_full() -> None:
    """The status keeps the last 10 failures: once full, the list no longer grows, the total does."""
    feed = FailureFeed()
    window = [failure(i) for i in range(10)]
    assert feed.update(status(failures=10, recent_failures=window)).failures == []  # baseline
    window = [failure(i) for i in range(3, 13)]  # three new ones; the list length did not change
    new = feed.update(status(failures=13, recent_failures=window))
    assert [f.detail for f in new.failures] == ["failure 10", "failure 11", "failure 12"] and new.missed == 0
    window = [failure(i) for i in range(18, 28)]  # fifteen new ones: ten shown, five gone by
    new = feed.update(status(failures=28, recent_failures=window))
    assert len(new.failures) == 10 and new.missed == 5
    assert feed.update(status(failures=28, recent_failures=window)).failures == []


def test_feed_new_runtime_process_starts_its_counters_again() -> None:
    feed = FailureFeed()
    feed.update(status(pid=1, failures=12, recent_failures=[failure(i) for i in range(2, 12)]))
    new = feed.update(status(pid=2, failures=1, recent_failures=[failure(50)]))
    assert [f.detail for f in new.failures] == ["failure 50"]


def test_hang_and_exits_from_a_full_status_window() -> None:
    """Two hangs and a crash arrive while the window stays at 10 entries: the hang detector
    records the two hangs, the OOM detector the crash (the list length never changed)."""
    hang, oom = HangDetector(cfg_of()), OomDetector()
    old = [failure(i) for i in range(10)]
    for d in (hang, oom):
        d.check(sample(status=status(failures=10, recent_failures=old)))
    new = [failure(10, "hang"), failure(11, "crash"), failure(12, "hang")]
    st = status(failures=13, recent_failures=old[3:] + new)
    h = hang.check(sample(status=st))
    assert [f.data["detail"] for f in h.findings] == ["failure 10", "failure 12"]
    assert all(f.kind == "hang" and f.data["handled_by"] == "runtime" for f in h.findings)
    o = oom.check(sample(status=st))
    assert [(f.kind, f.data["detail"]) for f in o.findings] == [("child_exit", "failure 11")]


# -- the watchdog's own probe of every replica (the one hang rule, core/hang.py) -------------------
TIMEOUT = ProbeResult(False, 20.0, "timeout after 20.0s", timed_out=True)


def reading(at: float, tokens: float | None = None, cpu: float | None = None, probe: ProbeResult | None = None,
            index: int = 0, generation: int = 4, state: RuntimeState = RuntimeState.SERVING) -> ReplicaReading:
    """One replica at one tick: its /metrics tokens (None: silent), its API server's CPU, a probe."""
    return ReplicaReading(index, state, generation, "http://127.0.0.1:1", at,
                          None if tokens is None else EngineMetrics(generation_tokens=tokens), cpu, probe)


def hang_cfg(**kw: Any) -> WatchdogConfig:
    return cfg_of({"hang_failures": 2, "progress_window": "10s", "probe_interval": "5s", **kw})


def tick(d: HangDetector, *replicas: ReplicaReading) -> Any:
    return d.check(sample(status=status(), replicas=list(replicas)))


def test_probe_timeouts_without_progress_are_a_hang_of_that_replica() -> None:
    d = HangDetector(hang_cfg())
    for t in range(0, 25):  # tokens frozen; a timed-out probe lands at 20 and at 24
        res = tick(d, reading(t, 500.0, probe=TIMEOUT if t in (20, 24) else None, index=1))
    assert res.health is Health.UNHEALTHY and res.suggested_action is Action.RESTART
    f = res.findings[0]
    assert f.key == "probe:4" and f.replica == 1 and f.data["handled_by"] == "watchdog" and f.data["verdict"] == "stalled"
    assert f.cause.startswith("replica 1: 2 probes timed out")


def test_probe_timeouts_while_tokens_move_are_a_busy_engine() -> None:
    d = HangDetector(hang_cfg())
    for t in range(0, 60):
        res = tick(d, reading(t, 10.0 * t, probe=TIMEOUT if t % 5 == 0 and t >= 15 else None))
        assert not res.findings
    assert res.health is Health.DEGRADED and "starved" in res.reason


def test_probe_answered_401_is_degraded_never_a_hang() -> None:
    """A wrong API key must not restart a healthy server, even an idle one whose tokens do not move."""
    d = HangDetector(hang_cfg(hang_failures=1))
    denied = ProbeResult(False, 0.01, "HTTP 401: {\"error\": \"Unauthorized\"}")
    for t in range(0, 40):
        res = tick(d, reading(t, 5.0, probe=denied if t % 5 == 0 else None))
        assert not res.findings and res.health is Health.DEGRADED and "HTTP 401" in res.reason
    assert tick(d, reading(41, 5.0, probe=ProbeResult(True, 0.01))).health is Health.HEALTHY


def test_a_young_generation_is_judged_once_its_window_is_covered() -> None:
    d = HangDetector(hang_cfg(hang_failures=1))
    res = tick(d, reading(0, 0.0, probe=TIMEOUT))  # the first tick of a generation: nothing to judge by
    assert not res.findings and res.health is Health.DEGRADED and "window is covered" in res.reason
    found = [f for t in range(1, 25) for f in tick(d, reading(t, 0.0)).findings]
    assert [f.replica for f in found] == [0]  # judged once, at 20 s: the probe waited 20 s, so the window does


def test_each_replica_is_judged_on_its_own_and_a_new_generation_starts_clean() -> None:
    d = HangDetector(hang_cfg())
    found = []
    for t in range(0, 30):
        probe = TIMEOUT if t in (20, 25) else None
        res = tick(d, reading(t, 10.0 * t, probe=probe, index=0), reading(t, 500.0, probe=probe, index=1))
        found += res.findings
    assert [f.replica for f in found] == [1] and d.misses(0) == 0
    assert res.data["replicas"]["0"]["health"] == "degraded" and res.data["replicas"]["1"]["probe_misses"] == 2
    res = tick(d, reading(31, 10.0, index=0), reading(31, 0.0, index=1, generation=9))  # replica 1 restarted
    assert d.misses(1) == 0 and res.data["replicas"]["1"]["generation"] == 9


def test_a_hung_replica_that_no_longer_serves_is_not_restarted_again() -> None:
    d = HangDetector(hang_cfg(hang_failures=1))
    for t in range(0, 25):
        res = tick(d, reading(t, 500.0, probe=TIMEOUT if t == 20 else None, state=RuntimeState.STOPPING))
    assert not res.findings and d.misses(0) == 1


# -- statistics and drift -------------------------------------------------------------------------
def test_theil_sen_ignores_outliers() -> None:
    rng = random.Random(3)
    x = list(range(0, 1000, 10))
    y = [500 + 0.2 * v + rng.gauss(0, 1) for v in x]
    y[10] += 400  # a GC spike
    y[50] -= 300
    s = theil_sen(x, y)
    assert s is not None and s.slope == pytest.approx(0.2, rel=0.03) and s.low < s.slope < s.high
    assert theil_sen([5, 5, 5], [1, 2, 3]) is None
    assert time_to_exhaust(100.0, 0.0) is None and time_to_exhaust(100.0, 2.0) == 50.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_theil_sen_equals_scipy(seed: int) -> None:
    from scipy import stats  # the reference; the watchdog itself stays without scipy.stats

    rng = random.Random(seed)
    x = [float(rng.randint(0, 60)) for _ in range(120)]  # ties in x, as idle ticks give
    y = [round(100 + 0.3 * v + rng.gauss(0, 3)) for v in x]  # ties in y, as MiB rounding gives
    ref = stats.theilslopes(y, x, 0.95)
    got = theil_sen(x, y)
    assert got is not None
    assert (got.slope, got.low, got.high) == pytest.approx((ref.slope, ref.low_slope, ref.high_slope), rel=1e-12)


def _host(avail: float = 8000.0) -> HostReading:
    return HostReading(mem_total_mb=16000.0, mem_available_mb=avail, swap_used_mb=0.0, boot_id="b")


def _drift_run(rate_mb: float, cfg_table: dict[str, Any], n: int = 600, seed: int = 1) -> list[Any]:
    d = DriftDetector(cfg_of(cfg_table))
    rng = random.Random(seed)
    out = []
    for i in range(n):
        req = i * 2
        rss = 600 + rate_mb * req + rng.gauss(0, 2.0)
        s = sample(t=float(i), status=status(requests=RequestCounters(total=req)),
                   procs={11: ProcReading(role=Role.ENGINE_CORE, rss_mb=rss)}, host=_host())
        out.append(d.check(s))
    return out


def test_drift_finds_a_leak_and_forecasts() -> None:
    res = _drift_run(0.2, {"forecast_horizon": "24h"})
    first = next(r for r in res if r.findings)
    v = first.findings[0].data
    assert v["slope_mb_per_100"] == pytest.approx(20.0, rel=0.2) and v["requests"] <= 1000
    assert res[-1].health is Health.UNHEALTHY and res[-1].suggested_action is Action.RECYCLE
    # 8000 MB headroom at 0.2 MB/request, 2 requests per second: ~5.6 h
    assert res[-1].findings[-1].data["time_to_oom_s"] == pytest.approx(8000 / 0.4, rel=0.2)
    assert res[-1].findings[-1].cls is EndClass.PREVENTIVE


def test_drift_flat_memory_no_alarm_and_warmup() -> None:
    res = _drift_run(0.0, {"forecast_horizon": "24h"})
    assert res[0].health is Health.INITIALIZING
    assert not any(r.findings for r in res)
    assert res[-1].health is Health.HEALTHY and res[-1].data["series"][0]["significant"] is False


def test_drift_a_warmup_step_is_not_a_leak() -> None:
    d = DriftDetector(cfg_of({"forecast_horizon": "24h"}))
    rng = random.Random(5)
    res = []
    for i in range(600):  # flat, one 120 MB step at request 200 (allocator pool), then flat
        req = i * 2
        rss = 1760 + (120 if req >= 200 else 0) + rng.gauss(0, 0.3)
        res.append(d.check(sample(t=float(i), status=status(requests=RequestCounters(total=req)),
                                  procs={9: ProcReading(role=Role.WORKER, rss_mb=rss)}, host=_host())))
    assert not any(r.findings for r in res)


def test_drift_outside_horizon_is_only_degraded() -> None:
    res = _drift_run(0.2, {"forecast_horizon": "1h"})
    assert res[-1].health is Health.DEGRADED and [f.kind for f in res[-1].findings] == ["memory_drift"]


def _gpu(uuid: str = "GPU-x", **kw: Any) -> GpuReading:
    return GpuReading(index=0, uuid=uuid, name="NVIDIA H200", **kw)


def test_drift_on_gpu_per_process_memory_with_gpu_headroom() -> None:
    """vLLM preallocates KV, so the device total is flat-ish: the per-process series finds it."""
    d = DriftDetector(cfg_of({"forecast_horizon": "1h"}))
    res = None
    for i in range(400):
        req = i * 5
        used = 22038.0 + 0.1465 * req  # the seed's 150 KB per request, in NVML's per-process list
        g = _gpu(mem_total_mb=24564.0, mem_used_mb=used + 600, processes=[{"pid": 77, "used_mb": used}])
        res = d.check(sample(t=float(i), status=status(requests=RequestCounters(total=req)),
                             nvml=NvmlRecord(at_s=float(i), gpus=[g]),
                             procs={77: ProcReading(role=Role.ENGINE_CORE, rss_mb=900.0)}, host=_host(1e5)))
    assert res is not None
    f = [x for x in res.findings if x.key == "gpu:77"]
    assert [x.kind for x in f] == ["memory_drift", "memory_forecast"]
    v = f[-1].data
    assert v["slope_mb_per_100"] == pytest.approx(14.65, rel=0.01)
    # headroom = 24564 - used at the end; 5 requests/s -> 0.7325 MB/s
    assert v["time_to_oom_s"] == pytest.approx((24564 - 600 - 22038 - 0.1465 * 1995) / (0.1465 * 5), rel=0.05)


@pytest.mark.parametrize("cap_mb", [0.0, 24564.0])
def test_an_injected_budget_makes_the_card_that_small_for_the_gpu_forecast(cap_mb: float) -> None:
    """`[inject] gpu_memory_budget_gib` on an 80 GB card: vLLM runs as on a 24 GB one, so the time
    to out of memory is read against 24 GB, as the runtime reads it (core.gpu's GPU-size rule)."""
    d = DriftDetector(cfg_of({"forecast_horizon": "1h"}), gpu_cap_mb=cap_mb)
    res = None
    for i in range(400):
        req = i * 5
        used = 22038.0 + 0.1465 * req
        g = _gpu(mem_total_mb=81559.0, mem_used_mb=used + 600, processes=[{"pid": 77, "used_mb": used}])
        res = d.check(sample(t=float(i), status=status(requests=RequestCounters(total=req)),
                             nvml=NvmlRecord(at_s=float(i), gpus=[g]),
                             procs={77: ProcReading(role=Role.ENGINE_CORE, rss_mb=900.0)}, host=_host(1e5)))
    assert res is not None
    v = [x for x in res.findings if x.key == "gpu:77"][0].data
    total = 24564.0 if cap_mb else 81559.0
    assert v["headroom_mb"] == pytest.approx(total - 600 - 22038 - 0.1465 * 1995, abs=10)  # judged every 10 s
    assert v["time_to_oom_s"] == pytest.approx((total - 600 - 22038 - 0.1465 * 1995) / (0.1465 * 5), rel=0.05)
    assert gpu.capped_total_mb(81559.0, 0.0) == 81559.0 and gpu.capped_total_mb(81559.0, 1e6) == 81559.0


# -- the one throttle rule ------------------------------------------------------------------------
def test_throttle_rule_power_cap_is_apart() -> None:
    assert gpu.throttled(0x20) and gpu.throttled(0x80) and gpu.thermal(0x40)
    assert not gpu.throttled(0x4) and gpu.power_capped(0x4) and not gpu.throttled(0x1)


# -- the one GPU-index rule, and vLLM's metrics as the watchdog reads them --------------------------
MIXED = [{"uuid": "GPU-4090", "pci_bus_id": "00000000:3B:00.0"}, {"uuid": "GPU-a100", "pci_bus_id": "00000000:18:00.0"}]


def test_visible_gpus_by_index_need_pci_bus_order() -> None:
    """NVML order is not CUDA's (fastest first) unless CUDA_DEVICE_ORDER=PCI_BUS_ID: without it
    an index names no NVML device for sure, so every GPU is watched; with it, the right one."""
    assert gpu.visible_uuids(MIXED, {"CUDA_VISIBLE_DEVICES": "1"}) == ["GPU-4090", "GPU-a100"]
    assert gpu.visible_uuids(MIXED, {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}) == ["GPU-4090"]
    assert gpu.visible_uuids(MIXED, {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}) == ["GPU-a100"]
    assert gpu.visible_uuids(MIXED, {"CUDA_VISIBLE_DEVICES": "GPU-a100"}) == ["GPU-a100"]


def test_parse_vllm_metrics_sums_labels() -> None:
    from vllm_guard.core.vllm_api import parse_metrics

    text = ('# TYPE vllm:request_success_total counter\n'
            'vllm:request_success_total{finished_reason="stop",model_name="m"} 3.0\n'
            'vllm:request_success_total{finished_reason="length",model_name="m"} 4.0\n'
            '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
            '# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total{model_name="m"} 9.0\n')
    assert parse_metrics(text) == EngineMetrics(request_success=7.0, kv_cache_usage=0.25, generation_tokens=9.0)


# -- policy ---------------------------------------------------------------------------------------
def _f(action: Action, kind: str = "memory_forecast") -> Finding:
    return Finding(kind, "k", "cause", EndClass.PREVENTIVE, action)


SERVING, HELD, DRAINING = RuntimeState.SERVING, RuntimeState.HELD, RuntimeState.DRAINING


def test_policy_cooldown_then_escalation() -> None:
    p = Policy(cfg_of({"cooldown": "60s", "max_actions": 2, "action_window": "1h"}))
    assert p.decide(_f(Action.RECYCLE), 0, SERVING, False).why == "act"
    assert p.decide(_f(Action.RECYCLE), 30, SERVING, False).why == "cooldown"
    assert p.decide(_f(Action.RECYCLE), 100, SERVING, False).why == "act"
    d = p.decide(_f(Action.RECYCLE), 200, SERVING, False)
    assert d.action is Action.ALERT and d.why.startswith("escalated") and p.escalated
    assert p.decide(_f(Action.RECYCLE), 3700, SERVING, False).why == "act"  # the window cleared


def test_policy_hold_is_never_rate_limited_and_blocks_restarts() -> None:
    p = Policy(cfg_of({"max_actions": 1}))
    assert p.decide(_f(Action.RESTART, "xid_13"), 0, SERVING, False).why == "act"
    assert p.decide(_f(Action.HOLD, "xid_79"), 1, SERVING, False).action is Action.HOLD
    assert p.decide(_f(Action.RESTART, "hang"), 2, HELD, True).action is Action.NONE
    assert p.decide(_f(Action.RECYCLE), 3, DRAINING, False).why == "runtime draining"


def test_policy_dry_run_decides_but_does_not_count() -> None:
    p = Policy(cfg_of({"dry_run": True, "max_actions": 1}))
    assert [p.decide(_f(Action.RECYCLE), t, SERVING, False).why for t in (0, 1, 2)] == ["dry-run"] * 3


# -- config (the core's one schema) and profiles ---------------------------------------------------
@pytest.mark.parametrize("table,needle", [
    ({"intervall": "1s"}, "intervall is not a known key"),
    ({"interval": "soon"}, "interval has value 'soon'"),
    ({"max_actions": -1}, "max_actions has value -1"),
    ({"dry_run": "yes"}, "dry_run has value 'yes'"),
    ({"kernel": "sometimes"}, "kernel has value 'sometimes'"),
    ({"thermal_share": 0}, "thermal_share has value 0.0"),
])
def test_config_errors_name_key_and_value(table: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        from_data({"watchdog": table})


def test_gpu_profile_defaults_do_not_override_the_operator() -> None:
    gc = from_data({"watchdog": {"thermal_margin_c": 3}})
    wd, name = apply_profile(gc.watchdog, gc.explicit["watchdog"], "NVIDIA A100-SXM4-80GB")
    assert name == "a100" and gc.watchdog.clock_drop_pct == 10.0  # a new value; the loaded one stays
    assert wd.thermal_margin_c == 3.0 and wd.clock_drop_pct == 8.0
    gc = from_data({"watchdog": {"gpu_profile": "h200"}})  # chosen by the operator, whatever the GPU
    wd, name = apply_profile(gc.watchdog, gc.explicit["watchdog"], "NVIDIA GeForce RTX 4090")
    assert name == "h200" and wd.thermal_margin_c == 8.0


# -- reboot, ledger -------------------------------------------------------------------------------
def test_reboot_detector_compares_with_the_last_recorded_boot() -> None:
    d = RebootDetector("aaaa-1", "2026-11-29T00:00:00.000Z")
    res = d.check(sample(host=_host().model_copy(update={"boot_id": "bbbb-2"})))
    assert res.findings[0].kind == "host_reboot" and res.findings[0].data["down_since"].startswith("2026")
    assert d.check(sample(host=_host().model_copy(update={"boot_id": "bbbb-2"}))).health is Health.HEALTHY


def test_ledger_downsamples_with_age_and_remembers_boot(tmp_path: Path) -> None:
    now = [dt.datetime(2026, 11, 1, tzinfo=dt.timezone.utc)]
    lg = WatchdogLedger(tmp_path, now=lambda: now[0])
    rec = NvmlRecord(at_s=0.0, gpus=[_gpu()])
    for _ in range(3 * 3600):  # 3 h at 1 Hz
        lg.sample(host=_host().model_copy(update={"boot_id": "b1"}), nvml=rec)
        now[0] += dt.timedelta(seconds=1)
    lg.compact()
    n = lg.conn.execute("SELECT COUNT(*) FROM samples").fetchone()[0]
    assert n == 2 * (3600 + 120)  # newest hour full, the two older hours one per minute
    assert lg.last_host()[0] == "b1"
    row = lg.incident("thermal", "hot", EndClass.PREVENTIVE, "recycle:ok", {"share": 0.7})
    lg.restored(row)
    r = lg.conn.execute("SELECT * FROM incidents").fetchone()
    assert r["restored_at"] is not None and r["class"] == "preventive" and lg.counts() == {"thermal": 1}


def test_ledger_rows_read_back_as_typed_ticks(tmp_path: Path) -> None:
    """Every row is a core.samples record; a reader rebuilds the Tick from the rows alone."""
    lg = WatchdogLedger(tmp_path)
    brief = StatusBrief(state="serving", generation=2, requests_total=40, requests_generation=7, in_flight=1,
                        queued=0, failures=1)
    per = {i: (EngineMetrics(generation_tokens=12.0 * (i + 1)),
               ReplicaBrief(state="serving", generation=2 + i, hang="healthy")) for i in (0, 1)}
    written = lg.sample(nvml=NvmlRecord(at_s=5.0, gpus=[_gpu(temp_c=40.0, clock_reasons=0x4)]),
                        procs={42: ProcReading(role=Role.WORKER, rss_mb=1800.0)}, host=_host(),
                        status=brief, verdicts={"thermal": "healthy"}, replicas=per)
    rows = lg.conn.execute("SELECT at, source, replica, data FROM samples").fetchall()
    meta = dict(lg.conn.execute("SELECT key, value FROM meta").fetchall())
    lg.close()
    assert json.loads(meta["watchdog.samples_schema"]) == SAMPLES_SCHEMA
    assert sorted((r["source"], r["replica"]) for r in rows if r["replica"] is not None) == [
        ("metrics", 0), ("metrics", 1), ("replica", 0), ("replica", 1)]
    tick = Tick.from_rows(rows[0]["at"], [(r["source"], r["replica"], json.loads(r["data"])) for r in rows])
    assert tick == written
    assert tick.procs is not None and tick.procs["42"].role is Role.WORKER
    assert tick.status is not None and tick.status.requests_total == 40
    assert tick.nvml is not None and tick.nvml.gpus[0].clock_reasons == 0x4
    r1 = tick.replicas["1"]
    assert r1.replica is not None and r1.replica.generation == 3 and r1.metrics == {**EngineMetrics().to_dict(),
                                                                                    "generation_tokens": 24.0}


# -- NVML session ---------------------------------------------------------------------------------
class _SlowNvml(SimpleNamespace):
    """An NVML whose device count blocks like a GPU that fell off the bus."""


def test_nvml_call_timeout_is_a_state_not_a_hang() -> None:
    nv = _SlowNvml(nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: time.sleep(3) or 1)
    t0 = time.monotonic()
    s = NvmlSession(timeout_s=0.2, nvml=nv)
    assert time.monotonic() - t0 < 1.5
    assert not s.available and "took more than 0.2s" in s.error
    assert s.sample()["error"] == s.error
    s.close()


def test_the_cards_total_memory_is_known_before_any_sample() -> None:
    """The runtime decides whether a weight holder fits beside vLLM (`hold_weights = "auto"`) from
    the static record, before it has sampled anything: a total missing there kept every GPU box
    without a holder."""
    mem = SimpleNamespace(total=81_559 * 2**20, used=512 * 2**20, free=81_047 * 2**20)
    nv = SimpleNamespace(nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 1,
                         nvmlDeviceGetHandleByIndex=lambda i: f"h{i}", nvmlDeviceGetUUID=lambda h: "GPU-0",
                         nvmlDeviceGetName=lambda h: "NVIDIA H100 80GB HBM3", nvmlDeviceGetMemoryInfo=lambda h: mem,
                         nvmlSystemGetDriverVersion=lambda: "580.159.04", nvmlSystemGetCudaDriverVersion_v2=lambda: 13000,
                         nvmlDeviceGetPciInfo=lambda h: SimpleNamespace(busId="00000000:01:00.0"))
    s = NvmlSession(nvml=nv)
    try:
        assert s.available and s.static[0]["mem_total_mb"] == 81_559.0
        assert s.sample()["gpus"][0]["mem_total_mb"] == 81_559.0
    finally:
        s.close()


class NVMLError_LibraryNotFound(Exception):  # noqa: N801 - pynvml's naming
    pass


def _missing_library() -> None:
    raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")


def test_nvml_unavailable_is_a_failed_collector_never_ok(tmp_path: Path) -> None:
    """No NVML: the nvml collector fails with the error, thermal says unknown with it, and the
    summary never puts "ok" next to it."""
    nv = NvmlSession(nvml=SimpleNamespace(nvmlInit=_missing_library))
    assert not nv.available and "Shared Library Not Found" in nv.error

    async def once() -> tuple[Sample, list[Any]]:
        wd = Watchdog(cfg_of({"kernel": "off", "prometheus_port": 0}), tmp_path, exporter=False, nvml=nv)
        await wd.start()
        try:
            s = await wd.collect()
            return s, await wd.judge(s)
        finally:
            await wd.close()

    s, results = asyncio.run(once())
    c = s.collectors["nvml"]
    assert c.ok is False and c.error is not None and "Shared Library Not Found" in c.error
    thermal = [r for r in results if r.name == "thermal"][0]
    assert thermal.health is Health.UNKNOWN and "Shared Library Not Found" in thermal.reason
    text = summary_text(s, results)
    nvml_lines = [ln for ln in text.splitlines() if "Shared Library Not Found" in ln]
    assert nvml_lines and not any(" ok" in ln or "healthy" in ln for ln in nvml_lines), text


def test_an_older_ledger_gains_the_replica_columns_and_reads_in_the_report(tmp_path: Path) -> None:
    """Schema 2 had no `replica` in samples and incidents: the report reads such a file as it is
    (its rows are box-wide), and the watchdog adds the columns when it opens it (schema 3)."""
    import sqlite3

    from vllm_guard.core import ledger as L
    from vllm_guard.report import ledgerread

    db = sqlite3.connect(tmp_path / L.LEDGER_NAME)
    db.executescript("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
                     "INSERT INTO meta VALUES ('schema_version', '2');"
                     "CREATE TABLE samples (id INTEGER PRIMARY KEY, at TEXT NOT NULL, source TEXT NOT NULL, "
                     "data TEXT NOT NULL);"
                     "CREATE TABLE incidents (id INTEGER PRIMARY KEY, kind TEXT NOT NULL, cause TEXT, "
                     "class TEXT NOT NULL, detected_at TEXT NOT NULL, action TEXT, restored_at TEXT, data TEXT);"
                     "INSERT INTO samples (at, source, data) VALUES ('2026-11-01T00:00:00.000Z', 'metrics', "
                     "'{\"generation_tokens\": 5.0}');"
                     "INSERT INTO incidents (kind, class, detected_at) VALUES ('hang', 'unplanned', "
                     "'2026-11-01T00:00:00.000Z');")
    db.commit()
    db.close()
    old = ledgerread.load(tmp_path)
    assert old.ticks is not None and old.ticks[0].metrics == {"generation_tokens": 5.0} and not old.ticks[0].replicas
    assert old.incidents is not None and old.incidents[0].replica is None
    lg = WatchdogLedger(tmp_path)
    lg.sample(replicas={1: (EngineMetrics(generation_tokens=7.0), None)})
    lg.incident("hang", "c", EndClass.UNPLANNED, "restart:ok", {}, replica=1)
    assert lg.conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == str(L.SCHEMA_VERSION)
    lg.close()
    new = ledgerread.load(tmp_path)
    assert new.ticks is not None and new.ticks[-1].replicas["1"].metrics is not None
    assert new.incidents is not None and [i.replica for i in new.incidents] == [None, 1]
