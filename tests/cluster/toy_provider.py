"""A provider from outside speedrun, in one module, as another package would add one
(tests/cluster/test_providers.py registers it through the `speedrun.providers` entry point).

Its machines are this one; what makes it its own is an option (`--toy-label`, make_job's
`toy_label=`) that every command it runs sees as TOY_LABEL, a check of that option, and its name
in a price. Everything else, the job kind and its verbs, it takes from HostProvider.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Mapping, Sequence

from speedrun.cluster.host_provider import HostProvider
from speedrun.cluster.hosts import Host, LocalHost
from speedrun.cluster.ssh import SSHOptions
from speedrun.errors import SpeedrunError


class ToyProvider(HostProvider):
    """Every task on this machine, with a label in its environment."""

    kind = "toy"
    option_names = ("toy_label",)

    def __init__(self, label: str):
        self.label = label

    @classmethod
    def add_options(cls, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("toy (tests/cluster/toy_provider.py)")
        g.add_argument("--toy-label", help="what every command sees as TOY_LABEL")

    @classmethod
    def from_args(cls, job: str, hosts: Sequence[str], ssh: SSHOptions | None,
                  config_dir: str | os.PathLike | None, options: Mapping[str, Any]) -> ToyProvider:
        if hosts or ssh is not None:
            raise SpeedrunError("the toy provider runs on this machine: it takes no hosts or ssh options")
        unknown = sorted(set(options) - set(cls.option_names))
        if unknown:
            raise SpeedrunError(f"unknown option(s) for the toy provider: {', '.join(unknown)}")
        label = options.get("toy_label", "toy")
        if not label.isalnum():
            raise SpeedrunError(f"toy_label {label!r}: letters and digits only")
        return cls(label)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> ToyProvider:
        return cls(record["label"])

    def record(self) -> dict[str, Any]:
        return {"kind": self.kind, "label": self.label}

    def hosts(self, count: int) -> list[Host]:
        return [LocalHost()] * count

    def environment(self) -> dict[str, str]:
        return {"TOY_LABEL": self.label}

    def machine_type(self) -> str:
        return f"toy machine ({self.label})"
