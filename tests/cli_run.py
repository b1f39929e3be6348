"""Running the `speedrun` command line from tests, as a user would (a fresh Python process)."""
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
