"""EFA on the AWS provider: the interfaces, placement group and security group rules an EFA launch
asks AWS for, against moto on 127.0.0.1 (tests/aws_server.py), and the pieces that need no server.

moto keeps neither an interface's InterfaceType nor its NetworkCardIndex, so the layout is checked
in the RunInstances request as speedrun sent it (the test server notes each request: `sent`); the
instance types' network data (cards, EFA limits, bandwidth) is moto's own copy of
DescribeInstanceTypes. There is no EFA hardware here: an EFA host's preparation fails on these
namespace hosts exactly as on an image without libfabric's EFA provider, which is tested too.
"""
from __future__ import annotations

import json
import logging
import re

import pytest

from speedrun.cli import main
from speedrun.cluster import make_job, registry
from speedrun.cluster.aws import AWSConfig, AWSProvider
from speedrun.cluster.aws.efa import (TypeNetwork, attach_public_addresses, efa_environment, efa_interfaces,
                                      needs_elastic_ip, release_addresses, wants_efa)
from speedrun.cluster.aws.instances import terminate
from speedrun.cluster.aws.resources import ensure_key_pair, ensure_network
from speedrun.cluster.aws.teardown import find_everything
from speedrun.cluster.provider import NetworkSpec
from speedrun.errors import SpeedrunError

from test_cluster_aws import cli_flags, job_instances, live, options



def on_server(test):
    """Full tier: needs the moto server and its namespace hosts."""
    return pytest.mark.netns(pytest.mark.aws(test))


def interfaces(params: dict[str, str]) -> list[dict[str, str]]:
    """RunInstances' NetworkInterface.N.<Field> parameters, one dict per interface, in order."""
    found: dict[int, dict[str, str]] = {}
    for key, value in params.items():
        if m := re.fullmatch(r"NetworkInterface\.(\d+)\.(.+)", key):
            found.setdefault(int(m.group(1)), {})[m.group(2)] = value
    return [found[i] for i in sorted(found)]


# --- without a server (unit tier) ---
P4D = TypeNetwork("p4d.24xlarge", cards=4, efa_interfaces=4, gbps=400.0)
C5N = TypeNetwork("c5n.18xlarge", cards=1, efa_interfaces=1, gbps=100.0)
C5 = TypeNetwork("c5.large", cards=1, efa_interfaces=0, gbps=0.75)


def test_efa_interfaces_put_one_on_each_card_the_first_at_device_index_0():
    layout = efa_interfaces(P4D, "subnet-1", "sg-1", public=True)
    assert [(i["NetworkCardIndex"], i["DeviceIndex"], i["InterfaceType"]) for i in layout] == [
        (0, 0, "efa"), (1, 1, "efa"), (2, 1, "efa"), (3, 1, "efa")]
    assert all(i["SubnetId"] == "subnet-1" and i["Groups"] == ["sg-1"] for i in layout)
    # AWS gives no public address to several interfaces: an Elastic IP does it instead.
    assert not any("AssociatePublicIpAddress" in i for i in layout) and needs_elastic_ip(P4D, public=True)
    single = efa_interfaces(C5N, "subnet-1", "sg-1", public=True)
    assert len(single) == 1 and single[0]["AssociatePublicIpAddress"] is True
    assert not needs_elastic_ip(C5N, public=True) and not needs_elastic_ip(P4D, public=False)


def test_efa_auto_on_off():
    assert wants_efa(AWSConfig(), P4D) and not wants_efa(AWSConfig(), C5)
    assert not wants_efa(AWSConfig(efa="off"), P4D)
    with pytest.raises(SpeedrunError, match=r"--efa on: c5.large has no EFA"):
        wants_efa(AWSConfig(efa="on"), C5)
    with pytest.raises(SpeedrunError, match="efa must be one of auto, on, off"):
        AWSConfig(efa="yes")


def test_nccl_gets_the_efa_provider_and_gpudirect_rdma_where_the_family_has_it():
    assert efa_environment("p5.48xlarge") == {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}
    assert efa_environment("c5n.18xlarge") == {"FI_PROVIDER": "efa"}


# --- against the moto server (full tier) ---
@on_server
@pytest.mark.parametrize("instance_type,cards", [("p4d.24xlarge", 4), ("p5.48xlarge", 32)])
def test_efa_types_launch_with_an_interface_per_card_in_the_placement_group(aws, job_name, instance_type, cards):
    # The namespace hosts have no libfabric: preparation fails as on an image without EFA's provider,
    # in one line naming it, and what was launched is terminated.
    with pytest.raises(SpeedrunError) as e:
        make_job(job_name, 2, **options(aws, instance_type=instance_type))
    msg = str(e.value)
    assert f"{instance_type} was launched with EFA but libfabric's EFA provider is missing" in msg
    assert "Deep Learning AMIs" in msg and "terminated the 2 instance(s) it launched" in msg
    assert live(job_instances(aws, job_name)) == []

    [request] = aws.sent("RunInstances")
    layout = interfaces(request)
    assert [(i["NetworkCardIndex"], i["DeviceIndex"], i["InterfaceType"]) for i in layout] == [
        (str(c), "0" if c == 0 else "1", "efa") for c in range(cards)]
    subnet, group = layout[0]["SubnetId"], layout[0]["SecurityGroupId.1"]
    assert all(i["SubnetId"] == subnet and i["SecurityGroupId.1"] == group for i in layout)
    assert "SubnetId" not in request and "SecurityGroupId.1" not in request  # on the interfaces only
    assert request["Placement.GroupName"] == f"speedrun-{job_name}" and request["MinCount"] == "2"
    assert not any("AssociatePublicIpAddress" in i for i in layout)  # private addresses (private_ips)


@on_server
def test_a_type_without_efa_gets_one_ordinary_interface_and_the_group_admits_itself_both_ways(aws, job_name):
    job = make_job(job_name, 1, **options(aws))  # c5.large: no EFA
    [request] = aws.sent("RunInstances")
    assert interfaces(request) == [] and request["SubnetId"] and request["SecurityGroupId.1"]
    assert "FI_PROVIDER" not in job.provider.environment()
    assert job.provider.network() == NetworkSpec(0.75, "c5.large: 1 network card(s), 0.75 Gbit/s in all", efa=False)
    group = aws.client().describe_security_groups(GroupIds=[request["SecurityGroupId.1"]])["SecurityGroups"][0]
    for direction in ("IpPermissions", "IpPermissionsEgress"):  # EFA's rule: all traffic to and from itself
        assert any(r["IpProtocol"] == "-1" and [p["GroupId"] for p in r["UserIdGroupPairs"]] == [group["GroupId"]]
                   for r in group[direction]), direction
    # `speedrun check` on it: the result is held against the type's network as AWS describes it.
    assert main(["check", job_name, "--size", "0.25", "--iters", "2"]) == 0
    res = json.loads(job.tasks[0].read(f"{job.run_dir}/check.json"))
    assert (res["nominal_gbps"], res["nominal_source"], res["efa_expected"]) == (
        0.75, "c5.large: 1 network card(s), 0.75 Gbit/s in all", False)
    assert res["verdict"].startswith("one machine:") and res["results"][-1]["bytes"] == 1 << 18


@on_server
def test_efa_on_for_a_type_without_it_is_one_line_and_launches_nothing(aws, job_name, capsys):
    assert main(["launch", job_name, *cli_flags(aws), "--efa", "on", "--", "-c", "pass"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("speedrun: error: --efa on: c5.large has no EFA; use a type that has it (p4d.24xlarge, "
                   "p5.48xlarge...) or --efa auto")
    assert "RunInstances" not in aws.calls and not registry.exists(job_name)


@on_server
def test_efa_hosts_tell_nccl_to_use_it_and_check_holds_them_to_the_types_bandwidth(aws, job_name):
    provider = AWSProvider(job_name, AWSConfig(instance_type="p4d.24xlarge"), None, launch=False)
    assert provider.environment() == {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}
    assert provider.network() == NetworkSpec(400.0, "p4d.24xlarge: 4 network card(s), 400 Gbit/s in all", efa=True)
    off = AWSProvider(job_name, AWSConfig(instance_type="p4d.24xlarge", efa="off"), None, launch=False)
    assert off.environment() == {} and off.network().efa is False


@on_server
def test_a_replacement_keeps_the_layout_and_outside_the_groups_zone_says_it_goes_without_efa(aws, job_name, caplog):
    caplog.set_level(logging.INFO, logger="speedrun.cluster")
    config = AWSConfig(**{k: v for k, v in options(aws, instance_type="p4d.24xlarge").items() if k != "provider"})
    provider = AWSProvider(job_name, config, None, launch=True)
    s = provider.session
    net = ensure_network(s, aws.VPC_CIDR)
    key_name, _ = ensure_key_pair(s, None)
    started: list[str] = []
    try:
        provider.launch_instances([0], [aws.zones[0]], net, key_name, None, started, provider.efa())
        # Task 1's replacement: no capacity in the group's zone, so it goes to the next one.
        provider.launch_instances([1], [aws.zones[1]], net, key_name, aws.zones[0], started, provider.efa())
    finally:
        terminate(s, started)
    first, replacement = aws.sent("RunInstances")
    strip = lambda layout: [{k: v for k, v in i.items() if k != "SubnetId"} for i in layout]  # noqa: E731
    assert len(interfaces(replacement)) == 4 and strip(interfaces(replacement)) == strip(interfaces(first))
    assert first["Placement.GroupName"] == f"speedrun-{job_name}" and "Placement.GroupName" not in replacement
    assert "without EFA's benefit" in caplog.text


@on_server
def test_several_interfaces_get_an_elastic_ip_each_released_by_down(aws, job_name):
    ec2 = aws.client()
    s = AWSProvider(job_name, AWSConfig(instance_type="p4d.24xlarge"), None, launch=False).session
    net = ensure_network(s, aws.VPC_CIDR)
    subnet = ec2.create_subnet(VpcId=net.vpc, CidrBlock="198.51.100.240/28")["Subnet"]["SubnetId"]  # no host boots
    r = ec2.run_instances(ImageId=ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"],
                          InstanceType="p4d.24xlarge", MinCount=1, MaxCount=1,
                          NetworkInterfaces=efa_interfaces(P4D, subnet, net.security_group, public=True),
                          TagSpecifications=[{"ResourceType": "instance", "Tags": [
                              {"Key": "speedrun:job", "Value": job_name}, {"Key": "speedrun:task", "Value": "0"}]}])
    [inst] = r["Instances"]
    try:
        attach_public_addresses(s, job_name, [inst])
        described = ec2.describe_instances(InstanceIds=[inst["InstanceId"]])["Reservations"][0]["Instances"][0]
        [address] = ec2.describe_addresses()["Addresses"]
        assert described["PublicIpAddress"] == address["PublicIp"]  # on the primary interface (never contacted)
        tags = {t["Key"]: t["Value"] for t in address["Tags"]}
        assert tags.items() >= {"speedrun:managed": "true", "speedrun:job": job_name, "speedrun:task": "0"}.items()
        assert find_everything(None).addresses == [address["AllocationId"]]  # down --all finds it
        assert release_addresses(s, job_name) == [address["PublicIp"]]
        assert ec2.describe_addresses()["Addresses"] == []
    finally:
        terminate(s, [inst["InstanceId"]])

