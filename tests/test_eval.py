"""`speedrun eval RUN_DIR`: score a run's checkpoint without training, on any number of processes."""
import json
import os

import pytest
from cli_run import one_line_error, speedrun, speedrun_here

from speedrun.track import read_jsonl


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
    """Two epochs of a tiny recipe that keeps an EMA of its weights and evaluates with flips."""
    d = tmp_path_factory.mktemp("eval")
    recipe = d / "ema.py"
    recipe.write_text(
        "import dataclasses\n"
        "from speedrun.recipes import BUILTIN\n"
        "recipe = dataclasses.replace(BUILTIN['tiny'].with_epochs(2), name='tiny-ema', "
        "ema_decay=0.99, eval_flip=True)\n"
    )
    out = d / "run"
    proc = speedrun("train", "--recipe", str(recipe), "--device", "cpu", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.slow
def test_eval_reproduces_the_runs_last_evaluation(ema_run):
    # Same weights (the EMA), same size, square validation, flips: the same numbers as the run's
    # own last evaluation, on one process and on two.
    final = json.loads((ema_run / "results.json").read_text())["final"]
    for extra in ([], ["--nproc-per-node", "2"]):
        proc = speedrun("eval", str(ema_run), "--device", "cpu", *extra, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr
        record = read_jsonl(ema_run / "eval.jsonl")[-1]
        assert record["count"] == final["count"] == 1000
        assert record["top1"] == pytest.approx(final["top1"], abs=1e-9)
        assert record["loss"] == pytest.approx(final["loss"], rel=1e-5)
        assert record["weights"] == "ema" and record["flip"] is True and record["size"] == final["size"]
        assert record["world_size"] == (2 if extra else 1)
        assert f"top1 {100 * final['top1']:.2f}%" in proc.stdout


@pytest.mark.slow
def test_eval_at_another_size_without_flips_gives_other_numbers(ema_run):
    proc = speedrun("eval", str(ema_run), "--device", "cpu", "--size", "24", "--no-flip", "--rect")
    assert proc.returncode == 0, proc.stderr
    record = read_jsonl(ema_run / "eval.jsonl")[-1]
    final = json.loads((ema_run / "results.json").read_text())["final"]
    assert (record["size"], record["flip"], record["rect"]) == (24, False, True)
    assert record["count"] == 1000 and record["loss"] != pytest.approx(final["loss"], rel=1e-4)


def test_eval_of_a_directory_without_a_checkpoint_is_one_line(tmp_path):
    one_line_error(speedrun_here("eval", str(tmp_path)), "no checkpoint")


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory):
    """One epoch of folder-small on a 3-class image folder."""
    from test_data_helpers import make_tree

    d = tmp_path_factory.mktemp("folder-eval")
    make_tree(d / "data", classes=3, train_per_class=20, val_per_class=4, sizes=[(32, 32), (40, 32)])
    proc = speedrun("train", "--recipe", "folder-small", "--data", str(d / "data"), "--epochs", "1", "--device", "cpu",
                    "--workers", "1", "--out", str(d / "run"))
    assert proc.returncode == 0, proc.stderr
    return d


@pytest.mark.slow
def test_eval_refuses_data_with_other_classes_and_records_absolute_paths(folder_run):
    import shutil

    from test_data_helpers import make_tree

    run = folder_run / "run"
    renamed = folder_run / "renamed"  # the same images, one class folder named otherwise
    shutil.copytree(folder_run / "data", renamed)
    for split in ("train", "val"):
        (renamed / split / "c01").rename(renamed / split / "zebra")
    make_tree(folder_run / "four", classes=4, train_per_class=2, val_per_class=2, sizes=[(32, 32)])
    for data, expected in ((renamed, "other classes than the checkpoint was trained on ('c02' where the run had 'c01'"),
                           (folder_run / "four", "has 4 classes, the checkpoint was trained on 3")):
        line = one_line_error(speedrun_here("eval", str(run), "--data", str(data), "--workers", "1"))
        assert expected in line, line
    assert not (run / "eval.jsonl").exists()
    # The data it trained on, given relative to the working directory, is recorded absolute.
    proc = speedrun("eval", str(run), "--data", "data", "--workers", "1", cwd=folder_run)
    assert proc.returncode == 0, proc.stderr
    assert read_jsonl(run / "eval.jsonl")[-1]["data"] == str(folder_run / "data")


@pytest.mark.slow
def test_eval_of_a_checkpoint_without_classes_checks_their_number(folder_run, tmp_path):
    import shutil

    import torch

    run = tmp_path / "old"
    shutil.copytree(folder_run / "run", run)
    saved = torch.load(run / "checkpoint.pt", weights_only=False)
    for key in ("classes", "num_classes"):  # as checkpoints before these fields were
        saved["state"].pop(key, None)
    torch.save(saved, run / "checkpoint.pt")
    from test_data_helpers import make_tree

    make_tree(tmp_path / "four", classes=4, train_per_class=2, val_per_class=2, sizes=[(32, 32)])
    line = one_line_error(speedrun_here("eval", str(run), "--data", str(tmp_path / "four"), "--workers", "1"))
    assert "has 4 classes, not as many as the checkpoint's weights were trained on" in line
    proc = speedrun("eval", str(run), "--workers", "1")
    assert proc.returncode == 0 and "records no class names" in one_line_error(proc, code=0)


@pytest.mark.slow
def test_eval_of_a_read_only_run_prints_the_metrics_and_says_they_were_not_recorded(folder_run, small_disk):
    import shutil

    from fs_helpers import remount_read_only

    run = small_disk / "run"
    shutil.copytree(folder_run / "run", run)
    remount_read_only(small_disk)
    proc = speedrun("eval", str(run), "--workers", "1")
    line = one_line_error(proc, code=0)
    assert "not recorded in" in line and "Read-only file system" in line
    assert "top1" in proc.stdout and read_jsonl(run / "eval.jsonl") == read_jsonl(folder_run / "run" / "eval.jsonl")


@pytest.mark.slow
def test_eval_at_a_size_beyond_memory_is_one_line(folder_run):
    import resource

    # The largest size eval takes (4096 px) in a process allowed 6 GiB of address space: the first
    # convolution's output for the 12 images alone is over 6 GiB.
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # noqa: E731
    line = one_line_error(speedrun("eval", str(folder_run / "run"), "--size", "4096", "--workers", "1",
                                   preexec_fn=limit))
    assert "--size 4096" in line and "does not fit" in line
    line = one_line_error(speedrun_here("eval", str(folder_run / "run"), "--size", "100000"))
    assert "argument --size: 100000 is not a whole number in 1..4096" in line
