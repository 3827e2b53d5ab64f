"""The soak's own figures from its `requests` rows (numpy arrays, no lists of rows): the client's
view, quantiles by the one rule (`core.latency`: the soak printed the same figures), errors by
category, from the scheduled send time too.

ITL is the distribution of each request's mean inter-chunk gap (the ledger keeps one figure
per request, not every gap). `*_sched` figures are measured from the scheduled send time.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from vllm_guard.core.latency import Histogram

from .figures import Quantiles, SoakFigures, SoakHour
from .ledgerread import SoakRun

QS = (50, 95, 99)


def quantiles(x: np.ndarray) -> Quantiles:
    x = x[np.isfinite(x)]
    if x.size == 0:
        return Quantiles()
    h = Histogram.of(x)
    return Quantiles(*(h.quantile(q / 100.0) for q in QS))


def soak_report(req: dict[str, np.ndarray], errors: list[str | None], runs: list[SoakRun]) -> SoakFigures:
    n = len(errors)
    if n == 0:
        return SoakFigures(False, "no soak ran on this ledger (the traffic figures are the runtime's)")
    err = np.array([e is not None for e in errors])
    ok = ~err
    sent, ended = req["sent_at"], req["ended_at"]
    t0 = np.nanmin(sent) if np.isfinite(sent).any() else np.nan
    span = float(np.nanmax(ended) - t0) if np.isfinite(ended).any() else 0.0
    cats = Counter(e for e in errors if e is not None)
    hours = []
    if np.isfinite(t0):
        h = np.floor((sent - t0) / 3600.0)
        for hv in np.unique(h[np.isfinite(h)]):
            m = h == hv
            hours.append(SoakHour(int(hv), int(m.sum()), int((m & err).sum()), quantiles(req["ttft_s"][m & ok]),
                                  quantiles(req["e2e_s"][m & ok]), quantiles(req["itl_mean_s"][m & ok])))
    out_tok = float(np.nansum(req["output_tokens"][ok]))
    return SoakFigures(
        present=True, note="", runs=[r.to_dict() for r in runs], requests=n, ok=int(ok.sum()), failed=int(err.sum()),
        error_rate=float(err.mean()), errors=dict(sorted(cats.items())),
        ttft_s=quantiles(req["ttft_s"][ok]), ttft_sched_s=quantiles(req["ttft_sched_s"][ok]),
        itl_mean_s=quantiles(req["itl_mean_s"][ok]), e2e_s=quantiles(req["e2e_s"][ok]),
        e2e_sched_s=quantiles(req["e2e_sched_s"][ok]), per_hour=hours, span_s=span,
        throughput_rps=n / span if span > 0 else None, output_tokens_per_s=out_tok / span if span > 0 else None)
