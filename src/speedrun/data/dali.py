"""Optional decoding with NVIDIA DALI, behind the same `TrainStream` interface.

Install the extra (``pip install 'speedrun[dali]'``, or the DALI build for your CUDA). On a CUDA
training device, image-folder training streams then use it by default; ``--loader dali`` asks
for it on the CPU too (``--loader pil`` never uses it). Validation always uses the PIL loader.
If building the DALI pipeline fails, the source logs why and uses the PIL loader.

The pipeline: file bytes read on the host in this rank's order (the same permutation and rank
slice as the PIL loader, so sharding follows `data.base`), then a fused crop-and-decode
(``decoders.image_random_crop``: only the crop's region of the JPEG is decoded) with
RandomResizedCrop's area and ratio ranges, resize to size x size, random horizontal flip.
On CUDA the decode is ``device="mixed"``: nvJPEG, and the A100/H100/H200 hardware JPEG decoder
where present, with batches coming out on the GPU; on the CPU it is libjpeg-turbo on DALI's
threads. Either way a batch is uint8 N x C x H x W with channels-last memory, like the PIL
loader's.

Differences from the PIL loader: the crop and flip draws come from DALI's own generator (seeded
from the run seed and the rank, continuing across epochs), so they are not a function of (seed,
epoch, sample) and a resumed run draws different crops. A file that fails to decode is found
(the failed batch's files are checked with PIL), logged, counted and, from then on, replaced by
the next sample, as in the PIL loader.
"""
from __future__ import annotations

import importlib.util
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from speedrun.data.base import CountedFiles, Batch, Shard, epoch_permutation, indexed_device, rank_indices
from speedrun.data.index import Split
from speedrun.errors import SpeedrunError, one_line
from speedrun.recipe import Phase

log = logging.getLogger("speedrun.data")


def installed() -> bool:
    """True when the `nvidia.dali` package can be imported."""
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ImportError:  # no `nvidia` namespace package at all
        return False


class _EpochFiles:
    """DALI external source: the encoded files and labels of each batch, in order."""

    def __init__(self, root: Path, split: Split):
        self.root, self.split = root, split
        self.batches: list[np.ndarray] = []

    def __call__(self, info) -> tuple[list[np.ndarray], np.ndarray]:
        if info.iteration >= len(self.batches):
            raise StopIteration
        rows = self.batches[info.iteration]
        return [self._read(int(r)) for r in rows], self.split.labels[rows].astype(np.int64)

    def _read(self, row: int) -> np.ndarray:
        try:
            return np.fromfile(self.root / self.split.path(row), dtype=np.uint8)
        except OSError:  # gone or unreadable since indexing: the decoder fails on it and it is found
            return np.zeros(0, dtype=np.uint8)


def _undecodable(path: Path) -> str | None:
    """Why PIL cannot fully decode `path`, or None when it can."""
    try:
        with Image.open(path) as img:
            img.load()
    except Exception as e:  # any failure is the answer
        return one_line(e)
    return None


class DaliTrainStream:
    """Training batches decoded by DALI on `device` (CUDA or CPU); see `data.base.TrainStream`.

    threads: DALI's CPU threads (file handling on CUDA, the whole decode on the CPU). bad: where
    undecodable files are recorded (`data.base.CountedFiles`).
    """

    def __init__(self, root: Path, split: Split, phase: Phase, shard: Shard, seed: int,
                 batch_size: int, device: torch.device, threads: int, bad: CountedFiles):
        if phase.translate:
            raise ValueError("DALI's random crop has no translation (the phase's translate); the PIL loader has")
        self.root, self.split, self.phase = root, split, phase
        self.shard, self.seed, self.threads, self.bad = shard, seed, max(1, threads), bad
        self.batch_size, self.epoch, self.start_step = batch_size, 0, 0
        self.device = indexed_device(device) if device.type == "cuda" else torch.device("cpu")
        self._files = _EpochFiles(root, split)
        self._bad_rows: set[int] = set()
        self._pipe = None
        self._max_batch = 0
        self._builds = 0
        self._state = "fresh"  # "fresh": never run; "ended": an epoch ran out; "dirty": stopped mid-epoch
        self._build(batch_size)

    def _build(self, max_batch: int) -> None:
        """(Re)build the pipeline for batches up to `max_batch` images."""
        from nvidia.dali import fn, pipeline_def, types

        gpu = self.device.type == "cuda"

        # A new seed per build, so that a rebuilt pipeline does not repeat the first one's draws.
        seed = ((self.seed * 1000 + self.shard.rank) * 1000 + self._builds) % 2**31
        self._builds += 1

        @pipeline_def(batch_size=max_batch, num_threads=self.threads, device_id=self.device.index if gpu else None,
                      seed=seed, prefetch_queue_depth=2)
        def train_pipe():
            jpegs, labels = fn.external_source(source=self._files, num_outputs=2, batch=True,
                                               batch_info=True, dtype=[types.UINT8, types.INT64])
            images = fn.decoders.image_random_crop(
                jpegs, device="mixed" if gpu else "cpu", output_type=types.RGB,
                random_area=[self.phase.min_scale, 1.0], random_aspect_ratio=list(self.phase.ratio), num_attempts=10)
            images = fn.resize(images, resize_x=self.phase.size, resize_y=self.phase.size,
                               interp_type=types.INTERP_LINEAR, antialias=True)
            images = fn.flip(images, horizontal=fn.random.coin_flip(probability=0.5 if self.phase.flip else 0.0))
            return images, labels.gpu() if gpu else labels

        self._pipe = train_pipe()
        self._pipe.build()
        self._max_batch = max_batch
        self._state = "fresh"

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        # DALI draws its crops and flips from its own generator, in batch order: a resumed epoch
        # reads the same images from `start_step` on, augmented with other draws.
        self.epoch, self.start_step = int(epoch), int(start_step)

    def __len__(self) -> int:
        return len(self.split) // self.shard.world_size // self.batch_size

    def _start(self, batches: list[np.ndarray]) -> None:
        """Point the pipeline at `batches`. DALI can only reset a pipeline whose epoch ran out, so
        one left mid-epoch (the loop stopped at its target, say) is built anew."""
        if self._state == "ended":
            self._pipe.reset()
        elif self._state == "dirty":
            self._build(self._max_batch)
        self._files.batches = batches
        self._state = "dirty"

    def _skip_bad(self, rows: np.ndarray) -> np.ndarray:
        """`rows` with each known-bad row replaced by the next good one (the PIL loader's rule)."""
        if not self._bad_rows or not self._bad_rows.intersection(rows.tolist()):
            return rows
        out = rows.copy()
        for i, r in enumerate(out):
            for step in range(len(self.split)):
                candidate = (int(r) + step) % len(self.split)
                if candidate not in self._bad_rows:
                    out[i] = candidate
                    break
            else:
                raise SpeedrunError(f"no decodable training image left in {self.root}")
        return out

    def _record_failure(self, rows: np.ndarray, error: Exception) -> None:
        """Find the files of a failed batch that do not decode, log and count them, or raise."""
        found = []
        for r in rows.tolist():
            path = self.root / self.split.path(r)
            reason = _undecodable(path)
            if reason is not None:
                found.append((r, str(path), reason))
        if not found:  # PIL reads them all: trust DALI's own pointer to the sample, if it gives one
            sample = re.search(r"sample #(\d+)", str(error))
            if sample is None or int(sample.group(1)) >= len(rows):
                first = next((ln.strip() for ln in str(error).splitlines() if ln.strip()), type(error).__name__)
                raise SpeedrunError(f"DALI failed on a batch of readable images: {first}") from error
            r = int(rows[int(sample.group(1))])
            found.append((r, str(self.root / self.split.path(r)), "DALI cannot decode it"))
        self._bad_rows.update(r for r, _, _ in found)
        self.bad.add([(path, reason) for _, path, reason in found])

    def __iter__(self) -> Iterator[Batch]:
        bs = self.batch_size
        if bs > self._max_batch:
            self._build(bs)  # a larger batch than the pipeline was built for
        rows = rank_indices(epoch_permutation(len(self.split), self.seed, self.epoch), self.shard, bs).numpy()
        batches = [self._skip_bad(rows[i : i + bs]) for i in range(self.start_step * bs, len(rows), bs)]
        if not batches:
            return
        self._start(batches)
        done = 0
        while done < len(batches):
            try:
                images, labels = self._pipe.run()
            except RuntimeError as e:  # a file failed to decode; the pipeline is dead after that
                self._record_failure(batches[done], e)
                batches = batches[:done] + [self._skip_bad(b) for b in batches[done:]]
                self._start(batches[done:])  # the pipeline is "dirty": built anew
                continue
            done += 1
            yield self._to_torch(images, labels)
        self._state = "ended"

    def _to_torch(self, images, labels) -> Batch:
        """DALI outputs as torch tensors on the stream's device: uint8 NCHW (channels-last), int64."""
        from nvidia.dali.plugin.pytorch import feed_ndarray

        images, labels = images.as_tensor(), labels.as_tensor()
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        out = torch.empty(images.shape(), dtype=torch.uint8, device=self.device)  # N x H x W x C
        lab = torch.empty(labels.shape(), dtype=torch.int64, device=self.device)
        feed_ndarray(images, out, cuda_stream=stream)
        feed_ndarray(labels, lab, cuda_stream=stream)
        return out.permute(0, 3, 1, 2), lab.view(-1)

    def close(self) -> None:
        self._pipe = None
