"""Validation plans: which images go in which batch, and the output shape of each batch.

Square (the default): images in index order, cut into batches; every image is resized so its
shorter side is `resize_for(size, crop_pct)` px (int(size * 1.14) for the 2018 recipes) and
centre-cropped to size x size.

Rectangular (the 2018 recipe, docs/record.md, "Data handling"): sort the images by aspect
ratio w/h (stable, so ties keep index order), cut the sorted list into consecutive chunks of
`batch_size`, give every image its chunk's mean aspect ratio (rounded to 5 decimals, as the
original), resize the shorter side as for square plans, then centre-crop to short side = size
and long side = int(size * AR) (wide) or int(size / AR) (tall), rounded down to a multiple of
8 px. One chunk is one batch, so a batch has one shape.

Batches are then split across ranks in contiguous runs (`base.split_batches_contiguously`), so
every image is evaluated exactly once at any world size, with identical batches.
"""
from __future__ import annotations

from dataclasses import dataclass

import math

import numpy as np


@dataclass(frozen=True, eq=False)
class ValBatch:
    """One validation batch: dataset rows (an int64 array: no Python object per image, which
    counts at ImageNet's size) and the output size in pixels."""

    rows: np.ndarray
    height: int
    width: int


def resize_for(size: int, crop_pct: float) -> int:
    """Shorter side, in px, that validation resizes to before cropping `size` px: size / crop_pct
    (`Phase.crop_pct`), rounded down. The 1e-9 keeps exact quotients exact: 224 / (1 / 1.14) is
    255.36 either way, but 100 / (1 / 1.14) must be 114, not 113.99999999999999."""
    return math.floor(size / crop_pct + 1e-9)


def rect_shape(size: int, aspect: float) -> tuple[int, int]:
    """(height, width) in px for a chunk of mean aspect ratio `aspect` = w / h."""
    if aspect < 1:
        return int(size / aspect) // 8 * 8, size
    return size, int(size * aspect) // 8 * 8


def square_plan(num: int, size: int, batch_size: int) -> list[ValBatch]:
    """Index order, size x size crops."""
    rows = np.arange(num, dtype=np.int64)
    return [ValBatch(rows[i:i + batch_size], size, size) for i in range(0, num, batch_size)]


def rect_plan(widths: np.ndarray, heights: np.ndarray, size: int, batch_size: int) -> list[ValBatch]:
    """Aspect-ratio-sorted chunks with their chunk-mean crop shapes (see the module docstring)."""
    aspect = np.round(widths.astype(np.float64) / heights.astype(np.float64), 5)
    order = np.argsort(aspect, kind="stable").astype(np.int64)
    plan = []
    for i in range(0, len(order), batch_size):
        rows = order[i : i + batch_size]
        mean = round(float(np.mean(aspect[rows])), 5)
        height, width = rect_shape(size, mean)
        plan.append(ValBatch(rows, height, width))
    return plan
