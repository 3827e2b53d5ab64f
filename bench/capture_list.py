#!/usr/bin/env python3
"""The shortest CUDA-graph capture list whose decode stays within a bound of vLLM's default list
at every batch size, derived from a `gpu_decode_sweep.py` run of the default configuration.

    python3 bench/capture_list.py DIR/sweep.json [--config default] [--within 0.01] [--above 320,384,448,512]

With vLLM's default list a batch of b runs the graph of the next captured size (b padded to a
multiple of 8 above 8), and the sweep measured that step time at every b. A shorter list pads b
further up, to a size that is itself in the default list, whose step time the sweep also
measured: so the step time of any sub-list at any b is read off the same run. The step times are
first made non-decreasing in b (isotonic regression: a bigger batch is never faster; what is
left is noise). Then, from the largest size down, each next size kept is the smallest one below
it that keeps every batch in between within the bound. Sizes above the sweep's largest batch are
not measured; `--above` lists the ones kept there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import isotonic_regression


def default_sizes(largest: int = 512) -> list[int]:
    """vLLM's default capture list (0.25.1, `max_cudagraph_capture_size` = largest)."""
    return [s for s in [1, 2, 4, *range(8, 256, 8), *range(256, largest + 1, 16)] if s <= largest]


def pad(b: int, sizes: list[int]) -> int:
    return next(s for s in sizes if s >= b)


def derive(step_ms: dict[int, float], within: float) -> tuple[list[int], dict[int, float]]:
    """(the list up to the sweep's largest batch, the predicted speed ratio at every batch)."""
    bs = sorted(step_ms)
    fit = isotonic_regression(np.array([step_ms[b] for b in bs]), increasing=True).x
    t = dict(zip(bs, (float(v) for v in fit)))
    top = max(bs)
    candidates = [s for s in default_sizes() if s <= top]
    if candidates[-1] != top:
        candidates.append(top)
    chosen = [candidates[-1]]
    while chosen[-1] > 1:  # keep the smallest lower size whose padding costs every size between within the bound
        upper = chosen[-1]
        below = [s for s in candidates if s < upper]
        ok = [s for s in below if all(t[d] >= (1 - within) * t[upper] for d in candidates if s < d <= upper)]
        chosen.append(min(ok) if ok else below[-1])
    sizes = sorted(chosen)
    # b runs the graph of the next captured size: pad(b, default) today, pad(b, sizes) with the list
    ratio = {b: t[pad(b, candidates)] / t[pad(b, sizes)] for b in bs}
    return sizes, ratio


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweep")
    p.add_argument("--config", default="default")
    p.add_argument("--within", type=float, default=0.01)
    p.add_argument("--above", default="320,384,448,512")
    a = p.parse_args()
    data = json.loads(Path(a.sweep).read_text())[a.config]
    step = {int(b): statistics.median(v) for b, v in data["itl_ms"].items()}
    sizes, ratio = derive(step, a.within)
    above = [int(s) for s in a.above.split(",") if s and int(s) > max(sizes)]
    worst = min(ratio.items(), key=lambda kv: kv[1])
    print(json.dumps({"sizes": sizes + above, "count": len(sizes + above), "default_count": len(default_sizes()),
                      "predicted_worst": {"batch": worst[0], "speed_ratio": round(worst[1], 4)}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
