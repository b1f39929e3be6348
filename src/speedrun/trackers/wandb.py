"""Weights & Biases: a run's records to a W&B run, online or offline (WANDB_MODE=offline).

Through wandb's own library (`pip install 'speedrun[wandb]'`), with its own settings (WANDB_MODE,
WANDB_API_KEY, WANDB_BASE_URL, WANDB_ENTITY): one W&B run per speedrun run, its id kept in
RUN/trackers/wandb.json so that a resume continues it (`resume="allow"`). wandb keeps its own files
in RUN/trackers/wandb/ (offline: `wandb sync RUN/trackers/wandb/offline-run-*` uploads them).
Records become W&B's: "start" the run's config (parameters and tags alike; the short tags also as
W&B tags), "metrics" history rows (step = the optimizer step, `_timestamp` = the wall time),
"tags" summary fields, "artifact" a file saved with the run, "status" the run's end (its exit code).
A run in a group (an ablation, a launch job) is in that W&B group.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from speedrun.errors import EXIT_RESUMABLE, SpeedrunError, one_line
from speedrun.trackers.outbox import Outbox

DEFAULT_PROJECT = "speedrun"
# The exit code a W&B run ends with, by results.json's status (failed: 1): W&B shows 0 as finished,
# any other as failed.
EXIT_CODES = {"finished": 0, "target_reached": 0, "stopped": EXIT_RESUMABLE, "interrupted": 130}
MAX_TAG = 64  # W&B's longest tag


def import_wandb():
    """The wandb module, or one line saying how to install it."""
    # wandb's own lines (its warnings among them) would come from the sender thread amid the run's;
    # the run says where its W&B run is itself. WANDB_SILENT=false brings them back.
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        import wandb
    except ImportError:
        raise SpeedrunError("--track wandb needs wandb: pip install 'speedrun[wandb]'") from None
    return wandb


class WandbBackend:
    """The W&B run of one speedrun run; `send` takes an Outbox's records."""

    name = "wandb"

    def __init__(self, where: str | None, run_dir: Path, outbox: Outbox):
        self.wandb = import_wandb()
        self.run_dir = Path(run_dir)
        self.outbox = outbox
        self.where = where or outbox.state.get("where") or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT
        self.run_id: str | None = outbox.state.get("run_id")
        self.run = None  # wandb's Run while it is open in this process

    def describe(self) -> str:
        """The W&B run, for a person: its page online, its folder and how to upload it offline."""
        url = self.outbox.state.get("url")
        if url:
            return f"W&B run {url}"
        folder = self.outbox.dir / "wandb"
        return f"W&B offline run {self.run_id} in {folder} (`wandb sync {folder}/offline-run-*` uploads it)"

    def open(self, run_name: str, group: str | None) -> None:
        """Start this run's W&B run, or continue it (a resume). W&B refusing it (no API key, a
        server that does not answer) is bad input at the start: SpeedrunError."""
        try:
            self._init(self.run_id, run_name, group)  # no id yet: W&B makes one
        except Exception as e:  # wandb's errors are its own classes, and its service's
            raise SpeedrunError(f"--track wandb: W&B did not take the run (project {self.where}): "
                                f"{one_line(e)}") from None
        self.run_id = self.run.id
        self.outbox.save_state(kind="wandb", where=self.where, run_id=self.run_id, run_name=run_name, group=group,
                               url=None if self.run.offline else self.run.url)

    def _init(self, run_id: str | None, run_name: str, group: str | None) -> None:
        entity, _, project = self.where.rpartition("/")
        # console "off": the trainer's console is its own, never wrapped.
        self.run = self.wandb.init(project=project, entity=entity or None, id=run_id, name=run_name, group=group,
                                   resume="allow", dir=str(self.outbox.dir),
                                   settings=self.wandb.Settings(console="off"))

    def send(self, records: list[dict[str, Any]]) -> None:
        if self.run is None:  # `track sync`, or a later start's leftovers: the same run again
            state = self.outbox.state
            self._init(self.run_id, state.get("run_name") or self.run_dir.name, state.get("group"))
        for r in records:
            kind = r["kind"]
            if kind == "start":
                self.run.config.update({**r["params"], **r["tags"]}, allow_val_change=True)
                self.run.tags = tuple(t for t in (f"{k.removeprefix('speedrun.')}:{v}" for k, v in r["tags"].items())
                                      if len(t) <= MAX_TAG)
            elif kind == "metrics":
                values = {k: v for k, v in r["values"].items() if v is not None}
                self.run.log({**values, "_timestamp": r["time"]}, step=r["step"])
            elif kind == "tags":
                self.run.summary.update(r["tags"])
            elif kind == "artifact":
                path = self.run_dir / r["path"]
                if path.exists():  # a file the run wrote; gone since (a cleaned folder): nothing to send
                    self.run.save(str(path), base_path=str(self.run_dir), policy="now")
            elif kind == "status" and r["status"] != "running":
                self.run.finish(exit_code=EXIT_CODES.get(r["status"], 1))
                self.run = None

    def close(self) -> None:
        """End the W&B run if records left it open (a `track sync` of a run that ended without)."""
        if self.run is not None:
            self.run.finish()
            self.run = None
