"""What a Slurm time limit costs a speedrun job: the warning, the stop at a step, the requeue and the
resumed run, side by side with the same job run without a limit.

    sudo python benchmarks/slurm_requeue.py [--epochs 60] [--cred-expire 10] [--out FILE]

It builds the test Slurm cluster (tests/slurm_cluster.py: Debian's slurmctld, slurmd and munge,
nodes in network namespaces; needs root and those packages), trains a small GroupNorm model on two
nodes (gloo, one process each) once without a limit (the baseline) and once with `--time 2
--signal-lead 60`, so that Slurm warns about a minute into each start and the job requeues itself
until the run is done. For each interruption it prints:

  warning -> stopped     Slurm's warning to the run's checkpoint and the requeue (speedrun's part)
  stopped -> started     the requeue to the next start of the batch script (Slurm's part: it holds a
                         requeued job for its credentials' lifetime, --cred-expire; 120 s by default)
  started -> first step  torchrun, Python, data and model start, and reading the checkpoint
  steps redone           steps trained before the stop that the checkpoint did not hold (goal: 0)

and the job's wall time against the baseline's. Goal (issue 25): 0 steps redone, and the warning to
the first step dominated by the scheduler, not speedrun.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the Slurm test cluster
from slurm_cluster import SlurmCluster, unavailable_reason  # noqa: E402
from test_distributed import write_recipe  # noqa: E402

from speedrun.cluster import make_job  # noqa: E402


def train(recipe: Path, run_root: Path, name: str, **options) -> tuple[Path, float, list[tuple[float, int]]]:
    """One 2-node job of `recipe`; its run directory, wall seconds (submit to end) and the step
    count as it grew: (time, steps) each time it changed, polled every 0.1 s."""
    job = make_job(name, 2, provider="slurm", run_root=str(run_root), **options)
    seen: list[tuple[float, int]] = []
    done = threading.Event()

    def poll() -> None:
        steps = Path(job.run_dir) / "steps.jsonl"
        while not done.wait(0.1):
            n = len(steps.read_text().splitlines()) if steps.exists() else 0
            if not seen or n != seen[-1][1]:
                seen.append((time.time(), n))
    threading.Thread(target=poll, daemon=True).start()
    start = time.time()
    job.launch(["-m", "speedrun", "train", "--recipe", str(recipe), "--device", "cpu", "--deterministic",
                "--log-every", "1", "--out", job.run_dir], env={"OMP_NUM_THREADS": "1"})
    results = job.wait(timeout=3600, check=False)
    wall = time.time() - start
    done.set()
    if any(not r.ok for r in results):
        raise SystemExit(f"slurm_requeue: job {name} failed; see {job.run_dir}")
    return Path(job.run_dir), wall, seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=60,
                        help="epochs of 768 images (default 60: 1440 steps, long enough to meet the warning)")
    parser.add_argument("--cred-expire", type=int, default=10,
                        help="the cluster's credential lifetime, seconds: how long Slurm holds a requeued job "
                             "(default 10; Slurm's own default is 120)")
    parser.add_argument("--out", type=Path, help="also write the numbers as JSON here")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"slurm_requeue: cannot build the test cluster: {reason}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="speedrun-slurm-bench-"))
    os.environ["SPEEDRUN_HOME"] = str(work / "home")
    recipe = write_recipe(work / "r.py", 2, 32, epochs=args.epochs, model="resnet-fmnist-tiny-gn")
    with SlurmCluster(3, workdir=work / "cluster", cred_expire_s=args.cred_expire) as cluster:
        os.environ.update(cluster.env)
        _, base_wall, _ = train(recipe, work / "runs", "baseline")  # a failed job exits, leaving `work` to look at
        run, wall, seen = train(recipe, work / "runs", "limited", time="2", signal_lead_s=60, max_requeues=20)
    results = json.loads((run / "results.json").read_text())
    shutil.rmtree(work, ignore_errors=True)
    rows = []
    for rec, cost in zip(results["recoveries"], results["interruptions"]):
        started = rec["at"] + rec["relaunch_s"]
        first = next((t for t, n in seen if t > started and n > cost["resumed_at_step"]), None)
        rows.append({"warning_to_stopped_s": rec["at"] - rec["warned_at"] if rec.get("warned_at") else None,
                     "stopped_to_started_s": rec["relaunch_s"],
                     "started_to_first_step_s": first - started if first else None,
                     "warning_to_first_step_s": first - (rec.get("warned_at") or rec["at"]) if first else None,
                     "steps_redone": cost["steps_redone"]})
    print(f"slurm_requeue: {len(rows)} interruption(s) of a {args.epochs}-epoch run on 2 nodes, "
          f"cred_expire {args.cred_expire} s")
    for i, r in enumerate(rows, 1):
        parts = ", ".join(f"{k.replace('_', ' ')} {v}" if not k.endswith("_s") else
                          f"{k.removesuffix('_s').replace('_', ' ')} {'-' if v is None else f'{v:.1f} s'}"
                          for k, v in r.items())
        print(f"  {i}: {parts}")
    print(f"  steps: {results['steps']} (the baseline's: same recipe), status {results['status']}")
    print(f"  wall: {wall:.1f} s with the limit vs {base_wall:.1f} s without: ratio {wall / base_wall:.2f}")
    if args.out:
        args.out.write_text(json.dumps({"interruptions": rows, "wall_s": wall, "baseline_wall_s": base_wall,
                                        "cred_expire_s": args.cred_expire, "epochs": args.epochs}, indent=2))
    redone = sum(r["steps_redone"] for r in rows)
    return 0 if rows and redone == 0 and results["status"] == "finished" else 1


if __name__ == "__main__":
    sys.exit(main())
