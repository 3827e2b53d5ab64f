"""Readiness and liveness on the public port, against the real proxy on a real socket (the
synthetic upstream of test_faults_proxy.py stands in for vLLM: what is tested is the proxy's own
answer, which never reaches the backend).

Readiness is what a load balancer polls: 503 while no generation takes a new request now (none
yet, all draining, held, shutting down) and while every generation that takes requests is about
to stop (`leaving`); with several replicas, 200 while any one takes requests. Liveness is 200
while the supervisor loop beats."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from test_faults_proxy import Rig, completion, run
from vllm_guard.core.vllm_api import unix_url
from vllm_guard.runtime.frontdoor import routes
from vllm_guard.runtime.frontdoor.done import Outcome, RequestDone
from vllm_guard.runtime.frontdoor.proxy import LIVENESS_STALE_S
from vllm_guard.runtime.frontdoor.target import Target

READY, LIVE = routes.READY_PATH, routes.LIVE_PATH


async def get(s: aiohttp.ClientSession, url: str, method: str = "GET") -> tuple[int, dict[str, Any]]:
    async with s.request(method, url) as r:
        body = await r.read()
        return r.status, ({} if method == "HEAD" else json.loads(body))


def test_readiness_follows_what_can_take_a_request_now(tmp_path: Path) -> None:
    async def scenario(rig: Rig) -> None:
        seen: list[RequestDone] = []
        rig.proxy.listeners.append(seen.append)
        async with aiohttp.ClientSession() as s:
            status, body = await get(s, rig.url + READY)
            assert status == 503 and not body["ready"] and "no generation" in body["reason"], body
            assert (await get(s, rig.url + READY, "HEAD"))[0] == 503
            one = await rig.target(generation=1)
            status, body = await get(s, rig.url + READY)
            assert status == 200 and body["ready"], body
            assert (await get(s, rig.url + READY, "HEAD"))[0] == 200

            # about to stop: unready, but it still answers what the balancer sends meanwhile
            rig.proxy.set_leaving(one)
            status, body = await get(s, rig.url + READY)
            assert status == 503 and "stops soon" in body["reason"], body
            async with s.post(rig.url + "/v1/completions", json=completion()) as r:
                assert r.status == 200 and r.headers["X-Vllm-Guard-Generation"] == "1"
                await r.read()

            # another replica that stays: ready, and it takes the new requests
            two = Target(generation=2, url=unix_url(str(rig.upstream.sock)))
            two.open(60.0)
            await rig.proxy.add_target(two, replica=1)
            assert (await get(s, rig.url + READY))[0] == 200
            for _ in range(4):
                async with s.post(rig.url + "/v1/completions", json=completion()) as r:
                    assert r.headers["X-Vllm-Guard-Generation"] == "2"
                    await r.read()
            await rig.proxy.stop_dispatch(two)
            await two.close()
            assert (await get(s, rig.url + READY))[0] == 503
            rig.proxy.set_leaving(one, False)
            assert (await get(s, rig.url + READY))[0] == 200

            # a drain: the generation stops taking requests, so the box is unready at once
            await rig.proxy.stop_dispatch(one)
            status, body = await get(s, rig.url + READY)
            assert status == 503 and "no generation" in body["reason"]
            await rig.target(generation=3)
            assert (await get(s, rig.url + READY))[0] == 200

            # held or shutting down: the proxy refuses everything, so it is unready too
            await rig.proxy.set_reject("held: Xid 79")
            status, body = await get(s, rig.url + READY)
            assert status == 503 and body["reason"] == "held: Xid 79"
            await rig.proxy.set_reject(None)
            assert (await get(s, rig.url + READY))[0] == 200

            async with s.post(rig.url + READY, json={}) as r:
                assert r.status == 405
        # the guard answers them itself: never forwarded, never counted, one record each
        assert set(rig.upstream.hits) == {"/v1/completions"}, rig.upstream.hits
        assert rig.proxy.counters.requests_total == 5 and one.dispatched == 1 and two.dispatched == 4
        probes = [d for d in seen if not d.counted]
        assert len(probes) == 13 and all(d.generation is None for d in probes)
        assert {(d.outcome, d.status) for d in probes} == {(Outcome.COMPLETED, 200), (Outcome.REJECTED, 503),
                                                           (Outcome.REJECTED, 405)}

    run(tmp_path, scenario)


def test_liveness_is_the_supervisor_loops_beat(tmp_path: Path) -> None:
    async def scenario(rig: Rig) -> None:
        async with aiohttp.ClientSession() as s:
            status, body = await get(s, rig.url + LIVE)  # alive from the start, before any generation
            assert status == 200 and body["alive"] and body["stale_after_s"] == LIVENESS_STALE_S
            rig.proxy._beat -= LIVENESS_STALE_S + 1  # the loop has not turned for longer than the threshold
            status, body = await get(s, rig.url + LIVE)
            assert status == 503 and not body["alive"] and body["last_beat_s"] > LIVENESS_STALE_S, body
            assert (await get(s, rig.url + LIVE, "HEAD"))[0] == 503
            assert (await get(s, rig.url + READY))[0] == 503  # readiness is its own question
            rig.proxy.beat()
            status, body = await get(s, rig.url + LIVE)
            assert status == 200 and body["last_beat_s"] < LIVENESS_STALE_S
            await rig.proxy.set_reject("vllm-guard is shutting down")
            assert (await get(s, rig.url + LIVE))[0] == 200  # draining for a stop is alive, not ready
            assert (await get(s, rig.url + READY))[0] == 503
        assert not rig.upstream.hits

    run(tmp_path, scenario)


def test_probe_paths_are_the_guards_own_and_no_vllm_route() -> None:
    """Both paths classify as the guard's, with GET or HEAD only, and no route of the installed
    vLLM (its API server, its launchers) uses either, nor anything under /vllm-guard/."""
    import vllm

    for path in routes.PROBES:
        assert routes.classify("GET", path) is routes.Kind.PROBE
        assert routes.classify("HEAD", path + "/") is routes.Kind.PROBE
        with pytest.raises(routes.NotAllowed) as e:
            routes.classify("POST", path)
        assert e.value.status == 405
    assert not [p for p in routes.ROUTES if p.startswith("/vllm-guard")]
    decorated = re.compile(r"""\.(?:get|post|put|delete|api_route|add_api_route|route)\(\s*["'](/[^"']*)["']""")
    paths: set[str] = set()
    for f in Path(vllm.__file__).parent.joinpath("entrypoints").rglob("*.py"):
        paths |= set(decorated.findall(f.read_text(errors="replace")))
    assert "/health" in paths and "/v1/completions" in paths and "/readyz" in paths, sorted(paths)[:20]
    assert not [p for p in paths if p.startswith("/vllm-guard")], paths
