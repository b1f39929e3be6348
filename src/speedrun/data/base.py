"""What every data source gives the training loop.

A source yields batches as (images, labels): images are uint8 tensors N x C x H x W (never
converted to float on the CPU: that is 4x the bytes to move), labels int64 tensors N. The loop
moves them to the device and normalises there (`normalize_on_device`).

Sharding rules, shared by all sources so that N processes see exactly what one process sees:
- Training: every epoch, one permutation of the training set drawn from (seed, epoch), the
  same on every rank; rank r takes positions r, r + world, r + 2*world, ... of it, then cuts
  whole batches (drop_last). Step s of the union of all ranks is step s of one process with
  a world-times-larger batch. Per-sample augmentation randomness depends on (seed, epoch,
  sample), not on the rank, nor on the batches before: an epoch can start at any step and
  yield what it would have yielded there (DALI's own random draws excepted).
- Validation: the (possibly aspect-sorted) list of validation samples is cut into batches first,
  then each rank takes a contiguous run of those batches; a rank may get fewer or none. Every
  sample is evaluated exactly once, whatever the world size.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from speedrun.recipe import IMAGENET_CROP_PCT, Phase

Batch = tuple[torch.Tensor, torch.Tensor]
log = logging.getLogger("speedrun.data")


@dataclass(frozen=True)
class Shard:
    """Which part of the data this process reads."""

    rank: int = 0
    world_size: int = 1


@dataclass
class CountedFiles:
    """Files met while training or evaluating that something happened to (path -> reason): the
    images skipped as undecodable (the default), or those the GPU decode path decoded on the CPU."""

    files: dict[str, str] = field(default_factory=dict)
    count: int = 0  # occurrences, counting repeats (a bad file fails every epoch)
    what: str = "skipping unreadable image"  # the warning logged once per file

    def add(self, found: list[tuple[str, str]]) -> None:
        for path, reason in found:
            self.count += 1
            if path not in self.files:
                self.files[path] = reason
                log.warning("%s %s: %s", self.what, path, reason)


class TrainStream(Protocol):
    """Training batches for one data setting (`Phase.data_key`).

    `batch_size` may be changed between epochs without rebuilding anything (no new dataset,
    no new loader workers): that is how a batch-size-only phase change is done.
    """

    batch_size: int

    # The next iteration yields `epoch`'s batches from step `start_step` on (a run resumed mid-epoch).
    def set_epoch(self, epoch: int, start_step: int = 0) -> None: ...

    def __len__(self) -> int: ...  # steps per epoch on this rank

    def __iter__(self) -> Iterator[Batch]: ...

    def close(self) -> None: ...


class DataSource(Protocol):
    """A dataset with a train and a validation split, able to feed any phase."""

    name: str
    num_classes: int
    channels: int
    mean: Sequence[float]  # per channel, in 0..255 units
    std: Sequence[float]
    num_train: int  # examples in the training split (after any recipe subset)
    num_val: int
    loader: str | None  # what decodes training images ("pil", "gpu", "dali"); None: tensors in memory

    def train_stream(self, phase: Phase, shard: Shard, seed: int) -> TrainStream: ...

    # `copy`: the resized copy to read (the evaluated phase's), None for full size; `crop_pct`:
    # the fraction of the resized image kept (`Phase.crop_pct`; 1.0: whole square images).
    def val_batches(self, size: int, batch_size: int, rect: bool, shard: Shard, copy: int | None = None,
                    crop_pct: float = IMAGENET_CROP_PCT) -> Iterable[Batch]: ...

    def skipped_images(self) -> dict[str, int] | None: ...  # files left out so far; None: never any

    def cpu_fallbacks(self) -> int | None: ...  # images the GPU decode path decoded on the CPU; None: no such path

    def close(self) -> None: ...


def split_batches_contiguously(num_batches: int, shard: Shard) -> range:
    """The contiguous run of batch indices rank `shard.rank` evaluates (possibly empty)."""
    per_rank = -(-num_batches // shard.world_size)
    start = min(shard.rank * per_rank, num_batches)
    return range(start, min(start + per_rank, num_batches))


def epoch_generator(seed: int, epoch: int, stream: int = 0) -> torch.Generator:
    """A CPU random generator for one (seed, epoch) and one purpose (`stream`: 0 = the order,
    1 = augmentation, ...), so that random draws never depend on the rank or on what ran before."""
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 16 + stream)


def epoch_permutation(num_examples: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of the training set in `epoch`; the same on every rank."""
    return torch.randperm(num_examples, generator=epoch_generator(seed, epoch, 0))


def rank_indices(order: torch.Tensor, shard: Shard, batch_size: int) -> torch.Tensor:
    """This rank's share of an epoch's order, cut to whole batches (equal on all ranks)."""
    steps = len(order) // shard.world_size // batch_size
    return order[shard.rank :: shard.world_size][: steps * batch_size]


def indexed_device(device: torch.device) -> torch.device:
    """`device` with its index: a bare "cuda" becomes the current CUDA device. Threads of the data
    path start on device 0 and must set theirs, and torch.cuda.set_device refuses a bare "cuda"."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on `device` without making the host wait: a host tensor goes through page-locked
    memory on CUDA (a copy from pageable memory waits for the stream's earlier work)."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def normalize_on_device(
    images: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    device: torch.device,
    channels_last: bool = False,
) -> torch.Tensor:
    """uint8 N x C x H x W (any device) -> normalised float32 on `device`, in the model's layout:
    channels_last, else contiguous (an image folder's batches come channels_last, and a
    convolution follows its input's layout: learner.to_device says why CPU models are contiguous).

    `mean` and `std` are C x 1 x 1 tensors already on `device`, in 0..255 units.
    """
    x = images.to(device, non_blocking=True)
    x = x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    return x.float().sub_(mean).div_(std)
