"""What a million tokens costs: energy from the GPUs' own power readings, prices from a file.

Energy is measured: the watchdog's NVML samples carry each GPU's power draw; integrated over
time (trapezoids between samples) over the soak's span it gives kWh, and the soak's output
tokens over it give tokens per kWh. Prices are not measured: they come from a small TOML file
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
the soak's measured throughput (the offered load: a soak below capacity overstates the cost).
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
from vllm_guard.core.samples import Tick
from vllm_guard.core.timefmt import epoch

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


def cost_report(ticks: list[Tick] | None, lat: dict[str, Any], req: dict[str, np.ndarray],
                svc: dict[str, Any], label: str, prices: Prices | None) -> dict[str, Any]:
    series = gpu_power_series(ticks)
    out: dict[str, Any] = {"energy_kwh": None, "mean_power_w": None, "gpus_metered": len(series),
                           "output_tokens": None, "tokens_per_kwh": None, "prices": None, "per_million_tokens": None,
                           "tco": None, "notes": []}
    notes: list[str] = out["notes"]
    span = None
    if lat.get("present"):
        sent, ended = req["sent_at"], req["ended_at"]
        span = (float(np.nanmin(sent)), float(np.nanmax(ended)))
        ok_tokens = req["output_tokens"][np.isfinite(req["output_tokens"])]
        out["output_tokens"] = int(ok_tokens.sum())
    if not series:
        notes.append("no GPU power readings (watchdog NVML samples): tokens per kWh not measurable")
    elif span is None:
        notes.append("no soak requests: tokens per kWh needs the soak's token counts")
    else:
        e = energy_kwh(series, *span)
        if e is None:
            notes.append("fewer than two power readings inside the soak's span")
        else:
            kwh, covered = e
            out["energy_kwh"] = kwh
            out["mean_power_w"] = kwh * 3.6e6 / covered
            if kwh > 0 and out["output_tokens"]:
                out["tokens_per_kwh"] = out["output_tokens"] / kwh
    if prices is None:
        notes.append("no price file (--prices): no $/M tokens or TCO")
        return out
    box = prices.box_for(label) or (prices.boxes[0] if len(prices.boxes) == 1 else None)
    if box is None:
        notes.append(f"{prices.path}: no [[box]] whose match is in the label {label!r}")
        return out
    out["prices"] = {"file": prices.path, "box": box.name or box.match, "currency": prices.currency,
                     "source": box.source or prices.source}
    if out["mean_power_w"] is not None:
        power_w, power_from = out["mean_power_w"], "measured (NVML, mean over the soak)"
    elif box.power_w is not None:
        power_w, power_from = box.power_w * box.cards, "price file (power_w x cards), not measured"
    else:
        power_w, power_from = None, "unknown"
    hours = prices.hours_per_year * prices.years
    per_h = {"capital": box.capital / hours, "operations": box.operations_per_year / prices.hours_per_year,
             "power": None if power_w is None else power_w / 1000.0 * prices.power_price_per_kwh}
    tok_s = lat.get("output_tokens_per_s") if lat.get("present") else None
    if tok_s and power_w is not None:
        hourly = sum(v for v in per_h.values() if v is not None)
        out["per_million_tokens"] = {"cost": hourly / (tok_s * 3600.0) * 1e6, "output_tokens_per_s": tok_s,
                                     "hourly": hourly, "hourly_parts": per_h, "power_w": power_w,
                                     "power_from": power_from}
    elif not tok_s:
        notes.append("no soak throughput: no $/M tokens")
    observed_h = svc.get("observed_h") or 0.0
    outages = svc.get("failures_unplanned") or 0
    per_month = outages / observed_h * HOURS_PER_MONTH if observed_h > 0 else None
    energy_cost = None if power_w is None else power_w / 1000.0 * hours * prices.power_price_per_kwh
    downtime = None if per_month is None else per_month * prices.years * 12 * box.downtime_cost_per_outage
    parts = {"cards": box.cards * box.card_price, "host": box.host_price, "psu_cooling": box.psu_cooling_price,
             "power": energy_cost, "operations": box.operations_per_year * prices.years, "downtime": downtime}
    out["tco"] = {"years": prices.years, "total": None if None in parts.values() else sum(v for v in parts.values() if v is not None),
                  "parts": parts, "power_w": power_w, "power_from": power_from,
                  "outages_per_month": per_month, "outages_from": f"{outages} unplanned in {observed_h:.3g} h observed"}
    return out


def headline(c: dict[str, Any]) -> str:
    bits = []
    if c["tokens_per_kwh"] is not None:
        bits.append(f"{c['tokens_per_kwh']:,.0f} output tokens/kWh ({c['mean_power_w']:.0f} W mean)")
    p = c.get("prices")
    if c["per_million_tokens"] is not None and p:
        bits.append(f"{c['per_million_tokens']['cost']:,.2f} {p['currency']}/M tokens at the soak's load")
    if c["tco"] is not None and c["tco"]["total"] is not None and p:
        bits.append(f"{c['tco']['years']:g}-year TCO {c['tco']['total']:,.0f} {p['currency']} ({p['box']})")
    return "; ".join(bits) if bits else "; ".join(c["notes"]) or "-"
