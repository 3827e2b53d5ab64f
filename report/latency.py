"""Latency and error figures from the soak's `requests` rows (numpy arrays, no lists of rows).

ITL is the distribution of each request's mean inter-chunk gap (the ledger keeps one figure
per request, not every gap). `*_sched` figures are measured from the scheduled send time.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from .ledgerread import SoakRun

QS = (50, 95, 99)


def quantiles(x: np.ndarray) -> dict[str, float | None]:
    x = x[np.isfinite(x)]
    if x.size == 0:
        return {f"p{q}": None for q in QS}
    return {f"p{q}": float(v) for q, v in zip(QS, np.percentile(x, QS))}


def latency_report(req: dict[str, np.ndarray], errors: list[str | None], runs: list[SoakRun],
                   requests_served: int = 0) -> dict[str, Any]:
    """`requests_served`: what the runtime counted (all traffic, not only the soak's), for the
    note when no soak ran here."""
    n = len(errors)
    if n == 0:
        served = f"; the runtime served {requests_served} requests (see SERVICE)" if requests_served else ""
        return {"present": False, "note": f"no soak requests in this ledger{served}", "requests": 0}
    err = np.array([e is not None for e in errors])
    ok = ~err
    sent, ended = req["sent_at"], req["ended_at"]
    t0 = np.nanmin(sent) if np.isfinite(sent).any() else np.nan
    span = float(np.nanmax(ended) - t0) if np.isfinite(ended).any() else 0.0
    cats = Counter(e for e in errors if e is not None)
    figs = {k: quantiles(req[k][ok]) for k in ("ttft_s", "ttft_sched_s", "itl_mean_s", "e2e_s", "e2e_sched_s")}
    hours = []
    if np.isfinite(t0):
        h = np.floor((sent - t0) / 3600.0)
        for hv in np.unique(h[np.isfinite(h)]):
            m = h == hv
            hours.append({"hour": int(hv), "requests": int(m.sum()), "errors": int((m & err).sum()),
                          **{f"{k}_{q}": v for k in ("ttft_s", "e2e_s", "itl_mean_s")
                             for q, v in quantiles(req[k][m & ok]).items()}})
    out_tok = float(np.nansum(req["output_tokens"][ok]))
    return {
        "present": True, "runs": [r.to_dict() for r in runs],
        "requests": n, "ok": int(ok.sum()), "failed": int(err.sum()), "error_rate": float(err.mean()),
        "errors": dict(sorted(cats.items())), **figs, "per_hour": hours,
        "span_s": span, "throughput_rps": n / span if span > 0 else None,
        "output_tokens_per_s": out_tok / span if span > 0 else None,
    }
