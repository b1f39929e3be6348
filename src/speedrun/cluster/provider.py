"""What a provider is: one class per kind of machine (`PROVIDERS` in providers.py lists them), the
one place that kind is described. The class declares

- its name (`kind`), the make_job keywords it takes (`option_names`) and launch's command-line
  options for them (`add_options`, read back by `cli_options`), and how it refuses the ones that
  do not apply (`from_args`);
- how it is saved with a job and made again (`record`, `from_record`);
- its verbs: `make_job` and `open_job` (the kind of Job its jobs are: host_provider.py's TmuxJob
  for machines speedrun reaches itself, slurm/job.py's SlurmJob for a Slurm cluster), and what
  a provider that starts machines itself (AWS) adds: what they cost (`price`, `billing`), their
  network (`network`), giving them back (`down`), and what `speedrun down --all` removes
  (`leftovers`, with `add_down_options`);
- what does not apply to it: `--recover` (`recover_refusal`), a variable a watcher elsewhere must
  not be given (`watcher_env_refusal`), a watcher on another host (`relocate`).
"""
from __future__ import annotations

import argparse
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Sequence

from speedrun.cluster.registry import JobRecord
from speedrun.cluster.ssh import SSHOptions
from speedrun.errors import SpeedrunError
from speedrun.money import Price

if TYPE_CHECKING:  # annotations only: jobs hold their provider, so job.py imports this module
    from speedrun.cluster.job import Job, JobSpec


class MachinesLeft(SpeedrunError):
    """Getting hosts failed, and the machines the provider had started for it could not be given
    back (the provider did not answer): `machines` names them. make_job then records the job, so
    that `speedrun down JOB` ends them once the provider answers again."""

    def __init__(self, message: str, machines: Sequence[str], exit_code: int):
        super().__init__(message)
        self.machines, self.exit_code = list(machines), exit_code


class NoCapacity(SpeedrunError):
    """The provider has no machine to give now (a cloud's InsufficientInstanceCapacity, no spot
    capacity in any zone tried), though it may later: recovery waits and tries again
    (`--recover-wait`); a launch says so in one line (exit 2, as before there was recovery to wait)."""


@dataclass
class Billing:
    """What a job's machines cost: one line of `speedrun ls`."""

    instance_type: str
    market: str  # "spot" or "on-demand"
    count: int  # machines running now
    uptime_s: float  # seconds since the longest-running one (re)started
    price_per_hour: float | None  # $ per hour for all running machines together; None: price unknown
    cost: float | None  # $ spent so far by the running machines since they (re)started
    price_source: str  # where the price comes from, e.g. "spot price history" or "on-demand table of 2025-06"


@dataclass(frozen=True)
class NetworkSpec:
    """What the machines' network promises, held against what `speedrun check` measures."""

    gbps: float  # nominal bandwidth of one machine's network, Gbit/s (all its cards together)
    source: str  # where that figure comes from, e.g. "p4d.24xlarge: 4 network cards x 100 Gbit/s"
    efa: bool = False  # launched with EFA interfaces: NCCL should move data over EFA, not sockets


class Leftovers(ABC):
    """What `speedrun down --all` would remove of one provider's: everything speedrun made with it
    that outlives a job (AWS: instances, EFS, VPC, key pairs), found before anything is removed."""

    where: str  # for the closing line, e.g. "AWS (us-east-1)"

    @abstractmethod
    def describe(self) -> list[str]:
        """One line per thing found, as the confirmation lists them; [] when there is nothing."""

    @abstractmethod
    def remove(self) -> None:
        """Terminate and delete all of it."""


class Provider(ABC):
    """One kind of machine (see the module's text). Made from make_job's arguments (`from_args`)
    or from the record saved with a job (`from_record`)."""

    kind: ClassVar[str]
    option_names: ClassVar[tuple[str, ...]] = ()  # make_job's keywords it takes (its config's fields)
    takes_ssh_options: ClassVar[bool] = False  # whether its hosts are reached with make_job's ssh=SSHOptions
    recover_refusal: ClassVar[str | None] = None  # why `launch --recover` does not apply; None: it does

    # --- the command line ---
    @classmethod  # noqa: B027  (a default: none)
    def add_options(cls, parser: argparse.ArgumentParser) -> None:
        """launch's options for this provider, as a group of their own (default: none). Their dest
        names are option_names: `cli_options` reads them back."""

    @classmethod
    def cli_options(cls, args: argparse.Namespace) -> dict[str, Any]:
        """make_job's keywords for the options of add_options that were given."""
        return {k: v for k in cls.option_names if (v := getattr(args, k, None)) is not None}

    @classmethod  # noqa: B027  (a default: none)
    def add_down_options(cls, parser: argparse.ArgumentParser) -> None:
        """`speedrun down`'s options for `--all` with this provider (default: none)."""

    @classmethod
    def leftovers(cls, args: argparse.Namespace, records: Sequence[JobRecord]) -> Leftovers | None:
        """For `speedrun down --all` (its parsed `args`): what speedrun made with this provider that
        outlives a job, found from the recorded jobs of this kind (`records`); None for a provider
        that makes nothing of the kind. Nothing is removed here."""
        return None

    @classmethod
    def watcher_env_refusal(cls, key: str) -> str | None:
        """Why `launch --watcher-env KEY=...` must not copy `key` to a controller host (a credential
        of this provider's, which a controller holds itself); None: it may."""
        return None

    # --- made, saved, made again ---
    @classmethod
    @abstractmethod
    def from_args(cls, job: str, hosts: Sequence[str], ssh: SSHOptions | None,
                  config_dir: str | os.PathLike | None, options: Mapping[str, Any]) -> Provider:
        """The provider for make_job's `hosts`, `ssh` and provider-specific `options` (keyword
        arguments such as instance_type); SpeedrunError for ones that do not apply."""

    @classmethod
    @abstractmethod
    def from_record(cls, record: dict[str, Any]) -> Provider:
        """The provider `record()` describes. It finds the job's machines; it never starts any, and
        host keys are checked strictly: first contact is over."""

    @abstractmethod
    def record(self) -> dict[str, Any]:
        """What from_record needs to make this provider again (JSON-able, no secrets), with "kind"."""

    # --- its jobs ---
    @abstractmethod
    def make_job(self, name: str, num_tasks: int, spec: JobSpec) -> Job:
        """Job `name` of `num_tasks` tasks on these machines: the running one found again
        (reconnected) unless spec.restart, else a new run as `spec` says (lifecycle.make_job)."""

    @abstractmethod
    def open_job(self, rec: JobRecord, *, probe: bool = True, watcher_known_hosts: str = "") -> Job:
        """The recorded job `rec` found again, to inspect, follow, attach to or kill (reopen.open_job);
        probe=False: without asking its machines anything (enough for status and kill).
        watcher_known_hosts: the host keys a watcher on a controller host pinned for them."""

    # --- what the machines are ---
    def relocate(self, home: str) -> tuple[dict[str, Any], dict[str, Path]]:
        """For a watcher on another machine (controller.py), whose speedrun home is `home` there:
        the record with that home's paths, and the local files to copy into it (path relative to
        `home` -> file here). SpeedrunError where another machine cannot reach these machines."""
        raise SpeedrunError(f"the {self.kind} provider's machines cannot be watched from another host")

    def environment(self) -> dict[str, str]:
        """Variables every launched command gets on these machines (e.g. where spot notices come)."""
        return {}

    def machine_type(self) -> str:
        """What these machines are called in a price (AWS: the instance type)."""
        return f"{self.kind} host"

    def price(self, machines: int) -> Price | None:
        """What `machines` of these cost per hour, if the provider knows (AWS); None: unknown."""
        return None

    def network(self) -> NetworkSpec | None:
        """What these machines' network promises, where the provider knows (AWS: the instance
        type's); None: unknown."""
        return None

    def billing(self) -> Billing | None:
        """What the machines cost; None for machines speedrun did not start."""
        return None

    def down(self) -> list[str]:
        """Give back (terminate) the machines this provider started for the job; what was given back.
        Nothing for machines speedrun did not start."""
        return []

    def close(self) -> None:  # noqa: B027  (a default: only providers holding connections override it)
        """Release connections."""
