"""The account's resources the AWS provider's instances need, each found by its tag or made once:
per region a VPC with an internet gateway, a default route and a security group, a subnet per
zone, a key pair and an EFS file system with a mount target per zone; per job a cluster placement
group; and the image to launch (`find_image`)."""
from __future__ import annotations

import ipaddress
import logging
import os
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speedrun.cluster import registry
from speedrun.cluster.aws.api import Session, aws_errors, wait_until
from speedrun.cluster.aws.config import MANAGED_FILTER, RESOURCE, tag_spec, tags
from speedrun.errors import SpeedrunError

log = logging.getLogger("speedrun.cluster")


@dataclass
class Network:
    """The region's speedrun VPC, its security group and its subnets."""

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
        groups = s.ec2.describe_security_groups(Filters=[
            {"Name": "vpc-id", "Values": [vpc]}, {"Name": "group-name", "Values": [RESOURCE]}])["SecurityGroups"]
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
        table = s.ec2.describe_route_tables(Filters=[
            {"Name": "vpc-id", "Values": [net.vpc]},
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


def admits_members(rules: list[dict[str, Any]], group: str) -> bool:
    """Whether these rules (ingress or egress) allow all traffic to or from the group's own members."""
    return any(r.get("IpProtocol") == "-1" and any(p["GroupId"] == group for p in r.get("UserIdGroupPairs", []))
               for r in rules)


def ensure_rules(s: Session, group: str, ssh_cidr: str) -> None:
    """The group admits TCP 22 from ssh_cidr and all traffic from its own members, and lets all
    traffic out to its members (EFA wants both directions named, whatever else egress allows);
    nothing else is added."""
    members = [{"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": group, "Description": "speedrun members"}]}]
    with aws_errors(f"set the rules of security group {group}"):
        described = s.ec2.describe_security_groups(GroupIds=[group])["SecurityGroups"][0]
        rules = described["IpPermissions"]
        if not admits_members(rules, group):
            s.ec2.authorize_security_group_ingress(GroupId=group, IpPermissions=members)
        if not admits_members(described.get("IpPermissionsEgress", []), group):
            s.ec2.authorize_security_group_egress(GroupId=group, IpPermissions=members)
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
    """The cluster placement group `name` (made if missing)."""
    with aws_errors(f"make placement group {name}"):
        if not s.ec2.describe_placement_groups(Filters=[{"Name": "group-name", "Values": [name]}])["PlacementGroups"]:
            s.ec2.create_placement_group(GroupName=name, Strategy="cluster",
                                         TagSpecifications=tag_spec("placement-group", name))


def delete_placement_group(s: Session, name: str) -> None:
    """Delete placement group `name` if it exists (once no instance is in it)."""
    with aws_errors(f"delete placement group {name}"):
        if s.ec2.describe_placement_groups(Filters=[{"Name": "group-name", "Values": [name]}])["PlacementGroups"]:
            s.ec2.delete_placement_group(GroupName=name)


def ensure_efs(s: Session, subnet: str, group: str) -> tuple[str, str]:
    """The region's EFS file system and its mount target in `subnet`: (file system id, target address)."""
    token = f"{RESOURCE}-{s.region}"
    with aws_errors("make the EFS file system"):
        systems = s.efs.describe_file_systems(CreationToken=token)["FileSystems"]
        fs = systems[0]["FileSystemId"] if systems else s.efs.create_file_system(
            CreationToken=token, PerformanceMode="generalPurpose", Encrypted=True,
            Tags=tags(token))["FileSystemId"]
        wait_until(lambda: s.efs.describe_file_systems(FileSystemId=fs)["FileSystems"][0]["LifeCycleState"]
                   == "available", 300, f"EFS file system {fs} to become available")
        targets = [t for t in s.efs.describe_mount_targets(FileSystemId=fs)["MountTargets"] if t["SubnetId"] == subnet]
        target = targets[0] if targets else s.efs.create_mount_target(FileSystemId=fs, SubnetId=subnet,
                                                                      SecurityGroups=[group])
        wait_until(lambda: s.efs.describe_mount_targets(MountTargetId=target["MountTargetId"])["MountTargets"][0]
                   ["LifeCycleState"] == "available", 300, f"the mount target of {fs} to become available")
    return fs, target["IpAddress"]


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
