"""A soak run's parameters: fixed when the run is created, stored as JSON in `runs.params`,
read back unchanged by `--resume` (so a resumed run sends the same schedule and prompts).

Typed so a resume of a run written by another version fails with one line instead of
sending with a missing or misspelt setting.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from vllm_guard.core.errors import ProtocolError


@dataclass(frozen=True)
class SoakParams:
    url: str
    model: str
    max_model_len: int | None
    scenario: str
    prompt_tokens: int
    output_tokens: int
    concurrency: int | None  # cap on requests in flight; None: none
    rate: float  # mean requests/s; inf: closed loop at `concurrency`
    burstiness: float  # gamma shape; 1 = Poisson
    mode: str  # steady | burst
    burst_period_s: float
    burst_duty: float
    seed: int
    duration_s: float  # run time (the schedule's clock counts only while a soak process runs)
    timeout_s: float  # per request
    max_requests: int | None
    state_dir: str | None  # the guard whose status is sampled; None: no samples
    sample_interval_s: float = 2.0
    span_requests: int = 0  # > 0: arrivals scaled so request N is sent at N / rate
    tokenizer: str | None = None  # send prompts as text decoded with this tokenizer

    @property
    def closed_loop(self) -> bool:
        return math.isinf(self.rate)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SoakParams:
        """Parameters of a stored run; ProtocolError when a key is missing or unknown."""
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ProtocolError(f"runs.params is not JSON: {e}") from e
        if not isinstance(data, dict):
            raise ProtocolError(f"runs.params is {type(data).__name__}, not an object")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        required = {n for n, f in fields.items() if f.default is dataclasses.MISSING}
        missing, unknown = sorted(required - data.keys()), sorted(data.keys() - fields.keys())
        if missing or unknown:
            raise ProtocolError("runs.params " + "; ".join(
                ([f"lacks {', '.join(missing)}"] if missing else []) + ([f"has unknown {', '.join(unknown)}"] if unknown else [])))
        data["rate"] = float(data["rate"])
        return cls(**data)
