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
from vllm_guard.runtime.frontdoor.proxy import Proxy
from vllm_guard.runtime.frontdoor.target import Target

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
            for i in range(self.chunks):  # the last chunk has vLLM's finish_reason
                fin = "length" if i == self.chunks - 1 else None
                await resp.write(f"data: {json.dumps({'choices': [{'text': str(i), 'finish_reason': fin}]})}\n\n".encode())
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


def no_tokenizer_config(tmp_path: Path, **server: Any) -> ServerConfig:
    """A proxy whose streams are not resumable: its model directory has no tokenizer. Without a
    model the proxy reads the embedded model's cache directory (~/.cache/vllm-guard), whose
    tokenizer exists once `make demo` ran; the path a stream takes must not depend on that."""
    model = tmp_path / "model-without-tokenizer"
    model.mkdir(exist_ok=True)
    server.setdefault("model", str(model))
    return ServerConfig(port=free_port(), **server)


def run(tmp_path: Path, scenario: Callable[[Rig], Awaitable[None]], **server: Any) -> None:
    async def main() -> None:
        up = Upstream(tmp_path / "up.sock")
        await up.start()
        cfg = no_tokenizer_config(tmp_path, **server)
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
                        assert body["error"]["code"] == "not_served" and set(body["error"]) == {"message", "type", "param", "code"}
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
        # admitted once for its client (one request in flight allowed): the retry is not admitted
        # again, and the request is one failure of the service
        from vllm_guard.core.protocol import FailReason
        c = rig.proxy.counters
        assert (c.requests_total, c.failed_requests, c.rejected) == (1, 1, 0), c
        assert c.failed_by == {FailReason.BACKEND_ERROR: 1} and rig.proxy.admission.clients == {}

    run(tmp_path, scenario, max_client_requests=1, migration_limit=1)  # one move: two attempts


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


def test_a_stalled_event_loop_does_not_cut_a_client_that_sent_its_headers_in_time(tmp_path: Path) -> None:
    """The runtime's loop stops for longer than the header timeout right after a client sent its
    whole request (a starved box: the loop not scheduled for 13.7 s was seen under a CPU hog).
    When the loop runs again its header timer is late and fires before the loop has read the
    request (uvloop runs timers before it polls): the client is answered, not cut."""
    async def scenario(rig: Rig) -> None:
        await rig.target()
        r, w = await asyncio.open_connection("127.0.0.1", rig.proxy.cfg.port)
        await asyncio.sleep(0.2)  # the guard has the connection, and its header timer runs
        w.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        time.sleep(2.5)  # the loop (the guard's and this client's) does not run: 2.5 x the header timeout
        answer = await asyncio.wait_for(r.read(), 10)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        assert rig.proxy.gate.header_timeouts == 0
        w.close()

    run(tmp_path, scenario, header_timeout=1)


def test_a_loop_that_runs_again_just_after_the_header_timeout_does_not_cut_a_request_it_has_not_read(
        tmp_path: Path) -> None:
    """The loop stalls for about the header timeout right after a client connected and sent its
    whole request, and runs again a moment (under LATE_S) after the timer was due. The timer
    fires before the loop polls: the request is in the socket, unread. Seen in CI: a 10.35 s
    stall (10.05 s starved) ending 0.35 s after a connection's 10 s timer was due, and the client
    of an overlap recycle got "Server disconnected without sending a response"."""
    async def scenario(rig: Rig) -> None:
        await rig.target()
        r, w = await asyncio.open_connection("127.0.0.1", rig.proxy.cfg.port)
        await asyncio.sleep(0.3)  # the guard has the connection: its 2 s header timer runs
        w.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        time.sleep(1.8)  # the loop runs again ~0.1 s after the timer was due
        answer = await asyncio.wait_for(r.read(), 10)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        assert rig.proxy.gate.header_timeouts == 0
        w.close()

    run(tmp_path, scenario, header_timeout=2)


def test_a_slowloris_whose_bytes_wait_unread_at_its_timeout_is_still_closed(tmp_path: Path) -> None:
    """The grace given to bytes waiting unread is one look, not a way to stay: a client that
    never completes its header block is closed once the loop has read what it sent."""
    async def scenario(rig: Rig) -> None:
        await rig.target()
        r, w = await asyncio.open_connection("127.0.0.1", rig.proxy.cfg.port)
        await asyncio.sleep(0.3)
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.8)  # the loop stalls; the timer is due during the stall (late under LATE_S)
        w.write(b"X-a: b\r\n")
        await w.drain()
        t0 = time.monotonic()
        assert await asyncio.wait_for(r.read(), 10) == b""  # closed
        assert time.monotonic() - t0 < 1 + 3
        assert rig.proxy.gate.header_timeouts == 1
        w.close()

    run(tmp_path, scenario, header_timeout=1)


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
from vllm_guard.runtime.frontdoor.proxy import Proxy
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


def test_every_request_ends_in_exactly_one_record(tmp_path: Path) -> None:
    """Each request the proxy receives gives its listeners one `RequestDone`: answered, refused by
    the route or the body limit, refused by vLLM, or left by its client."""
    from vllm_guard.runtime.frontdoor.done import Outcome, RequestDone

    async def scenario(rig: Rig) -> None:
        seen: list[RequestDone] = []
        rig.proxy.listeners.append(seen.append)
        await rig.target(generation=7)
        async with aiohttp.ClientSession() as s:
            async with s.post(rig.url + "/v1/completions", json=completion()) as r:
                assert r.status == 200
                await r.read()
            async with s.post(rig.url + "/nonexistent", json={}) as r:
                assert r.status == 404
            async with s.post(rig.url + "/v1/completions", data=b"x" * 2_000_000) as r:
                assert r.status == 413
            rig.upstream.mode = "bad"
            async with s.post(rig.url + "/v1/completions", json=completion(stream=False)) as r:
                assert r.status == 400
            rig.upstream.mode, rig.upstream.delay = "stream", 0.5
            async with s.post(rig.url + "/v1/completions", json=completion()) as r:
                await r.content.readany()  # the first chunk, then the client leaves
        end = time.monotonic() + 10
        while len(seen) < 5 and time.monotonic() < end:
            await asyncio.sleep(0.05)
        assert [d.outcome for d in seen] == [Outcome.COMPLETED, Outcome.REJECTED, Outcome.REJECTED,
                                             Outcome.REJECTED, Outcome.CLIENT_DISCONNECTED], seen
        ok = seen[0]
        assert ok.counted and ok.stream and ok.generation == 7 and ok.status == 200
        assert ok.chunks >= 20 and ok.ttft_s is not None and ok.e2e_s >= ok.ttft_s and ok.max_gap_s is not None
        assert not seen[1].counted and seen[1].status == 404
        assert seen[2].status == 413 and seen[3].status == 400 and "400" in seen[3].reason
        assert len({d.request_id for d in seen}) == 5

    run(tmp_path, scenario, max_body_mb=1.0)


# -- admission: what one request and one client may ask for ------------------------------------------
async def post(s: aiohttp.ClientSession, url: str, body: Any, path: str = "/v1/completions",
               headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any], aiohttp.ClientResponse]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with s.post(url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}) as r:
        return r.status, await r.json(content_type=None), r


def test_admission_bounds_a_request_and_a_client_once_with_one_error_each(tmp_path: Path) -> None:
    """n, max_tokens and the tokens a request asks for are bounded before it is queued or sent
    (400, nothing reaches the backend); a client (its API key when it is one of vLLM's, else its
    address: an invented key is the address) is bounded in requests and tokens in flight (429 with
    Retry-After); every refusal is one JSON error in OpenAI's shape, rejected with its reason."""
    from vllm_guard.core.protocol import RejectReason as R

    async def scenario(rig: Rig) -> None:
        await rig.target()
        url = rig.url
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            refusals = [
                ({"prompt": "x", "n": 5, "max_tokens": 8}, "/v1/completions", R.N_TOO_LARGE, "n"),
                ({"prompt": "x", "n": "5", "max_tokens": 8}, "/v1/completions", R.N_TOO_LARGE, "n"),  # vLLM reads "5" as 5
                ({"prompt": "x", "best_of": 9}, "/v1/completions", R.N_TOO_LARGE, "best_of"),
                ({"prompt": "x", "n": 2, "max_tokens": 600}, "/v1/completions", R.REQUEST_TOKENS_TOO_LARGE, "max_tokens"),
                ({"prompt": ["a", "b", "c"], "max_tokens": 400}, "/v1/completions", R.REQUEST_TOKENS_TOO_LARGE,
                 "max_tokens"),  # a batch of prompts: each is a sequence
                ({"messages": [], "n": 2}, "/v1/chat/completions", R.REQUEST_TOKENS_TOO_LARGE, "max_tokens"),  # 2 x 512
                ({"messages": [], "max_completion_tokens": 700, "max_tokens": 100}, "/v1/chat/completions",
                 R.MAX_TOKENS_TOO_LARGE, "max_tokens"),  # max_completion_tokens wins, as in vLLM
                ({"prompt": "x", "max_tokens": "many"}, "/v1/completions", R.BAD_REQUEST, "max_tokens"),
                (b'{"prompt": "x", "n": 2', "/v1/completions", R.BAD_REQUEST, None),
                (b'[1, 2]', "/v1/chat/completions", R.BAD_REQUEST, None),
            ]
            for body, path, reason, param in refusals:
                status, err, r = await post(s, url, body, path)
                assert status == 400 and err["error"]["code"] == reason.value, (body, status, err)
                assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["param"] == param
                assert err["error"]["type"] == "invalid_request_error" and "Retry-After" not in r.headers
            assert rig.upstream.hits["/v1/completions"] == 0 and rig.upstream.hits["/v1/chat/completions"] == 0
            rig.upstream.mode, rig.upstream.delay = "slow", 0.0
            for body, path in (({"prompt": "x", "n": 4, "max_tokens": 250}, "/v1/completions"),  # 1000: at the bound
                               ({"messages": []}, "/v1/chat/completions"),  # one sequence of the context
                               ({"prompt": "x"}, "/v1/completions")):  # vLLM's default: 16 tokens
                assert (await post(s, url, {**body, "stream": False}, path))[0] == 200, body
            # in flight per client: two slow requests from this address, a third is refused
            rig.upstream.mode, rig.upstream.delay = "slow", 30.0
            held = [asyncio.create_task(post(s, url, completion(stream=False, tokens=300))) for _ in range(2)]
            while rig.proxy.in_flight < 2:
                await asyncio.sleep(0.01)
            status, err, r = await post(s, url, completion(stream=False))
            assert status == 429 and err["error"]["code"] == R.CLIENT_REQUESTS.value, err
            assert err["error"]["type"] == "rate_limit_error" and r.headers["Retry-After"] == "10"
            status, err, _ = await post(s, url, completion(stream=False), headers={"Authorization": "Bearer invented"})
            assert status == 429, "an invented key made a new client"
            # one of vLLM's keys is a client of its own: its tokens in flight are bounded
            key = {"Authorization": "Bearer k2"}
            held.append(asyncio.create_task(post(s, url, completion(stream=False, tokens=600), headers=key)))
            while rig.proxy.in_flight < 3:
                await asyncio.sleep(0.01)
            status, err, _ = await post(s, url, completion(stream=False, tokens=500), headers=key)
            assert status == 429 and err["error"]["code"] == R.CLIENT_TOKENS.value, err
            assert len(rig.proxy.admission.clients) == 2
            for t in held:
                t.cancel()
            await asyncio.gather(*held, return_exceptions=True)
        end = time.monotonic() + 10
        while (rig.proxy.in_flight or rig.proxy.admission.clients) and time.monotonic() < end:
            await asyncio.sleep(0.05)
        assert rig.proxy.admission.clients == {}, "what ended was not given back"
        c = rig.proxy.counters
        assert c.rejected_by == {R.N_TOO_LARGE: 3, R.REQUEST_TOKENS_TOO_LARGE: 3, R.MAX_TOKENS_TOO_LARGE: 1,
                                 R.BAD_REQUEST: 3, R.CLIENT_REQUESTS: 2, R.CLIENT_TOKENS: 1}, c.rejected_by
        assert (c.completed, c.failed_requests, c.client_disconnects) == (3, 0, 3), c
        assert c.completed + c.rejected + c.failed_requests + c.client_disconnects == c.requests_total == 19
        assert c.not_forwarded == 13

    run(tmp_path, scenario, max_n=4, max_tokens=600, max_request_tokens=1000, max_client_requests=2,
        max_client_tokens=1000, vllm_args=["--max-model-len", "512", "--api-key", "k1", "k2"])


# -- the counters --------------------------------------------------------------------------------------
def test_outcome_counters_mean_what_they_say_under_a_mix_of_attacks(tmp_path: Path) -> None:
    """Client errors (the guard's 413/408/400/429, vLLM's 4xx) and held 503s are rejected, each
    with its reason; failed stays 0 until the service fails one (a stall past queue_max_wait);
    every counted request is in exactly one of completed / rejected / failed / client_disconnects."""
    from vllm_guard.core.protocol import FailReason, RejectReason as R

    async def scenario(rig: Rig) -> None:
        p = rig.proxy
        await rig.target()
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        assert (await raw(rig.url, head + b"Content-Length: 40000000\r\n\r\n")).startswith(b"HTTP/1.1 413")
        assert (await raw(rig.url, head + b"Content-Length: 100\r\n\r\n", b"{", read_timeout=10)).startswith(
            b"HTTP/1.1 408")
        async with aiohttp.ClientSession() as s:
            assert (await post(s, rig.url, b"{not json"))[0] == 400
            assert (await post(s, rig.url, {"prompt": "x", "n": 99}))[0] == 400
            async with s.post(rig.url + "/v1/completions", json=completion()) as r:
                assert r.status == 200 and b"[DONE]" in await r.read()
            rig.upstream.mode = "bad"
            assert (await post(s, rig.url, completion(stream=False)))[0] == 400  # vLLM's own 400
            rig.upstream.mode, rig.upstream.delay = "stream", 0.5
            async with s.post(rig.url + "/v1/completions", json=completion()) as r:
                await r.content.readany()  # the first chunk, then the client leaves
            async with s.get(rig.url + "/v1/models") as r:  # not an engine request: not counted
                assert r.status == 200
            await p.set_reject("held: maintenance")
            status, err, r = await post(s, rig.url, completion())
            assert status == 503 and err["error"]["code"] == R.UNAVAILABLE.value and "Retry-After" in r.headers
            await p.set_reject(None)
            await p.set_target(None)  # no backend: the queue's wait runs out, the service failed it
            status, err, _ = await post(s, rig.url, completion())
            assert status == 503 and err["error"]["code"] == FailReason.QUEUE_TIMEOUT.value, err
        end = time.monotonic() + 10
        while p.in_flight + p.queued and time.monotonic() < end:
            await asyncio.sleep(0.05)
        c = p.counters
        assert c.rejected_by == {R.BODY_TOO_LARGE: 1, R.BODY_STALLED: 1, R.BAD_REQUEST: 1, R.N_TOO_LARGE: 1,
                                 R.VLLM_REFUSED: 1, R.UNAVAILABLE: 1}, c.rejected_by
        assert c.failed_by == {FailReason.QUEUE_TIMEOUT: 1} and c.failed_requests == 1, c
        assert (c.completed, c.rejected, c.client_disconnects) == (1, 6, 1), c
        assert c.completed + c.rejected + c.failed_requests + c.client_disconnects == c.requests_total == 9
        assert c.not_forwarded == 4  # 413, 408, the bad JSON and n: never past the front door
        if rig.current is not None:
            await rig.current.close()

    run(tmp_path, scenario, idle_timeout=1, queue_max_wait=1)


# -- half-closed clients ---------------------------------------------------------------------------
def test_a_half_closed_client_is_one_log_line_and_a_count_never_a_traceback(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Clients that send a request and shut their side (`shutdown(SHUT_WR)`), before or after the
    whole body, or reset mid-body: each is one `client_disconnected` event and one count
    (`connections_lost`, and a client disconnect), and aiohttp logs no "Error handling request"
    with a traceback (it did, once per client)."""
    import logging

    import structlog

    def half_close(port: int, body: bytes, send: int, reset: bool) -> None:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body))
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            c.sendall(head + body[:send])
            if reset:  # RST instead of FIN
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            else:
                c.shutdown(socket.SHUT_WR)
                try:
                    c.recv(65536)
                except OSError:
                    pass

    async def scenario(rig: Rig) -> None:
        rig.upstream.mode, rig.upstream.delay = "slow", 0.5
        await rig.target()
        body = json.dumps(completion(stream=False)).encode()
        cases = [(len(body), False), (len(body) // 2, False), (len(body) // 2, True), (0, False)] * 3
        with structlog.testing.capture_logs() as events:
            for send, reset in cases:
                await asyncio.to_thread(half_close, rig.proxy.cfg.port, body, send, reset)
            end = time.monotonic() + 10
            while rig.proxy.counters.connections_lost < len(cases) and time.monotonic() < end:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
        gone = [e for e in events if e["event"] == "client_disconnected"]
        assert len(gone) == len(cases), events
        c = rig.proxy.counters
        assert c.connections_lost == c.client_disconnects == c.requests_total == len(cases), c
        assert rig.proxy.in_flight == 0 and rig.proxy.body_bytes == 0
        tracebacks = [r for r in caplog.records if r.exc_info or "Error handling request" in r.getMessage()]
        assert not tracebacks, [r.getMessage() for r in tracebacks]

    caplog.set_level(logging.DEBUG, logger="aiohttp")
    run(tmp_path, scenario)
