"""vllm-guard patches: a version-gated vLLM general plugin, its engine hooks, fault injection.

Importing this package never imports vLLM or torch; `register()` does, lazily. The runtime's
side of the contract (child env, report files) is `vllm_guard.core.plugin`.
"""

from __future__ import annotations


def register() -> None:
    """Entry point of group `vllm.general_plugins` (see pyproject.toml)."""
    from .plugin import register as _register

    _register()
