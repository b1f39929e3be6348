"""Optional GPU decoding with NVIDIA DALI, behind the same `TrainStream` interface.

Install the extra (``pip install nvidia-dali-cuda130``, or the build for your CUDA) and image
folder training streams switch to it on CUDA; the CPU path is unchanged and validation always
uses it. Set ``SPEEDRUN_DALI=0`` to keep the CPU loader. If building the DALI pipeline fails, the
source logs why and uses the CPU loader.

The pipeline: file bytes read on the host in this rank's order (the same permutation and rank
slice as the CPU loader, so sharding follows `data.base`), then a fused crop-and-decode on the
GPU (``decoders.image_random_crop`` with ``device="mixed"``: nvJPEG, and the A100/H100/H200
hardware JPEG decoder where present) with RandomResizedCrop's area and ratio ranges, resize to
size x size, random horizontal flip. Batches come out on the GPU as uint8 N x C x H x W with
channels-last memory, like the CPU loader's.

Differences from the CPU loader, stated plainly: the crop and flip draws come from DALI's own
generator (seeded from the run seed and the rank), so they are not a function of (seed, epoch,
sample); and a file that fails to decode stops the epoch with DALI's error instead of being
replaced. This module has not been run in this project's CI (no GPU, no DALI there).
"""
from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from speedrun.data.base import Batch, Shard, epoch_permutation, rank_indices
from speedrun.data.index import Split

log = logging.getLogger("speedrun.data")


def available() -> bool:
    """True when DALI is installed, CUDA is usable, and SPEEDRUN_DALI is not 0."""
    if os.environ.get("SPEEDRUN_DALI", "1") == "0" or not torch.cuda.is_available():
        return False
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ImportError:  # no `nvidia` namespace package at all
        return False


class _EpochFiles:
    """DALI external source: the encoded files and labels of each batch of the current epoch."""

    def __init__(self, root: Path, split: Split):
        self.root, self.split = root, split
        self.batches: list[np.ndarray] = []

    def __call__(self, info) -> tuple[list[np.ndarray], np.ndarray]:
        if info.iteration >= len(self.batches):
            raise StopIteration
        rows = self.batches[info.iteration]
        files = []
        for r in rows:
            with open(self.root / self.split.path(int(r)), "rb") as f:
                files.append(np.frombuffer(f.read(), dtype=np.uint8))
        return files, self.split.labels[rows].astype(np.int64)


class DaliTrainStream:
    """Training batches decoded on the GPU; see `data.base.TrainStream`."""

    def __init__(self, root: Path, split: Split, size: int, min_scale: float, shard: Shard, seed: int,
                 batch_size: int, threads: int = 4):
        self.root, self.split, self.size, self.min_scale = root, split, size, min_scale
        self.shard, self.seed, self.threads = shard, seed, threads
        self.batch_size, self.epoch = batch_size, 0
        self.device_id = torch.cuda.current_device()
        self._files = _EpochFiles(root, split)
        self._pipe = None
        self._max_batch = 0
        self._build(batch_size)

    def _build(self, max_batch: int) -> None:
        """(Re)build the pipeline for batches up to `max_batch` images."""
        from nvidia.dali import fn, pipeline_def, types

        @pipeline_def(batch_size=max_batch, num_threads=self.threads, device_id=self.device_id,
                      seed=self.seed * 1000 + self.shard.rank, prefetch_queue_depth=2)
        def train_pipe():
            jpegs, labels = fn.external_source(source=self._files, num_outputs=2, batch=True,
                                               batch_info=True, dtype=[types.UINT8, types.INT64])
            images = fn.decoders.image_random_crop(
                jpegs, device="mixed", output_type=types.RGB, random_area=[self.min_scale, 1.0],
                random_aspect_ratio=[3 / 4, 4 / 3], num_attempts=10)
            images = fn.resize(images, resize_x=self.size, resize_y=self.size,
                               interp_type=types.INTERP_LINEAR, antialias=True)
            images = fn.flip(images, horizontal=fn.random.coin_flip(probability=0.5))
            return images, labels.gpu()

        self._pipe = train_pipe()
        self._pipe.build()
        self._max_batch = max_batch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.split) // self.shard.world_size // self.batch_size

    def __iter__(self) -> Iterator[Batch]:
        from nvidia.dali.plugin.pytorch import feed_ndarray

        bs = self.batch_size
        if bs > self._max_batch:
            self._build(bs)  # a larger batch than the pipeline was built for
        rows = rank_indices(epoch_permutation(len(self.split), self.seed, self.epoch), self.shard, bs).numpy()
        self._files.batches = [rows[i : i + bs] for i in range(0, len(rows), bs)]
        self._pipe.reset()
        device = torch.device("cuda", self.device_id)
        stream = torch.cuda.current_stream(device)
        for _ in range(len(self._files.batches)):
            images, labels = self._pipe.run()
            images, labels = images.as_tensor(), labels.as_tensor()
            out = torch.empty(images.shape(), dtype=torch.uint8, device=device)  # N x H x W x C
            lab = torch.empty(labels.shape(), dtype=torch.int64, device=device)
            feed_ndarray(images, out, cuda_stream=stream)
            feed_ndarray(labels, lab, cuda_stream=stream)
            yield out.permute(0, 3, 1, 2), lab.view(-1)

    def close(self) -> None:
        self._pipe = None
