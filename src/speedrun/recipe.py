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
from speedrun.inputs import Bound

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
# Bounds on what a recipe may ask for, so that a typo is one line at construction rather than a
# C++ stack or an out-of-memory minutes later. Generous: 4,096 px is 16x ImageNet's usual 256 px
# side, 65,536 images per device is 64x the record's largest per-GPU batch.
MAX_IMAGE_SIZE = 4096  # px, the side of a training or validation image
MAX_BATCH_SIZE = 65536  # images per device per step
MAX_EPOCHS = 10_000  # the last phase's end
# The same as command-line types (`--epochs`, eval's `--size` and `--batch-size`).
EPOCHS = Bound(int, 1, MAX_EPOCHS)
IMAGE_SIZE = Bound(int, 1, MAX_IMAGE_SIZE)
BATCH_SIZE = Bound(int, 1, MAX_BATCH_SIZE)


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

    def __post_init__(self) -> None:
        for name in ("lr", "ratio"):  # pairs read from JSON or written as lists
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        _refuse(self.problems(), f"phase (epochs {self.start!r}-{self.end!r})")

    @property
    def epochs(self) -> int:
        return self.end - self.start

    def problems(self) -> list[str]:
        """Every reason this phase cannot run, one line each (empty when it is valid)."""
        out = []
        if not (_int(self.start) and _int(self.end) and 0 <= self.start < self.end <= MAX_EPOCHS):
            out.append(f"epochs must be whole numbers with 0 <= start < end <= {MAX_EPOCHS}, "
                       f"got start {self.start!r}, end {self.end!r}")
        if not IMAGE_SIZE.holds(self.size):
            out.append(f"image size must be {IMAGE_SIZE} (pixels), got {self.size!r}")
        if not BATCH_SIZE.holds(self.batch_size):
            out.append(f"batch size must be {BATCH_SIZE} (images per device), got {self.batch_size!r}")
        out.extend(_lr_problems(self.lr))
        if not (_finite(self.min_scale) and 0 < self.min_scale <= 1):
            out.append(f"min_scale must be in (0, 1], got {self.min_scale!r}")
        if not (isinstance(self.ratio, tuple) and len(self.ratio) == 2 and all(_finite(r) and r > 0 for r in self.ratio)
                and self.ratio[0] <= self.ratio[1]):
            out.append(f"ratio must be a (low, high) pair of aspect ratios with 0 < low <= high, got {self.ratio!r}")
        if not (_finite(self.translate) and 0 <= self.translate <= 0.5):
            out.append(f"translate must be a fraction of the image side in [0, 0.5], got {self.translate!r}")
        if not (_finite(self.crop_pct) and 0 < self.crop_pct <= 1):
            out.append(f"crop_pct must be in (0, 1] (1.0: the whole image), got {self.crop_pct!r}")
        if self.copy is not None and not IMAGE_SIZE.holds(self.copy):
            out.append(f"unknown data copy {self.copy!r} (use a shorter-side size in px, or None for full size)")
        out.extend(f"{name} must be True or False, got {getattr(self, name)!r}"
                   for name in ("rect_val", "flip") if not isinstance(getattr(self, name), bool))
        return out

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

    def __post_init__(self) -> None:
        _refuse(self.problems(), "optimizer")

    def problems(self) -> list[str]:
        """Every reason these settings cannot run, one line each (empty when they are valid)."""
        out = []
        if self.name not in OPTIMIZERS:
            out.append(f"unknown optimizer {self.name!r} (choose from {', '.join(OPTIMIZERS)})")
        if self.no_decay not in NO_DECAY_MODES:
            out.append(f"unknown no_decay mode {self.no_decay!r} (choose from {', '.join(NO_DECAY_MODES)})")
        if not (_finite(self.momentum) and 0 <= self.momentum < 1):
            out.append(f"momentum must be in [0, 1), got {self.momentum!r}")
        if not isinstance(self.nesterov, bool):
            out.append(f"nesterov must be True or False, got {self.nesterov!r}")
        if not (_finite(self.weight_decay) and self.weight_decay >= 0):
            out.append(f"weight decay must be a number >= 0, got {self.weight_decay!r}")
        if not (_finite(self.label_smoothing) and 0 <= self.label_smoothing < 1):
            out.append(f"label smoothing must be in [0, 1), got {self.label_smoothing!r}")
        return out


@dataclass(frozen=True)
class Target:
    """Stop training at the first evaluation where `metric` >= `value` (a fraction, 0.93 = 93%)."""

    metric: str
    value: float

    def __post_init__(self) -> None:
        _refuse(self.problems(), "target")

    def problems(self) -> list[str]:
        """Every reason this target cannot be reached, one line each (empty when it is valid)."""
        out = []
        if self.metric not in METRICS:
            out.append(f"unknown metric {self.metric!r} (choose from {', '.join(METRICS)})")
        if not (_finite(self.value) and 0 < self.value <= 1):
            out.append(f"value must be a fraction in (0, 1], got {self.value!r}")
        return out

    @classmethod
    def parse(cls, text: str) -> Target:
        """Parse "top5=0.93" (or "top5=93", read as percent; or "top5>=0.93", as a target prints)."""
        metric, sep, value = text.replace(">=", "=", 1).partition("=")
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

    def __post_init__(self) -> None:
        if isinstance(self.phases, list):  # a list reads as naturally as a tuple; keep the Recipe hashable
            object.__setattr__(self, "phases", tuple(self.phases))
        problems = self.problems()
        if problems:
            raise RecipeError(problems)

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
        """Every reason this recipe cannot run, one line each (empty when it is valid). A Recipe
        and its parts check themselves when they are made, so this is empty for any Recipe that
        exists; it stays for callers that ask."""
        where = f"recipe {self.name!r}"
        out = []
        if not (isinstance(self.name, str) and self.name.strip()):
            out.append(f"{where}: name must be a non-empty string")
        if not (isinstance(self.phases, tuple) and all(isinstance(p, Phase) for p in self.phases)):
            return [*out, f"{where}: phases must be a tuple of speedrun.Phase, got {self.phases!r:.80}"]
        if not self.phases:
            return [*out, f"{where}: has no phases"]
        if self.phases[0].start != 0:
            out.append(f"{where}: the first phase starts at epoch {self.phases[0].start}, not 0")
        for i, p in enumerate(self.phases):
            at = f"{where}, phase {i} (epochs {p.start}-{p.end})"
            out.extend(f"{at}: {msg}" for msg in p.problems())
            if i > 0:
                prev = self.phases[i - 1]
                if p.start > prev.end:
                    out.append(f"{at}: gap after the previous phase (epochs {prev.end}-{p.start} have no phase)")
                elif p.start < prev.end:
                    out.append(f"{at}: overlaps the previous phase (which ends at epoch {prev.end})")
        for name in ("model", "dataset"):
            if not (isinstance(getattr(self, name), str) and getattr(self, name)):
                out.append(f"{where}: {name} must be a name (a non-empty string), got {getattr(self, name)!r}")
        if not isinstance(self.optimizer, OptimizerSettings):
            out.append(f"{where}: optimizer must be a speedrun.OptimizerSettings, got {self.optimizer!r}")
        else:
            out.extend(f"{where}, optimizer: {msg}" for msg in self.optimizer.problems())
        if self.target is not None and not isinstance(self.target, Target):
            out.append(f"{where}: target must be a speedrun.Target or None, got {self.target!r} "
                       "(Target.parse('top1=0.93') reads the command line's form)")
        elif self.target is not None:
            out.extend(f"{where}, target: {msg}" for msg in self.target.problems())
        if not (_int(self.world_size) and self.world_size >= 1):
            out.append(f"{where}: world_size must be a whole number >= 1, got {self.world_size!r}")
        if self.ema_decay is not None and not (_finite(self.ema_decay) and 0 < self.ema_decay < 1):
            out.append(f"{where}: ema_decay must be in (0, 1), got {self.ema_decay!r}")
        if not (_finite(self.scale_warmup_epochs) and self.scale_warmup_epochs >= 0):
            out.append(f"{where}: scale_warmup_epochs must be a number >= 0, got {self.scale_warmup_epochs!r}")
        if not (_int(self.eval_every) and self.eval_every >= 1):
            out.append(f"{where}: eval_every must be a whole number >= 1, got {self.eval_every!r}")
        for name in ("val_batch_size", "train_examples", "val_examples"):
            value = getattr(self, name)
            if value is not None and not (_int(value) and value > 0):
                out.append(f"{where}: {name} must be a positive integer or None, got {value!r}")
        out.extend(f"{where}: {name} must be True or False, got {getattr(self, name)!r}"
                   for name in ("eval_flip", "zero_init") if not isinstance(getattr(self, name), bool))
        if not isinstance(self.description, str):
            out.append(f"{where}: description must be a string, got {self.description!r}")
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
        data["phases"] = tuple(Phase(**p) for p in data["phases"])  # Phase makes JSON's lists pairs again
        data["optimizer"] = OptimizerSettings(**data["optimizer"])
        data["target"] = Target(**data["target"]) if data.get("target") else None
        return cls(**data)


def _lr_problems(lr: LearningRate) -> list[str]:
    if isinstance(lr, tuple):
        if len(lr) != 2:
            return [f"a linear LR is a (start, end) pair, got {lr!r}"]
        start, end = lr
        if not _finite(start) or start <= 0:
            return [f"LR must be a positive number, got start {start!r}"]
        # A ramp may end at exactly 0 (linear decay to zero), never below.
        if not _finite(end) or end < 0:
            return [f"LR must be a number >= 0, got end {end!r}"]
        return []
    if not _finite(lr) or lr <= 0:
        return [f"LR must be a positive number or a (start, end) pair, got {lr!r}"]
    return []


def _refuse(problems: list[str], where: str) -> None:
    if problems:
        raise RecipeError([f"{where}: {p}" for p in problems])


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
