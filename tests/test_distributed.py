"""Distributed training with real torch.distributed processes (gloo on the CPU): the same numbers
as one process, every validation sample counted once, two torchrun "nodes", and a dead rank
stopping the whole job."""
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_run import speedrun, start, wait_for

from speedrun.engine import DeviceBatches, evaluate
from speedrun.data.fashion_mnist import FashionMNIST
from speedrun.dist import DistContext
from speedrun.model import build_model
from speedrun.track import read_jsonl

pytestmark = pytest.mark.slow

RECIPE = """
from speedrun import OptimizerSettings, Phase, Recipe
recipe = Recipe(
    name="ddp-check", model="{model}", dataset="fashion-mnist", world_size={world},
    optimizer=OptimizerSettings(momentum=0.9, nesterov=True, weight_decay=5e-4),
    train_examples={train}, val_examples={val}, val_batch_size={val_batch},
    phases=(
        Phase(0, 1, size=20, batch_size={b}, lr=(0.02, 0.05), min_scale=1.0),
        Phase(1, {epochs}, size=28, batch_size={b}, lr=(0.05, 0.01), min_scale=1.0),
    ),
)
"""


def write_recipe(path: Path, world: int, global_batch: int, train=768, val=500, val_batch=64, epochs=2,
                 model="resnet-fmnist-tiny") -> Path:
    path.write_text(RECIPE.format(world=world, b=global_batch // world, train=train, val=val, val_batch=val_batch,
                                  epochs=epochs, model=model))
    return path


def env_one_thread() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def run_cli(*args, timeout=600) -> subprocess.CompletedProcess:
    return speedrun(*args, timeout=timeout, env=env_one_thread())


def test_two_processes_equal_one_process_with_the_same_global_batch(tmp_path):
    """Same seed, same global batch (2 x 16 vs 1 x 32): the per-step losses agree within 1e-5
    relative (float32 reduction-order noise; measured 1.2e-7) and the final metrics within one
    validation image. The LR is kept moderate so that this noise is not amplified by chaos. The
    model normalises with GroupNorm, whose statistics are per image (BatchNorm's per-device batch statistics differ by design; SyncBatchNorm, which
    would make them equal, is GPU-only in PyTorch)."""
    gn = "resnet-fmnist-tiny-gn"
    one = run_cli("train", "--recipe", str(write_recipe(tmp_path / "one.py", 1, 32, model=gn)), "--device", "cpu",
                  "--deterministic", "--log-every", "1", "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    two = run_cli("train", "--recipe", str(write_recipe(tmp_path / "two.py", 2, 32, model=gn)), "--device", "cpu",
                  "--deterministic", "--log-every", "1", "--nproc-per-node", "2", "--out", str(tmp_path / "two"))
    assert two.returncode == 0, two.stderr

    steps_one, steps_two = read_jsonl(tmp_path / "one" / "steps.jsonl"), read_jsonl(tmp_path / "two" / "steps.jsonl")
    assert len(steps_one) == len(steps_two) == 2 * (768 // 32)
    for a, b in zip(steps_one, steps_two):
        assert a["step"] == b["step"] and a["lr"] == pytest.approx(b["lr"], rel=1e-12)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), a["step"]
    r1 = json.loads((tmp_path / "one" / "results.json").read_text())
    r2 = json.loads((tmp_path / "two" / "results.json").read_text())
    assert r2["world_size"] == 2 and r1["world_size"] == 1
    assert r1["final"]["count"] == r2["final"]["count"] == 500
    assert r2["final"]["top1"] == pytest.approx(r1["final"]["top1"], abs=0.002)  # at most 1 of 500 differs
    assert r2["final"]["top5"] == pytest.approx(r1["final"]["top5"], abs=0.002)
    assert r2["final"]["loss"] == pytest.approx(r1["final"]["loss"], rel=1e-5)


def test_three_processes_count_every_validation_sample_once(tmp_path):
    """500 validation images in batches of 64 = 8 batches, split 3/3/2 across 3 ranks; the reduced
    metrics equal one process evaluating the same weights."""
    recipe = write_recipe(tmp_path / "three.py", 3, 48, train=480, val=500, val_batch=64, epochs=2)
    out = tmp_path / "run"
    proc = run_cli("train", "--recipe", str(recipe), "--device", "cpu", "--nproc-per-node", "3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    final = json.loads((out / "results.json").read_text())["final"]
    assert final["count"] == 500

    model = build_model("resnet-fmnist-tiny", 10, 1)
    model.load_state_dict(torch.load(out / "checkpoint.pt", weights_only=False)["model"])
    model = model.to(memory_format=torch.channels_last)
    source = FashionMNIST(None, val_examples=500)
    batches = DeviceBatches(source, DistContext(0, 1, 0, torch.device("cpu")), channels_last=True)
    single = evaluate(model, source, 28, 64, False, batches, use_bf16=False)
    assert single["count"] == 500
    assert final["top1"] == pytest.approx(single["top1"], abs=1e-9)
    assert final["top5"] == pytest.approx(single["top5"], abs=1e-9)
    assert final["loss"] == pytest.approx(single["loss"], rel=1e-5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_nodes_on_localhost_train_together(tmp_path):
    recipe = write_recipe(tmp_path / "nodes.py", 2, 32, train=512, val=256, epochs=2)
    out = tmp_path / "run"
    port = free_port()
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
             "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", "two-nodes", "-m", "speedrun", "train", "--recipe", str(recipe), "--device", "cpu",
             "--out", str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env_one_thread(),
        )
        for rank in (0, 1)
    ]
    outputs = [n.communicate(timeout=600)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "finished" and results["world_size"] == 2 and results["epochs_run"] == 2
    assert results["final"]["count"] == 256


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of the training processes below the launcher, read from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        variables = dict(v.split(b"=", 1) for v in env if b"=" in v)
        if variables.get(b"TORCHELASTIC_RUN_ID") and b"RANK" in variables and _descends_from(int(entry.name), launcher_pid):
            found[int(variables[b"RANK"])] = int(entry.name)
    return found


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


def test_killing_one_rank_stops_the_job_with_a_clear_message(tmp_path):
    recipe = write_recipe(tmp_path / "long.py", 2, 32, train=4096, val=256, epochs=50)
    out = tmp_path / "run"
    launcher = start("train", "--recipe", str(recipe), "--device", "cpu", "--nproc-per-node", "2",
                     "--log-every", "1", "--out", str(out), env=env_one_thread())
    wait_for(lambda: (out / "steps.jsonl").exists() or launcher.poll() is not None, 300, "both ranks training")
    assert launcher.poll() is None, launcher.communicate()
    pids = worker_pids(launcher.pid)
    assert set(pids) == {0, 1}, pids
    os.kill(pids[1], signal.SIGKILL)
    _, stderr = launcher.communicate(timeout=60)  # the bound: the whole job ends within 60 s
    assert launcher.returncode == 3, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("speedrun: training failed: rank 1") and "SIGKILL" in last, stderr
    results = json.loads((out / "results.json").read_text())  # rank 0 kept what it had
    assert results["status"] in ("interrupted", "failed")
