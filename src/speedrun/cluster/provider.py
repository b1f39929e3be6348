"""What a provider is: the small interface every kind of machine sits behind.

A provider hands out the hosts a job's tasks run on. `hosts(n)` returns n Hosts (the same Host may
come back several times: several tasks on one machine), and `record()` / `from_record()` turn it
into JSON and back so that `speedrun ls | logs | attach | kill | down` can find a job's machines
later. A provider that starts machines itself (AWS) also says what they cost (`billing`), gives
them back (`down`) and may bring storage every host sees (`run_root`).

The kinds there are, and the registry that names them, are in providers.py.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from speedrun.cluster.hosts import Host
from speedrun.cluster.ssh import SSHOptions
from speedrun.errors import SpeedrunError
from speedrun.money import Price


class MachinesLeft(SpeedrunError):
    """Getting hosts failed, and the machines the provider had started for it could not be given
    back (the provider did not answer): `machines` names them. make_job then records the job, so
    that `speedrun down JOB` ends them once the provider answers again."""

    def __init__(self, message: str, machines: Sequence[str], exit_code: int):
        super().__init__(message)
        self.machines, self.exit_code = list(machines), exit_code


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


class Provider(ABC):
    """Hands out hosts. Each kind is one class in providers.PROVIDERS, made from make_job's arguments
    (`from_args`) or from the record saved with a job (`from_record`)."""

    kind: str

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
    def hosts(self, count: int) -> list[Host]:
        """Hosts for `count` tasks, task i on the i-th."""

    @abstractmethod
    def record(self) -> dict[str, Any]:
        """What from_record needs to make this provider again (JSON-able, no secrets), with "kind"."""

    @property
    def run_root(self) -> str | None:
        """Where run directories go by default on storage every host sees (EFS...); None: none."""
        return None

    def relocate(self, home: str) -> tuple[dict[str, Any], dict[str, Path]]:
        """For a watcher on another machine (controller.py), whose speedrun home is `home` there:
        the record with that home's paths, and the local files to copy into it (path relative to
        `home` -> file here). SpeedrunError where another machine cannot reach these hosts."""
        raise SpeedrunError(f"the {self.kind} provider's machines cannot be watched from another host: "
                            f"--watcher-host needs --provider ssh or aws")

    def replace(self, index: int, count: int) -> Host:
        """A host to take over task `index` (of `count`) from one that was lost (recovery)."""
        raise SpeedrunError(f"the {self.kind} provider has no machine to put in place of a lost one")

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
