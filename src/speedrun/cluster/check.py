"""`speedrun check JOB`: how fast the job's machines all-reduce, measured on them.

    speedrun check r50                 # every task, one process per GPU (one per task on CPUs)
    speedrun check r50 --size 256 --iters 50

`check_job` launches allreduce.py's benchmark on every task of the job (one torchrun per task, as
`launch` does, in a window called `check`), waits for it, and reads the result rank 0 wrote to
`<run_dir>/check.json`; `verdict` holds the largest message's bus bandwidth against what the
provider says the network promises (AWS: the instance type's network cards), and names the
transport NCCL chose when it should have used EFA and did not. The result, verdict included, stays
in the run directory as JSON.
"""
from __future__ import annotations

import json
import secrets
from typing import TYPE_CHECKING, Any

from speedrun.errors import SpeedrunError
from speedrun.files import to_json
from speedrun.inputs import Bound

if TYPE_CHECKING:  # annotations only: like cli.py, the command imports the job layer when it runs
    from speedrun.cluster.job import Job
    from speedrun.cluster.provider import NetworkSpec

WINDOW = "check"
RESULT_FILE = "check.json"
# A measured bus bandwidth at least this share of the nominal one is what a healthy network gives
# NCCL's ring all-reduce; below the lower share, something is wrong (a fallback to sockets, a
# machine outside the placement group, a slow interface).
GOOD_SHARE, POOR_SHARE = 0.5, 0.2


MESSAGE_MIB = Bound(float, 0.001, 16384)  # the largest message, MiB
ITERS = Bound(int, 1, 1_000_000)  # timed calls per message size


def check_sizes(size_mb: float, iters: int) -> None:
    """SpeedrunError unless the largest message (MiB) and the calls per size are ones to run."""
    if not MESSAGE_MIB.holds(size_mb):
        raise SpeedrunError(f"--size must be {MESSAGE_MIB} (MiB), got {size_mb!r}")
    if not ITERS.holds(iters):
        raise SpeedrunError(f"--iters must be {ITERS}, got {iters!r}")


def check_job(job: Job, *, size_mb: float = 64.0, iters: int = 20, nproc_per_node: int | None = None,
              timeout_s: float = 900.0) -> dict[str, Any]:
    """Run the all-reduce benchmark on every task of `job` (largest message `size_mb` MiB, `iters`
    timed calls per size, `nproc_per_node` processes per task: default one per GPU) and return
    its result with the verdict, also written to <run_dir>/check.json. A task that fails or a host
    that is lost raises as Job.wait does; no result raises SpeedrunError. The benchmark's processes
    end by themselves once `timeout_s` seconds have passed, also when this process was killed or
    lost their host; a check still running from then is stopped when the next one starts."""
    check_sizes(size_mb, iters)
    nproc = nproc_per_node if nproc_per_node is not None else job.devices_per_task()
    out = f"{job.run_dir}/{RESULT_FILE}"
    check_id = secrets.token_hex(8)  # the result must be this check's, never an earlier one's left there
    command = ["-m", "speedrun.cluster.allreduce", "--out", out, "--size", f"{size_mb:g}", "--iters", str(iters),
               "--id", check_id, "--max-seconds", f"{timeout_s:g}"]
    job.run_step(command, nproc_per_node=nproc, name=WINDOW, timeout_s=timeout_s)
    first = job.tasks[0]
    try:
        result = json.loads(first.read(out))
    except (SpeedrunError, ValueError) as e:
        raise SpeedrunError(f"job {job.name}: the check ended but left no result in {out} ({e})") from None
    if result.get("id") != check_id:
        raise SpeedrunError(f"job {job.name}: the check ended but {out} holds an earlier check's result")
    result["machines"] = job.machine_count()  # local jobs: tasks that share a machine
    spec = job.provider.network()
    result["nominal_gbps"] = spec.gbps if spec else None
    result["nominal_source"] = spec.source if spec else None
    result["efa_expected"] = bool(spec and spec.efa)
    result["verdict"] = verdict(result, spec)
    first.write(out, to_json(result, indent=1) + "\n")
    result["path"] = out
    return result


def verdict(result: dict[str, Any], spec: NetworkSpec | None) -> str:
    """One line on the largest message's bus bandwidth: against the network's nominal bandwidth
    (spec), and naming a transport that is not the one the machines were launched for (EFA)."""
    largest = result["results"][-1]
    gbps = largest["busbw_GBps"] * 8
    measured = f"{gbps:,.1f} Gbit/s bus bandwidth at {largest['bytes'] / 2**20:g} MiB"
    if any(r["wrong"] for r in result["results"]):
        return f"WRONG: some sums were wrong ({measured}); the devices or the library are at fault"
    if result["machines"] < 2:
        return (f"one machine: {measured} between its {result['ranks']} processes; no network between "
                f"machines was used")
    if spec is not None and spec.efa and result["backend"] == "nccl" and result["transport"] != "EFA":
        return (f"SLOW: NCCL moved data over {result['transport'] or 'an unnamed transport'}, not EFA ({measured}): "
                f"the image lacks aws-ofi-nccl or libfabric's EFA provider (the AWS Deep Learning AMI has both)")
    if spec is None:
        return f"{measured}; no nominal bandwidth is known for these machines to hold it against"
    share = gbps / spec.gbps
    word = "good" if share >= GOOD_SHARE else "below nominal" if share >= POOR_SHARE else "SLOW"
    return f"{word}: {measured}, {share:.0%} of the nominal {spec.gbps:g} Gbit/s ({spec.source})"


def format_table(result: dict[str, Any]) -> list[str]:
    """The result as nccl-tests prints it: one row per message size."""
    lines = [f"all-reduce, {result['backend']} over {result['transport'] or 'a transport NCCL did not name'}: "
             f"{result['ranks']} processes, {result['nodes']} task(s) on {result['machines']} machine(s) "
             f"({result['device']}), "
             f"{result['iters']} calls per size",
             f"{'size (B)':>12} {'count':>11} {'type':>8} {'time (us)':>11} {'algbw (GB/s)':>13} "
             f"{'busbw (GB/s)':>13} {'#wrong':>7}"]
    for r in result["results"]:
        lines.append(f"{r['bytes']:>12} {r['count']:>11} {r['type']:>8} {r['time_us']:>11.1f} "
                     f"{r['algbw_GBps']:>13.3f} {r['busbw_GBps']:>13.3f} {r['wrong']:>7}")
    if result.get("paths"):
        lines.append(f"NCCL's paths: {', '.join(result['paths'])}")
    return lines
