"""`speedrun launch | ls | attach | logs | kill | down | tb | check`: the cluster API from the command line.

    speedrun launch demo --provider ssh --hosts gpu1,gpu2 --run-root /shared/runs \\
        -- -m speedrun train --recipe tiny --out {run_dir}
    speedrun launch r50 --provider aws -n 2 --instance-type p5.48xlarge --spot -- -m speedrun train ...
    speedrun ls
    speedrun logs demo -f
    speedrun attach demo 1
    speedrun tb demo
    speedrun kill demo
    speedrun check r50
    speedrun down r50

`launch` starts one torchrun per task with what follows `--` (`{run_dir}` there becomes the run
directory); run again while the job runs, it reconnects instead of starting anything.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from speedrun.cluster.check_cli import add_check_command
from speedrun.cluster.down_cli import add_down_command
from speedrun.cluster.progress import show_progress
from speedrun.cluster.providers import DEFAULT_PROVIDER, PROVIDERS, UNLOADABLE
from speedrun.errors import EXIT_BAD_INPUT, EXIT_FAILED, SpeedrunError, stop_on_sigterm
from speedrun.inputs import PORT, PROCESSES, TASKS, USD_PER_HOUR, Bound, Parser, given, given_path, parse_env

TASK_INDEX = Bound(int, 0, TASKS.hi - 1)  # a task's number in its job, from 0

if TYPE_CHECKING:  # annotations only
    from speedrun.cluster.job import Job
    from speedrun.cluster.task import Result


def register(sub: argparse._SubParsersAction) -> None:
    """Add the cluster commands to the top-level parser."""
    p = sub.add_parser("launch", help="start a job: one torchrun per task (or reconnect to it if it runs)",
                       usage="speedrun launch NAME [options] -- ARGS...",
                       description="Start one torchrun per task with the ARGS after `--` "
                                   "(`{run_dir}` there becomes the run directory). If the job is running, "
                                   "reconnect to it instead (--restart replaces it).")
    p.add_argument("name", type=given, help="job name (letters, digits, - and _)")
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="-- ARGS",
                   help="what torchrun runs, e.g. -- -m speedrun train --recipe tiny --out {run_dir}")
    add_launch_options(p)
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("ls", help="list jobs: tasks, hosts, state, uptime")
    p.add_argument("name", type=given, nargs="?", help="only this job")
    p.add_argument("--window", type=given,
                   help="the command whose state is shown (default: the job's launched one, train)")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("attach", help="attach this terminal to a task's tmux session (Ctrl-b d detaches)")
    p.add_argument("name", type=given, help="job name")
    p.add_argument("task", nargs="?", type=TASK_INDEX, default=0, help="task index (default 0)")
    p.add_argument("--window", type=given,
                   help="select this window first (e.g. train, setup; default: the newest command's)")
    p.set_defaults(func=cmd_attach)

    p = sub.add_parser("logs", help="print a job's logs (all tasks, or one)")
    p.add_argument("name", type=given, help="job name")
    p.add_argument("task", nargs="?", type=TASK_INDEX, help="only this task")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the command ends")
    p.add_argument("--window", type=given, help="whose log (default: the job's launched command, train; also setup...)")
    p.add_argument("--raw", action="store_true",
                   help="the log as it is: torchrun's report of how a node ended in full, not one line naming the log")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("kill", help="stop a job: kill its tmux sessions (logs and run directory stay) and its "
                                    "watcher on a controller host")
    p.add_argument("name", type=given, help="job name")
    p.set_defaults(func=cmd_kill)

    p = sub.add_parser("watch", help="watch and recover a job on the controller host that `speedrun launch "
                                     "--recover --watcher-host` prepared (it runs this itself)")
    p.add_argument("name", type=given, help="job name")
    p.add_argument("--check", action="store_true",
                   help="only check that the watcher can start here (its record, and the provider reached)")
    p.set_defaults(func=cmd_watch)

    add_down_command(sub)

    p = sub.add_parser("tb", help="start TensorBoard on task 0 and forward it here over SSH")
    p.add_argument("name", type=given, help="job name")
    p.add_argument("--port", type=PORT, default=None, help="local port (default: a free one)")
    p.set_defaults(func=cmd_tb)

    add_check_command(sub)


def add_launch_options(p: argparse.ArgumentParser) -> None:
    # A plugin that could not be loaded is a choice too: naming it says why it cannot be used.
    p.add_argument("--provider", choices=[*PROVIDERS, *UNLOADABLE], default=None,
                   help=f"where tasks run (default: {DEFAULT_PROVIDER})")
    p.add_argument("--hosts", type=given, default=None, help="comma-separated user@host[:port] for the ssh provider")
    p.add_argument("-n", "--tasks", type=TASKS, default=None,
                   help="number of tasks: hosts, instances or Slurm nodes (default: one per host, or 1)")
    p.add_argument("--nproc-per-node", type=PROCESSES, default=None,
                   help="processes per task (default 1; slurm: --gpus-per-node when given)")
    p.add_argument("--run-root", type=given, default=None,
                   help="where run directories go; shared storage for several hosts (default: EFS for aws, else runs)")
    p.add_argument("--run-name", type=given, default="run", help="run directories are <run-root>/<job>/<run-name>.<NN>")
    p.add_argument("--setup", type=given_path, help="a shell script to run once per host (again when it changes)")
    p.add_argument("--sync", type=given_path, help="a local directory (your working tree) to copy to each host")
    p.add_argument("--python", type=given, default="python3", help="the Python on the hosts (default python3)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="set a variable (repeatable)")
    p.add_argument("--window", type=given, default="train", help="the tmux window's name (default train)")
    p.add_argument("--restart", action="store_true", help="replace the job if it is running")
    p.add_argument("--follow", action="store_true", help="print the logs until the job ends; exit 3 if it failed")
    p.add_argument("--wait", action="store_true", help="wait until the job ends; exit 3 if it failed")
    p.add_argument("--recover", action="store_true",
                   help="watch the job until it ends (as --wait) and keep it going: replace lost hosts (ssh: the "
                        "spare hosts listed beyond the tasks; aws: new instances) and resume from the checkpoint")
    p.add_argument("--max-restarts", type=Bound(int, 0, 1000), default=3,
                   help="with --recover: restart the command at most this many times after it failed (default 3); "
                        "lost machines and preemptions are recovered apart, without counting")
    p.add_argument("--recover-wait", type=Bound(float, 0, 7 * 86_400), default=None, metavar="SECONDS",
                   help="with --recover: how long to keep asking for a machine to replace a lost one when the "
                        "provider has none (no capacity), with exponential backoff: the first try again after "
                        "min(30 s, 1/16 of this), each wait twice the last, at most 5 minutes (default 3600)")
    p.add_argument("--price-per-hour", type=USD_PER_HOUR, metavar="USD",
                   help="what one machine costs per hour, for runs to record what they cost (results.json); "
                        "any provider, ahead of AWS's prices (default: AWS's, else none)")
    p.add_argument("--join-timeout", type=Bound(float, 1, 86_400), metavar="SECONDS",
                   help="how long each torchrun waits for all tasks to join before failing (default 120)")
    p.add_argument("--watcher-host", type=given, metavar="USER@HOST[:PORT]",
                   help="with --recover: run the watcher on this long-lived host (reached with the ssh options "
                        "below) instead of in this process, which then returns; see docs/cluster.md")
    p.add_argument("--watcher-env", action="append", default=[], metavar="KEY=VALUE",
                   help="with --watcher-host: set a variable for the watcher there only (repeatable), e.g. "
                        "AWS_PROFILE, AWS_REGION, AWS_SHARED_CREDENTIALS_FILE, AWS_ENDPOINT_URL; not recorded or "
                        "printed. AWS keys are refused: the controller has credentials of its own")
    g = p.add_argument_group("reaching hosts with OpenSSH (hosts you name, and a --watcher-host)")
    g.add_argument("--identity", type=given_path, help="private key (default: ssh's own choice and agent)")
    g.add_argument("--known-hosts", type=given_path,
                   help="speedrun's pinned host keys (default $SPEEDRUN_HOME/known_hosts)")
    g.add_argument("--ssh-config", type=given_path, help="ssh config file instead of ~/.ssh/config")
    g.add_argument("--accept-new-host-keys", action="store_true",
                   help="trust and pin the key of a host seen for the first time (host keys are checked strictly)")
    for provider in PROVIDERS.values():
        provider.add_options(p)


def cmd_launch(args: argparse.Namespace) -> int:
    from speedrun.cluster.hosts import HostLost
    from speedrun.cluster.job import JOIN_TIMEOUT_S
    from speedrun.cluster.states import summary
    from speedrun.cluster.lifecycle import make_job, save_record
    from speedrun.cluster.providers import default_provider, make_provider
    from speedrun.cluster.recovery import RECOVER_WAIT_S
    from speedrun.cluster.ssh import HostSpec, SSHOptions
    from speedrun.cluster.task import check_name

    show_progress()
    # Ended by `kill` or a closed terminal as by Ctrl-C: machines it is starting are given back.
    stop_on_sigterm((signal.SIGTERM, signal.SIGHUP))

    # Options may come before the name (argparse took them) or after it, up to `--` (parsed here:
    # argparse cannot tell them from the torchrun arguments on its own).
    argv = list(args.rest)
    if "--" in argv:
        cut = argv.index("--")
        options, argv = argv[:cut], argv[cut + 1:]
        if options:
            again = Parser(prog="speedrun launch NAME", add_help=False)
            add_launch_options(again)
            try:
                again.parse_args(options, namespace=args)
            except SystemExit as e:  # a usage error: its one line is printed (Parser.error)
                return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    if not argv:
        raise SpeedrunError("nothing to launch: add `-- ARGS` for torchrun, e.g. -- -m speedrun train --recipe tiny")
    # --price-per-hour, --join-timeout, --nproc-per-node: within their bounds already (the parser's types).
    join_timeout_s = JOIN_TIMEOUT_S if args.join_timeout is None else args.join_timeout
    # What job.launch would refuse, refused before make_job makes the sessions, run directory and record.
    check_name(args.window, "--window")
    if args.recover_wait is not None and not args.recover:
        raise SpeedrunError("--recover-wait needs --recover (it says how long recovery waits for capacity)")
    recover_wait_s = RECOVER_WAIT_S if args.recover_wait is None else args.recover_wait
    if args.watcher_host is not None and not args.recover:
        raise SpeedrunError("--watcher-host needs --recover (it says where the recovering watcher runs)")
    watcher_host = None if args.watcher_host is None else str(HostSpec.parse(args.watcher_host))
    if args.watcher_env and watcher_host is None:
        raise SpeedrunError("--watcher-env needs --watcher-host (it sets variables for the watcher there)")
    watcher_env = parse_env(args.watcher_env, "--watcher-env", show=False)
    for key in sorted(watcher_env):
        for why in filter(None, (p.watcher_env_refusal(key) for p in PROVIDERS.values())):
            raise SpeedrunError(f"--watcher-env {key}: {why}")
    hosts = [h for h in (args.hosts or "").split(",") if h.strip()]
    kind = args.provider or default_provider(hosts)
    chosen = PROVIDERS.get(kind)
    if chosen is None:  # a plugin that could not be loaded
        raise SpeedrunError(UNLOADABLE[kind])
    if args.recover and chosen.recover_refusal:
        raise SpeedrunError(f"--recover does not apply to the {kind} provider: {chosen.recover_refusal}")
    num_tasks = args.tasks if args.tasks is not None else (len(hosts) or 1)
    env = parse_env(args.env, "--env")
    setup = None
    if args.setup is not None:
        if not args.setup.is_file():
            raise SpeedrunError(f"setup script {args.setup} does not exist")
        setup = args.setup.read_text()
    ssh_flags = {"--identity": args.identity, "--known-hosts": args.known_hosts, "--ssh-config": args.ssh_config,
                 "--accept-new-host-keys": args.accept_new_host_keys or None}
    given_ssh = [flag for flag, value in ssh_flags.items() if value is not None]
    if given_ssh and not chosen.takes_ssh_options and watcher_host is None:  # they would be ignored
        takers = " or ".join(f"--provider {k}" for k, p in PROVIDERS.items() if p.takes_ssh_options)
        raise SpeedrunError(f"{', '.join(given_ssh)} {'does' if len(given_ssh) == 1 else 'do'} not apply to the "
                            f"{kind} provider: the ssh options are for {takers} hosts and a --watcher-host")
    ssh_options = SSHOptions(known_hosts=args.known_hosts, identity_file=args.identity, ssh_config=args.ssh_config,
                             accept_new_host_keys=args.accept_new_host_keys)
    options = {k: v for p in PROVIDERS.values() for k, v in p.cli_options(args).items()}
    prov = make_provider(kind, args.name, hosts, ssh_options if chosen.takes_ssh_options else None, None, options)
    if watcher_host is not None:
        prov.relocate("~")  # whether a watcher elsewhere can reach these machines: says so before anything starts
    job = make_job(args.name, num_tasks, provider=prov, run_root=args.run_root,
                   run_name=args.run_name, setup=setup, sync=args.sync, restart=args.restart, python=args.python,
                   price_per_hour=args.price_per_hour)
    argv = [a.replace("{run_dir}", job.run_dir) for a in argv]
    already = job.reconnected
    job.launch(argv, nproc_per_node=args.nproc_per_node, name=args.window, env=env, join_timeout_s=join_timeout_s)
    save_record(job)  # with the window launched, which ls and logs show by default
    scheduled = job.scheduler_line()  # a job a scheduler runs (Slurm) is submitted, not started
    state = "reconnected (it was running; nothing started)" if already else (
        f"submitted ({scheduled})" if scheduled else "started")
    print(f"job {job.name}: {len(job)} task(s), run dir {job.run_dir}: {state}")
    print(f"  logs:   speedrun logs {job.name} -f\n  attach: speedrun attach {job.name} [TASK]\n"
          f"  stop:   speedrun kill {job.name}")
    if watcher_host is not None:
        from speedrun.cluster.controller import start_watcher
        watcher = start_watcher(job, watcher_host, ssh_options, max_restarts=args.max_restarts,
                                recover_wait_s=recover_wait_s, python=args.python,
                                env=watcher_env)
        print(f"job {job.name}: watched from {watcher_host}, not from here (this process may end):\n"
              f"  watcher: speedrun logs {watcher.name}   (speedrun kill {job.name} stops it too)")
        return 0
    if args.recover:
        from speedrun.cluster.recovery import watch
        watch(job, args.window, max_restarts=args.max_restarts, recover_wait_s=recover_wait_s)
        print(f"job {job.name}: every task succeeded; recoveries, if any, are in {job.run_dir}/recoveries.jsonl")
        return 0
    if not (args.follow or args.wait):
        return 0
    try:
        results = wait_for_job(job, args.window, args.follow)
    except HostLost as e:  # the others are stopped; one line names the host and why (exit 3)
        print(f"speedrun: {e}", file=sys.stderr)
        return EXIT_FAILED
    failed = [(t.index, r) for t, r in zip(job.tasks, results) if not r.ok]
    if failed:
        print(f"speedrun: job {job.name}: {summary(job.status(args.window))}", file=sys.stderr)
    for i, r in failed:
        print(f"speedrun: task {i} failed with exit status {r.status} (log: {r.log})", file=sys.stderr)
    return EXIT_FAILED if failed else 0


def wait_for_job(job: Job, window: str, follow: bool) -> list[Result]:
    """job.wait (which stops the other tasks once one fails) without raising; with follow, the logs
    are printed meanwhile, until every task's command has ended."""
    if not follow:
        return job.wait(window, check=False)
    outcome: dict[str, Any] = {}
    failed = threading.Event()  # the wait failed (a host lost): stop following, whatever still streams

    def waiter() -> None:
        try:
            outcome["results"] = job.wait(window, check=False)
        except BaseException as e:  # noqa: BLE001 - raised below, in the command's thread
            outcome["error"] = e
            failed.set()
    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    for line in job.logs(window, follow=True, until=failed):
        print(f"speedrun: {line}", file=sys.stderr)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["results"]


def format_uptime(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def cmd_ls(args: argparse.Namespace) -> int:
    from speedrun.cluster import registry
    from speedrun.cluster.states import summary
    from speedrun.cluster.recovery import waiting_line
    from speedrun.cluster.reopen import open_job

    check_window(args.window)
    # A damaged record hides nothing but itself: one line each, and the other jobs are listed.
    records, skipped = ([registry.load(args.name)], []) if args.name else registry.read_all()
    rows = [("JOB", "TASK", "HOST", "STATE", "UPTIME", "RUN DIR")]
    money = [("JOB", "MACHINES", "MARKET", "RUNNING", "UPTIME", "PRICE", "COST SO FAR", "PRICES FROM")]
    why = []  # after the table: per job, why it is not simply running or done; per unreachable task, why
    for rec in records:
        try:
            job = open_job(rec.name, probe=False)
        except SpeedrunError as e:
            if args.name:
                raise
            skipped.append(str(e))
            continue
        states = job.status(args.window or rec.window)
        for st in states:
            rows.append((rec.name, str(st.index), st.host, st.state, format_uptime(st.uptime_s), rec.run_dir))
        line = summary(states)
        if line:
            why.append(f"{rec.name}: {line}")
        for line in (job.scheduler_line(), waiting_line(job)):
            if line:
                why.append(f"{rec.name}: {line}")
        why += [f"{rec.name} task {st.index}: {st.error}" for st in states if st.error]
        b = job.provider.billing()
        if b is not None:
            money.append((rec.name, b.instance_type, b.market, str(b.count), format_uptime(b.uptime_s),
                          "?" if b.price_per_hour is None else f"${b.price_per_hour:,.2f}/h",
                          "?" if b.cost is None else f"${b.cost:,.2f}", b.price_source))
    for line in skipped:
        print(f"speedrun: warning: skipped a job: {line}", file=sys.stderr)
    if len(rows) == 1:
        print("no jobs (start one with `speedrun launch`)")
        return 0
    print_rows(rows)
    for line in why:
        print(f"  {line}")
    if len(money) > 1:
        print()
        print_rows(money)
    return 0


def print_rows(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def cmd_attach(args: argparse.Namespace) -> int:
    from speedrun.cluster.reopen import open_job

    check_window(args.window)
    job = open_job(args.name)
    if not 0 <= args.task < len(job):
        raise SpeedrunError(f"job {args.name} has tasks 0..{len(job) - 1}, not {args.task}")
    if not (sys.stdin.isatty() and sys.stdout.isatty()):  # tmux would fail with "open terminal failed"
        raise SpeedrunError(f"attach needs a terminal, and this one has none; without one, `speedrun logs "
                            f"{args.name} {args.task}` prints the task's output")
    return job.attach(args.task, args.window)


def cmd_logs(args: argparse.Namespace) -> int:
    from speedrun.cluster import registry
    from speedrun.cluster.reopen import open_job

    check_window(args.window)
    job = open_job(args.name)
    if args.task is not None and not 0 <= args.task < len(job):
        raise SpeedrunError(f"job {args.name} has tasks 0..{len(job) - 1}, not {args.task}")
    window = args.window or registry.load(args.name).window
    unreachable = job.logs(window, follow=args.follow, tasks=None if args.task is None else [args.task], raw=args.raw)
    for line in unreachable:  # the others' logs came; a host out of reach is a lost one (exit 3)
        print(f"speedrun: {line}", file=sys.stderr)
    return EXIT_FAILED if unreachable else 0


def check_window(window: str | None) -> None:
    """A --window that cannot name a command is bad input (exit 2), before any host is asked for
    it (a host asked for it would fail, and read as lost)."""
    if window is not None:
        from speedrun.cluster.task import check_name

        check_name(window, "--window")


def cmd_kill(args: argparse.Namespace) -> int:
    from speedrun.cluster import registry
    from speedrun.cluster.reopen import open_job
    from speedrun.cluster.watcher import stop_watcher

    # The watcher first: it would take the killed job for a failed one and start it again. The job
    # is opened after it, so that the hosts it moved tasks to until then are the ones killed.
    stopped = stop_watcher(registry.load(args.name))
    job = open_job(args.name, probe=False)
    unreachable = job.kill()
    for line in unreachable:
        print(f"speedrun: {line}", file=sys.stderr)
    killed = len(job) - len(unreachable)
    print(f"killed job {job.name} ({killed} of {len(job)} task(s)); its logs stay in {job.run_dir}")
    if stopped is not None and stopped.ok:
        print(f"  {stopped.line}")
    elif stopped is not None:
        print(f"speedrun: error: {stopped.refusal(job.name, 'it may start the job again')}", file=sys.stderr)
    if unreachable:  # a host of the job that does not answer is a lost one, as for logs
        return EXIT_FAILED
    return EXIT_BAD_INPUT if stopped is not None and not stopped.ok else 0


def cmd_watch(args: argparse.Namespace) -> int:
    from speedrun.cluster.controller import watch_recorded

    show_progress()
    watch_recorded(args.name, check=args.check)
    if args.check:
        print(f"job {args.name}: the watcher can start here")
        return 0
    print(f"job {args.name}: every task succeeded; recoveries, if any, are in its run directory's recoveries.jsonl")
    return 0


def cmd_tb(args: argparse.Namespace) -> int:
    from speedrun.cluster.reopen import open_job

    job = open_job(args.name)
    # Ended by kill or a closed terminal as by Ctrl-C: TensorBoard on task 0 is stopped too.
    stop_on_sigterm((signal.SIGTERM, signal.SIGHUP))
    tb = job.tensorboard(local_port=args.port)
    try:  # the URL is printed inside: a signal may come the moment it is read
        print(f"TensorBoard for {job.name}: {tb.url}  (Ctrl-C stops it)", flush=True)
        while tb.tunnel is None or tb.tunnel.poll() is None:
            time.sleep(1)  # nothing to do but keep the tunnel open until Ctrl-C
        print("speedrun: the ssh tunnel closed", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        tb.close()
