"""The main job, measured: `speedrun train` (the default recipe, to its 92% top-1 target) run
several times one after another, exactly as the README's first command runs it, with the median
time to target from process start and from the first training step.

    python benchmarks/main_job.py              # 3 runs, 3 to 5 minutes each on 2 CPU cores
    python benchmarks/main_job.py --runs 5 --device cuda
    python benchmarks/main_job.py --memory-formats contiguous channels_last   # side by side, alternating

With --memory-formats, each round runs one `speedrun train --memory-format F` per format, so a
host that slows down or speeds up mid-benchmark weighs on every format alike; the medians and their
ratio against the first format follow.

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


def run_once(out: Path, device: str | None, memory_format: str | None = None) -> dict:
    """One `speedrun train` in a fresh process; its results.json."""
    cmd = [sys.executable, "-m", "speedrun", "train", "--out", str(out)]
    if device:
        cmd += ["--device", device]
    if memory_format:
        cmd += ["--memory-format", memory_format]
    code = subprocess.run(cmd).returncode
    if code != 0:
        sys.exit(f"main_job: `speedrun {' '.join(cmd[3:])}` exited with status {code} (its message is above)")
    return json.loads((out / "results.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--memory-formats", nargs="+", default=[None], metavar="FORMAT",
                        choices=("auto", "channels_last", "contiguous"),
                        help="run each round once per format, alternating (default: the run's own choice)")
    args = parser.parse_args()

    rows = {f: [] for f in args.memory_formats}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for f in args.memory_formats:
                r = run_once(Path(tmp) / f"run{i}-{f}", args.device, f)
                rows[f].append((r["time_to_target_s"], r["time_to_target_from_first_step_s"], r["epochs_run"],
                                r["best"]["top1"], r["memory_format"]))

    target = r["recipe"]["target"]
    medians = {}
    for f, runs in rows.items():
        print(f"\nspeedrun train{f' --memory-format {f}' if f else ''}, recipe {r['recipe']['name']}, "
              f"target {target['metric']}>={target['value']}, {r['device']}:")
        for i, (total, from_step, epochs, best, layout) in enumerate(runs):
            when = (f"{total:7.1f} s from start, {from_step:7.1f} s from the first step" if total is not None
                    else "target not reached")
            print(f"  run {i + 1}: {when}, {epochs} epochs, best top-1 {100 * best:.2f}%, {layout}")
        if all(row[0] is not None for row in runs):
            medians[f] = statistics.median(row[0] for row in runs)
            print(f"  median: {medians[f]:.1f} s from start, "
                  f"{statistics.median(row[1] for row in runs):.1f} s from the first step")
        else:
            print(f"  {sum(row[0] is None for row in runs)} of {len(runs)} runs missed the target")
    first = args.memory_formats[0]
    if len(medians) > 1 and first in medians:
        print("\nmedian time to target against " + str(first) + ": " + ", ".join(
            f"{f} {medians[first] / m:.2f}x" for f, m in medians.items() if f != first))


if __name__ == "__main__":
    main()
