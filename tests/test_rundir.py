"""The run directory's promises, through the command line: one writer, no stale logs, no dead
ends, damaged files and full disks reported in one line, and runs killed at any moment that
resume to exactly the uninterrupted result."""
import json
import os
import signal
import subprocess
from functools import partial
from pathlib import Path

import pytest
import torch
from cli_run import one_line_error, speedrun, speedrun_here, start, wait_for
from fs_helpers import fill

from speedrun.errors import EXIT_RESUMABLE, SpeedrunError
from speedrun.track import read_jsonl

pytestmark = pytest.mark.slow  # real runs, killed and resumed
TINY = ["train", "--recipe", "tiny", "--device", "cpu"]
# A refusal that comes before any step runs in this process (speedrun_here): a `speedrun train`
# process costs 6-8 CPU seconds of imports before it reads its first argument. How a refusal reaches
# a user from a real process (one line, exit 2) is proved by test_two_runs_on_one_directory here and
# test_cli.py. Not in this process: a refusal after `--deterministic` has changed torch's settings.


def test_a_second_claim_is_refused_until_the_first_is_released_or_its_process_dies(tmp_path):
    from speedrun import rundir

    out = tmp_path / "run"
    first = rundir.claim(out, resume=False)
    with pytest.raises(SpeedrunError, match=f"in use by another run \\(pid {os.getpid()} "):
        rundir.claim(out, resume=False)
    first.release()
    rundir.claim(out, resume=False).release()
    # A holder killed with SIGKILL holds nothing.
    holder = subprocess.Popen(
        ["python", "-c", "import sys, pathlib; from speedrun import rundir; "
         "held = rundir.claim(pathlib.Path(sys.argv[1]), False);"
         " print('held', flush=True); sys.stdin.read()", str(out)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(SpeedrunError, match=f"pid {holder.pid} "):
        rundir.claim(out, resume=False)
    holder.kill()
    holder.wait()
    rundir.claim(out, resume=False).release()


def test_two_runs_on_one_directory(tmp_path):
    out = tmp_path / "run"
    first = start(*TINY, "--epochs", "12", "--out", str(out))
    try:
        wait_for(lambda: (out / "steps.jsonl").exists() or first.poll() is not None, 120, "the first run training")
        assert first.poll() is None
        one_line_error(speedrun(*TINY, "--out", str(out)), f"in use by another run (pid {first.pid} ")
        one_line_error(speedrun(*TINY, "--out", str(out), "--resume"), "in use by another run")
    finally:
        first.kill()
        first.wait()


@pytest.fixture
def abandoned(tmp_path) -> Path:
    """A run stopped (Ctrl-C) after its first evaluation but before any checkpoint."""
    out = tmp_path / "run"
    proc = start(*TINY, "--checkpoint-every", "0", "--log-every", "1", "--out", str(out))
    wait_for(lambda: (out / "metrics.jsonl").exists() or proc.poll() is not None, 120, "the first evaluation")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert json.loads((out / "results.json").read_text())["status"] == "interrupted"
    assert not (out / "checkpoint.pt").exists()
    return out


def test_a_run_that_left_no_checkpoint_is_started_over_not_appended_to(abandoned):
    old_steps = len(read_jsonl(abandoned / "steps.jsonl"))
    resumed = speedrun(*TINY, "--out", str(abandoned), "--resume")
    one_line_error(resumed, "no checkpoint", "stopped before its first checkpoint", "run without --resume")
    again = speedrun(*TINY, "--epochs", "2", "--out", str(abandoned))
    assert again.returncode == 0, again.stderr
    assert "moved to abandoned-" in again.stdout
    assert [e["epoch"] for e in read_jsonl(abandoned / "metrics.jsonl")] == [1, 2]  # no stale lines
    assert len(list((abandoned / "tb").glob("events.*"))) == 1
    (aside,) = abandoned.glob("abandoned-*")
    assert len(read_jsonl(aside / "steps.jsonl")) == old_steps  # kept, not lost
    assert json.loads((aside / "results.json").read_text())["status"] == "interrupted"


def test_a_finished_run_without_checkpoint_is_never_overwritten(tmp_path):
    out = tmp_path / "run"
    assert speedrun(*TINY, "--epochs", "1", "--checkpoint-every", "0", "--out", str(out)).returncode == 0
    one_line_error(speedrun_here(*TINY, "--epochs", "1", "--out", str(out)), "holds a finished run")


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory) -> Path:
    """A run stopped at a step early in the first of its two epochs: `--resume` has work to do
    (resuming a complete run changes nothing)."""
    out = tmp_path_factory.mktemp("one") / "run"
    proc = start(*TINY, "--epochs", "2", "--log-every", "1", "--out", str(out))
    steps = out / "steps.jsonl"
    wait_for(lambda: steps.exists() and steps.read_text().count("}\n") >= 2, 300, "two steps")
    proc.send_signal(signal.SIGTERM)  # stops after the step in progress, of some 180 left
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_RESUMABLE, err
    return out


def copy_run(src: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    return dst


def test_a_cut_last_line_is_dropped_and_a_damaged_one_named(stopped_run, tmp_path):
    out = copy_run(stopped_run, tmp_path / "run")
    for name in ("steps.jsonl", "metrics.jsonl"):
        with open(out / name, "a") as f:
            f.write('{"step": 99, "epo')  # the disk filled up mid-line
    resumed = speedrun(*TINY, "--epochs", "2", "--out", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert len(read_jsonl(out / "metrics.jsonl")) == 2
    assert (out / "steps.jsonl").read_text().endswith("}\n")

    out = copy_run(stopped_run, tmp_path / "again")  # that run is complete now: resuming it changes nothing
    lines = (out / "steps.jsonl").read_text().splitlines()
    (out / "steps.jsonl").write_text("\n".join([lines[0][:20], *lines[1:]]) + "\n")
    one_line_error(speedrun_here(*TINY, "--epochs", "2", "--out", str(out), "--resume"), "steps.jsonl, line 1")


@pytest.mark.parametrize("content, expected", [
    (b"\x00garbage" * 100, "cannot be read"),
    (None, "is not a speedrun checkpoint"),
])
def test_a_damaged_or_foreign_checkpoint_says_what_to_do(stopped_run, tmp_path, content, expected):
    out = copy_run(stopped_run, tmp_path / "run")
    if content is None:
        torch.save({"weights": torch.zeros(2)}, out / "checkpoint.pt")
    else:
        (out / "checkpoint.pt").write_bytes(content)
    one_line_error(speedrun_here(*TINY, "--epochs", "2", "--out", str(out), "--resume"), expected, "another --out")


@pytest.mark.parametrize("flags, expected", [
    (["--seed", "1"], "--seed 0"),
    (["--deterministic"], "no --deterministic"),
])
def test_resume_refuses_another_seed_or_determinism(stopped_run, tmp_path, flags, expected):
    out = copy_run(stopped_run, tmp_path / "run")
    one_line_error(speedrun(*TINY, "--epochs", "2", "--out", str(out), "--resume", *flags), expected)


def test_temporaries_of_a_killed_writer_are_removed(stopped_run, tmp_path):
    # Every file a run writes whole (files.replacing) leaves `.<name>.<random>.tmp` when its writer
    # is killed mid-write: a checkpoint, results.json, a JSONL cut back on resume, a tracker's state.
    out = copy_run(stopped_run, tmp_path / "run")
    (out / ".checkpoint.pt.k1ll3d.tmp").write_bytes(b"half a checkpoint")
    (out / ".results.json.k1ll3d.tmp").write_text('{"status": "runn')
    (out / ".steps.jsonl.k1ll3d.tmp").write_text('{"step": 1}\n')
    (out / "trackers").mkdir(exist_ok=True)
    (out / "trackers" / ".mlflow.json.k1ll3d.tmp").write_text("{")
    (out / ".mine.tmp").write_text("not speedrun's")  # a file of the user's is theirs
    assert speedrun(*TINY, "--epochs", "2", "--out", str(out), "--resume").returncode == 0
    assert sorted(p.name for p in out.rglob("*.tmp")) == [".mine.tmp"]


# An --out that is a file, and a refused run that leaves no directory behind: test_cli.py (in
# this process, no mount needed).


def test_out_that_is_read_only_is_refused_before_loading(read_only_dir):
    one_line_error(speedrun_here(*TINY, "--out", str(read_only_dir / "run")), "cannot create the run directory",
                   "Read-only file system")


def test_a_full_disk_is_one_line_naming_the_last_checkpoint(small_disk):
    # The disk fills up once the first checkpoint is written; the next one cannot be.
    out = small_disk / "run"
    proc = start(*TINY, "--epochs", "12", "--out", str(out))
    wait_for(lambda: (out / "checkpoint.pt").exists() or proc.poll() is not None, 120, "the first checkpoint")
    fill(small_disk)
    _, stderr = proc.communicate(timeout=120)
    line = one_line_error(subprocess.CompletedProcess([], proc.returncode, "", stderr),
                          "cannot write to the run directory", "No space left on device")
    assert "the last complete checkpoint is" in line and "--resume" in line, line
    saved = torch.load(out / "checkpoint.pt", weights_only=False)  # intact
    assert 1 <= saved["state"]["epoch"] < 12 and f"after epoch {saved['state']['epoch']})" in line
    assert not list(out.glob(".checkpoint.pt.*.tmp"))


def test_runs_killed_at_any_moment_resume_to_the_uninterrupted_result(tiny_run, tmp_path):
    """SIGKILL during training steps, evaluations and checkpoint writes (best effort: the moment
    a temporary checkpoint appears), then --resume (or a fresh start when no checkpoint was made
    yet), again and again: the run ends bitwise where an uninterrupted one ends, with the same
    records and no temporary files."""
    args = [*TINY, "--deterministic", "--log-every", "1"]
    reference = tiny_run  # `speedrun ARGS` run to the end (conftest.py)
    out = tmp_path / "killed"
    steps = lambda: len(read_jsonl(out / "steps.jsonl"))  # noqa: E731
    # One kill of each kind of moment (a second mid-epoch kill, in epoch 3, proved nothing more
    # and cost a training process: the test was over 120 s in the suite).
    triggers = [
        lambda: steps() >= 5,  # mid-epoch 1, before any checkpoint
        lambda: any(out.glob(".checkpoint.pt.*.tmp")),  # mid-write, if the poll catches it
        lambda: steps() >= 120,  # mid-epoch 2, resumed from a checkpoint
        lambda: (out / "metrics.jsonl").exists() and len(read_jsonl(out / "metrics.jsonl")) >= 2,  # after an eval
    ]

    # Bound with partial below, so each wait polls its own iteration's process and trigger.
    def exited_or_triggered(proc: subprocess.Popen, trigger) -> bool:
        return proc.poll() is not None or trigger()

    kills = 0
    for trigger in triggers:
        resume = ["--resume"] if (out / "checkpoint.pt").exists() else []
        proc = start(*args, "--out", str(out), *resume)
        wait_for(partial(exited_or_triggered, proc, trigger), 120, "the moment to kill")
        if proc.poll() is None:
            proc.kill()
            kills += 1
        proc.communicate(timeout=60)
    final = speedrun(*args, "--out", str(out), *(["--resume"] if (out / "checkpoint.pt").exists() else []))
    assert final.returncode == 0, final.stderr
    assert kills >= 3
    a = torch.load(reference / "checkpoint.pt", weights_only=False)
    b = torch.load(out / "checkpoint.pt", weights_only=False)
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    strip = lambda rows: [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]  # noqa: E731
    assert strip(read_jsonl(out / "metrics.jsonl")) == strip(read_jsonl(reference / "metrics.jsonl"))
    assert read_jsonl(out / "steps.jsonl") == read_jsonl(reference / "steps.jsonl")
    assert json.loads((out / "results.json").read_text())["status"] == "finished"
    assert not list(out.rglob("*.tmp"))


def test_a_run_directory_removed_mid_run_is_one_line(tmp_path):
    out = tmp_path / "run"
    proc = start(*TINY, "--epochs", "12", "--out", str(out))
    wait_for(lambda: (out / "checkpoint.pt").exists() or proc.poll() is not None, 120, "the first checkpoint")
    subprocess.run(["rm", "-rf", str(out)], check=True)
    _, stderr = proc.communicate(timeout=120)
    one_line_error(subprocess.CompletedProcess([], proc.returncode, "", stderr), "was removed during the run")
