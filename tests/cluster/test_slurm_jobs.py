"""speedrun's jobs on a real Slurm cluster (tests/slurm_cluster.py), through the command line a user
types: `speedrun launch --provider slurm`, `ls`, `logs`, `kill`, `down`, and the trainer's files.

Runs are real `speedrun train` processes, one torchrun per node; the interruptions are Slurm's own:
`scontrol requeue`, a time limit's warning signal, a node whose slurmd and processes are killed.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from cli_run import in_terminal, terminal_exit, wait_for
from slurm_cluster import SlurmCluster, require
from speedrun.cli import main
from speedrun.cluster import make_job, open_job
from speedrun.cluster.registry import speedrun_home
from speedrun.cluster.slurm.config import SlurmConfig
from speedrun.cluster.slurm.scripts import array_script, batch_script, node_script, step_script
from speedrun.track import read_jsonl
from test_distributed import write_recipe

pytestmark = pytest.mark.slurm
ONE_THREAD = ["--env", "OMP_NUM_THREADS=1"]  # two processes per core at most: one thread each
TRAIN = ["-m", "speedrun", "train", "--device", "cpu", "--out", "{run_dir}"]
# Of write_recipe's 768 images in batches of 32: 480 steps, about 20 s of training on two nodes on a
# quiet machine here and 10-20 s to start. An interruption after 60 steps leaves far more to train
# than it takes to look at the run (the requeue test attaches to it first) and to interrupt it.
EPOCHS = 10  # 240 steps: a requeue after 60 leaves 180 to train, a node lost after 60 too


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    require("the Slurm tests")
    with SlurmCluster(3, workdir=tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture
def in_cluster(slurm, monkeypatch):
    """The module's cluster, reached as speedrun reaches it (SLURM_CONF); every job cancelled after
    the test and every node idle again, so that the next test has all three: a cancelled job's nodes
    stay "completing" for a moment, and a job started then is given another node than the test
    names (node1 and node3, not node2)."""
    for k, v in slurm.env.items():
        monkeypatch.setenv(k, v)
    yield slurm
    slurm.client("scancel", "--user", "root", check=False)
    slurm.wait_for_nodes("idle", slurm.node_names)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    """A run long enough to be interrupted mid-way (GroupNorm: the same losses on any split of the batch)."""
    return write_recipe(tmp_path_factory.mktemp("recipe") / "r.py", 2, 32, epochs=EPOCHS, model="resnet-fmnist-tiny-gn")


@pytest.fixture(scope="module")
def reference_run(recipe, tmp_path_factory) -> Path:
    """The uninterrupted run: the same recipe, two processes, on this machine."""
    out = tmp_path_factory.mktemp("reference") / "run"
    r = subprocess.run([sys.executable, "-m", "speedrun", "train", "--recipe", str(recipe), "--device", "cpu",
                        "--deterministic", "--log-every", "1", "--nproc-per-node", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def reference(reference_run) -> list[dict]:
    """The uninterrupted run's steps."""
    return read_jsonl(reference_run / "steps.jsonl")


def speedrun(capsys, *args: str) -> tuple[int, str, str]:
    """The command line, in this process: exit status, stdout, stderr."""
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def launch(capsys, name: str, run_root: Path, *args: str) -> Path:
    code, out, err = speedrun(capsys, "launch", name, "--provider", "slurm", "--run-root", str(run_root), *args)
    assert code == 0, out + err
    return Path(next(line for line in out.splitlines() if "run dir" in line).split("run dir ")[1].split(":")[0])


def ls_lines(capsys, name: str) -> list[str]:
    code, out, err = speedrun(capsys, "ls", name)
    assert code == 0, err
    return out.splitlines()


def steps_logged(run: Path) -> int:
    return len(read_jsonl(run / "steps.jsonl")) if (run / "steps.jsonl").exists() else 0


def check_resumed_exactly(run: Path, reference: list[dict]) -> dict:
    """The run finished with every step's loss equal to the uninterrupted run's and nothing redone."""
    results = json.loads((run / "results.json").read_text())
    assert results["status"] == "finished" and results["world_size"] == 2
    steps = read_jsonl(run / "steps.jsonl")
    assert [s["step"] for s in steps] == [s["step"] for s in reference]
    for ours, theirs in zip(steps, reference):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5), ours["step"]  # float noise of two processes
    assert results["interruptions"] and all(i["steps_redone"] == 0 for i in results["interruptions"])
    return results


def test_the_scripts_given_to_slurm_are_valid_bash_with_the_options_asked_for(tmp_path):
    config = SlurmConfig(partition="gpu", time="1:00:00", signal_lead_s=90, sbatch_args=("--exclusive",))
    batch = batch_script(job="j", name="train", nodes=2, run_dir="/r", cwd="/c", config=config, python="python3")
    node = node_script(job="j", name="train", nodes=2, run_dir="/r", env={"A": "it's"})
    array = array_script(job="j", name="ablate", count=4, limit=2, run_dir="/r", cwd="/c", config=config)
    step = step_script(job="j", name="check", nodes=2, run_dir="/r", cwd="/c", config=config, python="python3",
                       nproc_per_node=8, join_timeout_s=120, command="-m speedrun.cluster.allreduce --out '/r/c.json'")
    for text in (batch, node, array, step):
        (tmp_path / "s.sh").write_text(text)
        assert subprocess.run(["bash", "-n", tmp_path / "s.sh"], capture_output=True, text=True).stderr == ""
    sbatch = [ln.split(" ", 1)[1] for ln in batch.splitlines() if ln.startswith("#SBATCH ")]
    assert sbatch == ["--job-name=j", "--nodes=2", "--ntasks-per-node=1", "--chdir=/c",
                      "--output=/r/slurm/slurm-%j.out", "--open-mode=append", "--requeue", "--signal=B:USR1@90",
                      "--partition=gpu", "--time=1:00:00", "--exclusive"]
    assert "#SBATCH --array=0-3%2\n" in array and "export A='it'\"'\"'s'\n" in node
    # Slurm's warning can come before the run starts: the batch script traps it before it runs anything.
    lines = batch.splitlines()
    first_command = next(i for i, ln in enumerate(lines) if '"$python"' in ln or "scontrol" in ln or "srun" in ln)
    assert lines.index("trap warn USR1") < first_command


def test_a_job_waiting_for_nodes_is_pending_with_slurms_reason_until_killed(in_cluster, tmp_path, capsys):
    launch(capsys, "holder", tmp_path, "-n", "2", "--", "--no-python", "sleep", "600")  # two of the three nodes
    waiting = launch(capsys, "queued", tmp_path, "-n", "2", "--", *TRAIN, "--recipe", "tiny")
    wait_for(lambda: ls_lines(capsys, "queued")[-1].endswith(": PENDING (Resources)"), 60, "Slurm's reason")
    lines = ls_lines(capsys, "queued")
    assert [ln.split()[1:4] for ln in lines[1:3]] == [["0", "-", "pending"], ["1", "-", "pending"]]
    assert lines[3].startswith("  queued: slurm job ")
    code, out, err = speedrun(capsys, "kill", "queued")
    assert code == 0 and f"its logs stay in {waiting}" in out, out + err
    wait_for(lambda: "CANCELLED" in ls_lines(capsys, "queued")[-1], 60, "the queued job to be cancelled")
    code, out, _ = speedrun(capsys, "down", "queued")
    assert code == 0 and "job queued is down" in out
    code, _, err = speedrun(capsys, "ls", "queued")  # forgotten
    assert code == 2 and "no job named 'queued'" in err
    code, out, _ = speedrun(capsys, "down", "holder")
    assert code == 0 and "job holder is down" in out


def test_a_two_node_job_trains_and_ls_shows_slurms_state_next_to_speedruns(in_cluster, tmp_path, capsys):
    run = launch(capsys, "pair", tmp_path, "-n", "2", *ONE_THREAD, "--", *TRAIN, "--recipe", "tiny")
    wait_for(lambda: steps_logged(run) > 0 or (run / "results.json").exists(), 600, "the first steps")
    running = ls_lines(capsys, "pair")
    assert [ln.split()[1:4] for ln in running[1:3]] == [["0", "node1", "running"], ["1", "node2", "running"]]
    assert "  pair: slurm job " in running[3] and ": RUNNING on node[1-2]" in running[3]

    # `launch` again while it runs reconnects, and --wait waits for Slurm's job to end.
    code, out, err = speedrun(capsys, "launch", "pair", "--provider", "slurm", "-n", "2", "--run-root", str(tmp_path),
                              "--wait", "--", *TRAIN, "--recipe", "tiny")
    assert code == 0 and "reconnected" in out, out + err
    results = json.loads((run / "results.json").read_text())
    assert results["status"] == "finished" and results["world_size"] == 2
    done = ls_lines(capsys, "pair")
    assert [ln.split()[1:4] for ln in done[1:3]] == [["0", "node1", "succeeded"], ["1", "node2", "succeeded"]]
    assert done[3].endswith(": COMPLETED")
    code, out, _ = speedrun(capsys, "logs", "pair", "0", "-f")  # the job has ended: all of it, then done
    assert code == 0 and "epoch   4/4" in out
    tb = open_job("pair").tensorboard()  # `speedrun tb`: on this machine, over the shared run directory
    try:
        with urllib.request.urlopen(tb.url, timeout=30) as page:
            assert page.status == 200 and b"TensorBoard" in page.read()
    finally:
        tb.close()
    for i in (0, 1):  # the same layout as every provider's: a numbered command directory per task
        (cmd,) = (run / f"task-{i}" / "cmds").glob("*-train")
        assert (cmd / "status").read_text().strip() == "0" and (cmd / "node").read_text().strip() == f"node{i + 1}"

    # A finished run is never started again, even when Slurm requeues its job.
    results = (run / "results.json").read_text()
    job_id = (run / "slurm" / "job_id").read_text().strip()
    in_cluster.client("scontrol", "requeue", job_id)
    wait_for(lambda: ls_lines(capsys, "pair")[-1].endswith(": COMPLETED, requeued 1 time"), 120,
             "the requeued job to end")
    assert (run / "results.json").read_text() == results
    assert [len(list((run / f"task-{i}" / "cmds").glob("*-train"))) for i in (0, 1)] == [1, 1]
    assert "is complete: nothing to start again" in (run / "slurm" / f"slurm-{job_id}.out").read_text()


def test_a_requeue_mid_run_resumes_at_the_step_it_stopped_with_every_loss_equal(in_cluster, recipe, reference,
                                                                              tmp_path, capsys):
    run = launch(capsys, "requeued", tmp_path, "-n", "2", *ONE_THREAD, "--price-per-hour", "3.5", "--", *TRAIN,
                 "--recipe", str(recipe), "--deterministic", "--log-every", "1")
    wait_for(lambda: steps_logged(run) >= 60, 600, "60 steps")
    job_id = (run / "slurm" / "job_id").read_text().strip()
    assert f"epoch   1/{EPOCHS}" in attached_view("requeued", 0, f"speedrun-{job_id}")  # rank 0's log, live
    in_cluster.client("scontrol", "requeue", job_id)
    code, out, err = speedrun(capsys, "launch", "requeued", "--provider", "slurm", "-n", "2", "--run-root",
                              str(tmp_path), "--wait", "--", *TRAIN)
    assert code == 0, out + err
    results = check_resumed_exactly(run, reference)
    (recovery,) = results["recoveries"]
    assert recovery["slurm_job"] == int(job_id) and recovery["resumed"] and recovery["requeue"] == 1
    assert recovery["kind"] == "requeue" and "scontrol requeue" in recovery["reason"], recovery
    # Two allocated nodes at the price given at launch (the launch that reconnected gave none): the
    # cost counts the time the requeue lost.
    price = results["price"]
    assert (price["market"], price["machines"], price["usd_per_hour"]) == ("given", 2, 3.5)
    assert price["machine_type"].startswith("slurm node") and results["lost_s"] > 0
    assert results["cost_usd"] == pytest.approx(2 * 3.5 * (results["total_s"] + results["lost_s"]) / 3600)
    stopped = sorted((run / "task-0" / "cmds").glob("*-train"))[0] / "log"
    assert "on SIGTERM; the checkpoint holds this step" in stopped.read_text()
    check_first_start_stopped(run)
    assert ls_lines(capsys, "requeued")[3].endswith(": COMPLETED, requeued 1 time")


def check_first_start_stopped(run: Path) -> None:
    """Every task of the job's first start says it stopped at a step (exit 75, and the step in its
    log's last word), not that it failed, whatever torchrun made of the stop."""
    from speedrun.cluster.states import telling_line

    for task in ("task-0", "task-1"):
        first = sorted((run / task / "cmds").glob("*-train"))[0]
        lines = (first / "log").read_text().splitlines()
        why = telling_line(lines)
        assert (first / "status").read_text().strip() == "75", (task, lines[-20:])
        assert why.startswith("stopped at step ") and lines[-1].startswith("stopped at step "), (task, lines[-20:])


def attached_view(job_name: str, task: int, socket: str) -> str:
    """`speedrun attach`'s command line run in a terminal of its own, as a person would: what the
    session on the task's node shows in its first window (the task's log, followed live), after
    which the client detaches (exit status 0)."""
    pid, fd = in_terminal(open_job(job_name).attach_argv(task))

    def tmux(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["tmux", "-L", socket, *args], capture_output=True, text=True)
    try:
        session = f"{job_name}-{task}"
        clients = wait_for(lambda: tmux("list-clients", "-F", "#{client_session}").stdout.split(), 60,
                           "the attached client")
        view = wait_for(lambda: "epoch" in (text := tmux("capture-pane", "-p", "-t", f"={session}:train").stdout)
                        and text, 120, "the log in the attached view")
        windows = tmux("list-windows", "-t", f"={session}", "-F", "#{window_name}").stdout.split()
        tmux("detach-client", "-s", f"={session}")
        assert terminal_exit(pid, fd) == 0
        assert clients == [session] and windows == ["train", "shell"]
        return view
    finally:
        os.close(fd)
        tmux("kill-server")  # the test cluster tracks processes by parentage: tmux's server escapes it


def test_the_time_limits_warning_stops_the_run_at_a_step_and_the_requeued_job_finishes_it(
        in_cluster, reference_run, tmp_path, capsys):
    # slurmctld looks at time limits every 30 s and sends the warning at its first look after
    # `limit - lead`. The job is launched with a limit far off (15 minutes) and at once given a limit of
    # 2 minutes with a 3-minute lead: the warning is due already and comes at Slurm's next look,
    # within 30 s, before the run has started or while it trains; the run stops at a step (its first,
    # at the earliest) well before the limit. Then the limit goes back up, so the requeued start
    # finishes the run. The run must train for longer than those 30 s less its ~8 s start, however
    # fast this machine is: 40 s at the reference run's pace (two processes here; the job's two nodes
    # train at 0.8-2x that pace), and no longer: every second of it is trained once in the test.
    done = json.loads((reference_run / "results.json").read_text())
    per_epoch_s = (done["total_s"] - done["startup_s"]) / EPOCHS
    epochs = max(2, math.ceil(40 / per_epoch_s))
    recipe = write_recipe(tmp_path / "long.py", 2, 32, epochs=epochs, model="resnet-fmnist-tiny-gn")
    run = launch(capsys, "limited", tmp_path, "-n", "2", "--time", "15", "--signal-lead", "180",
                 "--max-requeues", "5", *ONE_THREAD, "--", *TRAIN, "--recipe", str(recipe), "--deterministic",
                 "--log-every", "1")
    job_id = (run / "slurm" / "job_id").read_text().strip()
    in_cluster.client("scontrol", "update", f"JobId={job_id}", "TimeLimit=2")
    batch = run / "slurm" / f"slurm-{job_id}.out"
    warning = "speedrun: Slurm warns that the time limit is near: asking the run to stop at a step"
    wait_for(lambda: batch.exists() and warning in batch.read_text(), 90, "Slurm's warning")
    in_cluster.client("scontrol", "update", f"JobId={job_id}", "TimeLimit=15")
    code, out, err = speedrun(capsys, "launch", "limited", "--provider", "slurm", "-n", "2", "--run-root",
                              str(tmp_path), "--wait", "--", *TRAIN)
    assert code == 0, out + err
    # Every step trained once (the requeue test checks the losses against an uninterrupted run).
    results = json.loads((run / "results.json").read_text())
    assert results["status"] == "finished" and results["world_size"] == 2 and results["epochs_run"] == epochs
    steps = [s["step"] for s in read_jsonl(run / "steps.jsonl")]
    assert steps == list(range(1, results["steps"] + 1))
    assert results["interruptions"] and all(i["steps_redone"] == 0 for i in results["interruptions"])
    warned = [r for r in results["recoveries"] if r["reason"].startswith("the time limit was near")]
    assert all(r["kind"] == "time_limit" for r in warned)
    assert warned and len(warned) == len(results["recoveries"]) == len(results["interruptions"])
    assert all(r["resumed"] and r["relaunch_s"] > 0 for r in warned)
    assert "on a stop request" in batch.read_text()  # every rank stopped after the same step
    check_first_start_stopped(run)


def test_a_command_that_fails_before_any_checkpoint_is_not_requeued_and_ls_says_why(in_cluster, tmp_path, capsys):
    code, out, err = speedrun(capsys, "launch", "broken", "--provider", "slurm", "-n", "2", "--run-root",
                              str(tmp_path), "--wait", "--", "--no-python", "false")
    assert code == 3, out + err
    lines = ls_lines(capsys, "broken")
    assert [ln.split()[3:5] for ln in lines[1:3]] == [["failed", "(1)"], ["failed", "(1)"]]
    assert lines[-1].endswith(": FAILED, exit 1: the step failed (exit 1); not requeued: no checkpoint to "
                              "resume from"), lines


def test_requeues_beyond_the_cap_end_the_job_and_ls_says_so(in_cluster, tmp_path, capsys):
    run = launch(capsys, "capped", tmp_path, "-n", "1", "--max-requeues", "0", "--", "--no-python", "sleep", "300")
    wait_for(lambda: list((run / "task-0" / "cmds").glob("*-train")), 120, "the command to start")
    in_cluster.client("scontrol", "requeue", (run / "slurm" / "job_id").read_text().strip())
    (result,) = open_job("capped").wait(timeout=300, check=False)
    assert not result.ok  # ended by the requeue's SIGTERM, and not started again:
    assert len(list((run / "task-0" / "cmds").glob("*-train"))) == 1
    assert ls_lines(capsys, "capped")[-1].endswith(": FAILED, exit 3, requeued 1 time: Slurm started this job 1 "
                                                   "times after the first, more than max_requeues (0): giving up")


@pytest.mark.parametrize("args, line", [
    (["--partition", "gpu"], "speedrun: error: partition 'gpu' does not exist on this cluster (its partitions: debug)"),
    (["-n", "5"], "speedrun: error: the job asks for 5 nodes, but partition debug has 3"),
    (["--time", "1:2:3:4"], "speedrun: error: time limit '1:2:3:4' is not one Slurm reads: give minutes (90), "
                            "hours:minutes:seconds (1:30:00) or days-hours[:minutes[:seconds]] (2-00:00:00)"),
    (["--hosts", "a,b"], "speedrun: error: hosts were given for the slurm provider: Slurm chooses the nodes "
                         "(give their number, -n, and a partition)"),
    (["--recover"], "speedrun: error: --recover does not apply to the slurm provider: a Slurm job requeues itself "
                    "and resumes (--max-requeues, docs/slurm.md)"),
])
def test_bad_input_is_one_line_and_exit_2_and_nothing_is_made(in_cluster, tmp_path, capsys, args, line):
    code, out, err = speedrun(capsys, "launch", "bad", "--provider", "slurm", "--run-root", str(tmp_path), *args,
                              "--", *TRAIN, "--recipe", "tiny")
    assert (code, err.strip()) == (2, line), out
    assert not list(tmp_path.iterdir()) and in_cluster.client("squeue", "-h", "--name", "bad").stdout.strip() == ""


def test_no_sbatch_on_path_is_one_line_and_exit_2(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", "/nonexistent")
    code, out, err = speedrun(capsys, "launch", "bad", "--provider", "slurm", "--run-root", str(tmp_path), "--",
                              *TRAIN, "--recipe", "tiny")
    assert code == 2 and err.startswith("speedrun: error: sinfo is not on PATH: the slurm provider runs where "
                                        "Slurm's clients are"), err


def test_ablate_on_a_slurm_job_runs_as_a_job_array_and_compare_reads_it_back(in_cluster, tmp_path, capsys):
    job = make_job("ablated", 2, provider="slurm", run_root=str(tmp_path))
    code, out, err = speedrun(capsys, "ablate", "tiny", "--only", "warmup", "--seeds", "1", "--epochs", "1",
                              "--target", "top1=0.3", "--job", "ablated")
    assert code == 0, out + err
    assert "slurm job array " in out and ": 2 commands, at most 2 at once" in out
    for variant in ("full", "warmup"):
        done = json.loads((Path(job.run_dir) / "ablate-tiny" / variant / "seed0" / "results.json").read_text())
        assert done["status"] in ("finished", "target_reached")
        assert done["recipe"]["name"] == ("tiny" if variant == "full" else "tiny-no-warmup")
    elements = sorted(p.name for p in (Path(job.run_dir) / "slurm" / "ablate").glob("*.out"))
    assert elements == ["0.out", "1.out"]  # one array element per run
    code, out, err = speedrun(capsys, "compare", "ablated", "--plot", str(tmp_path / "job.png"))
    assert code == 0 and "2 runs" in out, out + err


def test_tune_on_a_slurm_job_runs_each_trial_as_a_one_node_slurm_job_and_reports_here(in_cluster, tmp_path, capsys):
    job = make_job("tuned", 2, provider="slurm", run_root=str(tmp_path))
    (tmp_path / "space.py").write_text("from speedrun.tune.space import Range\n"
                                       "space = {'label_smoothing': Range(0, 0.1)}\n")
    code, out, err = speedrun(capsys, "tune", "tiny", "--job", "tuned", "--epochs", "1", "--target", "top1=0.3",
                              "--trials", "3", "--space", str(tmp_path / "space.py"), "--device", "cpu", "--json")
    assert code == 0, out + err
    summary = json.loads(out[out.index("{"):])
    assert sorted(t["number"] for t in summary["trials"]) == [0, 1, 2]
    assert all(t["state"] == "complete" for t in summary["trials"]), summary["trials"]
    assert "trial 0 on task 0:" in err and "trial 1 on task 1:" in err  # two at once: the job's two slots
    nodes = set()
    for t in summary["trials"]:
        folder = Path(job.run_dir) / "slurm" / f"trial-{t['number']:03d}"  # a Slurm job of its own
        assert (folder / "status").read_text().strip() == "0" and (folder / "job_id").exists()
        nodes.add((folder / "node").read_text().strip())
        results = json.loads((Path(job.run_dir) / "tune-tiny" / t["dir"] / "results.json").read_text())
        assert results["status"] == "target_reached" and results["recipe"]["name"] == f"tiny-trial{t['number']:03d}"
    assert nodes <= {"node1", "node2", "node3"} and len(nodes) >= 2
    local = speedrun_home() / "tune" / "tuned" / "tune-tiny"
    assert (local / "best_recipe.py").exists()
    assert all((local / t["dir"] / "results.json").exists() for t in summary["trials"])


def test_a_command_started_alone_on_a_slurm_job_is_running_then_killed_with_the_job(in_cluster, tmp_path):
    job = make_job("alone", 2, provider="slurm", run_root=str(tmp_path))
    assert job.command_state(1, "nap") == "none"
    job.start_command(1, "echo task $SPEEDRUN_TASK of $SPEEDRUN_NUM_TASKS on $SPEEDRUN_PROVIDER; echo $MINE; "
                      "exec sleep 300", name="nap", cwd=str(tmp_path), env={"MINE": "given"})
    wait_for(lambda: job.command_output(1, "nap").startswith("task 1 of 2 on slurm\ngiven"), 60, "the command to start")
    assert job.command_state(1, "nap") == "running"
    assert job.kill() == []  # speedrun kill: the job's commands too
    wait_for(lambda: job.command_state(1, "nap") != "running", 60, "the command to end")
    assert job.command_state(1, "nap") in ("143", "killed")  # SIGTERM's status, or none written before SIGKILL
    job.start_command(1, "exit 3", name="nap", cwd=str(tmp_path), env={})  # started again: its state anew
    wait_for(lambda: job.command_state(1, "nap") not in ("running", "143", "killed"), 60, "the second start to end")
    assert job.command_state(1, "nap") == "3"


def test_check_runs_as_a_slurm_job_of_its_own_and_measures_the_nodes_all_reduce(in_cluster, tmp_path, capsys):
    job = make_job("checked", 2, provider="slurm", run_root=str(tmp_path))
    code, out, err = speedrun(capsys, "check", "checked", "--size", "1", "--iters", "3")
    assert code == 0, out + err
    res = json.loads((Path(job.run_dir) / "check.json").read_text())
    assert (res["backend"], res["ranks"], res["nodes"], res["machines"]) == ("gloo", 2, 2, 2)
    assert [r["bytes"] for r in res["results"]][-1] == 1 << 20 and all(r["wrong"] == 0 for r in res["results"])
    for r in res["results"]:  # busbw = algbw x 2(n-1)/n, n = 2
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"]) and r["busbw_GBps"] > 0
    assert f"verdict: {res['verdict']}" in out and "no nominal bandwidth is known" in res["verdict"]
    folder = Path(job.run_dir) / "slurm" / "check"
    assert (folder / "status").read_text().strip() == "0" and list(folder.glob("slurm-*.out"))
    assert not (Path(job.run_dir) / "slurm" / "job_id").exists()  # the job's own Slurm job is not this one
