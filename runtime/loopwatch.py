"""A witness of the supervisor's event loop: when it stops turning, say where it is stuck.

The loop that answers status and pings systemd's watchdog is the loop that supervises; a call
that blocks it (a slow /proc read, a lock) delays all of them at once. A task on the loop beats
every `STEP_S`; a beat that comes `REPORT_S` or more after the one before logs
`event_loop_resumed` with the stall's bounds (`began`, `ended`: epoch seconds of the two beats)
and its length split by what the loop thread did meanwhile: `cpu_s` it ran (its own code,
without letting the loop turn; the thread's own CPU clock), `asleep_s` it waited in a call or for
a lock (not runnable, as a witness thread saw it in /proc/self/task/TID/stat), `starved_s` the
rest: runnable but not scheduled, a loaded box. The first two are defects of the runtime, the
third is the box's. The loop itself logs the stall, so one is never missed because the witness
thread was starved along with it. The witness thread logs `event_loop_blocked` once per stall of
`BLOCKED_S` with the loop thread's stack at that moment. Stalls under `BLOCKED_S` are logged at
info level, longer ones as warnings.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback

import structlog

log = structlog.get_logger("vllm_guard.supervisor")

STEP_S = 0.1
REPORT_S = 0.5
BLOCKED_S = 1.0
FRAMES = 12


class LoopWatch:
    def __init__(self, blocked_s: float = BLOCKED_S, report_s: float = REPORT_S) -> None:
        self.blocked_s = blocked_s
        self.report_s = min(report_s, blocked_s)
        self.stamp = time.monotonic()
        self.stalls = 0  # stalls of blocked_s or more (each logged with its stack)
        self._asleep = 0.0  # seconds the witness saw the loop thread waiting since the last beat
        self._loop_thread = threading.get_ident()
        self._native = threading.get_native_id()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="loop-watch", daemon=True)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._loop_thread, self._native = threading.get_ident(), threading.get_native_id()
        self._task = asyncio.get_running_loop().create_task(self._beat())
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()

    async def _beat(self) -> None:
        cpu0 = time.thread_time()
        self.stamp = time.monotonic()
        while True:
            await asyncio.sleep(STEP_S)
            now, cpu = time.monotonic(), time.thread_time()
            took = now - self.stamp
            if took >= self.report_s + STEP_S:
                self._resumed(took, min(took, cpu - cpu0), now)
            self._asleep = 0.0
            self.stamp, cpu0 = now, cpu

    def _resumed(self, took: float, cpu: float, now: float) -> None:
        slept = min(took - cpu, self._asleep)
        wall = time.time() - now
        (log.warning if took >= self.blocked_s else log.info)(
            "event_loop_resumed", seconds=round(took, 2), cpu_s=round(cpu, 2), asleep_s=round(slept, 2),
            starved_s=round(max(0.0, took - cpu - slept), 2), began=round(self.stamp + wall, 3),
            ended=round(now + wall, 3))

    def _thread_state(self) -> str | None:
        """The loop thread's scheduler state: R runnable, S/D waiting."""
        try:
            raw = open(f"/proc/self/task/{self._native}/stat").read()
        except OSError:
            return None
        return raw[raw.rindex(")") + 2:].split()[0]

    def _watch(self) -> None:
        """Each tick while the loop has not beaten for a step: is its thread waiting? Once it has
        not beaten for `blocked_s`, log where it is, once per stall."""
        told = None  # the stamp of the stall last told
        while not self._stop.wait(STEP_S):
            stamp = self.stamp
            age = time.monotonic() - stamp
            if age < 2 * STEP_S:
                continue
            if self._thread_state() in ("S", "D"):
                self._asleep += STEP_S
            if age >= self.blocked_s and told != stamp:
                told = stamp
                self.stalls += 1
                frame = sys._current_frames().get(self._loop_thread)
                stack = traceback.format_stack(frame, limit=FRAMES) if frame is not None else []
                log.warning("event_loop_blocked", seconds=round(age, 2), thread_state=self._thread_state(),
                            stack="".join(stack).rstrip())
