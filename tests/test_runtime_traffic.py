"""The runtime writes what it measures: every request its proxy ends (per-minute histograms for
the ledger's life, one row per request for the retention) with the tokens of vLLM's usage
record, and its processes' memory, through the ledger's writer thread; then `vllm-guard report`
answers from those rows alone. Unit tests on the real proxy and the real writer (a synthetic
upstream that answers as vLLM does), then one real vLLM."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from aiohttp import web

from conftest import GUARD_CMD
from test_faults_proxy import Upstream, completion, no_tokenizer_config
from vllm_guard.core.vllm_api import unix_url
from vllm_guard.runtime.frontdoor.proxy import Proxy, Target
from vllm_guard.core import ledger as L
from vllm_guard.core.latency import Histogram
from vllm_guard.core.protocol import MemoryReading, ProcessMemory, Role
from vllm_guard.core.timefmt import iso_from_epoch
from vllm_guard.runtime.frontdoor.done import Outcome, RequestDone, usage_of
from vllm_guard.runtime.records.traffic import TrafficRecorder
from vllm_guard.runtime.records.writer import RuntimeLedger

USAGE = {"prompt_tokens": 5, "total_tokens": 13, "completion_tokens": 8, "prompt_tokens_details": None}


def test_usage_of_reads_the_last_usage_record_of_a_tail() -> None:
    chunk = json.dumps({"id": "cmpl-1", "object": "text_completion", "choices": [], "usage": USAGE})
    assert usage_of(f"data: {chunk}\n\ndata: [DONE]\n\n".encode()) == (5, 8)
    body = json.dumps({"id": "c", "choices": [{"text": "x"}], "usage": {**USAGE, "completion_tokens": 3},
                       "kv_transfer_params": None}).encode()
    assert usage_of(body) == (5, 3)
    older = json.dumps({"usage": {"prompt_tokens": 5, "completion_tokens": 1}})  # continuous usage stats
    assert usage_of(f"data: {older}\n\ndata: {chunk}\n\n".encode()) == (5, 8)
    assert usage_of(b'data: {"usage":null}\n\n') == (None, None) and usage_of(b"data: [DONE]") == (None, None)


def _done(t: float, ttft: float, outcome: Outcome = Outcome.COMPLETED, replica: int = 0, tokens: int | None = 16,
          counted: bool = True) -> RequestDone:
    return RequestDone(request_id=f"r{t}", counted=counted, outcome=outcome, status=200, reason="", arrived=t,
                       e2e_s=ttft + 0.2, ttft_s=ttft, generation=1, replica=replica, chunks=11, max_gap_s=0.05,
                       stream=True, prompt_tokens=32, completion_tokens=tokens)


def test_recorder_writes_minutes_and_rows_and_keeps_them_for_their_time(tmp_path: Path) -> None:
    """Minutes by the minute a request ended, per replica; uncounted requests (health, models)
    are not the service's latency; rows past the retention and old memory rows go."""
    db = tmp_path / "l.sqlite"
    led = RuntimeLedger(db)
    t0 = 1_800_000_000.0  # a minute boundary
    rec = TrafficRecorder(led, retention_s=3600.0, clock=lambda: t0 + 7200)
    for i in range(120):  # 2 minutes, one request every second, replica 0
        rec.record(_done(t0 + i, 0.05 + 0.001 * (i % 10)))
    rec.record(_done(t0 + 10, 0.5, Outcome.FAILED, tokens=None))
    rec.record(_done(t0 + 11, 0.5, Outcome.REJECTED, tokens=None))
    rec.record(_done(t0 + 12, 0.5, replica=1))
    rec.record(_done(t0 + 13, 0.5, counted=False))
    for k in range(3):
        rec.memory(1, 0, MemoryReading(at=iso_from_epoch(t0 + 5 * k), requests=k, rss_mb=1.0, uss_mb=None, gpu_mb=None, per_process=[
            ProcessMemory(pid=9, role=Role.ENGINE_CORE, rss_mb=700.0 + k, uss_mb=600.0, swap_mb=0.0)]),
            host_available_mb=9000.0)
    rec.flush(everything=True)
    assert led.close(30.0)
    conn = L.open_readonly(db)
    minutes = conn.execute("SELECT minute, replica, requests, completed, failed, rejected, prompt_tokens, "
                           "completion_tokens, usage_known, ttft FROM edge_minutes ORDER BY minute, replica").fetchall()
    assert [(m[0] - t0, m[1]) for m in minutes] == [(0, 0), (0, 1), (60, 0)]
    m0 = minutes[0]
    assert (m0[2], m0[3], m0[4], m0[5]) == (62, 60, 1, 1) and m0[7] == 16 * 60 and m0[8] == 60
    assert Histogram.from_json(m0[9]).n == 60 and Histogram.from_json(m0[9]).quantile(0.5) == pytest.approx(0.0545, rel=0.02)
    assert conn.execute("SELECT COUNT(*) FROM edge_requests").fetchone()[0] == 123  # counted requests only
    row = conn.execute("SELECT outcome, prompt_tokens, completion_tokens, itl_mean_s, itl_max_s FROM edge_requests "
                       "ORDER BY id LIMIT 1").fetchone()
    assert tuple(row[:3]) == ("completed", 32, 16) and row[3] == pytest.approx(0.02) and row[4] == 0.05
    assert tuple(conn.execute("SELECT COUNT(*), MIN(host_available_mb) > 0 FROM process_memory").fetchone()) == (3, 1)
    conn.close()
    led = RuntimeLedger(db)  # two hours later: the rows are past the retention, memory is thinned
    TrafficRecorder(led, retention_s=3600.0).maintain(t0 + 7200)
    assert led.close(30.0)
    conn = L.open_readonly(db)
    assert conn.execute("SELECT COUNT(*) FROM edge_requests").fetchone()[0] == 0
    assert conn.execute("SELECT COUNT(*) FROM edge_minutes").fetchone()[0] == 3  # kept for the ledger's life
    assert conn.execute("SELECT COUNT(*) FROM process_memory").fetchone()[0] == 1  # one per minute past the hour
    conn.close()


class UsageUpstream(Upstream):
    """Answers as vLLM does: a JSON body with its usage, or a stream whose last chunk before
    [DONE] is the usage record when the client asked for it."""

    async def handler(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"id": "c", "choices": [{"text": "x"}], "usage": USAGE,
                                      "kv_transfer_params": None})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(8):
            fin = "length" if i == 7 else None
            await resp.write(f"data: {json.dumps({'choices': [{'text': str(i), 'finish_reason': fin}], 'usage': None})}\n\n".encode())
        if body.get("stream_options", {}).get("include_usage"):
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': USAGE})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def test_the_proxy_counts_tokens_from_vllms_usage_record(tmp_path: Path) -> None:
    """A streamed answer whose last chunk is the usage record, a JSON answer with its usage, and
    a stream without one: the record has the tokens, or None."""
    seen: list[RequestDone] = []

    async def main() -> None:
        up = UsageUpstream(tmp_path / "up.sock")
        await up.start()
        cfg = no_tokenizer_config(tmp_path)
        proxy = Proxy(cfg, on_limit=lambda t: None, on_error=lambda t: None)
        proxy.listeners.append(seen.append)
        await proxy.start()
        t = Target(generation=1, url=unix_url(str(up.sock)))
        t.open(60.0)
        await proxy.set_target(t)
        try:
            async with aiohttp.ClientSession() as s:
                for body in ({**completion(), "stream_options": {"include_usage": True}}, completion(stream=False),
                             completion()):
                    async with s.post(f"http://127.0.0.1:{cfg.port}/v1/completions", json=body) as r:
                        assert r.status == 200
                        await r.read()
            end = time.monotonic() + 10
            while len(seen) < 3 and time.monotonic() < end:
                await asyncio.sleep(0.05)
        finally:
            await t.close()
            await proxy.stop()
            await up.stop()

    asyncio.run(main())
    assert [(d.prompt_tokens, d.completion_tokens) for d in seen] == [(5, 8), (5, 8), (None, None)], seen


# -- on real vLLM -------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_served_box_answers_from_its_own_rows(guard_factory: Any, tmp_path: Path) -> None:
    """The README's `serve`, clients that are not the soak (streamed with and without usage,
    non-streamed), a SIGTERM: the ledger has a row per request with vLLM's own token counts
    (a stream without a usage record is counted from the token ids the proxy asks vLLM for),
    the minutes, the processes' memory and the warm-up; the report's traffic, SLA and leaks
    come from them."""
    g = guard_factory(args=["--max-requests", "0"])
    g.wait_serving()
    model = g.status()["model"]
    n = 24
    # request id -> (prompt tokens, completion tokens) as the client saw them; None: not known exactly
    seen: dict[str, tuple[int, int] | None] = {}
    limits: dict[str, int] = {}

    async def clients() -> None:
        async with aiohttp.ClientSession() as s:
            for i in range(n):
                rid = f"traffic-{i}-{tmp_path.name}"
                body: dict[str, Any] = {"model": model, "prompt": f"hello {i}", "max_tokens": 6 + i % 5,
                                        "stream": i % 3 != 2}
                if i % 3 == 0:
                    body["stream_options"] = {"include_usage": True}
                if i % 6 == 1:
                    body["return_token_ids"] = True  # the client counts its own tokens
                limits[rid] = body["max_tokens"]
                async with s.post(g.url + "/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
                    assert r.status == 200 and r.headers["X-Request-Id"] == rid
                    text = await r.text()
                    if not body["stream"]:
                        u = json.loads(text)["usage"]
                        seen[rid] = (u["prompt_tokens"], u["completion_tokens"])
                        continue
                    chunks = [json.loads(x[6:]) for x in text.split("\n\n") if x.startswith("data: {")]
                    usage = [c["usage"] for c in chunks if c.get("usage")]
                    if i % 3 == 0:
                        seen[rid] = (usage[-1]["prompt_tokens"], usage[-1]["completion_tokens"])
                        continue
                    assert not usage, chunks  # the guard's own usage request never reaches the client
                    if i % 6 == 1:
                        ids = [t for c in chunks for ch in c["choices"] for t in (ch.get("token_ids") or [])]
                        prompt = next(ch["prompt_token_ids"] for c in chunks for ch in c["choices"]
                                      if ch.get("prompt_token_ids"))
                        seen[rid] = (len(prompt), len(ids))
                    else:
                        seen[rid] = None

    asyncio.run(clients())
    time.sleep(6)  # one more memory reading
    assert g.stop() == 0
    conn = sqlite3.connect(g.state_dir / "ledger.sqlite")
    rows = conn.execute("SELECT request_id, outcome, stream, prompt_tokens, completion_tokens, ttft_s, e2e_s "
                        "FROM edge_requests ORDER BY arrived").fetchall()
    mine = {r[0]: r for r in rows if r[0] in seen}
    assert set(mine) == set(seen), rows
    for rid, r in mine.items():
        assert r[1] == "completed" and r[5] is not None and r[6] >= r[5], r
        want = seen[rid]
        if want is not None:
            assert (r[3], r[4]) == want, (rid, r, want)
        else:  # a plain stream: vLLM's tokens as the proxy counted them, within the client's limit
            assert r[3] is not None and r[3] > 0 and 1 <= r[4] <= limits[rid], r
    total = conn.execute("SELECT SUM(requests), SUM(completion_tokens), SUM(usage_known) FROM edge_minutes").fetchone()
    assert total[0] == len(rows), (total, rows)
    assert total[1] == sum(r[4] for r in rows if r[4] is not None) and total[2] == sum(r[4] is not None and r[1] == "completed" for r in rows)
    roles = {r[0] for r in conn.execute("SELECT DISTINCT role FROM process_memory")}
    assert {"api_server", "engine_core"} <= roles, roles
    assert conn.execute("SELECT value FROM meta WHERE key = 'runtime.memory_warmup_requests'").fetchone()[0] == "100"
    conn.close()
    out = subprocess.run([*GUARD_CMD, "report", "--db", str(g.state_dir), "--format", "json"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    f = json.loads(out.stdout)
    assert f["traffic"]["source"] == "runtime" and f["traffic"]["requests"] == len(rows)
    assert f["sla"]["source"] == "runtime" and f["sla"]["run_tier"] is not None
    assert f["leak"]["source"] == "runtime" and f["soak"]["present"] is False
    assert f["traffic"]["output_tokens"] == total[1] and f["traffic"]["ttft_s"]["p50"] > 0
