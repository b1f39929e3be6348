"""A speedrun job on Slurm: `SlurmJob`, a Job whose launch is one sbatch (scripts.py says what the
batch script does) and whose tasks are the job's nodes, seen through the run directory on the
cluster's shared file system from the machine you launch on (the login node).

    job = make_job("r50", 2, provider="slurm", partition="gpu", gpus_per_node=8, time="4:00:00")
    job.launch(f"-m speedrun train --recipe imagenet-2x8 --out {job.run_dir}")   # one sbatch
    job.wait()

Task i is the node with SLURM_NODEID i; each start of the Slurm job (the first and each requeue)
gives it a fresh command directory, so its state comes from there and from Slurm: a command with
an exit status has ended; one without runs while Slurm says RUNNING, and was lost otherwise. The
Slurm job's id is kept in `<run_dir>/slurm/job_id`, next to the scripts, so the run directory says
what ran it wherever it is read. `run_step` runs a one-off distributed command (`speedrun check`)
as a Slurm job of its own, in `<run_dir>/slurm/<name>/`.
"""
from __future__ import annotations

import logging
import math
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence, TextIO

from speedrun import files
from speedrun.cluster import registry, tmux
from speedrun.cluster.hosts import LocalHost
from speedrun.cluster.job import (JOIN_TIMEOUT_S, Job, JobSpec, Launch, StepTimedOut, check_join_timeout,
                                  check_nproc_per_node)
from speedrun.cluster.provider import Provider
from speedrun.cluster.states import ReportFold, TaskStatus, telling_line
from speedrun.cluster.slurm.config import SlurmConfig
from speedrun.cluster.slurm.queue import SlurmJobState, active, cancel, job_state, lost_nodes, submit
from speedrun.cluster.slurm.scripts import (array_script, batch_script, command_script, command_text, node_script,
                                            step_script)
from speedrun.cluster.slurm.submit import check_request
from speedrun.cluster.task import CommandFailed, Result, Task, check_name, status_code, tmux_message
from speedrun.cluster.tensorboard import TensorBoard, free_local_port, start_tensorboard
from speedrun.errors import SpeedrunError

log = logging.getLogger("speedrun.cluster")
POLL_S = 2.0  # how often wait and logs -f ask Slurm and the run directory, seconds


def make_slurm_job(name: str, num_tasks: int, provider: Provider, config: SlurmConfig, spec: JobSpec) -> SlurmJob:
    """make_job for provider="slurm" (`provider`, whose settings are `config`): the job found again
    when its Slurm job is pending or running (reconnected), else the request checked with Slurm
    (nothing is made for one it refuses) and, with spec.restart, that Slurm job cancelled; then a new
    run directory under spec.run_root (default `runs`, from the current directory: a path the nodes
    see on the shared file system)."""
    if spec.setup is not None or spec.sync is not None:
        raise SpeedrunError("the slurm provider takes no setup or sync (--setup, --sync): the nodes see your files "
                            "on the cluster's shared file system, so launch from your working tree there and put "
                            "setup steps in the command")
    old = registry.recorded(name, spec.config_dir)
    live = None  # the job's Slurm job, queued or running
    if old is not None and old.provider.get("kind") == provider.kind and old.num_tasks == num_tasks:
        job = slurm_job(name, num_tasks, provider, config, old.run_dir, python=old.python, reconnected=True)
        state = job.slurm_state()
        if state is not None and not state.ended:
            if not spec.restart:  # Slurm took the request already: what it can run now (a node lost) is no matter
                log.info("job %s is queued or running (%s, %s); reconnected without changing it", name,
                         state.describe(), job.run_dir)
                return job
            live = job, state
    check_request(config, num_tasks)
    if live is not None:
        log.info("job %s: cancelling %s to start it again", name, live[1].describe())
        live[0].kill()
    root = os.path.abspath(os.path.expanduser(spec.run_root or "runs"))
    r = LocalHost().shell(tmux.allocate_run_dir(root, name, spec.run_name))
    fields = tmux.parse_fields(r.text)
    if r.returncode != 0 or "run_dir" not in fields:
        raise SpeedrunError(f"cannot make a run directory under {root}: {tmux_message(r.stderr)}")
    return slurm_job(name, num_tasks, provider, config, fields["run_dir"], python=spec.python, reconnected=False)


def slurm_job(name: str, num_tasks: int, provider: Provider, config: SlurmConfig, run_dir: str, *, python: str,
              reconnected: bool, price_per_hour: float | None = None) -> SlurmJob:
    """The SlurmJob of run directory `run_dir` (made, or found again by open_job). Its tasks' files
    are read here, on the shared file system, and commands run where you launch from (as sbatch
    runs them)."""
    host, cwd = LocalHost(), os.getcwd()
    tasks = [Task(job=name, index=i, host=host, run_dir=run_dir, cwd=cwd, home=str(Path.home()), ip="",
                  tmux_socket="speedrun") for i in range(num_tasks)]
    return SlurmJob(name, tasks, run_dir, provider, config, python=python, reconnected=reconnected,
                    price_per_hour=price_per_hour)


class SlurmJob(Job):
    """A Job on Slurm (see the module's text). Tasks' files are read on this machine."""

    def __init__(self, name: str, tasks: list[Task], run_dir: str, provider: Provider, config: SlurmConfig, *,
                 python: str, reconnected: bool, price_per_hour: float | None = None):
        super().__init__(name, tasks, run_dir, provider, python=python, reconnected=reconnected,
                         price_per_hour=price_per_hour)
        self.config = config

    def machine_count(self) -> int:
        return len(self.tasks)  # one node per task

    # --- the Slurm job ---
    @property
    def slurm_dir(self) -> Path:
        return Path(self.run_dir) / "slurm"

    def slurm_job_id(self) -> str | None:
        """The id of the Slurm job that runs (or ran) this run directory; None before launch."""
        try:
            return (self.slurm_dir / "job_id").read_text().strip() or None
        except OSError:
            return None

    def slurm_state(self) -> SlurmJobState | None:
        """What Slurm says of the job now; None before launch or once Slurm has forgotten it."""
        job_id = self.slurm_job_id()
        return job_state(job_id) if job_id else None

    def scheduler_line(self) -> str | None:
        """Slurm's state of the job ("slurm job 12: RUNNING on node[1-2], requeued 1 time"), and for
        one that ended otherwise than COMPLETED the batch script's last word on why."""
        job_id = self.slurm_job_id()
        if job_id is None:
            return None
        state = job_state(job_id)
        line = state.describe() if state is not None else f"slurm job {job_id}: ended (Slurm no longer lists it)"
        nodes = _read(self.slurm_dir / "nodes")  # those of its last start
        if state is not None and state.waiting and nodes:
            lost = lost_nodes(nodes)
            if lost:  # why it waits after a start: a node it ran on is gone
                line += f"; lost since its last start: {', '.join(lost)}"
        if state is None or (state.ended and state.state != "COMPLETED"):
            said = [ln for ln in _tail(self.slurm_dir / f"slurm-{job_id}.out") if ln.startswith("speedrun: ")]
            if said:
                line += f": {said[-1][len('speedrun: '):]}"
        return line

    # --- launch ---
    def launch(self, command: str | Sequence[str], *, nproc_per_node: int | None = None, name: str = "train",
               env: Mapping[str, str] | None = None, restart: bool = False,
               join_timeout_s: float = JOIN_TIMEOUT_S) -> list:
        """Submit the job: one sbatch whose batch script starts one torchrun per node with `command`
        (shell text, or an argv quoted for you), `nproc_per_node` processes each (default: the
        config's gpus_per_node, else 1). Returns [] (the tasks start when Slurm runs the job).

        A job whose Slurm job is pending or running is reconnected to (nothing submitted); restart=True
        submits again once it has ended (`speedrun kill` first)."""
        check_name(name)
        nproc = nproc_per_node if nproc_per_node is not None else (self.config.gpus_per_node or 1)
        check_nproc_per_node(nproc, "nproc_per_node")
        check_join_timeout(join_timeout_s, "join_timeout_s")
        text = command if isinstance(command, str) else shlex.join(command)
        self.launched = Launch(text, nproc, name, dict(env or {}), join_timeout_s)
        state = self.slurm_state()
        if state is not None and not state.ended:
            if restart:
                raise SpeedrunError(f"job {self.name}: {state.describe()}; stop it (speedrun kill {self.name}) "
                                    f"before restarting")
            log.info("job %s: %s; reconnected", self.name, state.describe())
            return []
        if self.slurm_job_id() is not None and not restart:
            log.info("job %s: it already ran in %s; pass restart=True to run it again", self.name, self.run_dir)
            return []

        n = len(self.tasks)
        resume = text if "--resume" in shlex.split(text) else f"{text} --resume"
        self.slurm_dir.mkdir(parents=True, exist_ok=True)
        texts = {"job.sbatch": batch_script(job=self.name, name=name, nodes=n, run_dir=self.run_dir,
                                            cwd=self.tasks[0].cwd, config=self.config, python=self.python),
                 "node.sh": node_script(job=self.name, name=name, nodes=n, run_dir=self.run_dir,
                                        env={**self.price_environment(), **(env or {})}, python=self.python),
                 f"{name}.command.sh": command_text(python=self.python, nodes=n, nproc_per_node=nproc,
                                                    join_timeout_s=math.ceil(join_timeout_s), command=text),
                 f"{name}.resume.sh": command_text(python=self.python, nodes=n, nproc_per_node=nproc,
                                                   join_timeout_s=math.ceil(join_timeout_s), command=resume)}
        for file, content in texts.items():
            files.write_text(self.slurm_dir / file, content)
        job_id = submit(str(self.slurm_dir / "job.sbatch"), what=f"submit job {self.name}")
        files.write_text(self.slurm_dir / "job_id", job_id + "\n")
        log.info("job %s: submitted as slurm job %s (%d node(s))", self.name, job_id, n)
        return []

    def devices_per_task(self) -> int:
        """The job's --gpus-per-node (its nodes are reached through Slurm only), 1 without GPUs."""
        return self.config.gpus_per_node or 1

    def run_step(self, command: str | Sequence[str], *, nproc_per_node: int, name: str,
                 timeout_s: float | None = None) -> None:
        """Run `command` once under one torchrun per node as a Slurm job of its own (the job's own,
        if any, is left alone: this one may queue behind it), in `<run_dir>/slurm/<name>/`, and wait
        for it (at most timeout_s seconds, then it is cancelled: StepTimedOut; an interruption cancels
        it too). CommandFailed when it fails."""
        check_name(name)
        text = command if isinstance(command, str) else shlex.join(command)
        folder = self.slurm_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "status").unlink(missing_ok=True)
        script = folder / "step.sbatch"
        files.write_text(script, step_script(job=self.name, name=name, nodes=len(self.tasks), run_dir=self.run_dir,
                                             cwd=self.tasks[0].cwd, config=self.config, python=self.python,
                                             nproc_per_node=nproc_per_node,
                                             join_timeout_s=math.ceil(JOIN_TIMEOUT_S), command=text))
        job_id = submit(str(script), what=f"submit {name} for job {self.name}")
        log.info("job %s: %s submitted as slurm job %s (%d node(s))", self.name, name, job_id, len(self.tasks))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while active(job_id):
                if deadline is not None and time.monotonic() > deadline:
                    cancel(job_id)
                    raise StepTimedOut(f"job {self.name}: {name} (slurm job {job_id}) did not end within "
                                       f"{timeout_s:g} s; cancelled")
                time.sleep(POLL_S)  # asking the controller, as squeue users do, at a modest rate
        except KeyboardInterrupt:  # Ctrl-C (or SIGTERM) here ends the step on the cluster too
            cancel(job_id)
            raise
        status, output = _read(folder / "status"), folder / f"slurm-{job_id}.out"
        if status != "0":
            text = output.read_text(errors="replace") if output.exists() else ""
            raise CommandFailed(f"{name!r} of job {self.name} (slurm job {job_id})",
                                status_code(status) if status is not None else "killed", str(output), text)

    def run_each(self, commands: Sequence[str], *, name: str, cwd: str,
                 say: Callable[[str], None] = log.info) -> None:
        """Run independent commands (shell text each) as one Slurm job array, one node per command
        and at most as many at once as the job has nodes, in `cwd` (on the shared file system);
        returns when all have ended. Each command's output is in `<run_dir>/slurm/<name>/<k>.out`."""
        check_name(name)
        folder = self.slurm_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        for k, command in enumerate(commands):
            files.write_text(folder / f"{k}.sh", command + "\n")
        script = folder / "array.sbatch"
        files.write_text(script, array_script(job=self.name, name=name, count=len(commands), limit=len(self.tasks),
                                              run_dir=self.run_dir, cwd=cwd, config=self.config))
        job_id = submit(str(script), what=f"submit {name} for job {self.name}")
        say(f"slurm job array {job_id}: {len(commands)} commands, at most {len(self.tasks)} at once "
            f"(outputs in {folder})")
        while active(job_id):
            time.sleep(POLL_S)  # asking the controller, as squeue users do, at a modest rate

    # One command on one node (speedrun tune's trials), each a Slurm job of its own in
    # <run_dir>/slurm/<name>/: the job's tasks are slots here, Slurm picks the node.
    single_commands = True

    def start_command(self, task: int, command: str, *, name: str, cwd: str, env: Mapping[str, str]) -> None:
        """Submit `command` as a one-node Slurm job of its own (scripts.command_script), in place of
        task `task`; it starts when Slurm gives it a node. A command of that name started before is
        replaced (its files; one still queued or running is cancelled first)."""
        check_name(name)
        folder = self.slurm_dir / name
        _cancel_unfinished(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for stale in ("job_id", "status", "node", "log"):
            (folder / stale).unlink(missing_ok=True)
        files.write_text(folder / "command.sh", command + "\n")
        script = folder / "command.sbatch"
        files.write_text(script, command_script(job=self.name, name=name, task=task, nodes=len(self.tasks),
                                                run_dir=self.run_dir, cwd=cwd, config=self.config,
                                                env={**self.price_environment(), **env}))
        job_id = submit(str(script), what=f"submit {name} for job {self.name}")
        files.write_text(folder / "job_id", job_id + "\n")
        log.info("job %s: %s submitted as slurm job %s", self.name, name, job_id)

    def command_state(self, task: int, name: str) -> str:
        """See Job.command_state: from the command's status file, else from Slurm (pending counts
        as running: the command is Slurm's to start)."""
        folder = self.slurm_dir / name
        job_id = _read(folder / "job_id")
        if job_id is None:
            return "none"
        status = _read(folder / "status")
        if status is not None:
            return status
        state = job_state(job_id)
        if state is not None and not state.ended:
            return "running"
        status = _read(folder / "status")  # written just before the job ended
        if status is not None:
            return status
        return "killed" if state is not None and state.state in ("CANCELLED", "TIMEOUT") else "lost"

    def command_output(self, task: int, name: str) -> str:
        try:
            return (self.slurm_dir / name / "log").read_text(errors="replace")
        except OSError:
            return ""

    # --- state ---
    def latest(self, index: int, name: str, *, on_node: bool = False) -> Path | None:
        """Task `index`'s newest command directory called `name` (a glob: "*" for any); None before
        its first start. on_node: only those a node ran (not this machine's TensorBoard)."""
        base = Path(self.run_dir) / f"task-{index}" / "cmds"
        found = sorted(base.glob("[0-9]" * tmux.SEQ_DIGITS + f"-{name}")) if base.is_dir() else []
        found = [d for d in found if (d / "node").exists()] if on_node else found
        return found[-1] if found else None

    def status(self, name: str = "train") -> list[TaskStatus]:
        """Each task's state: `pending` (with Slurm's reason) before its node runs it, `running`,
        `succeeded`, `failed (N)`, or `killed`/`lost` when the Slurm job ended without the
        command's exit status (cancelled, timed out, its node failed)."""
        state = self.slurm_state()
        return [self._task_status(i, name, state) for i in range(len(self.tasks))]

    def _task_status(self, index: int, name: str, state: SlurmJobState | None) -> TaskStatus:
        d = self.latest(index, name)
        node = _read(d / "node") if d else None
        host = node or "-"
        if state is not None and state.waiting:
            why = f"slurm: {state.state} ({state.reason})" if state.reason not in ("", "None") else None
            return TaskStatus(index, host, "pending", None, None, why=why)
        if d is None:
            started = state is not None and state.state == "RUNNING"
            return TaskStatus(index, host, "starting" if started else "idle", None, None)
        log_path = str(d / "log")
        status = _read(d / "status")
        if status is None:
            if state is not None and not state.ended:
                return TaskStatus(index, host, "running", time.time() - d.stat().st_mtime, log_path)
            how = {"CANCELLED": "killed", "TIMEOUT": "killed"}.get(state.state if state else "", "lost")
            return TaskStatus(index, host, how, None, log_path,
                              why=f"slurm: {state.state}" if state is not None else None)
        ended = (d / "status").stat().st_mtime
        code = status_code(status)
        if code == 0:
            return TaskStatus(index, host, "succeeded", None, log_path, ended=ended)
        tail = _tail(d / "log")
        return TaskStatus(index, host, f"failed ({code})", None, log_path, why=telling_line(tail), ended=ended)

    def wait(self, name: str = "train", *, timeout: float | None = None, check: bool = True) -> list[Result]:
        """Wait until the Slurm job has ended (requeues included: a requeued job is waited for again;
        timeout in seconds), then each task's Result from its newest command (a task with no exit
        status gets 137). With check, CommandFailed for the first that failed."""
        if self.slurm_job_id() is None:
            raise SpeedrunError(f"job {self.name}: nothing was launched in {self.run_dir}")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            state = self.slurm_state()
            if state is None or state.ended:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise SpeedrunError(f"job {self.name} did not end within {timeout:g} s ({state.describe()})")
            time.sleep(POLL_S)  # asking the controller, as squeue users do, at a modest rate
        results = []
        for i in range(len(self.tasks)):
            d = self.latest(i, name)
            status = _read(d / "status") if d else None
            output = (d / "log").read_text(errors="replace") if d and (d / "log").exists() else ""
            results.append(Result(status_code(status) if status is not None else 137, output,
                                  str(d / "log") if d else ""))
        if check:
            for i, r in enumerate(results):
                if not r.ok:
                    raise CommandFailed(f"{name!r} on task {self.tasks[i].name} (slurm)", r.status, r.log, r.output)
        return results

    def kill(self) -> list[str]:
        """Cancel the Slurm job (its processes get SIGTERM, then SIGKILL after Slurm's KillWait) and
        end its TensorBoard session here, if any; logs and the run directory stay. Returns [] (Slurm
        answered) or raises."""
        job_id = self.slurm_job_id()
        if job_id is not None:
            cancel(job_id)
        for own in sorted(self.slurm_dir.glob("*/job_id")):  # start_command's, each a Slurm job of its own
            _cancel_unfinished(own.parent)
        self.tasks[0].kill()
        return []

    def logs(self, name: str = "train", *, follow: bool = False, out: TextIO | None = None,
             tasks: Sequence[int] | None = None, until: threading.Event | None = None, raw: bool = False) -> list[str]:
        """Write each task's newest `name` log (see TmuxJob.logs); with follow, keep writing as it grows,
        from one start to the next after a requeue, until the Slurm job has ended or `until` is set."""
        out = out or sys.stdout
        chosen = list(tasks) if tasks is not None else list(range(len(self.tasks)))
        prefix = (lambda i: f"[{i}] ") if len(chosen) > 1 else (lambda i: "")
        lock = threading.Lock()

        def emit(i: int, text: str) -> None:
            with lock:
                for line in text.splitlines(keepends=True):
                    out.write(prefix(i) + line)
                out.flush()

        def one(i: int) -> None:
            d, offset, fold = None, 0, None
            while True:
                newest = self.latest(i, name)
                if newest is not None and newest != d:
                    if d is not None:
                        emit(i, (fold.flush() if fold is not None else "") +
                             f"(started again after a requeue: {newest.name})\n")
                    d, offset = newest, 0
                    fold = None if raw else ReportFold(str(d / "log"))
                if d is None and not follow:
                    emit(i, f"(no command named {name!r} on task {self.tasks[i].name})\n")
                    return
                ended = d is not None and (d / "status").exists()  # before reading: its last lines come first
                if d is not None and (d / "log").exists():
                    with open(d / "log", "rb") as f:
                        f.seek(offset)
                        chunk = f.read()
                    offset += len(chunk)
                    if chunk:
                        text = chunk.decode("utf-8", errors="replace")
                        emit(i, text if fold is None else fold.feed(text))
                if not follow or (until is not None and until.is_set()):
                    break
                if d is None or ended:
                    state = self.slurm_state()
                    if (state is None or state.ended) and self.latest(i, name) == d:
                        break
                # A log on a shared file system has no change notice to wait on: read it twice a second,
                # and ask Slurm (waiting for the job, or for the next start) at its modest rate.
                time.sleep(POLL_S if d is None or ended else 0.5)
            if fold is not None:
                emit(i, fold.flush())

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in chosen]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return []

    def tensorboard(self, local_port: int | None = None, timeout: float = 120.0) -> TensorBoard:
        """TensorBoard on this machine, over the run directory it sees on the shared file system (see
        TmuxJob.tensorboard), in a tmux session of task 0 here: `speedrun tb JOB` as for any job."""
        t = self.tasks[0]
        t._shell(tmux.new_session(t.tmux_socket, t.session, self.name, self.run_dir, t.logdir, t.cwd, replace=False))
        return start_tensorboard(t, self.run_dir, self.python, free_local_port(), local_port, timeout)

    def attach_argv(self, task: int = 0, window: str | None = None) -> list[str]:
        """The command line that puts this terminal in a tmux session on task `task`'s node, inside
        the job's allocation (`srun --overlap --pty`): a window following the log of the task's
        command `window` (default: its newest), live, and a shell beside it on that node.
        SpeedrunError when the job is not running there now."""
        job_id, state = self.slurm_job_id(), self.slurm_state()
        if job_id is None or state is None or state.state != "RUNNING":
            now = state.describe() if state is not None else "not running"
            raise SpeedrunError(f"job {self.name} is not running on Slurm ({now}): attach reaches a running task's "
                                f"node; read what it wrote with speedrun logs {self.name}")
        d = self.latest(task, check_name(window) if window else "*", on_node=True)
        name = d.name.split("-", 1)[1] if d is not None else window
        node = _read(d / "node") if d is not None else None
        if d is None or node is None or (d / "status").exists():
            raise SpeedrunError(f"task {task} of job {self.name} is not running a command now ({state.describe()})")
        session, socket = f"{self.name}-{task}", f"speedrun-{job_id}"
        follow = shlex.quote(f"tail -n +1 -F {shlex.quote(str(d / 'log'))}")
        script = f"""tm() {{ tmux -L {socket} "$@"; }}
tm has-session -t ={session} 2>/dev/null || tm new-session -d -s {session} -n {name} {follow} \\; \\
    new-window -d -n shell
exec tmux -L {socket} attach-session -t ={session}
"""
        return ["srun", f"--jobid={job_id}", "--overlap", f"--nodelist={node}", "--nodes=1", "--ntasks=1", "--pty",
                "bash", "-c", script]

    def attach(self, task: int = 0, window: str | None = None) -> int:
        """Attach this terminal to a live view of task `task` on its node (see attach_argv); Ctrl-b d
        detaches."""
        return subprocess.call(self.attach_argv(task, window), env={k: v for k, v in os.environ.items() if k != "TMUX"})


def _cancel_unfinished(folder: Path) -> None:
    """Cancel the Slurm job of start_command's `folder` unless its command has ended (or none ran)."""
    job_id = _read(folder / "job_id")
    if job_id is not None and not (folder / "status").exists():
        cancel(job_id)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _tail(path: Path, lines: int = tmux.LOG_TAIL_LINES) -> list[str]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return text.replace("\r", "\n").splitlines()[-lines:]

