"""vllm-guard patches: a version-gated vLLM general plugin, its runtime hooks, fault injection.

Importing this package (or `hooks`) never imports vLLM or torch; `register()` does, lazily.
"""

from __future__ import annotations


def register() -> None:
    """Entry point of group `vllm.general_plugins` (see pyproject.toml)."""
    from .plugin import register as _register

    _register()
