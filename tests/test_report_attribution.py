"""Leak attribution: the report names the kind of request that makes a process grow.

The maths on ticks with known per-request costs (API server: cancelled requests; EngineCore:
completed ones), then on a real ledger: the runtime with an injected EngineCore host leak per
finished request, the watchdog recording memory and the runtime's counters, load with
completions and client cancellations. The report must name completed requests with the
injected cost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import GUARD_CMD
from vllm_guard.core.samples import Tick
from vllm_guard.report.attribution import attribution_report, headline

BASE_S = 1_767_225_600  # 2026-01-01T00:00:00Z


def _at(s: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(BASE_S + s, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def synthetic_ticks(seed: int = 0, n: int = 400, gens: int = 2) -> list[Tick]:
    """API server: +0.31 MB per cancelled request; EngineCore: +0.2 MB per completed one and
    nothing per cancelled; allocator noise and a rare 8 MB step on both."""
    rng = np.random.default_rng(seed)
    ticks = []
    done = cancelled = failed = 0
    t = 0.0
    for g in range(1, gens + 1):
        api, eng = 300.0, 700.0
        first = done + cancelled + failed
        for _ in range(n):
            t += 1.0
            dc, dx, df = rng.poisson(3), rng.poisson(1), rng.poisson(0.1)
            done, cancelled, failed = done + dc, cancelled + dx, failed + df
            api += 0.31 * dx + rng.normal(0, 0.3) + 8 * (rng.random() < 0.01)
            eng += 0.2 * dc + rng.normal(0, 0.3) + 8 * (rng.random() < 0.01)
            ticks.append(Tick.from_sources(_at(t), {
                "procs": {str(100 * g): {"role": "api_server", "rss_mb": api},
                          str(100 * g + 1): {"role": "engine_core", "rss_mb": eng}},
                "status": {"state": "serving", "generation": g, "requests_total": done + cancelled + failed,
                           "requests_generation": done + cancelled + failed - first, "in_flight": 0, "queued": 0, "failures": 0,
                           "completed": done, "failed": failed, "client_disconnects": cancelled},
            }))
        t += 60.0  # the recycle
    return ticks


def _report(*args: Any, **kw: Any) -> dict[str, Any]:
    """The typed figures as the JSON has them."""
    return dataclasses.asdict(attribution_report(*args, **kw))


def test_names_the_cause_per_process_with_its_cost() -> None:
    rep = _report(synthetic_ticks(), 0.90)
    by = {(p["role"], p["metric"]): p for p in rep["processes"]}
    api, eng = by[("api_server", "rss_mb")], by[("engine_core", "rss_mb")]
    assert api["cause"] == "cancelled" and eng["cause"] == "completed"
    c = {f["feature"]: f for f in api["features"]}
    assert c["cancelled"]["low"] <= 0.31 <= c["cancelled"]["high"]
    assert not c["completed"]["significant"]  # the API server does not grow per completed request
    e = {f["feature"]: f for f in eng["features"]}
    assert e["completed"]["low"] <= 0.2 <= e["completed"]["high"] and not e["cancelled"]["significant"]
    line = headline("api_server", "rss_mb", api)
    assert line.startswith("API server RSS: +0.3") and "per cancelled request [" in line and "completed: 0" in line
    assert rep["counters_missing"] == ["prompt_tokens", "output_tokens", "streamed"]
    assert any(x.startswith("EngineCore RSS: +0.2") for x in rep["lines"])


def test_no_growth_names_nothing_and_lockstep_counters_are_left_out() -> None:
    ticks = []
    for i in range(100):
        ticks.append(Tick.from_sources(_at(i), {
            "procs": {"5": {"role": "engine_core", "rss_mb": 700.0 + (0.5 if i % 7 == 0 else 0.0)}},
            "status": {"state": "serving", "generation": 1, "requests_total": 3 * i, "requests_generation": 3 * i,
                       "in_flight": 0, "queued": 0, "failures": 0, "completed": 3 * i, "failed": 0,
                       "client_disconnects": 0},
        }))
    p = _report(ticks)["processes"][0]
    assert p["cause"] is None
    assert any(x.startswith("cancelled: never changed") for x in p["left_out"])
    assert any("collinear" in x for x in p["left_out"])  # 3 per second: completed moves with time
    assert _report([])["present"] is False


def test_errored_requests_named_on_phased_load() -> None:
    """The shape of tests/test_report_upstream_leak.py: phases of failing requests (+0.16 MB each
    in the API server), of completed ones (nothing) and idle spells, 0.5 s ticks; an allocator
    step now and then. Errored requests are named, completed ones are not."""
    rng = np.random.default_rng(3)
    ticks, t, api = [], 0.0, 300.0
    done = failed = 0
    phases = ["fail"] * 22 + ["ok"] * 22 + ["idle"] * 8
    rng.shuffle(phases)
    for p in phases:
        for _ in range(int(rng.integers(3, 7))):  # ticks in this phase
            t += 0.5
            df = int(rng.integers(1, 3)) if p == "fail" else 0
            dc = int(rng.integers(1, 5)) if p == "ok" else 0
            done, failed = done + dc, failed + df
            api += 0.16 * df + rng.normal(0, 0.05) + 2.0 * (rng.random() < 0.01)
            ticks.append(Tick.from_sources(_at(t), {
                "procs": {"100": {"role": "api_server", "rss_mb": api}},
                "status": {"state": "serving", "generation": 1, "requests_total": done + failed,
                           "requests_generation": done + failed, "in_flight": 0, "queued": 0, "failures": 0,
                           "completed": done, "failed": failed, "client_disconnects": 0},
            }))
    rep = _report(ticks, 0.90)
    api_p = rep["processes"][0]
    f = {x["feature"]: x for x in api_p["features"]}
    assert api_p["cause"] == "errored", api_p
    assert f["errored"]["low"] > 0 and f["errored"]["low"] <= 0.16 <= f["errored"]["high"], f["errored"]
    assert not f["completed"]["significant"] or f["completed"]["mb_per_unit"] < 0.016, f["completed"]
    assert any(x.startswith("API server RSS: +0.1") and "per errored request [" in x for x in rep["lines"]), rep


# -- on real vLLM -------------------------------------------------------------------------------
LEAK_MB = 0.25


async def _load(url: str, n: int, cancel_every: int) -> None:
    """`n` short completions, 4 at a time; every `cancel_every`-th is a stream the client closes
    after its first chunk (a client disconnect)."""
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        todo = iter(range(n))

        async def worker() -> None:
            for i in todo:
                cancel = i % cancel_every == 0
                body = {"model": model, "prompt": f"hello {i}", "max_tokens": 48 if cancel else 3,
                        "temperature": 0, "stream": cancel, "ignore_eos": cancel}
                async with s.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=600)) as r:
                    assert r.status == 200, await r.text()
                    if cancel:
                        async for _ in r.content:
                            break
                    else:
                        await r.read()
                await asyncio.sleep(random.uniform(0.0, 0.3))

        await asyncio.gather(*(worker() for _ in range(4)))


@pytest.mark.slow
@pytest.mark.long
def test_real_injected_engine_leak_is_attributed_to_completed_requests(guard_factory: Any, tmp_path: Path) -> None:
    # the runtime's memory readings every 0.5 s: the verdict names a leak (and so its cause) from
    # 20 readings on, and the load may take under a minute on a quiet box (11 readings at 5 s)
    gcfg = tmp_path / "guard.toml"
    gcfg.write_text('[recycle]\nmemory_interval = "0.5s"\n')
    srv = guard_factory(env={"VLLM_GUARD_INJECT": f"host_leak_mb_per_request={LEAK_MB}"}, args=["--config", str(gcfg)])
    srv.wait_serving()
    cfg = tmp_path / "watchdog.toml"
    cfg.write_text('[watchdog]\ninterval = "0.5s"\nkernel = "off"\nprometheus_port = 0\ndry_run = true\n')
    log = open(tmp_path / "watchdog.log", "ab")
    wd = subprocess.Popen([*GUARD_CMD, "watchdog", "--config", str(cfg), "--state-dir", str(srv.state_dir)],
                          stdout=log, stderr=log)
    try:
        time.sleep(5)
        asyncio.run(_load(srv.url, 900, cancel_every=5))
        time.sleep(3)
    finally:
        wd.terminate()
        wd.wait(60)
        log.close()
    st = srv.status()
    # of the 180 streams the client closes, those the engine had already finished count as
    # completed (71 of 180 were disconnects on a loaded box): enough to tell the features apart
    assert st["requests"]["client_disconnects"] >= 30, st["requests"]
    out = subprocess.run([*GUARD_CMD, "report", "--db", str(srv.state_dir), "--format", "json"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    f = json.loads(out.stdout)
    eng = next(p for p in f["attribution"]["processes"] if p["role"] == "engine_core" and p["metric"] == "rss_mb")
    feats = {x["feature"]: x for x in eng["features"]}
    print(json.dumps(feats, indent=1), f["attribution"]["lines"])
    assert eng["cause"] == "completed", eng
    c = feats["completed"]
    assert c["low"] <= LEAK_MB * 1.25 and c["high"] >= LEAK_MB * 0.75 and abs(c["mb_per_unit"] - LEAK_MB) < 0.25 * LEAK_MB
    assert any(x.startswith("EngineCore RSS: +0.2") and "per completed request" in x for x in f["attribution"]["lines"])
    text = subprocess.run([*GUARD_CMD, "report", "--db", str(srv.state_dir)], capture_output=True, text=True,
                          timeout=600).stdout
    assert "Leak cause: EngineCore RSS:" in text.split("SERVICE")[0]  # in the verdict, first screen


def test_features_that_cancel_name_no_cause() -> None:
    """Memory falls overall while cancellations cost +1 MB each and completions give back 0.5 MB:
    the cancellation cost is real, but naming it as the cause of a leak that is not there would
    mislead; the note says why nothing is named."""
    rng = np.random.default_rng(7)
    ticks, eng, done, cancelled = [], 900.0, 0, 0
    for i in range(300):
        dc, dx = rng.poisson(5), rng.poisson(1)
        done, cancelled = done + dc, cancelled + dx
        eng += 1.0 * dx - 0.5 * dc + rng.normal(0, 0.2)
        ticks.append(Tick.from_sources(_at(i), {
            "procs": {"5": {"role": "engine_core", "rss_mb": eng}},
            "status": {"state": "serving", "generation": 1, "requests_total": done + cancelled,
                       "requests_generation": done + cancelled, "in_flight": 0, "queued": 0, "failures": 0,
                       "completed": done, "failed": 0, "client_disconnects": cancelled},
        }))
    rep = _report(ticks)
    p = rep["processes"][0]
    f = {x["feature"]: x for x in p["features"]}
    assert f["cancelled"]["low"] <= 1.0 <= f["cancelled"]["high"] and f["cancelled"]["significant"]
    assert p["growth_mb"] < 0 and p["cause"] is None and p["note"].startswith("no cause named: cancelled"), p
    assert rep["lines"] == []


def test_an_injected_gpu_leak_on_the_h200_is_attributed_to_completed_requests() -> None:
    """A real ledger: 1.9 min of load on an H200 (vLLM 0.25.1, the 7B shape) with an injected
    EngineCore GPU leak of 4 MB per request (`summary.json`'s `leak_mb`). The EngineCore's own
    start (30 GB of GPU memory in 20 s before any request) once swamped the fit, which then named
    nothing; from the warm-up on the cost per completed request is found, and nothing else is
    named."""
    here = Path(__file__).parent.parent / "docs/results/h200-2026-11-30/example-ledgers"
    leak = json.loads((here / "summary.json").read_text())["args"]["leak_mb"]
    out = subprocess.run([*GUARD_CMD, "report", "--db", str(here / "a100-80g.sqlite"), "--format", "json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    att = json.loads(out.stdout)["attribution"]
    by = {(p["role"], p["metric"]): p for p in att["processes"]}
    gpu = by[("engine_core", "gpu_mb")]
    assert gpu["cause"] == "completed", gpu
    c = {f["feature"]: f for f in gpu["features"]}["completed"]
    assert c["low"] <= leak <= c["high"], c
    assert [p for p in att["processes"] if p["cause"] is not None] == [gpu]
    assert len(att["lines"]) == 1 and att["lines"][0].startswith("EngineCore GPU: +"), att["lines"]


def _start_then_steady(warm_from: int) -> list[Tick]:
    """Two generations as a gated recycle leaves them: each EngineCore's start after its gate
    (host RSS of staged weights falling, GPU memory climbing to 21 GB) while the runtime's status
    already names it (`starting`, 0 requests of its own) and the cumulative counters stand; then
    steady serving, 4 requests a tick, no growth but allocator noise."""
    rng = np.random.default_rng(11)
    ticks, t, done = [], 0.0, 0
    for g in (1, 2):
        start = [(14000.0, 518.0), (6350.0, 13544.0), (1470.0, 14632.0), (1635.0, 20548.0), (1729.0, 20716.0)]
        first = done
        for i in range(warm_from + 300):
            t += 1.0
            if i < len(start):
                rss, gpu = start[i]
                state = "starting"
            else:
                done += 4
                rss, gpu = 1730.0 + rng.normal(0, 0.3), 21118.0
                state = "serving"
            ticks.append(Tick.from_sources(_at(t), {
                "procs": {str(200 + g): {"role": "engine_core", "rss_mb": rss}},
                "nvml": {"at_s": t, "gpus": [{"index": 0, "uuid": "GPU-x", "name": "NVIDIA H200", "mem_total_mb": 143771.0,
                                   "mem_used_mb": gpu + 600.0,
                                   "processes": [{"pid": 200 + g, "used_mb": gpu}]}]},
                "status": {"state": state, "generation": g, "requests_total": done,
                           "requests_generation": done - first, "in_flight": 0, "queued": 0, "failures": 0,
                           "completed": done, "failed": 0, "client_disconnects": 0},
            }))
    return ticks


def test_a_generations_own_start_is_not_attributed() -> None:
    """The start after a gate grows the EngineCore by 20 GB of GPU memory in a few seconds while
    the counters stand: without the warm-up those intervals made the fit trade +1e6 MB per hour
    against -24 MB per completed request on a real H200 ledger. From the warm-up on (the leak
    slopes' rule), nothing grew and nothing is named."""
    ticks = _start_then_steady(warm_from=40)
    rep = _report(ticks, 0.90)
    by = {(p["role"], p["metric"]): p for p in rep["processes"]}
    for kind in ("gpu_mb", "rss_mb"):
        p = by[("engine_core", kind)]
        assert p["cause"] is None and abs(p["growth_mb"]) < 20, p
        assert not any(f["significant"] and abs(f["explained_mb"]) > 100 for f in p["features"]), p
    assert rep["lines"] == []
    # the same ticks with no warm-up take the starts in: GPU growth of tens of GB to explain
    raw = {(p["role"], p["metric"]): p for p in _report(ticks, 0.90, warmup=0)["processes"]}
    assert raw[("engine_core", "gpu_mb")]["growth_mb"] > 40_000, raw[("engine_core", "gpu_mb")]
    assert raw[("engine_core", "gpu_mb")]["intervals"] > by[("engine_core", "gpu_mb")]["intervals"]


def test_a_real_gated_run_attributes_no_start(tmp_path: Path) -> None:
    """A real ledger: the guard on an H200 (vLLM 0.25.1, a 7B shape), two gated recycles whose
    successors started after their gates while the status named them, the watchdog beside it.
    The EngineCore's GPU memory fit sees only its serving generations' few MB, not the 20 GB of
    each start."""
    import lzma

    src = Path(__file__).parent.parent / "docs/results/h200-2026-12-04/warm3000/ledger.sqlite.xz"
    db = tmp_path / "ledger.sqlite"
    db.write_bytes(lzma.decompress(src.read_bytes()))
    out = subprocess.run([*GUARD_CMD, "report", "--db", str(db), "--format", "json"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    att = json.loads(out.stdout)["attribution"]
    by = {(p["role"], p["metric"]): p for p in att["processes"]}
    gpu = by[("engine_core", "gpu_mb")]
    assert gpu["intervals"] > 100 and abs(gpu["growth_mb"]) < 500, gpu
    assert gpu["cause"] is None and not gpu["withheld"], gpu
    assert att["lines"] == []
