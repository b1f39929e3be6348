"""The one exception type for mistakes a user can fix (bad path, bad value, unreachable host).

The CLI prints such an error as a single line and exits with status 2; anything else is a bug
and is reported with the path of a full traceback instead of the traceback itself.
"""


class SpeedrunError(Exception):
    """A user-facing error; its message is one line that says what is wrong and what to do."""


class TrainingFailed(Exception):
    """Training cannot go on (a non-finite loss, a peer process died); the CLI exits with status 3."""
