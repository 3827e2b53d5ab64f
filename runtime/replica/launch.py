"""Launching a generation: its environment, its backend process, its ledger row, its target.

The `Spawner` of `ports`: the driver asks for a generation of a replica, gated or not; this
gives each its number (numbers continue across runtimes), its log file, its startup gate
(`core.plugin.gate_dir`) and its count limit (`max_requests` + jitter).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Callable, Sequence

import structlog

from vllm_guard.core import plugin
from vllm_guard.core import holder as held
from vllm_guard.core import startcpus
from vllm_guard.core.config import GuardConfig, ServerConfig
from vllm_guard.core.protocol import HolderStatus

from ..child.adopted import AdoptedProcess
from ..child.backend import Backend, child_env, free_port
from ..child.handover import HandedGeneration, live_procs
from ..child.holder import HolderProcess
from ..frontdoor.target import Target
from .generation import Generation
from .plan import ReplicaPlan, holder_room
from .ports import Ledger
from .triggers import generation_limit

log = structlog.get_logger("vllm_guard.supervisor")

KEEP_LOGS = 20
PARK_SLACK_S = 120.0
SETTLE_EVERY_S = 0.5  # a pending drop asks the holder this often whether an engine still maps it
STANDBY_PARK_S = 30 * 86400.0  # a standby waits at its gate until it is needed (a month: then it is replaced)


def park_limit(s: ServerConfig) -> float:
    """How long a parked engine waits for its gate before it gives up and exits: the old
    generation's whole way out (drain, stop, memory release) plus slack."""
    return s.drain_timeout + s.stop_timeout + s.memory_release_timeout + PARK_SLACK_S


def prune_logs(logs: Path) -> None:
    """Keep the last KEEP_LOGS generation logs."""
    old = sorted(logs.glob("generation-*.log"), key=lambda p: p.stat().st_mtime)[:-KEEP_LOGS]
    for p in old:
        p.unlink(missing_ok=True)


class Launcher:
    def __init__(self, cfg: GuardConfig, model: str, python: str, state_dir: Path, ledger: Ledger,
                 plans: Sequence[ReplicaPlan], next_number: Callable[[], int], config_hash: str = "") -> None:
        self.cfg, self.model, self.python, self.state_dir, self.ledger = cfg, model, python, state_dir, ledger
        self.plans = {p.index: p for p in plans}
        self.next_number = next_number
        self.config_hash = config_hash
        self._changed: dict[int, tuple[str, ...]] = {}  # per replica: what a reload changed, until it spawns
        self.kept = False  # generations may outlive this runtime (a hand-over): no parent-death signal
        self.adoptable: dict[int, HandedGeneration] = {}  # per replica: what a previous runtime handed over
        self.adopt_mark: Path | None = None  # created once adopted: the previous runtime's keeper lets go
        self.gpu_box = False  # NVML sees a GPU: `[server] hold_weights = "auto"` holds on the GPU
        self.gpu_total_mb: float | None = None  # the smallest GPU's total (NVML)
        self._holder_off = ""  # why auto keeps no holder, once logged
        self.holders: dict[int, HolderProcess] = {}  # per replica: the weight holder (`core.holder`)
        self.pending_drop: dict[int, str] = {}  # per replica: why its copy goes once nothing maps it
        self._settle_tried: dict[int, float] = {}
        self.all_cpus = tuple(sorted(os.sched_getaffinity(0)))  # the runtime's own: a start gets them back
        self._cpus_said = ""  # the start CPU rule's last reason, once logged

    def configure(self, cfg: GuardConfig, model: str, config_hash: str, changed: Sequence[str]) -> None:
        """A reload's configuration: every generation launched from now on runs it; each replica's
        first one records the keys that changed."""
        self.cfg, self.model, self.config_hash = cfg, model, config_hash
        self._changed = {i: tuple(changed) for i in self.plans}

    def hand_over(self, kept: bool, adoptable: dict[int, HandedGeneration], mark: Path | None) -> None:
        """The hand-over's part here: whether generations may outlive this runtime (`kept`: no
        parent-death signal), and what a previous runtime handed over, adopted by each replica's
        first start (then `mark` releases the old keeper)."""
        self.kept, self.adoptable, self.adopt_mark = kept, dict(adoptable), mark

    def prestage(self, generation: int) -> str | None:
        """The model dir a parked generation reads its weights from before its gate
        (`[server] prestage_weights = "on"`), or None; says why when it is on but cannot apply."""
        if self.cfg.server.prestage_weights != "on":
            return None
        why = plugin.prestage_applies(self.cfg.server.vllm_args)
        if why is None and not Path(self.model).is_dir():
            why = f"the model {self.model!r} is not a local directory"
        if why is not None:
            log.info("prestage_skipped", generation=generation, why=why)
            return None
        return str(Path(self.model).resolve())

    def start_cpus(self) -> tuple[int, ...]:
        """The CPUs a start beside a serving generation runs on (`core.startcpus`); empty: all."""
        rule = startcpus.start_cpus(self.cfg.server.start_cpus, self.all_cpus, self.gpu_box,
                                    self.cfg.server.vllm_args)
        if rule.why != self._cpus_said:
            log.info("start_cpus", cpus=list(rule.cpus) or None, why=rule.why)
            self._cpus_said = rule.why
        return rule.cpus

    async def unpin(self, gen: Generation, why: str) -> None:
        moved = await gen.backend.unpin(self.all_cpus)
        if moved:
            log.info("generation_unpinned", generation=gen.number, replica=gen.replica, threads=moved, why=why)

    # -- the weight holder ------------------------------------------------------------------------
    def holder_device(self) -> str | None:
        """Where a replica's holder keeps the weights (`[server] hold_weights`), or None: no holder."""
        mode = self.cfg.server.hold_weights
        if mode == "off":
            return None
        if self.gpu_box and mode == "auto":
            why = holder_room(self.cfg.server.vllm_args, self.model, self.gpu_total_mb)
            if why is not None:
                if why != self._holder_off:
                    log.info("holder_off", why=why)
                    self._holder_off = why
                return None
        if self.gpu_box:
            return "cuda"
        return "cpu" if mode == "on" else None

    def kv_may_hold(self, replica: int) -> bool:
        """Whether a generation of `replica` may map a held KV cache (`[server] hold_kv_cache`):
        auto where its holder is on a GPU (on the host vLLM-CPU gains nothing from it), on with any."""
        mode, h = self.cfg.server.hold_kv_cache, self.holders.get(replica)
        if mode == "off" or h is None or h.device != self.holder_device():
            return False
        if plugin.kv_hold_applies(self.cfg.server.vllm_args) is not None:
            return False
        return mode == "on" or h.device == "cuda"

    async def holder_env(self, replica: int) -> dict[str, str]:
        """The holder's address for a new generation of `replica`, started if it is not running
        (without waiting: the engine looks for it only when it loads its weights)."""
        device = self.holder_device()
        h = self.holders.get(replica)
        if device is None:
            if h is not None:
                self.drop_holder(replica, "[server] hold_weights is off")
            return {}
        if h is None or h.device != device:
            if h is not None:
                await h.stop()
            env = {k: v for k, v in {**os.environ, **self.plans[replica].env()}.items()
                   if k != plugin.ALLOC_VAR}  # IPC export of expandable segments is not what torch shares
            h = self.holders[replica] = HolderProcess(replica, self.state_dir, self.python, env, device)
        if not h.alive:
            h.start()
        return h.child_env()

    def adopt_holder(self, replica: int, pid: int, key: str, device: str) -> None:
        """A previous runtime's holder (a hand-over): its adopted generation maps its memory."""
        env = {**os.environ, **self.plans[replica].env()}
        h = self.holders[replica] = HolderProcess(replica, self.state_dir, self.python, env, device)
        h.adopt(pid, key)

    async def claim_holders(self) -> None:
        """Tell each adopted holder this runtime is the one it follows (else it exits after its lease)."""
        for i, h in list(self.holders.items()):
            if await h.take_over(os.getpid()):
                log.info("holder_adopted", replica=i, pid=h.pid, bytes=h.last.bytes if h.last else None)
            else:
                log.warning("holder_not_adopted", replica=i, pid=h.pid, error=h.error)
                self.holders.pop(i, None)

    def drop_holder(self, replica: int | None, reason: str) -> None:
        """Drop the held copy of `replica` (None: every replica's) as soon as no live generation
        maps it (`settle_holders`); the next start then loads from disk and fills a fresh holder."""
        for i in self.holders:
            if replica is None or i == replica:
                self.pending_drop.setdefault(i, reason)
                log.info("holder_drop_pending", replica=i, reason=reason)

    def note_failure(self, replica: int, detail: str) -> None:
        """A generation died: a CUDA error in its cause drops the copy (`core.holder.drop_reason`)."""
        why = held.drop_reason(death_cause=detail)
        if why is not None:
            self.drop_holder(replica, why)

    async def settle_holders(self) -> None:
        """Each turn: restart a holder whose copy must go (a pending drop, or stale) once no live
        engine maps it (the holder knows their pids: it refuses to retire while one lives)."""
        for i, h in list(self.holders.items()):
            stale = h.last is not None and h.last.state == "stale"
            reason = self.pending_drop.get(i) or (f"stale: {h.last.stale}" if stale and h.last else "")
            now = time.monotonic()
            if not reason or now - self._settle_tried.get(i, 0.0) < SETTLE_EVERY_S:
                continue
            self._settle_tried[i] = now
            if h.alive and not await h.retire():
                continue
            self.pending_drop.pop(i, None)
            if self.holder_device() is None:
                await h.stop()
                self.holders.pop(i, None)
            else:
                await h.restart(reason)

    async def stop_holders(self) -> None:
        """The runtime's way out, after every generation: the holders' memory goes back."""
        for i, h in list(self.holders.items()):
            await h.stop()
        self.holders.clear()

    def holder_status(self, replica: int) -> HolderStatus | None:
        h = self.holders.get(replica)
        return h.status(self.pending_drop.get(replica, "")) if h is not None else None

    async def went_live(self, gen: Generation) -> None:
        reports = await asyncio.to_thread(plugin.read_states, self.state_dir, gen.number)
        gen.note_weights(next((r.weights for r in reports.values() if r.weights is not None), None))
        kv = gen.note_kv(reports)
        if kv is not None:
            log.info("generation_kv", generation=gen.number, replica=gen.replica, source=kv.source,
                     why=kv.reason or None, gib=round(kv.bytes / 2**30, 2), seconds=kv.seconds)
        h = self.holders.get(gen.replica)
        if h is not None:
            await h.stat()  # a stale copy is restarted once nothing maps it (`settle_holders`)
        if gen.weights is not None:
            log.info("generation_weights", generation=gen.number, replica=gen.replica, source=gen.weights.source.value,
                     why=gen.weights.reason or None, seconds=gen.weights.seconds,
                     gib=round(gen.weights.bytes / 2**30, 2), given=gen.weights.given or None)

    async def spawn(self, replica: int, strategy: str | None, gated: bool, beside: bool,
                    standby: bool = False, late: bool = False, kv: str = "held") -> Generation:
        """Launch a generation of `replica` (OSError: the interpreter cannot even be run); its
        first start takes over the generation a previous runtime handed over, if there is one."""
        handed = self.adoptable.pop(replica, None) if not (gated or beside or standby) else None
        if handed is not None:
            return self.adopt(handed)
        s, n = self.cfg.server, self.next_number()
        env = child_env(self.cfg, self.state_dir, n)
        env.update(self.plans[replica].env())
        env.update(await self.holder_env(replica))
        kv_ok = self.kv_may_hold(replica)
        late = late and gated and kv_ok
        if kv_ok:
            env[plugin.KV_VAR] = kv
        gate = plugin.gate_dir(self.state_dir, n) if gated else None
        if gate is not None:
            env = plugin.gate_env(env, gate, STANDBY_PARK_S if standby else park_limit(s), self.prestage(n),
                                  warm=s.warm_start == "on", at_ready=late)
        env = plugin.pace_env(env, self.cfg, plugin.pace_wanted(self.cfg, beside, gate is not None, late))
        backend = Backend(generation=n, model=self.model, host=s.backend_host, port=free_port(s.backend_host),
                          vllm_args=list(s.vllm_args), log_path=self.state_dir / "logs" / f"generation-{n}.log",
                          python=self.python, env=env, nice=s.backend_nice, deathsig=not self.kept,
                          cpus=self.start_cpus() if beside else ())
        target = Target(generation=n, url=backend.url, limit=generation_limit(self.cfg.recycle))
        try:
            await backend.start()
        except OSError as e:
            log.error("backend_launch_failed", error=str(e), python=self.python)
            raise
        changed = self._changed.pop(replica, ())
        row = self.ledger.generation_started(n, backend.pid, backend.pid_started, self.model, replica, strategy,
                                             self.config_hash or None, changed)
        gen = Generation(n, backend, target, row, replica=replica, strategy=strategy, gate=gate,
                         spawned_mono=time.monotonic(), beside=beside, standby=standby, config=self.config_hash,
                         kv=kv if kv_ok else "", late=late, paced=plugin.PACE_VAR in env)
        log.info("generation_starting", generation=n, replica=replica, pid=backend.pid, backend=backend.url,
                 max_requests=target.limit, strategy=strategy, gated=gated, beside=beside,
                 kv=gen.kv or None, late_gate=late or None, paced=env.get(plugin.PACE_VAR),
                 cpus=list(backend.cpus) or None,
                 gpus=self.plans[replica].gpus or None, log=str(backend.log_path), config=self.config_hash or None,
                 config_changed=list(changed) or None)
        await asyncio.to_thread(prune_logs, self.state_dir / "logs")
        return gen

    async def unpace(self, gen: Generation) -> None:
        await asyncio.to_thread(plugin.unpace, self.state_dir, gen.number)

    def adopt(self, h: HandedGeneration) -> Generation:
        """The generation a previous runtime handed over, as this runtime's own: same number,
        same ledger row, same processes; it still has to pass the readiness check (/health and a
        1-token completion) before it serves here."""
        env = child_env(self.cfg, self.state_dir, h.generation)
        env.update(self.plans[h.replica].env())
        backend = Backend(generation=h.generation, model=h.model, host=h.host, port=h.port, vllm_args=list(h.vllm_args),
                          log_path=Path(h.log_path), python=self.python, env=env, uds=Path(h.uds) if h.uds else None,
                          deathsig=False)
        backend.adopt(AdoptedProcess(h.api.pid, h.api.ticks), live_procs(h))  # our keeper watches it now
        if self.adopt_mark is not None:  # the old keeper lets go (the others are adopted in the same turn)
            self.adopt_mark.touch()
        target = Target(generation=h.generation, url=backend.url, limit=generation_limit(self.cfg.recycle),
                        completed=h.served)
        gen = Generation(h.generation, backend, target, h.row, replica=h.replica, strategy="adopted",
                         spawned_mono=time.monotonic(), config=h.config_hash, adopted=True)
        # its KV cache may be the holder's (adopted with it): known before any successor is decided
        gen.note_kv(plugin.read_states(self.state_dir, h.generation))
        log.info("generation_adopted", generation=h.generation, replica=h.replica, pid=h.api.pid,
                 backend=backend.url, pids=sorted(backend.known_pids), config=h.config_hash,
                 config_now=self.config_hash, same_config=h.config_hash == self.config_hash)
        return gen
