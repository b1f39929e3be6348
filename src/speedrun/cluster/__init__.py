"""Experiment infrastructure: jobs of N machines as Python code, run in tmux, over SSH.

    from speedrun.cluster import make_job
    job = make_job("demo", 2, provider="ssh", hosts=["gpu1", "gpu2"], run_root="/shared/runs")
    job.run("nvidia-smi -L")
    job.launch(f"-m speedrun train --recipe tiny --out {job.run_dir}")
    job.wait()

Modules, from the bottom up: hosts (Host, LocalHost) and ssh (SSHHost) run scripts and move files;
tmux writes the scripts that run commands in tmux windows; task (Task, Command) and utils (parallel)
build on them; job (Job) is what can be done with a job's tasks, whatever runs them; provider says
what a provider is (one class per kind of machine, its options and verbs); tmux_job (TmuxJob) runs
a job's tasks in tmux sessions on hosts, which host_provider's providers hand out; probe looks at a
task's host; providers lists the providers (local, ssh, the aws package: EC2 instances speedrun
starts itself, and the slurm package: a Slurm cluster's nodes, one Slurm job per job, SlurmJob);
lifecycle makes a job (make_job) through its provider, reopen finds it again (open_job); registry
keeps job records;
tensorboard serves a run's events; recovery keeps a job going when it loses machines, controller
runs that watcher on another host and watcher stops it; check measures how fast a job's machines
all-reduce (allreduce is the benchmark it runs on them); cli (with check_cli.py) is
`speedrun launch | ls | attach | logs | kill | down | tb | check`, progress its lines on stderr.
The wing imports nothing of the trainer's: only
speedrun.errors, speedrun.files and speedrun.spot. Tests and benchmarks make hosts out of network
namespaces (tests/netns.py), emulate AWS with moto (tests/aws_server.py) and build a real Slurm
cluster (tests/slurm_cluster.py).
"""
from speedrun.cluster.hosts import Host, LocalHost
from speedrun.cluster.job import Job
from speedrun.cluster.states import TaskStatus
from speedrun.cluster.lifecycle import make_job
from speedrun.cluster.provider import Billing, Provider
from speedrun.cluster.providers import LocalProvider, SSHProvider
from speedrun.cluster.reopen import open_job
from speedrun.cluster.ssh import SSHHost, SSHOptions
from speedrun.cluster.task import Command, CommandFailed, Result, Task
from speedrun.cluster.tmux_job import TmuxJob

__all__ = [
    "Billing", "Command", "CommandFailed", "Host", "Job", "LocalHost", "LocalProvider", "Provider", "Result", "SSHHost",
    "SSHOptions", "SSHProvider", "Task", "TaskStatus", "TmuxJob", "make_job", "open_job",
]
