"""The `speedrun` command line. Each command lives with the code it drives; this file only wires
them together and turns errors into one-line messages and exit codes.

Exit codes (the README's table): 0 success; 1 internal error (traceback saved to a file, path
printed); 2 bad input (usage, recipe, data path, a host named at launch) or a run directory that
cannot be written (full disk, read-only); 3 failed (non-finite loss, a rank died, a job's host lost,
AWS or Slurm failed); 75 stopped at a step on request, `--resume` continues; 130 interrupted (Ctrl-C).
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import tempfile
import traceback
from collections.abc import Sequence

from speedrun.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERNAL, EXIT_INTERRUPTED, SpeedrunError, TrainingFailed
from speedrun.inputs import Parser


# The routing table: which module registers which commands (its `register(sub)`), in the order
# `speedrun --help` lists them. A command's process imports its own module only: a training process
# that imported every command's (the cluster wing, the trackers, tune) spent 0.30 CPU s building its
# parser, 0.12 with its own only (a 2-core box, 5 fresh processes each).
COMMAND_MODULES = {
    "speedrun.train_cli": ("train", "eval", "tune-host", "recipes"),
    "speedrun.experiment_cli": ("compare", "ablate"),
    "speedrun.tune.cli": ("lr-find", "tune"),
    "speedrun.data.cli": ("data",),
    "speedrun.trackers.cli": ("track",),
    "speedrun.cluster.cli": ("launch", "ls", "attach", "logs", "kill", "watch", "down", "tb", "check"),
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """speedrun's parser. Given the arguments `argv` to parse, it knows only their command (when the
    first is one): the one module that registers it is imported; without, every command."""
    from speedrun.version import __version__

    owner = [m for m, commands in COMMAND_MODULES.items() if argv and argv[0] in commands]
    parser = Parser(
        prog="speedrun",
        description="Train image classifiers to a target accuracy as fast as possible, on one machine or many.",
        epilog="Exit codes: 0 ok, 1 internal error, 2 bad input or a run directory that cannot be written, "
               "3 failed (training, a job's host, AWS or Slurm), 75 stopped at a step (--resume continues), "
               "130 interrupted.",
    )
    parser.add_argument("--version", action="version", version=f"speedrun {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in owner or COMMAND_MODULES:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    as_program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # a usage error (Parser.error: its one line is printed), --help, --version
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    args.argv = argv  # for commands that re-launch themselves
    try:
        return int(run_command(args, as_program=as_program) or 0)
    except SpeedrunError as e:  # exit 2, or the error's own code (cluster.aws.api.AWSFailed: 3, AWS failed)
        return report(e, "error", getattr(e, "exit_code", EXIT_BAD_INPUT))
    except TrainingFailed as e:
        return report(e, "training failed", EXIT_FAILED)
    except KeyboardInterrupt as e:
        return report(e, "interrupted", EXIT_INTERRUPTED)
    except Exception as e:  # a bug: keep the traceback, but in a file
        with tempfile.NamedTemporaryFile("w", prefix="speedrun-crash-", suffix=".txt", delete=False) as f:
            traceback.print_exc(file=f)
        return report(e, "internal error", EXIT_INTERNAL, f" (traceback in {f.name})")


def run_command(args: argparse.Namespace, as_program: bool) -> int | None:
    """Run the command `args` names. As the program (`main()` reading sys.argv), its outcome is
    settled once the command returns or raises (results written, exit code chosen): from then on
    SIGTERM is ignored, so that a second one (torchrun's, a scheduler's) cannot turn exit 75 or
    130 into death by signal (143) while Python tears down, which takes seconds with a big model.
    Only SIG_IGN lasts through that: Python puts its own handlers back to the default there."""
    try:
        return args.func(args)
    finally:
        if as_program:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


def report(error: BaseException, kind: str, code: int, suffix: str = "") -> int:
    """Print one line for `error` and return `code`. Under torchrun the line names the rank, and
    the error is also written where torchrun's failure summary will show it."""
    message = str(error) if kind != "internal error" else f"{type(error).__name__}: {error}"
    where = f"rank {os.environ['RANK']}: " if "RANK" in os.environ and "TORCHELASTIC_ERROR_FILE" in os.environ else ""
    line = f"speedrun: {where}{kind}" + (f": {message}" if message else "") + suffix
    print(line, file=sys.stderr, flush=True)
    if "TORCHELASTIC_ERROR_FILE" in os.environ and code != EXIT_INTERRUPTED:
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        get_error_handler().record_exception(RuntimeError(line))
    return code


if __name__ == "__main__":
    sys.exit(main())
