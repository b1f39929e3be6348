"""Batched augmentation for datasets that fit in one tensor (Fashion-MNIST).

RandomResizedCrop + horizontal flip for a whole batch in one `torchvision.ops.roi_align` call,
on whatever device the images live (the GPU when training there): each image gets its own crop
box, resampled bilinearly to the phase's size, with averaging over the source pixels of each
output pixel when shrinking (so a crop is antialiased, like PIL's resize).
"""
from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torchvision.transforms.v2.functional as TF
from torchvision.ops import roi_align

from speedrun.data.base import Batch, Shard, epoch_generator, epoch_permutation, rank_indices
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
    out = roi_align(images.float(), rois, output_size=size, spatial_scale=1.0, sampling_ratio=-1, aligned=True)
    out = torch.where(flips.view(-1, 1, 1, 1), out.flip(-1), out)
    return out.round_().clamp_(0, 255).to(torch.uint8)


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
