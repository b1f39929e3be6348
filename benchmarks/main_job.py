"""The main job, measured: `speedrun train` (the default recipe, to its 92% top-1 target) run
several times one after another, exactly as the README's first command runs it, with the median
time to target from process start and from the first training step.

    python benchmarks/main_job.py              # 3 runs, about 25 minutes on 2 CPU cores
    python benchmarks/main_job.py --runs 5 --device cuda

Run it on a quiet machine: on 2 cores, any other busy process slows training by up to 2x.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_once(out: Path, device: str | None) -> dict:
    """One `speedrun train` in a fresh process; its results.json."""
    cmd = [sys.executable, "-m", "speedrun", "train", "--out", str(out)]
    if device:
        cmd += ["--device", device]
    code = subprocess.run(cmd).returncode
    if code != 0:
        sys.exit(f"main_job: `speedrun {' '.join(cmd[3:])}` exited with status {code} (its message is above)")
    return json.loads((out / "results.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            r = run_once(Path(tmp) / f"run{i}", args.device)
            rows.append((r["time_to_target_s"], r["time_to_target_from_first_step_s"], r["epochs_run"],
                         r["best"]["top1"]))

    target = r["recipe"]["target"]
    print(f"\nspeedrun train, recipe {r['recipe']['name']}, "
          f"target {target['metric']}>={target['value']}, {r['device']}:")
    for i, (total, from_step, epochs, best) in enumerate(rows):
        when = (f"{total:7.1f} s from start, {from_step:7.1f} s from the first step" if total is not None
                else "target not reached")
        print(f"  run {i + 1}: {when}, {epochs} epochs, best top-1 {100 * best:.2f}%")
    reached = [row for row in rows if row[0] is not None]
    if len(reached) == len(rows):
        print(f"  median: {statistics.median(r[0] for r in rows):.1f} s from start, "
              f"{statistics.median(r[1] for r in rows):.1f} s from the first step")
    else:
        print(f"  {len(rows) - len(reached)} of {len(rows)} runs missed the target")


if __name__ == "__main__":
    main()
