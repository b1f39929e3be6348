"""`--track mlflow`: a run's parameters, metrics, tags and files in a real MLflow tracking server
(tests/mlflow_server.py), read back through MLflow's own client; a stopped and resumed run is one
MLflow run; a server that dies mid-run holds nothing up, and `speedrun track sync` fills the gap."""
import json
import os
import signal

import pytest
from cli_run import one_line_error, speedrun, speedrun_here, start, wait_for
from mlflow_server import MLflowServer

from speedrun.errors import EXIT_RESUMABLE
from speedrun.files import read_jsonl

ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}
TINY = ["train", "--recipe", "tiny", "--device", "cpu"]


@pytest.mark.parametrize("args, line", [
    (["--track", "neptune"], "bad --track 'neptune': give mlflow[=URI]"),
    (["--track", "mlflow="], "bad --track 'mlflow=': give mlflow[=URI]"),
    (["--track-checkpoints"], "--track-checkpoints uploads to a tracker: give --track mlflow[=URI] too"),
])
def test_bad_track_settings_are_one_line_and_exit_2(tmp_path, args, line):
    one_line_error(speedrun_here(*TINY, "--out", str(tmp_path / "r"), *args), line)
    assert not (tmp_path / "r").exists()


def test_track_sync_of_a_run_without_trackers_is_one_line_and_exit_2(tmp_path):
    one_line_error(speedrun_here("track", "sync", str(tmp_path)), "it ran without --track")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    with MLflowServer(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


def client(server):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=server.uri)


def the_run(server, run_dir):
    """The MLflow run(s) named after `run_dir`, in the default experiment; exactly one is expected."""
    c = client(server)
    experiment = c.get_experiment_by_name("speedrun")
    runs = c.search_runs([experiment.experiment_id], filter_string=f"attributes.run_name = '{run_dir.name}'")
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0]


def series(server, run_id, key):
    return [(m.step, m.value) for m in sorted(client(server).get_metric_history(run_id, key), key=lambda m: m.step)]


@pytest.mark.slow
def test_a_runs_parameters_metrics_tags_and_files_read_back_through_mlflow(mlflow_server, tmp_path):
    out = tmp_path / "tracked"
    r = speedrun(*TINY, "--epochs", "2", "--log-every", "5", "--out", str(out),
                 "--track", f"mlflow={mlflow_server.uri}", env=ONE_THREAD, timeout=600)
    assert r.returncode == 0, r.stderr
    run = the_run(mlflow_server, out)
    assert run.info.status == "FINISHED"
    assert json.loads((out / "trackers" / "mlflow.json").read_text())["run_id"] == run.info.run_id
    # The run's last lines say where it is; MLflow's own "View run" line is not among them.
    page = f"{mlflow_server.uri}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    assert f"tracked: MLflow run {page}" in r.stdout and "View run" not in r.stdout
    params = run.data.params
    assert params["recipe.name"] == "tiny" and params["recipe.epochs"] == "2" and params["world_size"] == "1"
    assert params["seed"] == "0" and params["device"] == "cpu" and "recipe.phases.size" in params
    tags = run.data.tags
    assert tags["speedrun.recipe"] == "tiny" and tags["speedrun.world_size"] == "1" and tags["speedrun.host"]
    assert tags["speedrun.device"].startswith("cpu") and tags["speedrun.status"] == "finished"
    assert tags["speedrun.checkpoint"].startswith(str(out / "checkpoint.pt"))
    # Every point as the run's own records have it, at the optimizer step.
    evals, steps = read_jsonl(out / "metrics.jsonl"), read_jsonl(out / "steps.jsonl")
    for key in ("top1", "top5", "loss"):
        assert series(mlflow_server, run.info.run_id, f"val/{key}") == [(e["step"], e[key]) for e in evals]
    assert series(mlflow_server, run.info.run_id, "train/loss") == [(s["step"], s["loss"]) for s in steps]
    assert series(mlflow_server, run.info.run_id, "train/lr") == [(s["step"], s["lr"]) for s in steps]
    results = json.loads((out / "results.json").read_text())
    summary = run.data.metrics
    assert summary["total_s"] == results["total_s"] and summary["best/top1"] == results["best"]["top1"]
    assert summary["epochs_run"] == 2
    names = {a.path for a in client(mlflow_server).list_artifacts(run.info.run_id)}
    assert {"accuracy.png", "results.json"} <= names and "checkpoint.pt" not in names
    got = client(mlflow_server).download_artifacts(run.info.run_id, "results.json", str(tmp_path))
    assert json.loads(open(got).read()) == results


@pytest.mark.slow
def test_a_run_stopped_and_resumed_is_one_mlflow_run_with_an_unbroken_series(mlflow_server, tmp_path):
    out = tmp_path / "stopped"
    args = [*TINY, "--epochs", "2", "--log-every", "1", "--out", str(out)]
    proc = start(*args, "--track", f"mlflow={mlflow_server.uri}", env=ONE_THREAD)
    wait_for(lambda: (out / "steps.jsonl").exists() and len(read_jsonl(out / "steps.jsonl")) >= 20, 300, "20 steps")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_RESUMABLE, err
    assert the_run(mlflow_server, out).info.status == "KILLED"
    # The resume needs no --track: the run directory knows its tracker run.
    r = speedrun(*args, "--resume", env=ONE_THREAD, timeout=600)
    assert r.returncode == 0, r.stderr
    run = the_run(mlflow_server, out)
    assert run.info.status == "FINISHED"
    steps = read_jsonl(out / "steps.jsonl")
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    assert series(mlflow_server, run.info.run_id, "train/loss") == [(s["step"], s["loss"]) for s in steps]


@pytest.mark.slow
def test_a_server_killed_mid_run_holds_nothing_up_and_track_sync_fills_the_gap(tmp_path):
    out = tmp_path / "gap"
    with MLflowServer(tmp_path / "mlflow") as server:
        proc = start(*TINY, "--epochs", "2", "--log-every", "1", "--out", str(out), "--track", f"mlflow={server.uri}",
                     env=ONE_THREAD)
        wait_for(lambda: (out / "steps.jsonl").exists() and len(read_jsonl(out / "steps.jsonl")) >= 10, 300,
                 "10 steps")
        server.kill()
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr  # the run finished without its tracker
        assert "not sent" in stdout and f"speedrun track sync {out}" in stdout
        kept = json.loads((out / "trackers" / "mlflow.json").read_text())
        assert kept["sent"] < len(read_jsonl(out / "trackers" / "mlflow.jsonl"))
        one_line_error(speedrun("track", "sync", str(out)), "record(s) still kept in", code=3)
        server.start()  # the same port and database, back
        r = speedrun("track", "sync", str(out))
        assert r.returncode == 0, r.stderr
        assert "none left" in r.stdout
        run = the_run(server, out)
        assert run.info.status == "FINISHED"
        steps = read_jsonl(out / "steps.jsonl")
        assert series(server, run.info.run_id, "train/loss") == [(s["step"], s["loss"]) for s in steps]
        evals = read_jsonl(out / "metrics.jsonl")
        assert series(server, run.info.run_id, "val/top1") == [(e["step"], e["top1"]) for e in evals]
        assert {a.path for a in client(server).list_artifacts(run.info.run_id)} >= {"accuracy.png", "results.json"}


@pytest.mark.slow
def test_a_tracker_that_does_not_answer_at_the_start_is_one_line_exit_2_before_any_step(tmp_path):
    from postgres_server import free_port

    out = tmp_path / "r"
    r = speedrun(*TINY, "--out", str(out), "--track", f"mlflow=http://127.0.0.1:{free_port()}", env=ONE_THREAD,
                 timeout=300)
    one_line_error(r, "--track mlflow: the tracking server at http://127.0.0.1:", "did not take the run")
    assert not (out / "steps.jsonl").exists()


@pytest.mark.slow
def test_a_run_without_track_imports_nothing_of_mlflow():
    import subprocess
    import sys

    code = ("import sys; from speedrun import cli, engine, track, trackers; cli.build_parser(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlflow', 'wandb')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
