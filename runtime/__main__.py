"""`python -m vllm_guard.runtime` runs the same CLI as the `vllm-guard` console script."""

from .cli import main

raise SystemExit(main())
