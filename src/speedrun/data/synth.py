"""Generated image-folder trees, for tests, benchmarks and trying the pipeline without ImageNet.

- `imagenet_tree`: ImageNet-shaped JPEGs. Aspect ratios mostly 4:3 (landscape) and 3:4
  (portrait), the rest spread log-uniformly over 0.5..2.0; shorter side around 320 px, so the
  mean size is about 400 x 350 px like ImageNet's. Pixels are smooth colour fields plus fine
  noise, which JPEG-compresses to roughly photo-like sizes (tens of kB), so decode cost is
  realistic. Classes differ only by a colour cast: this tree is for speed, not for learning.
- `fmnist_tree`: a learnable tree made from Fashion-MNIST. Each garment is scaled to most of a
  canvas's shorter side and placed near one end of its longer side, on canvases with aspect
  ratios log-uniform in 0.5..2.0. A square centre crop of a wide or tall canvas cuts off much
  of the garment; a rectangular crop keeps it, so rectangular validation should score higher.
  With `side`, the canvases are squares of that many pixels instead (a small-image folder);
  with `plain`, the images are Fashion-MNIST's own 28 x 28 grayscale pictures as PNG files
  (the in-memory dataset as a folder: same pixels, same labels).

Generation runs on all cores (one process per chunk of images) and is deterministic in `seed`.
"""
from __future__ import annotations

import math
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from speedrun.data.fashion_mnist import DEBIAN_DIR as FMNIST_DIR  # where dataset-fashion-mnist puts the files
from speedrun.data.fashion_mnist import read_idx  # the one IDX reader; re-exported here
from speedrun.data.bounds import CLASSES, FMNIST_TRAIN, FMNIST_VAL, MAX_IMAGES, PER_CLASS, QUALITY, SIDE
from speedrun.inputs import SEED, WORKERS, Bound
from speedrun.errors import SpeedrunError

FMNIST_CLASSES = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle-boot")


@dataclass(frozen=True)
class TreeSummary:
    """What a generator wrote."""

    root: Path
    classes: int
    train: int  # images
    val: int  # images


def _imagenet_aspect(rng: np.random.Generator) -> float:
    u = rng.random()
    if u < 0.55:
        return 4 / 3
    if u < 0.75:
        return 3 / 4
    return math.exp(rng.uniform(math.log(0.5), math.log(2.0)))


def imagenet_like_image(rng: np.random.Generator, label: int, num_classes: int, short: float = 320) -> Image.Image:
    """One ImageNet-shaped RGB image (see the module docstring)."""
    aspect = _imagenet_aspect(rng)
    s = int(np.clip(rng.normal(short, 50), 120, 600))
    w, h = (int(s * aspect), s) if aspect >= 1 else (s, int(s / aspect))
    # Smooth field: a small random image upsampled bicubically, tinted by class.
    low = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
    field = np.asarray(Image.fromarray(low).resize((w, h), Image.Resampling.BICUBIC), dtype=np.int16)
    hue = np.array([math.cos(2 * math.pi * (label / num_classes + k / 3)) for k in range(3)]) * 40
    # Uniform integer noise (cheap to draw): mostly luminance, a little chroma.
    noise = rng.integers(-22, 23, size=(h, w, 1), dtype=np.int16) + rng.integers(-8, 9, size=(h, w, 3), dtype=np.int16)
    pixels = np.clip(field + hue.astype(np.int16) + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def _write_imagenet_chunk(args: tuple) -> int:
    root, jobs, num_classes, quality, seed = args
    for split, cls_name, label, k in jobs:
        rng = np.random.default_rng([seed, 0 if split == "train" else 1, label, k])
        img = imagenet_like_image(rng, label, num_classes)
        path = Path(root) / split / cls_name / f"{cls_name}_{k:06d}.JPEG"
        img.save(path, "JPEG", quality=quality)
    return len(jobs)


def _run_chunks(fn, chunks: list[tuple], workers: int | None, root: Path) -> None:
    workers = workers or os.cpu_count() or 1
    try:
        if workers <= 1 or len(chunks) <= 1:
            for c in chunks:
                fn(c)
            return
        with ProcessPoolExecutor(workers) as pool:
            list(pool.map(fn, chunks))
    except OSError as e:  # the disk filled up, the folder went away: the user's to fix, not a bug
        raise SpeedrunError(f"DST {root}: cannot write {e.filename or 'an image'} ({e.strerror or e})") from None


# Bounds on what a tree may ask for. A canvas is held as float32 with three channels while it is
# drawn: 2048 px is 50 MB per worker, a 100000 px side would be 120 GB.
def check_request(root: Path, options: dict[str, tuple[int | None, Bound]], images: int) -> None:
    """SpeedrunError, one line, for a tree that cannot be written as asked, before anything is
    made: an option outside its bounds (`options`: option name -> (value or None, bound)), more
    than MAX_IMAGES `images` in all, or a destination that is a file or read-only."""
    from speedrun.data.prepare import check_destination

    for name, (value, bound) in options.items():
        if value is not None and not bound.holds(value):
            raise SpeedrunError(f"--{name} must be {bound}, got {value!r}")
    if images > MAX_IMAGES:
        raise SpeedrunError(f"{images:,} images asked for: a generated tree holds at most {MAX_IMAGES:,}")
    check_destination(root)


def imagenet_tree(
    root: str | os.PathLike,
    classes: int = 10,
    train_per_class: int = 100,
    val_per_class: int = 20,
    quality: int = 90,
    seed: int = 0,
    workers: int | None = None,
) -> TreeSummary:
    """Write an ImageNet-shaped JPEG tree at `root` (train/ and val/ with `classes` folders)."""
    root = Path(root)
    check_request(root, {"classes": (classes, CLASSES), "train-per-class": (train_per_class, PER_CLASS),
                         "val-per-class": (val_per_class, PER_CLASS), "quality": (quality, QUALITY),
                         "seed": (seed, SEED), "workers": (workers, WORKERS)},
                  classes * (train_per_class + val_per_class))
    names = [f"n{i:08d}" for i in range(classes)]
    jobs = []
    for split, per in (("train", train_per_class), ("val", val_per_class)):
        for label, name in enumerate(names):
            (root / split / name).mkdir(parents=True, exist_ok=True)
            jobs.extend((split, name, label, k) for k in range(per))
    chunk = 64
    chunks = [(str(root), jobs[i : i + chunk], classes, quality, seed) for i in range(0, len(jobs), chunk)]
    _run_chunks(_write_imagenet_chunk, chunks, workers, root)
    return TreeSummary(root, classes, classes * train_per_class, classes * val_per_class)


# ---------------------------------------------------------------------------------------------
# Fashion-MNIST


def garment_canvas(garment: np.ndarray, rng: np.random.Generator, short_range: tuple[int, int] = (48, 96),
                   aspect_range: tuple[float, float] = (0.5, 2.0)) -> Image.Image:
    """Place a 28 x 28 garment on a canvas of random aspect ratio, off-centre (module docstring)."""
    aspect = math.exp(rng.uniform(math.log(aspect_range[0]), math.log(aspect_range[1])))
    s = int(rng.integers(short_range[0], short_range[1] + 1))
    w, h = (int(round(s * aspect)), s) if aspect >= 1 else (s, int(round(s / aspect)))
    g = int(round(s * rng.uniform(0.75, 0.95)))
    sprite = np.asarray(Image.fromarray(garment).resize((g, g), Image.Resampling.BILINEAR), dtype=np.float32)
    # Dim textured background, so the garment is not the only thing that is not black.
    canvas = rng.normal(20, 8, size=(h, w)).clip(0, 255).astype(np.float32)
    free = max(w, h) - g
    # Near one end of the long side: within the outer 15% of the free room.
    offset = int(rng.uniform(0, 0.15) * free)
    along = offset if rng.random() < 0.5 else free - offset
    across = int(rng.integers(0, (min(w, h) - g) + 1))
    x, y = (along, across) if w >= h else (across, along)
    region = canvas[y : y + g, x : x + g]
    canvas[y : y + g, x : x + g] = np.maximum(region, sprite)
    tint = rng.uniform(0.8, 1.0, size=3).astype(np.float32)
    rgb = (canvas[..., None] * tint).clip(0, 255).astype(np.uint8)
    return Image.fromarray(rgb)


def _write_fmnist_chunk(args: tuple) -> int:
    root, split, images, labels, first, quality, seed, side, plain = args
    for k, (img, label) in enumerate(zip(images, labels)):
        n = first + k
        folder = Path(root) / split / FMNIST_CLASSES[int(label)]
        if plain:
            Image.fromarray(img).save(folder / f"{split}_{n:06d}.png")
            continue
        rng = np.random.default_rng([seed, 0 if split == "train" else 1, n])
        canvas = garment_canvas(img, rng) if side is None else garment_canvas(img, rng, (side, side), (1.0, 1.0))
        canvas.save(folder / f"{split}_{n:06d}.jpg", "JPEG", quality=quality)
    return len(images)


def fmnist_tree(
    root: str | os.PathLike,
    train: int = 6000,
    val: int = 1000,
    source: str | os.PathLike = FMNIST_DIR,
    quality: int = 90,
    seed: int = 0,
    workers: int | None = None,
    side: int | None = None,
    plain: bool = False,
) -> TreeSummary:
    """Write a learnable tree from the first `train` / `val` Fashion-MNIST train / test images:
    garments on canvases of varied aspect ratio (JPEG), on `side` px squares, or `plain` (the
    28 px originals as grayscale PNG); see the module docstring."""
    source = Path(source)
    files = {
        "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
        "val": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
    }
    root = Path(root)
    check_request(root, {"train": (train, FMNIST_TRAIN), "val": (val, FMNIST_VAL), "quality": (quality, QUALITY),
                         "seed": (seed, SEED), "workers": (workers, WORKERS), "side": (side, SIDE)}, train + val)
    chunks = []
    for split, count in (("train", train), ("val", val)):
        img_file, lbl_file = (source / f for f in files[split])
        if not img_file.is_file() or not lbl_file.is_file():
            raise SpeedrunError(
                f"Fashion-MNIST not found at {source} (install Debian's dataset-fashion-mnist or pass --source)"
            )
        images, labels = read_idx(img_file, count), read_idx(lbl_file, count)
        for cls in FMNIST_CLASSES:
            (root / split / cls).mkdir(parents=True, exist_ok=True)
        chunk = 256
        chunks += [
            (str(root), split, images[i : i + chunk], labels[i : i + chunk], i, quality, seed, side, plain)
            for i in range(0, len(images), chunk)
        ]
    _run_chunks(_write_fmnist_chunk, chunks, workers, root)
    return TreeSummary(root, len(FMNIST_CLASSES), min(train, 60000), min(val, 10000))
