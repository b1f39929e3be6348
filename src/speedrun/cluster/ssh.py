"""SSHHost: a Host reached through the OpenSSH client binary.

Using `ssh` itself (not a Python SSH library) means ~/.ssh/config, keys, agents, ProxyJump and
everything else users already set up keep working. Around it speedrun adds:

* Multiplexing: the first contact opens a master connection (ControlMaster, ControlPersist) and
  every later command rides on it, so a command costs a few milliseconds instead of a handshake.
  A master that is dead, or whose connection carries nothing (as after a link flapped), is
  replaced the first time it is used after that (see connect).
* Strict host-key checking, always. A host whose key is unknown is refused, unless the user asked
  to learn keys on first contact (`accept_new_host_keys`); learned keys are pinned in speedrun's own
  known_hosts file. Keys the user already trusts (~/.ssh/known_hosts, or the UserKnownHostsFile
  their ssh config names) are honoured too. A changed key is refused in every mode.
* Clear errors: ssh's failures (refused, unreachable, unknown or changed host key, no permission)
  become one-line SpeedrunErrors saying what to do; HostUnreachable when the network or the host
  failed us, with ssh's reason in a few words.
* rsync over the same connection for files when both ends have it, tar through ssh otherwise.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from speedrun.cluster import registry
from speedrun.cluster.hosts import Host, HostUnreachable, ShellResult, run_prune
from speedrun.errors import SpeedrunError, last_line

log = logging.getLogger("speedrun.cluster")

CONTROL_PERSIST_S = 600  # how long an idle master connection stays up, seconds
# How long a master connection this process has not seen answer gets to carry one command there
# and back before it is replaced, seconds (at most half of the caller's time).
PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class HostSpec:
    """`user@host:port` taken apart; user and port None mean "as ~/.ssh/config says"."""

    host: str
    user: str | None = None
    port: int | None = None

    @classmethod
    def parse(cls, spec: str) -> "HostSpec":
        """Parse `host`, `user@host`, `user@host:port` or `user@[v6addr]:port`."""
        m = re.fullmatch(r"(?:([^@\s:]+)@)?(\[[0-9A-Fa-f:.]+\]|[^@\s:\[\]]+)(?::(\d+))?", spec.strip())
        if not m:
            raise SpeedrunError(f"bad host {spec!r}: write it as host, user@host or user@host:port")
        user, host, port = m.groups()
        port_n = int(port) if port else None
        if port_n is not None and not 0 < port_n < 65536:
            raise SpeedrunError(f"bad port in host {spec!r}: use 1..65535")
        return cls(host=host.strip("[]"), user=user, port=port_n)

    @property
    def destination(self) -> str:
        """What goes on ssh's command line (the port travels separately, with -p)."""
        return f"{self.user}@{self.host}" if self.user else self.host

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        s = f"{self.user}@{host}" if self.user else host
        return f"{s}:{self.port}" if self.port else s


@dataclass(frozen=True)
class SSHOptions:
    """How to reach SSH hosts (the same for all hosts of a job).

    known_hosts: speedrun's own file of pinned host keys (made if missing; None: the default,
        $SPEEDRUN_HOME/known_hosts, filled in by the ssh provider).
    identity_file: a private key to use instead of ssh's defaults and agent.
    ssh_config: an ssh_config file to use instead of ~/.ssh/config.
    accept_new_host_keys: learn and pin the key of a host seen for the first time.
    connect_timeout: seconds to wait for a TCP connection.
    """

    known_hosts: Path | None = None
    identity_file: Path | None = None
    ssh_config: Path | None = None
    accept_new_host_keys: bool = False
    connect_timeout: int = 10


def control_dir() -> Path:
    """A private directory for master-connection sockets (short path: sockets have a length limit)."""
    d = Path(tempfile.gettempdir()) / f"speedrun-ssh-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    st = d.lstat()
    # Someone else's directory (or a symlink) in /tmp could capture our connections: refuse it.
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise SpeedrunError(f"{d} is not a private directory of this user: remove it and try again")
    return d


class SSHHost(Host):
    """A machine reached with `ssh`; see the module docstring."""

    def __init__(self, spec: str | HostSpec, options: SSHOptions):
        self.spec = spec if isinstance(spec, HostSpec) else HostSpec.parse(spec)
        if options.known_hosts is None:
            options = dataclasses.replace(options, known_hosts=registry.default_known_hosts())
        self.options = options
        self.name = str(self.spec)
        identity = "\0".join(map(str, (self.spec, options.known_hosts, options.identity_file, options.ssh_config)))
        self.control_path = control_dir() / hashlib.sha256(identity.encode()).hexdigest()[:24]
        self._lock = threading.Lock()  # one master connection per host, even when tasks run in threads
        self._rsync: bool | None = None
        self._user_known_hosts: list[Path] | None = None
        self._checked = False  # whether this process has seen the master connection answer

    # --- command lines ---
    def ssh_options(self, *, multiplex: bool = True) -> list[str]:
        """Options common to every ssh (and rsync) call for this host; multiplex=False leaves out the
        master connection's socket (ssh takes an option's first value, so it cannot be overridden)."""
        o = self.options
        o.known_hosts.parent.mkdir(parents=True, exist_ok=True)
        o.known_hosts.touch(exist_ok=True)
        # New keys are written to the first file; the user's own files are only read.
        known = " ".join(f'"{p}"' for p in (o.known_hosts, *self.user_known_hosts()))
        args = [] if o.ssh_config is None else ["-F", str(o.ssh_config)]
        args += [
            "-o", "BatchMode=yes",  # never prompt: a question nobody sees would hang a job
            "-o", f"StrictHostKeyChecking={'accept-new' if o.accept_new_host_keys else 'yes'}",
            "-o", f"UserKnownHostsFile={known}",
            "-o", "HashKnownHosts=no",  # so that a user can find and remove a pinned key
            "-o", "UpdateHostKeys=no",
            "-o", f"ConnectTimeout={o.connect_timeout}",
            "-o", "ServerAliveInterval=15",
            "-o", "ServerAliveCountMax=4",
            "-o", "LogLevel=ERROR",
            "-o", f"ControlPath={self.control_path if multiplex else 'none'}",
        ]
        if o.identity_file is not None:
            args += ["-i", str(o.identity_file), "-o", "IdentitiesOnly=yes"]
        if self.spec.port is not None:
            args += ["-p", str(self.spec.port)]
        return args

    def user_known_hosts(self) -> list[Path]:
        """The known_hosts files the user's own ssh would read for this host (UserKnownHostsFile in
        their ssh config, else ~/.ssh/known_hosts and known_hosts2), as `ssh -G` reports them:
        keys a user pinned long ago count as known here too. Asked once per host."""
        if self._user_known_hosts is None:
            argv = ["ssh", *([] if self.options.ssh_config is None else ["-F", str(self.options.ssh_config)]),
                    *([] if self.spec.port is None else ["-p", str(self.spec.port)]), "-G", self.spec.destination]
            r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
            files = [line.split()[1:] for line in r.stdout.splitlines() if line.startswith("userknownhostsfile ")]
            found = [Path(f).expanduser() for f in (files[0] if files else [])]
            self._user_known_hosts = [f for f in found if f != self.options.known_hosts] or \
                [Path("~/.ssh/known_hosts").expanduser()]
        return self._user_known_hosts

    def ssh_argv(self, *extra: str) -> list[str]:
        """`ssh` riding on the master connection, ending with the destination; append a remote command."""
        return ["ssh", *self.ssh_options(), "-o", "ControlMaster=no", *extra, self.spec.destination]

    # --- connection ---
    def connect(self, timeout: float | None = None) -> None:
        """Open the master connection unless one is up and answers; raise HostUnreachable when the
        host can't be reached (within `timeout` seconds, if given), SpeedrunError when it refuses us."""
        limit = self.options.connect_timeout + 30 if timeout is None else max(timeout, 0.1)
        deadline = time.monotonic() + limit
        with self._lock:
            if self.control_path.exists():
                if self._checked:
                    return
                # A master this process has not seen answer (another process's, or one a command
                # just failed on) may be dead, or alive with a connection that carries nothing: a
                # link that went down and came back leaves TCP backing off its retransmissions
                # for many seconds, while a new connection would work at once. One round trip
                # tells; one that does not answer is replaced.
                if self._master_answers(min(PROBE_TIMEOUT_S, limit / 2)):
                    self._checked = True
                    return
                self._stop_master()
            known_before = self._known_hosts_size()
            remaining = max(deadline - time.monotonic(), 0.1)
            with tempfile.TemporaryFile() as err:  # a file, not a pipe: the master keeps it open
                argv = ["ssh", *self.ssh_options(), "-o", "ControlMaster=yes",
                        "-o", f"ControlPersist={CONTROL_PERSIST_S}", "-f", "-N", self.spec.destination]
                try:
                    r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                       timeout=remaining)
                except subprocess.TimeoutExpired:
                    raise HostUnreachable(f"cannot connect to {self.name}: no answer within {limit:g} s; check the "
                                          f"address and network", f"no answer within {limit:g} s") from None
                err.seek(0)
                stderr = err.read().decode("utf-8", errors="replace")
            if r.returncode != 0:
                raise self.connection_error(stderr)
            self._checked = True
            if self._known_hosts_size() != known_before:
                log.info("first contact with %s: its host key is now pinned in %s", self.name, self.options.known_hosts)

    def _master_answers(self, timeout: float) -> bool:
        """Whether the master connection runs (its socket answers) and carries a command to the
        host and back within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        if not self._master_runs(timeout):  # a socket left by a master that was killed
            return False
        try:
            probe = subprocess.run(self.ssh_argv("-T") + ["true"], stdin=subprocess.DEVNULL, capture_output=True,
                                   timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            return False
        return probe.returncode == 0

    def _stop_master(self) -> None:
        """Make way for a new master: the old one stops taking commands (those on it end as they
        will) and its socket goes, even when it does not answer."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(["ssh", *self.ssh_options(), "-O", "stop", self.spec.destination],
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=PROBE_TIMEOUT_S / 2)
        self.control_path.unlink(missing_ok=True)
        self._checked = False

    def _known_hosts_size(self) -> int:
        try:
            return self.options.known_hosts.stat().st_size
        except FileNotFoundError:
            return 0

    def connection_error(self, stderr: str) -> SpeedrunError:
        """A one-line error for an ssh failure, from ssh's stderr: HostUnreachable when the network
        or the host failed us, SpeedrunError when it refused us (a host key, a login)."""
        message = describe_ssh_failure(self.name, stderr, self.options)
        reason = unreachable_reason(stderr)
        if reason is None:
            return SpeedrunError(message)
        self._checked = False  # whatever carried the command may be dead: check it before the next one
        return HostUnreachable(message, reason)

    def close(self) -> None:
        """Close the master connection, if any."""
        with self._lock:
            if self.control_path.exists():
                subprocess.run(["ssh", *self.ssh_options(), "-O", "exit", self.spec.destination],
                               capture_output=True, timeout=30)

    # --- Host interface ---
    def shell(self, script: str, *, timeout: float | None = None) -> ShellResult:
        deadline = None if timeout is None else time.monotonic() + timeout
        self.connect(timeout)  # within the same limit: a host that went silent answers nothing
        try:
            r = subprocess.run(self.ssh_argv("-T") + ["bash -s"], input=script.encode(), capture_output=True,
                               timeout=None if deadline is None else max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired as e:
            self._checked = False  # a slow host, or a master whose connection went silent: the next use tells
            raise HostUnreachable(f"a command on {self.name} did not finish within {timeout:g} s",
                                  f"no answer within {timeout:g} s") from e
        stderr = r.stderr.decode("utf-8", errors="replace")
        if r.returncode == 255 and looks_like_ssh_failure(stderr):
            raise self.connection_error(stderr)
        if r.returncode == 255 and not self._master_runs():
            # The master died under the command (ServerAlive gave up on a silent host): ssh says
            # nothing of it, and the script's own status is lost.
            self._checked = False
            raise HostUnreachable(f"cannot reach {self.name}: its connection closed while a command ran",
                                  "connection closed")
        return ShellResult(r.returncode, r.stdout, stderr)

    def _master_runs(self, timeout: float = PROBE_TIMEOUT_S) -> bool:
        """Whether the master connection's socket answers within `timeout` seconds (a local
        question: no round trip to the host)."""
        try:
            return subprocess.run(["ssh", *self.ssh_options(), "-O", "check", self.spec.destination],
                                  stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def start_shell(self, script: str) -> subprocess.Popen:
        self.connect()
        p = subprocess.Popen(self.ssh_argv("-T") + ["bash -s"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL)
        p.stdin.write(script.encode())
        p.stdin.close()
        return p

    def interactive_argv(self, argv: Sequence[str]) -> list[str]:
        return self.ssh_argv("-t") + [shlex.join(argv)]

    def forward(self, local_port: int, remote_port: int) -> subprocess.Popen:
        self.connect()  # checks the host key and reports errors clearly before the tunnel starts
        # A connection of its own (ControlPath=none), so the tunnel lives exactly as long as this process.
        argv = ["ssh", *self.ssh_options(multiplex=False), "-o", "ExitOnForwardFailure=yes", "-N",
                "-L", f"127.0.0.1:{local_port}:127.0.0.1:{remote_port}", self.spec.destination]
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def has_rsync(self) -> bool:
        """Whether rsync is on both this machine and the host (asked once)."""
        if self._rsync is None:
            self._rsync = shutil.which("rsync") is not None and \
                self.shell("command -v rsync >/dev/null").returncode == 0
        return self._rsync

    def put(self, local: Path, remote: str, *, exclude: Sequence[str] = (), mirror: bool = False) -> None:
        local = Path(local)
        if not local.exists():
            raise SpeedrunError(f"{local} does not exist")
        self.connect()
        if self.has_rsync():
            src = f"{local}/" if local.is_dir() else str(local)
            dst = remote.rstrip("/") + "/" if local.is_dir() else remote
            parent = remote.rstrip("/") if local.is_dir() else os.path.dirname(remote) or "."
            argv = ["rsync", "-a", *(f"--exclude={p}" for p in exclude),
                    "-e", shlex.join(["ssh", *self.ssh_options(), "-o", "ControlMaster=no"]),
                    f"--rsync-path=mkdir -p {shlex.quote(parent)} && rsync",
                    src, f"{self.rsync_destination()}:{dst}"]
            self._run_transfer(argv, f"upload {local} to {self.name}:{remote}")
            if mirror:
                run_prune(self, local, remote, exclude)
            return
        # tar through ssh: pack here, unpack there.
        if local.is_dir():
            pack = ["tar", "-C", str(local), *(f"--exclude={p}" for p in exclude), "-cf", "-", "."]
            q = shlex.quote(remote.rstrip("/"))
            unpack = f"mkdir -p {q} && tar -C {q} -xf -"
        else:
            pack = ["tar", "-C", str(local.parent), "-cf", "-", local.name]
            tmp = shlex.quote(remote + ".speedrun-tmp")
            unpack = (f"rm -rf {tmp} && mkdir -p {tmp} && tar -C {tmp} -xf - && "
                      f"mv -f {tmp}/{shlex.quote(local.name)} {shlex.quote(remote)} && rmdir {tmp}")
        self._pipe(pack, self.ssh_argv("-T") + [unpack], f"upload {local} to {self.name}:{remote}")
        if mirror:
            run_prune(self, local, remote, exclude)

    def get(self, remote: str, local: Path) -> None:
        local = Path(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        self.connect()
        if self.has_rsync():
            is_dir = self.shell(f"test -d {shlex.quote(remote)}").returncode == 0
            src = remote.rstrip("/") + "/" if is_dir else remote
            argv = ["rsync", "-a", "-e", shlex.join(["ssh", *self.ssh_options(), "-o", "ControlMaster=no"]),
                    f"{self.rsync_destination()}:{src}", f"{local}/" if is_dir else str(local)]
            self._run_transfer(argv, f"download {self.name}:{remote} to {local}")
            return
        name = os.path.basename(remote.rstrip("/"))
        pack = self.ssh_argv("-T") + [f"tar -C {shlex.quote(os.path.dirname(remote.rstrip('/')) or '/')} -cf - "
                                      f"{shlex.quote(name)}"]
        with tempfile.TemporaryDirectory(dir=local.parent) as tmp:
            self._pipe(pack, ["tar", "-C", tmp, "-xf", "-"], f"download {self.name}:{remote} to {local}")
            got = Path(tmp) / name
            if local.is_dir() and got.is_dir():
                shutil.copytree(got, local, symlinks=True, dirs_exist_ok=True)
            else:
                got.replace(local)

    # --- helpers ---
    def rsync_destination(self) -> str:
        host = f"[{self.spec.host}]" if ":" in self.spec.host else self.spec.host
        return f"{self.spec.user}@{host}" if self.spec.user else host

    def _run_transfer(self, argv: list[str], what: str) -> None:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if r.returncode != 0:
            if looks_like_ssh_failure(r.stderr):
                raise self.connection_error(r.stderr)
            raise SpeedrunError(f"cannot {what}: {last_line(r.stderr)}")

    def _pipe(self, producer: list[str], consumer: list[str], what: str) -> None:
        p1 = subprocess.Popen(producer, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        p2 = subprocess.run(consumer, stdin=p1.stdout, capture_output=True)
        p1.stdout.close()
        err1 = p1.stderr.read().decode("utf-8", errors="replace")
        p1.wait()
        err2 = p2.stderr.decode("utf-8", errors="replace")
        if p2.returncode == 255 and looks_like_ssh_failure(err2):
            raise self.connection_error(err2)
        if p1.returncode != 0 or p2.returncode != 0:
            raise SpeedrunError(f"cannot {what}: {last_line(err1 or err2)}")


SSH_FAILURES = (
    "Host key verification failed", "REMOTE HOST IDENTIFICATION HAS CHANGED", "Connection refused",
    "Connection timed out", "No route to host", "Could not resolve hostname", "Permission denied",
    "Connection closed", "Connection reset", "kex_exchange_identification", "ssh: connect to host",
    "Network is unreachable", "Host is unreachable", "banner exchange",
)


def looks_like_ssh_failure(stderr: str) -> bool:
    """Whether stderr of an exit status 255 is ssh failing (rather than the remote command)."""
    return any(s in stderr for s in SSH_FAILURES) or stderr.lstrip().startswith("ssh:")


# ssh's words for the network or the host failing us (not refusing us), and how a message puts it.
UNREACHABLE = (("timed out", "connection timed out"), ("Connection refused", "connection refused"),
               ("No route to host", "no route to host"), ("unreachable", "no route to host"),
               ("Could not resolve hostname", "unknown host name"), ("Connection reset", "connection reset"),
               ("Connection closed", "connection closed"), ("closed by remote host", "connection closed"),
               ("kex_exchange_identification", "connection closed"), ("banner exchange", "connection closed"))


def unreachable_reason(stderr: str) -> str | None:
    """A few words on how the network or host failed ssh ("connection timed out"), or None when ssh
    was refused (a host key, a login) or the text says nothing of the connection."""
    if "Host key verification failed" in stderr or "REMOTE HOST IDENTIFICATION" in stderr \
            or "Permission denied" in stderr:
        return None
    return next((reason for words, reason in UNREACHABLE if words in stderr), None)


def describe_ssh_failure(host: str, stderr: str, options: SSHOptions) -> str:
    """One line saying why ssh could not reach `host` and what to do about it."""
    kh = options.known_hosts
    if "REMOTE HOST IDENTIFICATION HAS CHANGED" in stderr:
        return (f"the host key of {host} differs from the one pinned for it (possible man-in-the-middle); "
                f"if the host was reinstalled, remove its line from {kh} or ~/.ssh/known_hosts and retry")
    if "Host key verification failed" in stderr:
        return (f"the host key of {host} is not known (speedrun checks host keys strictly); to trust it on "
                f"first contact and pin it in {kh}, pass --accept-new-host-keys (accept_new_host_keys=True)")
    if "Connection refused" in stderr:
        return f"cannot connect to {host}: connection refused; check that sshd runs there and the port is right"
    if "timed out" in stderr:
        return f"cannot connect to {host}: connection timed out; check the address, network and firewall"
    if "No route to host" in stderr or "unreachable" in stderr:
        return f"cannot connect to {host}: no route to host; check the address and network"
    if "Could not resolve hostname" in stderr:
        return f"cannot connect to {host}: unknown host name; check the spelling or ~/.ssh/config"
    if "Permission denied" in stderr:
        return (f"{host} refused to log in (permission denied); check the user name and the key "
                f"(--identity / identity_file, or your ssh agent)")
    return f"cannot connect to {host}: {last_line(stderr) or 'ssh failed without a message'}"
