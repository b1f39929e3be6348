"""MLflow: a run's records to an MLflow tracking server (or any tracking URI MLflow's client takes).

Through MLflow's own client (`pip install 'speedrun[mlflow]'`, mlflow-skinny): one MLflow run per
speedrun run, found again by its id (kept in RUN/trackers/mlflow.json) when the run resumes.
Records become MLflow's: "start" its parameters and tags, "metrics" metric points (step = the
optimizer step, timestamp = the wall time), "tags" tags, "artifact" a file of the run directory,
"status" the run's status (RUNNING, FINISHED, FAILED, KILLED).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from speedrun.errors import SpeedrunError
from speedrun.trackers.outbox import Outbox, one_line

# MLflow's client retries a failed call 7 times over minutes by default: the sender retries by
# itself (outbox.RETRY_S) and a start must fail in seconds, so one try of 10 s unless set. Its
# "View run" line would come from the sender thread amid the run's own; the run prints the link.
CLIENT_SETTINGS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
                   "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
DEFAULT_EXPERIMENT = "speedrun"
# MLflow's limits for one log_batch call.
MAX_METRICS, MAX_PARAMS, MAX_TAGS, MAX_PARAM_LENGTH = 1000, 100, 100, 6000

STATUS = {"running": "RUNNING", "finished": "FINISHED", "target_reached": "FINISHED", "failed": "FAILED",
          "stopped": "KILLED", "interrupted": "KILLED"}


def import_client():
    """MLflow's client class, or one line saying how to install it."""
    for key, value in CLIENT_SETTINGS.items():
        os.environ.setdefault(key, value)
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise SpeedrunError("--track mlflow needs MLflow's client: pip install 'speedrun[mlflow]'") from None
    return MlflowClient


class MLflowBackend:
    """The MLflow run of one speedrun run; `send` takes an Outbox's records."""

    name = "mlflow"

    def __init__(self, uri: str | None, run_dir: Path, outbox: Outbox):
        self.run_dir = Path(run_dir)
        self.outbox = outbox
        self.uri = uri or outbox.state.get("uri") or os.environ.get("MLFLOW_TRACKING_URI")
        self.client = import_client()(tracking_uri=self.uri)
        self.run_id: str | None = outbox.state.get("run_id")

    def where(self) -> str:
        """The MLflow run, for a person: its page where the tracking URI is a server's."""
        uri = self.client.tracking_uri
        if uri.startswith(("http://", "https://")) and self.outbox.state.get("experiment_id"):
            return f"MLflow run {uri.rstrip('/')}/#/experiments/{self.outbox.state['experiment_id']}/runs/{self.run_id}"
        return f"MLflow run {self.run_id} at {uri}"

    def open(self, run_name: str, experiment: str | None, parent_run_id: str | None) -> None:
        """Find this run's MLflow run again (a resume), or make it; either way it is RUNNING after.
        The tracker not answering, or refusing, is bad input at the start: SpeedrunError."""
        try:
            if self.run_id is None:
                name = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
                found = self.client.get_experiment_by_name(name)
                experiment_id = found.experiment_id if found else self.client.create_experiment(name)
                tags = {"mlflow.parentRunId": parent_run_id} if parent_run_id else {}
                run = self.client.create_run(experiment_id, run_name=run_name, tags=tags)
                self.run_id = run.info.run_id
                self.outbox.save_state(kind="mlflow", uri=self.client.tracking_uri, run_id=self.run_id,
                                       experiment_id=experiment_id)
            else:
                self.client.update_run(self.run_id, status="RUNNING")
        except Exception as e:  # MLflow raises its own exceptions and requests' alike
            raise SpeedrunError(f"--track mlflow: the tracking server at {self.client.tracking_uri} did not take "
                                f"the run: {one_line(e)}") from None

    def send(self, records: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric, Param, RunTag

        metrics, params, tags = [], [], []

        def flush() -> None:
            while metrics or params or tags:
                self.client.log_batch(self.run_id, metrics=metrics[:MAX_METRICS], params=params[:MAX_PARAMS],
                                      tags=tags[:MAX_TAGS], synchronous=True)
                del metrics[:MAX_METRICS], params[:MAX_PARAMS], tags[:MAX_TAGS]

        for r in records:
            kind = r["kind"]
            if kind == "start":
                params += [Param(k, str(v)[:MAX_PARAM_LENGTH]) for k, v in r["params"].items()]
                tags += [RunTag(k, str(v)) for k, v in r["tags"].items()]
            elif kind == "metrics":
                ms = int(1000 * r["time"])
                metrics += [Metric(k, float(v), ms, r["step"]) for k, v in r["values"].items() if v is not None]
            elif kind == "tags":
                tags += [RunTag(k, str(v)) for k, v in r["tags"].items()]
            elif kind == "artifact":
                flush()
                path = self.run_dir / r["path"]
                if path.exists():  # a file the run wrote; gone since (a cleaned folder): nothing to send
                    self.client.log_artifact(self.run_id, str(path))
            elif kind == "status":
                flush()
                status = STATUS.get(r["status"], "FAILED")
                if status == "RUNNING":
                    self.client.update_run(self.run_id, status=status)
                else:
                    self.client.set_terminated(self.run_id, status=status, end_time=int(1000 * r["time"]))
        flush()
