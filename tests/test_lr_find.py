"""`speedrun lr-find` and `speedrun.lr_find`: the LR range test on a recipe's first phase, its
suggestion below the point where the loss diverged, and no run touched."""
import hashlib
import json
import math
import shutil

import pytest
from cli_run import one_line_error, speedrun, speedrun_here

import speedrun as sr
from speedrun.errors import SpeedrunError
from speedrun.recipes import load_recipe
from speedrun.tune.lr_find import DIVERGED, lr_ramp, suggest


def test_the_ramp_is_exponential_from_start_to_end():
    lrs = lr_ramp(1e-4, 1.0, 5)
    assert lrs[0] == pytest.approx(1e-4) and lrs[-1] == pytest.approx(1.0)
    assert [b / a for a, b in zip(lrs, lrs[1:])] == pytest.approx([10.0] * 4)


def test_the_suggestion_is_a_tenth_of_the_smoothed_minimum_and_below_the_divergence():
    # A loss flat at 2.3, falling to 0.5 between LR 1e-2 and 1, then exploding past 3 (x40 per step).
    lrs = lr_ramp(1e-5, 1e3, 81)
    losses = [2.3 if lr < 1e-2 else max(0.5, 2.3 - 0.9 * math.log10(lr / 1e-2)) if lr < 3 else 0.5 * 40 ** (i - 71)
              for i, lr in enumerate(lrs)]
    finding = suggest(load_recipe("tiny"), 64, 20, lrs, losses)
    assert finding.diverged_lr is not None
    assert finding.suggested_lr == pytest.approx(finding.min_loss_lr / 10)
    assert finding.suggested_lr < finding.min_loss_lr < finding.diverged_lr
    assert 1e-2 <= finding.steepest_lr <= finding.min_loss_lr
    i = finding.lrs.index(finding.diverged_lr)  # the first smoothed point past DIVERGED x the minimum before it
    assert finding.smoothed[i] > DIVERGED * min(finding.smoothed[:i]) and i > finding.lrs.index(finding.min_loss_lr)


def test_a_loss_that_is_not_finite_is_where_it_diverged():
    lrs = lr_ramp(1e-3, 1.0, 10)
    finding = suggest(load_recipe("tiny"), 64, 20, lrs, [2.3, 2.2, 2.0, 1.8, 1.7, float("nan")])
    assert finding.diverged_lr == pytest.approx(lrs[5]) and finding.min_loss_lr == pytest.approx(lrs[4])
    assert finding.lrs == lrs[:6]


def test_a_loss_that_diverges_at_once_is_one_line():
    with pytest.raises(SpeedrunError, match="start the range lower"):
        suggest(load_recipe("tiny"), 64, 20, lr_ramp(1e-3, 1.0, 10), [float("inf")])


@pytest.mark.parametrize("args, line", [
    (["--start", "1", "--end", "0.1"], "the LR range must grow: 0 < --start < --end, got start 1, end 0.1"),
    (["--start", "0"], "argument --start: 0 is not a number in"),
    (["--steps", "1"], "argument --steps: 1 is not a whole number in 2..100,000"),
    (["--recipe", "no-such-recipe"], "no-such-recipe"),
])
def test_bad_input_is_one_line_and_exit_2_before_anything_trains(tmp_path, args, line):
    one_line_error(speedrun_here("lr-find", "--out", str(tmp_path / "o"), *args), line)
    assert not (tmp_path / "o").exists()


def digest(tree) -> dict:
    return {p.relative_to(tree).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(tree.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_lr_find_on_a_run_directory_adds_its_curve_and_changes_nothing_of_the_run(tiny_one_epoch_run, tmp_path):
    run = shutil.copytree(tiny_one_epoch_run, tmp_path / "run")
    before = digest(run)
    proc = speedrun("lr-find", "--recipe", "tiny", "--device", "cpu", "--start", "1e-4", "--end", "1e4",
                    "--steps", "60", "--out", str(run), "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr
    finding = json.loads(proc.stdout)
    assert json.loads((run / "lr_find.json").read_text()) == finding
    assert (run / "lr_find.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    after = digest(run)
    assert {k: v for k, v in after.items() if not k.startswith("lr_find.")} == before
    # The loss diverged inside the range (1e4 is far past what a tiny ResNet takes), and the
    # suggestion lies below it, where the smoothed loss was still falling or at its lowest.
    assert finding["diverged_lr"] is not None and len(finding["losses"]) < 60
    assert finding["suggested_lr"] < finding["min_loss_lr"] < finding["diverged_lr"]
    assert finding["recipe_lr"] == finding["suggested_lr"] * load_recipe("tiny").world_size
    assert finding["batch_size"] == 64 and finding["size"] == 20  # the tiny recipe's first phase
    assert "suggested" in proc.stderr  # the lines a person reads go to stderr with --json


@pytest.mark.slow
def test_the_python_api_gives_a_finding_for_the_recipe():
    finding = sr.lr_find(load_recipe("tiny"), start=1e-3, end=1e3, steps=15, device="cpu")
    assert isinstance(finding, sr.LRFinding) and finding.recipe == "tiny" and 3 <= len(finding.losses) <= 15
    assert finding.lrs == lr_ramp(1e-3, 1e3, 15)[:len(finding.losses)] and finding.suggested_lr < finding.lrs[-1]
