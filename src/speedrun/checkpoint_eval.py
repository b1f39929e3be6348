"""`speedrun eval RUN_DIR`: score a run's checkpoint on the validation split, without training.

The weights are the ones the run evaluated (its EMA when it kept one); size, rectangular or
square validation and test-time flips default to the recipe's last phase and can be changed, so
one checkpoint can be scored several ways. Under torchrun each process evaluates its share, as
in training. Every evaluation is printed and appended to RUN_DIR/eval.jsonl (the data path made
absolute); a run directory that cannot be written to gets the metrics printed and one line saying
they were not recorded. Data whose classes are not the ones the checkpoint was trained on is
refused: its labels would not mean what the weights' outputs mean.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from speedrun import checkpoint
from speedrun.config import absolute_data
from speedrun.data import build_source
from speedrun.dist import init_distributed, job_share, pick_device, processes, shutdown
from speedrun.errors import SpeedrunError
from speedrun.files import to_json
from speedrun.learner import DeviceBatches, EvalSettings, choose_precision, device_capability, evaluate, to_device
from speedrun.model import build_model
from speedrun.recipe import Recipe


@dataclass
class EvalConfig:
    """What `speedrun eval` passes in; None means "as the run's recipe says"."""

    run_dir: Path
    data: str | None = None  # None: the data path the run trained on
    size: int | None = None  # pixels; None: the last phase's size
    rect: bool | None = None  # rectangular validation; None: the last phase's rect_val
    flip: bool | None = None  # test-time flips; None: the recipe's eval_flip
    crop_pct: float | None = None  # fraction of the resized image kept (Phase.crop_pct); None: the last phase's
    batch_size: int | None = None  # per device; None: the recipe's validation batch size
    device: str | None = None
    precision: str = "auto"
    workers: int | None = None
    copies: str | None = None


def evaluate_run(cfg: EvalConfig) -> dict[str, Any]:
    """Evaluate RUN_DIR/checkpoint.pt; returns the record also appended to RUN_DIR/eval.jsonl."""
    path = cfg.run_dir / "checkpoint.pt"
    saved = checkpoint.load_run(path)
    recipe = Recipe.from_dict(saved["recipe"])
    last = recipe.phases[-1]
    size = cfg.size or last.size
    rect = last.rect_val if cfg.rect is None else cfg.rect
    flip = recipe.eval_flip if cfg.flip is None else cfg.flip
    crop_pct = cfg.crop_pct or last.crop_pct
    batch_size = cfg.batch_size or recipe.val_batch_size or last.batch_size
    data = absolute_data(cfg.data if cfg.data is not None else saved.get("data"))

    ctx = init_distributed(pick_device(cfg.device))
    try:
        source = build_source(recipe, data, ctx.device, cfg.workers, cfg.copies, job=job_share(ctx))
        try:
            note = check_classes(saved["state"], source, data)
            weights = "ema" if saved.get("ema") is not None else "model"
            model = build_model(recipe.model, source.num_classes, source.channels)
            try:
                model.load_state_dict(saved[weights])
            except RuntimeError as e:  # a checkpoint without a class count: the last layer's size tells
                if "size mismatch" not in str(e):
                    raise
                raise SpeedrunError(f"{data or recipe.dataset} has {source.num_classes} classes, not as many as the "
                                    "checkpoint's weights were trained on: "
                                    "give data with the same class folders") from None
            if note and ctx.is_main:
                print(f"speedrun: {note}", file=sys.stderr, flush=True)
            model, channels_last = to_device(model, ctx.device)
            precision = choose_precision(cfg.precision, ctx.device.type, device_capability(ctx.device))
            batches = DeviceBatches(source, ctx.device, channels_last)
            settings = EvalSettings(size, batch_size, rect, flip, precision, last.copy, crop_pct)
            try:
                metrics = evaluate(model, source, settings, batches, ctx)
            except (RuntimeError, torch.OutOfMemoryError) as e:
                if not out_of_memory(e):
                    raise
                raise SpeedrunError(f"--size {size} with --batch-size {batch_size}: a batch does not fit in "
                                    f"{ctx.device.type} memory; give a smaller --size or --batch-size") from None
        finally:
            source.close()
        record = {
            "checkpoint_epoch": saved["state"]["epoch"], "weights": weights, "size": size, "rect": rect, "flip": flip,
            "crop_pct": crop_pct, "batch_size": batch_size, "data": data, "world_size": ctx.world_size,
            "precision": precision, **metrics,
        }
        if ctx.is_main:
            print(
                f"{cfg.run_dir}: epoch {record['checkpoint_epoch']} {weights} weights, {size}px "
                f"{'rect' if rect else 'square'} crop_pct {crop_pct:.3g}{' + flips' if flip else ''}, "
                f"{metrics['count']} images on "
                f"{processes(ctx.world_size)}: loss {metrics['loss']:.4f}  top1 {100 * metrics['top1']:.2f}%  "
                f"top5 {100 * metrics['top5']:.2f}%",
                flush=True,
            )
            try:
                with open(cfg.run_dir / "eval.jsonl", "a") as f:
                    f.write(to_json(record) + "\n")
            except OSError as e:  # a read-only copy of a run, say: the metrics above still count
                print(f"speedrun: not recorded in {cfg.run_dir / 'eval.jsonl'} ({e.strerror or e}); "
                      "the metrics above are "
                      "all there is of this evaluation", file=sys.stderr, flush=True)
        return record
    finally:
        shutdown(ctx)


def check_classes(state: dict[str, Any], source: Any, data: str | None) -> str | None:
    """SpeedrunError when `source`'s classes are not the ones the checkpoint (its `state`) was
    trained on: other names, another order or another count would score against the wrong labels.
    Returns a note when the checkpoint predates recorded classes (then only the count is checked,
    by the size of the model's last layer)."""
    where = data or "the data"
    trained, count = state.get("classes"), state.get("num_classes")
    if count is None:
        return ("the checkpoint records no class names (made before speedrun recorded them): "
                "only their number is checked")
    if count != source.num_classes:
        raise SpeedrunError(f"{where} has {source.num_classes} classes, the checkpoint was trained on {count}: "
                            "give data with the same class folders")
    found = getattr(source, "classes", None)
    if trained is not None and found is not None and [str(c) for c in found] != trained:
        pairs = [(a, b) for a, b in zip(found, trained) if str(a) != b]
        shown = ", ".join(f"{a!r} where the run had {b!r}" for a, b in pairs[:2]) + (", ..." if len(pairs) > 2 else "")
        raise SpeedrunError(f"{where} has other classes than the checkpoint was trained on ({shown}): its labels "
                            "would not match; give data with the same class folders")
    return None


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation that failed (CPU or GPU), not a bug."""
    return (isinstance(error, torch.OutOfMemoryError)
            or "can't allocate memory" in str(error) or "out of memory" in str(error))
