"""The image-folder index: contents, cache, invalidation, layout errors."""
from __future__ import annotations

import logging
import os
import re
import time

import numpy as np
import pytest

from speedrun.data import index_cache, index_walk
from speedrun.data.index import CACHE_NAME, cache_path, load_index
from speedrun.errors import SpeedrunError
from cli_run import speedrun_here, start
from test_data_helpers import age, make_tree, write_jpeg


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


def test_cache_is_written_beside_the_data_and_reused(tmp_path):
    root = age(make_tree(tmp_path / "d"))
    first = load_index(root, workers=1)
    assert (root / CACHE_NAME).is_file() and first.checked.headers == 27 and first.checked.written
    # A second load lists the 6 class folders and reads nothing else: no file stat'ed, no header.
    idx = load_index(root, workers=1)
    assert (idx.checked.folders, idx.checked.rescanned, idx.checked.files_statted, idx.checked.headers) == (6, 0, 0, 0)
    assert not idx.checked.written and len(idx.train) == 18


def test_cache_is_invalidated_when_the_tree_changes(tmp_path):
    root = age(make_tree(tmp_path / "d"))
    load_index(root, workers=1)
    write_jpeg(root / "train/c00/new.JPEG", 90, 30, seed=99)  # added
    (root / "train/c01/img000.JPEG").unlink()  # removed
    write_jpeg(root / "val/c02/img001.JPEG", 33, 77, seed=5)  # replaced: other size and bytes
    os.utime(root / "val/c02", ns=(1, 1))  # and its folder's mtime changed (as a copy tool would)
    idx = load_index(root, workers=1)
    # Only the three changed folders are listed again, and only the new and the changed file read.
    assert (idx.checked.rescanned, idx.checked.headers) == (3, 2)
    paths = [idx.train.path(k) for k in range(len(idx.train))]
    assert "train/c00/new.JPEG" in paths and "train/c01/img000.JPEG" not in paths
    j = [idx.val.path(k) for k in range(len(idx.val))].index("val/c02/img001.JPEG")
    assert (idx.val.widths[j], idx.val.heights[j]) == (33, 77)
    # And the cache now holds the new state: a later load reads no header.
    assert load_index(root, workers=1).checked.headers == 0


def test_only_the_changed_folder_is_listed_again(tmp_path):
    root = age(make_tree(tmp_path / "d", classes=3, train_per_class=5))
    write_jpeg(root / "train/c01/deeper/a.JPEG", 30, 30)  # a new sub-folder inside c01
    age(root)
    load_index(root, workers=1)
    write_jpeg(root / "train/c01/deeper/b.JPEG", 40, 20, seed=3)
    idx = load_index(root, workers=1)
    # 7 folders listed; only deeper/ had its files stat'ed (a and b), and only b's header read.
    assert (idx.checked.folders, idx.checked.rescanned, idx.checked.files_statted, idx.checked.headers) == (7, 1, 2, 1)
    assert "train/c01/deeper/b.JPEG" in [idx.train.path(k) for k in range(len(idx.train))]


@pytest.mark.parametrize("change", ["add", "remove", "rename"])
def test_a_file_added_removed_or_renamed_is_seen_without_verify(tmp_path, change):
    root = age(make_tree(tmp_path / "d", classes=2, train_per_class=3))
    load_index(root, workers=1)
    folder = root / "train/c01"
    if change == "add":
        write_jpeg(folder / "img009.JPEG", 30, 30)
    elif change == "remove":
        (folder / "img001.JPEG").unlink()
    else:
        (folder / "img001.JPEG").rename(folder / "renamed.JPEG")
    expected = {"add": ["img000", "img001", "img002", "img009"], "remove": ["img000", "img002"],
                "rename": ["img000", "img002", "renamed"]}[change]
    idx = load_index(root, workers=1)
    assert sorted(os.path.basename(idx.train.path(k))[:-5] for k in range(len(idx.train)) if idx.train.labels[k] == 1) \
        == expected
    assert idx.checked.rescanned == 1


def test_a_file_rewritten_under_its_name_is_seen_with_verify_only(tmp_path):
    root = age(make_tree(tmp_path / "d", classes=2, train_per_class=3))
    load_index(root, workers=1)
    path = root / "train/c00/img001.JPEG"
    stamp = os.stat(root / "train/c00").st_mtime_ns
    write_jpeg(path, 99, 11, seed=7)  # the same name, other content (in place: open, truncate, write)
    assert os.stat(root / "train/c00").st_mtime_ns == stamp  # its folder did not change
    row = lambda idx: [idx.train.path(k) for k in range(len(idx.train))].index("train/c00/img001.JPEG")  # noqa: E731
    trusted = load_index(root, workers=1)
    assert (trusted.train.widths[row(trusted)], trusted.checked.files_statted) == (48, 0)  # the old size: missed
    verified = load_index(root, workers=1, verify=True)
    assert verified.train.widths[row(verified)] == 99 and verified.checked.headers == 1
    assert load_index(root, workers=1).train.widths[row(trusted)] == 99  # and the cache holds it now


def test_a_folder_changed_just_before_the_cache_was_written_is_not_trusted(tmp_path):
    # Its mtime may not tick again for a change made in the same clock tick as the cache's write.
    root = make_tree(tmp_path / "d", classes=2, train_per_class=3)  # written just now
    load_index(root, workers=1)
    again = load_index(root, workers=1)
    assert again.checked.racy == 4 and again.checked.files_statted == 12 and again.checked.headers == 0
    os.utime(root / CACHE_NAME, ns=(time.time_ns() + 10**10,) * 2)  # as if written 10 s later
    assert load_index(root, workers=1).checked.files_statted == 0


def test_a_cache_of_the_old_version_is_rebuilt_saying_so(tmp_path, caplog):
    root = make_tree(tmp_path / "d", classes=2, train_per_class=3)
    np.savez(root / CACHE_NAME, version=np.int64(1), paths=np.array([b"train/c00/img000.JPEG"]))
    with caplog.at_level(logging.WARNING, logger="speedrun.data"):
        idx = load_index(root, workers=1)
    assert idx.checked.headers == 12 and len(idx.train) == 6
    assert [r.getMessage() for r in caplog.records] == [
        f"index cache {root / CACHE_NAME} is version 1, this speedrun keeps version 2: rebuilding it"]


def test_read_only_tree_caches_in_the_cache_dir(tmp_path, monkeypatch):
    root = make_tree(tmp_path / "ro")
    # Tests run as root, for whom every folder is writable: make this one read-only to the code.
    real_access = os.access
    monkeypatch.setattr(index_cache.os, "access",
                        lambda p, m: False if os.path.samefile(p, root) else real_access(p, m))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    where = cache_path(root)
    assert tmp_path / "cache" in where.parents
    load_index(root, workers=1)
    assert where.is_file() and not (root / CACHE_NAME).exists()


@pytest.mark.slow
def test_parallel_header_reading_matches_serial(tmp_path, monkeypatch):
    root = make_tree(tmp_path / "d", classes=2, train_per_class=5, val_per_class=2)
    serial = load_index(root, workers=1, verify=True)
    (root / CACHE_NAME).unlink()
    monkeypatch.setattr(index_walk, "POOL_AFTER", 0)  # a process pool even for 14 files
    pooled = load_index(root, workers=2)
    assert pooled.checked.headers == serial.checked.headers == 14
    for name in ("train", "val"):
        a, b = serial.split(name), pooled.split(name)
        assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("paths", "labels", "widths", "heights"))


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


def test_data_index_verify_from_the_command_line(tmp_path):
    root = age(make_tree(tmp_path / "d", classes=2, train_per_class=3))
    first = speedrun_here("data", "index", str(root))
    assert first.returncode == 0 and "12 image headers read; cache written" in first.stdout
    write_jpeg(root / "train/c00/img001.JPEG", 99, 11, seed=7)  # rewritten in place
    trusted = speedrun_here("data", "index", str(root))
    assert "this load: 4 folders listed, 0 of them read again (0 files stat'ed), 0 image headers read" in trusted.stdout
    verified = speedrun_here("data", "index", str(root), "--verify")
    assert "4 folders listed, 4 of them read again (12 files stat'ed), 1 image headers read" in verified.stdout


@pytest.mark.slow
def test_two_processes_starting_at_once_build_the_index_once(tmp_path):
    root = make_tree(tmp_path / "d", classes=3, train_per_class=4, val_per_class=2)
    procs = [start("data", "index", str(root), "--workers", "1") for _ in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    read = sorted(int(re.search(r"(\d+) image headers read", out).group(1)) for out in outputs)
    assert read == [0, 18], outputs  # one built it; the other waited on the lock, then read no header


@pytest.mark.slow
def test_train_verify_index_sees_a_file_rewritten_in_place(tmp_path):
    root = age(make_tree(tmp_path / "d", classes=2, train_per_class=4, val_per_class=2))
    load_index(root, workers=1)
    write_jpeg(root / "train/c00/img001.JPEG", 99, 11, seed=7)  # in place: its folder unchanged
    recipe = tmp_path / "r.py"
    recipe.write_text("from speedrun.recipe import Phase, Recipe\n"
                      "recipe = Recipe('v', (Phase(0, 1, size=24, batch_size=4, lr=0.05),), "
                      "model='resnet-fmnist-tiny', dataset='imagefolder', val_batch_size=4)\n")
    run = speedrun_here("train", "--recipe", str(recipe), "--data", str(root), "--workers", "1", "--device", "cpu",
                        "--target", "none", "--verify-index", "--out", str(tmp_path / "run"))
    assert run.returncode == 0, run.stderr
    after = load_index(root, workers=1)  # trusted by folder: what the training run's check wrote
    k = [after.train.path(i) for i in range(len(after.train))].index("train/c00/img001.JPEG")
    assert (after.train.widths[k], after.checked.files_statted) == (99, 0)


def test_a_hard_link_added_later_to_a_trusted_folders_file_is_used_once(tmp_path):
    root = age(make_tree(tmp_path / "d", classes=2, train_per_class=3))
    load_index(root, workers=1)
    (root / "train/c00/sub").mkdir()
    os.link(root / "train/c00/img001.JPEG", root / "train/c00/sub/again.JPEG")
    idx = load_index(root, workers=1)
    assert len(idx.train) == 6 and idx.checked.rescanned == 2  # c00 (a new entry) and sub/
    assert [(b.path, b.reason) for b in idx.bad] == [
        ("train/c00/sub/again.JPEG", "the same file as train/c00/img001.JPEG (a link): used once")]
