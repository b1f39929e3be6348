"""Round trip of `task.run("true")` on the ssh provider, side by side with plain ssh.

    sudo python benchmarks/ssh_roundtrip.py [--runs 50]

It makes its own host (a network namespace running sshd, tests/netns.py; needs
root) and times, over the multiplexed connection speedrun keeps open:

  task.run("true")           what a user calls: script file, tmux window, log, exit status back
  ssh host true (mux)        the same connection without any of that: the floor
  ssh host true (fresh)      the baseline: a new connection, key exchange and login every time

The goal for task.run is a median under 0.1 s. The figures depend on the machine's load: the
ratio to the fresh connection, measured in the same run, is the more portable number.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from speedrun.cluster import make_job
from speedrun.cluster.ssh import SSHHost, SSHOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the namespace-host harness
from netns import NetnsCluster, unavailable_reason  # noqa: E402

GOAL_S = 0.1


def timed(fn: Callable[[], object], runs: int, warmup: int = 3) -> list[float]:
    """Wall-clock seconds of each of `runs` calls of fn, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def ssh_true(argv: list[str]) -> None:
    subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="timed calls of task.run (default 50)")
    parser.add_argument("--baseline-runs", type=int, default=15, help="timed fresh connections (default 15)")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"ssh_roundtrip: cannot make a test host: {reason}", file=sys.stderr)
        return 2

    with NetnsCluster(1) as cluster, tempfile.TemporaryDirectory() as tmp:
        job = make_job("bench", 1, provider="ssh", hosts=cluster.specs, run_root=f"{tmp}/runs", config_dir=tmp,
                       ssh=SSHOptions(known_hosts=cluster.known_hosts, identity_file=cluster.client_key))
        task = job[0]
        host: SSHHost = task.host  # type: ignore[assignment]
        try:
            run = timed(lambda: task.run("true"), args.runs)
            mux = timed(lambda: ssh_true(host.ssh_argv() + ["true"]), args.runs)
            fresh = timed(lambda: ssh_true(["ssh", *host.ssh_options(multiplex=False), host.spec.destination,
                                            "true"]), args.baseline_runs, warmup=1)
        finally:
            job.kill()
            job.close()

    rows = [
        ('task.run("true"), multiplexed', run),
        ("ssh host true, multiplexed (floor)", mux),
        ("ssh host true, fresh connection (baseline)", fresh),
    ]
    print(f"{'round trip':44} {'median':>9} {'p10':>9} {'p90':>9} {'runs':>5}")
    for name, times in rows:
        q = statistics.quantiles(times, n=10)
        print(f"{name:44} {statistics.median(times):8.4f}s {q[0]:8.4f}s {q[-1]:8.4f}s {len(times):5d}")
    median_run, median_fresh = statistics.median(run), statistics.median(fresh)
    print(f"\nbaseline / task.run: {median_fresh / median_run:.1f}x faster than a fresh ssh connection")
    print(f"goal: median task.run under {GOAL_S} s: {'met' if median_run < GOAL_S else 'NOT met'} "
          f"({median_run * 1000:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
