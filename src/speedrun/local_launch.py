"""N processes of one `speedrun` command on this machine (`--nproc-per-node N`), through torchrun's
elastic agent: one failing process stops the others, and the failure is told in one line naming
the process that caused it."""
from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

from speedrun.errors import EXIT_BAD_INPUT, EXIT_RESUMABLE, SpeedrunError, TrainingFailed
from speedrun.inputs import Bound, env_number

PROCESS_START_ENV = "SPEEDRUN_PROCESS_START"  # the launcher's start, seconds since the epoch
UNIX_TIME = Bound(float, 0, 2**33)  # seconds since 1970, up to the year 2242


def process_start_time() -> float:
    """When this run began: the launcher's start when `--nproc-per-node` started us, else the
    moment the command line was read (after Python and speedrun's imports)."""
    start = env_number(PROCESS_START_ENV, UNIX_TIME)
    return time.time() if start is None else start


def launch_local_processes(argv: list[str], n: int) -> int:
    """Run `speedrun ARGV` as `n` processes on this machine through torchrun's launcher (the
    elastic agent: it watches the processes and stops them all when one fails). A process that
    refused bad input (exit 2) makes this a bad-input error too."""
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ[PROCESS_START_ENV] = str(process_start_time())
    # Share the cores instead of every process starting one thread per core.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=n,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.5,
    )
    try:
        elastic_launch(config, sys.executable)("-m", "speedrun", *argv)
    except SignalException:  # SIGTERM here: torchrun passed it on, the processes stopped at a step
        if run_status(argv) == "stopped":
            return EXIT_RESUMABLE
        raise KeyboardInterrupt("stopped by SIGTERM") from None
    except ChildFailedError as e:
        rank, failure = root_cause(e.failures)
        # Stopped at a step: the first to exit made torchrun stop the others, whose exit codes do
        # not matter then. Unless the root cause is a rank that died: that is reported.
        if failure.exitcode == EXIT_RESUMABLE and run_status(argv) == "stopped":
            return EXIT_RESUMABLE
        message = failure.message or ""
        if not message or str(message).startswith("To enable traceback"):  # torchrun's placeholder
            message = "it left no error message"
        elif isinstance(failure.message, dict):  # the error file our processes write (cli.report)
            message = str(failure.message.get("message", failure.message)).removeprefix("RuntimeError: ")
        if failure.exitcode == EXIT_BAD_INPUT:  # the process's own one line, without its prefix
            raise SpeedrunError(re.sub(r"^speedrun: (rank \d+: )?error: ", f"rank {rank}: ", message)) from None
        raise TrainingFailed(
            f"rank {rank} (pid {failure.pid}) failed first with exit code {failure.exitcode}: {message}; "
            "the other ranks were stopped"
        ) from None
    return 0


def run_status(argv: list[str]) -> str | None:
    """The status in results.json of the run `--out` names in argv, if there is one."""
    from speedrun.rundir import run_status as status_of

    if "--out" not in argv:
        return None
    return status_of(Path(argv[argv.index("--out") + 1]))


def root_cause(failures: dict) -> tuple[int, object]:
    """The failure that caused the others: a process that died on its own comes before one
    stopped by torchrun (SIGTERM, or stopped at a step after it) or one that failed because a
    peer vanished."""
    from speedrun.dist import PEER_DIED

    def collateral(item) -> bool:
        _, f = item
        return f.signal_name() == "SIGTERM" or f.exitcode in (130, EXIT_RESUMABLE) or PEER_DIED in str(f.message)

    return min(failures.items(), key=lambda item: (collateral(item), item[1].timestamp))


def strip_option(argv: list[str], name: str) -> list[str]:
    """`argv` without `name VALUE` / `name=VALUE`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out
