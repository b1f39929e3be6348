"""Time to 93% Fashion-MNIST test top-1: speedrun's default recipe against a plain baseline, run
side by side in this one script, with the ratio.

The baseline is written simply here, the way a first training script would be: the same model
(`resnet-fmnist`), fixed 28 px, a constant batch of 128, per-sample torchvision transforms
(random crop with 2 px padding, horizontal flip) in a DataLoader, SGD with momentum and weight
decay on every parameter, LR 0.1 divided by 10 at 50% and 75% of the epoch cap, evaluation after
every epoch. No progressive resizing, no warmup, no label smoothing, no channels_last.

Both clocks start at the first training step and include evaluation.

    python benchmarks/fashion_mnist.py                 # CPU, about 30 minutes on 2 cores
    python benchmarks/fashion_mnist.py --device cuda
"""
from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import torch
import torchvision.transforms.v2 as T
from torch import nn
from torch.utils.data import DataLoader, Dataset

from speedrun.data.fashion_mnist import FashionMNIST
from speedrun.config import TrainConfig
from speedrun.engine import train
from speedrun.model import build_model
from speedrun.recipe import Target
from speedrun.recipes import BUILTIN, DEFAULT


class Augmented(Dataset):
    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels
        self.transform = T.Compose([T.RandomCrop(28, padding=2), T.RandomHorizontalFlip()])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.transform(self.images[i]), self.labels[i]


def baseline_time_to(target: float, epochs: int, device: torch.device,
                     seed: int) -> tuple[float | None, int, float, float]:
    """(seconds to `target` top-1 or None, epochs run, best top-1, seconds run) for the plain baseline."""
    torch.manual_seed(seed)
    data = FashionMNIST(None, "cpu")
    mean, std = data.mean[0], data.std[0]
    loader = DataLoader(Augmented(data.train_images, data.train_labels), batch_size=128, shuffle=True, drop_last=True)
    model = build_model("resnet-fmnist", 10, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    schedule = torch.optim.lr_scheduler.MultiStepLR(optimizer, [epochs // 2, epochs * 3 // 4], gamma=0.1)
    criterion = nn.CrossEntropyLoss()
    start, best = None, 0.0
    for epoch in range(epochs):
        model.train()
        for images, labels in loader:
            start = start or time.perf_counter()
            x = (images.to(device).float() - mean) / std
            loss = criterion(model(x), labels.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        schedule.step()
        model.eval()
        correct = 0
        with torch.no_grad():
            for i in range(0, data.num_val, 1000):
                x = (data.val_images[i : i + 1000].to(device).float() - mean) / std
                correct += (model(x).argmax(1).cpu() == data.val_labels[i : i + 1000]).sum().item()
        top1 = correct / data.num_val
        best = max(best, top1)
        elapsed = time.perf_counter() - start
        print(f"  baseline epoch {epoch + 1:>2}/{epochs}: top1 {100 * top1:.2f}%  {elapsed:.0f}s", flush=True)
        if top1 >= target:
            return elapsed, epoch + 1, best, elapsed
    return None, epochs, best, elapsed


def speedrun_time_to(target: float, device: str, seed: int, out: Path) -> tuple[float | None, int, float]:
    recipe = dataclasses.replace(BUILTIN[DEFAULT], target=Target("top1", target))
    results = train(TrainConfig(recipe=recipe, out=out, device=device, seed=seed, checkpoint_every=0, log_every=1000))
    return results["time_to_target_from_first_step_s"], results["epochs_run"], results["best"]["top1"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=float, default=0.93, help="top-1 fraction (default 0.93)")
    parser.add_argument("--baseline-epochs", type=int, default=30, help="the baseline's epoch cap (default 30)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_float32_matmul_precision("highest")

    with tempfile.TemporaryDirectory() as tmp:
        print(f"speedrun, recipe {DEFAULT}:")
        ours = speedrun_time_to(args.target, args.device, args.seed, Path(tmp) / "run")
    print("baseline:")
    base = baseline_time_to(args.target, args.baseline_epochs, torch.device(args.device), args.seed)

    print(f"\ntime to {100 * args.target:.1f}% Fashion-MNIST test top-1 on {args.device}, from the first step:")
    for name, (seconds, epochs, best, *_) in (("speedrun", ours), ("baseline", base)):
        when = f"{seconds:8.1f} s" if seconds is not None else "  not reached"
        print(f"  {name:<9} {when}  after {epochs} epochs (best top-1 {100 * best:.2f}%)")
    if ours[0] is not None and base[0] is not None:
        print(f"  ratio speedrun / baseline: {ours[0] / base[0]:.2f}x")
    elif ours[0] is not None:
        print(f"  baseline did not reach the target in {base[3]:.0f} s ({args.baseline_epochs} epochs): "
              f"ratio below {ours[0] / base[3]:.2f}x")


if __name__ == "__main__":
    main()
