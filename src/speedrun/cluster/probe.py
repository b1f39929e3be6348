"""Looking at a task's host before deciding anything (make_job) or to show it (open_job): one round
trip (`probe_task`, see tmux.probe) tells its home, address, tmux session, run directory, windows
and setup hash; `resolve` makes a path on the host absolute."""
from __future__ import annotations

import posixpath
from dataclasses import dataclass
from pathlib import Path

from speedrun.cluster import tmux
from speedrun.cluster.hosts import Host
from speedrun.cluster.task import tmux_message
from speedrun.errors import SpeedrunError


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


def probe_task(host: Host, socket: str, session: str, index: int, setup_mark: str,
               timeout: float | None = None) -> TaskProbe:
    """Look at task `index`'s host in one round trip (see tmux.probe); SpeedrunError if it can't serve
    (or does not answer within `timeout` seconds)."""
    r = host.shell(tmux.probe(socket, session, index, setup_mark, local=host.is_local), timeout=timeout)
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
