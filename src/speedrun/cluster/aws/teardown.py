"""`speedrun down --all`: everything speedrun made in a region, found by its tag (`find_everything`)
and removed in dependency order (`remove_everything`): instances, their Elastic IPs, placement
groups, EFS file systems, the VPC with its subnets, gateway and security group, key pairs; for
several regions at once, `AWSLeftovers` (the provider's `leftovers`)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from speedrun.cluster.aws.api import Session, aws_errors, wait_until
from speedrun.cluster.aws.config import MANAGED, MANAGED_FILTER, tag_value
from speedrun.cluster.aws.instances import live_instances, terminate
from speedrun.cluster.aws.resources import Network, find_network, key_path
from speedrun.cluster.provider import Leftovers
from speedrun.errors import SpeedrunError


@dataclass
class Everything:
    """What speedrun made in a region (found by its tag), to remove with `speedrun down --all`."""

    region: str
    instances: list[str]
    placement_groups: list[str]
    file_systems: list[str]
    network: Network | None
    key_pairs: list[str]
    addresses: list[str]  # Elastic IPs (EFA instances with several interfaces), by allocation id

    def describe(self) -> list[str]:
        """One line per kind of thing found, naming the region, for the confirmation prompt."""
        lines = [f"{len(self.instances)} instance(s): {', '.join(self.instances)}" if self.instances else "",
                 f"placement group(s): {', '.join(self.placement_groups)}" if self.placement_groups else "",
                 f"EFS file system(s) and everything on them (run directories): {', '.join(self.file_systems)}"
                 if self.file_systems else "",
                 f"VPC {self.network.vpc} with its subnets, gateway and security group" if self.network else "",
                 f"key pair(s): {', '.join(self.key_pairs)}" if self.key_pairs else "",
                 f"Elastic IP(s): {', '.join(self.addresses)}" if self.addresses else ""]
        return [f"{self.region}: {line}" for line in lines if line]


def find_everything(region: str | None) -> Everything:
    """What speedrun made in `region` (None: the AWS configuration's), found by its tag."""
    s = Session(region)
    with aws_errors(f"list what speedrun made in {s.region}"):
        instances = [i["InstanceId"] for i in live_instances(s, [MANAGED_FILTER])]
        groups = [g["GroupName"] for g in s.ec2.describe_placement_groups(Filters=[MANAGED_FILTER])["PlacementGroups"]]
        systems = [f["FileSystemId"] for f in s.efs.describe_file_systems()["FileSystems"]
                   if tag_value(f, MANAGED) == "true"]
        keys = [k["KeyName"] for k in s.ec2.describe_key_pairs(Filters=[MANAGED_FILTER])["KeyPairs"]]
        addresses = [a["AllocationId"] for a in s.ec2.describe_addresses(Filters=[MANAGED_FILTER])["Addresses"]]
    return Everything(s.region, instances, groups, systems, find_network(s), keys, addresses)


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


def no_mount_targets(s: Session, file_system: str) -> bool:
    return not s.efs.describe_mount_targets(FileSystemId=file_system)["MountTargets"]


def remove_found(s: Session, found: Everything) -> None:
    """remove_everything's steps, each of which raises when it fails."""
    terminate(s, found.instances)
    with aws_errors(f"remove speedrun's resources in {s.region}"):
        for allocation in found.addresses:  # their instances are gone: nothing holds them now
            s.ec2.release_address(AllocationId=allocation)
        for name in found.placement_groups:
            s.ec2.delete_placement_group(GroupName=name)
        for fs in found.file_systems:
            for target in s.efs.describe_mount_targets(FileSystemId=fs)["MountTargets"]:
                s.efs.delete_mount_target(MountTargetId=target["MountTargetId"])
            wait_until(partial(no_mount_targets, s, fs), 300, f"the mount targets of {fs} to go")
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


class AWSLeftovers(Leftovers):
    """What `speedrun down --all` removes in AWS: everything speedrun made in these regions."""

    def __init__(self, found: list[Everything]):
        self.found = found
        self.where = f"AWS ({', '.join(f.region for f in found)})"

    @classmethod
    def find(cls, regions: list[str]) -> AWSLeftovers:
        return cls([find_everything(r) for r in regions])

    def describe(self) -> list[str]:
        return [line for f in self.found for line in f.describe()]

    def remove(self) -> None:
        for f in self.found:
            remove_everything(f)
