"""Preflight under the unit's own sandbox: can the service user run the interpreter and read the model?

A venv under /tmp is hidden by `PrivateTmp=yes`, one under /home by `ProtectHome=yes`, and a base
Python under /root (mode 0700) cannot be entered by a system user: each gives 203/EXEC on the
first start, after install said it was done. So install runs a small check *as the service
would*: with systemd as PID 1, through `systemd-run --wait --pipe` with the sandbox properties of
the rendered unit itself; without systemd (containers, build hosts), through `setpriv` to the
service user after checking the paths against the sandbox's rules (`hidden_by`, pure). A user
that does not exist yet (install creates it) is checked as a fresh one: `DynamicUser=yes`, or
nobody/nogroup, which have only what "others" may do, exactly like a new system user.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# [Service] keys that decide what the service can see, reach and run: passed to systemd-run.
SANDBOX_KEYS = frozenset({
    "User", "Group", "SupplementaryGroups", "UMask", "Environment", "ProtectSystem", "ProtectHome", "PrivateTmp",
    "PrivateDevices", "DevicePolicy", "DeviceAllow", "NoNewPrivileges", "ProtectKernelTunables",
    "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups", "ProtectClock", "ProtectHostname",
    "RestrictSUIDSGID", "RestrictRealtime", "RestrictNamespaces", "LockPersonality", "RestrictAddressFamilies",
    "CapabilityBoundingSet", "AmbientCapabilities", "SystemCallArchitectures", "SystemCallFilter",
    "MemoryDenyWriteExecute", "PrivateUsers", "ReadWritePaths", "ReadOnlyPaths", "InaccessiblePaths",
    "TemporaryFileSystem", "BindPaths", "BindReadOnlyPaths",
})
TMP_DIRS = ("/tmp", "/var/tmp")
HOME_DIRS = ("/home", "/root", "/run/user")
MARK = "vllm-guard-preflight:"
NOBODY = 65534

# Runs as the service user: prints MARK + JSON. Imports nothing heavy (vllm is only located).
CHECK_CODE = r'''
import importlib.util, json, os, sys
model = sys.argv[1]
out = {"python": sys.executable, "prefix": sys.prefix, "base_prefix": sys.base_prefix,
       "vllm_guard": importlib.util.find_spec("vllm_guard") is not None,
       "vllm": importlib.util.find_spec("vllm") is not None, "model_error": ""}
def fail(e):
    raise e
if model:
    try:
        with open(os.path.join(model, "config.json"), "rb") as f:
            f.read(1)
        for d, _, files in os.walk(model, onerror=fail):
            for name in files:
                with open(os.path.join(d, name), "rb") as f:
                    f.read(1)
    except OSError as e:
        out["model_error"] = f"{type(e).__name__}: {e}"
print("MARK" + json.dumps(out))
'''.replace("MARK", MARK)


@dataclass(frozen=True)
class Verdict:
    """What the check found; `problem` is the one line the operator sees ("" when all is well)."""

    how: str  # which check ran: "systemd-run ...", "setpriv ...", "path rules only ..."
    problem: str = ""


def unit_service_properties(unit_text: str) -> list[tuple[str, str]]:
    """(key, value) of the [Service] section, in order, comments and other sections left out."""
    out: list[tuple[str, str]] = []
    section = ""
    for raw in unit_text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        if section == "Service" and "=" in line:
            key, _, value = line.partition("=")
            out.append((key.strip(), value.strip()))
    return out


def _under(path: str, roots: tuple[str, ...]) -> str | None:
    return next((r for r in roots if path == r or path.startswith(r + "/")), None)


def hidden_by(path: str, props: dict[str, str]) -> str | None:
    """The unit setting that hides `path` from the service, or None (pure: tested on literals)."""
    if props.get("PrivateTmp", "no") in ("yes", "true", "1") and (root := _under(path, TMP_DIRS)):
        return f"PrivateTmp=yes gives the service its own empty {root}"
    if props.get("ProtectHome", "no") in ("yes", "true", "1", "tmpfs") and (root := _under(path, HOME_DIRS)):
        return f"ProtectHome={props['ProtectHome']} hides {root}"
    for key in ("InaccessiblePaths", "TemporaryFileSystem"):
        for p in props.get(key, "").split():
            p = p.lstrip("-").split(":", 1)[0]
            if p and (path == p or path.startswith(p.rstrip("/") + "/")):
                return f"{key}={p} hides it"
    return None


def interpreter_of(bin_path: str) -> str:
    """The interpreter the kernel runs for a console script (its `#!` line), else the file itself."""
    try:
        with open(bin_path, "rb") as f:
            first = f.readline(512).decode(errors="replace").strip()
    except OSError:
        return bin_path
    return first[2:].strip().split()[0] if first.startswith("#!") and first[2:].strip() else bin_path


def venv_base(python: str) -> str | None:
    """The base interpreter's home of a venv (`home =` of pyvenv.cfg next to its bin/), if any."""
    cfg = Path(python).parent.parent / "pyvenv.cfg"
    try:
        for line in cfg.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home":
                return value.strip()
    except OSError:
        return None
    return None


def paths_to_check(bin_path: str, pythons: list[str], model: str) -> dict[str, str]:
    """What the service must reach, by what it is: the executable, each interpreter as named and
    as resolved, each venv's base Python, the model."""
    out = {"the vllm-guard executable": bin_path}
    for py in pythons:
        out[f"the interpreter {py} is" if py == bin_path else "the interpreter"] = py
        real = os.path.realpath(py)
        if real != py:
            out[f"the interpreter {py} links to"] = real
        base = venv_base(py)
        if base:
            out[f"the base Python of {py} is"] = os.path.realpath(base)
    if model:
        out["the model"] = os.path.realpath(model)
    return {label: path for label, path in out.items()}


def blocked_dir(path: str, uid: int | None, gids: set[int]) -> tuple[str, int, int] | None:
    """The first directory on the way to `path` that this user may not enter (no search
    permission), as (dir, mode, owner uid); uid None: a user that owns nothing (a new one)."""
    p = Path(path)
    for d in [*reversed(p.parents), p] if p.is_dir() else reversed(p.parents):
        try:
            st = os.stat(d)
        except OSError:
            return None  # not there: the run (or the start) says so
        if uid == 0:
            return None
        bit = 0o100 if uid == st.st_uid else 0o010 if st.st_gid in gids else 0o001
        if not st.st_mode & bit:
            return str(d), st.st_mode & 0o7777, st.st_uid
    return None


def _ids(user: str) -> tuple[int | None, set[int]]:
    import grp

    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        return None, set()
    return pw.pw_uid, {pw.pw_gid} | {g.gr_gid for g in grp.getgrall() if user in g.gr_mem}


def check_paths(paths: dict[str, str], props: dict[str, str], unit: str, user: str) -> str:
    """The first path the sandbox hides or the user cannot reach, as one line; "" when none."""
    uid, gids = _ids(user)
    for what, path in paths.items():
        why = hidden_by(path, props)
        if why:
            return (f"{what} {path}, which {unit} cannot see ({why}): install the venv and the model "
                    f"outside /tmp and home directories, e.g. python3 -m venv /opt/vllm-guard/venv")
        blocked = blocked_dir(path, uid, gids)
        if blocked:
            d, mode, owner = blocked
            who = f"user {user}" if uid is not None else f"the service user {user} (created by install)"
            return (f"{what} {path}, but {who} cannot enter {d} (mode {mode:04o}, owner uid {owner}): "
                    f"give others search permission there (chmod o+x {d}) or install the venv and its "
                    f"Python under /opt")
    return ""


def _user_exists(user: str) -> bool:
    try:
        pwd.getpwnam(user)
        return True
    except KeyError:
        return False


def systemd_run_command(props: list[tuple[str, str]], user: str, python: str, model: str) -> list[str]:
    """`systemd-run --wait --pipe` with the unit's sandbox; a user not created yet: DynamicUser."""
    exists = _user_exists(user)
    cmd = ["systemd-run", "--quiet", "--wait", "--pipe", "--collect", "--service-type=exec",
           "--working-directory=/"]
    for key, value in props:
        if key not in SANDBOX_KEYS or (not exists and key in ("User", "Group", "SupplementaryGroups")):
            continue
        cmd += ["-p", f"{key}={value}"]
    if not exists:
        cmd += ["-p", "DynamicUser=yes"]
    return [*cmd, python, "-c", CHECK_CODE, model]


def setpriv_command(user: str, python: str, model: str) -> list[str]:
    """setpriv to the service user (nobody/nogroup when it does not exist yet)."""
    if _user_exists(user):
        ids = ["--reuid", user, "--regid", str(pwd.getpwnam(user).pw_gid), "--init-groups"]
    else:
        ids = ["--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups"]
    return ["setpriv", *ids, "--no-new-privs", python, "-c", CHECK_CODE, model]


def _environment(props: list[tuple[str, str]]) -> dict[str, str]:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    for key, value in props:
        if key == "Environment":
            name, _, v = value.partition("=")
            env[name] = v
    return env


def _base_prefix(python: str) -> str:
    """sys.base_prefix of `python` as this (root) process sees it; "" when it cannot tell."""
    try:
        out = subprocess.run([python, "-c", "import sys; print(sys.base_prefix)"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def parse_output(stdout: str) -> dict[str, object] | None:
    for line in stdout.splitlines():
        if line.startswith(MARK):
            try:
                data = json.loads(line[len(MARK):])
            except ValueError:
                return None
            return data if isinstance(data, dict) else None
    return None


def judge(found: dict[str, object] | None, rc: int, stderr: str, who: str, python: str, need_guard: bool,
          need_vllm: bool, model: str, base_prefix: str = "") -> str:
    """One line for what went wrong ("" when nothing did); pure, tested on literal outputs.
    `base_prefix`: the interpreter's own, as root sees it: a user that cannot reach it gets
    another standard library (or none), which is a failure too."""
    if found is None:
        last = next((ln.strip() for ln in reversed(stderr.splitlines()) if ln.strip()), "")
        how = "could not execute it" if rc in (126, 127, 203) or "exec" in last.lower() else f"exit {rc}"
        return (f"{who} cannot run {python} under the unit's sandbox ({how}: {last or 'no output'}): every "
                f"directory on the way to the interpreter and its base Python must be searchable by others "
                f"(chmod o+rx), or install a venv under /opt")
    if base_prefix and found.get("base_prefix") != base_prefix:
        return (f"{who} runs {python} but cannot reach its base Python {base_prefix} (it found "
                f"{found.get('base_prefix')!r} instead): install the venv and its Python under /opt")
    if need_guard and not found.get("vllm_guard"):
        return f"{who} runs {python} but cannot import vllm_guard from it: install the package into that venv"
    if need_vllm and not found.get("vllm"):
        return (f"{who} runs {python} but cannot find vLLM there: install vllm-guard[gpu] (or [cpu]) into that "
                f"venv, readable by others")
    err = found.get("model_error")
    if model and err:
        return f"{who} cannot read the model {model} ({err}): chmod -R o+rX {model} and o+x on its parents"
    return ""


def check(unit_text: str, unit: str, user: str, bin_path: str, child_python: str, model: str,
          systemd_pid1: bool, is_root: bool) -> Verdict:
    """Every interpreter the service runs, and the model, as the service user under its sandbox."""
    props_list = unit_service_properties(unit_text)
    props = dict(props_list)
    runtime_python = interpreter_of(bin_path)
    child_python = child_python or runtime_python
    pythons = list(dict.fromkeys([runtime_python, child_python]))
    problem = check_paths(paths_to_check(bin_path, pythons, model), props, unit, user)
    use_systemd = systemd_pid1 and shutil.which("systemd-run") is not None
    exists = _user_exists(user)
    who = f"user {user}" if exists else f"a new system user like {user} (it does not exist yet)"
    if use_systemd:
        how = f"systemd-run as {'' if exists else 'a dynamic user standing in for '}{user} with {unit}'s sandbox"
    elif is_root and shutil.which("setpriv"):
        how = (f"setpriv as {user if exists else 'nobody (standing in for ' + user + ', not created yet)'} "
               f"and {unit}'s path rules (systemd is not PID 1 here)")
    else:
        how = f"{unit}'s path rules only (running as the service user needs root and setpriv)"
    if problem or not (use_systemd or (is_root and shutil.which("setpriv"))):
        return Verdict(how, problem)
    for py in pythons:
        is_runtime = py == runtime_python
        checked_model = model if is_runtime else ""
        cmd = (systemd_run_command(props_list, user, py, checked_model) if use_systemd
               else setpriv_command(user, py, checked_model))
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd="/",
                                 env=None if use_systemd else _environment(props_list))
        except (OSError, subprocess.TimeoutExpired) as e:
            return Verdict(how, f"{who}: the sandbox check could not run ({type(e).__name__}: {e})")
        problem = judge(parse_output(out.stdout), out.returncode, out.stderr, who, py, need_guard=is_runtime,
                        need_vllm=py == child_python, model=checked_model, base_prefix=_base_prefix(py))
        if problem:
            return Verdict(how, problem)
    return Verdict(how)
