"""`vllm-guard revive` (run by vllm-guard-revive.timer): a failed unit gets another chance later.

After the start limit, systemd leaves a unit failed for good; on a box nobody watches that means
dead until someone logs in. Revive resets and starts failed vllm-guard units, except those whose
runtime said "an operator must act": exit 2 (config error) or 4 (boot error, e.g. no vLLM).
A stopped (inactive) unit is never started: that was someone's decision.
"""

from __future__ import annotations

import subprocess
import sys

PATTERNS = ("vllm-guard.service", "vllm-guard@*.service", "vllm-guard-watchdog.service",
            "vllm-guard-watchdog@*.service")
OPERATOR_EXITS = {"2": "config error", "4": "boot error"}


def parse_show(text: str) -> dict[str, str]:
    """`systemctl show -p A,B unit` output (KEY=VALUE lines) as a dict."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key] = value
    return out


def decide(props: dict[str, str]) -> tuple[bool, str]:
    """(revive?, why) from ActiveState, Result and ExecMainStatus."""
    if props.get("ActiveState") != "failed":
        return False, f"not failed ({props.get('ActiveState', '?')})"
    status = props.get("ExecMainStatus", "")
    if props.get("Result") == "exit-code" and status in OPERATOR_EXITS:
        return False, f"exit {status} ({OPERATOR_EXITS[status]}): needs an operator"
    return True, f"failed ({props.get('Result', '?')}, exit {status or '?'})"


def failed_units() -> list[str]:
    out = subprocess.run(["systemctl", "list-units", "--all", "--plain", "--no-legend", "--state=failed",
                          *PATTERNS], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def revive_all() -> int:
    revived = 0
    for unit in failed_units():
        show = subprocess.run(["systemctl", "show", "-p", "ActiveState,Result,ExecMainStatus", unit],
                              capture_output=True, text=True, check=False)
        ok, why = decide(parse_show(show.stdout))
        print(f"{unit}: {'reviving' if ok else 'left alone'}: {why}", file=sys.stderr)
        if ok:
            subprocess.run(["systemctl", "reset-failed", unit], check=False)
            if subprocess.run(["systemctl", "start", "--no-block", unit], check=False).returncode == 0:
                revived += 1
    print(f"revived {revived} unit(s)")
    return 0
