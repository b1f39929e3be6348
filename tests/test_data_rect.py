"""Validation plans and batches: rectangular (docs/record.md, "Data handling") and square."""
from __future__ import annotations

import numpy as np
import pytest

from speedrun.data.base import Shard
from speedrun.data.imagefolder import ImageFolderSource
from speedrun.data.rect import rect_plan, rect_shape, resize_for, square_plan
from test_data_helpers import make_tree


def test_rect_shape_rule():
    # Wide: height = size, width = int(size * AR) down to a multiple of 8.
    assert rect_shape(288, 4 / 3) == (288, 384)
    assert rect_shape(224, 1.5) == (224, 336)
    assert rect_shape(224, 1.4) == (224, 312)  # int(313.6) = 313 -> 312
    # Tall: width = size, height = int(size / AR) down to a multiple of 8.
    assert rect_shape(224, 0.75) == (296, 224)  # int(298.67) = 298 -> 296
    assert rect_shape(128, 1.0) == (128, 128)
    # crop_pct 1/1.14: the record's int(size * 1.14) at every size its recipes use.
    assert [resize_for(s, 1 / 1.14) for s in (128, 224, 288)] == [145, 255, 328]
    assert resize_for(100, 1 / 1.14) == 114 and resize_for(28, 1.0) == 28  # exact quotients stay exact


def test_rect_plan_sorts_by_aspect_and_uses_chunk_means():
    rng = np.random.default_rng(0)
    widths = rng.integers(100, 500, size=37)
    heights = rng.integers(100, 500, size=37)
    plan = rect_plan(widths, heights, size=64, batch_size=8)
    assert [len(b.rows) for b in plan] == [8, 8, 8, 8, 5]
    rows = [r for b in plan for r in b.rows]
    assert sorted(rows) == list(range(37))  # every image exactly once
    aspect = np.round(widths / heights, 5)
    assert np.all(np.diff(aspect[rows]) >= 0)  # in aspect-ratio order
    for b in plan:
        mean = round(float(np.mean(aspect[list(b.rows)])), 5)
        assert (b.height, b.width) == rect_shape(64, mean)
        assert b.height % 8 == 0 and b.width % 8 == 0 and min(b.height, b.width) == 64
    # Shapes grow wider along the sorted list.
    assert [b.width / b.height for b in plan] == sorted(b.width / b.height for b in plan)


def test_rect_plan_ties_keep_index_order():
    plan = rect_plan(np.array([40, 30, 40, 30]), np.array([30, 40, 30, 40]), 32, 2)
    assert [b.rows.tolist() for b in plan] == [[1, 3], [0, 2]]


def test_square_plan_is_index_order():
    plan = square_plan(10, 32, 4)
    assert [b.rows.tolist() for b in plan] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert {(b.height, b.width) for b in plan} == {(32, 32)}


@pytest.mark.parametrize("rect", [False, True])
def test_val_batches_have_the_planned_shapes_and_labels(tmp_path, rect):
    root = make_tree(tmp_path / "d", classes=3, train_per_class=1, val_per_class=5,
                     sizes=[(120, 90), (90, 120), (160, 80), (100, 100), (80, 140)])
    source = ImageFolderSource(root, workers=0)
    plan = source.val_plan(40, 4, rect)
    batches = list(source.val_batches(40, 4, rect, Shard()))
    assert len(batches) == len(plan) == 4
    val = source.index(None).val
    for (images, labels), b in zip(batches, plan):
        assert images.dtype.is_floating_point is False and images.shape == (len(b.rows), 3, b.height, b.width)
        assert labels.tolist() == [int(val.labels[r]) for r in b.rows]
    shapes = {tuple(i.shape[2:]) for i, _ in batches}
    assert (len(shapes) > 1) == rect


def test_rect_crop_keeps_more_of_a_wide_image(tmp_path):
    # A wide image with a bright bar at its left end: a square centre crop loses the bar.
    from PIL import Image

    root = make_tree(tmp_path / "d", classes=1, train_per_class=1, val_per_class=0)
    pixels = np.zeros((100, 200, 3), dtype=np.uint8)
    pixels[:, 10:30] = 255
    (root / "val" / "c00").mkdir(parents=True)
    Image.fromarray(pixels).save(root / "val" / "c00" / "wide.png")
    source = ImageFolderSource(root, workers=0)
    (square, _), = list(source.val_batches(64, 1, False, Shard()))
    (rect, _), = list(source.val_batches(64, 1, True, Shard()))
    assert square.shape == (1, 3, 64, 64) and rect.shape == (1, 3, 64, 128)
    assert square.max() < 50 and rect.max() > 200
