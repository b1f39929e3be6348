"""The `speedrun` command line. Each command lives with the code it drives; this file only wires
them together and turns errors into one-line messages and exit codes.

Exit codes: 0 success; 1 internal error (traceback saved to a file, path printed);
2 bad input (usage, recipe, data path, host); 3 training failed (non-finite loss, a rank died);
130 interrupted (Ctrl-C).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import traceback

from speedrun.errors import SpeedrunError

EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT, EXIT_TRAINING_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def build_parser() -> argparse.ArgumentParser:
    from speedrun import __version__
    from speedrun import commands
    from speedrun.cluster import cli as cluster_cli
    from speedrun.data import cli as data_cli

    parser = argparse.ArgumentParser(
        prog="speedrun",
        description="Train image classifiers to a target accuracy as fast as possible, on one machine or many.",
        epilog="Exit codes: 0 ok, 1 internal error, 2 bad input, 3 training failed, 130 interrupted.",
    )
    parser.add_argument("--version", action="version", version=f"speedrun {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands.register(sub)
    data_cli.register(sub)
    cluster_cli.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for commands that re-launch themselves
    try:
        return int(args.func(args) or 0)
    except SpeedrunError as e:
        print(f"speedrun: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("speedrun: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # a bug: keep the traceback, but in a file
        with tempfile.NamedTemporaryFile("w", prefix="speedrun-crash-", suffix=".txt", delete=False) as f:
            traceback.print_exc(file=f)
        print(f"speedrun: internal error: {type(e).__name__}: {e} (traceback in {f.name})", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
