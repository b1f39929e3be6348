"""Decode one image file straight to the pixels a batch needs (uint8 H x W x 3).

Two operations, each a single PIL resize from the (possibly DCT-reduced) decoded image:
- train: RandomResizedCrop(size, scale=(min_scale, 1), ratio) + horizontal flip, with
  torchvision's parameter rule (plus optional pad-and-crop translation), randomness from a
  caller-given `random.Random`; the recipe's `Phase` gives min_scale, ratio, translate, flip;
- eval: resize the shorter side to `resize` px, centre-crop to `out_h` x `out_w` (zero-padded
  where the crop is larger than the image, as torchvision's `center_crop` does).

JPEG files are decoded at 1/2, 1/4 or 1/8 scale (libjpeg DCT scaling, PIL's `draft`) whenever
the region that ends up in the output still has at least as many pixels as the output: a 500 px
image cropped to 128 px decodes at a quarter of the cost. The crop-and-resize is one call
(`Image.resize(box=...)`), so no intermediate image is made.

Every function raises on a bad file; callers decide what to count and skip.
"""
from __future__ import annotations

import math
import os
import random
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from PIL import Image

from speedrun.recipe import IMAGENET_RATIO

# Bilinear with PIL's antialiasing support, as torchvision's PIL path uses.
RESAMPLE = Image.Resampling.BILINEAR


@contextmanager
def open_image(path: str | os.PathLike) -> Iterator[Image.Image]:
    """PIL's Image.open without its DecompressionBombWarning: very large images are expected
    (and decode fine, a JPEG in draft mode at a fraction of its size)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Image.open(path) as img:
            yield img


def crop_params(
    width: int,
    height: int,
    min_scale: float,
    rng: random.Random,
    ratio: tuple[float, float] = IMAGENET_RATIO,
    translate: float = 0.0,
) -> tuple[int, int, int, int]:
    """torchvision RandomResizedCrop.get_params: (left, top, crop_w, crop_h) in pixels.

    With `translate` > 0 the image is first padded by round(translate * side) px of zeros on
    each side (pad-and-crop translation), so the box may start left of or above the image; its
    area is still drawn from the image's own area.
    """
    area = width * height
    pad_x, pad_y = round(translate * width), round(translate * height)
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(min_scale, 1.0)
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width + 2 * pad_x and 0 < h <= height + 2 * pad_y:
            return rng.randint(-pad_x, width + pad_x - w), rng.randint(-pad_y, height + pad_y - h), w, h
    # Fallback: the whole image, clamped to the ratio range, centred.
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        w, h = int(round(height * ratio[1])), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def _reduce(img: Image.Image, region_w: float, region_h: float, out_w: int, out_h: int,
            draft: bool) -> tuple[Image.Image, float, float]:
    """Decode the opened `img` at the coarsest DCT scale that keeps the region >= the output.

    Returns the decoded RGB image and the factors (x, y) from original to decoded pixels (libjpeg
    rounds each side up, so they differ slightly).
    """
    width, height = img.size
    if draft and img.format == "JPEG":
        # Largest s in {8, 4, 2, 1} with region / s still covering the output.
        room = min(region_w / max(out_w, 1), region_h / max(out_h, 1))
        s = next((s for s in (8, 4, 2) if room >= s), 1)
        if s > 1:
            # PIL picks scale = min(W // rw, H // rh) rounded down to a power of two: this asks
            # for exactly s.
            img.draft(img.mode, (img.size[0] // s, img.size[1] // s))
    if img.mode != "RGB":
        # CMYK, grayscale, palette, alpha, 16-bit: all become plain RGB here (this also decodes).
        img = img.convert("RGB")
    else:
        img.load()
    return img, img.size[0] / width, img.size[1] / height


def _box(x0: float, y0: float, x1: float, y1: float, fx: float, fy: float, img: Image.Image) -> tuple[float, ...]:
    """A source box in decoded pixels, clamped to the image (float rounding may overshoot)."""
    w, h = img.size
    return (min(x0 * fx, w), min(y0 * fy, h), min(x1 * fx, w), min(y1 * fy, h))


def _to_array(img: Image.Image, out: np.ndarray | None) -> np.ndarray:
    arr = np.asarray(img)
    if out is None:
        return arr
    out[...] = arr
    return out


def decode_train(
    path: str,
    size: int,
    min_scale: float,
    rng: random.Random,
    draft: bool = True,
    out: np.ndarray | None = None,
    ratio: tuple[float, float] = IMAGENET_RATIO,
    translate: float = 0.0,
    flip: bool = True,
) -> np.ndarray:
    """RandomResizedCrop (`crop_params`) + random flip (when `flip`) of the image at `path` as
    uint8 size x size x 3 (into `out`)."""
    with open_image(path) as img:
        width, height = img.size
        left, top, cw, ch = crop_params(width, height, min_scale, rng, ratio, translate)
        flipped = rng.random() < 0.5 and flip  # drawn either way: the same crops with and without flips
        img, fx, fy = _reduce(img, cw, ch, size, size, draft)
        if left < 0 or top < 0 or left + cw > width or top + ch > height:
            img, left, top = _zero_padded(img, left, top, cw, ch, width, height, fx, fy)
        box = _box(left, top, left + cw, top + ch, fx, fy, img)
        img = img.resize((size, size), RESAMPLE, box=box)
    if flipped:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return _to_array(img, out)


def _zero_padded(img: Image.Image, left: int, top: int, cw: int, ch: int, width: int, height: int,
                 fx: float, fy: float) -> tuple[Image.Image, float, float]:
    """The decoded image on a black canvas just large enough for a crop box that reaches past its
    edges (PIL's resize box must lie inside the image). Returns the canvas and the box's new
    top-left corner, in original pixels."""
    pad_l, pad_t = max(0, -left), max(0, -top)
    pad_r, pad_b = max(0, left + cw - width), max(0, top + ch - height)
    canvas = Image.new("RGB", (math.ceil((width + pad_l + pad_r) * fx), math.ceil((height + pad_t + pad_b) * fy)))
    canvas.paste(img, (round(pad_l * fx), round(pad_t * fy)))
    return canvas, left + pad_l, top + pad_t


def eval_geometry(width: int, height: int, resize: int) -> tuple[int, int]:
    """Size (w, h) after torchvision's Resize(resize): shorter side to `resize`, aspect kept."""
    if width <= height:
        return resize, int(resize * height / width)
    return int(resize * width / height), resize


def decode_eval(
    path: str,
    resize: int,
    out_h: int,
    out_w: int,
    draft: bool = True,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Resize shorter side to `resize`, centre-crop out_h x out_w: uint8 out_h x out_w x 3."""
    with open_image(path) as img:
        width, height = img.size
        rw, rh = eval_geometry(width, height, resize)
        # torchvision center_crop's offsets, in the resized image's pixels.
        top = int(round((rh - out_h) / 2.0))
        left = int(round((rw - out_w) / 2.0))
        # The part of the crop inside the resized image (the rest is zero padding).
        x0, y0 = max(left, 0), max(top, 0)
        x1, y1 = min(left + out_w, rw), min(top + out_h, rh)
        sx, sy = width / rw, height / rh  # resized -> original pixels
        # The DCT scale must keep the whole resized image's resolution, not just the crop's.
        img, fx, fy = _reduce(img, width, height, rw, rh, draft)
        box = _box(x0 * sx, y0 * sy, x1 * sx, y1 * sy, fx, fy, img)
        img = img.resize((x1 - x0, y1 - y0), RESAMPLE, box=box)
    if (x0, y0, x1, y1) == (left, top, left + out_w, top + out_h):
        return _to_array(img, out)
    if out is None:
        out = np.empty((out_h, out_w, 3), dtype=np.uint8)
    out[...] = 0
    out[y0 - top : y1 - top, x0 - left : x1 - left] = np.asarray(img)
    return out
