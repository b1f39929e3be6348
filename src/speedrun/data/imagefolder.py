"""Image folders (ImageNet layout) as a `DataSource`: train streams per phase, validation batches.

Where things are read from:
- the full-size tree at ROOT (``ROOT/train/<class>/...``, ``ROOT/val/<class>/...``);
- resized copies made by ``speedrun data prepare``: a phase with ``copy=N`` reads
  ``COPIES/N/{train,val}``, where COPIES is, in order, the `copies_dir` argument, the
  environment variable ``SPEEDRUN_COPIES``, or ``<ROOT>-sz`` beside ROOT (the 2018 layout:
  ``imagenet`` and ``imagenet-sz/160``). A missing copy falls back to the full-size tree with
  one logged warning. Validation reads the copy it is given (the evaluated phase's, as the
  2018 loader did), or the full-size tree.

Batches are uint8 N x C x H x W tensors whose memory is channels-last (N x H x W x C underneath,
exactly as images decode): no transpose copy on the CPU, and ``.contiguous(channels_last)`` on
the device is free. Labels are int64.

Decoding runs in DataLoader worker processes (persistent for training, so a batch-size change
keeps them); a worker decodes a whole batch into one shared-memory buffer. A file that fails to
decode is logged with its path and counted (`bad_images`); in training its slot is filled by the
next decodable sample, so batch shapes never change; in validation it is left out of its batch.
"""
from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from speedrun.data.kinds import LOADERS
from speedrun.data.base import CountedFiles, Batch, Shard, TrainStream, indexed_device, split_batches_contiguously
from speedrun.data import gpu
from speedrun.data.index import Index, JobShare, Split, load_index_once
from speedrun.data.loading import (
    MAX_SUBSTITUTES,
    ImageFolderTrainStream,
    LoaderOptions,
    passthrough,
    shared_buffer,
)
from speedrun.data.rect import ValBatch, rect_plan, resize_for, square_plan
from speedrun.data.transforms import decode_eval, decode_train
from speedrun.errors import SpeedrunError, one_line
from speedrun.recipe import IMAGENET_CROP_PCT, Phase

log = logging.getLogger("speedrun.data")

# ImageNet statistics in 0..255 units (torchvision's, x 255).
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)
SUBSET_SEED = 0  # fixed: a recipe's train_examples subset is the same for every run


def default_workers() -> int:
    """Decode processes per device: this machine's usable cores shared by the local ranks."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(16, cores // max(local, 1)))


# ---------------------------------------------------------------------------------------------
# Map-style datasets that decode whole batches (DataLoader calls __getitems__ with a batch).


class _TrainDecoder(torch.utils.data.Dataset):
    """Keys are (epoch, row); randomness depends on (seed, epoch, row) only, never on the rank."""

    def __init__(self, root: Path, split: Split, phase: Phase, seed: int, draft: bool):
        # The phase gives the crop geometry (size, min_scale, ratio, translate, flip).
        self.root, self.split, self.phase, self.seed, self.draft = root, split, phase, seed, draft

    def __len__(self) -> int:
        return len(self.split)

    def __getitems__(self, keys: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor, list]:
        n, phase = len(keys), self.phase
        size = phase.size
        images = shared_buffer((n, size, size, 3))
        pixels = images.numpy()
        labels = torch.empty(n, dtype=torch.int64)
        bad: list[tuple[str, str]] = []
        for i, (epoch, row) in enumerate(keys):
            for attempt in range(MAX_SUBSTITUTES):
                # A bad file's slot takes the next row: deterministic, and the batch keeps its shape.
                r = (row + attempt) % len(self.split)
                path = str(self.root / self.split.path(r))
                rng = random.Random(f"{self.seed}/{epoch}/{r}")
                try:
                    decode_train(path, size, phase.min_scale, rng, self.draft, pixels[i], phase.ratio, phase.translate,
                                 phase.flip)
                except Exception as e:  # any decode failure: count it, use another sample
                    bad.append((path, one_line(e)))
                    continue
                labels[i] = int(self.split.labels[r])
                break
            else:
                raise SpeedrunError(f"{MAX_SUBSTITUTES} undecodable images in a row from {path}: is the data intact?")
        return images.permute(0, 3, 1, 2), labels, bad

    def __getitem__(self, key):
        return self.__getitems__([key])


class _EvalDecoder(torch.utils.data.Dataset):
    """Keys are (row, height, width): each batch has the output shape of its plan entry."""

    def __init__(self, root: Path, split: Split, resize: int, draft: bool):
        self.root, self.split, self.resize, self.draft = root, split, resize, draft

    def __len__(self) -> int:
        return len(self.split)

    def __getitems__(self, keys: Sequence[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor, list]:
        _, height, width = keys[0]
        images = shared_buffer((len(keys), height, width, 3))
        pixels = images.numpy()
        labels = torch.empty(len(keys), dtype=torch.int64)
        bad, kept = [], 0
        for row, _, _ in keys:
            path = str(self.root / self.split.path(row))
            try:
                decode_eval(path, self.resize, height, width, self.draft, out=pixels[kept])
            except Exception as e:  # left out of the metrics, counted and logged
                bad.append((path, one_line(e)))
                continue
            labels[kept] = int(self.split.labels[row])
            kept += 1
        return images[:kept].permute(0, 3, 1, 2), labels[:kept], bad

    def __getitem__(self, key):
        return self.__getitems__([key])


def _sample(split: Split, limit: int | None) -> Split:
    """A fixed, seeded sample of `limit` rows in index order; not the first N, because the
    index is sorted by class and the first N would be a few classes only."""
    if limit is None or limit >= len(split):
        return split
    rows = np.random.default_rng(SUBSET_SEED).permutation(len(split))[:limit]
    return split.subset(np.sort(rows))


# ---------------------------------------------------------------------------------------------
# The source


def resolve_loader(loader: str, device: torch.device) -> str:
    """The loader that will decode training batches on `device`: "auto" is the GPU path on a GPU
    with hardware JPEG decoders (`gpu.has_jpeg_engine`: A100, H100, H200, B200) when torchvision
    decodes there (else PIL, with a warning); "gpu" must decode there, on any device (else one clear
    error, rather than every file falling back to the CPU)."""
    if loader == "gpu" or (loader == "auto" and gpu.has_jpeg_engine(device)):
        problem = gpu.decoder_problem(device)
        if problem is None:
            return "gpu"
        if loader == "gpu":
            raise SpeedrunError(f"--loader gpu: torchvision cannot decode JPEGs on {device}: {problem}")
        log.warning("torchvision cannot decode JPEGs on %s (%s): training images are decoded by PIL", device, problem)
        return "pil"
    return "pil" if loader == "auto" else loader


class ImageFolderSource:
    """An ImageNet-layout tree (and its resized copies) as a `DataSource`.

    path: the tree's root. workers, pin_memory, prefetch, draft: see `LoaderOptions` (None:
    chosen for this machine). train_examples / val_examples: a fixed, seeded sample of that many
    images across all classes (the same for every run). copies_dir: see the module
    docstring. device: the training device (None: CUDA when available). loader: what decodes
    training batches, one of `data.LOADERS`: "pil" worker processes, "gpu" torchvision's decoder
    on `device` fed file bytes by the workers (`data.gpu`: nvJPEG on CUDA), "dali" NVIDIA DALI
    (`data.dali`) on `device`, "auto" see `resolve_loader`. job: the processes of a job, so that
    rank 0 checks each index and the others read it (`data.index.load_index_once`); every index
    is then loaded here, at the start: the full tree's and those of `copies_read` (the copies' px,
    as in `Phase.copy`). verify_index: check the indexes file by file.
    """

    channels = 3
    mean = IMAGENET_MEAN
    std = IMAGENET_STD

    def __init__(
        self,
        path: str | os.PathLike,
        workers: int | None = None,
        train_examples: int | None = None,
        val_examples: int | None = None,
        copies_dir: str | os.PathLike | None = None,
        pin_memory: bool | None = None,
        prefetch: int = 2,
        draft: bool = True,
        device: torch.device | None = None,
        loader: str = "auto",
        job: JobShare | None = None,
        verify_index: bool = False,
        copies_read: Sequence[int] = (),
    ):
        self.root = Path(path).expanduser()
        self.device = indexed_device(device or torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        self.options = LoaderOptions(
            workers=default_workers() if workers is None else int(workers),
            pin_memory=self.device.type == "cuda" if pin_memory is None else bool(pin_memory),
            prefetch=prefetch,
            draft=draft,
        )
        self.train_examples, self.val_examples = train_examples, val_examples
        if loader not in LOADERS:
            raise SpeedrunError(f"unknown loader {loader!r} (choose from {', '.join(LOADERS)})")
        from speedrun.data.dali import installed

        if loader == "dali" and not installed():
            raise SpeedrunError("the DALI loader was asked for, but NVIDIA DALI is not installed "
                                "(pip install 'speedrun[dali]')")
        self.loader = resolve_loader(loader, self.device)  # what decodes training batches here
        copies = copies_dir or os.environ.get("SPEEDRUN_COPIES") or f"{self.root.resolve()}-sz"
        self.copies_dir = Path(copies).expanduser()
        if self.copies_dir.exists() and not self.copies_dir.is_dir():  # a typo, never "no copies"
            given = "--copies" if copies_dir else "SPEEDRUN_COPIES" if os.environ.get("SPEEDRUN_COPIES") else "DATA-sz"
            raise SpeedrunError(f"{given} {self.copies_dir} is a file, not the folder of resized copies")
        self.bad_images = CountedFiles()
        self.cpu_decoded = CountedFiles(what="decoding on the CPU")  # the GPU path's fallbacks (not skipped)
        self._indexes: dict[int | None, Index | None] = {}
        self._warned: set[int] = set()
        self._job, self._verify_index = job, verify_index

        full = self.index(None)
        for copy in copies_read:  # now, while every process of a job is here to share the work
            self.index(copy)
        self.name = f"imagefolder:{self.root.name}"
        self.classes = full.classes
        self.num_classes = len(full.classes)
        self.num_train = len(self._train_split(None))
        self.num_val = len(self._val_split(None))

    def skipped_images(self) -> dict[str, int]:
        """Files left out so far: at indexing (unusable, or links not followed) and while
        decoding (distinct files, and failures counting repeats)."""
        return {"at_index": len(self.index(None).bad), "files": len(self.bad_images.files),
                "failures": self.bad_images.count}

    def cpu_fallbacks(self) -> int | None:
        """Training images the GPU path decoded on the CPU so far, counting repeats (None: another loader)."""
        return self.cpu_decoded.count if self.loader == "gpu" else None

    # -- trees -----------------------------------------------------------------------------

    def copy_root(self, copy: int | None) -> Path:
        return self.root if copy is None else self.copies_dir / str(copy)

    def index(self, copy: int | None) -> Index | None:
        """The index of the full tree (copy=None) or of a copy; None when the copy is missing."""
        if copy not in self._indexes:
            workers = self.options.workers or None
            if copy is None:
                self._indexes[None] = load_index_once(self.root, self._job, workers, verify=self._verify_index)
            else:
                root = self.copy_root(copy)
                here = (root / "train").is_dir() and (root / "val").is_dir()
                # Rank 0's view decides, so every process calls load_index_once or none does; a
                # node without the copy rank 0 has then fails there, in one line.
                if self._job.share(here) if self._job else here:
                    self._indexes[copy] = load_index_once(root, self._job, workers, self.index(None).classes,
                                                          self._verify_index)
                else:
                    self._indexes[copy] = None
        return self._indexes[copy]

    def _resolve(self, copy: int | None) -> tuple[int | None, Index]:
        """The copy that will really be read (falling back to full size) and its index."""
        index = self.index(copy)
        if index is None:
            if copy not in self._warned:
                self._warned.add(copy)
                log.warning(
                    "no %d px copy at %s (make it with: speedrun data prepare %s %s --sizes %d); "
                    "reading full-size images",
                    copy, self.copy_root(copy), self.root, self.copies_dir, copy)
            return None, self.index(None)
        return copy, index

    def _train_split(self, copy: int | None) -> Split:
        return _sample(self._resolve(copy)[1].train, self.train_examples)

    def _val_split(self, copy: int | None) -> Split:
        return _sample(self._resolve(copy)[1].val, self.val_examples)

    # -- DataSource ------------------------------------------------------------------------

    def train_stream(self, phase: Phase, shard: Shard, seed: int) -> TrainStream:
        copy, _ = self._resolve(phase.copy)
        if self.loader == "dali":
            from speedrun.data.dali import DaliTrainStream

            try:
                return DaliTrainStream(self.copy_root(copy), self._train_split(copy), phase,
                                       shard, seed, phase.batch_size, self.device, self.options.workers or 1,
                                       self.bad_images)
            except Exception as e:  # optional extra: never worse than the PIL loader
                log.warning("DALI pipeline failed (%s: %s); decoding with PIL", type(e).__name__, e)
        if self.loader == "gpu":
            reader = gpu.ByteReader(self.copy_root(copy), self._train_split(copy), phase, seed)
            return gpu.GpuDecodeTrainStream(reader, shard, seed, phase.batch_size, self.options, self.device,
                                        self.bad_images, self.cpu_decoded)
        dataset = _TrainDecoder(self.copy_root(copy), self._train_split(copy), phase, seed, self.options.draft)
        return ImageFolderTrainStream(dataset, shard, seed, phase.batch_size, self.options, self.bad_images)

    def val_plan(self, size: int, batch_size: int, rect: bool, copy: int | None = None) -> list[ValBatch]:
        """Every validation batch (all ranks), in order, from the `copy` px copy (None: full size;
        a missing copy falls back to full size); see `data.rect`."""
        split = self._val_split(copy)
        if rect:
            return rect_plan(split.widths, split.heights, size, batch_size)
        return square_plan(len(split), size, batch_size)

    def val_batches(self, size: int, batch_size: int, rect: bool, shard: Shard, copy: int | None = None,
                    crop_pct: float = IMAGENET_CROP_PCT) -> Iterator[Batch]:
        copy, _ = self._resolve(copy)
        plan = self.val_plan(size, batch_size, rect, copy)
        mine = [plan[i] for i in split_batches_contiguously(len(plan), shard)]
        if not mine:
            return
        dataset = _EvalDecoder(self.copy_root(copy), self._val_split(copy), resize_for(size, crop_pct),
                               self.options.draft)
        # Keys are made batch by batch as the loader asks, never a list over the whole split.
        keys = ([(r, b.height, b.width) for r in b.rows.tolist()] for b in mine)
        workers = min(self.options.workers, len(mine))
        loader = DataLoader(
            dataset,
            batch_sampler=keys,
            num_workers=workers,
            collate_fn=passthrough,
            pin_memory=self.options.pin_memory,
            prefetch_factor=self.options.prefetch if workers > 0 else None,
        )
        for images, labels, bad in loader:
            if bad:
                self.bad_images.add(bad)
            if len(labels):
                yield images, labels

    def close(self) -> None:
        """Nothing to release: train streams own their workers, validation loaders are per call."""
