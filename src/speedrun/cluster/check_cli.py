"""`speedrun check JOB`'s command line: its options (`add_check_command`, registered by cli.py)
and the command (`cmd_check`), which runs check.py's `check_job` and prints its table and verdict."""
from __future__ import annotations

import argparse
import signal
import sys

from speedrun.cluster.check import ITERS, MESSAGE_MIB, check_job, format_table
from speedrun.cluster.progress import show_progress
from speedrun.errors import EXIT_FAILED, stop_on_sigterm
from speedrun.inputs import PROCESSES, Bound, given


def add_check_command(sub: argparse._SubParsersAction) -> None:
    """`speedrun check`'s parser."""
    p = sub.add_parser("check", help="measure how fast a job's machines all-reduce (like nccl-tests)",
                       description="Run an all-reduce benchmark on every task of the job (one process per GPU, "
                                   "NCCL; one per task on CPUs, gloo), print algbw and busbw per message size "
                                   "and a verdict against the machines' nominal network bandwidth; the result "
                                   "goes to <run_dir>/check.json.")
    p.add_argument("name", type=given, help="job name")
    p.add_argument("--size", type=MESSAGE_MIB, default=64.0, metavar="MB", help="largest message, MiB (default 64)")
    p.add_argument("--iters", type=ITERS, default=20, help="timed calls per message size (default 20)")
    p.add_argument("--nproc-per-node", type=PROCESSES, default=None,
                   help="processes per task (default: one per GPU, else 1)")
    p.add_argument("--timeout", type=Bound(float, 0.1, 86_400), default=900.0, metavar="SECONDS",
                   help="give up waiting for the check after this long (default 900)")
    p.set_defaults(func=cmd_check)


def cmd_check(args: argparse.Namespace) -> int:
    from speedrun.cluster.hosts import HostLost
    from speedrun.cluster.reopen import open_job
    from speedrun.cluster.states import telling_line
    from speedrun.cluster.task import CommandFailed

    show_progress()  # what the job layer says meanwhile (a task failed, the Slurm job submitted...)
    stop_on_sigterm((signal.SIGTERM, signal.SIGHUP))  # as Ctrl-C: the check is stopped on the tasks too
    job = open_job(args.name)
    try:
        result = check_job(job, size_mb=args.size, iters=args.iters, nproc_per_node=args.nproc_per_node,
                           timeout_s=args.timeout)
    except CommandFailed as e:  # the benchmark itself failed: what the log says why, exit 3 as a failed run
        why = telling_line(e.output.splitlines()) or "no message"
        print(f"speedrun: job {job.name}: the check failed (exit {e.status}): {why} (log: {e.log})", file=sys.stderr)
        return EXIT_FAILED
    except HostLost as e:  # a check, not a training run, failed: the others are stopped already
        print(f"speedrun: job {job.name}: the check failed: {e}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        job.close()
    for line in format_table(result):
        print(line)
    print(f"verdict: {result['verdict']}")
    print(f"result: {result['path']}")
    return EXIT_FAILED if result["verdict"].startswith("WRONG") else 0
