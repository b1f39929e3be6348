"""The image-folder index: contents, cache, invalidation, layout errors."""
from __future__ import annotations

import os

import numpy as np
import pytest

from speedrun.data import index as index_mod
from speedrun.data.index import CACHE_NAME, cache_path, load_index
from speedrun.errors import SpeedrunError
from test_data_helpers import make_tree, write_jpeg


def test_index_lists_every_image_with_label_and_size(tmp_path):
    root = make_tree(tmp_path / "d", classes=3, train_per_class=4, val_per_class=2)
    (root / "train" / "c01" / "README.txt").write_text("not an image")  # ignored silently
    idx = load_index(root, workers=1)
    assert idx.classes == ["c00", "c01", "c02"]
    assert len(idx.train) == 12 and len(idx.val) == 6
    assert idx.bad == []
    i = [idx.train.path(k) for k in range(len(idx.train))].index("train/c01/img002.JPEG")
    assert idx.train.labels[i] == 1
    from PIL import Image

    with Image.open(root / "train/c01/img002.JPEG") as img:
        assert (idx.train.widths[i], idx.train.heights[i]) == img.size


def test_cache_is_written_beside_the_data_and_reused(tmp_path, monkeypatch):
    root = make_tree(tmp_path / "d")
    load_index(root, workers=1)
    assert (root / CACHE_NAME).is_file()
    # A second load must not read a single header.
    calls = []
    monkeypatch.setattr(index_mod, "_header_pool_map", lambda paths, *a: calls.append(paths) or [])
    idx = load_index(root, workers=1)
    assert calls == [] and len(idx.train) == 18


def test_cache_is_invalidated_when_the_tree_changes(tmp_path, monkeypatch):
    root = make_tree(tmp_path / "d")
    load_index(root, workers=1)
    read = []
    real = index_mod._header_pool_map

    def spy(paths, *a):
        read.extend(paths)
        return real(paths, *a)

    monkeypatch.setattr(index_mod, "_header_pool_map", spy)
    write_jpeg(root / "train/c00/new.JPEG", 90, 30, seed=99)  # added
    (root / "train/c01/img000.JPEG").unlink()  # removed
    write_jpeg(root / "val/c02/img001.JPEG", 33, 77, seed=5)  # replaced: other size and bytes
    idx = load_index(root, workers=1)
    # Only the new and the changed file are re-read.
    assert sorted(os.path.relpath(p, root) for p in read) == ["train/c00/new.JPEG", "val/c02/img001.JPEG"]
    paths = [idx.train.path(k) for k in range(len(idx.train))]
    assert "train/c00/new.JPEG" in paths and "train/c01/img000.JPEG" not in paths
    j = [idx.val.path(k) for k in range(len(idx.val))].index("val/c02/img001.JPEG")
    assert (idx.val.widths[j], idx.val.heights[j]) == (33, 77)
    # And the cache now holds the new state: a third load reads nothing.
    read.clear()
    load_index(root, workers=1)
    assert read == []


def test_read_only_tree_caches_in_the_cache_dir(tmp_path, monkeypatch):
    root = make_tree(tmp_path / "ro")
    # Tests run as root, for whom every folder is writable: make this one read-only to the code.
    real_access = os.access
    monkeypatch.setattr(index_mod.os, "access", lambda p, m: False if os.path.samefile(p, root) else real_access(p, m))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    where = cache_path(root)
    assert tmp_path / "cache" in where.parents
    load_index(root, workers=1)
    assert where.is_file() and not (root / CACHE_NAME).exists()


def test_parallel_header_reading_matches_serial(tmp_path):
    root = make_tree(tmp_path / "d", classes=2, train_per_class=5, val_per_class=2)
    paths = [str(p) for p in sorted(root.rglob("*.JPEG"))]
    assert index_mod._header_pool_map(paths, 2, "x") == index_mod._header_pool_map(paths, 1, "x")


def test_classes_come_from_train_and_val_class_missing_from_train_is_an_error(tmp_path):
    root = make_tree(tmp_path / "d", classes=2)
    write_jpeg(root / "val" / "zebra" / "a.JPEG", 40, 40)
    with pytest.raises(SpeedrunError, match="zebra"):
        load_index(root, workers=1)


def test_val_may_lack_a_class_that_train_has(tmp_path):
    root = make_tree(tmp_path / "d", classes=3)
    for f in (root / "val" / "c02").iterdir():
        f.unlink()
    (root / "val" / "c02").rmdir()
    idx = load_index(root, workers=1)
    assert idx.classes == ["c00", "c01", "c02"] and set(idx.val.labels.tolist()) == {0, 1}


@pytest.mark.parametrize("missing", ["train", "val"])
def test_missing_split_is_a_clear_error(tmp_path, missing):
    root = make_tree(tmp_path / "d")
    import shutil

    shutil.rmtree(root / missing)
    with pytest.raises(SpeedrunError, match=f"no {missing} folder"):
        load_index(root, workers=1)


def test_nested_folders_inside_a_class_are_indexed(tmp_path):
    root = make_tree(tmp_path / "d", classes=2, train_per_class=2)
    write_jpeg(root / "train/c01/deeper/still/x.JPEG", 30, 30)
    idx = load_index(root, workers=1)
    k = [idx.train.path(i) for i in range(len(idx.train))].index("train/c01/deeper/still/x.JPEG")
    assert idx.train.labels[k] == 1


def test_labels_are_stable_int64_arrays(tmp_path):
    idx = load_index(make_tree(tmp_path / "d"), workers=1)
    assert idx.train.labels.dtype == np.int64 and idx.train.widths.dtype == np.int32
