"""The AWS provider's instances: finding a job's again by tag (`job_instances`), launching the
missing ones (`launch`: one zone for all, the next zone on a capacity error, spot then on-demand
when allowed), starting stopped ones, terminating, and reaching them over SSH (`instance_host`,
`wait_for_ssh`, with host keys pinned on first contact and forgotten when AWS reuses an address)."""
from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from speedrun.cluster.aws.api import Session, aws_errors, error_code
from speedrun.cluster.aws.config import (DATA_DEVICE, GROUP_TAG, JOB_TAG, LIVE_STATES, TASK_TAG, AWSConfig,
                                         placement_group_name, tag_value, tags)
from speedrun.cluster.aws.efa import TypeNetwork, efa_interfaces
from speedrun.cluster.aws.pricing import quota_message
from speedrun.cluster.aws.resources import Network, ensure_subnet
from speedrun.cluster.hosts import AbsentHost, Host
from speedrun.cluster.provider import NoCapacity
from speedrun.cluster.ssh import HostSpec, SSHHost, SSHOptions
from speedrun.errors import SpeedrunError

log = logging.getLogger("speedrun.cluster")

CAPACITY_ERRORS = ("InsufficientInstanceCapacity", "InsufficientCapacity", "Unsupported")


# --- finding ---
def live_instances(s: Session, filters: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Instances matching the filters, in any live state (not shutting down or terminated)."""
    with aws_errors("list instances"):
        pages = s.ec2.get_paginator("describe_instances").paginate(
            Filters=[*filters, {"Name": "instance-state-name", "Values": list(LIVE_STATES)}])
        return [i for page in pages for r in page["Reservations"] for i in r["Instances"]]


def tagged_instances(s: Session, job: str) -> list[dict[str, Any]]:
    """Every live instance tagged with the job, also one that a launch started but did not get to
    give a task (interrupted between AWS starting it and tagging it)."""
    return live_instances(s, [{"Name": f"tag:{JOB_TAG}", "Values": [job]}])


def job_instances(s: Session, job: str) -> dict[int, dict[str, Any]]:
    """The job's live instances by task index (the newest when two claim one index)."""
    return instances_by_task(tagged_instances(s, job))


def instances_by_task(instances: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """A job's instances by task index (the newest when two claim one index); those without a task
    tag are left out."""
    found: dict[int, dict[str, Any]] = {}
    for inst in sorted(instances, key=lambda i: i["LaunchTime"]):
        task = tag_value(inst, TASK_TAG)
        if task is not None and task.isdigit():
            found[int(task)] = inst
    return found


def job_hosts(job: str, by_task: Mapping[int, dict[str, Any]], count: int,
              connect: Callable[[dict[str, Any]], Host]) -> list[Host]:
    """Hosts for the job's instances as they are (`connect` makes one of a running instance); a
    missing or stopped one is an AbsentHost."""
    hosts: list[Host] = []
    for i in range(count):
        inst = by_task.get(i)
        if inst is None:
            hosts.append(AbsentHost(f"task {i}", f"job {job} has no instance for task {i} (terminated?)"))
        elif inst["State"]["Name"] != "running":
            hosts.append(AbsentHost(f"{inst['InstanceId']} ({inst['State']['Name']})",
                                    f"instance {inst['InstanceId']} of job {job} is {inst['State']['Name']}; "
                                    f"make_job (speedrun launch) again starts it"))
        else:
            hosts.append(connect(inst))
    return hosts


# --- starting, launching, terminating ---
def start_stopped(s: Session, ids: list[str]) -> None:
    """Start stopped instances, once those still stopping have stopped."""
    with aws_errors(f"start {', '.join(ids)}"):
        s.ec2.get_waiter("instance_stopped").wait(InstanceIds=ids, WaiterConfig={"Delay": 5, "MaxAttempts": 120})
        s.ec2.start_instances(InstanceIds=ids)


def wait_running(s: Session, ids: list[str]) -> list[dict[str, Any]]:
    """The instances, in the order of `ids`, as AWS describes them once all of them run."""
    with aws_errors(f"wait for {', '.join(ids)} to run"):
        s.ec2.get_waiter("instance_running").wait(InstanceIds=ids, WaiterConfig={"Delay": 5, "MaxAttempts": 120})
        described = {i["InstanceId"]: i for r in s.ec2.describe_instances(InstanceIds=ids)["Reservations"]
                     for i in r["Instances"]}
    return [described[i] for i in ids]


def terminate(s: Session, ids: Sequence[str]) -> None:
    """Terminate instances and wait until they are gone."""
    if not ids:
        return
    with aws_errors(f"terminate {', '.join(ids)}"):
        s.ec2.terminate_instances(InstanceIds=list(ids))
        s.ec2.get_waiter("instance_terminated").wait(InstanceIds=list(ids),
                                                      WaiterConfig={"Delay": 5, "MaxAttempts": 120})


def launch(s: Session, config: AWSConfig, job: str, tasks: list[int], zones: list[str], net: Network,
           image: dict[str, Any], key_name: str, group_zone: str | None, started: list[str],
           efa: TypeNetwork | None = None) -> list[dict[str, Any]]:
    """run_instances for these task indices of `job`, all in one zone: the first of `zones` with
    capacity. group_zone: where the job's placement group has instances (None: it has none);
    launches in another zone go without the group. efa: the type's network, to launch with an EFA
    interface on each card (None: one ordinary interface). The new instances' ids are added to
    `started` as soon as AWS has started them, so that a failure after that (tagging them)
    terminates them."""
    c = config
    group = placement_group_name(job)
    markets = ["spot", "on-demand"] if c.spot and c.on_demand_fallback else ["spot" if c.spot else "on-demand"]
    n, tried = len(tasks), []
    for market in markets:
        tried = []
        for zone in zones:
            subnet = ensure_subnet(s, net, zone)
            grouped = c.placement_group and group_zone in (None, zone)
            try:
                r = s.ec2.run_instances(**run_instances_args(c, job, image, market, zone, subnet, net, key_name, n,
                                                             grouped, efa))
            except Exception as e:
                code = error_code(e)
                if code in CAPACITY_ERRORS:
                    tried.append(zone)
                    log.info("no %s capacity for %d x %s in %s (%s); trying the next zone",
                             market, n, c.instance_type, zone, code)
                    continue
                if code in ("VcpuLimitExceeded", "MaxSpotInstanceCountExceeded"):
                    raise SpeedrunError(quota_message(s, c.instance_type, market, n, e)) from None
                with aws_errors(f"launch {n} x {c.instance_type} in {zone}"):
                    raise
            instances = r["Instances"]
            started += [inst["InstanceId"] for inst in instances]
            with aws_errors("tag the new instances"):
                for i, inst in zip(tasks, instances):
                    s.ec2.create_tags(Resources=[inst["InstanceId"]],
                                      Tags=[{"Key": TASK_TAG, "Value": str(i)}, {"Key": "Name", "Value": f"{job}-{i}"}])
            log.info("launched %d %s %s instance(s) in %s: %s", n, market, c.instance_type, zone,
                     ", ".join(i["InstanceId"] for i in instances))
            if c.placement_group and not grouped:
                log.info("they run outside placement group %s, whose instances are in %s (a cluster placement "
                         "group holds one zone): slower links to the others%s", group, group_zone,
                         "; without EFA's benefit (EFA's traffic stays in one zone's placement group)" if efa else "")
            return instances
        if market == "spot" and len(markets) > 1:
            log.info("no spot capacity for %d x %s in %s; trying on-demand", n, c.instance_type, ", ".join(tried))
    if c.spot and not c.on_demand_fallback:
        raise NoCapacity(f"no spot capacity for {n} x {c.instance_type} in {s.region} (tried {', '.join(tried)}); "
                            f"try later or another region, or allow on-demand (on_demand_fallback=True, "
                            f"--on-demand-fallback)")
    raise NoCapacity(f"AWS has no capacity for {n} x {c.instance_type} in {s.region} now (tried "
                        f"{', '.join(tried)}); try later, another region or zone, or fewer instances")


def run_instances_args(config: AWSConfig, job: str, image: dict[str, Any], market: str, zone: str, subnet: str,
                       net: Network, key_name: str, n: int, grouped: bool,
                       efa: TypeNetwork | None = None) -> dict[str, Any]:
    """RunInstances' arguments; grouped: into the job's placement group; efa: with an EFA interface
    on each of the type's network cards (efa.efa_interfaces)."""
    c = config
    disks = [{"DeviceName": image.get("RootDeviceName", "/dev/sda1"),
              "Ebs": {"VolumeSize": c.disk_gb, "VolumeType": "gp3", "DeleteOnTermination": True}}]
    if c.data_snapshot:
        disks.append({"DeviceName": DATA_DEVICE, "Ebs": {"SnapshotId": c.data_snapshot, "VolumeType": "gp3",
                                                         "DeleteOnTermination": True}})
    placement = {"AvailabilityZone": zone}
    instance_tags = {JOB_TAG: job}
    if grouped:
        placement["GroupName"] = placement_group_name(job)
        instance_tags[GROUP_TAG] = placement_group_name(job)
    # The subnet and security group go on the interfaces when they are given (AWS refuses both places).
    network: dict[str, Any] = dict(SubnetId=subnet, SecurityGroupIds=[net.security_group]) if efa is None else \
        dict(NetworkInterfaces=efa_interfaces(efa, subnet, net.security_group, public=not c.private_ips))
    args = dict(
        ImageId=image["ImageId"], InstanceType=c.instance_type, MinCount=n, MaxCount=n, KeyName=key_name,
        **network, Placement=placement, BlockDeviceMappings=disks,
        # A host that powers itself off (autostop) stops, keeping its disk; a spot one cannot stop.
        InstanceInitiatedShutdownBehavior="terminate" if market == "spot" else "stop",
        TagSpecifications=[{"ResourceType": kind, "Tags": tags(job, **instance_tags)}
                           for kind in ("instance", "volume")],
    )
    if market == "spot":
        args["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": {
            "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
    if c.instance_profile:
        args["IamInstanceProfile"] = {"Name": c.instance_profile}
    return args


# --- reaching them ---
def instance_host(inst: dict[str, Any], config: AWSConfig, known_hosts: Path, identity_file: Path, *,
                  first_contact: bool) -> SSHHost:
    """The instance as an SSH host, at its public address (private with private_ips); first_contact:
    learn and pin its host key (an instance speedrun just launched or started)."""
    address = inst.get("PrivateIpAddress") if config.private_ips else inst.get("PublicIpAddress")
    if not address:
        raise SpeedrunError(f"instance {inst['InstanceId']} has no {'private' if config.private_ips else 'public'} "
                            f"address; launch from inside the VPC with private_ips=True (--private-ips)")
    return SSHHost(HostSpec(host=address, user=config.ssh_user),
                   SSHOptions(known_hosts=known_hosts, identity_file=identity_file, accept_new_host_keys=first_contact))


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

