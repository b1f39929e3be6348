"""What state a job's tasks are in, and why one ended: the lines of `speedrun ls`.

`TaskStatus` is one task's state; `telling_line` finds, in the end of a failed command's log, the
line that says why (not c10d's noise, not torchrun's report); `summary` makes the one line per job
that says which task ended first and why; `ReportFold` folds torchrun's report into one line where
a log is printed (`logs`, `launch --follow`).
"""
from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from typing import Sequence

@dataclass
class TaskStatus:
    """One line of `speedrun ls`."""

    index: int
    host: str
    # running, succeeded, failed (N), killed, lost, idle (session, nothing launched), stopped, unreachable;
    # on Slurm also pending (queued or requeued) and starting (its node runs the batch script)
    state: str
    uptime_s: float | None  # age of the task's tmux session, seconds
    log: str | None
    error: str | None = None  # why it is unreachable
    why: str | None = None  # why it ended, if not in success: speedrun's reason for stopping it, or its log's
    ended: float | None = None  # when its command ended, seconds since the epoch


STOPPED_BY = "stopped by speedrun"  # how a command that the job layer stopped is said to have ended

# In a failed command's log, the lines that say why, best first: speedrun's own one line; the
# trainer's line for a run stopped at a step (exit 75: torchrun then exits 1); Python's
# (`python3: No module named x`); an error with its message (torchrun's ChildFailedError has none);
# torchrun's note of a worker ended by a signal.
REASON_PATTERNS = (re.compile(r"^speedrun: \S"), re.compile(r"^stopped at step \d+"),
                   re.compile(r"^\S*python[\d.]*: \S"),
                   re.compile(r"\b\w*(Error|Exception)\b: \S"), re.compile(r"\bSignal \d+ \(SIG\w+\) received"))
REASON_CHARS = 200  # a reason longer than this is cut in the middle
# Where torchrun starts its report of a worker that failed: its log line, then its own traceback
# and table. The worker's last words are above it.
TORCHRUN_REPORT = re.compile(r"\] failed \(exitcode: -?\d+\) local_rank: \d+")
# Lines that never say why: c10d's warning that a peer's address has no host name (a reverse
# lookup failed: hosts without a resolver, or whose addresses DNS does not name) and the
# trainer's header line ("speedrun 0.1.0: recipe ...").
NOISE_PATTERNS = (re.compile(r"\[c10d\] The hostname of the client socket cannot be retrieved"),
                  re.compile(r"^speedrun \d\S*: recipe "))


# torchrun's lines that start its own report of how a node ended: the agent's log line for a worker
# that failed (then its traceback and failure table), and the one for a signal it got itself (then
# the workers' last lines, as it passes the signal on, then its traceback).
WORKER_FAILED = re.compile(r"\] failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
DEATH_SIGNAL = re.compile(r"\] Received (?:Signals\.)?(SIG[A-Z]+|\d+) death signal")


class ReportFold:
    """Folds torchrun's own report of how a node ended (its traceback and failure table, dozens of
    lines after the processes' last words) into one line naming the log file, which keeps it all:
    what `speedrun logs` and `launch --follow` print for one task's log, fed in pieces as it grows."""

    def __init__(self, log: str):
        self.log, self.pending, self.signal = log, "", ""
        self.state = "pass"  # pass; report (a worker failed: to the table's closing rule); signalled; trace
        self.rules = 0  # rules of "=" seen in the failure table

    def feed(self, text: str) -> str:
        """The text to print for the next piece of the log (complete lines; the rest waits)."""
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        return "".join(self.line(ln) for ln in lines)

    def flush(self) -> str:
        """What is left once the log has ended (a last line without its newline)."""
        rest, self.pending = self.pending, ""
        return self.line(rest).removesuffix("\n") if rest else ""

    def line(self, line: str) -> str:
        note = f"; torchrun's report is in {self.log}\n"
        if self.state == "report":
            if line.strip() and not line.strip().strip("="):
                self.rules += 1
                if self.rules == 2:  # the table's closing rule: what follows is the log again
                    self.state = "pass"
            return ""
        if self.state == "trace":
            if "SignalException: " in line and not line.startswith(" "):  # the traceback's last line
                self.state = "pass"
            return ""
        if m := WORKER_FAILED.search(line):
            code = int(m.group(1))
            how = f"exit code {code}" + (f" ({signal_name(-code)})" if code < 0 else "")
            self.state, self.rules = "report", 0
            return f"torchrun: local rank {m.group(2)} (pid {m.group(3)}) ended with {how}{note}"
        if m := DEATH_SIGNAL.search(line):
            sig = m.group(1)
            self.state, self.signal = "signalled", signal_name(int(sig)) if sig.isdigit() else sig
            return line + "\n"
        if self.state == "signalled" and line.startswith("Traceback (most recent call last)"):
            self.state = "trace"
            return f"torchrun: stopped by {self.signal}, which it passed on to its processes{note}"
        return line + "\n"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def telling_line(lines: Sequence[str], *, killed: bool = False) -> str | None:
    """The line of a failed command's last log lines that says why it failed (see REASON_PATTERNS),
    else its last line that is neither decoration nor noise (NOISE_PATTERNS); None for a log
    without one. What the command printed before torchrun's failure report (TORCHRUN_REPORT) comes
    first: the report's own last line is a link to torchrun's docs. For a command that was
    `killed` (a signal from outside) only a line that says why counts: its last line says where it
    was, not why it ended."""
    # torchrun's failure table puts its fields as "key : value": the value is what says why.
    text = [re.sub(r"^traceback\s+:\s+", "", ln.strip()) for ln in lines
            if ln.strip().strip("=-") and not any(p.search(ln.strip()) for p in NOISE_PATTERNS)]
    report = next((i for i, ln in enumerate(text) if TORCHRUN_REPORT.search(ln)), len(text))
    before = text[:report]
    found = next((ln for part in (before, text) for pattern in REASON_PATTERNS for ln in reversed(part)
                  if pattern.search(ln)), None)
    if found is None and not killed:
        found = before[-1] if before else text[-1] if text else None
    if found is None or len(found) <= REASON_CHARS:
        return found
    # A line's end says why (bash's "...: command not found", an exception's message): a long path
    # in its middle is what goes.
    head = REASON_CHARS // 3
    return found[:head] + "..." + found[-(REASON_CHARS - head - 3):]


def summary(states: Sequence[TaskStatus]) -> str | None:
    """One line on why a job is not simply running or done: each task whose command ended otherwise
    than in success, the first to end first and those speedrun stopped because of it last, with its
    reason, then the unreachable and those still running beside them (e.g. "task 1 failed (exit 1):
    RuntimeError: ...; task 0 stopped by speedrun"); None when every task runs, succeeded or has
    nothing launched."""
    def order(s: TaskStatus) -> tuple:
        return bool(s.why and s.why.startswith(STOPPED_BY)), s.ended is None, s.ended or 0.0, s.index
    ended = sorted((s for s in states if s.state not in ("running", "succeeded", "idle", "stopped", "unreachable",
                                                         "pending", "starting")),
                   key=order)
    if not ended:
        return None
    parts = []
    for s in ended:
        if s.why and s.why.startswith(STOPPED_BY):  # the task that caused it is named already
            parts.append(f"task {s.index} {STOPPED_BY}")
            continue
        state = re.sub(r"^failed \((\d+)\)$", r"failed (exit \1)", s.state)
        parts.append(f"task {s.index} {state}" + (f": {s.why}" if s.why else ""))
    parts += [f"task {s.index} unreachable" for s in states if s.state == "unreachable"]
    parts += [f"task {s.index} still running" for s in states if s.state == "running"]
    return "; ".join(parts)
