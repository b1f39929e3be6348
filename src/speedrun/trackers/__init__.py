"""Experiment trackers beside TensorBoard: where a run's parameters, metrics and files also go.

    speedrun train --track mlflow[=URI] --track wandb[=[ENTITY/]PROJECT] [--track-group NAME]
    (each repeatable; or SPEEDRUN_TRACK=mlflow=http://host:5000,wandb and SPEEDRUN_TRACK_GROUP)

`open_trackers` makes each asked-for tracker's run (or finds it again on a resume) before the
first step, in its group where the run has one (an ablation, a job: MLflow's parent run, W&B's
group): a tracker that does not take it then is one line, exit 2. From then on `Trackers` takes
the loop's records and each tracker's Outbox sends them in the background (speedrun.trackers.outbox):
a tracker that stops answering mid-run never stops the run, and what it missed is sent at the
next start or by `speedrun track sync RUN` (`sync`). Nothing of a tracker's library is imported
unless it is asked for.
"""
from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speedrun.errors import EXIT_FAILED, SpeedrunError, one_line
from speedrun.trackers.outbox import Backend, Outbox, read_state

KINDS = {"mlflow": "mlflow[=URI]", "wandb": "wandb[=[ENTITY/]PROJECT]"}  # each kind, as --track takes it
METAVAR = "|".join(KINDS.values())  # --track's, in every command that takes it
ENV = "SPEEDRUN_TRACK"  # comma-separated, as --track takes them
GROUP_ENV = "SPEEDRUN_TRACK_GROUP"


@dataclass(frozen=True)
class TrackSpec:
    """One --track value: a tracker kind and where in it (MLflow: the tracking URI; W&B:
    [ENTITY/]PROJECT); None: the tracker's own default (MLFLOW_TRACKING_URI, WANDB_PROJECT...)."""

    kind: str
    where: str | None = None

    @classmethod
    def parse(cls, text: str) -> TrackSpec:
        kind, sep, where = text.strip().partition("=")
        if kind not in KINDS or (sep and not where):
            raise SpeedrunError(f"bad --track {text!r}: give " + " or ".join(KINDS.values()))
        return cls(kind, where or None)


def parse_tracks(values: Sequence[str] | None, fallback: Sequence[str] = ()) -> tuple[TrackSpec, ...]:
    """--track values (or, when none is given, SPEEDRUN_TRACK's, else `fallback`'s: a recipe
    file's `track`) as specs, one per kind."""
    texts = list(values or []) or [t for t in os.environ.get(ENV, "").split(",") if t.strip()] or list(fallback)
    specs = {s.kind: s for s in (TrackSpec.parse(t) for t in texts)}
    return tuple(specs.values())


def parse_group(value: str | None) -> str | None:
    """--track-group's value, else SPEEDRUN_TRACK_GROUP's, else the launch job's name
    (SPEEDRUN_JOB); None outside any. One line, exit 2, for a name no tracker can take."""
    name = value or os.environ.get(GROUP_ENV) or os.environ.get("SPEEDRUN_JOB") or None
    if name is not None and (not name.strip() or len(name) > 128 or any(c in name for c in "'\"\\\n")):
        raise SpeedrunError(f"bad --track-group {name!r}: give a name of 1-128 characters without quotes")
    return name


def saved_tracks(run_dir: Path) -> tuple[TrackSpec, ...]:
    """The trackers a run directory's earlier starts logged to (a resume goes on with them)."""
    folder = Path(run_dir) / "trackers"
    states = [read_state(p) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []
    return tuple(TrackSpec(s["kind"], s.get("where")) for s in states if s.get("kind") in KINDS)


class Trackers:
    """Every tracker of one run (rank 0's): each record goes to all of them."""

    def __init__(self, boxes: list[tuple[Outbox, Any]]):
        self._boxes = boxes

    def __bool__(self) -> bool:
        return bool(self._boxes)

    def _put(self, record: dict[str, Any]) -> None:
        for box, _ in self._boxes:
            box.put(record)

    def metrics(self, step: int, values: dict[str, float | None]) -> None:
        self._put({"kind": "metrics", "step": step, "time": time.time(), "values": values})

    def tags(self, tags: dict[str, str]) -> None:
        self._put({"kind": "tags", "tags": tags})

    def artifact(self, relative_path: str) -> None:
        self._put({"kind": "artifact", "path": relative_path})

    def status(self, status: str) -> None:
        self._put({"kind": "status", "status": status, "time": time.time()})

    def close(self) -> list[str]:
        """Send what is left (a few seconds at most); a line per tracker: where the run is, or
        what it kept back and how to send it."""
        lines = []
        for box, backend in self._boxes:
            left = box.close()
            if left:
                why = box.last_error or "no answer yet"
                lines.append(f"{left} record(s) for {backend.describe()} not sent ({why}): kept in {box.log}; "
                             f"`speedrun track sync {box.dir.parent}` sends them")
            else:
                lines.append(f"tracked: {backend.describe()}")
        return lines


def open_trackers(specs: Sequence[TrackSpec], run_dir: Path, run_name: str, params: dict[str, Any],
                  tags: dict[str, str], group: str | None = None) -> Trackers:
    """Each tracker's run for `run_dir`, made with `params` and `tags` in `group` (or found again:
    a resumed run keeps its tracker run), its sender started and sending what an earlier start left."""
    boxes = []
    for spec in specs:
        box = Outbox(run_dir, spec.kind)
        backend = _backend(spec.kind, spec.where, run_dir, box)
        fresh = backend.run_id is None
        backend.open(run_name, group)
        if fresh:
            box.put({"kind": "start", "params": params, "tags": tags})
        box.start(backend)
        boxes.append((box, backend))
    return Trackers(boxes)


def _backend(kind: str, where: str | None, run_dir: Path, box: Outbox) -> Backend:
    # Imported here: a run imports only the trackers it is asked for, and their libraries with them.
    if kind == "mlflow":
        from speedrun.trackers.mlflow import MLflowBackend

        return MLflowBackend(where, run_dir, box)
    if kind == "wandb":
        from speedrun.trackers.wandb import WandbBackend

        return WandbBackend(where, run_dir, box)
    raise SpeedrunError(f"unknown tracker {kind!r}")


def sync(run_dir: Path) -> list[str]:
    """Send every record a run's trackers have not taken (`speedrun track sync RUN`); a line per
    tracker. SpeedrunError when there is nothing to sync or a tracker still does not answer."""
    folder = Path(run_dir) / "trackers"
    states = sorted(folder.glob("*.json")) if folder.is_dir() else []
    if not states:
        raise SpeedrunError(f"{run_dir} has no trackers (no {folder}/*.json): it ran without --track")
    lines = []
    for state in states:
        box = Outbox(run_dir, state.stem)
        backend = _backend(state.stem, None, run_dir, box)
        try:
            sent = box.send_pending(backend)
            backend.close()
        except Exception as e:
            raise TrackerUnreachable(f"{backend.describe()}: {one_line(e)}; {box.pending()} record(s) still "
                                     f"kept in {box.log}") from None
        lines.append(f"{backend.describe()}: {sent} record(s) sent, none left")
    return lines


class TrackerUnreachable(SpeedrunError):
    """`track sync` could not reach a tracker: the world, not the input (exit 3)."""

    exit_code = EXIT_FAILED
