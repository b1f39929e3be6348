"""Batched augmentation on whatever device the images live (the GPU when training there): for
datasets that fit in one tensor (Fashion-MNIST) and for the GPU decode path's decoded batches.

RandomResizedCrop + horizontal flip for a whole batch in one `torchvision.ops.roi_align` call:
each image gets its own crop box, resampled bilinearly to the phase's size, with averaging over
the source pixels of each output pixel when shrinking (so a crop is antialiased, like PIL's
resize). Images of different sizes share one call through a canvas (`crop_resize_flip_ragged`).
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import torch
import torchvision.transforms.v2.functional as TF
from torchvision.ops import roi_align

from speedrun.data.base import Batch, Shard, epoch_generator, epoch_permutation, rank_indices, host_to_device
from speedrun.recipe import IMAGENET_RATIO, Phase


def random_crop_boxes(
    count: int,
    height: int,
    width: int,
    min_scale: float,
    generator: torch.Generator,
    ratio: tuple[float, float] = IMAGENET_RATIO,
    translate: float = 0.0,
    flip: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RandomResizedCrop boxes and flip flags for `count` images of height x width pixels; the
    geometry is a `Phase`'s (min_scale, ratio, translate, flip).

    Area fraction ~ U(min_scale, 1) of the image, aspect ratio log-uniform in `ratio`, position
    uniform; a box may reach round(translate * side) pixels past the edges (zeros there), the
    translation of pad-and-crop augmentation. Where torchvision retries a box that does not fit,
    this clamps it to the padded image. Returns boxes (count x 4: x1, y1, x2, y2 in pixels) and
    flips (count, bool; all False without `flip`).
    """
    pad_x, pad_y = round(translate * width), round(translate * height)
    area = torch.empty(count).uniform_(min_scale, 1.0, generator=generator) * height * width
    log_ratio = torch.empty(count).uniform_(math.log(ratio[0]), math.log(ratio[1]), generator=generator)
    aspect = torch.exp(log_ratio)
    w = torch.sqrt(area * aspect).clamp(max=width + 2 * pad_x)
    h = torch.sqrt(area / aspect).clamp(max=height + 2 * pad_y)
    x1 = -pad_x + torch.rand(count, generator=generator) * (width + 2 * pad_x - w)
    y1 = -pad_y + torch.rand(count, generator=generator) * (height + 2 * pad_y - h)
    flips = (torch.rand(count, generator=generator) < 0.5) & flip  # drawn either way: same boxes
    return torch.stack([x1, y1, x1 + w, y1 + h], dim=1), flips


def crop_resize_flip(images: torch.Tensor, boxes: torch.Tensor, flips: torch.Tensor, size: int) -> torch.Tensor:
    """Crop each uint8 image to its box, resize to size x size px, flip where asked; uint8 out."""
    rois = torch.cat([torch.arange(len(images), device=images.device, dtype=torch.float32)[:, None], boxes], dim=1)
    return _resample(images.float(), rois, flips, size)


def _resample(images: torch.Tensor, rois: torch.Tensor, flips: torch.Tensor, size: int) -> torch.Tensor:
    """roi_align of float `images` (N x C x H x W) at `rois` (K x 5: image, x1, y1, x2, y2 in px)
    to size x size, averaging every source pixel under an output pixel (antialiased), flipped
    where `flips`; uint8 K x C x size x size."""
    out = roi_align(images, rois, output_size=size, spatial_scale=1.0, sampling_ratio=-1, aligned=True)
    out = out.round_().clamp_(0, 255).to(torch.uint8)  # flipped after: a quarter of the bytes to move
    return torch.where(flips.view(-1, 1, 1, 1), out.flip(-1), out)


# The windows of one canvas cover at most this many pixels (more make more canvases; one window
# larger than this gets a canvas of its own). With shelf packing's waste, a canvas is at most about
# twice that, and building it takes about 45 bytes per canvas pixel (int32 index maps, the uint8
# gather, its float copy): under 1 GB.
MAX_CANVAS_PX = 8 * 2**20
EDGE = 1e-6  # px: a box within this of an image's edge is inside it (boxes arrive as scaled fractions)


def crop_resize_flip_ragged(images: list[torch.Tensor], boxes: torch.Tensor, flips: torch.Tensor,
                            size: int) -> torch.Tensor:
    """`crop_resize_flip` for images of different sizes: `images` a list of uint8 3 x H x W on one
    device, `boxes` N x 4 (x1, y1, x2, y2 in each image's pixels, may reach past its edges),
    `flips` N bool (any device); uint8 N x 3 x size x size on the images' device.

    roi_align needs one input tensor, so each box's window of its image (the pixels under the box
    and one more on each side, which bilinear sampling reads) is copied onto a shared canvas, in
    shelves, tallest first, with one gather; then one roi_align resamples every box. For a box
    inside its image the result equals `crop_resize_flip` on that image alone (the window's rim
    repeats the image's edge, as roi_align does at a border). Where a box reaches past an edge the
    image is zero-padded on that side, as the PIL loader pads (`transforms._zero_padded`), which
    roi_align alone does not quite do (it clamps samples within one pixel of the edge, zeros beyond).
    """
    boxes = boxes.detach().to("cpu", torch.float64)  # the packing is planned on the host
    lo, hi = boxes.floor().to(torch.int64) - 1, boxes.ceil().to(torch.int64) + 1
    windows = torch.cat([lo[:, :2], hi[:, 2:] - lo[:, :2]], dim=1).tolist()  # x0, y0, width, height
    groups, start, area = [], 0, 0  # runs of consecutive images, one canvas each
    for i, (_, _, w, h) in enumerate(windows):
        if i > start and area + w * h > MAX_CANVAS_PX:
            groups.append(range(start, i))
            start, area = i, 0
        area += w * h
    groups.append(range(start, len(windows)))
    return torch.cat([_canvas_crops(images, boxes, windows, g, flips, size) for g in groups])


def _canvas_crops(images: list[torch.Tensor], boxes: torch.Tensor, windows: list[list[int]], group: range,
                  flips: torch.Tensor, size: int) -> torch.Tensor:
    """The crops of the images in `group`, from one canvas (see crop_resize_flip_ragged)."""
    device = images[0].device
    # Shelf packing: windows left to right, tallest first, in rows about as wide as the canvas is tall.
    width = max(max(windows[i][2] for i in group), math.isqrt(sum(windows[i][2] * windows[i][3] for i in group)))
    x = y = shelf_h = 0
    shelves: list[list[int]] = []  # [top, height] per shelf
    place = {}  # group position -> (canvas x, canvas y)
    runs: list[tuple[int, int]] = []  # the shelves' columns, left to right, top shelf first: (window or -1, width)
    for k in sorted(range(len(group)), key=lambda k: -windows[group[k]][3]):
        w, h = windows[group[k]][2:]
        if x + w > width:
            runs.append((-1, width - x))
            y, x, shelf_h = y + shelf_h, 0, 0
        if shelf_h == 0:
            shelf_h = h
            shelves.append([y, h])
        place[k] = (x, y)
        runs.append((k, w))
        x += w
    runs.append((-1, width - x))
    height = y + shelf_h
    # Which window each canvas pixel shows: canvas row -> shelf (and row within it), (shelf,
    # column) -> window (-1: none). A window's rows all start at its shelf's top.
    tops, heights = (torch.tensor(v, dtype=torch.int64) for v in zip(*shelves))
    row_shelf = torch.repeat_interleave(torch.arange(len(shelves)), heights)
    row_in_shelf = (torch.arange(height) - tops[row_shelf]).to(torch.int32)
    values, lengths = (torch.tensor(v, dtype=torch.int64) for v in zip(*runs))
    col_window = torch.repeat_interleave(values, lengths).view(len(shelves), width)
    # Per window: where it is on the canvas and in its image, its image's place in `flat`, and the
    # image pixels it may show (lo..hi, -1 and w/h being the rim: shown where the box stays inside,
    # zero padding where it reaches past that edge).
    shapes = [images[i].shape for i in group]
    starts = [0, *itertools.accumulate(h * w for _, h, w in shapes)]
    rows, shift = [], []
    for k, (bx1, by1, bx2, by2) in enumerate(boxes[group.start : group.stop].tolist()):
        i, (_, ih, iw), (cx, cy) = group[k], shapes[k], place[k]
        rows.append([cx, windows[i][0], windows[i][1], windows[i][3], ih, iw, starts[k],
                     -1 if bx1 > -EDGE else 0, iw if bx2 < iw + EDGE else iw - 1,
                     -1 if by1 > -EDGE else 0, ih if by2 < ih + EDGE else ih - 1])
        shift.append([cx - windows[i][0], cy - windows[i][1]] * 2)  # image px -> canvas px
    table, row_shelf, row_in_shelf, col_window = (
        host_to_device(t, device) for t in (torch.tensor(rows, dtype=torch.int64), row_shelf, row_in_shelf, col_window))
    cx, x0, y0, win_h, img_h, img_w, start, lo_x, hi_x, lo_y, hi_y = table.unbind(1)

    # Everything about a canvas column is known per shelf (S x W, small): the image column it
    # shows (clamped: the rim repeats the edge), which of the window's rows are shown, and where
    # its row r (clamped likewise) lies in `flat`: base + r * w.
    k = col_window.clamp(min=0)
    ix = x0[k] + torch.arange(width, device=device) - cx[k]
    w = img_w[k]
    shown = (col_window >= 0) & (ix >= lo_x[k]) & (ix <= hi_x[k])
    first = (lo_y[k] - y0[k]).clamp(min=0)
    last = torch.where(shown, torch.minimum(win_h[k] - 1, hi_y[k] - y0[k]), -1)
    base = start[k] + ix.clamp(min=0).minimum(w - 1) + y0[k] * w
    per_column = torch.stack([base, w, -y0[k], img_h[k] - 1 - y0[k], first, last]).to(torch.int32)
    # Then one gather spreads that over the canvas rows, and a few int32 passes make each canvas
    # pixel's index in `flat` (a last, zero pixel where nothing is shown): the canvas-sized work
    # is what costs on the GPU (memory traffic), so it is kept to these.
    base, w, r_min, r_max, first, last = per_column[:, row_shelf].unbind(0)
    r = row_in_shelf[:, None]
    at = torch.clamp(r, r_min, r_max).mul_(w).add_(base)
    # All three channels of every image share one index: `flat` is 3 x (all pixels), channel-major.
    flat = torch.cat([images[i].reshape(3, -1) for i in group] + [torch.zeros(3, 1, dtype=torch.uint8, device=device)],
                     dim=1)
    at.masked_fill_((r < first) | (r > last), flat.shape[1] - 1)
    canvas = flat[:, at].float()
    rois = torch.cat([torch.zeros(len(group), 1, dtype=torch.float64), boxes[group.start : group.stop]
                      + torch.tensor(shift, dtype=torch.float64)], dim=1).float()
    return _resample(canvas[None], host_to_device(rois, device),
                     host_to_device(flips[group.start : group.stop], device), size)


def resize_center_crop(images: torch.Tensor, size: int, resize: int) -> torch.Tensor:
    """Evaluation geometry for a uint8 batch: shorter side resized to `resize` px (antialiased),
    centre-cropped to size x size (`rect.resize_for` gives `resize` from a phase's crop_pct).
    With `resize` == size a square image is shown whole; unchanged when nothing is to do."""
    if min(images.shape[-2:]) != resize:
        images = TF.resize(images, [resize], antialias=True)  # one number: the shorter side
    if images.shape[-2:] != (size, size):
        images = TF.center_crop(images, [size, size])
    return images


class TensorTrainStream:
    """Training batches from images held in one uint8 tensor (N x C x H x W), following the
    sharding rules of `speedrun.data.base`, with the phase's crop geometry (`random_crop_boxes`).
    Crop boxes are drawn per sample from (seed, epoch), so every rank and every world size sees
    the same augmented image for the same sample."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, phase: Phase, shard: Shard, seed: int):
        self.images, self.labels, self.phase = images, labels, phase
        self.batch_size = phase.batch_size
        self.shard, self.seed = shard, seed
        self.epoch, self.start_step = 0, 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.epoch, self.start_step = epoch, start_step

    def __len__(self) -> int:
        return len(self.labels) // self.shard.world_size // self.batch_size

    def __iter__(self) -> Iterator[Batch]:
        n, _, height, width = self.images.shape
        device = self.images.device
        order = rank_indices(epoch_permutation(n, self.seed, self.epoch), self.shard, self.batch_size)
        p = self.phase
        boxes, flips = random_crop_boxes(
            n, height, width, p.min_scale, epoch_generator(self.seed, self.epoch, 1), p.ratio, p.translate, p.flip
        )
        order, boxes, flips = order.to(device), boxes.to(device), flips.to(device)
        for start in range(self.start_step * self.batch_size, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            yield crop_resize_flip(self.images[idx], boxes[idx], flips[idx], p.size), self.labels[idx]

    def close(self) -> None:
        pass
