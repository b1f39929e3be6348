"""The Slurm provider (issue 25, being built): speedrun's jobs on the clusters where most GPUs
already are, one Slurm job per speedrun job, through Slurm's own clients.

Here so far, one step per module: config.py (SlurmConfig: make_job's options for provider="slurm",
and Slurm's time-limit format), api.py (running sbatch, squeue, scontrol, scancel with each failure
in one line: exit 2 for what the user can fix, 3 when Slurm does not answer) and submit.py (a
request checked against the cluster before anything of the job is made). docs/slurm.md says what
works today.
"""
