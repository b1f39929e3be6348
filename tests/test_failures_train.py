"""What a training process reports when the world fails it (issue 23): a peer that dies or stops
answering mid-run, a disk with less room than one checkpoint, `--resume` of a run that is complete, and two
SIGTERMs close together. Each case is a real `speedrun train` process."""
import json
import os
import shutil
import signal
import socket
from pathlib import Path

import pytest
import torch
from cli_run import speedrun, start, wait_for
from test_distributed import env_one_thread, free_port, write_recipe

from speedrun.errors import EXIT_FAILED, EXIT_INTERNAL, EXIT_RESUMABLE
from speedrun.track import read_jsonl

pytestmark = pytest.mark.slow

TINY = ["train", "--recipe", "tiny", "--device", "cpu"]

# A model whose forward is a genuine bug (a shape error), registered by the recipe file: the
# RuntimeError it raises under a process group is not a peer's death.
BROKEN_MODEL = """
import torch
from speedrun import model

class Broken(torch.nn.Module):
    def __init__(self, in_chans, num_classes):
        super().__init__()
        self.fc = torch.nn.Linear(7, num_classes)

    def forward(self, x):
        return self.fc(x.flatten(1))  # 784 features into a 7-input layer

model.OWN_MODELS["broken"] = Broken
"""


def rank_env(rank: int, port: int, tmp: Path) -> dict:
    """The variables torchrun gives rank `rank` of 2 (on 127.0.0.1), and a TMPDIR of its own,
    where the CLI would leave a crash file."""
    tmp.mkdir(exist_ok=True)
    return {**env_one_thread(), "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TMPDIR": str(tmp)}


def test_a_peer_killed_mid_run_is_exit_3_naming_it_not_an_internal_error(tmp_path):
    """Two ranks as torchrun starts them, but with no agent to stop the survivor (as when the
    peer is on another host): rank 1 is killed mid-run; rank 0's collective fails, and it says
    which rank probably died, in one line, with results.json `failed` and no crash file."""
    recipe = write_recipe(tmp_path / "long.py", 2, 32, train=4096, val=256, epochs=50)
    out, port = tmp_path / "run", free_port()
    args = ["train", "--recipe", str(recipe), "--device", "cpu", "--log-every", "1", "--out", str(out)]
    ranks = [start(*args, env=rank_env(rank, port, tmp_path / f"tmp{rank}")) for rank in (0, 1)]
    wait_for(lambda: (out / "steps.jsonl").exists() or any(r.poll() is not None for r in ranks),
             300, "both ranks training")
    assert all(r.poll() is None for r in ranks), [r.communicate() for r in ranks]
    ranks[1].kill()
    ranks[1].wait()
    _, stderr = ranks[0].communicate(timeout=300)
    assert ranks[0].returncode == EXIT_FAILED, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    line = stderr.strip()
    assert line.startswith("speedrun: training failed: a collective failed: rank 1 "), line
    assert f"(host {socket.gethostname()}, 127.0.0.1) probably died" in line, line
    assert json.loads((out / "results.json").read_text())["status"] == "failed"
    assert not list((tmp_path / "tmp0").iterdir())  # no crash file: not a bug


def test_a_peer_that_stops_answering_fails_the_run_after_the_dist_timeout_naming_it(tmp_path):
    """A peer cut off rather than killed (its host's link down, the machine frozen) sends no
    reset: rank 0's collective waits `--dist-timeout` seconds for it (here rank 1 is SIGSTOPped),
    then fails the run as a peer's death: exit 3, one line naming rank 1, results.json `failed`,
    no crash file. The 300 s default would outlast the test's wait."""
    recipe = write_recipe(tmp_path / "long.py", 2, 32, train=4096, val=256, epochs=50)
    out, port = tmp_path / "run", free_port()
    args = ["train", "--recipe", str(recipe), "--device", "cpu", "--log-every", "1", "--out", str(out),
            "--dist-timeout", "20"]  # long enough for a loaded machine's slowest legitimate wait
    ranks = [start(*args, env=rank_env(rank, port, tmp_path / f"tmp{rank}")) for rank in (0, 1)]
    try:
        wait_for(lambda: (out / "steps.jsonl").exists() or any(r.poll() is not None for r in ranks),
                 300, "both ranks training")
        assert all(r.poll() is None for r in ranks), [r.communicate() for r in ranks]
        ranks[1].send_signal(signal.SIGSTOP)
        _, stderr = ranks[0].communicate(timeout=200)
    finally:
        ranks[1].kill()
        ranks[1].wait()
    assert ranks[0].returncode == EXIT_FAILED, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    line = stderr.strip()
    assert line.startswith("speedrun: training failed: a collective failed: rank 1 "), line
    assert f"(host {socket.gethostname()}, 127.0.0.1) probably died" in line, line
    # gloo words the same timeout two ways, by which side of the pair notices it first.
    assert "Timed out" in line or "Application timeout caused pair closure" in line, line
    assert json.loads((out / "results.json").read_text())["status"] == "failed"
    assert not list((tmp_path / "tmp0").iterdir())  # no crash file: not a bug


def test_a_genuine_bug_under_a_process_group_is_still_an_internal_error(tmp_path):
    recipe = write_recipe(tmp_path / "broken.py", 2, 32, train=256, val=64, epochs=2, model="broken")
    recipe.write_text(BROKEN_MODEL + recipe.read_text())
    port = free_port()
    args = ["train", "--recipe", str(recipe), "--device", "cpu", "--out", str(tmp_path / "run")]
    ranks = [start(*args, env=rank_env(rank, port, tmp_path / f"tmp{rank}")) for rank in (0, 1)]
    errors = [r.communicate(timeout=300)[1] for r in ranks]
    for rank, (proc, stderr) in enumerate(zip(ranks, errors)):
        assert proc.returncode == EXIT_INTERNAL, stderr
        assert "internal error: RuntimeError" in stderr and "probably died" not in stderr, stderr
        assert len(list((tmp_path / f"tmp{rank}").glob("speedrun-crash-*.txt"))) == 1


def fill_leaving(folder: Path, free_bytes: int) -> None:
    """Fill `folder`'s file system until about `free_bytes` are left."""
    stat = os.statvfs(folder)
    size = stat.f_bavail * stat.f_frsize - free_bytes
    with open(folder / "filler", "wb") as f:
        f.write(b"\0" * max(size, 0))


def test_a_disk_with_less_room_than_a_checkpoint_stops_at_once_naming_the_last_one(small_disk):
    """Room left for half a checkpoint: the next checkpoint's write fails part-way (torch's zip
    writer reports that as a RuntimeError); the run stops at that point, in one line, exit 2."""
    out = small_disk / "run"
    proc = start(*TINY, "--epochs", "12", "--out", str(out))
    wait_for(lambda: (out / "checkpoint.pt").exists() or proc.poll() is not None, 300, "the first checkpoint")
    fill_leaving(small_disk, (out / "checkpoint.pt").stat().st_size // 2)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "Traceback" not in stderr, stderr
    (line,) = stderr.strip().splitlines()
    assert "cannot write to the run directory" in line and "No space left on device" in line, line
    import torch

    saved = torch.load(out / "checkpoint.pt", weights_only=False)["state"]  # intact
    assert f"the last complete checkpoint is {out / 'checkpoint.pt'} (after epoch {saved['epoch']})" in line, line
    # At once: the epoch whose checkpoint failed was the last one evaluated, none after it.
    assert len(read_jsonl(out / "metrics.jsonl")) == saved["epoch"] + 1
    assert not list(out.glob(".checkpoint.pt.*.tmp"))


@pytest.mark.parametrize("flags, status", [(["--epochs", "1"], "finished"),
                                           (["--target", "top1=0.2"], "target_reached")])
def test_resuming_a_complete_run_changes_nothing_and_says_so(tmp_path, request, flags, status):
    # What `speedrun ARGS` made, once per session (conftest.py), copied: --resume may change it.
    if status == "finished":
        made = request.getfixturevalue("tiny_one_epoch_run")
    else:
        made = request.getfixturevalue("tiny_target_run").out
    out = shutil.copytree(made, tmp_path / "run")
    args = [*TINY, *flags, "--out", str(out)]
    # Every file but the lock, which says who holds the directory now.
    contents = lambda: {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"}  # noqa: E731
    files = contents()
    assert json.loads(files["results.json"])["status"] == status

    again = speedrun(*args, "--resume")
    assert again.returncode == 0, again.stderr
    assert f"{out} is complete" in again.stdout and "nothing to resume; nothing was changed" in again.stdout
    assert contents() == files
    assert json.loads(files["results.json"])["lost_s"] == 0


def test_two_sigterms_close_together_are_one_stop_and_one_after_the_results_changes_nothing(tmp_path):
    """A second SIGTERM right after the first is the same request delivered twice (Slurm signals
    every process of a job, and torchrun's agent forwards its copy): the run still stops at a step
    with its checkpoint. One once the run has stopped and the process is exiting: never killed by
    the signal (143)."""
    out = tmp_path / "run"
    proc = start(*TINY, "--log-every", "1", "--out", str(out))
    wait_for(lambda: (out / "steps.jsonl").exists() or proc.poll() is not None, 300, "the first step")
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_RESUMABLE, (proc.returncode, stderr)
    assert json.loads((out / "results.json").read_text())["status"] == "stopped"
    state = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)["state"]
    assert state["step"] == read_jsonl(out / "steps.jsonl")[-1]["step"]  # the step's checkpoint, nothing redone

    again = tmp_path / "again"
    status = lambda: json.loads((again / "results.json").read_text())["status"]  # noqa: E731
    steps = lambda: len(read_jsonl(again / "steps.jsonl")) if (again / "steps.jsonl").exists() else 0  # noqa: E731
    proc = start(*TINY, "--log-every", "1", "--out", str(again))
    wait_for(lambda: proc.poll() is not None or steps() >= 3, 300, "three steps")
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: proc.poll() is not None or ((again / "results.json").exists() and status() == "stopped"), 300,
             "the run to stop")
    proc.send_signal(signal.SIGTERM)  # while the process tears down, after its results are written
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_RESUMABLE, (proc.returncode, stderr)
    assert status() == "stopped"


def test_data_removed_mid_run_is_one_line_and_a_failed_run_that_says_why(tmp_path):
    from test_data_helpers import make_tree

    data = make_tree(tmp_path / "data", classes=3, train_per_class=40, val_per_class=4, sizes=[(32, 32)])
    out = tmp_path / "run"
    proc = start("train", "--recipe", "folder-small", "--data", str(data), "--device", "cpu", "--workers", "1",
                 "--log-every", "1", "--out", str(out), env=env_one_thread())
    wait_for(lambda: (out / "steps.jsonl").exists() or proc.poll() is not None, 120, "the first step")
    # The world changes under the run: its training images are gone, all at once. A rename is atomic;
    # rmtree removes file by file, and a batch decoded meanwhile rightly skips (and logs) the files
    # already gone while it still finds others, which is a different story from this one.
    (data / "train").rename(tmp_path / "gone")
    shutil.rmtree(tmp_path / "gone")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "undecodable images in a row" in lines[0] and "is the data intact?" in lines[0]
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "failed" and "undecodable images in a row" in results["failure"]
