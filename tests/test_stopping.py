"""Stopping at a step and resuming there (speedrun.stopping, the engine, the CLI).

Runs are real `speedrun train` processes; the "interruptions" are the real signals, files and
HTTP answers a scheduler, a person or EC2 gives.
"""
from __future__ import annotations

import http.server
import json
import os
import signal
import sys
import threading
from functools import partial
from pathlib import Path

import pytest
import torch

from cli_run import start, wait_for
from ranks import start_ranks
from speedrun.errors import EXIT_RESUMABLE
from speedrun.track import read_jsonl
from test_distributed import env_one_thread, run_cli, write_recipe

pytestmark = pytest.mark.slow
STEPS_PER_EPOCH = 768 // 32  # write_recipe's defaults: 768 training images, a global batch of 32


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def checkpoint_state(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)["state"]


def test_a_run_stopped_by_sigterm_resumes_bit_identically(tmp_path):
    args = ["train", "--recipe", str(write_recipe(tmp_path / "r.py", 1, 32, epochs=6)), "--device", "cpu",
            "--deterministic", "--log-every", "1"]
    full = run_cli(*args, "--out", str(tmp_path / "full"))
    assert full.returncode == 0, full.stderr

    part = tmp_path / "part"
    proc = start(*args, "--out", str(part), env=env_one_thread())
    steps = part / "steps.jsonl"
    wait_for(lambda: lines(steps) >= 30, 300, "30 steps")

    # A function of `done` (bound with partial below), so each wait compares against its own iteration's count.
    def more_steps_than(done: int) -> bool:
        return lines(steps) > done

    # Freeze the run where the log says it is mid-epoch, then ask it to stop: it stops after the
    # step in progress or the next, so at least two steps before the epoch's end.
    while True:
        os.kill(proc.pid, signal.SIGSTOP)
        if 0 < lines(steps) % STEPS_PER_EPOCH < STEPS_PER_EPOCH - 3:
            break
        os.kill(proc.pid, signal.SIGCONT)
        done = lines(steps)
        wait_for(partial(more_steps_than, done), 300, "another step")
    proc.send_signal(signal.SIGTERM)
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_RESUMABLE, err
    state = checkpoint_state(part)
    assert 0 < state["epoch_step"] < STEPS_PER_EPOCH and state["step"] == read_jsonl(steps)[-1]["step"]
    assert "stopped at step" in out and "on SIGTERM" in out and "--resume" in out
    assert json.loads((part / "results.json").read_text())["status"] == "stopped"

    resumed = run_cli(*args, "--resume", "--out", str(part))
    assert resumed.returncode == 0, resumed.stderr
    a, b = read_jsonl(tmp_path / "full" / "steps.jsonl"), read_jsonl(steps)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 6 * STEPS_PER_EPOCH + 1))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # bit-identical, before and after the stop
    final = [json.loads((d / "results.json").read_text())["final"] for d in (tmp_path / "full", part)]
    (lost,) = json.loads((part / "results.json").read_text())["interruptions"]
    assert lost["steps_redone"] == 0 and lost["resumed_at_step"] == state["step"]  # a stop at a step loses no training
    assert [{k: f[k] for k in ("loss", "top1", "top5", "count")} for f in final] == [
        {k: final[0][k] for k in ("loss", "top1", "top5", "count")}] * 2


def test_two_processes_stop_together_on_a_stop_file_and_resume(tmp_path):
    epochs = 4
    recipe = write_recipe(tmp_path / "r.py", 2, 32, epochs=epochs, model="resnet-fmnist-tiny-gn")
    args = ["train", "--recipe", str(recipe),
            "--device", "cpu", "--deterministic", "--log-every", "1", "--nproc-per-node", "2"]
    # The uninterrupted twin trains beside the interrupted run: neither depends on the other.
    full = start(*args, "--out", str(tmp_path / "full"), env=env_one_thread())

    part = tmp_path / "part"
    proc = start(*args, "--out", str(part), env=env_one_thread(), start_new_session=True)
    wait_for(lambda: lines(part / "steps.jsonl") >= 30, 300, "30 steps")
    # The request is made with the launcher and both ranks frozen, so that however late this
    # process gets to it, 66 of the run's 96 steps are left: the ranks read the stop file within
    # a second (some 16 steps here when quiet, fewer when busy).
    os.killpg(proc.pid, signal.SIGSTOP)
    frozen_at = lines(part / "steps.jsonl")
    (part / "stop").touch()  # a request; every rank stops after the same step
    os.killpg(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_RESUMABLE, err
    state = checkpoint_state(part)
    assert frozen_at <= state["step"] == read_jsonl(part / "steps.jsonl")[-1]["step"] < epochs * STEPS_PER_EPOCH
    assert not (part / "stop").exists()  # handled: the resumed run does not stop at once

    resumed = run_cli(*args, "--resume", "--out", str(part))
    assert resumed.returncode == 0, resumed.stderr
    _, err = full.communicate(timeout=300)
    assert full.returncode == 0, err
    a, b = read_jsonl(tmp_path / "full" / "steps.jsonl"), read_jsonl(part / "steps.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, epochs * STEPS_PER_EPOCH + 1))
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), x["step"]  # float noise of two processes at most


class NoticeServer(http.server.ThreadingHTTPServer):
    """EC2's instance metadata for a spot instance, on 127.0.0.1: IMDSv2's token, then 404 at
    spot/instance-action until `notice` is set (then 200 with it)."""

    def __init__(self):
        self.notice: dict | None = None
        self.polls = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_PUT(h):
                h.send_response(200)
                h.end_headers()
                h.wfile.write(b"test-token")

            def do_GET(h):
                self.polls += 1
                ok = h.path == "/latest/meta-data/spot/instance-action" and self.notice is not None
                ok = ok and h.headers.get("X-aws-ec2-metadata-token") == "test-token"
                h.send_response(200 if ok else 404)
                h.end_headers()
                if ok:
                    h.wfile.write(json.dumps(self.notice).encode())

            def log_message(h, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/latest/meta-data/spot/instance-action"


def test_a_spot_notice_makes_a_running_job_checkpoint_and_exit_resumable(tmp_path):
    server = NoticeServer()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        run = tmp_path / "run"
        proc = start("train", "--recipe", str(write_recipe(tmp_path / "r.py", 1, 32, epochs=100)), "--device", "cpu",
                     "--log-every", "1", "--spot-notice-url", server.url, "--out", str(run), env=env_one_thread())
        wait_for(lambda: lines(run / "steps.jsonl") >= 10 and server.polls >= 1, 300, "training and a first poll")
        server.notice = {"action": "terminate", "time": "2026-12-01T12:00:00Z"}  # two minutes from "now" on EC2
        out, err = proc.communicate(timeout=120)  # the notice's window
    finally:
        server.shutdown()
    assert proc.returncode == EXIT_RESUMABLE, err
    assert "on a spot interruption notice (terminate at 2026-12-01T12:00:00Z)" in out
    assert checkpoint_state(run)["step"] == read_jsonl(run / "steps.jsonl")[-1]["step"]
    assert json.loads((run / "results.json").read_text())["status"] == "stopped"


def test_minute_checkpoints_are_written_mid_epoch_and_resume_from_there(tmp_path):
    recipe = str(write_recipe(tmp_path / "r.py", 1, 32, epochs=2))
    args = ["train", "--recipe", recipe, "--device", "cpu", "--deterministic", "--log-every", "1"]
    full = run_cli(*args, "--out", str(tmp_path / "full"))
    assert full.returncode == 0, full.stderr
    # No epoch checkpoints, one every 0.06 s: the last one on disk is from within the last epoch.
    part = tmp_path / "part"
    mid = run_cli(*args, "--checkpoint-every", "0", "--checkpoint-every", "0.001m", "--out", str(part))
    assert mid.returncode == 0, mid.stderr
    state = checkpoint_state(part)
    assert state["epoch"] == 1 and 0 < state["epoch_step"] <= STEPS_PER_EPOCH
    resumed = run_cli(*args, "--resume", "--out", str(part))
    assert resumed.returncode == 0, resumed.stderr
    assert ([r["loss"] for r in read_jsonl(part / "steps.jsonl")]
            == [r["loss"] for r in read_jsonl(tmp_path / "full" / "steps.jsonl")])


# A bad --checkpoint-every or --spot-notice-url is refused before a run starts: test_cli.py.


def test_a_sigterm_while_the_run_cleans_up_does_not_lose_its_results(tmp_path, monkeypatch):
    """torchrun sends SIGTERM to the survivors when a rank dies; a survivor that has already met
    the failure is then cleaning up (closing its loaders, waiting for the last checkpoint). The
    signal there must not cut the clean-up short: results.json is still written. (The race behind
    a CI failure: `test_killing_one_rank...` lost results.json when the signal came that late.)"""
    from speedrun import cli, engine

    close = engine.PhaseStreams.close

    def close_with_a_sigterm(self):
        if sys._getframe(1).f_code.co_name == "write_results":  # the loop's clean-up, not a new phase's stream
            os.kill(os.getpid(), signal.SIGTERM)  # delivered here, as torchrun's would be
        close(self)

    monkeypatch.setattr(engine.PhaseStreams, "close", close_with_a_sigterm)
    out = tmp_path / "run"
    code = cli.main(["train", "--recipe", str(write_recipe(tmp_path / "r.py", 1, 32, train=64, val=64, epochs=2)),
                     "--device", "cpu", "--out", str(out)])
    assert code == 0  # the run had finished every epoch: that is its outcome
    assert json.loads((out / "results.json").read_text())["status"] == "finished"


@pytest.mark.parametrize("late", ["plotting", "shutting-down"])
def test_a_sigterm_once_a_stopped_runs_results_are_written_changes_nothing(tmp_path, monkeypatch, late):
    """A SIGTERM stops the run at a step; another comes once results.json says "stopped" (a
    scheduler's second, torchrun's copy): while the run plots its accuracy, still inside the stop
    handler's reach, or while it shuts its process group down, after it. The outcome is settled:
    exit 75 and "stopped" (CI, under load: the second one, 2 s or more after the first, made it
    130, "interrupted", which a scheduler does not requeue)."""
    from speedrun import cli, engine, stopping, track

    monkeypatch.setattr(stopping, "DUPLICATE_S", 0.0)  # the second SIGTERM comes long after the first
    sent = []
    advance = track.Tracker.advance

    def advance_then_sigterm(self, images_per_s):
        advance(self, images_per_s)
        if not sent:  # after the first step: the run stops at the next one
            sent.append("first")
            os.kill(os.getpid(), signal.SIGTERM)

    where = (track.Tracker, "plot") if late == "plotting" else (engine, "shutdown")
    original = getattr(*where)

    def sigterm_then(*args, **kwargs):
        assert json.loads((out / "results.json").read_text())["status"] == "stopped"
        sent.append(late)
        os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    monkeypatch.setattr(track.Tracker, "advance", advance_then_sigterm)
    monkeypatch.setattr(*where, sigterm_then)
    out = tmp_path / "run"
    code = cli.main(["train", "--recipe", str(write_recipe(tmp_path / "r.py", 1, 32, train=64, val=64, epochs=2)),
                     "--device", "cpu", "--out", str(out)])
    assert sent == ["first", late]
    assert code == EXIT_RESUMABLE
    assert json.loads((out / "results.json").read_text())["status"] == "stopped"


def test_a_second_sigterm_soon_after_the_first_is_the_same_request_and_a_later_one_interrupts(tmp_path, monkeypatch):
    """The SIGTERM handler itself (what the run above relies on): within DUPLICATE_S of the first,
    a SIGTERM changes nothing; later, it interrupts at once as Ctrl-C does."""
    import types

    from speedrun import stopping

    clock = [100.0]
    monkeypatch.setattr(stopping.time, "monotonic", lambda: clock[0])
    requests = stopping.StopRequests(types.SimpleNamespace(world_size=1), tmp_path, None)
    requests._on_sigterm(signal.SIGTERM, None)
    clock[0] += stopping.DUPLICATE_S / 2
    requests._on_sigterm(signal.SIGTERM, None)  # torchrun's copy of the scheduler's: no exception
    assert requests.agreed() and requests.reason == "SIGTERM"
    clock[0] += stopping.DUPLICATE_S
    with pytest.raises(KeyboardInterrupt, match="second SIGTERM"):
        requests._on_sigterm(signal.SIGTERM, None)


def rank_pid(ancestor: int, rank: int) -> int | None:
    """The pid of the training process of `rank` (its RANK variable) among `ancestor`'s descendants."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == ancestor:
                return True
        return False
    for pid in parents:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and descends(pid):
            return pid
    return None


def test_a_sigterm_that_reaches_one_rank_first_still_stops_every_rank_after_the_same_step(tmp_path):
    """A scheduler signals each rank on its own, milliseconds apart (Slurm's requeue, a preemption):
    the rank signalled first must not leave the others waiting for it in the step's agreement. Here
    only rank 1 is signalled: every rank still stops after one step, and rank 0 writes its checkpoint."""
    args = ["train", "--recipe", str(write_recipe(tmp_path / "r.py", 2, 32, epochs=20, model="resnet-fmnist-tiny-gn")),
            "--device", "cpu", "--log-every", "1", "--nproc-per-node", "2"]
    run = tmp_path / "run"
    proc = start(*args, "--out", str(run), env=env_one_thread())
    wait_for(lambda: lines(run / "steps.jsonl") >= 30, 300, "30 steps")
    pid = wait_for(lambda: rank_pid(proc.pid, 1), 60, "rank 1's process")
    os.kill(pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_RESUMABLE, err
    assert checkpoint_state(run)["step"] == read_jsonl(run / "steps.jsonl")[-1]["step"] < 20 * STEPS_PER_EPOCH
    assert json.loads((run / "results.json").read_text())["status"] == "stopped"


def _agree_with_a_sigterm_during_the_question(rank: int, store: str, out: str) -> None:
    """One rank of the test below: two agreements; on rank 1, SIGTERM lands while it waits in the
    first one (its handler runs as soon as the all-reduce returns)."""
    import types

    import torch.distributed as dist

    from speedrun import stopping

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    all_reduce = dist.all_reduce

    def signalled_during(*args, **kwargs):
        result = all_reduce(*args, **kwargs)
        if rank == 1 and not answers:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    answers: list[bool] = []
    dist.all_reduce = signalled_during
    with stopping.StopRequests(types.SimpleNamespace(world_size=2), Path(out), None) as requests:
        answers.append(requests.agreed())
        answers.append(requests.agreed())
    Path(out, f"rank{rank}.json").write_text(json.dumps(answers))
    dist.destroy_process_group()


def test_a_sigterm_that_lands_during_the_agreement_waits_for_the_next_one(tmp_path):
    """Every rank must take the same decision after a step: a SIGTERM that reaches one rank while it
    waits in the step's agreement is not part of that answer (the others did not hear it), so that
    rank goes on with them and it is asked at the next step. Before, that rank alone stopped and the
    others waited for it in the next step until the run hung."""
    start_ranks(_agree_with_a_sigterm_during_the_question, (str(tmp_path / "store"), str(tmp_path)), 2, join=True)
    answers = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert answers == [[False, True], [False, True]]
