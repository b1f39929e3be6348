"""`--track mlflow`: a run's parameters, metrics, tags and files in a real MLflow tracking server
(tests/mlflow_server.py), read back through MLflow's own client; a stopped and resumed run is one
MLflow run; a server that dies mid-run holds nothing up, and `speedrun track sync` fills the gap.
`--track wandb`: W&B offline (WANDB_MODE=offline), its run files read back with wandb's own reader
(`wandb leet inspect --json`). An ablation: an MLflow parent run with its runs as children, and
one W&B group."""
import json
import os
import signal
from pathlib import Path

import pytest
from cli_run import one_line_error, speedrun, speedrun_here, start, wait_for
from mlflow_server import MLflowServer
from wandb_files import wandb_env, wandb_runs, wandb_series

from speedrun.errors import EXIT_RESUMABLE
from speedrun.files import read_jsonl

ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}
TINY = ["train", "--recipe", "tiny", "--device", "cpu"]


@pytest.mark.parametrize("args, line", [
    (["--track", "neptune"], "bad --track 'neptune': give mlflow[=URI] or wandb[=[ENTITY/]PROJECT]"),
    (["--track", "mlflow="], "bad --track 'mlflow=': give mlflow[=URI] or wandb[=[ENTITY/]PROJECT]"),
    (["--track-checkpoints"], "--track-checkpoints uploads to a tracker: give --track too"),
    (["--track", "wandb", "--track-group", "it's"],
     "bad --track-group \"it's\": give a name of 1-128 characters without quotes"),
])
def test_bad_track_settings_are_one_line_and_exit_2(tmp_path, args, line):
    one_line_error(speedrun_here(*TINY, "--out", str(tmp_path / "r"), *args), line)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("track, line", [
    ('["neptune"]', "bad --track 'neptune': give mlflow[=URI] or wandb[=[ENTITY/]PROJECT]"),
    ("3", "`track` must be a list of --track values such as"),
])
def test_a_recipe_files_track_is_read_and_refused_like_the_option(tmp_path, track, line):
    recipe = tmp_path / "mine.py"
    recipe.write_text(f"from speedrun.recipes import BUILTIN\nrecipe = BUILTIN['tiny']\ntrack = {track}\n")
    one_line_error(speedrun_here("train", "--recipe", str(recipe), "--out", str(tmp_path / "r")), line)
    assert not (tmp_path / "r").exists()


def test_track_sync_of_a_run_without_trackers_is_one_line_and_exit_2(tmp_path):
    one_line_error(speedrun_here("track", "sync", str(tmp_path)), "it ran without --track")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    with MLflowServer(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


def the_run(server, run_dir):
    """The MLflow run(s) named after `run_dir`, in the default experiment; exactly one is expected."""
    c = server.client()
    experiment = c.get_experiment_by_name("speedrun")
    runs = c.search_runs([experiment.experiment_id], filter_string=f"attributes.run_name = '{run_dir.name}'")
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0]


def series(server, run_id, key):
    return [(m.step, m.value) for m in sorted(server.client().get_metric_history(run_id, key), key=lambda m: m.step)]


@pytest.mark.slow
def test_a_run_stopped_and_resumed_is_one_tracker_run_read_back_whole_through_mlflow_and_wandbs_reader(
        mlflow_server, tmp_path):
    # One run, two trackers (MLflow's server and W&B offline), SIGTERMed mid-epoch and resumed:
    # each tracker holds one run with the parameters, tags, unbroken series and files.
    out, env = tmp_path / "tracked", wandb_env(tmp_path)
    args = [*TINY, "--epochs", "2", "--log-every", "5", "--out", str(out)]
    proc = start(*args, "--track", f"mlflow={mlflow_server.uri}", "--track", "wandb=team/bench", env=env)
    wait_for(lambda: (out / "steps.jsonl").exists() and len(read_jsonl(out / "steps.jsonl")) >= 4, 300,
             "20 steps (4 logged)")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_RESUMABLE, err
    assert the_run(mlflow_server, out).info.status == "KILLED"
    stopped_at = read_jsonl(out / "steps.jsonl")[-1]["step"]  # a stop logs its last step
    # The resume needs no --track: the run directory knows its tracker runs.
    r = speedrun(*args, "--resume", env=env, timeout=600)
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
    # Every point as the run's own records have it, at the optimizer step, with no gap or repeat.
    evals, steps = read_jsonl(out / "metrics.jsonl"), read_jsonl(out / "steps.jsonl")
    logged = set(range(5, evals[-1]["step"] + 1, 5)) | {e["step"] for e in evals} | {stopped_at}
    assert [s["step"] for s in steps] == sorted(logged)  # every 5th step, each epoch's last, the stop's
    for key in ("top1", "top5", "loss"):
        assert series(mlflow_server, run.info.run_id, f"val/{key}") == [(e["step"], e[key]) for e in evals]
    assert series(mlflow_server, run.info.run_id, "train/loss") == [(s["step"], s["loss"]) for s in steps]
    assert series(mlflow_server, run.info.run_id, "train/lr") == [(s["step"], s["lr"]) for s in steps]
    results = json.loads((out / "results.json").read_text())
    summary = run.data.metrics
    assert summary["total_s"] == results["total_s"] and summary["best/top1"] == results["best"]["top1"]
    assert summary["epochs_run"] == 2
    names = {a.path for a in mlflow_server.client().list_artifacts(run.info.run_id)}
    assert {"accuracy.png", "results.json", "metrics.jsonl"} <= names and "checkpoint.pt" not in names
    got = mlflow_server.client().download_artifacts(run.info.run_id, "results.json", str(tmp_path))
    assert json.loads(open(got).read()) == results

    # W&B offline, read back with wandb's own reader: one file per start, both of the one run
    # (`wandb sync` makes them one), the first ended as stopped (75), the two histories the run's
    # series without a gap or a repeat; the config and files as the run has them.
    state = json.loads((out / "trackers" / "wandb.json").read_text())
    assert f"tracked: W&B offline run {state['run_id']} in {out / 'trackers' / 'wandb'}" in r.stdout
    assert "wandb:" not in r.stdout + r.stderr + err  # wandb's own lines stay out of the run's
    (first, config, before, stopped), (wb, _, after, finished) = wandb_runs(out)
    assert first["run_id"] == wb["run_id"] == state["run_id"] and stopped == [EXIT_RESUMABLE] and finished == [0]
    assert wb["project"] == "bench" and wb["entity"] == "team" and wb["display_name"] == "tracked"
    recipe = {k: v for k, v in params.items() if k.startswith("recipe.")}  # strings in both (settings: W&B's types)
    assert {k: config[k] for k in recipe} == recipe and config["speedrun.recipe"] == "tiny"  # set at the start
    assert "recipe:tiny" in first["tags"] and "world_size:1" in first["tags"] and "provider:none" in first["tags"]
    assert wandb_series(before, "train/loss") + wandb_series(after, "train/loss") == \
        [(s["step"], s["loss"]) for s in steps]
    for key in ("top1", "top5", "loss"):
        assert wandb_series(before, f"val/{key}") + wandb_series(after, f"val/{key}") == \
            [(e["step"], e[key]) for e in evals]
    assert after[results["steps"]]["total_s"] == results["total_s"]
    files = {p.name for p in (out / "trackers" / "wandb").glob("offline-run-*/files/*")}
    assert {"results.json", "metrics.jsonl", "accuracy.png"} <= files


@pytest.mark.slow
def test_a_server_killed_mid_run_holds_nothing_up_and_track_sync_fills_the_gap(mlflow_server, tmp_path):
    out, server = tmp_path / "gap", mlflow_server
    # The tracker named by the recipe file, not by --track.
    recipe = tmp_path / "tracked.py"
    recipe.write_text(f"from speedrun.recipes import BUILTIN\nrecipe = BUILTIN['tiny']\n"
                      f"track = ['mlflow={server.uri}']\n")
    try:
        proc = start("train", "--recipe", str(recipe), "--device", "cpu", "--epochs", "1", "--log-every", "1",
                     "--track-checkpoints", "--out", str(out), env=ONE_THREAD)
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
        # --track-checkpoints: the final checkpoint too, sent with the rest once the server is back.
        assert {a.path for a in server.client().list_artifacts(run.info.run_id)} >= {"accuracy.png", "results.json",
                                                                                    "checkpoint.pt"}
        got = server.client().download_artifacts(run.info.run_id, "checkpoint.pt", str(tmp_path))
        assert Path(got).read_bytes() == (out / "checkpoint.pt").read_bytes()
    finally:
        if server.proc is None:  # the module's other tests use it
            server.start()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mlflow", "wandb"])
def test_a_tracker_that_does_not_take_the_run_at_the_start_is_one_line_exit_2_before_any_step(tmp_path, kind):
    from postgres_server import free_port

    out, nobody = tmp_path / "r", f"http://127.0.0.1:{free_port()}"
    if kind == "mlflow":  # no server there
        r = speedrun(*TINY, "--out", str(out), "--track", f"mlflow={nobody}", env=ONE_THREAD, timeout=300)
        one_line_error(r, f"--track mlflow: the tracking server at {nobody} did not take the run")
    else:  # W&B online without an API key (and its server, were it asked, on loopback)
        env = wandb_env(tmp_path, WANDB_MODE="online", WANDB_BASE_URL=nobody, HOME=str(tmp_path))
        r = speedrun(*TINY, "--out", str(out), "--track", "wandb", env=env, timeout=300)
        one_line_error(r, "--track wandb: W&B did not take the run (project speedrun): UsageError: No API key")
    assert not (out / "steps.jsonl").exists()


@pytest.mark.slow
def test_a_run_without_track_imports_nothing_of_mlflow_nor_another_commands_module():
    import subprocess
    import sys

    # `speedrun train`'s parser first (speedrun.cli's routing table), then every command's.
    code = ("import sys; from speedrun import cli; cli.build_parser(['train']); "
            "print(sorted(m for m in sys.modules if m.startswith(('speedrun.cluster', 'speedrun.tune.cli', "
            "'speedrun.trackers.cli', 'speedrun.data.cli', 'speedrun.experiment_cli', 'mlflow', 'wandb')))); "
            "from speedrun import engine, track, trackers; cli.build_parser(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlflow', 'wandb')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split("\n")[:2] == ["[]", "[]"], r.stdout + r.stderr


@pytest.mark.slow
def test_an_ablation_is_an_mlflow_parent_with_its_runs_as_children_and_one_wandb_group(mlflow_server, tmp_path):
    out = tmp_path / "abl"
    env = wandb_env(tmp_path, MLFLOW_EXPERIMENT_NAME="ablations", MLFLOW_TRACKING_URI=mlflow_server.uri)
    r = speedrun("ablate", "tiny", "--only", "zero-init", "--epochs", "1", "--device", "cpu", "--out", str(out),
                 "--track", "mlflow", "--track", "wandb", env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    c = mlflow_server.client()
    experiment = c.get_experiment_by_name("ablations").experiment_id
    [parent] = c.search_runs([experiment], "tags.`speedrun.kind` = 'group' and tags.`speedrun.group` = 'abl'")
    assert parent.info.run_name == "abl" and parent.info.status == "FINISHED"
    children = c.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(ch.info.run_name for ch in children) == ["full/seed0", "zero-init/seed0"]
    assert sorted(ch.data.tags["speedrun.recipe"] for ch in children) == ["tiny", "tiny-no-zero-init"]
    assert all(ch.info.status == "FINISHED" and ch.data.tags["speedrun.group"] == "abl" for ch in children)
    for variant in ("full", "zero-init"):
        [(run, _, history, _)] = wandb_runs(out / variant / "seed0")
        assert run["run_group"] == "abl" and run["display_name"] == f"{variant}/seed0" and history
    # compare reads the experiment's runs as it reads their folders: the same table.
    from_mlflow, from_folders = (speedrun("compare", source, "--json", "--plot", str(tmp_path), env=env)
                                 for source in ("mlflow://ablations", str(out)))
    assert from_mlflow.returncode == 0 and from_folders.returncode == 0, from_mlflow.stderr + from_folders.stderr
    mlflow_rows, folder_rows = (rows_by_run(r.stdout, prefix) for r, prefix in
                                ((from_mlflow, "mlflow://ablations/"), (from_folders, f"{out}/")))
    assert mlflow_rows == folder_rows and sorted(mlflow_rows) == ["full/seed0", "zero-init/seed0"]


@pytest.mark.slow
def test_compare_of_an_mlflow_experiment_that_is_not_there_is_one_line_exit_2(mlflow_server):
    r = speedrun("compare", "mlflow://no-such-experiment", env={**ONE_THREAD, "MLFLOW_TRACKING_URI": mlflow_server.uri})
    one_line_error(r, "nothing to compare: mlflow://no-such-experiment: no such MLflow experiment at "
                   f"{mlflow_server.uri}")


def rows_by_run(stdout, prefix):
    """`compare --json`'s rows by their run's label, less `prefix`."""
    return {row.pop("run").removeprefix(prefix): row for row in json.loads(stdout)}
