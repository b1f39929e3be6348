"""`speedrun data ...` commands."""
import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `data` command group to the top-level parser."""
