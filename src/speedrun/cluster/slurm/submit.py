"""Asking Slurm for a job's nodes: what is wrong with a request is found before anything of the job
is made (run directory, record), each in one line, exit 2.

`check_request` asks the controller: the partition (named, or the cluster's default) and its node
count from `sinfo`, then the whole request with `sbatch --test-only`, which Slurm answers as it would
answer the real submission (an unknown partition, an impossible node count, a GPU request the
nodes cannot meet) without queueing anything.
"""
from __future__ import annotations

from dataclasses import dataclass

from speedrun.cluster.slurm.api import run_client
from speedrun.cluster.slurm.config import SlurmConfig
from speedrun.errors import SpeedrunError


@dataclass(frozen=True)
class Partition:
    """One line of `sinfo -s`: a partition and its nodes."""

    name: str
    default: bool
    nodes: int  # all of them, whatever their state


def partitions() -> list[Partition]:
    """The cluster's partitions as sinfo lists them (the default one marked)."""
    out = run_client(["sinfo", "-h", "-s", "-o", "%P %F"], what="list the cluster's partitions")
    found = []
    for line in out.splitlines():
        fields = line.split()
        counts = fields[1].split("/") if len(fields) == 2 else []  # allocated/idle/other/total
        if len(counts) == 4 and all(c.isdigit() for c in counts):
            name = fields[0]
            found.append(Partition(name.rstrip("*"), name.endswith("*"), int(counts[3])))
    return found


def check_request(config: SlurmConfig, nodes: int) -> Partition:
    """The partition a job of `nodes` nodes with these settings would run in; SpeedrunError (one
    line, Slurm's own message quoted) when the cluster could never run it."""
    known = partitions()
    if config.partition is not None:
        partition = next((p for p in known if p.name == config.partition), None)
        if partition is None:
            names = ", ".join(p.name for p in known) or "none"
            raise SpeedrunError(f"partition {config.partition!r} does not exist on this cluster (its partitions: "
                                f"{names})")
    else:
        partition = next((p for p in known if p.default), None)
        if partition is None:
            raise SpeedrunError("this cluster has no default partition: name one (partition=..., --partition)")
    if nodes > partition.nodes:
        raise SpeedrunError(f"the job asks for {nodes} nodes, but partition {partition.name} has "
                            f"{partition.nodes}")
    run_client(["sbatch", "--test-only", f"--nodes={nodes}", *config.sbatch_options(), "--wrap=true"],
               what=f"run {nodes} node(s) in partition {partition.name}")
    return partition
