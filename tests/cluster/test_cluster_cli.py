"""`speedrun launch | ls | logs | kill` from the command line (in this process: same code, no startup)."""
from __future__ import annotations

import pytest

from cli_run import speedrun
from speedrun.cli import main


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


def test_a_refused_host_is_one_line_and_exit_status_2(netns, shared_dir, capsys):
    # options after the job name, before `--`, are understood too
    code = main(["launch", "refused-cli", "--hosts", f"root@{netns.hosts[1].address}:2222",
                 "--identity", str(netns.client_key), "--known-hosts", str(netns.known_hosts),
                 "--run-root", str(shared_dir), "--", "train.py"])
    assert code == 2
    assert "connection refused" in error_line(capsys)


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
])
def test_bad_input_is_one_line_and_exit_status_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in error_line(capsys)


@pytest.mark.parametrize("flags,message", [
    (["--watcher-host", "root@ctl"], "--watcher-host needs --recover (it says where the recovering watcher runs)"),
    (["--recover", "--watcher-host", "root@ctl"],
     "the local provider's machines cannot be watched from another host: --watcher-host needs --provider ssh or aws"),
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


def test_ls_reads_a_failed_log_with_carriage_returns_as_log_lines(local_job):
    # A progress bar redraws with '\r': what follows one is still the log's, never a field of
    # the status (`now=` here, which ls reads as a number).
    job = local_job()
    job[0].run("printf 'epoch 1/2 [###   ]\\rnow=soon\\nboom: the reason\\n'; exit 1", name="train", check=False)
    r = speedrun("ls", job.name)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1].split()[:5] == [job.name, "0", "local", "failed", "(1)"]
    assert f"{job.name} task 0" not in r.stdout  # reachable: no error line
