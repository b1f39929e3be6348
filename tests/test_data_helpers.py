"""Small real image trees for the data tests (no tests here; imported by test_data_*.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def write_jpeg(path: Path, width: int, height: int, seed: int = 0, mode: str = "RGB", fmt: str = "JPEG") -> Path:
    """A real image file with random smooth content (JPEG unless `fmt` says otherwise)."""
    rng = np.random.default_rng(seed)
    low = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    img = Image.fromarray(low).resize((width, height), Image.Resampling.BILINEAR).convert(mode)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, fmt, quality=90)
    return path


def make_tree(
    root: Path,
    classes: int = 3,
    train_per_class: int = 6,
    val_per_class: int = 3,
    sizes: list[tuple[int, int]] | None = None,
) -> Path:
    """ROOT/{train,val}/cNN/imgNNN.JPEG with sizes cycling through `sizes` (w, h) in px."""
    sizes = sizes or [(64, 48), (48, 64), (80, 40), (50, 50), (40, 72)]
    k = 0
    for split, per in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            for i in range(per):
                w, h = sizes[k % len(sizes)]
                write_jpeg(root / split / f"c{c:02d}" / f"img{i:03d}.JPEG", w, h, seed=k)
                k += 1
    return root
