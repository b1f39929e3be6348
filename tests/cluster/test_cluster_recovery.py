"""Recovery for real: a 2-host gloo job on network-namespace hosts, with a third host as spare;
one host is killed mid-run (its sshd and every process in it gone, its network removed) and the
job carries on on the spare without a person (speedrun.cluster.recovery)."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from cli_run import wait_for
from netns import NetnsCluster, require
from speedrun.cluster import SSHOptions, make_job
from speedrun.cluster.recovery import watch
from speedrun.track import read_jsonl
from test_cluster_e2e import ONE_THREAD, TRAIN

pytestmark = [pytest.mark.netns, pytest.mark.slow]
EPOCHS = 4  # the tiny recipe's own: the host is lost after the first epoch's checkpoint, with three to train


def start_watch(job, max_restarts: int = 3, recover_wait_s: float = 3600.0) -> tuple[threading.Thread, dict]:
    """recovery.watch(job) on a thread of its own, as `speedrun launch --recover` runs it; the
    dict gets its "states" or its "error"."""
    outcome: dict = {}

    def watcher() -> None:
        try:
            outcome["states"] = watch(job, every_s=0.5, max_restarts=max_restarts, recover_wait_s=recover_wait_s)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            outcome["error"] = e
    thread = threading.Thread(target=watcher)
    thread.start()
    return thread, outcome


@pytest.fixture
def three_hosts():
    require("the recovery tests")
    with NetnsCluster(3) as cluster:
        yield cluster


def test_a_lost_host_is_replaced_by_the_spare_and_the_run_finishes(three_hosts, tmp_path, job_name):
    ssh = SSHOptions(known_hosts=three_hosts.known_hosts, identity_file=three_hosts.client_key)
    train = [*TRAIN, "--epochs", str(EPOCHS)]
    runs = str(tmp_path / "runs")
    base = make_job(f"{job_name}-base", 2, provider="ssh", hosts=three_hosts.specs[:2], ssh=ssh, run_root=runs)
    base.launch([*train, "--out", base.run_dir], env=ONE_THREAD)
    assert [r.status for r in base.wait(timeout=600)] == [0, 0]
    base.kill()

    lost, spare = three_hosts.hosts[1], three_hosts.hosts[2]
    job = make_job(job_name, 2, provider="ssh", hosts=three_hosts.specs, ssh=ssh, run_root=runs)  # the 3rd: spare
    job.launch([*train, "--out", job.run_dir], env=ONE_THREAD)
    thread, outcome = start_watch(job, max_restarts=0)  # a lost machine is no failure of the command
    wait_for(lambda: Path(job.run_dir, "checkpoint.pt").exists(), 300, "the first checkpoint")
    three_hosts.remove_host(lost)  # the machine is gone: sshd, the training process, its network
    thread.join(timeout=900)
    try:
        assert not thread.is_alive() and "error" not in outcome, outcome
        assert [s.state for s in outcome["states"]] == ["succeeded", "succeeded"]
        assert job[1].host.name == spare.spec
        (event,) = read_jsonl(Path(job.run_dir) / "recoveries.jsonl")
        assert event["replaced"] == {"1": [lost.spec, spare.spec]} and event["resumed"]
        assert event["kind"] == "lost_host"
        assert "task 1" in event["reason"] and "unreachable" in event["reason"]

        results = [json.loads(Path(d, "results.json").read_text()) for d in (base.run_dir, job.run_dir)]
        assert results[1]["status"] == "finished" and results[1]["epochs_run"] == EPOCHS
        assert len(results[1]["recoveries"]) == 1
        (lost,) = results[1]["interruptions"]  # the steps after the checkpoint, trained again, and the gap
        assert lost["last_step_logged"] >= lost["resumed_at_step"] and lost["wall_s_lost"] > 0
        assert results[1]["lost_s"] == lost["wall_s_lost"] and results[1]["lost_usd"] is None  # own machines: no price
        # Resumed from an epoch's checkpoint with the same data order: the same model, within float noise.
        assert results[1]["final"]["top1"] == pytest.approx(results[0]["final"]["top1"], abs=0.01)
    finally:
        job.kill()
        job.close()


def test_a_host_slow_to_answer_for_a_look_or_two_is_not_lost(netns, ssh_job, shared_dir, caplog):
    """A busy machine may take longer than a look's wait to answer: not a lost one. Task 1's sshd
    (its listener and the session serving the master connection) is frozen for two looks, then
    thawed: no recovery (with no spare host, one would fail), and the job finishes where it ran."""
    import os
    import signal

    from test_cluster_ssh import sshd_sessions

    job = ssh_job()
    go, waits = Path(job.run_dir, "go"), shared_dir / "waits.py"
    waits.write_text(f"import os, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.2)\n")
    job.launch([str(waits)])
    wait_for(lambda: [s.state for s in job.status()] == ["running", "running"], 120, "both tasks running")
    caplog.set_level("INFO", logger="speedrun.cluster")
    thread, outcome = start_watch(job, max_restarts=0, recover_wait_s=1)
    frozen = [netns.hosts[1].sshd.pid, *sshd_sessions(netns.hosts[1])]
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: "(look 2 of 3)" in caplog.text or not thread.is_alive(), 120, "two unanswered looks")
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    go.touch()
    thread.join(timeout=300)
    assert not thread.is_alive() and "error" not in outcome, outcome
    assert [s.state for s in outcome["states"]] == ["succeeded", "succeeded"]
    assert f"task 1 ({netns.specs[1]}) did not answer (look 1 of 3)" in caplog.text
    assert "recovering" not in caplog.text and not Path(job.run_dir, "recoveries.jsonl").exists()


def test_launch_recover_starts_an_ended_job_again_and_gives_up_after_max_restarts(tmp_path, job_name, capsys):
    from speedrun.cli import main
    flaky = tmp_path / "flaky.py"  # fails on its first run, as a job whose rank died would
    flaky.write_text("import pathlib, sys\nmark = pathlib.Path(sys.argv[1]) / 'ran-once'\n"
                     "if not mark.exists():\n    mark.touch()\n    sys.exit(3)\nprint('second run ok')\n")
    common = ["--run-root", str(tmp_path / "runs"), "--recover", "--max-restarts", "1", "--"]
    assert main(["launch", job_name, *common, str(flaky), str(tmp_path)]) == 0
    assert "every task succeeded" in capsys.readouterr().out
    run_dir = next((tmp_path / "runs" / job_name).iterdir())
    (event,) = read_jsonl(run_dir / "recoveries.jsonl")
    assert event["replaced"] == {} and "task 0 (local) failed" in event["reason"] and not event["resumed"]

    broken = tmp_path / "broken.py"
    broken.write_text("raise SystemExit('cannot read /data/x: no such directory')\n")
    assert main(["launch", f"{job_name}-b", *common, str(broken)]) == 2
    # each failure says why, from the task's log
    assert ("gave up after 1 recoveries: task 0 (local) failed (1): cannot read /data/x: no such directory"
            in capsys.readouterr().err)


def test_a_run_stopped_at_a_step_is_resumed_without_counting_as_a_failure(local_job, tmp_path):
    """A run that stopped at a step (results.json says "stopped": a spot notice, a stop request;
    its workers exit 75, torchrun 1) is a preemption: started again with --resume even when no
    failure may be (max_restarts=0)."""
    stopping = tmp_path / "stopping.py"  # stops at a step on its first run, as a spot notice makes it
    stopping.write_text("import json, os, pathlib, sys\n"
                        "results = pathlib.Path(os.environ['SPEEDRUN_RUN_DIR']) / 'results.json'\n"
                        "if not results.exists():\n"
                        "    results.write_text(json.dumps({'status': 'stopped'}))\n    sys.exit(75)\n"
                        "print('resumed' if '--resume' in sys.argv else 'started afresh')\n")
    job = local_job()
    Path(job.run_dir, "checkpoint.pt").write_text("a checkpoint, as the stopped run left one")
    job.launch([str(stopping)])
    thread, outcome = start_watch(job, max_restarts=0)
    thread.join(timeout=300)
    assert [s.state for s in outcome.get("states", [])] == ["succeeded"], outcome
    (event,) = read_jsonl(Path(job.run_dir) / "recoveries.jsonl")
    assert event["kind"] == "preemption" and event["resumed"] and "task 0 (local) failed" in event["reason"]
    assert "resumed" in job[0].command("train").output().splitlines()


def test_ls_shows_a_watcher_waiting_for_capacity_and_one_that_gave_up(local_job, capsys):
    from speedrun.cli import main

    job = local_job(num_tasks=2)
    recoveries = Path(job.run_dir, "recoveries.jsonl")
    refusal = {"at": 1_700_000_000.0, "task": 1, "attempt": 2, "reason": "AWS has no capacity for 1 x c5.large",
               "next_try_in_s": 7.5, "kind": "no_capacity"}
    recoveries.write_text(json.dumps({"kind": "lost_host", "reason": "task 1 unreachable"}) + "\n" +
                          json.dumps(refusal) + "\n")
    assert main(["ls", job.name]) == 0
    said = [ln.strip() for ln in capsys.readouterr().out.splitlines() if "recovery:" in ln]
    assert said == [f"{job.name}: recovery: no capacity to replace task 1 (try 2: AWS has no capacity for 1 x "
                    f"c5.large); trying again 8 s after {time.strftime('%H:%M:%S', time.localtime(refusal['at']))}"]
    with recoveries.open("a") as f:
        f.write(json.dumps({**refusal, "attempt": 3, "next_try_in_s": None}) + "\n")
    assert main(["ls", job.name]) == 0
    said = [ln.strip() for ln in capsys.readouterr().out.splitlines() if "recovery:" in ln]
    assert said == [f"{job.name}: recovery: no capacity to replace task 1 (try 3: AWS has no capacity for 1 x "
                    f"c5.large); gave up (--recover-wait spent)"]
    with recoveries.open("a") as f:
        f.write(json.dumps({"kind": "lost_host", "reason": "replaced at last"}) + "\n")
    assert main(["ls", job.name]) == 0
    assert "recovery:" not in capsys.readouterr().out


def test_a_watcher_started_again_takes_over_and_counts_earlier_recoveries(local_job, tmp_path):
    gate = tmp_path / "go"
    flaky = tmp_path / "flaky.py"  # waits for the gate, then fails on its first run only
    flaky.write_text("import pathlib, sys, time\nd = pathlib.Path(sys.argv[1])\n"
                     "while not (d / 'go').exists():\n    time.sleep(0.05)\n"
                     "if not (d / 'ran-once').exists():\n    (d / 'ran-once').touch()\n    sys.exit(3)\n")
    first = local_job()
    first.launch([str(flaky), str(tmp_path)])  # its watcher died with the machine that ran it
    again = local_job()  # the same script, started again: reconnects to the running job
    assert again.reconnected
    again.launch([str(flaky), str(tmp_path)])  # nothing new starts; this process now knows the command
    Path(again.run_dir, "recoveries.jsonl").write_text('{"reason": "an earlier watcher recovered once"}\n')
    thread, outcome = start_watch(again, max_restarts=1)
    gate.touch()
    thread.join(timeout=300)
    assert "gave up after 1 recoveries" in str(outcome.get("error")), outcome  # the earlier one counted

    Path(again.run_dir, "recoveries.jsonl").unlink()
    thread, outcome = start_watch(again, max_restarts=1)
    thread.join(timeout=300)
    assert [s.state for s in outcome["states"]] == ["succeeded"], outcome


def test_a_negative_max_restarts_is_one_line(capsys):
    from speedrun.cli import main
    assert main(["launch", "neg", "--recover", "--max-restarts", "-1", "--", "x.py"]) == 2
    assert capsys.readouterr().err.strip() == (
        "speedrun: error: speedrun launch NAME: argument --max-restarts: -1 is not a whole number in 0..1000 "
        "(`speedrun launch NAME --help` for usage)")
