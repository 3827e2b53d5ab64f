"""Two guards behind a real HAProxy (Debian's package) that checks each box's readiness endpoint,
with open-loop streaming load through HAProxy: a cold recycle on one box, then `kill -9` of one
runtime.

What a fleet needs from a box's readiness: HAProxy stops sending a box requests while it has no
generation to serve them, so they go to the other box instead of waiting in this one's queue.
- A cold recycle with `[server] unready_lead = 0` (box a): readiness is 503 for the whole gap; HAProxy
  notices only after `fall` failed checks, so requests sent in that window wait in the box's queue
  (served, not failed). Measured: how many, and HAProxy's delay (the `long` tier: a whole cold
  start under load).
- A cold recycle with the default lead time (box b): readiness turns 503 before the generation
  stops, HAProxy moves traffic first: 0 failed at the client, nothing queued at the box, and HAProxy's
  log shows no request sent to it from the start of its gap until it is ready again.
- `kill -9` of a runtime (box a): the requests that fail at the client (streams cut; HAProxy
  retries the refused connections on the other box) and the time until HAProxy stops sending to it.

Each guard has its own state dir, port and metrics port (two on the default 9465 would collide).
The figures go to docs/BENCHMARKS.md ("Fleets: two guards behind HAProxy").
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from conftest import GuardServer, free_port, processes_of
from streams import StreamResult, stream_completion
from vllm_guard.runtime.frontdoor.routes import READY_PATH

pytestmark = pytest.mark.slow

RATE = 2.0  # requests/s, open loop (Poisson)
MAX_TOKENS = 16
KILL_TOKENS = 128  # longer streams for the kill, so some are in flight when it comes
INTER_S, FALL, RISE = 2, 3, 2  # HAProxy's check: every 2 s, down after 3 failures, up after 2 passes
LEAD_S = 10.0  # the default [server] unready_lead (box b)
HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"


# -- HAProxy ------------------------------------------------------------------------------------
HAPROXY_CFG = """\
global
    log stdout format raw local0
    maxconn 2000

defaults
    mode http
    log global
    log-format "req ts=%Ts.%ms th=%Th ti=%Ti tr=%TR tw=%Tw srv=%s status=%ST retries=%rc term=%tsc id=%[capture.req.hdr(0)]"
    option log-health-checks
    timeout connect 5s
    timeout client 600s
    timeout server 600s
    # a refused connection (a dead box) and a guard's own 503 before forwarding go to the other box
    retries 2
    option redispatch 1
    retry-on conn-failure empty-response 503

frontend fleet
    bind 127.0.0.1:{port}
    capture request header X-Request-Id len 64
    default_backend guards

backend guards
    balance leastconn
    option httpchk
    http-check send meth GET uri {ready}
    http-check expect status 200
    default-server inter {inter}s fall {fall} rise {rise}
    server a 127.0.0.1:{a} check
    server b 127.0.0.1:{b} check
"""

_REQ = re.compile(r"^req ts=(?P<ts>[\d.]+) th=(?P<th>-?\d+) ti=(?P<ti>-?\d+) tr=(?P<tr>-?\d+) tw=(?P<tw>-?\d+) srv=(?P<srv>\S+) status=(?P<status>-?\d+) retries=(?P<retries>\S+) "
                  r"term=(?P<term>\S+) id=(?P<id>\S*)")
_STATE = re.compile(r"Server guards/(?P<srv>\w+) is (?P<state>UP|DOWN)")


@dataclass
class HaproxyLog:
    requests: list[dict[str, Any]] = field(default_factory=list)  # when its server was picked (epoch), which, id
    states: list[tuple[float, str, str]] = field(default_factory=list)  # (read at, server, UP|DOWN)
    lines: list[str] = field(default_factory=list)

    def feed(self, line: str, at: float) -> None:
        self.lines.append(line)
        m = _REQ.match(line)
        if m:
            # %Ts is the connection's accept date (for a kept-alive connection, about the end of its
            # previous request): the server was picked after the handshake, the idle time, the
            # request's own reception and its wait in HAProxy's queue
            picked = float(m["ts"]) + sum(max(0, int(m[k])) for k in ("th", "ti", "tr", "tw")) / 1000
            self.requests.append({"ts": picked, "srv": m["srv"], "status": int(m["status"]),
                                  "retries": m["retries"], "term": m["term"], "id": m["id"]})
            return
        m = _STATE.search(line)
        if m:
            self.states.append((at, m["srv"], m["state"]))

    def state_at(self, srv: str, state: str, after: float) -> float | None:
        return next((t for t, s, st in self.states if s == srv and st == state and t >= after), None)


class Haproxy:
    def __init__(self, tmp: Path, a: int, b: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cfg = tmp / "haproxy.cfg"
        self.cfg.write_text(HAPROXY_CFG.format(port=self.port, ready=READY_PATH, inter=INTER_S, fall=FALL, rise=RISE,
                                               a=a, b=b))
        check = subprocess.run([HAPROXY, "-c", "-f", str(self.cfg)], capture_output=True, text=True, timeout=300)
        assert check.returncode == 0, check.stdout + check.stderr
        self.log = HaproxyLog()
        self.stderr = open(tmp / "haproxy.stderr", "w")  # its own warnings repeat the log's state lines
        self.proc = subprocess.Popen([HAPROXY, "-db", "-f", str(self.cfg)], stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True)
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.feed(line.rstrip("\n"), time.time())

    def wait_both_serving(self, timeout: float = 60.0) -> None:
        """Servers start UP in HAProxy (no log line): wait until it has sent a request to each."""
        end = time.monotonic() + timeout
        with httpx.Client(timeout=10.0) as c:
            while time.monotonic() < end:
                try:
                    c.get(self.url + "/v1/models")
                except httpx.ConnectError:  # HAProxy has not bound its port yet (a loaded box)
                    time.sleep(0.2)
                    continue
                if {"a", "b"} <= {q["srv"] for q in self.log.requests}:
                    return
                time.sleep(0.2)
        raise TimeoutError("HAProxy did not send to both boxes; log:\n" + "\n".join(self.log.lines[-30:]))

    def wait_up(self, srv: str, after: float, timeout: float = 120.0) -> float:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            t = self.log.state_at(srv, "UP", after)
            if t is not None:
                return t
            time.sleep(0.2)
        raise TimeoutError(f"HAProxy never marked {srv} UP; log:\n" + "\n".join(self.log.lines[-30:]))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._t.join(5)
        self.stderr.close()


# -- load and readiness, each in its own thread -------------------------------------------------
class OpenLoop:
    """Poisson arrivals at `rate` through `url`, each a streaming completion; bounded in count."""

    def __init__(self, url: str, model: str, rate: float = RATE, seed: int = 26, cap: int = 3000,
                 tokens: int = MAX_TOKENS) -> None:
        self.url, self.model, self.rate, self.cap, self.tokens = url, model, rate, cap, tokens
        self.rng = random.Random(seed)
        self.results: list[tuple[float, StreamResult]] = []  # (sent at, epoch; result)
        self._stop = threading.Event()
        self._t = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        tasks: list[asyncio.Task[None]] = []
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
        async with httpx.AsyncClient(limits=limits) as client:
            async def one(sent: float) -> None:
                res = await stream_completion(client, self.url, self.model, self.tokens, timeout=900.0)
                self.results.append((sent, res))
            nxt = time.monotonic()
            while not self._stop.is_set() and len(tasks) < self.cap:
                nxt += self.rng.expovariate(self.rate)
                await asyncio.sleep(max(0.0, nxt - time.monotonic()))
                tasks.append(asyncio.create_task(one(time.time())))
            await asyncio.gather(*tasks)

    def start(self) -> OpenLoop:
        self._t.start()
        return self

    def stop(self, timeout: float = 900.0) -> list[tuple[float, StreamResult]]:
        self._stop.set()
        self._t.join(timeout)
        assert not self._t.is_alive(), "requests still open long after the load stopped"
        return self.results


class ReadinessPoll:
    """A box's readiness endpoint polled directly every 0.25 s: (epoch, status, reason)."""

    def __init__(self, url: str) -> None:
        self.url = url + READY_PATH
        self.seen: list[tuple[float, int, str]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        with httpx.Client(timeout=5.0) as c:
            while not self._stop.wait(0.25):
                try:
                    r = c.get(self.url)
                    self.seen.append((time.time(), r.status_code, r.json().get("reason", "")))
                except (httpx.HTTPError, ValueError) as e:
                    self.seen.append((time.time(), 0, type(e).__name__))

    def stop(self) -> None:
        self._stop.set()
        self._t.join(5)

    def spell(self, status: int, words: str = "") -> tuple[float, float] | None:
        """First and last poll with this status (and reason words)."""
        ts = [t for t, s, why in self.seen if s == status and words in why]
        return (ts[0], ts[-1]) if ts else None


def epoch(iso: str) -> float:
    return dt.datetime.fromisoformat(iso).timestamp()


def last_recycle(state_dir: Path) -> dict[str, Any]:
    conn = sqlite3.connect(f"file:{state_dir / 'ledger.sqlite'}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        row = conn.execute("SELECT * FROM recycles ORDER BY id DESC LIMIT 1").fetchone()
    finally:
        conn.close()
    assert row is not None
    return dict(row)


def failed(results: list[tuple[float, StreamResult]], tokens: int = MAX_TOKENS) -> list[StreamResult]:
    """Every request that did not end with all its tokens (an error event, a cut stream, a 5xx)."""
    return [r for _, r in results if not (r.ok and r.completion_tokens == tokens and r.chunk_tokens == tokens)]


# -- the fleet: two guards and HAProxy, for the whole module ------------------------------------
@dataclass
class Fleet:
    a: GuardServer
    b: GuardServer
    haproxy: Haproxy
    model: str
    metrics_ports: dict[str, int]

    def scrape(self, name: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The runtime's own metrics port of box `name`, parsed by Prometheus's parser."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"http://127.0.0.1:{self.metrics_ports[name]}/metrics", timeout=30).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture(scope="module")
def fleet(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if not os.access(HAPROXY, os.X_OK):
        pytest.fail("haproxy is not installed (.ci/system-deps installs Debian's package)")
    tmp = tmp_path_factory.mktemp("fleet")
    guards = []
    ports = {"a": free_port(), "b": free_port()}
    for name, lead in (("a", 0.0), ("b", LEAD_S)):
        conf = tmp / f"{name}.toml"
        conf.write_text(f'[server]\nmetrics_port = {ports[name]}\nunready_lead = "{lead:g}s"\n')
        guards.append(GuardServer(tiny_model, tmp / name, args=["--config", str(conf)]).start())
    a, b = guards
    hap: Haproxy | None = None
    try:
        a.wait_serving(1, 900)
        b.wait_serving(1, 900)
        hap = Haproxy(tmp, a.port, b.port)
        hap.wait_both_serving()
        yield Fleet(a, b, hap, tiny_model, ports)
    finally:
        if hap is not None:
            hap.stop()
            print("\n[haproxy log tail]\n" + "\n".join(hap.log.lines[-15:]), flush=True)
        for g in guards:
            g.stop()


def recycle_under_load(fleet: Fleet, box: GuardServer, name: str) -> dict[str, Any]:
    """A cold recycle of `box` under open-loop load through HAProxy; what each side saw."""
    poll = ReadinessPoll(box.url)
    load = OpenLoop(fleet.haproxy.url, fleet.model).start()
    try:
        time.sleep(15)  # both boxes serve the load first
        gen = box.status()["generation"]
        asked = time.time()
        out = box.admin("recycle", "--reason", "fleet test")
        assert out.returncode == 0, out.stdout + out.stderr
        box.wait_serving(gen + 1, 900)
        ready_again = fleet.haproxy.wait_up(name, asked, 300)
        time.sleep(10)  # and both serve again
    finally:
        results = load.stop()
        poll.stop()
    return {"poll": poll, "results": results, "asked": asked, "haproxy_up": ready_again,
            "recycle": last_recycle(box.state_dir)}


@pytest.mark.long  # a measurement: a whole cold start under load (~4 min on 2 cores)
def test_a_cold_recycle_without_lead_time_is_unready_for_the_whole_gap(fleet: Fleet) -> None:
    """Box a (`unready_lead = 0`): readiness 503 from the start of the gap to the new generation;
    HAProxy notices after its checks fail, so the requests it sent meanwhile wait at the box."""
    r = recycle_under_load(fleet, fleet.a, "a")
    poll, results, rec = r["poll"], r["results"], r["recycle"]
    gap = poll.spell(503, "no generation")
    assert gap is not None, poll.seen[-20:]
    assert poll.spell(503, "stops soon") is None  # no lead time asked for
    # ready (200) before and after, 503 for every poll between the first and the last 503
    assert any(s == 200 and t < gap[0] for t, s, _ in poll.seen) and any(s == 200 and t > gap[1] for t, s, _ in poll.seen)
    assert all(s == 503 for t, s, _ in poll.seen if gap[0] <= t <= gap[1]), poll.seen
    assert not failed(results), [f"{x.status} {x.error}" for x in failed(results)][:5]
    down = fleet.haproxy.log.state_at("a", "DOWN", r["asked"])
    assert down is not None and gap[0] <= down <= gap[1] + 1
    into_gap = [q for q in fleet.haproxy.log.requests if q["srv"] == "a" and gap[0] <= q["ts"] <= down]
    # a request's pick time is estimated from HAProxy's log fields (accept date + phases, in ms):
    # within a second of the DOWN line is that estimate's error, not a request sent to a DOWN server
    after_down = [q for q in fleet.haproxy.log.requests if q["srv"] == "a" and down + 1.0 < q["ts"] < r["haproxy_up"]]
    assert not after_down, after_down  # HAProxy sends a DOWN server nothing
    # the fleet metrics of the box, from a real vLLM: latency histograms, vLLM's own series, readiness
    v = fleet.scrape("a")
    assert v[("vllm_guard_runtime_request_ttft_seconds_count", (("replica", "0"),))] > 0
    assert v[("vllm_guard_runtime_replica_metrics_up", (("replica", "0"),))] == 1
    assert [k for k in v if k[0] == "vllm:generation_tokens_total" and ("replica", "0") in k[1]]
    assert v[("vllm_guard_runtime_ready", ())] == 1
    print(f"\n[figure] haproxy cold recycle, no lead time: {len(results)} requests through HAProxy at {RATE:g}/s, "
          f"{len(failed(results))} failed; box a unready (503) for {gap[1] - gap[0]:.1f} s (ledger downtime "
          f"{rec['downtime_s']:.1f} s); HAProxy marked it DOWN {down - gap[0]:.1f} s after it turned unready "
          f"and UP {r['haproxy_up'] - gap[1]:.1f} s after it was ready again; {len(into_gap)} requests sent to "
          f"it in between waited in its queue (at most {rec['max_queued']} at once)", flush=True)


def test_a_cold_recycle_with_lead_time_sends_nothing_into_the_gap(fleet: Fleet) -> None:
    """Box b (`unready_lead` 10 s): unready before its generation stops; HAProxy has moved traffic
    before the gap, so nothing waits at the box and nothing fails."""
    r = recycle_under_load(fleet, fleet.b, "b")
    poll, results, rec = r["poll"], r["results"], r["recycle"]
    lead = poll.spell(503, "stops soon")
    gap = poll.spell(503, "no generation")
    assert lead is not None and gap is not None and lead[0] < gap[0], poll.seen[-40:]
    assert not failed(results), [f"{x.status} {x.error}" for x in failed(results)][:5]
    down = fleet.haproxy.log.state_at("b", "DOWN", r["asked"])
    assert down is not None and down < gap[0], (down, gap)
    into_gap = [q for q in fleet.haproxy.log.requests if q["srv"] == "b" and gap[0] <= q["ts"] < r["haproxy_up"]]
    assert not into_gap, into_gap
    assert rec["max_queued"] == 0, rec
    during_lead = [q for q in fleet.haproxy.log.requests if q["srv"] == "b" and lead[0] <= q["ts"] < gap[0]]
    print(f"\n[figure] haproxy cold recycle, lead time {LEAD_S:g} s: {len(results)} requests, "
          f"{len(failed(results))} failed; box b unready {gap[0] - lead[0]:.1f} s before its gap "
          f"({gap[1] - gap[0]:.1f} s); HAProxy DOWN {down - lead[0]:.1f} s after unready, "
          f"{len(during_lead)} requests sent to it in the lead (served by the old generation), "
          f"0 into the gap, at most {rec['max_queued']} queued", flush=True)


def test_kill_9_of_one_runtime(fleet: Fleet) -> None:
    """`kill -9` of box a's runtime under load: its streams are cut (counted as failed), refused
    connections are retried on box b, and HAProxy stops sending to a after its checks fail; the
    dead runtime's vLLM tree does not outlive it."""
    load = OpenLoop(fleet.haproxy.url, fleet.model, seed=9, tokens=KILL_TOKENS).start()
    try:
        time.sleep(15)
        assert fleet.a.proc is not None
        killed, killed_mono = time.time(), time.monotonic()
        os.kill(fleet.a.proc.pid, signal.SIGKILL)
        fleet.a.proc.wait(30)
        time.sleep(FALL * INTER_S + 20)
    finally:
        results = load.stop()
    down = fleet.haproxy.log.state_at("a", "DOWN", killed)
    assert down is not None, fleet.haproxy.log.lines[-20:]
    bad = {id(r) for r in failed(results, KILL_TOKENS)}
    before = [r for s, r in results if s <= killed and id(r) in bad]
    after = [r for s, r in results if s > killed and id(r) in bad]
    known = [r for s, r in results if s > down + 1 and id(r) in bad]
    assert not known, [f"{r.status} {r.error}" for r in known][:5]  # nothing fails once HAProxy knows
    to_dead = [q for q in fleet.haproxy.log.requests if q["srv"] == "a" and q["ts"] > killed]
    retried = [q for q in fleet.haproxy.log.requests if q["srv"] == "b" and q["ts"] > killed and q["retries"] != "0"]
    end = time.monotonic() + 120  # the keeper kills the dead runtime's vLLM tree
    while processes_of(fleet.a.state_dir) and time.monotonic() < end:
        time.sleep(1)
    assert not processes_of(fleet.a.state_dir), "the killed runtime's vLLM processes were left running"
    in_flight = [r for s, r in results if s <= killed and (r.ended == 0 or r.ended > killed_mono)]
    print(f"\n[figure] haproxy kill -9 of one runtime: {len(results)} streams of {KILL_TOKENS} tokens at {RATE:g}/s, "
          f"{len(in_flight)} in flight at the kill (both boxes), {len(bad)} failed "
          f"({len(before)} sent before the kill, {len(after)} after it); HAProxy marked the box DOWN "
          f"{down - killed:.1f} s after the kill; after the kill it logged {len(to_dead)} requests ending at the "
          f"dead box and {len(retried)} retried onto the other one", flush=True)
