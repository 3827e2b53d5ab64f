"""Each replica's own vLLM `/metrics`, re-exported on the runtime's metrics port with `replica="N"`.

vLLM serves `/metrics` on its backend socket, which only the runtime's user and group reach, and
the public port answers 404 for it: Prometheus cannot scrape vLLM itself. So the runtime's
exporter fetches every replica's page at scrape time and adds the replica to each sample. The
fetch runs on the runtime's event loop (`core.vllm_api`), the exporter's thread only waits for it,
at most `SCRAPE_TIMEOUT_S`. Only each replica's current generation is read (a successor starting
beside it serves nothing yet), so a recycle shows as a counter reset, which `rate()` handles, not
as new series. A replica that does not answer never breaks the scrape (node_exporter's rule):
`vllm_guard_runtime_replica_metrics_up{replica}` says which pages came.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Callable, Iterator, Mapping, Sequence

import structlog
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from vllm_guard.core import vllm_api

log = structlog.get_logger("vllm_guard.metrics")

P = "vllm_guard_runtime_"
SCRAPE_TIMEOUT_S = 3.0
Targets = Callable[[], Sequence[tuple[int, str | None]]]  # (replica, its backend URL or None: not serving)
Fetch = Callable[[Sequence[tuple[int, str]]], Mapping[int, str | None]]


def relabel(replica: int, text: str) -> list[Metric]:
    """vLLM's families from one replica's page with `replica` added to every sample (pure);
    `_created` samples are left out. ValueError for a page Prometheus's parser refuses."""
    out: list[Metric] = []
    for fam in text_string_to_metric_families(text):
        m = Metric(fam.name, fam.documentation, fam.type, fam.unit)
        m.samples = [Sample(s.name, {**s.labels, "replica": str(replica)}, s.value, s.timestamp, s.exemplar)
                     for s in fam.samples if not s.name.endswith("_created")]
        if m.samples:  # vLLM writes each `_created` as a family of its own
            out.append(m)
    return out


def merge(pages: Sequence[list[Metric]]) -> list[Metric]:
    """One family per name across replicas (the exposition allows each name once); a family whose
    type differs from the first replica's (two vLLM versions) is left out."""
    fams: dict[str, Metric] = {}
    for page in pages:
        for fam in page:
            have = fams.get(fam.name)
            if have is None:
                fams[fam.name] = have = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            if have.type == fam.type:
                have.samples.extend(fam.samples)
    return list(fams.values())


class LoopFetch:
    """Fetch pages on `loop` (the runtime's) from another thread (the exporter's)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float = SCRAPE_TIMEOUT_S) -> None:
        self.loop, self.timeout = loop, timeout

    async def _all(self, targets: Sequence[tuple[int, str]]) -> dict[int, str | None]:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            pages = await asyncio.gather(*(vllm_api.metrics_page(session, url, self.timeout) for _, url in targets))
        return {i: page for (i, _), page in zip(targets, pages)}

    def __call__(self, targets: Sequence[tuple[int, str]]) -> Mapping[int, str | None]:
        try:
            fut = asyncio.run_coroutine_threadsafe(self._all(targets), self.loop)
        except RuntimeError:  # the loop is closed: the runtime is going down
            return {}
        try:
            return fut.result(self.timeout + 1.0)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            fut.cancel()
            return {}


class VllmReexport(Collector):
    """Every replica's vLLM series, labelled by replica, built at scrape time."""

    def __init__(self, targets: Targets, fetch: Fetch) -> None:
        self.targets = targets
        self.fetch = fetch

    def collect(self) -> Iterator[Metric]:
        want = list(self.targets())
        reachable = [(i, url) for i, url in want if url]
        pages = self.fetch(reachable) if reachable else {}
        up = GaugeMetricFamily(P + "replica_metrics_up", "1 when the replica's vLLM /metrics answered this scrape "
                               "(its series are re-exported with replica=N)", labels=["replica"])
        good: list[list[Metric]] = []
        for i, _ in want:
            text = pages.get(i)
            ok = False
            if text is not None:
                try:
                    good.append(relabel(i, text))
                    ok = True
                except ValueError as e:  # a page the parser refuses is this replica's failure only
                    log.warning("vllm_metrics_unparsable", replica=i, error=str(e)[:200])
            up.add_metric([str(i)], 1.0 if ok else 0.0)
        yield up
        yield from merge(good)
