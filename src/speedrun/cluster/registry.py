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
    # "known_hosts": this machine's file for the keys the watcher pins there (host_provider.adopt_host_keys)}.
    watcher: dict[str, Any] | None = None
    price_per_hour: float | None = None  # $ per machine-hour given with --price-per-hour; None: not given


def path_of(name: str, config_dir: str | os.PathLike | None = None) -> Path:
    """Where job `name`'s record is (or would be)."""
    return speedrun_home(config_dir) / "jobs" / f"{name}.json"


def save(record: JobRecord, config_dir: str | os.PathLike | None = None) -> Path:
    """Write the record atomically; returns its path."""
    path = path_of(record.name, config_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_text(path, files.to_json(asdict(record), indent=2))
    return path


def exists(name: str, config_dir: str | os.PathLike | None = None) -> bool:
    """Whether a job named `name` was recorded here."""
    return path_of(name, config_dir).is_file()


def forget(name: str, config_dir: str | os.PathLike | None = None) -> None:
    """Remove job `name`'s record (its machines are gone)."""
    path_of(name, config_dir).unlink(missing_ok=True)


def load(name: str, config_dir: str | os.PathLike | None = None) -> JobRecord:
    """The record of job `name`; a SpeedrunError naming the known jobs if there is none, or saying
    which file to delete if it is damaged."""
    path = path_of(name, config_dir)
    if not path.exists():
        known = ", ".join(r.name for r in load_all(config_dir)) or "none"
        raise SpeedrunError(f"no job named {name!r} was launched from here (known jobs: {known}); see `speedrun ls`")
    return _read(path)


def recorded(name: str, config_dir: str | os.PathLike | None = None) -> JobRecord | None:
    """Job `name`'s record here; None when there is none or it is damaged (it is written anew)."""
    try:
        return load(name, config_dir) if exists(name, config_dir) else None
    except SpeedrunError:
        return None


def read_all(config_dir: str | os.PathLike | None = None) -> tuple[list[JobRecord], list[str]]:
    """Every job record, oldest first, and for each damaged one a line saying so (as `load` would)."""
    records, bad = [], []
    for path in sorted((speedrun_home(config_dir) / "jobs").glob("*.json")):
        try:
            records.append(_read(path))
        except SpeedrunError as e:
            bad.append(str(e))
    return sorted(records, key=lambda r: r.created), bad


def load_all(config_dir: str | os.PathLike | None = None) -> list[JobRecord]:
    """Every job record, oldest first (damaged ones are skipped; read_all says which)."""
    return read_all(config_dir)[0]


def damaged(path: Path, why: str) -> SpeedrunError:
    """The error for a job record that cannot be used: which file, why, what to do."""
    return SpeedrunError(f"the job record {path} is damaged ({why}): delete it and launch the job again")


# A record's fields that every version wrote, and their JSON types: a file without them is no record.
REQUIRED: dict[str, tuple[type, ...]] = {"name": (str,), "num_tasks": (int,), "provider": (dict,), "run_dir": (str,),
                                         "cwd": (str, type(None))}


def _read(path: Path) -> JobRecord:
    """The JobRecord in `path`, ignoring fields that older versions wrote; SpeedrunError (see
    `damaged`) when it is not one: not JSON, not an object, a field missing or of the wrong type,
    another job's name."""
    try:
        text = path.read_text()
    except OSError as e:
        raise damaged(path, f"unreadable: {e.strerror}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise damaged(path, f"not JSON: {e}") from None
    if not isinstance(data, dict):
        raise damaged(path, f"it holds a JSON {type(data).__name__}, not an object")
    for key, kinds in REQUIRED.items():
        if key not in data:
            raise damaged(path, f"no {key}")
        if not isinstance(data[key], kinds) or isinstance(data[key], bool):
            raise damaged(path, f"{key} is {json.dumps(data[key])[:40]}")
    if data["num_tasks"] < 1:
        raise damaged(path, f"num_tasks is {data['num_tasks']}")
    if data["name"] != path.stem:
        raise damaged(path, f"it names job {data['name']!r}")
    known = {f.name for f in fields(JobRecord)}
    return JobRecord(**{k: v for k, v in data.items() if k in known})
