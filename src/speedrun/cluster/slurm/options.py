"""The command line's Slurm side: launch's options for the slurm provider (`add_slurm_options`, read
back as SlurmConfig's fields by `slurm_options`). Like cli.py, it imports nothing else of the cluster
but the config (its bounds) until a command runs."""
from __future__ import annotations

import argparse
from typing import Any

from speedrun.cluster.slurm.config import CPUS_PER_TASK, GPUS_PER_NODE, MAX_REQUEUES, SIGNAL_LEAD_S
from speedrun.inputs import given

# SlurmConfig's fields that launch takes as options (default None: SlurmConfig's own default).
SLURM_OPTIONS = ("partition", "gpus_per_node", "cpus_per_task", "time", "account", "qos", "constraint", "sbatch_args",
                 "signal_lead_s", "max_requeues")


def add_slurm_options(p: argparse.ArgumentParser) -> None:
    """launch's options for the slurm provider (SlurmConfig's fields), as a group of their own."""
    g = p.add_argument_group("slurm (a Slurm cluster's nodes, one Slurm job; see docs/slurm.md)")
    g.add_argument("--partition", type=given, help="the partition to run in (default: the cluster's default one)")
    g.add_argument("--gpus-per-node", type=GPUS_PER_NODE,
                   help="GPUs on each node; torchrun starts that many processes per node unless --nproc-per-node "
                        "says otherwise")
    g.add_argument("--cpus-per-task", type=CPUS_PER_TASK, help="CPUs for each node's one task (its torchrun)")
    g.add_argument("--time", type=given,
                   help="the job's time limit in Slurm's format (90, 1:30:00, 2-00:00:00); the run is "
                        "stopped at a step before it and the job requeued to resume")
    g.add_argument("--account", type=given, help="the account to charge")
    g.add_argument("--qos", type=given, help="the quality of service")
    g.add_argument("--constraint", type=given, help="node features required (Slurm's --constraint)")
    g.add_argument("--sbatch-arg", dest="sbatch_args", action="append", metavar="OPTION",
                   help="another sbatch option, verbatim, e.g. --sbatch-arg=--exclusive (repeatable)")
    g.add_argument("--signal-lead", dest="signal_lead_s", type=SIGNAL_LEAD_S, metavar="SECONDS",
                   help="how long before the time limit Slurm's warning comes (default 120)")
    g.add_argument("--max-requeues", type=MAX_REQUEUES, help="requeue a stopped or failed run at most this many times "
                                                             "(default 3)")


def slurm_options(args: argparse.Namespace) -> dict[str, Any]:
    """The slurm options given on the command line, as make_job's keywords."""
    return {k: v for k in SLURM_OPTIONS if (v := vars(args).get(k)) is not None}
