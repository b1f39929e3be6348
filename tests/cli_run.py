"""Running the `speedrun` command line from tests: as a user would (a fresh Python process:
`speedrun`, `start`), or in this process (`speedrun_here`, for the unit tier: what a command says
before it starts any work needs no process of its own), and checking a one-line error.
"""
import contextlib
import io
import subprocess
import sys
import time


def speedrun(*args: str, **kw) -> subprocess.CompletedProcess:
    """Run `python -m speedrun ARGS` to completion; keyword arguments go to subprocess.run."""
    return subprocess.run([sys.executable, "-m", "speedrun", *args], capture_output=True, text=True, **kw)


def start(*args: str, **kw) -> subprocess.Popen:
    """Start `python -m speedrun ARGS` with its output piped; keyword arguments go to Popen."""
    return subprocess.Popen([sys.executable, "-m", "speedrun", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def speedrun_here(*args: str) -> subprocess.CompletedProcess:
    """Run `speedrun ARGS` through `speedrun.cli.main` in this process, capturing what it prints;
    the result reads like `speedrun`'s (returncode, stdout, stderr)."""
    from speedrun import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as e:  # argparse: usage errors and --help
            code = e.code if isinstance(e.code, int) else 2
    return subprocess.CompletedProcess(["speedrun", *args], code, out.getvalue(), err.getvalue())


def one_line_error(proc: subprocess.CompletedProcess, *expected: str, code: int = 2) -> str:
    """Check that a command failed with exit `code` (2: bad input) and said why in exactly one
    line, with no traceback, containing each of `expected`; return that line."""
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def wait_for(predicate, timeout_s: float, what: str):
    """Poll `predicate` until it returns something true, and return that (a bounded wait for a
    file or a state, not a sleep as synchronisation)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def in_terminal(argv: list[str]) -> tuple[int, int]:
    """Start argv in a terminal of its own (a pty), as a person at a keyboard would: its pid and the
    terminal's file descriptor, for `terminal_exit`."""
    import os
    import pty

    pid, fd = pty.fork()
    if pid == 0:
        os.environ.pop("TMUX", None)  # attach must work from inside someone's tmux too
        os.execvp(argv[0], argv)
    return pid, fd


def terminal_exit(pid: int, fd: int) -> int:
    """Read the terminal until the program in it exits; its exit status."""
    import os

    while True:
        try:
            if not os.read(fd, 65536):
                break
        except OSError:  # the terminal closed
            break
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)
