"""SlurmProvider: provider="slurm" behind the same interface as local, ssh and aws.

Slurm, not speedrun, picks the nodes, and only when the job runs; what speedrun reads of a job's
tasks (their logs, statuses, the run's files) is on the cluster's shared file system, seen from the
machine you launch on. So its jobs are SlurmJobs (slurm/job.py), whose tasks are read on that
machine and which ask Slurm for the rest.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Mapping, Sequence

from speedrun.cluster.job import JobSpec
from speedrun.cluster.provider import Provider
from speedrun.cluster.registry import JobRecord
from speedrun.cluster.slurm.config import SlurmConfig
from speedrun.cluster.slurm.job import SlurmJob, make_slurm_job, slurm_job
from speedrun.cluster.slurm.options import add_slurm_options
from speedrun.cluster.ssh import SSHOptions
from speedrun.errors import SpeedrunError


class SlurmProvider(Provider):
    """A Slurm cluster, reached through its clients (sbatch, squeue...) on this machine."""

    kind = "slurm"
    option_names = tuple(f.name for f in dataclasses.fields(SlurmConfig))
    recover_refusal = "a Slurm job requeues itself and resumes (--max-requeues, docs/slurm.md)"

    def __init__(self, config: SlurmConfig):
        self.config = config

    @classmethod
    def add_options(cls, parser: argparse.ArgumentParser) -> None:
        add_slurm_options(parser)

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

    def make_job(self, name: str, num_tasks: int, spec: JobSpec) -> SlurmJob:
        return make_slurm_job(name, num_tasks, self, self.config, spec)

    def open_job(self, rec: JobRecord, *, probe: bool = True, watcher_known_hosts: str = "") -> SlurmJob:
        """Its tasks are read through the run directory: nothing to probe, and no watcher elsewhere."""
        return slurm_job(rec.name, rec.num_tasks, self, self.config, rec.run_dir, python=rec.python,
                         reconnected=True, price_per_hour=rec.price_per_hour)

    def machine_type(self) -> str:
        return f"slurm node ({self.config.partition or 'default partition'})"

    def record(self) -> dict[str, Any]:
        return {"kind": self.kind, "config": {**dataclasses.asdict(self.config),
                                              "sbatch_args": list(self.config.sbatch_args)}}
