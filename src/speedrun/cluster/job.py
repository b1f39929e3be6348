"""Job: what speedrun can do with a job's N tasks at once, whatever runs them. `ls`, `logs`,
`kill`, `attach`, `tb`, `launch --wait`, `check`, `ablate --job` and `compare JOB` use this
interface and nothing else; recovery (recovery.py) needs tasks it can move, which only a
TmuxJob has. Two kinds implement it:

    TmuxJob   (tmux_job.py)    every task a tmux session on a host speedrun reaches: local, ssh, aws
    SlurmJob  (slurm/job.py)   one Slurm job whose nodes are the tasks, read through the run directory

A job is made by lifecycle.make_job (its provider's make_job), or found again by reopen.open_job.

    job = make_job("resnet", 2, provider="ssh", hosts=["gpu1", "gpu2"], run_root="/shared/runs",
                   setup=open("setup.sh").read(), sync=".")
    job.launch(f"-m speedrun train --recipe imagenet-2x8 --out {job.run_dir}", nproc_per_node=8)
    job.logs(follow=True)
"""
from __future__ import annotations

import logging
import math
import os
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence, TextIO

from speedrun.cluster.states import TaskStatus
from speedrun.cluster.task import Result, Task
from speedrun.cluster.utils import parallel
from speedrun.errors import EXIT_FAILED, SpeedrunError
from speedrun.money import PRICE_ENV, Price

if TYPE_CHECKING:  # annotations only: a provider makes jobs, so provider.py imports this module
    from speedrun.cluster.provider import Provider
    from speedrun.cluster.tensorboard import TensorBoard

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


@dataclass(frozen=True)
class JobSpec:
    """make_job's settings for the run it makes, as a provider's make_job takes them (lifecycle.py
    says what each means)."""

    run_root: str | None = None
    run_name: str = "run"
    setup: str | None = None  # the setup script's text
    sync: Path | None = None  # an absolute local directory
    sync_exclude: tuple[str, ...] = DEFAULT_SYNC_EXCLUDE
    restart: bool = False
    python: str = "python3"
    host_dir: str = "~/.speedrun"
    tmux_socket: str = "speedrun"
    config_dir: str | os.PathLike | None = None  # speedrun's directory on this machine (registry.speedrun_home)
    # Called once the provider has decided to start a new run rather than reconnect, before anything
    # of it is made (make_job: a watcher elsewhere still watching the old run is stopped first).
    before_new_run: Callable[[], None] = lambda: None


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


class Job(ABC):
    """A job's tasks and run directory; see make_job. Methods act on all tasks in parallel."""

    def __init__(self, name: str, tasks: list[Task], run_dir: str, provider: Provider, *, python: str,
                 reconnected: bool, price_per_hour: float | None = None):
        self.name, self.tasks, self.run_dir, self.provider = name, tasks, run_dir, provider
        self.python = python
        self.price_per_hour = price_per_hour  # $ per machine-hour the user gave (--price-per-hour); None: not given
        self.reconnected = reconnected  # True when make_job found this job running and joined it
        self.launched: Launch | None = None  # the last launch of this process

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, i: int) -> Task:
        return self.tasks[i]

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {len(self.tasks)} tasks, run_dir={self.run_dir!r})"

    # --- files on the tasks' hosts ---
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
    @abstractmethod
    def machine_count(self) -> int:
        """The machines the job holds."""

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

    # --- running commands ---
    @abstractmethod
    def launch(self, command: str | Sequence[str], *, nproc_per_node: int | None = None, name: str = "train",
               env: Mapping[str, str] | None = None, restart: bool = False,
               join_timeout_s: float = JOIN_TIMEOUT_S) -> list[Any]:
        """Start one torchrun per task with `command` (shell text after torchrun's options, or an argv
        quoted for you), `nproc_per_node` processes each, under the name `name`, the environment
        holding SPEEDRUN_JOB, SPEEDRUN_RUN_DIR, SPEEDRUN_TASK, SPEEDRUN_NUM_TASKS, SPEEDRUN_PROVIDER
        (the provider's kind), the provider's variables, the price (SPEEDRUN_PRICE) and `env`; each
        torchrun waits join_timeout_s seconds at most for the others. A job already running `name`
        is reconnected to (nothing started); restart=True starts it again once it has ended.
        Records the launch in `launched`."""

    @abstractmethod
    def devices_per_task(self) -> int:
        """How many processes a task runs, one per device: its GPUs, 1 where there are none."""

    @abstractmethod
    def run_step(self, command: str | Sequence[str], *, nproc_per_node: int, name: str,
                 timeout_s: float | None = None) -> None:
        """Run `command` once under one torchrun per task (`speedrun check`'s benchmark), beside
        whatever the job runs, and wait for it: StepTimedOut after timeout_s seconds (it is
        stopped), CommandFailed (or HostLost) when a task fails; an interruption stops it too."""

    @abstractmethod
    def run_each(self, commands: Sequence[str], *, name: str, cwd: str,
                 say: Callable[[str], None] = log.info) -> None:
        """Run independent commands (shell text each) on the job's machines at once, in `cwd`,
        going on after a failure, with the price (SPEEDRUN_PRICE) when known; says how they were
        spread, and returns when all have ended (`ablate --job`)."""

    # Whether `start_command` can start one command on one task (`speedrun tune --job`).
    single_commands = False

    def start_command(self, task: int, command: str, *, name: str, cwd: str, env: Mapping[str, str]) -> None:
        """Start shell text `command` on task `task` alone, in `cwd`, as its own command called
        `name` (see command_state), with `env` beside the job's variables, and return at once. Jobs
        that cannot (single_commands False) say so."""
        raise self._no_single_commands()

    def command_state(self, task: int, name: str) -> str:
        """The newest command `name` that start_command started on task `task`: `running` (on Slurm,
        also while it waits for a node), its exit status as text (`0` is success), `killed`, `lost`
        (it ended without an exit status), or `none` before it ever started."""
        raise self._no_single_commands()

    def command_output(self, task: int, name: str) -> str:
        """Everything that command printed so far ("" before it started)."""
        raise self._no_single_commands()

    def _no_single_commands(self) -> SpeedrunError:
        return SpeedrunError(f"job {self.name} ({self.provider.kind}) cannot start a command on one of its tasks "
                             "alone: use a job of tmux tasks (local, ssh, aws) or a Slurm job")

    # --- state ---
    @abstractmethod
    def status(self, name: str = "train") -> list[TaskStatus]:
        """Each task's state (states.py's words) for its newest `name` command."""

    @abstractmethod
    def wait(self, name: str = "train", *, timeout: float | None = None, check: bool = True) -> list[Result]:
        """Wait for the `name` command on every task (timeout in seconds); their Results. With
        check, CommandFailed for the task that failed first; HostLost for a host that stopped
        answering, whatever check says."""

    @abstractmethod
    def kill(self) -> list[str]:
        """Stop everything the job runs (logs and the run directory stay); a line for each task that
        could not be reached (none: all stopped)."""

    @abstractmethod
    def logs(self, name: str = "train", *, follow: bool = False, out: TextIO | None = None,
             tasks: Sequence[int] | None = None, until: threading.Event | None = None, raw: bool = False) -> list[str]:
        """Write the `name` command's log of each task (or of `tasks`) to `out` (default stdout),
        lines prefixed with `[i] ` when there are several; with follow, keep writing until the
        commands end or `until` is set. torchrun's report of how a node ended is one line naming
        the log (states.ReportFold) unless `raw`. A line for each task that could not be reached."""

    @abstractmethod
    def attach(self, task: int = 0, window: str | None = None) -> int:
        """Put this terminal on task `task`'s command `window` (default: its newest) live; Ctrl-b d
        detaches. The exit status."""

    @abstractmethod
    def tensorboard(self, local_port: int | None = None, timeout: float = 120.0) -> TensorBoard:
        """TensorBoard over the run directory, reachable here at `.url` (local_port: default a free
        one); `.close()` ends it. See tensorboard.py."""

    def scheduler_line(self) -> str | None:
        """What the scheduler running the job says of it, one line for `ls` (Slurm's state); None
        for jobs no scheduler runs."""
        return None

    def record_fields(self) -> dict[str, Any]:
        """What the job's record (registry.JobRecord) keeps of this kind of job beyond its name,
        tasks, provider and run directory: where commands run (cwd) and the tmux server."""
        return {}

    def close(self) -> None:
        """Close the provider's connections (the job keeps running)."""
        self.provider.close()
