"""Slurm taking a job's nodes away: a node that dies mid-run (the job is requeued onto the spare node
and the run finishes), and a job preempted by another partition's.

A file of its own, each test with a cluster of its own (a killed node stays down; preemption needs
a second partition): under pytest-xdist it runs beside tests/cluster/test_slurm_jobs.py, whose
helpers it uses.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from cli_run import wait_for
from slurm_cluster import SlurmCluster, require
from speedrun.track import read_jsonl
from test_distributed import write_recipe
from test_slurm_jobs import EPOCHS, ONE_THREAD, TRAIN, launch, speedrun, steps_logged

pytestmark = pytest.mark.slurm


def test_a_node_that_dies_mid_run_is_replaced_by_the_spare_and_the_run_finishes(tmp_path, capsys, monkeypatch):
    require("the Slurm tests")
    recipe = write_recipe(tmp_path / "r.py", 2, 32, epochs=EPOCHS, model="resnet-fmnist-tiny-gn")
    with SlurmCluster(3, workdir=tmp_path / "cluster") as cluster:
        for k, v in cluster.env.items():
            monkeypatch.setenv(k, v)
        run = launch(capsys, "survivor", tmp_path, "-n", "2", *ONE_THREAD, "--", *TRAIN, "--recipe", str(recipe),
                     "--log-every", "1")
        wait_for(lambda: (run / "checkpoint.pt").exists() and steps_logged(run) >= 60, 600, "a checkpoint")
        # The spare is held back at first, so that the job waits after the loss and `ls` can say why.
        cluster.client("scontrol", "update", "NodeName=node3", "State=DRAIN", "Reason=held back by the test")
        # node2 dies: its slurmd, its job's slurmstepd and every process it ran, at once.
        pids = subprocess.run(["ip", "netns", "pids", cluster.netns.hosts[2].namespace], capture_output=True,
                              text=True, check=True).stdout.split()
        for pid in pids:
            os.kill(int(pid), signal.SIGKILL)
        line = wait_for(lambda: next((ln for ln in speedrun(capsys, "ls", "survivor")[1].splitlines()
                                      if "lost since its last start" in ln), None), 300, "ls to name the lost node")
        assert "PENDING" in line and "lost since its last start: node2 DOWN" in line, line
        cluster.client("scontrol", "update", "NodeName=node3", "State=RESUME")
        code, out, err = speedrun(capsys, "launch", "survivor", "--provider", "slurm", "-n", "2", "--run-root",
                                  str(tmp_path), "--wait", "--", *TRAIN)
        assert code == 0, out + err
        results = json.loads((run / "results.json").read_text())
        assert results["status"] == "finished" and results["world_size"] == 2
        # One recovery: the node failure. The first start's srun, cancelling its step as Slurm ended the
        # start, must not cancel the next start's step as well (a second recovery, "failed (exit 137)").
        (lost,) = results["recoveries"]
        assert lost["kind"] == "node_failure" and results["interruptions"], results["recoveries"]
        assert lost["reason"].startswith("node(s) lost: node2 (") and lost["resumed"], lost
        last = sorted((run / "task-1" / "cmds").glob("*-train"))[-1]
        assert (last / "node").read_text().strip() == "node3" and (last / "status").read_text().strip() == "0"
        assert cluster.node_states()["node2"].startswith("down")


def test_a_preempted_job_is_requeued_and_its_recovery_says_it_was_preempted(tmp_path, capsys, monkeypatch):
    require("the Slurm tests")
    # The command waits until it is started again (the requeued start has a recovery recorded).
    script = tmp_path / "wait_for_requeue.py"
    script.write_text("import os, time\n"
                      "while not os.path.exists(os.path.join(os.environ['SPEEDRUN_RUN_DIR'], 'recoveries.jsonl')):\n"
                      "    time.sleep(0.5)\n")
    with SlurmCluster(2, workdir=tmp_path / "cluster", urgent_partition="urgent") as cluster:
        for k, v in cluster.env.items():
            monkeypatch.setenv(k, v)
        run = launch(capsys, "preempted", tmp_path, "-n", "2", "--", str(script))
        wait_for(lambda: len(list(run.glob("task-*/cmds/*/node"))) == 2, 120, "the command on both nodes")
        cluster.client("sbatch", "--partition", "urgent", "--nodes", "2", "--wrap", "true")  # takes both nodes
        code, out, err = speedrun(capsys, "launch", "preempted", "--provider", "slurm", "-n", "2", "--run-root",
                                  str(tmp_path), "--wait", "--", str(script))
        assert code == 0, out + err
        (recovery,) = read_jsonl(run / "recoveries.jsonl")
        assert recovery["kind"] == "preemption" and recovery["reason"] == "Slurm preempted the job (requeued)"
        assert recovery["requeue"] == 1 and not recovery["resumed"]
