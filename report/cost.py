"""What a million tokens costs: energy from the GPUs' own power readings, prices from a file.

Energy is measured: the watchdog's NVML samples carry each GPU's power draw; integrated over
time (trapezoids between samples) over the span of what was served it gives kWh, and the output
tokens served over it (vLLM's usage records, counted by the runtime at the proxy, else the
soak's) give tokens per kWh. Prices are not measured: they come from a small TOML file
(`--prices`), one `[[box]]` per kind of box, picked by a substring of the report's label:

    currency = "USD"
    power_price_per_kwh = 0.12
    hours_per_year = 8760
    years = 3
    [[box]]
    match = "A100"           # substring of the label (GPU name, profile)
    name = "2x A100 80GB"
    cards = 2
    card_price = 15000.0
    host_price = 12000.0     # optional, like the rest below
    psu_cooling_price = 800.0
    operations_per_year = 2000.0
    downtime_cost_per_outage = 300.0
    power_w = 382.0          # per card; used only when the ledger has no power readings

$/M tokens = (capital over `years` + operations + power, per hour) / output tokens per hour at
the measured throughput (the offered load: a box served below capacity costs more per token).
The 3-year TCO adds the outages the ledger saw, extrapolated per month, times the cost of one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vllm_guard.core.config import tomllib
from vllm_guard.core.errors import UsageError
from vllm_guard.core.reliability import ServiceFigures
from vllm_guard.core.samples import Tick

from .figures import CostFigures, PerMillion, PriceRef, Tco, TrafficFigures

HOURS_PER_MONTH = 730.0
_TOP = {"currency": str, "power_price_per_kwh": float, "hours_per_year": float, "years": float, "source": str}
_BOX = {"match": str, "name": str, "cards": int, "card_price": float, "host_price": float,
        "psu_cooling_price": float, "operations_per_year": float, "downtime_cost_per_outage": float,
        "power_w": float, "source": str}
_REQUIRED_TOP = ("currency", "power_price_per_kwh")
_REQUIRED_BOX = ("match", "cards", "card_price")


@dataclass(frozen=True)
class BoxPrice:
    match: str
    cards: int
    card_price: float
    name: str = ""
    host_price: float = 0.0
    psu_cooling_price: float = 0.0
    operations_per_year: float = 0.0
    downtime_cost_per_outage: float = 0.0
    power_w: float | None = None
    source: str = ""

    @property
    def capital(self) -> float:
        return self.cards * self.card_price + self.host_price + self.psu_cooling_price


@dataclass(frozen=True)
class Prices:
    path: str
    currency: str
    power_price_per_kwh: float
    hours_per_year: float = 8760.0
    years: float = 3.0
    source: str = ""
    boxes: tuple[BoxPrice, ...] = field(default_factory=tuple)

    def box_for(self, label: str) -> BoxPrice | None:
        for b in self.boxes:
            if b.match.lower() in label.lower():
                return b
        return None


def _value(path: str, where: str, key: str, v: Any, kind: type) -> Any:
    bad = f"{path}: {where}{key} has value {v!r}:"
    if kind is str:
        if not isinstance(v, str) or not v.strip():
            raise UsageError(f"{bad} must be a non-empty string")
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise UsageError(f"{bad} must be a number")
    if kind is int and (not isinstance(v, int) or v < 1):
        raise UsageError(f"{bad} must be a whole number >= 1")
    if not math.isfinite(v) or v < 0:
        raise UsageError(f"{bad} must be a finite number >= 0")
    if key in ("hours_per_year", "years") and v == 0:
        raise UsageError(f"{bad} must be > 0")
    if key == "hours_per_year" and v > 8784:
        raise UsageError(f"{bad} a year has at most 8784 hours")
    return kind(v)


def _table(path: str, where: str, data: dict[str, Any], spec: dict[str, type], required: tuple[str, ...]
           ) -> dict[str, Any]:
    out = {}
    for key, v in data.items():
        if key not in spec:
            raise UsageError(f"{path}: {where}{key}: unknown key (known: {', '.join(spec)})")
        out[key] = _value(path, where, key, v, spec[key])
    for key in required:
        if key not in out:
            raise UsageError(f"{path}: {where}{key}: missing")
    return out


def load_prices(path: str | Path) -> Prices:
    """The price file, validated: one line naming the file and key for the first problem."""
    p = str(path)
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise UsageError(f"--prices has value {p!r}: cannot read it ({e.strerror})") from e
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{p}: not TOML ({str(e).splitlines()[0]})") from e
    boxes = data.pop("box", None)
    top = _table(p, "", data, _TOP, _REQUIRED_TOP)
    if not isinstance(boxes, list) or not boxes or not all(isinstance(b, dict) for b in boxes):
        raise UsageError(f"{p}: box: missing (one [[box]] table per kind of box)")
    parsed = tuple(BoxPrice(**_table(p, f"[[box]] {i + 1}: ", b, _BOX, _REQUIRED_BOX)) for i, b in enumerate(boxes))
    return Prices(path=p, boxes=parsed, **top)


def gpu_power_series(ticks: list[Tick] | None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """uuid -> (epoch seconds, watts), time-ordered, from the ticks' NVML readings."""
    pts: dict[str, list[tuple[float, float]]] = {}
    for s in ticks or []:
        if s.nvml is None:
            continue
        for g in s.nvml.gpus:
            if g.power_w is not None and math.isfinite(g.power_w):
                pts.setdefault(g.uuid, []).append((s.nvml.at_s, g.power_w))
    return {u: (np.array([a for a, _ in sorted(v)]), np.array([w for _, w in sorted(v)])) for u, v in pts.items()}


def energy_kwh(series: dict[str, tuple[np.ndarray, np.ndarray]], t0: float, t1: float) -> tuple[float, float] | None:
    """(kWh, covered seconds) of all GPUs over [t0, t1]; None without two samples inside."""
    total_j = 0.0
    covered = 0.0
    for t, w in series.values():
        m = (t >= t0) & (t <= t1)
        if m.sum() < 2:
            continue
        tt, ww = t[m], w[m]
        total_j += float(np.sum((ww[1:] + ww[:-1]) / 2.0 * np.diff(tt)))
        covered = max(covered, float(tt[-1] - tt[0]))
    return (total_j / 3.6e6, covered) if covered > 0 else None


def cost_report(ticks: list[Tick] | None, traffic: TrafficFigures, t0: float | None, t1: float | None,
                svc: ServiceFigures, label: str, prices: Prices | None) -> CostFigures:
    """`traffic`: what was served (the runtime's counts, else the soak's) over [t0, t1]."""
    series = gpu_power_series(ticks)
    notes: list[str] = []
    tokens = traffic.output_tokens if traffic.present and traffic.usage_known else None
    tokens_from = (f"{traffic.source} usage records ({traffic.usage_known} of {traffic.completed} completed "
                   f"requests carried one)" if tokens is not None else "")
    energy = mean_w = per_kwh = None
    if not series:
        notes.append("no GPU power readings (watchdog NVML samples): tokens per kWh not measurable")
    elif t0 is None or t1 is None:
        notes.append("no requests recorded: tokens per kWh needs token counts")
    else:
        e = energy_kwh(series, t0, t1)
        if e is None:
            notes.append("fewer than two power readings inside the served span")
        else:
            energy, covered = e
            mean_w = energy * 3.6e6 / covered
            if energy > 0 and tokens:
                per_kwh = tokens / energy
    base: dict[str, Any] = dict(energy_kwh=energy, mean_power_w=mean_w, gpus_metered=len(series), output_tokens=tokens,
                tokens_from=tokens_from, tokens_per_kwh=per_kwh, notes=notes)
    if prices is None:
        notes.append("no price file (--prices): no cost per million tokens or TCO")
        return CostFigures(**base)
    box = prices.box_for(label) or (prices.boxes[0] if len(prices.boxes) == 1 else None)
    if box is None:
        notes.append(f"{prices.path}: no [[box]] whose match is in the label {label!r}")
        return CostFigures(**base)
    ref = PriceRef(prices.path, box.name or box.match, prices.currency, box.source or prices.source)
    if mean_w is not None:
        power_w, power_from = mean_w, "measured (NVML, mean over the served span)"
    elif box.power_w is not None:
        power_w, power_from = box.power_w * box.cards, "price file (power_w x cards), not measured"
    else:
        power_w, power_from = None, "unknown"
    hours = prices.hours_per_year * prices.years
    per_h: dict[str, float | None] = {
        "capital": box.capital / hours, "operations": box.operations_per_year / prices.hours_per_year,
        "power": None if power_w is None else power_w / 1000.0 * prices.power_price_per_kwh}
    tok_s = traffic.output_tokens_per_s if traffic.present else None
    per_m = None
    if tok_s and power_w is not None:
        hourly = sum(v for v in per_h.values() if v is not None)
        per_m = PerMillion(hourly / (tok_s * 3600.0) * 1e6, tok_s, hourly, per_h, power_w, power_from)
    elif not tok_s:
        notes.append("no output token throughput (no usage records): no cost per million tokens")
    observed_h = svc.observed_h or 0.0
    outages = svc.failures_unplanned or 0
    per_month = outages / observed_h * HOURS_PER_MONTH if observed_h > 0 else None
    energy_cost = None if power_w is None else power_w / 1000.0 * hours * prices.power_price_per_kwh
    downtime = None if per_month is None else per_month * prices.years * 12 * box.downtime_cost_per_outage
    parts: dict[str, float | None] = {
        "cards": box.cards * box.card_price, "host": box.host_price, "psu_cooling": box.psu_cooling_price,
        "power": energy_cost, "operations": box.operations_per_year * prices.years, "downtime": downtime}
    total = None if any(v is None for v in parts.values()) else sum(v for v in parts.values() if v is not None)
    tco = Tco(prices.years, total, parts, power_w, power_from, per_month,
              f"{outages} unplanned in {observed_h:.3g} h observed")
    return CostFigures(prices=ref, per_million_tokens=per_m, tco=tco, **base)


def headline(c: CostFigures) -> str:
    bits = []
    p = c.prices
    if c.per_million_tokens is not None and p:
        bits.append(f"{c.per_million_tokens.cost:,.2f} {p.currency} per million output tokens at the served "
                    f"{c.per_million_tokens.output_tokens_per_s:.4g} tok/s")
    if c.tokens_per_kwh is not None and c.mean_power_w is not None:
        bits.append(f"{c.tokens_per_kwh:,.0f} output tokens/kWh ({c.mean_power_w:.0f} W mean)")
    if c.tco is not None and c.tco.total is not None and p:
        bits.append(f"{c.tco.years:g}-year TCO {c.tco.total:,.0f} {p.currency} ({p.box})")
    return "; ".join(bits) if bits else "; ".join(c.notes) or "-"
