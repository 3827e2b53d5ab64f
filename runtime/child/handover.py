"""A runtime upgrade that refuses no connection: the serving generations outlive the runtime.

On a hand-over (`systemctl restart` of a socket-activated unit, or `vllm-guard upgrade`) the old
runtime stops taking connections (they wait in the backlog of the socket systemd holds), lets
its requests in flight finish, and exits leaving each replica's serving vLLM running, described
in one record in the state dir; its keeper waits a lease for the next runtime before it would kill
them. The next runtime reads the record and adopts each generation whose identity still holds
(the API server's pid *and* start time, the processes it had, its backend socket), proves it with
the normal readiness check (/health and a 1-token completion), and writes the mark that releases
the old keeper. A record that does not hold is ignored: those processes are killed as orphans
(their ledger rows are open) and the replica cold-starts, as after any crash.

A runtime that is killed, not upgraded, writes no record and sends no lease: vLLM dies with it.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path
from typing import Literal, Mapping

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .keeper import same_process, start_ticks

log = structlog.get_logger("vllm_guard.handover")

SCHEMA: Literal["vllm-guard-handover/1"] = "vllm-guard-handover/1"
RECORD = "handover.json"
LEASE_S = 60.0  # how long a handed-over generation waits for the next runtime before its keeper kills it
RESTART_JOBS = frozenset({"restart", "try-restart", "reload-or-restart", "try-reload-or-restart"})


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Proc(_Model):
    pid: int
    ticks: int  # start time in clock ticks since boot (`keeper.start_ticks`): pid + ticks is one process


class HandedGeneration(_Model):
    replica: int
    generation: int
    row: int  # its ledger row (stays open: the next runtime ends it)
    api: Proc  # the API server, leader of the generation's process group
    procs: list[Proc]  # every process of it the old runtime knew
    model: str
    vllm_args: list[str]
    host: str
    port: int
    uds: str | None
    log_path: str
    config_hash: str
    served: int  # requests it completed so far (its ledger row's count goes on from there)


class HandedHolder(_Model):
    """A replica's weight holder, left running for the next runtime (it waits `core.holder.LEASE_S`)."""

    replica: int
    proc: Proc
    key: str  # its socket's authkey (hex); the record is the state dir's, mode 0600
    device: str


class Record(_Model):
    version: Literal["vllm-guard-handover/1"] = SCHEMA
    state_dir: str
    runtime_pid: int
    written_at: str
    lease_s: float
    mark: str  # the file the next runtime creates once it adopted them (releases the old keeper)
    generations: list[HandedGeneration]
    holders: list[HandedHolder] = Field(default_factory=list)


def record_path(state_dir: Path) -> Path:
    return state_dir / RECORD


def new_mark(state_dir: Path) -> Path:
    return state_dir / f"handover-adopted-{secrets.token_hex(6)}"


def write(state_dir: Path, record: Record) -> None:
    """Write the record atomically (the next runtime reads it whole or not at all)."""
    path = record_path(state_dir)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(record.model_dump_json())
    os.replace(tmp, path)


def take(state_dir: Path) -> Record | None:
    """The record a previous runtime left, removed as it is read (it is acted on once); None
    when there is none or it cannot be read (then the generations are orphans)."""
    path = record_path(state_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.error("handover_unreadable", path=str(path), error=str(e))
        return None
    finally:
        path.unlink(missing_ok=True)
    try:
        return Record.model_validate_json(text)
    except ValidationError as e:
        log.error("handover_invalid", path=str(path), error=str(e).splitlines()[0])
        return None


def holds(g: HandedGeneration) -> str | None:
    """Why generation `g` cannot be adopted (None: it can): its API server is the same process,
    and its backend socket is still there."""
    if not same_process(start_ticks(g.api.pid), g.api.ticks):
        return f"its API server (pid {g.api.pid}) is gone"
    if g.uds is not None and not Path(g.uds).exists():
        return f"its backend socket {g.uds} is gone"
    return None


def live_procs(g: HandedGeneration) -> list[int]:
    """The processes of `g` that are still the same ones."""
    return [p.pid for p in g.procs if same_process(start_ticks(p.pid), p.ticks)]


def release(record: Record) -> None:
    """Tell the old keeper the generations are taken over: it exits without killing."""
    Path(record.mark).touch()


def own_unit(cgroup: str | None = None) -> str | None:
    """The systemd unit this process runs in (the last component of its cgroup), or None."""
    if cgroup is None:
        try:
            cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    for line in cgroup.splitlines():
        last = line.rpartition("/")[2].strip()
        if last.endswith(".service"):
            return last
    return None


def job_of(unit: str, jobs: str) -> str | None:
    """The type of `unit`'s pending job in `systemctl list-jobs --no-legend --plain` output."""
    for line in jobs.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == unit:
            return parts[2]
    return None


def systemd_restarting(env: Mapping[str, str] | None = None) -> bool:
    """Whether the SIGTERM we got is systemd stopping us for a restart (`systemctl restart`),
    not for good (`systemctl stop`): the unit's pending job, asked of systemd. False outside
    systemd or when systemd cannot be asked (then the stop is a full one, as before)."""
    env = os.environ if env is None else env
    unit = own_unit() if env.get("INVOCATION_ID") else None
    if unit is None:
        return False
    try:
        out = subprocess.run(["systemctl", "list-jobs", "--no-legend", "--plain", "--no-pager", unit],
                             capture_output=True, text=True, timeout=3.0, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("systemd_job_unknown", unit=unit, error=str(e))
        return False
    job = job_of(unit, out.stdout)
    log.info("systemd_job", unit=unit, job=job)
    return job in RESTART_JOBS


HandOverWhy = Literal["upgrade", "restart"]
