"""What a checkpoint costs the training loop: written on the training thread (torch.save + fsync,
as speedrun did before) vs handed to speedrun's background writer (checkpoint.CheckpointWriter).

The state is a ResNet-50's weights plus SGD momentum (about 200 MB, what a record run saves
every epoch). For each way, interleaved, `--repeats` times: the seconds the training thread is
blocked by the save, then the seconds of `--steps` training steps of the demo ResNet run right
after it (while a background write is still in flight), against the same steps with no save.

    python benchmarks/checkpoint_cost.py [--repeats 3] [--steps 20] [--dir /tmp]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from speedrun import checkpoint
from speedrun.learner import train_step
from speedrun.model import build_model
from speedrun.optim import build_optimizer
from speedrun.recipe import OptimizerSettings


def resnet50_state() -> dict:
    """ResNet-50 weights and SGD momentum after one step: a full record-run checkpoint."""
    model = build_model("resnet50", 1000)
    optimizer = build_optimizer(model, OptimizerSettings(), lr=0.1)
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


class Steps:
    """A few training steps of the demo model: the work that runs while a checkpoint is written."""

    def __init__(self, steps: int):
        self.steps = steps
        self.model = build_model("resnet-fmnist", 10, 1).to(memory_format=torch.channels_last)
        self.optimizer = build_optimizer(self.model, OptimizerSettings(), lr=0.01)
        self.x = torch.randn(128, 1, 28, 28).contiguous(memory_format=torch.channels_last)
        self.y = torch.randint(0, 10, (128,))

    def run(self) -> float:
        start = time.perf_counter()
        for _ in range(self.steps):
            train_step(self.model, self.optimizer, nn.CrossEntropyLoss(), self.x, self.y)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="training steps timed after each save")
    parser.add_argument("--dir", default=None, help="where to write (default: the system's temp dir)")
    args = parser.parse_args()

    state = resnet50_state()
    mb = sum(t.numel() * t.element_size() for t in checkpoint.copy_to_cpu(state)["model"].values()) / 2**20
    steps = Steps(args.steps)
    steps.run()  # warm up oneDNN
    blocked = {"sync": [], "background": []}
    after = {"none": [], "sync": [], "background": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = Path(d) / "checkpoint.pt"
        writer = checkpoint.CheckpointWriter()
        for _ in range(args.repeats):
            after["none"].append(steps.run())

            start = time.perf_counter()
            checkpoint.save_atomic(state, path)
            blocked["sync"].append(time.perf_counter() - start)
            after["sync"].append(steps.run())

            start = time.perf_counter()
            writer.save(state, path)
            blocked["background"].append(time.perf_counter() - start)
            after["background"].append(steps.run())
            writer.wait()
        size_mb = path.stat().st_size / 2**20

    med = {k: statistics.median(v) for k, v in blocked.items()}
    steps_med = {k: statistics.median(v) for k, v in after.items()}
    print(f"checkpoint: ResNet-50 + momentum, {size_mb:.0f} MB on disk ({mb:.0f} MB of weights), "
          f"{torch.get_num_threads()} threads, {args.repeats} repeats, medians")
    print(f"training thread blocked by the save: on the thread {med['sync']:.2f} s, "
          f"background writer {med['background']:.2f} s (the copy)  ratio {med['background'] / med['sync']:.2f}x")
    print(f"{args.steps} training steps right after: no save {steps_med['none']:.2f} s, "
          f"after an on-thread save {steps_med['sync']:.2f} s, "
          f"during a background write {steps_med['background']:.2f} s")
    total = {k: med[k] + steps_med[k] - steps_med["none"] for k in med}
    print(f"time the save adds to the run: on the thread {total['sync']:.2f} s, "
          f"background {total['background']:.2f} s  "
          f"ratio {total['background'] / total['sync']:.2f}x")


if __name__ == "__main__":
    main()
