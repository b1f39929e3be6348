"""The command line: bad input gives one clear line on stderr and a non-zero exit, never a
traceback. What a command refuses before it starts work is checked in this process
(`speedrun_here`); runs that train are real processes (the full tier)."""
import json
import os
import signal

import pytest
from cli_run import one_line_error as assert_one_line_error
from cli_run import speedrun, speedrun_here


def test_unknown_recipe_name(tmp_path):
    assert_one_line_error(speedrun_here("train", "--recipe", "imagenet-3x8", "--out", str(tmp_path / "r")),
                          "unknown recipe 'imagenet-3x8'")


def test_missing_data_path(tmp_path):
    proc = speedrun_here("train", "--recipe", "tiny", "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "r"))
    assert_one_line_error(proc, "does not exist", "dataset-fashion-mnist")
    assert not (tmp_path / "r" / "results.json").exists()


def test_data_path_without_the_files(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = speedrun_here("train", "--recipe", "tiny", "--data", str(tmp_path / "empty"), "--out", str(tmp_path / "r"))
    assert_one_line_error(proc, "does not hold the four Fashion-MNIST IDX files")


@pytest.mark.parametrize(
    "phase, expected",
    [
        ("Phase(0, 2, size=28, batch_size=0, lr=0.1)", "batch size must be a whole number in 1..65,536"),
        ("Phase(0, 2, size=-28, batch_size=8, lr=0.1)", "image size must be a whole number in 1..4096"),
        ("Phase(0, 2, size=10**6, batch_size=8, lr=0.1)", "image size must be a whole number in 1..4096"),
        ("Phase(0, 2, size=28, batch_size=8, lr=-1.0)", "LR must be a positive number"),
    ],
)
def test_bad_recipe_value(tmp_path, phase, expected):
    path = tmp_path / "bad.py"
    path.write_text(
        "from speedrun import Phase, Recipe\n"
        f"recipe = Recipe(name='bad', dataset='fashion-mnist', model='resnet-fmnist-tiny', phases=({phase},))\n"
    )
    assert_one_line_error(speedrun_here("train", "--recipe", str(path), "--out", str(tmp_path / "r")),
                          "bad.py': phase (epochs 0-2)", expected)


def test_two_recipe_problems_are_both_reported(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(
        "from speedrun import Phase, Recipe\n"
        "recipe = Recipe(name='bad', phases=(Phase(0, 2, 28, 8, 0.1), Phase(3, 4, 28, 8, 0.1)), world_size=0)\n"
    )
    proc = speedrun_here("train", "--recipe", str(path))
    assert proc.returncode == 2
    assert "gap after the previous phase" in proc.stderr and "world_size must be" in proc.stderr


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--target", "top7=0.5"], "expected METRIC=VALUE"),
        (["--epochs", "0"], "argument --epochs: 0 is not a whole number in 1..10,000"),
        (["--epochs", "1000000000"], "argument --epochs: 1000000000 is not a whole number in 1..10,000"),
        (["--epochs", "abc"], "argument --epochs: 'abc' is not a whole number in 1..10,000"),
        (["--seed", "-1"], "argument --seed: -1 is not a whole number in 0..4,294,967,295"),
        (["--seed", str(2**32)], "argument --seed: 4294967296 is not a whole number in 0..4,294,967,295"),
        (["--log-every", "0"], "argument --log-every: 0 is not a whole number in 1..1,000,000"),
        (["--resume"], "no checkpoint at"),
        (["--bucket-cap-mb", "-1"], "argument --bucket-cap-mb: -1 is not a number in 0.01..4096"),
        (["--bucket-cap-mb", "nan"], "argument --bucket-cap-mb: nan is not a number in 0.01..4096"),
        (["--dist-timeout", "0"], "argument --dist-timeout: 0 is not a number in 1..86,400"),
        (["--dist-timeout", "inf"], "argument --dist-timeout: inf is not a number in 1..86,400"),
        (["--memory-format", "nhwc"], "argument --memory-format: invalid choice: 'nhwc'"),
    ],
)
def test_bad_options(tmp_path, args, expected):
    assert_one_line_error(speedrun_here("train", "--recipe", "tiny", "--out", str(tmp_path / "r"), *args), expected)


def test_recipes_listing_and_table(monkeypatch):
    listing = speedrun_here("recipes")
    assert listing.returncode == 0
    for name in ("fashion-mnist", "tiny", "imagenet-1x8", "imagenet-16x8"):
        assert name in listing.stdout
    monkeypatch.setenv("COLUMNS", "200")
    table = speedrun_here("recipes", "imagenet-16x8")
    assert table.returncode == 0
    assert "1.88 -> 3.76" in table.stdout and "160 px copy" in table.stdout
    assert "0.08-1 ar0.75-1.33 flip" in table.stdout and "square 0.877" in table.stdout
    assert_one_line_error(speedrun_here("recipes", "nope"), "unknown recipe 'nope'")


def test_every_command_has_help():
    for command in ([], ["train"], ["recipes"]):
        proc = speedrun_here(*command, "--help")
        assert proc.returncode == 0 and "usage:" in proc.stdout


def test_the_routing_table_names_every_command_and_each_module_registers_its_own():
    # That `speedrun train` imports no other command's module: tests/test_trackers.py, in a process.
    from speedrun.cli import COMMAND_MODULES, build_parser

    every = build_parser()._subparsers._group_actions[0].choices  # argparse's own record of them
    assert list(every) == [c for commands in COMMAND_MODULES.values() for c in commands]
    for commands in COMMAND_MODULES.values():
        assert list(build_parser([commands[0], "--x"])._subparsers._group_actions[0].choices) == list(commands)


@pytest.mark.parametrize("command", [[], ["train"]])
def test_help_names_every_exit_code(command):
    from speedrun import errors
    out = " ".join(speedrun_here(*command, "--help").stdout.split())  # argparse wraps the epilog
    for code in (errors.EXIT_OK, errors.EXIT_INTERNAL, errors.EXIT_BAD_INPUT, errors.EXIT_FAILED,
                 errors.EXIT_RESUMABLE, errors.EXIT_INTERRUPTED):
        assert f" {code} " in f" {out} ", (code, out)


def test_an_image_folder_with_a_fashion_mnist_recipe_names_the_recipes_that_read_one(tmp_path):
    from test_data_helpers import make_tree

    tree = make_tree(tmp_path / "tree", classes=2, train_per_class=1, val_per_class=1)
    proc = speedrun_here("train", "--data", str(tree), "--out", str(tmp_path / "r"))
    assert_one_line_error(proc, "is an image folder", "--recipe folder-small", "imagenet-1x8",
                          "dataset=\"imagefolder\"")
    assert "dataset-fashion-mnist" not in proc.stderr


def test_folder_small_needs_an_image_folder(tmp_path):
    assert_one_line_error(speedrun_here("train", "--recipe", "folder-small", "--out", str(tmp_path / "r")),
                          "fitted to an image folder", "--data DIR")
    assert_one_line_error(speedrun_here("train", "--recipe", "folder-small", "--data", str(tmp_path),
                                        "--out", str(tmp_path / "r")),
                          "is not one")


@pytest.mark.slow
def test_folder_small_trains_on_a_folder_at_the_folders_own_size(tmp_path):
    """`speedrun train --recipe folder-small --data DIR`: the sizes come from the folder's images
    (40 x 32 px here: the shorter side, 32 px, is the final size, after 24 and 28 px)."""
    from test_data_helpers import make_tree

    tree = make_tree(tmp_path / "tree", classes=2, train_per_class=40, val_per_class=5, sizes=[(40, 32)])
    proc = speedrun("train", "--recipe", "folder-small", "--data", str(tree), "--epochs", "2", "--workers", "1",
                    "--out", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr
    results = json.loads((tmp_path / "r" / "results.json").read_text())
    assert results["recipe"]["name"] == "folder-small"
    assert [p["size"] for p in results["recipe"]["phases"]] == [24, 24]  # cut to 2 epochs by --epochs
    assert [r["size"] for r in map(json.loads, (tmp_path / "r" / "metrics.jsonl").read_text().splitlines())] == [24, 24]
    listing = speedrun("recipes", "folder-small", "--data", str(tree), env={**os.environ, "COLUMNS": "200"})
    assert listing.returncode == 0 and "24 -> 32 px" in listing.stdout


def test_a_recipe_file_that_exits_is_an_error_not_a_silent_success(tmp_path):
    recipe = tmp_path / "exits.py"
    recipe.write_text("import sys\nsys.exit(0)\n")
    assert_one_line_error(speedrun_here("train", "--recipe", str(recipe), "--out", str(tmp_path / "r")),
                          "called exit(0)")


@pytest.mark.slow
def test_files_skipped_at_indexing_are_counted_in_the_results(tmp_path):
    from test_data_helpers import make_tree

    tree = make_tree(tmp_path / "tree", classes=2, train_per_class=8, val_per_class=2, sizes=[(40, 40)])
    (tree / "train/c00/broken.JPEG").write_text("not an image")
    (tree / "train/c01/x").symlink_to("../c00")
    recipe = tmp_path / "folder.py"
    recipe.write_text(
        "from speedrun import Phase, Recipe\n"
        "recipe = Recipe(name='folder', dataset='imagefolder', model='resnet-fmnist-tiny',\n"
        "                phases=(Phase(0, 1, size=32, batch_size=4, lr=0.05),))\n"
    )
    proc = speedrun("train", "--recipe", str(recipe), "--data", str(tree), "--device", "cpu", "--workers", "1",
                    "--out", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr
    skipped = json.loads((tmp_path / "r" / "results.json").read_text())["skipped_images"]
    assert skipped == {"at_index": 2, "files": 0, "failures": 0}

    one = make_tree(tmp_path / "one", classes=1, train_per_class=4, val_per_class=1, sizes=[(40, 40)])
    assert_one_line_error(speedrun("train", "--recipe", str(recipe), "--data", str(one), "--device", "cpu",
                                   "--out", str(tmp_path / "r1")), "has 1 class", "at least 2")


# Refusals of `speedrun train` before it trains, which the run directory's and the stopping
# tests (test_rundir.py, test_stopping.py) once made in processes of their own.
TINY = ["train", "--recipe", "tiny", "--device", "cpu"]


def test_out_that_is_a_file_is_refused_before_loading(tmp_path):
    (tmp_path / "file").write_text("x")
    assert_one_line_error(speedrun_here(*TINY, "--out", str(tmp_path / "file")), "is a file")


def test_a_refused_run_leaves_no_directory_behind(tmp_path):
    # Refused after the run directory was claimed: nothing to resume, data that is not there.
    for args, expected in ((["--resume"], "no checkpoint at"),
                           (["--data", str(tmp_path / "nowhere")], "does not exist")):
        assert_one_line_error(speedrun_here(*TINY, "--out", str(tmp_path / "r"), *args), expected)
        assert not (tmp_path / "r").exists()
    # A directory that was there before stays, as it was: without the lock file.
    (tmp_path / "mine").mkdir()
    for args in (["--resume"], ["--data", str(tmp_path / "nowhere")]):
        assert_one_line_error(speedrun_here(*TINY, "--out", str(tmp_path / "mine"), *args))
        assert list((tmp_path / "mine").iterdir()) == []


def test_a_bad_checkpoint_interval_is_one_line(tmp_path):
    r = speedrun_here(*TINY, "--checkpoint-every", "soon", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and r.stderr.strip() == (
        "speedrun: error: bad --checkpoint-every 'soon': give epochs (0 or more) or minutes, e.g. 10m")


def test_a_spot_notice_url_that_is_not_one_is_one_line(tmp_path):
    r = speedrun_here(*TINY, "--spot-notice-url", "169.254.169.254", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and r.stderr.strip().startswith("speedrun: error: bad --spot-notice-url '169.254.169.254'")
    assert "\n" not in r.stderr.strip()


def test_the_suite_lets_ctrl_c_reach_the_runs_it_starts():
    """A suite started in the background by a non-interactive shell (`scripts/test &`, `nohup ... &`)
    inherits SIGINT ignored, and so would every run it starts: the tests that press Ctrl-C on a run
    (test_train, test_rundir, test_experiments) would watch it finish instead. conftest.py gives
    SIGINT back its default."""
    assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
