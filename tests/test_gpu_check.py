"""benchmarks/gpu_check.sh, the device run of issue 14, as a whole on the CPU (GPU_CHECK_SMOKE).

A device session has minutes, not hours: a key renamed between a benchmark's JSON and the
summary that reads it must be found here, not there. This runs every step of the script with a
tiny model and checks what each step hands to the next; the figures themselves mean nothing.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_every_step_and_summarises_them(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_SMOKE": "1"}
    run = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    step = json.loads((out / "gpu-check-step.json").read_text())
    assert [r["size"] for r in step["rows"]] == [32, 40, 48]
    variants = {"baseline", "speedrun", "no-bf16", "no-channels-last", "no-fused", "no-autotune"}
    assert all(set(r["images_per_s"]) == variants for r in step["rows"])
    compiled = json.loads((out / "gpu-check-compile.json").read_text())
    assert set(compiled["rows"][0]["images_per_s"]) == {"speedrun", "+compile"}

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
