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


def age(root: Path, seconds: float = 60) -> Path:
    """Set every folder's and file's mtime under `root` `seconds` back: a tree made a while ago.
    A folder changed just before its index was written is not trusted (the clock may not have
    ticked in between), so a test of trust-by-folder starts from an aged tree."""
    import os
    import time

    then = time.time_ns() - int(seconds * 1e9)
    for folder, _, names in os.walk(root):
        for name in names:
            if name.startswith(".speedrun-index"):
                continue  # the index's own cache keeps its time
            os.utime(os.path.join(folder, name), ns=(then, then), follow_symlinks=False)
        os.utime(folder, ns=(then, then))
    return root


def train_from_cli(tree: Path, tmp_path: Path, loader: str):
    """`speedrun train --loader LOADER` on the image folder `tree` for 2 epochs (24 px crops, batch
    8, a tiny ResNet, on the CPU); returns the finished process and results.json (None if absent)."""
    import json

    from cli_run import speedrun

    recipe = tmp_path / "r.py"
    recipe.write_text(
        "from speedrun.recipe import Phase, Recipe\n"
        f"recipe = Recipe('{loader}-loader', (Phase(0, 2, size=24, batch_size=8, lr=0.05),), "
        "model='resnet-fmnist-tiny',\n"
        "                dataset='imagefolder', val_batch_size=6)\n")
    out = tmp_path / "run"
    proc = speedrun("train", "--recipe", str(recipe), "--data", str(tree), "--loader", loader, "--workers", "1",
                    "--out", str(out), "--target", "none", "--device", "cpu")
    results = out / "results.json"
    return proc, json.loads(results.read_text()) if results.exists() else None
