"""End to end through the CLI: a real run of the tiny recipe on real Fashion-MNIST images, what
it leaves in its run directory, resuming after an interruption, and how the loop uses data."""
import dataclasses
import json
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from cli_run import speedrun, start, wait_for

from speedrun import engine
from speedrun.config import TrainConfig
from speedrun.data.fashion_mnist import FashionMNIST
from speedrun.dist import DistContext
from speedrun.errors import SpeedrunError
from speedrun.learner import DeviceBatches, EvalSettings, choose_precision, evaluate
from speedrun.model import build_model
from speedrun.recipes import BUILTIN
from speedrun.track import read_jsonl

TINY = BUILTIN["tiny"]
CPU = DistContext(0, 1, 0, torch.device("cpu"))  # one process on the CPU


# tiny_run (one deterministic run of the tiny recipe, logging every step) and tiny_target_run are
# made once per session, in conftest.py.


@pytest.mark.slow
def test_tiny_run_learns_far_above_chance(tiny_run):
    results = json.loads((tiny_run / "results.json").read_text())
    assert results["status"] == "finished"
    assert results["epochs_run"] == TINY.epochs
    assert results["final"]["count"] == TINY.val_examples
    assert results["best"]["top1"] > 0.5  # 10 classes: chance is 0.1
    assert results["best"]["top5"] > 0.9
    assert results["versions"]["torch"] == torch.__version__
    assert results["device"].startswith("cpu")


@pytest.mark.slow
def test_lr_of_every_logged_step_equals_the_recipe(tiny_run):
    steps = read_jsonl(tiny_run / "steps.jsonl")
    n = TINY.train_examples
    expected = []
    for epoch in range(TINY.epochs):
        per_epoch = n // TINY.phase_at(epoch).batch_size
        expected += [(epoch + 1, TINY.lr_at(epoch, i, per_epoch)) for i in range(per_epoch)]  # epochs 1-based
    assert [r["step"] for r in steps] == list(range(1, len(expected) + 1))
    assert [(r["epoch"], r["lr"]) for r in steps] == expected
    assert all(r["loss"] > 0 for r in steps)


@pytest.mark.slow
def test_run_directory_holds_events_metrics_plot_and_checkpoint(tiny_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    evals = read_jsonl(tiny_run / "metrics.jsonl")
    assert [e["epoch"] for e in evals] == list(range(1, TINY.epochs + 1))  # 1-based, as printed
    assert [e["size"] for e in evals] == [20, 20, 28, 28]
    assert all(0 <= e["top1"] <= e["top5"] <= 1 for e in evals)
    assert all(a["wall_s"] < b["wall_s"] for a, b in zip(evals, evals[1:]))

    events = EventAccumulator(str(tiny_run / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {f"train/{k}" for k in ("loss", "lr", "images_per_s", "size", "batch_size", "epoch_s", "memory_mb")}
    assert expected | {"val/loss", "val/top1", "val/top5"} <= tags
    assert [round(e.value, 4) for e in events.Scalars("val/top1")] == [round(e["top1"], 4) for e in evals]
    assert [e.value for e in events.Scalars("train/batch_size")] == [64, 128, 128, 128]

    assert (tiny_run / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = torch.load(tiny_run / "checkpoint.pt", weights_only=False)
    assert {"model", "optimizer", "state", "recipe", "rng"} <= set(saved)
    assert saved["state"]["epoch"] == TINY.epochs


@pytest.mark.slow
def test_resume_after_interruption_ends_exactly_like_an_uninterrupted_run(tiny_run, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--recipe", "tiny", "--device", "cpu", "--deterministic", "--log-every", "1", "--out", str(out)]
    proc = start(*args)
    wait_for(lambda: (out / "checkpoint.pt").exists() or proc.poll() is not None, 300, "the first checkpoint")
    proc.send_signal(signal.SIGINT)  # the checkpoint of epoch 1 of 4 exists: 3 epochs are left
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr  # interrupted mid-run: the results so far are kept
    interrupted = json.loads((out / "results.json").read_text())
    assert interrupted["status"] == "interrupted" and interrupted["epochs_run"] < TINY.epochs
    assert "Traceback" not in stderr
    again = speedrun(*args)
    assert again.returncode == 2 and "already holds a run" in again.stderr  # no silent overwrite
    resumed = speedrun(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr

    a = torch.load(tiny_run / "checkpoint.pt", weights_only=False)
    b = torch.load(out / "checkpoint.pt", weights_only=False)
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key  # bitwise
    strip = lambda rows: [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]  # noqa: E731
    assert strip(read_jsonl(out / "metrics.jsonl")) == strip(read_jsonl(tiny_run / "metrics.jsonl"))
    assert read_jsonl(out / "steps.jsonl") == read_jsonl(tiny_run / "steps.jsonl")


@pytest.mark.slow
def test_batch_size_only_change_keeps_the_train_stream(tmp_path, monkeypatch):
    """Phase 0 -> 1 of the tiny recipe changes only the batch size: the loop must reuse the same
    stream (no new dataset, no new workers); 1 -> 2 changes the image size and needs a new one."""
    made = []
    real_build_source = engine.build_source

    def recording_build_source(*args, **kw):
        source = real_build_source(*args, **kw)
        real_train_stream = source.train_stream

        def train_stream(phase, shard, seed):
            stream = real_train_stream(phase, shard, seed)
            made.append((phase.size, stream))
            return stream

        source.train_stream = train_stream
        return source

    monkeypatch.setattr(engine, "build_source", recording_build_source)
    recipe = TINY.with_epochs(3)
    engine.train(TrainConfig(recipe=recipe, out=tmp_path / "run", device="cpu", checkpoint_every=0))
    assert [size for size, _ in made] == [20, 28]
    assert made[0][1].batch_size == 128  # the same object, re-batched for phase 1


@pytest.mark.slow
def test_ema_weights_are_what_is_evaluated_and_saved(tmp_path):
    """With ema_decay the evaluation runs on the moving average, which the checkpoint holds next
    to the raw weights."""
    recipe = dataclasses.replace(TINY.with_epochs(2), ema_decay=0.99)
    results = engine.train(TrainConfig(recipe=recipe, out=tmp_path / "run", device="cpu", checkpoint_every=1))
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert saved["ema"] is not None and saved["ema"].keys() == saved["model"].keys()
    assert not torch.equal(saved["ema"]["fc.weight"], saved["model"]["fc.weight"])

    source = FashionMNIST(None, val_examples=TINY.val_examples)
    batches = DeviceBatches(source, torch.device("cpu"), channels_last=True)
    final = results["final"]

    def loss(weights):
        model = build_model(TINY.model, 10, 1).to(memory_format=torch.channels_last)
        model.load_state_dict(weights)
        settings = EvalSettings(final["size"], TINY.val_batch_size, crop_pct=final["crop_pct"])
        return evaluate(model, source, settings, batches, CPU)["loss"]

    assert loss(saved["ema"]) == pytest.approx(final["loss"], rel=1e-6)
    assert loss(saved["model"]) != pytest.approx(final["loss"], rel=1e-3)


def test_eval_flip_averages_each_image_with_its_mirror():
    # With eval_flip, mirroring the whole validation set changes nothing (the same two forward
    # passes, summed the other way round: bit for bit); without it, the numbers change.
    class Mirrored:
        """The same validation images, each flipped left to right."""

        def __init__(self, source):
            self.source = source

        def val_batches(self, *args):
            for images, labels in self.source.val_batches(*args):
                yield images.flip(3), labels

    torch.manual_seed(0)
    model = build_model(TINY.model, 10, 1).to(memory_format=torch.channels_last)
    source = FashionMNIST(None, val_examples=300)
    batches = DeviceBatches(source, torch.device("cpu"), channels_last=True)

    def metrics(src, flip):
        return evaluate(model, src, EvalSettings(28, 100, flip=flip), batches, CPU)

    both, both_mirrored = metrics(source, True), metrics(Mirrored(source), True)
    plain, plain_mirrored = metrics(source, False), metrics(Mirrored(source), False)
    assert both == both_mirrored
    assert abs(plain["loss"] - plain_mirrored["loss"]) > 1e-6  # an untrained model: small but real
    assert both["loss"] not in (plain["loss"], plain_mirrored["loss"])
    assert both["count"] == plain["count"] == 300


@pytest.mark.slow
def test_resuming_a_run_that_reached_its_target_trains_no_more(tiny_target_run, tmp_path):
    out = shutil.copytree(tiny_target_run.out, tmp_path / "run")  # made by `speedrun train ARGS` (conftest.py)
    args = ["train", "--recipe", "tiny", "--device", "cpu", "--target", "top1=0.2", "--out", str(out)]
    reached = json.loads((out / "results.json").read_text())
    assert reached["status"] == "target_reached" and reached["epochs_run"] < TINY.epochs
    # One numbering: results.json's target epoch is the one the log printed (1-based).
    assert f"reached at epoch {reached['target_epoch']}:" in tiny_target_run.stdout
    assert reached["target_epoch"] == reached["epochs_run"] == read_jsonl(out / "metrics.jsonl")[-1]["epoch"]
    steps_before = read_jsonl(out / "steps.jsonl")

    again = speedrun(*args, "--resume")
    assert again.returncode == 0, again.stderr
    resumed = json.loads((out / "results.json").read_text())
    assert resumed["status"] == "target_reached"
    assert (resumed["epochs_run"], resumed["steps"], resumed["target_epoch"]) == (
        reached["epochs_run"], reached["steps"], reached["target_epoch"])
    assert read_jsonl(out / "steps.jsonl") == steps_before
    assert len(read_jsonl(out / "metrics.jsonl")) == reached["epochs_run"]


@pytest.mark.slow
def test_fp16_autocast_trains_with_a_gradient_scaler(tmp_path):
    """GPUs without bf16 (V100, T4) train in fp16 with a gradient scaler; the same code runs on
    the CPU here. The scaler's state is saved with the checkpoint."""
    recipe = dataclasses.replace(TINY.with_epochs(1), train_examples=1024, val_examples=200)
    results = engine.train(TrainConfig(recipe=recipe, out=tmp_path / "run", device="cpu", precision="fp16"))
    assert results["precision"] == "fp16" and results["status"] == "finished"
    losses = [r["loss"] for r in read_jsonl(tmp_path / "run" / "steps.jsonl")]
    assert losses and all(0 < x < 3 for x in losses)
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert saved["scaler"]["scale"] > 0


@pytest.mark.parametrize("requested, device, capability, expected", [
    ("auto", "cpu", None, "fp32"),
    ("auto", "cuda", (7, 0), "fp16"),  # V100: the record's GPU has no bf16
    ("auto", "cuda", (7, 5), "fp16"),  # T4
    ("auto", "cuda", (8, 0), "bf16"),  # A100
    ("auto", "cuda", (9, 0), "bf16"),  # H100 / H200
    ("fp16", "cuda", (9, 0), "fp16"),
    ("fp32", "cuda", (9, 0), "fp32"),
    ("bf16", "cpu", None, "bf16"),
])
def test_precision_follows_what_the_device_supports(requested, device, capability, expected):
    assert choose_precision(requested, device, capability) == expected


def test_bf16_on_a_gpu_without_it_is_refused():
    with pytest.raises(SpeedrunError, match="compute capability 7.0"):
        choose_precision("bf16", "cuda", (7, 0))


@pytest.mark.slow
def test_a_compiled_model_trains_and_evaluates_rectangular_batches_without_compiling_them(tmp_path):
    # Rectangular validation batches come in several shapes; compiled per shape (dynamic=False)
    # each would be a new graph. Evaluation runs them eagerly, so only training compiles. (Also
    # the suite's one compiled run: compile=True trains and evaluates every validation image.)
    from torch._dynamo.utils import counters

    from speedrun.data.imagefolder import ImageFolderSource
    from speedrun.data.rect import rect_plan
    from speedrun.recipe import Phase, Recipe
    from test_data_helpers import make_tree

    tree = make_tree(tmp_path / "d", classes=2, train_per_class=8, val_per_class=8,
                     sizes=[(64, 32), (32, 64), (48, 48), (72, 40), (40, 72)])
    recipe = Recipe("rect", (Phase(0, 1, size=24, batch_size=8, lr=0.05, rect_val=True),),
                    model="resnet-fmnist-tiny", dataset="imagefolder", val_batch_size=4)
    split = ImageFolderSource(tree, workers=0, device=torch.device("cpu"))._val_split(None)
    shapes = {(b.height, b.width) for b in rect_plan(split.widths, split.heights, 24, 4)}
    assert len(shapes) >= 3  # enough shapes that compiling each would show
    before = counters["stats"]["unique_graphs"]
    results = engine.train(TrainConfig(recipe=recipe, out=tmp_path / "run", device="cpu", compile=True,
                                       data=str(tree), workers=0))
    assert results["status"] == "finished" and results["compile"] is True and results["final"]["count"] == 16
    assert counters["stats"]["unique_graphs"] - before <= 2  # the training step's graphs, not one per shape


@pytest.mark.slow
def test_a_cpu_training_step_of_a_narrow_model_at_48_px_survives(tmp_path):
    # oneDNN's channels_last backward of a 1x1 stride-2 convolution with fewer input channels than
    # its kernel's block corrupts the heap at 48 px and up (torch 2.14.1: SIGSEGV, or "free():
    # invalid next size" on an AVX-512 AMD EPYC, whose block is 16; "double free or corruption" with
    # 4 or 6 channels on an AVX2 one, block 8); the tiny model has such a downsample, of 8 channels.
    # The step runs in whichever format speedrun.memory_format picks on this machine: contiguous on
    # AVX-512, channels_last on AVX2. In a process of its own: a crash must not take pytest with it.
    script = tmp_path / "step.py"
    script.write_text(
        "import torch\nfrom torch import nn\nfrom speedrun.learner import to_device, train_step\n"
        "from speedrun.model import build_model\nfrom speedrun.optim import build_optimizer\n"
        "from speedrun.recipe import OptimizerSettings\n"
        "model, channels_last = to_device(build_model('resnet-fmnist-tiny', 10, 3), torch.device('cpu'))\n"
        "layout = torch.channels_last if channels_last else torch.contiguous_format\n"
        "x = torch.randn(16, 3, 48, 48).contiguous(memory_format=layout)\n"
        "optimizer = build_optimizer(model, OptimizerSettings(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    train_step(model, optimizer, nn.CrossEntropyLoss(), x, torch.randint(0, 10, (16,)))\n"
        "print('layout', layout)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-500:])
    isa = torch.backends.cpu.get_cpu_capability()
    expected = {"AVX512": "torch.contiguous_format", "AVX2": "torch.channels_last"}.get(isa, "torch.contiguous_format")
    assert f"layout {expected}" in proc.stdout


def test_batches_reach_a_contiguous_model_contiguous_even_when_the_loader_gave_channels_last():
    from types import SimpleNamespace

    from speedrun.learner import to_device

    model, channels_last = to_device(build_model(TINY.model, 10, 3), torch.device("cpu"), "contiguous")
    assert not channels_last
    batches = DeviceBatches(SimpleNamespace(mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25)), torch.device("cpu"),
                            channels_last)
    images = torch.zeros(2, 48, 48, 3, dtype=torch.uint8).permute(0, 3, 1, 2)  # an image folder's batch: NHWC memory
    assert images.is_contiguous(memory_format=torch.channels_last)
    x, _ = batches.to_device(images, torch.zeros(2, dtype=torch.int64))
    assert x.is_contiguous() and x.dtype == torch.float32
