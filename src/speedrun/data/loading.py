"""The worker machinery both image-folder training loaders share (`data.imagefolder`'s PIL
decoding and `data.gpu`'s byte reading): a persistent DataLoader whose workers each make a whole
batch from (epoch, row) keys, drawn per epoch by the sharding rules of `data.base`, straight into
one shared-memory buffer.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, get_worker_info

from speedrun.data.base import CountedFiles, Batch, Shard, epoch_permutation, rank_indices

# A run of this many undecodable samples in a row means the data is broken, not a few bad files.
MAX_SUBSTITUTES = 64


@dataclass(frozen=True)
class LoaderOptions:
    """How batches are produced; every field may be overridden by the caller.

    workers: decode processes per device (0 = decode in the calling process).
    pin_memory: page-locked batches for fast, asynchronous host-to-GPU copies (None: on CUDA).
    prefetch: batches each worker keeps ready ahead of the loop.
    draft: JPEG DCT-scaled decoding when the crop allows it.
    """

    workers: int = 0
    pin_memory: bool = False
    prefetch: int = 2
    draft: bool = True


def shared_buffer(shape: tuple[int, ...]) -> torch.Tensor:
    """A uint8 buffer; in a worker, allocated in shared memory so sending it copies nothing."""
    buf = torch.empty(shape, dtype=torch.uint8)
    return buf.share_memory_() if get_worker_info() is not None else buf


def passthrough(batch):
    """collate_fn: __getitems__ already returns a finished batch."""
    return batch


class EpochBatchSampler:
    """This rank's training batches of the current epoch, per the rules in `data.base`.

    `epoch` and `batch_size` are read when iteration starts, so the trainer can change them
    between epochs while the DataLoader (and its persistent workers) stays.
    """

    def __init__(self, num: int, shard: Shard, seed: int, batch_size: int):
        self.num, self.shard, self.seed, self.batch_size, self.epoch = num, shard, seed, batch_size, 0
        self.start_step = 0

    def __len__(self) -> int:
        return self.num // self.shard.world_size // self.batch_size

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch, bs = self.epoch, self.batch_size
        rows = rank_indices(epoch_permutation(self.num, self.seed, epoch), self.shard, bs)
        for i in range(self.start_step * bs, len(rows), bs):  # a Python list per batch, not per epoch
            yield [(epoch, r) for r in rows[i : i + bs].tolist()]


class ImageFolderTrainStream:
    """Training batches for one data setting (`Phase.data_key`); see `data.base.TrainStream`."""

    def __init__(self, dataset: torch.utils.data.Dataset, shard: Shard, seed: int, batch_size: int,
                 options: LoaderOptions, bad: CountedFiles):
        # `dataset` makes whole batches from (epoch, row) keys: imagefolder's decoder, gpu.ByteReader.
        self._sampler = EpochBatchSampler(len(dataset), shard, seed, batch_size)
        self._bad = bad
        workers = options.workers
        self._dataloader = DataLoader(
            dataset,
            batch_sampler=self._sampler,
            num_workers=workers,
            collate_fn=passthrough,
            pin_memory=options.pin_memory,
            persistent_workers=workers > 0,
            prefetch_factor=options.prefetch if workers > 0 else None,
        )

    @property
    def batch_size(self) -> int:
        return self._sampler.batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self._sampler.batch_size = int(value)

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self._sampler.epoch, self._sampler.start_step = int(epoch), int(start_step)

    def __len__(self) -> int:
        return len(self._sampler)

    def __iter__(self) -> Iterator[Batch]:
        for images, labels, bad in self._dataloader:
            if bad:
                self._bad.add(bad)
            yield images, labels

    def worker_pids(self) -> list[int]:
        """PIDs of the decode workers (empty before the first epoch or without workers)."""
        it = self._dataloader._iterator  # DataLoader keeps the persistent iterator here
        return [w.pid for w in getattr(it, "_workers", [])] if it is not None else []

    def close(self) -> None:
        """Stop the workers now (not whenever the garbage collector gets to them)."""
        shutdown_workers(self._dataloader)


def shutdown_workers(loader: DataLoader) -> None:
    """End `loader`'s persistent worker processes now and wait for them, rather than whenever
    the garbage collector (or interpreter shutdown) gets to them. A later epoch starts new ones."""
    it = loader._iterator  # DataLoader keeps the persistent iterator here
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
    loader._iterator = None
