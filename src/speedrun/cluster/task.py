"""Task: one member of a job, i.e. a tmux session on a host, with a directory in the run directory.

    task.run("python train.py --lr 0.1")            # waits; returns exit status and output
    task.run("python serve.py", background=True)    # returns a Command to wait on, read or kill
    task.upload("config.yaml"); task.read("results.json")

Relative paths on the host are taken from the task's working directory (`task.cwd`: the synced code,
or the task's log directory when nothing is synced). Each command runs in its own tmux window from a
script file; see tmux.py for the files it leaves in `task.logdir`.
"""
from __future__ import annotations

import base64
import math
import os
import posixpath
import secrets
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence, TypeVar

from speedrun.cluster import tmux
from speedrun.cluster.hosts import Host, HostUnreachable
from speedrun.errors import SpeedrunError, last_line

TAIL_LINES = 3  # lines of output quoted in a CommandFailed message

# Command.wait asks the host whether the command ended in rounds of this many seconds, and allows
# a round this much longer before the host counts as not answering, seconds.
WAIT_ROUND_S = 10.0
ANSWER_GRACE_S = 10.0
# A host that has not answered for this long, over two rounds or more, is lost, seconds: far
# beyond a blip (a master connection being replaced) and far below the process group's timeout
# (300 s) that a peer of a vanished rank would otherwise wait out.
HOST_LOST_AFTER_S = 20.0
RETRY_PAUSE_S = 1.0  # between a round that failed and the next, seconds

T = TypeVar("T")


@dataclass
class Result:
    """A finished command: exit status, everything it printed (stdout and stderr) and its log's path."""

    status: int
    output: str
    log: str

    @property
    def ok(self) -> bool:
        return self.status == 0


class CommandFailed(SpeedrunError):
    """A command exited with a non-zero status (or was killed). The message is one line ending with
    the last lines of output; `output` holds all of it."""

    def __init__(self, what: str, status: int | str, log: str, output: str):
        self.status, self.log, self.output = status, log, output
        lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
        tail = " | ".join(lines[-TAIL_LINES:])
        if len(tail) > 400:
            tail = "..." + tail[-400:]
        how = "was killed" if status == "killed" else f"failed with exit status {status}"
        super().__init__(f"{what} {how} (log: {log})" + (f": {tail}" if tail else ""))


class CommandLost(SpeedrunError):
    """A command ended without an exit status: its host restarted, or it was killed hard."""


def status_code(status: str) -> int:
    """The exit status from a status file's text; a command killed by a signal counts as 137."""
    return int(status) if status.lstrip("-").isdigit() else 137


def check_name(name: str, what: str = "command name") -> str:
    """Names of jobs and commands become tmux names and directory names: keep them plain."""
    if not name or len(name) > 64 or not all(c.isalnum() or c in "_-" for c in name) or name[0] == "-":
        raise SpeedrunError(f"bad {what} {name!r}: use letters, digits, '-' and '_' (at most 64)")
    return name


class Task:
    """One task of a job; made by make_job / open_job (see job.py), not directly."""

    def __init__(self, *, job: str, index: int, host: Host, run_dir: str, cwd: str, home: str, ip: str,
                 tmux_socket: str, last_seq: int = 0):
        self.job, self.index, self.host = job, index, host
        self.run_dir, self.cwd, self.home, self.ip = run_dir, cwd, home, ip
        self.tmux_socket = tmux_socket
        self._seq = last_seq

    @property
    def name(self) -> str:
        """The task's name, which is also its tmux session's name: `<job>-<index>`."""
        return f"{self.job}-{self.index}"

    @property
    def session(self) -> str:
        return self.name

    @property
    def logdir(self) -> str:
        """This task's directory in the run directory: its commands, their logs and exit statuses."""
        return f"{self.run_dir}/task-{self.index}"

    def __repr__(self) -> str:
        return f"Task({self.name!r} on {self.host.name})"

    def path(self, path: str) -> str:
        """An absolute path on the host: `~/x` from the home directory, relative paths from `cwd`."""
        if path == "~" or path.startswith("~/"):
            return posixpath.normpath(self.home + path[1:])
        return posixpath.normpath(posixpath.join(self.cwd, path))

    # --- commands ---
    def run(self, command: str | Sequence[str], *, background: bool = False, check: bool = True,
            name: str | None = None, env: Mapping[str, str] | None = None, cwd: str | None = None,
            timeout: float | None = None) -> "Result | Command":
        """Run shell text (or an argv, quoted for you) in a new tmux window of this task.

        Waits for it and returns a Result, raising CommandFailed with the end of its output if it
        fails and `check` is set. With background=True returns at once with a Command instead; a
        background command's window stays open after it ends so that `attach` shows its last output.
        name: the window's name (default `cmd`, or `bg<N>` in the background); env: variables to set;
        cwd: where it runs (default task.cwd); timeout: seconds to wait before raising SpeedrunError
        (the command keeps running).
        """
        text = command if isinstance(command, str) else shlex.join(command)
        name = check_name(name or (f"bg{self._seq + 1}" if background else "cmd"))
        channel = None if background else f"speedrun-{self.session}-{secrets.token_hex(6)}"
        run_sh = tmux.wrapper(cwd=self.path(cwd) if cwd else self.cwd, env=dict(env or {}),
                              signal_channel=channel, keep_window=background)
        script = tmux.start_command(self.tmux_socket, self.session, self.logdir, self._seq + 1, name, text, run_sh,
                                    wait_channel=channel, unique_window=background)
        r = self.host.shell(script, timeout=timeout)
        if r.returncode == 4:
            raise SpeedrunError(f"a command named {name!r} is still running on task {self.name}: "
                                f"wait for it, kill it, or give this one another name")
        if r.returncode != 0 or not r.stdout.startswith(b"dir="):
            raise SpeedrunError(f"cannot start a command on task {self.name} ({self.host.name}): "
                                f"{tmux_message(r.stderr)}")
        head = r.stdout.split(b"\n", 4 if channel else 3)
        fields = tmux.parse_fields(b"\n".join(head[:4 if channel else 3]).decode())
        cmd = Command(self, name, fields["dir"], int(fields["pid"]))
        self._seq = max(self._seq, cmd.seq)
        if background:
            return cmd
        status = fields.get("status", "lost")
        if status == "lost":
            raise SpeedrunError(f"command {name!r} on task {self.name} ended without an exit status "
                                f"(its tmux server or window was killed); log: {cmd.log_path}")
        result = Result(status_code(status), head[4].decode("utf-8", errors="replace") if len(head) > 4 else "",
                        cmd.log_path)
        if check and result.status != 0:
            raise CommandFailed(f"command {name!r} on task {self.name} ({self.host.name})", status, result.log,
                                result.output)
        return result

    def command(self, name: str, timeout: float | None = None) -> "Command | None":
        """The newest command of that name in this run, or None (timeout: seconds to wait for the host)."""
        fields = tmux.parse_fields(self._shell(tmux.latest_command(self.logdir, check_name(name)), timeout))
        return Command(self, name, fields["dir"], None) if "dir" in fields else None

    # --- files ---
    def upload(self, local: str | os.PathLike, remote: str | None = None) -> str:
        """Copy a local file or directory to the host (default: same base name in task.cwd); returns
        the absolute path there."""
        local = Path(local)
        dest = self.path(remote if remote is not None else local.name)
        self.host.put(local, dest)
        return dest

    def download(self, remote: str, local: str | os.PathLike | None = None) -> Path:
        """Copy a file or directory from the host here (default: same base name in the current
        directory); returns the local path."""
        src = self.path(remote)
        dest = Path(local) if local is not None else Path(posixpath.basename(src))
        self.host.get(src, dest)
        return dest

    def exists(self, path: str) -> bool:
        """Whether the path exists on the host."""
        return self.host.shell(f"test -e {shlex.quote(self.path(path))}").returncode == 0

    def find(self, path: str, names: Sequence[str]) -> list[str]:
        """Absolute paths of the files named one of `names` at or under `path` on the host, sorted
        (none when `path` does not exist)."""
        p = self.path(path)
        match = " -o ".join(f"-name {shlex.quote(n)}" for n in names)
        r = self.host.shell(f"test -d {shlex.quote(p)} || exit 0; find {shlex.quote(p)} -type f \\( {match} \\) -print")
        if r.returncode != 0:
            raise SpeedrunError(f"cannot list {p} on {self.host.name}: {r.stderr.strip()}")
        return sorted(line for line in r.text.splitlines() if line)

    def read(self, path: str) -> str:
        """A text file's content on the host (UTF-8)."""
        p = self.path(path)
        r = self.host.shell(f"cat -- {shlex.quote(p)}")
        if r.returncode != 0:
            raise SpeedrunError(f"cannot read {p} on {self.host.name}: {r.stderr.strip()}")
        return r.text

    def write(self, path: str, data: str | bytes) -> str:
        """Write text or bytes to a file on the host (its directory is made); returns the absolute path."""
        p = self.path(path)
        raw = data.encode() if isinstance(data, str) else data
        encoded = base64.encodebytes(raw).decode()
        # base64 inside a quoted heredoc: any bytes survive, and the data never touches a command line.
        script = (f"mkdir -p {shlex.quote(posixpath.dirname(p))} && base64 -d > {shlex.quote(p)} <<'SPEEDRUN_EOF'\n"
                  f"{encoded}SPEEDRUN_EOF\n")
        r = self.host.shell(script)
        if r.returncode != 0:
            raise SpeedrunError(f"cannot write {p} on {self.host.name}: {r.stderr.strip()}")
        return p

    # --- session ---
    def attach_argv(self, window: str | None = None) -> list[str]:
        """The command line that attaches this terminal to the task's tmux session, at `window`, or
        at the newest command's window (the last one; the idle shell when nothing ran)."""
        tm = ["tmux", "-L", self.tmux_socket]
        target = check_name(window) if window else "{end}"
        return self.host.interactive_argv(tm + ["select-window", "-t", f"={self.session}:{target}", ";",
                                                "attach-session", "-t", f"={self.session}"])

    def attach(self, window: str | None = None) -> int:
        """Attach this terminal to the task's session until you detach (Ctrl-b d); returns the exit status."""
        env = {k: v for k, v in os.environ.items() if k != "TMUX"}  # allowed even when run inside tmux
        return subprocess.call(self.attach_argv(window), env=env)

    def kill(self, timeout: float | None = None) -> bool:
        """Kill the task's tmux session and the commands in it; True if there was one."""
        return "killed" in tmux.parse_fields(self._shell(tmux.kill_session(self.tmux_socket, self.session), timeout))

    def _shell(self, script: str, timeout: float | None = None) -> str:
        r = self.host.shell(script, timeout=timeout)
        if r.returncode != 0:
            raise SpeedrunError(f"task {self.name} on {self.host.name}: {tmux_message(r.stderr)}")
        return r.text


@dataclass
class Command:
    """A command started in a task's window; its files are in `dir` on the task's host."""

    task: Task
    name: str
    dir: str
    pid: int | None

    @property
    def seq(self) -> int:
        return int(posixpath.basename(self.dir).split("-", 1)[0])

    @property
    def log_path(self) -> str:
        return f"{self.dir}/log"

    def state(self) -> str:
        """`running`, the exit status as text (`0` is success), `killed`, or `lost` (no status and no
        process: the host restarted or the process was SIGKILLed)."""
        return tmux.parse_fields(self.task._shell(tmux.command_state(self.dir)))["status"]

    def wait(self, *, timeout: float | None = None, check: bool = True) -> Result:
        """Wait for the command to end (timeout in seconds) and return its Result; raise CommandFailed
        if it failed and `check` is set.

        The host is asked in rounds of WAIT_ROUND_S seconds, each bounded, so a host that stops
        answering (its link down, the machine gone) is noticed: once it has not answered for
        HOST_LOST_AFTER_S seconds, over two failed rounds or more, HostUnreachable is raised (a
        blip in between costs nothing)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise SpeedrunError(f"command {self.name!r} on task {self.task.name} did not end within {timeout:g} s")
            span = WAIT_ROUND_S if left is None else max(min(WAIT_ROUND_S, left), 1.0)
            script = tmux.wait_command(self.dir, max_s=math.ceil(span))
            state = tmux.parse_fields(until_lost(self.task, lambda grace, script=script, span=span: self.task._shell(
                script, timeout=None if grace is None else span + grace)))["status"]
            if state != "running":
                break
        if state == "lost":
            raise CommandLost(f"command {self.name!r} on task {self.task.name} ended without an exit status "
                              f"(killed hard, or its host restarted); log: {self.log_path}")
        output = self.output()
        if check and state != "0":
            raise CommandFailed(f"command {self.name!r} on task {self.task.name} ({self.task.host.name})", state,
                                self.log_path, output)
        return Result(status_code(state), output, self.log_path)

    def output(self) -> str:
        """Everything the command printed so far."""
        r = self.task.host.shell(f"cat -- {shlex.quote(self.log_path)} 2>/dev/null; true")
        return r.text

    def kill(self, reason: str | None = None) -> None:
        """Stop the command (SIGHUP to its window's processes); a no-op once it has ended. `reason`
        (one line, e.g. "stopped by speedrun: task 1 failed (exit 1)") is what status reports."""
        self.task._shell(tmux.stop_command(self.dir, reason=reason))


def until_lost(task: Task, ask: Callable[[float | None], T]) -> T:
    """ask(grace) until it returns: `grace` is how long beyond its own work it may wait for the
    task's host (ANSWER_GRACE_S; None on this machine, which always answers). Failures to reach
    the host are tried again, until it has not answered for HOST_LOST_AFTER_S over two tries or
    more: then HostUnreachable, with the last failure's reason."""
    answered, failures = time.monotonic(), 0
    while True:
        try:
            return ask(None if task.host.is_local else ANSWER_GRACE_S)
        except HostUnreachable as e:
            failures += 1
            silent = time.monotonic() - answered
            if failures >= 2 and silent >= HOST_LOST_AFTER_S:
                raise HostUnreachable(f"{task.host.name} (task {task.index}) has not answered for {silent:.0f} s: {e}",
                                      e.reason) from e
            time.sleep(RETRY_PAUSE_S)  # a host that refuses at once is not asked in a tight loop


def tmux_message(stderr: str) -> str:
    """The useful line of a failed driver script's stderr."""
    return last_line(stderr, "the host's shell failed without a message")
