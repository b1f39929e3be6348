"""The Slurm provider's settings, in this process: Slurm's time-limit formats and SlurmConfig's
refusals, each one line; the sbatch options a config asks for; Slurm's messages and a job's state as
one line; the provider's record."""
import json

import pytest

from speedrun.cluster.slurm.api import slurm_message
from speedrun.cluster.slurm.config import SlurmConfig, parse_time_limit
from speedrun.cluster.slurm.queue import SlurmJobState
from speedrun.errors import SpeedrunError


@pytest.mark.parametrize("text, seconds", [
    ("90", 5400), ("90:30", 5430), ("1:30:00", 5400), ("2-0", 172800), ("1-2:30", 95400), ("1-00:00:10", 86410),
])
def test_time_limits_in_every_format_slurm_reads(text, seconds):
    assert parse_time_limit(text) == seconds


@pytest.mark.parametrize("text", ["1:xx", "1h", "-5", "1:2:3:4", "", "2-", "0", "0:00:00"])
def test_a_malformed_or_zero_time_limit_is_one_line(text):
    with pytest.raises(SpeedrunError, match=f"time limit {text!r} ") as e:
        parse_time_limit(text)
    assert "\n" not in str(e.value)


def test_config_refusals_say_what_to_give():
    with pytest.raises(SpeedrunError, match=r"time limit 2 \(120 s\) leaves no time before its warning signal"):
        SlurmConfig(time="2")
    assert SlurmConfig(time="2", signal_lead_s=30).time == "2"
    with pytest.raises(SpeedrunError, match=r"gpus_per_node must be a whole number in 1\.\.64, got 0"):
        SlurmConfig(gpus_per_node=0)
    with pytest.raises(SpeedrunError, match="sbatch_args is a list of options"):
        SlurmConfig(sbatch_args="--exclusive")
    with pytest.raises(SpeedrunError, match=r"unknown option instance_type for the slurm provider \(its options: "):
        SlurmConfig.from_options({"instance_type": "p5.48xlarge"})


def test_the_sbatch_options_are_the_ones_given():
    config = SlurmConfig.from_options({"partition": "gpu", "gpus_per_node": 8, "time": "2:00:00", "account": "lab",
                                       "sbatch_args": ["--exclusive"]})
    assert config.sbatch_options() == ["--partition=gpu", "--gpus-per-node=8", "--time=2:00:00", "--account=lab",
                                       "--exclusive"]
    assert SlurmConfig().sbatch_options() == []


def test_slurm_messages_become_one_line_without_the_program_prefix():
    assert slurm_message("sbatch: error: invalid partition specified: x\n"
                         "allocation failure: Invalid partition name specified\n") == (
        "invalid partition specified: x; allocation failure: Invalid partition name specified")
    assert slurm_message("") == "no message"


def test_the_provider_comes_back_from_its_record_and_refuses_what_does_not_apply():
    from speedrun.cluster.providers import make_provider, provider_from_record

    provider = make_provider("slurm", "j", options={"partition": "gpu", "sbatch_args": ["--exclusive"],
                                                    "time": "1:00:00"})
    again = provider_from_record(json.loads(json.dumps(provider.record())))
    assert again.config == provider.config and again.config.sbatch_args == ("--exclusive",)
    with pytest.raises(SpeedrunError, match="^hosts were given for the slurm provider: Slurm chooses the nodes"):
        make_provider("slurm", "j", hosts=["a"])
    with pytest.raises(SpeedrunError, match=r"^partition does not apply to the ssh provider: it is an option of "
                                            r"provider='slurm' \(--provider slurm\)"):
        make_provider("ssh", "j", hosts=["a"], options={"partition": "gpu"})
    with pytest.raises(SpeedrunError, match="^unknown option instance for the slurm provider"):
        make_provider("slurm", "j", options={"instance": "x"})


@pytest.mark.parametrize("state, line", [
    (SlurmJobState("7", "PENDING", "Resources", 0, 0, 0, ""), "slurm job 7: PENDING (Resources)"),
    (SlurmJobState("7", "RUNNING", "None", 0, 0, 1, "node[1-2]"),
     "slurm job 7: RUNNING on node[1-2], requeued 1 time"),
    (SlurmJobState("7", "FAILED", "NonZeroExitCode", 1, 0, 3, "node[1-2]"),
     "slurm job 7: FAILED, exit 1, requeued 3 times"),
    (SlurmJobState("7", "CANCELLED", "None", 0, 15, 0, "node1"), "slurm job 7: CANCELLED, exit 0 (signal 15)"),
    (SlurmJobState("7", "COMPLETED", "None", 0, 0, 0, "node1"), "slurm job 7: COMPLETED"),
])
def test_slurms_state_of_a_job_is_one_line(state, line):
    assert state.describe() == line

