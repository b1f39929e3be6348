"""The test tiers, and fixtures shared by the trainer's tests.

Tiers: plain `pytest` runs the unit tier, the tests with none of the markers in FULL_TIER (under
60 s on two cores); `pytest --full` (what scripts/test and CI run) runs every test. A unit-tier
test that starts a process fails, naming the marker it needs: a process means a torch import,
a server or a host, which is what makes a suite slow. `-m EXPR` chooses tests itself, as usual.

Record: every run writes each test's seconds to test-results/durations.tsv and prints the seconds
per file (tests/suite_record.py); scripts/test shares the full suite among pytest-xdist workers,
a whole file (or xdist group) per worker.

Fixtures: small real file systems (tmpfs mounts) for read-only and full-disk cases (see fs_helpers),
and the `speedrun train` runs that several test modules read, made once per session (full tier).
"""
from __future__ import annotations

import contextlib
import fcntl
import multiprocessing.process
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import torch  # noqa: F401  (here, before any test: its first import runs ldconfig, a process of its own)
from cli_run import speedrun
from fs_helpers import mount_tmpfs, require_root
from suite_record import CpuMeter, DurationRecord, make_scheduler

# A test with any of these markers runs only in the full suite (pyproject.toml describes each).
FULL_TIER = ("slow", "netns", "aws", "slurm")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true",
                     help="run every test, also those marked " + ", ".join(FULL_TIER) + " (scripts/test does)")


def pytest_configure(config: pytest.Config) -> None:
    # A suite started in the background by a non-interactive shell (`scripts/test &`, `nohup ... &`)
    # has SIGINT ignored, and every process it starts would inherit that: the tests that press Ctrl-C
    # on a run would watch it finish. Runs started by a terminal's user get SIGINT as usual.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.pluginmanager.register(CpuMeter(), "speedrun-cpu")  # in every process that runs tests
    if not hasattr(config, "workerinput"):  # the process that reports (not an xdist worker)
        config.pluginmanager.register(DurationRecord(config), "speedrun-durations")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return make_scheduler(config, log) if config.getvalue("dist") == "loadgroup" else None


def pytest_itemcollected(item: pytest.Item) -> None:
    # The AWS tests share one worker under xdist: one moto server, whose zones are network slots 1-5.
    if item.get_closest_marker("aws"):
        item.add_marker(pytest.mark.xdist_group("aws"))


def in_full_tier(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(m) for m in FULL_TIER)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--full") or config.getoption("markexpr"):
        return
    deselected = [item for item in items if in_full_tier(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not in_full_tier(item)]


def pytest_sessionstart(session: pytest.Session) -> None:
    # matplotlib builds its font cache on its first import on a machine by running `fc-list`: done
    # here, before any unit-tier test runs, so a fresh machine's first plot is not refused as a
    # process the test started.
    import matplotlib.font_manager  # noqa: F401


@contextlib.contextmanager
def no_process_started(item: pytest.Item) -> Iterator[None]:
    """While a unit-tier test (or a fixture it sets up, of any scope) runs: starting a process fails
    the test, naming what it needs instead."""
    if in_full_tier(item):
        yield
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{item.nodeid} starts a process: mark it slow (or netns, aws) "
                             "to put it in the full suite, or do the work in this process")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", refuse)
        patch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    with no_process_started(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with no_process_started(item):
        return (yield)


def tmpfs(path: Path, options: str, what: str) -> Iterator[Path]:
    require_root(what)
    mount_tmpfs(path, options)
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def read_only_dir(tmp_path) -> Iterator[Path]:
    """An empty read-only file system."""
    yield from tmpfs(tmp_path / "ro", "ro,size=1m", "the read-only file system test")


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """An 8 MiB file system, for filling up."""
    yield from tmpfs(tmp_path / "small", "size=8m", "the full-disk test")


# Runs of the tiny recipe that several test modules read, made once per test session (once in all,
# when pytest-xdist's workers share the suite: the first worker to need one makes it, the others
# wait for it). Each is a `speedrun train` process of its own (a torch import and a training run).
# Their users only read them; a test that changes a run (--resume, a damaged file) copies it first
# (shutil.copytree).


class MadeRun(NamedTuple):
    """A run a fixture made: its directory and what `speedrun train` printed."""

    out: Path
    stdout: str


def train_tiny(tmp_path_factory: pytest.TempPathFactory, *args: str, name: str) -> MadeRun:
    """`speedrun train --recipe tiny --device cpu ARGS` into a directory called `name` (unique in
    the session), made once for every worker of this test session."""
    # Under xdist each worker's base directory is one level below the session's.
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    made = root / "shared-runs" / name
    made.parent.mkdir(exist_ok=True)
    with open(made.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, even if the run fails
        if not (made / "stdout.txt").exists():
            made.mkdir(exist_ok=True)
            out = made / name
            proc = speedrun("train", "--recipe", "tiny", "--device", "cpu", *args, "--out", str(out))
            assert proc.returncode == 0, proc.stderr
            (made / "stdout.txt").write_text(proc.stdout)
    return MadeRun(made / name, (made / "stdout.txt").read_text())


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """One deterministic run of the tiny recipe, logging every step: the uninterrupted run that
    interrupted and killed ones must end exactly like (test_train, test_rundir)."""
    return train_tiny(tmp_path_factory, "--deterministic", "--log-every", "1", name="deterministic").out


@pytest.fixture(scope="session")
def tiny_one_epoch_run(tmp_path_factory) -> Path:
    """A finished one-epoch run of the tiny recipe (test_experiments, test_failures_train,
    test_distributed), under a long path (compare's tables must not cut it)."""
    return train_tiny(tmp_path_factory, "--epochs", "1",
                      name="a-run-directory-with-a-name-longer-than-any-column-" + "x" * 40).out


@pytest.fixture(scope="session")
def tiny_target_run(tmp_path_factory) -> MadeRun:
    """A run of the tiny recipe that stopped at its target, top-1 0.2, before its last epoch
    (test_train, test_failures_train): its directory and what it printed."""
    return train_tiny(tmp_path_factory, "--target", "top1=0.2", name="target")
