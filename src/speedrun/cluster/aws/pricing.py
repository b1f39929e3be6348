"""What the AWS provider's instances cost (`job_billing`, for `speedrun ls`) and which vCPU quota a
launch ran into (`quota_message`): the on-demand price table, the spot price history, the quotas."""
from __future__ import annotations

import datetime as dt
from typing import Any, Iterable

from speedrun.cluster.aws.api import Session, aws_errors, error_code
from speedrun.cluster.aws.config import AWSConfig
from speedrun.cluster.provider import Billing

# On-demand Linux prices, $ per instance-hour, as AWS's on-demand pricing page listed them (after
# the June 2025 P4/P5 price cut; not re-checked since). Spot prices come from the spot price history.
PRICES_AS_OF = "2025-06"
ON_DEMAND_PRICES: dict[str, dict[str, float]] = {
    "us-east-1": {
        "p5.48xlarge": 55.04, "p5en.48xlarge": 63.30, "p4d.24xlarge": 21.96, "p3.16xlarge": 24.48,
        "p3.2xlarge": 3.06, "g6e.xlarge": 1.861, "g6.xlarge": 0.8048, "g5.xlarge": 1.006, "g4dn.xlarge": 0.526,
        "c5.large": 0.085, "m5.large": 0.096, "t3.micro": 0.0104, "t3.large": 0.0832,
    },
}

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


def instance_price(s: Session, inst: dict[str, Any]) -> float | None:
    """$ per hour of one instance: its zone's latest spot price, or the on-demand table's."""
    if inst.get("InstanceLifecycle") != "spot":
        return ON_DEMAND_PRICES.get(s.region, {}).get(inst["InstanceType"])
    with aws_errors("read the spot price history"):
        history = s.ec2.describe_spot_price_history(
            InstanceTypes=[inst["InstanceType"]], AvailabilityZone=inst["Placement"]["AvailabilityZone"],
            ProductDescriptions=["Linux/UNIX", "Linux/UNIX (Amazon VPC)"], StartTime=dt.datetime.now(dt.timezone.utc),
        )["SpotPriceHistory"]
    return float(max(history, key=lambda h: h["Timestamp"])["SpotPrice"]) if history else None



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
    """What a job's running instances cost: their count, price per hour and cost so far."""
    c = config
    running = [i for i in instances if i["State"]["Name"] == "running"]
    market = "spot" if c.spot else "on-demand"
    if any(i.get("InstanceLifecycle") == "spot" for i in running):
        market = "spot"
    now = dt.datetime.now(dt.timezone.utc)
    ups = [(now - i["LaunchTime"]).total_seconds() for i in running]
    prices = [instance_price(s, i) for i in running]
    source = "spot price history" if market == "spot" else f"on-demand table of {PRICES_AS_OF}"
    if any(p is None for p in prices):
        return Billing(c.instance_type, market, len(running), max(ups, default=0.0), None, None, source)
    return Billing(c.instance_type, market, len(running), max(ups, default=0.0), sum(prices),
                   sum(p * u / 3600 for p, u in zip(prices, ups)), source)
