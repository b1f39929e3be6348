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
from speedrun.recipe import Phase


def random_crop_boxes(
    count: int,
    height: int,
    width: int,
    min_scale: float,
    generator: torch.Generator,
    pad: int = 0,
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> tuple[torch.Tensor, torch.Tensor]:
    """RandomResizedCrop boxes and flip flags for `count` images of height x width pixels.

    Area fraction ~ U(min_scale, 1) of the image, aspect ratio log-uniform in `ratio`, position
    uniform; a box may reach `pad` pixels past the edges (zeros there), which adds the
    translation of pad-and-crop augmentation. Where torchvision retries a box that does not fit,
    this clamps it to the padded image. Returns boxes (count x 4: x1, y1, x2, y2 in pixels) and
    flips (count, bool).
    """
    area = torch.empty(count).uniform_(min_scale, 1.0, generator=generator) * height * width
    log_ratio = torch.empty(count).uniform_(math.log(ratio[0]), math.log(ratio[1]), generator=generator)
    aspect = torch.exp(log_ratio)
    w = torch.sqrt(area * aspect).clamp(max=width + 2 * pad)
    h = torch.sqrt(area / aspect).clamp(max=height + 2 * pad)
    x1 = -pad + torch.rand(count, generator=generator) * (width + 2 * pad - w)
    y1 = -pad + torch.rand(count, generator=generator) * (height + 2 * pad - h)
    flips = torch.rand(count, generator=generator) < 0.5
    return torch.stack([x1, y1, x1 + w, y1 + h], dim=1), flips


def crop_resize_flip(images: torch.Tensor, boxes: torch.Tensor, flips: torch.Tensor, size: int) -> torch.Tensor:
    """Crop each uint8 image to its box, resize to size x size px, flip where asked; uint8 out."""
    rois = torch.cat([torch.arange(len(images), device=images.device, dtype=torch.float32)[:, None], boxes], dim=1)
    out = roi_align(images.float(), rois, output_size=size, spatial_scale=1.0, sampling_ratio=-1, aligned=True)
    out = torch.where(flips.view(-1, 1, 1, 1), out.flip(-1), out)
    return out.round_().clamp_(0, 255).to(torch.uint8)


def resize_batch(images: torch.Tensor, size: int) -> torch.Tensor:
    """Resize a uint8 batch to size x size px (antialiased); unchanged when already that size."""
    if images.shape[-2:] == (size, size):
        return images
    return TF.resize(images, [size, size], antialias=True)


class TensorTrainStream:
    """Training batches from images held in one uint8 tensor (N x C x H x W), following the
    sharding rules of `speedrun.data.base`. Crop boxes are drawn per sample from (seed, epoch),
    so every rank and every world size sees the same augmented image for the same sample.
    `pad` (pixels) and `ratio` (aspect-ratio range) are passed to `random_crop_boxes`."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        phase: Phase,
        shard: Shard,
        seed: int,
        pad: int = 2,
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
    ):
        self.images, self.labels = images, labels
        self.size, self.min_scale = phase.size, phase.min_scale
        self.batch_size = phase.batch_size
        self.shard, self.seed, self.pad, self.ratio = shard, seed, pad, ratio
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.labels) // self.shard.world_size // self.batch_size

    def __iter__(self) -> Iterator[Batch]:
        n, _, height, width = self.images.shape
        device = self.images.device
        order = rank_indices(epoch_permutation(n, self.seed, self.epoch), self.shard, self.batch_size)
        boxes, flips = random_crop_boxes(
            n, height, width, self.min_scale, epoch_generator(self.seed, self.epoch, 1), self.pad, self.ratio
        )
        order, boxes, flips = order.to(device), boxes.to(device), flips.to(device)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            yield crop_resize_flip(self.images[idx], boxes[idx], flips[idx], self.size), self.labels[idx]

    def close(self) -> None:
        pass
