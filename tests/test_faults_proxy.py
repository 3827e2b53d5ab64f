"""Attacks on the public port, against the real proxy (`runtime.proxy.Proxy` on a real socket).

The thing under test here is the proxy itself: what it forwards, counts, retries, buffers and
keeps open. The backend's nature is irrelevant to that, so the backend is a small synthetic
upstream on a real Unix socket that records what reached it (every path, every attempt, every
disconnect it saw). What only a real vLLM can show — that a disconnect aborts generation, that
vLLM's own endpoints stay unreachable — is in test_faults_guard.py against the real thing.
"""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from vllm_guard.core.config import ServerConfig
from vllm_guard.core.vllm_api import PROBE_ID_PREFIX, unix_url
from vllm_guard.runtime.proxy import Proxy, Target

pytestmark = pytest.mark.faults

DEV_ENDPOINTS = ["/scale_elastic_ep", "/is_scaling_elastic_ep", "/v1/responses/resp_1/cancel", "/v1/responses/resp_1",
                 "/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache", "/reset_mm_cache", "/collective_rpc",
                 "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/start_profile", "/update_weights",
                 "/pause", "/resume", "/abort_requests", "/server_info", "/metrics", "/nonexistent", "/docs"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Upstream:
    """Records what reaches it. `mode`: stream (SSE chunks), slow (non-streaming, answers after
    `delay`), drop (closes the connection without answering), bad (HTTP 400)."""

    def __init__(self, sock: Path) -> None:
        self.sock = sock
        self.mode = "stream"
        self.chunks = 20
        self.delay = 0.05
        self.hits: collections.Counter[str] = collections.Counter()
        self.ids: list[str] = []
        self.disconnects: list[str] = []  # request ids whose client (the proxy) went away
        self.runner: web.AppRunner | None = None

    async def handler(self, request: web.Request) -> web.StreamResponse:
        self.hits[request.path] += 1
        rid = request.headers.get("X-Request-Id", "")
        self.ids.append(rid)
        await request.read()
        try:
            if self.mode == "drop":
                assert request.transport is not None
                request.transport.close()
                await asyncio.sleep(0.1)
                return web.Response()
            if self.mode == "bad":
                return web.json_response({"error": "bad request"}, status=400)
            if self.mode == "slow" or request.method == "GET":
                await asyncio.sleep(self.delay if request.method == "POST" else 0)
                return web.json_response({"ok": True, "path": request.path})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(self.chunks):
                await resp.write(f"data: {json.dumps({'choices': [{'text': str(i)}]})}\n\n".encode())
                await asyncio.sleep(self.delay)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        except asyncio.CancelledError:
            self.disconnects.append(rid)
            raise

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handler)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        await web.UnixSite(self.runner, str(self.sock)).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


class Rig:
    def __init__(self, proxy: Proxy, upstream: Upstream, url: str) -> None:
        self.proxy, self.upstream, self.url = proxy, upstream, url
        self.errors: list[int] = []
        self.current: Target | None = None  # the last target set: the one the proxy routes to

    async def target(self, generation: int = 1, limit: int | None = None) -> Target:
        t = Target(generation=generation, url=unix_url(str(self.upstream.sock)), limit=limit)
        t.open(60.0)
        await self.proxy.set_target(t)
        self.current = t
        return t


def run(tmp_path: Path, scenario: Callable[[Rig], Awaitable[None]], **server: Any) -> None:
    async def main() -> None:
        up = Upstream(tmp_path / "up.sock")
        await up.start()
        cfg = ServerConfig(port=free_port(), **server)
        rig_errors: list[int] = []
        proxy = Proxy(cfg, on_limit=lambda t: None, on_error=lambda t: rig_errors.append(t.generation))
        await proxy.start()
        rig = Rig(proxy, up, f"http://127.0.0.1:{cfg.port}")
        rig.errors = rig_errors
        try:
            await scenario(rig)
        finally:
            for route in list(proxy.router.routes):
                await route.target.close()
            await proxy.stop()
            await up.stop()

    try:  # the runtime's own loop (`serve` runs on uvloop where present): its transports differ
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())


def completion(stream: bool = True, tokens: int = 8) -> dict[str, Any]:
    return {"model": "m", "prompt": "hi", "max_tokens": tokens, "stream": stream}


# -- what is forwarded and what counts -----------------------------------------------------------
def test_vllm_development_endpoints_never_reach_the_backend(tmp_path: Path) -> None:
    async def scenario(rig: Rig) -> None:
        t = await rig.target()
        async with aiohttp.ClientSession() as s:
            for path in DEV_ENDPOINTS:
                for method in ("GET", "POST"):
                    async with s.request(method, rig.url + path, json={}) as r:
                        body = await r.json()
                        assert r.status == 404, (method, path, r.status)
                        assert body["error"]["type"] == "vllm_guard"
            async with s.get(rig.url + "/v1/completions") as r:
                assert r.status == 405
            async with s.get(rig.url + "/v1/models") as r:
                assert r.status == 200 and (await r.json())["path"] == "/v1/models"
        assert dict(rig.upstream.hits) == {"/v1/models": 1}, rig.upstream.hits
        assert rig.proxy.counters.not_forwarded == 2 * len(DEV_ENDPOINTS) + 1
        assert t.dispatched == 0

    run(tmp_path, scenario)


def test_a_refused_path_with_a_body_gets_its_answer_not_a_reset(tmp_path: Path) -> None:
    """A client whose body follows its headers a moment later (a loaded box, a slow client) reads
    the 404 and can reuse the connection; a large body is not read: 404 and Connection: close."""
    async def scenario(rig: Rig) -> None:
        await rig.target()
        r, w = await asyncio.open_connection("127.0.0.1", rig.proxy.cfg.port)
        w.write(b"POST /sleep HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n")
        await w.drain()
        await asyncio.sleep(0.3)
        w.write(b"{}")
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 404") and b"Connection: close" not in head, head
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        await r.readexactly(length)
        w.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")  # the same connection, reused
        assert (await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)).startswith(b"HTTP/1.1 200")
        w.close()
        answer = await raw(rig.url, b"POST /sleep HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 404") and b"Connection: close" in answer, answer[:300]
        assert rig.upstream.hits == {"/v1/models": 1}

    run(tmp_path, scenario)


def test_only_requests_that_reach_the_engine_count_toward_the_limit(tmp_path: Path) -> None:
    async def scenario(rig: Rig) -> None:
        t = await rig.target(limit=5)
        async with aiohttp.ClientSession() as s:
            for _ in range(60):
                async with s.post(rig.url + "/nonexistent", json={}) as r:
                    assert r.status == 404
            for _ in range(20):
                async with s.get(rig.url + "/ping") as r:
                    assert r.status == 200
                async with s.post(rig.url + "/tokenize", json={"prompt": "x"}) as r:
                    assert r.status == 200
            rig.upstream.mode = "bad"  # the API server refuses it: it never reached the engine
            for _ in range(10):
                async with s.post(rig.url + "/v1/completions", json=completion()) as r:
                    assert r.status == 400
            assert t.dispatched == 0 and t.accepting, "404s, pings, tokenize and 4xx counted"
            rig.upstream.mode = "stream"
            for _ in range(4):
                async with s.post(rig.url + "/v1/completions", json=completion()) as r:
                    assert r.status == 200
                    await r.read()
        assert t.dispatched == 4 and t.completed == 4 and t.accepting
        assert rig.proxy.counters.requests_total == 14  # engine routes received; 10 of them were 400s

    run(tmp_path, scenario)


def test_a_count_undone_reopens_a_generation_its_limit_had_closed(tmp_path: Path) -> None:
    async def scenario(rig: Rig) -> None:
        t = await rig.target(limit=2)
        async with aiohttp.ClientSession() as s:
            async with s.post(rig.url + "/v1/completions", json=completion()) as r:
                await r.read()
            rig.upstream.mode = "bad"
            async with s.post(rig.url + "/v1/completions", json=completion()) as r:  # the 2nd: closes, then 400
                assert r.status == 400
        assert t.dispatched == 1 and t.accepting and not t.limit_closed

    run(tmp_path, scenario)


def test_a_backend_that_drops_the_connection_gets_the_request_twice_not_ten_times(tmp_path: Path) -> None:
    async def scenario(rig: Rig) -> None:
        t = await rig.target(limit=100)
        rig.upstream.mode = "drop"
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            async with s.post(rig.url + "/v1/completions", json=completion(stream=False)) as r:
                body = await r.json()
            took = time.monotonic() - t0
        assert r.status == 502, body
        assert rig.upstream.hits["/v1/completions"] == 2, rig.upstream.hits
        assert len(set(rig.upstream.ids)) == 1  # the same request, once more
        assert rig.proxy.counters.retried == 1 and rig.errors == [1, 1]
        assert t.dispatched == 0  # neither attempt reached an engine
        assert took >= 4.5  # the retry waited for another generation first (none came)

    run(tmp_path, scenario)


def test_the_retry_goes_to_the_next_generation_when_one_comes(tmp_path: Path) -> None:
    async def scenario(rig: Rig) -> None:
        old = await rig.target(generation=1)
        rig.upstream.mode = "drop"

        async def replace() -> None:
            while not rig.errors:
                await asyncio.sleep(0.01)
            rig.upstream.mode = "stream"
            await rig.proxy.stop_dispatch(old, dead=True)
            await rig.target(generation=2)

        async with aiohttp.ClientSession() as s:
            swap = asyncio.create_task(replace())
            async with s.post(rig.url + "/v1/completions", json=completion()) as r:
                text = await r.text()
            await swap
        assert r.status == 200 and "[DONE]" in text
        assert r.headers["X-Vllm-Guard-Generation"] == "2"
        assert rig.upstream.hits["/v1/completions"] == 2
        assert old.dispatched == 0 and rig.current is not None and rig.current.dispatched == 1
        await old.close()

    run(tmp_path, scenario)


def test_a_client_request_id_posing_as_the_guards_probe_is_replaced(tmp_path: Path) -> None:
    async def scenario(rig: Rig) -> None:
        await rig.target()
        async with aiohttp.ClientSession() as s:
            for rid in (PROBE_ID_PREFIX + "x", "a" * 500, "ok-id-1"):
                async with s.post(rig.url + "/v1/completions", json=completion(), headers={"X-Request-Id": rid}) as r:
                    await r.read()
        sent = rig.upstream.ids
        assert not sent[0].startswith(PROBE_ID_PREFIX) and len(sent[1]) <= 128 and sent[2] == "ok-id-1"

    run(tmp_path, scenario)


# -- bodies ------------------------------------------------------------------------------------------
async def raw(url: str, head: bytes, body: bytes = b"", read_timeout: float = 5.0) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head + body)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(65536), read_timeout)
    finally:
        writer.close()


def test_a_declared_2gb_body_is_refused_before_any_of_it_is_read(tmp_path: Path) -> None:
    async def scenario(rig: Rig) -> None:
        await rig.target()
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 2000000000\r\n\r\n")
        t0 = time.monotonic()
        answer = await raw(rig.url, head)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert time.monotonic() - t0 < 3
        # with Expect: 100-continue the client is told before it sends anything, never "100 Continue"
        answer = await raw(rig.url, head.replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n"))
        assert answer.startswith(b"HTTP/1.1 413") and b"100 Continue" not in answer
        assert rig.upstream.hits["/v1/completions"] == 0
        assert rig.proxy.body_bytes == 0

    run(tmp_path, scenario, max_body_mb=1)


def test_a_chunked_body_is_cut_at_the_limit_and_bodies_held_at_once_are_bounded(tmp_path: Path) -> None:
    async def scenario(rig: Rig) -> None:
        await rig.target()

        async def chunks(n: int) -> AsyncIterator[bytes]:
            for _ in range(n):
                yield b"x" * 65536

        async with aiohttp.ClientSession() as s:
            async with s.post(rig.url + "/v1/completions", data=chunks(64)) as r:  # 4 MiB, no Content-Length
                assert r.status == 413
        assert rig.upstream.hits["/v1/completions"] == 0 and rig.proxy.body_bytes == 0
        # three clients each send 0.9 MiB and stall: 2 MiB of budget holds two, the third gets 503
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 943718\r\n\r\n"
        opened = []
        for _ in range(2):
            _, w = await asyncio.open_connection("127.0.0.1", rig.proxy.cfg.port)
            w.write(head + b"x" * 1000)
            await w.drain()
            opened.append(w)
        await asyncio.sleep(0.3)
        answer = await raw(rig.url, head)
        assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After" in answer, answer[:300]
        for w in opened:
            w.close()
        await asyncio.sleep(0.3)
        assert rig.proxy.body_bytes == 0, "a client that left kept its reservation"

    run(tmp_path, scenario, max_body_mb=1, body_buffer_mb=2)


def test_a_body_that_stalls_is_answered_408(tmp_path: Path) -> None:
    async def scenario(rig: Rig) -> None:
        await rig.target()
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
        answer = await raw(rig.url, head, b"{", read_timeout=10)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert rig.upstream.hits["/v1/completions"] == 0

    run(tmp_path, scenario, idle_timeout=1)


# -- connections -----------------------------------------------------------------------------------
def test_slowloris_connections_are_closed_at_the_header_timeout_and_serving_goes_on(tmp_path: Path) -> None:
    async def scenario(rig: Rig) -> None:
        await rig.target()
        port = rig.proxy.cfg.port
        slow = []
        for _ in range(20):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            await w.drain()
            slow.append((r, w))
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as s:  # a legitimate client is served meanwhile
            async with s.post(rig.url + "/v1/completions", json=completion()) as resp:
                assert resp.status == 200 and b"[DONE]" in await resp.read()
        for r, w in slow:  # keep dripping header bytes: the timeout is for the whole header
            w.write(b"X-a: b\r\n")
        closed_at = []
        for r, _ in slow:
            assert await asyncio.wait_for(r.read(), 10) == b""  # EOF: the guard closed it
            closed_at.append(time.monotonic() - t0)
        assert max(closed_at) < 2 + 3, closed_at
        assert rig.proxy.gate.header_timeouts == 20 and len(rig.proxy.gate.conns) == 0
        for _, w in slow:
            w.close()

    run(tmp_path, scenario, header_timeout=2)


def test_at_the_connection_cap_idle_connections_make_room_and_busy_ones_get_503(tmp_path: Path) -> None:
    async def scenario(rig: Rig) -> None:
        await rig.target()
        port = rig.proxy.cfg.port
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(8)]
        await asyncio.sleep(0.1)
        assert len(rig.proxy.gate.conns) == 8
        async with aiohttp.ClientSession() as s:  # idle ones give way
            async with s.post(rig.url + "/v1/completions", json=completion()) as resp:
                assert resp.status == 200
                await resp.read()
        assert rig.proxy.gate.evicted >= 1
        for _, w in idle:
            w.close()
        await asyncio.sleep(0.1)
        # eight requests in progress: a ninth connection is told 503, and nothing else breaks
        rig.upstream.mode, rig.upstream.delay = "slow", 2.0
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            async def one() -> int:
                async with s.post(rig.url + "/v1/completions", json=completion(stream=False)) as r:
                    await r.read()
                    return r.status
            busy = [asyncio.create_task(one()) for _ in range(8)]
            await asyncio.sleep(0.5)
            answer = await raw(rig.url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: " in answer, answer[:200]
            assert await asyncio.gather(*busy) == [200] * 8
        assert rig.proxy.gate.refused == 1

    run(tmp_path, scenario, max_connections=8)


def test_a_kept_alive_connection_left_idle_is_closed(tmp_path: Path) -> None:
    async def scenario(rig: Rig) -> None:
        await rig.target()
        r, w = await asyncio.open_connection("127.0.0.1", rig.proxy.cfg.port)
        w.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        await w.drain()
        assert (await r.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        while await asyncio.wait_for(r.read(65536), 10):
            pass
        assert 0.5 < time.monotonic() - t0 < 6
        w.close()

    run(tmp_path, scenario, idle_timeout=1)


# -- disconnects -------------------------------------------------------------------------------------
def test_a_client_that_leaves_cancels_its_request_at_every_stage(tmp_path: Path) -> None:
    async def scenario(rig: Rig) -> None:
        p, up = rig.proxy, rig.upstream

        async def leave_after(delay: float, body: dict[str, Any], rid: str) -> None:
            async with aiohttp.ClientSession() as s:
                with pytest.raises(asyncio.TimeoutError):
                    async with s.post(rig.url + "/v1/completions", json=body, headers={"X-Request-Id": rid},
                                      timeout=aiohttp.ClientTimeout(total=delay)) as r:
                        await r.read()

        # queued: no generation serves; the client leaves; the next generation never sees it
        await leave_after(0.5, completion(), "queued-1")
        await asyncio.sleep(0.1)
        assert p.queued == 0
        await rig.target()
        await asyncio.sleep(0.2)
        assert "queued-1" not in up.ids, "a request whose client left while queued ran later (a ghost)"
        # waiting for the first byte (non-streaming): the backend sees its client go
        up.mode, up.delay = "slow", 30.0
        await leave_after(1.0, completion(stream=False), "first-byte-1")
        await asyncio.sleep(0.3)
        assert "first-byte-1" in up.disconnects
        # streaming
        up.mode, up.delay, up.chunks = "stream", 0.2, 200
        await leave_after(1.0, completion(), "stream-1")
        await asyncio.sleep(0.5)
        assert "stream-1" in up.disconnects
        assert p.counters.client_disconnects == 3 and p.in_flight == 0 and p.queued == 0

    run(tmp_path, scenario)


# -- memory under a 1 GB upload ---------------------------------------------------------------------
_PROXY_ALONE = """
import asyncio, sys
from vllm_guard.core.config import ServerConfig
from vllm_guard.runtime.proxy import Proxy
async def main():
    p = Proxy(ServerConfig(port=int(sys.argv[1])), on_limit=lambda t: None, on_error=lambda t: None)
    await p.start()
    print("ready", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def _kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def test_a_1gb_upload_costs_the_proxy_no_more_than_its_body_limit(tmp_path: Path) -> None:
    """The proxy alone in a process of its own (its peak RSS is the figure), default settings
    ([server] max_body_mb 32): a 1 GB body, declared and then chunked, sent as fast as loopback
    takes it."""
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", _PROXY_ALONE, str(port)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        while (line := proc.stdout.readline()) and line.strip() != b"ready":  # (its log lines)
            pass
        assert line.strip() == b"ready"
        before = _kb(proc.pid, "VmRSS")
        sent = {}
        for name, head in (("declared", b"Content-Length: 1073741824\r\n"), ("chunked", b"Transfer-Encoding: chunked\r\n")):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + head
                          + b"\r\n")
                block = b"x" * (1 << 20)
                frame = (b"%x\r\n" % len(block)) + block + b"\r\n" if name == "chunked" else block
                n = 0
                try:
                    for _ in range(1024):
                        s.sendall(frame)
                        n += len(block)
                except OSError:  # the proxy answered and closed: the rest was never taken
                    pass
                s.settimeout(10)
                try:
                    answer = s.recv(4096)
                except OSError:
                    answer = b""
                sent[name] = n
                assert answer.startswith(b"HTTP/1.1 413") or answer == b"", answer[:200]
        time.sleep(0.5)
        peak, after = _kb(proc.pid, "VmHWM"), _kb(proc.pid, "VmRSS")
    finally:
        proc.kill()
        proc.wait()
    grew_mb = (peak - before) / 1024
    assert grew_mb < 3 * 32, (before, peak, after)  # the 32 MB limit, and aiohttp's own buffers
    print(f"\n[figure] 1 GB upload against the proxy (max_body_mb 32): RSS {before / 1024:.0f} MB before, "
          f"peak {peak / 1024:.0f} MB, {after / 1024:.0f} MB after; the proxy took "
          f"{sent['declared'] / 2**20:.0f} MB (declared) and {sent['chunked'] / 2**20:.0f} MB (chunked) "
          f"before closing", flush=True)
