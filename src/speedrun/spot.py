"""The names of a spot instance's interruption notice, shared by both sides of speedrun.

The trainer's stop requests (stopping.py) poll the notice URL; the AWS provider
(speedrun.cluster.aws) puts it in a spot job's environment under NOTICE_ENV. Both need the same
two names, and the cluster wing imports nothing from the trainer, so they live here, below both.
"""

NOTICE_ENV = "SPEEDRUN_SPOT_NOTICE_URL"  # the variable naming the URL that `speedrun train` polls
IMDS_NOTICE_URL = "http://169.254.169.254/latest/meta-data/spot/instance-action"  # EC2's instance metadata
