"""Keeping a job going when it loses machines: notice, replace what was lost, resume.

`watch(job)` (`speedrun launch --recover`) runs where the job was made, on your machine: simple,
but the job is not watched while that machine sleeps; with `--watcher-host` it runs on a controller
host instead (controller.py). What it did is kept in the run directory
(`recoveries.jsonl`, which the trainer copies into results.json), so the same `speedrun launch
... --recover` run again while the job runs reconnects and takes over, counting the recoveries
already made towards `max_restarts`. Every `every_s` seconds it asks
each task's state, within seconds whatever the network does (as `speedrun ls`), and:

- every task succeeded: done;
- a task is unreachable or lost (its machine died or went silent): the provider gives a
  replacement (ssh: the next spare host, listed beyond the tasks; aws: a new instance of the same
  type), which gets a session in the same run directory, the synced code and the setup;
- a task ended otherwise (stopped at a step, exit 75; a rank died; killed): nothing to replace.

Either way the commands still running are stopped and every task's torchrun is started again,
with `--resume` when the run directory has a checkpoint, up to `max_restarts` times.
"""
from __future__ import annotations

import json
import logging
import shlex
import time
from dataclasses import asdict, dataclass

from speedrun.cluster.host_provider import HostProvider
from speedrun.cluster.lifecycle import save_record
from speedrun.cluster.states import TaskStatus
from speedrun.cluster.tmux_job import TmuxJob
from speedrun.cluster.utils import REACH_TIMEOUT_S, parallel
from speedrun.errors import SpeedrunError
from speedrun.files import to_json

log = logging.getLogger("speedrun.cluster")
RECOVERIES = "recoveries.jsonl"


@dataclass
class Recovery:
    """One recovery, as a line of recoveries.jsonl."""

    at: float  # when it was noticed, seconds since the epoch
    reason: str  # e.g. "task 1 (root@host) unreachable: ..."
    replaced: dict[int, list[str]]  # task -> [lost host, its replacement]
    resumed: bool  # from the run directory's checkpoint
    relaunch_s: float  # from noticing to the new torchruns started, seconds
    price_per_hour: float | None  # $ per hour of all the job's machines (Job.price), None: unknown


def watch(job: TmuxJob, name: str = "train", *, max_restarts: int = 3, every_s: float = 5.0,
          resume_flag: str = "--resume") -> list[TaskStatus]:
    """Watch `job`'s `name` command until every task succeeded, recovering as the module says;
    returns the final states. SpeedrunError once `max_restarts` recoveries did not suffice."""
    if not (isinstance(job, TmuxJob) and isinstance(job.provider, HostProvider)):
        raise SpeedrunError(f"job {job.name}: recovery moves tasks between hosts, which the {job.provider.kind} "
                            f"provider's jobs do not have")
    if job.launched is None or job.launched.name != name:
        raise SpeedrunError(f"job {job.name}: nothing named {name!r} was launched by this process to watch")
    restarts = len(past_recoveries(job))  # a watcher started again goes on counting
    while True:
        states = job.status(name)
        if all(s.state == "succeeded" for s in states):
            return states
        lost = [s for s in states if s.state in ("unreachable", "lost")]
        ended = [s for s in states if s.state.startswith("failed") or s.state == "killed"]
        if not lost and not ended:
            time.sleep(every_s)  # the commands run: look again later
            continue
        # What made each one end, from its log (as `speedrun ls` says it): a task that fails again
        # after a recovery must say why, not only "failed (1)".
        why = "; ".join(f"task {s.index} ({s.host}) {s.state}" + (f": {s.error or s.why}" if s.error or s.why else "")
                        for s in lost + ended)
        if restarts >= max_restarts:
            raise SpeedrunError(f"job {job.name}: gave up after {restarts} recoveries: {why}")
        restarts += 1
        recover(job, name, [s.index for s in lost], why, resume_flag)


def past_recoveries(job: TmuxJob) -> list[dict]:
    """The recoveries recorded in the run directory so far (by this watcher or an earlier one)."""
    r = job.tasks[0].host.shell(f"cat {shlex.quote(f'{job.run_dir}/{RECOVERIES}')} 2>/dev/null; true",
                                timeout=REACH_TIMEOUT_S)
    return [json.loads(line) for line in r.text.splitlines() if line.strip().startswith("{")]


def recover(job: TmuxJob, name: str, lost: list[int], why: str, resume_flag: str) -> Recovery:
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
        host = job.provider.replace(i, len(job))
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
    event = Recovery(start, why, replaced, resumed, time.time() - start,
                     price.machines * price.usd_per_hour if price is not None else None)
    job.tasks[0].host.shell(f"printf '%s\\n' {shlex.quote(to_json(asdict(event)))} >> "
                            f"{shlex.quote(f'{job.run_dir}/{RECOVERIES}')}")
    log.info("job %s: started again in %.1f s%s", job.name, event.relaunch_s, " from the checkpoint" if resumed else "")
    return event
