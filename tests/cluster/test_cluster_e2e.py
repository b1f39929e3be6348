"""End to end: torchrun launched on every task, through the API and from the command line.

The two-host runs train the real `tiny` recipe with `speedrun train` under torchrun (gloo, one
process per host), on hosts that are network namespaces of this machine sharing its filesystem.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from speedrun.cli import main
from speedrun.cluster import open_job
from speedrun.recipes import load_recipe
from mlflow_server import MLflowServer
from wandb_files import wandb_env, wandb_runs

HERE = Path(__file__).parent
TRAIN = ["-m", "speedrun", "train", "--recipe", "tiny", "--device", "cpu"]
# One thread per process: two processes with a thread per core each would fight over two cores.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.slow


def last_epoch() -> str:
    """How the trainer's log line for the tiny recipe's last epoch starts (e.g. "epoch   3/3")."""
    n = load_recipe("tiny").epochs
    return rf"epoch\s+{n}/{n}\b"


def check_trained(run_dir: str, num_tasks: int) -> None:
    """The trainer's outputs and each task's torchrun log are in the run directory."""
    run = Path(run_dir)
    results = json.loads((run / "results.json").read_text())
    assert results["status"] == "finished" and results["world_size"] == num_tasks
    assert results["epochs_run"] == load_recipe("tiny").epochs
    assert list((run / "tb").glob("events.out.tfevents.*"))
    logs = [next((run / f"task-{i}" / "cmds").glob("*-train")) / "log" for i in range(num_tasks)]
    assert re.search(last_epoch(), logs[0].read_text())
    for i, log in enumerate(logs):
        assert (log.parent / "status").read_text().strip() == "0", log.read_text()[-2000:]
        assert f"--node-rank={i}" in (log.parent / "command.sh").read_text()


def test_local_launch_runs_one_torchrun_per_task(local_job, tmp_path):
    job = local_job(num_tasks=2)
    commands = job.launch([str(HERE / "allreduce.py"), job.run_dir], env=ONE_THREAD)
    results = job.wait(timeout=300)
    assert [r.status for r in results] == [0, 0]
    records = [json.loads(Path(job.run_dir, f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world_size"], r["sum"], r["task"]) for r in records] == [(0, 2, 3.0, "0"), (1, 2, 3.0, "1")]
    assert all(r["run_dir"] == job.run_dir for r in records)
    # Each task's log has its rank's line. Not necessarily as the last line: torchrun's exit barrier
    # races the store on task 0's torchrun, which may close it first, and task 1's torchrun then logs
    # "Error waiting on exit barrier" after a run that succeeded (seen under load; exit status 0).
    assert [f"rank {i} of 2: sum 3" in r.output.splitlines() for i, r in enumerate(results)] == [True, True]
    assert [c.name for c in commands] == ["train", "train"]
    assert all(f"--nnodes=2 --node-rank={i} " in Path(c.dir, "command.sh").read_text() for i, c in enumerate(commands))


def test_two_hosts_train_through_the_api(ssh_job):
    job = ssh_job()
    job.launch([*TRAIN, "--out", job.run_dir], env=ONE_THREAD)
    relaunched = ssh_job()  # the experiment script run again while training: reconnects
    assert relaunched.reconnected and relaunched.run_dir == job.run_dir
    relaunched.launch([*TRAIN, "--out", job.run_dir])  # nothing new is started
    results = job.wait(timeout=600)
    assert [r.status for r in results] == [0, 0]
    assert [len(list(Path(job.run_dir, f"task-{i}", "cmds").glob("*-train"))) for i in (0, 1)] == [1, 1]
    check_trained(job.run_dir, 2)


def speedrun(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """The real command line, in a process of its own."""
    return subprocess.run([sys.executable, "-m", "speedrun", *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ.copy())


def test_two_hosts_train_from_the_cli(netns, shared_dir, job_name, capsys):
    ssh = ["--hosts", ",".join(netns.specs), "--identity", str(netns.client_key),
           "--known-hosts", str(netns.known_hosts), "--run-root", str(shared_dir / "cli-runs")]
    # Tracked by W&B, offline (its files stay in the run directory), and by an MLflow server on this
    # machine's address on the hosts' network.
    offline = [f"{k}={v}" for k, v in wandb_env(shared_dir).items() if k.startswith("WANDB_")]
    with MLflowServer(shared_dir / "mlflow", host=netns.address(-1)) as server:
        r = speedrun("launch", job_name, *ssh, "--env", "OMP_NUM_THREADS=1", *(f"--env={e}" for e in offline),
                     "--price-per-hour", "1.25", "--follow", "--", *TRAIN, "--out", "{run_dir}", "--track", "wandb",
                     "--track", f"mlflow={server.uri}")
        assert r.returncode == 0, r.stderr
        # One MLflow run, rank 0's, a child of the job's parent run, tagged with the job and its provider.
        client = server.client()
        experiment = client.get_experiment_by_name("speedrun").experiment_id
        group = f"tags.`speedrun.kind` = 'group' and tags.`speedrun.group` = '{job_name}'"
        [parent] = client.search_runs([experiment], group)
        [child] = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
        assert parent.info.run_name == job_name and child.info.run_name == f"{job_name}/run.01"
        assert child.info.status == "FINISHED" and child.data.tags["speedrun.provider"] == "ssh"
        assert child.data.tags["speedrun.job"] == job_name and child.data.tags["speedrun.world_size"] == "2"
    run_dir = r.stdout.split("run dir ", 1)[1].split(":", 1)[0]
    assert run_dir == str(shared_dir / "cli-runs" / job_name / "run.01")
    assert re.search(r"^\[0\] " + last_epoch(), r.stdout, re.M)  # --follow printed task 0's log
    check_trained(run_dir, 2)
    # One W&B run, rank 0's, in the job's group, tagged with the job and its provider.
    [(run, config, history, exits)] = wandb_runs(Path(run_dir))
    assert run["run_group"] == job_name and run["display_name"] == f"{job_name}/run.01" and exits == [0]
    assert config["speedrun.provider"] == "ssh" and config["speedrun.job"] == job_name
    assert config["speedrun.world_size"] == "2" and history
    # Owned machines at the price the user gave: what the run cost is in its results.
    results = json.loads(Path(run_dir, "results.json").read_text())
    assert results["price"] == {"machine_type": "ssh host", "market": "given", "machines": 2, "usd_per_hour": 1.25,
                                "source": "given with --price-per-hour"}
    assert results["cost_usd"] == pytest.approx(2 * 1.25 * results["billed_s"] / 3600)

    # The other commands in this process (`speedrun` costs seconds to start: it imports torch).
    assert main(["ls", job_name]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [tuple(row[:4]) for row in rows] == [
        (job_name, "0", netns.specs[0], "succeeded"), (job_name, "1", netns.specs[1], "succeeded")]
    assert main(["logs", job_name, "1"]) == 0
    task1_log = next(Path(run_dir, "task-1", "cmds").glob("*-train")) / "log"
    assert capsys.readouterr().out == task1_log.read_text()
    assert main(["kill", job_name]) == 0
    assert run_dir in capsys.readouterr().out
    assert main(["ls", job_name, "--window", "nothing"]) == 0
    assert [line.split()[3] for line in capsys.readouterr().out.splitlines()[1:]] == ["stopped", "stopped"]
    open_job(job_name, probe=False).close()  # the master connections the launching process left open
