"""benchmarks/gpu_check.sh, the device run of issue 14, as a whole on the CPU (GPU_CHECK_SMOKE).

A device session has minutes, not hours: a key renamed between a benchmark's JSON and the
summary that reads it must be found here, not there. This runs every step of the script with a
tiny model and checks what each step hands to the next; the figures themselves mean nothing.
The script's step runner (benchmarks/gpu_check_steps.sh) is also run alone on small commands that
die at exit after writing their results, or run out of time: how it names them, what it keeps.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _gpu_check(out: Path, steps: str) -> None:
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_SMOKE": "1", "GPU_CHECK_STEPS": steps}
    run = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.fixture(scope="module")
def first_steps(tmp_path_factory) -> Path:
    """The output folder after steps 1 and 2; the next test runs step 3 into it, as a step that
    failed on the device is run again alone (the two halves are two tests: each well under 120 s)."""
    out = tmp_path_factory.mktemp("gpu-check") / "out"
    _gpu_check(out, "1 2")
    return out


@pytest.mark.slow
def test_gpu_check_steps_1_and_2_leave_their_results_and_a_summary_without_step_3(first_steps):
    out = first_steps
    assert not (out / "gpu-check-feed.json").exists()
    assert json.loads((out / "gpu-check-step.json").read_text())["complete"] is True
    assert json.loads((out / "gpu-check-summary.json").read_text())["images_per_s"] == {}


@pytest.mark.slow
def test_gpu_check_runs_every_step_and_summarises_them(first_steps):
    out = first_steps
    _gpu_check(out, "3")

    step = json.loads((out / "gpu-check-step.json").read_text())
    assert [r["size"] for r in step["rows"]] == [32, 40, 48]
    # Every setting taken away at the middle size only, where the goal is judged.
    variants = {"baseline", "speedrun", "no-bf16", "no-channels-last", "no-fused", "no-autotune"}
    assert [set(r["images_per_s"]) for r in step["rows"]] == [{"baseline", "speedrun"}, variants,
                                                             {"baseline", "speedrun"}]
    compiled = json.loads((out / "gpu-check-compile.json").read_text())
    assert set(compiled["rows"][0]["images_per_s"]) == {"speedrun", "+compile"}
    assert compiled["compile_backend"] == "aot_eager"  # the device's run compiles with inductor
    # Each benchmark marks its results complete last, which run_step reads when a step ends badly.
    feed = json.loads((out / "gpu-check-feed.json").read_text())
    assert step["complete"] is compiled["complete"] is feed["complete"] is True

    summary = json.loads((out / "gpu-check-summary.json").read_text())
    assert summary["device"] == "cpu (GPU_CHECK_SMOKE: a check of the script alone)"
    assert set(summary["images_per_s"]) == {"32", "40", "48"}  # training fed by the GPU decode path
    assert all(rate > 0 for rate in summary["images_per_s"].values())
    # Every goal the issue names is judged (here on meaningless CPU figures), the agreement included.
    goals = summary["goals"]
    assert {f"{s}px_{loader}_fed_vs_synthetic_>=0.95" for s in (32, 40, 48) for loader in ("pil", "gpu")} < set(goals)
    assert "40px_synthetic_>=7800" in goals
    assert goals["gpu_path_same_labels_as_pil"] is True
    assert summary["agreement"]["device"] == "cpu"

    projection = (out / "projection.txt").read_text()
    for name in ("imagenet-1x8", "imagenet-16x8"):
        assert name in projection
    assert "MLPerf" in projection


def _run_step(tmp_path, seconds: int, code: str, smoke: bool = False) -> tuple[subprocess.CompletedProcess, Path]:
    """gpu_check.sh's step runner (benchmarks/gpu_check_steps.sh) on `python3 -c code` as step 2,
    whose results go to $JSON; then the script's closing report. `smoke`: as GPU_CHECK_SMOKE=1 runs it."""
    json_path = tmp_path / "gpu-check-x.json"
    script = (f'source "{REPO}/benchmarks/gpu_check_steps.sh"\n'
              f'run_step 2 {seconds} "$JSON" "{tmp_path}/x.txt" python3 -c "$CODE"; echo "run_step $?"\n'
              f'report_steps "{tmp_path}"')
    env = {**os.environ, "JSON": str(json_path), "CODE": code, "GPU_CHECK_SMOKE": "1" if smoke else "0"}
    run = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    return run, json_path


WRITE = "import json, os, sys; open(os.environ['JSON'], 'w').write(json.dumps({'rows': [1], 'complete': %s}))\n"


@pytest.mark.slow
def test_a_step_that_dies_at_exit_after_writing_its_results_is_named_and_they_are_kept(tmp_path):
    # What issue 23 saw: a benchmark wrote its results, then the interpreter died at exit (SIGSEGV).
    crash_at_exit = WRITE % True + "import atexit, signal; atexit.register(os.kill, os.getpid(), signal.SIGSEGV)"
    run, results = _run_step(tmp_path, 60, crash_at_exit)
    assert run.returncode == 1 and "run_step 1" in run.stdout
    assert (f"gpu_check: step 2 wrote all its results to {results}, then died at exit (SIGSEGV, exit 139); "
            "they are kept and used") in run.stderr.splitlines()
    assert run.stderr.splitlines()[-1] == ("gpu_check: 1 step(s) did not end cleanly (above); "
                                           f"all logs and results are in {tmp_path}")
    assert json.loads(results.read_text()) == {"rows": [1], "complete": True}
    # Its log holds what was running when it died: the Python stack of every thread (faulthandler).
    log = (tmp_path / "x.txt").read_text()
    assert "Fatal Python error: Segmentation fault" in log
    assert "Current thread" in log or "Thread 0x" in log


@pytest.mark.slow
def test_a_step_that_runs_out_of_time_keeps_its_partial_results_and_says_so(tmp_path):
    hangs = WRITE % False + "import signal; signal.pause()"
    run, results = _run_step(tmp_path, 1, hangs)
    assert run.returncode == 1 and "run_step 1" in run.stdout
    line = f"gpu_check: step 2 ran out of time (1 s); its partial results are kept in {results}"
    assert line in run.stderr.splitlines()
    assert json.loads(results.read_text())["rows"] == [1]


@pytest.mark.slow
def test_a_smoke_run_holds_no_step_to_the_devices_time_limit(tmp_path):
    # The limits are the device's budget; on a CPU shared with test workers a smoke step may take
    # longer (torch.compile's ran past its 100 s beside three workers on 2 cores) and must not fail.
    run, results = _run_step(tmp_path, 1, WRITE % True + "import time; time.sleep(2)", smoke=True)
    assert run.returncode == 0 and "run_step 0" in run.stdout and run.stderr == "", run.stderr
    assert json.loads(results.read_text())["complete"] is True


@pytest.mark.slow
def test_a_step_that_ends_cleanly_is_not_reported(tmp_path):
    run, results = _run_step(tmp_path, 60, WRITE % True)
    assert run.returncode == 0 and "run_step 0" in run.stdout and run.stderr == ""
