"""What the public port passes to vLLM: an allow-list of its public API, and which requests count.

vLLM's server also answers development and control endpoints (`/sleep`, `/wake_up`,
`/reset_prefix_cache`, `/scale_elastic_ep`, `/collective_rpc`, `/v1/load_lora_adapter`,
`/v1/responses/{id}/cancel`, profiling, weight updates...) that anyone reaching the port could
call. A deny-list misses the next one vLLM adds; so the proxy forwards only the public inference
API below and answers everything else itself (404, or 405 for a known path with the wrong
method), without reaching vLLM.

Only `ENGINE` routes (POST requests that run the model) count toward a generation's
`max_requests`; reading the model list, health, tokenizing do not.

Two paths are the guard's own and never reach vLLM (`PROBE`): readiness (`READY_PATH`: may a load
balancer send this box a request now?) and liveness (`LIVE_PATH`: is the runtime's loop alive?).
They live under `/vllm-guard/`, a prefix vLLM's API never uses: vLLM's `/health` stays vLLM's, and
`/ready`, `/readyz` are already routes of vLLM's own data-parallel launcher.
"""

from __future__ import annotations

import enum
import re
import uuid

from vllm_guard.core.vllm_api import PROBE_ID_PREFIX


class Kind(enum.Enum):
    ENGINE = "engine"  # runs the model: counted
    PUBLIC = "public"  # answered by the API server alone: forwarded, never counted
    PROBE = "probe"  # readiness and liveness, answered by the guard itself: never forwarded or counted


READY_PATH = "/vllm-guard/ready"
LIVE_PATH = "/vllm-guard/live"
PROBES = (READY_PATH, LIVE_PATH)
PROBE_METHODS = ("GET", "HEAD")  # load balancers' checks use either


# path -> (method, kind). POST routes run the model, GET routes only read.
ROUTES: dict[str, tuple[str, Kind]] = {
    "/v1/completions": ("POST", Kind.ENGINE),
    "/v1/chat/completions": ("POST", Kind.ENGINE),
    "/v1/embeddings": ("POST", Kind.ENGINE),
    "/v1/responses": ("POST", Kind.ENGINE),
    "/v1/messages": ("POST", Kind.ENGINE),
    "/v1/audio/transcriptions": ("POST", Kind.ENGINE),
    "/v1/audio/translations": ("POST", Kind.ENGINE),
    "/v1/score": ("POST", Kind.ENGINE),
    "/v1/rerank": ("POST", Kind.ENGINE),
    "/v2/rerank": ("POST", Kind.ENGINE),
    "/v2/embed": ("POST", Kind.ENGINE),
    "/score": ("POST", Kind.ENGINE),
    "/rerank": ("POST", Kind.ENGINE),
    "/pooling": ("POST", Kind.ENGINE),
    "/classify": ("POST", Kind.ENGINE),
    "/v1/messages/count_tokens": ("POST", Kind.PUBLIC),
    "/tokenize": ("POST", Kind.PUBLIC),
    "/detokenize": ("POST", Kind.PUBLIC),
    "/v1/models": ("GET", Kind.PUBLIC),
    "/health": ("GET", Kind.PUBLIC),
    "/ping": ("GET", Kind.PUBLIC),
    "/version": ("GET", Kind.PUBLIC),
}


class NotAllowed(Exception):
    """The request is not part of the public API: answered here with `status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def classify(method: str, path: str) -> Kind:
    """The route's kind; NotAllowed (404 or 405) for anything else."""
    path = path.rstrip("/") or "/"
    if path in PROBES:
        if method in PROBE_METHODS:
            return Kind.PROBE
        raise NotAllowed(405, f"{method} is not allowed on {path} (use GET or HEAD)")
    route = ROUTES.get(path)
    if route is None:
        raise NotAllowed(404, f"{path[:100]} is not served here")
    want, kind = route
    if method == want:
        return kind
    raise NotAllowed(405, f"{method} is not allowed on {path[:100]} (use {want})")


_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")


def request_id(given: str | None) -> str:
    """The client's X-Request-Id if it is a short printable token, else a fresh one. It is logged,
    echoed and forwarded; one that claims to be the guard's probe (the plugin exempts probes from
    counting and injected faults) is replaced."""
    if given and _REQUEST_ID.match(given) and not given.startswith(PROBE_ID_PREFIX):
        return given
    return uuid.uuid4().hex
