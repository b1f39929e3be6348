"""A real Slurm cluster on this machine, for the Slurm tests: Debian's munged, slurmctld and slurmd,
each node a network-namespace host of tests/netns.py.

    root namespace: bridge 198.51.100.(16k+1)/28, where sbatch, squeue, scancel... run (the login node)
        |-- namespace speedrun-k-0: 198.51.100.(16k+2), slurmctld (port 6817)
        |-- namespace speedrun-k-1: 198.51.100.(16k+3), slurmd -N node1 (port 6818)
        |-- namespace speedrun-k-2: 198.51.100.(16k+4), slurmd -N node2
        ...

One munged serves them all over a path socket (it reaches every namespace, which share this
machine's file system, as a real cluster shares its home directories). Everything the cluster keeps
(slurm.conf, state, logs) is in the cluster's directory; the sockets (munged's, and the nodes' spool
directories, where slurmstepd makes its own) are in a short one of their own under /tmp, since a
socket's path may not exceed 108 bytes; nothing goes to /etc or /var. Clients find the cluster
through SLURM_CONF (`env`).

What a container without systemd or a cgroup file system needs: ProctrackType=proctrack/linuxproc
(processes tracked by parentage), TaskPlugin=task/none, cgroup/v1 named in cgroup.conf (slurmd
loads a cgroup plugin whatever the other settings; v1 loads without a mounted hierarchy), and
SlurmdParameters=config_overrides (every node says it has the CPUs slurm.conf gives it, though they
share this machine's). Nodes are allocated whole (select/linear), as GPU nodes usually are.

Needs root, network namespaces (tests/netns.py) and the Debian packages slurmctld, slurmd,
slurm-client and munge (scripts/test installs them).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import netns
from netns import NetnsCluster

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol", "scancel", "srun")
PACKAGES = "slurmctld slurmd slurm-client munge"
START_TIMEOUT_S = 60.0  # from the daemons' start to every node idle; seconds


def unavailable_reason() -> str | None:
    """Why a Slurm cluster cannot be built here, or None when it can."""
    reason = netns.unavailable_reason()
    if reason:
        return reason
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install {PACKAGES}; scripts/test does)"
    return None


def require(what: str) -> None:
    """Skip the calling test where no cluster can be built, except under CI, where that fails it."""
    netns.require(what, unavailable_reason())


class SlurmCluster:
    """`nodes` compute nodes and a controller, each in a namespace; use as a context manager.

    After `start()`: `env` (what a client needs: SLURM_CONF), `node_names` ("node1", ...), `partition`.
    """

    def __init__(self, nodes: int = 3, workdir: str | os.PathLike | None = None, partition: str = "debug",
                 cpus_per_node: int = 1, slurmd_timeout_s: int = 10, cred_expire_s: int = 10,
                 urgent_partition: str | None = None):
        self.num_nodes, self.partition, self.cpus_per_node = nodes, partition, cpus_per_node
        # A second partition over the same nodes whose jobs preempt the first's (requeued), if named.
        self.urgent_partition = urgent_partition
        self.slurmd_timeout_s = slurmd_timeout_s
        # Slurm holds a requeued job for its credentials' lifetime (120 s by default): short here,
        # so that the requeue tests wait seconds, not minutes, for the job to start again.
        self.cred_expire_s = cred_expire_s
        self._own_workdir = workdir is None
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="speedrun-slurm-"))
        # The daemons' Unix sockets (munged's; slurmstepd's, in each node's spool directory) must have
        # paths of at most 108 bytes: they live in a short directory of their own, not under `workdir`
        # (pytest's, under an xdist worker's, is long).
        self.sockets = Path(tempfile.mkdtemp(prefix="srslurm-"))
        self.netns = NetnsCluster(nodes + 1, workdir=self.dir / "netns")
        self.daemons: dict[str, subprocess.Popen] = {}

    @property
    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.num_nodes + 1)]

    @property
    def env(self) -> dict[str, str]:
        """The variables a Slurm client (sbatch, squeue, speedrun) needs to reach this cluster."""
        return {"SLURM_CONF": str(self.dir / "slurm.conf")}

    def node_address(self, i: int) -> str:
        """The address of compute node i (1-based, as in its name)."""
        return self.netns.hosts[i].address

    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Namespaces, munged, slurmctld, one slurmd per node; returns once every node is idle."""
        try:
            self.netns.start()
            (self.dir / "state").mkdir(parents=True, exist_ok=True)
            for d in ("munge", *(f"spool/{n}" for n in self.node_names)):
                (self.sockets / d).mkdir(parents=True, exist_ok=True)
            self._start_munged()
            self._write_config()
            controller = self.netns.hosts[0]
            self._start("slurmctld", controller.namespace, ["slurmctld", "-D", "-i"])
            for i, name in enumerate(self.node_names, start=1):
                self._start(name, self.netns.hosts[i].namespace, ["slurmd", "-D", "-N", name])
            self.wait_for_nodes("idle", self.node_names)
        except BaseException:
            self.stop()
            raise

    def client(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run a Slurm client command (sinfo, squeue, scontrol...) against this cluster."""
        r = subprocess.run(argv, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=60)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")
        return r

    def node_states(self) -> dict[str, str]:
        """Each node's state as sinfo says it ("idle", "allocated", "down*"...)."""
        out = self.client("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def wait_for_nodes(self, state: str, names: list[str], timeout: float = START_TIMEOUT_S) -> None:
        """Poll sinfo until every node in `names` is in `state`, for at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.node_states()
            if all(states.get(n) == state for n in names):
                return
            if time.monotonic() > deadline:
                logs = "; ".join(f"{n}: {self._last_log_line(n)}" for n in ("slurmctld", *names))
                raise RuntimeError(f"Slurm nodes not {state} within {timeout:g} s: {states} ({logs})")
            time.sleep(0.2)  # polling the controller, with a bound

    def stop(self) -> None:
        """Stop the daemons and munged, remove the namespaces; idempotent."""
        for p in reversed(list(self.daemons.values())):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.daemons = {}
        pid = self.dir / "munged.pid"
        # munged removes its pid file as it exits: it may be gone at any point here.
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
            os.kill(int(pid.read_text().split()[0]), signal.SIGTERM)
        pid.unlink(missing_ok=True)
        self.netns.stop()
        shutil.rmtree(self.sockets, ignore_errors=True)
        if self._own_workdir:
            shutil.rmtree(self.dir, ignore_errors=True)

    # --- steps ---
    def _start_munged(self) -> None:
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        # --force: munged refuses to run as root otherwise (it is the tests' only user).
        subprocess.run(["munged", "--force", f"--socket={self._munge_socket}", f"--key-file={key}",
                        f"--pid-file={self.dir / 'munged.pid'}", f"--log-file={self.dir / 'munged.log'}",
                        f"--seed-file={self.dir / 'munge.seed'}"], check=True, capture_output=True, timeout=30)

    @property
    def _munge_socket(self) -> Path:
        return self.sockets / "munge" / "munge.socket"

    def _write_config(self) -> None:
        controller = self.netns.hosts[0]
        nodes = "".join(f"NodeName={n} NodeAddr={self.node_address(i)} CPUs={self.cpus_per_node} State=UNKNOWN\n"
                        for i, n in enumerate(self.node_names, start=1))
        d = self.dir
        (d / "slurm.conf").write_text(f"""# Written by tests/slurm_cluster.py
ClusterName=speedrun-test
SlurmctldHost={socket.gethostname()}({controller.address})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self._munge_socket},cred_expire={self.cred_expire_s}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={self.sockets}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/linear
SchedulerType=sched/backfill
# A requeued job is started by the backfill scheduler, every bf_interval seconds (default 30): 1 s,
# so that a requeue test waits for the run, not for the scheduler's next pass.
SchedulerParameters=bf_interval=1
SlurmdParameters=config_overrides
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
SlurmdTimeout={self.slurmd_timeout_s}
{nodes}PartitionName={self.partition} Nodes={','.join(self.node_names)} Default=YES MaxTime=INFINITE State=UP
{self._preemption()}""")
        (d / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")

    def _preemption(self) -> str:
        """slurm.conf's lines for the urgent partition, whose jobs preempt the other's by requeueing them."""
        if self.urgent_partition is None:
            return ""
        return (f"PreemptType=preempt/partition_prio\nPreemptMode=REQUEUE\n"
                f"PartitionName={self.urgent_partition} Nodes={','.join(self.node_names)} PriorityTier=2 "
                f"PreemptMode=OFF MaxTime=INFINITE State=UP\n")

    def _start(self, name: str, namespace: str, argv: list[str]) -> None:
        log = open(self.dir / f"{name}.out", "ab")
        self.daemons[name] = subprocess.Popen(["ip", "netns", "exec", namespace, *argv],
                                              env={**os.environ, **self.env}, stdin=subprocess.DEVNULL,
                                              stdout=log, stderr=log, start_new_session=True)
        log.close()

    def _last_log_line(self, name: str) -> str:
        log = self.dir / ("slurmctld.log" if name == "slurmctld" else f"slurmd-{name}.log")
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        return lines[-1] if lines else "(no log)"
