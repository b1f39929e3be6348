"""What `speedrun tune` searches: a space of recipe changes as typed data.

A space maps a field name (FIELDS) to a `Range` (numbers, linear or log) or a `Choice` (a few
values). `default_space(recipe)` derives one from the recipe: an LR range from a third to three
times lr-find's suggestion, widened to hold a third to three times the recipe's own LR, a decade
of weight decay around the recipe's, half and double the batch size, the schedule 0.5-1.5x as
long, label smoothing 0-0.2, the first phase's image size or three quarters of it, EMA on or off.
A user's file (`--space FILE.py`) defines `space`, a dict of some of the same fields, and
replaces it:

    from speedrun.tune.space import Choice, Range
    space = {"lr_scale": Range(0.3, 3, log=True), "batch_size": Choice((64, 128))}

`apply(recipe, params)` is the recipe one trial trains: each field's meaning is below, in APPLY.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speedrun.errors import SpeedrunError
from speedrun.recipe import BATCH_SIZE, IMAGE_SIZE, MAX_EPOCHS, Phase, Recipe, RecipeError


@dataclass(frozen=True)
class Range:
    """Numbers from `low` to `high` (both included), drawn on a log scale when `log`; whole numbers when `integer`."""

    low: float
    high: float
    log: bool = False
    integer: bool = False

    def problems(self, name: str) -> list[str]:
        finite = all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                     for v in (self.low, self.high))
        if not finite:
            return [f"{name}: a range of numbers, got {self.low!r}..{self.high!r}"]
        if self.low > self.high:
            return [f"{name}: the range {self.low:g}..{self.high:g} is inverted (low > high)"]
        if self.low == self.high:
            return [f"{name}: the range {self.low:g}..{self.high:g} is empty: use Choice(({self.low:g},)) "
                    "to fix a value"]
        if self.log and self.low <= 0:
            return [f"{name}: a log range must be above 0, got {self.low:g}..{self.high:g}"]
        return []

    def distribution(self):
        import optuna

        if self.integer:
            return optuna.distributions.IntDistribution(int(self.low), int(self.high), log=self.log)
        return optuna.distributions.FloatDistribution(float(self.low), float(self.high), log=self.log)

    def __str__(self) -> str:
        return f"{self.low:.3g}..{self.high:.3g}{' (log)' if self.log else ''}"


@dataclass(frozen=True)
class Choice:
    """One of `values` (numbers or booleans)."""

    values: tuple

    def __post_init__(self) -> None:
        if isinstance(self.values, list):
            object.__setattr__(self, "values", tuple(self.values))

    def problems(self, name: str) -> list[str]:
        if not isinstance(self.values, tuple) or not self.values:
            return [f"{name}: a choice needs at least one value, got {self.values!r}"]
        if len(set(self.values)) != len(self.values):
            return [f"{name}: a choice lists a value twice: {self.values!r}"]
        return []

    def distribution(self):
        import optuna

        return optuna.distributions.CategoricalDistribution(self.values)

    def __str__(self) -> str:
        return " | ".join(str(v) for v in self.values)


Dimension = Range | Choice


def _scale_lr(lr, factor: float):
    return tuple(v * factor for v in lr) if isinstance(lr, tuple) else lr * factor


def _phases(recipe: Recipe, change: Callable[[int, Phase], Phase]) -> Recipe:
    return dataclasses.replace(recipe, phases=tuple(change(i, p) for i, p in enumerate(recipe.phases)))


def _batch(recipe: Recipe, size: int) -> Recipe:
    # Every phase's batch by the same factor, its LR too (the linear scaling rule: the same LR per image).
    factor = size / recipe.phases[0].batch_size
    return _phases(recipe, lambda i, p: dataclasses.replace(
        p, batch_size=max(1, round(p.batch_size * factor)), lr=_scale_lr(p.lr, factor)))


def _epochs(recipe: Recipe, scale: float) -> Recipe:
    return recipe.with_epochs(max(len(recipe.phases), min(MAX_EPOCHS, round(recipe.epochs * scale))))


# What each field does to a recipe (field -> recipe, value -> recipe), in the order they apply.
APPLY: dict[str, Callable[[Recipe, Any], Recipe]] = {
    # Every phase's LR times this (a recipe's LRs keep their shape: warmup, decay).
    "lr_scale": lambda r, v: _phases(r, lambda i, p: dataclasses.replace(p, lr=_scale_lr(p.lr, v))),
    "weight_decay": lambda r, v: dataclasses.replace(r, optimizer=dataclasses.replace(r.optimizer, weight_decay=v)),
    # The first phase's batch (images per device); the others keep their ratio to it, LRs scale with it.
    "batch_size": lambda r, v: _batch(r, int(v)),
    # The schedule stretched or cut to this fraction of its epochs (Recipe.with_epochs).
    "epochs_scale": _epochs,
    "label_smoothing": lambda r, v: dataclasses.replace(
        r, optimizer=dataclasses.replace(r.optimizer, label_smoothing=v)),
    # The first phase's training image side, px.
    "first_size": lambda r, v: _phases(r, lambda i, p: dataclasses.replace(p, size=int(v)) if i == 0 else p),
    # Evaluate a moving average of the weights (the recipe's decay, else 0.998) or the raw weights.
    "ema": lambda r, v: dataclasses.replace(r, ema_decay=(r.ema_decay or 0.998) if v else None),
}
FIELDS = tuple(APPLY)


def peak_lr(recipe: Recipe) -> float:
    """The largest LR anywhere in the recipe's phases (as the recipe writes it)."""
    return max(max(p.lr) if isinstance(p.lr, tuple) else p.lr for p in recipe.phases)


def default_space(recipe: Recipe, suggested_recipe_lr: float | None = None) -> dict[str, Dimension]:
    """The space derived from `recipe` (see the module's text); `suggested_recipe_lr`: lr-find's
    suggestion in the recipe's terms (LRFinding.recipe_lr), the centre of the LR range."""
    centre = suggested_recipe_lr / peak_lr(recipe) if suggested_recipe_lr else 1.0
    # The recipe's own LR stays inside: lr-find's rule is a rough guide (on Fashion-MNIST its loss
    # had not diverged by LR 10, and the suggestion was 3.6x the recipe's LR, which is tuned).
    wd = recipe.optimizer.weight_decay
    b, size = recipe.phases[0].batch_size, recipe.phases[0].size
    space: dict[str, Dimension] = {
        "lr_scale": Range(min(centre, 1.0) / 3, max(centre, 1.0) * 3, log=True),
        "weight_decay": Range(wd / 10, wd * 10, log=True) if wd > 0 else Range(1e-5, 1e-3, log=True),
        "batch_size": Choice(tuple(sorted({v for v in (b // 2, b, 2 * b) if BATCH_SIZE.holds(v)}))),
        "epochs_scale": Range(0.5, 1.5),
        "label_smoothing": Range(0.0, 0.2),
        "first_size": Choice(tuple(sorted({v for v in (round(size * 0.75), size) if IMAGE_SIZE.holds(v)}))),
        "ema": Choice((False, True)),
    }
    return {k: v for k, v in space.items() if not (isinstance(v, Choice) and len(v.values) < 2)}


def check_space(space: Any, where: str = "the search space") -> dict[str, Dimension]:
    """`space` if it is a dict of known fields to valid Ranges and Choices; else one SpeedrunError
    naming every problem."""
    if not isinstance(space, dict) or not space:
        raise SpeedrunError(f"{where} must be a non-empty dict of field -> Range or Choice (fields: "
                            f"{', '.join(FIELDS)}), got {space!r:.80}")
    problems = []
    for name, dim in space.items():
        if name not in APPLY:
            problems.append(f"unknown field {name!r} (fields: {', '.join(FIELDS)})")
        elif not isinstance(dim, Range | Choice):
            problems.append(f"{name}: a Range or a Choice, got {dim!r:.60}")
        else:
            problems.extend(dim.problems(name))
    if problems:
        raise SpeedrunError(f"{where}: " + "; ".join(problems))
    return space


def load_space(path: Path) -> dict[str, Dimension]:
    """The `space` a user's file defines (see the module's text), checked."""
    from speedrun.recipes import run_user_file

    if path.suffix != ".py" or not path.is_file():
        raise SpeedrunError(f"--space {path}: not a Python file (one that defines `space`)")
    module = run_user_file(path, "search space", SpeedrunError)
    return check_space(getattr(module, "space", None), f"search space file {str(path)!r}")


def apply(recipe: Recipe, params: dict[str, Any], name: str) -> Recipe:
    """The recipe a trial with `params` trains, called `name`; SpeedrunError when the values make a
    recipe that cannot run (a batch size past the bounds, say)."""
    out = recipe
    for field in FIELDS:
        if field in params:
            try:
                out = APPLY[field](out, params[field])
            except RecipeError as e:
                raise SpeedrunError(f"{field}={params[field]!r} makes a recipe that cannot run: {e}") from None
    return dataclasses.replace(out, name=name).validate()


def corners(space: dict[str, Dimension]) -> list[dict[str, Any]]:
    """The space's extreme points (every field at its low end, every field at its high end, each
    choice's every value beside the others' low ends): what is checked before any trial starts."""
    low = {k: d.low if isinstance(d, Range) else d.values[0] for k, d in space.items()}
    high = {k: d.high if isinstance(d, Range) else d.values[-1] for k, d in space.items()}
    out = [low, high]
    for k, d in space.items():
        if isinstance(d, Choice):
            out.extend({**low, k: v} for v in d.values[1:])
    return out


def describe(space: dict[str, Dimension]) -> dict[str, str]:
    """The space as printable text, field -> range or choices."""
    return {k: str(d) for k, d in space.items()}
