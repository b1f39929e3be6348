"""`speedrun launch | ls | logs | kill` from the command line (in this process: same code, no startup)."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from cli_run import speedrun, wait_for
from speedrun.cli import main
from speedrun.cluster.states import REASON_CHARS, ReportFold, telling_line


@pytest.mark.slow
def test_ls_logs_and_kill_a_local_job(local_job, capsys):
    job = local_job(num_tasks=2)
    for t in job:
        t.run(f"echo hello {t.index}", name="train")
    assert main(["ls", job.name]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["JOB", "TASK", "HOST", "STATE", "UPTIME", "RUN", "DIR"]
    assert [line.split()[:4] for line in lines[1:]] == [[job.name, "0", "local", "succeeded"],
                                                        [job.name, "1", "local", "succeeded"]]
    assert all(line.split()[5] == job.run_dir for line in lines[1:])

    assert main(["logs", job.name]) == 0
    assert sorted(capsys.readouterr().out.splitlines()) == ["[0] hello 0", "[1] hello 1"]
    assert main(["logs", job.name, "1", "--follow"]) == 0
    assert capsys.readouterr().out == "hello 1\n"

    assert main(["logs", job.name, "--window", "bad:win"]) == 2  # bad input, never a host taken for lost
    assert "bad --window 'bad:win'" in error_line(capsys)
    assert main(["attach", job.name]) == 2  # pytest's stdin is no terminal
    assert "attach needs a terminal" in error_line(capsys)

    assert main(["ls"]) == 0  # all jobs: this one among them
    assert any(line.startswith(job.name + " ") for line in capsys.readouterr().out.splitlines())
    assert main(["kill", job.name]) == 0
    capsys.readouterr()
    main(["ls", job.name, "--window", "none"])
    assert [line.split()[3] for line in capsys.readouterr().out.splitlines()[1:]] == ["stopped", "stopped"]


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("speedrun: error: "), err
    return err


@pytest.mark.slow
def test_a_refused_host_is_one_line_and_exit_status_2(netns, shared_dir, capsys):
    # options after the job name, before `--`, are understood too
    code = main(["launch", "refused-cli", "--hosts", f"root@{netns.hosts[1].address}:2222",
                 "--identity", str(netns.client_key), "--known-hosts", str(netns.known_hosts),
                 "--run-root", str(shared_dir), "--", "train.py"])
    assert code == 2
    assert "connection refused" in error_line(capsys)


@pytest.mark.slow
def test_an_unknown_host_key_is_one_line_and_exit_status_2(netns, shared_dir, tmp_path, capsys):
    code = main(["launch", "unknown-key-cli", "--hosts", netns.specs[0], "--identity", str(netns.client_key),
                 "--known-hosts", str(tmp_path / "empty"), "--run-root", str(shared_dir), "--", "train.py"])
    assert code == 2
    assert "--accept-new-host-keys" in error_line(capsys)


@pytest.mark.parametrize("argv, message", [
    (["launch", "j"], "nothing to launch"),
    (["launch", "j", "--env", "novalue", "--", "x.py"], "bad --env"),
    (["launch", "bad name", "--", "x.py"], "bad job name"),
    (["launch", "j", "--provider", "ssh", "--", "x.py"], "needs hosts"),
    (["logs", "never-launched"], "no job named 'never-launched'"),
    (["kill", "never-launched"], "no job named"),
    (["attach", "never-launched"], "no job named"),
    (["logs", "never-launched", "--window", "bad:win"], "bad --window 'bad:win': use letters, digits"),
    (["ls", "--window", "bad:win"], "bad --window 'bad:win'"),
    (["attach", "never-launched", "--window", "a b"], "bad --window 'a b'"),
])
def test_bad_input_is_one_line_and_exit_status_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in error_line(capsys)


@pytest.mark.parametrize("flags, message", [
    (["--identity", "/k"], "--identity does not apply to the local provider: the ssh options are for --provider ssh"),
    (["--known-hosts", "/kh", "--accept-new-host-keys"],
     "--known-hosts, --accept-new-host-keys do not apply to the local"),
    (["--provider", "aws", "--instance-type", "m9.huge"], "unknown instance type 'm9.huge': not an EC2 type botocore"),
    (["--provider", "aws", "--on-demand-fallback"], "on_demand_fallback is a fallback for spot instances: add --spot"),
    (["--provider", "aws", "--vpc-cidr", "10.0.0.0/8"], "vpc_cidr 10.0.0.0/8: give an IPv4 range from /16 to /24"),
    (["--provider", "aws", "--vpc-cidr", "ten"], "bad vpc_cidr 'ten'"),
    (["--provider", "aws", "--identity", "/k"], "--identity does not apply to the aws provider"),
    (["--provider", "aws", "--instance-type", "c5.large", "--efa", "on"], "--efa on: c5.large has no EFA; use a type"),
])
def test_options_that_do_not_apply_are_refused_offline_before_anything_is_asked(flags, message, capsys, monkeypatch,
                                                                                tmp_path):
    # Were a check missed, boto3 would fail fast here, on a closed local port, never ask a public address.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    assert main(["launch", "offline", *flags, "--", "x.py"]) == 2
    assert message in error_line(capsys)


@pytest.mark.parametrize("flags,message", [
    (["--watcher-host", "root@ctl"], "--watcher-host needs --recover (it says where the recovering watcher runs)"),
    (["--recover", "--watcher-host", "root@ctl"],
     "the local provider's machines cannot be watched from another host"),
    (["--hosts", "root@gpu1", "--recover", "--watcher-host", "root@ctl"],
     "a watcher on another host reaches the job's hosts with a key copied there: give it with --identity"),
    (["--recover", "--watcher-host", "root@ctl:notaport"], "bad host 'root@ctl:notaport'"),
    (["--recover", "--watcher-env", "AWS_REGION=eu-west-1"], "--watcher-env needs --watcher-host"),
    (["--recover", "--watcher-host", "root@ctl", "--watcher-env", "s3cr3t-without-a-name"], "bad --watcher-env"),
    (["--recover", "--watcher-host", "root@ctl", "--watcher-env", "AWS_SECRET_ACCESS_KEY=s3cr3t"],
     "--watcher-env AWS_SECRET_ACCESS_KEY: speedrun does not copy AWS credentials to the controller"),
    (["--recover", "--watcher-host", "root@ctl", "--watcher-env", "AWS_SESSION_TOKEN=s3cr3t"],
     "--watcher-env AWS_SESSION_TOKEN: speedrun does not copy AWS credentials"),
])
def test_a_watcher_host_that_cannot_work_is_one_line_before_anything_starts(flags, message, capsys):
    assert main(["launch", "wh", *flags, "--", "x.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"speedrun: error: {message}") and "\n" not in err
    assert "s3cr3t" not in err  # a value given for the controller is never printed


@pytest.mark.slow
def test_ls_reads_a_failed_log_with_carriage_returns_as_log_lines(local_job):
    # A progress bar redraws with '\r': what follows one is still the log's, never a field of
    # the status (`now=` here, which ls reads as a number).
    job = local_job()
    job[0].run("printf 'epoch 1/2 [###   ]\\rnow=soon\\nboom: the reason\\n'; exit 1", name="train", check=False)
    r = speedrun("ls", job.name)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1].split()[:5] == [job.name, "0", "local", "failed", "(1)"]
    assert f"{job.name} task 0" not in r.stdout  # reachable: no error line


@pytest.mark.parametrize("text", ["[]", "{}", "not json", '{"name": "other-name", "num_tasks": 1}',
                                  '{"name": "damaged", "num_tasks": 1, "provider": {"kind": "ssh"}, '
                                  '"run_dir": "/x", "cwd": null}'])
@pytest.mark.slow
def test_a_damaged_job_record_is_skipped_by_ls_and_one_line_elsewhere(local_job, private_speedrun, text, capsys):
    job = local_job()
    job[0].run("echo hello", name="train")
    damaged = private_speedrun / "home" / "jobs" / "damaged.json"
    damaged.write_text(text)
    try:
        # ls lists every other job, and says in one line which record it skipped
        assert main(["ls"]) == 0
        captured = capsys.readouterr()
        assert any(line.split()[:4] == [job.name, "0", "local", "succeeded"] for line in captured.out.splitlines())
        assert captured.err.count("\n") == 1 and captured.err.startswith("speedrun: warning: "), captured.err
        assert str(damaged) in captured.err
        for argv in (["ls", "damaged"], ["kill", "damaged"], ["logs", "damaged"]):
            assert main(argv) == 2
            assert str(damaged) in error_line(capsys)
    finally:
        damaged.unlink()


@pytest.mark.parametrize("flags, message", [
    (["--nproc-per-node", "0"], "argument --nproc-per-node: 0 is not a whole number in 1..1024"),
    (["--window", "no spaces"], "bad --window 'no spaces'"),
])
@pytest.mark.slow
def test_launch_refuses_bad_arguments_before_making_anything(flags, message, job_name, tmp_path, capsys):
    from speedrun.cluster import registry
    run_root = tmp_path / "runs"
    assert main(["launch", job_name, "--run-root", str(run_root), *flags, "--", "x.py"]) == 2
    assert message in error_line(capsys)
    assert not run_root.exists() and not registry.exists(job_name)
    sessions = subprocess.run(["tmux", "-L", "speedrun", "list-sessions", "-F", "#{session_name}"],
                              capture_output=True, text=True).stdout.split()
    assert f"{job_name}-0" not in sessions


@pytest.mark.netns
def test_logs_of_an_unreachable_task_is_one_line_and_exit_status_3(ssh_job, netns, capsys):
    job = ssh_job()
    job.run("echo started; sleep 300", background=True, name="train")
    wait_for(lambda: all("started" in c.output() for c in job.commands()), 30, "both tasks to start")
    # The network to host 1 goes silent (its link down): packets are dropped, nothing is refused.
    netns.hosts[1].exec(["ip", "link", "set", "eth0", "down"], check=True)
    try:
        capsys.readouterr()
        assert main(["logs", job.name, "1"]) == 3
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.count("\n") == 1, captured.err
        assert captured.err.startswith(f"speedrun: task 1 ({netns.specs[1]}) is unreachable: ")
        # the reachable task's log still comes; the unreachable one is named, and the status says so
        assert main(["logs", job.name]) == 3
        captured = capsys.readouterr()
        assert captured.out == "[0] started\n"
        assert captured.err.startswith(f"speedrun: task 1 ({netns.specs[1]}) is unreachable: ")
        assert main(["logs", job.name, "0"]) == 0
        assert capsys.readouterr().out == "started\n"
    finally:
        netns.hosts[1].exec(["ip", "link", "set", "eth0", "up"], check=True)


def test_a_long_reason_is_cut_in_the_middle_keeping_what_says_why():
    line = f"/{'d' * 300}/command.sh: line 1: nosuchprogram: command not found"
    reason = telling_line(["started", line])
    assert len(reason) == REASON_CHARS and reason.startswith("/ddd") and "..." in reason
    assert reason.endswith("/command.sh: line 1: nosuchprogram: command not found")


# torchrun's own reports, as it printed them here (torch 2.x): a node whose surviving rank failed
# after its peer died (the rank's one line, then torchrun's failure log line, traceback and table),
# and a node whose torchrun got SIGTERM (its warning, the worker's last line, its traceback).
LOGS = Path(__file__).parent / "logs"
SURVIVOR_LOG = (LOGS / "torchrun-survivor.log").read_text()
SIGNALLED_LOG = (LOGS / "torchrun-signalled.log").read_text()


def test_torchruns_report_folds_into_one_line_after_the_ranks_last_word():
    fold = ReportFold("/runs/r/task-0/cmds/000001-train/log")
    out = (fold.feed(SURVIVOR_LOG) + fold.flush()).splitlines()
    assert out[-2].startswith("speedrun: rank 0: training failed: a collective failed: rank 1 ")
    assert out[-1] == ("torchrun: local rank 0 (pid 7684) ended with exit code 3; torchrun's report is in "
                       "/runs/r/task-0/cmds/000001-train/log")
    assert len(out) == 3 and "Traceback" not in "".join(out)
    # Fed line by line as `logs -f` does, with what a later start appends after the report: the same.
    fold = ReportFold("log")
    pieces = [fold.feed(line + "\n") for line in SURVIVOR_LOG.splitlines()] + [fold.feed("stopped at step 9")]
    assert "".join(pieces).splitlines()[-1].startswith("torchrun: local rank 0 (pid 7684)")
    assert fold.flush() == "stopped at step 9"


def test_a_signal_torchrun_got_folds_its_traceback_and_keeps_the_workers_last_lines():
    fold = ReportFold("log")
    out = (fold.feed(SIGNALLED_LOG) + fold.flush()).splitlines()
    assert out[0] == "training" and out[3] == "stopped at step 12 (epoch 1) on SIGTERM; the checkpoint holds this step"
    assert out[-1] == "torchrun: stopped by SIGTERM, which it passed on to its processes; torchrun's report is in log"
    assert len(out) == 5 and "Traceback" not in "".join(out)
    # A worker killed by a signal: its exit code is negative, said by the signal's name.
    fold = ReportFold("log")
    line = ("E1205 17:21:01.230000 7423 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed "
            "(exitcode: -9) local_rank: 0 (pid: 7685) of binary: /usr/bin/python3")
    assert fold.feed(line + "\n") == \
        "torchrun: local rank 0 (pid 7685) ended with exit code -9 (SIGKILL); torchrun's report is in log\n"


def worker_pid(job: str, rank: int) -> int | None:
    """The pid of a training process (not torchrun) of a local job's rank, if it runs."""
    for d in Path("/proc").iterdir():
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SPEEDRUN_JOB={job}".encode() in env and f"RANK={rank}".encode() in env and \
                b"torch.distributed.run" not in argv and any(v.startswith(b"LOCAL_RANK=") for v in env):
            return int(d.name)
    return None


@pytest.mark.slow
def test_a_surviving_ranks_line_is_the_last_word_of_its_log_and_ls(local_job, capsys):
    job = local_job(num_tasks=2)
    job.launch(["-m", "speedrun", "train", "--recipe", "tiny", "--device", "cpu", "--epochs", "8", "--out",
                job.run_dir], env={"OMP_NUM_THREADS": "1"})
    wait_for(lambda: Path(job.run_dir, "steps.jsonl").exists(), 300, "the first training steps")
    os.kill(wait_for(lambda: worker_pid(job.name, 1), 60, "rank 1's process"), signal.SIGKILL)
    wait_for(lambda: all(s.state != "running" for s in job.status()), 120, "both tasks to end")
    for flags in ([], ["--follow"]):
        assert main(["logs", job.name, "0", *flags]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[-2].startswith("speedrun: rank 0: training failed: a collective failed: rank 1 "), lines[-3:]
        assert "probably died" in lines[-2] and "Traceback" not in "\n".join(lines)
        assert lines[-1].startswith("torchrun: local rank 0 (pid ") and lines[-1].endswith("/log"), lines[-1]
    assert main(["logs", job.name, "1"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("torchrun: local rank 0 (pid ")
    assert main(["logs", job.name, "0", "--raw"]) == 0  # the log keeps it all
    assert "ChildFailedError" in capsys.readouterr().out
    assert main(["ls", job.name]) == 0
    (why,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(f"  {job.name}: ")]
    assert "task 0 failed (exit 1): speedrun: rank 0: training failed: a collective failed: rank 1" in why, why


def test_the_efa_table_refuses_only_types_it_lists_without_efa():
    from speedrun.cluster.aws.config import AWSConfig, has_efa

    assert (has_efa("p5.48xlarge"), has_efa("p5.4xlarge"), has_efa("c5.large"), has_efa("p9.96xlarge")) == \
        (True, True, False, None)
    assert AWSConfig(instance_type="p5.4xlarge", efa="on").efa == "on"  # a small size with EFA
