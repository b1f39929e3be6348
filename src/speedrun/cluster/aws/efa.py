"""EFA (Elastic Fabric Adapter): the AWS network that lets NCCL reach full speed between machines.

An instance type with EFA (p4d.24xlarge: 4 x 100 Gbit/s; p5.48xlarge: 32 network cards,
3,200 Gbit/s) moves NCCL's traffic over it only when it was launched with EFA interfaces, one per
network card, inside a cluster placement group, and NCCL uses the EFA provider of libfabric
(aws-ofi-nccl, in the AWS Deep Learning AMIs). Launched with one ordinary interface, NCCL falls
back to TCP sockets without a word and a 16-GPU job scales like a slow cluster.

- `type_network`: what DescribeInstanceTypes says of a type's network (cards, EFA interfaces,
  bandwidth), asked once per session and type.
- `wants_efa`: whether a launch uses it (config.efa: auto = where the type has it; on = required).
- `efa_interfaces`: RunInstances' NetworkInterfaces: an EFA interface on every network card (card 0
  at device index 0, the others at 1, as AWS documents for p4d and p5), at most the type's
  MaximumEfaInterfaces.
- AWS gives no automatic public address to an instance with several interfaces: `attach_public_addresses`
  gives each one an Elastic IP (tagged like everything speedrun makes), `release_addresses` gives them back.
- `efa_environment`: what NCCL needs on such hosts; `efa_check_script`: host preparation's check
  that libfabric's EFA provider is there (`fi_info -p efa`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable

from speedrun.cluster.aws.api import Session, aws_errors
from speedrun.cluster.aws.config import JOB_TAG, TASK_TAG, AWSConfig, tag_spec, tag_value
from speedrun.errors import SpeedrunError

log = logging.getLogger("speedrun.cluster")

# Families whose GPUs read and write EFA directly (GPUDirect RDMA); others with EFA go through host memory.
RDMA_FAMILIES = ("p4d", "p4de", "p5", "p5e", "p5en", "p6-b200", "p6e-gb200")
# Where the EFA installer (and the Deep Learning AMIs) put libfabric's tools.
EFA_BIN = "/opt/amazon/efa/bin"


@dataclass(frozen=True)
class TypeNetwork:
    """An instance type's network as DescribeInstanceTypes gives it."""

    instance_type: str
    cards: int  # network cards
    efa_interfaces: int  # at most this many EFA interfaces; 0: no EFA
    gbps: float  # all cards' baseline bandwidth together, Gbit/s

    @property
    def source(self) -> str:
        return f"{self.instance_type}: {self.cards} network card(s), {self.gbps:g} Gbit/s in all"


def type_network(s: Session, instance_type: str) -> TypeNetwork:
    """What AWS says of the type's network (asked once per session and type)."""
    if instance_type not in s.networks:
        with aws_errors(f"describe instance type {instance_type}"):
            found = s.ec2.describe_instance_types(InstanceTypes=[instance_type])["InstanceTypes"]
        if not found:
            raise SpeedrunError(f"AWS has no instance type {instance_type!r} in {s.region}")
        info = found[0].get("NetworkInfo", {})
        cards = info.get("NetworkCards") or [{}]
        efa = info.get("EfaInfo", {}).get("MaximumEfaInterfaces", 1) if info.get("EfaSupported") else 0
        s.networks[instance_type] = TypeNetwork(instance_type, len(cards), efa,
                                    sum(c.get("BaselineBandwidthInGbps", 0.0) for c in cards))
    return s.networks[instance_type]


def wants_efa(config: AWSConfig, net: TypeNetwork) -> bool:
    """Whether instances of `net`'s type are launched with EFA: config.efa "auto" where the type
    has it, "on" always (SpeedrunError for a type without it), "off" never."""
    if config.efa == "on" and not net.efa_interfaces:
        raise SpeedrunError(f"--efa on: {net.instance_type} has no EFA; use a type that has it (p4d.24xlarge, "
                            f"p5.48xlarge...) or --efa auto")
    return config.efa != "off" and net.efa_interfaces > 0


def interface_count(net: TypeNetwork) -> int:
    """EFA interfaces an instance of the type is launched with: one per network card, up to its limit."""
    return max(1, min(net.cards, net.efa_interfaces))


def efa_interfaces(net: TypeNetwork, subnet: str, security_group: str, *, public: bool) -> list[dict[str, Any]]:
    """RunInstances' NetworkInterfaces for an EFA launch (interface_count of them); public: the
    single interface asks for a public address (AWS refuses that with several: see
    needs_elastic_ip)."""
    count = interface_count(net)
    interfaces = [{"NetworkCardIndex": card, "DeviceIndex": 0 if card == 0 else 1, "InterfaceType": "efa",
                   "SubnetId": subnet, "Groups": [security_group], "DeleteOnTermination": True}
                  for card in range(count)]
    if public and count == 1:
        interfaces[0]["AssociatePublicIpAddress"] = True
    return interfaces


def needs_elastic_ip(net: TypeNetwork, public: bool) -> bool:
    """Whether EFA instances of the type need an Elastic IP to be reached at a public address."""
    return public and interface_count(net) > 1


def attach_public_addresses(s: Session, job: str, instances: Iterable[dict[str, Any]]) -> None:
    """Give each running instance without a public address an Elastic IP on its primary interface
    (device index 0), tagged with the job and task so that down and replacements release it."""
    for inst in instances:
        if inst.get("PublicIpAddress"):
            continue
        primary = next(n for n in inst["NetworkInterfaces"] if n["Attachment"]["DeviceIndex"] == 0)
        task = tag_value(inst, TASK_TAG) or ""
        with aws_errors(f"give {inst['InstanceId']} a public address"):
            address = s.ec2.allocate_address(Domain="vpc", TagSpecifications=tag_spec(
                "elastic-ip", f"{job}-{task}", **{JOB_TAG: job, TASK_TAG: task}))
            s.ec2.associate_address(AllocationId=address["AllocationId"],
                                    NetworkInterfaceId=primary["NetworkInterfaceId"])
        log.info("%s: public address %s (an Elastic IP: an instance with several interfaces gets none "
                 "of its own)", inst["InstanceId"], address["PublicIp"])


def release_addresses(s: Session, job: str, tasks: Iterable[int] | None = None) -> list[str]:
    """Release the Elastic IPs of the job's `tasks` (None: all of them); their addresses."""
    wanted = None if tasks is None else {str(t) for t in tasks}
    with aws_errors(f"release the public addresses of job {job}"):
        found = s.ec2.describe_addresses(Filters=[{"Name": f"tag:{JOB_TAG}", "Values": [job]}])["Addresses"]
        gone = [a for a in found if wanted is None or tag_value(a, TASK_TAG) in wanted]
        for a in gone:
            if a.get("AssociationId"):
                s.ec2.disassociate_address(AssociationId=a["AssociationId"])
            s.ec2.release_address(AllocationId=a["AllocationId"])
    return [a["PublicIp"] for a in gone]


def efa_environment(instance_type: str) -> dict[str, str]:
    """Variables NCCL's EFA plugin (aws-ofi-nccl) needs: libfabric's EFA provider, and GPUDirect
    RDMA where the family has it."""
    env = {"FI_PROVIDER": "efa"}
    if instance_type.split(".")[0] in RDMA_FAMILIES:
        env["FI_EFA_USE_DEVICE_RDMA"] = "1"
    return env


def efa_check_script(instance_type: str) -> str:
    """Bash for host preparation: fail with one line unless libfabric's EFA provider is present."""
    return f"""PATH="$PATH:{EFA_BIN}"
if ! fi_info -p efa >/dev/null 2>&1; then
  echo "speedrun: {instance_type} was launched with EFA but libfabric's EFA provider is missing (fi_info -p efa \
found none): use an image with the EFA driver and aws-ofi-nccl (the AWS Deep Learning AMIs), or --efa off" >&2
  exit 1
fi
"""
