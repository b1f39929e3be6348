"""The suite's own record (tests/suite_record.py): every test's seconds written at the end of a run,
and whole files (or xdist groups) per worker."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from suite_record import CpuMeter, DurationRecord, make_scheduler
from xdist.remote import Producer


def report(nodeid: str, when: str, seconds: float, outcome: str = "passed", cpu_s: float | None = None
           ) -> pytest.TestReport:
    props = [] if cpu_s is None else [("cpu_s", cpu_s)]
    return pytest.TestReport(nodeid, ("f.py", 0, nodeid), {}, outcome, None, when, duration=seconds,
                             user_properties=props)


def test_the_record_adds_each_tests_phases_and_writes_every_test_slowest_first_and_each_file(tmp_path):
    record = DurationRecord(SimpleNamespace(rootpath=tmp_path))
    for nodeid, seconds in (("tests/a.py::one", 1.0), ("tests/a.py::two", 30.0), ("tests/b.py::three", 2.5)):
        for when, share in (("setup", 0.5), ("call", 0.25), ("teardown", 0.25)):
            record.pytest_runtest_logreport(report(nodeid, when, seconds * share))
    record.pytest_runtest_logreport(report("tests/b.py::four", "setup", 0.5, outcome="failed"))
    record.pytest_sessionfinish(None)
    lines = (tmp_path / "test-results" / "durations.tsv").read_text().splitlines()
    assert lines[0].startswith("# 4 tests, 34.0 s of tests (0.0 s of CPU) in ")
    assert lines[1:6] == ["seconds\tcpu_s\toutcome\ttest", "30.00\t0.00\tpassed\ttests/a.py::two",
                          "2.50\t0.00\tpassed\ttests/b.py::three", "1.00\t0.00\tpassed\ttests/a.py::one",
                          "0.50\t0.00\tfailed\ttests/b.py::four"]
    assert lines[-3:] == ["seconds\tcpu_s\ttests\tfile", "31.0\t0.0\t2\ttests/a.py", "3.0\t0.0\t2\ttests/b.py"]


def test_the_record_adds_the_cpu_seconds_of_each_tests_phases_per_test_and_file(tmp_path):
    record = DurationRecord(SimpleNamespace(rootpath=tmp_path))
    for when, cpu in (("setup", 4.0), ("call", 20.0), ("teardown", 1.0)):
        record.pytest_runtest_logreport(report("tests/a.py::one", when, 10.0, cpu_s=cpu))
    record.pytest_runtest_logreport(report("tests/b.py::two", "call", 3.0, cpu_s=0.5))
    record.pytest_sessionfinish(None)
    lines = (tmp_path / "test-results" / "durations.tsv").read_text().splitlines()
    assert lines[0].startswith("# 2 tests, 33.0 s of tests (25.5 s of CPU) in ")
    assert lines[1:4] == ["seconds\tcpu_s\toutcome\ttest", "30.00\t25.00\tpassed\ttests/a.py::one",
                          "3.00\t0.50\tpassed\ttests/b.py::two"]
    assert lines[-3:] == ["seconds\tcpu_s\ttests\tfile", "30.0\t25.0\t1\ttests/a.py", "3.0\t0.5\t1\ttests/b.py"]


@pytest.mark.slow  # it starts a process
def test_the_meter_counts_the_cpu_of_the_processes_a_test_waited_for():
    meter = CpuMeter()
    meter.start()
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(6_000_000))"], check=True)
    spent = meter.lap()
    assert spent > 0.2  # the child's computing, not this process's few milliseconds
    assert meter.lap() < spent / 10  # each lap counts from the last


def test_workers_get_whole_files_and_grouped_tests_together():
    two_workers = SimpleNamespace(getvalue=lambda name: {"tx": ["popen", "popen"]}.get(name))
    scheduler = make_scheduler(two_workers, log=Producer("test", enabled=False))
    split = scheduler._split_scope
    assert split("tests/cluster/test_x.py::test_a[1]") == split("tests/cluster/test_x.py::test_b") == \
        "tests/cluster/test_x.py"
    assert split("tests/cluster/test_aws_efa.py::test_c@aws") == split("tests/cluster/test_y.py::test_d@aws") == "aws"
    assert split("tests/test_z.py::test_e[user@host]") == "tests/test_z.py"
