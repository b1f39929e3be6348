"""A training schedule as typed data.

A `Recipe` is a list of `Phase`s over epochs plus the settings that do not change during a run
(model, data, optimizer, target). Everything the training loop needs to know about *when* to
do *what* comes from here: the learning rate at any iteration, the image size and batch size of
any epoch, and whether a phase change needs new data or only a new batch size.

Recipes are plain Python: the built-ins live in `speedrun.recipes`, and a user's recipe is a
Python file that defines a module-level variable `recipe` (see `speedrun.recipes.load_recipe`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from speedrun.errors import SpeedrunError

LearningRate = float | tuple[float, float]

METRICS = ("top1", "top5")
OPTIMIZERS = ("sgd", "lars")
NO_DECAY_MODES = ("norm_bias", "bn", "none")
# Evaluation keeps this fraction of the resized image (timm's crop_pct): the shorter side is
# resized to size / crop_pct px, then centre-cropped to size. 1/1.14 is the 2018 record's (and
# torchvision's 256 -> 224) convention; 1.0 shows small images whole.
IMAGENET_CROP_PCT = 1 / 1.14
IMAGENET_RATIO = (3 / 4, 4 / 3)  # torchvision's RandomResizedCrop aspect-ratio range (w / h)
PRECISIONS = ("auto", "bf16", "fp16", "fp32")  # a run's --precision (learner.choose_precision)
MEMORY_FORMATS = ("auto", "channels_last", "contiguous")  # a run's --memory-format (speedrun.memory_format)


class RecipeError(SpeedrunError, ValueError):
    """A recipe that cannot run. `problems` holds one human-readable line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


@dataclass(frozen=True)
class Phase:
    """One stretch of epochs with fixed data settings and one LR rule.

    Epochs run from `start` (inclusive) to `end` (exclusive). `lr` is either a constant or a
    `(start_lr, end_lr)` pair interpolated linearly per iteration across the phase.
    """

    start: int
    end: int
    size: int  # training crop size, pixels (square)
    batch_size: int  # images per device per step
    lr: LearningRate
    min_scale: float = 0.08  # smallest RandomResizedCrop area fraction (torchvision's default)
    rect_val: bool = False  # rectangular validation (aspect-ratio buckets) instead of centre crop
    copy: int | None = None  # resized dataset copy to read, by shorter side in px; None = full size
    # The training crop's geometry. `ratio`: its aspect ratio (w / h) range, drawn log-uniformly
    # (torchvision's 3/4..4/3 stretches images; (1, 1) keeps their shape). `translate`: how far a
    # crop may reach past each edge, as a fraction of that side (zeros there): pad-and-crop
    # translation, 0 for none. `flip`: mirror half the images at random (not for digits or text).
    ratio: tuple[float, float] = IMAGENET_RATIO
    translate: float = 0.0
    flip: bool = True
    crop_pct: float = IMAGENET_CROP_PCT  # evaluation geometry; see IMAGENET_CROP_PCT

    @property
    def epochs(self) -> int:
        return self.end - self.start

    @property
    def data_key(self) -> tuple:
        """What decides the training data pipeline: phases with equal keys share one loader,
        and only the batch size may change between them."""
        return (self.size, self.min_scale, self.copy, self.ratio, self.translate, self.flip)

    def lr_at(self, epoch: float) -> float:
        """LR at a fractional epoch inside this phase (before any world-size scaling)."""
        if isinstance(self.lr, tuple):
            lr0, lr1 = self.lr
            progress = (epoch - self.start) / self.epochs
            return lr0 + (lr1 - lr0) * progress
        return float(self.lr)


@dataclass(frozen=True)
class OptimizerSettings:
    """SGD (or LARS) settings that hold for the whole run."""

    name: str = "sgd"  # "sgd" or "lars"
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 1e-4
    # Which parameters get no weight decay: "norm_bias" (every norm weight and every bias),
    # "bn" (BatchNorm weight and bias only, exactly as the 2018 code), or "none".
    no_decay: str = "norm_bias"
    label_smoothing: float = 0.0


@dataclass(frozen=True)
class Target:
    """Stop training at the first evaluation where `metric` >= `value` (a fraction, 0.93 = 93%)."""

    metric: str
    value: float

    @classmethod
    def parse(cls, text: str) -> Target:
        """Parse "top5=0.93" (or "top5=93", read as percent)."""
        metric, sep, value = text.partition("=")
        metric = metric.strip().lower()
        if not sep or metric not in METRICS:
            raise RecipeError([f"target {text!r}: expected METRIC=VALUE with METRIC one of {', '.join(METRICS)}"])
        try:
            number = float(value)
        except ValueError:
            raise RecipeError([f"target {text!r}: {value!r} is not a number"]) from None
        return cls(metric, number / 100 if number > 1 else number)

    def __str__(self) -> str:
        return f"{self.metric}>={self.value:.4g}"


@dataclass(frozen=True)
class Recipe:
    """A whole training run as data. See the module docstring."""

    name: str
    phases: tuple[Phase, ...]
    model: str = "resnet50"
    dataset: str = "imagefolder"  # "imagefolder" or "fashion-mnist" (data.DATASETS)
    world_size: int = 1  # devices the schedule was written for (the LR rule scales from this)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    target: Target | None = None
    eval_every: int = 1  # evaluate every k epochs (and always after the last one)
    eval_flip: bool = False  # test-time augmentation: average the logits of each image and its mirror
    ema_decay: float | None = None  # evaluate and save a moving average of the weights (per step)
    # Each residual block's last norm starts at zero, so blocks start as the identity (Goyal et al.
    # 2017); False keeps PyTorch's default of one.
    zero_init: bool = True
    val_batch_size: int | None = None  # per device; defaults to the phase's batch size
    train_examples: int | None = None  # use only the first N training examples (quick runs)
    val_examples: int | None = None  # use only the first N validation examples
    # On more devices than `world_size`, the LR ramps from the recipe's own value to the scaled
    # one over this many epochs (Goyal et al. 2017 used 5): a scaled LR at step 0 can diverge.
    scale_warmup_epochs: float = 5.0
    description: str = ""

    @property
    def epochs(self) -> int:
        return self.phases[-1].end if self.phases else 0

    def phase_at(self, epoch: int) -> Phase:
        """The phase that covers `epoch` (0-based)."""
        for phase in self.phases:
            if phase.start <= epoch < phase.end:
                return phase
        raise IndexError(f"epoch {epoch} is outside recipe {self.name!r} (0..{self.epochs - 1})")

    def lr_scale(self, world_size: int) -> float:
        """The linear scaling rule: batch sizes are per device, so running on a different
        number of devices changes the global batch by world_size / self.world_size, and the LR
        is scaled by the same factor (Goyal et al. 2017)."""
        return world_size / self.world_size

    def lr_scale_at(self, epoch: float, world_size: int) -> float:
        """The factor on the recipe's LR at a fractional epoch: `lr_scale`, reached gradually
        over `scale_warmup_epochs` when it is above 1 (Goyal et al. 2017's gradual warmup)."""
        scale = self.lr_scale(world_size)
        if scale <= 1 or self.scale_warmup_epochs <= 0:
            return scale
        return 1 + (scale - 1) * min(1.0, epoch / self.scale_warmup_epochs)

    def lr_at(self, epoch: int, step: int, steps_per_epoch: int, world_size: int | None = None) -> float:
        """LR for iteration `step` (0-based) of `epoch`, which has `steps_per_epoch` iterations.

        Linear phases interpolate on the fractional epoch epoch + step / steps_per_epoch, so the
        LR moves every iteration and a batch-size change at a phase edge changes only how many
        iterations share the same range. With `world_size` given, the linear scaling rule applies
        (with its warmup, `lr_scale_at`).
        """
        at = epoch + step / steps_per_epoch
        lr = self.phase_at(epoch).lr_at(at)
        return lr * (self.lr_scale_at(at, world_size) if world_size else 1.0)

    def with_epochs(self, epochs: int) -> Recipe:
        """The same recipe cut to `epochs` epochs (the last phase keeps its LR line up to the cut),
        or every phase stretched by epochs / self.epochs when it is longer (the same LRs at the
        same fraction of the run)."""
        if epochs <= 0:
            raise RecipeError([f"--epochs must be positive, got {epochs}"])
        if epochs > self.epochs:
            # Stretching never merges phases: boundaries at least one epoch apart, scaled by a
            # factor above 1, stay at least one epoch apart after rounding.
            factor = epochs / self.epochs
            edge = lambda e: round(e * factor)  # noqa: E731
            return dataclasses.replace(
                self, phases=tuple(dataclasses.replace(p, start=edge(p.start), end=edge(p.end)) for p in self.phases)
            )
        kept = [p for p in self.phases if p.start < epochs]
        last = kept[-1]
        if last.end != epochs and isinstance(last.lr, tuple):
            # Keep the LR line: evaluate it at the new end instead of the old one.
            last_lr = (last.lr[0], last.lr_at(epochs))
        else:
            last_lr = last.lr
        kept[-1] = dataclasses.replace(last, end=epochs, lr=last_lr)
        return dataclasses.replace(self, phases=tuple(kept))

    def problems(self) -> list[str]:
        """Every reason this recipe cannot run, one line each (empty when it is valid)."""
        out: list[str] = []
        where = f"recipe {self.name!r}"
        if not self.phases:
            return [f"{where}: has no phases"]
        if self.phases[0].start != 0:
            out.append(f"{where}: the first phase starts at epoch {self.phases[0].start}, not 0")
        for i, p in enumerate(self.phases):
            at = f"{where}, phase {i} (epochs {p.start}-{p.end})"
            if p.end <= p.start:
                out.append(f"{at}: ends before it starts")
            if i > 0:
                prev = self.phases[i - 1]
                if p.start > prev.end:
                    out.append(f"{at}: gap after the previous phase (epochs {prev.end}-{p.start} have no phase)")
                elif p.start < prev.end:
                    out.append(f"{at}: overlaps the previous phase (which ends at epoch {prev.end})")
            if not isinstance(p.size, int) or p.size <= 0:
                out.append(f"{at}: image size must be a positive number of pixels, got {p.size!r}")
            if not isinstance(p.batch_size, int) or p.batch_size <= 0:
                out.append(f"{at}: batch size must be a positive integer, got {p.batch_size!r}")
            out.extend(f"{at}: {msg}" for msg in _lr_problems(p.lr))
            if not (0 < p.min_scale <= 1):
                out.append(f"{at}: min_scale must be in (0, 1], got {p.min_scale!r}")
            if not (isinstance(p.ratio, tuple) and len(p.ratio) == 2 and all(_finite(r) and r > 0 for r in p.ratio)
                    and p.ratio[0] <= p.ratio[1]):
                out.append(f"{at}: ratio must be a (low, high) pair of aspect ratios with 0 < low <= high, "
                           f"got {p.ratio!r}")
            if not (_finite(p.translate) and 0 <= p.translate <= 0.5):
                out.append(f"{at}: translate must be a fraction of the image side in [0, 0.5], got {p.translate!r}")
            if not (_finite(p.crop_pct) and 0 < p.crop_pct <= 1):
                out.append(f"{at}: crop_pct must be in (0, 1] (1.0: the whole image), got {p.crop_pct!r}")
            if p.copy is not None and (not isinstance(p.copy, int) or isinstance(p.copy, bool) or p.copy <= 0):
                out.append(f"{at}: unknown data copy {p.copy!r} (use a shorter-side size in px, or None for full size)")
        opt = self.optimizer
        if opt.name not in OPTIMIZERS:
            out.append(f"{where}: unknown optimizer {opt.name!r} (choose from {', '.join(OPTIMIZERS)})")
        if opt.no_decay not in NO_DECAY_MODES:
            out.append(f"{where}: unknown no_decay mode {opt.no_decay!r} (choose from {', '.join(NO_DECAY_MODES)})")
        if not (0 <= opt.momentum < 1):
            out.append(f"{where}: momentum must be in [0, 1), got {opt.momentum!r}")
        if opt.weight_decay < 0:
            out.append(f"{where}: weight decay must be >= 0, got {opt.weight_decay!r}")
        if not (0 <= opt.label_smoothing < 1):
            out.append(f"{where}: label smoothing must be in [0, 1), got {opt.label_smoothing!r}")
        if self.target is not None:
            if self.target.metric not in METRICS:
                out.append(f"{where}: unknown target metric {self.target.metric!r} (choose from {', '.join(METRICS)})")
            if not (0 < self.target.value <= 1):
                out.append(f"{where}: target value must be a fraction in (0, 1], got {self.target.value!r}")
        if self.world_size < 1:
            out.append(f"{where}: world_size must be >= 1, got {self.world_size!r}")
        if self.ema_decay is not None and not (0 < self.ema_decay < 1):
            out.append(f"{where}: ema_decay must be in (0, 1), got {self.ema_decay!r}")
        if self.scale_warmup_epochs < 0:
            out.append(f"{where}: scale_warmup_epochs must be >= 0, got {self.scale_warmup_epochs!r}")
        if self.eval_every < 1:
            out.append(f"{where}: eval_every must be >= 1, got {self.eval_every!r}")
        for name in ("val_batch_size", "train_examples", "val_examples"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                out.append(f"{where}: {name} must be a positive integer or None, got {value!r}")
        return out

    def validate(self) -> Recipe:
        """Raise `RecipeError` listing every problem; return self when there are none."""
        problems = self.problems()
        if problems:
            raise RecipeError(problems)
        return self

    def table(self) -> list[dict]:
        """The phases as rows of short strings and numbers, for printing (`speedrun recipes`)."""
        return [
            {
                "epochs": f"{p.start}-{p.end}",
                "size": p.size,
                "batch": p.batch_size,
                "lr": f"{p.lr[0]:.4g} -> {p.lr[1]:.4g}" if isinstance(p.lr, tuple) else f"{p.lr:.4g}",
                # Training crop: area fraction, aspect ratio ("=" kept), translation, flips.
                "crop": " ".join(filter(None, (
                    f"{p.min_scale:g}-1",
                    "ar=" if p.ratio == (1.0, 1.0) else f"ar{p.ratio[0]:.3g}-{p.ratio[1]:.3g}",
                    f"t{p.translate:.2g}" if p.translate else "",
                    "flip" if p.flip else ""))),
                "eval": f"{'rect' if p.rect_val else 'square'} {p.crop_pct:.3g}",
                "data": f"{p.copy} px copy" if p.copy else "full size",
            }
            for p in self.phases
        ]

    def to_dict(self) -> dict:
        """Plain-data form (JSON-serialisable), used in checkpoints and results."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Recipe:
        data = dict(data)
        data["phases"] = tuple(
            Phase(**{**p, "lr": tuple(p["lr"]) if isinstance(p["lr"], list | tuple) else p["lr"],
                      **({"ratio": tuple(p["ratio"])} if "ratio" in p else {})})
            for p in data["phases"]
        )
        data["optimizer"] = OptimizerSettings(**data["optimizer"])
        data["target"] = Target(**data["target"]) if data.get("target") else None
        return cls(**data)


def _lr_problems(lr: LearningRate) -> list[str]:
    if isinstance(lr, tuple):
        if len(lr) != 2:
            return [f"a linear LR is a (start, end) pair, got {lr!r}"]
        start, end = lr
        if not _finite(start) or start <= 0:
            return [f"LR must be positive, got start {start!r}"]
        # A ramp may end at exactly 0 (linear decay to zero), never below.
        if not _finite(end) or end < 0:
            return [f"LR must not be negative, got end {end!r}"]
        return []
    if not _finite(lr) or lr <= 0:
        return [f"LR must be positive, got {lr!r}"]
    return []


def _finite(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
