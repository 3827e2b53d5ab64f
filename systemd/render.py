"""Render the unit templates (package data) and guard.toml for one box or one GPU-set instance.

Templates use `@name@` placeholders (systemd itself owns `%i`, `$MAINPID`, `${VAR}`); a
placeholder left unrendered is a bug and raises. One template renders both the plain unit
(`vllm-guard.service`) and the instance template (`vllm-guard@.service`), so the hardening is
written once.

Values that come from outside (the venv's path, the model's path in a comment, the docs URL) are
written per systemd.syntax(7): a value with a control character is refused (a newline would
start a new directive: `ExecStartPre=` from a crafted model path), an `ExecStart=` word that is
not plain is quoted with `\\` and `"` escaped and `%` doubled (a specifier otherwise), `$`
doubled in arguments (variable expansion otherwise), a URL percent-encoded.
"""

from __future__ import annotations

import ipaddress
import json
import re
import sys
import urllib.parse
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from vllm_guard.core.config import GuardConfig, InstallConfig
from vllm_guard.core.errors import UsageError

ETC = "/etc/vllm-guard"
UNIT_DIR = "/etc/systemd/system"
SYSUSERS = "/etc/sysusers.d/vllm-guard.conf"
_REPO_DOCS = Path(__file__).resolve().parent.parent / "docs" / "OPERATIONS.md"
DOCS = f"file://{urllib.parse.quote(str(_REPO_DOCS))}" if _REPO_DOCS.exists() else "man:systemd.service(5)"
_PLACEHOLDER = re.compile(r"@([a-z_]+)@")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_PLAIN_WORD = re.compile(r"^[A-Za-z0-9_@+=:,./-]+$")
MULTILINE = ("device_allow", "ip_policy", "watchdog_ip_policy")  # built here from checked lines
# The NVIDIA nodes by /proc/devices class: nvidia-frontend (major 195: /dev/nvidia0..N,
# /dev/nvidiactl, modeset), nvidia-uvm, nvidia-caps (MIG). Absent classes are ignored by systemd.
DEVICE_ALLOW = ("DeviceAllow=char-nvidia-frontend rw\nDeviceAllow=char-nvidia-uvm rw\n"
                "DeviceAllow=char-nvidia-caps rw")
HIDDEN_HOMES = ("/home", "/root", "/run/user")


@dataclass(frozen=True)
class Layout:
    """Where one service's files live; `spec` is what goes into unit files (may hold %i)."""

    instance: str | None  # None: the plain vllm-guard.service

    def _name(self, instance: str | None) -> str:
        return "guard" if instance is None else instance

    @property
    def unit(self) -> str:
        return "vllm-guard.service" if self.instance is None else f"vllm-guard@{self.instance}.service"

    @property
    def watchdog_unit(self) -> str:
        return ("vllm-guard-watchdog.service" if self.instance is None
                else f"vllm-guard-watchdog@{self.instance}.service")

    @property
    def config(self) -> str:
        return f"{ETC}/{self._name(self.instance)}.toml"

    @property
    def env_file(self) -> str:
        return f"{ETC}/{self._name(self.instance)}.env"

    @property
    def state_name(self) -> str:
        return "vllm-guard" if self.instance is None else f"vllm-guard/{self.instance}"

    @property
    def state_dir(self) -> str:
        return f"/var/lib/{self.state_name}"

    @property
    def cache_dir(self) -> str:
        return f"/var/cache/{self.state_name}"


PLAIN = Layout(None)
TEMPLATE = Layout("%i")  # the instance template's own view of the paths


def template_text(name: str) -> str:
    return resources.files("vllm_guard.systemd").joinpath(name).read_text()


def substitute(text: str, ctx: dict[str, str]) -> str:
    """Replace every `@key@`; a key missing from `ctx` raises KeyError naming it."""
    def one(m: re.Match[str]) -> str:
        if m.group(1) not in ctx:
            raise KeyError(f"template placeholder @{m.group(1)}@ has no value")
        return ctx[m.group(1)]
    for key, value in ctx.items():
        if key not in MULTILINE:
            unit_value(key, value)
    return _PLACEHOLDER.sub(one, text)


def unit_value(name: str, value: str) -> str:
    """`value` if it can go into a unit file line; UsageError for a control character."""
    if _CONTROL.search(value):
        raise UsageError(f"{name} has value {value!r}: control characters (newline, tab, ...) cannot go "
                         "into a systemd unit")
    return value


def exec_word(word: str, first: bool = False) -> str:
    """One word of an `ExecStart=` line (systemd.syntax(7), systemd.service(5)): as is when plain,
    else double-quoted with `\\` and `"` escaped; `%` doubled everywhere (specifiers), `$` doubled
    in arguments (the executable path is not expanded)."""
    unit_value("ExecStart", word)
    if _PLAIN_WORD.match(word):
        return word
    escaped = word.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    if not first:
        escaped = escaped.replace("$", "$$")
    return f'"{escaped}"'


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def ip_policies(cfg: GuardConfig | None) -> tuple[str, str]:
    """IPAddressAllow/Deny lines for the runtime and the watchdog: only loopback when nothing
    they serve or call needs another address."""
    deny = "IPAddressAllow=localhost\nIPAddressDeny=any"
    if cfg is None:
        return deny, deny
    host = cfg.server.host
    runtime = (f"# The public port is on loopback ({host}): no other address is reachable either way.\n{deny}"
               if loopback(host) else
               f"# No IP address policy: [server] host is {host}, clients come from the network.")
    w = cfg.watchdog
    why = ("its exporter listens on " + w.prometheus_addr if not loopback(w.prometheus_addr) else
           "alerts go to a webhook" if w.alert_webhook else "an alert command runs" if w.alert_command else "")
    watchdog = (f"# No IP address policy: {why}." if why else
                f"# Exporter on loopback, no webhook: no other address is reachable either way.\n{deny}")
    return runtime, watchdog


def systemd_seconds(seconds: float) -> str:
    return f"{int(round(seconds))}s"


def protect_home(paths: list[str]) -> tuple[str, str]:
    """`yes` hides /home, /root and /run/user; a venv or model living there needs `read-only`."""
    inside = [p for p in paths if any(p == h or p.startswith(h + "/") for h in HIDDEN_HOMES)]
    if inside:
        return "read-only", f"read-only, not yes: {inside[0]} lives under a home directory"
    return "yes", "yes: nothing this service runs lives under /home, /root or /run/user"


def base_context(settings: InstallConfig, bin_path: str, timeout_stop: float,
                 extra_paths: list[str], cfg: GuardConfig | None = None) -> dict[str, str]:
    """Placeholders shared by every unit (not those that depend on the instance)."""
    for p in (bin_path, sys.prefix, sys.base_prefix, *extra_paths):
        unit_value("a path the units name", p)
    ph, why = protect_home([bin_path, sys.prefix, sys.base_prefix, *extra_paths])
    runtime_ip, watchdog_ip = ip_policies(cfg)
    return {
        "ip_policy": runtime_ip,
        "watchdog_ip_policy": watchdog_ip,
        "bin": exec_word(bin_path, first=True),
        "docs": DOCS,
        "etc_dir": ETC,
        "user": settings.user,
        "group": settings.group,
        "watchdog_user": settings.watchdog_user,
        "memory_high": settings.memory_high,
        "memory_max": settings.memory_max,
        "watchdog_sec": systemd_seconds(settings.watchdog_sec),
        "restart_sec": systemd_seconds(settings.restart_sec),
        "start_limit_interval": systemd_seconds(settings.start_limit_interval),
        "start_limit_burst": str(settings.start_limit_burst),
        "timeout_start": systemd_seconds(settings.timeout_start),
        "timeout_stop": systemd_seconds(timeout_stop),
        "revive_every": systemd_seconds(settings.revive_every),
        "protect_home": ph,
        "protect_home_why": f"ProtectHome={why}",
        "device_allow": DEVICE_ALLOW,
        "state_root": "/var/lib/vllm-guard",
        "unit": PLAIN.unit,
    }


def layout_context(layout: Layout) -> dict[str, str]:
    inst = layout.instance
    return {
        "unit": layout.unit,
        "description": "GPU set %i" if inst == "%i" else (inst or "this box"),
        "config": layout.config,
        "env_file": layout.env_file,
        "state_name": layout.state_name,
        "state_dir": layout.state_dir,
        "cache_dir": layout.cache_dir,
    }


def render_units(base: dict[str, str]) -> dict[str, str]:
    """Unit file name -> rendered text, for every unit we ship."""
    out: dict[str, str] = {}
    for layout, suffix in ((PLAIN, ""), (TEMPLATE, "@")):
        ctx = {**base, **layout_context(layout)}
        out[f"vllm-guard{suffix}.service"] = substitute(template_text("vllm-guard.service"), ctx)
        out[f"vllm-guard-watchdog{suffix}.service"] = substitute(
            template_text("vllm-guard-watchdog.service"), ctx)
    for name in ("vllm-guard-soak@.service", "vllm-guard-revive.service", "vllm-guard-revive.timer"):
        out[name] = substitute(template_text(name), base)
    return out


def socket_unit(layout: Layout, host: str, port: int, description: str) -> tuple[str, str]:
    """(file name, text) of the socket unit that holds this service's public port."""
    name = layout.unit.removesuffix(".service") + ".socket"
    listen = f"[{host}]:{port}" if ":" in host else f"{host or '0.0.0.0'}:{port}"
    ctx = {"unit": layout.unit, "socket": name, "listen": listen, "description": description, "docs": DOCS}
    return name, substitute(template_text("vllm-guard.socket"), ctx)


def sysusers(settings: InstallConfig) -> str:
    """sysusers.d(5): the runtime user and group, the watchdog user (no login, no home of its own)."""
    return (
        "# Written by `vllm-guard install`; `systemd-sysusers` creates these (kept on uninstall).\n"
        f"u {settings.user} - \"vllm-guard runtime\" /var/lib/vllm-guard -\n"
        f"u {settings.watchdog_user} - \"vllm-guard watchdog\" /var/lib/vllm-guard -\n"
        f"m {settings.watchdog_user} {settings.user}\n"
    )


def env_text(env: dict[str, str]) -> str:
    lines = ["# Environment for the runtime (written by `vllm-guard install` from [install] env; the GPUs",
             "# are [server] gpus in guard.toml: the runtime sets each replica's CUDA_VISIBLE_DEVICES)."]
    lines += [f"{k}={json.dumps(v)}" for k, v in env.items()]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} to TOML")


def toml_text(data: dict[str, dict[str, Any]], header: str) -> str:
    """A flat guard.toml: sections of scalars, lists and inline tables (all guard.toml needs)."""
    parts = [header.rstrip() + "\n"]
    for section, table in data.items():
        parts.append(f"\n[{section}]\n")
        parts += [f"{key} = {_toml_value(value)}\n" for key, value in table.items()]
    return "".join(parts)


def config_header(layout: Layout) -> str:
    return (f"# vllm-guard configuration for {layout.unit} (written by `vllm-guard install`, kept on\n"
            "# re-install: edit freely). `systemctl restart` applies changes (it drops streams still\n"
            "# running after the drain); `systemctl reload` recycles gracefully with the loaded config.\n"
            "# [server] model is a pinned local path: the unit sets HF_HUB_OFFLINE=1.\n")


def unit_path(root: Path, name: str) -> Path:
    return root / UNIT_DIR.lstrip("/") / name


def under(root: Path, path: str) -> Path:
    return root / path.lstrip("/")
