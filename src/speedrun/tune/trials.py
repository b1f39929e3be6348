"""One trial of a search as a process on this machine: an ordinary `speedrun train` run in
`DIR/trials/NNN/` (so `compare`, `tb`, `eval` and `--resume` work on it), its recipe in
`DIR/recipes/NNN.py`, what it printed in `DIR/logs/NNN.log`.

A trial is started in a session of its own: a Ctrl-C in the terminal reaches the controller only,
which stops each trial with exactly one SIGTERM (the trainer stops at a step, with a checkpoint).
A trial whose controller was lost keeps running; the next controller adopts it and waits for it
like any other. A trial is alive while its process (`DIR/logs/NNN.pid`, checked against the
process's command line) runs or its run directory is locked: a process still starting holds no lock yet.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from speedrun.errors import EXIT_RESUMABLE, last_line
from speedrun.files import read_jsonl
from speedrun.rundir import in_use

STOP_FILE = "stop"  # the run directory's stop request (speedrun.stopping.STOP_FILE)


def trial_name(number: int) -> str:
    return f"{number:03d}"


@dataclass
class TrialRun:
    """A trial's run and the process training it (None when adopted from a lost controller)."""

    number: int
    root: Path  # the search's directory
    proc: subprocess.Popen | None = None
    stopped_for: str | None = None  # why the controller asked it to stop (pruned, the budget)
    verdicts: list = field(default_factory=list)  # asha.Verdicts it passed

    @property
    def dir(self) -> Path:
        return self.root / "trials" / trial_name(self.number)

    @property
    def recipe_path(self) -> Path:
        return self.root / "recipes" / f"{trial_name(self.number)}.py"

    @property
    def log(self) -> Path:
        return self.root / "logs" / f"{trial_name(self.number)}.log"

    @property
    def pid_file(self) -> Path:
        return self.root / "logs" / f"{trial_name(self.number)}.pid"

    def alive(self) -> bool:
        """Whether a process trains it now: this controller's, or one an earlier controller started."""
        if self.proc is not None:
            return self.proc.poll() is None
        return in_use(self.dir) or self._recorded_process_runs()

    def _recorded_process_runs(self) -> bool:
        try:
            pid = int(self.pid_file.read_text())
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return False
        # The pid is this trial's process, not another that took its number since.
        return str(self.dir.relative_to(self.root)).encode() in argv

    def argv(self, seed: int, data: str | None, train_args: tuple[str, ...], resume: bool) -> list[str]:
        """Its `speedrun train` command line, relative to the search's directory."""
        rel = lambda p: str(p.relative_to(self.root))  # noqa: E731
        return [sys.executable, "-m", "speedrun", "train", "--recipe", rel(self.recipe_path), "--out", rel(self.dir),
                "--seed", str(seed), *(["--data", data] if data else []), *train_args,
                *(["--resume"] if resume else [])]

    def start(self, seed: int, data: str | None, train_args: tuple[str, ...], env: dict[str, str]) -> bool:
        """Start it (resumed when its run has a checkpoint) or adopt it when a process still holds
        its run directory; whether it resumed or was adopted."""
        if self.alive():
            return True
        resume = (self.dir / "checkpoint.pt").is_file()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(self.argv(seed, data, train_args, resume), cwd=self.root, env=env,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.pid_file.write_text(f"{self.proc.pid}\n")
        return resume

    def ended(self) -> bool:
        return not self.alive()

    def evals(self) -> list[dict]:
        """Its evaluations so far (metrics.jsonl)."""
        try:
            return read_jsonl(self.dir / "metrics.jsonl")
        except (OSError, ValueError):  # not there yet, or a line being written
            return []

    def stop(self, why: str) -> None:
        """Ask it to stop at a step (the run directory's stop file: every rank stops after the same
        step, with a checkpoint)."""
        if self.stopped_for is None:
            self.stopped_for = why
            (self.dir / STOP_FILE).touch()

    def interrupt(self) -> None:
        """One SIGTERM (as Ctrl-C): it stops at a step; the caller waits with `wait`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self) -> None:
        if self.proc is not None:
            self.proc.wait()

    @property
    def exit_code(self) -> int | None:
        """Its exit status; None when adopted (its status is in results.json)."""
        return self.proc.returncode if self.proc is not None else None

    def failure(self) -> str:
        """Why it failed, one line: the trainer's own line (speedrun: ...), else its exit status."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            text = ""
        lines = [ln for ln in text.splitlines() if ln.startswith("speedrun: ")]
        line = lines[-1] if lines else last_line(text, f"exit status {self.exit_code}")
        return line.removeprefix("speedrun: ")


def same_failure(a: str, b: str) -> bool:
    """Two failures of one kind: the same text once numbers are set aside (the step, the LR)."""
    strip = lambda s: re.sub(r"[-+0-9.e]+", "#", s)  # noqa: E731
    return strip(a) == strip(b)


def resumable(code: int | None) -> bool:
    return code == EXIT_RESUMABLE


def trial_env(parallel: int, extra: dict[str, str]) -> dict[str, str]:
    """The environment of each trial: this one, `extra`, and its share of the cores for its
    computing threads when the user set none (K trials each with every core's threads cost
    several times the CPU, docs/measurements.md)."""
    env = {**os.environ, **extra}
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // parallel))
    return env
