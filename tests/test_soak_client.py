"""The soak client over real sockets against the synthetic upstream: error categories, request
ids, latency from the scheduled send time, and kill -9 + --resume accounting per X-Request-Id."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import GUARD, free_port
from vllm_guard.loadgen.arrivals import Schedule


class Upstream:
    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "vllm_guard.loadgen.upstream", "--port", str(self.port), *args])
        end = time.monotonic() + 30
        while time.monotonic() < end:
            try:
                self.stats()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("synthetic upstream did not start")

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/stats", timeout=5) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def upstream_factory() -> Iterator[Any]:
    ups: list[Upstream] = []

    def make(*args: str) -> Upstream:
        ups.append(Upstream(*args))
        return ups[-1]

    yield make
    for u in ups:
        u.stop()


def wait_rows(db: Path, n: int, timeout: float = 60.0) -> None:
    """Until the soak has stored `n` results (it starts slowly on a busy box)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if db.exists() and rows(db, "SELECT COUNT(*) FROM requests")[0][0] >= n:
                return
        except sqlite3.OperationalError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"fewer than {n} results in {db} after {timeout} s")


def soak_cmd(url: str, db: Path, *extra: str) -> list[str]:
    return [GUARD, "soak", "--url", url, "--db", str(db), "--scenario", "custom", "--prompt-tokens", "16",
            "--no-progress", *extra]


def rows(db: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    with sqlite3.connect(db) as c:
        return c.execute(sql, args).fetchall()


def test_every_error_category_is_recorded_with_its_request_id(upstream_factory: Any, tmp_path: Path) -> None:
    up = upstream_factory("--faults", "--chunk-delay", "0.001")
    db = tmp_path / "l.sqlite"
    out = subprocess.run(soak_cmd(up.url, db, "--output-tokens", "8", "--rate", "100", "--requests", "100"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    cats = dict(rows(db, "SELECT COALESCE(error, 'ok'), COUNT(*) FROM requests GROUP BY 1"))
    assert cats == {"ok": 60, "http_500": 10, "truncated": 10, "disconnect": 10, "http_503_recycle": 10}
    assert summary["failed"] == 40 and summary["finished"] == 100
    ok = rows(db, "SELECT chunks, output_tokens, ttft_s, e2e_s FROM requests WHERE error IS NULL")
    assert all(c == 8 and t == 8 and 0 < a <= e for c, t, a, e in ok)
    seen = up.stats()["ids"]
    ids = [r[0] for r in rows(db, "SELECT request_id FROM requests")]
    assert sorted(seen) == sorted(ids) and set(seen.values()) == {1}


def test_latency_counts_from_the_scheduled_send_time(upstream_factory: Any, tmp_path: Path) -> None:
    """Concurrency 1 against a 50 ms server at 40 req/s: requests wait for the slot, and that wait
    shows in e2e_sched (no coordinated omission) while e2e (from the actual send) stays ~50 ms."""
    up = upstream_factory("--ttft", "0.05")
    db = tmp_path / "l.sqlite"
    out = subprocess.run(soak_cmd(up.url, db, "--output-tokens", "4", "--rate", "40", "--concurrency", "1",
                                  "--requests", "60"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = rows(db, "SELECT seq, scheduled_at, sent_at, e2e_s, e2e_sched_s, offset_s FROM requests ORDER BY seq")
    assert len(r) == 60
    for seq, sched, sent, e2e, e2e_sched, off in r:
        assert e2e_sched == pytest.approx(e2e + (sent - sched), abs=1e-6)
        assert 0.045 < e2e < 0.5
    waits = [sent - sched for _, sched, sent, *_ in r]
    assert waits[-1] > 1.0 > waits[0]  # 60 x 50 ms of work arrived in ~1.5 s
    offsets = [x[5] for x in r]
    expect = [t for _, t in zip(range(60), (t for _, t in Schedule(40.0, 1.0, 0).offsets()))]
    assert offsets == pytest.approx(expect)


def test_kill_9_and_resume_account_for_every_request_id(upstream_factory: Any, tmp_path: Path) -> None:
    up = upstream_factory("--chunks", "20", "--chunk-delay", "0.03")  # 0.6 s per request
    db = tmp_path / "l.sqlite"
    args = ("--output-tokens", "20", "--rate", "25", "--duration", "8s", "--seed", "11")
    db.touch()  # an empty file (as a reader's sqlite3.connect leaves it) is a new ledger, not a foreign one
    p = subprocess.Popen(soak_cmd(up.url, db, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_rows(db, 25)
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    before = len(rows(db, "SELECT 1 FROM requests"))
    assert before > 10
    out = subprocess.run([GUARD, "soak", "--resume", "--db", str(db), "--no-progress"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    expected = Schedule(25.0, 1.0, 11).count_within(8.0)
    got = rows(db, "SELECT seq, request_id, error, sent_at FROM requests ORDER BY seq")
    assert [g[0] for g in got] == list(range(expected))  # every index once, none twice
    seen = up.stats()
    assert set(seen["ids"].values()) == {1}  # no request id reached the server twice
    assert seen["posts"] == len(seen["ids"])
    done = {g[1] for g in got if g[2] is None}
    lost_ids = {g[1] for g in got if g[2] == "lost_in_flight"}
    # every result came from the server; a lost one was journaled just before its send, so the
    # server may or may not have seen it; nothing else reached the server
    assert done <= set(seen["ids"]) <= done | lost_ids
    lost = [g for g in got if g[2] == "lost_in_flight"]
    assert 0 < len(lost) <= 25  # the ones in flight at the kill (about rate x 0.6 s)
    assert all(g[2] in (None, "lost_in_flight") for g in got)
    assert rows(db, "SELECT status FROM runs") == [("done",)]
    assert [r[0] for r in rows(db, "SELECT first_seq FROM soak_segments ORDER BY segment")][0] == 0
    assert len(rows(db, "SELECT 1 FROM soak_segments")) == 2


def test_sigint_interrupts_and_resume_finishes(upstream_factory: Any, tmp_path: Path) -> None:
    up = upstream_factory()
    db = tmp_path / "l.sqlite"
    p = subprocess.Popen(soak_cmd(up.url, db, "--output-tokens", "4", "--rate", "20", "--duration", "4s"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_rows(db, 10)
    p.send_signal(signal.SIGINT)
    assert p.wait(30) == 130
    assert rows(db, "SELECT status FROM runs") == [("interrupted",)]
    out = subprocess.run([GUARD, "soak", "--resume", "--db", str(db), "--no-progress"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    n = Schedule(20.0, 1.0, 0).count_within(4.0)
    assert rows(db, "SELECT COUNT(*), COUNT(DISTINCT request_id), SUM(error IS NULL) FROM requests") == [(n, n, n)]
    assert up.stats()["posts"] == n


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    for args in (["soak", "--url", "http://127.0.0.1:1", "--db", str(tmp_path / "x")],
                 ["soak", "--resume", "--db", str(tmp_path / "none.sqlite")],
                 ["report", "--db", str(tmp_path / "none.sqlite")]):
        out = subprocess.run([GUARD, *args], capture_output=True, text=True, timeout=600)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, (args, out.stderr)


def test_unloadable_tokenizer_is_one_line_exit_2(upstream_factory: Any, tmp_path: Path) -> None:
    up = upstream_factory()
    out = subprocess.run(soak_cmd(up.url, tmp_path / "l.sqlite", "--output-tokens", "4", "--rate", "5", "--requests", "3",
                                  "--tokenizer", str(tmp_path / "no-such-model")),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--tokenizer" in out.stderr, out.stderr
    assert up.stats()["posts"] == 0


def test_soak_section_of_the_config_then_flags(upstream_factory: Any, tmp_path: Path) -> None:
    """[soak] of --config (core.config.SoakConfig) gives the defaults, flags win; the whole file
    is validated, so a typo in another section is one line, exit 2, before anything is sent."""
    up = upstream_factory()
    cfg = tmp_path / "guard.toml"
    cfg.write_text(f'[soak]\nurl = "{up.url}"\nscenario = "custom"\nprompt_tokens = 16\noutput_tokens = 4\n'
                   f'rate = 40\nseed = 3\nduration = "1s"\ndb = "{tmp_path / "c.sqlite"}"\n')
    out = subprocess.run([GUARD, "soak", "--config", str(cfg), "--no-progress", "--rate", "20"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    params = json.loads(rows(tmp_path / "c.sqlite", "SELECT params FROM runs")[0][0])
    assert (params["rate"], params["seed"], params["duration_s"], params["url"]) == (20.0, 3, 1.0, up.url)
    assert up.stats()["posts"] == Schedule(20.0, 1.0, 3).count_within(1.0)
    for text, says in (('[soak]\nrat = 5\n', "[soak] rat is not a known key"),
                       ('[soak]\nduration = "soon"\n', "[soak] duration has value 'soon'"),
                       ('[watchdog]\nintervall = "1s"\n', "[watchdog] intervall is not a known key")):
        cfg.write_text(text)
        out = subprocess.run([GUARD, "soak", "--config", str(cfg), "--url", up.url, "--db", str(tmp_path / "x.sqlite")],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and says in out.stderr, (text, out.stderr)
    out = subprocess.run([GUARD, "soak", "--url", up.url, "--db", str(tmp_path / "x.sqlite"), "--duration", "soon"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "duration has value 'soon'" in out.stderr
    assert up.stats()["posts"] == Schedule(20.0, 1.0, 3).count_within(1.0)  # nothing more was sent
