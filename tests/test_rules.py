"""The rules more than one package applies, each defined once in core and checked here against
every package that applies it: the hang rule (runtime probe, watchdog), which states take a
restart or recycle (runtime commands, watchdog policy), GPU selection (runtime replicas,
install, watchdog), and the public port's bind check (serve, install)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from vllm_guard.core import config as C
from vllm_guard.core import host, ports
from vllm_guard.core.config import ConfigError, ProbeConfig, WatchdogConfig, section_from_table
from vllm_guard.core.errors import UsageError
from vllm_guard.core.ledger import EndClass
from vllm_guard.core.protocol import RECYCLABLE, RESTARTABLE, ProbeSummary, RuntimeState, StatusSnapshot
from vllm_guard.core.vllm_api import ProbeResult
from vllm_guard.runtime.cli import _preflight_port
from vllm_guard.runtime.replica import monitors
from vllm_guard.runtime.replica.plan import plan, replica_uuids
from vllm_guard.systemd import config_file
from vllm_guard.systemd.preflight import PreflightError, require_free_port
from vllm_guard.systemd.render import Layout
from vllm_guard.watchdog.base import Action, Finding, Health, ReplicaReading, Sample
from vllm_guard.watchdog.hang import HangDetector
from vllm_guard.watchdog.loop import Watchdog
from vllm_guard.watchdog.policy import Policy
from vllm_guard.watchdog.trace import TraceWriter, read_trace

FIX = Path(__file__).parent / "fixtures" / "watchdog"
WINDOW_S, TIMEOUT_S, INTERVAL_S = 2.0, 1.0, 0.5


# -- hang: /metrics silent, the API server busy -> starved, not hung (runtime and watchdog) --------
@pytest.fixture
def api_server() -> Iterator[Any]:
    """A real process standing where vLLM's API server is, for its CPU time: spinning (alive,
    /metrics merely slow to answer) or SIGSTOPped (stopped: it answers nothing)."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(stopped: bool) -> int:
        p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        procs.append(p)
        if stopped:
            time.sleep(0.2)
            os.kill(p.pid, signal.SIGSTOP)
        return p.pid

    yield start
    for p in procs:
        p.kill()
        p.wait()


class SilentBackend:
    """What the runtime's probe loop reads of a vLLM whose /metrics does not answer and whose
    1-token completion times out; its CPU time is read from the real process `pid`."""

    generation = 1

    def __init__(self, pid: int) -> None:
        self.pid = pid

    async def metrics(self, http: Any) -> None:
        return None

    async def probe(self, http: Any, prompt: str, timeout: float) -> ProbeResult:
        return ProbeResult(False, timeout, f"timeout after {timeout:.1f}s", timed_out=True)


class SilentGeneration:
    """The generation the probe loop watches: its backend, and where a hang verdict lands."""

    def __init__(self, backend: SilentBackend) -> None:
        self.backend = backend
        self.hang: str | None = None

    def note_hang(self, why: str) -> None:
        self.hang = why


async def runtime_verdict(pid: int, rounds: int = 4) -> tuple[str | None, list[ProbeSummary]]:
    """The runtime's own probe loop (monitors.probe_loop) over `rounds` judged probes."""
    cfg: ProbeConfig = section_from_table("probe", {"interval": f"{INTERVAL_S}s", "timeout": f"{TIMEOUT_S}s",
                                                    "progress_window": f"{WINDOW_S}s", "failures": 2})
    gen = SilentGeneration(SilentBackend(pid))
    seen: list[ProbeSummary] = []
    task = asyncio.create_task(monitors.probe_loop(gen, None, cfg, seen.append, lambda: None))  # type: ignore[arg-type]
    while not task.done() and len(seen) < rounds:
        await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return gen.hang, seen


def watchdog_verdict(pid: int, seconds: float = 3 * WINDOW_S) -> tuple[list[Finding], str]:
    """The watchdog's hang detector over the same silence: a tick every 0.2 s reading the real
    process's CPU time, /metrics unanswered, a timed-out probe every INTERVAL_S."""
    cfg: WatchdogConfig = section_from_table("watchdog", {"hang_failures": 2, "progress_window": f"{WINDOW_S}s",
                                                          "probe_interval": f"{INTERVAL_S}s",
                                                          "probe_timeout": f"{TIMEOUT_S}s"})
    d = HangDetector(cfg)
    st = StatusSnapshot(state=RuntimeState.SERVING, state_for_s=1.0, generation=1, pid=1, port=1, model="m")
    found: list[Finding] = []
    t0 = last_probe = time.monotonic()
    reason = ""
    while time.monotonic() - t0 < seconds and not found:
        now = time.monotonic()
        probe = None
        if now - last_probe >= INTERVAL_S:
            probe, last_probe = ProbeResult(False, TIMEOUT_S, "timeout after 1.0s", timed_out=True), now
        r = ReplicaReading(0, RuntimeState.SERVING, 1, "http://127.0.0.1:1", now, None, host.cpu_seconds(pid), probe)
        res = d.check(Sample(at="2026-12-01T00:00:00.000Z", t=time.time(), status=st, replicas=[r]))
        found += res.findings
        reason = res.reason
        time.sleep(0.2)
    return found, reason


def test_metrics_silent_but_the_api_server_busy_is_starved_for_runtime_and_watchdog(api_server: Any) -> None:
    """Measured on 2 loaded cores: vLLM's API server did not answer /metrics for 9 s while it
    streamed. It kept using CPU: starved. The watchdog used to count such a probe as a miss."""
    busy = api_server(stopped=False)
    hung, seen = asyncio.run(runtime_verdict(busy))
    assert hung is None and len(seen) >= 4 and all(not p.ok and p.engine_progress is None for p in seen), seen
    found, reason = watchdog_verdict(busy)
    assert found == [] and "starved" in reason and "busy" in reason, reason


def test_metrics_silent_and_the_api_server_stopped_is_a_hang_for_runtime_and_watchdog(api_server: Any) -> None:
    stopped = api_server(stopped=True)
    hung, _ = asyncio.run(runtime_verdict(stopped))
    assert hung is not None and "neither /metrics answered nor the API server used CPU" in hung, hung
    found, _ = watchdog_verdict(stopped)
    assert found and found[0].action is Action.RESTART and found[0].data["verdict"] == "silent", found


# -- which states take a restart or a recycle ------------------------------------------------------
@pytest.mark.parametrize("state", list(RuntimeState))
def test_the_watchdog_restarts_and_recycles_in_the_states_core_names(state: RuntimeState) -> None:
    """`core.protocol.RESTARTABLE` / `RECYCLABLE` are the runtime's command rule too: the
    watchdog sends a command only where the runtime takes it (never a 409 by design)."""
    p = Policy(section_from_table("watchdog", {"cooldown": "0s", "max_actions": 100}))
    restart = p.decide(Finding("hang", "k", "c", EndClass.UNPLANNED, Action.RESTART, replica=1), 0, state, False)
    recycle = p.decide(Finding("thermal", "k", "c", EndClass.PREVENTIVE, Action.RECYCLE), 0, state, False)
    assert (restart.action is Action.RESTART) == (state in RESTARTABLE), restart
    assert (recycle.action is Action.RECYCLE) == (state in RECYCLABLE), recycle
    if state not in RESTARTABLE:
        assert restart.why == f"replica 1 {state.value}"


def test_the_runtime_takes_a_restart_or_recycle_in_the_same_states() -> None:
    """The runtime's command rule over the replica's own states (runtime/replica/machine.py,
    derived from core's sets), seen as the status reports them (`COARSE`): it restarts exactly
    where the watchdog sends a restart, and recycles in every coarse state where the watchdog may
    send one (a recycle already under way is refused with 409, an outcome). Non-empty: a subset
    test alone passes for an empty set. That `decide` takes the commands in exactly these states
    is tests/test_replica_machine.py's."""
    from vllm_guard.runtime.replica.machine import COARSE, RECYCLABLE_STATES, RESTARTABLE_STATES

    assert RESTARTABLE_STATES and {COARSE[s] for s in RESTARTABLE_STATES} == RESTARTABLE
    assert RECYCLABLE_STATES and {COARSE[s] for s in RECYCLABLE_STATES} == RECYCLABLE


# -- GPU selection: [server] gpus, one rule for runtime, install and watchdog ----------------------
A, B = "GPU-aaaa0000-0000-0000-0000-000000000001", "GPU-bbbb0000-0000-0000-0000-000000000002"


def _two_gpu_trace(tmp_path: Path) -> Path:
    meta, samples = read_trace(FIX / "nvml_h200_steady.jsonl")
    out = tmp_path / "two.jsonl"
    w = TraceWriter(out, meta)
    for rec in samples[:2]:
        g = rec["gpus"][0]
        rec["gpus"] = [{**g, "index": 0, "uuid": A, "pci_bus_id": "00000000:18:00.0"},
                       {**g, "index": 1, "uuid": B, "pci_bus_id": "00000000:3B:00.0"}]
        w.write(rec)
    w.close()
    return out


@pytest.mark.parametrize("text, env", [
    ('[server]\ngpus = ["1"]\n', {}),
    (f'[server]\ngpus = ["{A[:12]}"]\n', {}),
    ("", {}),
    ('[server]\ngpus = ["0"]\n', {"CUDA_VISIBLE_DEVICES": B}),
    (f'[install]\ngpus = ["{B}"]\n', {}),  # an older file: read as [server] gpus
])
def test_the_watchdog_watches_the_gpus_the_runtime_gives_its_replicas(tmp_path: Path, text: str,
                                                                       env: dict[str, str]) -> None:
    (tmp_path / "guard.toml").write_text(text)
    cfg = C.load(tmp_path / "guard.toml")
    trace = _two_gpu_trace(tmp_path)
    wd_cfg: WatchdogConfig = section_from_table("watchdog", {"nvml_trace": str(trace), "kernel": "off",
                                                             "prometheus_port": 0})
    wd = Watchdog(wd_cfg, tmp_path / "state", exporter=False, env=env, gpus=cfg.server.gpus)
    try:
        static = wd.nvml.static
        runtime_gpus = {u for r in plan(cfg, static, env) for u in replica_uuids(static, r, env)}
        assert wd.visible == runtime_gpus and runtime_gpus
    finally:
        wd.ledger.close()


def test_install_writes_server_gpus_and_no_unit_wide_cuda_visible_devices() -> None:
    cfg = config_file.apply_flags(C.GuardConfig(), model=None, host=None, port=None, user=None, watchdog_user=None,
                            gpus="0,GPU-cccc", env=[], layout=Layout(None))
    assert cfg.server.gpus == ("0", "GPU-cccc")
    assert "CUDA_VISIBLE_DEVICES" not in cfg.install.environment()
    with pytest.raises(UsageError, match=r"--gpus has value 'zero': not a GPU index"):
        config_file.apply_flags(C.GuardConfig(), model=None, host=None, port=None, user=None, watchdog_user=None,
                                gpus="zero", env=[], layout=Layout(None))


def test_the_old_install_gpus_key_is_read_as_server_gpus_or_refused_beside_it(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = C.from_data({"install": {"gpus": [A]}}, "old.toml")
    assert cfg.server.gpus == (A,) and cfg.deprecations and "[server] gpus" in cfg.deprecations[0]
    assert "old.toml: [install] gpus is deprecated" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"\[install\] gpus has value .*replaced by \[server\] gpus, which is set"):
        C.from_data({"install": {"gpus": [A]}, "server": {"gpus": ["0"]}})
    with pytest.raises(ConfigError, match=r"\[install\] gpus has value 'x': not a GPU index"):
        C.from_data({"install": {"gpus": ["x"]}})


# -- the public port's bind check -----------------------------------------------------------------
def test_serve_and_install_refuse_a_taken_port_with_the_same_check() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        why = ports.bind_error("127.0.0.1", port)
        assert why is not None and "in use" in why
        with pytest.raises(UsageError, match=f"port has value {port}: cannot bind 127.0.0.1:{port} \\({why}\\)"):
            _preflight_port("127.0.0.1", port)
        with pytest.raises(PreflightError, match=f"port {port} on 127.0.0.1 is taken \\({why}\\)"):
            require_free_port("127.0.0.1", port)
    assert ports.bind_error("127.0.0.1", port) is None  # closed: free again (SO_REUSEADDR, as the proxy binds)
    _preflight_port("127.0.0.1", port)
    require_free_port("127.0.0.1", port)
