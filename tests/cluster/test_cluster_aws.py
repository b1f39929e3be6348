"""The AWS provider end to end against moto on 127.0.0.1 (tests/aws_server.py).

What runs for real: boto3 over HTTP, speedrun's resource and launch logic, ssh-keygen, OpenSSH to
namespace hosts at the private addresses moto handed out, tmux, torchrun and training. What is
emulated: the AWS API (moto), with the placement-group calls and injected error codes added by
the test server.
"""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from speedrun.cli import main
from speedrun.cluster import make_job, open_job
from speedrun.cluster import aws as aws_provider
from speedrun.cluster import registry
from speedrun.errors import SpeedrunError

from cli_run import start
from test_cluster_e2e import ONE_THREAD, TRAIN, check_trained

pytestmark = [pytest.mark.netns, pytest.mark.aws]

IMAGE = "ubuntu/images/hvm-ssd/ubuntu-*"  # one of moto's images


def options(aws, **extra):
    """make_job options that put instances where the test server boots them and reach them there."""
    return {**dict(provider="aws", instance_type="c5.large", image=IMAGE, zone=aws.zone, vpc_cidr=aws.VPC_CIDR,
                   private_ips=True, ssh_user="root", shared_storage=False), **extra}


def cli_flags(aws) -> list[str]:
    """`speedrun launch` options matching `options(aws)`."""
    return ["--provider", "aws", "--instance-type", "c5.large", "--image", IMAGE, "--zone", aws.zone,
            "--vpc-cidr", aws.VPC_CIDR, "--private-ips", "--ssh-user", "root", "--no-shared-storage"]


def job_instances(aws, job: str) -> list[dict]:
    r = aws.client().describe_instances(Filters=[{"Name": "tag:speedrun:job", "Values": [job]}])
    return [i for res in r["Reservations"] for i in res["Instances"]]


def live(instances: list[dict]) -> list[dict]:
    return [i for i in instances if i["State"]["Name"] not in ("shutting-down", "terminated")]


@pytest.mark.slow
def test_two_instances_train_end_to_end_and_go_down(aws, efs_mount, job_name):
    aws.list_price("c5.large", 0.0891)  # the Price List API's price (the table's is 0.085)
    job = make_job(job_name, 2, **options(aws, shared_storage=True, efs_mount=efs_mount))
    instances = sorted(live(job_instances(aws, job_name)),
                       key=lambda i: int(aws_provider.tag_value(i, "speedrun:task")))
    # Two instances launched into the job's placement group, reached at the addresses moto gave them.
    assert len(instances) == 2 and [t.ip for t in job] == [i["PrivateIpAddress"] for i in instances]
    assert [aws.placement_of[i["InstanceId"]] for i in instances] == [f"speedrun-{job_name}"] * 2
    assert job.run_dir.startswith(f"{efs_mount}/runs/{job_name}/")  # EFS is the run root
    key = aws_provider.key_path("us-east-1", None)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and stat.S_IMODE(key.parent.stat().st_mode) == 0o700

    job.launch([*TRAIN, "--out", job.run_dir], env=ONE_THREAD)
    again = make_job(job_name, 2, **options(aws, shared_storage=True, efs_mount=efs_mount))  # the script run again
    assert again.reconnected and again.run_dir == job.run_dir
    assert aws.calls.count("RunInstances") == 1  # found by name, nothing launched
    results = job.wait(timeout=600)
    assert [r.status for r in results] == [0, 0]
    check_trained(job.run_dir, 2)
    # What the run cost: 2 machines x the listed price x its hours, within a second's worth.
    run = json.loads(Path(job.run_dir, "results.json").read_text())
    price = run["price"]
    assert (price["machine_type"], price["market"], price["machines"], price["usd_per_hour"]) == (
        "c5.large", "on-demand", 2, 0.0891)
    assert price["source"].startswith("AWS Price List API, ")
    assert run["billed_s"] == pytest.approx(run["total_s"] + run["lost_s"])
    assert abs(run["cost_usd"] - 2 * 0.0891 * run["billed_s"] / 3600) <= 2 * 0.0891 / 3600
    assert run["machine_hours"] == pytest.approx(2 * run["billed_s"] / 3600)

    assert main(["down", job_name]) == 0
    assert live(job_instances(aws, job_name)) == []
    assert not registry.exists(job_name)
    assert aws.client().describe_placement_groups()["PlacementGroups"] == []
    assert aws.booted == {}  # the machines are gone


def test_resources_are_made_once_reused_and_never_open_to_the_world(aws, job_name):
    first = make_job(f"{job_name}-a", 1, **options(aws, ssh_cidr="198.51.100.7/32"))
    second = make_job(f"{job_name}-b", 1, **options(aws, ssh_cidr="198.51.100.7/32"))
    ec2 = aws.client()
    managed = [{"Name": "tag:speedrun:managed", "Values": ["true"]}]
    assert len(ec2.describe_vpcs(Filters=managed)["Vpcs"]) == 1
    assert len(ec2.describe_subnets(Filters=managed)["Subnets"]) == 1  # one per zone used
    assert len(ec2.describe_key_pairs(Filters=managed)["KeyPairs"]) == 1
    groups = ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": ["speedrun"]}])["SecurityGroups"]
    assert len(groups) == 1
    rules = groups[0]["IpPermissions"]
    cidrs = [r["CidrIp"] for rule in rules for r in rule.get("IpRanges", [])]
    assert cidrs == ["198.51.100.7/32"]  # SSH from the caller only
    assert [(r["IpProtocol"], r.get("FromPort")) for r in rules if r.get("IpRanges")] == [("tcp", 22)]
    assert all(p["GroupId"] == groups[0]["GroupId"] for r in rules for p in r.get("UserIdGroupPairs", []))
    assert first[0].run("echo a").output == "a\n" and second[0].run("echo b").output == "b\n"
    for name in (f"{job_name}-a", f"{job_name}-b"):
        assert main(["down", name]) == 0

    with pytest.raises(SpeedrunError, match="whole internet"):
        make_job(f"{job_name}-c", 1, **options(aws, ssh_cidr="0.0.0.0/0"))


def test_a_stopped_instance_is_started_again_by_name(aws, job_name):
    job = make_job(job_name, 1, **options(aws))
    (inst,) = live(job_instances(aws, job_name))
    ec2 = aws.client()
    ec2.stop_instances(InstanceIds=[inst["InstanceId"]])
    assert open_job(job_name).status()[0].state == "unreachable"
    job = make_job(job_name, 1, **options(aws))
    assert aws.calls.count("RunInstances") == 1 and aws.calls.count("StartInstances") == 1
    assert job[0].run("echo back").output == "back\n"
    main(["down", job_name])


def test_a_zone_without_capacity_is_skipped(aws, job_name, caplog):
    for zone in ("us-east-1a", "us-east-1b", "us-east-1c"):
        if zone != aws.zone:
            aws.fail("RunInstances", "InsufficientInstanceCapacity", zone=zone)
    opts = options(aws)
    opts.pop("zone")
    # Zones are tried in name order, so the test server's zone must come after a failing one.
    assert aws.zone != "us-east-1a"
    job = make_job(job_name, 1, **opts)
    assert job[0].run("echo ok").output == "ok\n"
    (inst,) = live(job_instances(aws, job_name))
    assert inst["Placement"]["AvailabilityZone"] == aws.zone
    main(["down", job_name])


def test_no_capacity_anywhere_names_the_zones_tried(aws, job_name):
    aws.fail("RunInstances", "InsufficientInstanceCapacity")
    opts = options(aws)
    opts.pop("zone")
    with pytest.raises(SpeedrunError) as e:
        make_job(job_name, 2, **opts)
    msg = str(e.value)
    assert "no capacity for 2 x c5.large" in msg and "us-east-1a, us-east-1b" in msg and "us-east-1f" in msg
    assert "\n" not in msg


def test_spot_without_capacity_is_an_error_unless_on_demand_is_allowed(aws, job_name):
    aws.fail("RunInstances", "InsufficientInstanceCapacity", market="spot")
    with pytest.raises(SpeedrunError,
                       match=r"no spot capacity for 1 x c5.large .*tried us-east-1.\).*on_demand_fallback"):
        make_job(job_name, 1, **options(aws, spot=True))
    assert live(job_instances(aws, job_name)) == []
    job = make_job(job_name, 1, **options(aws, spot=True, on_demand_fallback=True))
    (inst,) = live(job_instances(aws, job_name))
    assert inst.get("InstanceLifecycle") != "spot"  # on-demand, as allowed
    assert job[0].run("echo ok").output == "ok\n"
    main(["down", job_name])


@pytest.mark.parametrize("spot,code,quota", [
    (False, "VcpuLimitExceeded", "'Running On-Demand P instances' (L-417A185B)"),
    (True, "MaxSpotInstanceCountExceeded", "'All P Spot Instance Requests' (L-7212CCBC)"),
])
def test_a_quota_too_small_names_the_quota_and_the_vcpus(aws, job_name, spot, code, quota):
    aws.fail("RunInstances", code)
    with pytest.raises(SpeedrunError) as e:
        make_job(job_name, 2, **options(aws, instance_type="p5.48xlarge", spot=spot))
    assert quota in str(e.value) and "2 x p5.48xlarge = 384 vCPUs" in str(e.value)
    assert aws.client().describe_placement_groups()["PlacementGroups"] == []  # nothing half made is left


def test_no_credentials_is_one_line(aws, monkeypatch, capsys):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    code = main(["launch", "no-creds", "--provider", "aws", "--zone", aws.zone, "--", "-c", "pass"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("speedrun: error: no AWS credentials found") and "\n" not in err


def test_a_launch_failing_after_instances_started_terminates_them(aws, job_name):
    # A login the image does not have: the instances start, SSH never lets speedrun in.
    with pytest.raises(SpeedrunError) as e:
        make_job(job_name, 2, **options(aws, ssh_user="nobody-here", boot_timeout=1))
    ids = sorted(i["InstanceId"] for i in job_instances(aws, job_name))
    assert len(ids) == 2 and live(job_instances(aws, job_name)) == []
    assert aws.client().describe_placement_groups()["PlacementGroups"] == []
    msg = str(e.value)
    assert "terminated the 2 instance(s) it launched" in msg and all(i in msg for i in ids)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signal_while_launch_starts_instances_terminates_every_one_it_started(aws, job_name, sig):
    # A login the image does not have: the instances start and launch waits for SSH that never lets
    # it in. The signal comes as soon as AWS lists them, which may be before launch has heard back.
    flags = ["nobody-here" if f == "root" else f for f in cli_flags(aws)]
    proc = start("launch", job_name, *flags, "-n", "2", "--", "-c", "pass")
    try:
        wait_for(lambda: len(job_instances(aws, job_name)) == 2 or proc.poll() is not None)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    ids = sorted(i["InstanceId"] for i in job_instances(aws, job_name))
    assert proc.returncode == 130 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("speedrun: interrupted: ") and f"{sig.name}" in line and all(i in line for i in ids), line
    assert len(ids) == 2 and live(job_instances(aws, job_name)) == []
    assert aws.client().describe_placement_groups()["PlacementGroups"] == []


def test_instances_a_launch_cannot_terminate_are_recorded_for_down(aws, job_name, capsys):
    aws.garble("TerminateInstances")  # AWS answers everything but the clean-up
    with pytest.raises(SpeedrunError) as e:  # SSH never lets speedrun in: the launch fails and cleans up
        make_job(job_name, 2, **options(aws, ssh_user="nobody-here", boot_timeout=1))
    ids = sorted(i["InstanceId"] for i in live(job_instances(aws, job_name)))
    line = str(e.value)
    assert len(ids) == 2 and all(i in line for i in ids) and f"speedrun down {job_name}" in line, line
    aws.faults.clear()  # AWS reachable again: ls shows what the launch left, down ends it
    assert main(["ls", job_name]) == 0
    out = capsys.readouterr().out
    assert any(ln.split()[:4] == [job_name, "c5.large", "on-demand", "2"] for ln in out.splitlines()), out
    assert main(["down", job_name]) == 0
    assert live(job_instances(aws, job_name)) == [] and not registry.exists(job_name)


def test_ls_shows_what_a_job_costs_and_down_all_removes_everything_speedrun_made(aws, job_name, capsys):
    make_job(job_name, 2, **options(aws))
    ec2 = aws.client()
    foreign = ec2.create_vpc(CidrBlock="192.0.2.0/24")["Vpc"]["VpcId"]  # not speedrun's: must survive
    capsys.readouterr()
    assert main(["ls"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith(job_name) and "c5.large" in ln)
    # 2 on-demand c5.large at $0.085/h each, from the dated table shipped with speedrun.
    assert "on-demand" in line and " 2 " in line and "$0.17/h" in line and "$0.00" in line

    assert main(["down", "--all", "--yes"]) == 0
    assert live(job_instances(aws, job_name)) == []
    managed = [{"Name": "tag:speedrun:managed", "Values": ["true"]}]
    assert ec2.describe_vpcs(Filters=managed)["Vpcs"] == []
    assert ec2.describe_key_pairs(Filters=managed)["KeyPairs"] == []
    assert [v["VpcId"] for v in ec2.describe_vpcs(VpcIds=[foreign])["Vpcs"]] == [foreign]
    assert not registry.exists(job_name)


def test_the_efs_mount_command_fits_the_hosts_os():
    ubuntu = aws_provider.efs_mount_script("ubuntu debian", "10.0.0.5", "/mnt/efs")
    assert "apt-get install -y -q nfs-common" in ubuntu
    assert "mount -t nfs4 -o nfsvers=4.1,rsize=1048576,wsize=1048576,hard,timeo=600,retrans=2,noresvport " \
           "10.0.0.5:/ /mnt/efs" in ubuntu
    amazon = aws_provider.efs_mount_script("amzn rhel fedora", "10.0.0.5", "/mnt/efs")
    assert "yum install -y -q nfs-utils" in amazon and "10.0.0.5:/ /mnt/efs" in amazon
    with pytest.raises(SpeedrunError, match="Ubuntu or Amazon Linux"):
        aws_provider.efs_mount_script("alpine", "10.0.0.5", "/mnt/efs")


def test_data_comes_from_a_snapshot_and_the_root_disk_has_the_size_asked(aws, job_name, tmp_path):
    ec2 = aws.client()
    volume = ec2.create_volume(AvailabilityZone=aws.zone, Size=20)["VolumeId"]
    snapshot = ec2.create_snapshot(VolumeId=volume)["SnapshotId"]
    data = tmp_path / "data"  # already a mount point here (see efs_mount): the mount step leaves it
    data.mkdir()
    subprocess.run(["mount", "--bind", str(data), str(data)], check=True)
    try:
        make_job(job_name, 1, **options(aws, data_snapshot=snapshot, data_mount=str(data), disk_gb=64))
    finally:
        subprocess.run(["umount", "-l", str(data)], check=False)
    (inst,) = live(job_instances(aws, job_name))
    disks = {m["DeviceName"]: m["Ebs"]["VolumeId"] for m in inst["BlockDeviceMappings"]}
    volumes = {v["VolumeId"]: v for v in ec2.describe_volumes(VolumeIds=list(disks.values()))["Volumes"]}
    assert volumes[disks["/dev/sdf"]].get("SnapshotId") == snapshot
    assert volumes[disks["/dev/sda1"]]["Size"] == 64
    main(["down", job_name])


def test_a_spot_job_is_priced_from_the_spot_price_history_and_told_where_notices_come(aws, job_name, tmp_path, capsys):
    job = make_job(job_name, 1, **options(aws, spot=True, run_root=str(tmp_path / "runs")))
    (inst,) = live(job_instances(aws, job_name))
    assert inst.get("InstanceLifecycle") == "spot"
    (command,) = job.launch([str(Path(__file__).parent / "allreduce.py"), job.run_dir])
    assert command.wait(timeout=300).ok
    # The trainer polls EC2's metadata for the two-minute notice (speedrun.stopping).
    assert "SPEEDRUN_SPOT_NOTICE_URL=http://169.254.169.254/latest/meta-data/spot/instance-action" in \
        Path(command.dir, "run.sh").read_text()
    capsys.readouterr()
    assert main(["ls", job_name]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(job_name) and "c5.large" in ln)
    assert " spot " in line and "spot price history" in line and "?" not in line
    main(["down", job_name])


def test_autostop_powers_off_only_after_the_idle_time_with_no_command_running(tmp_path):
    socket, done = f"autostop-{os.getpid()}", tmp_path / "powered-off"
    tmux = ["tmux", "-L", socket]
    subprocess.run([*tmux, "new-session", "-d", "-s", "task", "-n", "shell", "sh"], check=True)
    subprocess.run([*tmux, "new-window", "-d", "-t", "task", "-n", "train", "sleep 600"], check=True)
    status = tmp_path / ".speedrun" / "autostop" / "status"
    env = {**os.environ, "HOME": str(tmp_path)}
    script = aws_provider.autostop_script(1 / 60, tmux_socket=socket, poweroff=f"touch {done}", every_s=0.1)
    try:
        subprocess.run(["bash", "-c", script], env=env, check=True)
        # Twenty checks (two seconds, twice the idle time) with the train window alive: no power-off.
        wait_for(lambda: status.exists() and int(status.read_text().split()[0]) >= 20)
        assert status.read_text().split()[1] == "busy" and not done.exists()
        subprocess.run([*tmux, "kill-window", "-t", "task:train"], check=True)
        wait_for(done.exists)  # idle now: powered off after a second
        assert status.read_text().split()[1] == "idle"
    finally:
        pid = (tmp_path / ".speedrun" / "autostop" / "pid").read_text().strip()
        subprocess.run(["kill", pid], capture_output=True)
        subprocess.run([*tmux, "kill-server"], capture_output=True)


def test_autostop_never_powers_off_while_a_command_runs_whatever_the_clock_reads(tmp_path):
    # A clock that moves a whole second at every read: the watcher once read it twice per check
    # (when it saw the command, then to count the idle time), so a second's tick between the two
    # made a busy host "idle for 1 s" and, with a 1 s limit, powered it off (CI: "5 busy 1").
    socket, done = f"autostop-tick-{os.getpid()}", tmp_path / "powered-off"
    tmux = ["tmux", "-L", socket]
    subprocess.run([*tmux, "new-session", "-d", "-s", "task", "-n", "shell", "sh"], check=True)
    subprocess.run([*tmux, "new-window", "-d", "-t", "task", "-n", "train", "sleep 600"], check=True)
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "date").write_text(f'#!/bin/sh\nn=$(cat "{tmp_path}/clock" 2>/dev/null || echo 1000)\n'
                                f'echo $((n + 1)) > "{tmp_path}/clock"\necho $n\n')
    (shims / "date").chmod(0o755)
    status = tmp_path / ".speedrun" / "autostop" / "status"
    env = {**os.environ, "HOME": str(tmp_path), "PATH": f"{shims}:{os.environ['PATH']}"}
    script = aws_provider.autostop_script(1 / 60, tmux_socket=socket, poweroff=f"touch {done}", every_s=0.05)
    try:
        subprocess.run(["bash", "-c", script], env=env, check=True)
        wait_for(lambda: done.exists() or (status.exists() and int(status.read_text().split()[0]) >= 10))
        assert not done.exists(), status.read_text()
        assert status.read_text().split()[1:] == ["busy", "0"]
    finally:
        pid = (tmp_path / ".speedrun" / "autostop" / "pid").read_text().strip()
        subprocess.run(["kill", pid], capture_output=True)
        subprocess.run([*tmux, "kill-server"], capture_output=True)


def wait_for(condition, timeout: float = 60.0) -> None:
    """Poll a condition (a background watcher's progress), failing after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_launch_ls_logs_kill_down_from_the_command_line(aws, job_name, tmp_path, capsys):
    allreduce = Path(__file__).parent / "allreduce.py"
    flags = [*cli_flags(aws), "-n", "2", "--run-root", str(tmp_path / "runs")]
    assert main(["launch", job_name, *flags, "--env", "OMP_NUM_THREADS=1", "--wait", "--", str(allreduce),
                 "{run_dir}"]) == 0
    run_dir = capsys.readouterr().out.split("run dir ", 1)[1].split(":", 1)[0]
    assert sorted(p.name for p in Path(run_dir).glob("rank*.json")) == ["rank0.json", "rank1.json"]
    instances = sorted(live(job_instances(aws, job_name)),
                       key=lambda i: int(aws_provider.tag_value(i, "speedrun:task")))

    assert main(["ls", job_name]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [tuple(ln.split()[:4]) for ln in out[1:3]] == [
        (job_name, str(i), f"root@{inst['PrivateIpAddress']}", "succeeded") for i, inst in enumerate(instances)]
    assert any(ln.startswith(job_name) and "c5.large" in ln and "on-demand" in ln for ln in out[3:])
    assert main(["logs", job_name, "1"]) == 0
    # The program's line, not necessarily the log's last: torchrun's agent on node 1 may log after
    # it, when node 0's agent (the rendezvous store's host) has already exited.
    assert "rank 1 of 2: sum 3" in capsys.readouterr().out.splitlines()
    assert main(["kill", job_name]) == 0
    assert len(live(job_instances(aws, job_name))) == 2  # kill ends the commands, not the machines
    assert main(["down", job_name]) == 0
    assert live(job_instances(aws, job_name)) == [] and not registry.exists(job_name)


def two_zones(aws) -> tuple[str, str, dict]:
    """The test server's two zones (the job's, then the one a replacement can go to) and make_job
    options with no zone pinned; every other zone of the region has no capacity."""
    from aws_server import ZONES
    home, other = aws.zones
    for zone in ZONES:
        if zone not in (home, other):
            aws.fail("RunInstances", "InsufficientInstanceCapacity", zone=zone)
    opts = options(aws)
    opts.pop("zone")
    return home, other, opts


def task_instance(aws, job: str, index: int) -> dict:
    return next(i for i in live(job_instances(aws, job)) if aws_provider.tag_value(i, "speedrun:task") == str(index))


def test_a_replacement_stays_in_the_jobs_zone_and_goes_to_another_when_it_has_no_capacity(aws, efs_mount, job_name,
                                                                                          caplog):
    home, other, opts = two_zones(aws)
    opts.update(shared_storage=True, efs_mount=efs_mount)
    job = make_job(job_name, 2, **opts)
    group = f"speedrun-{job_name}"
    first = task_instance(aws, job_name, 1)
    assert first["Placement"]["AvailabilityZone"] == home and aws.placement_of[first["InstanceId"]] == group

    # Capacity in the job's zone: the replacement goes there, into the job's placement group.
    host = job.provider.replace(1, 2)
    same = task_instance(aws, job_name, 1)
    assert same["InstanceId"] != first["InstanceId"] and same["Placement"]["AvailabilityZone"] == home
    assert aws.placement_of[same["InstanceId"]] == group
    assert host.spec.host == same["PrivateIpAddress"] and host.shell("echo here").text == "here\n"

    # None there now: the next zone with capacity, outside the group (a cluster placement group is
    # one zone's), with a subnet and an EFS mount target made in that zone.
    aws.fail("RunInstances", "InsufficientInstanceCapacity", zone=home)
    aws.client().terminate_instances(InstanceIds=[same["InstanceId"]])  # as a spot reclaim would
    caplog.set_level("INFO", logger="speedrun.cluster")
    host = job.provider.replace(1, 2)
    moved = task_instance(aws, job_name, 1)
    assert moved["Placement"]["AvailabilityZone"] == other and moved["InstanceId"] not in aws.placement_of
    assert aws.placement_of[task_instance(aws, job_name, 0)["InstanceId"]] == group  # task 0 stays in it
    assert host.spec.host == moved["PrivateIpAddress"] and host.shell("echo there").text == "there\n"
    assert (f"outside placement group {group}" in caplog.text
            and f"launched 1 on-demand c5.large instance(s) in {other}" in caplog.text)
    efs = aws.client("efs")
    (fs,) = efs.describe_file_systems()["FileSystems"]
    subnets = {n["SubnetId"]: n["AvailabilityZone"] for n in aws.client().describe_subnets()["Subnets"]}
    targets = [subnets.get(t["SubnetId"])
               for t in efs.describe_mount_targets(FileSystemId=fs["FileSystemId"])["MountTargets"]]
    assert sorted(targets) == [home, other]

    # The job spans two zones now; found again by name, nothing is launched.
    launches = aws.calls.count("RunInstances")
    again = make_job(job_name, 2, **opts)
    assert aws.calls.count("RunInstances") == launches and [t.ip for t in again] == \
        [task_instance(aws, job_name, 0)["PrivateIpAddress"], moved["PrivateIpAddress"]]
    main(["down", job_name])
    assert aws.client().describe_placement_groups()["PlacementGroups"] == []


@pytest.mark.slow
def test_an_instance_terminated_mid_run_is_replaced_in_another_zone_and_the_run_finishes(aws, efs_mount, job_name):
    """...once that zone has capacity again: it refuses the replacement twice, and the watcher tries again
    with backoff (--recover-wait)."""
    from cli_run import wait_for
    from speedrun.track import read_jsonl
    from test_cluster_recovery import start_watch

    home, other, opts = two_zones(aws)
    job = make_job(job_name, 2, **{**opts, "shared_storage": True, "efs_mount": efs_mount})
    job.launch([*TRAIN, "--epochs", "8", "--out", job.run_dir], env=ONE_THREAD)
    thread, outcome = start_watch(job, recover_wait_s=60)  # tries again after 3.75 s, then 7.5 s
    wait_for(lambda: Path(job.run_dir, "checkpoint.pt").exists(), 300, "the first checkpoint")
    old = task_instance(aws, job_name, 1)
    aws.fail("RunInstances", "InsufficientInstanceCapacity", zone=home)  # the job's zone is full now
    aws.fail("RunInstances", "InsufficientInstanceCapacity", zone=other, times=2)  # the other one, twice
    aws.client().terminate_instances(InstanceIds=[old["InstanceId"]])  # as a spot reclaim would
    thread.join(timeout=900)
    try:
        assert not thread.is_alive() and "error" not in outcome, outcome
        assert [s.state for s in outcome["states"]] == ["succeeded", "succeeded"]
        new = task_instance(aws, job_name, 1)
        assert (new["InstanceId"] != old["InstanceId"]
                and job[1].ip == new["PrivateIpAddress"] != old["PrivateIpAddress"])
        # Trained on across the two zones' subnets.
        assert (old["Placement"]["AvailabilityZone"], new["Placement"]["AvailabilityZone"]) == (home, other)
        # Both refusals are recorded, with the waits between the tries, then the recovery itself.
        *refusals, event = read_jsonl(Path(job.run_dir) / "recoveries.jsonl")
        assert [(r["kind"], r["task"], r["attempt"], r["next_try_in_s"]) for r in refusals] == [
            ("no_capacity", 1, 1, 3.75), ("no_capacity", 1, 2, 7.5)]
        assert all("InsufficientInstanceCapacity" in r["reason"] or "no capacity" in r["reason"] for r in refusals)
        assert event["kind"] == "lost_host"
        assert event["replaced"] == {"1": [f"root@{old['PrivateIpAddress']}", f"root@{new['PrivateIpAddress']}"]}
        results = json.loads(Path(job.run_dir, "results.json").read_text())
        assert results["status"] == "finished" and results["epochs_run"] == 8 and len(results["recoveries"]) == 3
        # What the loss cost at two c5.large's on-demand price, $0.17 an hour (the table's: the Price
        # List API lists none here), and the run's cost includes it.
        assert results["recoveries"][-1]["price_per_hour"] == pytest.approx(0.17)
        assert results["lost_usd"] == pytest.approx(results["lost_s"] * 0.17 / 3600) and results["lost_usd"] > 0
        assert results["price"]["source"].startswith("on-demand table of ")
        assert results["billed_s"] == pytest.approx(results["total_s"] + results["lost_s"])
        assert results["cost_usd"] == pytest.approx(0.17 * (results["total_s"] + results["lost_s"]) / 3600)
    finally:
        main(["down", job_name])


# --- when AWS, or the way to it, fails: one line, exit 3; when the user's input is wrong: exit 2 ---
def error_of(capsys) -> str:
    """The command's error: one line, the last on stderr (progress lines come before it), no traceback."""
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith(("speedrun: error: ", "speedrun: internal error: "))]
    assert len(errors) == 1 and err.splitlines()[-1] == errors[0] and "Traceback" not in err, err
    return errors[0]


@pytest.mark.parametrize("call", ["RunInstances", "CreateTags"])
def test_a_reply_that_is_not_aws_at_launch_is_one_line_exit_3_and_leaves_nothing(aws, job_name, capsys, call):
    # RunInstances: nothing starts. CreateTags (naming each new instance's task): the instances
    # have started, so the launch must terminate them, as after any failure once they run.
    aws.garble(call)
    code = main(["launch", job_name, *cli_flags(aws), "-n", "2", "--", "-c", "pass"])
    line = error_of(capsys)
    assert code == 3 and line.startswith("speedrun: error: ") and call in line and "HTTP 502" in line, line
    started = sorted(i["InstanceId"] for i in job_instances(aws, job_name))
    assert len(started) == (0 if call == "RunInstances" else 2) and all(i in line for i in started)
    assert live(job_instances(aws, job_name)) == [] and not registry.exists(job_name)
    assert aws.client().describe_placement_groups()["PlacementGroups"] == []


def test_aws_out_of_reach_is_exit_3_and_an_unknown_profile_exit_2(aws, monkeypatch, capsys):
    import socket
    with socket.socket() as s:  # a port on loopback that nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed}")
    assert main(["launch", "unreachable", *cli_flags(aws), "--", "-c", "pass"]) == 3
    line = error_of(capsys)
    assert "cannot reach AWS" in line and "DescribeInstances" in line, line

    monkeypatch.setenv("AWS_ENDPOINT_URL", aws.endpoint)
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    assert main(["launch", "no-profile", *cli_flags(aws), "--", "-c", "pass"]) == 2
    assert "no-such-profile" in error_of(capsys)
    assert aws.calls == []


def test_aws_failing_inside_is_exit_3_and_a_bad_argument_exit_2(aws, job_name, capsys):
    aws.fail("DescribeImages", "InternalError")  # AWS's own failure: try again later
    assert main(["launch", job_name, *cli_flags(aws), "--", "-c", "pass"]) == 3
    line = error_of(capsys)
    assert "DescribeImages" in line and "InternalError" in line, line
    aws.faults.clear()
    aws.fail("DescribeImages", "InvalidAMIID.Malformed")  # the user's: their --image
    assert main(["launch", job_name, *cli_flags(aws), "--", "-c", "pass"]) == 2
    assert "InvalidAMIID.Malformed" in error_of(capsys)
    assert "RunInstances" not in aws.calls and not registry.exists(job_name)


def test_down_of_a_job_without_a_placement_group_never_asks_for_one(aws, job_name, capsys):
    make_job(job_name, 1, **options(aws, placement_group=False))
    for call in ("DescribePlacementGroups", "DeletePlacementGroup"):
        aws.garble(call)  # asking would fail: it must not ask
    aws.calls.clear()
    assert main(["down", job_name]) == 0, capsys.readouterr().err
    assert not {"DescribePlacementGroups", "DeletePlacementGroup"} & set(aws.calls)
    assert live(job_instances(aws, job_name)) == [] and not registry.exists(job_name)


def test_down_failing_midway_keeps_the_record_says_what_is_left_and_runs_again(aws, job_name, capsys):
    make_job(job_name, 1, **options(aws))
    (inst,) = live(job_instances(aws, job_name))
    group = f"speedrun-{job_name}"

    aws.garble("TerminateInstances")  # the reply is lost: the instance may or may not be going
    assert main(["down", job_name]) == 3
    line = error_of(capsys)
    assert "TerminateInstances" in line and f"{inst['InstanceId']} may still run" in line and \
        f"speedrun down {job_name}" in line, line
    assert live(job_instances(aws, job_name)) != [] and registry.exists(job_name)

    aws.faults.clear()
    aws.garble("DeletePlacementGroup")  # the instance goes, its placement group stays
    assert main(["down", job_name]) == 3
    line = error_of(capsys)
    assert "DeletePlacementGroup" in line and f"terminated {inst['InstanceId']}" in line and \
        f"placement group {group} is left" in line and f"speedrun down {job_name}" in line, line
    assert live(job_instances(aws, job_name)) == [] and registry.exists(job_name)
    assert [g["GroupName"] for g in aws.client().describe_placement_groups()["PlacementGroups"]] == [group]

    aws.faults.clear()
    assert main(["down", job_name]) == 0  # run again: what was left goes, and then the record
    assert aws.client().describe_placement_groups()["PlacementGroups"] == [] and not registry.exists(job_name)


@pytest.mark.parametrize("cidr", ["0.0.0.0/1", "10.0.0.0/8", "198.50.0.0/15", "2001:db8::/32", "::/1"])
def test_an_ssh_cidr_wider_than_a_16_is_refused_unless_allowed_by_name(aws, job_name, capsys, cidr):
    assert main(["launch", job_name, *cli_flags(aws), "--ssh-cidr", cidr, "--", "-c", "pass"]) == 2
    line = error_of(capsys)
    assert f"--ssh-cidr {cidr}" in line and "--ssh-cidr-allow-wide" in line, line
    assert aws.calls == [] and not registry.exists(job_name)  # refused before anything was asked of AWS


def test_a_wide_ssh_cidr_is_admitted_only_with_its_override_and_never_the_whole_internet(aws, job_name, capsys):
    jobs = {"a": dict(ssh_cidr="198.51.0.0/16"), "b": dict(ssh_cidr="2001:db8:1::/48"),  # as wide as they go
            "c": dict(ssh_cidr="198.0.0.0/8", ssh_cidr_allow_wide=True)}
    for suffix, extra in jobs.items():
        make_job(f"{job_name}-{suffix}", 1, **options(aws, **extra))
    (group,) = aws.client().describe_security_groups(
        Filters=[{"Name": "group-name", "Values": ["speedrun"]}])["SecurityGroups"]
    ssh = [rule for rule in group["IpPermissions"] if rule.get("FromPort") == 22]
    assert sorted(r["CidrIp"] for rule in ssh for r in rule.get("IpRanges", [])) == ["198.0.0.0/8", "198.51.0.0/16"]
    assert [r["CidrIpv6"] for rule in ssh for r in rule.get("Ipv6Ranges", [])] == ["2001:db8:1::/48"]
    for suffix in jobs:
        assert main(["down", f"{job_name}-{suffix}"]) == 0
    capsys.readouterr()
    assert main(["launch", job_name, *cli_flags(aws), "--ssh-cidr", "0.0.0.0/0", "--ssh-cidr-allow-wide",
                 "--", "-c", "pass"]) == 2
    assert "whole internet" in error_of(capsys)


@pytest.mark.parametrize("key", ["AWS_CONTAINER_AUTHORIZATION_TOKEN", "AWS_BEARER_TOKEN_BEDROCK"])
def test_watcher_env_refuses_every_aws_secret(key, capsys):
    assert main(["launch", "wh", "--recover", "--watcher-host", "root@ctl", "--watcher-env", f"{key}=s3cr3t",
                 "--", "x.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"speedrun: error: --watcher-env {key}: speedrun does not copy AWS credentials") and \
        "\n" not in err and "s3cr3t" not in err


def test_watcher_env_passes_a_path_to_a_token_file_on_the_controller(capsys):
    # A file's path on the controller is no secret: past the refusal, the local provider's own error.
    assert main(["launch", "wh", "--recover", "--watcher-host", "root@ctl", "--watcher-env",
                 "AWS_WEB_IDENTITY_TOKEN_FILE=/var/run/token", "--", "x.py"]) == 2
    assert "the local provider's machines cannot be watched from another host" in capsys.readouterr().err
