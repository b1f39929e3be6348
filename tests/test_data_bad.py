"""Bad data: each case is decoded correctly, or counted, logged with its path and skipped.

Tests run as root, so chmod 000 does not make a file unreadable; unreadability is made real
with a dangling symlink, a folder named like an image, a FIFO, a symlink loop and a file that
disappears after indexing.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from speedrun.data.base import Shard
from speedrun.errors import SpeedrunError
from speedrun.data.imagefolder import ImageFolderSource
from speedrun.data.index import load_index
from speedrun.data.prepare import REPORT_NAME, prepare
from speedrun.recipe import Phase
from test_data_helpers import make_tree, write_jpeg

PHASE = Phase(0, 1, size=32, batch_size=4, lr=0.1)


def _train_batches(source: ImageFolderSource, phase: Phase = PHASE, epoch: int = 0):
    stream = source.train_stream(phase, Shard(), seed=0)
    try:
        stream.set_epoch(epoch)
        return list(stream)
    finally:
        stream.close()


def _good_case(root: Path, name: str, w: int = 60, h: int = 40) -> Path:
    """Write one unusual-but-valid image into train/c00; return its path."""
    folder = root / "train" / "c00"
    if name == "cmyk":
        return write_jpeg(folder / "cmyk.JPEG", w, h, mode="CMYK")
    if name == "grayscale":
        return write_jpeg(folder / "gray.JPEG", w, h, mode="L")
    if name == "png-named-jpeg":
        return write_jpeg(folder / "png.JPEG", w, h, fmt="PNG")
    if name == "palette-png":
        return write_jpeg(folder / "pal.png", w, h, mode="P", fmt="PNG")
    if name == "rgba-png":
        return write_jpeg(folder / "rgba.png", w, h, mode="RGBA", fmt="PNG")
    if name == "very-large":
        # 12000 x 9000 = 108 Mpx: above PIL's decompression-bomb warning threshold. Uniform
        # colour keeps the file small; draft mode decodes it at 1/8 scale.
        path = folder / "huge.JPEG"
        folder.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (12000, 9000), (200, 30, 40)).save(path, "JPEG", quality=50)
        return path
    raise ValueError(name)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
@pytest.mark.parametrize("case", ["cmyk", "grayscale", "png-named-jpeg", "palette-png", "rgba-png", "very-large"])
def test_unusual_images_decode_correctly(tmp_path, case):
    root = make_tree(tmp_path / "d", classes=1, train_per_class=0, val_per_class=1)
    path = _good_case(root, case)
    idx = load_index(root, workers=1)
    assert idx.bad == [] and len(idx.train) == 1
    source = ImageFolderSource(root, workers=0)
    stream = source.train_stream(Phase(0, 1, size=32, batch_size=1, lr=0.1), Shard(), 0)
    (images, labels), = list(stream)
    assert images.shape == (1, 3, 32, 32) and images.dtype == torch.uint8
    assert source.bad_images.count == 0
    # The pixels are the image's, not garbage: compare the mean colour with PIL's own decode.
    with Image.open(path) as img:
        img.draft("RGB", (img.size[0] // 8, img.size[1] // 8))  # the huge one: no 324 MB decode here
        expected = np.asarray(img.convert("RGB").resize((8, 8)), dtype=np.float64).mean(axis=(0, 1))
    got = images[0].double().mean(dim=(1, 2)).numpy()
    assert np.abs(got - expected).max() < 40, (got, expected)


def _bad_case(root: Path, name: str) -> str:
    """Write one unusable file into train/c00; return its path relative to root."""
    folder = root / "train" / "c00"
    rel = f"train/c00/bad-{name}.JPEG"
    path = root / rel
    if name == "zero-bytes":
        path.write_bytes(b"")
    elif name == "not-an-image":
        path.write_text("<html>404 not found</html>\n" * 20)
    elif name == "dangling-symlink":
        path.symlink_to(root / "nowhere.JPEG")
    elif name == "folder-named-like-image":
        # A folder is walked into (it has no images), never opened as a file.
        path.mkdir()
        return ""
    elif name == "fifo":
        os.mkfifo(path)  # reading would block forever: must be refused without opening
    elif name == "symlink-loop":
        path.symlink_to(path)
    elif name == "folder-symlink-loop":
        (folder / "loop").symlink_to(folder)  # walking it would never end
        return ""
    else:
        raise ValueError(name)
    return rel


BAD_AT_INDEX = ["zero-bytes", "not-an-image", "dangling-symlink", "fifo", "symlink-loop"]


@pytest.mark.parametrize("case", BAD_AT_INDEX + ["folder-named-like-image", "folder-symlink-loop"])
def test_unusable_files_are_listed_and_left_out_of_the_index(tmp_path, case, caplog):
    root = make_tree(tmp_path / "d", classes=2, train_per_class=3)
    rel = _bad_case(root, case)
    with caplog.at_level(logging.WARNING, logger="speedrun.data"):
        idx = load_index(root, workers=1)
    assert len(idx.train) == 6  # the good ones, nothing else
    if rel:
        assert [b.path for b in idx.bad] == [rel]
        assert rel in caplog.text
    # And the source trains on the rest without a hitch.
    batches = _train_batches(ImageFolderSource(root, workers=0))
    assert len(batches) == 1 and batches[0][0].shape == (4, 3, 32, 32)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_truncated_and_vanished_files_are_counted_and_replaced_in_training(tmp_path, workers, caplog):
    # Headers are fine at index time; decoding fails later. The batch keeps its shape.
    root = make_tree(tmp_path / "d", classes=2, train_per_class=4, sizes=[(200, 150)])
    source = ImageFolderSource(root, workers=workers)
    _truncate(root / "train/c00/img001.JPEG")
    (root / "train/c01/img002.JPEG").unlink()
    (root / "train/c01/img002.JPEG").mkdir()  # now a folder: open() fails
    phase = Phase(0, 1, size=32, batch_size=8, lr=0.1)
    with caplog.at_level(logging.WARNING, logger="speedrun.data"):
        batches = _train_batches(source, phase)
    (images, labels), = batches
    assert images.shape == (8, 3, 32, 32)
    assert source.bad_images.count == 2
    assert set(source.bad_images.files) == {str(root / "train/c00/img001.JPEG"), str(root / "train/c01/img002.JPEG")}
    assert "img001.JPEG" in caplog.text and "img002.JPEG" in caplog.text


def test_bad_validation_images_are_left_out_of_the_metrics(tmp_path):
    root = make_tree(tmp_path / "d", classes=2, train_per_class=2, val_per_class=3, sizes=[(200, 150)])
    source = ImageFolderSource(root, workers=0)
    _truncate(root / "val/c01/img000.JPEG")
    for rect in (False, True):
        batches = list(source.val_batches(32, 4, rect, Shard()))
        assert sum(len(labels) for _, labels in batches) == 5
    assert source.bad_images.count == 2 and len(source.bad_images.files) == 1


def test_empty_class_folders_keep_their_label_and_warn(tmp_path, caplog):
    root = make_tree(tmp_path / "d", classes=3, train_per_class=2)
    for f in (root / "train" / "c01").iterdir():
        f.unlink()
    with caplog.at_level(logging.WARNING, logger="speedrun.data"):
        idx = load_index(root, workers=1)
    assert idx.classes == ["c00", "c01", "c02"] and idx.empty_classes == ["c01"]
    assert sorted(set(idx.train.labels.tolist())) == [0, 2]
    assert "c01" in caplog.text


def test_all_bad_tree_is_a_clear_error(tmp_path):
    root = tmp_path / "d"
    (root / "train" / "a").mkdir(parents=True)
    (root / "val" / "a").mkdir(parents=True)
    (root / "train" / "a" / "x.JPEG").write_bytes(b"")
    with pytest.raises(SpeedrunError, match="no usable images"):
        load_index(root, workers=1)


@pytest.mark.slow
def test_prepare_reports_bad_images_and_copies_the_rest(tmp_path):
    root = make_tree(tmp_path / "d", classes=2, train_per_class=3, sizes=[(200, 150)])
    for case in BAD_AT_INDEX:
        _bad_case(root, case)
    _truncate(root / "train/c01/img001.JPEG")
    _good_case(root, "cmyk", 200, 150)
    _good_case(root, "png-named-jpeg", 200, 150)
    summary = prepare(root, tmp_path / "sz", [64], workers=1, progress=False)
    report = (tmp_path / "sz" / REPORT_NAME).read_text().splitlines()
    reported = {line.split("\t")[0] for line in report[1:]}
    assert reported == {f"train/c00/bad-{c}.JPEG" for c in BAD_AT_INDEX} | {"train/c01/img001.JPEG"}
    assert len(summary.bad) == len(reported)
    # The unusual-but-valid ones were resized and converted: real RGB JPEGs now.
    for name in ("cmyk.JPEG", "png.JPEG"):
        with Image.open(tmp_path / "sz/64/train/c00" / name) as img:
            assert img.format == "JPEG" and img.mode == "RGB" and min(img.size) == 64


@pytest.mark.parametrize("link, target", [
    ("train/c00/x", ".."),  # the split: every other class again, labelled c00
    ("train/c00/x", "../.."),  # the root: val's images into training
    ("train/c00/x", "../c01"),  # another class
    ("train/c00/x", "../../val/c00"),  # the other split's same class
    ("val/c01/x", "../../train/c01"),  # training images into validation
])
def test_a_folder_symlink_out_of_its_class_is_reported_and_not_followed(tmp_path, link, target):
    # A link must never make one file count twice or under two labels, nor cross between splits.
    root = make_tree(tmp_path / "d", classes=3, train_per_class=2, val_per_class=2)
    (root / link).symlink_to(target)
    idx = load_index(root, workers=1)
    assert (len(idx.train), len(idx.val)) == (6, 6)
    assert sorted(np.bincount(idx.train.labels).tolist()) == [2, 2, 2]
    assert [b.path for b in idx.bad] == [link] and "not used" in idx.bad[0].reason


def test_links_inside_a_class_or_out_of_the_tree_are_used_once(tmp_path):
    root = make_tree(tmp_path / "d", classes=2, train_per_class=2, val_per_class=1)
    extra = make_tree(tmp_path / "extra", classes=1, train_per_class=3, val_per_class=1)
    (root / "train/c00/more").symlink_to(extra / "train/c00")  # outside the tree: used
    (root / "train/c01/same").symlink_to(extra / "train/c00")  # the same folder again: used once
    (root / "train/c00/again").symlink_to(".")  # a loop inside the class
    (root / "train/c01/dup.JPEG").symlink_to(root / "train/c01/img000.JPEG")  # a file twice
    idx = load_index(root, workers=1)
    assert np.bincount(idx.train.labels).tolist() == [2 + 3, 2]
    reasons = {b.path: b.reason for b in idx.bad}
    assert set(reasons) == {"train/c01/same", "train/c00/again", "train/c01/dup.JPEG"}
    assert "used once" in reasons["train/c01/dup.JPEG"]


@pytest.mark.slow
def test_prepare_copies_no_image_twice_through_a_link(tmp_path):
    root = make_tree(tmp_path / "d", classes=2, train_per_class=2, val_per_class=1, sizes=[(120, 90)])
    (root / "train/c00/x").symlink_to("../..")
    prepare(root, tmp_path / "sz", [48], workers=1, progress=False)
    copied = sorted(str(p.relative_to(tmp_path / "sz" / "48")) for p in (tmp_path / "sz" / "48").rglob("*.JPEG"))
    assert len(copied) == 6 and not any("/x/" in c for c in copied)


def test_a_file_the_system_refused_to_read_is_read_again_next_time(tmp_path, monkeypatch):
    # A permission or I/O error is not a property of the file: not remembered in the cache.
    # (As root, chmod cannot make a file unreadable, so the refusal is injected into PIL.)
    root = make_tree(tmp_path / "d", classes=2, train_per_class=2, val_per_class=1)
    refused = str(root / "train/c00/img001.JPEG")
    real_open = Image.open

    def open_refusing(path, *a, **k):
        if str(path) == refused:
            raise PermissionError(13, "Permission denied", refused)
        return real_open(path, *a, **k)

    monkeypatch.setattr(Image, "open", open_refusing)
    first = load_index(root, workers=1)
    assert len(first.train) == 3 and "Permission denied" in first.bad[0].reason
    monkeypatch.setattr(Image, "open", real_open)
    assert len(load_index(root, workers=1).train) == 4
