"""HostProvider: a provider whose machines speedrun reaches itself, as hosts (this machine, SSH
hosts, EC2 instances), its jobs TmuxJobs: every task a tmux session on one host.

make_job on such a provider gets the hosts (`hosts(n)`), then:

1. looks at each host (one round trip): if the job is running there (a command other than the
   idle shell is alive in its tmux sessions), it reconnects to that run and changes nothing; with
   restart it replaces it;
2. otherwise it starts a new run: claims `<run_root>/<job>/<run_name>.<NN>` on task 0 (storage
   every task sees), makes one tmux session per task, syncs the working tree to each host (`sync`)
   and runs the setup script once per host, again only when its text changed (a hash is kept on
   the host).

open_job finds the sessions again from the job's record; a host a watcher elsewhere put in place
of a lost one is reached with the key that watcher pinned for it (`adopt_host_keys`).
"""
from __future__ import annotations

import logging
import posixpath
from abc import abstractmethod
from pathlib import Path
from typing import Sequence

from speedrun import files
from speedrun.cluster import tmux
from speedrun.cluster.hosts import Host
from speedrun.cluster.job import JobSpec
from speedrun.cluster.probe import probe_task, resolve
from speedrun.cluster.provider import Provider
from speedrun.cluster.registry import JobRecord
from speedrun.cluster.ssh import SSHHost
from speedrun.cluster.task import Task, tmux_message
from speedrun.cluster.tmux_job import HostSetup, TmuxJob, make_task, setup_mark_of, start_tasks
from speedrun.cluster.utils import REACH_TIMEOUT_S, parallel
from speedrun.errors import SpeedrunError

log = logging.getLogger("speedrun.cluster")


class HostProvider(Provider):
    """Hands out hosts; its jobs are TmuxJobs (see the module's text)."""

    @abstractmethod
    def hosts(self, count: int) -> list[Host]:
        """Hosts for `count` tasks, task i on the i-th (the same Host may come back several times:
        several tasks on one machine)."""

    @property
    def run_root(self) -> str | None:
        """Where run directories go by default on storage every host sees (EFS...); None: none."""
        return None

    def replace(self, index: int, count: int) -> Host:
        """A host to take over task `index` (of `count`) from one that was lost (recovery)."""
        raise SpeedrunError(f"the {self.kind} provider has no machine to put in place of a lost one")

    def make_job(self, name: str, num_tasks: int, spec: JobSpec) -> TmuxJob:
        hosts = self.hosts(num_tasks)
        run_root = spec.run_root or self.run_root or "runs"
        hs = HostSetup(spec.tmux_socket, spec.host_dir, spec.sync, spec.sync_exclude, spec.setup)
        setup_mark = setup_mark_of(hs, name)
        probes = parallel(lambda i: probe_task(hosts[i], hs.tmux_socket, f"{name}-{i}", i, setup_mark),
                          range(num_tasks))

        def make_tasks(run_dir: str, seqs: Sequence[int]) -> list[Task]:
            return [make_task(name, i, hosts[i], probes[i], run_dir, hs, seqs[i]) for i in range(num_tasks)]

        running = [i for i, p in enumerate(probes) if p.running]
        if running and not spec.restart:
            run_dirs = {p.run_dir for p in probes if p.session}
            if len(run_dirs) != 1 or not all(p.session for p in probes):
                raise SpeedrunError(f"job {name} runs on tasks {running} but not on all {num_tasks} as asked; "
                                    f"kill it (speedrun kill {name}) or pass restart=True (--restart)")
            tasks = make_tasks(run_dirs.pop(), [p.last_seq for p in probes])
            log.info("job %s is running (%s); reconnected without changing it", name, tasks[0].run_dir)
            return TmuxJob(name, tasks, tasks[0].run_dir, self, python=spec.python, reconnected=True, host_setup=hs)
        spec.before_new_run()
        root = resolve(run_root, probes[0].home, hosts[0].is_local)
        if len({h.key for h in hosts}) > 1 and not posixpath.isabs(run_root):
            log.warning("run_root %r is relative, so each host has its own %s; give a path on storage "
                        "all hosts see (NFS, EFS...) to keep the run in one place", run_root, root)
        r = hosts[0].shell(tmux.allocate_run_dir(root, name, spec.run_name))
        fields = tmux.parse_fields(r.text)
        if r.returncode != 0 or "run_dir" not in fields:
            raise SpeedrunError(f"cannot make a run directory under {root} on {hosts[0].name}: "
                                f"{tmux_message(r.stderr)}")
        tasks = make_tasks(fields["run_dir"], [0] * num_tasks)
        start_tasks(tasks, name, hs, [p.setup_hash for p in probes])
        return TmuxJob(name, tasks, fields["run_dir"], self, python=spec.python, reconnected=False, host_setup=hs)

    def open_job(self, rec: JobRecord, *, probe: bool = True, watcher_known_hosts: str = "") -> TmuxJob:
        hosts = self.hosts(rec.num_tasks)
        adopt_host_keys(rec, hosts, watcher_known_hosts)  # before a replacement the watcher met is reached
        sessions = [f"{rec.name}-{i}" for i in range(rec.num_tasks)]

        def task(i: int) -> Task:
            p = None
            if probe:
                try:
                    p = probe_task(hosts[i], rec.tmux_socket, sessions[i], i, "/dev/null", timeout=REACH_TIMEOUT_S)
                except SpeedrunError:
                    pass  # unreachable: status says so; other operations raise when they try it
            home = p.home if p else "~"
            cwd = resolve(rec.cwd, home, hosts[i].is_local) if rec.cwd else f"{rec.run_dir}/task-{i}"
            return Task(job=rec.name, index=i, host=hosts[i], run_dir=rec.run_dir, cwd=cwd, home=home,
                        ip=p.ip if p else "", tmux_socket=rec.tmux_socket, last_seq=p.last_seq if p else 0)

        tasks = parallel(task, range(rec.num_tasks))
        return TmuxJob(rec.name, tasks, rec.run_dir, self, python=rec.python, reconnected=True,
                       price_per_hour=rec.price_per_hour)


def adopt_host_keys(rec: JobRecord, hosts: list[Host], remote_known_hosts: str) -> None:
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
