"""Pure parts of the watchdog on literal inputs: parsers, statistics, detectors, policy, config,
cgroup files, ledger downsampling, the NVML call timeout."""

from __future__ import annotations

import datetime as dt
import random
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_guard.runtime.config import ConfigError
from vllm_guard.watchdog import host, kernel
from vllm_guard.watchdog.base import Action, Finding, Health
from vllm_guard.watchdog.drift import DriftDetector
from vllm_guard.watchdog.nvml import NvmlSampler, visible_uuids
from vllm_guard.watchdog.oom import OomDetector
from vllm_guard.watchdog.policy import Policy
from vllm_guard.watchdog.reboot import RebootDetector
from vllm_guard.watchdog.service import parse_metrics
from vllm_guard.watchdog.settings import apply_profile, from_table
from vllm_guard.watchdog.stats import theil_sen, time_to_exhaust
from vllm_guard.watchdog.store import WatchdogLedger
from vllm_guard.watchdog.xid import catalog_class

FIX = Path(__file__).parent / "fixtures" / "watchdog"


# -- kernel lines ---------------------------------------------------------------------------------
def test_parse_oom_context_line_with_task_memcg() -> None:
    ev = kernel.parse("[200000.100120] oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,"
                      "mems_allowed=0,oom_memcg=/system.slice/a.service,task_memcg=/system.slice/a.service/x,"
                      "task=VLLM::EngineCor,pid=48213,uid=998")
    assert ev is not None and ev["type"] == "oom_context"
    assert (ev["pid"], ev["task"], ev["task_memcg"]) == (48213, "VLLM::EngineCor", "/system.slice/a.service/x")


@pytest.mark.parametrize("line", [
    "3,91241,201000100110,-;Out of memory: Killed process 7777 (chrome) total-vm:5242880kB",
    "[  1.5] Memory cgroup out of memory: Killed process 7777 (chrome) total-vm:1kB",
    "Nov 29 22:10:01 box kernel: Out of memory: Killed process 7777 (chrome) total-vm:1kB",
])
def test_parse_killed_process_in_every_prefix(line: str) -> None:
    ev = kernel.parse(line)
    assert ev is not None and (ev["type"], ev["pid"], ev["task"]) == ("oom_killed", 7777, "chrome")


def test_parse_xid_lines() -> None:
    ev = kernel.parse("[ 3021.412345] NVRM: Xid (PCI:0000:18:00): 79, pid=48213, name=x, GPU has fallen off the bus.")
    assert ev is not None and (ev["xid"], ev["pci"], ev["pid"]) == (79, "0000:18:00", 48213)
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
    src.close()


# -- OOM attribution ------------------------------------------------------------------------------
def _sample(**kw: Any) -> dict[str, Any]:
    return {"at": "2026-11-29T00:00:00.000Z", "t": 0.0, "errors": {}, "kernel_events": [], **kw}


def test_oom_attributed_by_pid_when_no_memcg_line() -> None:
    d = OomDetector()
    st = {"children": [{"pid": 4242, "role": "engine_core"}], "failure_log": []}
    d.check(_sample(status=st))
    ev = kernel.parse("Out of memory: Killed process 4242 (python3) total-vm:1kB")
    res = d.check(_sample(status={**st, "children": []}, kernel_events=[ev]))
    assert res.health is Health.UNHEALTHY
    assert res.findings[0].data["attributed_by"] == "pid" and res.findings[0].data["role"] == "engine_core"


def test_oom_of_a_stranger_is_not_ours() -> None:
    ev = kernel.parse("Out of memory: Killed process 99 (chrome) total-vm:1kB")
    res = OomDetector().check(_sample(service_cgroup="/system.slice/a.service", kernel_events=[ev]))
    assert res.health is Health.HEALTHY


def test_cgroup_counter_rise_is_an_oom() -> None:
    d = OomDetector()
    assert d.check(_sample(cgroup={"oom_kill": 2})).health is Health.HEALTHY
    res = d.check(_sample(cgroup={"oom_kill": 3}))
    assert res.findings[0].kind == "oom_kill" and "2 -> 3" in res.findings[0].cause


def test_cuda_oom_in_child_log() -> None:
    line = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    res = OomDetector().check(_sample(child_log=["INFO fine", line]))
    assert [f.kind for f in res.findings] == ["cuda_oom"]


@pytest.mark.parametrize("version,expect", [("v1", 2), ("v2", 1)])
def test_cgroup_v1_and_v2_counters(version: str, expect: int) -> None:
    got = host.oom_kills("/system.slice/vllm-guard.service", str(FIX / f"cgroup_{version}"))
    assert (got["version"], got["oom_kill"]) == (version, expect)


def test_service_path_from_proc_cgroup(tmp_path: Path) -> None:
    (tmp_path / "12").mkdir()
    (tmp_path / "12" / "cgroup").write_text(
        "12:memory:/system.slice/vllm-guard.service\n1:name=systemd:/system.slice/vllm-guard.service\n")
    assert host.service_path(12, str(tmp_path)) == "/system.slice/vllm-guard.service"
    (tmp_path / "12" / "cgroup").write_text("0::/system.slice/vllm-guard.service\n")
    assert host.service_path(12, str(tmp_path)) == "/system.slice/vllm-guard.service"


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


def _drift_run(rate_mb: float, cfg_table: dict[str, Any], n: int = 600, seed: int = 1) -> list[Any]:
    cfg, _ = from_table(cfg_table)
    d = DriftDetector(cfg)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        req = i * 2
        rss = 600 + rate_mb * req + rng.gauss(0, 2.0)
        s = _sample(t=float(i), status={"requests_total": req},
                    procs={"11": {"role": "engine_core", "rss_mb": rss}}, host={"mem_available_mb": 8000.0})
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


def test_drift_flat_memory_no_alarm_and_warmup() -> None:
    res = _drift_run(0.0, {"forecast_horizon": "24h"})
    assert res[0].health is Health.INITIALIZING
    assert not any(r.findings for r in res)
    assert res[-1].health is Health.HEALTHY and res[-1].data["series"][0]["significant"] is False


def test_drift_a_warmup_step_is_not_a_leak() -> None:
    cfg, _ = from_table({"forecast_horizon": "24h"})
    d = DriftDetector(cfg)
    rng = random.Random(5)
    res = []
    for i in range(600):  # flat, one 120 MB step at request 200 (allocator pool), then flat
        req = i * 2
        rss = 1760 + (120 if req >= 200 else 0) + rng.gauss(0, 0.3)
        res.append(d.check(_sample(t=float(i), status={"requests_total": req},
                                   procs={"9": {"role": "worker", "rss_mb": rss}}, host={"mem_available_mb": 8e3})))
    assert not any(r.findings for r in res)


def test_drift_outside_horizon_is_only_degraded() -> None:
    res = _drift_run(0.2, {"forecast_horizon": "1h"})
    assert res[-1].health is Health.DEGRADED and [f.kind for f in res[-1].findings] == ["memory_drift"]


# -- policy ---------------------------------------------------------------------------------------
def _f(action: Action, kind: str = "memory_forecast") -> Finding:
    return Finding(kind, "k", "cause", "preventive", action)


def test_policy_cooldown_then_escalation() -> None:
    cfg, _ = from_table({"cooldown": "60s", "max_actions": 2, "action_window": "1h"})
    p = Policy(cfg)
    assert p.decide(_f(Action.RECYCLE), 0, "serving", False).why == "act"
    assert p.decide(_f(Action.RECYCLE), 30, "serving", False).why == "cooldown"
    assert p.decide(_f(Action.RECYCLE), 100, "serving", False).why == "act"
    d = p.decide(_f(Action.RECYCLE), 200, "serving", False)
    assert d.action is Action.ALERT and d.why.startswith("escalated") and p.escalated
    assert p.decide(_f(Action.RECYCLE), 3700, "serving", False).why == "act"  # the window cleared


def test_policy_hold_is_never_rate_limited_and_blocks_restarts() -> None:
    cfg, _ = from_table({"max_actions": 1})
    p = Policy(cfg)
    assert p.decide(_f(Action.RESTART, "xid_13"), 0, "serving", False).why == "act"
    assert p.decide(_f(Action.HOLD, "xid_79"), 1, "serving", False).action is Action.HOLD
    assert p.decide(_f(Action.RESTART, "hang"), 2, "held", True).action is Action.NONE
    assert p.decide(_f(Action.RECYCLE), 3, "draining", False).why == "runtime draining"


def test_policy_dry_run_decides_but_does_not_count() -> None:
    cfg, _ = from_table({"dry_run": True, "max_actions": 1})
    p = Policy(cfg)
    assert [p.decide(_f(Action.RECYCLE), t, "serving", False).why for t in (0, 1, 2)] == ["dry-run"] * 3


# -- config ---------------------------------------------------------------------------------------
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
        from_table(table)


def test_gpu_profile_defaults_do_not_override_the_operator() -> None:
    cfg, explicit = from_table({"thermal_margin_c": 3})
    assert apply_profile(cfg, explicit, "NVIDIA A100-SXM4-80GB") == "a100"
    assert cfg.thermal_margin_c == 3.0 and cfg.clock_drop_pct == 8.0


def test_visible_uuids_honours_pci_bus_order() -> None:
    static = [{"uuid": "GPU-b", "pci_bus_id": "0000:3B:00.0"}, {"uuid": "GPU-a", "pci_bus_id": "0000:18:00.0"}]
    env = {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert visible_uuids(static, env) == ["GPU-a"]
    assert visible_uuids(static, {"CUDA_VISIBLE_DEVICES": "0"}) == ["GPU-b", "GPU-a"]  # ambiguous: watch all
    assert visible_uuids(static, {"CUDA_VISIBLE_DEVICES": "GPU-b"}) == ["GPU-b"]


# -- metrics, reboot, ledger ----------------------------------------------------------------------
def test_parse_vllm_metrics_sums_labels() -> None:
    text = ('# TYPE vllm:request_success_total counter\n'
            'vllm:request_success_total{finished_reason="stop",model_name="m"} 3.0\n'
            'vllm:request_success_total{finished_reason="length",model_name="m"} 4.0\n'
            '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="m"} 0.25\n')
    assert parse_metrics(text) == {"request_success": 7.0, "kv_cache_usage": 0.25}


def test_reboot_detector_compares_with_the_last_recorded_boot() -> None:
    d = RebootDetector("aaaa-1", "2026-11-29T00:00:00.000Z")
    res = d.check(_sample(host={"boot_id": "bbbb-2"}))
    assert res.findings[0].kind == "host_reboot" and res.findings[0].data["down_since"].startswith("2026")
    assert d.check(_sample(host={"boot_id": "bbbb-2"})).health is Health.HEALTHY


def test_ledger_downsamples_with_age_and_remembers_boot(tmp_path: Path) -> None:
    now = [dt.datetime(2026, 11, 1, tzinfo=dt.timezone.utc)]
    lg = WatchdogLedger(tmp_path, now=lambda: now[0])
    for _ in range(3 * 3600):  # 3 h at 1 Hz
        lg.sample({"host": {"boot_id": "b1"}, "nvml": {"x": 1}})
        now[0] += dt.timedelta(seconds=1)
    lg.compact()
    n = lg.conn.execute("SELECT COUNT(*) FROM samples").fetchone()[0]
    assert n == 2 * (3600 + 120)  # newest hour full, the two older hours one per minute
    assert lg.last_host()[0] == "b1"
    row = lg.incident("thermal", "hot", "preventive", "recycle:ok", {"share": 0.7})
    lg.restored(row)
    r = lg.conn.execute("SELECT * FROM incidents").fetchone()
    assert r["restored_at"] is not None and lg.counts() == {"thermal": 1}


# -- NVML session ---------------------------------------------------------------------------------
class _SlowNvml(SimpleNamespace):
    """An NVML whose device count blocks like a GPU that fell off the bus."""


def test_nvml_call_timeout_is_a_state_not_a_hang() -> None:
    nv = _SlowNvml(nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: time.sleep(3) or 1)
    t0 = time.monotonic()
    s = NvmlSampler(timeout_s=0.2, nvml=nv)
    assert time.monotonic() - t0 < 1.5
    assert not s.available and "took more than 0.2s" in s.error
    assert s.sample()["error"] == s.error
    s.close()


def test_nvml_absent_is_one_line() -> None:
    s = NvmlSampler(nvml=None)
    s.nv = None
    s._init()
    assert s.error == "NVML unavailable: nvidia-ml-py is not installed"


def test_drift_on_gpu_per_process_memory_with_gpu_headroom() -> None:
    """vLLM preallocates KV, so the device total is flat-ish: the per-process series finds it."""
    cfg, _ = from_table({"forecast_horizon": "1h"})
    d = DriftDetector(cfg)
    res = None
    for i in range(400):
        req = i * 5
        used = 22038.0 + 0.1465 * req  # the seed's 150 KB per request, in NVML's per-process list
        gpu = {"uuid": "GPU-x", "mem_total_mb": 24564.0, "mem_used_mb": used + 600,
               "processes": [{"pid": 77, "used_mb": used}]}
        res = d.check(_sample(t=float(i), status={"requests_total": req}, nvml={"gpus": [gpu]},
                              procs={"77": {"role": "engine_core", "rss_mb": 900.0}}, host={"mem_available_mb": 1e5}))
    assert res is not None
    f = [x for x in res.findings if x.key == "gpu:77"]
    assert [x.kind for x in f] == ["memory_drift", "memory_forecast"]
    v = f[-1].data
    assert v["slope_mb_per_100"] == pytest.approx(14.65, rel=0.01)
    # headroom = 24564 - used at the end; 5 requests/s -> 0.7325 MB/s
    assert v["time_to_oom_s"] == pytest.approx((24564 - 600 - 22038 - 0.1465 * 1995) / (0.1465 * 5), rel=0.05)
