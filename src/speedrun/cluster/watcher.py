"""Stopping a job's watcher on its controller host (controller.py) from this machine: before `kill`
and `down` (else it would take the job for a failed one and start it again) and before a new run
of the job starts (else it would start the old one in its place)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from speedrun.cluster import registry
from speedrun.cluster.reopen import open_job
from speedrun.errors import SpeedrunError

log = logging.getLogger("speedrun.cluster")


@dataclass(frozen=True)
class WatcherStop:
    """What stop_watcher did: `ok` when the watcher is known to be stopped, and a line saying so
    (or why it could not be); `record`, the watcher's record on this machine."""

    ok: bool
    line: str
    record: Path

    def refusal(self, job: str, consequence: str) -> str:
        """The one line for a command that did not go on because job `job`'s watcher could not be
        stopped (`consequence`: what was left undone and why), with the ways out."""
        return (f"job {job}: {self.line}; {consequence}: run this again once that host answers (if it is gone "
                f"for good, so is the watcher: delete {self.record})")


def stop_watcher(rec: registry.JobRecord, config_dir: str | os.PathLike | None = None, *,
                 forget: bool = False) -> WatcherStop | None:
    """Kill the job's watcher on its controller (controller.py) and, with `forget`, once it is
    stopped, its record; None when the job has no watcher elsewhere. One that could not be reached
    keeps its record: it may still run there, and only that record lets a later call stop it."""
    if not rec.watcher or not registry.exists(rec.watcher["job"], config_dir):
        return None
    watcher = open_job(rec.watcher["job"], config_dir, probe=False)
    where = watcher[0].host.name
    record = registry.path_of(watcher.name, config_dir)
    unreachable = watcher.kill()
    if unreachable:
        return WatcherStop(False, f"its watcher on {where} could not be stopped ({unreachable[0]})", record)
    if forget:
        registry.forget(watcher.name, config_dir)
    return WatcherStop(True, f"stopped its watcher on {where}", record)


def stop_watcher_for_new_run(name: str, config_dir: str | os.PathLike | None = None) -> None:
    """Stop and forget the recorded watcher of job `name` before a new run of it starts;
    SpeedrunError, with nothing started, when it could not be stopped."""
    rec = registry.recorded(name, config_dir)
    stopped = stop_watcher(rec, config_dir, forget=True) if rec is not None else None
    if stopped is not None and stopped.ok:
        log.info("job %s: %s (a new run starts)", name, stopped.line)
    elif stopped is not None:
        raise SpeedrunError(stopped.refusal(name, "no new run was started, since that watcher would start "
                                                  "the old one again in its place"))
