"""A job's lifecycle: making it (`make_job`), recording it (`save_record`) and putting a task on a
new host (`replace_task`). Finding it again is reopen.py's (`open_job`); stopping its watcher on a
controller host, watcher.py's.

make_job gets the hosts from the provider, then:

1. looks at each host (one round trip): if the job is running there (a command other than the
   idle shell is alive in its tmux sessions), it reconnects to that run and changes nothing; with
   restart=True it replaces it;
2. otherwise it starts a new run: claims `<run_root>/<job>/<run_name>.<NN>` on task 0 (storage
   every task sees), makes one tmux session per task, syncs the working tree to each host (`sync`)
   and runs the setup script once per host, again only when its text changed (a hash is kept on
   the host);
3. records the job under ~/.config/speedrun/jobs so that the CLI can find it again.
"""
from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import time
from pathlib import Path
from typing import Any, Sequence

from speedrun.cluster import registry, tmux
from speedrun.cluster.hosts import Host
from speedrun.cluster.job import DEFAULT_SYNC_EXCLUDE, HostSetup, Job
from speedrun.cluster.probe import TaskProbe, probe_task, resolve
from speedrun.cluster.provider import MachinesLeft, Provider
from speedrun.cluster.providers import make_provider
from speedrun.cluster.slurm import SlurmProvider
from speedrun.cluster.slurm.job import make_slurm_job
from speedrun.cluster.ssh import SSHOptions
from speedrun.cluster.task import CommandFailed, Task, check_name, tmux_message
from speedrun.cluster.utils import parallel
from speedrun.cluster.watcher import stop_watcher_for_new_run
from speedrun.errors import SpeedrunError
from speedrun.money import check_price

log = logging.getLogger("speedrun.cluster")


def make_job(name: str, num_tasks: int = 1, *, provider: str | Provider = "local", hosts: Sequence[str] = (),
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
        partition, gpus_per_node, time, ...; see docs/slurm.md), or a Provider.
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
    prov = make_provider(provider, name, hosts, ssh, config_dir, options)
    if isinstance(prov, SlurmProvider):  # one Slurm job, submitted by launch: no sessions to make or find
        job = make_slurm_job(name, num_tasks, prov, run_root=run_root, run_name=run_name, restart=restart,
                             python=python, setup=setup, sync=sync, config_dir=config_dir)
        keep_price(job, price_per_hour, config_dir)
        save_record(job, config_dir)
        return job
    try:
        hosts_ = prov.hosts(num_tasks)
    except MachinesLeft:
        record_left(name, num_tasks, prov, python, config_dir)
        raise
    run_root = run_root or prov.run_root or "runs"
    hs = HostSetup(tmux_socket, host_dir, Path(sync).resolve() if sync is not None else None, tuple(sync_exclude),
                   setup)
    setup_mark = setup_mark_of(hs, name)
    probes = parallel(lambda i: probe_task(hosts_[i], tmux_socket, f"{name}-{i}", i, setup_mark), range(num_tasks))

    def make_tasks(run_dir: str, seqs: Sequence[int]) -> list[Task]:
        return [make_task(name, i, hosts_[i], probes[i], run_dir, hs, seqs[i]) for i in range(num_tasks)]

    running = [i for i, p in enumerate(probes) if p.running]
    if running and not restart:
        run_dirs = {p.run_dir for p in probes if p.session}
        if len(run_dirs) != 1 or not all(p.session for p in probes):
            raise SpeedrunError(f"job {name} runs on tasks {running} but not on all {num_tasks} as asked; "
                                f"kill it (speedrun kill {name}) or pass restart=True (--restart)")
        tasks = make_tasks(run_dirs.pop(), [p.last_seq for p in probes])
        job = Job(name, tasks, tasks[0].run_dir, prov, python=python, reconnected=True, host_setup=hs)
        log.info("job %s is running (%s); reconnected without changing it", name, job.run_dir)
    else:
        # A watcher elsewhere still watching the old run would take the new one's sessions for its
        # own lost tasks and start them again; the new run's record has no watcher.
        stop_watcher_for_new_run(name, config_dir)
        root = resolve(run_root, probes[0].home, hosts_[0].is_local)
        if len({h.key for h in hosts_}) > 1 and not posixpath.isabs(run_root):
            log.warning("run_root %r is relative, so each host has its own %s; give a path on storage "
                        "all hosts see (NFS, EFS...) to keep the run in one place", run_root, root)
        r = hosts_[0].shell(tmux.allocate_run_dir(root, name, run_name))
        fields = tmux.parse_fields(r.text)
        if r.returncode != 0 or "run_dir" not in fields:
            raise SpeedrunError(f"cannot make a run directory under {root} on {hosts_[0].name}: "
                                f"{tmux_message(r.stderr)}")
        tasks = make_tasks(fields["run_dir"], [0] * num_tasks)
        start_tasks(tasks, name, hs, [p.setup_hash for p in probes])
        job = Job(name, tasks, fields["run_dir"], prov, python=python, reconnected=False, host_setup=hs)

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


def setup_mark_of(hs: HostSetup, job: str) -> str:
    """Where a host keeps the hash of the setup script that last succeeded there for `job`."""
    return f"{hs.host_dir.rstrip('/')}/setup/{job}.sha256"


def make_task(job: str, index: int, host: Host, probe: TaskProbe, run_dir: str, hs: HostSetup, last_seq: int) -> Task:
    code = resolve(f"{hs.host_dir.rstrip('/')}/code/{job}", probe.home, host.is_local)
    return Task(job=job, index=index, host=host, run_dir=run_dir,
                cwd=code if hs.sync is not None else f"{run_dir}/task-{index}",
                home=probe.home, ip=probe.ip, tmux_socket=hs.tmux_socket, last_seq=last_seq)


def start_tasks(tasks: Sequence[Task], job: str, hs: HostSetup, setup_hashes: Sequence[str]) -> None:
    """Each task's tmux session, then per host the synced code and the setup script (`setup_hashes`:
    what each task's host recorded, so that an unchanged setup is skipped)."""
    parallel(lambda t: t._shell(tmux.new_session(hs.tmux_socket, t.session, job, t.run_dir, t.logdir, t.cwd,
                                                 replace=True)), tasks)
    first_on_host = list({t.host.key: (t, h) for t, h in reversed(list(zip(tasks, setup_hashes)))}.values())
    if hs.sync is not None:
        log.info("copying %s to %d host(s)", hs.sync, len(first_on_host))
        parallel(lambda th: th[0].host.put(hs.sync, th[0].cwd, exclude=hs.sync_exclude, mirror=True), first_on_host)
    if hs.setup is not None:
        digest = hashlib.sha256(hs.setup.encode()).hexdigest()
        parallel(lambda th: run_setup(th[0], hs.setup, digest, th[1], setup_mark_of(hs, job)), first_on_host)


def save_record(job: Job, config_dir: str | os.PathLike | None = None) -> None:
    """Record the job (again, after a host was replaced) so that the CLI finds it."""
    hs = job.host_setup
    old = registry.recorded(job.name, config_dir)  # the same run keeps its watcher elsewhere (controller.py)
    registry.save(registry.JobRecord(
        name=job.name, num_tasks=len(job), provider=job.provider.record(), run_dir=job.run_dir,
        cwd=None if hs is None or hs.sync is None else posixpath.join(hs.host_dir.rstrip("/"), "code", job.name),
        tmux_socket=job.tasks[0].tmux_socket, python=job.python, created=time.time(),
        window=job.launched.name if job.launched else "train",
        watcher=old.watcher if old is not None and old.run_dir == job.run_dir else None,
        price_per_hour=job.price_per_hour), config_dir)


def replace_task(job: Job, index: int, host: Host) -> Task:
    """Put task `index` of a job on `host` instead (its machine was lost): a session there in the
    same run directory, the synced code and the setup, as make_job gave the others."""
    hs = job.host_setup
    if hs is None:
        raise SpeedrunError(f"job {job.name} was found again, not made, by this process: how to set up a "
                            f"replacement host is known only where make_job ran")
    old = job.tasks[index]
    probe = probe_task(host, hs.tmux_socket, old.session, index, setup_mark_of(hs, job.name))
    task = make_task(job.name, index, host, probe, job.run_dir, hs, last_seq=0)
    start_tasks([task], job.name, hs, [probe.setup_hash])
    job.tasks[index] = task
    return task


def run_setup(task: Task, setup: str, digest: str, recorded: str, mark: str) -> None:
    """Run the setup script on the task's host unless this exact script already ran there."""
    if recorded == digest:
        log.info("setup on %s is unchanged; skipped", task.host.name)
        return
    log.info("running setup on %s (log in %s)", task.host.name, task.logdir)
    result = task.run(setup, name="setup", check=False)
    if not result.ok:
        raise CommandFailed(f"setup on {task.host.name}", result.status, result.log, result.output)
    task.write(mark, digest + "\n")


