"""Providers hand out the hosts a job's tasks run on.

A provider is small on purpose: `hosts(n)` returns n Hosts (the same Host may come back several
times: several tasks on one machine), and `record()` / `from_record()` turn it into JSON and back
so that `speedrun ls | logs | attach | kill | tb` can find a job's machines later. Each kind is
one class, listed once in `PROVIDERS`.

    local  this machine, every task a tmux session of its own
    ssh    given machines, `user@host[:port]`, one task per machine, through the OpenSSH client

A cloud provider (AWS is planned) starts instances and returns SSHHosts for them.
"""
from __future__ import annotations

import dataclasses
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Sequence

from speedrun.cluster import registry
from speedrun.cluster.hosts import Host, LocalHost
from speedrun.cluster.ssh import HostSpec, SSHHost, SSHOptions
from speedrun.errors import SpeedrunError


class Provider(ABC):
    """Hands out hosts. Each kind is one class in `PROVIDERS`, made from make_job's arguments
    (`from_args`) or from the record saved with a job (`from_record`)."""

    kind: str

    @classmethod
    @abstractmethod
    def from_args(cls, hosts: Sequence[str], ssh: SSHOptions | None, config_dir: str | os.PathLike | None) -> Provider:
        """The provider for make_job's `hosts` and `ssh` options; SpeedrunError for ones that do not apply."""

    @classmethod
    @abstractmethod
    def from_record(cls, record: dict[str, Any]) -> Provider:
        """The provider `record()` describes (host keys are checked strictly: first contact is over)."""

    @abstractmethod
    def hosts(self, count: int) -> list[Host]:
        """Hosts for `count` tasks, task i on the i-th."""

    @abstractmethod
    def record(self) -> dict[str, Any]:
        """What from_record needs to make this provider again (JSON-able, no secrets), with "kind"."""

    def close(self) -> None:
        """Release connections."""


class LocalProvider(Provider):
    """Every task on this machine."""

    kind = "local"

    def __init__(self) -> None:
        self._host = LocalHost()

    @classmethod
    def from_args(cls, hosts: Sequence[str], ssh: SSHOptions | None, config_dir: str | os.PathLike | None) -> LocalProvider:
        if hosts:
            raise SpeedrunError("hosts were given for the local provider: use provider='ssh' (--provider ssh)")
        if ssh is not None:
            raise SpeedrunError("ssh options were given for the local provider: use provider='ssh' (--provider ssh)")
        return cls()

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> LocalProvider:
        return cls()

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

    @classmethod
    def from_args(cls, hosts: Sequence[str], ssh: SSHOptions | None, config_dir: str | os.PathLike | None) -> SSHProvider:
        """`ssh` with its paths made absolute and checked; pinned keys in speedrun's own
        known_hosts file under `config_dir` unless it names one."""
        ssh = ssh or SSHOptions()
        if ssh.identity_file is not None and not Path(ssh.identity_file).expanduser().is_file():
            raise SpeedrunError(f"identity file {ssh.identity_file} does not exist")
        return cls(hosts, dataclasses.replace(
            ssh,
            known_hosts=_absolute(ssh.known_hosts) or registry.default_known_hosts(config_dir),
            identity_file=_absolute(ssh.identity_file),
            ssh_config=_absolute(ssh.ssh_config),
        ))

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> SSHProvider:
        options = SSHOptions(known_hosts=_absolute(record["known_hosts"]), identity_file=_absolute(record.get("identity_file")),
                             ssh_config=_absolute(record.get("ssh_config")))
        return cls(record["hosts"], options)

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


def _absolute(path: str | os.PathLike | None) -> Path | None:
    return Path(path).expanduser().resolve() if path else None


# kind -> Provider class: the one place a new provider is added.
PROVIDERS: dict[str, type[Provider]] = {p.kind: p for p in (LocalProvider, SSHProvider)}


def make_provider(provider: str | Provider, hosts: Sequence[str] = (), ssh: SSHOptions | None = None,
                  config_dir: str | os.PathLike | None = None) -> Provider:
    """A Provider from make_job's arguments (a Provider given as such is used as it is)."""
    if isinstance(provider, Provider):
        return provider
    if provider not in PROVIDERS:
        raise SpeedrunError(f"unknown provider {provider!r}: use one of {', '.join(PROVIDERS)}")
    return PROVIDERS[provider].from_args(hosts, ssh, config_dir)


def provider_from_record(record: dict[str, Any]) -> Provider:
    """The provider a job record describes."""
    kind = record.get("kind")
    if kind not in PROVIDERS:
        raise SpeedrunError(f"unknown provider {kind!r} in a job record: this speedrun knows {', '.join(PROVIDERS)}")
    return PROVIDERS[kind].from_record(record)
