"""A simulated box for the replica's driver: generations that boot, park, crash and die on
command, with the real driver, the real `decide`, the real books on a real SQLite ledger, and
fakes only where a process or a socket would be (the backend's process, the proxy's routing,
the monitors). One `step()` is one second of the box's time and one look of each replica.

Used by tests/test_replica_driver.py: every strategy start to end, successors that die or are
late, crashes, commands, rolling replicas — in milliseconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import msgspec

from vllm_guard.core import plugin
from vllm_guard.core.config import GuardConfig
from vllm_guard.core.protocol import ChildProcess, GateReport
from vllm_guard.core.startcpus import start_cpus
from vllm_guard.runtime.child.backend import Backend
from vllm_guard.runtime.frontdoor.target import Target
from vllm_guard.runtime.records.books import RuntimeBooks
from vllm_guard.runtime.records.writer import RuntimeLedger
from vllm_guard.runtime.replica.driver import ReplicaDriver
from vllm_guard.runtime.replica.generation import Generation
from vllm_guard.runtime.replica.machine import State
from vllm_guard.runtime.replica.plan import ReplicaPlan
from vllm_guard.runtime.replica.strategy import MemoryFit, StartHistory
from vllm_guard.runtime.replica.view import Facts, Tick

GIB = 1024.0


class SimBackend(Backend):
    """A backend with no process: it exits when the world says, dies on SIGKILL at once and on
    SIGTERM after `term_s`; never signals a real pid."""

    def __init__(self, n: int, world: World) -> None:
        super().__init__(generation=n, model="m", host="127.0.0.1", port=1, vllm_args=[],
                         log_path=Path("/nonexistent/generation.log"))
        self.world = world
        self.rc: int | None = None
        self.log = ""  # its generation log, as the world writes it when it exits
        self.dead_at: float | None = None  # when its processes are gone
        self.signals: list[int] = []
        self.started_mono = world.now

    @property
    def returncode(self) -> int | None:  # type: ignore[override]
        return self.rc

    @property
    def pid(self) -> int:  # type: ignore[override]
        return 4_000_000 + self.generation  # above pid_max: never a real process

    async def children(self) -> list[ChildProcess]:
        return []

    def signal_all(self, sig: int) -> None:
        self.signals.append(sig)
        when = self.world.now + (0.0 if sig == signal.SIGKILL else self.world.term_s)
        self.dead_at = when if self.dead_at is None else min(self.dead_at, when)

    async def alive_pids(self) -> list[int]:
        return [] if self.gone_now() else [self.pid]

    def gone_now(self) -> bool:
        return self.rc is not None and self.dead_at is None or (self.dead_at is not None and self.world.now >= self.dead_at)

    async def kill_for_good(self, timeout: float = 10.0) -> None:
        self.dead_at = self.world.now

    def log_text(self) -> str:
        return self.log

    def gone(self) -> None:
        pass


@dataclass
class Plan:
    """How a generation of the simulated box behaves."""

    ready_s: float = 5.0  # spawn -> ready (beside a serving one: `beside_ready_s`)
    beside_ready_s: float | None = None
    park_s: float = 3.0  # a gated one parks this long after spawn
    after_gate_s: float = 2.0  # ... and is ready this long after its gate opened
    exit_at_s: float | None = None  # it exits (code 1) this long after spawn
    log: str = "RuntimeError: simulated\n"  # ... with this in its log
    gate: str = "parked"  # parked | skipped


@dataclass
class SimGen:
    gen: Generation
    plan: Plan
    spawned: float
    opened: float | None = None  # when its gate opened


def tweak(cfg: GuardConfig, section: str, **values: Any) -> GuardConfig:
    """`cfg` with keys of one section replaced, unchecked and not marked explicit (a test's
    arrangement, as a value: the configuration is frozen)."""
    return dataclasses.replace(cfg, **{section: msgspec.structs.replace(getattr(cfg, section), **values)})


class World:
    def __init__(self, tmp: Path, cfg: GuardConfig | None = None, replicas: int = 1) -> None:
        self.tmp = tmp
        self.now = 1000.0
        self.term_s = 2.0
        self.cfg = tweak(cfg or GuardConfig(), "server", state_dir=str(tmp))
        self.ledger = RuntimeLedger(tmp)
        self.books = RuntimeBooks(self.ledger, self.cfg.server.failure_window, clock=self.clock)
        self.plans: list[Plan] = []  # consumed in spawn order; default Plan() when empty
        self.gens: list[SimGen] = []
        self.number = 0
        self.shutting_down = False
        self.hold: str | None = None
        self.gave_up = 0
        self.start_failed: list[str] = []  # the lines of `start_failure`
        self.exit_code: int | None = None
        self.learned_gate: str | None = None
        self.unpaced: list[int] = []  # generations told to stop pacing, in order
        self.unpinned: list[tuple[int, str, bool]] = []  # (generation, why, its gate open then) as given all CPUs
        self.starts: dict[int, StartHistory] = {}
        self.standby_failures: dict[int, int] = {}
        self.routes: dict[int, Target] = {}  # generation -> target routed to
        self.handed_over: list[int] = []  # generations whose streams went on at the next one
        self.past_limit: set[int] = set()
        self.leaving: set[int] = set()
        self.queued = 0
        self.enforce_limit = True  # the proxy's: a generation stops at its count limit (not while held)
        self.rejecting: str | None = None  # the proxy fails requests fast with this reason
        self.fit = MemoryFit(host_available_mb=20 * GIB, host_footprint_mb=3 * GIB, parked_mb=1.5 * GIB)
        self.reading_after_s = 0.0  # a serving generation's first memory reading comes this long after ready
        self.nvml = False
        self.kv_holder = False  # the replica has a holder on a GPU: generations may map its KV cache
        self.kv_mb = 6 * GIB
        self.spawned: list[tuple[int, bool, str]] = []  # (generation, late, kv) as launched
        self.has_room = True
        self.room_watched: list[float] = []  # when a GPU-room watch started ...
        self.room_unwatched: list[float] = []  # ... and stopped
        self.visits: list[tuple[int, State]] = []  # (replica, state) in the order entered
        self.drivers = [ReplicaDriver(ReplicaPlan(i), self, self, self.books, self, self,
                                      request_timeout=60.0, clock=self.clock) for i in range(replicas)]
        self.ready_sent = False
        self.live: list[int] = []  # generations in the order they went live (Spawner.went_live)

    def clock(self) -> float:
        return self.now

    # -- Spawner -----------------------------------------------------------------------------
    async def spawn(self, replica: int, strategy: str | None, gated: bool, beside: bool,
                    standby: bool = False, late: bool = False, kv: str = "held") -> Generation:
        self.number += 1
        n = self.number
        b = SimBackend(n, self)
        row = self.ledger.generation_started(n, b.pid, None, "m", replica, strategy)
        held = self.kv_holder  # as launch.Launcher: only with a holder on a GPU
        gen = Generation(n, b, Target(generation=n, url="http://127.0.0.1:1", limit=self._limit()), row,
                         replica=replica, strategy=strategy, gate=self.tmp / f"gate-{n}" if gated else None,
                         spawned_mono=self.now, beside=beside, standby=standby, kv=kv if held else "",
                         late=late and gated and held)
        gen.paced = plugin.pace_wanted(self.cfg, beside, gated, gen.late)
        if beside:  # as launch.Launcher, on a box of 16 CPUs with a GPU
            b.cpus = start_cpus(self.cfg.server.start_cpus, range(16), True, self.cfg.server.vllm_args).cpus
        if held and kv == "held" and not gated:
            gen.kv_mb = self.kv_mb  # as its engine reports once its KV cache is mapped
        self.spawned.append((n, gen.late, gen.kv))
        self.gens.append(SimGen(gen, self.plans.pop(0) if self.plans else Plan(), self.now))
        return gen

    async def went_live(self, gen: Generation) -> None:
        self.live.append(gen.number)

    async def unpace(self, gen: Generation) -> None:
        self.unpaced.append(gen.number)

    async def unpin(self, gen: Generation, why: str) -> None:
        if gen.backend.cpus:
            gen.backend.cpus = ()
            self.unpinned.append((gen.number, why, gen.gate_open))

    def holder_status(self, replica: int) -> None:
        return None

    def _limit(self) -> int | None:
        return self.cfg.recycle.max_requests or None

    # -- Door --------------------------------------------------------------------------------
    async def add_target(self, target: Target, replica: int = 0) -> None:
        self.routes[target.generation] = target

    async def stop_dispatch(self, target: Target, dead: bool = False, hand_over: bool = False) -> None:
        self.routes.pop(target.generation, None)
        if hand_over:
            self.handed_over.append(target.generation)

    async def allow_past_limit(self, target: Target, allowed: bool = True) -> None:
        (self.past_limit.add if allowed else self.past_limit.discard)(target.generation)

    def set_leaving(self, target: Target, leaving: bool) -> None:
        (self.leaving.add if leaving else self.leaving.discard)(target.generation)

    def queue_mark(self) -> int:
        return self.queued

    async def set_reject(self, reason: str | None) -> None:
        self.rejecting = reason

    # -- Watchers ----------------------------------------------------------------------------
    def booting(self, gen: Generation) -> None:
        pass

    def serving(self, gen: Generation) -> None:
        if not self.reading_after_s:
            gen.note_memory(gen.memory, gen.growth, self.fit, gen.to_limit_s, gen.gpu_mb_s)  # type: ignore[arg-type]

    def stopping(self, gen: Generation) -> None:
        pass

    def room(self, replica: int, note: Callable[[bool], None]) -> Callable[[], None]:
        self._room_note = note
        self.room_watched.append(self.now)

        def off() -> None:
            self.room_unwatched.append(self.now)

        return off

    # -- Hub ---------------------------------------------------------------------------------
    def give_up(self) -> None:
        self.gave_up += 1
        self.shutting_down = True

    def start_failure(self, line: str) -> None:
        self.start_failed.append(line)
        self.shutting_down = True

    def exit_all(self, code: int) -> None:
        self.exit_code, self.shutting_down = code, True

    def reap_later(self, pids: list[int]) -> None:
        pass

    def learn_gate(self, reason: str) -> None:
        self.learned_gate = reason

    def learn_standby(self, replica: int, failed: bool) -> None:
        self.standby_failures[replica] = self.standby_failures.get(replica, 0) + 1 if failed else 0

    def learn_start(self, replica: int, beside: bool, seconds: float) -> None:
        from dataclasses import replace

        h = self.starts.get(replica, StartHistory())
        self.starts[replica] = replace(h, beside_s=seconds) if beside else replace(h, alone_s=seconds)

    def ready(self) -> None:
        self.ready_sent = True

    def extend(self) -> None:
        pass

    def state_changed(self) -> None:
        for d in self.drivers:
            mine = [st for i, st in self.visits if i == d.index]
            if not mine or mine[-1] is not d.state:
                self.visits.append((d.index, d.state))

    # -- the box -----------------------------------------------------------------------------
    def facts(self, d: ReplicaDriver) -> Facts:
        return Facts(cfg=self.cfg, index=d.index, peers=tuple(x.machine for x in self.drivers),
                     stopping=self.shutting_down, hold=self.hold, failures_in_window=self.books.in_window(self.now),
                     gate_unavailable=self.learned_gate,
                     starts=self.starts.get(d.index, StartHistory()), gpu_room=d.gpu_room, nvml=self.nvml,
                     standby_failures=self.standby_failures.get(d.index, 0), gpu_mb_s=d.gpu_mb_s,
                     ready_sent=self.ready_sent)

    def _world(self) -> None:
        """What the box does in a second: starts progress, processes die, gates park and open."""

        for s in self.gens:
            g, b, age = s.gen, s.gen.backend, self.now - s.spawned
            assert isinstance(b, SimBackend)
            if s.plan.exit_at_s is not None and age >= s.plan.exit_at_s and b.rc is None:
                b.rc, b.log = 1, s.plan.log
            if b.dead_at is not None and self.now >= b.dead_at and b.rc is None:
                b.rc = -9
            if g.stop_mark is not None:
                g.note_stop([] if b.gone_now() else [b.pid], gpu_free=True)
            if g.ready_mono is not None and g.fit is None and self.reading_after_s \
                    and self.now - g.ready_mono >= self.reading_after_s:
                g.note_memory(g.memory, g.growth, self.fit, g.to_limit_s, g.gpu_mb_s)  # type: ignore[arg-type]
            if b.rc is not None or g.ready_mono is not None:
                continue
            if g.gate is None:
                ready_s = s.plan.beside_ready_s if g.beside and s.plan.beside_ready_s is not None else s.plan.ready_s
                if age >= ready_s:
                    g.note_ready(self.now)
            elif g.gate_report is None and age >= s.plan.park_s and s.plan.gate == "parked" \
                    and plugin.gate_is_open(g.gate):
                s.opened = self.now  # opened before it got there: it says `opened` at once and goes on
                g.note_gate(GateReport(state="opened", pid=b.pid, at="now"))
            elif g.gate_report is None and age >= s.plan.park_s:
                if g.late and g.kv == "held":
                    g.kv_mb = self.kv_mb  # it mapped the held KV cache and captured its graphs first
                g.note_gate(GateReport(state=s.plan.gate, pid=b.pid, at="now",
                                       reason="simulated: cannot park" if s.plan.gate == "skipped" else ""))
            elif s.opened is None and g.gate_report is not None and plugin.gate_is_open(g.gate):
                s.opened = self.now
                if g.kv and not g.late:
                    g.kv = plugin.gate_kv(g.gate) or g.kv  # it allocates after the gate, as told there
                if g.kv == "held":
                    g.kv_mb = self.kv_mb
                g.note_gate(GateReport(state="opened", pid=b.pid, at="now"))
            elif s.opened is not None and self.now - s.opened >= s.plan.after_gate_s:
                g.note_ready(self.now)
        if hasattr(self, "_room_note"):
            self._room_note(self.has_room)

    async def step(self, seconds: float = 1.0) -> None:
        self.now += seconds
        self._world()
        for d in self.drivers:
            await d.handle(Tick(), lambda d=d: self.facts(d))  # type: ignore[misc]

    async def run_until(self, pred: Callable[[], bool], limit_s: float = 600.0) -> float:
        """Step until `pred()`; returns the simulated seconds it took."""
        t0 = self.now
        while not pred():
            if self.now - t0 > limit_s:
                raise AssertionError(f"not reached in {limit_s} simulated s; states "
                                     f"{[d.state.value for d in self.drivers]}, visits {self.visits[-12:]}")
            await self.step()
        return self.now - t0

    async def command(self, event: Any, replica: int = 0) -> Any:
        d = self.drivers[replica]
        return await d.handle(event, lambda: self.facts(d))

    def states(self, replica: int = 0) -> list[State]:
        return [s for i, s in self.visits if i == replica]

    def gen(self, number: int) -> Generation:
        return next(s.gen for s in self.gens if s.gen.number == number)

    async def close(self) -> None:
        for s in self.gens:
            await s.gen.target.close()
        self.ledger.close()


def run(tmp: Path, scenario: Callable[[World], Any], cfg: GuardConfig | None = None, replicas: int = 1) -> World:
    world = World(tmp, cfg, replicas)

    async def main() -> None:
        try:
            await scenario(world)
        finally:
            await world.close()

    asyncio.run(main())
    return world

