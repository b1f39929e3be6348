"""Finding a job again: `open_job` turns the record make_job left on this machine into a Job (its
provider's open_job), to inspect, follow, attach to or kill. When a watcher on a controller host
(controller.py) keeps the job going, that watcher's record is the newer one: `refreshed` takes the
provider's part of it from there (it may have replaced hosts) and the host keys it pinned for them
(which host_provider.adopt_host_keys takes)."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex

from speedrun.cluster import registry
from speedrun.cluster.job import Job
from speedrun.cluster.providers import provider_from_record
from speedrun.cluster.utils import REACH_TIMEOUT_S
from speedrun.errors import SpeedrunError

log = logging.getLogger("speedrun.cluster")


def open_job(name: str, config_dir: str | os.PathLike | None = None, *, probe: bool = True) -> Job:
    """The job `name` as recorded by make_job on this machine, to inspect, follow, attach to or kill.

    probe=False skips contacting the hosts (enough for status and kill; run and launch need it)."""
    rec, pinned = refreshed(registry.load(name, config_dir), config_dir)  # a watcher elsewhere may have moved tasks
    prov = provider_from_record(rec.provider, registry.path_of(name, config_dir))
    return prov.open_job(rec, probe=probe, watcher_known_hosts=pinned)


def refreshed(rec: registry.JobRecord, config_dir: str | os.PathLike | None = None) -> tuple[registry.JobRecord, str]:
    """A job's record with the provider's state as its controller keeps it (a watcher there may have
    replaced hosts) and this machine's paths, saved here when it changed; and the controller's
    known_hosts text (for host_provider.adopt_host_keys). The record as it is and "" when the job has
    no watcher elsewhere or the controller does not answer within seconds."""
    w = rec.watcher
    if not w:
        return rec, ""
    cut = "--- speedrun: known_hosts ---"  # between the record and the pinned keys, in one round trip
    try:
        watcher = registry.load(w["job"], config_dir)
        host = provider_from_record(watcher.provider).open_job(watcher, probe=False).tasks[0].host
        home = shlex.quote(w["home"])
        r = host.shell(f"cat {home}/jobs/{shlex.quote(rec.name)}.json && echo {shlex.quote(cut)} && "
                       f"cat {home}/known_hosts 2>/dev/null; true", timeout=REACH_TIMEOUT_S)
        text, _, known_hosts = r.text.partition(f"{cut}\n")
        remote = json.loads(text)["provider"]
    except (SpeedrunError, ValueError, KeyError) as e:
        log.debug("job %s: its controller's record is out of reach (%s); using this one", rec.name, e)
        return rec, ""
    provider = {**remote, **{k: rec.provider[k] for k in w["paths"]}}
    if provider != rec.provider:
        rec = dataclasses.replace(rec, provider=provider)
        registry.save(rec, config_dir)
    return rec, known_hosts
