"""The one exception type for mistakes a user can fix (bad path, bad value, unreachable host).

The CLI prints such an error as a single line and exits with status 2; anything else is a bug
and is reported with the path of a full traceback instead of the traceback itself.
"""


# Exit codes of every speedrun command.
EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class SpeedrunError(Exception):
    """A user-facing error; its message is one line that says what is wrong and what to do."""


class TrainingFailed(Exception):
    """Training cannot go on (a non-finite loss, a peer process died); the CLI exits with status 3."""


def one_line(error: BaseException, limit: int = 200) -> str:
    """An exception as one short line ("ValueError: ..."), for logs, reports and error messages."""
    return f"{type(error).__name__}: {error}".splitlines()[0][:limit]


def last_line(text: str, default: str = "") -> str:
    """The last non-empty line of a command's output (where shells and tools put the reason)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else default
