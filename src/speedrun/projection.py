"""Projected wall time of a schedule from measured training speeds (`speedrun recipes --project`).

A recipe says how many epochs it trains at each image size; a GPU check (benchmarks/gpu_check.sh)
says how many images per second one GPU trains at some sizes. Their quotient is the time the
schedule needs, if the run goes at the measured pace:

- training: for each phase, epochs x training images / (images/s per GPU at the phase's size x
  GPUs x `scaling`, the fraction of linear scaling the run keeps across GPUs);
- evaluation: after every `eval_every` epochs, validation images / (GPUs x an evaluation rate of
  `EVAL_SPEEDUP` times the training rate at that size: a forward pass without the backward);
- a size not measured takes the rate of the power law (images/s ~ size^-k) through the two
  nearest measured sizes.

Not counted: start-up, torch.compile, data pre-warming (also left out of the 2018 clock).

What a schedule costs on a machine type (`project_cost`): its projected time plus a start-up
allowance (machines booting, code and data arriving), times the machines, times their price per
hour. Each machine type's GPUs train at the rates measured on that GPU (`rates_for`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from speedrun.errors import SpeedrunError
from speedrun.money import Price
from speedrun.recipe import Recipe

IMAGENET_TRAIN_IMAGES = 1_281_167
IMAGENET_VAL_IMAGES = 50_000
# Evaluation is forward-only: about a third of a training step's work (forward + backward ~ 3x forward).
EVAL_SPEEDUP = 3.0
# The anchors (docs/record.md): the 2018 record's time to 93% top-5 with each schedule (machines of
# 8 V100s), minutes; and NVIDIA's MLPerf v4.0 ResNet-50 on 8 H200s (75.9% top-1), minutes.
RECORD_MINUTES = {"imagenet-16x8": 18 + 5 / 60, "imagenet-8x8": 18 + 53 / 60, "imagenet-4x8": 29 + 42 / 60,
                  "imagenet-2x8": 54.0, "imagenet-1x8": 109.0}
MLPERF_H200_MINUTES = 12.03


@dataclass(frozen=True)
class Rates:
    """Measured training images/s of one GPU, by image size (pixels), on `device`."""

    images_per_s: dict[int, float]
    device: str = "the measured GPU"

    def at(self, size: int) -> float:
        """Images/s at `size` px: measured, else from the power law through the two nearest sizes."""
        if size in self.images_per_s:
            return self.images_per_s[size]
        sizes = sorted(self.images_per_s, key=lambda s: (abs(math.log(s / size)), s))[:2]
        if len(sizes) == 1:  # one size known: the work grows with the pixels
            return self.images_per_s[sizes[0]] * (sizes[0] / size) ** 2
        (a, ra), (b, rb) = sorted((s, self.images_per_s[s]) for s in sizes)
        k = math.log(ra / rb) / math.log(b / a)
        return ra * (a / size) ** k


def read_gpu_rates(spec: str) -> tuple[str | None, Rates]:
    """`--project [GPU:]RATES`: the GPU the rates were measured on (as named in machine types:
    H100, A100...; None: take it from a summary's device) and the rates (read_rates)."""
    gpu, sep, rest = spec.partition(":")
    if sep and gpu.isalnum() and not Path(spec).exists():
        return gpu, read_rates(rest)
    return None, read_rates(spec)


def rates_for(gpu: str, measured: list[tuple[str | None, Rates]]) -> Rates | None:
    """The rates measured on `gpu` (a machine type's GPU: "H100"): those labelled so, else those
    whose device names it ("NVIDIA H100 80GB HBM3"); None when none were."""
    for label, rates in measured:
        if (label or "").lower() == gpu.lower():
            return rates
    for label, rates in measured:
        if label is None and re.search(rf"\b{re.escape(gpu)}\b", rates.device, re.IGNORECASE):
            return rates
    return None


def read_rates(spec: str) -> Rates:
    """Rates from "128=10842,224=4702" (size=images/s per GPU) or from a JSON file: a GPU check's
    summary ({"device": ..., "images_per_s": {"128": ...}}). One clear error for anything else."""
    path = Path(spec)
    if path.suffix == ".json" or path.exists():
        try:
            data = json.loads(path.read_text())
            return _checked({int(k): float(v) for k, v in data["images_per_s"].items()}, data.get("device"), spec)
        except FileNotFoundError:
            raise SpeedrunError(f"--project {spec}: no such file") from None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise SpeedrunError(f"--project {spec}: not a rates file "
                                f"with an images_per_s table by size ({e})") from None
    try:
        pairs = dict(item.split("=", 1) for item in spec.split(","))
        return _checked({int(k): float(v) for k, v in pairs.items()}, None, spec)
    except ValueError:
        raise SpeedrunError(f"--project {spec!r}: give SIZE=IMAGES_PER_S pairs (128=10842,224=4702) "
                            "or a GPU check's summary .json") from None


def _checked(rates: dict[int, float], device: str | None, spec: str) -> Rates:
    if not rates or any(s <= 0 or r <= 0 or not math.isfinite(r) for s, r in rates.items()):
        raise SpeedrunError(f"--project {spec}: sizes and images/s must be positive numbers")
    return Rates(rates, device or "the measured GPU")


@dataclass(frozen=True)
class Projection:
    """A schedule's projected time on `gpus` GPUs, seconds."""

    recipe: str
    gpus: int
    train_s: float
    eval_s: float

    @property
    def total_s(self) -> float:
        return self.train_s + self.eval_s


@dataclass(frozen=True)
class MachineType:
    """A machine type as projections need it: its GPUs and what one machine costs (None: unknown)."""

    name: str  # e.g. "p4d.24xlarge"
    gpus: int  # GPUs per machine
    gpu: str  # which GPU, as rates are labelled: "A100"
    price: Price | None  # one machine's price


@dataclass(frozen=True)
class CostProjection:
    """A schedule on `machines` machines of a type: projected wall time (seconds, start-up
    included) and $ (None without a price)."""

    machine: MachineType
    machines: int
    projection: Projection
    startup_s: float

    @property
    def total_s(self) -> float:
        return self.projection.total_s + self.startup_s

    @property
    def usd(self) -> float | None:
        price = self.machine.price
        return None if price is None else dataclasses.replace(price, machines=self.machines).cost(self.total_s)


def project_cost(recipe: Recipe, rates: Rates, machine: MachineType, machines: int, scaling: float = 1.0,
                 startup_s: float = 0.0) -> CostProjection:
    """`recipe` on `machines` x `machine` (machines x its GPUs, at `rates`), with `startup_s`
    seconds of start-up on top, and what that costs at the machine's price."""
    if machines < 1 or startup_s < 0:
        raise SpeedrunError(f"--count must be 1 or more and --startup-min 0 or more, got {machines} and "
                            f"{startup_s / 60:g}")
    return CostProjection(machine, machines, project(recipe, rates, machines * machine.gpus, scaling), startup_s)


def project(recipe: Recipe, rates: Rates, gpus: int | None = None, scaling: float = 1.0,
            train_images: int = IMAGENET_TRAIN_IMAGES, val_images: int = IMAGENET_VAL_IMAGES) -> Projection:
    """The time `recipe` takes on `gpus` GPUs (None: the count it was written for) at `rates`,
    keeping `scaling` (0..1] of linear speed-up, over ImageNet-1k's images (or the recipe's
    subset); see the module docstring."""
    if recipe.dataset != "imagefolder":
        raise SpeedrunError(f"--project times image-folder (ImageNet) schedules; "
                            f"{recipe.name!r} reads {recipe.dataset}")
    gpus = recipe.world_size if gpus is None else gpus
    if gpus < 1 or not 0 < scaling <= 1:
        raise SpeedrunError(f"--gpus must be 1 or more and --scaling in (0, 1], got {gpus} and {scaling}")
    train_images = min(train_images, recipe.train_examples or train_images)
    val_images = min(val_images, recipe.val_examples or val_images)
    pace = gpus * scaling
    train_s = sum(p.epochs * train_images / (rates.at(p.size) * pace) for p in recipe.phases)
    evaluated = [e for e in range(recipe.epochs) if (e + 1) % recipe.eval_every == 0 or e == recipe.epochs - 1]
    eval_s = sum(val_images / (EVAL_SPEEDUP * rates.at(recipe.phase_at(e).size) * pace) for e in evaluated)
    return Projection(recipe.name, gpus, train_s, eval_s)
