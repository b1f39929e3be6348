"""The one exception type for mistakes a user can fix (bad path, bad value, unreachable host).

The CLI prints such an error as a single line and exits with status 2; anything else is a bug
and is reported with the path of a full traceback instead of the traceback itself. SIGTERM is
turned into an interruption (exit status 130), as Ctrl-C is.
"""
import signal
import threading


# Exit codes of every speedrun command.
EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
# Stopped at a step on request (SIGTERM, a spot notice, a stop file) with a checkpoint there:
# `--resume` continues exactly (sysexits' EX_TEMPFAIL: "try again later").
EXIT_RESUMABLE = 75


class SpeedrunError(Exception):
    """A user-facing error; its message is one line that says what is wrong and what to do."""


class TrainingFailed(Exception):
    """Training cannot go on (a non-finite loss, a peer process died); the CLI exits with status 3."""


def stop_on_sigterm(signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)):
    """Treat SIGTERM (torchrun stopping the survivors when a rank died, a spot instance being
    reclaimed, `kill` of a background job, which ignores SIGINT), and any other of `signals`
    (SIGHUP: the terminal closed), like Ctrl-C, so that `finally` blocks clean up and results so
    far are written. Returns a function undoing this."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"stopped by signal {signal.Signals(signum).name}")

    previous = {s: signal.signal(s, interrupt) for s in signals}
    return lambda: [signal.signal(s, handler) for s, handler in previous.items()]


def one_line(error: BaseException, limit: int = 200) -> str:
    """An exception as one short line ("ValueError: ..."), for logs, reports and error messages."""
    return f"{type(error).__name__}: {error}".splitlines()[0][:limit]


def unwrapped(error: SpeedrunError) -> SpeedrunError:
    """`error` as its one line. A DataLoader worker's error reaches the training process re-raised
    with the worker's whole traceback as its message ("Caught SpeedrunError in DataLoader worker
    process 0. Original Traceback ..."); its last line holds the original message."""
    text = str(error)
    if "\nOriginal Traceback" not in text:
        return error
    line = last_line(text)
    return SpeedrunError(line.split(": ", 1)[1] if line.startswith("speedrun.") and ": " in line else line)


def last_line(text: str, default: str = "") -> str:
    """The last non-empty line of a command's output (where shells and tools put the reason)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else default
