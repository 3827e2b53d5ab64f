"""The vLLM OpenAI server as every guard process speaks to it: health, probe, metrics.

One probe rule for the runtime and the watchdog: a real 1-token completion, with the
server's API key and an `X-Request-Id` that starts with PROBE_ID_PREFIX (the plugin and the
injector know probes by it, so probes never count toward limits or injected faults). One
progress rule: the engine moved if its prompt+generation token counters grew.
`/health` alone proves nothing: it says 200 while the engine is hung (vLLM #36451).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import urllib.parse
import uuid
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Mapping, Sequence

if TYPE_CHECKING:
    import aiohttp

PROBE_ID_PREFIX = "vllm-guard-probe-"
API_KEY_ENV = "VLLM_API_KEY"
# A server on a Unix socket (vLLM's --uds): `http+unix://<percent-encoded socket path>`.
UNIX_SCHEME = "http+unix://"


def unix_url(path: str) -> str:
    return UNIX_SCHEME + urllib.parse.quote(str(path), safe="")


def unix_socket_of(url: str) -> str | None:
    """The socket path of a `unix_url`, None for a TCP URL."""
    if not url.startswith(UNIX_SCHEME):
        return None
    return urllib.parse.unquote(url[len(UNIX_SCHEME):].split("/", 1)[0])


@contextlib.asynccontextmanager
async def reach(session: aiohttp.ClientSession, url: str) -> AsyncIterator[tuple[aiohttp.ClientSession, str]]:
    """(session, base URL) for `url`: the given session for TCP, a short-lived one on the socket
    for a `unix_url` (a session's connector is bound to one socket)."""
    sock = unix_socket_of(url)
    if sock is None:
        yield session, url
        return
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock)) as s:
        yield s, "http://localhost"


def arg_value(args: Sequence[str], flag: str) -> str | None:
    """Value of `flag` in a vLLM argument list (`--flag v` or `--flag=v`), last one wins."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def api_key(vllm_args: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The key vLLM will demand: `--api-key`, else `VLLM_API_KEY` in the server's env."""
    return arg_value(vllm_args, "--api-key") or env.get(API_KEY_ENV) or None


_HUMAN_INT = re.compile(r"^(\d+(?:\.\d+)?)([kKmMgGtT]?)$")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def context_length(vllm_args: Sequence[str]) -> int | None:
    """`--max-model-len` as vLLM reads it (`4096`, `4k` = 4000, `4K` = 4096); None when not
    given, `auto`/-1 (vLLM derives it from the model) or not a number vLLM would take."""
    value = arg_value(vllm_args, "--max-model-len")
    m = _HUMAN_INT.match(value.strip()) if value else None
    if m is None:
        return None
    number, suffix = m.groups()
    if suffix in _DECIMAL:
        n = int(float(number) * _DECIMAL[suffix])
    elif "." in number:  # vLLM refuses decimals without a suffix or with a binary one
        return None
    else:
        n = int(number) * _BINARY.get(suffix, 1)
    return n if n > 0 else None


def api_keys(vllm_args: Sequence[str], env: Mapping[str, str]) -> frozenset[str]:
    """Every key vLLM accepts: `--api-key K [K...]` (also `--api-key=K`, repeated: the last
    wins), else `VLLM_API_KEY`, as vLLM's middleware reads them (0.32); empty: none demanded."""
    keys: list[str] = []
    i = 0
    while i < len(vllm_args):
        a = vllm_args[i]
        if a == "--api-key":
            keys = []
            i += 1
            while i < len(vllm_args) and not vllm_args[i].startswith("-"):
                keys.append(vllm_args[i])
                i += 1
            continue
        if a.startswith("--api-key="):
            keys = [a.split("=", 1)[1]]
        i += 1
    if not keys and env.get(API_KEY_ENV):
        keys = [env[API_KEY_ENV]]
    return frozenset(k for k in keys if k)


def served_model_name(vllm_args: Sequence[str], model: str) -> str:
    name = arg_value(vllm_args, "--served-model-name")
    return name.split(",")[0].strip() if name else model


def auth_headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    latency_s: float
    error: str = ""
    timed_out: bool = False  # no answer in time (the hang rule counts only these; an HTTP error is an answer)


@dataclass(frozen=True)
class EngineMetrics:
    """The vLLM series the guard reads, summed over labels (model, finished_reason...)."""

    generation_tokens: float = 0.0
    prompt_tokens: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float | None = None
    preemptions: float = 0.0
    request_success: float = 0.0

    @property
    def tokens(self) -> float:
        return self.generation_tokens + self.prompt_tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_WANTED = {
    "vllm:generation_tokens": "generation_tokens",
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:num_preemptions": "preemptions",
    "vllm:request_success": "request_success",
}
_PREFIXES = tuple(_WANTED)


def parse_metrics(text: str) -> EngineMetrics:
    """The wanted series from a /metrics page (pure). Only their lines reach the parser:
    vLLM's page is mostly histograms nobody here reads."""
    from prometheus_client.parser import text_string_to_metric_families

    keep = "\n".join(ln for ln in text.splitlines()
                     if ln.startswith(_PREFIXES) or (ln.startswith("# ") and any(p in ln for p in _WANTED)))
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(keep + "\n"):
        key = _WANTED.get(fam.name)
        if key is None:
            continue
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            out[key] = out.get(key, 0.0) + float(s.value)
    return EngineMetrics(**out)


def progressed(before: EngineMetrics | None, after: EngineMetrics | None) -> bool | None:
    """Did the engine process any token between two scrapes? None when either is unknown."""
    if before is None or after is None:
        return None
    return after.tokens > before.tokens


async def health(session: aiohttp.ClientSession, url: str, timeout: float = 5.0) -> bool:
    import aiohttp

    try:
        async with reach(session, url) as (s, base), \
                s.get(base + "/health", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False


async def probe(session: aiohttp.ClientSession, url: str, model: str, key: str | None, prompt: str = "ping",
                timeout: float = 20.0) -> ProbeResult:
    """A real 1-token completion; the only proof that the engine still works."""
    import aiohttp

    t0 = time.monotonic()
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    headers = {**auth_headers(key), "X-Request-Id": f"{PROBE_ID_PREFIX}{uuid.uuid4().hex}"}
    try:
        async with reach(session, url) as (s, base), \
                s.post(base + "/v1/completions", json=body, headers=headers,
                       timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            text = await r.text()
            if r.status != 200:
                return ProbeResult(False, time.monotonic() - t0, f"HTTP {r.status}: {text[:200]}")
            return ProbeResult(True, time.monotonic() - t0)
    except asyncio.TimeoutError:
        return ProbeResult(False, time.monotonic() - t0, f"timeout after {timeout:.1f}s", timed_out=True)
    except (aiohttp.ClientError, OSError) as e:
        return ProbeResult(False, time.monotonic() - t0, f"{type(e).__name__}: {e}")


async def metrics_page(session: aiohttp.ClientSession, url: str, timeout: float = 5.0) -> str | None:
    """vLLM's whole /metrics page (Prometheus text); None when the scrape fails."""
    import aiohttp

    try:
        async with reach(session, url) as (s, base), \
                s.get(base + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                return None
            return await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return None


async def metrics(session: aiohttp.ClientSession, url: str, timeout: float = 5.0) -> EngineMetrics | None:
    """Engine counters from /metrics; None when the scrape fails."""
    text = await metrics_page(session, url, timeout)
    return None if text is None else parse_metrics(text)
