"""Fashion-MNIST (Xiao et al. 2017): 60,000 + 10,000 grayscale 28 x 28 images, 10 classes.

The whole dataset is 55 MB of uint8, so it lives in one tensor on the training device and is
augmented there a batch at a time; no loader processes are needed.
"""
from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

import numpy as np
import torch

from speedrun.data.augment import TensorTrainStream, resize_center_crop
from speedrun.data.base import Batch, Shard, split_batches_contiguously
from speedrun.errors import SpeedrunError
from speedrun.data.rect import resize_for
from speedrun.recipe import IMAGENET_CROP_PCT, Phase

FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "val_images": "t10k-images-idx3-ubyte",
    "val_labels": "t10k-labels-idx1-ubyte",
}
DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
# The official mirror (github.com/zalandoresearch/fashion-mnist).
OFFICIAL_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
HOW_TO_GET = (
    "install it with `apt-get install dataset-fashion-mnist`, or put the four IDX files "
    f"({', '.join(f + '.gz' for f in FILES.values())}) in ~/.cache/speedrun/fashion-mnist, or pass --data DIR"
)


def candidate_dirs(path: str | os.PathLike | None = None) -> list[Path]:
    """Where Fashion-MNIST is looked for, in order: an explicit path (alone, when given),
    $SPEEDRUN_DATA/fashion-mnist, ~/.cache/speedrun/fashion-mnist, the Debian package's folder."""
    if path is not None:
        return [Path(path)]
    dirs = []
    if os.environ.get("SPEEDRUN_DATA"):
        dirs.append(Path(os.environ["SPEEDRUN_DATA"]) / "fashion-mnist")
    dirs += [cache_dir(), DEBIAN_DIR]
    return dirs


def cache_dir() -> Path:
    return Path("~/.cache/speedrun/fashion-mnist").expanduser()


def _file_in(directory: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (directory / name).is_file():
            return directory / name
    return None


def find_files(path: str | os.PathLike | None = None, download: bool = True) -> dict[str, Path]:
    """The four IDX files (see `candidate_dirs`), downloading them to the cache when none of the
    places has them and the machine is online. Raises SpeedrunError saying how to get them."""
    for directory in candidate_dirs(path):
        found = {key: _file_in(directory, stem) for key, stem in FILES.items()}
        if all(found.values()):
            return found
    if path is not None:
        if not Path(path).exists():
            raise SpeedrunError(f"data path {str(path)!r} does not exist; {HOW_TO_GET}")
        raise SpeedrunError(f"{str(path)!r} does not hold the four Fashion-MNIST IDX files; {HOW_TO_GET}")
    if download:
        try:
            return _download(cache_dir())
        except OSError as e:
            looked = ", ".join(str(d) for d in candidate_dirs())
            raise SpeedrunError(
                f"Fashion-MNIST not found (looked in {looked}) and downloading failed ({e}); {HOW_TO_GET}"
            ) from None
    raise SpeedrunError(f"Fashion-MNIST not found; {HOW_TO_GET}")


def _download(directory: Path) -> dict[str, Path]:
    import urllib.request

    directory.mkdir(parents=True, exist_ok=True)
    found = {}
    for key, stem in FILES.items():
        target = directory / (stem + ".gz")
        if not target.is_file():
            partial = target.with_suffix(".gz.part")
            with urllib.request.urlopen(OFFICIAL_URL + stem + ".gz", timeout=30) as response:
                partial.write_bytes(response.read())
            partial.replace(target)
        found[key] = target
    return found


def read_idx(path: Path, count: int | None = None) -> np.ndarray:
    """An IDX file (gzipped or not) as a uint8 array of the shape its header gives; with `count`,
    only its first `count` items (all of them if it holds fewer). Only those are read: a recipe
    that trains on a tenth of the set decompresses a tenth of it (0.03 s instead of 0.3 s at every
    start). The file's whole length is still checked against its header, by the gzip trailer's
    size field or the file's size, so a file cut short is refused even where its first items read."""
    gz = path.suffix == ".gz"
    try:
        with (gzip.open if gz else open)(path, "rb") as f:
            # Header: two zero bytes, a type code (0x08 = unsigned byte), the number of dimensions,
            # then one big-endian int32 per dimension.
            head = f.read(4)
            if len(head) < 4 or head[:2] != b"\0\0" or head[2] != 0x08:
                raise SpeedrunError(f"{path} is not an unsigned-byte IDX file")
            ndim = head[3]
            dims = [int.from_bytes(f.read(4), "big") for _ in range(ndim)]
            item = int(np.prod(dims[1:]))
            n = dims[0] if count is None else min(count, dims[0])
            data = f.read(n * item)
            whole = f.read() if count is None else None
        expected = 4 + 4 * ndim + int(np.prod(dims))
        if whole is not None:
            size = 4 + 4 * ndim + len(data) + len(whole)
        elif gz:  # gzip's last 4 bytes: the uncompressed size, modulo 2**32 (RFC 1952)
            with open(path, "rb") as raw:
                raw.seek(-4, os.SEEK_END)
                size, expected = int.from_bytes(raw.read(4), "little"), expected % 2**32
        else:
            size = path.stat().st_size
    except (OSError, EOFError, zlib.error) as e:
        raise SpeedrunError(f"cannot read {path}: {e}") from None
    if size != expected or len(data) != n * item:
        raise SpeedrunError(f"{path} is truncated or corrupt: {size} bytes, expected {expected}")
    return np.frombuffer(data, np.uint8).reshape([n, *dims[1:]])


class FashionMNIST:
    """The Fashion-MNIST DataSource (contract in `speedrun.data.base`)."""

    name = "fashion-mnist"
    num_classes = 10
    channels = 1
    loader = None  # the whole dataset is one tensor on the device
    # Training-set statistics, 0..255 units.
    mean = (72.94,)
    std = (90.02,)

    def __init__(
        self,
        path: str | os.PathLike | None,
        device: torch.device | str = "cpu",
        train_examples: int | None = None,
        val_examples: int | None = None,
    ):
        files = find_files(path)
        counts = {"train_images": train_examples, "train_labels": train_examples, "val_images": val_examples,
                  "val_labels": val_examples}
        arrays = {key: read_idx(p, counts[key]) for key, p in files.items()}
        device = torch.device(device)
        self.train_images = torch.from_numpy(arrays["train_images"][:train_examples].copy())[:, None].to(device)
        self.train_labels = torch.from_numpy(arrays["train_labels"][:train_examples].astype(np.int64)).to(device)
        self.val_images = torch.from_numpy(arrays["val_images"][:val_examples].copy())[:, None].to(device)
        self.val_labels = torch.from_numpy(arrays["val_labels"][:val_examples].astype(np.int64)).to(device)
        self.num_train = len(self.train_labels)
        self.num_val = len(self.val_labels)

    def train_stream(self, phase: Phase, shard: Shard, seed: int) -> TensorTrainStream:
        if phase.copy is not None:
            raise SpeedrunError("fashion-mnist has no resized copies: set copy=None in the recipe's phases")
        return TensorTrainStream(self.train_images, self.train_labels, phase, shard, seed)

    def val_batches(self, size: int, batch_size: int, rect: bool, shard: Shard, copy: int | None = None,
                    crop_pct: float = IMAGENET_CROP_PCT):
        """Test images resized and centre-cropped to `size` px as `crop_pct` says (1.0: whole);
        `rect` and `copy` change nothing: the images are square, and there are no resized copies."""
        num_batches = -(-self.num_val // batch_size)
        for b in split_batches_contiguously(num_batches, shard):
            images = self.val_images[b * batch_size : (b + 1) * batch_size]
            yield (resize_center_crop(images, size, resize_for(size, crop_pct)),
                   self.val_labels[b * batch_size : (b + 1) * batch_size])

    def skipped_images(self) -> None:
        """Nothing is ever skipped: the images are tensors in memory."""
        return None

    def cpu_fallbacks(self) -> None:
        """No decoding at all: the images are tensors in memory."""
        return None

    def close(self) -> None:
        pass


__all__ = ["FashionMNIST", "Batch", "find_files", "read_idx"]
