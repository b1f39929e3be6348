"""`speedrun launch | ls | attach | logs | kill | tb` commands."""
import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add the cluster commands to the top-level parser."""
