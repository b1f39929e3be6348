"""What a run's machines cost, shared by both sides of speedrun.

The job layer (speedrun.cluster) knows the machines and their price: the AWS provider from the
Price List API, its table or the spot price history; any provider from `--price-per-hour`. It
hands the price to every process it starts in PRICE_ENV; the trainer records it in
results.json with what the run cost (`cost_fields`). The cluster wing imports nothing of the
trainer, so the one type both sides need lives here, below both.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from speedrun.errors import SpeedrunError
from speedrun.inputs import USD_PER_HOUR

PRICE_ENV = "SPEEDRUN_PRICE"  # the variable holding a launched run's Price, as JSON
NO_PRICE = ("no price: the machines' price is unknown (launch through the AWS provider, or give "
            "--price-per-hour to speedrun launch)")


@dataclass(frozen=True)
class Price:
    """What a run's machines cost per hour."""

    machine_type: str  # e.g. "p4d.24xlarge", or the provider's name for machines it did not start
    market: str  # "on-demand", "spot" or "given" (a price the user gave)
    machines: int  # machines the run holds (several tasks on one machine count once)
    usd_per_hour: float  # $ per machine-hour
    source: str  # where the price comes from, e.g. "AWS Price List API, 2026-12-02"

    def cost(self, seconds: float) -> float:
        """$ for all the machines over `seconds` of wall time."""
        return self.machines * self.usd_per_hour * seconds / 3600

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Price:
        """A Price from its dict (results.json, a checkpoint, PRICE_ENV); SpeedrunError if it is not one."""
        try:
            price = cls(str(data["machine_type"]), str(data["market"]), int(data["machines"]),
                        float(data["usd_per_hour"]), str(data["source"]))
        except (KeyError, TypeError, ValueError):
            raise SpeedrunError(f"not a price: {dict(data) if isinstance(data, Mapping) else data!r}") from None
        check_price(price.usd_per_hour, "a price per machine-hour")
        if price.machines < 1:
            raise SpeedrunError(f"a price needs at least one machine, got {price.machines}")
        return price


def check_price(usd_per_hour: float, what: str = "--price-per-hour") -> float:
    """A price per machine-hour as given ($, within USD_PER_HOUR), or SpeedrunError."""
    if not USD_PER_HOUR.holds(usd_per_hour):
        raise SpeedrunError(f"{what} must be {USD_PER_HOUR} ($ per machine-hour), got {usd_per_hour!r}")
    return usd_per_hour


def price_from_env(environ: Mapping[str, str] = os.environ) -> Price | None:
    """The price the job layer gave this process (PRICE_ENV), None when it gave none."""
    text = environ.get(PRICE_ENV)
    if not text:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        raise SpeedrunError(f"{PRICE_ENV} is not JSON: {text[:80]!r}") from None
    if not isinstance(data, dict):
        raise SpeedrunError(f"{PRICE_ENV} is not a price: {text[:80]!r}")
    return Price.from_dict(data)


def cost_fields(price: Price | None, billed_s: float, to_target_s: float | None) -> dict[str, Any]:
    """results.json's money: the price, machine-hours and $ for `billed_s` seconds of wall time
    (the run's time and what interruptions lost), and $ to the target for `to_target_s` (None:
    not reached). Without a price every amount is None and `price_note` says why: never a zero
    that reads as a price."""
    if price is None:
        return {"price": None, "price_note": NO_PRICE, "billed_s": billed_s, "machine_hours": None,
                "cost_usd": None, "cost_to_target_usd": None}
    return {"price": asdict(price), "price_note": None, "billed_s": billed_s,
            "machine_hours": price.machines * billed_s / 3600, "cost_usd": price.cost(billed_s),
            "cost_to_target_usd": price.cost(to_target_s) if to_target_s is not None else None}
