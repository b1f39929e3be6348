"""`speedrun eval RUN_DIR`: score a run's checkpoint on the validation split, without training.

The weights are the ones the run evaluated (its EMA when it kept one); size, rectangular or
square validation and test-time flips default to the recipe's last phase and can be changed, so
one checkpoint can be scored several ways. Under torchrun each process evaluates its share, as
in training. Every evaluation is printed and appended to RUN_DIR/eval.jsonl.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from speedrun import checkpoint
from speedrun.data import build_source
from speedrun.dist import init_distributed, pick_device, processes, shutdown
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
    data = cfg.data if cfg.data is not None else saved.get("data")

    ctx = init_distributed(pick_device(cfg.device))
    try:
        source = build_source(recipe, data, ctx.device, cfg.workers, cfg.copies)
        try:
            weights = "ema" if saved.get("ema") is not None else "model"
            model = build_model(recipe.model, source.num_classes, source.channels)
            model.load_state_dict(saved[weights])
            model, channels_last = to_device(model, ctx.device)
            precision = choose_precision(cfg.precision, ctx.device.type, device_capability(ctx.device))
            batches = DeviceBatches(source, ctx.device, channels_last)
            metrics = evaluate(model, source, EvalSettings(size, batch_size, rect, flip, precision, last.copy, crop_pct), batches, ctx)
        finally:
            source.close()
        record = {
            "checkpoint_epoch": saved["state"]["epoch"], "weights": weights, "size": size, "rect": rect, "flip": flip,
            "crop_pct": crop_pct, "batch_size": batch_size, "data": data, "world_size": ctx.world_size, "precision": precision, **metrics,
        }
        if ctx.is_main:
            print(
                f"{cfg.run_dir}: epoch {record['checkpoint_epoch']} {weights} weights, {size}px "
                f"{'rect' if rect else 'square'} crop_pct {crop_pct:.3g}{' + flips' if flip else ''}, {metrics['count']} images on "
                f"{processes(ctx.world_size)}: loss {metrics['loss']:.4f}  top1 {100 * metrics['top1']:.2f}%  "
                f"top5 {100 * metrics['top5']:.2f}%",
                flush=True,
            )
            with open(cfg.run_dir / "eval.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
        return record
    finally:
        shutdown(ctx)
