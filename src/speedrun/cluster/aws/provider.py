"""AWSProvider: the AWS provider as make_job and the CLI see it (speedrun.cluster.provider's
interface), composing the package's steps: find the job's instances or make the region's resources
and launch them, reach and prepare them, replace one, bill and end them."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from speedrun.cluster import registry
from speedrun.cluster.aws.api import Session
from speedrun.cluster.aws.config import GROUP_TAG, AWSConfig, placement_group_name, tag_value
from speedrun.cluster.aws.efa import (TypeNetwork, attach_public_addresses, efa_environment, needs_elastic_ip,
                                      release_addresses, type_network, wants_efa)
from speedrun.cluster.aws.instances import (forget_host_key, instance_host, instances_by_task, job_hosts, job_instances,
                                            launch, start_stopped, tagged_instances, terminate, wait_for_ssh,
                                            wait_running)
from speedrun.cluster.aws.pricing import job_billing
from speedrun.cluster.aws.resources import (Network, caller_cidr, delete_placement_group, ensure_efs, ensure_key_pair,
                                            ensure_network, ensure_placement_group, ensure_rules, ensure_subnet,
                                            find_image, key_path)
from speedrun.cluster.aws.scripts import prepare_host
from speedrun.cluster.aws.options import add_aws_options, add_down_options, is_aws_secret
from speedrun.cluster.aws.teardown import AWSLeftovers
from speedrun.cluster.host_provider import HostProvider
from speedrun.cluster.hosts import Host
from speedrun.cluster.provider import Billing, MachinesLeft, NetworkSpec
from speedrun.cluster.registry import JobRecord
from speedrun.money import Price
from speedrun.cluster.ssh import SSHHost, SSHOptions
from speedrun.cluster.utils import parallel
from speedrun.errors import EXIT_BAD_INPUT, SpeedrunError
from speedrun.spot import IMDS_NOTICE_URL, NOTICE_ENV

log = logging.getLogger("speedrun.cluster")


class AWSProvider(HostProvider):
    """EC2 instances for one job; see the package docstring (speedrun.cluster.aws). It composes the
    package's steps: resources.py's, instances.py's, scripts.py's and pricing.py's."""

    kind = "aws"
    option_names = tuple(f.name for f in dataclasses.fields(AWSConfig))

    @classmethod
    def add_options(cls, parser: argparse.ArgumentParser) -> None:
        add_aws_options(parser)

    @classmethod
    def add_down_options(cls, parser: argparse.ArgumentParser) -> None:
        add_down_options(parser)

    @classmethod
    def leftovers(cls, args: argparse.Namespace, records: Sequence[JobRecord]) -> AWSLeftovers:
        """Everything speedrun made in AWS, in the regions of the recorded AWS jobs (`records`) and
        --region (or the AWS configuration's)."""
        regions = {r.provider["config"]["region"] for r in records} | {Session(args.region).region}
        return AWSLeftovers.find(sorted(regions))

    @classmethod
    def watcher_env_refusal(cls, key: str) -> str | None:
        if not is_aws_secret(key):
            return None
        return ("speedrun does not copy AWS credentials to the controller; give it its own (an instance role, or "
                "~/.aws there; AWS_SHARED_CREDENTIALS_FILE=PATH names a credentials file on it)")

    def __init__(self, job: str, config: AWSConfig, config_dir: str | os.PathLike | None, *, launch: bool):
        self.job, self.config, self.launch = job, config, launch
        self.config_dir = str(registry.speedrun_home(config_dir))
        self._session: Session | None = None
        self._hosts: list[Host] = []
        # The job's placement group, when it has one (recorded: `down` asks for no group otherwise).
        self.group: str | None = self.placement_group_name if config.placement_group else None

    @classmethod
    def from_args(cls, job: str, hosts: Sequence[str], ssh: SSHOptions | None,
                  config_dir: str | os.PathLike | None, options: Mapping[str, Any]) -> AWSProvider:
        if hosts:
            raise SpeedrunError("hosts were given for the aws provider, which starts its own: use provider='ssh'")
        if ssh is not None:
            raise SpeedrunError("ssh options do not apply to the aws provider: it makes its own key and pins host keys")
        known = {f.name for f in dataclasses.fields(AWSConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise SpeedrunError(f"unknown option(s) for provider='aws': {', '.join(unknown)} "
                                f"(known: {', '.join(sorted(known))})")
        return cls(job, AWSConfig(**options), config_dir, launch=True)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> AWSProvider:
        # A record written before ssh_cidr had a bound: its rule is in AWS already, and down must work.
        # One written before EFA: its instances have one ordinary interface, and replacements match them.
        config = AWSConfig(**{"ssh_cidr_allow_wide": True, "efa": "off", **record["config"]})
        provider = cls(record["job"], config, record["config_dir"], launch=False)
        provider.group = record.get("placement_group", provider.group)
        return provider

    def record(self) -> dict[str, Any]:
        config = dataclasses.replace(self.config, region=self.session.region)
        return {"kind": self.kind, "job": self.job, "config": dataclasses.asdict(config), "config_dir": self.config_dir,
                "placement_group": self.group}

    @property
    def session(self) -> Session:
        if self._session is None:
            self._session = Session(self.config.region)
        return self._session

    @property
    def run_root(self) -> str | None:
        return f"{self.config.efs_mount}/runs" if self.config.shared_storage else None

    @property
    def known_hosts(self) -> Path:
        return registry.default_known_hosts(self.config_dir)

    @property
    def placement_group_name(self) -> str:
        return placement_group_name(self.job)

    def hosts(self, count: int) -> list[Host]:
        if self._hosts and len(self._hosts) >= count:
            return self._hosts[:count]
        self._hosts = self.bring_up(count) if self.launch else self.find(count)
        return self._hosts[:count]

    # --- finding ---
    def find(self, count: int) -> list[Host]:
        """Hosts for the job's instances as they are; a missing or stopped one is an AbsentHost."""
        return job_hosts(self.job, job_instances(self.session, self.job), count,
                         lambda inst: self.ssh_host(inst, first_contact=False))

    def ssh_host(self, inst: dict[str, Any], *, first_contact: bool) -> SSHHost:
        return instance_host(inst, self.config, self.known_hosts, key_path(self.session.region, self.config_dir),
                             first_contact=first_contact)

    # --- the network ---
    def efa(self) -> TypeNetwork | None:
        """The instance type's network when the job's instances use EFA (config.efa; see efa.py),
        else None. SpeedrunError for efa="on" and a type without it."""
        net = type_network(self.session, self.config.instance_type) if self.config.efa != "off" else None
        return net if net is not None and wants_efa(self.config, net) else None

    def network(self) -> NetworkSpec | None:
        net = type_network(self.session, self.config.instance_type)
        return NetworkSpec(net.gbps, net.source, efa=self.efa() is not None) if net.gbps else None

    # --- bringing up ---
    def bring_up(self, count: int, *, other_zones: bool = False) -> list[Host]:
        """The job's `count` instances running and answering SSH, prepared; launched where missing:
        in the job's zone(s), and with other_zones (a replacement) then the region's other zones in
        name order, unless `zone` pins one."""
        s, c = self.session, self.config
        tagged = tagged_instances(s, self.job)
        found = instances_by_task(tagged)
        before = {i["InstanceId"] for i in tagged}  # after a failure, the others this launch started
        efa = self.efa()  # asked before anything is made: --efa on for a type without it makes nothing
        if any(tag_value(i, GROUP_TAG) or i["Placement"].get("GroupName") == self.placement_group_name
               for i in found.values()):
            self.group = self.placement_group_name  # launched into it earlier, whatever this launch says
        by_task = {i: inst for i, inst in found.items() if i < count}
        existing = len(by_task)
        fresh: set[str] = set()  # instances whose host keys are learned now (launched or started)
        stopped = [inst["InstanceId"] for inst in by_task.values() if inst["State"]["Name"] in ("stopping", "stopped")]
        started: list[str] = []
        if stopped:
            log.info("starting the stopped instance(s) of job %s: %s", self.job, ", ".join(stopped))
            start_stopped(s, stopped)
            started, fresh = stopped, set(stopped)
        missing = [i for i in range(count) if i not in by_task]
        launched: list[str] = []
        try:
            net = ensure_network(s, c.vpc_cidr)
            ensure_rules(s, net.security_group, c.ssh_cidr or (c.vpc_cidr if c.private_ips else caller_cidr()))
            key_name, _ = ensure_key_pair(s, self.config_dir)
            if missing:
                zones = sorted({inst["Placement"]["AvailabilityZone"] for inst in by_task.values()})
                order = zones or ([c.zone] if c.zone else s.zones())
                if other_zones and not c.zone:
                    order += [z for z in s.zones() if z not in order]
                # The group's zone: that of an instance in it, by its tag or, for instances launched
                # before the tag existed, by the group AWS reports for them.
                group_zone = next((inst["Placement"]["AvailabilityZone"] for inst in by_task.values()
                                   if tag_value(inst, GROUP_TAG)
                                   or inst["Placement"].get("GroupName") == self.placement_group_name), None)
                new = self.launch_instances(missing, order, net, key_name, group_zone, launched, efa)
                by_task.update(zip(missing, new))
                fresh |= set(launched)
            ids = [by_task[i]["InstanceId"] for i in range(count)]
            instances = wait_running(s, ids)
            if efa is not None and needs_elastic_ip(efa, public=not c.private_ips) and \
                    any(not inst.get("PublicIpAddress") for inst in instances):
                attach_public_addresses(s, self.job, instances)  # those that have none
                instances = wait_running(s, ids)  # described again, with their addresses
            hosts = [self.ssh_host(inst, first_contact=inst["InstanceId"] in fresh) for inst in instances]
            for inst, host in zip(instances, hosts):
                if inst["InstanceId"] in fresh:
                    # a key left from an earlier tenant of the address
                    forget_host_key(self.known_hosts, host.spec.host)
            parallel(lambda h: wait_for_ssh(h, c.boot_timeout), hosts)
            # A host mounts EFS through the mount target of its own zone (a replacement may be elsewhere).
            zones = {inst["Placement"]["AvailabilityZone"] for inst in instances}
            efs = {z: ensure_efs(s, ensure_subnet(s, net, z), net.security_group) for z in sorted(zones)} \
                if c.shared_storage else {}
            parallel(lambda pair: prepare_host(pair[1], pair[0], c, efs.get(pair[0]["Placement"]["AvailabilityZone"]),
                                               efa=efa is not None),
                     list(zip(instances, hosts)))
            return hosts
        except BaseException as e:
            if missing:  # also those AWS started before it could answer (an interruption in between)
                launched += [i for i in self.instance_ids_or_none() if i not in before and i not in launched]
            if started and not launched:
                raise
            raise self.undo(launched, e, job_had_instances=existing > 0, tasks=missing) from e

    def instance_ids_or_none(self) -> list[str]:
        """The job's live instances, or none when AWS does not answer (the error at hand says why)."""
        try:
            return [i["InstanceId"] for i in tagged_instances(self.session, self.job)]
        except SpeedrunError:
            return []

    def undo(self, launched: list[str], error: BaseException, *, job_had_instances: bool,
             tasks: Sequence[int] = ()) -> BaseException:
        """Terminate the instances this launch started after `error` (a failure, or an interruption:
        Ctrl-C, SIGTERM, SIGHUP), for these `tasks` (and their public addresses, and the job's
        placement group when the job has no other instance); the error to raise, naming them.
        MachinesLeft when AWS does not let them be terminated."""
        interrupted = isinstance(error, KeyboardInterrupt)  # Ctrl-C, or a signal taken as one (its name)
        if isinstance(error, SpeedrunError):
            what = str(error)
        else:
            what = (str(error) or "Ctrl-C") if interrupted else f"interrupted ({type(error).__name__})"
        kind = type(error) if isinstance(error, SpeedrunError) else SpeedrunError  # AWSFailed stays exit 3
        try:
            terminate(self.session, launched)
            release_addresses(self.session, self.job, tasks)
            if not job_had_instances:
                self.delete_placement_group()
        except SpeedrunError as e2:
            return MachinesLeft(f"{what}; what it launched could not be removed ({e2}): "
                                f"{', '.join(launched) or 'its instances'} may still run: `speedrun down {self.job}` "
                                f"ends them", launched, getattr(e2, "exit_code", EXIT_BAD_INPUT))
        if not launched or not (isinstance(error, SpeedrunError) or interrupted):
            return error
        log.info("terminated the instance(s) this launch started: %s", ", ".join(launched))
        done = f"terminated the {len(launched)} instance(s) it launched ({', '.join(launched)})"
        return KeyboardInterrupt(f"{what}; {done}") if interrupted else kind(f"{what}; {done}")

    def delete_placement_group(self) -> None:
        """Delete the job's placement group if it has one and it exists (once no instance is in it)."""
        s, name = self.session, self.group
        if name is None:  # launched without one: nothing to ask AWS for
            return
        delete_placement_group(s, name)

    def launch_instances(self, tasks: list[int], zones: list[str], net: Network, key_name: str,
                         group_zone: str | None, started: list[str], efa: TypeNetwork | None) -> list[dict[str, Any]]:
        """instances.launch for these task indices, all in one zone: the first of `zones` with capacity.
        group_zone: where the job's placement group has instances (None: it has none); launches in
        another zone go without the group. The new instances' ids are added to `started` as soon as
        AWS has started them, so that a failure after that (tagging them) terminates them."""
        s, c = self.session, self.config
        image = find_image(s, c.image, c.image_owner)
        if c.placement_group:
            ensure_placement_group(s, self.placement_group_name)
            self.group = self.placement_group_name
        return launch(s, c, self.job, tasks, zones, net, image, key_name, group_zone, started, efa)

    def replace(self, index: int, count: int) -> Host:
        """A new instance for task `index` (the lost one is terminated if it still exists): in the
        job's zone, else (no capacity there) the region's next zone that has some, unless `zone`
        pins one; outside the job's placement group there, as the log says."""
        lost = job_instances(self.session, self.job).get(index)
        if lost is not None:
            terminate(self.session, [lost["InstanceId"]])
        release_addresses(self.session, self.job, [index])  # the lost one's, if it had one
        self._hosts = self.bring_up(count, other_zones=True)
        return self._hosts[index]

    def relocate(self, home: str) -> tuple[dict[str, Any], dict[str, Path]]:
        """The region's key (the public half too: a replacement's launch checks it against the key
        pair's) and the pinned host keys go to `home`; AWS credentials do not (the controller has
        its own: an instance role, or its ~/.aws)."""
        region = self.session.region
        key = key_path(region, self.config_dir)
        files = {"known_hosts": self.known_hosts, f"keys/aws-{region}": key,
                 f"keys/aws-{region}.pub": Path(f"{key}.pub")}
        return {**self.record(), "config_dir": home}, files

    def environment(self) -> dict[str, str]:
        # A spot instance gets two minutes' notice: `speedrun train` then stops at a step, resumable.
        env = {NOTICE_ENV: IMDS_NOTICE_URL} if self.config.spot else {}
        return env | (efa_environment(self.config.instance_type) if self.efa() is not None else {})

    # --- money and lifetime ---
    def billing(self) -> Billing:
        return job_billing(self.session, self.config, job_instances(self.session, self.job).values())

    def machine_type(self) -> str:
        return self.config.instance_type

    def price(self, machines: int) -> Price | None:
        """The running instances' mean price per instance-hour (each at its market's), with its
        source; None when an instance's price is unknown."""
        b = self.billing()
        if not b.count or b.price_per_hour is None:
            return None
        return Price(b.instance_type, b.market, machines, b.price_per_hour / b.count, b.price_source)

    def down(self) -> list[str]:
        """Terminate the job's instances, then delete its placement group (if it has one); the ids
        terminated. When a step fails the error says what is left: the record stays (the CLI
        forgets it only after this returns), and running `speedrun down JOB` again finishes."""
        s = self.session
        again = f"the job's record is kept: run `speedrun down {self.job}` again"
        instances = tagged_instances(s, self.job)  # also one an interrupted launch did not give a task
        ids = [i["InstanceId"] for i in instances]
        if ids:
            log.info("terminating %s", ", ".join(ids))
            try:
                terminate(s, ids)
            except SpeedrunError as e:
                raise type(e)(f"{e}; {', '.join(ids)} may still run; {again}") from None
        for inst in instances:
            for address in (inst.get("PrivateIpAddress"), inst.get("PublicIpAddress")):
                if address:
                    forget_host_key(self.known_hosts, address)
        done = f"terminated {', '.join(ids)}; " if ids else ""
        try:
            release_addresses(s, self.job)
        except SpeedrunError as e:
            raise type(e)(f"{e}; {done}its public addresses (Elastic IPs) are left; {again}") from None
        try:
            self.delete_placement_group()
        except SpeedrunError as e:
            raise type(e)(f"{e}; {done}placement group {self.group} is left; {again}") from None
        return ids

    def close(self) -> None:
        for h in self._hosts:
            h.close()
