"""Providers hand out the hosts a job's tasks run on.

A provider is small on purpose: `hosts(n)` returns n Hosts (the same Host may come back several
times: several tasks on one machine), and `record()` / `provider_from_record()` turn it into JSON
and back so that `speedrun ls | logs | attach | kill | tb` can find a job's machines later.

    local  this machine, every task a tmux session of its own
    ssh    given machines, `user@host[:port]`, one task per machine, through the OpenSSH client

A cloud provider (AWS is planned) starts instances and returns SSHHosts for them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Sequence

from speedrun.cluster.hosts import Host, LocalHost
from speedrun.cluster.ssh import HostSpec, SSHHost, SSHOptions
from speedrun.errors import SpeedrunError


class Provider(ABC):
    kind: str

    @abstractmethod
    def hosts(self, count: int) -> list[Host]:
        """Hosts for `count` tasks, task i on the i-th."""

    @abstractmethod
    def record(self) -> dict[str, Any]:
        """What provider_from_record needs to make this provider again (JSON-able, no secrets)."""

    def close(self) -> None:
        """Release connections."""


class LocalProvider(Provider):
    """Every task on this machine."""

    kind = "local"

    def __init__(self) -> None:
        self._host = LocalHost()

    def hosts(self, count: int) -> list[Host]:
        return [self._host] * count

    def record(self) -> dict[str, Any]:
        return {"kind": self.kind}


class SSHProvider(Provider):
    """Machines you already have, reached with ssh; task i runs on hosts[i]."""

    kind = "ssh"

    def __init__(self, hosts: Sequence[str], options: SSHOptions):
        if not hosts:
            raise SpeedrunError("the ssh provider needs hosts: pass hosts=[...] (--hosts user@host,...)")
        specs = [HostSpec.parse(h) for h in hosts]
        if len({str(s) for s in specs}) != len(specs):
            raise SpeedrunError(f"a host is listed twice in {', '.join(hosts)}: the ssh provider runs one task per host")
        self.options = options
        self._hosts = [SSHHost(s, options) for s in specs]

    def hosts(self, count: int) -> list[Host]:
        if count > len(self._hosts):
            raise SpeedrunError(f"{count} tasks need {count} hosts, but {len(self._hosts)} were given "
                                f"(the ssh provider runs one task per host)")
        return list(self._hosts[:count])

    def record(self) -> dict[str, Any]:
        o = self.options
        return {
            "kind": self.kind, "hosts": [h.name for h in self._hosts], "known_hosts": str(o.known_hosts),
            "identity_file": str(o.identity_file) if o.identity_file else None,
            "ssh_config": str(o.ssh_config) if o.ssh_config else None,
        }

    def close(self) -> None:
        for h in self._hosts:
            h.close()


def provider_from_record(record: dict[str, Any]) -> Provider:
    """The provider a job record describes (host keys are checked strictly: first contact is over)."""
    kind = record.get("kind")
    if kind == "local":
        return LocalProvider()
    if kind == "ssh":
        def path(key: str) -> Path | None:
            return Path(record[key]) if record.get(key) else None
        return SSHProvider(record["hosts"], SSHOptions(known_hosts=Path(record["known_hosts"]),
                                                       identity_file=path("identity_file"),
                                                       ssh_config=path("ssh_config")))
    raise SpeedrunError(f"unknown provider {kind!r} in a job record: this speedrun knows local and ssh")
