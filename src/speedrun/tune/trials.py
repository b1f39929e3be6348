"""Where a search's trials run: on this machine (`LocalTrials`), or one per task of a job
(`JobTrials`: `speedrun tune --job NAME`). Either way a trial is an ordinary `speedrun train` run
in `<search>/trials/NNN/` (so `compare`, `tb`, `eval` and `--resume` work on it), its recipe in
`<search>/recipes/NNN.py`, and the controller sees it through one `TrialRun` interface: start it,
ask whether it is alive, read its evaluations and results, ask it to stop at a step.

On this machine a trial is a process in a session of its own: a Ctrl-C in the terminal reaches the
controller only, which stops each trial with exactly one SIGTERM (the trainer stops at a step, with
a checkpoint); what it prints goes to `<search>/logs/NNN.log`. A trial whose controller was lost
keeps running and the next controller adopts it: it is alive while its process (`logs/NNN.pid`,
checked against the process's command line) runs or its run directory is locked (a process still
starting holds no lock yet).

On a job, a trial is a command in a window of a task (`trial-NNN`, `speedrun attach` shows it),
at most one per task at a time, under the job's run directory on that task's host; the controller
reads its files there and asks it to stop with the run's stop file. Its task is recorded, so a
continued search finds (or resumes) it where its checkpoint is.
"""
from __future__ import annotations

import json
import os
import posixpath
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from speedrun.errors import SpeedrunError, last_line
from speedrun.files import read_jsonl
from speedrun.rundir import in_use

STOP_FILE = "stop"  # the run directory's stop request (speedrun.stopping.STOP_FILE)
REMOTE_WAIT_S = 2.0  # how often a job trial that was asked to stop is looked at, seconds


def trial_name(number: int) -> str:
    return f"{number:03d}"


def train_argv(python: str, number: int, seed: int, data: str | None, train_args: tuple[str, ...],
               resume: bool) -> list[str]:
    """A trial's `speedrun train` command line, run in the search's directory."""
    name = trial_name(number)
    return [python, "-m", "speedrun", "train", "--recipe", f"recipes/{name}.py", "--out", f"trials/{name}",
            "--seed", str(seed), *(["--data", data] if data else []), *train_args, *(["--resume"] if resume else [])]


def parse_results(text: str | None) -> dict[str, Any]:
    try:
        data = json.loads(text or "")
        return data if isinstance(data, dict) else {}
    except ValueError:
        return {}


def parse_evals(text: str | None) -> list[dict]:
    out = []
    for line in (text or "").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            break
    return out


def failure_line(output: str, code: int | None) -> str:
    """Why a trial failed, one line: the trainer's own line (speedrun: ...), else its exit status."""
    lines = [ln for ln in output.splitlines() if ln.startswith("speedrun: ")]
    line = lines[-1] if lines else last_line(output, f"exit status {code}")
    return line.removeprefix("speedrun: ")


class TrialRun:
    """One trial's run, wherever it runs (the subclasses), and what the controller decided of it."""

    def __init__(self, number: int, stopped_for: str | None = None, verdicts: list | None = None):
        self.number = number
        self.task: int | None = None  # the job's task it runs on; None: this machine
        self.stopped_for = stopped_for  # why the controller asked it to stop (pruned, the budget)
        self.verdicts: list[float] = list(verdicts or [])  # the rungs it passed, seconds

    @property
    def dir(self) -> str:
        """Its run directory, relative to the search's."""
        return f"trials/{trial_name(self.number)}"

    def ended(self) -> bool:
        return not self.alive()

    def stop(self, why: str) -> None:
        """Ask it to stop at a step (the run directory's stop file: every rank stops after the same
        step, with a checkpoint)."""
        if self.stopped_for is None:
            self.stopped_for = why
            self.touch(f"{self.dir}/{STOP_FILE}")

    # What each place provides.
    def write_recipe(self, text: str) -> None: raise NotImplementedError
    def start(self, seed: int, data: str | None, train_args: tuple[str, ...], env: dict[str, str]) -> bool:
        raise NotImplementedError
    def alive(self) -> bool: raise NotImplementedError
    def evals(self) -> list[dict]: raise NotImplementedError
    def results(self) -> dict[str, Any]: raise NotImplementedError
    def touch(self, path: str) -> None: raise NotImplementedError
    def interrupt(self) -> None: raise NotImplementedError
    def wait(self) -> None: raise NotImplementedError
    def failure(self) -> str: raise NotImplementedError
    @property
    def exit_code(self) -> int | None: raise NotImplementedError


class LocalTrial(TrialRun):
    """A trial as a process on this machine, in the search's directory `root`."""

    def __init__(self, number: int, root: Path, **kw):
        super().__init__(number, **kw)
        self.root = root
        self.proc: subprocess.Popen | None = None  # None when adopted from a lost controller

    def _path(self, rel: str) -> Path:
        return self.root / rel

    @property
    def log(self) -> Path:
        return self.root / "logs" / f"{trial_name(self.number)}.log"

    @property
    def pid_file(self) -> Path:
        return self.root / "logs" / f"{trial_name(self.number)}.pid"

    def write_recipe(self, text: str) -> None:
        path = self._path(f"recipes/{trial_name(self.number)}.py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def start(self, seed: int, data: str | None, train_args: tuple[str, ...], env: dict[str, str]) -> bool:
        """Start it (resumed when its run has a checkpoint) or adopt it when a process still trains
        it; whether it resumed or was adopted."""
        if self.alive():
            return True
        resume = (self._path(self.dir) / "checkpoint.pt").is_file()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(train_argv(sys.executable, self.number, seed, data, train_args, resume),
                                         cwd=self.root, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.pid_file.write_text(f"{self.proc.pid}\n")
        return resume

    def alive(self) -> bool:
        """Whether a process trains it now: this controller's, or one an earlier controller started."""
        if self.proc is not None:
            return self.proc.poll() is None
        return in_use(self._path(self.dir)) or self._recorded_process_runs()

    def _recorded_process_runs(self) -> bool:
        try:
            pid = int(self.pid_file.read_text())
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return False
        return self.dir.encode() in argv  # this trial's process, not another that took its number since

    def evals(self) -> list[dict]:
        try:
            return read_jsonl(self._path(self.dir) / "metrics.jsonl")
        except (OSError, ValueError):  # not there yet, or a line being written
            return []

    def results(self) -> dict[str, Any]:
        try:
            return parse_results((self._path(self.dir) / "results.json").read_text())
        except OSError:
            return {}

    def touch(self, path: str) -> None:
        # The trainer may not have made its run directory yet (a budget spent just after a start):
        # the request waits there, and the trainer honours it at its first step.
        self._path(path).parent.mkdir(parents=True, exist_ok=True)
        self._path(path).touch()

    def interrupt(self) -> None:
        """One SIGTERM (as Ctrl-C): it stops at a step; an adopted one, its stop file."""
        if self.proc is None:
            self.stop("the search was interrupted")
        elif self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self) -> None:
        if self.proc is not None:
            self.proc.wait()

    @property
    def exit_code(self) -> int | None:
        """Its exit status; None when adopted (its status is in results.json)."""
        return self.proc.returncode if self.proc is not None else None

    def failure(self) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            text = ""
        return failure_line(text, self.exit_code)


class JobTrial(TrialRun):
    """A trial as a command on task `task` of `job`, in the search's directory `root` (a path the
    task reads, under the job's run directory)."""

    def __init__(self, number: int, job, task: int, root: str, **kw):
        super().__init__(number, **kw)
        self.job, self.task, self.root = job, task, root
        self._state: str | None = None

    @property
    def window(self) -> str:
        return f"trial-{trial_name(self.number)}"

    def _path(self, rel: str) -> str:
        return posixpath.join(self.root, rel)

    def _read(self, rel: str) -> str | None:
        try:
            return self.job.tasks[self.task].read(self._path(rel))
        except SpeedrunError:  # not there yet
            return None

    def write_recipe(self, text: str) -> None:
        self.job.tasks[self.task].write(self._path(f"recipes/{trial_name(self.number)}.py"), text)

    def start(self, seed: int, data: str | None, train_args: tuple[str, ...], env: dict[str, str]) -> bool:
        if self.alive():
            return True
        t = self.job.tasks[self.task]
        resume = t.exists(self._path(f"{self.dir}/checkpoint.pt"))
        argv = train_argv(self.job.python, self.number, seed, data, train_args, resume)
        self.job.start_command(self.task, shlex.join(argv), name=self.window, cwd=self.root, env=env)
        self._state = "running"
        return resume

    def state(self) -> str:
        """The trial's command state on its task (`running`, its exit status, `killed`, `lost`, or
        `none` before it ever started there)."""
        self._state = self.job.command_state(self.task, self.window)
        return self._state

    def alive(self) -> bool:
        return self.state() == "running"

    def evals(self) -> list[dict]:
        return parse_evals(self._read(f"{self.dir}/metrics.jsonl"))

    def results(self) -> dict[str, Any]:
        return parse_results(self._read(f"{self.dir}/results.json"))

    def touch(self, path: str) -> None:
        self.job.tasks[self.task].write(self._path(path), "")

    def interrupt(self) -> None:
        self.stop("the search was interrupted")

    def wait(self) -> None:
        while self.alive():
            time.sleep(REMOTE_WAIT_S)

    @property
    def exit_code(self) -> int | None:
        return int(self._state) if self._state and re.fullmatch(r"-?\d+", self._state) else None

    def failure(self) -> str:
        return failure_line(self.job.command_output(self.task, self.window), self.exit_code)


class LocalTrials:
    """Trials on this machine, `parallel` at a time, in the search's directory `root`."""

    poll_s = 1.0

    def __init__(self, root: Path, parallel: int):
        self.root, self.parallel = root, parallel

    def new(self, number: int, running: dict[int, TrialRun]) -> TrialRun:
        return LocalTrial(number, self.root)

    def existing(self, number: int, attrs: dict[str, Any]) -> TrialRun:
        return LocalTrial(number, self.root, stopped_for=attrs.get("stopping"), verdicts=attrs.get("rungs_passed"))

    def bring_back(self, say) -> None:
        """Nothing to copy: the trials are here."""


class JobTrials:
    """Trials on a job's tasks, one per task at a time, in `root` (relative to the job's run
    directory) on each task's host."""

    poll_s = 5.0  # each look is a round trip to the task's host

    def __init__(self, job, root: str, parallel: int, local: Path):
        self.job, self.parallel, self.local = job, parallel, local
        self.root = posixpath.join(job.run_dir, root)

    def new(self, number: int, running: dict[int, TrialRun]) -> TrialRun:
        busy = {r.task for r in running.values()}
        task = next(i for i in range(len(self.job.tasks)) if i not in busy)
        return JobTrial(number, self.job, task, self.root)

    def existing(self, number: int, attrs: dict[str, Any]) -> TrialRun:
        return JobTrial(number, self.job, int(attrs.get("task", 0)), self.root, stopped_for=attrs.get("stopping"),
                        verdicts=attrs.get("rungs_passed"))

    def bring_back(self, say) -> None:
        """The trials' results.json and metrics.jsonl, copied into the local search directory."""
        from speedrun.compare import fetch_run_files

        fetch_run_files(self.job, f"{self.root}/trials", self.local / "trials", per_task=False, warn=say)


def same_failure(a: str, b: str) -> bool:
    """Two failures of one kind: the same text once numbers are set aside (the step, the LR)."""
    strip = lambda s: re.sub(r"[-+0-9.e]+", "#", s)  # noqa: E731
    return strip(a) == strip(b)


def trial_env(parallel: int, extra: dict[str, str]) -> dict[str, str]:
    """The environment of each trial on this machine: this one, `extra`, and its share of the cores
    for its computing threads when neither sets them (K trials each with every core's threads cost
    several times the CPU, docs/measurements.md)."""
    env = {**os.environ, **extra}
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // parallel))
    return env
