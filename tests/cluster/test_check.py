"""`speedrun check`: the all-reduce benchmark's arithmetic and verdicts (unit tier), and the command on a
local job of two tasks, on two and three namespace hosts over ssh (full tier; the Slurm check is in
test_slurm_jobs.py)."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from cli_run import start, wait_for
from netns import NetnsCluster, require
from speedrun.cli import main
from speedrun.cluster import make_job
from speedrun.cluster.allreduce import bus_bandwidth, message_sizes, nccl_transport
from speedrun.cluster.check import format_table, verdict
from speedrun.cluster.provider import NetworkSpec
from speedrun.cluster.ssh import SSHOptions

MiB = 1 << 20


# --- the arithmetic (unit tier) ---
@pytest.mark.parametrize("ranks,factor", [(1, 1.0), (2, 1.0), (3, 4 / 3), (8, 1.75), (16, 1.875)])
def test_bus_bandwidth_is_nccl_tests_formula(ranks, factor):
    # nccl-tests' all_reduce: busbw = algbw x 2(n-1)/n; one process has no bus to speak of.
    assert bus_bandwidth(10.0, ranks) == pytest.approx(10.0 * factor)


def test_message_sizes_double_by_four_and_end_at_the_largest():
    assert message_sizes(64 * MiB) == [4096, 16384, 65536, 262144, MiB, 4 * MiB, 16 * MiB, 64 * MiB]
    assert message_sizes(3 * MiB)[-1] == 3 * MiB  # the size asked for is always measured
    assert message_sizes(1000) == [1000]  # below the smallest: just that one, whole float32s
    assert all(s % 4 == 0 for s in message_sizes(int(2.5 * MiB) + 2))


# NCCL 2.2x's own lines (aws-ofi-nccl's plugin on EFA, the socket fallback, a single node's P2P).
EFA_LOG = """\
ip-10-0-0-5:3190:3190 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.13.2
ip-10-0-0-5:3190:3190 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa-direct (found 4 nics)
ip-10-0-0-5:3190:3190 [0] NCCL INFO Using network Libfabric
ip-10-0-0-5:3190:3261 [0] NCCL INFO Channel 00/0 : 7[7] -> 8[0] [receive] via NET/Libfabric/0/GDRDMA
ip-10-0-0-5:3190:3261 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
"""
SOCKET_LOG = """\
node1:811:811 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so. Using internal network plugin.
node1:811:811 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.5<0>
node1:811:811 [0] NCCL INFO Using network Socket
node1:811:870 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0
"""


def test_the_transport_nccl_chose_is_read_from_its_debug_output():
    assert nccl_transport(EFA_LOG.splitlines()) == ("EFA", ["NET/Libfabric/0/GDRDMA", "P2P/CUMEM/read"])
    assert nccl_transport(SOCKET_LOG.splitlines()) == ("sockets", ["NET/Socket/0"])
    assert nccl_transport(["x NCCL INFO Using network IB"])[0] == "InfiniBand"
    assert nccl_transport([]) == (None, [])


def result(busbw_GBps: float, *, machines: int = 2, transport: str = "sockets", backend: str = "nccl",
           wrong: int = 0) -> dict:
    rows = [{"bytes": size, "count": size // 4, "type": "float32", "time_us": 10.0, "algbw_GBps": busbw_GBps / 1.5,
             "busbw_GBps": busbw_GBps, "wrong": wrong} for size in (4096, 64 * MiB)]
    return {"backend": backend, "transport": transport, "paths": [], "ranks": 4, "nodes": machines,
            "machines": machines, "device": "NVIDIA H100 80GB HBM3", "iters": 20, "results": rows}


def test_the_verdict_holds_the_largest_message_against_the_nominal_bandwidth():
    p4d = NetworkSpec(400.0, "p4d.24xlarge: 4 network card(s), 400 Gbit/s in all", efa=True)
    good = verdict(result(40.0, transport="EFA"), p4d)  # 320 Gbit/s of 400
    assert good.startswith("good: 320.0 Gbit/s bus bandwidth at 64 MiB, 80% of the nominal 400 Gbit/s")
    assert verdict(result(12.5, transport="EFA"), p4d).startswith("below nominal: 100.0 Gbit/s")
    assert verdict(result(5.0, transport="EFA"), p4d).startswith("SLOW: 40.0 Gbit/s")
    # Launched with EFA, but NCCL went over sockets: said whatever the figure.
    fallback = verdict(result(40.0, transport="sockets"), p4d)
    assert fallback.startswith("SLOW: NCCL moved data over sockets, not EFA") and "aws-ofi-nccl" in fallback
    # No figure to hold it against, one machine, wrong sums.
    assert "no nominal bandwidth is known" in verdict(result(1.0, backend="gloo", transport="TCP"), None)
    assert verdict(result(1.0, machines=1), p4d).startswith("one machine:")
    assert verdict(result(40.0, transport="EFA", wrong=3), p4d).startswith("WRONG:")


def test_the_table_has_a_row_per_size_like_nccl_tests():
    lines = format_table(result(40.0, transport="EFA"))
    assert lines[0].startswith("all-reduce, nccl over EFA: 4 processes, 2 task(s) on 2 machine(s)")
    assert lines[1].split() == ["size", "(B)", "count", "type", "time", "(us)", "algbw", "(GB/s)", "busbw", "(GB/s)",
                                "#wrong"]
    assert [line.split()[0] for line in lines[2:]] == ["4096", str(64 * MiB)]


# --- on jobs (full tier) ---
def read_check(run_dir: str) -> dict:
    return json.loads(Path(run_dir, "check.json").read_text())


def assert_measured(res: dict, ranks: int, size_mib: float) -> None:
    """Every size measured, right sums, positive bandwidth, busbw by nccl-tests' formula."""
    assert [r["bytes"] for r in res["results"]] == message_sizes(int(size_mib * MiB))
    assert res["ranks"] == ranks and res["backend"] == "gloo" and res["transport"] == "TCP"
    for r in res["results"]:
        assert r["wrong"] == 0 and r["time_us"] > 0 and r["algbw_GBps"] > 0
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / (r["time_us"] / 1e6) / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (ranks - 1) / ranks)


@pytest.mark.slow
def test_check_on_a_local_job_of_two_tasks_prints_every_size_and_writes_json(local_job, capsys):
    job = local_job(num_tasks=2)
    assert main(["check", job.name, "--size", "1", "--iters", "3"]) == 0
    out = capsys.readouterr().out
    res = read_check(job.run_dir)
    assert_measured(res, 2, 1)
    assert (res["machines"], res["nodes"], res["nproc_per_node"]) == (1, 2, 1)
    assert res["verdict"].startswith("one machine:") and f"verdict: {res['verdict']}" in out
    for r in res["results"]:  # the table printed what the file holds
        assert f"{r['busbw_GBps']:.3f}" in out and str(r["bytes"]) in out
    assert f"result: {job.run_dir}/check.json" in out
    # Run again: a new result (its own id), never the last one's.
    first = res["id"]
    assert main(["check", job.name, "--size", "0.25", "--iters", "2"]) == 0
    again = read_check(job.run_dir)
    assert again["id"] != first and again["results"][-1]["bytes"] == MiB // 4


@pytest.mark.slow
def test_check_refuses_bad_sizes_before_asking_any_host(local_job, capsys):
    job = local_job(num_tasks=1)
    for flags, message in ((["--size", "0"], "argument --size: 0 is not a number in 0.001..16,384"),
                           (["--iters", "0"], "argument --iters: 0 is not a whole number in 1..1,000,000"),
                           (["--iters", str(10**11)], "argument --iters: 100000000000 is not a whole number"),
                           (["--nproc-per-node", "0"], "argument --nproc-per-node: 0 is not a whole number in 1..1024"),
                           (["--timeout", "nan"], "argument --timeout: nan is not a number in 0.1..86,400")):
        assert main(["check", job.name, *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
    assert not Path(job.run_dir, "check.json").exists()


@pytest.mark.netns
def test_check_on_two_ssh_hosts(ssh_job, capsys):
    job = ssh_job(num_tasks=2)
    assert main(["check", job.name, "--size", "2", "--iters", "3"]) == 0
    res = read_check(job.run_dir)
    assert_measured(res, 2, 2)
    assert res["machines"] == 2
    assert res["socket_interface"]  # gloo was told the interface that reaches task 0
    assert res["verdict"].startswith(f"{res['results'][-1]['busbw_GBps'] * 8:,.1f} Gbit/s")
    assert "no nominal bandwidth is known" in res["verdict"]


@pytest.fixture(scope="module")
def netns3():
    """Three namespace hosts (the shared `netns` fixture has two)."""
    require("the three-host check")
    cluster = NetnsCluster(3)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.mark.netns
def test_check_on_three_ssh_hosts(netns3, shared_dir, job_name, capsys):
    job = make_job(job_name, 3, provider="ssh", hosts=netns3.specs, run_root=str(shared_dir / "runs"),
                   ssh=SSHOptions(known_hosts=netns3.known_hosts, identity_file=netns3.client_key))
    try:
        assert main(["check", job_name, "--size", "1", "--iters", "3"]) == 0
        res = read_check(job.run_dir)
        assert_measured(res, 3, 1)  # busbw = algbw x 4/3
        assert res["machines"] == 3
        out = capsys.readouterr().out
        assert "3 processes, 3 task(s) on 3 machine(s) (cpu)" in out
    finally:
        job.kill()
        job.close()


@pytest.mark.slow
def test_a_check_that_fails_on_a_task_is_one_line_saying_why_and_exit_3(local_job, capsys):
    job = local_job(num_tasks=2, python="python3 -S")  # a Python without site-packages: no torch there
    assert main(["check", job.name, "--nproc-per-node", "1"]) == 3
    lines = capsys.readouterr().err.strip().splitlines()  # the job's progress lines, then the reason
    failed = [line for line in lines if "the check failed" in line]
    assert failed == lines[-1:] and failed[0].startswith(f"speedrun: job {job.name}: the check failed (exit 1): ")
    assert "No module named 'torch'" in failed[0] and "/cmds/" in failed[0] and "Traceback" not in "".join(lines)


@pytest.mark.slow
def test_a_check_past_its_timeout_is_stopped_one_line_exit_3_and_the_next_one_runs(local_job, capsys):
    job = local_job(num_tasks=2)
    assert main(["check", job.name, "--timeout", "0.5", "--iters", "2"]) == 3  # torch alone takes longer
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == f"speedrun: error: job {job.name}: check did not end within 0.5 s; stopped"
    assert [line for line in lines if "error" in line] == lines[-1:]
    assert all(st.state != "running" for st in job.status("check"))  # stopped, not left running
    assert main(["check", job.name, "--size", "0.25", "--iters", "2"]) == 0  # and not in the next one's way


@pytest.mark.slow
def test_an_interrupted_check_is_stopped_on_every_task(local_job):
    job = local_job(num_tasks=2)
    check = start("check", job.name, "--iters", "100000")  # hours of calls: it is interrupted long before
    wait_for(lambda: [st.state for st in job.status("check")] == ["running"] * 2, 120, "the check on both tasks")
    check.send_signal(signal.SIGTERM)  # a closed terminal or `kill`, as Ctrl-C
    _, err = check.communicate(timeout=120)
    assert check.returncode == 130, err
    assert all(st.state != "running" for st in job.status("check"))


def check_states(job) -> list[str]:
    return [st.state for st in job.status("check")]


@pytest.mark.slow
def test_a_check_whose_client_was_killed_ends_at_its_timeout_and_the_next_one_runs(local_job):
    job = local_job(num_tasks=2)
    check = start("check", job.name, "--iters", "1000000", "--timeout", "600")  # hours of calls
    wait_for(lambda: check_states(job) == ["running"] * 2, 120, "the check on both tasks")
    check.kill()  # SIGKILL: nothing of the client's clean-up runs
    check.communicate()
    assert check_states(job) == ["running"] * 2  # left behind...
    assert main(["check", job.name, "--size", "0.25", "--iters", "2"]) == 0  # ...and ended by the next check
    assert read_check(job.run_dir)["iters"] == 2
    # Killed again, with a short timeout: the processes end by themselves when it has passed.
    check = start("check", job.name, "--iters", "1000000", "--timeout", "15")
    wait_for(lambda: check_states(job) == ["running"] * 2, 120, "the check on both tasks")
    check.kill()
    check.communicate()
    wait_for(lambda: "running" not in check_states(job), 120, "the check to end at its timeout")


@pytest.mark.netns
def test_a_host_lost_during_a_check_is_a_failed_check_and_its_leftovers_end_at_the_next(ssh_job, netns, capsys):
    job = ssh_job(num_tasks=2)
    check = start("check", job.name, "--iters", "1000000", "--timeout", "600")
    try:
        wait_for(lambda: check_states(job) == ["running"] * 2, 120, "the check on both tasks")
        netns.set_link(netns.hosts[1], False)
        _, err = check.communicate(timeout=200)
    finally:
        check.kill()
        netns.set_link(netns.hosts[1], True)
    last = err.strip().splitlines()[-1]
    assert check.returncode == 3 and "Traceback" not in err and "training failed" not in err, err
    assert last.startswith(f"speedrun: job {job.name}: the check failed: ") and "task 1" in last, last
    assert main(["check", job.name, "--size", "0.25", "--iters", "2"]) == 0  # the cut host answers again
    assert read_check(job.run_dir)["iters"] == 2 and "running" not in check_states(job)
