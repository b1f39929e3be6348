"""Job: N tasks on N hosts (or N sessions on this machine), and what can be done with all of
them at once: run, upload, launch one torchrun per node, wait, status, logs, attach, kill,
TensorBoard. A Job is made by speedrun.cluster.lifecycle's make_job, or found again by reopen's open_job.

    job = make_job("resnet", 2, provider="ssh", hosts=["gpu1", "gpu2"], run_root="/shared/runs",
                   setup=open("setup.sh").read(), sync=".")
    job.launch(f"-m speedrun train --recipe imagenet-2x8 --out {job.run_dir}", nproc_per_node=8)
    job.logs(follow=True)
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, TextIO

from speedrun.cluster import tmux
from speedrun.cluster.hosts import HostLost, HostUnreachable
from speedrun.cluster.provider import Provider
from speedrun.cluster.tensorboard import TensorBoard, start_tensorboard
from speedrun.cluster.task import (Command, CommandFailed, CommandLost, Result, Task, check_name, tmux_message,
                                   until_lost)
from speedrun.cluster.states import STOPPED_BY, ReportFold, TaskStatus, telling_line
from speedrun.cluster.utils import REACH_TIMEOUT_S, parallel
from speedrun.errors import EXIT_FAILED, SpeedrunError, last_line
from speedrun.money import PRICE_ENV, Price

log = logging.getLogger("speedrun.cluster")

# Left out when the working tree is copied to hosts: history, data, outputs and caches.
DEFAULT_SYNC_EXCLUDE = (".git", "data", "runs", "__pycache__", "*.egg-info", ".venv", "venv", ".pytest_cache",
                        ".mypy_cache", ".ruff_cache", "build", "dist")

# How long each task's torchrun waits for all of them to join its rendezvous, seconds. torchrun's
# own default, 900 s, keeps a job whose other host never started "running" for a quarter of an
# hour; launch starts every task within seconds of the others, so two minutes is ample.
JOIN_TIMEOUT_S = 120.0


def interface_script(address: str) -> str:
    """Bash that sets `dev` to the network interface holding `address` (a bash word: a quoted
    address or "$VAR") or that the host routes it through; empty when `ip` cannot tell."""
    return f"""m={address}
dev=$(ip -o -4 addr show 2>/dev/null | awk -v m="$m" '{{split($4, a, "/"); if (a[1] == m) {{print $2; exit}}}}')
[ -n "$dev" ] || dev=$(ip -o route get "$m" 2>/dev/null | sed -n 's/.* dev \\([^ ]*\\).*/\\1/p')
"""


def interface_towards(task: Task, address: str) -> str | None:
    """The network interface on the task's host that holds `address` (on task 0 itself) or that
    the host routes `address` through; None when `ip` cannot tell."""
    r = task.host.shell(interface_script(shlex.quote(address)) + 'echo "$dev"\n')
    device = r.text.strip()
    return device if r.returncode == 0 and device and device != "lo" else None


@dataclass(frozen=True)
class HostSetup:
    """How make_job prepared the job's hosts (tmux server, synced code, setup script): what a host
    that replaces a lost one gets too (see lifecycle.replace_task)."""

    tmux_socket: str
    host_dir: str
    sync: Path | None
    sync_exclude: tuple[str, ...]
    setup: str | None


@dataclass(frozen=True)
class Launch:
    """What `Job.launch` started: enough to start it again on replaced hosts."""

    command: str  # shell text after torchrun's options
    nproc_per_node: int
    name: str
    env: dict[str, str]
    join_timeout_s: float = JOIN_TIMEOUT_S


class StepTimedOut(SpeedrunError):
    """A one-off command on the job's tasks (run_step) ran past its time and was stopped: the
    machines or the network, not the input, so the CLI exits 3."""

    exit_code = EXIT_FAILED


def check_join_timeout(seconds: float, what: str) -> float:
    """A join timeout as given (`what`: how the user gave it), or SpeedrunError if it is not a
    number of seconds above 0."""
    if not 0 < seconds < math.inf:
        raise SpeedrunError(f"{what} must be a number of seconds above 0, got {seconds:g}")
    return seconds


def check_nproc_per_node(count: int, what: str) -> int:
    """A number of processes per task as given (`what`: how the user gave it), or SpeedrunError if
    it is below 1."""
    if count < 1:
        raise SpeedrunError(f"{what} must be at least 1, got {count}")
    return count


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


class Job:
    """A job's tasks and run directory; see make_job. Methods act on all tasks in parallel."""

    def __init__(self, name: str, tasks: list[Task], run_dir: str, provider: Provider, *, python: str,
                 reconnected: bool, host_setup: HostSetup | None = None, price_per_hour: float | None = None):
        self.name, self.tasks, self.run_dir, self.provider = name, tasks, run_dir, provider
        self.python = python
        self.price_per_hour = price_per_hour  # $ per machine-hour the user gave (--price-per-hour); None: not given
        self.reconnected = reconnected  # True when make_job found this job running and joined it
        self.host_setup = host_setup  # None: found again by open_job, which does not know it
        self.launched: Launch | None = None  # the last launch of this process

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
        parallel(lambda t: t.upload(local, remote), self.one_per_destination(remote or Path(local).name))

    def write(self, path: str, data: str | bytes) -> None:
        """task.write on every distinct host (tasks sharing a host and path get one copy)."""
        parallel(lambda t: t.write(path, data), self.one_per_destination(path))

    def one_per_destination(self, path: str) -> list[Task]:
        """One task per distinct (host, absolute path): where `path` is one shared directory (or
        several tasks share a host), the first task that sees it."""
        seen: dict[tuple[str, str], Task] = {}
        for t in self.tasks:
            seen.setdefault((t.host.key, t.path(path)), t)
        return list(seen.values())

    # --- what it costs ---
    def machine_count(self) -> int:
        """The machines the job holds: tasks on one host count once."""
        return len({t.host.key for t in self.tasks})

    def price(self) -> Price | None:
        """What the job's machines cost: the price per machine-hour given to make_job
        (`--price-per-hour`), else the provider's (AWS: Price List API, table or spot history);
        None when neither knows. Launched commands get it in PRICE_ENV, for results.json."""
        machines = self.machine_count()
        if self.price_per_hour is not None:
            return Price(self.provider.machine_type(), "given", machines, self.price_per_hour,
                         "given with --price-per-hour")
        return self.provider.price(machines)

    def price_environment(self) -> dict[str, str]:
        """PRICE_ENV for the commands launched now, when the price is known. A price that cannot
        be read (AWS not answering) costs the run its cost record, not its start."""
        try:
            price = self.price()
        except SpeedrunError as e:
            log.warning("job %s: the machines' price could not be read (%s); the run records no cost", self.name, e)
            return {}
        return {PRICE_ENV: price.to_env()} if price is not None else {}

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
        SPEEDRUN_RUN_DIR, SPEEDRUN_TASK and SPEEDRUN_NUM_TASKS, the provider's variables (spot
        jobs on AWS: SPEEDRUN_SPOT_NOTICE_URL), the machines' price when known (SPEEDRUN_PRICE,
        see price()), plus `env`.

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
                         "SPEEDRUN_NUM_TASKS": str(n), **self.provider.environment(), **price}
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
        r = t.host.shell(f"{self.python} -c 'import torch; print(torch.cuda.device_count())'")
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

    def scheduler_line(self) -> str | None:
        """What the scheduler running the job says of it, one line for `ls` (Slurm's state); None
        for jobs no scheduler runs."""
        return None

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
