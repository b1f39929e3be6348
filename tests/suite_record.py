"""The suite's own record: how long every test took, kept with each run, and how the full suite is
shared among pytest-xdist's workers.

`DurationRecord` (registered by tests/conftest.py in the process that reports, the controller
under xdist) adds up each test's setup, call and teardown seconds (a session fixture's cost lands
on the first test that uses it) and writes them all, slowest first, to test-results/durations.tsv
in the repository at the end of every run; the terminal summary prints the seconds per file and
names any test over BUDGET_S. Nothing fails on time: speed is measured, not asserted.

`FileOrGroupScheduling` (for `--dist loadgroup`, as scripts/test runs it) gives each worker whole
test files, so a file's module fixtures (a Slurm cluster, namespace hosts, a reference run) are made
once; tests marked `xdist_group(NAME)` go to one worker together whatever their file (the AWS
tests: one moto server, whose zones are the network slots 1-5).
"""
from __future__ import annotations

import collections
import time
from pathlib import Path

import pytest

BUDGET_S = 120.0  # a test longer than this is named in the summary (issue: no test over two minutes)
RECORD = Path("test-results") / "durations.tsv"


class DurationRecord:
    """Seconds per test, written to `path` (relative: to pytest's rootdir) when the session ends."""

    def __init__(self, config: pytest.Config, path: Path = RECORD):
        self.path = path if path.is_absolute() else Path(config.rootpath) / path
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.outcomes: dict[str, str] = {}
        self.error: str | None = None  # why the record could not be written
        self.started = time.monotonic()

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.nodeid] = report.outcome

    def per_file(self) -> list[tuple[float, str, int]]:
        """(seconds, file, tests) for each test file, slowest first."""
        files: dict[str, list[float]] = collections.defaultdict(list)
        for nodeid, s in self.seconds.items():
            files[nodeid.split("::")[0]].append(s)
        return sorted(((sum(v), f, len(v)) for f, v in files.items()), reverse=True)

    @pytest.hookimpl
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.seconds:
            return
        wall = time.monotonic() - self.started
        lines = [f"# {len(self.seconds)} tests, {sum(self.seconds.values()):.1f} s of tests in {wall:.1f} s "
                 f"wall ({time.strftime('%Y-%m-%d %H:%M:%S')}); seconds = setup + call + teardown",
                 "seconds\toutcome\ttest"]
        for nodeid, s in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
            lines.append(f"{s:.2f}\t{self.outcomes.get(nodeid, 'passed')}\t{nodeid}")
        lines += ["", "# per file", "seconds\ttests\tfile"]
        lines += [f"{s:.1f}\t{n}\t{f}" for s, f, n in self.per_file()]
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
        tr.section("seconds per test file (setup + call + teardown, summed)")
        for s, f, n in self.per_file():
            tr.write_line(f"{s:8.1f} s  {n:4d} tests  {f}")
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
