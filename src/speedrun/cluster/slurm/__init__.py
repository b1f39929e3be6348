"""The Slurm provider: speedrun's jobs on the clusters where most GPUs already are, one Slurm job per
speedrun job, through Slurm's own clients (docs/slurm.md).

    config.py    SlurmConfig: make_job's options for provider="slurm", and Slurm's time-limit format
    api.py       running sbatch, squeue, scontrol, scancel, each failure in one line (exit 2 for what
                 the user can fix, 3 when Slurm does not answer)
    submit.py    a request checked against the cluster before anything of the job is made
    queue.py     the job's Slurm job: submit, its state, cancel
    scripts.py   the batch script and each node's script: one torchrun per node, requeue on warning
    job.py       SlurmJob: launch, status, wait, logs, kill for a job on Slurm
    options.py   launch's command-line options for it
    provider.py  SlurmProvider, the provider interface: its options, and its jobs SlurmJobs
"""
from speedrun.cluster.slurm.config import SlurmConfig
from speedrun.cluster.slurm.provider import SlurmProvider

__all__ = ["SlurmConfig", "SlurmProvider"]
