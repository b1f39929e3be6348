"""The ssh provider against real sshd servers in network namespaces (tests/netns.py)."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from speedrun.cluster import CommandFailed, make_job
from speedrun.cluster.ssh import SSHHost, SSHOptions
from cli_run import wait_for
from speedrun.errors import SpeedrunError

pytestmark = pytest.mark.netns


def test_each_host_is_its_own_machine(ssh_job, netns):
    job = ssh_job()
    assert [t.ip for t in job] == [h.address for h in netns.hosts]
    results = job.run("echo $HOME; hostname -I")
    for r, h in zip(results, netns.hosts):
        home, addresses = r.output.splitlines()
        assert home == str(h.home) and addresses.split() == [h.address]
    # both tasks write in the one run directory on the shared storage
    for i, r in enumerate(results):
        assert r.log.startswith(f"{job.run_dir}/task-{i}/cmds/") and Path(r.log).read_text() == r.output


def test_exit_status_output_and_shell_text_over_ssh(ssh_job):
    job = ssh_job(num_tasks=1)
    text = """echo "it's \\"quoted\\"" # a comment
(sleep 0.01; echo amp) & wait
cat <<'EOF'
$NOT_EXPANDED & # kept
EOF
exit 4"""
    r = job[0].run(text, check=False)
    assert r.status == 4
    assert r.output.splitlines() == ["it's \"quoted\"", "amp", "$NOT_EXPANDED & # kept"]
    with pytest.raises(CommandFailed, match=r"exit status 4 .*amp \| \$NOT_EXPANDED & # kept"):
        job[0].run(text)


def test_a_mirror_deletes_what_it_put_there_before_and_nothing_else(ssh_job, tmp_path):
    t = ssh_job(num_tasks=1)[0]
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    for rel in ("keep.py", "pkg/gone.py", "pkg/stays.py", "name with space.py"):
        (src / rel).write_text(rel)
    for use_rsync in (True, False):  # rsync over ssh, and tar through ssh for hosts without rsync
        t.host._rsync = use_rsync
        dest = t.path(f"mirror-{use_rsync}")
        t.host.put(src, dest, mirror=True)
        t.run(f"echo made > '{dest}/pkg/made-there.txt'")  # as a setup script would
        (src / "pkg" / "gone.py").unlink()
        (src / "name with space.py").unlink()
        t.host.put(src, dest, mirror=True)
        found = t.run(f"cd '{dest}' && find . -type f | sort").output.split("\n")
        assert found == ["./keep.py", "./pkg/made-there.txt", "./pkg/stays.py", ""]
        for rel in ("pkg/gone.py", "name with space.py"):
            (src / rel).write_text(rel)
    t.host._rsync = None


def test_upload_and_download(ssh_job, tmp_path):
    job = ssh_job(num_tasks=1)
    t = job[0]
    src = tmp_path / "src"
    (src / "deep" / "er").mkdir(parents=True)
    (src / "deep" / "er" / "f.bin").write_bytes(bytes(range(256)) * 10)
    (src / "name with space.txt").write_text("spaced")
    for use_rsync in (True, False):  # rsync over ssh, and tar through ssh for hosts without rsync
        t.host._rsync = use_rsync
        dest = f"up-{use_rsync}"
        t.upload(src, dest)
        assert t.read(f"{dest}/name with space.txt") == "spaced"
        t.upload(src / "deep" / "er" / "f.bin", f"single-{use_rsync}/f.bin")
        back = tmp_path / f"back-{use_rsync}"
        t.download(dest, back)
        assert (back / "deep" / "er" / "f.bin").read_bytes() == bytes(range(256)) * 10
        t.download(f"single-{use_rsync}/f.bin", tmp_path / f"f-{use_rsync}.bin")
        assert (tmp_path / f"f-{use_rsync}.bin").read_bytes() == bytes(range(256)) * 10
    t.host._rsync = None
    with pytest.raises(SpeedrunError, match="does not exist"):
        t.upload(tmp_path / "missing")


def test_reconnect_does_not_kill_a_running_job(ssh_job, shared_dir, job_name):
    gate = shared_dir / f"{job_name}.gate"
    job = ssh_job()
    first = job.run(f"while [ ! -e {gate} ]; do sleep 0.05; done; echo released", background=True, name="train")
    again = ssh_job()
    assert again.reconnected and again.run_dir == job.run_dir
    assert [c.state() for c in first] == ["running", "running"]
    assert [c.dir for c in again.commands("train")] == [c.dir for c in first]
    gate.touch()
    assert [r.output for r in again.wait()] == ["released\n", "released\n"]


def test_setup_runs_once_on_each_host(ssh_job, netns, shared_dir, job_name):
    log = shared_dir / f"{job_name}.setup-log"
    setup = f'echo "$(hostname -I)" >> {log}\n'
    ssh_job(setup=setup)
    assert sorted(log.read_text().split()) == sorted(h.address for h in netns.hosts)
    ssh_job(setup=setup)
    assert len(log.read_text().split()) == 2  # unchanged: not run again
    ssh_job(setup=setup + "true\n")
    assert len(log.read_text().split()) == 4  # changed: run again on both


def test_sync_to_every_host(ssh_job, tmp_path):
    tree = tmp_path / "tree"
    (tree / ".git").mkdir(parents=True)
    (tree / ".git" / "config").write_text("x")
    (tree / "train.py").write_text("print('hi')")
    job = ssh_job(sync=tree)
    results = job.run("pwd; ls -A")
    for t, r in zip(job, results):
        cwd, *files = r.output.split()
        assert cwd == f"{t.home}/.speedrun/code/{job.name}" and files == ["train.py"]


def test_a_host_refusing_connections_is_a_clear_error(netns, shared_dir):
    with pytest.raises(SpeedrunError) as e:
        make_job("refused", 1, provider="ssh", hosts=[f"root@{netns.hosts[0].address}:2222"],
                 ssh=SSHOptions(known_hosts=netns.known_hosts, identity_file=netns.client_key),
                 run_root=str(shared_dir))
    msg = str(e.value)
    assert "connection refused" in msg and f"{netns.hosts[0].address}:2222" in msg and "\n" not in msg


def test_ssh_options_as_keywords_of_make_job_are_used(netns, shared_dir, job_name):
    # The form of earlier releases, still in many scripts: the options as make_job's own keywords.
    job = make_job(job_name, 2, provider="ssh", hosts=netns.specs, identity_file=str(netns.client_key),
                   known_hosts=netns.known_hosts, run_root=str(shared_dir / "runs"))
    try:
        assert [r.output for r in job.run("echo up")] == ["up\n", "up\n"]
        assert job.provider.record()["identity_file"] == str(netns.client_key.resolve())
        assert job.provider.record()["known_hosts"] == str(netns.known_hosts.resolve())
    finally:
        job.kill()
        job.close()


def test_an_unknown_host_key_is_refused_unless_asked(netns, shared_dir, tmp_path):
    pinned = tmp_path / "known_hosts"  # empty: nothing known
    strict = SSHOptions(known_hosts=pinned, identity_file=netns.client_key)
    kwargs = dict(provider="ssh", hosts=[netns.specs[1]], run_root=str(shared_dir))
    with pytest.raises(SpeedrunError, match="host key of .* is not known .*--accept-new-host-keys"):
        make_job("unknown-key", 1, ssh=strict, **kwargs)
    assert pinned.read_text() == ""
    job = make_job("unknown-key", 1, ssh=dataclasses.replace(strict, accept_new_host_keys=True), **kwargs)
    assert job[0].run("echo in").output == "in\n"
    assert pinned.read_text() == netns.hosts[1].known_hosts_line()  # pinned in speedrun's file
    job.kill()
    job.close()
    job = make_job("unknown-key", 1, ssh=strict, **kwargs)  # strict again: the pinned key is enough
    assert job[0].run("echo again").output == "again\n"
    job.kill()
    job.close()


def test_keys_pinned_in_the_users_own_known_hosts_file_count_as_known(netns, shared_dir, tmp_path):
    # The user's ssh config names their own known_hosts file, which already holds the host's key;
    # speedrun's file is empty and host keys are checked strictly: the host is known, not refused.
    users_file = tmp_path / "users_known_hosts"
    users_file.write_text(netns.hosts[0].known_hosts_line())
    config = tmp_path / "ssh_config"
    config.write_text(f"Host *\n  UserKnownHostsFile {users_file}\n")
    speedruns_file = tmp_path / "speedrun_known_hosts"
    job = make_job("users-known-hosts", 1, provider="ssh", hosts=[netns.specs[0]], run_root=str(shared_dir),
                   ssh=SSHOptions(known_hosts=speedruns_file, identity_file=netns.client_key, ssh_config=config))
    assert job[0].run("echo known").output == "known\n"
    assert speedruns_file.read_text() == ""  # nothing had to be learned
    job.kill()
    job.close()


def test_a_changed_host_key_is_refused_even_when_accepting_new_ones(netns, shared_dir, tmp_path):
    wrong = tmp_path / "known_hosts"
    h0, h1 = netns.hosts
    wrong.write_text(f"{h0.address} {h1.host_public_key}\n")  # another host's key under h0's name
    with pytest.raises(SpeedrunError, match="differs from the one pinned"):
        make_job("changed-key", 1, provider="ssh", hosts=[h0.spec], run_root=str(shared_dir),
                 ssh=SSHOptions(known_hosts=wrong, identity_file=netns.client_key, accept_new_host_keys=True))


def test_a_dead_master_connection_is_replaced(ssh_job, netns):
    job = ssh_job(num_tasks=1)
    host = job[0].host

    def master_pid() -> int:
        r = subprocess.run(["ssh", *host.ssh_options(), "-O", "check", host.spec.destination],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return int(r.stderr.split("pid=")[1].split(")")[0])

    old = master_pid()
    subprocess.run(["kill", "-KILL", str(old)], check=True)
    assert host.control_path.exists()  # the dead master's socket is left behind
    again = ssh_job(num_tasks=1)  # a new process would start like this: it must notice
    assert again[0].run("echo ok").output == "ok\n"
    assert master_pid() != old


def test_ssh_command_lines_check_host_keys_strictly(netns, tmp_path):
    host = SSHHost(netns.specs[0], SSHOptions(known_hosts=tmp_path / "kh"))
    opts = " ".join(host.ssh_options())
    assert "StrictHostKeyChecking=yes" in opts and "BatchMode=yes" in opts
    assert "StrictHostKeyChecking=no" not in opts and "/dev/null" not in opts
    host = SSHHost(netns.specs[0], SSHOptions(known_hosts=tmp_path / "kh", accept_new_host_keys=True))
    assert "StrictHostKeyChecking=accept-new" in host.ssh_options()


def test_logs_follow_over_ssh(ssh_job):
    job = ssh_job()
    job.run("for i in 1 2 3; do echo line$i; done", background=True, name="train")
    out = io.StringIO()
    job.logs(follow=True, out=out)
    assert sorted(out.getvalue().splitlines()) == sorted(f"[{t}] line{i}" for t in (0, 1) for i in (1, 2, 3))


@pytest.mark.slow
def test_tensorboard_is_bound_to_localhost_and_forwarded(ssh_job, netns):
    job = ssh_job()
    job[0].write(f"{job.run_dir}/tb/placeholder.txt", "")
    tb = job.tensorboard()
    try:
        assert tb.url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(tb.url, timeout=30) as page:
            assert page.status == 200 and b"TensorBoard" in page.read()
        # on the host it listens on 127.0.0.1 only: its network address gets nothing
        remote_port = int(job[0].read(f"{tb.command.dir}/command.sh").split("--port ")[1].split()[0])
        listening = netns.hosts[0].exec(["ss", "-Hltn", f"sport = :{remote_port}"], capture_output=True,
                                        text=True).stdout
        assert listening.split()[3] == f"127.0.0.1:{remote_port}"
    finally:
        tb.close()
    wait_for(lambda: tb.tunnel.poll() is not None, 30, "the tunnel to close")
    assert tb.command.state() == "killed"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_speedrun_tb_ended_by_a_signal_stops_tensorboard_on_the_host(ssh_job, sig):
    job = ssh_job(num_tasks=1)
    job[0].write(f"{job.run_dir}/tb/placeholder.txt", "")
    tb = subprocess.Popen([sys.executable, "-m", "speedrun", "tb", job.name], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    try:
        line = tb.stdout.readline()
        assert line.startswith(f"TensorBoard for {job.name}: http://127.0.0.1:"), tb.stderr.read()
        tb.send_signal(sig)
        assert tb.wait(timeout=60) == 0  # as after Ctrl-C
    finally:
        tb.kill()
    command = job[0].command("tensorboard")
    assert command is not None and command.state() == "killed"


def test_a_partitioned_host_is_reported_while_the_reachable_one_is_served(ssh_job, netns, capsys):
    from speedrun.cli import main
    job = ssh_job()
    job.run("echo started; sleep 300", background=True, name="train")
    # The network to host 1 goes silent (its link down): packets are dropped, nothing is refused.
    netns.hosts[1].exec(["ip", "link", "set", "eth0", "down"], check=True)
    try:
        capsys.readouterr()
        assert main(["ls", job.name]) == 0
        out = capsys.readouterr().out.splitlines()
        assert [ln.split()[3] for ln in out[1:3]] == ["running", "unreachable"]
        assert out[3].startswith(f"  {job.name} task 1: ") and "no answer within 5 s" in out[3]

        assert main(["logs", job.name]) == 3  # the reachable task's log, and the lost host named
        captured = capsys.readouterr()
        assert "[0] started" in captured.out and "unreachable" not in captured.out
        assert captured.err.startswith(f"speedrun: task 1 ({netns.specs[1]}) is unreachable: ")

        assert main(["kill", job.name]) == 3  # a lost host, as for logs: not the user's bad input
        captured = capsys.readouterr()
        assert "killed job" in captured.out and "(1 of 2 task(s))" in captured.out
        assert f"task 1 ({netns.specs[1]}) is unreachable" in captured.err
        assert job[0].command("train").state() == "killed"  # the reachable task was killed all the same
    finally:
        netns.hosts[1].exec(["ip", "link", "set", "eth0", "up"], check=True)


def sshd_sessions(host) -> list[int]:
    """The sshd processes serving connections on a namespace host (not its listening sshd)."""
    out = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True, text=True).stdout
    found = []
    for pid in map(int, out.split()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # it ended since
            continue
        if argv.startswith(b"sshd") and pid != host.sshd.pid:
            found.append(pid)
    return found


def test_a_master_connection_that_stopped_answering_is_replaced_at_once(ssh_job, netns, capsys):
    from speedrun.cli import main
    job = ssh_job()
    job.run("sleep 300", background=True, name="train")
    # The state a link that went down and came back leaves behind (TCP backing off its
    # retransmissions for many seconds): the master here runs and its socket answers, but its
    # connection to the host carries nothing, while a new connection would. Here the host's sshd
    # serving the master is stopped (the host and its listening sshd are fine).
    sessions = sshd_sessions(netns.hosts[1])
    assert sessions
    for pid in sessions:
        os.kill(pid, signal.SIGSTOP)
    try:
        capsys.readouterr()
        assert main(["kill", job.name]) == 0  # at once: not "unreachable" until the old connection recovers
        assert "(2 of 2 task(s))" in capsys.readouterr().out
        assert job[1].command("train").state() == "killed"
    finally:
        for pid in sessions:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
