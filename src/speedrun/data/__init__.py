"""Data sources: Fashion-MNIST (the demo) and image folders (ImageNet layout).

`build_source` picks the one a recipe names. Each source follows the contract in `data.base`.
Nothing here imports torch at package import, so the command line starts quickly.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from speedrun.data.kinds import DATASETS
from speedrun.data.kinds import LOADERS as LOADERS  # also offered here, where it was first
from speedrun.errors import SpeedrunError

if TYPE_CHECKING:
    import torch

    from speedrun.data.base import DataSource
    from speedrun.data.index import JobShare
    from speedrun.recipe import Recipe


def build_source(
    recipe: Recipe,
    path: str | None,
    device: torch.device,
    workers: int | None = None,
    copies: str | None = None,
    loader: str = "auto",
    job: JobShare | None = None,
    verify_index: bool = False,
) -> DataSource:
    """The data source for `recipe.dataset`, reading from `path` (None: the source's default).

    `workers` is the number of decode processes per device for sources that decode files
    (None: chosen from the machine's cores); `copies` is where an image folder's resized copies
    are (None: $SPEEDRUN_COPIES, else <path>-sz; see docs/data.md). `loader` decodes an image
    folder's training images: "pil" in worker processes, "gpu" with torchvision's decoder on
    `device` (nvJPEG on CUDA) fed file bytes by the workers, "dali" with NVIDIA DALI on `device`,
    "auto" the GPU path on GPUs with hardware JPEG decoders, else PIL. `job`: the processes of
    a job (`data.index.JobShare`), so that one of them checks an image folder's index and the
    others read it. `verify_index`: check the index file by file (`data.index.load_index`).
    """
    if loader != "auto" and recipe.dataset != "imagefolder":
        raise SpeedrunError(f"--loader {loader} applies to image folders; "
                            f"recipe {recipe.name!r} reads {recipe.dataset}")
    if recipe.dataset != "imagefolder" and path is not None and is_image_folder(path):
        from speedrun.recipes import BUILTIN

        readers = ", ".join(name for name, r in BUILTIN.items() if r.dataset == "imagefolder")
        raise SpeedrunError(
            f"{path} is an image folder (train/ and val/), but recipe {recipe.name!r} reads {recipe.dataset}: "
            "for small images use --recipe folder-small (a small ResNet fitted to the folder's image size), "
            f"else a recipe that reads image folders ({readers}) or a recipe file with "
            'dataset="imagefolder" (README, "Recipes are Python")'
        )
    if recipe.dataset == "fashion-mnist":
        from speedrun.data.fashion_mnist import FashionMNIST

        return FashionMNIST(path, device, train_examples=recipe.train_examples, val_examples=recipe.val_examples)
    if recipe.dataset == "imagefolder":
        from speedrun.data.imagefolder import ImageFolderSource

        if path is None:
            raise SpeedrunError(f"recipe {recipe.name!r} reads an image folder: give its root with --data PATH")
        return ImageFolderSource(
            path,
            workers=workers,
            train_examples=recipe.train_examples,
            val_examples=recipe.val_examples,
            copies_dir=copies,
            device=device,
            loader=loader,
            job=job,
            verify_index=verify_index,
            copies_read=sorted({p.copy for p in recipe.phases if p.copy is not None}),
        )
    raise SpeedrunError(f"unknown dataset {recipe.dataset!r} (choose from {', '.join(DATASETS)})")


def folder_summary(path: str, workers: int | None = None) -> tuple[int, int]:
    """(typical image side in px: the median shorter side of the training images, number of
    training images) of the image folder at `path`, from its index (cached after the first look)."""
    import numpy as np

    from speedrun.data.index import load_index

    train = load_index(path, workers).train
    if len(train) == 0:
        raise SpeedrunError(f"{path}/train holds no usable images")
    return int(np.median(np.minimum(train.widths, train.heights))), len(train)


def is_image_folder(path: str) -> bool:
    """Whether `path` has the image-folder layout's two splits (train/ and val/)."""
    return all((Path(path) / split).is_dir() for split in ("train", "val"))
