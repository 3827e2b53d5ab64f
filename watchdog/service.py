"""What the watchdog asks the service: the runtime's status (admin socket), vLLM's /metrics,
and its own 1-token probe. Each is a plain async call with a timeout; the loop isolates them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from vllm_guard.runtime import admin

WANTED = {
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_preemptions": "preemptions",
    "vllm:request_success": "request_success",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:prompt_tokens": "prompt_tokens",
}

_PREFIXES = tuple(WANTED)


def parse_metrics(text: str) -> dict[str, float]:
    """The vLLM series the watchdog uses, summed over labels (finished_reason, model...).
    Only their lines reach the parser: vLLM's page is mostly histograms we do not read."""
    keep = "\n".join(ln for ln in text.splitlines() if ln.startswith(_PREFIXES)
                     or (ln.startswith("# ") and any(p in ln for p in WANTED)))
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(keep + "\n"):
        key = WANTED.get(fam.name)
        if key is None:
            continue
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


async def status(state_dir: str | Path, timeout: float) -> dict[str, Any]:
    return await admin.request(state_dir, "GET", "/status", timeout=timeout)


async def metrics(session: aiohttp.ClientSession, url: str, timeout: float) -> dict[str, float]:
    async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        r.raise_for_status()
        return parse_metrics(await r.text())


async def probe(session: aiohttp.ClientSession, url: str, timeout: float) -> dict[str, Any]:
    """A real 1-token completion (vLLM's /health says 200 while the engine is hung)."""
    t0 = time.monotonic()
    try:
        async with session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            model = (await r.json())["data"][0]["id"]
        body = {"model": model, "prompt": "ping", "max_tokens": 1, "temperature": 0}
        async with session.post(url + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            await r.read()
            ok, err = r.status == 200, "" if r.status == 200 else f"HTTP {r.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, ValueError) as e:
        ok, err = False, f"{type(e).__name__}: {e}"
    return {"ok": ok, "error": err or None, "latency_s": round(time.monotonic() - t0, 3)}
