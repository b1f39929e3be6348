"""Projected schedule times from measured images/s (`speedrun recipes --project`)."""
from __future__ import annotations

import json

import pytest

from cli_run import one_line_error, speedrun_here
from speedrun.errors import SpeedrunError
from speedrun.projection import EVAL_SPEEDUP, Rates, project, read_rates
from speedrun.recipe import Phase, Recipe
from speedrun.recipes import BUILTIN


def test_rates_between_and_beyond_the_measured_sizes_follow_a_power_law():
    rates = Rates({100: 4000.0, 200: 1000.0, 400: 200.0})
    assert rates.at(200) == 1000.0
    assert rates.at(141) == pytest.approx(4000 * (100 / 141) ** 2)  # k = 2 between 100 and 200
    k = 2.321928  # log(1000 / 200) / log(2), between 200 and 400
    assert rates.at(300) == pytest.approx(1000 * (200 / 300) ** k, rel=1e-5)
    assert rates.at(50) == pytest.approx(16000.0)  # beyond the smallest: the nearest two sizes' law
    assert Rates({128: 1000.0}).at(256) == pytest.approx(250.0)  # one size: work grows with the pixels


def test_a_schedule_takes_its_images_over_the_rate_at_each_size():
    recipe = Recipe("two", (Phase(0, 2, size=100, batch_size=8, lr=0.1), Phase(2, 3, size=200, batch_size=8, lr=0.1)),
                    world_size=4, eval_every=2)
    rates = Rates({100: 1000.0, 200: 500.0})
    p = project(recipe, rates, train_images=8000, val_images=600, scaling=0.5)
    assert p.gpus == 4
    assert p.train_s == pytest.approx(2 * 8000 / (1000 * 2) + 8000 / (500 * 2))  # 4 GPUs at half scaling
    # Evaluated after epoch 2 (size 100) and after the last one (size 200).
    assert p.eval_s == pytest.approx(600 / (EVAL_SPEEDUP * 1000 * 2) + 600 / (EVAL_SPEEDUP * 500 * 2))
    with pytest.raises(SpeedrunError, match="--scaling"):
        project(recipe, rates, scaling=1.5)
    with pytest.raises(SpeedrunError, match="--gpus"):
        project(recipe, rates, gpus=0)
    with pytest.raises(SpeedrunError, match="reads fashion-mnist"):
        project(BUILTIN["tiny"], rates)


def test_the_command_prints_each_imagenet_schedule_next_to_the_record(tmp_path):
    summary = tmp_path / "gpu-check-summary.json"
    summary.write_text(json.dumps({"device": "NVIDIA H200", "images_per_s": {"128": 10000, "224": 4000, "288": 2500}}))
    proc = speedrun_here("recipes", "--project", str(summary), "--gpus", "8")
    assert proc.returncode == 0, proc.stderr
    expected = project(BUILTIN["imagenet-1x8"], read_rates(str(summary)), 8)
    lines = {line.split()[1]: line for line in proc.stdout.splitlines() if "imagenet-" in line}
    assert set(lines) == {"imagenet-1x8", "imagenet-2x8", "imagenet-4x8", "imagenet-8x8", "imagenet-16x8"}
    assert f"{expected.total_s / 60:.1f}" in lines["imagenet-1x8"] and "109.0" in lines["imagenet-1x8"]
    assert "NVIDIA H200" in proc.stdout and "12.03 min" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--project", "128=fast"], "give SIZE=IMAGES_PER_S pairs"),
    (["--project", "128=-5"], "must be positive"),
    (["--project", "missing.json"], "no such file"),
    (["--project", "128=1000", "--gpus", "0"], "--gpus must be 1 or more"),
    (["--gpus", "8"], "go with --project"),
])
def test_bad_rates_are_one_line(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)  # where missing.json is not
    one_line_error(speedrun_here("recipes", "imagenet-1x8", *args), message)
