"""The watcher on a controller host for an AWS job, for real against the AWS test server: two
instances train, a namespace host on the VPC's network is the controller, and the `speedrun
launch` process ends once the job runs. The controller reaches moto through tests/aws_relay.py
and has AWS credentials of its own (a file on it); the user's are never copied there."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from aws_relay import Relay
from cli_run import speedrun, wait_for
from speedrun.cluster import open_job
from speedrun.cluster.registry import speedrun_home
from speedrun.track import read_jsonl
from test_cluster_aws import IMAGE, task_instance, two_zones
from test_cluster_e2e import TRAIN

pytestmark = [pytest.mark.netns, pytest.mark.aws, pytest.mark.slow]
EPOCHS = 8  # as in test_cluster_aws's mid-run termination: the loss comes after the first checkpoint


@pytest.fixture
def controller(aws, tmp_path):
    """A namespace host on the test VPC's network at the job subnet's second address (one AWS keeps
    for itself, so no instance gets it), with a relay to moto on its loopback and a credentials
    file of its own. Yields (host, the endpoint it reaches moto at, its credentials file, its secret)."""
    cluster = aws.cluster
    host = cluster.add_host(cluster.address(0))
    secret = "controller-secret-never-copied"
    credentials = tmp_path / "controller-aws" / "credentials"  # stands in for ~/.aws on that host
    credentials.parent.mkdir()
    credentials.write_text(f"[default]\naws_access_key_id = controller\naws_secret_access_key = {secret}\n")
    credentials.chmod(0o600)
    try:
        with Relay(aws.endpoint, tmp_path / "relay.sock", host.namespace) as relay:
            yield host, relay.endpoint, credentials, secret
    finally:
        cluster.remove_host(host)


def files_holding(root: Path, text: str) -> list[Path]:
    """The files under root whose bytes contain text."""
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and text.encode() in p.read_bytes()]


def flags(aws, host, endpoint: str, run_root: Path, tasks: int) -> list[str]:
    """`speedrun launch` options for an AWS job of `tasks` instances watched from `host`, which reaches
    moto at `endpoint`."""
    return ["--provider", "aws", "-n", str(tasks), "--instance-type", "c5.large", "--image", IMAGE,
            "--vpc-cidr", aws.VPC_CIDR, "--private-ips", "--ssh-user", "root", "--no-shared-storage",
            "--run-root", str(run_root), "--recover", "--watcher-host", host.spec,
            "--identity", str(aws.cluster.client_key), "--known-hosts", str(aws.cluster.known_hosts),
            "--watcher-env", f"AWS_ENDPOINT_URL={endpoint}",
            "--watcher-env", "AWS_EC2_METADATA_DISABLED=true"]  # no instance role to look for here


def test_a_controller_without_aws_credentials_is_one_line_and_no_watcher(aws, controller, tmp_path, job_name):
    host, endpoint, _, _ = controller
    r = speedrun("launch", job_name, *flags(aws, host, endpoint, tmp_path / "runs", 1), "--zone", aws.zone, "--",
                 waiting(tmp_path))
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1].startswith(f"speedrun: error: job {job_name} runs, but its watcher cannot "
                                                f"work on {host.spec}: no AWS credentials found")
    assert speedrun("ls", f"{job_name}-watcher").returncode == 2  # nothing runs there, nothing listed
    assert speedrun("down", job_name).returncode == 0


def test_a_watcher_on_a_controller_replaces_a_terminated_instance_through_the_aws_api(aws, controller, tmp_path,
                                                                                      job_name, monkeypatch):
    host, endpoint, credentials, controller_secret = controller
    home, other, _ = two_zones(aws)  # every other zone has no capacity
    user_secret = "user-secret-stays-here"  # moto takes any credentials; this one must not travel
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", user_secret)
    runs = tmp_path / "runs"
    launched = speedrun("launch", job_name, *flags(aws, host, endpoint, runs, 2), "--max-restarts", "2",
                        "--watcher-env", f"AWS_SHARED_CREDENTIALS_FILE={credentials}", "--env", "OMP_NUM_THREADS=1",
                        "--", *TRAIN, "--epochs", str(EPOCHS), "--out", "{run_dir}")
    assert launched.returncode == 0, launched.stderr
    assert f"watched from {host.spec}" in launched.stdout
    (run_dir,) = (runs / job_name).iterdir()
    old = task_instance(aws, job_name, 1)

    wait_for(lambda: (run_dir / "checkpoint.pt").exists(), 300, "the first checkpoint")
    aws.fail("RunInstances", "InsufficientInstanceCapacity", zone=home)  # the job's zone is full now
    aws.client().terminate_instances(InstanceIds=[old["InstanceId"]])  # as a spot reclaim would
    watcher = f"{job_name}-watcher"
    # "unreachable" is no end: on a loaded machine one look at the controller can take over 5 s.
    wait_for(lambda: open_job(watcher, probe=False).status("watch")[0].state not in ("running", "unreachable"), 900,
             "the watcher to end")
    assert open_job(watcher, probe=False).status("watch")[0].state == "succeeded", speedrun("logs", watcher).stdout

    # The controller asked AWS for the replacement: a new instance, in the zone with capacity.
    new = task_instance(aws, job_name, 1)
    assert new["InstanceId"] != old["InstanceId"] and new["PrivateIpAddress"] != old["PrivateIpAddress"]
    assert new["Placement"]["AvailabilityZone"] == other
    (event,) = read_jsonl(run_dir / "recoveries.jsonl")
    assert event["replaced"] == {"1": [f"root@{old['PrivateIpAddress']}", f"root@{new['PrivateIpAddress']}"]}
    assert event["resumed"] and event["price_per_hour"] == pytest.approx(0.17)
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "finished" and results["epochs_run"] == EPOCHS and len(results["recoveries"]) == 1

    # This side finds the job where it now runs, and reaches it (the host key the controller pinned).
    r = speedrun("ls", job_name)
    assert r.returncode == 0, r.stderr
    first = task_instance(aws, job_name, 0)
    assert [line.split()[:4] for line in r.stdout.splitlines()[1:3]] == [
        [job_name, "0", f"root@{first['PrivateIpAddress']}", "succeeded"],
        [job_name, "1", f"root@{new['PrivateIpAddress']}", "succeeded"]]
    logs = speedrun("logs", watcher)
    assert f"task 1 moved from root@{old['PrivateIpAddress']} to root@{new['PrivateIpAddress']}" in logs.stdout

    # No AWS secret went to the controller or into any output: neither this side's nor the controller's own.
    for secret in (user_secret, controller_secret):
        assert files_holding(host.home, secret) == []
        assert all(secret not in out.stdout + out.stderr for out in (launched, r, logs))
    assert speedrun("down", job_name).returncode == 0


def test_down_all_stops_the_watchers_first_and_removes_nothing_while_one_is_out_of_reach(aws, controller, tmp_path,
                                                                                       job_name):
    host, endpoint, credentials, _ = controller
    r = speedrun("launch", job_name, *flags(aws, host, endpoint, tmp_path / "runs", 1), "--zone", aws.zone,
                 "--watcher-env", f"AWS_SHARED_CREDENTIALS_FILE={credentials}", "--", waiting(tmp_path))
    assert r.returncode == 0, r.stderr
    watcher = f"{job_name}-watcher"
    # A copy of the watcher's record, to look at it once `down --all` forgot it.
    saved = tmp_path / "saved"
    (saved / "jobs").mkdir(parents=True)
    (saved / "jobs" / f"{watcher}.json").write_bytes((speedrun_home() / "jobs" / f"{watcher}.json").read_bytes())
    instance = task_instance(aws, job_name, 0)["InstanceId"]

    # The controller is out of this machine's reach; its watcher runs on, and still reaches the job's
    # instance (cutting the controller's link instead made the watcher take the instance for lost
    # and replace it, terminating it, when `down --all` took longer than its poll).
    aws.cluster.set_path_from_here(host, up=False)
    try:
        r = speedrun("down", "--all", "--yes")
    finally:
        aws.cluster.set_path_from_here(host, up=True)
    assert r.returncode == 2
    # This job's line: SPEEDRUN_HOME is the test session's, and a job an earlier failed test left has its own.
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith(f"speedrun: error: job {job_name}: ")]
    assert line.startswith(f"speedrun: error: job {job_name}: its watcher on {host.spec} could not be stopped")
    assert "nothing in AWS (" in line and "was removed" in line
    (reservation,) = aws.client().describe_instances(InstanceIds=[instance])["Reservations"]
    assert reservation["Instances"][0]["State"]["Name"] == "running"
    assert speedrun("ls", job_name).returncode == 0 and speedrun("ls", watcher).returncode == 0  # both kept

    r = speedrun("down", "--all", "--yes")  # reachable again: the watcher stopped, then everything removed
    assert r.returncode == 0, r.stderr
    assert f"job {job_name}: stopped its watcher on {host.spec}" in r.stderr
    # Not running there (the cut may have ended it already: it could not reach the instance either).
    assert open_job(watcher, saved, probe=False).status("watch")[0].state in ("killed", "failed (2)")
    (reservation,) = aws.client().describe_instances(InstanceIds=[instance])["Reservations"]
    assert reservation["Instances"][0]["State"]["Name"] in ("shutting-down", "terminated")
    assert speedrun("ls", job_name).returncode == 2 and speedrun("ls", watcher).returncode == 2


def waiting(tmp_path: Path) -> str:
    """A job command that runs until killed."""
    script = tmp_path / "wait.py"
    script.write_text("import time\nwhile True:\n    time.sleep(1)\n")
    return str(script)
