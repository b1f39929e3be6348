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
    (["--project", "128=1000", "--gpus", "0"], "argument --gpus: 0 is not a whole number in 1..100,000"),
    (["--project", "128=1000", "--scaling", "nan"], "argument --scaling: nan is not a number in 0.01..1"),
    (["--project", "A100:128=1000", "--machines", "p4d.24xlarge", "--startup-min", "nan"],
     "argument --startup-min: nan is not a number in 0..1440"),
    (["--gpus", "8"], "go with --project"),
    (["--machines", "p4d.24xlarge"], "go with --project"),
    (["--count", "2"], "go with --project RATES --machines"),
    (["--project", "A100:128=1000", "--machines", "p4d.24xlarge", "--count", "0"], "every count must be 1 or more"),
    (["--project", "A100:128=1000", "--machines", "p4d.24xlarge,m9.huge"], "not a GPU machine type speedrun knows"),
    (["--project", "A100:128=1000", "--machines", "p5.48xlarge"], "add --project H100:"),
    (["--project", "128=1000", "--project", "224=500"], "--project once"),
])
def test_bad_rates_are_one_line(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)  # where missing.json is not
    one_line_error(speedrun_here("recipes", "imagenet-1x8", *args), message)


@pytest.fixture
def no_aws(monkeypatch, tmp_path):
    """No AWS access: no credentials anywhere boto3 looks, and no asking EC2's metadata service."""
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))


def test_cost_projection_of_two_machine_types_marks_the_fastest_and_the_cheapest(tmp_path, no_aws):
    recipe = tmp_path / "one_phase.py"
    recipe.write_text("from speedrun.recipe import Phase, Recipe\n"
                      "recipe = Recipe('one-phase', (Phase(0, 2, size=128, batch_size=256, lr=0.1),), "
                      "dataset='imagefolder', world_size=8, eval_every=1)\n")
    proc = speedrun_here("recipes", str(recipe), "--project", "A100:128=1000", "--project", "L40S:128=400",
                         "--machines", "p4d.24xlarge,g6e.xlarge", "--count", "1,2")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in proc.stdout.splitlines() if line.startswith("│")}
    # By hand: 2 epochs of 1,281,167 images at 1000 images/s per A100 on 8 A100s (320.3 s) and two
    # evaluations of 50,000 images at 3x that (4.2 s), plus 5 min start-up: 624.5 s = 10.4 min, at
    # $21.96 an hour (the table's p4d.24xlarge): $3.81. One L40S at 400 images/s: 6405.8 + 83.3 +
    # 300 s = 113.2 min at $1.861: $3.51; two: 59.1 min, 2 x $1.861: $3.66.
    assert rows["1 x p4d.24xlarge"] == ["8 x A100", "$21.96 on-demand", "10.4", "$3.81", ""]
    assert rows["2 x p4d.24xlarge"][2:] == ["7.7", "$5.64", "fastest"]
    assert rows["1 x g6e.xlarge"] == ["1 x L40S", "$1.86 on-demand", "113.2", "$3.51", "cheapest"]
    assert rows["2 x g6e.xlarge"][2:] == ["59.1", "$3.66", ""]
    assert "projected, not measured" in proc.stdout and "5 min start-up" in proc.stdout
    assert "scaling 1 of linear" in proc.stdout and "on-demand table of 2025-06" in proc.stdout
    spot = speedrun_here("recipes", str(recipe), "--project", "A100:128=1000", "--machines", "p4d.24xlarge", "--spot")
    assert spot.returncode == 0 and "no price" in spot.stdout and "no spot prices without AWS access" in spot.stdout


def test_rates_are_matched_to_a_machine_types_gpu_by_label_or_by_the_summarys_device(tmp_path):
    from speedrun.projection import rates_for, read_gpu_rates

    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"device": "NVIDIA A100-SXM4-40GB", "images_per_s": {"128": 2000}}))
    measured = [read_gpu_rates(str(summary)), read_gpu_rates("H100:128=3000")]
    assert rates_for("A100", measured).at(128) == 2000 and rates_for("h100", measured).at(128) == 3000
    assert rates_for("V100", measured) is None
