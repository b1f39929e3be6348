"""`speedrun ablate --job` and `speedrun compare JOB` on a real local job (tmux sessions on this
machine): the runs are shared among the job's tasks, and compare reads them from its hosts."""
from __future__ import annotations

import json
import os

import pytest
from cli_run import speedrun
from speedrun.cluster.registry import speedrun_home

pytestmark = pytest.mark.slow  # real runs on a local job


def test_ablate_on_a_job_then_compare_the_job(local_job, tmp_path):
    WIDE = {**os.environ, "COLUMNS": "250"}  # after the fixtures set the private tmux and speedrun home
    job = local_job(num_tasks=2)
    proc = speedrun("ablate", "tiny", "--only", "warmup", "--seeds", "2", "--epochs", "2", "--target", "top1=0.3",
                    "--job", job.name, env=WIDE)
    assert proc.returncode == 0, proc.stderr
    assert "task 0: 2 commands" in proc.stdout and "task 1: 2 commands" in proc.stdout  # shared between the tasks
    # The runs were made on the job's host, in its run directory.
    remote = job[0].path(job.run_dir)
    for variant in ("full", "warmup"):
        for seed in (0, 1):
            done = json.loads(open(f"{remote}/ablate-tiny/{variant}/seed{seed}/results.json").read())
            assert done["status"] in ("finished", "target_reached") and done["seed"] == seed
            assert done["recipe"]["name"] == ("tiny" if variant == "full" else "tiny-no-warmup")
    local = speedrun_home() / "ablate" / job.name / "ablate-tiny"
    summary = json.loads((local / "ablation.json").read_text())
    assert [row["off"] for row in summary["rows"]] == ["full", "warmup"]

    proc = speedrun("compare", job.name, "--plot", str(tmp_path / "job.png"), env=WIDE)
    assert proc.returncode == 0, proc.stderr
    labels = sorted(line.split()[0] for line in proc.stdout.splitlines() if line.strip().startswith("0:"))
    assert labels == [f"0:ablate-tiny/{v}/seed{s}" for v in ("full", "warmup") for s in (0, 1)]
    assert "4 runs" in proc.stdout and (tmp_path / "job.png").is_file()
