"""The kinds of provider (see provider.py for what a provider is), listed once in `PROVIDERS`.

    local  this machine, every task a tmux session of its own
    ssh    given machines, `user@host[:port]`, one task per machine, through the OpenSSH client
    aws    EC2 instances speedrun starts itself (the aws package), reached as SSH hosts
    slurm  a Slurm cluster's nodes, one Slurm job per speedrun job (the slurm package)

Another package adds a provider without changing speedrun: an entry point in the group
`speedrun.providers` naming its Provider class (pyproject.toml:
`[project.entry-points."speedrun.providers"] mine = "my_package.provider:MyProvider"`), listed in
`PROVIDERS` after these. docs/architecture.md ("Changing speedrun") says what such a class declares.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence

from speedrun.cluster import registry
from speedrun.cluster.aws import AWSProvider
from speedrun.cluster.host_provider import HostProvider
from speedrun.cluster.hosts import Host, LocalHost
from speedrun.cluster.provider import Provider
from speedrun.cluster.slurm import SlurmProvider
from speedrun.cluster.ssh import HostSpec, SSHHost, SSHOptions
from speedrun.errors import SpeedrunError, one_line


class LocalProvider(HostProvider):
    """Every task on this machine."""

    kind = "local"

    def __init__(self) -> None:
        self._host = LocalHost()

    @classmethod
    def from_args(cls, job: str, hosts: Sequence[str], ssh: SSHOptions | None,
                  config_dir: str | os.PathLike | None, options: Mapping[str, Any]) -> LocalProvider:
        check_no_options(cls.kind, options)
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


class SSHProvider(HostProvider):
    """Machines you already have, reached with ssh; task i runs on hosts[i]."""

    kind = "ssh"
    option_names = tuple(f.name for f in dataclasses.fields(SSHOptions))
    takes_ssh_options = True

    @classmethod
    def cli_options(cls, args: argparse.Namespace) -> dict[str, Any]:
        return {}  # launch's ssh options reach every provider that takes them as make_job's ssh=SSHOptions

    def __init__(self, hosts: Sequence[str], options: SSHOptions):
        if not hosts:
            raise SpeedrunError("the ssh provider needs hosts: pass hosts=[...] (--hosts user@host,...)")
        specs = [HostSpec.parse(h) for h in hosts]
        if len({str(s) for s in specs}) != len(specs):
            raise SpeedrunError(f"a host is listed twice in {', '.join(hosts)}: "
                                "the ssh provider runs one task per host")
        self.options = options
        self._hosts = [SSHHost(s, options) for s in specs]

    @classmethod
    def from_args(cls, job: str, hosts: Sequence[str], ssh: SSHOptions | None,
                  config_dir: str | os.PathLike | None, options: Mapping[str, Any]) -> SSHProvider:
        """`ssh` with its paths made absolute and checked; pinned keys in speedrun's own
        known_hosts file under `config_dir` unless it names one. SSHOptions' fields may also come
        as make_job's own keywords (`identity_file=...`, as earlier releases took them)."""
        given = {k: v for k, v in options.items() if k in SSH_OPTIONS}
        check_no_options(cls.kind, {k: v for k, v in options.items() if k not in SSH_OPTIONS})
        ssh = ssh or SSHOptions()
        for k in sorted(given):
            if getattr(ssh, k) != getattr(SSHOptions(), k):
                raise SpeedrunError(f"{k} was given twice, as {k}= and in ssh=SSHOptions(...): give it once")
        ssh = dataclasses.replace(ssh, **given)
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
        options = SSHOptions(known_hosts=_absolute(record["known_hosts"]),
                             identity_file=_absolute(record.get("identity_file")),
                             ssh_config=_absolute(record.get("ssh_config")))
        return cls(record["hosts"], options)

    def hosts(self, count: int) -> list[Host]:
        if count > len(self._hosts):
            raise SpeedrunError(f"{count} tasks need {count} hosts, but {len(self._hosts)} were given "
                                f"(the ssh provider runs one task per host)")
        return list(self._hosts[:count])

    def replace(self, index: int, count: int) -> Host:
        """The first spare (hosts listed beyond the tasks) takes task `index`'s place; the lost host
        leaves the list."""
        if len(self._hosts) <= count:
            raise SpeedrunError(f"no spare host is left to replace task {index}'s: list more hosts than tasks "
                                f"(the extra ones are spares)")
        self._hosts[index] = self._hosts.pop(count)
        return self._hosts[index]

    def relocate(self, home: str) -> tuple[dict[str, Any], dict[str, Path]]:
        """The key, pinned host keys and ssh config go to `home` (the watcher reaches the hosts as
        this machine does, without the agent or ~/.ssh of this machine)."""
        o = self.options
        if o.identity_file is None:
            raise SpeedrunError("a watcher on another host reaches the job's hosts with a key copied there: "
                                "give it with --identity (SSHOptions(identity_file=...))")
        files = {"known_hosts": o.known_hosts, "keys/identity": o.identity_file}
        if o.ssh_config is not None:
            files["ssh_config"] = o.ssh_config
        record = {**self.record(), "known_hosts": f"{home}/known_hosts", "identity_file": f"{home}/keys/identity",
                  "ssh_config": f"{home}/ssh_config" if o.ssh_config is not None else None}
        return record, files

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


# make_job's keywords that the ssh provider takes as its SSHOptions (identity_file=..., ...).
SSH_OPTIONS = SSHProvider.option_names


def check_no_options(kind: str, options: Mapping[str, Any]) -> None:
    """SpeedrunError for options given to a provider that does not take them (`kind`: the
    provider's, or "given" for a Provider object), saying where each belongs (the provider whose
    option_names hold it); any other is unknown."""
    if not options:
        return
    for owner, cls in PROVIDERS.items():
        names = sorted(k for k in options if k in cls.option_names)
        if names and owner != kind:
            it = "it is an option" if len(names) == 1 else "they are options"
            raise SpeedrunError(f"{', '.join(names)} {'does' if len(names) == 1 else 'do'} not apply to the {kind} "
                                f"provider: {it} of provider='{owner}' (--provider {owner})")
    unknown = sorted(options)
    own = PROVIDERS[kind].option_names if kind in PROVIDERS else ()
    takes = f"its options: {', '.join(own)}" if own else "it takes none"
    raise SpeedrunError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} for the {kind} "
                        f"provider ({takes})")


def _absolute(path: str | os.PathLike | None) -> Path | None:
    return Path(path).expanduser().resolve() if path else None


def plugins(taken: Collection[str]) -> tuple[list[type[Provider]], dict[str, str]]:
    """The providers other packages add (entry points in ENTRY_POINTS, each a Provider class whose
    kind is the entry point's name, not one of `taken`), and for each that cannot be used, why (its
    name -> one line): such a plugin is left out, and naming it says why, rather than every speedrun
    command failing."""
    found, broken = [], {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINTS):
        what = f"the provider plugin {ep.name} ({ep.value})"
        if ep.name in taken:
            broken[ep.name] = f"{what} is left out: speedrun has a provider of that name"
            continue
        try:
            cls = ep.load()
        except Exception as e:  # noqa: BLE001 - any failure of another package's code: it is left out
            broken[ep.name] = f"{what} cannot be loaded: {one_line(e)}"
            continue
        if not (isinstance(cls, type) and issubclass(cls, Provider)) or getattr(cls, "kind", None) != ep.name:
            broken[ep.name] = f"{what} is not a Provider class whose kind is {ep.name!r}"
            continue
        found.append(cls)
    return found, broken


ENTRY_POINTS = "speedrun.providers"
BUILTIN: tuple[type[Provider], ...] = (LocalProvider, SSHProvider, AWSProvider, SlurmProvider)
_PLUGINS, UNLOADABLE = plugins({p.kind for p in BUILTIN})
# kind -> Provider class: the one list of providers, this package's then the plugins'.
PROVIDERS: dict[str, type[Provider]] = {p.kind: p for p in (*BUILTIN, *_PLUGINS)}


DEFAULT_KIND = LocalProvider.kind  # make_job's provider when none is named
DEFAULT_PROVIDER = "ssh when --hosts is given, else local"  # launch's, as its --help says


def default_provider(hosts: Sequence[str]) -> str:
    """The provider launch uses when none is named (DEFAULT_PROVIDER says it)."""
    return SSHProvider.kind if hosts else DEFAULT_KIND


def make_provider(provider: str | Provider, job: str, hosts: Sequence[str] = (), ssh: SSHOptions | None = None,
                  config_dir: str | os.PathLike | None = None, options: Mapping[str, Any] | None = None) -> Provider:
    """A Provider from make_job's arguments (a Provider given as such is used as it is)."""
    if isinstance(provider, Provider):
        check_no_options("given", options or {})
        return provider
    if provider not in PROVIDERS and provider in UNLOADABLE:
        raise SpeedrunError(UNLOADABLE[provider])
    if provider not in PROVIDERS:
        raise SpeedrunError(f"unknown provider {provider!r}: use one of {', '.join(PROVIDERS)}")
    return PROVIDERS[provider].from_args(job, hosts, ssh, config_dir, options or {})


def provider_from_record(record: dict[str, Any], path: Path | None = None) -> Provider:
    """The provider a job record (in file `path`, named in errors) describes; SpeedrunError if the
    record's provider part is not one this speedrun can read."""
    where = f"the job record {path}" if path is not None else "a job record"
    kind = record.get("kind")
    if kind not in PROVIDERS:
        why = f" ({UNLOADABLE[kind]})" if kind in UNLOADABLE else ""
        raise SpeedrunError(f"unknown provider {kind!r} in {where}: this speedrun knows {', '.join(PROVIDERS)}{why}")
    try:
        return PROVIDERS[kind].from_record(record)
    except (KeyError, TypeError, ValueError) as e:
        why = f"its {kind} provider: {one_line(e)}"
        if path is not None:
            raise registry.damaged(path, why) from None
        raise SpeedrunError(f"a job record is damaged ({why})") from None
