"""The local provider: tasks are tmux sessions on this machine (real tmux)."""
from __future__ import annotations

import ctypes
import io
import os
import shlex
import subprocess
import threading
from pathlib import Path

import pytest

from speedrun.cluster import CommandFailed, SSHOptions, make_job
from speedrun.cluster.tmux_job import COUNT_GPUS
from cli_run import in_terminal, terminal_exit, wait_for
from speedrun.errors import SpeedrunError

pytestmark = pytest.mark.slow  # real tmux sessions and processes


def running(pid: int) -> bool:
    """Whether the process runs (an exited one waiting to be reaped does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def tmux(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tmux", "-L", "speedrun", *args], capture_output=True, text=True)


def test_run_returns_exit_status_and_output(local_job):
    job = local_job()
    r = job[0].run("echo out; echo err >&2; exit 0")
    assert r.status == 0 and r.ok
    assert r.output == "out\nerr\n"
    assert Path(r.log).read_text() == "out\nerr\n"
    assert r.log.startswith(f"{job.run_dir}/task-0/cmds/")
    r = job[0].run("echo partial; exit 7", check=False)
    assert (r.status, r.output) == (7, "partial\n")


def test_failure_raises_with_the_end_of_the_log(local_job):
    job = local_job()
    with pytest.raises(CommandFailed) as e:
        job[0].run("for i in 1 2 3 4 5; do echo line$i; done; exit 3")
    msg = str(e.value)
    assert "exit status 3" in msg and "line3 | line4 | line5" in msg and "line1" not in msg
    assert "\n" not in msg  # one line
    assert e.value.status == "3" and e.value.output.startswith("line1")


def test_any_shell_text_runs_verbatim(local_job):
    job = local_job()
    text = r'''echo "double 'single' quotes" 'single "double" quotes'
echo a # this is a comment, not an argument
echo "a # inside quotes is kept"
(echo from-background > bg.txt) & wait $!
cat bg.txt
cat <<'EOF'
heredoc line with $HOME kept literally & a # too
EOF
x=$(printf '%s' "back\\slash"); echo "$x"
echo tab:$'\t':end
'''
    r = job[0].run(text)
    assert r.output.splitlines() == [
        "double 'single' quotes single \"double\" quotes",
        "a",
        "a # inside quotes is kept",
        "from-background",
        "heredoc line with $HOME kept literally & a # too",
        "back\\slash",
        "tab:\t:end",
    ]
    # the command was stored as given
    cmd_dir = Path(r.log).parent
    assert (cmd_dir / "command.sh").read_text() == text
    assert (cmd_dir / "status").read_text().strip() == "0"


def test_argv_is_quoted(local_job):
    job = local_job()
    r = job[0].run(["printf", "%s|", "a b", "it's", "#x", "&"])
    assert r.output == "a b|it's|#x|&|"


def test_each_command_gets_a_named_window_and_the_session_survives(local_job):
    job = local_job()
    c = job[0].run("echo started; while [ ! -e go ]; do sleep 0.05; done; echo finished", background=True,
                   name="worker")
    windows = tmux("list-windows", "-t", f"={job[0].session}", "-F", "#{window_name}").stdout.split()
    assert windows == ["shell", "worker"]
    assert c.state() == "running"
    job[0].write("go", "")
    r = c.wait(timeout=30)
    assert (r.status, r.output) == (0, "started\nfinished\n")
    assert c.state() == "0"
    # foreground commands' windows close when they end; the session stays
    job[0].run("true")
    assert tmux("has-session", "-t", f"={job[0].session}").returncode == 0


def test_a_busy_window_name_is_refused(local_job):
    job = local_job()
    job[0].run("sleep 300", background=True, name="busy")
    with pytest.raises(SpeedrunError, match="still running"):
        job[0].run("true", background=True, name="busy")


def test_kill_a_background_command(local_job):
    job = local_job()
    c = job[0].run("echo $$ > pid.txt; sleep 300", background=True, name="sleeper")
    wait_for(lambda: job[0].exists("pid.txt") and job[0].read("pid.txt").strip(), 30, "the command's pid")
    pid = int(job[0].read("pid.txt"))
    c.kill()
    assert c.state() == "killed"
    with pytest.raises(CommandFailed, match="was killed"):
        c.wait()
    assert running(os.getpid()) and not running(pid)  # kill() returns once the command's processes are gone


def test_kill_stops_what_the_command_started_in_sessions_of_their_own(local_job):
    # torchrun starts each worker in a session of its own: signalling the command's process group
    # misses them, and a worker left behind holds the run directory (and a GPU) from the next run.
    # One child takes SIGHUP as it comes; the other ignores it, as a process stuck in a collective
    # does in effect, and is killed after the grace period.
    job = local_job()
    child = ("import os, signal, sys, time; signal.signal(signal.SIGHUP, signal.SIG_IGN if sys.argv[1] == 'deaf' "
             "else signal.SIG_DFL); open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(300)")
    spawn = (f"import subprocess, sys; "
             f"subprocess.Popen([sys.executable, '-c', {child!r}, sys.argv[1]], start_new_session=True).wait()")
    c = job[0].run(f"python3 -c {shlex.quote(spawn)} plain & python3 -c {shlex.quote(spawn)} deaf & wait",
                   background=True, name="workers")
    wait_for(lambda: all(job[0].exists(f) and job[0].read(f).strip() for f in ("plain", "deaf")), 30, "the children")
    children = [int(job[0].read(f)) for f in ("plain", "deaf")]
    assert all(running(p) for p in children)
    c.kill()
    assert c.state() == "killed"
    assert [running(p) for p in children] == [False, False]


def test_job_run_on_all_tasks(local_job):
    job = local_job(num_tasks=3)
    results = job.run('echo "task $SPEEDRUN_X $(basename "$PWD")"', env={"SPEEDRUN_X": "x"})
    assert [r.output for r in results] == [f"task x task-{i}\n" for i in range(3)]
    assert len({t.session for t in job}) == 3


def test_files_upload_download_read_write_exists(local_job, tmp_path):
    job = local_job()
    t = job[0]
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("A")
    (src / "sub" / "b.bin").write_bytes(bytes(range(256)))
    dest = t.upload(src, "copy")
    assert dest == f"{t.cwd}/copy"
    assert t.read("copy/a.txt") == "A"
    t.write("made/here.bin", b"\x00\x01binary\xff")
    assert t.exists("made/here.bin") and not t.exists("made/nothing")
    got = t.download("made/here.bin", tmp_path / "back.bin")
    assert got.read_bytes() == b"\x00\x01binary\xff"
    t.download("copy", tmp_path / "back")
    assert (tmp_path / "back" / "sub" / "b.bin").read_bytes() == bytes(range(256))
    with pytest.raises(SpeedrunError, match="cannot read"):
        t.read("made/nothing")


def test_relaunch_reconnects_to_a_running_job_and_restart_replaces_it(local_job, tmp_path):
    gate = tmp_path / "gate"
    job = local_job()
    first = job[0].run(f"while [ ! -e {gate} ]; do sleep 0.05; done; echo done", background=True, name="train")
    again = local_job()
    assert again.reconnected and again.run_dir == job.run_dir
    assert first.state() == "running"  # not killed
    same = again[0].command("train")
    assert same.dir == first.dir and same.state() == "running"
    # a command started after reconnecting does not clash with the earlier ones
    r = again[0].run("echo next")
    assert Path(r.log).parent.name > Path(first.dir).name

    replaced = local_job(restart=True)
    assert not replaced.reconnected and replaced.run_dir != job.run_dir
    assert first.state() == "killed"
    assert Path(job.run_dir, "task-0").is_dir()  # the old run's logs stay


def test_sessions_are_replaced_without_a_hitch(local_job):
    # A new run replaces the sessions of a finished one. Were they killed before the new ones were
    # made, the tmux server could be left empty and exit, and a client reaching it meanwhile fails
    # ("server exited unexpectedly"). Likewise right after a job was killed.
    for i in range(12):
        job = local_job(num_tasks=2)
        assert [r.output for r in job.run("echo up")] == ["up\n", "up\n"]
        assert not job.reconnected and job.run_dir.endswith(f"run.{i + 1:02d}")
    job.kill()
    assert local_job(num_tasks=2)[1].run("echo up").output == "up\n"


def test_a_finished_job_gets_a_new_run_directory(local_job):
    job = local_job()
    job[0].run("echo one", name="train")
    second = local_job()
    assert not second.reconnected
    assert job.run_dir.endswith("/run.01") and second.run_dir.endswith("/run.02")
    assert Path(second.run_dir).parent == Path(job.run_dir).parent


def ending(command) -> None:
    """Hold `command` where its wrapper has written its exit status but tmux still shows its window
    alive: the moment between the wrapper's last write and tmux closing the window, which a busy
    machine stretches. (The command itself keeps running, so the moment lasts.)"""
    Path(command.dir, "status").write_text("0\n")


def test_a_finished_job_whose_window_is_still_closing_gets_a_new_run(local_job):
    # A command has ended once its status is written; were its window, still open for a moment,
    # taken for a running command, the next make_job would reconnect to the finished run (run.01
    # again), and a launch there would write over its results.
    job = local_job()
    ending(job[0].run("sleep 300", background=True, name="train"))
    second = local_job()
    assert not second.reconnected
    assert job.run_dir.endswith("/run.01") and second.run_dir.endswith("/run.02")


def test_setup_runs_once_per_host_and_again_when_it_changes(local_job, tmp_path):
    counter = tmp_path / "setup-ran"
    setup = f"echo ran >> {counter}\n"
    local_job(num_tasks=2, setup=setup)
    assert counter.read_text() == "ran\n"  # one host (this machine) for both tasks: once
    local_job(num_tasks=2, setup=setup)
    assert counter.read_text() == "ran\n"  # unchanged: not again
    local_job(num_tasks=2, setup=setup + "# changed\n")
    assert counter.read_text() == "ran\nran\n"


def test_failed_setup_is_reported_and_run_again(local_job, tmp_path):
    with pytest.raises(CommandFailed, match="setup on local failed with exit status 5.*no network"):
        local_job(setup="echo no network; exit 5")
    counter = tmp_path / "n"
    with pytest.raises(CommandFailed):
        local_job(setup=f"echo x >> {counter}; exit 1")
    with pytest.raises(CommandFailed):
        local_job(setup=f"echo x >> {counter}; exit 1")
    assert counter.read_text() == "x\nx\n"  # a failed setup is not marked as done


def test_a_failed_setup_is_reported_while_the_last_setup_window_closes(local_job):
    # The setup window of the run before has ended but is still open: the new run must run its
    # own setup (and report its failure), not reconnect to the old run.
    job = local_job()
    ending(job[0].run("sleep 300", background=True, name="setup"))
    with pytest.raises(CommandFailed, match="setup on local failed with exit status 5.*no network"):
        local_job(setup="echo no network; exit 5")


def test_sync_copies_the_tree_without_git_data_and_runs(local_job, tmp_path):
    tree = tmp_path / "tree"
    for rel in ("train.py", "pkg/mod.py", ".git/HEAD", "data/big.bin", "runs/old/log", "pkg/__pycache__/x.pyc"):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(rel)
    job = local_job(sync=tree)
    r = job[0].run("find . -type f | sort")
    assert r.output.split() == ["./pkg/mod.py", "./train.py"]
    assert job[0].cwd == str(tmp_path / "host" / "code" / job.name)
    # a new run mirrors the tree again: deleted files go, new ones come
    (tree / "train.py").unlink()
    (tree / "new.py").write_text("new")
    job2 = local_job(sync=tree)
    assert job2[0].run("find . -type f | sort").output.split() == ["./new.py", "./pkg/mod.py"]


def test_sync_keeps_what_the_setup_made_when_the_setup_is_skipped(local_job, tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "train.py").write_text("train")
    (tree / "old.py").write_text("old")
    setup = "echo built > built.txt\n"  # runs in the synced code directory, once
    job = local_job(sync=tree, setup=setup)
    assert job[0].run("cat built.txt").output == "built\n"
    (tree / "old.py").unlink()
    job2 = local_job(sync=tree, setup=setup)  # a new run: synced again, setup unchanged so skipped
    assert job2[0].run("find . -type f | sort").output.split() == ["./built.txt", "./train.py"]


def test_status_logs_and_kill(local_job, tmp_path):
    job = local_job(num_tasks=2)
    assert [s.state for s in job.status()] == ["idle", "idle"]
    for t in job:
        t.run(f"echo hello from {t.index}; exit {t.index}", name="train", check=False)
    states = job.status()
    assert [s.state for s in states] == ["succeeded", "failed (1)"]
    assert all(s.uptime_s is not None and s.uptime_s >= 0 for s in states)
    out = io.StringIO()
    job.logs(out=out)
    assert sorted(out.getvalue().splitlines()) == ["[0] hello from 0", "[1] hello from 1"]
    out = io.StringIO()
    job.logs(follow=True, out=out, tasks=[1])
    assert out.getvalue() == "hello from 1\n"
    job.kill()
    assert [s.state for s in job.status()] == ["succeeded", "failed (1)"]  # results outlive the sessions
    after = job.status("nothing")
    assert [s.state for s in after] == ["stopped", "stopped"] and all(s.uptime_s is None for s in after)


def test_logs_follow_streams_until_the_command_ends(local_job, tmp_path):
    job = local_job()
    gate = tmp_path / "gate"
    job[0].run(f"echo first; while [ ! -e {gate} ]; do sleep 0.05; done; echo last", background=True, name="train")
    wait_for(lambda: "first" in job[0].command("train").output(), 30, "the first line")
    out = io.StringIO()
    follower = threading.Thread(target=job.logs, kwargs=dict(follow=True, out=out))
    follower.start()
    wait_for(lambda: "first" in out.getvalue(), 30, "the follower to print the first line")
    assert follower.is_alive()  # still following: the command has not ended
    gate.touch()
    follower.join(timeout=60)
    assert not follower.is_alive()
    assert out.getvalue() == "first\nlast\n"


def attached_window(task, window: str | None) -> str:
    """Attach to the task in a terminal of its own, as a person at a keyboard would; the window the
    client lands in (then it detaches)."""
    pid, fd = in_terminal(task.attach_argv(window))
    try:
        clients = wait_for(lambda: tmux("list-clients", "-t", f"={task.session}",
                                          "-F", "#{client_session} #{window_name}").stdout.split(), 30,
                             "the attached client")
        tmux("detach-client", "-s", f"={task.session}")
        assert terminal_exit(pid, fd) == 0
        assert clients[0] == task.session
        return clients[1]
    finally:
        os.close(fd)


def test_attach_joins_the_session_in_a_terminal(local_job):
    job = local_job()
    job[0].run("sleep 300", background=True, name="train")
    job[0].run("sleep 300", background=True, name="other")
    assert attached_window(job[0], "train") == "train"


def test_attach_lands_in_the_newest_commands_window_not_the_idle_shell(local_job):
    job = local_job()
    job[0].run("sleep 300", background=True, name="setup")
    job[0].run("sleep 300", background=True, name="train")
    assert attached_window(job[0], None) == "train"


def test_bad_input_is_a_one_line_error(local_job, tmp_path):
    with pytest.raises(SpeedrunError, match="bad job name"):
        make_job("no spaces", run_root=str(tmp_path))
    with pytest.raises(SpeedrunError, match="at least one task"):
        make_job("x", 0, run_root=str(tmp_path))
    with pytest.raises(SpeedrunError, match="unknown provider"):
        make_job("x", provider="nope")
    with pytest.raises(SpeedrunError, match="hosts were given"):
        make_job("x", hosts=["a"])
    with pytest.raises(SpeedrunError, match="sync directory"):
        make_job("x", sync=tmp_path / "missing")
    # Each option is said to belong where it does: never "does not apply to the ssh provider" for
    # an ssh option.
    key = tmp_path / "key"
    key.write_text("")
    ssh_hosts = dict(provider="ssh", hosts=["root@gpu1"])  # refused before any host is contacted
    with pytest.raises(SpeedrunError, match=r"^identity_file does not apply to the local provider: it is an "
                                            r"option of provider='ssh'"):
        make_job("x", identity_file=key)
    with pytest.raises(SpeedrunError, match=r"^identity_file was given twice, as identity_file= and in ssh=SSHOptions"):
        make_job("x", ssh=SSHOptions(identity_file=key), identity_file=key, **ssh_hosts)
    with pytest.raises(SpeedrunError, match=r"^instance_type does not apply to the ssh provider: it is an option "
                                            r"of provider='aws'"):
        make_job("x", instance_type="p5.48xlarge", **ssh_hosts)
    with pytest.raises(SpeedrunError, match=r"^unknown option identity for the ssh provider \(its options: "
                                            r"known_hosts, identity_file, ssh_config, accept_new_host_keys"):
        make_job("x", identity=key, **ssh_hosts)
    job = local_job()
    with pytest.raises(SpeedrunError, match="bad command name"):
        job[0].run("true", name="has space")


def test_a_host_without_gpus_runs_one_process_per_task_and_is_asked_without_importing_torch(local_job):
    # `speedrun check`'s processes per task: torch sees no GPU without libcuda (NVIDIA) or /dev/kfd
    # (AMD), and then the question costs no import of torch (2-3 CPU s on the host).
    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("this machine has NVIDIA's driver")
    except OSError:
        pass
    if os.path.exists("/dev/kfd"):
        pytest.skip("this machine has AMD's driver")
    job = local_job()
    assert job.devices_per_task() == 1
    r = subprocess.run([job.python, "-X", "importtime", "-c", COUNT_GPUS], capture_output=True, text=True)
    assert r.stdout == "0\n" and r.returncode == 0
    assert not [ln for ln in r.stderr.splitlines() if ln.rstrip().endswith("| torch")]
