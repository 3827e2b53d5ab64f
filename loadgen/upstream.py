"""A fast synthetic OpenAI-style streaming server: the soak client's test and benchmark peer.

Not a mock of vLLM (the real-vLLM tests use the guarded tiny model); it exists to measure the
client itself at request rates no model reaches, and to produce every error category on demand.
It counts each X-Request-Id it receives (`GET /stats`), the accounting a resumed soak is checked
against. With `--faults`, request seq (the X-Request-Id's last `-N`) picks a failure:
seq % 10 == 3 -> HTTP 500, 5 -> stream cut without [DONE], 7 -> connection dropped mid-stream,
9 -> 503 with Retry-After (as the guard answers while no backend serves).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time

from aiohttp import web


def make_app(chunks: int, chunk_delay_s: float, ttft_s: float, faults: bool) -> web.Application:
    seen: collections.Counter[str] = collections.Counter()
    state = {"posts": 0}

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "synthetic", "max_model_len": 4096}]})

    async def stats(_: web.Request) -> web.Response:
        return web.json_response({"posts": state["posts"], "ids": dict(seen)})

    async def completions(request: web.Request) -> web.StreamResponse:
        state["posts"] += 1
        rid = request.headers.get("X-Request-Id", "")
        seen[rid] += 1
        body = await request.json()
        n = int(body.get("max_tokens") or chunks)
        tail = rid.rsplit("-", 1)[-1]
        mode = int(tail) % 10 if faults and tail.isdigit() else -1
        if mode == 3:
            return web.json_response({"error": {"message": "synthetic failure"}}, status=500)
        if mode == 9:
            return web.json_response({"error": {"message": "no backend", "type": "vllm_guard"}}, status=503,
                                     headers={"Retry-After": "1"})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Request-Id": rid})
        await resp.prepare(request)
        if ttft_s:
            await asyncio.sleep(ttft_s)
        for i in range(n):
            if mode in (5, 7) and i == n // 2:
                if mode == 7 and request.transport is not None:
                    request.transport.close()
                    return resp
                await resp.write_eof()
                return resp
            ev = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": "synthetic",
                  "choices": [{"index": 0, "text": " x", "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
            if chunk_delay_s:
                await asyncio.sleep(chunk_delay_s)
        usage = {"choices": [], "usage": {"prompt_tokens": len(body.get("prompt") or []), "completion_tokens": n,
                                          "total_tokens": n}}
        await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/stats", stats)
    app.router.add_post("/v1/completions", completions)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--chunk-delay", type=float, default=0.0)
    p.add_argument("--ttft", type=float, default=0.0)
    p.add_argument("--faults", action="store_true")
    a = p.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(make_app(a.chunks, a.chunk_delay, a.ttft, a.faults), host="127.0.0.1", port=a.port,
                access_log=None, print=None, backlog=4096)


if __name__ == "__main__":
    main()
