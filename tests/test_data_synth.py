"""Generated trees: `speedrun data synth imagenet` and `speedrun data synth fmnist-tree`."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from speedrun.cli import main
from speedrun.data.index import load_index
from speedrun.data.synth import FMNIST_CLASSES, FMNIST_DIR, garment_canvas, read_idx


def test_imagenet_tree_is_imagenet_shaped(tmp_path, capsys):
    assert main(["data", "synth", "imagenet", str(tmp_path / "t"), "--classes", "3", "--train-per-class", "25",
                 "--val-per-class", "4", "--workers", "1"]) == 0
    assert "wrote 75 train and 12 val images in 3 classes" in capsys.readouterr().out
    idx = load_index(tmp_path / "t", workers=1)
    assert (len(idx.train), len(idx.val), len(idx.classes)) == (75, 12, 3)
    w, h = idx.train.widths.astype(float), idx.train.heights.astype(float)
    aspect = w / h
    assert 0.5 - 0.01 <= aspect.min() and aspect.max() <= 2.0 + 0.01
    assert np.mean(np.isclose(aspect, 4 / 3, atol=0.01) | np.isclose(aspect, 3 / 4, atol=0.01)) > 0.5
    assert 330 < w.mean() < 470 and 300 < h.mean() < 420
    with Image.open(tmp_path / "t" / idx.train.path(0)) as img:
        assert img.format == "JPEG" and img.mode == "RGB"


def test_imagenet_tree_is_deterministic(tmp_path):
    from speedrun.data.synth import imagenet_tree

    imagenet_tree(tmp_path / "a", classes=2, train_per_class=3, val_per_class=1, workers=1)
    imagenet_tree(tmp_path / "b", classes=2, train_per_class=3, val_per_class=1, workers=1)
    for p in (tmp_path / "a").rglob("*.JPEG"):
        assert p.read_bytes() == (tmp_path / "b" / p.relative_to(tmp_path / "a")).read_bytes()


def test_garment_sits_off_centre_so_a_centre_crop_loses_it():
    garment = np.full((28, 28), 255, dtype=np.uint8)  # a solid white "garment"
    lost = []
    for seed in range(40):
        img = np.asarray(garment_canvas(garment, np.random.default_rng(seed))).max(axis=2)
        h, w = img.shape
        bright = img > 128
        if max(w, h) / min(w, h) < 1.6:
            continue
        s = min(w, h)
        centre = bright[(h - s) // 2 : (h + s) // 2, (w - s) // 2 : (w + s) // 2]
        lost.append(1 - centre.sum() / bright.sum())
    # On clearly wide or tall canvases a square centre crop cuts off a large part of the garment.
    assert len(lost) >= 5 and np.mean(lost) > 0.3


@pytest.mark.skipif(not (FMNIST_DIR / "t10k-images-idx3-ubyte.gz").is_file(), reason="needs dataset-fashion-mnist")
def test_fmnist_tree_from_the_real_idx_files(tmp_path, capsys):
    assert main(["data", "synth", "fmnist-tree", str(tmp_path / "f"),
                 "--train", "40", "--val", "20", "--workers", "1"]) == 0
    idx = load_index(tmp_path / "f", workers=1)
    assert (len(idx.train), len(idx.val), len(idx.classes)) == (40, 20, 10)
    labels = read_idx(FMNIST_DIR / "train-labels-idx1-ubyte.gz")[:40]
    # Each image sits in the folder named for its Fashion-MNIST label.
    counts = np.bincount(idx.train.labels, minlength=10)
    for k, name in enumerate(FMNIST_CLASSES):
        assert counts[idx.classes.index(name)] == (labels == k).sum()
    aspect = idx.train.widths / idx.train.heights
    assert aspect.min() < 0.8 and aspect.max() > 1.25


def test_fmnist_tree_without_the_dataset_is_a_clear_error(tmp_path, capsys):
    assert main(["data", "synth", "fmnist-tree", str(tmp_path / "f"), "--source", str(tmp_path / "none")]) == 2
    assert "Fashion-MNIST not found" in capsys.readouterr().err


@pytest.mark.parametrize("kind, args, expected", [
    ("imagenet", ["--classes", "0"], "argument --classes: 0 is not a whole number in 2..100,000"),
    ("imagenet", ["--classes", "1"], "argument --classes: 1 is not a whole number in 2..100,000"),
    ("imagenet", ["--classes", "1000000000"], "argument --classes: 1000000000 is not a whole number in 2..100,000"),
    ("imagenet", ["--train-per-class", "0"], "argument --train-per-class: 0 is not a whole number in 1..100,000"),
    ("imagenet", ["--val-per-class", "-3"], "argument --val-per-class: -3 is not a whole number in 1..100,000"),
    ("imagenet", ["--classes", "1000", "--train-per-class", "3000"],
     "3,020,000 images asked for: a generated tree holds at most 2,000,000"),
    ("imagenet", ["--workers", "-1"], "argument --workers: -1 is not a whole number in 1..256"),
    ("imagenet", ["--quality", "101"], "argument --quality: 101 is not a whole number in 1..100"),
    ("fmnist-tree", ["--train", "-5"], "argument --train: -5 is not a whole number in 1..60,000"),
    ("fmnist-tree", ["--train", "70000"], "argument --train: 70000 is not a whole number in 1..60,000"),
    ("fmnist-tree", ["--val", "0"], "argument --val: 0 is not a whole number in 1..10,000"),
    ("fmnist-tree", ["--side", "100000"], "argument --side: 100000 is not a whole number in 28..2048"),
    ("fmnist-tree", ["--side", "10"], "argument --side: 10 is not a whole number in 28..2048"),
    ("fmnist-tree", ["--seed", "-1"], "argument --seed: -1 is not a whole number in 0..4,294,967,295"),
    ("fmnist-tree", ["--seed", "abc"], "argument --seed: 'abc' is not a whole number in 0..4,294,967,295"),
])
def test_synth_refuses_what_it_cannot_make_in_one_line(tmp_path, capsys, kind, args, expected):
    assert main(["data", "synth", kind, str(tmp_path / "t"), *args]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "t").exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["imagenet", "fmnist-tree"])
def test_synth_into_a_file_or_a_read_only_folder_is_one_line(tmp_path, read_only_dir, capsys, kind):
    (tmp_path / "afile").write_text("x")
    for dst, expected in ((tmp_path / "afile", "is a file"), (tmp_path / "afile" / "sub", "is a file"),
                          (read_only_dir / "t", "is on a read-only file system")):
        assert main(["data", "synth", kind, str(dst), "--workers", "1"]) == 2
        err = capsys.readouterr().err
        assert expected in err and len(err.strip().splitlines()) == 1, err
