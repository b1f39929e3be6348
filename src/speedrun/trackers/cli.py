"""`speedrun track ...` commands: what a run's experiment trackers have not taken yet."""
from __future__ import annotations

import argparse

from speedrun.inputs import given_path


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `track` command group to the top-level parser."""
    track = sub.add_parser("track", help="a run's experiment trackers (MLflow, W&B)")
    cmds = track.add_subparsers(dest="track_command", metavar="SUBCOMMAND", required=True)
    p = cmds.add_parser("sync", help="send a tracker what a run kept back while it did not answer",
                        description="Send each tracker of RUN_DIR (its --track) the records it has not taken: those "
                        "a run kept in RUN_DIR/trackers/ while the tracker did not answer. Exit 3 when one still "
                        "does not answer (the records stay).")
    p.add_argument("run_dir", type=given_path, metavar="RUN_DIR", help="a run directory trained with --track")
    p.set_defaults(func=cmd_sync)


def cmd_sync(args: argparse.Namespace) -> int:
    from speedrun.trackers import sync

    for line in sync(args.run_dir):
        print(line, flush=True)
    return 0
