"""The learning-rate range test (Smith 2015, "Cyclical Learning Rates"; fastai's `lr_find`): train
a fresh model on the recipe's first phase (its image size, batch size and data) while the LR grows
exponentially from `start` to `end`, one value per step, and watch the loss. The loss falls while
the LR is useful and shoots up once it is too large; the suggestion is taken from the smoothed
curve below that point.

    finding = lr_find(recipe, data)           # speedrun.lr_find
    finding.suggested_lr                      # for one device and the first phase's batch
    finding.recipe_lr                         # the same, as the recipe writes it (its world_size)
    write_finding(finding, Path("out"))       # lr_find.json and lr_find.png

Nothing of a run is touched: the model is made and thrown away here, no run directory is claimed,
and only lr_find.json and lr_find.png are written where asked.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speedrun.errors import SpeedrunError
from speedrun.files import to_json
from speedrun.recipe import Recipe

SMOOTHING = 0.98  # exponential moving average of the loss, bias-corrected (fastai's beta)
DIVERGED = 4.0  # the test stops once the smoothed loss is this many times its minimum so far (fastai's)
RULE = "minimum/10: a tenth of the LR at the smoothed loss's minimum (fastai's lr_min)"


@dataclass(frozen=True)
class LRFinding:
    """What the range test saw, step by step, and what it suggests. LRs are per step on one device
    with the first phase's batch size (`batch_size` images per step); `recipe_lr` is the suggestion
    in the recipe's own terms (its LRs are written for `world_size` devices: linear scaling)."""

    recipe: str
    size: int  # px, the first phase's training image side
    batch_size: int  # images per step
    world_size: int  # devices the recipe's LRs are written for
    lrs: list[float]
    losses: list[float]  # each step's training loss
    smoothed: list[float]  # the same, smoothed (SMOOTHING)
    suggested_lr: float  # the rule's LR, for one device
    rule: str
    min_loss_lr: float  # where the smoothed loss was lowest
    steepest_lr: float  # where the smoothed loss fell fastest per log-LR
    diverged_lr: float | None  # the LR at which the smoothed loss passed DIVERGED x its minimum; None: never

    @property
    def recipe_lr(self) -> float:
        """The suggested peak LR as the recipe writes LRs: for its `world_size` devices."""
        return self.suggested_lr * self.world_size

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "recipe_lr": self.recipe_lr}


def lr_ramp(start: float, end: float, steps: int) -> list[float]:
    """`steps` LRs growing exponentially from `start` to `end` (both included)."""
    if not (math.isfinite(start) and math.isfinite(end) and 0 < start < end):
        raise SpeedrunError(f"the LR range must grow: 0 < --start < --end, got start {start:g}, end {end:g}")
    if steps < 2:
        raise SpeedrunError(f"--steps must be at least 2, got {steps}")
    return [start * (end / start) ** (i / (steps - 1)) for i in range(steps)]


def smooth(losses: list[float], beta: float = SMOOTHING) -> list[float]:
    """The bias-corrected exponential moving average of `losses` (each point: what it had seen)."""
    out, avg = [], 0.0
    for i, loss in enumerate(losses, start=1):
        avg = beta * avg + (1 - beta) * loss
        out.append(avg / (1 - beta ** i))
    return out


def suggest(recipe: Recipe, batch_size: int, size: int, lrs: list[float], losses: list[float]) -> LRFinding:
    """The finding for a test that trained at `lrs` with these losses (as many, or fewer when it
    stopped early; the last one may be NaN or infinite, where it diverged): the curve up to the
    divergence point, and the rule's suggestion below it."""
    if len(losses) < 3 or not all(math.isfinite(x) for x in losses[:2]):
        raise SpeedrunError(f"the loss diverged within the first steps (LR {lrs[0]:g}): "
                            "start the range lower (--start)")
    lrs = lrs[:len(losses)]
    smoothed = smooth(losses)
    best, diverged = math.inf, None
    for i, s in enumerate(smoothed):
        if not math.isfinite(s) or s > DIVERGED * best:
            diverged = i
            break
        best = min(best, s)
    usable = smoothed[:diverged] if diverged is not None else smoothed
    low = min(range(len(usable)), key=usable.__getitem__)
    # Steepest: the largest fall of the smoothed loss per unit of log LR, before its minimum.
    slopes = [(usable[i + 1] - usable[i]) / math.log(lrs[i + 1] / lrs[i]) for i in range(max(1, low))
              if i + 1 < len(usable)]
    steep = min(range(len(slopes)), key=slopes.__getitem__) if slopes else 0
    return LRFinding(recipe=recipe.name, size=size, batch_size=batch_size, world_size=recipe.world_size,
                     lrs=lrs, losses=losses, smoothed=smoothed, suggested_lr=lrs[low] / 10, rule=RULE,
                     min_loss_lr=lrs[low], steepest_lr=lrs[steep],
                     diverged_lr=lrs[diverged] if diverged is not None else None)


def lr_find(recipe: Recipe, data: str | None = None, *, start: float = 1e-6, end: float = 10.0, steps: int = 100,
            device: str | None = None, seed: int = 0, workers: int | None = None, copies: str | None = None,
            loader: str = "auto", say=None) -> LRFinding:
    """Run the range test on `recipe`'s first phase with the data at `data` (as `speedrun train
    --data`): `steps` optimizer steps of a fresh model (seed `seed`), the LR from `start` to `end`,
    stopped early once the smoothed loss passes DIVERGED x its minimum or is not finite. `say`,
    if given, gets a line every tenth of the way."""
    import torch

    from speedrun.config import TrainConfig
    from speedrun.data import build_source
    from speedrun.dist import init_distributed, pick_device
    from speedrun.engine import PhaseStreams
    from speedrun.learner import DeviceBatches, build_learner
    from speedrun.optim import set_lr

    lrs = lr_ramp(start, end, steps)
    phase = recipe.phases[0]
    ctx = init_distributed(pick_device(device))
    if ctx.world_size > 1:
        raise SpeedrunError("lr-find runs in one process: start it without torchrun or --nproc-per-node")
    cfg = TrainConfig(recipe=recipe, data=data, device=device, seed=seed, workers=workers, copies=copies,
                      loader=loader)
    torch.manual_seed(seed)
    source = build_source(recipe, data, ctx.device, workers, copies, loader)
    streams = PhaseStreams(source, ctx, seed)
    try:
        learner = build_learner(cfg, ctx, source)
        batches = DeviceBatches(source, ctx.device, learner.channels_last)
        learner.net.train()
        losses: list[float] = []
        avg, best = 0.0, math.inf  # the smoothed loss as it goes (smooth()), and its minimum so far
        for i, (lr, (images, labels)) in enumerate(zip(lrs, endless(streams, phase)), start=1):
            set_lr(learner.optimizer, lr)
            loss = learner.step(*batches.to_device(images, labels), i).item()
            losses.append(loss)
            if not math.isfinite(loss):  # diverged: the last point, where it did
                break
            if say and i % max(1, steps // 10) == 0:
                say(f"step {i}/{steps}: LR {lr:.3g}, loss {loss:.4f}")
            avg = SMOOTHING * avg + (1 - SMOOTHING) * loss
            smoothed = avg / (1 - SMOOTHING ** i)
            if smoothed > DIVERGED * best:
                break
            best = min(best, smoothed)
    finally:
        streams.close()
        source.close()
    return suggest(recipe, phase.batch_size, phase.size, lrs, losses)


def endless(streams, phase):
    """The phase's training batches, epoch after epoch (a range test may outlast one epoch)."""
    for epoch in itertools.count():
        yield from streams.for_epoch(phase, epoch)


def write_finding(finding: LRFinding, out: Path) -> tuple[Path, Path]:
    """lr_find.json (every point and the suggestion) and lr_find.png (the loss against the LR, log
    scale, the suggestion and the divergence point marked) in `out`; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / "lr_find.json", out / "lr_find.png"
    json_path.write_text(to_json(finding.to_dict(), indent=1) + "\n")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(finding.lrs, finding.losses, alpha=0.3, label="loss")
    ax.plot(finding.lrs, finding.smoothed, label="smoothed loss")
    ax.axvline(finding.suggested_lr, color="green", linestyle="--",
               label=f"suggested {finding.suggested_lr:.3g} ({finding.rule.split(':')[0]})")
    if finding.diverged_lr is not None:
        ax.axvline(finding.diverged_lr, color="red", linestyle=":", label=f"diverged at {finding.diverged_lr:.3g}")
    ax.set_xscale("log")
    finite = [s for s in finding.smoothed if math.isfinite(s)]
    ax.set_ylim(min(finite) * 0.9, min(max(finite), DIVERGED * min(finite)) * 1.1)
    ax.set_xlabel(f"learning rate (one device, batch {finding.batch_size})")
    ax.set_ylabel("training loss")
    ax.set_title(f"LR range test: {finding.recipe}, {finding.size} px")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return json_path, png_path
