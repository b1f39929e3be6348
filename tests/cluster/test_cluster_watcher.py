"""The watcher on a controller host, for real: `speedrun launch ... --recover --watcher-host` on
network-namespace hosts. Two hosts run the job, a third is the spare, a fourth is the controller;
the `speedrun launch` process ends once the job runs, and nobody on this side watches it."""
from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from cli_run import speedrun, wait_for
from netns import NetnsCluster, require
from speedrun.cluster import open_job
from speedrun.track import read_jsonl
from test_cluster_e2e import TRAIN

pytestmark = [pytest.mark.netns, pytest.mark.slow]
EPOCHS = 8  # as in test_cluster_recovery: the loss comes after the first checkpoint, well before the end


@pytest.fixture(scope="module")
def four_hosts():
    """Hosts 0-2 for jobs (2 the spare), host 3 the controller."""
    require("the controller tests")
    with NetnsCluster(4) as cluster:
        cluster.controller = cluster.hosts[3]
        yield cluster


def ssh_flags(cluster: NetnsCluster, hosts) -> list[str]:
    return ["--hosts", ",".join(h.spec for h in hosts), "--identity", str(cluster.client_key),
            "--known-hosts", str(cluster.known_hosts)]


def state(job: str, window: str) -> list[str]:
    return [s.state for s in open_job(job, probe=False).status(window)]


def test_kill_stops_the_remote_watcher_before_the_job(four_hosts, tmp_path, job_name):
    gate = tmp_path / "never"  # the job runs until killed
    script = tmp_path / "wait.py"
    script.write_text(f"import pathlib, time\nwhile not pathlib.Path({str(gate)!r}).exists():\n    time.sleep(0.05)\n")
    controller = four_hosts.controller
    r = speedrun("launch", job_name, *ssh_flags(four_hosts, four_hosts.hosts[:1]), "--run-root", str(tmp_path / "runs"),
                 "--recover", "--watcher-host", controller.spec, "--", str(script))
    assert r.returncode == 0, r.stderr
    assert f"watched from {controller.spec}" in r.stdout
    assert state(f"{job_name}-watcher", "watch") == ["running"] and state(job_name, "train") == ["running"]
    r = speedrun("ls", f"{job_name}-watcher")  # its own window, `watch`, without saying so
    assert r.stdout.splitlines()[1].split()[:4] == [f"{job_name}-watcher", "0", controller.spec, "running"]

    r = speedrun("kill", job_name)
    assert r.returncode == 0, r.stderr
    assert f"stopped its watcher on {controller.spec}" in r.stdout
    # Killed first: it could not take the killed job for a failed one and start it again.
    assert state(f"{job_name}-watcher", "watch") == ["killed"] and state(job_name, "train") == ["killed"]


def test_a_watcher_on_a_controller_host_replaces_a_lost_host_and_the_job_finishes(four_hosts, tmp_path, job_name):
    (first, lost, spare), controller = four_hosts.hosts[:3], four_hosts.controller
    runs = tmp_path / "runs"
    secret = "s3cr3t-not-for-logs"
    r = speedrun("launch", job_name, *ssh_flags(four_hosts, [first, lost, spare]), "-n", "2", "--run-root", str(runs),
                 "--env", "OMP_NUM_THREADS=1", "--env", f"SOME_TOKEN={secret}", "--recover", "--max-restarts", "2",
                 "--watcher-host", controller.spec, "--", *TRAIN, "--epochs", str(EPOCHS), "--out", "{run_dir}")
    assert r.returncode == 0, r.stderr
    (run_dir,) = (runs / job_name).iterdir()
    # What the controller holds: speedrun's code, the job's record and key (private to its user).
    base = controller.home / ".speedrun" / "watchers" / job_name
    assert (base / "src" / "speedrun" / "cluster" / "recovery.py").is_file()
    for private in (base / "home" / "keys" / "identity", base / "home" / "watch" / f"{job_name}.json"):
        assert stat.S_IMODE(private.stat().st_mode) == 0o600

    wait_for(lambda: (run_dir / "checkpoint.pt").exists(), 300, "the first checkpoint")
    four_hosts.remove_host(lost)  # sshd, the training process and its network gone
    wait_for(lambda: state(f"{job_name}-watcher", "watch") != ["running"], 900, "the watcher to end")
    assert state(f"{job_name}-watcher", "watch") == ["succeeded"]

    (event,) = read_jsonl(run_dir / "recoveries.jsonl")
    assert event["replaced"] == {"1": [lost.spec, spare.spec]} and event["resumed"]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "finished" and results["epochs_run"] == EPOCHS and len(results["recoveries"]) == 1

    # This side learns the replacement from the controller: ls shows the job where it ran.
    r = speedrun("ls", job_name)
    assert r.returncode == 0, r.stderr
    rows = [line.split()[:4] for line in r.stdout.splitlines()[1:3]]
    assert rows == [[job_name, "0", first.spec, "succeeded"], [job_name, "1", spare.spec, "succeeded"]]
    r = speedrun("logs", f"{job_name}-watcher")
    assert f"task 1 moved from {lost.spec} to {spare.spec}" in r.stdout and secret not in r.stdout
    assert secret not in r.stderr

    assert speedrun("down", job_name).returncode == 0
    assert speedrun("ls", f"{job_name}-watcher").returncode != 0  # forgotten with the job


def waiting_script(tmp_path) -> str:
    """A job command that runs until killed."""
    script = tmp_path / "wait.py"
    script.write_text("import time\nwhile True:\n    time.sleep(1)\n")
    return str(script)


def test_launch_restart_replaces_the_watcher_of_the_old_run(four_hosts, tmp_path, job_name):
    controller, runs = four_hosts.controller, tmp_path / "runs"
    launch = ["launch", job_name, *ssh_flags(four_hosts, four_hosts.hosts[:1]), "--run-root", str(runs),
              "--recover", "--watcher-host", controller.spec, "--", waiting_script(tmp_path)]
    assert speedrun(*launch).returncode == 0
    base = controller.home / ".speedrun" / "watchers" / job_name
    # Reconnected with another launch (more restarts): the watcher there repeats this one now.
    r = speedrun(*launch[:-2], "--max-restarts", "5", *launch[-2:])
    assert r.returncode == 0 and "reconnected" in r.stdout, r.stderr
    assert json.loads((base / "home" / "watch" / f"{job_name}.json").read_text())["max_restarts"] == 5
    assert state(f"{job_name}-watcher", "watch") == ["running"]

    r = speedrun(*launch[:-2], "--restart", *launch[-2:])
    assert r.returncode == 0, r.stderr
    assert f"stopped its watcher on {controller.spec}" in r.stderr  # the old run's, before the new run started
    new_run = next(line for line in r.stdout.splitlines() if "run dir" in line).split("run dir ")[1].split(":")[0]
    assert sorted(str(p) for p in (runs / job_name).iterdir())[-1] == new_run
    # The watcher there now watches the new run: what it holds names it.
    held = json.loads((base / "home" / "jobs" / f"{job_name}.json").read_text())
    assert held["run_dir"] == new_run
    assert state(f"{job_name}-watcher", "watch") == ["running"]
    r = speedrun("kill", job_name)  # and kill finds it: the record still names it
    assert r.returncode == 0, r.stderr
    assert f"stopped its watcher on {controller.spec}" in r.stdout
    assert state(f"{job_name}-watcher", "watch") == ["killed"] and state(job_name, "train") == ["killed"]


def test_a_watcher_that_cannot_be_stopped_keeps_down_from_ending_the_job(four_hosts, tmp_path, job_name):
    controller = four_hosts.add_host(four_hosts.address(4))  # a controller of its own: it goes away here
    job_host = four_hosts.hosts[0]
    r = speedrun("launch", job_name, *ssh_flags(four_hosts, [job_host]), "--run-root", str(tmp_path / "runs"),
                 "--recover", "--watcher-host", controller.spec, "--", waiting_script(tmp_path))
    assert r.returncode == 0, r.stderr
    four_hosts.remove_host(controller)  # out of reach: its watcher may still run, for all this side knows

    r = speedrun("down", job_name)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"speedrun: error: job {job_name}: its watcher on "
                                                             f"{controller.spec} could not be stopped"), r.stderr
    assert "nothing of the job was removed" in r.stderr
    assert state(job_name, "train") == ["running"]  # not ended: the watcher would start it again

    r = speedrun("launch", job_name, *ssh_flags(four_hosts, [job_host]), "--run-root", str(tmp_path / "runs"),
                 "--restart", "--", waiting_script(tmp_path))
    assert r.returncode == 2 and "no new run was started" in r.stderr.splitlines()[-1]
    assert state(job_name, "train") == ["running"]

    r = speedrun("kill", job_name)  # the tasks are stopped, loudly not the watcher
    assert r.returncode == 2
    assert f"killed job {job_name} (1 of 1 task(s))" in r.stdout and "stopped its watcher" not in r.stdout
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("speedrun: error: ")]
    assert f"its watcher on {controller.spec} could not be stopped" in line and "may start the job again" in line
    assert state(job_name, "train") == ["killed"]
    assert speedrun("ls", f"{job_name}-watcher").returncode == 0  # kept: only it lets a later kill stop the watcher

    # The way out the line gives when that machine is gone for good: its watcher's record deleted.
    Path(line.rsplit("delete ", 1)[1].rstrip(")")).unlink()
    r = speedrun("down", job_name)
    assert r.returncode == 0, r.stderr
