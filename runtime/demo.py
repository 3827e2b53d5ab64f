"""`vllm-guard demo`: the product in a few minutes on the embedded tiny model.

Serves the tiny model under the guard, drives concurrent streaming load through the proxy while
the guard recycles on `max_requests`, forces one more graceful recycle through the admin socket
mid-load, streams on until three generations have served, and prints the runtime's status. Every
stream is checked: none may fail.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

from vllm_guard.core import admin
from vllm_guard.core.errors import GuardError
from vllm_guard.core.progress import ProgressLine
from vllm_guard.core.protocol import Command, CommandRequest, RuntimeState, StatusSnapshot
from vllm_guard.core.stream import stream_completion

from .child.backend import free_port
from .status.fmt import format_status

MAX_TOKENS = 16
LOAD_CAP_S = 600.0  # the load stops after this long even if fewer than three generations served
RECYCLES = 2  # what the demo shows: the `max_requests` recycle and the forced one, both under load
PROGRESS_LOG_S = 5.0  # stdout not a terminal: one progress line per this many seconds
RECYCLE_RETRY_S = 2.0  # a refused forced recycle is asked again after this long


async def _force_recycle(state_dir: Path, out: ProgressLine, timeout: float = 600.0) -> None:
    """The operator's graceful recycle. While one is already under way (the `max_requests` one)
    the runtime refuses it and says why: try again until it is taken."""
    req = CommandRequest(command=Command.RECYCLE, reason="demo: forced by operator")
    end, told = time.monotonic() + timeout, False
    while True:
        try:
            await admin.send(state_dir, req)
        except admin.CommandRefused as e:
            if time.monotonic() > end:
                raise
            if not told:
                told = True
                out.note(f"  -> forced recycle refused for now ({e.reply.detail}): trying again")
            await asyncio.sleep(RECYCLE_RETRY_S)
            continue
        out.note("  -> forced a graceful recycle through the admin socket")
        return


async def _load(url: str, model: str, total: int, concurrency: int, state_dir: Path,
                out: ProgressLine | None = None) -> dict[str, Any]:
    """`concurrency` clients stream back to back: at least `total` streams, and on until three
    generations have served (the `max_requests` recycle and the forced one both done under
    load), for at most `LOAD_CAP_S` seconds. Progress goes to `out` (default: stdout, one
    rewritten line on a terminal, a line per `PROGRESS_LOG_S` elsewhere)."""
    line = out if out is not None else ProgressLine(sys.stdout, interval_s=PROGRESS_LOG_S)
    per_gen: dict[str, int] = {}
    failed = done = 0
    forced: list[asyncio.Task[None]] = []
    body = {"model": model, "prompt": "hello world", "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}

    end = time.monotonic() + LOAD_CAP_S

    def enough() -> bool:
        return time.monotonic() > end or (done >= total and len(per_gen) >= 3)

    async with aiohttp.ClientSession() as session:
        async def client() -> None:
            nonlocal failed, done
            while not enough():
                res, _ = await stream_completion(session, url, body, uuid.uuid4().hex, 600.0)
                done += 1
                gen = str(res.generation) if res.generation is not None else "?"
                per_gen[gen] = per_gen.get(gen, 0) + 1
                # complete: [DONE] came and usage says max_tokens (vLLM may merge deltas under load)
                failed += not (res.error is None and res.output_tokens == MAX_TOKENS)
                line.update(f"  streamed {done}  failed {failed}  generations {sorted(per_gen)}")
                if done >= total // 2 and not forced:
                    forced.append(asyncio.create_task(_force_recycle(state_dir, line)))

        try:
            await asyncio.gather(*(client() for _ in range(concurrency)))
            await asyncio.gather(*forced)
        finally:  # an error, too, starts on a line of its own
            line.close()
    return {"per_generation": per_gen, "failed": failed, "streams": done}


def run_demo(state_dir: str | None, port: int | None, total: int) -> int:
    own_state = state_dir is None
    sd = Path(state_dir or tempfile.mkdtemp(prefix="vllm-guard-demo-"))
    port = port or free_port()
    env = {**os.environ}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    log_path = sd / "guard.log"
    sd.mkdir(parents=True, exist_ok=True)
    # The demo's limit is tiny so that it recycles within a minute; the old generation serves past
    # it until its successor is ready (its memory is not urgent). `auto` on a small CPU box soon
    # measures that the busy serving generation starves a start beside it, and then prefers the
    # parked standby (a gap of the start after its gate, ~15 s here): the demo overlaps, as a GPU
    # box with room would.
    conf = sd / "demo.toml"
    conf.write_text('[server]\nrecycle_strategy = "overlap"\n')
    cmd = [sys.executable, "-m", "vllm_guard.cli", "serve", "--config", str(conf), "--port", str(port),
           "--state-dir", str(sd),
           "--max-requests", str(max(total // 3, 4)), "--max-requests-jitter", "2",
           "--", "--enforce-eager", "--max-model-len", "512"]
    print(f"vllm-guard demo: serving the embedded tiny model (random weights: its text is noise)\n"
          f"  state dir {sd}, proxy http://127.0.0.1:{port}, runtime log {log_path}", flush=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        status = _wait_serving(proc, sd, 600)
        print(f"  generation {status.generation} ready (vLLM {status.vllm_version}); children "
              + ", ".join(f"{c.role.value}={c.pid}" for c in status.children), flush=True)
        t0 = time.monotonic()
        model = status.served_model or status.model
        result = asyncio.run(_load(f"http://127.0.0.1:{port}", model, total, 4, sd))
        status = _wait_serving(proc, sd, 600)
        print(f"  {result['streams']} streams in {time.monotonic() - t0:.0f}s, failed: {result['failed']}, "
              f"served per generation: {json.dumps(result['per_generation'], sort_keys=True)}\n")
        print(format_status(status))
        ok, line = verdict(result["failed"], status)
        print(f"\n{line}", flush=True)
        return 0 if ok else 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
        if own_state and proc.returncode == 0:
            shutil.rmtree(sd, ignore_errors=True)


def verdict(failed: int, status: StatusSnapshot) -> tuple[bool, str]:
    """Whether the demo kept the product's promise, and the line that says so: no stream failed
    (at the client or the proxy), at least `RECYCLES` recycles done under load, and none of them
    left the replica without a serving generation (a cold one always does)."""
    done = [r for r in status.recent_recycles if r.duration_s is not None]
    gaps = [r for r in done if r.downtime_s is None or r.downtime_s > 0.0]
    problems = []
    if failed or status.requests.failed:
        problems.append(f"{failed or status.requests.failed} streams failed")
    if len(done) < RECYCLES:
        problems.append(f"{len(done)} of {RECYCLES} recycles done")
    problems += [f"the {r.reason} recycle of generation {r.generation} ({r.strategy}) left "
                 f"{r.downtime_s if r.downtime_s is not None else '?'} s without a serving generation" for r in gaps]
    if problems:
        return False, "demo: FAILED: " + "; ".join(problems)
    return True, (f"demo: ok: {len(done)} recycles under load ({', '.join(r.reason for r in done)}), "
                  "0 s without a serving generation, 0 failed")


def serve_error(log_path: Path) -> str:
    """The last line `vllm-guard serve` printed as its error ("vllm-guard: error: ..."), without
    that prefix; '' when it printed none."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    mark = "vllm-guard: error: "
    return next((ln[len(mark):] for ln in reversed(lines) if ln.startswith(mark)), "")


def _wait_serving(proc: subprocess.Popen[bytes], sd: Path, timeout: float) -> StatusSnapshot:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            why = serve_error(sd / "guard.log")
            raise GuardError(f"vllm-guard serve exited with {proc.returncode}" + (f": {why}" if why else "")
                             + f"; see {sd / 'guard.log'}")
        try:
            st = asyncio.run(admin.fetch_status(sd))
            if st.state is RuntimeState.SERVING:
                return st
        except admin.AdminError:
            pass
        time.sleep(1)
    raise GuardError(f"not serving after {timeout:.0f}s; see {sd / 'guard.log'}")
