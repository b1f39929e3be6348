"""`speedrun tune --job`: a search whose trials run one per task of a job of two ssh hosts (network
namespaces running sshd), its study and report on this machine."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from speedrun.cluster.registry import speedrun_home

pytestmark = pytest.mark.netns

SPACE = "from speedrun.tune.space import Range\nspace = {'label_smoothing': Range(0, 0.1)}\n"


def test_a_search_runs_one_trial_per_task_of_an_ssh_job_and_reports_here(ssh_job, tmp_path):
    job = ssh_job(num_tasks=2)
    (tmp_path / "space.py").write_text(SPACE)
    r = subprocess.run([sys.executable, "-m", "speedrun", "tune", "tiny", "--job", job.name, "--epochs", "1",
                        "--target", "top1=0.3", "--env", "OMP_NUM_THREADS=1",
                        "--trials", "3", "--space", str(tmp_path / "space.py"), "--device", "cpu", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert sorted(t["number"] for t in summary["trials"]) == [0, 1, 2]
    assert all(t["state"] == "complete" for t in summary["trials"])
    assert "trial 0 on task 0:" in r.stderr and "trial 1 on task 1:" in r.stderr  # two at once, one per task
    # Each trial is an ordinary run under the job's run directory, a command of its task's session.
    remote = Path(job.run_dir) / "tune-tiny"
    for t in summary["trials"]:
        results = json.loads((remote / t["dir"] / "results.json").read_text())
        assert results["status"] == "target_reached" and results["recipe"]["name"] == f"tiny-trial{t['number']:03d}"
        # --env reached the trial on its host: one computing thread, where the host's 2 cores would give 2.
        assert results["device"].endswith(", 1 threads)"), results["device"]
    commands = {(i, n): job.tasks[i].command(f"trial-{n:03d}") for i in (0, 1) for n in range(3)}
    ran = {where: c for where, c in commands.items() if c is not None}
    assert {(0, 0), (1, 1)} <= set(ran) and len(ran) == 3 and all(c.state() == "0" for c in ran.values())
    # The study, the report and the trials' results are here.
    local = speedrun_home() / "tune" / job.name / "tune-tiny"
    assert (local / "study.db").exists() and (local / "best_recipe.py").exists() and (local / "tune.png").exists()
    for t in summary["trials"]:
        assert json.loads((local / t["dir"] / "results.json").read_text())["status"] == "target_reached"
