"""Checks before `vllm-guard install` touches the system: each failure is one line, exit 2.

Pure decisions (`cuda_of_torch`, `driver_verdict`) are separate from the probes that read the
machine (root, sd_booted, a port, NVML, the venv's torch), so they are tested on literal values.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from vllm_guard.core import gpu, ports
from vllm_guard.core.errors import EXIT_USAGE, GuardError

try:
    import pynvml
except ImportError:  # pragma: no cover - a base dependency
    pynvml = None


class PreflightError(GuardError):
    """A check failed; the message is the one line the operator sees (exit 2: nothing was done)."""

    exit_code = EXIT_USAGE


@dataclass
class Report:
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def require_root() -> None:
    if os.geteuid() != 0:
        raise PreflightError("install needs root (or use --dry-run, or --root DIR to render into a prefix)")


def require_systemd(run_dir: Path = Path("/run/systemd/system")) -> None:
    """sd_booted(3): systemd is PID 1 exactly when /run/systemd/system is a directory."""
    if not run_dir.is_dir():
        raise PreflightError("systemd is not PID 1 here (no /run/systemd/system): "
                             "use --root DIR to render the units for another system")


def require_free_port(host: str, port: int) -> None:
    why = ports.bind_error(host, port)
    if why is not None:
        raise PreflightError(f"port {port} on {host} is taken ({why}): choose another with --port")


def require_model_dir(model: str) -> None:
    """The unit runs with HF_HUB_OFFLINE=1: the model must be a local directory with a config."""
    if not model:
        return  # the embedded tiny model, built on first start
    p = Path(model)
    if not p.is_absolute() or not (p / "config.json").is_file():
        raise PreflightError(
            f"--model has value {model!r}: not an absolute path to a local model directory with "
            "config.json (download a pinned revision first, e.g. `huggingface-cli download M "
            "--revision R --local-dir DIR`)")
    for f in sorted(p.rglob("*")):
        if f.is_file() and not f.stat().st_mode & 0o004:
            raise PreflightError(f"model file {str(f)!r} is mode {f.stat().st_mode & 0o777:04o}: the service "
                                 f"user cannot read it (chmod -R a+rX {model})")


_CU = re.compile(r"\+cu(\d+)(\d)$")
_CUDA = re.compile(r"^(\d+)\.(\d+)")


def cuda_of_torch(torch_version: str) -> tuple[int, int] | None:
    """`2.11.0+cu130` -> (13, 0); `2.13.0+cpu` -> None; no local label -> None (unknown)."""
    m = _CU.search(torch_version.strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


def cuda_version(text: str | None) -> tuple[int, int] | None:
    """`torch.version.cuda` ("12.4", "13.0") -> (12, 4); None (a CPU build) -> None."""
    m = _CUDA.match(text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def driver_verdict(driver_cuda: int | None, needed: tuple[int, int] | None) -> tuple[str, str]:
    """('ok'|'warn'|'error', why) for NVML's nvmlSystemGetCudaDriverVersion (e.g. 12040) against
    the CUDA the installed torch was built for. A driver of the same major version but an older
    minor runs it (CUDA minor-version compatibility, without PTX JIT): a warning, never a refusal;
    only an older major version is refused."""
    if needed is None:
        return "ok", "the installed torch is not a CUDA build: no NVIDIA driver needed"
    want = f"{needed[0]}.{needed[1]}"
    if driver_cuda is None:
        return "error", f"the installed torch is built for CUDA {want} but no NVIDIA driver answers (NVML not found)"
    have = (driver_cuda // 1000, (driver_cuda % 1000) // 10)
    got = f"{have[0]}.{have[1]}"
    if have[0] < needed[0]:
        return "error", (f"NVIDIA driver supports CUDA {got}, the installed torch needs {want}: upgrade the "
                         f"driver (then `apt-mark hold` it), or install a torch/vLLM built for CUDA {have[0]}.x "
                         "(docs/GPU-INSTALL.md)")
    if have < needed:
        return "warn", (f"NVIDIA driver supports CUDA {got} < {want} (torch's): minor-version compatibility "
                        "only (no PTX JIT)")
    return "ok", f"NVIDIA driver supports CUDA {got}, torch needs {want}"


_TORCH_CODE = """import json
try:
    import torch
    print(json.dumps([torch.__version__, torch.version.cuda]))
except Exception as e:
    import importlib.metadata as m
    try:
        v = m.version("torch")
    except Exception:
        v = ""
    print(json.dumps([v, "?"]))
"""


def torch_build(python: str) -> tuple[str, tuple[int, int] | None, bool]:
    """(torch version, the CUDA it was built for, known) as the service's interpreter sees it:
    `torch.version.cuda` when torch imports, else the wheel's `+cuXYZ` label."""
    try:
        out = subprocess.run([python, "-c", _TORCH_CODE], capture_output=True, text=True, timeout=180)
        version, cuda = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return "", None, False
    if cuda == "?":  # torch is not importable: the wheel's label is all there is
        label = cuda_of_torch(str(version))
        return str(version), label, label is not None or str(version).endswith("+cpu")
    return str(version), cuda_version(cuda), True


def check_nvidia(python: str, gpus: Sequence[str], env: dict[str, str], report: Report) -> None:
    """Driver new enough for the CUDA of the installed torch; `[server] gpus` name GPUs of this box
    as the service (environment `env`) will see them; persistence mode (a warning)."""
    version, needed, known = torch_build(python)
    driver: int | None = None
    nvml_ok = False
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
            nvml_ok = True
            driver = pynvml.nvmlSystemGetCudaDriverVersion()
        except pynvml.NVMLError:
            nvml_ok = False
    try:
        if not known:
            why = (f"cannot tell which CUDA {python}'s torch ({version or 'not installed'}) needs: "
                   "the driver was not checked")
            (report.warnings if nvml_ok or not version else report.notes).append(why)
        else:
            verdict, why = driver_verdict(driver, needed)
            if verdict == "error":
                raise PreflightError(why)
            if verdict == "warn":
                report.warnings.append(why)
            else:
                report.notes.append(why)
        if gpus and not nvml_ok:
            raise PreflightError(f"--gpus has value {','.join(gpus)!r}: no NVIDIA driver answers (NVML not found)")
        if nvml_ok:
            _check_gpus(gpus, env, report)
    finally:
        if nvml_ok:
            pynvml.nvmlShutdown()


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _check_gpus(gpus: Sequence[str], env: dict[str, str], report: Report) -> None:
    """The one selection rule (`core.gpu.service_gpus`), as the runtime will apply it."""
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    static = [{"index": i, "uuid": _text(pynvml.nvmlDeviceGetUUID(h)),
               "pci_bus_id": _text(pynvml.nvmlDeviceGetPciInfo(h).busId)} for i, h in enumerate(handles)]
    try:
        used = set(gpu.service_gpus(static, gpus, env))
    except ValueError as e:
        raise PreflightError(f"--gpus has value {','.join(gpus)!r}: {e}; see `nvidia-smi -L`") from e
    for h, s in zip(handles, static):
        if s["uuid"] not in used:
            continue
        try:
            if pynvml.nvmlDeviceGetPersistenceMode(h) == 0:
                report.warnings.append(
                    f"persistence mode is off on {s['uuid']}: enable nvidia-persistenced (or `nvidia-smi -pm 1`) "
                    "so a recycle does not pay driver re-initialisation")
        except pynvml.NVMLError:
            pass  # not supported (e.g. some GeForce/WSL): nothing to say


def check_users_differ(user: str, watchdog_user: str) -> None:
    if user == "root" or watchdog_user == "root":
        raise PreflightError("--user has value 'root': the runtime and watchdog run as dedicated system users")
