"""The command line's AWS side: launch's options for the aws provider (`add_aws_options`, read back
as AWSConfig's fields by AWS_OPTIONS), the AWS credentials `--watcher-env` refuses to copy
(`is_aws_secret`), and `speedrun down --all` (`down_all`), which removes everything speedrun made
in AWS. Like cli.py, it imports the cluster modules only when a command runs, but for the config's
bounds (config.py imports nothing of AWS's)."""
from __future__ import annotations

import argparse
import sys

from speedrun.cluster.aws.config import AUTOSTOP_MIN, DISK_GB
from speedrun.errors import EXIT_BAD_INPUT, EXIT_FAILED
from speedrun.inputs import given

# AWSConfig's fields that launch takes as options (default None: AWSConfig's own default).
AWS_OPTIONS = ("instance_type", "image", "spot", "on_demand_fallback", "placement_group", "efa", "shared_storage",
               "region",
               "zone", "disk_gb", "ssh_user", "ssh_cidr", "ssh_cidr_allow_wide", "private_ips", "vpc_cidr",
               "data_snapshot", "data_s3",
               "data_mount", "instance_profile", "autostop")


def add_aws_options(p: argparse.ArgumentParser) -> None:
    """launch's options for the aws provider (AWSConfig's fields, AWS_OPTIONS), as a group of their own."""
    g = p.add_argument_group("aws (instances speedrun starts; see docs/aws.md)")
    g.add_argument("--instance-type", type=given, help="EC2 instance type (default p5.48xlarge)")
    g.add_argument("--image", type=given,
                   help="AMI id, or a name pattern with * (default: the Deep Learning AMI, PyTorch, Ubuntu)")
    g.add_argument("--spot", action="store_true", default=None, help="spot instances instead of on-demand")
    g.add_argument("--on-demand-fallback", action="store_true", default=None,
                   help="with --spot: use on-demand when no zone has spot capacity")
    g.add_argument("--no-placement-group", dest="placement_group", action="store_false", default=None,
                   help="do not launch into a cluster placement group")
    g.add_argument("--efa", choices=["auto", "on", "off"], default=None,
                   help="EFA interfaces on every network card, for NCCL at full network speed: auto (default) "
                        "where the instance type has EFA, on (refuse a type without it), off")
    g.add_argument("--no-shared-storage", dest="shared_storage", action="store_false", default=None,
                   help="no EFS file system (run directories then stay on each host)")
    g.add_argument("--region", type=given, help="AWS region (default: the AWS configuration's, else us-east-1)")
    g.add_argument("--zone", type=given, help="launch in this zone only (default: the region's zones in turn)")
    g.add_argument("--disk-gb", type=DISK_GB, help="root volume size, GiB (default 500)")
    g.add_argument("--ssh-user", type=given, help="the image's login user (default ubuntu)")
    g.add_argument("--ssh-cidr", type=given,
                   help="addresses allowed to SSH in (default: this machine's public address); at "
                        "most a /16 (IPv6: a /48), never /0")
    g.add_argument("--ssh-cidr-allow-wide", action="store_true", default=None,
                   help="admit an --ssh-cidr wider than /16 (IPv6: /48) to SSH: a large part of the internet")
    g.add_argument("--private-ips", action="store_true", default=None,
                   help="reach hosts at their private addresses (launching from inside the VPC)")
    g.add_argument("--vpc-cidr", type=given, help="address range of the VPC speedrun makes (default 10.210.0.0/16)")
    g.add_argument("--data-snapshot", type=given,
                   help="EBS snapshot id: a volume made from it is mounted read-only on each host")
    g.add_argument("--data-s3", type=given, help="s3:// prefix synced to the data mount on each host")
    g.add_argument("--data-mount", type=given, help="where the data lands on each host (default /mnt/data)")
    g.add_argument("--instance-profile", type=given,
                   help="IAM instance profile for the instances (e.g. to read --data-s3)")
    g.add_argument("--autostop", type=AUTOSTOP_MIN, help="stop a host after this many idle minutes (spot: terminate)")


# What --watcher-env refuses: AWS credentials themselves (a controller uses its own, never copies).
AWS_SECRETS = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
               "AWS_CONTAINER_AUTHORIZATION_TOKEN"}


def is_aws_secret(key: str) -> bool:
    """Whether --watcher-env must refuse `key`: an AWS credential, or any AWS_ token, secret or
    password (AWS_BEARER_TOKEN_<SERVICE>...). A path to a file on the controller holding one
    (AWS_WEB_IDENTITY_TOKEN_FILE...) is no secret."""
    if key in AWS_SECRETS:
        return True
    return key.startswith("AWS_") and not key.endswith("_FILE") and \
        any(word in key for word in ("SECRET", "TOKEN", "PASSWORD"))


# Why `down` (a job, or --all) removes nothing when a watcher could not be stopped.
DOWN_REFUSED = "or that watcher would start the job again where speedrun no longer looks"


def down_all(region: str | None, yes: bool) -> int:
    """Terminate and delete everything speedrun made in AWS, in the regions of recorded AWS jobs
    and `region` (or the AWS configuration's), after confirmation. The recorded jobs' watchers on
    controller hosts are stopped first; if one cannot be, nothing is removed (exit status 2)."""
    from speedrun.cluster import aws, registry
    from speedrun.cluster.watcher import stop_watcher

    records = [r for r in registry.load_all() if r.provider.get("kind") == "aws"]
    regions = {r.provider["config"]["region"] for r in records} | {aws.Session(region).region}
    found = [aws.find_everything(r) for r in sorted(regions)]
    lines = [line for f in found for line in f.describe()]
    if lines:
        print("this terminates and deletes, for good:")
        for line in lines:
            print(f"  {line}")
        if not yes:
            try:
                answer = input("type yes to go on: ")
            except EOFError:
                answer = ""
            if answer.strip() != "yes":
                print("nothing was removed")
                return EXIT_FAILED
    # Every watcher before anything goes: one left running would see its tasks lost and start
    # instances that no record tracks.
    left = []
    for r in records:
        stopped = stop_watcher(r, forget=True)
        if stopped is not None and not stopped.ok:
            left.append(stopped.refusal(r.name, f"nothing in AWS was removed, {DOWN_REFUSED}"))
        elif stopped is not None:
            print(f"speedrun: job {r.name}: {stopped.line}", file=sys.stderr)
    if left:
        for line in left:
            print(f"speedrun: error: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for f in found:
        aws.remove_everything(f)
    for r in records:
        registry.forget(r.name)
    print(f"speedrun has nothing left in AWS ({', '.join(sorted(regions))})")
    return 0
