"""MLflow: a run's records to an MLflow tracking server (or any tracking URI MLflow's client takes).

Through MLflow's own client (`pip install 'speedrun[mlflow]'`, mlflow-skinny): one MLflow run per
speedrun run, found again by its id (kept in RUN/trackers/mlflow.json) when the run resumes. A run
in a group (an ablation, a launch job) is the child of the group's parent run: an MLflow run named
after the group, tagged `speedrun.group` and `speedrun.kind` = group, made by the first of them.
Records become MLflow's: "start" its parameters and tags, "metrics" metric points (step = the
optimizer step, timestamp = the wall time), "tags" tags, "artifact" a file of the run directory,
"status" the run's status (RUNNING, FINISHED, FAILED, KILLED).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from speedrun.errors import SpeedrunError, one_line
from speedrun.trackers.outbox import Outbox

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
        self.client = import_client()(tracking_uri=uri or outbox.state.get("where") or
                                      os.environ.get("MLFLOW_TRACKING_URI"))
        self.run_id: str | None = outbox.state.get("run_id")

    def describe(self) -> str:
        """The MLflow run, for a person: its page where the tracking URI is a server's."""
        uri = self.client.tracking_uri
        if uri.startswith(("http://", "https://")) and self.outbox.state.get("experiment_id"):
            return f"MLflow run {uri.rstrip('/')}/#/experiments/{self.outbox.state['experiment_id']}/runs/{self.run_id}"
        return f"MLflow run {self.run_id} at {uri}"

    def open(self, run_name: str, group: str | None) -> None:
        """Find this run's MLflow run again (a resume), or make it, in `group`'s parent run when
        given; either way it is RUNNING after. The tracker not answering, or refusing, is bad
        input at the start: SpeedrunError."""
        try:
            if self.run_id is None:
                name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
                found = self.client.get_experiment_by_name(name)
                experiment_id = found.experiment_id if found else self.client.create_experiment(name)
                tags = {"mlflow.parentRunId": self._parent(experiment_id, group)} if group else {}
                run = self.client.create_run(experiment_id, run_name=run_name, tags=tags)
                self.run_id = run.info.run_id
                self.outbox.save_state(kind="mlflow", where=self.client.tracking_uri, run_id=self.run_id,
                                       experiment_id=experiment_id)
            else:
                self.client.update_run(self.run_id, status="RUNNING")
        except Exception as e:  # MLflow raises its own exceptions and requests' alike
            raise SpeedrunError(f"--track mlflow: the tracking server at {self.client.tracking_uri} did not take "
                                f"the run: {one_line(e)}") from None

    def _parent(self, experiment_id: str, group: str) -> str:
        """The id of `group`'s parent run, made if it is not there yet. Runs of one group may start
        at once (a job's tasks): each that made a parent looks again, all take the oldest, and a
        maker whose parent is not the oldest deletes its own."""
        query = f"tags.`speedrun.kind` = 'group' and tags.`speedrun.group` = '{group}'"
        order = ["attributes.start_time ASC", "attributes.run_id ASC"]
        found = self.client.search_runs([experiment_id], query, order_by=order, max_results=1)
        if found:
            return found[0].info.run_id
        mine = self.client.create_run(experiment_id, run_name=group,
                                      tags={"speedrun.kind": "group", "speedrun.group": group}).info.run_id
        self.client.set_terminated(mine, status="FINISHED")  # a folder for its children, never "running"
        oldest = self.client.search_runs([experiment_id], query, order_by=order, max_results=1)[0].info.run_id
        if oldest != mine:
            self.client.delete_run(mine)
        return oldest

    def close(self) -> None:
        """Nothing to end: every call was complete when it returned."""

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


def download_runs(experiment: str, into: Path) -> tuple[list[tuple[str, Path]], list[str]]:
    """The speedrun runs of MLflow experiment `experiment` (at $MLFLOW_TRACKING_URI), oldest first,
    each as (its MLflow run name, a folder in `into` holding its results.json and metrics.jsonl:
    what `compare` reads of a run directory); and a line for each run left out, saying why (one
    still going has no results.json yet). SpeedrunError when the server or the experiment is not there."""
    client = import_client()()
    try:
        found = client.get_experiment_by_name(experiment)
        if found is None:
            raise SpeedrunError(f"mlflow://{experiment}: no such MLflow experiment at {client.tracking_uri}")
        runs, token = [], None
        while True:  # a page at a time: an experiment of many runs
            page = client.search_runs([found.experiment_id], order_by=["attributes.start_time ASC"],
                                      max_results=1000, page_token=token)
            runs += page
            token = page.token
            if not token:
                break
        read, skipped = [], []
        for run in runs:
            tags, name = run.data.tags, run.info.run_name
            if tags.get("speedrun.kind") == "group" or "speedrun.recipe" not in tags:
                continue  # an ablation's parent, or a run of something else
            kept = {a.path for a in client.list_artifacts(run.info.run_id)}
            if "results.json" not in kept:
                skipped.append(f"MLflow run {name} ({run.info.run_id}): no results.json yet ({run.info.status})")
                continue
            folder = into / run.info.run_id
            folder.mkdir(parents=True)
            for artifact in ("results.json", "metrics.jsonl"):
                if artifact in kept:
                    client.download_artifacts(run.info.run_id, artifact, str(folder))
            read.append((name, folder))
    except SpeedrunError:
        raise
    except Exception as e:  # MLflow's exceptions and requests' alike
        raise SpeedrunError(f"mlflow://{experiment}: the tracking server at {client.tracking_uri} did not "
                            f"answer: {one_line(e)}") from None
    return read, skipped
