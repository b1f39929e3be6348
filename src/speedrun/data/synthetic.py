"""Random images and labels held on the device: a data source that costs nothing to read, for
measuring the model's training speed alone (images/s). Nothing in it is learnable."""
from __future__ import annotations

import torch

from speedrun.data.augment import TensorTrainStream, resize_batch
from speedrun.data.base import Shard, split_batches_contiguously
from speedrun.recipe import Phase


class SyntheticSource:
    """ImageNet-shaped random data (3 channels, 1000 classes) at `base_size` px; crops are
    resized to each phase's size like real images are."""

    name = "synthetic"
    channels = 3
    mean = (123.7, 116.3, 103.5)
    std = (58.4, 57.1, 57.4)

    def __init__(
        self,
        device: torch.device | str = "cpu",
        train_examples: int | None = None,
        val_examples: int | None = None,
        num_classes: int = 1000,
        base_size: int = 160,
    ):
        g = torch.Generator().manual_seed(0)
        self.num_classes = num_classes
        self.num_train = train_examples or 4096
        self.num_val = val_examples or 1024
        shape = (3, base_size, base_size)
        self.train_images = torch.randint(0, 256, (self.num_train, *shape), generator=g, dtype=torch.uint8).to(device)
        self.train_labels = torch.randint(0, num_classes, (self.num_train,), generator=g).to(device)
        self.val_images = torch.randint(0, 256, (self.num_val, *shape), generator=g, dtype=torch.uint8).to(device)
        self.val_labels = torch.randint(0, num_classes, (self.num_val,), generator=g).to(device)

    def train_stream(self, phase: Phase, shard: Shard, seed: int) -> TensorTrainStream:
        return TensorTrainStream(self.train_images, self.train_labels, phase, shard, seed, pad=0)

    def val_batches(self, size: int, batch_size: int, rect: bool, shard: Shard):
        num_batches = -(-self.num_val // batch_size)
        for b in split_batches_contiguously(num_batches, shard):
            sl = slice(b * batch_size, (b + 1) * batch_size)
            yield resize_batch(self.val_images[sl], size), self.val_labels[sl]

    def skipped_images(self) -> None:
        """Nothing is ever skipped: the images are tensors in memory."""
        return None

    def close(self) -> None:
        pass
