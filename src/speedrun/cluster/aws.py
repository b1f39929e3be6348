"""The AWS provider: EC2 instances that speedrun starts, finds again by name and gives back.

    job = make_job("r50", 2, provider="aws", instance_type="p5.48xlarge", spot=True)

`hosts(n)` for a job, in order:

1. Instances tagged `speedrun:job=<job>` are the job's: running ones are reused (make_job again with
   the same name reconnects), stopped ones started, missing task indices launched.
2. Before launching, the region's shared resources are found by their `speedrun:managed` tag, or
   made once: a VPC (`vpc_cidr`) with an internet gateway and a default route, a subnet per zone
   (the zone's sixteenth of the VPC), a security group admitting SSH from `ssh_cidr` only and all
   traffic between its members (NCCL, NFS), a key pair per region (ed25519, made here; the private
   key stays in $SPEEDRUN_HOME/keys with mode 0600), an EFS file system with a mount target in
   each zone used, and a cluster placement group per job. No rule ever admits 0.0.0.0/0.
3. Launch all missing instances in one zone (placement groups and NCCL want one); on a capacity
   error the next zone is tried; spot falls back to on-demand only when allowed. A replacement for
   a lost instance (`replace`) goes to the job's zone, else the next zone with capacity, there
   outside the job's placement group (which holds one zone). Quota errors
   name the quota and the vCPUs asked for. If anything fails after instances started, they are
   terminated (or, failing that, listed).
4. Wait until each answers SSH. Host keys: the first key an instance speedrun just launched or
   started shows is pinned in speedrun's known_hosts (trust on first use, after removing any key
   left pinned for its reused address); from then on keys are checked strictly.
5. Prepare each host (one idempotent script): EFS mounted at `efs_mount` (the default run root, so
   logs, events and checkpoints outlive the machines), the data volume made from `data_snapshot`
   mounted read-only at `data_mount`, `data_s3` synced there, and the `autostop` watcher.

Every AWS call runs inside awsapi.aws_errors: a failure is one line naming the call, exit status 2
when the user's input or credentials are at fault, 3 when AWS or the way to it failed. `down`
keeps the job's record until everything of the job is gone, so that running it again finishes.

Tested against moto, running as a server on 127.0.0.1 (tests/aws_server.py); nothing in the tests
reaches AWS. docs/aws.md has the user's side: prerequisites, an example, cost, removal.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import ipaddress
import logging
import os
import shlex
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from speedrun.cluster import registry
from speedrun.cluster.awsapi import AWSFailed, NO_CREDENTIALS, aws_errors, boto3_module, error_code, track_calls
from speedrun.cluster.hosts import AbsentHost, Host
from speedrun.cluster.job import parallel
from speedrun.cluster.provider import Billing, Provider
from speedrun.cluster.ssh import HostSpec, SSHHost, SSHOptions
from speedrun.errors import SpeedrunError, last_line
from speedrun.stopping import IMDS_NOTICE_URL, NOTICE_ENV

log = logging.getLogger("speedrun.cluster")

MANAGED = "speedrun:managed"  # tag on everything speedrun makes; only such things are ever changed or removed
JOB_TAG, TASK_TAG = "speedrun:job", "speedrun:task"
# On instances launched into the job's placement group: the group is in their zone (the group's zone
# cannot be read back from every API, and a cluster placement group holds one zone only).
GROUP_TAG = "speedrun:placement-group"
RESOURCE = "speedrun"  # the name of the shared resources (VPC, subnets, security group)
DEFAULT_IMAGE = "Deep Learning OSS Nvidia Driver AMI GPU PyTorch * (Ubuntu 22.04) *"
LIVE_STATES = ("pending", "running", "stopping", "stopped")

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
    "g": (("Running On-Demand G and VT instances", "L-DB2E81BA"), ("All G and VT Spot Instance Requests", "L-3819A6DF")),
}
STANDARD_QUOTAS = (("Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances", "L-1216C47A"),
                   ("All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests", "L-34B43A08"))
CAPACITY_ERRORS = ("InsufficientInstanceCapacity", "InsufficientCapacity", "Unsupported")
# The widest ranges ssh_cidr may admit without ssh_cidr_allow_wide: a site's or a company's network,
# never a good part of the internet (the rule is meant for the user's own address).
WIDEST_SSH_PREFIX = {4: 16, 6: 48}


@dataclass(frozen=True)
class AWSConfig:
    """make_job's options for provider="aws" (the CLI's `--instance-type`, `--spot`...).

    instance_type: EC2 type, e.g. p5.48xlarge (8 H100s).
    image: an AMI id (ami-...) or a name pattern with * (the newest match of `image_owner`).
    spot: spot instead of on-demand; on_demand_fallback: use on-demand when no zone has spot capacity.
    placement_group: launch into a cluster placement group of the job's own (fast links between hosts).
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
        if self.disk_gb < 8:
            raise SpeedrunError(f"disk_gb must be at least 8 (GiB), got {self.disk_gb}")
        if self.autostop is not None and self.autostop <= 0:
            raise SpeedrunError(f"autostop must be a positive number of minutes, got {self.autostop}")
        if self.ssh_cidr is not None:  # as AWS wants it: a network with its prefix
            object.__setattr__(self, "ssh_cidr", check_ssh_cidr(self.ssh_cidr, self.ssh_cidr_allow_wide))
        for path in (self.efs_mount, self.data_mount):
            if not path.startswith("/"):
                raise SpeedrunError(f"mount paths must be absolute, got {path!r}")
        if self.data_s3 is not None and not self.data_s3.startswith("s3://"):
            raise SpeedrunError(f"data_s3 must be an s3:// URL, got {self.data_s3!r}")


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


# --- talking to AWS (awsapi.py: boto3, errors as one line) ---
def tags(name: str, **extra: str) -> list[dict[str, str]]:
    return [{"Key": "Name", "Value": name}, {"Key": MANAGED, "Value": "true"},
            *({"Key": k, "Value": v} for k, v in extra.items())]


def tag_spec(kind: str, name: str, **extra: str) -> list[dict[str, Any]]:
    return [{"ResourceType": kind, "Tags": tags(name, **extra)}]


def tag_value(resource: Mapping[str, Any], key: str) -> str | None:
    return next((t["Value"] for t in resource.get("Tags", []) if t["Key"] == key), None)


MANAGED_FILTER = {"Name": f"tag:{MANAGED}", "Values": ["true"]}


class Session:
    """The EC2 and EFS clients of one region, with the lookups every step needs."""

    def __init__(self, region: str | None):
        boto3 = boto3_module()
        from botocore.config import Config
        with aws_errors("read the AWS configuration"):  # an unknown AWS_PROFILE, a bad region...
            session = boto3.Session()
            self.region = region or session.region_name or "us-east-1"
            if session.get_credentials() is None:
                raise SpeedrunError(NO_CREDENTIALS)
            config = Config(retries={"mode": "standard", "max_attempts": 4})
            self.ec2 = track_calls(session.client("ec2", region_name=self.region, config=config))
            self.efs = track_calls(session.client("efs", region_name=self.region, config=config))

    def instances(self, filters: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Instances matching the filters, in any live state (not shutting down or terminated)."""
        with aws_errors("list instances"):
            pages = self.ec2.get_paginator("describe_instances").paginate(
                Filters=[*filters, {"Name": "instance-state-name", "Values": list(LIVE_STATES)}])
            return [i for page in pages for r in page["Reservations"] for i in r["Instances"]]

    def job_instances(self, job: str) -> dict[int, dict[str, Any]]:
        """The job's live instances by task index (the newest when two claim one index)."""
        found: dict[int, dict[str, Any]] = {}
        for inst in sorted(self.instances([{"Name": f"tag:{JOB_TAG}", "Values": [job]}]), key=lambda i: i["LaunchTime"]):
            task = tag_value(inst, TASK_TAG)
            if task is not None and task.isdigit():
                found[int(task)] = inst
        return found

    def zones(self) -> list[str]:
        """The region's availability zones, in name order (which fixes each one's subnet range)."""
        with aws_errors(f"list the zones of {self.region}"):
            zones = self.ec2.describe_availability_zones(
                Filters=[{"Name": "zone-type", "Values": ["availability-zone"]}])["AvailabilityZones"]
        return sorted(z["ZoneName"] for z in zones)

    def terminate(self, ids: Sequence[str]) -> None:
        """Terminate instances and wait until they are gone."""
        if not ids:
            return
        with aws_errors(f"terminate {', '.join(ids)}"):
            self.ec2.terminate_instances(InstanceIds=list(ids))
            self.ec2.get_waiter("instance_terminated").wait(InstanceIds=list(ids),
                                                             WaiterConfig={"Delay": 5, "MaxAttempts": 120})


# --- shared resources, made once per region and found again by tag ---
@dataclass
class Network:
    vpc: str
    security_group: str
    subnets: dict[str, str]  # zone -> subnet id


def find_network(s: Session) -> Network | None:
    """The region's speedrun VPC with its security group and subnets, if it was made."""
    with aws_errors("look for speedrun's VPC"):
        vpcs = s.ec2.describe_vpcs(Filters=[MANAGED_FILTER])["Vpcs"]
        if not vpcs:
            return None
        vpc = vpcs[0]["VpcId"]
        groups = s.ec2.describe_security_groups(Filters=[{"Name": "vpc-id", "Values": [vpc]},
                                                         {"Name": "group-name", "Values": [RESOURCE]}])["SecurityGroups"]
        subnets = s.ec2.describe_subnets(Filters=[{"Name": "vpc-id", "Values": [vpc]}, MANAGED_FILTER])["Subnets"]
    return Network(vpc, groups[0]["GroupId"] if groups else "", {n["AvailabilityZone"]: n["SubnetId"] for n in subnets})


def ensure_network(s: Session, vpc_cidr: str) -> Network:
    """The VPC, internet gateway, default route and security group (made if missing)."""
    net = find_network(s)
    with aws_errors("make speedrun's VPC"):
        if net is None:
            vpc = s.ec2.create_vpc(CidrBlock=vpc_cidr, TagSpecifications=tag_spec("vpc", RESOURCE))["Vpc"]["VpcId"]
            s.ec2.modify_vpc_attribute(VpcId=vpc, EnableDnsSupport={"Value": True})
            s.ec2.modify_vpc_attribute(VpcId=vpc, EnableDnsHostnames={"Value": True})
            log.info("made VPC %s (%s) in %s", vpc, vpc_cidr, s.region)
            net = Network(vpc, "", {})
        gateways = s.ec2.describe_internet_gateways(
            Filters=[{"Name": "attachment.vpc-id", "Values": [net.vpc]}])["InternetGateways"]
        if gateways:
            gateway = gateways[0]["InternetGatewayId"]
        else:
            gateway = s.ec2.create_internet_gateway(
                TagSpecifications=tag_spec("internet-gateway", RESOURCE))["InternetGateway"]["InternetGatewayId"]
            s.ec2.attach_internet_gateway(InternetGatewayId=gateway, VpcId=net.vpc)
        table = s.ec2.describe_route_tables(Filters=[{"Name": "vpc-id", "Values": [net.vpc]},
                                                     {"Name": "association.main", "Values": ["true"]}])["RouteTables"][0]
        # A route, not a firewall rule: instances reach the internet; what reaches them is the group's business.
        if not any(r.get("DestinationCidrBlock") == "0.0.0.0/0" for r in table["Routes"]):
            s.ec2.create_route(RouteTableId=table["RouteTableId"], DestinationCidrBlock="0.0.0.0/0", GatewayId=gateway)
        if not net.security_group:
            net.security_group = s.ec2.create_security_group(
                GroupName=RESOURCE, Description="speedrun: SSH from its user, all traffic between members",
                VpcId=net.vpc, TagSpecifications=tag_spec("security-group", RESOURCE))["GroupId"]
    return net


def ensure_subnet(s: Session, net: Network, zone: str) -> str:
    """The zone's subnet: the zone's sixteenth of the VPC's range (by its place among the region's zones)."""
    if zone in net.subnets:
        return net.subnets[zone]
    zones = s.zones()
    if zone not in zones:
        raise SpeedrunError(f"there is no zone {zone!r} in {s.region}: use one of {', '.join(zones)}")
    with aws_errors(f"make a subnet in {zone}"):
        vpc = s.ec2.describe_vpcs(VpcIds=[net.vpc])["Vpcs"][0]
        ranges = list(ipaddress.ip_network(vpc["CidrBlock"]).subnets(prefixlen_diff=4))
        subnet = s.ec2.create_subnet(VpcId=net.vpc, AvailabilityZone=zone, CidrBlock=str(ranges[zones.index(zone)]),
                                     TagSpecifications=tag_spec("subnet", f"{RESOURCE}-{zone}"))["Subnet"]["SubnetId"]
        s.ec2.modify_subnet_attribute(SubnetId=subnet, MapPublicIpOnLaunch={"Value": True})
    net.subnets[zone] = subnet
    return subnet


def ensure_ingress(s: Session, group: str, ssh_cidr: str) -> None:
    """The group admits TCP 22 from ssh_cidr and everything from its own members; nothing else is added."""
    with aws_errors(f"set the rules of security group {group}"):
        rules = s.ec2.describe_security_groups(GroupIds=[group])["SecurityGroups"][0]["IpPermissions"]
        members = any(r.get("IpProtocol") == "-1" and any(p["GroupId"] == group for p in r.get("UserIdGroupPairs", []))
                      for r in rules)
        if not members:
            s.ec2.authorize_security_group_ingress(GroupId=group, IpPermissions=[
                {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": group, "Description": "speedrun members"}]}])
        # IPv4 and IPv6 ranges are separate lists, with keys of their own.
        v6 = ipaddress.ip_network(ssh_cidr).version == 6
        ranges, key = ("Ipv6Ranges", "CidrIpv6") if v6 else ("IpRanges", "CidrIp")
        ssh = any(r.get("IpProtocol") == "tcp" and r.get("FromPort") == 22 and
                  any(x[key] == ssh_cidr for x in r.get(ranges, [])) for r in rules)
        if not ssh:
            s.ec2.authorize_security_group_ingress(GroupId=group, IpPermissions=[
                {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22,
                 ranges: [{key: ssh_cidr, "Description": "speedrun: SSH from its user"}]}])
            log.info("security group %s admits SSH from %s", group, ssh_cidr)


def key_path(region: str, config_dir: str | os.PathLike | None) -> Path:
    """Where the private key of the region's key pair is kept (mode 0600)."""
    return registry.speedrun_home(config_dir) / "keys" / f"aws-{region}"


def ensure_key_pair(s: Session, config_dir: str | os.PathLike | None) -> tuple[str, Path]:
    """The region's key pair `speedrun-<region>`: made here with ssh-keygen, its public half
    imported; returns (name, private key path)."""
    name, path = f"speedrun-{s.region}", key_path(s.region, config_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    if not path.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(path)],
                       check=True, stdin=subprocess.DEVNULL)
    path.chmod(0o600)
    public = " ".join(Path(f"{path}.pub").read_text().split()[:2])
    with aws_errors(f"import key pair {name}"):
        found = s.ec2.describe_key_pairs(Filters=[{"Name": "key-name", "Values": [name]}],
                                         IncludePublicKey=True)["KeyPairs"]
        if not found:
            s.ec2.import_key_pair(KeyName=name, PublicKeyMaterial=public.encode(),
                                  TagSpecifications=tag_spec("key-pair", name))
        elif " ".join(found[0].get("PublicKey", "").split()[:2]) != public:
            raise SpeedrunError(f"the key pair {name} in {s.region} is not the key in {path}: delete the key pair "
                                f"(aws ec2 delete-key-pair --key-name {name} --region {s.region}) and launch again")
    return name, path


def ensure_placement_group(s: Session, name: str) -> None:
    with aws_errors(f"make placement group {name}"):
        if not s.ec2.describe_placement_groups(Filters=[{"Name": "group-name", "Values": [name]}])["PlacementGroups"]:
            s.ec2.create_placement_group(GroupName=name, Strategy="cluster",
                                         TagSpecifications=tag_spec("placement-group", name))


def ensure_efs(s: Session, subnet: str, group: str) -> tuple[str, str]:
    """The region's EFS file system and its mount target in `subnet`: (file system id, target address)."""
    token = f"{RESOURCE}-{s.region}"
    with aws_errors("make the EFS file system"):
        systems = s.efs.describe_file_systems(CreationToken=token)["FileSystems"]
        fs = systems[0]["FileSystemId"] if systems else s.efs.create_file_system(
            CreationToken=token, PerformanceMode="generalPurpose", Encrypted=True,
            Tags=tags(token))["FileSystemId"]
        wait_until(lambda: s.efs.describe_file_systems(FileSystemId=fs)["FileSystems"][0]["LifeCycleState"] == "available",
                   300, f"EFS file system {fs} to become available")
        targets = [t for t in s.efs.describe_mount_targets(FileSystemId=fs)["MountTargets"] if t["SubnetId"] == subnet]
        target = targets[0] if targets else s.efs.create_mount_target(FileSystemId=fs, SubnetId=subnet,
                                                                      SecurityGroups=[group])
        wait_until(lambda: s.efs.describe_mount_targets(MountTargetId=target["MountTargetId"])["MountTargets"][0]
                   ["LifeCycleState"] == "available", 300, f"the mount target of {fs} to become available")
    return fs, target["IpAddress"]


def wait_until(ready: Callable[[], bool], timeout: float, what: str, every: float = 3.0) -> None:
    """Poll `ready` until it holds (AWS has no waiter for this), at most timeout seconds."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:  # AWS did not get there: not the user's doing
            raise AWSFailed(f"gave up after {timeout:g} s waiting for {what}")
        time.sleep(every)


def find_image(s: Session, image: str, owner: str) -> dict[str, Any]:
    """The AMI `image` names: by id, or the newest whose name matches the pattern."""
    with aws_errors(f"find image {image}"):
        if image.startswith("ami-"):
            found = s.ec2.describe_images(ImageIds=[image])["Images"]
        else:
            found = s.ec2.describe_images(Owners=[owner], Filters=[{"Name": "name", "Values": [image]},
                                                                  {"Name": "state", "Values": ["available"]}])["Images"]
    if not found:
        raise SpeedrunError(f"no image matches {image!r} (owner {owner}) in {s.region}: give an AMI id or "
                            f"another name pattern (image=, --image)")
    return max(found, key=lambda i: i.get("CreationDate", ""))


def caller_cidr() -> str:
    """This machine's public address as a /32, asked of AWS's checkip service (once per launch)."""
    try:
        with urllib.request.urlopen("https://checkip.amazonaws.com", timeout=10) as r:
            address = r.read().decode().strip()
        return str(ipaddress.ip_network(f"{address}/32"))
    except (OSError, ValueError) as e:
        raise SpeedrunError(f"cannot find this machine's public address ({e}): pass ssh_cidr= "
                            f"(--ssh-cidr) with the addresses allowed to SSH in") from None


# --- the provider ---
class AWSProvider(Provider):
    """EC2 instances for one job; see the module docstring."""

    kind = "aws"

    def __init__(self, job: str, config: AWSConfig, config_dir: str | os.PathLike | None, *, launch: bool):
        self.job, self.config, self.launch = job, config, launch
        self.config_dir = str(registry.speedrun_home(config_dir))
        self._session: Session | None = None
        self._hosts: list[Host] = []
        # The job's placement group, when it has one (recorded: `down` asks for no group otherwise).
        self.group: str | None = self.placement_group_name if config.placement_group else None

    @classmethod
    def from_args(cls, job: str, hosts: Sequence[str], ssh: SSHOptions | None,
                  config_dir: str | os.PathLike | None, options: Mapping[str, Any]) -> AWSProvider:
        if hosts:
            raise SpeedrunError("hosts were given for the aws provider, which starts its own: use provider='ssh'")
        if ssh is not None:
            raise SpeedrunError("ssh options do not apply to the aws provider: it makes its own key and pins host keys")
        known = {f.name for f in dataclasses.fields(AWSConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise SpeedrunError(f"unknown option(s) for provider='aws': {', '.join(unknown)} "
                                f"(known: {', '.join(sorted(known))})")
        return cls(job, AWSConfig(**options), config_dir, launch=True)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> AWSProvider:
        # A record written before ssh_cidr had a bound: its rule is in AWS already, and down must work.
        config = AWSConfig(**{"ssh_cidr_allow_wide": True, **record["config"]})
        provider = cls(record["job"], config, record["config_dir"], launch=False)
        provider.group = record.get("placement_group", provider.group)
        return provider

    def record(self) -> dict[str, Any]:
        config = dataclasses.replace(self.config, region=self.session.region)
        return {"kind": self.kind, "job": self.job, "config": dataclasses.asdict(config), "config_dir": self.config_dir,
                "placement_group": self.group}

    @property
    def session(self) -> Session:
        if self._session is None:
            self._session = Session(self.config.region)
        return self._session

    @property
    def run_root(self) -> str | None:
        return f"{self.config.efs_mount}/runs" if self.config.shared_storage else None

    @property
    def known_hosts(self) -> Path:
        return registry.default_known_hosts(self.config_dir)

    @property
    def placement_group_name(self) -> str:
        return f"{RESOURCE}-{self.job}"

    def hosts(self, count: int) -> list[Host]:
        if self._hosts and len(self._hosts) >= count:
            return self._hosts[:count]
        self._hosts = self.bring_up(count) if self.launch else self.find(count)
        return self._hosts[:count]

    # --- finding ---
    def find(self, count: int) -> list[Host]:
        """Hosts for the job's instances as they are; a missing or stopped one is an AbsentHost."""
        by_task = self.session.job_instances(self.job)
        hosts: list[Host] = []
        for i in range(count):
            inst = by_task.get(i)
            if inst is None:
                hosts.append(AbsentHost(f"task {i}", f"job {self.job} has no instance for task {i} (terminated?)"))
            elif inst["State"]["Name"] != "running":
                hosts.append(AbsentHost(f"{inst['InstanceId']} ({inst['State']['Name']})",
                                        f"instance {inst['InstanceId']} of job {self.job} is {inst['State']['Name']}; "
                                        f"make_job (speedrun launch) again starts it"))
            else:
                hosts.append(self.ssh_host(inst, first_contact=False))
        return hosts

    def ssh_host(self, inst: dict[str, Any], *, first_contact: bool) -> SSHHost:
        address = inst.get("PrivateIpAddress") if self.config.private_ips else inst.get("PublicIpAddress")
        if not address:
            raise SpeedrunError(f"instance {inst['InstanceId']} has no {'private' if self.config.private_ips else 'public'} "
                                f"address; launch from inside the VPC with private_ips=True (--private-ips)")
        return SSHHost(HostSpec(host=address, user=self.config.ssh_user),
                       SSHOptions(known_hosts=self.known_hosts, identity_file=key_path(self.session.region, self.config_dir),
                                  accept_new_host_keys=first_contact))

    # --- bringing up ---
    def bring_up(self, count: int, *, other_zones: bool = False) -> list[Host]:
        """The job's `count` instances running and answering SSH, prepared; launched where missing:
        in the job's zone(s), and with other_zones (a replacement) then the region's other zones in
        name order, unless `zone` pins one."""
        s, c = self.session, self.config
        found = s.job_instances(self.job)
        if any(tag_value(i, GROUP_TAG) or i["Placement"].get("GroupName") == self.placement_group_name
               for i in found.values()):
            self.group = self.placement_group_name  # launched into it earlier, whatever this launch says
        by_task = {i: inst for i, inst in found.items() if i < count}
        existing = len(by_task)
        fresh: set[str] = set()  # instances whose host keys are learned now (launched or started)
        stopped = [inst["InstanceId"] for inst in by_task.values() if inst["State"]["Name"] in ("stopping", "stopped")]
        started: list[str] = []
        if stopped:
            log.info("starting the stopped instance(s) of job %s: %s", self.job, ", ".join(stopped))
            with aws_errors(f"start {', '.join(stopped)}"):
                s.ec2.get_waiter("instance_stopped").wait(InstanceIds=stopped, WaiterConfig={"Delay": 5, "MaxAttempts": 120})
                s.ec2.start_instances(InstanceIds=stopped)
            started, fresh = stopped, set(stopped)
        missing = [i for i in range(count) if i not in by_task]
        launched: list[str] = []
        try:
            net = ensure_network(s, c.vpc_cidr)
            ensure_ingress(s, net.security_group, c.ssh_cidr or (c.vpc_cidr if c.private_ips else caller_cidr()))
            key_name, _ = ensure_key_pair(s, self.config_dir)
            if missing:
                zones = sorted({inst["Placement"]["AvailabilityZone"] for inst in by_task.values()})
                order = zones or ([c.zone] if c.zone else s.zones())
                if other_zones and not c.zone:
                    order += [z for z in s.zones() if z not in order]
                # The group's zone: that of an instance in it, by its tag or, for instances launched
                # before the tag existed, by the group AWS reports for them.
                group_zone = next((inst["Placement"]["AvailabilityZone"] for inst in by_task.values()
                                   if tag_value(inst, GROUP_TAG)
                                   or inst["Placement"].get("GroupName") == self.placement_group_name), None)
                new = self.launch_instances(missing, order, net, key_name, group_zone, launched)
                by_task.update(zip(missing, new))
                fresh |= set(launched)
            ids = [by_task[i]["InstanceId"] for i in range(count)]
            with aws_errors(f"wait for {', '.join(ids)} to run"):
                s.ec2.get_waiter("instance_running").wait(InstanceIds=ids, WaiterConfig={"Delay": 5, "MaxAttempts": 120})
                described = {i["InstanceId"]: i for r in s.ec2.describe_instances(InstanceIds=ids)["Reservations"]
                             for i in r["Instances"]}
            instances = [described[i] for i in ids]
            hosts = [self.ssh_host(inst, first_contact=inst["InstanceId"] in fresh) for inst in instances]
            for inst, host in zip(instances, hosts):
                if inst["InstanceId"] in fresh:
                    forget_host_key(self.known_hosts, host.spec.host)  # a key left from an earlier tenant of the address
            parallel(lambda h: wait_for_ssh(h, c.boot_timeout), hosts)
            # A host mounts EFS through the mount target of its own zone (a replacement may be elsewhere).
            zones = {inst["Placement"]["AvailabilityZone"] for inst in instances}
            efs = {z: ensure_efs(s, ensure_subnet(s, net, z), net.security_group) for z in sorted(zones)} \
                if c.shared_storage else {}
            parallel(lambda pair: prepare_host(pair[1], pair[0], c, efs.get(pair[0]["Placement"]["AvailabilityZone"])),
                     list(zip(instances, hosts)))
            return hosts
        except BaseException as e:
            if started and not launched:
                raise
            raise self.undo(launched, e, job_had_instances=existing > 0) from e

    def undo(self, launched: list[str], error: BaseException, *, job_had_instances: bool) -> BaseException:
        """Terminate the instances this launch started after `error` (and the job's placement group
        when the job has no other instance); the error to raise, naming them."""
        what = str(error) if isinstance(error, SpeedrunError) else f"interrupted ({type(error).__name__})"
        kind = type(error) if isinstance(error, SpeedrunError) else SpeedrunError  # AWSFailed stays exit 3
        try:
            self.session.terminate(launched)
            if not job_had_instances:
                self.delete_placement_group()
        except SpeedrunError as e2:
            return (AWSFailed if isinstance(e2, AWSFailed) else kind)(
                f"{what}; what it launched could not be removed ({e2}): terminate "
                f"{', '.join(launched) or 'its instances'} yourself (speedrun down {self.job})")
        if not launched or not isinstance(error, SpeedrunError):
            return error
        log.info("terminated the instance(s) this launch started: %s", ", ".join(launched))
        return kind(f"{what}; terminated the {len(launched)} instance(s) it launched ({', '.join(launched)})")

    def delete_placement_group(self) -> None:
        """Delete the job's placement group if it has one and it exists (once no instance is in it)."""
        s, name = self.session, self.group
        if name is None:  # launched without one: nothing to ask AWS for
            return
        with aws_errors(f"delete placement group {name}"):
            if s.ec2.describe_placement_groups(Filters=[{"Name": "group-name", "Values": [name]}])["PlacementGroups"]:
                s.ec2.delete_placement_group(GroupName=name)

    def launch_instances(self, tasks: list[int], zones: list[str], net: Network, key_name: str,
                         group_zone: str | None, started: list[str]) -> list[dict[str, Any]]:
        """run_instances for these task indices, all in one zone: the first of `zones` with capacity.
        group_zone: where the job's placement group has instances (None: it has none); launches in
        another zone go without the group. The new instances' ids are added to `started` as soon as
        AWS has started them, so that a failure after that (tagging them) terminates them."""
        s, c = self.session, self.config
        image = find_image(s, c.image, c.image_owner)
        if c.placement_group:
            ensure_placement_group(s, self.placement_group_name)
            self.group = self.placement_group_name
        markets = ["spot", "on-demand"] if c.spot and c.on_demand_fallback else ["spot" if c.spot else "on-demand"]
        n, tried = len(tasks), []
        for market in markets:
            tried = []
            for zone in zones:
                subnet = ensure_subnet(s, net, zone)
                grouped = c.placement_group and group_zone in (None, zone)
                try:
                    r = s.ec2.run_instances(**self.run_instances_args(image, market, zone, subnet, net, key_name, n,
                                                                      grouped))
                except Exception as e:
                    code = error_code(e)
                    if code in CAPACITY_ERRORS:
                        tried.append(zone)
                        log.info("no %s capacity for %d x %s in %s (%s); trying the next zone",
                                 market, n, c.instance_type, zone, code)
                        continue
                    if code in ("VcpuLimitExceeded", "MaxSpotInstanceCountExceeded"):
                        raise SpeedrunError(self.quota_message(market, n, e)) from None
                    with aws_errors(f"launch {n} x {c.instance_type} in {zone}"):
                        raise
                instances = r["Instances"]
                started += [inst["InstanceId"] for inst in instances]
                with aws_errors("tag the new instances"):
                    for i, inst in zip(tasks, instances):
                        s.ec2.create_tags(Resources=[inst["InstanceId"]],
                                          Tags=[{"Key": TASK_TAG, "Value": str(i)}, {"Key": "Name", "Value": f"{self.job}-{i}"}])
                log.info("launched %d %s %s instance(s) in %s: %s", n, market, c.instance_type, zone,
                         ", ".join(i["InstanceId"] for i in instances))
                if c.placement_group and not grouped:
                    log.info("they run outside placement group %s, whose instances are in %s (a cluster placement "
                             "group holds one zone): slower links to the others", self.placement_group_name, group_zone)
                return instances
            if market == "spot" and len(markets) > 1:
                log.info("no spot capacity for %d x %s in %s; trying on-demand", n, c.instance_type, ", ".join(tried))
        if c.spot and not c.on_demand_fallback:
            raise SpeedrunError(f"no spot capacity for {n} x {c.instance_type} in {s.region} (tried {', '.join(tried)}); "
                                f"try later or another region, or allow on-demand (on_demand_fallback=True, "
                                f"--on-demand-fallback)")
        raise SpeedrunError(f"AWS has no capacity for {n} x {c.instance_type} in {s.region} now (tried "
                            f"{', '.join(tried)}); try later, another region or zone, or fewer instances")

    def run_instances_args(self, image: dict[str, Any], market: str, zone: str, subnet: str, net: Network,
                           key_name: str, n: int, grouped: bool) -> dict[str, Any]:
        """RunInstances' arguments; grouped: into the job's placement group."""
        c = self.config
        disks = [{"DeviceName": image.get("RootDeviceName", "/dev/sda1"),
                  "Ebs": {"VolumeSize": c.disk_gb, "VolumeType": "gp3", "DeleteOnTermination": True}}]
        if c.data_snapshot:
            disks.append({"DeviceName": DATA_DEVICE, "Ebs": {"SnapshotId": c.data_snapshot, "VolumeType": "gp3",
                                                             "DeleteOnTermination": True}})
        placement = {"AvailabilityZone": zone}
        instance_tags = {JOB_TAG: self.job}
        if grouped:
            placement["GroupName"] = self.placement_group_name
            instance_tags[GROUP_TAG] = self.placement_group_name
        args = dict(
            ImageId=image["ImageId"], InstanceType=c.instance_type, MinCount=n, MaxCount=n, KeyName=key_name,
            SubnetId=subnet, SecurityGroupIds=[net.security_group], Placement=placement, BlockDeviceMappings=disks,
            # A host that powers itself off (autostop) stops, keeping its disk; a spot one cannot stop.
            InstanceInitiatedShutdownBehavior="terminate" if market == "spot" else "stop",
            TagSpecifications=[{"ResourceType": kind, "Tags": tags(self.job, **instance_tags)}
                               for kind in ("instance", "volume")],
        )
        if market == "spot":
            args["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": {
                "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
        if c.instance_profile:
            args["IamInstanceProfile"] = {"Name": c.instance_profile}
        return args

    def quota_message(self, market: str, n: int, error: Exception) -> str:
        c = self.config
        family = c.instance_type.split(".")[0].lower()
        on_demand, spot = QUOTAS["g" if family.startswith("vt") else family[:1]] if family[:1] in QUOTAS or \
            family.startswith("vt") else STANDARD_QUOTAS
        name, code = spot if market == "spot" else on_demand
        vcpus = instance_vcpus(self.session, c.instance_type)
        asked = f"{n} x {c.instance_type} = {n * vcpus} vCPUs" if vcpus else f"{n} x {c.instance_type}"
        return (f"the vCPU quota '{name}' ({code}) in {self.session.region} is too small for {asked} "
                f"({error_code(error)}); ask AWS for more: Service Quotas > Amazon EC2 > {name}")

    def replace(self, index: int, count: int) -> Host:
        """A new instance for task `index` (the lost one is terminated if it still exists): in the
        job's zone, else (no capacity there) the region's next zone that has some, unless `zone`
        pins one; outside the job's placement group there, as the log says."""
        lost = self.session.job_instances(self.job).get(index)
        if lost is not None:
            self.session.terminate([lost["InstanceId"]])
        self._hosts = self.bring_up(count, other_zones=True)
        return self._hosts[index]

    def relocate(self, home: str) -> tuple[dict[str, Any], dict[str, Path]]:
        """The region's key (the public half too: a replacement's launch checks it against the key
        pair's) and the pinned host keys go to `home`; AWS credentials do not (the controller has
        its own: an instance role, or its ~/.aws)."""
        region = self.session.region
        key = key_path(region, self.config_dir)
        files = {"known_hosts": self.known_hosts, f"keys/aws-{region}": key,
                 f"keys/aws-{region}.pub": Path(f"{key}.pub")}
        return {**self.record(), "config_dir": home}, files

    def environment(self) -> dict[str, str]:
        # A spot instance gets two minutes' notice: `speedrun train` then stops at a step, resumable.
        return {NOTICE_ENV: IMDS_NOTICE_URL} if self.config.spot else {}

    # --- money and lifetime ---
    def billing(self) -> Billing:
        s, c = self.session, self.config
        running = [i for i in s.job_instances(self.job).values() if i["State"]["Name"] == "running"]
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

    def down(self) -> list[str]:
        """Terminate the job's instances, then delete its placement group (if it has one); the ids
        terminated. When a step fails the error says what is left: the record stays (the CLI
        forgets it only after this returns), and running `speedrun down JOB` again finishes."""
        s = self.session
        again = f"the job's record is kept: run `speedrun down {self.job}` again"
        instances = list(s.job_instances(self.job).values())
        ids = [i["InstanceId"] for i in instances]
        if ids:
            log.info("terminating %s", ", ".join(ids))
            try:
                s.terminate(ids)
            except SpeedrunError as e:
                raise type(e)(f"{e}; {', '.join(ids)} may still run; {again}") from None
        for inst in instances:
            for address in (inst.get("PrivateIpAddress"), inst.get("PublicIpAddress")):
                if address:
                    forget_host_key(self.known_hosts, address)
        try:
            self.delete_placement_group()
        except SpeedrunError as e:
            done = f"terminated {', '.join(ids)}; " if ids else ""
            raise type(e)(f"{e}; {done}placement group {self.group} is left; {again}") from None
        return ids

    def close(self) -> None:
        for h in self._hosts:
            h.close()


DATA_DEVICE = "/dev/sdf"  # where the data volume is attached (Nitro instances show it as an NVMe device)


def instance_vcpus(s: Session, instance_type: str) -> int | None:
    try:
        return s.ec2.describe_instance_types(InstanceTypes=[instance_type])["InstanceTypes"][0]["VCpuInfo"]["DefaultVCpus"]
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


def forget_host_key(known_hosts: Path, address: str) -> None:
    """Remove any key pinned for `address` in speedrun's known_hosts (AWS reuses addresses)."""
    if known_hosts.exists():
        subprocess.run(["ssh-keygen", "-R", address, "-f", str(known_hosts)], capture_output=True)
        Path(f"{known_hosts}.old").unlink(missing_ok=True)


def wait_for_ssh(host: SSHHost, timeout: float) -> None:
    """Connect to a booting instance, retrying until its sshd answers, at most timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            host.connect()
            return
        except SpeedrunError as e:
            if "differs from the one pinned" in str(e) or time.monotonic() > deadline:
                raise SpeedrunError(f"{host.name} did not answer SSH within {timeout:g} s of starting: {e}") from None
        time.sleep(3)  # the instance is booting; ask again


# --- preparing a host ---
def os_id(host: Host) -> str:
    """The host's distribution family: the ID (or ID_LIKE) of /etc/os-release, e.g. ubuntu, amzn."""
    r = host.shell(". /etc/os-release && echo \"$ID $ID_LIKE\"")
    return r.text.strip() or "unknown"


def install_command(os_ids: str, debian: str, redhat: str) -> str:
    """The command installing a package on this distribution family (apt-get or yum)."""
    words = os_ids.split()
    if any(w in ("ubuntu", "debian") for w in words):
        return f"$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q {debian}"
    if any(w in ("amzn", "rhel", "fedora", "centos") for w in words):
        return f"$SUDO yum install -y -q {redhat}"
    raise SpeedrunError(f"speedrun does not know how to install packages on {os_ids!r}: use an Ubuntu or "
                        f"Amazon Linux image")


def efs_mount_script(os_ids: str, address: str, path: str) -> str:
    """Mount an EFS file system (by its mount target's address, so no DNS is needed) at `path` over
    NFS 4.1 with AWS's recommended options, installing the NFS client for the host's OS first.
    Does nothing where `path` is already a mount point."""
    p = shlex.quote(path)
    return f"""if ! mountpoint -q {p}; then
  command -v mount.nfs4 >/dev/null || {install_command(os_ids, "nfs-common", "nfs-utils")}
  $SUDO mkdir -p {p}
  $SUDO mount -t nfs4 -o nfsvers=4.1,rsize=1048576,wsize=1048576,hard,timeo=600,retrans=2,noresvport {address}:/ {p}
  $SUDO chown "$(id -u):$(id -g)" {p}
fi
"""


def data_volume_script(volume_id: str, path: str) -> str:
    """Mount the data volume read-only at `path`: on Nitro instances the NVMe device whose serial is
    the volume id, else the Xen name of /dev/sdf."""
    p, serial = shlex.quote(path), volume_id.replace("-", "")
    return f"""if ! mountpoint -q {p}; then
  dev=$(lsblk -ndpo NAME,SERIAL | awk '$2 == "{serial}" {{print $1}}')
  [ -n "$dev" ] || dev=/dev/xvdf
  $SUDO mkdir -p {p}
  $SUDO mount -o ro "$dev" {p}
fi
"""


def s3_sync_script(os_ids: str, url: str, path: str) -> str:
    p = shlex.quote(path)
    return f"""command -v aws >/dev/null || {install_command(os_ids, "awscli", "awscli")}
$SUDO mkdir -p {p} && $SUDO chown "$(id -u):$(id -g)" {p}
aws s3 sync --only-show-errors {shlex.quote(url)} {p}
"""


def autostop_script(minutes: float, tmux_socket: str = "speedrun", poweroff: str = "$SUDO shutdown -h now",
                    every_s: float = 60.0) -> str:
    """Start a watcher in the background that powers the host off (`poweroff`) once no job command
    (a live tmux window other than the idle `shell`) has run on `tmux_socket` for `minutes`.
    It checks every `every_s` seconds and writes "<checks> busy|idle <seconds idle>" to
    ~/.speedrun/autostop/status; starting it again replaces the previous watcher."""
    state = "$HOME/.speedrun/autostop"
    loop = f"""idle_since=$(date +%s); checks=0
while true; do
  busy=$(tmux -L {tmux_socket} list-panes -a -F '#{{pane_dead}} #{{window_name}}' 2>/dev/null | awk '$1 == 0 && $2 != "shell"' | head -n 1)
  [ -n "$busy" ] && idle_since=$(date +%s)
  idle=$(( $(date +%s) - idle_since )); checks=$((checks + 1))
  # Written whole, then renamed: a reader never sees the file empty.
  echo "$checks $([ -n "$busy" ] && echo busy || echo idle) $idle" > "{state}/status.new" && mv -f "{state}/status.new" "{state}/status"
  if [ "$idle" -ge {max(1, round(minutes * 60))} ]; then {poweroff}; exit 0; fi
  sleep {every_s:g}
done"""
    return f"""mkdir -p "{state}"
[ -f "{state}/pid" ] && kill "$(cat "{state}/pid")" 2>/dev/null
SUDO="${{SUDO:-}}" nohup setsid bash -c {shlex.quote(loop)} >"{state}/log" 2>&1 </dev/null &
echo $! >"{state}/pid"
"""


def prepare_script(os_ids: str, inst: dict[str, Any], config: AWSConfig, efs: tuple[str, str] | None) -> str:
    """The host's preparation: shared storage, data and the autostop watcher (idempotent)."""
    parts = ['set -e\nSUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo\n']
    if efs is not None:
        parts.append(efs_mount_script(os_ids, efs[1], config.efs_mount))
    volume = next((m["Ebs"]["VolumeId"] for m in inst.get("BlockDeviceMappings", []) if m["DeviceName"] == DATA_DEVICE), None)
    if config.data_snapshot and volume:
        parts.append(data_volume_script(volume, config.data_mount))
    if config.data_s3:
        parts.append(s3_sync_script(os_ids, config.data_s3, config.data_mount))
    if config.autostop:
        parts.append(autostop_script(config.autostop))
    return "".join(parts)


def prepare_host(host: Host, inst: dict[str, Any], config: AWSConfig, efs: tuple[str, str] | None) -> None:
    script = prepare_script(os_id(host), inst, config, efs)
    r = host.shell(script)
    if r.returncode != 0:
        raise SpeedrunError(f"preparing {host.name} ({inst['InstanceId']}) failed: {last_line(r.stderr, 'no message')}")


# --- everything speedrun made in a region ---
@dataclass
class Everything:
    """What speedrun made in a region (found by its tag), to remove with `speedrun down --all`."""

    region: str
    instances: list[str]
    placement_groups: list[str]
    file_systems: list[str]
    network: Network | None
    key_pairs: list[str]

    def describe(self) -> list[str]:
        lines = [f"{len(self.instances)} instance(s): {', '.join(self.instances)}" if self.instances else "",
                 f"placement group(s): {', '.join(self.placement_groups)}" if self.placement_groups else "",
                 f"EFS file system(s) and everything on them (run directories): {', '.join(self.file_systems)}"
                 if self.file_systems else "",
                 f"VPC {self.network.vpc} with its subnets, gateway and security group" if self.network else "",
                 f"key pair(s): {', '.join(self.key_pairs)}" if self.key_pairs else ""]
        return [f"{self.region}: {line}" for line in lines if line]


def find_everything(region: str | None) -> Everything:
    s = Session(region)
    with aws_errors(f"list what speedrun made in {s.region}"):
        instances = [i["InstanceId"] for i in s.instances([MANAGED_FILTER])]
        groups = [g["GroupName"] for g in s.ec2.describe_placement_groups(Filters=[MANAGED_FILTER])["PlacementGroups"]]
        systems = [f["FileSystemId"] for f in s.efs.describe_file_systems()["FileSystems"]
                   if tag_value(f, MANAGED) == "true"]
        keys = [k["KeyName"] for k in s.ec2.describe_key_pairs(Filters=[MANAGED_FILTER])["KeyPairs"]]
    return Everything(s.region, instances, groups, systems, find_network(s), keys)


def remove_everything(found: Everything, config_dir: str | os.PathLike | None = None) -> None:
    """Terminate and delete what find_everything found, in dependency order. When a step fails,
    the error says so: what is left is found and removed by running it again."""
    s = Session(found.region)
    try:
        remove_found(s, found)
    except SpeedrunError as e:
        raise type(e)(f"{e}; the rest is left (and the job records kept): run `speedrun down --all` again") from None
    if found.key_pairs:
        for p in (key_path(s.region, config_dir), Path(f"{key_path(s.region, config_dir)}.pub")):
            p.unlink(missing_ok=True)


def remove_found(s: Session, found: Everything) -> None:
    """remove_everything's steps, each of which raises when it fails."""
    s.terminate(found.instances)
    with aws_errors(f"remove speedrun's resources in {s.region}"):
        for name in found.placement_groups:
            s.ec2.delete_placement_group(GroupName=name)
        for fs in found.file_systems:
            for target in s.efs.describe_mount_targets(FileSystemId=fs)["MountTargets"]:
                s.efs.delete_mount_target(MountTargetId=target["MountTargetId"])
            wait_until(lambda: not s.efs.describe_mount_targets(FileSystemId=fs)["MountTargets"], 300,
                       f"the mount targets of {fs} to go")
            s.efs.delete_file_system(FileSystemId=fs)
        net = found.network
        if net is not None:
            if net.security_group:
                s.ec2.delete_security_group(GroupId=net.security_group)
            for subnet in net.subnets.values():
                s.ec2.delete_subnet(SubnetId=subnet)
            for gw in s.ec2.describe_internet_gateways(
                    Filters=[{"Name": "attachment.vpc-id", "Values": [net.vpc]}])["InternetGateways"]:
                s.ec2.detach_internet_gateway(InternetGatewayId=gw["InternetGatewayId"], VpcId=net.vpc)
                s.ec2.delete_internet_gateway(InternetGatewayId=gw["InternetGatewayId"])
            s.ec2.delete_vpc(VpcId=net.vpc)
        for name in found.key_pairs:
            s.ec2.delete_key_pair(KeyName=name)
