"""A job's lifecycle: making it (`make_job`) and recording it (`save_record`). Finding it again is
reopen.py's (`open_job`); stopping its watcher on a controller host, watcher.py's.

make_job checks what it was given, makes the provider, and leaves the rest to it (its make_job:
host_provider.py for machines speedrun reaches itself, slurm/job.py for Slurm): reconnect to the
job if it runs, else start a new run. Then it records the job under ~/.config/speedrun/jobs so
that the CLI can find it again.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Sequence

from speedrun.cluster import registry
from speedrun.cluster.job import DEFAULT_SYNC_EXCLUDE, Job, JobSpec
from speedrun.cluster.provider import MachinesLeft, Provider
from speedrun.cluster.providers import DEFAULT_KIND, make_provider
from speedrun.cluster.ssh import SSHOptions
from speedrun.cluster.task import check_name
from speedrun.cluster.watcher import stop_watcher_for_new_run
from speedrun.errors import SpeedrunError
from speedrun.money import check_price

log = logging.getLogger("speedrun.cluster")


def make_job(name: str, num_tasks: int = 1, *, provider: str | Provider | None = None, hosts: Sequence[str] = (),
             run_root: str | None = None, run_name: str = "run", setup: str | None = None,
             sync: str | os.PathLike | None = None, sync_exclude: Sequence[str] = DEFAULT_SYNC_EXCLUDE,
             restart: bool = False, python: str = "python3", host_dir: str = "~/.speedrun",
             tmux_socket: str = "speedrun", ssh: SSHOptions | None = None,
             config_dir: str | os.PathLike | None = None, price_per_hour: float | None = None,
             **options: Any) -> Job:
    """Get num_tasks hosts and a run directory for job `name`, or reconnect to it if it is running.

    provider: "local" (this machine), "ssh" (then `hosts`: ["user@host:port", ...]), "aws" (instances
        speedrun starts; `options` are AWSConfig's: instance_type, spot, region, ...), "slurm" (num_tasks
        nodes of a Slurm cluster, one Slurm job submitted by launch; `options` are SlurmConfig's:
        partition, gpus_per_node, time, ...; see docs/slurm.md), another in providers.PROVIDERS, or a
        Provider. None: local (providers.DEFAULT_KIND), which refuses hosts, naming ssh.
    run_root: where run directories go, `<run_root>/<name>/<run_name>.<NN>`; for several hosts, a path
        they all see (NFS, EFS...). Relative: from the current directory (local) or the home (ssh).
        None: the provider's shared storage (aws: <efs_mount>/runs), else "runs".
    setup: a shell script run once per host before anything else, again whenever its text changes.
    sync: a local directory (your working tree) copied to `<host_dir>/code/<name>` on each host at every
        new run, without `sync_exclude`; commands then run there.
    restart: replace the job if it is running, instead of reconnecting to it.
    python: the Python on the hosts (for torchrun and helpers).
    host_dir: speedrun's directory on each host (setup marks, synced code).
    tmux_socket: the tmux server (`tmux -L <socket>`) that holds the job's sessions.
    ssh: how to reach ssh hosts (SSHOptions: known_hosts, identity_file, ssh_config,
        accept_new_host_keys). Host keys are checked strictly; accept_new_host_keys learns unknown
        ones and pins them in known_hosts (default $SPEEDRUN_HOME/known_hosts). For provider="ssh"
        SSHOptions' fields may also come as keywords of their own (`identity_file=...`,
        `known_hosts=...`), as earlier releases took them; not one field both ways.
    config_dir: speedrun's directory on this machine (default $SPEEDRUN_HOME or ~/.config/speedrun).
    price_per_hour: what one of the job's machines costs per hour, $, for runs to record what they
        cost (results.json); for any provider, ahead of the one AWS's prices give. None: a job found
        running keeps the price it was launched with.
    """
    check_name(name, "job name")
    check_name(run_name, "run name")
    if num_tasks < 1:
        raise SpeedrunError(f"a job needs at least one task, got {num_tasks}")
    if not (host_dir.startswith("/") or host_dir == "~" or host_dir.startswith("~/")):
        raise SpeedrunError(f"host_dir must be absolute or start with ~/, got {host_dir!r}")
    if sync is not None and not Path(sync).is_dir():
        raise SpeedrunError(f"sync directory {sync} does not exist")
    if price_per_hour is not None:
        check_price(price_per_hour, "price_per_hour")
    prov = make_provider(DEFAULT_KIND if provider is None else provider, name, hosts, ssh, config_dir, options)
    # A watcher elsewhere still watching the old run would take the new one's sessions for its
    # own lost tasks and start them again; the new run's record has no watcher.
    spec = JobSpec(run_root=run_root, run_name=run_name, setup=setup,
                   sync=Path(sync).resolve() if sync is not None else None, sync_exclude=tuple(sync_exclude),
                   restart=restart, python=python, host_dir=host_dir, tmux_socket=tmux_socket,
                   config_dir=config_dir, before_new_run=lambda: stop_watcher_for_new_run(name, config_dir))
    try:
        job = prov.make_job(name, num_tasks, spec)
    except MachinesLeft:
        record_left(name, num_tasks, prov, python, config_dir)
        raise
    keep_price(job, price_per_hour, config_dir)
    save_record(job, config_dir)
    return job


def record_left(name: str, num_tasks: int, prov: Provider, python: str,
                config_dir: str | os.PathLike | None) -> None:
    """Record a job whose start failed with machines left running (MachinesLeft), so that `speedrun
    down NAME` finds and ends them: it has no run directory yet. A job recorded already keeps its
    record, which finds them as well."""
    if not registry.exists(name, config_dir):
        registry.save(registry.JobRecord(name=name, num_tasks=num_tasks, provider=prov.record(), run_dir="",
                                         cwd=None, python=python, created=time.time()), config_dir)


def keep_price(job: Job, given: float | None, config_dir: str | os.PathLike | None) -> None:
    """The price per machine-hour `given` to make_job, else, for a job found running in the same
    run directory, the one it was launched with (so that relaunches cost the same)."""
    old = registry.recorded(job.name, config_dir)
    job.price_per_hour = given if given is not None or old is None or old.run_dir != job.run_dir \
        else old.price_per_hour


def save_record(job: Job, config_dir: str | os.PathLike | None = None) -> None:
    """Record the job (again, after a host was replaced) so that the CLI finds it."""
    old = registry.recorded(job.name, config_dir)  # the same run keeps its watcher elsewhere (controller.py)
    registry.save(registry.JobRecord(
        name=job.name, num_tasks=len(job), provider=job.provider.record(), run_dir=job.run_dir,
        python=job.python, created=time.time(), window=job.launched.name if job.launched else "train",
        watcher=old.watcher if old is not None and old.run_dir == job.run_dir else None,
        price_per_hour=job.price_per_hour, **{"cwd": None, **job.record_fields()}), config_dir)
