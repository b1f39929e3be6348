"""CPU seconds of a short `speedrun train`, with the start as speedrun makes it (speedrun.startup:
lifelong imports without the cyclic collector, then frozen) and as Python would make it (the
collector left alone), alternated in one script so that both see the same machine.

    python benchmarks/startup.py                  # 6 pairs of 1-epoch tiny runs on the CPU
    python benchmarks/startup.py --pairs 10 --epochs 4
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile

# The same command either way: speedrun's CLI, with kept_imports swapped for a block that does
# nothing in the baseline.
RUN = """
import sys
if sys.argv[1] == "baseline":
    import contextlib, speedrun.startup
    speedrun.startup.kept_imports = contextlib.nullcontext
from speedrun.cli import main
sys.exit(main(sys.argv[2:]))
"""


def cpu_seconds(variant: str, out: str, epochs: int) -> float:
    """User + system CPU seconds of one run (the process and anything it waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", RUN, variant, "train", "--recipe", "tiny", "--device", "cpu", "--epochs",
                    str(epochs), "--out", out], check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--epochs", type=int, default=1)
    args = ap.parse_args()
    times: dict[str, list[float]] = {"speedrun": [], "baseline": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            for variant in ("baseline", "speedrun"):
                times[variant].append(cpu_seconds(variant, f"{tmp}/{variant}-{i}", args.epochs))
    for variant, xs in times.items():
        print(f"{variant:9s} CPU s per run: mean {statistics.mean(xs):.2f}, min {min(xs):.2f}, max {max(xs):.2f}")
    print(f"speedrun / baseline: {statistics.mean(times['speedrun']) / statistics.mean(times['baseline']):.2f}x "
          f"the CPU seconds ({args.pairs} pairs of {args.epochs}-epoch tiny runs)")


if __name__ == "__main__":
    main()
