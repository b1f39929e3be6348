"""The aws provider on the command line (AWSProvider declares them): launch's options
(`add_aws_options`, AWSConfig's fields), `speedrun down --all`'s (`add_down_options`), and the AWS
credentials `--watcher-env` refuses to copy to a controller (`is_aws_secret`)."""
from __future__ import annotations

import argparse

from speedrun.cluster.aws.config import AUTOSTOP_MIN, DISK_GB
from speedrun.inputs import given

def add_aws_options(p: argparse.ArgumentParser) -> None:
    """launch's options for the aws provider (AWSConfig's fields, each under its own name; default
    None: AWSConfig's own default), as a group of their own."""
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


def add_down_options(p: argparse.ArgumentParser) -> None:
    """`speedrun down --all`'s options for AWS."""
    p.add_argument("--region", type=given,
                   help="with --all: this AWS region too (default: the regions of recorded jobs and "
                        "the AWS configuration's)")
