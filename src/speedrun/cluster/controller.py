"""The watcher on a controller host: `speedrun launch ... --recover --watcher-host USER@HOST`.

recovery.watch runs where it is started. By default that is the `speedrun launch --recover`
process on your machine; with --watcher-host it runs on a small long-lived machine instead, so
that the job is still watched while your machine sleeps. `start_watcher` makes that machine a
job of its own, `<job>-watcher` (one task, the ssh provider, recorded here like any job), and
puts under ~/.speedrun/watchers/<job>/ there:

    src/speedrun/   speedrun's code as this machine runs it (the controller needs Python 3 and
                    rich, which `python3 -m speedrun` imports, and boto3 for aws; not PyTorch)
    code/           the job's synced working tree, for the replacement hosts (with sync= only)
    home/           its speedrun home ($SPEEDRUN_HOME there): the job's record, whose paths point
                    at the key and pinned host keys copied beside it, and watch/<job>.json, what
                    the watcher repeats on a replacement (the launch, env= values included, and
                    the setup script). Files mode 0600, directories 0700.

and runs `python3 -m speedrun watch <job>` there in a window named `watch`, so `speedrun ls` and
`speedrun logs <job>-watcher` show it; `speedrun watch --check <job>` first, so that a controller
that cannot reach the job's provider (no boto3, no AWS credentials, no route) is one line here.
No AWS credentials travel: the controller uses its own (an instance role, or its ~/.aws).
`env` (--watcher-env) sets variables of the watcher's environment there, such as AWS_PROFILE or
AWS_SHARED_CREDENTIALS_FILE; they are neither recorded nor logged. The watcher's state is the run
directory's, as everywhere: started again, it counts the recoveries already made.

When the watcher replaces a host, the record it changes is the controller's; `open_job` here
takes the provider's part of it from there (reopen.refreshed), so `speedrun ls | logs | kill` find the
job where it now runs, and the host keys the controller pinned for the job's hosts (host_provider.adopt_host_keys:
a replacement's key is learned there, on first contact). `speedrun kill` and `speedrun down` stop
the watcher first.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import shlex
import shutil
import tempfile
from pathlib import Path

from speedrun.cluster import registry
from speedrun.cluster.job import Job, Launch
from speedrun.cluster.states import TaskStatus
from speedrun.cluster.tmux_job import HostSetup, TmuxJob
from speedrun.cluster.lifecycle import make_job
from speedrun.cluster.providers import default_provider
from speedrun.cluster.recovery import RECOVER_WAIT_S, watch
from speedrun.cluster.reopen import open_job
from speedrun.cluster.ssh import SSHOptions
from speedrun.cluster.utils import REACH_TIMEOUT_S
from speedrun.errors import SpeedrunError

log = logging.getLogger("speedrun.cluster")
# speedrun's package directory, copied whole to the controller (found from here: the cluster wing
# imports nothing of the trainer's, not even the package's face).
PACKAGE_DIR = Path(__file__).parent.parent
WINDOW = "watch"  # the watcher's window on the controller
WATCHERS = ".speedrun/watchers"  # under the controller's home: one directory per watched job
CHECK_TIMEOUT_S = 120.0  # seconds for `speedrun watch --check` there: Python, boto3 and an AWS call or two


def watcher_name(job: str) -> str:
    """The name of the job that runs `job`'s watcher on its controller."""
    return f"{job}-watcher"


def start_watcher(job: TmuxJob, host: str, ssh: SSHOptions | None, *, max_restarts: int,
                  recover_wait_s: float = RECOVER_WAIT_S, python: str = "python3",
                  env: dict[str, str] | None = None) -> Job:
    """Start `job`'s watcher on `host` (user@host[:port], reached with `ssh`) with `env` added to
    its environment there, as the module says. One that runs there already is left alone when it
    watches this run with this launch, else replaced. `job` must have been made and launched by
    this process (its host setup and launch are what the watcher repeats). Returns the watcher's
    job; SpeedrunError when the watcher cannot work there."""
    if job.launched is None or job.host_setup is None:
        raise SpeedrunError(f"job {job.name}: only the process that made and launched it can start its watcher")

    def make(restart: bool) -> Job:
        return make_job(watcher_name(job.name), 1, provider=default_provider([host]), hosts=[host], ssh=ssh,
                        run_root=f"{WATCHERS}/runs", python=python, restart=restart)
    watcher = make(restart=False)
    task = watcher[0]
    base = f"{task.home}/{WATCHERS}/{job.name}"
    home = f"{base}/home"
    spec = {"launch": dataclasses.asdict(job.launched), "max_restarts": max_restarts, "recover_wait_s": recover_wait_s,
            "host_setup": {**dataclasses.asdict(job.host_setup), "sync": job.host_setup.sync is not None}}
    running = task.command(WINDOW)
    if running is not None and running.state() == "running":
        if watches(job.name, task, home, spec):
            log.info("job %s: its watcher already runs on %s; left as it is", job.name, task.host.name)
            registry.save(dataclasses.replace(registry.load(watcher.name), window=WINDOW))
            return watcher
        # Left running, it would fight this run: take its sessions for lost tasks and start them again.
        log.info("job %s: the watcher on %s watches another run or launch; it is replaced", job.name, task.host.name)
        watcher = make(restart=True)  # a new session there: the old watcher ends with its own
        task = watcher[0]
    record, copies = job.provider.relocate(home)
    original = job.provider.record()
    with tempfile.TemporaryDirectory() as d:  # mkdtemp's mode is 0700: the key is private here too
        staged = Path(d) / "home"
        for relative, local in copies.items():
            (staged / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(local, staged / relative)
        registry.save(dataclasses.replace(registry.load(job.name), provider=record, watcher=None), staged)
        (staged / "watch").mkdir()
        (staged / "watch" / f"{job.name}.json").write_text(json.dumps(spec, indent=2))
        for p in [staged, *staged.rglob("*")]:
            p.chmod(0o700 if p.is_dir() else 0o600)  # rsync and tar keep the modes there
        task.host.put(staged, home, mirror=True)
    task.host.put(PACKAGE_DIR, f"{base}/src/speedrun", exclude=("__pycache__",), mirror=True)
    hs = job.host_setup
    if hs.sync is not None:
        task.host.put(hs.sync, f"{base}/code", exclude=hs.sync_exclude, mirror=True)
    variables = {**(env or {}), "SPEEDRUN_HOME": home, "PYTHONPATH": f"{base}/src"}
    try:
        check_watcher(task, job.name, python, base, variables)
    except SpeedrunError:
        registry.forget(watcher.name)  # nothing runs there: no `JOB-watcher` to list
        raise
    task.run(f"{python} -m speedrun watch {shlex.quote(job.name)}", background=True, name=WINDOW, cwd=base,
             env=variables)
    log.info("job %s: its watcher runs on %s (speedrun logs %s)", job.name, task.host.name, watcher.name)
    job_record = registry.load(job.name)
    paths = sorted(k for k in record if record[k] != original.get(k))
    # The controller's known_hosts (relative to its home) and this machine's: host_provider.adopt_host_keys.
    registry.save(dataclasses.replace(job_record, watcher={"job": watcher.name, "home": home, "paths": paths,
                                                           "known_hosts": str(copies["known_hosts"])}))
    registry.save(dataclasses.replace(registry.load(watcher.name), window=WINDOW))
    return watcher


def watches(name: str, task, home: str, spec: dict) -> bool:
    """Whether the watcher running on `task`'s host for job `name`, its speedrun home there `home`,
    watches the job's current run with `spec`: this machine's record still names it (a new run's
    record does not) and the spec it repeats there is this one."""
    rec = registry.load(name)
    if not rec.watcher or rec.watcher.get("home") != home:
        return False
    r = task.host.shell(f"cat {shlex.quote(home)}/watch/{shlex.quote(name)}.json", timeout=REACH_TIMEOUT_S)
    try:
        return r.returncode == 0 and json.loads(r.text) == json.loads(json.dumps(spec))
    except ValueError:  # a damaged spec there: watching nothing this side knows
        return False


def check_watcher(task, name: str, python: str, base: str, env: dict[str, str]) -> None:
    """Run `speedrun watch --check NAME` on the controller (`task`'s host) in `base` with `env`;
    SpeedrunError with its error line when it fails there. The variables go in the script (ssh's
    stdin), not on a command line that `ps` shows."""
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
    r = task.host.shell(f"{exports}cd {shlex.quote(base)} && "
                        f"exec {python} -m speedrun watch --check {shlex.quote(name)}",
                        timeout=CHECK_TIMEOUT_S)
    if r.returncode != 0:
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()] or [f"exit status {r.returncode}"]
        why = lines[-1].removeprefix("speedrun: error: ")
        raise SpeedrunError(f"job {name} runs, but its watcher cannot work on {task.host.name}: {why} (fix that and "
                            f"run the same launch again: it reconnects and starts the watcher)")


def watch_recorded(name: str, *, check: bool = False) -> list[TaskStatus]:
    """`speedrun watch NAME` on the controller: the job as recorded in this speedrun home, with the
    launch and host setup of watch/NAME.json, watched until every task succeeded (recovery.watch).
    With `check`, only whether that can start: the record read and the provider asked for the job's
    machines (for aws: boto3, credentials and the endpoint); returns no states then."""
    path = registry.speedrun_home() / "watch" / f"{name}.json"
    if not path.is_file():
        raise SpeedrunError(f"nothing says how to watch job {name!r} here ({path} is missing): `speedrun watch` "
                            f"runs on a controller that `speedrun launch ... --recover --watcher-host` prepared")
    spec = json.loads(path.read_text())
    job = open_job(name, probe=not check)
    if check:
        return []
    job.launched = Launch(**spec["launch"])
    hs = spec["host_setup"]
    code = path.parents[2] / "code"  # <base>/home/watch/<job>.json -> <base>/code
    job.host_setup = HostSetup(hs["tmux_socket"], hs["host_dir"], code if hs["sync"] else None,
                               tuple(hs["sync_exclude"]), hs["setup"])
    return watch(job, job.launched.name, max_restarts=spec["max_restarts"],
                 recover_wait_s=spec.get("recover_wait_s", RECOVER_WAIT_S))  # none in an older watcher's spec
