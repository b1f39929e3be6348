"""Keeping a job going when it loses machines: notice, replace what was lost, resume.

`watch(job)` (`speedrun launch --recover`) runs where the job was made, on your machine: simple,
but the job is not watched while that machine sleeps; with `--watcher-host` it runs on a controller
host instead (controller.py). What it did is kept in the run directory (`recoveries.jsonl`, which
the trainer copies into results.json), so the same `speedrun launch ... --recover` run again while
the job runs reconnects and takes over, counting the recoveries already made. Every `every_s`
seconds it asks each task's state, within seconds whatever the network does (as `speedrun ls`), and:

- every task succeeded: done;
- a task is unreachable (it has not answered LOOKS_UNANSWERED = 3 looks in a row, each waiting up to
  REACH_TIMEOUT_S; until then nothing is decided) or lost (its machine died): a `lost_host` recovery. The
  provider gives a replacement (ssh: the next spare host, listed beyond the tasks; aws: a new
  instance of the same type), which gets a session in the same run directory, the synced code and
  the setup. A provider with no capacity now (NoCapacity: AWS's InsufficientInstanceCapacity) is
  asked again with exponential backoff, the first wait min(30 s, recover_wait_s / 16), each twice
  the last up to 5 minutes, for at most `recover_wait_s` seconds in all; each refusal is a
  `no_capacity` line of recoveries.jsonl, which `speedrun ls` shows while it waits;
- the tasks ended and the run stopped at a step (results.json says "stopped": a spot notice,
  SIGTERM, a stop request): a `preemption`;
- a task ended otherwise (a rank died, killed): a `failure` of the command.

Either way the commands still running are stopped and every task's torchrun is started again,
with `--resume` when the run directory has a checkpoint. Only failures of the command count
towards `max_restarts`: machines the world took away (lost hosts, preemptions) are counted apart.
"""
from __future__ import annotations

import json
import logging
import shlex
import time
from dataclasses import asdict, dataclass

from speedrun.cluster.host_provider import HostProvider
from speedrun.cluster.hosts import Host
from speedrun.cluster.job import Job
from speedrun.cluster.lifecycle import save_record
from speedrun.cluster.provider import NoCapacity
from speedrun.cluster.states import TaskStatus
from speedrun.cluster.tmux_job import TmuxJob
from speedrun.cluster.utils import REACH_TIMEOUT_S, parallel
from speedrun.errors import SpeedrunError
from speedrun.files import to_json

log = logging.getLogger("speedrun.cluster")
RECOVERIES = "recoveries.jsonl"
RECOVER_WAIT_S = 3600.0  # default --recover-wait: how long a replacement waits for capacity, seconds
MAX_BACKOFF_S = 300.0  # the longest wait between two tries for capacity, seconds
COUNTED = "failure"  # the kind of recovery that counts towards max_restarts
# Looks in a row a task must go unanswered before its machine counts as lost: a machine busy enough
# to take longer than a look's wait (REACH_TIMEOUT_S) to answer once is slow, not gone (a loaded
# 2-core box took over 5 s to answer one look mid-run, and the watcher replaced both machines).
LOOKS_UNANSWERED = 3


@dataclass
class Recovery:
    """One recovery, as a line of recoveries.jsonl."""

    at: float  # when it was noticed, seconds since the epoch
    kind: str  # "lost_host", "preemption" or "failure" (the module's text says which is which)
    reason: str  # e.g. "task 1 (root@host) unreachable: ..."
    replaced: dict[int, list[str]]  # task -> [lost host, its replacement]
    resumed: bool  # from the run directory's checkpoint
    relaunch_s: float  # from noticing to the new torchruns started, seconds
    price_per_hour: float | None  # $ per hour of all the job's machines (Job.price), None: unknown


@dataclass
class CapacityWait:
    """A replacement the provider had no capacity for, as a line of recoveries.jsonl."""

    at: float  # when it was refused, seconds since the epoch
    task: int  # whose machine it was to replace
    attempt: int  # 1 for the first try
    reason: str  # the provider's line
    next_try_in_s: float | None  # None: no more tries (recover_wait_s is spent)
    kind: str = "no_capacity"

    def line(self) -> str:
        """What `speedrun ls` says of it, while the watcher waits or once it gave up."""
        head = f"recovery: no capacity to replace task {self.task} (try {self.attempt}: {self.reason})"
        if self.next_try_in_s is None:
            return f"{head}; gave up (--recover-wait spent)"
        at = time.strftime("%H:%M:%S", time.localtime(self.at))
        return f"{head}; trying again {self.next_try_in_s:.0f} s after {at}"


def watch(job: TmuxJob, name: str = "train", *, max_restarts: int = 3, every_s: float = 5.0,
          resume_flag: str = "--resume", recover_wait_s: float = RECOVER_WAIT_S) -> list[TaskStatus]:
    """Watch `job`'s `name` command until every task succeeded, recovering as the module says;
    returns the final states. SpeedrunError once the command failed `max_restarts` times after
    recoveries, or a lost machine found no replacement within `recover_wait_s` seconds."""
    if not (isinstance(job, TmuxJob) and isinstance(job.provider, HostProvider)):
        raise SpeedrunError(f"job {job.name}: recovery moves tasks between hosts, which the {job.provider.kind} "
                            f"provider's jobs do not have")
    if job.launched is None or job.launched.name != name:
        raise SpeedrunError(f"job {job.name}: nothing named {name!r} was launched by this process to watch")
    # A watcher started again goes on counting (a line without a kind is an older watcher's: counted).
    restarts = sum(1 for r in past_recoveries(job) if r.get("kind", COUNTED) == COUNTED)
    unanswered = [0] * len(job.tasks)  # looks in a row each task has not answered
    while True:
        states = job.status(name)
        if all(s.state == "succeeded" for s in states):
            return states
        for s in states:
            unanswered[s.index] = unanswered[s.index] + 1 if s.state == "unreachable" else 0
        waiting = [s for s in states if s.state == "unreachable" and unanswered[s.index] < LOOKS_UNANSWERED]
        for s in waiting:
            log.info("job %s: task %d (%s) did not answer (look %d of %d): %s", job.name, s.index, s.host,
                     unanswered[s.index], LOOKS_UNANSWERED, s.error)
        if waiting:  # nothing is decided while a machine may only be slow: look again
            time.sleep(every_s)
            continue
        lost = [s for s in states if s.state in ("unreachable", "lost")]
        ended = [s for s in states if s.state.startswith("failed") or s.state == "killed"]
        if not lost and not ended:
            time.sleep(every_s)  # the commands run: look again later
            continue
        # What made each one end, from its log (as `speedrun ls` says it): a task that fails again
        # after a recovery must say why, not only "failed (1)".
        why = "; ".join(f"task {s.index} ({s.host}) {s.state}" + (f": {s.error or s.why}" if s.error or s.why else "")
                        for s in lost + ended)
        kind = "lost_host" if lost else "preemption" if stopped_at_a_step(job, name) else COUNTED
        if kind == COUNTED:
            if restarts >= max_restarts:
                raise SpeedrunError(f"job {job.name}: gave up after {restarts} recoveries: {why}")
            restarts += 1
        recover(job, name, [s.index for s in lost], why, resume_flag, kind=kind, recover_wait_s=recover_wait_s)
        unanswered = [0] * len(job.tasks)  # the replacements start afresh


def stopped_at_a_step(job: TmuxJob, name: str) -> bool:
    """Whether the run in the job's run directory stopped at a step (a spot notice, SIGTERM or a stop
    request), which torchrun reports as a failure of its own (exit 1) though its workers exit 75:
    its results.json says "stopped" and was written by this launch of `name` (newer than task 0's
    command.sh; a resumed run killed outright leaves the last one's). False when unknown."""
    try:
        command = job.tasks[0].command(name, timeout=REACH_TIMEOUT_S)
        if command is None:
            return False
        results, started = shlex.quote(f"{job.run_dir}/results.json"), shlex.quote(f"{command.dir}/command.sh")
        r = job.tasks[0].host.shell(f"if [ {results} -nt {started} ]; then cat {results}; fi; true",
                                    timeout=REACH_TIMEOUT_S)
        return json.loads(r.text).get("status") == "stopped"
    except (SpeedrunError, ValueError, AttributeError):
        return False


def past_recoveries(job: TmuxJob) -> list[dict]:
    """The recoveries recorded in the run directory so far (by this watcher or an earlier one)."""
    r = job.tasks[0].host.shell(f"cat {shlex.quote(f'{job.run_dir}/{RECOVERIES}')} 2>/dev/null; true",
                                timeout=REACH_TIMEOUT_S)
    return [json.loads(line) for line in r.text.splitlines() if line.strip().startswith("{")]


def recover(job: TmuxJob, name: str, lost: list[int], why: str, resume_flag: str, *, kind: str = COUNTED,
            recover_wait_s: float = RECOVER_WAIT_S) -> Recovery:
    """Stop what still runs, replace the lost tasks' hosts, start every task again (resuming)."""
    start = time.time()
    log.info("job %s: %s; recovering", job.name, why)
    stop = [t for t in job.tasks if t.index not in lost]

    def stop_command(t) -> None:
        try:
            command = t.command(name, timeout=REACH_TIMEOUT_S)
            if command is not None:
                command.kill()
        except SpeedrunError as e:  # it may be going too: then it is replaced next time
            log.info("job %s: could not stop task %d's %r: %s", job.name, t.index, name, e)
    parallel(stop_command, stop)
    replaced = {}
    for i in lost:
        old = job.tasks[i].host.name
        host = replacement(job, i, recover_wait_s)
        job.replace_task(i, host)
        replaced[i] = [old, host.name]
        log.info("job %s: task %d moved from %s to %s", job.name, i, old, host.name)
    save_record(job)
    resumed = job.tasks[0].exists(f"{job.run_dir}/checkpoint.pt")
    launch = job.launched
    command = launch.command
    if resumed and resume_flag and resume_flag not in shlex.split(command):
        command = f"{command} {resume_flag}"
    job.launch(command, nproc_per_node=launch.nproc_per_node, name=name, env=launch.env, restart=True,
               join_timeout_s=launch.join_timeout_s)
    price = job.price()
    event = Recovery(start, kind, why, replaced, resumed, time.time() - start,
                     price.machines * price.usd_per_hour if price is not None else None)
    note(job, asdict(event))
    log.info("job %s: started again in %.1f s%s", job.name, event.relaunch_s, " from the checkpoint" if resumed else "")
    return event


def replacement(job: TmuxJob, index: int, recover_wait_s: float) -> Host:
    """The provider's host for task `index` in place of its lost one; while the provider has no
    capacity (NoCapacity), asked again with exponential backoff (the module's text), each refusal
    noted in recoveries.jsonl. NoCapacity once `recover_wait_s` seconds would be spent."""
    provider: HostProvider = job.provider  # type: ignore[assignment]  (watch checked it)
    first, waited, attempt = min(30.0, recover_wait_s / 16), 0.0, 0
    while True:
        attempt += 1
        try:
            return provider.replace(index, len(job))
        except NoCapacity as e:
            wait = min(first * 2 ** (attempt - 1), MAX_BACKOFF_S)
            left = waited + wait <= recover_wait_s
            refusal = CapacityWait(time.time(), index, attempt, str(e), wait if left else None)
            note(job, asdict(refusal))
            log.info("job %s: %s", job.name, refusal.line())
            if not left:
                raise NoCapacity(f"job {job.name}: no machine to replace task {index}'s after {attempt} tries in "
                                 f"{waited:.0f} s (--recover-wait {recover_wait_s:g}): {e}") from None
            time.sleep(wait)  # the provider has none now; it may have one later
            waited += wait


def note(job: TmuxJob, record: dict) -> None:
    """Append `record` to the run directory's recoveries.jsonl (on task 0's host)."""
    job.tasks[0].host.shell(f"printf '%s\\n' {shlex.quote(to_json(record))} >> "
                            f"{shlex.quote(f'{job.run_dir}/{RECOVERIES}')}")


def waiting_line(job: Job) -> str | None:
    """`speedrun ls`'s line for a job whose watcher waits for capacity to replace a machine (or gave
    up waiting): the newest line of its recoveries.jsonl, when that is a refusal; None otherwise,
    and for a job no watcher recovers (or whose run directory cannot be read now)."""
    if not isinstance(job, TmuxJob):
        return None
    try:
        done = past_recoveries(job)
        last = done[-1] if done else {}
        return CapacityWait(**last).line() if last.get("kind") == "no_capacity" else None
    except (SpeedrunError, ValueError, TypeError):  # unreadable now, or a line of another shape: no line
        return None
