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
from vllm_guard.core.timefmt import human_duration

# What must match for `--resume-or-start` to continue a stored run rather than start a new one:
# the load itself. Where it goes (url, state dir) and how it is observed may differ.
LOAD_FIELDS = ("model", "scenario", "prompt_tokens", "output_tokens", "concurrency", "rate", "burstiness",
               "mode", "burst_period_s", "burst_duty", "seed", "duration_s", "max_requests", "span_requests",
               "tokenizer")


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

    def same_load(self, other: SoakParams) -> bool:
        """True when `other` sends the same load (see LOAD_FIELDS)."""
        return all(getattr(self, f) == getattr(other, f) for f in LOAD_FIELDS)

    def describe(self) -> str:
        """One line that says which loop runs: `open loop at 2 req/s ...` or `closed loop at
        concurrency 4 ...`, then the length, the shape and the target."""
        if self.closed_loop:
            how = (f"closed loop at concurrency {self.concurrency} (the next request is sent as soon "
                   f"as one ends)")
        else:
            arrivals = "Poisson" if self.burstiness == 1.0 else f"gamma, burstiness {self.burstiness:g}"
            how = f"open loop at {self.rate:g} req/s ({arrivals}"
            if self.mode == "burst":
                how += f", in bursts: {self.burst_duty:.0%} of every {human_duration(self.burst_period_s)}"
            how += ")" + (f", at most {self.concurrency} in flight" if self.concurrency else "")
        length = human_duration(self.duration_s)
        if self.max_requests is not None:
            length += f" or {self.max_requests} requests, whichever comes first"
        return (f"{how}, for {length}; {self.scenario} {self.prompt_tokens}/{self.output_tokens} tokens, "
                f"model {self.model} at {self.url}")

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
