#!/usr/bin/env python3
"""What admission costs the proxy's event loop: `admission.read` against `json.loads` (how vLLM's
API server reads a body) on the same bodies, in one run, as ratios.

    python bench/bench_admission.py [--mb 32] [--repeat 5]

Bodies: a typical chat request (a few KB), and bodies made to be expensive at the default
`[server] max_body_mb` (32): a prompt of token ids, a batch of one-character prompts, a batch of
token lists, floats nested in `messages`, one long string. Each figure is the median of
`--repeat` reads; `read` runs on the loop once per client request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

from vllm_guard.runtime.frontdoor.admission import Limits, read


def bodies(mb: int) -> dict[str, tuple[str, bytes]]:
    size = mb << 20

    def fill(unit: bytes, build: Callable[[int], Any]) -> bytes:
        return json.dumps(build(size // len(unit))).encode()

    chat = {"model": "m", "messages": [{"role": "user", "content": "hello " * 500}], "max_tokens": 256, "n": 1}
    return {
        "chat request (3 KB)": ("/v1/chat/completions", json.dumps(chat).encode()),
        "prompt of token ids": ("/v1/completions", fill(b"12345, ", lambda n: {"prompt": [12345] * n, "max_tokens": 1})),
        "batch of 1-char prompts": ("/v1/completions", fill(b'"a", ', lambda n: {"prompt": ["a"] * n, "max_tokens": 1})),
        "batch of token lists": ("/v1/completions", fill(b"[1, 2], ", lambda n: {"prompt": [[1, 2]] * n,
                                                                                 "max_tokens": 1})),
        "floats in messages": ("/v1/chat/completions", fill(b"1.5, ", lambda n: {"messages": [[1.5] * 10] * (n // 10),
                                                                                  "max_tokens": 1})),
        "one long string": ("/v1/completions", fill(b"x", lambda n: {"prompt": "x" * n, "max_tokens": 1})),
    }


def median_s(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    lim = Limits(max_n=16, max_request_tokens=32768, context=4096)
    print(f"{'body':28} {'MB':>6} {'admission ms':>13} {'json.loads ms':>14} {'ratio':>7}")
    for name, (path, body) in bodies(a.mb).items():
        ours = median_s(lambda: read(path, body, lim), a.repeat)
        theirs = median_s(lambda: json.loads(body), a.repeat)
        print(f"{name:28} {len(body) / 2**20:6.2f} {ours * 1000:13.2f} {theirs * 1000:14.1f} {ours / theirs:7.3f}")


if __name__ == "__main__":
    main()
