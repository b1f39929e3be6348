"""`speedrun tune`: the search space as data, the pruning rule, bad input before any trial, and
real searches of the tiny recipe (real Optuna, real `speedrun train` trials): pruning at a step,
a best recipe that trains, a failing trial recorded with its reason, an interrupted search
continued with no trial lost or run twice."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from cli_run import one_line_error, speedrun, speedrun_here, start

from speedrun.files import read_jsonl
from speedrun.recipes import load_recipe, recipe_source
from speedrun.tune import asha
from speedrun.tune.cli import parse_budget
from speedrun.tune.space import Choice, Range, apply, check_space, corners, default_space, peak_lr
from speedrun.tune.trials import LocalTrial

TINY = load_recipe("tiny")


# The space, as data.

def test_the_default_space_centres_the_lr_on_the_suggestion_and_spans_the_recipes_own_values():
    space = default_space(TINY, suggested_recipe_lr=0.1)
    centre = 0.1 / peak_lr(TINY)  # 0.5: the range reaches 3x the recipe's own LR too
    assert space["lr_scale"] == Range(centre / 3, 3, log=True)
    assert default_space(TINY, suggested_recipe_lr=0.8)["lr_scale"] == Range(1 / 3, 0.8 / peak_lr(TINY) * 3, log=True)
    assert space["batch_size"] == Choice((32, 64, 128)) and space["first_size"] == Choice((15, 20))
    assert space["weight_decay"] == Range(5e-5, 5e-3, log=True) and space["ema"] == Choice((False, True))
    assert default_space(TINY)["lr_scale"] == Range(1 / 3, 3, log=True)  # no suggestion: the recipe's own LR
    check_space(space)


def test_a_trials_recipe_is_the_recipe_with_each_field_applied():
    r = apply(TINY, {"lr_scale": 0.5, "batch_size": 128, "epochs_scale": 1.5, "label_smoothing": 0.1,
                     "first_size": 15, "ema": True, "weight_decay": 1e-3}, "t")
    assert r.name == "t" and r.epochs == 6 and r.ema_decay == 0.998 and r.optimizer.label_smoothing == 0.1
    assert r.optimizer.weight_decay == 1e-3 and r.phases[0].size == 15 and r.phases[-1].size == 28
    # The batch doubles in every phase, and its LR with it (the same LR per image), then x0.5.
    assert [p.batch_size for p in r.phases] == [128, 256, 256]
    assert r.phases[0].lr == pytest.approx((0.05, 0.2)) and r.phases[1].lr == pytest.approx(0.2)


@pytest.mark.parametrize("space, line", [
    ({"lr_scale": Range(1, 1)}, "lr_scale: the range 1..1 is empty"),
    ({"lr_scale": Range(3, 1)}, "lr_scale: the range 3..1 is inverted (low > high)"),
    ({"lr_scale": Range(0, 1, log=True)}, "lr_scale: a log range must be above 0"),
    ({"momentum": Range(0.8, 0.99)}, "unknown field 'momentum' (fields: lr_scale, weight_decay"),
    ({"ema": Choice(())}, "ema: a choice needs at least one value"),
    ({}, "must be a non-empty dict"),
])
def test_a_bad_space_is_one_line_naming_the_field(space, line):
    with pytest.raises(Exception, match=line.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        check_space(space)


def test_the_corners_are_every_low_end_every_high_end_and_each_choice():
    space = {"lr_scale": Range(0.5, 2), "batch_size": Choice((32, 64, 128))}
    assert corners(space) == [{"lr_scale": 0.5, "batch_size": 32}, {"lr_scale": 2, "batch_size": 128},
                              {"lr_scale": 0.5, "batch_size": 64}, {"lr_scale": 0.5, "batch_size": 128}]


# The pruning rule.

def evals(*points):
    return [{"wall_s": t, "top1": v} for t, v in points]


def test_a_trial_behind_the_best_at_a_rung_stops_and_the_first_there_goes_on():
    ahead = evals((5, 0.6), (12, 0.8))
    alone = asha.judge(evals((4, 0.3), (10, 0.5)), [], "top1", 10, 3)
    assert alone.go_on and alone.others == 0  # first to the rung
    behind = asha.judge(evals((4, 0.3), (10, 0.5)), [(ahead, False)], "top1", 10, 3)
    assert not behind.go_on and behind.bar == 0.6 and behind.value == 0.5  # the other had 0.6 by 10 s
    # A trial that ended before the rung counts with its final best (it reached the target at 12 s: 0.8).
    assert asha.judge(evals((4, 0.3), (20, 0.7)), [(ahead, True)], "top1", 20, 3).bar == 0.8
    # One still running that has not reached the rung does not count yet.
    assert asha.judge(evals((4, 0.3), (10, 0.5)), [(evals((4, 0.9)), False)], "top1", 10, 3).go_on
    # Among 6 at a rung, the best 6 // 3 = 2 go on.
    others = [(evals((9, v)), True) for v in (0.9, 0.7, 0.4, 0.3, 0.2)]
    assert asha.judge(evals((9, 0.8)), others, "top1", 10, 3).go_on
    assert not asha.judge(evals((9, 0.6)), others, "top1", 10, 3).go_on
    assert asha.judge(evals((11, 0.9)), [], "top1", 10, 3) is None  # nothing by the rung
    assert asha.rungs(3, 3, 100) == [3, 9, 27, 81]


def test_a_budget_is_a_duration_or_dollars():
    assert parse_budget("2h") == (7200, None) and parse_budget("90m") == (5400, None)
    assert parse_budget("600") == (600, None) and parse_budget("$30") == (None, 30)
    for bad in ("2 days", "$3h", "-5m", "0", ""):
        with pytest.raises(Exception, match="give a duration"):
            parse_budget(bad)


# Bad input: one line, exit 2, before any trial (or lr-find) starts.

@pytest.mark.parametrize("args, line", [
    (["--target", "top7=0.5"], "target 'top7=0.5': expected METRIC=VALUE with METRIC one of top1, top5"),
    ([], "recipe tiny has no target, and a search needs one: give --target top1=0.9"),
    (["--target", "top1=0.5", "--parallel", "999"], "--parallel 999: this machine has"),
    (["--target", "top1=0.5", "--budget", "30s"], "--budget 30s cannot hold one trial: the first rung"),
    (["--target", "top1=0.5", "--objective", "cost"], "--objective cost and a $ budget need the machine's price"),
    (["--target", "top1=0.5", "--budget", "soon"], "--budget 'soon': give a duration"),
    (["--target", "top1=0.5", "--env", "novalue"], "bad --env 'novalue': write KEY=VALUE"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_trial(tmp_path, args, line):
    one_line_error(speedrun_here("tune", "tiny", "--trials", "2", "--out", str(tmp_path / "s"), *args), line)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("text, line", [
    ("space = {'lr_scale': Range(2, 2)}", "lr_scale: the range 2..2 is empty"),
    ("space = {'lr_scale': Range(2, 1)}", "lr_scale: the range 2..1 is inverted"),
    ("space = {'nesterov': Choice((True, False))}", "unknown field 'nesterov'"),
    ("space = {'batch_size': Choice((64, 10**6))}", "the search space reaches a recipe that cannot run: batch_size"),
    ("space = 5", "must be a non-empty dict"),
    ("raise ValueError('oops')", "failed to load: ValueError: oops"),
])
def test_a_bad_space_file_is_one_line_and_exit_2_before_any_trial(tmp_path, text, line):
    space = tmp_path / "space.py"
    space.write_text(f"from speedrun.tune.space import Choice, Range\n{text}\n")
    one_line_error(speedrun_here("tune", "tiny", "--target", "top1=0.5", "--trials", "2", "--space", str(space),
                                 "--out", str(tmp_path / "s")), line)
    assert not (tmp_path / "s").exists()


def test_a_directory_holding_something_else_is_refused(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "notes.txt").write_text("mine")
    one_line_error(speedrun_here("tune", "tiny", "--target", "top1=0.5", "--trials", "2", "--no-lr-find",
                                 "--out", str(tmp_path / "s")), "holds other things than a search (notes.txt)")


@pytest.mark.slow
def test_a_trial_asked_to_stop_before_its_run_directory_exists_stops_at_its_first_step(tmp_path):
    # A budget can end between a trial's start and its trainer making its run directory
    # (benchmarks/tune.py met it: FileNotFoundError for trials/024/stop, the search ended as an
    # internal error). The request waits in the directory; the trainer honours it at its first step.
    run = LocalTrial(0, tmp_path)
    run.write_recipe(recipe_source(TINY, "# a trial\n"))
    run.start(0, None, ("--device", "cpu"), {**os.environ, "OMP_NUM_THREADS": "1"})
    run.stop("the budget (60 s of search) is spent")
    run.wait()
    assert run.exit_code == 75 and run.results()["status"] == "stopped" and run.results()["steps"] <= 2


# Real searches of the tiny recipe.

SPACE = """from speedrun.tune.space import Choice, Range

# 1: the recipe's LR; 0.01: one that learns slowly (pruned); 1e6: the loss becomes NaN (the trial fails).
space = {"lr_scale": Choice((1.0, 0.01, 1e6)), "label_smoothing": Range(0.0, 0.1)}
"""
SMOOTHING_ONLY = "from speedrun.tune.space import Range\nspace = {'label_smoothing': Range(0, 0.1)}\n"
# Seed 2 draws lr_scale 1e6, 1, 1e6, 0.01, 1 for trials 0-4 (TPE's first trials are random): two that fail,
# one that is pruned (judged at its rung against trial 1, which started before it), two that finish.
SEARCH = ["tiny", "--epochs", "8", "--target", "top1=0.75", "--first-rung", "3", "--seed", "2", "--device", "cpu"]


def study_trials(out):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name="speedrun-tune", storage=f"sqlite:///{out / 'study.db'}").get_trials()


@pytest.fixture(scope="module")
def five_trials(tmp_path_factory):
    """A five-trial search, two at a time, of SPACE (made once: the two tests below read it)."""
    tmp_path = tmp_path_factory.mktemp("five")
    (tmp_path / "space.py").write_text(SPACE)
    out = tmp_path / "search"
    proc = speedrun("tune", *SEARCH, "--trials", "5", "--parallel", "2", "--space", str(tmp_path / "space.py"),
                    "--out", str(out), "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr
    return out, json.loads(proc.stdout)


@pytest.mark.slow
def test_a_five_trial_search_two_at_a_time_prunes_at_a_step_and_records_failures(five_trials):
    out, summary = five_trials
    trials = study_trials(out)
    assert len(trials) == 5 and len(summary["trials"]) == 5
    assert [t.params["lr_scale"] for t in trials] == [1e6, 1.0, 1e6, 0.01, 1.0]
    # Every trial is an ordinary run in trials/NNN.
    for t in trials:
        assert t.user_attrs["dir"] == f"trials/{t.number:03d}" and (out / t.user_attrs["dir"] / "results.json").exists()
    # At least one was stopped at a step: its checkpoint holds the step the study recorded, before its end.
    pruned = [t for t in trials if t.user_attrs["state"] == "pruned"]
    assert pruned, [(t.number, t.user_attrs) for t in trials]
    for t in pruned:
        run = out / t.user_attrs["dir"]
        results = json.loads((run / "results.json").read_text())
        saved = torch.load(run / "checkpoint.pt", weights_only=False)
        assert results["status"] == "stopped" and saved["state"]["step"] == t.user_attrs["step"] == results["steps"]
        assert results["epochs_run"] < 8 and t.user_attrs["value"] < t.user_attrs["bar"]
        assert t.user_attrs["checkpoint"].startswith(f"{t.user_attrs['dir']}/checkpoint.pt (at step {results['steps']}")
        assert "behind at the" in t.user_attrs["why"] and str(t.state) == "TrialState.PRUNED"
    # The 1e6 x LR trials failed, each recorded with its reason, and the search went on.
    failed = [t for t in trials if t.user_attrs["state"] == "failed"]
    assert [t.number for t in failed] == [0, 2] and all(str(t.state) == "TrialState.FAIL" for t in failed)
    assert all(t.user_attrs["why"].startswith("loss became nan at epoch 1") for t in failed)
    # The complete ones are sorted first, by their time.
    complete = [r for r in summary["trials"] if r["state"] == "complete"]
    assert complete and all(r["params"]["lr_scale"] == 1.0 for r in complete)
    assert [r["value"] for r in complete] == sorted(r["value"] for r in complete)
    assert summary["best"] == summary["trials"][0] == complete[0]
    assert (out / "tune.png").read_bytes()[:4] == b"\x89PNG" and json.loads((out / "tune.json").read_text()) == summary


@pytest.mark.slow
def test_the_searchs_best_recipe_trains_as_any_recipe_does(five_trials, tmp_path):
    out, summary = five_trials
    best = out / "best_recipe.py"
    assert f"Trial {summary['best']['number']} of 5" in best.read_text()
    run = speedrun("train", "--recipe", str(best), "--device", "cpu", "--seed", "2", "--out", str(tmp_path / "again"),
                   timeout=300)
    assert run.returncode == 0, run.stderr
    again = json.loads((tmp_path / "again" / "results.json").read_text())
    assert again["recipe"]["name"] == "tiny-tuned" and again["status"] == "target_reached"


def wait_for_lines(proc: subprocess.Popen, *wanted: str) -> list[str]:
    """The lines `proc` prints, read until each of `wanted` has been in one."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if all(any(w in ln for ln in seen) for w in wanted):
            return seen
    raise AssertionError(f"{proc.args} ended (exit {proc.wait()}) without printing {wanted}: {seen}")


@pytest.mark.slow
def test_an_interrupted_search_and_a_lost_controller_continue_with_the_same_command_no_trial_lost_or_run_twice(
        tmp_path):
    (tmp_path / "space.py").write_text(SMOOTHING_ONLY)
    out = tmp_path / "search"
    # No rung before the trials end (--first-rung 1000): every trial trains its 6 epochs unless interrupted.
    argv = ["tiny", "--epochs", "6", "--target", "top1=0.9", "--first-rung", "1000", "--device", "cpu", "--trials",
            "2", "--parallel", "2", "--space", str(tmp_path / "space.py"), "--out", str(out)]
    # 1. Ctrl-C once both trials have saved an epoch: they stop at a step and stay running in the study.
    proc = start("tune", *argv)
    deadline = time.monotonic() + 120
    while not all((out / "trials" / n / "checkpoint.pt").exists() for n in ("000", "001")):
        assert time.monotonic() < deadline and proc.poll() is None, proc.poll()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (rest, err)
    assert "search stopped, 2 trial(s) at a step: run the same command to continue" in err
    trials = study_trials(out)
    assert [str(t.state) for t in trials] == ["TrialState.RUNNING"] * 2
    stopped = {t.number: json.loads((out / t.user_attrs["dir"] / "results.json").read_text()) for t in trials}
    assert all(r["status"] == "stopped" for r in stopped.values())

    # 2. The same command resumes both; its controller is then lost (SIGKILL): the trials train on.
    proc = start("tune", *argv)
    wait_for_lines(proc, "trial 0 resumed", "trial 1 resumed")
    proc.kill()
    proc.communicate()

    # 3. The same command again adopts them (their processes still run) and waits for them.
    again = subprocess.run([sys.executable, "-m", "speedrun", "tune", *argv], capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr
    assert "trial 0: still running, adopted" in again.stdout and "trial 1: still running, adopted" in again.stdout
    assert "resumed" not in again.stdout and "label_smoothing=" not in again.stdout  # nothing started again
    trials = study_trials(out)
    assert len(trials) == 2 and all(str(t.state) == "TrialState.PRUNED" for t in trials)  # none reached 0.9
    for number, before in stopped.items():  # each went on from the step it stopped at, nothing trained again
        results = json.loads((out / "trials" / f"{number:03d}" / "results.json").read_text())
        assert results["status"] == "finished" and len(results["interruptions"]) == 1  # the controller's loss: none
        assert results["interruptions"][0]["resumed_at_step"] == before["steps"]
        assert results["interruptions"][0]["steps_redone"] == 0
    for t in trials:  # no trial began twice from its first step
        run = out / t.user_attrs["dir"]
        steps = [s["step"] for s in read_jsonl(run / "steps.jsonl")]
        assert steps == sorted(set(steps)) and not list(run.glob("abandoned-*")), t.number
        assert t.user_attrs["state"] == "not_reached"


# The study in PostgreSQL.

def test_a_storage_that_does_not_answer_is_one_line_exit_3_with_its_password_hidden(tmp_path):
    from postgres_server import free_port

    url = f"postgresql://speedrun:secret@127.0.0.1:{free_port()}/speedrun"  # nothing listens there
    proc = speedrun_here("tune", "tiny", "--target", "top1=0.5", "--trials", "1", "--no-lr-find", "--storage", url,
                         "--out", str(tmp_path / "s"))
    line = one_line_error(proc, "the study's storage postgresql+psycopg://speedrun:***@127.0.0.1:", "does not answer",
                          code=3)
    assert "secret" not in line


@pytest.mark.slow
def test_a_search_in_postgresql_records_three_failures_alike_ends_with_exit_3_and_continues_from_it(tmp_path):
    from postgres_server import PostgresServer

    # Every trial's loss becomes NaN (the LR a million times the recipe's): each fails, with its reason.
    (tmp_path / "space.py").write_text("from speedrun.tune.space import Choice\nspace = {'lr_scale': Choice((1e6,))}\n")
    out = tmp_path / "search"
    with PostgresServer() as pg:
        user_url = pg.url.replace("postgresql+psycopg://", "postgresql://")  # as a user writes it
        argv = ["tune", "tiny", "--target", "top1=0.75", "--trials", "5", "--parallel", "2", "--device", "cpu",
                "--space", str(tmp_path / "space.py"), "--storage", user_url, "--out", str(out)]
        line = one_line_error(speedrun(*argv, timeout=300), "the same failure 3 times in a row: loss became nan",
                              code=3)
        assert "the search stopped" in line and not (out / "study.db").exists()
        import optuna

        trials = optuna.load_study(study_name="speedrun-tune", storage=pg.url).trials
        failed = [t for t in trials if str(t.state) == "TrialState.FAIL"]
        assert all(t.user_attrs["state"] == "failed" for t in failed)
        assert all(t.user_attrs["why"].startswith("loss became nan at epoch 1") for t in failed)
        # Two at a time: a fourth may have started; asked to stop when the search ended, it failed
        # first or stopped at a step.
        assert len(trials) in (3, 4) and len(failed) >= 3
        assert [t.user_attrs["state"] for t in trials if t not in failed] in ([], ["stopped"])
        # The same command with as many trials as the database holds: continued from it, nothing to run.
        again = speedrun(*[a if a != "5" else str(len(trials)) for a in argv], "--json", timeout=300)
        assert again.returncode == 0, again.stderr
        assert len(json.loads(again.stdout)["trials"]) == len(trials) and "lr_scale=" not in again.stderr
        assert json.loads(again.stdout)["storage"] == pg.url  # psycopg 3 for the plain URL
