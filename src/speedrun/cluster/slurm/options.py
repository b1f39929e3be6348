"""The slurm provider on the command line (SlurmProvider declares them): launch's options
(`add_slurm_options`, SlurmConfig's fields)."""
from __future__ import annotations

import argparse

from speedrun.cluster.slurm.config import CPUS_PER_TASK, GPUS_PER_NODE, MAX_REQUEUES, SIGNAL_LEAD_S
from speedrun.inputs import given

def add_slurm_options(p: argparse.ArgumentParser) -> None:
    """launch's options for the slurm provider (SlurmConfig's fields, each under its own name;
    default None: SlurmConfig's own default), as a group of their own."""
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
