"""`speedrun down`'s command line (registered by cli.py): one job ended for good (`cmd_down`: its
machines given back, or its sessions killed, and its record forgotten), or with `--all` everything
speedrun made that outlives a job, with every provider (`down_all`: each provider's `leftovers`)."""
from __future__ import annotations

import argparse
import sys

from speedrun.cluster.progress import show_progress
from speedrun.cluster.providers import PROVIDERS
from speedrun.errors import EXIT_BAD_INPUT, EXIT_FAILED, SpeedrunError
from speedrun.inputs import given

# Why `down` (a job, or --all) removes nothing when a watcher could not be stopped.
DOWN_REFUSED = "or that watcher would start the job again where speedrun no longer looks"


def add_down_command(sub: argparse._SubParsersAction) -> None:
    """`speedrun down`'s parser, each provider's options for --all included."""
    p = sub.add_parser("down", help="end a job for good: terminate the instances speedrun started for it "
                                    "(or just kill its sessions on your own machines) and forget it")
    p.add_argument("name", type=given, nargs="?", help="job name")
    p.add_argument("--all", action="store_true",
                   help="terminate and delete everything speedrun made that outlives a job, with every provider "
                        "(in a cloud: instances, file systems, networks, key pairs), and forget those jobs")
    p.add_argument("--yes", action="store_true", help="with --all: do not ask for confirmation")
    for provider in PROVIDERS.values():
        provider.add_down_options(p)
    p.set_defaults(func=cmd_down)


def cmd_down(args: argparse.Namespace) -> int:
    from speedrun.cluster import registry
    from speedrun.cluster.reopen import open_job
    from speedrun.cluster.watcher import stop_watcher

    show_progress()
    if args.all:
        if args.name:
            raise SpeedrunError("give a job name or --all, not both")
        return down_all(args)
    if not args.name:
        raise SpeedrunError("which job? speedrun down NAME (or --all)")
    rec = registry.load(args.name)
    stopped = stop_watcher(rec, forget=True)
    if stopped is not None and not stopped.ok:
        raise SpeedrunError(stopped.refusal(rec.name, f"nothing of the job was removed, {DOWN_REFUSED}"))
    if stopped is not None:
        print(f"speedrun: {stopped.line}", file=sys.stderr)
    job = open_job(args.name, probe=False)  # after the watcher: where it last moved the tasks
    released = job.provider.down()
    if not released:
        job.kill()  # machines that are not speedrun's stay; the job's sessions on them end
    registry.forget(job.name)
    how = f"terminated {', '.join(released)}" if released else "its commands were stopped"
    print(f"job {job.name} is down: {how}; its run directory was {job.run_dir}")
    return 0


def down_all(args: argparse.Namespace) -> int:
    """`speedrun down --all`: what every provider made that outlives a job (Provider.leftovers),
    listed, confirmed unless --yes, then terminated and deleted, and the jobs of those providers
    forgotten. Their watchers on controller hosts are stopped first; if one cannot be, nothing is
    removed (exit status 2)."""
    from speedrun.cluster import registry
    from speedrun.cluster.watcher import stop_watcher

    records = registry.load_all()
    found, forget = [], []
    for kind, provider in PROVIDERS.items():
        mine = [r for r in records if r.provider.get("kind") == kind]
        leftovers = provider.leftovers(args, mine)
        if leftovers is not None:
            found.append(leftovers)
            forget += mine
    lines = [line for f in found for line in f.describe()]
    if lines:
        print("this terminates and deletes, for good:")
        for line in lines:
            print(f"  {line}")
        if not args.yes:
            try:
                answer = input("type yes to go on: ")
            except EOFError:
                answer = ""
            if answer.strip() != "yes":
                print("nothing was removed")
                return EXIT_FAILED
    # Every watcher before anything goes: one left running would see its tasks lost and start
    # machines that no record tracks.
    left = []
    for r in forget:
        stopped = stop_watcher(r, forget=True)
        if stopped is not None and not stopped.ok:
            where = ", ".join(f.where for f in found)
            left.append(stopped.refusal(r.name, f"nothing in {where} was removed, {DOWN_REFUSED}"))
        elif stopped is not None:
            print(f"speedrun: job {r.name}: {stopped.line}", file=sys.stderr)
    if left:
        for line in left:
            print(f"speedrun: error: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for f in found:
        f.remove()
    for r in forget:
        registry.forget(r.name)
    print(f"speedrun has nothing left in {', '.join(f.where for f in found) or 'any provider'}")
    return 0
