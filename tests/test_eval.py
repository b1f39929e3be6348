"""`speedrun eval RUN_DIR`: score a run's checkpoint without training, on any number of processes."""
import json
import os

import pytest
from cli_run import speedrun

from speedrun.track import read_jsonl


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
    """Two epochs of a tiny recipe that keeps an EMA of its weights and evaluates with flips."""
    d = tmp_path_factory.mktemp("eval")
    recipe = d / "ema.py"
    recipe.write_text(
        "import dataclasses\n"
        "from speedrun.recipes import BUILTIN\n"
        "recipe = dataclasses.replace(BUILTIN['tiny'].with_epochs(2), name='tiny-ema', ema_decay=0.99, eval_flip=True)\n"
    )
    out = d / "run"
    proc = speedrun("train", "--recipe", str(recipe), "--device", "cpu", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


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


def test_eval_at_another_size_without_flips_gives_other_numbers(ema_run):
    proc = speedrun("eval", str(ema_run), "--device", "cpu", "--size", "24", "--no-flip", "--rect")
    assert proc.returncode == 0, proc.stderr
    record = read_jsonl(ema_run / "eval.jsonl")[-1]
    final = json.loads((ema_run / "results.json").read_text())["final"]
    assert (record["size"], record["flip"], record["rect"]) == (24, False, True)
    assert record["count"] == 1000 and record["loss"] != pytest.approx(final["loss"], rel=1e-4)


def test_eval_of_a_directory_without_a_checkpoint_is_one_line(tmp_path):
    proc = speedrun("eval", str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "no checkpoint" in proc.stderr
