"""The cluster's progress messages (reconnected, setup, a task failed, the Slurm job submitted...) as
`speedrun: ...` lines on stderr, for the commands that show them (`show_progress`)."""
from __future__ import annotations

import logging
import sys


def show_progress() -> None:
    """Print the cluster's progress messages (reconnected, setup, pinned keys...) on stderr."""
    logger = logging.getLogger("speedrun.cluster")
    if not any(isinstance(h, StderrHandler) for h in logger.handlers):
        logger.addHandler(StderrHandler())
        logger.setLevel(logging.INFO)


class StderrHandler(logging.Handler):
    """Writes `speedrun: message` lines to whatever sys.stderr is at the time."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"speedrun: {record.getMessage()}", file=sys.stderr)
