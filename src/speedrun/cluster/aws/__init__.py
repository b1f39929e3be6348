"""The AWS provider: EC2 instances that speedrun starts, finds again by name and gives back.

    job = make_job("r50", 2, provider="aws", instance_type="p5.48xlarge", spot=True)

`hosts(n)` for a job, in order:

1. Instances tagged `speedrun:job=<job>` are the job's: running ones are reused (make_job again with
   the same name reconnects), stopped ones started, missing task indices launched.
2. Before launching, the region's shared resources are found by their `speedrun:managed` tag, or
   made once: a VPC (`vpc_cidr`) with an internet gateway and a default route, a subnet per zone
   (the zone's sixteenth of the VPC), a security group admitting SSH from `ssh_cidr` only and all
   traffic between its members (NCCL, NFS), a key pair per region (ed25519, made here; the private
   key stays in $SPEEDRUN_HOME/keys with mode 0600), an EFS file system with a mount target in
   each zone used, and a cluster placement group per job. No rule ever admits 0.0.0.0/0.
3. Launch all missing instances in one zone (placement groups and NCCL want one); on a capacity
   error the next zone is tried; spot falls back to on-demand only when allowed. A replacement for
   a lost instance (`replace`) goes to the job's zone, else the next zone with capacity, there
   outside the job's placement group (which holds one zone). Quota errors
   name the quota and the vCPUs asked for. If anything fails after instances started, they are
   terminated (or, failing that, listed).
4. Wait until each answers SSH. Host keys: the first key an instance speedrun just launched or
   started shows is pinned in speedrun's known_hosts (trust on first use, after removing any key
   left pinned for its reused address); from then on keys are checked strictly.
5. Prepare each host (one idempotent script): EFS mounted at `efs_mount` (the default run root, so
   logs, events and checkpoints outlive the machines), the data volume made from `data_snapshot`
   mounted read-only at `data_mount`, `data_s3` synced there, and the `autostop` watcher.

Every AWS call runs inside api.aws_errors: a failure is one line naming the call, exit status 2
when the user's input or credentials are at fault, 3 when AWS or the way to it failed. `down`
keeps the job's record until everything of the job is gone, so that running it again finishes.

Tested against moto, running as a server on 127.0.0.1 (tests/aws_server.py); nothing in the tests
reaches AWS. docs/aws.md has the user's side: prerequisites, an example, cost, removal.

The package, one step per module, each readable alone, from the bottom up; modules import each
other by their full path, never through this face:

    api.py        boto3, a region's clients (Session), each AWS failure as one line (aws_errors)
    config.py     AWSConfig (make_job's options), check_ssh_cidr, the fixed names and the tags
    resources.py  the account's resources, found by tag or made once: Network (VPC, gateway,
                  security group, subnets), its rules, key pair (key_path), placement group, EFS,
                  the image (find_image)
    efa.py        EFA: which types have it, the interfaces to launch with, Elastic IPs for
                  them, NCCL's variables, the host's check for libfabric's EFA provider
    pricing.py    prices (on-demand table, spot history), billing, vCPU quotas
    instances.py  finding a job's instances, launching, starting, terminating, reaching them over
                  SSH (instance_host, wait_for_ssh, forget_host_key)
    scripts.py    preparing a host: EFS, the data volume or S3 sync, autostop (prepare_host)
    teardown.py   everything speedrun made in a region, for `speedrun down --all`
    provider.py   AWSProvider, the provider interface, composing the steps above

This face re-exports what code outside the package uses.
"""
from speedrun.cluster.aws.api import Session
from speedrun.cluster.aws.config import AWSConfig, tag_value
from speedrun.cluster.aws.provider import AWSProvider
from speedrun.cluster.aws.resources import key_path
from speedrun.cluster.aws.scripts import autostop_script, efs_mount_script
from speedrun.cluster.aws.teardown import find_everything, remove_everything

__all__ = [
    "AWSConfig", "AWSProvider", "Session", "autostop_script", "efs_mount_script", "find_everything", "key_path",
    "remove_everything", "tag_value",
]
