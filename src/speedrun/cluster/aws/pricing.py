"""What the AWS provider's instances cost and which vCPU quota a launch ran into (`quota_message`).

Prices, $ per instance-hour: on-demand from the AWS Price List API (`listed_price`; GetProducts,
Linux, shared tenancy), and from the table in instance_types.json (its date and source inside)
only when that API cannot be reached or does not list the type; spot from the spot price
history of the instance's zone. `job_billing` is a job's running instances priced (for `speedrun
ls` and the runs' results.json); `offer_price` a type's price before anything runs (projections).
"""
from __future__ import annotations

import datetime as dt
import json
import logging
from typing import Any, Iterable

from speedrun.cluster.aws.api import Session, aws_errors, error_code
from speedrun.cluster.aws.config import INSTANCE_TYPES, AWSConfig
from speedrun.cluster.provider import Billing
from speedrun.errors import SpeedrunError
from speedrun.money import Price

log = logging.getLogger("speedrun.cluster")
PRICES_AS_OF = INSTANCE_TYPES["as_of"]
PRICE_LIST_SOURCE = "AWS Price List API"


# The vCPU quotas run_instances runs into, by instance family: (on-demand quota, spot quota), each
# (name, code) as Service Quotas shows them. Families not listed count against the standard ones.
QUOTAS = {
    "p": (("Running On-Demand P instances", "L-417A185B"), ("All P Spot Instance Requests", "L-7212CCBC")),
    "g": (("Running On-Demand G and VT instances", "L-DB2E81BA"),
          ("All G and VT Spot Instance Requests", "L-3819A6DF")),
}
STANDARD_QUOTAS = (("Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances", "L-1216C47A"),
                   ("All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests", "L-34B43A08"))


def instance_vcpus(s: Session, instance_type: str) -> int | None:
    """The vCPUs of one instance of the type (None when AWS does not say)."""
    try:
        return s.ec2.describe_instance_types(
            InstanceTypes=[instance_type])["InstanceTypes"][0]["VCpuInfo"]["DefaultVCpus"]
    except Exception:  # only for a message: the quota error is what matters
        return None


def table_price(region: str, instance_type: str) -> float | None:
    """The on-demand table's $ per hour (instance_types.json), None where it has none."""
    return INSTANCE_TYPES["on_demand_usd_per_hour"].get(region, {}).get(instance_type)


def price_list_price(s: Session, instance_type: str) -> float | None:
    """On-demand $ per hour of Linux `instance_type` in the session's region, as the Price List
    API lists it; None where it lists none. Raises what botocore raises when it cannot be reached."""
    filters = {"instanceType": instance_type, "regionCode": s.region, "operatingSystem": "Linux",
               "tenancy": "Shared", "preInstalledSw": "NA", "capacitystatus": "Used"}
    reply = s.pricing().get_products(
        ServiceCode="AmazonEC2", MaxResults=10,
        Filters=[{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in filters.items()])
    for item in reply.get("PriceList", []):
        product = json.loads(item) if isinstance(item, str) else item
        for term in product.get("terms", {}).get("OnDemand", {}).values():
            for dimension in term.get("priceDimensions", {}).values():
                usd = float(dimension.get("pricePerUnit", {}).get("USD", 0))
                if usd > 0:
                    return usd
    return None


def listed_price(s: Session, instance_type: str) -> tuple[float, str] | None:
    """On-demand $ per hour of `instance_type` and where it comes from: the Price List API, else
    (not reachable, or not listed there) the table; None when neither has it. Asked once per
    session and type."""
    key = ("on-demand", instance_type)
    if key not in s.prices:
        try:
            usd = price_list_price(s, instance_type)
        except Exception as e:  # noqa: BLE001 - any failure to reach it: the table is the fallback
            log.info("the AWS Price List API did not answer (%s); using the table of %s", type(e).__name__,
                     PRICES_AS_OF)
            usd = None
        s.prices[key] = ((usd, f"{PRICE_LIST_SOURCE}, {dt.date.today().isoformat()}") if usd is not None
                         else table_offer(s.region, instance_type))
    return s.prices[key]


def table_offer(region: str, instance_type: str) -> tuple[float, str] | None:
    """The table's on-demand $ per hour and its source line; None where it has none."""
    usd = table_price(region, instance_type)
    return (usd, f"on-demand table of {PRICES_AS_OF}") if usd is not None else None


def spot_price(s: Session, instance_type: str, zone: str) -> float | None:
    """The latest spot $ per hour of `instance_type` in `zone` (the spot price history)."""
    with aws_errors("read the spot price history"):
        history = s.ec2.describe_spot_price_history(
            InstanceTypes=[instance_type], AvailabilityZone=zone,
            ProductDescriptions=["Linux/UNIX", "Linux/UNIX (Amazon VPC)"], StartTime=dt.datetime.now(dt.timezone.utc),
        )["SpotPriceHistory"]
    return float(max(history, key=lambda h: h["Timestamp"])["SpotPrice"]) if history else None


def offer_price(s: Session, instance_type: str, spot: bool) -> Price | None:
    """What one `instance_type` would cost now, before any runs: on-demand as listed_price; spot,
    the cheapest zone's latest spot price in the region. None: no price known."""
    if not spot:
        listed = listed_price(s, instance_type)
        return Price(instance_type, "on-demand", 1, *listed) if listed else None
    zones = s.zones()
    prices = {z: spot_price(s, instance_type, z) for z in zones}
    known = {z: p for z, p in prices.items() if p is not None}
    if not known:
        return None
    zone = min(known, key=known.get)
    return Price(instance_type, "spot", 1, known[zone],
                 f"spot price history, {zone} (cheapest of {len(zones)} zones), {dt.date.today().isoformat()}")


def gpus_of(instance_type: str) -> tuple[int, str] | None:
    """How many GPUs of which kind ("A100") one instance of the type has; None: not in the table."""
    found = INSTANCE_TYPES["gpus"].get(instance_type)
    return (int(found[0]), str(found[1])) if found else None


def offer_prices(instance_types: list[str], spot: bool) -> tuple[dict[str, Price | None], str]:
    """What one instance of each type costs now, and a line saying where the prices come from:
    with AWS credentials, offer_price (the Price List API or spot history); without, the
    on-demand table (no spot prices then)."""
    try:
        s = Session(None)
    except SpeedrunError as e:  # no boto3 or no credentials: the table is what there is
        if spot:
            return dict.fromkeys(instance_types), f"no spot prices without AWS access ({e})"
        offers = {t: table_offer("us-east-1", t) for t in instance_types}
        return ({t: Price(t, "on-demand", 1, *offer) if offer else None for t, offer in offers.items()},
                f"the on-demand table of {PRICES_AS_OF}, us-east-1 (no AWS access: {e})")
    prices = {t: offer_price(s, t, spot) for t in instance_types}
    sources = sorted({p.source for p in prices.values() if p is not None})
    return prices, f"{s.region}: " + ("; ".join(sources) or "none found")


def quota_message(s: Session, instance_type: str, market: str, n: int, error: Exception) -> str:
    """The one line for a launch of `n` x `instance_type` refused for a vCPU quota: which quota, in
    which region, and how many vCPUs were asked for."""
    family = instance_type.split(".")[0].lower()
    on_demand, spot = QUOTAS["g" if family.startswith("vt") else family[:1]] if family[:1] in QUOTAS or \
        family.startswith("vt") else STANDARD_QUOTAS
    name, code = spot if market == "spot" else on_demand
    vcpus = instance_vcpus(s, instance_type)
    asked = f"{n} x {instance_type} = {n * vcpus} vCPUs" if vcpus else f"{n} x {instance_type}"
    return (f"the vCPU quota '{name}' ({code}) in {s.region} is too small for {asked} "
            f"({error_code(error)}); ask AWS for more: Service Quotas > Amazon EC2 > {name}")


def job_billing(s: Session, config: AWSConfig, instances: Iterable[dict[str, Any]]) -> Billing:
    """What a job's running instances cost: their count, price per hour and cost so far, each
    priced as its market is (a spot job's replacement may have come on demand)."""
    running = [i for i in instances if i["State"]["Name"] == "running"]
    now = dt.datetime.now(dt.timezone.utc)
    ups = [(now - i["LaunchTime"]).total_seconds() for i in running]
    prices, sources = [], []
    for i in running:
        if i.get("InstanceLifecycle") == "spot":
            zone = i["Placement"]["AvailabilityZone"]
            prices.append(spot_price(s, i["InstanceType"], zone))
            source = f"spot price history, {zone}, {now:%Y-%m-%d %H:%M} UTC"
        else:
            listed = listed_price(s, i["InstanceType"])
            prices.append(listed[0] if listed else None)
            source = listed[1] if listed else f"no on-demand price for {i['InstanceType']} in {s.region}"
        sources += [source] if source not in sources else []
    spot = config.spot or any(i.get("InstanceLifecycle") == "spot" for i in running)
    billing = Billing(config.instance_type, "spot" if spot else "on-demand", len(running), max(ups, default=0.0),
                      None, None, "; ".join(sources) or "no instance running")
    if running and all(p is not None for p in prices):
        billing.price_per_hour = sum(prices)
        billing.cost = sum(p * u / 3600 for p, u in zip(prices, ups))
    return billing
