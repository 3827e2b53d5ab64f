"""`python -m vllm_guard.cli`: the same CLI as the `vllm-guard` console script."""

import sys

from . import main

sys.exit(main())
