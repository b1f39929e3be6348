"""speedrun's own files on the machine you launch from: pinned host keys and a record per job.

    $SPEEDRUN_HOME (default ~/.config/speedrun)/
        known_hosts        host keys learned with --accept-new-host-keys
        jobs/<job>.json    how to find a job's hosts and run directory again (JobRecord)
        watch/<job>.json   on a controller host only: what its watcher repeats (controller.py)
        keys/aws-<region>  the private key of speedrun's EC2 key pair in that region (mode 0600)

The records let `speedrun ls | logs | attach | kill | tb JOB` work from another shell, later.
They hold no secrets: paths to keys, never keys.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from speedrun import files
from speedrun.errors import SpeedrunError


def speedrun_home(config_dir: str | os.PathLike | None = None) -> Path:
    """The directory for speedrun's files on this machine: `config_dir` if given, else
    $SPEEDRUN_HOME, else ~/.config/speedrun. (A host's `home` is its $HOME, another thing.)"""
    if config_dir is not None:
        return Path(config_dir).expanduser()
    return Path(os.environ.get("SPEEDRUN_HOME") or Path.home() / ".config" / "speedrun")


def default_known_hosts(config_dir: str | os.PathLike | None = None) -> Path:
    return speedrun_home(config_dir) / "known_hosts"


@dataclass
class JobRecord:
    """What `open_job` needs to reach a job again."""

    name: str
    num_tasks: int
    provider: dict[str, Any]  # Provider.record()
    run_dir: str
    cwd: str | None  # where the job's commands run on each host; None: each task's log directory
    tmux_socket: str = "speedrun"
    python: str = "python3"
    created: float = 0.0  # seconds since the epoch
    window: str = "train"  # the command whose state `ls` shows and whose log `logs` prints by default
    # Where the job's watcher runs when not here (controller.py): {"job": the watcher's own job,
    # "home": its speedrun home there, "paths": the provider record's keys that name files here,
    # "known_hosts": this machine's file for the keys the watcher pins there (lifecycle.adopt_host_keys)}.
    watcher: dict[str, Any] | None = None


def save(record: JobRecord, config_dir: str | os.PathLike | None = None) -> Path:
    """Write the record atomically; returns its path."""
    d = speedrun_home(config_dir) / "jobs"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{record.name}.json"
    files.write_text(path, json.dumps(asdict(record), indent=2))
    return path


def exists(name: str, config_dir: str | os.PathLike | None = None) -> bool:
    """Whether a job named `name` was recorded here."""
    return (speedrun_home(config_dir) / "jobs" / f"{name}.json").is_file()


def forget(name: str, config_dir: str | os.PathLike | None = None) -> None:
    """Remove job `name`'s record (its machines are gone)."""
    (speedrun_home(config_dir) / "jobs" / f"{name}.json").unlink(missing_ok=True)


def load(name: str, config_dir: str | os.PathLike | None = None) -> JobRecord:
    """The record of job `name`; a SpeedrunError naming the known jobs if there is none."""
    path = speedrun_home(config_dir) / "jobs" / f"{name}.json"
    if not path.exists():
        known = ", ".join(r.name for r in load_all(config_dir)) or "none"
        raise SpeedrunError(f"no job named {name!r} was launched from here (known jobs: {known}); see `speedrun ls`")
    try:
        return _record(json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise SpeedrunError(f"the job record {path} is damaged ({e}): delete it and launch the job again")


def load_all(config_dir: str | os.PathLike | None = None) -> list[JobRecord]:
    """Every job record, oldest first (damaged ones are skipped)."""
    records = []
    for path in sorted((speedrun_home(config_dir) / "jobs").glob("*.json")):
        try:
            records.append(_record(json.loads(path.read_text())))
        except (ValueError, TypeError):
            continue
    return sorted(records, key=lambda r: r.created)


def _record(data: dict[str, Any]) -> JobRecord:
    """A JobRecord from its JSON, ignoring fields that older versions wrote."""
    known = {f.name for f in fields(JobRecord)}
    return JobRecord(**{k: v for k, v in data.items() if k in known})
