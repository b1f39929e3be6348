"""Sweep the learning rate of the `tiny` recipe with a plain Python loop: one job per value.

    python examples/sweep.py                                  # on this machine, one task per job
    python examples/sweep.py --hosts gpu1,gpu2 --run-root /shared/runs --device cuda   # 2 machines a job

Experiments are code: the values are a Python list, each job's recipe is a Python file written for
its value (into the job's run directory, which every task sees), and the results come back as a
table. Run the script again while the jobs run and it reconnects to them instead of restarting
anything; once they have finished, running it again starts new runs (run.02, ...).
Follow a job with `speedrun logs sweep-lr0p5 -f`, or watch it with `speedrun attach sweep-lr0p5`.
"""
from __future__ import annotations

import argparse
import json

from speedrun.cluster import make_job

# A recipe file for one value: the tiny recipe with every phase's learning rate scaled.
RECIPE = """\
import dataclasses

from speedrun.recipes.fashion_mnist import tiny


def scaled(lr):
    return tuple(x * {scale} for x in lr) if isinstance(lr, tuple) else lr * {scale}


recipe = dataclasses.replace(tiny, phases=tuple(dataclasses.replace(p, lr=scaled(p.lr)) for p in tiny.phases))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description="Sweep the tiny recipe's learning rate, one job per value.")
    parser.add_argument("--scales", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="learning-rate factors")
    parser.add_argument("--hosts", default="", help="user@host,... for the ssh provider (default: this machine)")
    parser.add_argument("--run-root", default="runs", help="where run directories go (shared storage for ssh)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--serial", action="store_true", help="one job at a time (small machines)")
    parser.add_argument("--restart", action="store_true", help="start afresh even if the jobs are running")
    args = parser.parse_args()
    hosts = [h for h in args.hosts.split(",") if h]

    jobs = []
    for scale in args.scales:
        name = f"sweep-lr{scale:g}".replace(".", "p")
        job = make_job(name, len(hosts) or 1, provider="ssh" if hosts else "local", hosts=hosts,
                       run_root=args.run_root, restart=args.restart)
        recipe = f"{job.run_dir}/recipe.py"
        if not job.reconnected:
            job[0].write(recipe, RECIPE.format(scale=scale))
        job.launch(["-m", "speedrun", "train", "--recipe", recipe, "--device", args.device, "--out", job.run_dir],
                   env={"OMP_NUM_THREADS": "1"} if args.device == "cpu" else {})
        print(f"{name}: {'reconnected to' if job.reconnected else 'started'} {job.run_dir}")
        if args.serial:
            job.wait(check=False)
        jobs.append((scale, job))

    print(f"\n{'lr x':>6} {'top1':>7} {'top5':>7} {'seconds':>8}  run")
    for scale, job in jobs:
        result = job.wait(check=False)[0]
        if not result.ok:
            print(f"{scale:6g} failed (exit status {result.status}; log {result.log})")
            continue
        r = json.loads(job[0].read(f"{job.run_dir}/results.json"))
        print(f"{scale:6g} {r['final']['top1']:7.3f} {r['final']['top5']:7.3f} {r['total_s']:8.1f}  {job.run_dir}")


if __name__ == "__main__":
    main()
