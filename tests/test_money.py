"""What runs cost (speedrun.money): the price the job layer hands a run, and what results.json
makes of it, interruptions included; a run without a price says so."""
import json
import os
import signal

import pytest
from cli_run import speedrun, start, wait_for

from speedrun.errors import SpeedrunError
from speedrun.money import PRICE_ENV, Price, check_price, cost_fields, price_from_env

P4D_SPOT = Price("p4d.24xlarge", "spot", 2, 9.83, "spot price history, us-east-1a, 2026-12-02")


def test_a_price_costs_machines_times_dollars_per_hour_times_hours():
    assert P4D_SPOT.cost(1800) == pytest.approx(2 * 9.83 / 2)
    fields = cost_fields(P4D_SPOT, billed_s=3600.0, to_target_s=900.0)
    assert fields["machine_hours"] == 2.0 and fields["cost_usd"] == pytest.approx(19.66)
    assert fields["cost_to_target_usd"] == pytest.approx(19.66 / 4)
    assert fields["price"]["usd_per_hour"] == 9.83 and fields["price_note"] is None
    assert cost_fields(P4D_SPOT, 3600.0, None)["cost_to_target_usd"] is None  # target not reached


def test_without_a_price_every_amount_is_none_and_the_note_says_why():
    fields = cost_fields(None, billed_s=3600.0, to_target_s=900.0)
    assert (fields["price"], fields["machine_hours"], fields["cost_usd"], fields["cost_to_target_usd"]) == (
        None, None, None, None)
    assert fields["price_note"].startswith("no price: ") and "--price-per-hour" in fields["price_note"]


def test_the_price_travels_in_the_environment_and_bad_ones_are_refused():
    assert price_from_env({PRICE_ENV: P4D_SPOT.to_env()}) == P4D_SPOT
    assert price_from_env({}) is None
    with pytest.raises(SpeedrunError, match="is not JSON"):
        price_from_env({PRICE_ENV: "{9.83"})
    with pytest.raises(SpeedrunError, match="not a price"):
        price_from_env({PRICE_ENV: '{"machine_type": "x"}'})
    with pytest.raises(SpeedrunError, match=r"a price per machine-hour must be a number in 0\.0001\.\.10,000"):
        price_from_env({PRICE_ENV: json.dumps({**json.loads(P4D_SPOT.to_env()), "usd_per_hour": -1})})
    for bad in (0.0, -2.0, 1e308, float("inf"), float("nan")):
        with pytest.raises(SpeedrunError, match=r"--price-per-hour must be a number in 0\.0001\.\.10,000"):
            check_price(bad)


@pytest.mark.slow
def test_a_run_without_a_price_records_none(tiny_run):
    results = json.loads((tiny_run / "results.json").read_text())
    assert results["price"] is None and results["cost_usd"] is None and results["cost_to_target_usd"] is None
    assert results["price_note"].startswith("no price: ")
    assert results["billed_s"] == pytest.approx(results["total_s"] + results["lost_s"])


@pytest.mark.slow
def test_an_interrupted_run_costs_its_time_and_the_time_its_interruption_lost(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, PRICE_ENV: P4D_SPOT.to_env()}
    # Reached at epoch 3 of 4 (of this seed), after the interruption: its cost includes what was lost.
    args = ["train", "--recipe", "tiny", "--device", "cpu", "--deterministic", "--target", "top1=0.6",
            "--out", str(out)]
    proc = start(*args, env=env)
    wait_for(lambda: (out / "checkpoint.pt").exists() or proc.poll() is not None, 300, "the first checkpoint")
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    resumed = speedrun(*args, "--resume")  # given no price: the run keeps the one it started with
    assert resumed.returncode == 0, resumed.stderr

    r = json.loads((out / "results.json").read_text())
    assert r["status"] == "target_reached" and r["target_epoch"] > 1, r["target_epoch"]
    (lost,) = r["interruptions"]
    assert r["lost_s"] == lost["wall_s_lost"] > 0
    assert r["price"] == json.loads(P4D_SPOT.to_env()) and r["price_note"] is None
    assert r["billed_s"] == pytest.approx(r["total_s"] + r["lost_s"])
    assert r["machine_hours"] == pytest.approx(2 * r["billed_s"] / 3600)
    assert r["cost_usd"] == pytest.approx(2 * 9.83 * (r["total_s"] + r["lost_s"]) / 3600)
    assert r["cost_to_target_usd"] == pytest.approx(2 * 9.83 * (r["time_to_target_s"] + r["lost_s"]) / 3600)
    assert r["lost_usd"] == pytest.approx(2 * 9.83 * r["lost_s"] / 3600)
