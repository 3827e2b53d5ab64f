"""A start beside a serving generation runs on a few CPUs and gets them all back (`core.startcpus`).

The rule is pure; the launch and the give-back run real processes with real threads: the
runtime's launcher sets the affinity before it execs, every thread and process the child starts
inherits it, and `Backend.unpin` moves every thread of the tree back.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from vllm_guard.core import config
from vllm_guard.core.errors import ConfigError
from vllm_guard.core.startcpus import start_cpus
from vllm_guard.runtime.child.backend import Backend

SIXTEEN = list(range(16))


def test_auto_gives_a_start_on_a_gpu_box_the_last_quarter() -> None:
    rule = start_cpus("auto", SIXTEEN, gpu=True, vllm_args=[])
    assert rule.cpus == (12, 13, 14, 15) and "4 of the runtime's 16" in rule.why


def test_auto_is_off_on_vllm_cpu_on_a_small_box_and_where_vllm_binds_its_own() -> None:
    assert start_cpus("auto", SIXTEEN, gpu=False, vllm_args=[]).cpus == ()
    assert "binds its engine's threads" in start_cpus("auto", SIXTEEN, gpu=False, vllm_args=[]).why
    assert start_cpus("auto", list(range(7)), gpu=True, vllm_args=[]).cpus == ()
    assert start_cpus("auto", [3, 5, 9, 11, 20, 21, 22, 23], gpu=True, vllm_args=[]).cpus == (22, 23)
    for args in (["--numa-bind"], ["--numa-bind-nodes", "0"], ["--numa-bind-cpus=0-7"]):
        rule = start_cpus(4, SIXTEEN, gpu=True, vllm_args=args)
        assert rule.cpus == () and "--numa-bind" in rule.why, args


def test_a_number_is_taken_as_given_anywhere_and_off_is_off() -> None:
    assert start_cpus(3, SIXTEEN, gpu=False, vllm_args=[]).cpus == (13, 14, 15)
    assert start_cpus(1, [0, 1], gpu=False, vllm_args=[]).cpus == (1,)
    assert start_cpus(16, SIXTEEN, gpu=True, vllm_args=[]).cpus == ()  # all of them: nothing to pin
    assert start_cpus("off", SIXTEEN, gpu=True, vllm_args=[]).cpus == ()


def test_the_setting_is_auto_off_or_a_whole_number(tmp_path: Path) -> None:
    f = tmp_path / "guard.toml"
    f.write_text("[server]\nstart_cpus = 6\n")
    assert config.load(f).server.start_cpus == 6
    assert config.load(None).server.start_cpus == "off"  # measured no better on an H100: opt-in
    for bad, words in (('"some"', "one of auto, off or a whole number"), ("0", "must be >= 1")):
        f.write_text(f"[server]\nstart_cpus = {bad}\n")
        with pytest.raises(ConfigError, match=words):
            config.load(f)


# A child that starts two threads and a grandchild with a thread of its own, then says its pids.
CHILD = """
import os, subprocess, sys, threading, time
grand = subprocess.Popen([sys.executable, "-c",
    "import threading, time; threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); time.sleep(60)"])
for _ in range(2):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
open(sys.argv[1], "w").write(f"{os.getpid()} {grand.pid}")
time.sleep(60)
"""


class PayloadBackend(Backend):
    """The real launcher and process handling, with a small Python child in vLLM's place."""

    def command(self) -> list[str]:
        return [sys.executable, "-c", CHILD, str(self.log_path.parent / "pids")]


def affinities(pid: int) -> dict[int, set[int]]:
    return {int(t): os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin to one")
def test_the_launch_pins_the_whole_tree_and_unpin_gives_every_thread_all_cpus_back(tmp_path: Path) -> None:
    mine = sorted(os.sched_getaffinity(0))
    last = mine[-1:]

    async def scenario() -> None:
        b = PayloadBackend(generation=1, model="m", host="127.0.0.1", port=1, vllm_args=[],
                           log_path=tmp_path / "logs" / "generation-1.log", cpus=tuple(last))
        await b.start()
        try:
            pids = tmp_path / "logs" / "pids"
            end = time.monotonic() + 60
            while not (pids.exists() and pids.read_text().count(" ") == 1) and time.monotonic() < end:
                await asyncio.sleep(0.05)
            api, grand = map(int, pids.read_text().split())
            await asyncio.sleep(0.5)  # the grandchild's thread
            assert api == b.pid  # the launcher exec'd into the command
            tree = {**affinities(api), **affinities(grand)}
            assert len(tree) >= 5 and set(map(frozenset, tree.values())) == {frozenset(last)}, tree
            moved = await b.unpin(mine)
            assert moved == len(tree) and b.cpus == ()
            tree = {**affinities(api), **affinities(grand)}
            assert set(map(frozenset, tree.values())) == {frozenset(mine)}, tree
            assert await b.unpin(mine) == 0  # once
        finally:
            await b.kill_for_good()

    asyncio.run(scenario())
