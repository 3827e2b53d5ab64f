"""`python -m vllm.entrypoints.openai.api_server`, as far as a start that dies goes: it logs as
vLLM 0.32.0 does, starts a worker that is killed by SIGILL inside a function named like vLLM's
CPU attention op (with faulthandler on, as the runtime sets PYTHONFAULTHANDLER=1), reports the
worker's death in vLLM's words and exits 0, as vLLM's API server does after its engine died.

FAKE_VLLM_FAULT=vary makes each start's fault differ (another line in the frame, from a counter
file beside this module in FAKE_VLLM_COUNTER), so no two deaths are the same cause."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

WORKER = '''{pad}
import faulthandler, os, signal, sys
faulthandler.enable()
def cpu_attention_with_kv_cache():
    os.kill(os.getpid(), signal.SIGILL)
cpu_attention_with_kv_cache()
'''


def main() -> int:
    pid = os.getpid()
    print(f"(APIServer pid={pid}) INFO 12-05 10:00:00 [api_server.py:1] vLLM API server version 0.32.0", flush=True)
    pad = ""
    counter = os.environ.get("FAKE_VLLM_COUNTER")
    if os.environ.get("FAKE_VLLM_FAULT") == "vary" and counter:
        path = Path(counter)
        n = int(path.read_text()) + 1 if path.exists() else 1
        path.write_text(str(n))
        pad = "\n" * n  # the op moves down: another frame, another cause
    w = subprocess.run([sys.executable, "-c", WORKER.format(pad=pad)])
    print(f"(EngineCore_DP0 pid={pid + 1}) ERROR 12-05 10:00:01 [multiproc_executor.py:315] Worker proc "
          f"VllmWorker-0 died unexpectedly (exit code: {w.returncode}), shutting down executor.", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
