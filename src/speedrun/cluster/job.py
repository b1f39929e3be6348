"""Job: N tasks on N hosts (or N sessions on this machine), made and driven from Python.

    job = make_job("resnet", 2, provider="ssh", hosts=["gpu1", "gpu2"], run_root="/shared/runs",
                   setup=open("setup.sh").read(), sync=".")
    job.launch(f"-m speedrun train --recipe imagenet-2x8 --out {job.run_dir}", nproc_per_node=8)
    job.logs(follow=True)

make_job gets the hosts from the provider, then:

1. looks at each host: if the job is running there (a command other than the idle shell is alive in
   its tmux sessions), it reconnects to that run and changes nothing; with restart=True it replaces it;
2. otherwise it starts a new run: claims `<run_root>/<job>/<run_name>.<NN>` on task 0 (storage every
   task sees), makes one tmux session per task, syncs the working tree to each host (`sync`) and runs
   the setup script once per host, again only when its text changed (a hash is kept on the host);
3. records the job under ~/.config/speedrun/jobs so that the CLI can find it again.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import posixpath
import shlex
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, TextIO, TypeVar

from speedrun.cluster import registry, tmux
from speedrun.cluster.hosts import Host
from speedrun.cluster.providers import Provider, make_provider, provider_from_record
from speedrun.cluster.ssh import SSHOptions
from speedrun.cluster.tensorboard import TensorBoard, start_tensorboard
from speedrun.cluster.task import Command, CommandFailed, Result, Task, check_name, tmux_message
from speedrun.errors import SpeedrunError

log = logging.getLogger("speedrun.cluster")

# Left out when the working tree is copied to hosts: history, data, outputs and caches.
DEFAULT_SYNC_EXCLUDE = (".git", "data", "runs", "__pycache__", "*.egg-info", ".venv", "venv", ".pytest_cache",
                        ".mypy_cache", ".ruff_cache", "build", "dist")

T = TypeVar("T")
R = TypeVar("R")


def parallel(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """fn on every item at once (threads: the work is waiting on hosts); results in order.
    If some fail, raises the first failure, noting how many others failed too."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(items))) as pool:
        futures = [pool.submit(fn, x) for x in items]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            if len(errors) > 1 and isinstance(errors[0], SpeedrunError) and not isinstance(errors[0], CommandFailed):
                raise SpeedrunError(f"{errors[0]} (and {len(errors) - 1} more failed alike)") from errors[0]
            raise errors[0]
        return [f.result() for f in futures]


@dataclass
class TaskProbe:
    """What make_job learns about a task's host before deciding anything (see tmux.probe)."""

    home: str
    ip: str
    session: bool
    run_dir: str
    created: int
    now: int
    windows: list[tuple[bool, str]]  # (alive, window name)
    last_seq: int
    setup_hash: str

    @property
    def running(self) -> list[str]:
        """Names of the windows whose commands are still running (the idle shell does not count)."""
        return [name for alive, name in self.windows if alive and name != "shell"]


@dataclass
class TaskStatus:
    """One line of `speedrun ls`."""

    index: int
    host: str
    state: str  # running, succeeded, failed (N), killed, lost, idle (session, nothing launched), stopped, unreachable
    uptime_s: float | None  # age of the task's tmux session, seconds
    log: str | None


def probe_task(host: Host, socket: str, session: str, index: int, setup_mark: str) -> TaskProbe:
    """Look at task `index`'s host in one round trip (see tmux.probe); SpeedrunError if it can't serve."""
    r = host.shell(tmux.probe(socket, session, index, setup_mark, local=host.is_local))
    f = tmux.parse_fields(r.text)
    if r.returncode != 0 or "home" not in f:
        raise SpeedrunError(f"cannot inspect {host.name}: {tmux_message(r.stderr)}")
    if f.get("tmux") != "1":
        raise SpeedrunError(f"tmux is not installed on {host.name}: install it there (apt-get install tmux)")
    windows = []
    for line in f.get("window", "").splitlines():
        dead, _, name = line.partition(" ")
        windows.append((dead == "0", name))
    return TaskProbe(home=f["home"], ip=f.get("ip", "127.0.0.1"), session=f.get("session") == "1",
                     run_dir=f.get("run_dir", ""), created=int(f.get("created") or 0), now=int(f.get("now") or 0),
                     windows=windows, last_seq=int(f.get("last_seq") or 0), setup_hash=f.get("setup_hash", ""))


def resolve(path: str, home: str, local: bool) -> str:
    """An absolute path on a host: `~` and relative paths start at its home, except on this machine,
    where relative paths start at the current directory."""
    if path == "~" or path.startswith("~/"):
        return posixpath.normpath(home + path[1:])
    if posixpath.isabs(path):
        return posixpath.normpath(path)
    return str(Path(path).resolve()) if local else posixpath.normpath(posixpath.join(home, path))


class Job:
    """A job's tasks and run directory; see make_job. Methods act on all tasks in parallel."""

    def __init__(self, name: str, tasks: list[Task], run_dir: str, provider: Provider, *, python: str,
                 reconnected: bool):
        self.name, self.tasks, self.run_dir, self.provider = name, tasks, run_dir, provider
        self.python = python
        self.reconnected = reconnected  # True when make_job found this job running and joined it

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, i: int) -> Task:
        return self.tasks[i]

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)

    def __repr__(self) -> str:
        return f"Job({self.name!r}, {len(self.tasks)} tasks, run_dir={self.run_dir!r})"

    # --- on every task ---
    def run(self, command: str | Sequence[str], **kwargs: Any) -> list[Any]:
        """task.run(command, **kwargs) on every task at once; a list of their Results (or Commands)."""
        return parallel(lambda t: t.run(command, **kwargs), self.tasks)

    def upload(self, local: str | os.PathLike, remote: str | None = None) -> None:
        """task.upload on every distinct host (tasks sharing a host and path get one copy)."""
        parallel(lambda t: t.upload(local, remote), self._one_per_destination(remote or Path(local).name))

    def write(self, path: str, data: str | bytes) -> None:
        """task.write on every distinct host (tasks sharing a host and path get one copy)."""
        parallel(lambda t: t.write(path, data), self._one_per_destination(path))

    def _one_per_destination(self, path: str) -> list[Task]:
        seen: dict[tuple[str, str], Task] = {}
        for t in self.tasks:
            seen.setdefault((t.host.key, t.path(path)), t)
        return list(seen.values())

    # --- distributed training ---
    def launch(self, command: str | Sequence[str], *, nproc_per_node: int = 1, name: str = "train",
               env: Mapping[str, str] | None = None) -> list[Command]:
        """Start one torchrun per task: `torchrun --nnodes N --node-rank i --nproc-per-node P
        --master-addr <task 0> --master-port <free port there> COMMAND`, in a window named `name`.

        COMMAND is what follows torchrun's options: `train.py --lr 0.1` or `-m speedrun train ...`
        (shell text; a list is quoted for you). The environment also gets SPEEDRUN_JOB,
        SPEEDRUN_RUN_DIR, SPEEDRUN_TASK and SPEEDRUN_NUM_TASKS, plus `env`.

        If the job already runs a command of this name, nothing is started: the running commands are
        returned (reconnecting). Returns one Command per task.
        """
        check_name(name)
        if nproc_per_node < 1:
            raise SpeedrunError(f"nproc_per_node must be at least 1, got {nproc_per_node}")
        existing = parallel(lambda t: t.command(name), self.tasks)
        states = parallel(lambda c: c.state() if c else None, existing)
        running = [i for i, s in enumerate(states) if s == "running"]
        if running:
            if len(running) != len(self.tasks):
                raise SpeedrunError(f"job {self.name}: {name!r} runs on tasks {running} but not on the others; "
                                    f"kill the job (speedrun kill {self.name}) or relaunch with restart")
            log.info("job %s: %r is already running; reconnected", self.name, name)
            return [c for c in existing if c is not None]
        if self.reconnected and all(states):
            log.info("job %s: %r already ran in %s; pass restart=True to run it again", self.name, name, self.run_dir)
            return [c for c in existing if c is not None]

        n = len(self.tasks)
        master = self.tasks[0].ip if n > 1 else "127.0.0.1"
        port = self.free_port()
        text = command if isinstance(command, str) else shlex.join(command)

        def start(t: Task) -> Command:
            torchrun = (f"{self.python} -m torch.distributed.run --nnodes={n} --node-rank={t.index} "
                        f"--nproc-per-node={nproc_per_node} --master-addr={master} --master-port={port} {text}")
            variables = {"SPEEDRUN_JOB": self.name, "SPEEDRUN_RUN_DIR": self.run_dir, "SPEEDRUN_TASK": str(t.index),
                         "SPEEDRUN_NUM_TASKS": str(n), **(env or {})}
            return t.run(torchrun, background=True, name=name, env=variables)

        return parallel(start, self.tasks)

    def free_port(self) -> int:
        """A TCP port free on task 0's host: the OS picks it (bind to port 0 on all addresses)."""
        t = self.tasks[0]
        r = t.host.shell(f"{self.python} -c 'import socket; s = socket.socket(); s.bind((\"\", 0)); "
                         f"print(s.getsockname()[1])'")
        if r.returncode != 0 or not r.text.strip().isdigit():
            raise SpeedrunError(f"cannot find a free port on {t.host.name} with {self.python}: "
                                f"{tmux_message(r.stderr)}")
        return int(r.text.strip())

    def commands(self, name: str = "train") -> list[Command]:
        """The newest command of that name on each task; SpeedrunError if a task has none."""
        found = parallel(lambda t: t.command(name), self.tasks)
        missing = [i for i, c in enumerate(found) if c is None]
        if missing:
            raise SpeedrunError(f"job {self.name}: no command named {name!r} on task(s) {missing} in {self.run_dir}")
        return found  # type: ignore[return-value]

    def wait(self, name: str = "train", *, timeout: float | None = None, check: bool = True) -> list[Result]:
        """Wait for the `name` command on every task (timeout in seconds); their Results. With check,
        raise CommandFailed for the first task whose command failed."""
        results = parallel(lambda c: c.wait(timeout=timeout, check=False), self.commands(name))
        if check:
            for t, r in zip(self.tasks, results):
                if not r.ok:
                    raise CommandFailed(f"{name!r} on task {t.name} ({t.host.name})",
                                        "killed" if r.status == 137 else r.status, r.log, r.output)
        return results

    def status(self, name: str = "train") -> list[TaskStatus]:
        """Each task's state: that of its newest `name` command, else whether its session is up."""
        def one(t: Task) -> TaskStatus:
            try:
                r = t.host.shell(tmux.task_status(t.tmux_socket, t.session, t.logdir, name))
            except SpeedrunError:
                return TaskStatus(t.index, t.host.name, "unreachable", None, None)
            f = tmux.parse_fields(r.text)
            uptime = float(int(f["now"]) - int(f["created"])) if f.get("created") and f.get("now") else None
            s = f.get("status")
            if s is None:
                state = "idle" if f.get("session") == "1" else "stopped"
            elif s.isdigit():
                state = "succeeded" if s == "0" else f"failed ({s})"
            else:
                state = s
            return TaskStatus(t.index, t.host.name, state, uptime, f"{f['dir']}/log" if "dir" in f else None)
        return parallel(one, self.tasks)

    def kill(self) -> None:
        """Kill every task's tmux session and the commands in it (logs and the run directory stay)."""
        parallel(lambda t: t.kill(), self.tasks)

    def logs(self, name: str = "train", *, follow: bool = False, out: TextIO | None = None,
             tasks: Sequence[int] | None = None) -> None:
        """Write the `name` command's log of each task to `out` (default stdout), lines prefixed with
        `[i] ` when there are several tasks; with follow, keep writing until the commands end."""
        out = out or sys.stdout
        chosen = [self.tasks[i] for i in tasks] if tasks is not None else self.tasks
        commands = parallel(lambda t: t.command(name), chosen)
        lock = threading.Lock()

        def emit(t: Task, data: bytes) -> None:
            prefix = f"[{t.index}] " if len(chosen) > 1 else ""
            text = data.decode("utf-8", errors="replace")
            with lock:
                for line in text.splitlines(keepends=True):
                    out.write(prefix + line)
                out.flush()

        def one(pair: tuple[Task, Command | None]) -> None:
            t, c = pair
            if c is None:
                emit(t, f"(no command named {name!r} on task {t.name})\n".encode())
            elif not follow:
                emit(t, c.output().encode())
            else:
                p = t.host.start_shell(tmux.follow_log(c.dir))
                for line in p.stdout:
                    emit(t, line)
                p.wait()

        parallel(one, list(zip(chosen, commands)))

    def attach(self, task: int = 0, window: str | None = None) -> int:
        """Attach this terminal to a task's tmux session (Ctrl-b d detaches); the exit status."""
        return self.tasks[task].attach(window)

    def tensorboard(self, local_port: int | None = None, timeout: float = 120.0) -> TensorBoard:
        """Start TensorBoard on task 0 over the run directory (bound to 127.0.0.1 there) and forward it
        here; returns a TensorBoard with `.url` and `.close()`. See tensorboard.py."""
        return start_tensorboard(self.tasks[0], self.run_dir, self.python, self.free_port(), local_port, timeout)

    def close(self) -> None:
        """Close the provider's connections (the job keeps running)."""
        self.provider.close()


def make_job(name: str, num_tasks: int = 1, *, provider: str | Provider = "local", hosts: Sequence[str] = (),
             run_root: str = "runs", run_name: str = "run", setup: str | None = None,
             sync: str | os.PathLike | None = None, sync_exclude: Sequence[str] = DEFAULT_SYNC_EXCLUDE,
             restart: bool = False, python: str = "python3", host_dir: str = "~/.speedrun",
             tmux_socket: str = "speedrun", ssh: SSHOptions | None = None,
             home: str | os.PathLike | None = None) -> Job:
    """Get num_tasks hosts and a run directory for job `name`, or reconnect to it if it is running.

    provider: "local" (this machine) or "ssh" (then `hosts`: ["user@host:port", ...]), or a Provider.
    run_root: where run directories go, `<run_root>/<name>/<run_name>.<NN>`; for several hosts, a path
        they all see (NFS, EFS...). Relative: from the current directory (local) or the home (ssh).
    setup: a shell script run once per host before anything else, again whenever its text changes.
    sync: a local directory (your working tree) copied to `<host_dir>/code/<name>` on each host at every
        new run, without `sync_exclude`; commands then run there.
    restart: replace the job if it is running, instead of reconnecting to it.
    python: the Python on the hosts (for torchrun and helpers).
    host_dir: speedrun's directory on each host (setup marks, synced code).
    tmux_socket: the tmux server (`tmux -L <socket>`) that holds the job's sessions.
    ssh: how to reach ssh hosts (SSHOptions: known_hosts, identity_file, ssh_config,
        accept_new_host_keys). Host keys are checked strictly; accept_new_host_keys learns unknown
        ones and pins them in known_hosts (default $SPEEDRUN_HOME/known_hosts).
    home: speedrun's local directory (default $SPEEDRUN_HOME or ~/.config/speedrun).
    """
    check_name(name, "job name")
    check_name(run_name, "run name")
    if num_tasks < 1:
        raise SpeedrunError(f"a job needs at least one task, got {num_tasks}")
    if not (host_dir.startswith("/") or host_dir == "~" or host_dir.startswith("~/")):
        raise SpeedrunError(f"host_dir must be absolute or start with ~/, got {host_dir!r}")
    if sync is not None and not Path(sync).is_dir():
        raise SpeedrunError(f"sync directory {sync} does not exist")
    prov = make_provider(provider, hosts, ssh, home)
    hosts_ = prov.hosts(num_tasks)
    sessions = [f"{name}-{i}" for i in range(num_tasks)]
    setup_mark = f"{host_dir.rstrip('/')}/setup/{name}.sha256"
    probes = parallel(lambda i: probe_task(hosts_[i], tmux_socket, sessions[i], i, setup_mark), range(num_tasks))

    def code_dir(i: int) -> str:
        return resolve(f"{host_dir.rstrip('/')}/code/{name}", probes[i].home, hosts_[i].is_local)

    def make_tasks(run_dir: str, seqs: Sequence[int]) -> list[Task]:
        return [Task(job=name, index=i, host=hosts_[i], run_dir=run_dir,
                     cwd=code_dir(i) if sync is not None else f"{run_dir}/task-{i}",
                     home=probes[i].home, ip=probes[i].ip, tmux_socket=tmux_socket, last_seq=seqs[i])
                for i in range(num_tasks)]

    running = [i for i, p in enumerate(probes) if p.running]
    if running and not restart:
        run_dirs = {p.run_dir for p in probes if p.session}
        if len(run_dirs) != 1 or not all(p.session for p in probes):
            raise SpeedrunError(f"job {name} runs on tasks {running} but not on all {num_tasks} as asked; "
                                f"kill it (speedrun kill {name}) or pass restart=True (--restart)")
        tasks = make_tasks(run_dirs.pop(), [p.last_seq for p in probes])
        job = Job(name, tasks, tasks[0].run_dir, prov, python=python, reconnected=True)
        log.info("job %s is running (%s); reconnected without changing it", name, job.run_dir)
    else:
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
        parallel(lambda t: t._shell(tmux.new_session(tmux_socket, t.session, name, t.run_dir, t.logdir, t.cwd,
                                                     replace=True)), tasks)
        job = Job(name, tasks, fields["run_dir"], prov, python=python, reconnected=False)
        first_on_host = list({t.host.key: t for t in reversed(tasks)}.values())  # the first task on each host
        if sync is not None:
            src = Path(sync).resolve()
            log.info("copying %s to %d host(s)", src, len(first_on_host))
            parallel(lambda t: t.host.put(src, t.cwd, exclude=sync_exclude, mirror=True), first_on_host)
        if setup is not None:
            digest = hashlib.sha256(setup.encode()).hexdigest()
            parallel(lambda t: run_setup(t, setup, digest, probes[t.index].setup_hash, setup_mark), first_on_host)

    registry.save(registry.JobRecord(
        name=name, num_tasks=num_tasks, provider=prov.record(), run_dir=job.run_dir,
        cwd=None if sync is None else posixpath.join(host_dir.rstrip("/"), "code", name),
        tmux_socket=tmux_socket, python=python, created=time.time()), home)
    return job


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


def open_job(name: str, home: str | os.PathLike | None = None, *, probe: bool = True) -> Job:
    """The job `name` as recorded by make_job on this machine, to inspect, follow, attach to or kill.

    probe=False skips contacting the hosts (enough for status and kill; run and launch need it)."""
    rec = registry.load(name, home)
    prov = provider_from_record(rec.provider)
    hosts_ = prov.hosts(rec.num_tasks)
    sessions = [f"{name}-{i}" for i in range(rec.num_tasks)]

    def task(i: int) -> Task:
        p = None
        if probe:
            try:
                p = probe_task(hosts_[i], rec.tmux_socket, sessions[i], i, "/dev/null")
            except SpeedrunError:
                pass  # unreachable: status says so; other operations raise when they try it
        home_ = p.home if p else "~"
        cwd = resolve(rec.cwd, home_, hosts_[i].is_local) if rec.cwd else f"{rec.run_dir}/task-{i}"
        return Task(job=name, index=i, host=hosts_[i], run_dir=rec.run_dir, cwd=cwd, home=home_,
                    ip=p.ip if p else "", tmux_socket=rec.tmux_socket, last_seq=p.last_seq if p else 0)

    tasks = parallel(task, range(rec.num_tasks))
    return Job(name, tasks, rec.run_dir, prov, python=rec.python, reconnected=True)
