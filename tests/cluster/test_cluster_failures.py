"""A job whose task fails ends as a whole, within a bounded time, and says why: on two
network-namespace hosts, with real torchrun, `speedrun train` and tmux.

- A rank dies where its peer cannot notice (its host's route to task 0 is cut first, as when a
  rank dies under NCCL or behind a partition): the survivor's collective alone would wait for the
  trainer's process-group timeout (300 s); whoever waits on the job stops it at once.
- A host's torchrun never starts (torch is broken there): the rendezvous never completes, and
  torchrun's own join timeout (900 s) would keep task 0 "running"; launch's bounded one ends it,
  and `speedrun launch --wait` stops it at once.
- A host's link goes down mid-run: `speedrun launch --wait` declares the host lost once ssh has
  not reached it for a bounded time (not gloo's 300 s), stops the job and exits 3 naming the host.
- `speedrun ls` quotes the line that says why a task ended, never noise (c10d's hostname warning,
  the run's header line).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import shlex
import signal
import site
import subprocess
from pathlib import Path

import pytest

from cli_run import start, wait_for
from netns import NetnsHost
from speedrun.cli import main
from test_cluster_e2e import ONE_THREAD, TRAIN, speedrun

pytestmark = [pytest.mark.netns, pytest.mark.slow]
EPOCHS = 8  # the tiny recipe, longer: the rank dies well before the end


def training_pids(host: NetnsHost) -> list[int]:
    """The training processes (torchrun's workers, not torchrun) running on a namespace host."""
    out = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True, text=True).stdout
    found = []
    for pid in out.split():
        with contextlib.suppress(OSError):  # it may have ended since
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"speedrun" in argv and b"train" in argv and b"torch.distributed.run" not in argv:
                found.append(int(pid))
    return found


@contextlib.contextmanager
def cut_off(host: NetnsHost, peer: NetnsHost):
    """Packets from `host` to `peer` are dropped while inside (ssh from here still reaches both)."""
    route = ["ip", "-n", host.namespace, "route", "add", "blackhole", f"{peer.address}/32"]
    subprocess.run(route, check=True)
    try:
        yield
    finally:
        subprocess.run([*route[:4], "del", *route[5:]], check=False)


@contextlib.contextmanager
def broken_torch(host: NetnsHost):
    """`import torch` fails on the host (a package of that name in its user site, which its HOME
    holds), so its torchrun exits before it joins; removed afterwards."""
    package = host.home / Path(site.getusersitepackages()).relative_to(Path.home()) / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('torch is broken on this host')\n")
    try:
        yield
    finally:
        shutil.rmtree(package)


def ended(job) -> list | None:
    """The job's task states once none is running, else None."""
    states = job.status()
    return None if any(s.state == "running" for s in states) else states


def ls_reason(job_name: str, capsys) -> str:
    """The line `speedrun ls JOB` prints under its table to say why the job is not simply running."""
    assert main(["ls", job_name]) == 0
    lines = [ln.strip() for ln in capsys.readouterr().out.splitlines() if ln.startswith(f"  {job_name}: ")]
    assert len(lines) == 1, lines
    return lines[0]


def test_a_rank_that_dies_unnoticed_stops_the_whole_job_and_ls_says_why(netns, ssh_job, job_name, capsys):
    job = ssh_job()
    job.launch([*TRAIN, "--epochs", str(EPOCHS), "--out", job.run_dir], env=ONE_THREAD)
    wait_for(lambda: Path(job.run_dir, "steps.jsonl").exists(), 300, "the first training steps")
    (rank1,) = wait_for(lambda: training_pids(netns.hosts[1]), 60, "task 1's training process")
    with cut_off(netns.hosts[1], netns.hosts[0]):
        os.kill(rank1, signal.SIGKILL)
        # Well within the survivor's 300 s collective timeout: the job layer must stop it.
        results = job.wait(timeout=120, check=False)
    assert [r.status for r in results] == [137, 1]  # task 0 stopped, task 1's torchrun failed
    states = job.status()
    assert [s.state for s in states] == ["killed", "failed (1)"]
    assert states[0].why == "stopped by speedrun: task 1 failed (exit 1)"
    reason = ls_reason(job_name, capsys)
    assert reason.startswith(f"{job_name}: task 1 failed (exit 1): ") and "Signal 9 (SIGKILL)" in reason
    assert reason.endswith("; task 0 stopped by speedrun")


def test_a_rendezvous_that_never_completes_ends_after_the_join_timeout(netns, ssh_job, job_name, capsys):
    job = ssh_job()
    with broken_torch(netns.hosts[1]):
        job.launch([*TRAIN, "--out", job.run_dir], env=ONE_THREAD, join_timeout_s=20)
        # Nobody waits on the job here: torchrun itself gives up, long before its own 900 s.
        states = wait_for(lambda: ended(job), 300, "both tasks to end")
    assert [s.state for s in states] == ["failed (1)", "failed (1)"]
    reason = ls_reason(job_name, capsys)
    first, second = reason.split("; ")  # task 1 failed first, then task 0 gave up waiting for it
    assert first.startswith(f"{job_name}: task 1 failed (exit 1): ") and "torch is broken on this host" in first
    assert second.startswith("task 0 failed (exit 1): ") and "1/2 clients joined" in second


def test_launch_wait_stops_the_others_when_a_task_fails(netns, shared_dir, job_name):
    ssh = ["--hosts", ",".join(netns.specs), "--identity", str(netns.client_key),
           "--known-hosts", str(netns.known_hosts), "--run-root", str(shared_dir / "failing-runs")]
    with broken_torch(netns.hosts[1]):
        # A join timeout longer than the wait: only --wait's rule can end task 0 in time.
        r = speedrun("launch", job_name, *ssh, "--join-timeout", "900", "--wait", "--", *TRAIN, "--out", "{run_dir}",
                     timeout=300)
    assert r.returncode == 3, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines()
               if ln.startswith(f"speedrun: job {job_name}: ") and "stopped by" in ln]
    assert "task 1 failed (exit 1): " in line and "torch is broken on this host" in line
    assert line.endswith("; task 0 stopped by speedrun")


def test_a_bad_join_timeout_is_one_line(capsys):
    assert main(["launch", "bad-join", "--join-timeout", "0", "--", "x.py"]) == 2
    assert capsys.readouterr().err.strip() == (
        "speedrun: error: speedrun launch NAME: argument --join-timeout: 0 is not a number in 1..86,400 "
        "(`speedrun launch NAME --help` for usage)")


@pytest.mark.parametrize("waiting", ["--wait", "--follow"])
def test_launch_wait_stops_the_job_when_a_host_is_cut_off(netns, shared_dir, job_name, capsys, waiting):
    run_root = shared_dir / "cut-off-runs"
    ssh = ["--hosts", ",".join(netns.specs), "--identity", str(netns.client_key),
           "--known-hosts", str(netns.known_hosts), "--run-root", str(run_root)]
    launch = start("launch", job_name, *ssh, "--env", "OMP_NUM_THREADS=1", waiting, "--",
                   *TRAIN, "--epochs", str(EPOCHS), "--out", "{run_dir}")
    try:
        wait_for(lambda: list(run_root.glob(f"{job_name}/run.*/steps.jsonl")), 300, "the first training steps")
        netns.set_link(netns.hosts[1], False)
        # Task 0 would wait in a collective for gloo's 300 s: the job layer must end it well before.
        out, err = launch.communicate(timeout=200)
    finally:
        launch.kill()
        netns.set_link(netns.hosts[1], True)
    assert launch.returncode == 3, err
    assert "Traceback" not in err, err
    last = err.splitlines()[-1]  # before it, progress lines: "task 1 unreachable (...); stopping task(s) 0"
    assert last.startswith(f"speedrun: host {netns.specs[1]} (task 1) unreachable: ") and last.endswith("; job stopped")
    # With the link back, task 1's collective still waits (`kill` ends it), or has failed on the
    # stopped peer's reset (`kill` ends it on its way out, or it has exited): the network's race
    # decides which, so each is right, and `ls` must say which, quoting the failure where there
    # was one, never the c10d warnings that start every task's log here or the trainer's header.
    assert main(["kill", job_name]) == 0
    assert "(2 of 2 task(s))" in capsys.readouterr().out
    reason = ls_reason(job_name, capsys)
    task1, task0 = reason.removeprefix(f"{job_name}: ").split("; ")
    collective = ": speedrun: rank 1: training failed: a collective failed: rank 0 (host "
    assert task1 == "task 1 killed" or (
        task1.startswith(("task 1 killed" + collective, "task 1 failed (exit 1)" + collective))
        and "probably died" in task1), task1
    assert task0 == "task 0 stopped by speedrun"
    assert "c10d" not in reason and "recipe tiny" not in reason


C10D_NOISE = ("[W1201 16:10:45.365592007 socket.cpp:207] [c10d] "
              "The hostname of the client socket cannot be retrieved. err=-3")
HEADER = "speedrun 0.1.0: recipe tiny, model resnet-fmnist-tiny, 6000 train / 1000 val images, 2 x cpu, fp32"


def test_ls_quotes_the_reason_a_task_ended_not_noise(local_job, job_name, capsys):
    job = local_job(num_tasks=2)
    failing = job[0].run(f"echo '{C10D_NOISE}'; echo '{HEADER}'; nosuchprogram; echo '{C10D_NOISE}'; exit 1",
                         background=True, name="train")
    job[1].run(f"echo '{C10D_NOISE}'; echo '{HEADER}'; echo started; sleep 300", background=True, name="train")
    failing.wait(timeout=60, check=False)
    wait_for(lambda: "started" in job[1].command("train").output(), 60, "task 1 to start")
    assert main(["kill", job_name]) == 0
    capsys.readouterr()
    first, second = ls_reason(job_name, capsys).split("; ")
    assert (first.startswith(f"{job_name}: task 0 failed (exit 1): ")
            and first.endswith("nosuchprogram: command not found"))
    assert second == "task 1 killed"


STOPPED = ("stopped at step 441, 9 steps into epoch 19 on a stop request (the run directory's `stop` file); "
           "the checkpoint holds this step: continue with --resume --out /r")
# What torchrun prints after a worker exits 75 (a run stopped at a step), then exiting 1 itself.
TORCHRUN_AFTER_A_STOP = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
Root Cause (first observed failure):
[0]:
  exitcode  : 75 (pid: 29763)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================"""


def test_ls_says_a_run_stopped_at_a_step_not_what_torchrun_printed_after_it(local_job, job_name, capsys):
    job = local_job(num_tasks=1)
    command = job[0].run(f"echo {shlex.quote(STOPPED)}; echo {shlex.quote(TORCHRUN_AFTER_A_STOP)}; exit 1",
                         background=True, name="train")
    command.wait(timeout=60, check=False)
    assert ls_reason(job_name, capsys) == f"{job_name}: task 0 failed (exit 1): {STOPPED}"
