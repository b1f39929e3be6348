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
