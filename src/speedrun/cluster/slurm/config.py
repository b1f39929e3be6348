"""The Slurm provider's settings: SlurmConfig (make_job's options for provider="slurm", the CLI's
`--partition`, `--gpus-per-node`, `--time`...) and Slurm's time-limit format."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from speedrun.errors import SpeedrunError
from speedrun.inputs import Bound

GPUS_PER_NODE = Bound(int, 1, 64)
CPUS_PER_TASK = Bound(int, 1, 4096)
SIGNAL_LEAD_S = Bound(int, 1, 65_535)  # Slurm's --signal takes at most 65535 s
MAX_REQUEUES = Bound(int, 0, 1000)

# Slurm's time limits (sbatch --time): minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds.
_TIME = re.compile(r"(?:(?P<days>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
                   r"|(?P<a>\d+)(?::(?P<b>\d+)(?::(?P<c>\d+))?)?)")


def parse_time_limit(text: str) -> int:
    """Seconds in a Slurm time limit ("90", "1:30:00", "2-00:00:00"...); SpeedrunError for one that
    is malformed or zero. Slurm's own formats, so that what is given is what sbatch gets."""
    m = _TIME.fullmatch(text.strip())
    if m is None:
        raise SpeedrunError(f"time limit {text!r} is not one Slurm reads: give minutes (90), hours:minutes:seconds "
                            f"(1:30:00) or days-hours[:minutes[:seconds]] (2-00:00:00)")
    g = {k: int(v) for k, v in m.groupdict().items() if v is not None}
    if "days" in g:
        seconds = ((g["days"] * 24 + g["dh"]) * 60 + g.get("dm", 0)) * 60 + g.get("ds", 0)
    elif "c" in g:  # hours:minutes:seconds
        seconds = (g["a"] * 60 + g["b"]) * 60 + g["c"]
    else:  # minutes[:seconds]
        seconds = g["a"] * 60 + g.get("b", 0)
    if seconds <= 0:
        raise SpeedrunError(f"time limit {text!r} is zero: give the job some time")
    return seconds


@dataclass(frozen=True)
class SlurmConfig:
    """make_job's options for provider="slurm"; each is the sbatch option of the same name, left to
    the cluster's defaults when None.

    partition: the partition (queue) to run in.
    gpus_per_node: GPUs on each node (--gpus-per-node); torchrun starts that many processes per
        node unless launch says otherwise.
    cpus_per_task: CPUs for each node's one task (speedrun runs one torchrun per node).
    time: the job's time limit in Slurm's format ("2:00:00"); it gets `signal_lead_s` seconds of
        warning to stop at a step and be requeued.
    account, qos, constraint: as sbatch takes them.
    sbatch_args: further sbatch options, verbatim (["--exclusive", "--mem=0"]).
    signal_lead_s: seconds before the time limit at which Slurm sends the warning signal that stops
        the run with a checkpoint (Slurm sends it up to a minute early: docs/slurm.md).
    max_requeues: how many times a stopped run is requeued before the job is left stopped.
    """

    partition: str | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    time: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    sbatch_args: tuple[str, ...] = field(default_factory=tuple)
    signal_lead_s: int = 120
    max_requeues: int = 3

    def __post_init__(self) -> None:
        if self.time is not None:
            limit = parse_time_limit(self.time)
            if limit <= self.signal_lead_s:
                raise SpeedrunError(f"time limit {self.time} ({limit} s) leaves no time before its warning signal, "
                                    f"{self.signal_lead_s} s before the end: give more time or a smaller "
                                    f"signal_lead_s")
        for name, bound in (("gpus_per_node", GPUS_PER_NODE), ("cpus_per_task", CPUS_PER_TASK),
                            ("signal_lead_s", SIGNAL_LEAD_S), ("max_requeues", MAX_REQUEUES)):
            value = getattr(self, name)
            if value is not None and not bound.holds(value):
                raise SpeedrunError(f"{name} must be {bound}, got {value!r}")
        if isinstance(self.sbatch_args, str):
            raise SpeedrunError("sbatch_args is a list of options (['--exclusive']), not one string")
        object.__setattr__(self, "sbatch_args", tuple(self.sbatch_args))

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> SlurmConfig:
        """The config for make_job's keyword options; SpeedrunError naming any it does not take."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise SpeedrunError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} for the "
                                f"slurm provider (its options: {', '.join(sorted(known))})")
        return cls(**options)

    def sbatch_options(self) -> list[str]:
        """The sbatch options these settings ask for (the job's node count aside)."""
        given = {"--partition": self.partition, "--gpus-per-node": self.gpus_per_node,
                 "--cpus-per-task": self.cpus_per_task, "--time": self.time, "--account": self.account,
                 "--qos": self.qos, "--constraint": self.constraint}
        return [f"{k}={v}" for k, v in given.items() if v is not None] + list(self.sbatch_args)
