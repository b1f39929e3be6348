"""SlurmProvider: provider="slurm" behind the same interface as local, ssh and aws.

Slurm, not speedrun, picks the nodes, and only when the job runs; what speedrun reads of a job's
tasks (their logs, statuses, the run's files) is on the cluster's shared file system, seen from the
machine you launch on. So the provider's hosts are that machine, one per task, and the job itself
(slurm/job.py) asks Slurm for the rest.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

from speedrun.cluster.hosts import Host, LocalHost
from speedrun.cluster.provider import Provider
from speedrun.cluster.slurm.config import SlurmConfig
from speedrun.cluster.ssh import SSHOptions
from speedrun.errors import SpeedrunError


class SlurmProvider(Provider):
    """A Slurm cluster, reached through its clients (sbatch, squeue...) on this machine."""

    kind = "slurm"

    def __init__(self, config: SlurmConfig):
        self.config = config
        self._host = LocalHost()

    @classmethod
    def from_args(cls, job: str, hosts: Sequence[str], ssh: SSHOptions | None,
                  config_dir: str | os.PathLike | None, options: Mapping[str, Any]) -> SlurmProvider:
        """The provider for SlurmConfig's options (partition=..., time=...); hosts and ssh options do
        not apply: Slurm chooses the nodes."""
        if hosts:
            raise SpeedrunError("hosts were given for the slurm provider: Slurm chooses the nodes "
                                "(give their number, -n, and a partition)")
        if ssh is not None:
            raise SpeedrunError("ssh options were given for the slurm provider: it reaches the cluster through "
                                "Slurm's own clients on this machine")
        return cls(SlurmConfig.from_options(options))

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> SlurmProvider:
        config = dict(record["config"])
        return cls(SlurmConfig(**{**config, "sbatch_args": tuple(config.get("sbatch_args", ()))}))

    def hosts(self, count: int) -> list[Host]:
        """This machine for every task: their files are on the shared file system it sees."""
        return [self._host] * count

    def machine_type(self) -> str:
        return f"slurm node ({self.config.partition or 'default partition'})"

    def record(self) -> dict[str, Any]:
        return {"kind": self.kind, "config": {**dataclasses.asdict(self.config),
                                              "sbatch_args": list(self.config.sbatch_args)}}
