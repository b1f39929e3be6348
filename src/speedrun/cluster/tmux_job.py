"""TmuxJob: a Job whose tasks are tmux sessions on hosts speedrun reaches (this machine, SSH hosts,
EC2 instances: the local, ssh and aws providers), one torchrun per task started in a window of its
session. How a host gets its session, synced code and setup script is here too (`start_tasks`),
for make_job (host_provider.py) and for a host that replaces a lost one (`TmuxJob.replace_task`,
recovery.py).
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import math
import re
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TextIO

from speedrun.cluster import tmux
from speedrun.cluster.hosts import Host, HostLost, HostUnreachable
from speedrun.cluster.job import (JOIN_TIMEOUT_S, Job, Launch, StepTimedOut, check_join_timeout,
                                  check_nproc_per_node, interface_script)
from speedrun.cluster.probe import TaskProbe, probe_task, resolve
from speedrun.cluster.provider import Provider
from speedrun.cluster.tensorboard import TensorBoard, start_tensorboard
from speedrun.cluster.task import (Command, CommandFailed, CommandLost, Result, Task, check_name, tmux_message,
                                   until_lost)
from speedrun.cluster.states import STOPPED_BY, ReportFold, TaskStatus, telling_line
from speedrun.cluster.utils import REACH_TIMEOUT_S, parallel
from speedrun.errors import SpeedrunError, last_line

log = logging.getLogger("speedrun.cluster")


def interface_towards(task: Task, address: str) -> str | None:
    """The network interface on the task's host that holds `address` (on task 0 itself) or that
    the host routes `address` through; None when `ip` cannot tell."""
    r = task.host.shell(interface_script(shlex.quote(address)) + 'echo "$dev"\n')
    device = r.text.strip()
    return device if r.returncode == 0 and device and device != "lo" else None


# What torch.cuda.device_count() says on a host, without torch's import (2-3 CPU s) where it can only
# say 0: torch finds NVIDIA GPUs through the driver's libcuda and AMD ones through /dev/kfd.
COUNT_GPUS = """import ctypes, os, sys
try:
    ctypes.CDLL("libcuda.so.1")
except OSError:
    if not os.path.exists("/dev/kfd"):
        print(0)
        sys.exit()
import torch
print(torch.cuda.device_count())
"""


@dataclass(frozen=True)
class HostSetup:
    """How make_job prepared the job's hosts (tmux server, synced code, setup script): what a host
    that replaces a lost one gets too (TmuxJob.replace_task)."""

    tmux_socket: str
    host_dir: str
    sync: Path | None
    sync_exclude: tuple[str, ...]
    setup: str | None


def ended_badly(future: concurrent.futures.Future) -> str | None:
    """How a finished Command.wait shows its command ended, if not in success: "failed (exit N)",
    "was killed", "ended without an exit status", "unreachable (<why>)" (its host stopped
    answering: Command.wait gives up on it within a bounded time); None for success or another
    error of ours."""
    e = future.exception()
    if isinstance(e, CommandLost):
        return "ended without an exit status"
    if isinstance(e, HostUnreachable):
        return f"unreachable ({e.reason})"
    if e is not None or future.result().ok:
        return None
    status = future.result().status
    return "was killed" if status == 137 else f"failed (exit {status})"


def end_when(event: threading.Event, process: subprocess.Popen) -> None:
    """Kill `process` once `event` is set, unless it has ended by then (asked each second)."""
    while not event.wait(1.0):
        if process.poll() is not None:
            return
    process.kill()


class TmuxJob(Job):
    """A job whose tasks are tmux sessions on hosts (see the module's text); methods act on all
    tasks in parallel."""

    def __init__(self, name: str, tasks: list[Task], run_dir: str, provider: Provider, *, python: str,
                 reconnected: bool, host_setup: HostSetup | None = None, price_per_hour: float | None = None):
        super().__init__(name, tasks, run_dir, provider, python=python, reconnected=reconnected,
                         price_per_hour=price_per_hour)
        self.host_setup = host_setup  # None: found again by open_job, which does not know it

    def run(self, command: str | Sequence[str], **kwargs: Any) -> list[Any]:
        """task.run(command, **kwargs) on every task at once; a list of their Results (or Commands)."""
        return parallel(lambda t: t.run(command, **kwargs), self.tasks)

    single_commands = True

    def start_command(self, task: int, command: str, *, name: str, cwd: str, env: Mapping[str, str]) -> None:
        """A window `name` of the task's tmux session (Job.start_command)."""
        self.tasks[task].run(command, background=True, name=name, env=env, cwd=cwd)

    def command_state(self, task: int, name: str) -> str:
        command = self.tasks[task].command(name)
        return command.state() if command is not None else "none"

    def command_output(self, task: int, name: str) -> str:
        command = self.tasks[task].command(name)
        return command.output() if command is not None else ""

    def machine_count(self) -> int:
        """The machines the job holds: tasks on one host count once."""
        return len({t.host.key for t in self.tasks})

    # --- distributed training ---
    def launch(self, command: str | Sequence[str], *, nproc_per_node: int | None = None, name: str = "train",
               env: Mapping[str, str] | None = None, restart: bool = False,
               join_timeout_s: float = JOIN_TIMEOUT_S) -> list[Command]:
        """Start one torchrun per task: `torchrun --nnodes N --node-rank i --nproc-per-node P
        --master-addr <task 0> --master-port <free port there> --rdzv-conf=timeout=T COMMAND`, in a
        window named `name`. P is nproc_per_node (default 1). T, join_timeout_s (seconds, rounded
        up), bounds how long each torchrun waits for all of them to join: one that never comes makes
        the others fail then.

        COMMAND is what follows torchrun's options: `train.py --lr 0.1` or `-m speedrun train ...`
        (shell text; a list is quoted for you). The environment also gets SPEEDRUN_JOB,
        SPEEDRUN_RUN_DIR, SPEEDRUN_TASK, SPEEDRUN_NUM_TASKS, SPEEDRUN_PROVIDER (the provider's
        kind), the provider's variables (spot jobs on AWS: SPEEDRUN_SPOT_NOTICE_URL), the machines'
        price when known (SPEEDRUN_PRICE, see price()), plus `env`.

        If the job already runs a command of this name, nothing is started: the running commands are
        returned (reconnecting); restart=True starts it again once those have ended (a recovery).
        Returns one Command per task.
        """
        check_name(name)
        nproc_per_node = check_nproc_per_node(1 if nproc_per_node is None else nproc_per_node, "nproc_per_node")
        check_join_timeout(join_timeout_s, "join_timeout_s")
        text = command if isinstance(command, str) else shlex.join(command)
        # Also when reconnecting: a watcher started again with the same command takes over.
        self.launched = Launch(text, nproc_per_node, name, dict(env or {}), join_timeout_s)
        existing = parallel(lambda t: t.command(name), self.tasks)
        states = parallel(lambda c: c.state() if c else None, existing)
        running = [i for i, s in enumerate(states) if s == "running"]
        if running and restart:
            raise SpeedrunError(f"job {self.name}: {name!r} still runs on tasks {running}; stop it before restarting")
        if running:
            if len(running) != len(self.tasks):
                raise SpeedrunError(f"job {self.name}: {name!r} runs on tasks {running} but not on the others; "
                                    f"kill the job (speedrun kill {self.name}) or relaunch with restart")
            log.info("job %s: %r is already running; reconnected", self.name, name)
            return [c for c in existing if c is not None]
        if self.reconnected and all(states) and not restart:
            log.info("job %s: %r already ran in %s; pass restart=True to run it again", self.name, name, self.run_dir)
            return [c for c in existing if c is not None]

        n = len(self.tasks)
        master = self.tasks[0].ip if n > 1 else "127.0.0.1"
        port = self.free_port()
        price = self.price_environment()  # asked at every start: a recovery's machines may cost otherwise

        def start(t: Task) -> Command:
            torchrun = (f"{self.python} -m torch.distributed.run --nnodes={n} --node-rank={t.index} "
                        f"--nproc-per-node={nproc_per_node} --master-addr={master} --master-port={port} "
                        f"--rdzv-conf=timeout={math.ceil(join_timeout_s)} {text}")
            variables = {"SPEEDRUN_JOB": self.name, "SPEEDRUN_RUN_DIR": self.run_dir, "SPEEDRUN_TASK": str(t.index),
                         "SPEEDRUN_NUM_TASKS": str(n), "SPEEDRUN_PROVIDER": self.provider.kind,
                         **self.provider.environment(), **price}
            if n > 1:
                # gloo and NCCL bind to the address the host name resolves to, which may be 127.0.0.1
                # or an interface the other hosts cannot reach: name the one that reaches task 0.
                device = interface_towards(t, master)
                if device:
                    variables.update(GLOO_SOCKET_IFNAME=device, NCCL_SOCKET_IFNAME=device)
            return t.run(torchrun, background=True, name=name, env={**variables, **(env or {})})

        return parallel(start, self.tasks)

    def devices_per_task(self) -> int:
        """One process per device: the GPUs torch sees on task 0's host, 1 where there are none."""
        t = self.tasks[0]
        r = t.host.shell(f"{self.python} -c {shlex.quote(COUNT_GPUS)}")
        count = r.text.strip()
        if r.returncode != 0 or not count.isdigit():
            raise SpeedrunError(f"cannot ask torch on {t.host.name} how many GPUs it has ({self.python}): "
                                f"{last_line(r.stderr or r.text, 'no message')}")
        return max(1, int(count))

    def run_step(self, command: str | Sequence[str], *, nproc_per_node: int, name: str,
                 timeout_s: float | None = None) -> None:
        """Run `command` once on every task under torchrun (as launch does, in a window `name`,
        beside whatever the job runs) and wait for it, at most timeout_s seconds (then it is
        stopped: StepTimedOut; an interruption stops it too). CommandFailed (or HostLost) when a task fails, as
        wait raises. A `name` command still running from an earlier call (whose caller was killed, or
        lost that host) is stopped first."""
        earlier = [c for c in parallel(lambda t: t.command(name), self.tasks) if c is not None]
        leftovers = [c for c, state in zip(earlier, parallel(lambda c: c.state(), earlier)) if state == "running"]
        self.stop_commands(leftovers, f"a {name} left running by an earlier call")
        commands = self.launch(command, nproc_per_node=nproc_per_node, name=name, restart=True)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            self.wait(name, timeout=timeout_s)
        except KeyboardInterrupt:  # Ctrl-C (or SIGTERM) here ends the step there too
            self.stop_commands(commands, f"{name} interrupted")
            raise
        except SpeedrunError:
            if deadline is None or time.monotonic() < deadline:
                raise  # a failure, which wait has stopped the other tasks for
            self.stop_commands(commands, f"{name} ran past {timeout_s:g} s")
            raise StepTimedOut(f"job {self.name}: {name} did not end within {timeout_s:g} s; stopped") from None

    def run_each(self, commands: Sequence[str], *, name: str, cwd: str,
                 say: Callable[[str], None] = log.info) -> None:
        """Run independent commands (shell text each) on the job's tasks at once, in `cwd`: task i
        runs commands i, i + N, i + 2N... one after another, going on after a failure, in a window
        called `name`, with the machines' price (SPEEDRUN_PRICE) when known. Says how they were
        spread, and returns when all have ended."""
        shares = [list(commands[i::len(self.tasks)]) for i in range(len(self.tasks))]
        started = []
        price = self.price_environment()  # runs record what they cost, as launched ones do
        for t, share in zip(self.tasks, shares):
            if share:
                started.append(t.run("\n".join([f"cd {shlex.quote(t.path(cwd))}", *share]), background=True,
                                     name=name, env=price))
                say(f"task {t.index}: {len(share)} commands")
        for command in started:
            command.wait(check=False)

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
        """Wait for the `name` command on every task (timeout in seconds); their Results.

        The tasks are one run: once a task's command has ended in failure (or without an exit
        status), or its host has stopped answering, the commands still running on the others are
        stopped, each noting why for `status`, rather than left waiting on a peer that is gone (a
        collective with a dead rank can wait for the whole process-group timeout). A host that
        stopped answering raises HostLost (whatever check says); with check, CommandFailed is
        raised for the task whose command failed first."""
        def find(t: Task) -> Command | HostUnreachable | None:
            try:
                return until_lost(t, lambda grace: t.command(name, timeout=grace))
            except HostUnreachable as e:
                return e
        found = parallel(find, self.tasks)
        missing = [i for i, c in enumerate(found) if c is None]
        if missing:
            raise SpeedrunError(f"job {self.name}: no command named {name!r} on task(s) {missing} in {self.run_dir}")
        lost = [(i, e) for i, e in enumerate(found) if isinstance(e, HostUnreachable)]
        if lost:  # gone before the wait began: the job is stopped all the same
            i, e = lost[0]
            self.stop_commands([c for c in found if isinstance(c, Command)], f"task {i} unreachable ({e.reason})")
            raise HostLost(self.tasks[i].host.name, i, e.reason) from e
        commands: list[Command] = found  # type: ignore[assignment]
        first_failed: int | None = None
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(commands)))
        try:
            futures = {pool.submit(c.wait, timeout=timeout, check=False): i for i, c in enumerate(commands)}
            pending = set(futures)
            while pending:
                done, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                failed = [(futures[f], how) for f in done if (how := ended_badly(f))]
                if failed and first_failed is None:
                    first_failed, how = failed[0]
                    self.stop_commands([commands[futures[f]] for f in pending], f"task {first_failed} {how}")
        except BaseException:
            # Interrupted (Ctrl-C): the waits go on in their threads, but the caller is not held up
            # until the commands end; a caller that stops them (run_step) lets those threads end.
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        outcomes = sorted(futures.items(), key=lambda item: item[1])
        lost = [(i, e) for f, i in outcomes if isinstance(e := f.exception(), HostUnreachable)]
        if lost:
            i, e = next(((i, e) for i, e in lost if i == first_failed), lost[0])
            raise HostLost(self.tasks[i].host.name, i, e.reason) from e
        errors = [f.exception() for f, _ in outcomes if f.exception() is not None]
        if errors:
            raise errors[0]
        results = [f.result() for f, _ in outcomes]
        if check:
            order = [first_failed] if first_failed is not None else []
            for i in order + list(range(len(results))):
                if not results[i].ok:
                    t = self.tasks[i]
                    raise CommandFailed(f"{name!r} on task {t.name} ({t.host.name})",
                                        "killed" if results[i].status == 137 else results[i].status,
                                        results[i].log, results[i].output)
        return results

    def stop_commands(self, commands: Sequence[Command], why: str) -> None:
        """Stop these commands because `why` (e.g. "task 1 failed (exit 1)"), which their
        status reports as "stopped by speedrun: <why>"; one that cannot be reached is logged."""
        if not commands:
            return
        log.info("job %s: %s; stopping task(s) %s", self.name, why, ", ".join(str(c.task.index) for c in commands))

        def one(c: Command) -> None:
            try:
                c.kill(reason=f"{STOPPED_BY}: {why}")
            except SpeedrunError as e:  # its own wait reports it
                log.info("job %s: could not stop task %d: %s", self.name, c.task.index, e)
        parallel(one, list(commands))

    def status(self, name: str = "train") -> list[TaskStatus]:
        """Each task's state: that of its newest `name` command, else whether its session is up."""
        def one(t: Task) -> TaskStatus:
            try:
                r = t.host.shell(tmux.task_status(t.tmux_socket, t.session, t.logdir, name), timeout=REACH_TIMEOUT_S)
            except SpeedrunError as e:
                return TaskStatus(t.index, t.host.name, "unreachable", None, None, str(e))
            f = tmux.parse_fields(r.text)
            uptime = float(int(f["now"]) - int(f["created"])) if f.get("created") and f.get("now") else None
            s = f.get("status")
            if s is None:
                state = "idle" if f.get("session") == "1" else "stopped"
            elif s.isdigit():
                state = "succeeded" if s == "0" else f"failed ({s})"
            else:
                state = s
            why = f.get("stopped") or (telling_line(f["logline"].splitlines(), killed=state == "killed")
                                       if "logline" in f else None)
            return TaskStatus(t.index, t.host.name, state, uptime, f"{f['dir']}/log" if "dir" in f else None,
                              why=why, ended=float(f["ended"]) if re.fullmatch(r"[\d.]+", f.get("ended", "")) else None)
        return parallel(one, self.tasks)

    def kill(self) -> list[str]:
        """Kill every reachable task's tmux session and the commands in it (logs and the run
        directory stay); a line for each task that could not be reached (none: all killed)."""
        def one(t: Task) -> str | None:
            try:
                t.kill(timeout=REACH_TIMEOUT_S)
                return None
            except SpeedrunError as e:
                return f"task {t.index} ({t.host.name}) is unreachable: {e}"
        return [line for line in parallel(one, self.tasks) if line]

    def logs(self, name: str = "train", *, follow: bool = False, out: TextIO | None = None,
             tasks: Sequence[int] | None = None, until: threading.Event | None = None, raw: bool = False) -> list[str]:
        """Write the `name` command's log of each task to `out` (default stdout), lines prefixed with
        `[i] ` when there are several tasks; with follow, keep writing until the commands end, or
        until `until` is set (a host that went silent never ends its stream). torchrun's report of
        how a node ended is one line naming the log (states.ReportFold) unless `raw`.
        Returns a line for each task that could not be reached (its log is not written; none: all were)."""
        out = out or sys.stdout
        chosen = [self.tasks[i] for i in tasks] if tasks is not None else self.tasks

        def find(t: Task) -> Command | SpeedrunError | None:
            try:
                return t.command(name, timeout=REACH_TIMEOUT_S)
            except SpeedrunError as e:  # returned; the other tasks' logs still come
                return e
        commands = parallel(find, chosen)
        lock = threading.Lock()

        def emit(t: Task, text: str) -> None:
            prefix = f"[{t.index}] " if len(chosen) > 1 else ""
            with lock:
                for line in text.splitlines(keepends=True):
                    out.write(prefix + line)
                out.flush()

        def one(pair: tuple[Task, Command | SpeedrunError | None]) -> None:
            t, c = pair
            if isinstance(c, SpeedrunError):
                return
            if c is None:
                emit(t, f"(no command named {name!r} on task {t.name})\n")
                return
            fold = None if raw else ReportFold(c.log_path)
            if not follow:
                text = c.output()
                emit(t, text if fold is None else fold.feed(text) + fold.flush())
                return
            p = t.host.start_shell(tmux.follow_log(c.dir))
            if until is not None:
                threading.Thread(target=end_when, args=(until, p), daemon=True).start()
            for line in p.stdout:
                text = line.decode("utf-8", errors="replace")
                emit(t, text if fold is None else fold.feed(text))
            p.wait()
            if fold is not None:
                emit(t, fold.flush())

        parallel(one, list(zip(chosen, commands)))
        return [f"task {t.index} ({t.host.name}) is unreachable: {c}" for t, c in zip(chosen, commands)
                if isinstance(c, SpeedrunError)]

    def attach(self, task: int = 0, window: str | None = None) -> int:
        """Attach this terminal to a task's tmux session (Ctrl-b d detaches); the exit status."""
        return self.tasks[task].attach(window)

    def tensorboard(self, local_port: int | None = None, timeout: float = 120.0) -> TensorBoard:
        """Start TensorBoard on task 0 over the run directory (bound to 127.0.0.1 there) and forward it
        here; returns a TensorBoard with `.url` and `.close()`. See tensorboard.py."""
        return start_tensorboard(self.tasks[0], self.run_dir, self.python, self.free_port(), local_port, timeout)

    def record_fields(self) -> dict[str, Any]:
        hs = self.host_setup
        return {"cwd": None if hs is None or hs.sync is None else code_dir(hs, self.name),
                "tmux_socket": self.tasks[0].tmux_socket}

    def replace_task(self, index: int, host: Host) -> Task:
        """Put task `index` on `host` instead (its machine was lost): a session there in the same
        run directory, the synced code and the setup, as make_job gave the others."""
        hs = self.host_setup
        if hs is None:
            raise SpeedrunError(f"job {self.name} was found again, not made, by this process: how to set up a "
                                f"replacement host is known only where make_job ran")
        old = self.tasks[index]
        probe = probe_task(host, hs.tmux_socket, old.session, index, setup_mark_of(hs, self.name))
        task = make_task(self.name, index, host, probe, self.run_dir, hs, last_seq=0)
        start_tasks([task], self.name, hs, [probe.setup_hash])
        self.tasks[index] = task
        return task


def setup_mark_of(hs: HostSetup, job: str) -> str:
    """Where a host keeps the hash of the setup script that last succeeded there for `job`."""
    return f"{hs.host_dir.rstrip('/')}/setup/{job}.sha256"


def code_dir(hs: HostSetup, job: str) -> str:
    """Where a host keeps `job`'s synced code (`~` or absolute, as host_dir is)."""
    return f"{hs.host_dir.rstrip('/')}/code/{job}"


def make_task(job: str, index: int, host: Host, probe: TaskProbe, run_dir: str, hs: HostSetup, last_seq: int) -> Task:
    code = resolve(code_dir(hs, job), probe.home, host.is_local)
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
