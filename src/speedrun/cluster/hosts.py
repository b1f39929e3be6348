"""A Host is a machine that can run a bash script, receive files and send files back.

Everything else in `speedrun.cluster` (tmux windows, setup, jobs) is built on these few operations,
so one code path serves every kind of machine: `LocalHost` runs its scripts as a subprocess of this
one, `SSHHost` (in ssh.py) runs them through the OpenSSH client, and a cloud provider only has to
hand out SSH hosts.

Scripts travel on bash's standard input (`bash -s`), never on a command line, so the commands they
carry (and anything secret in them) do not show up in `ps` on either machine.
"""
from __future__ import annotations

import fnmatch
import os
import shlex
import shutil
import subprocess
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from speedrun.errors import SpeedrunError, TrainingFailed


class HostUnreachable(SpeedrunError):
    """The host did not answer: ssh could not connect, its connection broke, or nothing came back
    within the time allowed. `reason` says which in a few words, e.g. "connection timed out"."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message


class HostLost(TrainingFailed):
    """A host of a running job stopped answering for longer than a blip, so the job was stopped
    (the CLI exits with status 3): "host H (task K) unreachable: <reason>; job stopped"."""

    def __init__(self, host: str, task: int, reason: str):
        super().__init__(f"host {host} (task {task}) unreachable: {reason}; job stopped")
        self.host, self.task, self.reason = host, task, reason


@dataclass
class ShellResult:
    """What a script run on a host returned."""

    returncode: int
    stdout: bytes
    stderr: str

    @property
    def text(self) -> str:
        """stdout decoded as UTF-8 (undecodable bytes replaced)."""
        return self.stdout.decode("utf-8", errors="replace")


class Host(ABC):
    """One machine. `name` is how messages refer to it; `key` tells hosts apart (one setup per key)."""

    name: str

    @property
    def key(self) -> str:
        return self.name

    @property
    def is_local(self) -> bool:
        return False

    @abstractmethod
    def shell(self, script: str, *, timeout: float | None = None) -> ShellResult:
        """Run `script` with bash on the host and wait for it (timeout in seconds, None: no limit).

        Raises HostUnreachable when the host cannot be reached or does not answer within the
        timeout, SpeedrunError when it refuses us (a host key, a login); the script's own failures
        are in the result's returncode and stderr.
        """

    @abstractmethod
    def start_shell(self, script: str) -> subprocess.Popen:
        """Start `script` with bash on the host; its output streams from the returned process's stdout."""

    @abstractmethod
    def put(self, local: Path, remote: str, *, exclude: Sequence[str] = (), mirror: bool = False) -> None:
        """Copy a local file or directory to the absolute path `remote` on the host.

        A directory's contents land in `remote` (made if missing). `exclude` holds rsync-style name
        patterns to leave out; `mirror` also deletes the files an earlier mirror put in `remote`
        that `local` no longer has (files made there otherwise, by a setup script, stay).
        """

    @abstractmethod
    def get(self, remote: str, local: Path) -> None:
        """Copy the file or directory at the absolute path `remote` on the host to `local`."""

    @abstractmethod
    def interactive_argv(self, argv: Sequence[str]) -> list[str]:
        """The local command line that runs argv on the host attached to this terminal."""

    def forward(self, local_port: int, remote_port: int) -> subprocess.Popen | None:
        """Forward 127.0.0.1:local_port here to 127.0.0.1:remote_port on the host, until the returned
        process ends. None when nothing is needed (the host is this machine)."""
        return None

    def close(self) -> None:  # noqa: B027  (a default: only hosts holding connections override it)
        """Release connections held for this host (nothing for the local host)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class LocalHost(Host):
    """This machine: scripts run as subprocesses, files are copied with shutil."""

    name = "local"

    @property
    def is_local(self) -> bool:
        return True

    def shell(self, script: str, *, timeout: float | None = None) -> ShellResult:
        try:
            r = subprocess.run(["bash", "-s"], input=script.encode(), capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise SpeedrunError(f"a command on this machine did not finish within {timeout:g} s") from e
        return ShellResult(r.returncode, r.stdout, r.stderr.decode("utf-8", errors="replace"))

    def start_shell(self, script: str) -> subprocess.Popen:
        p = subprocess.Popen(["bash", "-s"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        p.stdin.write(script.encode())
        p.stdin.close()
        return p

    def put(self, local: Path, remote: str, *, exclude: Sequence[str] = (), mirror: bool = False) -> None:
        copy_path(Path(local), Path(remote), exclude=exclude)
        if mirror:
            run_prune(self, Path(local), remote, exclude)

    def get(self, remote: str, local: Path) -> None:
        copy_path(Path(remote), Path(local))

    def interactive_argv(self, argv: Sequence[str]) -> list[str]:
        return list(argv)


class AbsentHost(Host):
    """A machine that is not there now (a stopped or terminated instance): every operation raises
    HostUnreachable(`why`), which `speedrun ls` shows as unreachable."""

    def __init__(self, name: str, why: str):
        self.name, self.why = name, why

    def shell(self, script: str, *, timeout: float | None = None) -> ShellResult:
        raise HostUnreachable(self.why)

    def start_shell(self, script: str) -> subprocess.Popen:
        raise HostUnreachable(self.why)

    def put(self, local: Path, remote: str, *, exclude: Sequence[str] = (), mirror: bool = False) -> None:
        raise HostUnreachable(self.why)

    def get(self, remote: str, local: Path) -> None:
        raise HostUnreachable(self.why)

    def interactive_argv(self, argv: Sequence[str]) -> list[str]:
        raise HostUnreachable(self.why)


def copy_path(src: Path, dst: Path, *, exclude: Sequence[str] = ()) -> None:
    """Copy a file or directory tree from src to dst on this machine (see Host.put)."""
    if not src.exists():
        raise SpeedrunError(f"{src} does not exist")
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*exclude), symlinks=True, dirs_exist_ok=True)
    else:
        shutil.copy2(src, dst)


def tree_files(root: Path, exclude: Sequence[str]) -> list[str]:
    """The relative paths of the files a copy of `root` without `exclude` (name patterns matched
    against every path component, as rsync's are) carries, sorted."""
    found = []
    for directory, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not any(fnmatch.fnmatch(d, p) for p in exclude)]
        for name in names:
            if not any(fnmatch.fnmatch(name, p) for p in exclude):
                found.append(os.path.relpath(os.path.join(directory, name), root))
    return sorted(found)


def run_prune(host: Host, local: Path, remote: str, exclude: Sequence[str]) -> None:
    """After copying `local` to `remote` on `host` without deleting anything: delete the files the
    previous mirror put there (listed in `<remote>.synced`) that `local` no longer has, and list
    this copy's files there. Files that something else made in `remote` are left alone."""
    if not local.is_dir():
        return
    q = shlex.quote(remote.rstrip("/"))
    listing = "\n".join(tree_files(local, exclude))
    script = f"""set -e
new=$(mktemp)
cat > "$new" <<'SPEEDRUN_SYNCED_EOF'
{listing}
SPEEDRUN_SYNCED_EOF
if [ -f {q}.synced ]; then
  sort {q}.synced | comm -23 - <(sort "$new") | while IFS= read -r f; do [ -n "$f" ] && rm -f -- {q}/"$f"; done
fi
mv "$new" {q}.synced
"""
    r = host.shell(script)
    if r.returncode != 0:
        raise SpeedrunError(f"cannot remove deleted files from {host.name}:{remote}: {r.stderr.strip()[-200:]}")
