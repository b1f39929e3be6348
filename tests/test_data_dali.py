"""The DALI loader (`data.dali`), run for real with DALI's CPU decoder (CI has no GPU).

Every image in these trees is one flat colour that names its file, so the colour of a decoded
crop (any crop, resized and flipped) says which file it came from: the tests check order,
sharding and substitution of bad files image by image.
"""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from PIL import Image

from speedrun.data.base import Shard, epoch_permutation, rank_indices
from speedrun.data.imagefolder import ImageFolderSource
from speedrun.data.loading import ImageFolderTrainStream
from speedrun.errors import SpeedrunError
from speedrun.recipe import Phase, Recipe
from test_data_helpers import train_from_cli

pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed (pip install 'speedrun[dali]')")
from speedrun.data.dali import DaliTrainStream  # noqa: E402

CPU = torch.device("cpu")
CLASSES, PER_CLASS = 3, 8


def _colour(c: int, i: int) -> tuple[int, int, int]:
    return 40 + 60 * c, 30 + 25 * i, 128


def _flat_tree(root: Path) -> Path:
    """ROOT/{train,val}/cN/iNN.JPEG, each a flat colour naming (class, image), sizes varied."""
    for split, per in (("train", PER_CLASS), ("val", 2)):
        for c in range(CLASSES):
            for i in range(per):
                path = root / split / f"c{c}" / f"i{i:02d}.JPEG"
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.new("RGB", (160 + 20 * (i % 3), 120 + 30 * (c % 2)), _colour(c, i)).save(path, quality=95)
    return root


def _which(image: torch.Tensor) -> tuple[int, int]:
    """(class, image) of a decoded flat-colour crop, C x H x W uint8."""
    r, g, _ = image.float().mean(dim=(1, 2)).tolist()
    return round((r - 40) / 60), round((g - 30) / 25)


@pytest.fixture
def tree(tmp_path):
    return _flat_tree(tmp_path / "flat")


def _epoch(stream, epoch: int) -> list:
    stream.set_epoch(epoch)
    return list(stream)


def _expected(source: ImageFolderSource, shard: Shard, epoch: int, batch: int) -> list[tuple[int, int]]:
    """(class, image) of every sample this rank should see, in order, from the split's paths."""
    split = source._train_split(None)
    rows = rank_indices(epoch_permutation(len(split), 0, epoch), shard, batch).tolist()
    return [(int(p.parent.name[1:]), int(p.stem[1:])) for p in (Path(split.path(r)) for r in rows)]


def test_batches_follow_the_epoch_order_and_the_rank_slice(tree):
    source = ImageFolderSource(tree, workers=2, device=CPU, loader="dali")
    for shard in (Shard(0, 2), Shard(1, 2)):
        stream = source.train_stream(Phase(0, 1, size=32, batch_size=4, lr=0.1), shard, seed=0)
        assert isinstance(stream, DaliTrainStream) and len(stream) == 3
        for epoch in (0, 1):
            batches = _epoch(stream, epoch)
            seen = []
            for images, labels in batches:
                assert images.shape == (4, 3, 32, 32) and images.dtype == torch.uint8
                assert images.is_contiguous(memory_format=torch.channels_last)
                assert labels.dtype == torch.int64
                which = [_which(x) for x in images]
                assert [c for c, _ in which] == labels.tolist()
                seen += which
            assert seen == _expected(source, shard, epoch, 4)
        stream.close()


def test_batch_size_changes_and_an_epoch_left_midway(tree):
    source = ImageFolderSource(tree, workers=1, device=CPU, loader="dali")
    stream = source.train_stream(Phase(0, 1, size=24, batch_size=4, lr=0.1), Shard(), seed=0)
    stream.set_epoch(0)
    next(iter(stream))  # the loop stops mid-epoch (a target reached): the next epoch still works
    stream.batch_size = 8  # larger than the pipeline was built for
    assert len(stream) == 3
    batches = _epoch(stream, 1)
    assert [x.shape[0] for x, _ in batches] == [8, 8, 8]
    assert [_which(x) for b, _ in batches for x in b] == _expected(source, Shard(), 1, 8)
    stream.batch_size = 6
    assert [x.shape[0] for x, _ in _epoch(stream, 2)] == [6, 6, 6, 6]


def test_bad_files_are_counted_logged_and_replaced(tree, caplog):
    source = ImageFolderSource(tree, workers=1, device=CPU, loader="dali")
    truncated, vanished = tree / "train/c0/i01.JPEG", tree / "train/c2/i05.JPEG"
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])  # the header still reads: found only at decode
    vanished.unlink()
    vanished.mkdir()  # a folder now: reading it fails
    stream = source.train_stream(Phase(0, 1, size=24, batch_size=8, lr=0.1), Shard(), seed=0)
    with caplog.at_level(logging.WARNING, logger="speedrun.data"):
        batches = _epoch(stream, 0)
    assert [x.shape[0] for x, _ in batches] == [8, 8, 8]
    seen = [_which(x) for b, _ in batches for x in b]
    assert (0, 1) not in seen and (2, 5) not in seen
    assert set(source.bad_images.files) == {str(truncated), str(vanished)}
    assert "i01.JPEG" in caplog.text and "i05.JPEG" in caplog.text
    count = source.bad_images.count
    assert [x.shape[0] for x, _ in _epoch(stream, 1)] == [8, 8, 8]
    assert source.bad_images.count == count  # known bad files are skipped up front, not decoded again


def test_the_loader_choice(tree):
    from speedrun.data import build_source

    phase = Phase(0, 1, size=24, batch_size=4, lr=0.1)
    auto = ImageFolderSource(tree, workers=0, device=CPU)  # auto on the CPU: PIL
    assert auto.loader == "pil" and isinstance(auto.train_stream(phase, Shard(), 0), ImageFolderTrainStream)
    recipe = Recipe("t", (phase,), dataset="imagefolder")
    chosen = build_source(recipe, str(tree), CPU, workers=1, loader="dali")
    assert chosen.loader == "dali" and isinstance(chosen.train_stream(phase, Shard(), 0), DaliTrainStream)
    with pytest.raises(SpeedrunError, match="applies to image folders"):
        build_source(Recipe("f", (phase,), dataset="fashion-mnist"), None, CPU, loader="dali")


@pytest.mark.slow
def test_train_with_the_dali_loader_from_the_command_line(tree, tmp_path):
    proc, results = train_from_cli(tree, tmp_path, "dali")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "(dali loader)" in proc.stdout
    assert results["status"] == "finished" and results["loader"] == "dali" and results["steps"] == 6
