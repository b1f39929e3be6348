"""Hosts for tests and benchmarks: network namespaces on this machine, each running its own sshd.

`NetnsCluster(n)` makes n "machines" that the ssh provider reaches exactly as it would reach real
ones: through the OpenSSH client, with a key and host keys made here, over a network of their own.

    root namespace: bridge 198.51.100.(16k+1)/28
        |-- veth --> namespace speedrun-k-0: eth0 198.51.100.(16k+2), lo, sshd on port 22
        |-- veth --> namespace speedrun-k-1: eth0 198.51.100.(16k+3), lo, sshd on port 22
        ...

k is a slot (0..15) so that several test sessions (and pytest-xdist's workers) can run at once
(`add_subnet` puts a second slot's /28 on the same bridge, for hosts in two subnets of one network);
a slot is held with a file lock for the cluster's lifetime, and whatever a crashed session left in a
slot is removed before reuse. Slots 0-5 are the AWS test server's zones (tests/aws_server.py: zone i
is slot i), so a cluster that asks for no slot takes those last.
Only addresses from 198.51.100.0/24 (TEST-NET-2) and loopback are ever used.

The namespaces isolate the network only: the hosts share this machine's filesystem (which serves as
the "shared storage" a real cluster would mount) and its users. Each sshd gives its sessions their
own HOME and TMUX_TMPDIR (set from authorized_keys), so that per-host state such as tmux servers,
setup marks and synced code is kept apart as it would be on separate machines. Nothing else is
set for them: the machine's host name resolves to an address outside the namespaces, as on many
real machines, and `job.launch` must find the interface that reaches task 0 by itself.

Needs root, `ip` (iproute2), `ssh-keygen` and `/usr/sbin/sshd`.
"""
from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SUBNET_PREFIX = "198.51.100."
SLOTS = 16  # 198.51.100.0/24 cut into sixteen /28 networks, one per cluster
ZONE_SLOTS = 6  # slots 0-5: the subnets of the AWS test region's six zones
MAX_HOSTS = 13  # a /28 has 14 usable addresses, one of them the bridge's
LOCK_DIR = Path("/run/speedrun-netns")
SSHD = "/usr/sbin/sshd"


def unavailable_reason() -> str | None:
    """Why network-namespace hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (run the tests as root)"
    for tool in ("ip", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install iproute2 openssh-client)"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} is not installed (apt-get install openssh-server)"
    probe = f"speedrun-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"network namespaces are unavailable here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def require(what: str, reason: str | None = None) -> None:
    """Skip the calling test where namespaces cannot be made (or where `reason`, another harness's
    own, says it cannot run), except under CI (CI=true), where that fails it: `what` (e.g. "the
    recovery tests") must run there."""
    reason = reason or unavailable_reason()
    if reason:
        import pytest
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI must run {what}, but {reason}")
        pytest.skip(reason)


@dataclass
class NetnsHost:
    """One namespace "machine"."""

    index: int
    namespace: str
    address: str  # its IPv4 address on the cluster network
    port: int  # where its sshd listens
    dir: Path  # its sshd config, keys and logs
    home: Path  # HOME for its ssh sessions
    host_public_key: str  # "ssh-ed25519 AAAA..."
    sshd: subprocess.Popen | None = None

    @property
    def spec(self) -> str:
        """The host as the ssh provider takes it: user@address[:port]."""
        return f"root@{self.address}" if self.port == 22 else f"root@{self.address}:{self.port}"

    def known_hosts_line(self) -> str:
        """This host's key as a known_hosts line."""
        name = self.address if self.port == 22 else f"[{self.address}]:{self.port}"
        return f"{name} {self.host_public_key}\n"

    def exec(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Run argv inside this host's namespace, directly (not over ssh)."""
        return subprocess.run(["ip", "netns", "exec", self.namespace, *argv], **kwargs)


class NetnsCluster:
    """n hosts as network namespaces with sshd; use as a context manager.

    After `start()`: `hosts`, `client_key` (private key that every host accepts for root) and
    `known_hosts` (a file holding every host's key), ready for the ssh provider. More hosts come up
    at given addresses of `subnet` with `add_host` (the AWS test server boots an instance's host
    so) and go down with `remove_host`.
    """

    def __init__(self, num_hosts: int, workdir: str | os.PathLike | None = None, first_slot: int | None = None):
        if not 0 <= num_hosts <= MAX_HOSTS:
            raise ValueError(f"num_hosts must be 0..{MAX_HOSTS}, got {num_hosts}")
        self.num_hosts = num_hosts
        self.first_slot = first_slot
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="speedrun-netns-"))
        self.hosts: list[NetnsHost] = []
        self.slot: int | None = None
        self._lock_file = None
        self.extra_slots: list[int] = []  # more subnets on the same bridge (add_subnet)
        self._extra_locks: list = []

    # --- names: all derive from the slot so that leftovers of a crashed session can be found ---
    def _namespace(self, i: int) -> str:
        return f"speedrun-{self.slot}-{i}"

    def _bridge(self, slot: int | None = None) -> str:
        return f"srbr{self.slot if slot is None else slot}"

    def _veth_root(self, i: int, slot: int | None = None) -> str:
        return f"sr{self.slot if slot is None else slot}h{i}"

    def _veth_ns(self, i: int) -> str:
        return f"sr{self.slot}n{i}"

    @property
    def client_key(self) -> Path:
        return self.workdir / "client_key"

    @property
    def known_hosts(self) -> Path:
        return self.workdir / "known_hosts"

    @property
    def specs(self) -> list[str]:
        return [h.spec for h in self.hosts]

    def address(self, i: int) -> str:
        """The address of host i (i == -1: the bridge, i.e. this machine on the cluster network)."""
        return f"{SUBNET_PREFIX}{16 * self.slot + 2 + i}"

    # --- life cycle ---
    def __enter__(self) -> "NetnsCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def subnets(self) -> list[str]:
        """Every network of this cluster: `subnet`, then those of add_subnet."""
        return [f"{SUBNET_PREFIX}{16 * s}/28" for s in (self.slot, *self.extra_slots)]

    def add_subnet(self) -> str:
        """Take one more slot and put its /28 on this cluster's bridge, as a second subnet of one
        network (a VPC's subnet in another zone): the bridge gets the slot's first address, and
        every host, now and later, reaches the subnet's addresses on its link (no router needed).
        Returns the subnet, e.g. 198.51.100.32/28; it goes with the cluster."""
        slot, lock = self._lock_slot(self.slot + 1)
        self.extra_slots.append(slot)
        self._extra_locks.append(lock)
        self._remove_network(slot)  # whatever a crashed session left in that slot
        subnet = f"{SUBNET_PREFIX}{16 * slot}/28"
        ip("addr", "add", f"{SUBNET_PREFIX}{16 * slot + 1}/28", "dev", self._bridge())
        for h in self.hosts:
            ip("-n", h.namespace, "route", "add", subnet, "dev", "eth0")
        return subnet

    def start(self) -> None:
        """Take a slot, make the bridge and the first num_hosts hosts (their sshd accepting)."""
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        try:
            self._take_slot()
            self._remove_network()  # whatever a crashed session left in this slot
            self.workdir.mkdir(parents=True, exist_ok=True)
            keygen(self.client_key, comment="speedrun-test-client")
            ip("link", "add", self._bridge(), "type", "bridge")
            ip("addr", "add", f"{self.address(-1)}/28", "dev", self._bridge())
            ip("link", "set", self._bridge(), "up")
            self.hosts = []
            for i in range(self.num_hosts):
                self.add_host(self.address(i))
        except BaseException:
            self.stop()
            raise

    @property
    def subnet(self) -> str:
        """This cluster's network, e.g. 198.51.100.16/28 (the bridge holds its first address)."""
        return f"{SUBNET_PREFIX}{16 * self.slot}/28"

    def add_host(self, address: str, authorized_key: str | None = None) -> NetnsHost:
        """Bring up a host at `address` (inside one of `subnets`) whose sshd admits root with
        `authorized_key` (an OpenSSH public key line; default: client_key's); returns once its sshd
        accepts connections."""
        used = {h.index for h in self.hosts}
        i = next((i for i in range(MAX_HOSTS) if i not in used), None)
        if i is None:
            raise RuntimeError(f"a cluster has at most {MAX_HOSTS} hosts at once")
        d = self.workdir / f"host{i}"
        shutil.rmtree(d, ignore_errors=True)  # a new machine: nothing of an earlier host in this place
        home = d / "home"
        (home / ".tmux").mkdir(parents=True, exist_ok=True)
        keygen(d / "ssh_host_ed25519_key", comment=f"host{i}")
        pub = (d / "ssh_host_ed25519_key.pub").read_text().split()
        host = NetnsHost(index=i, namespace=self._namespace(i), address=address, port=22, dir=d, home=home,
                         host_public_key=f"{pub[0]} {pub[1]}")
        # The environment= options make this namespace feel like its own machine (see module doc).
        env = {
            "HOME": str(home),
            "TMUX_TMPDIR": str(home / ".tmux"),
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        }
        options = ",".join(f'environment="{k}={v}"' for k, v in env.items())
        key = authorized_key or Path(f"{self.client_key}.pub").read_text()
        (d / "authorized_keys").write_text(f"{options} {key.strip()}\n")
        (d / "sshd_config").write_text(
            "\n".join([
                f"ListenAddress {host.address}:{host.port}",
                f"HostKey {d / 'ssh_host_ed25519_key'}",
                f"PidFile {d / 'sshd.pid'}",
                f"AuthorizedKeysFile {d / 'authorized_keys'}",
                "PermitRootLogin prohibit-password",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",  # the temp dir's modes are not sshd's business here
                "PermitUserEnvironment yes",
                "MaxSessions 64",
                "MaxStartups 64",
                "AllowTcpForwarding local",
                "X11Forwarding no",
                "LogLevel ERROR",
                "",
            ])
        )
        self.hosts.append(host)
        self.known_hosts.write_text("".join(h.known_hosts_line() for h in self.hosts))
        ns = host.namespace
        ip("netns", "add", ns)
        ip("link", "add", self._veth_root(i), "type", "veth", "peer", "name", self._veth_ns(i))
        ip("link", "set", self._veth_root(i), "master", self._bridge())
        ip("link", "set", self._veth_root(i), "up")
        ip("link", "set", self._veth_ns(i), "netns", ns)
        ip("-n", ns, "link", "set", self._veth_ns(i), "name", "eth0")
        ip("-n", ns, "addr", "add", f"{address}/28", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")
        for subnet in self.subnets:  # the others: on the link too (see add_subnet)
            if ipaddress.ip_address(address) not in ipaddress.ip_network(subnet):
                ip("-n", ns, "route", "add", subnet, "dev", "eth0")
        self._start_sshd(host)
        wait_for_port(host.address, host.port, timeout=20, what=f"sshd of {host.namespace}")
        return host

    def remove_host(self, host: NetnsHost) -> None:
        """Take a host down as a machine vanishes: every process in it killed at once (SIGKILL: no
        chance to clean up, as in a power loss), then its namespace and link."""
        kill_namespace_processes(host.namespace, signals=(signal.SIGKILL,))
        if host.sshd is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                host.sshd.wait(timeout=10)
        host.sshd = None
        ip("netns", "del", host.namespace, check=False)
        if Path(f"/sys/class/net/{self._veth_root(host.index)}").exists():
            ip("link", "del", self._veth_root(host.index), check=False)
        self.hosts.remove(host)

    def set_link(self, host: NetnsHost, up: bool) -> None:
        """Cut (up=False) or restore a host's link to the network, as a partition would: its
        processes keep running, unreachable meanwhile. Restoring returns once this machine
        reaches the host's sshd again: an ARP resolution begun while the link was cut ends in
        failure up to 3 s after it is back, failing every packet queued on it ("No route to
        host"), as it would on a real network healing."""
        ip("link", "set", self._veth_root(host.index), "up" if up else "down")
        if up:
            deadline = time.monotonic() + 30
            while True:
                try:
                    socket.create_connection((host.address, host.port), timeout=1).close()
                    return
                except OSError as e:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{host.spec} unreachable 30 s after its link came back: {e}") from e

    def set_path_from_here(self, host: NetnsHost, up: bool) -> None:
        """Cut (up=False) or restore the path between this machine and `host` alone, as a firewall
        between them would: `host` keeps reaching the other hosts of its subnet, and they it (its
        replies to this machine's address on the network go nowhere: a blackhole route there)."""
        host.exec(["ip", "route", "del" if up else "add", "blackhole", f"{self.address(-1)}/32"], check=True)

    def stop(self) -> None:
        """Stop every process in the namespaces, delete them and the links; idempotent."""
        if self.slot is None:
            return
        for h in self.hosts:
            if h.sshd is not None and h.sshd.poll() is None:
                h.sshd.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    h.sshd.wait(timeout=10)
        self._remove_network()
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None
        for f in self._extra_locks:
            f.close()
        self.extra_slots, self._extra_locks = [], []
        self.slot = None
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # --- steps ---
    def _take_slot(self) -> None:
        self.slot, self._lock_file = self._lock_slot(self.first_slot)

    @staticmethod
    def _lock_slot(first: int | None):
        """The first free slot from `first` on (None: past the zone slots first, then those), and the
        open file whose lock holds it."""
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        order = range(first, SLOTS) if first is not None else [*range(ZONE_SLOTS, SLOTS), *range(ZONE_SLOTS)]
        for slot in order:
            f = open(LOCK_DIR / f"slot-{slot}.lock", "w")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            return slot, f
        raise RuntimeError(f"all {SLOTS} network slots in {LOCK_DIR} are in use")

    def _start_sshd(self, h: NetnsHost) -> None:
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        log = open(h.dir / "sshd.log", "ab")
        h.sshd = subprocess.Popen(
            ["ip", "netns", "exec", h.namespace, SSHD, "-D", "-e", "-f", str(h.dir / "sshd_config")],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
        )
        log.close()

    def _remove_network(self, slot: int | None = None) -> None:
        """Remove what a cluster in `slot` (default this one's) made: namespaces, links, bridge."""
        slot = self.slot if slot is None else slot
        namespaces = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
        prefix = f"speedrun-{slot}-"
        for ns in sorted(n for n in namespaces if n.startswith(prefix)):
            kill_namespace_processes(ns)
            ip("netns", "del", ns, check=False)
        for link in [self._veth_root(i, slot) for i in range(MAX_HOSTS)] + [self._bridge(slot)]:
            if Path(f"/sys/class/net/{link}").exists():
                ip("link", "del", link, check=False)


def kill_namespace_processes(namespace: str, timeout: float = 10.0,
                             signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGKILL)) -> None:
    """Each of `signals` in turn (until none is left) to every process in a network namespace
    (sshd children, tmux servers...)."""
    def pids() -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    for sig in signals:
        for pid in pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while pids() and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for the processes to be gone, with a bound
        if not pids():
            return


def ip(*args: str, check: bool = True) -> None:
    """Run `ip ARGS`; raise with its message when it fails and check is set."""
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


def keygen(path: Path, comment: str) -> None:
    """Make an ed25519 key pair without a passphrase at path (and path.pub)."""
    for p in (path, Path(f"{path}.pub")):
        p.unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)], check=True)


def wait_for_port(address: str, port: int, timeout: float, what: str) -> None:
    """Poll until something accepts TCP connections on address:port, at most timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError), socket.create_connection((address, port), timeout=1):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not accept connections on {address}:{port} within {timeout:g} s")
        time.sleep(0.05)
