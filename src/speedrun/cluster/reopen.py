"""Finding a job again: `open_job` turns the record make_job left on this machine into a Job, to
inspect, follow, attach to or kill. When a watcher on a controller host (controller.py) keeps the
job going, that watcher's record is the newer one: `refreshed` takes the provider's part of it from
there (it may have replaced hosts) and `adopt_host_keys` the host keys it pinned for them."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
from pathlib import Path

from speedrun import files
from speedrun.cluster import registry
from speedrun.cluster.hosts import Host
from speedrun.cluster.job import Job
from speedrun.cluster.probe import probe_task, resolve
from speedrun.cluster.providers import provider_from_record
from speedrun.cluster.slurm import SlurmProvider
from speedrun.cluster.slurm.job import slurm_job
from speedrun.cluster.ssh import SSHHost
from speedrun.cluster.task import Task
from speedrun.cluster.utils import REACH_TIMEOUT_S, parallel
from speedrun.errors import SpeedrunError

log = logging.getLogger("speedrun.cluster")


def open_job(name: str, config_dir: str | os.PathLike | None = None, *, probe: bool = True) -> Job:
    """The job `name` as recorded by make_job on this machine, to inspect, follow, attach to or kill.

    probe=False skips contacting the hosts (enough for status and kill; run and launch need it)."""
    rec, pinned = refreshed(registry.load(name, config_dir), config_dir)  # a watcher elsewhere may have moved tasks
    prov = provider_from_record(rec.provider, registry.path_of(name, config_dir))
    if isinstance(prov, SlurmProvider):  # its tasks are read through the run directory: nothing to probe
        job = slurm_job(name, rec.num_tasks, prov, rec.run_dir, python=rec.python, reconnected=True)
        job.price_per_hour = rec.price_per_hour
        return job
    hosts_ = prov.hosts(rec.num_tasks)
    adopt_host_keys(rec, hosts_, pinned)  # and met a replacement there first
    sessions = [f"{name}-{i}" for i in range(rec.num_tasks)]

    def task(i: int) -> Task:
        p = None
        if probe:
            try:
                p = probe_task(hosts_[i], rec.tmux_socket, sessions[i], i, "/dev/null", timeout=REACH_TIMEOUT_S)
            except SpeedrunError:
                pass  # unreachable: status says so; other operations raise when they try it
        home_ = p.home if p else "~"
        cwd = resolve(rec.cwd, home_, hosts_[i].is_local) if rec.cwd else f"{rec.run_dir}/task-{i}"
        return Task(job=name, index=i, host=hosts_[i], run_dir=rec.run_dir, cwd=cwd, home=home_,
                    ip=p.ip if p else "", tmux_socket=rec.tmux_socket, last_seq=p.last_seq if p else 0)

    tasks = parallel(task, range(rec.num_tasks))
    return Job(name, tasks, rec.run_dir, prov, python=rec.python, reconnected=True, price_per_hour=rec.price_per_hour)


def refreshed(rec: registry.JobRecord, config_dir: str | os.PathLike | None = None) -> tuple[registry.JobRecord, str]:
    """A job's record with the provider's state as its controller keeps it (a watcher there may have
    replaced hosts) and this machine's paths, saved here when it changed; and the controller's
    known_hosts text (for adopt_host_keys). The record as it is and "" when the job has no watcher
    elsewhere or the controller does not answer within seconds."""
    w = rec.watcher
    if not w:
        return rec, ""
    cut = "--- speedrun: known_hosts ---"  # between the record and the pinned keys, in one round trip
    try:
        host = provider_from_record(registry.load(w["job"], config_dir).provider).hosts(1)[0]
        home = shlex.quote(w["home"])
        r = host.shell(f"cat {home}/jobs/{shlex.quote(rec.name)}.json && echo {shlex.quote(cut)} && "
                       f"cat {home}/known_hosts 2>/dev/null; true", timeout=REACH_TIMEOUT_S)
        text, _, known_hosts = r.text.partition(f"{cut}\n")
        remote = json.loads(text)["provider"]
    except (SpeedrunError, ValueError, KeyError) as e:
        log.debug("job %s: its controller's record is out of reach (%s); using this one", rec.name, e)
        return rec, ""
    provider = {**remote, **{k: rec.provider[k] for k in w["paths"]}}
    if provider != rec.provider:
        rec = dataclasses.replace(rec, provider=provider)
        registry.save(rec, config_dir)
    return rec, known_hosts


def adopt_host_keys(rec: registry.JobRecord, hosts: list[Host], remote_known_hosts: str) -> None:
    """Pin here the keys the controller pinned for the job's `hosts` (its known_hosts text), in place
    of any this machine has for those names. The watcher learned a replacement's key on first
    contact, as this machine would have; only the job's current hosts are taken, because the rest
    of the controller's copy may be older than this machine's (AWS reuses addresses)."""
    local = (rec.watcher or {}).get("known_hosts")
    if not local or not remote_known_hosts:
        return
    names = {h.spec.host if h.spec.port in (None, 22) else f"[{h.spec.host}]:{h.spec.port}"
             for h in hosts if isinstance(h, SSHHost)}
    path = Path(local)
    lines = path.read_text().splitlines() if path.exists() else []

    def pinned(text: list[str]) -> dict[str, set[str]]:
        """host name -> its keys ("type base64"), for the job's host names only."""
        found: dict[str, set[str]] = {}
        for line in text:
            fields = line.split()
            if len(fields) >= 3 and not line.startswith(("#", "@")):
                for name in set(fields[0].split(",")) & names:
                    found.setdefault(name, set()).add(" ".join(fields[1:3]))
        return found
    mine, theirs = pinned(lines), pinned(remote_known_hosts.splitlines())
    changed = sorted(n for n in theirs if theirs[n] != mine.get(n))
    if not changed:
        return
    kept = [ln for ln in lines if not (ln.split() and set(ln.split()[0].split(",")) & set(changed))]
    files.write_text(path, "".join(f"{ln}\n" for ln in kept) +
                     "".join(f"{n} {key}\n" for n in changed for key in sorted(theirs[n])))
    log.info("job %s: pinned the host key(s) its watcher learned for %s", rec.name, ", ".join(changed))
