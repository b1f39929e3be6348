"""A speedrun job's one Slurm job: submitting it (`submit`), what Slurm says of it (`job_state`) and
cancelling it (`cancel`), through sbatch, scontrol and scancel.

Slurm keeps a finished job in its controller's memory for MinJobAge seconds (300 by default); after
that only its accounting (sacct, where the cluster has slurmdbd) knows it, and `job_state` returns
None: what the job's tasks wrote to the run directory then says how it ended.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from speedrun.cluster.slurm.api import CLIENT_TIMEOUT_S, SlurmFailed, run_client
from speedrun.errors import SpeedrunError

# Slurm's job states that end a job (it is not requeued from them by Slurm itself).
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "SPECIAL_EXIT")
WAITING = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED", "CONFIGURING")
# In `scontrol show node -o`, the state of a node lost to a job: down, failed, or not responding (a
# drained node is one an administrator set aside, not lost).
LOST_STATES = r" State=[A-Z_+]*(DOWN|FAIL|NOT_RESPONDING)"


@dataclass(frozen=True)
class SlurmJobState:
    """What `scontrol show job` says of a job."""

    job_id: str
    state: str  # PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, NODE_FAIL, PREEMPTED...
    reason: str  # why it waits or ended ("Resources", "BeginTime", "NonZeroExitCode"; "None")
    exit_code: int  # the batch script's exit status (0 until it ends)
    signal: int  # the signal that ended it, 0 for none
    restarts: int  # times it was requeued
    nodes: str  # its nodes ("node[1-2]"; "(null)" or "" while pending)

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    @property
    def waiting(self) -> bool:
        """Pending or requeued: its tasks are not running."""
        return self.state in WAITING

    def describe(self) -> str:
        """One line: "slurm job 12: PENDING (Resources)", "... RUNNING on node[1-2], requeued 1 time"."""
        text = f"slurm job {self.job_id}: {self.state}"
        if self.waiting and self.reason not in ("", "None"):
            text += f" ({self.reason})"
        if self.state == "RUNNING" and self.nodes not in ("", "(null)"):
            text += f" on {self.nodes}"
        if self.ended and self.state != "COMPLETED":
            text += f", exit {self.exit_code}" + (f" (signal {self.signal})" if self.signal else "")
        if self.restarts:
            text += f", requeued {self.restarts} time{'s' if self.restarts > 1 else ''}"
        return text


def submit(script: str, *, what: str) -> str:
    """Submit a batch script (its path; its #SBATCH lines carry the options) and return the job id."""
    out = run_client(["sbatch", "--parsable", script], what=what)
    job_id = out.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmFailed(f"cannot {what}: sbatch answered {out.strip()[:100]!r}, not a job id")
    return job_id


def _field(text: str, key: str, default: str = "") -> str:
    m = re.search(rf"(?:^|\s){key}=(\S*)", text)
    return m.group(1) if m else default


def job_state(job_id: str) -> SlurmJobState | None:
    """What Slurm says of the job now; None when the controller no longer knows it (see above)."""
    try:
        out = run_client(["scontrol", "show", "job", "-o", job_id], what=f"ask Slurm about job {job_id}")
    except SlurmFailed:
        raise
    except SpeedrunError as e:
        if "Invalid job id" in str(e):
            return None
        raise
    code, _, sig = _field(out, "ExitCode", "0:0").partition(":")
    return SlurmJobState(job_id=job_id, state=_field(out, "JobState", "UNKNOWN"), reason=_field(out, "Reason"),
                         exit_code=int(code) if code.isdigit() else 0, signal=int(sig) if sig.isdigit() else 0,
                         restarts=int(_field(out, "Restarts", "0") or 0), nodes=_field(out, "NodeList"))


def lost_nodes(nodes: str) -> list[str]:
    """Of `nodes` (a Slurm host list: "node[1-2]"), those Slurm says are down, failed or not
    responding, each with its state and Slurm's reason: "node2 DOWN+NOT_RESPONDING (Not responding)"."""
    out = run_client(["scontrol", "show", "node", "-o", nodes], what=f"ask Slurm about nodes {nodes}")
    lost = []
    for line in out.splitlines():
        if re.search(LOST_STATES, line):
            reason = re.search(r"(?:^|\s)Reason=(.*?)(?: \[[^\]]*\])?(?=\s+\w+=|$)", line)
            lost.append(f"{_field(line, 'NodeName')} {_field(line, 'State')}" +
                        (f" ({reason.group(1)})" if reason and reason.group(1) else ""))
    return lost


def cancel(job_id: str) -> None:
    """Cancel the job (Slurm sends its processes SIGTERM, then SIGKILL after KillWait); nothing
    for one that has ended or that Slurm no longer knows."""
    try:
        run_client(["scancel", job_id], what=f"cancel slurm job {job_id}", timeout=CLIENT_TIMEOUT_S)
    except SlurmFailed:
        raise
    except SpeedrunError as e:
        if "Invalid job id" not in str(e) and "already completing or completed" not in str(e):
            raise



def active(job_id: str) -> int:
    """How many of a job's parts (an array's elements) are pending or running; 0 once all ended."""
    try:
        out = run_client(["squeue", "-h", "-j", job_id, "-o", "%i %T"], what=f"ask Slurm about job {job_id}")
    except SlurmFailed:
        raise
    except SpeedrunError as e:
        if "Invalid job id" in str(e):
            return 0
        raise
    return len([line for line in out.splitlines() if line.strip()])
