"""Fixtures for the cluster tests: a private tmux server and speedrun home, and namespace hosts.

Real parts only: real tmux, real sshd in network namespaces (tests/netns.py), real ssh.
"""
from __future__ import annotations

import itertools
import os
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from speedrun.cluster import SSHOptions, make_job
from netns import NetnsCluster, require

_names = itertools.count()


@pytest.fixture(scope="session", autouse=True)
def private_speedrun(tmp_path_factory):
    """A tmux server (TMUX_TMPDIR) and a speedrun home of this test session's own, removed afterwards."""
    d = tmp_path_factory.mktemp("speedrun-env")
    (d / "tmux").mkdir()
    saved = {k: os.environ.get(k) for k in ("TMUX_TMPDIR", "SPEEDRUN_HOME", "TMUX", "SHELL")}
    os.environ["TMUX_TMPDIR"] = str(d / "tmux")
    os.environ["SPEEDRUN_HOME"] = str(d / "home")
    os.environ.pop("TMUX", None)  # tests may run inside someone's tmux
    # Each session's `shell` window runs $SHELL for a person to attach to. Tests kill sessions
    # within a second of making them; a bash killed while its .bashrc runs `pyenv init` leaves
    # pyenv's rehash lock behind, and every later pip install and bash start waits 60 s.
    os.environ["SHELL"] = "/bin/sh"
    pyenv_lock = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "shims" / ".pyenv-shim"
    lock_before = pyenv_lock.exists()
    yield d
    subprocess.run(["tmux", "-L", "speedrun", "kill-server"], capture_output=True)
    # Commands over ssh start the login shell too: remove a rehash lock these tests orphaned.
    if not lock_before and pyenv_lock.exists() and not _rehash_running():
        pyenv_lock.unlink(missing_ok=True)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _rehash_running() -> bool:
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"pyenv-rehash" in cmdline.read_bytes():
                return True
        except OSError:  # the process ended
            pass
    return False


@pytest.fixture
def job_name(request) -> str:
    """A job name unique in this test session (jobs share the tmux server)."""
    base = "".join(c if c.isalnum() else "-" for c in request.node.name)[:40].strip("-")
    return f"{base}-{next(_names)}"


@pytest.fixture
def local_job(tmp_path, job_name) -> Callable:
    """make_job for the local provider with a run root and host dir in tmp_path; jobs killed at the end."""
    jobs = []

    def make(name: str = job_name, num_tasks: int = 1, **kwargs):
        kwargs.setdefault("run_root", str(tmp_path / "runs"))
        kwargs.setdefault("host_dir", str(tmp_path / "host"))
        job = make_job(name, num_tasks, **kwargs)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.kill()


@pytest.fixture(scope="session")
def netns() -> NetnsCluster:
    """Two hosts as network namespaces running sshd (see tests/netns.py). Skipped
    where namespaces cannot be made, except under CI (CI=true), where that is a failure: the
    multi-host tests must run there."""
    require("the multi-host tests")
    cluster = NetnsCluster(2)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    """Storage every namespace host sees (they share this machine's filesystem)."""
    return tmp_path_factory.mktemp("shared")


@pytest.fixture
def ssh_job(netns, shared_dir, job_name) -> Callable:
    """make_job for the ssh provider on the namespace hosts; jobs killed at the end."""
    jobs = []

    def make(name: str = job_name, num_tasks: int = 2, **kwargs):
        kwargs.setdefault("hosts", netns.specs)
        kwargs.setdefault("ssh", SSHOptions(known_hosts=netns.known_hosts, identity_file=netns.client_key))
        kwargs.setdefault("run_root", str(shared_dir / "runs"))
        job = make_job(name, num_tasks, provider="ssh", **kwargs)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.kill()
        job.close()  # the master connections


@pytest.fixture(scope="session")
def aws_server():
    """moto on 127.0.0.1 behind tests/aws_server.py, whose new instances boot as namespace hosts of a
    cluster of their own with two networks (so two zones' subnets are that cluster's networks). Fails under CI, as
    `netns` does, where namespaces cannot be made."""
    require("the AWS tests")
    from aws_server import ZONES, AWSTestServer
    # Slot 1 or later: zone i's subnet is slot i, and zone a must come before the test zone for the
    # zone-fallback test to have a zone to fall back from.
    cluster = NetnsCluster(0, first_slot=1)
    cluster.start()
    cluster.add_subnet()  # a second zone, for replacements that must go elsewhere
    if cluster.extra_slots[-1] >= len(ZONES):
        cluster.stop()
        pytest.fail(f"network slots {cluster.slot} and {cluster.extra_slots} need zones in the test region; "
                    f"too many test sessions at once")
    server = AWSTestServer(cluster)
    server.start()
    yield server
    server.stop()
    cluster.stop()


@pytest.fixture
def aws(aws_server, monkeypatch, tmp_path):
    """The AWS test server, emptied (a new account, no faults), with boto3 pointed at it and no
    AWS configuration of this machine's in the way."""
    aws_server.reset()
    for k, v in aws_server.environment().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return aws_server


@pytest.fixture
def efs_mount(tmp_path):
    """A directory that is a mount point (bound onto itself), standing in for where EFS is mounted:
    the namespace hosts share this machine's filesystem, so it is storage they all see, and the
    provider's mount step finds it mounted and leaves it."""
    d = tmp_path / "efs"
    d.mkdir()
    subprocess.run(["mount", "--bind", str(d), str(d)], check=True)
    yield str(d)
    subprocess.run(["umount", "-l", str(d)], check=False)
