"""The Slurm test cluster itself (tests/slurm_cluster.py): the ground the Slurm provider's tests
stand on. A batch job gets two nodes, and one srun step puts a torchrun on each: they meet at the
first node's address and all-reduce over gloo, as a speedrun job on Slurm does."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_cluster import SlurmCluster, require
from speedrun.cluster.slurm.api import SlurmFailed
from speedrun.cluster.slurm.config import SlurmConfig
from speedrun.cluster.slurm.submit import check_request
from speedrun.errors import SpeedrunError

pytestmark = pytest.mark.slurm
ALLREDUCE = Path(__file__).with_name("allreduce.py")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    require("the Slurm tests")
    with SlurmCluster(3, workdir=tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def test_a_two_node_batch_job_runs_one_torchrun_per_node_and_they_all_reduce(slurm, tmp_path):
    script = tmp_path / "job.sh"
    script.write_text(f"""#!/bin/bash
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
addr=$(scontrol show node "$head" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')
# Each node's own interface: the machine's host name resolves to an address outside the namespaces.
srun --ntasks-per-node=1 bash -c '
    echo "$SLURMD_NODENAME $(ip -o -4 addr show eth0 | awk "{{print \\$4}}")" > {tmp_path}/node-$SLURM_NODEID
    GLOO_SOCKET_IFNAME=eth0 exec {sys.executable} -m torch.distributed.run --nnodes=2 --node-rank=$SLURM_NODEID \\
        --nproc-per-node=1 --master-addr='"$addr"' --master-port=29500 {ALLREDUCE} {tmp_path}'
""")
    r = subprocess.run(["sbatch", "--wait", "-N", "2", "-o", str(tmp_path / "job.out"), str(script)],
                       env={**os.environ, **slurm.env}, capture_output=True, text=True, timeout=300)
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert r.returncode == 0, r.stderr + log
    nodes = [(tmp_path / f"node-{i}").read_text().split() for i in range(2)]
    assert [n[0] for n in nodes] == ["node1", "node2"]
    assert [n[1] for n in nodes] == [f"{slurm.node_address(i)}/28" for i in (1, 2)]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["world_size"], r["sum"]) for r in ranks] == [(2, 3.0), (2, 3.0)]


def in_cluster(slurm, monkeypatch):
    for k, v in slurm.env.items():
        monkeypatch.setenv(k, v)


def test_a_request_the_cluster_can_run_is_checked_without_queueing_anything(slurm, monkeypatch):
    in_cluster(slurm, monkeypatch)
    partition = check_request(SlurmConfig(), 3)
    assert (partition.name, partition.default, partition.nodes) == ("debug", True, 3)
    assert check_request(SlurmConfig(partition="debug", time="10:00"), 2).name == "debug"
    assert slurm.client("squeue", "-h").stdout.strip() == ""


@pytest.mark.parametrize("options, nodes, line", [
    ({"partition": "gpu"}, 1, "partition 'gpu' does not exist on this cluster (its partitions: debug)"),
    ({}, 5, "the job asks for 5 nodes, but partition debug has 3"),
    ({"gpus_per_node": 8}, 1, "cannot run 1 node(s) in partition debug: sbatch: Invalid generic resource (gres) "
                              "specification"),
    ({"constraint": "h100"}, 1, "cannot run 1 node(s) in partition debug: sbatch: allocation failure: Invalid "
                                "feature specification"),
])
def test_a_request_the_cluster_cannot_run_is_one_line_quoting_slurm(slurm, monkeypatch, options, nodes, line):
    in_cluster(slurm, monkeypatch)
    with pytest.raises(SpeedrunError) as e:
        check_request(SlurmConfig(**options), nodes)
    assert str(e.value) == line and not isinstance(e.value, SlurmFailed)


def test_no_slurm_client_on_path_is_one_line(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SpeedrunError, match=r"^sinfo is not on PATH: the slurm provider runs where Slurm's clients "):
        check_request(SlurmConfig(), 1)


def test_a_controller_that_does_not_answer_is_exit_3(slurm, monkeypatch, tmp_path):
    conf = tmp_path / "slurm.conf"  # the same cluster, its controller asked at a port where nothing listens
    conf.write_text(Path(slurm.env["SLURM_CONF"]).read_text() + "SlurmctldPort=9\n")
    (tmp_path / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    with pytest.raises(SlurmFailed, match="^cannot list the cluster's partitions: ") as e:
        check_request(SlurmConfig(), 1)
    assert e.value.exit_code == 3
