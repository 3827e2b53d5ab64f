"""Where a start's seconds go, in every Python process started with this folder on PYTHONPATH.

Set VLLM_GUARD_STARTPROF=DIR and put this folder first on PYTHONPATH: each process (the guard,
vLLM's API server, its EngineCore) samples its main thread's Python stack every 5 ms from a daemon
thread and appends `wall_time stack_id` lines to DIR/PID.prof (stacks interned as `S id ...`
lines). A long call that holds the GIL delays the next sample; `bench/startprof.py` gives each
interval to the stack seen at its start. Stops after VLLM_GUARD_STARTPROF_S seconds (600).
A dev tool for the start anatomy, not part of the product: nothing imports it.
"""

from __future__ import annotations

import os

_DIR = os.environ.get("VLLM_GUARD_STARTPROF", "")


def _start(out_dir: str) -> None:
    import json
    import sys
    import threading
    import time

    interval = float(os.environ.get("VLLM_GUARD_STARTPROF_EVERY_S", "0.005"))
    limit = float(os.environ.get("VLLM_GUARD_STARTPROF_S", "600"))
    main_id = threading.main_thread().ident

    import atexit

    os.makedirs(out_dir, exist_ok=True)
    f = open(os.path.join(out_dir, f"{os.getpid()}.prof"), "w", buffering=1 << 16)  # noqa: SIM115
    atexit.register(f.flush)

    def run() -> None:
        ids: dict[tuple[str, ...], int] = {}
        if True:
            f.write(f"# pid {os.getpid()} ppid {os.getppid()} argv {json.dumps(sys.argv[:8])}\n")
            t_end = time.time() + limit
            last_flush = time.time()
            while True:
                time.sleep(interval)
                now = time.time()
                if now > t_end:
                    break
                frame = sys._current_frames().get(main_id)
                names: list[str] = []
                while frame is not None and len(names) < 120:
                    code = frame.f_code
                    fn = code.co_filename
                    cut = max(fn.rfind("/site-packages/"), fn.rfind("/site/"))
                    if cut >= 0:
                        fn = fn[fn.index("/", cut + 1) + 1:]
                    names.append(f"{fn}:{code.co_name}:{frame.f_lineno}")
                    frame = frame.f_back
                key = tuple(reversed(names))
                sid = ids.get(key)
                if sid is None:
                    sid = ids[key] = len(ids)
                    f.write(f"S {sid} {';'.join(key)}\n")
                f.write(f"{now:.4f} {sid}\n")
                if now - last_flush > 1.0:
                    f.flush()
                    last_flush = now

    threading.Thread(target=run, name="vllm-guard-startprof", daemon=True).start()


if _DIR:
    _start(_DIR)
