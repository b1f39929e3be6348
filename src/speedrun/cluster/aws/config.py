"""The AWS provider's settings and names: AWSConfig (make_job's options for provider="aws"), the
tags by which speedrun finds what it made again, and the fixed names it gives things."""
from __future__ import annotations

import functools
import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from speedrun.errors import SpeedrunError
from speedrun.inputs import Bound

MANAGED = "speedrun:managed"  # tag on everything speedrun makes; only such things are ever changed or removed
JOB_TAG, TASK_TAG = "speedrun:job", "speedrun:task"
# On instances launched into the job's placement group: the group is in their zone (the group's zone
# cannot be read back from every API, and a cluster placement group holds one zone only).
GROUP_TAG = "speedrun:placement-group"
RESOURCE = "speedrun"  # the name of the shared resources (VPC, subnets, security group)
DEFAULT_IMAGE = "Deep Learning OSS Nvidia Driver AMI GPU PyTorch * (Ubuntu 22.04) *"
LIVE_STATES = ("pending", "running", "stopping", "stopped")
DATA_DEVICE = "/dev/sdf"  # where the data volume is attached (Nitro instances show it as an NVMe device)
# The widest ranges ssh_cidr may admit without ssh_cidr_allow_wide: a site's or a company's network,
# never a good part of the internet (the rule is meant for the user's own address).
WIDEST_SSH_PREFIX = {4: 16, 6: 48}
EFA_CHOICES = ("auto", "on", "off")
DISK_GB = Bound(int, 8, 16_384)  # GiB: a gp3 root volume's sizes
AUTOSTOP_MIN = Bound(float, 1, 43_200)  # idle minutes before a host stops: a minute to 30 days


@dataclass(frozen=True)
class AWSConfig:
    """make_job's options for provider="aws" (the CLI's `--instance-type`, `--spot`...).

    instance_type: EC2 type, e.g. p5.48xlarge (8 H100s).
    image: an AMI id (ami-...) or a name pattern with * (the newest match of `image_owner`).
    spot: spot instead of on-demand; on_demand_fallback: use on-demand when no zone has spot capacity.
    placement_group: launch into a cluster placement group of the job's own (fast links between hosts).
    efa: "auto": launch with an EFA interface on every network card where the type has EFA (p4d,
        p5...; see efa.py), and have NCCL use it; "on": the same, refusing a type without EFA; "off": one
        ordinary interface.
    shared_storage: an EFS file system mounted at `efs_mount` on every host, the default run root.
    region: None: AWS_REGION / AWS_DEFAULT_REGION / the AWS config's, else us-east-1.
    zone: launch there only; None: the region's zones in turn until one has capacity.
    disk_gb: root volume size, GiB.
    ssh_user: the image's login user (ubuntu for Ubuntu images, ec2-user for Amazon Linux).
    ssh_cidr: addresses admitted to SSH; None: this machine's public address (/32), looked up once
        per launch (or the VPC's own range with private_ips). At most a /16 (IPv6: a /48) unless
        ssh_cidr_allow_wide; never the whole internet (/0).
    private_ips: reach hosts at their private addresses (when launching from inside the VPC).
    vpc_cidr: the VPC's range when speedrun makes it; each zone gets a sixteenth of it.
    data_snapshot: an EBS snapshot id; each instance gets a volume made from it, mounted read-only at
        `data_mount`. data_s3: an s3:// prefix synced to `data_mount` when a host is prepared (the
        instances need `instance_profile`, an IAM instance profile allowed to read it).
    autostop: stop (spot: terminate) a host after this many minutes with no job command running.
    boot_timeout: seconds to wait for a new instance to answer SSH.
    """

    instance_type: str = "p5.48xlarge"
    image: str = DEFAULT_IMAGE
    image_owner: str = "amazon"
    spot: bool = False
    on_demand_fallback: bool = False
    placement_group: bool = True
    efa: str = "auto"
    shared_storage: bool = True
    region: str | None = None
    zone: str | None = None
    disk_gb: int = 500
    ssh_user: str = "ubuntu"
    ssh_cidr: str | None = None
    ssh_cidr_allow_wide: bool = False
    private_ips: bool = False
    vpc_cidr: str = "10.210.0.0/16"
    efs_mount: str = "/mnt/efs"
    data_snapshot: str | None = None
    data_s3: str | None = None
    data_mount: str = "/mnt/data"
    instance_profile: str | None = None
    autostop: float | None = None
    boot_timeout: float = 600.0

    def __post_init__(self) -> None:
        # Checked here, offline, before any credentials are looked up or anything is made.
        if self.instance_type not in ec2_instance_types():
            raise SpeedrunError(f"unknown instance type {self.instance_type!r}: not an EC2 type botocore knows (a type "
                                "newer than botocore needs `pip install -U botocore`), e.g. p5.48xlarge, p4d.24xlarge")
        if self.on_demand_fallback and not self.spot:
            raise SpeedrunError("on_demand_fallback is a fallback for spot instances: add --spot (spot=True), or "
                                "leave it out for on-demand instances")
        object.__setattr__(self, "vpc_cidr", check_vpc_cidr(self.vpc_cidr))
        if not DISK_GB.holds(self.disk_gb):
            raise SpeedrunError(f"disk_gb must be {DISK_GB} (GiB), got {self.disk_gb!r}")
        if self.efa not in EFA_CHOICES:
            raise SpeedrunError(f"efa must be one of {', '.join(EFA_CHOICES)}, got {self.efa!r}")
        if self.efa == "on" and has_efa(self.instance_type) is False:
            raise SpeedrunError(f"--efa on: {self.instance_type} has no EFA; use a type that has it (p4d.24xlarge, "
                                f"p5.48xlarge...) or --efa auto")
        if self.autostop is not None and not AUTOSTOP_MIN.holds(self.autostop):
            raise SpeedrunError(f"autostop must be {AUTOSTOP_MIN} (minutes), got {self.autostop!r}")
        if self.ssh_cidr is not None:  # as AWS wants it: a network with its prefix
            object.__setattr__(self, "ssh_cidr", check_ssh_cidr(self.ssh_cidr, self.ssh_cidr_allow_wide))
        for path in (self.efs_mount, self.data_mount):
            if not path.startswith("/"):
                raise SpeedrunError(f"mount paths must be absolute, got {path!r}")
        if self.data_s3 is not None and not self.data_s3.startswith("s3://"):
            raise SpeedrunError(f"data_s3 must be an s3:// URL, got {self.data_s3!r}")


def check_vpc_cidr(cidr: str) -> str:
    """The VPC's range as a network, checked: IPv4 from /16 to /24 (AWS's VPC sizes are /16 to /28,
    and each of up to 16 zones gets a sixteenth, at least the /28 a subnet needs)."""
    try:
        net = ipaddress.ip_network(cidr, strict=False)
    except ValueError:
        raise SpeedrunError(f"bad vpc_cidr {cidr!r}: write an IPv4 range such as 10.210.0.0/16") from None
    if net.version != 4 or not 16 <= net.prefixlen <= 24:
        raise SpeedrunError(f"vpc_cidr {cidr}: give an IPv4 range from /16 to /24 (each zone's subnet is a "
                            "sixteenth of it, and AWS's smallest subnet is a /28)")
    return str(net)


# The on-demand price table (a fallback), the GPUs of the GPU instance types (for projections) and
# which types have EFA (for offline checks): dated, with their sources, inside.
INSTANCE_TYPES = json.loads(Path(__file__).with_name("instance_types.json").read_text())


def has_efa(instance_type: str) -> bool | None:
    """Whether the type has EFA by the table in instance_types.json; None for a type it does not list
    (newer than the table: AWS is asked)."""
    table = INSTANCE_TYPES["efa"]
    if instance_type in table["with_efa"]:
        return True
    return False if instance_type in table["without_efa"] else None


@functools.cache
def ec2_instance_types() -> frozenset[str]:
    """Every instance type botocore's EC2 model names: read from the installed package, offline."""
    import botocore.session

    return frozenset(botocore.session.get_session().get_service_model("ec2").shape_for("InstanceType").enum)


def check_ssh_cidr(cidr: str, allow_wide: bool = False) -> str:
    """The CIDR as a network (a bare address becomes a /32 or /128), checked: never the whole
    internet, and no wider than WIDEST_SSH_PREFIX unless `allow_wide`."""
    try:
        net = ipaddress.ip_network(cidr, strict=False)
    except ValueError:
        raise SpeedrunError(f"bad ssh_cidr {cidr!r}: write an address range such as 198.51.100.7/32") from None
    if net.prefixlen == 0:
        raise SpeedrunError(f"ssh_cidr {cidr} would open SSH to the whole internet; speedrun admits only your address"
                            + (" (--ssh-cidr-allow-wide does not change that)" if allow_wide else ""))
    widest = WIDEST_SSH_PREFIX[net.version]
    if net.prefixlen < widest and not allow_wide:
        count = f"2^{net.max_prefixlen - net.prefixlen}" + (f" ({net.num_addresses:,})" if net.version == 4 else "")
        raise SpeedrunError(f"--ssh-cidr {cidr} would admit {count} addresses to SSH; speedrun admits your address, "
                            f"or a network of at most /{widest}: if you mean it, add --ssh-cidr-allow-wide "
                            f"(ssh_cidr_allow_wide=True)")
    return str(net)


def placement_group_name(job: str) -> str:
    """The name of job `job`'s cluster placement group."""
    return f"{RESOURCE}-{job}"


# --- tags: what speedrun made, and for which job and task ---
def tags(name: str, **extra: str) -> list[dict[str, str]]:
    """The tags of a thing speedrun makes: its Name, the managed tag, and `extra`."""
    return [{"Key": "Name", "Value": name}, {"Key": MANAGED, "Value": "true"},
            *({"Key": k, "Value": v} for k, v in extra.items())]


def tag_spec(kind: str, name: str, **extra: str) -> list[dict[str, Any]]:
    """TagSpecifications for making a thing of `kind` (vpc, subnet...) with `tags`."""
    return [{"ResourceType": kind, "Tags": tags(name, **extra)}]


def tag_value(resource: Mapping[str, Any], key: str) -> str | None:
    """The value of tag `key` on a resource as AWS describes it; None when it has none."""
    return next((t["Value"] for t in resource.get("Tags", []) if t["Key"] == key), None)


MANAGED_FILTER = {"Name": f"tag:{MANAGED}", "Values": ["true"]}
