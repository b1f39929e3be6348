"""A Slurm node that dies mid-run: the job is requeued onto the spare node and the run finishes.

A file of its own, with a cluster of its own (the node it kills stays down): under pytest-xdist it
runs beside tests/cluster/test_slurm_jobs.py, whose helpers it uses.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from cli_run import wait_for
from slurm_cluster import SlurmCluster, require
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
        # node2 dies: its slurmd, its job's slurmstepd and every process it ran, at once.
        pids = subprocess.run(["ip", "netns", "pids", cluster.netns.hosts[2].namespace], capture_output=True,
                              text=True, check=True).stdout.split()
        for pid in pids:
            os.kill(int(pid), signal.SIGKILL)
        code, out, err = speedrun(capsys, "launch", "survivor", "--provider", "slurm", "-n", "2", "--run-root",
                                  str(tmp_path), "--wait", "--", *TRAIN)
        assert code == 0, out + err
        results = json.loads((run / "results.json").read_text())
        assert results["status"] == "finished" and results["world_size"] == 2
        assert results["recoveries"] and results["interruptions"]
        last = sorted((run / "task-1" / "cmds").glob("*-train"))[-1]
        assert (last / "node").read_text().strip() == "node3" and (last / "status").read_text().strip() == "0"
        assert cluster.node_states()["node2"].startswith("down")
