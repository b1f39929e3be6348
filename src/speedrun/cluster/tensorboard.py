"""TensorBoard for a job: started on task 0 over the run directory, reachable only through SSH.

TensorBoard listens on 127.0.0.1 of task 0's host, never on a public interface; for an ssh host an
`ssh -L` tunnel forwards a port on this machine's 127.0.0.1 to it.
"""
from __future__ import annotations

import contextlib
import shlex
import socket
import subprocess
import time
from dataclasses import dataclass

from speedrun.cluster.task import Command, Task
from speedrun.errors import SpeedrunError


WINDOW = "tensorboard"


@dataclass
class TensorBoard:
    """A running TensorBoard: open `url` in a browser; `close()` stops it and its tunnel."""

    url: str
    command: Command
    tunnel: subprocess.Popen | None

    def close(self) -> None:
        if self.tunnel is not None and self.tunnel.poll() is None:
            self.tunnel.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.tunnel.wait(timeout=10)
        self.command.kill()


def start_tensorboard(
    task: Task, logdir: str, python: str, port: int, local_port: int | None = None, timeout: float = 120.0
) -> TensorBoard:
    """Start TensorBoard on `task` (replacing one started before), reading `logdir` and listening
    on `port` of its host, with the host's `python`, and forward it here.

    local_port: the port on this machine (default: a free one). timeout: seconds to wait for
    TensorBoard to listen and for the tunnel to open.
    """
    old = task.command(WINDOW)
    if old is not None:
        old.kill()
    cmd = task.run(f"{python} -m tensorboard.main --logdir {shlex.quote(logdir)} "
                   f"--host 127.0.0.1 --port {port}", background=True, name=WINDOW)
    # Wait (bounded) on the host until TensorBoard accepts connections, or its command has ended.
    code = "\n".join([
        "import os, socket, sys, time",
        f"end = time.monotonic() + {timeout}",
        "while time.monotonic() < end:",
        "    try:",
        f"        socket.create_connection(('127.0.0.1', {port}), timeout=1).close()",
        "        sys.exit(0)",
        "    except OSError:",
        "        pass",
        f"    if os.path.exists({cmd.dir + '/status'!r}):",
        "        sys.exit(2)",
        "    time.sleep(0.2)",
        "sys.exit(1)",
    ])
    probe = f"{python} -c {shlex.quote(code)}"
    r = task.host.shell(probe, timeout=timeout + 30)
    if r.returncode != 0:
        tail = " | ".join(cmd.output().strip().splitlines()[-3:])
        cmd.kill()
        raise SpeedrunError(f"TensorBoard did not start on {task.host.name} (log: {cmd.log_path}): {tail}")
    if task.host.is_local:
        return TensorBoard(f"http://127.0.0.1:{port}/", cmd, None)
    local_port = local_port or free_local_port()
    tunnel = task.host.forward(local_port, port)
    try:
        wait_for_tunnel(tunnel, local_port, timeout)
    except SpeedrunError:
        cmd.kill()
        raise
    return TensorBoard(f"http://127.0.0.1:{local_port}/", cmd, tunnel)


def free_local_port() -> int:
    """A free TCP port on this machine's 127.0.0.1 (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_tunnel(tunnel: subprocess.Popen, port: int, timeout: float) -> None:
    """Poll until 127.0.0.1:port accepts connections (bounded by timeout, seconds), or the tunnel dies."""
    deadline = time.monotonic() + timeout
    while True:
        if tunnel.poll() is not None:
            err = tunnel.stderr.read().decode("utf-8", errors="replace").strip() if tunnel.stderr else ""
            raise SpeedrunError("the ssh tunnel for TensorBoard failed: "
                                f"{err.splitlines()[-1] if err else 'no message'}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        if time.monotonic() > deadline:
            tunnel.terminate()
            raise SpeedrunError(f"the ssh tunnel for TensorBoard did not open port {port} within {timeout:g} s")
        time.sleep(0.05)
