"""The suite's own record: how long every test took, kept with each run, and how the full suite is
shared among pytest-xdist's workers.

`DurationRecord` (registered by tests/conftest.py in the process that reports, the controller
under xdist) adds up each test's setup, call and teardown seconds (a session fixture's cost lands
on the first test that uses it) and writes them all, slowest first, to test-results/durations.tsv
in the repository at the end of every run; the terminal summary prints the seconds per file and
names any test over BUDGET_S. Nothing fails on time: speed is measured, not asserted.

`CpuMeter` (registered in every process that runs tests) puts on each phase's report the CPU
seconds spent meanwhile by the test process and the processes it waited for (theirs, and their
own children's that they waited for: a torchrun's workers, a CLI's run). Wall seconds stretch with
whatever shares the cores; CPU seconds hardly do, so they say what a test costs, and on a machine
of N cores the full suite takes at least its CPU seconds / N. A daemon (sshd, slurmctld) counts
when a fixture stops and waits for it: on that fixture's last test.

`FileOrGroupScheduling` (for `--dist loadgroup`, as scripts/test runs it) gives each worker whole
test files, so a file's module fixtures (a Slurm cluster, namespace hosts, a reference run) are made
once; tests marked `xdist_group(NAME)` go to one worker together whatever their file (the AWS
tests: one moto server, whose zones are the network slots 1-5).
"""
from __future__ import annotations

import collections
import resource
import time
from pathlib import Path

import pytest

BUDGET_S = 120.0  # a test longer than this is named in the summary (issue: no test over two minutes)
RECORD = Path("test-results") / "durations.tsv"


class CpuMeter:
    """CPU seconds of this process and of the children it has waited for, lap by lap."""

    def __init__(self):
        self.last = 0.0

    @staticmethod
    def now() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    def start(self) -> None:
        self.last = self.now()

    def lap(self) -> float:
        """CPU seconds since start() or the last lap."""
        now = self.now()
        spent, self.last = now - self.last, now
        return spent

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem):
        self.start()
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call):
        outcome = yield
        outcome.get_result().user_properties.append(("cpu_s", self.lap()))  # travels to xdist's controller


class DurationRecord:
    """Seconds and CPU seconds per test, written to `path` (relative: to pytest's rootdir) when
    the session ends."""

    def __init__(self, config: pytest.Config, path: Path = RECORD):
        self.path = path if path.is_absolute() else Path(config.rootpath) / path
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.cpu: dict[str, float] = collections.defaultdict(float)
        self.outcomes: dict[str, str] = {}
        self.error: str | None = None  # why the record could not be written
        self.started = time.monotonic()

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration
        self.cpu[report.nodeid] += sum(v for k, v in report.user_properties if k == "cpu_s")
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.nodeid] = report.outcome

    def per_file(self) -> list[tuple[float, float, str, int]]:
        """(seconds, CPU seconds, file, tests) for each test file, slowest first."""
        files: dict[str, list[str]] = collections.defaultdict(list)
        for nodeid in self.seconds:
            files[nodeid.split("::")[0]].append(nodeid)
        return sorted(((sum(self.seconds[t] for t in v), sum(self.cpu[t] for t in v), f, len(v))
                       for f, v in files.items()), reverse=True)

    @pytest.hookimpl
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.seconds:
            return
        wall = time.monotonic() - self.started
        when = time.strftime("%Y-%m-%d %H:%M:%S")
        lines = [f"# {len(self.seconds)} tests, {sum(self.seconds.values()):.1f} s of tests "
                 f"({sum(self.cpu.values()):.1f} s of CPU) in {wall:.1f} s wall ({when}); "
                 "seconds = setup + call + teardown", "seconds\tcpu_s\toutcome\ttest"]
        for nodeid, s in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
            lines.append(f"{s:.2f}\t{self.cpu[nodeid]:.2f}\t{self.outcomes.get(nodeid, 'passed')}\t{nodeid}")
        lines += ["", "# per file", "seconds\tcpu_s\ttests\tfile"]
        lines += [f"{s:.1f}\t{c:.1f}\t{n}\t{f}" for s, c, f, n in self.per_file()]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("\n".join(lines) + "\n")
        except OSError as e:  # a read-only checkout still runs its tests
            self.error = str(e)

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.seconds:
            return
        tr = terminalreporter
        tr.section("seconds per test file (setup + call + teardown, summed; CPU seconds beside)")
        for s, c, f, n in self.per_file():
            tr.write_line(f"{s:8.1f} s {c:8.1f} s CPU  {n:4d} tests  {f}")
        tr.write_line(f"CPU seconds of all tests: {sum(self.cpu.values()):.1f}")
        over = [(s, n) for n, s in self.seconds.items() if s > BUDGET_S]
        for s, nodeid in sorted(over, reverse=True):
            tr.write_line(f"over the {BUDGET_S:.0f} s a test may take: {s:.1f} s {nodeid}", yellow=True)
        tr.write_line(f"the durations record was not written: {self.error}" if self.error
                      else f"every test's seconds: {self.path}")


def make_scheduler(config: pytest.Config, log):
    """pytest-xdist's scheduler for the suite: whole files, or whole xdist groups, per worker."""
    from xdist.scheduler import LoadScopeScheduling

    class FileOrGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            # Under --dist loadgroup a grouped test's id ends in "@NAME" (a parameter may hold an "@").
            if nodeid.rfind("@") > nodeid.rfind("]"):
                return nodeid.rsplit("@", 1)[-1]
            return nodeid.split("::", 1)[0]

    return FileOrGroupScheduling(config, log)
