"""The image-folder path learns as the in-memory path does: the same Fashion-MNIST images written
as a folder of 28 px PNGs, read with the same recipe, give the same evaluation images, the same
kind of training crops, and (through the CLI) the same accuracy."""
import dataclasses
import json
import random

import numpy as np
import pytest
import torch

from cli_run import speedrun
from speedrun.data.augment import resize_center_crop
from speedrun.data.base import Shard, epoch_permutation
from speedrun.data.fashion_mnist import FashionMNIST
from speedrun.data.imagefolder import ImageFolderSource
from speedrun.data.rect import resize_for
from speedrun.data.synth import FMNIST_CLASSES, fmnist_tree
from speedrun.data.transforms import crop_params
from speedrun.recipes import BUILTIN

TRAIN, VAL = 600, 300


@pytest.fixture(scope="module")
def plain_tree(tmp_path_factory):
    """The first TRAIN / VAL Fashion-MNIST images as a folder of 28 x 28 grayscale PNGs."""
    root = tmp_path_factory.mktemp("fmnist-png")
    fmnist_tree(root, TRAIN, VAL, plain=True, workers=1)
    return root


def folder_order(source: ImageFolderSource, split: str) -> np.ndarray:
    """For each row of the folder's index, the Fashion-MNIST position its file was written from
    (file names carry it), so in-memory tensors can be put in the folder's order."""
    index = source.index(None).split(split)
    return np.array([int(index.path(i).rsplit("_", 1)[1].split(".")[0]) for i in range(len(index))])


@pytest.mark.slow
def test_folder_labels_name_the_same_garments(plain_tree):
    """Class folders are sorted by name, so label numbers differ from Fashion-MNIST's; the
    garments behind them are the same."""
    folder, memory = ImageFolderSource(plain_tree, workers=0), FashionMNIST(None, val_examples=VAL)
    order = folder_order(folder, "val")
    labels = torch.cat([y for _, y in folder.val_batches(28, 100, False, Shard(), crop_pct=1.0)])
    assert [folder.classes[i] for i in labels] == [FMNIST_CLASSES[i] for i in memory.val_labels[order]]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fashion-mnist", "tiny"])
def test_each_phase_evaluates_the_same_images_on_both_paths(plain_tree, recipe):
    """Every phase of the built-in Fashion-MNIST recipes evaluates the whole garment on both paths
    (crop_pct 1.0): exactly the stored pixels at 28 px, the same resize within rounding below.
    The folder path used to resize to 1.14x and centre-crop, the ImageNet convention, which cut
    the garments' edges and cost 10 points of top-1."""
    folder, memory = ImageFolderSource(plain_tree, workers=0), FashionMNIST(None, val_examples=VAL)
    order = torch.from_numpy(folder_order(folder, "val"))
    for phase in BUILTIN[recipe].phases:
        assert phase.crop_pct == 1.0
        got = torch.cat([x for x, _ in folder.val_batches(phase.size, 128, False, Shard(), crop_pct=phase.crop_pct)])
        want = torch.cat([x for x, _ in memory.val_batches(phase.size, 128, False, Shard(),
                                                           crop_pct=phase.crop_pct)])[order]
        assert got.shape == (VAL, 3, phase.size, phase.size)
        assert (got[:, 0] == got[:, 1]).all() and (got[:, 0] == got[:, 2]).all()  # gray stays gray
        diff = (got[:, 0].float() - want[:, 0].float()).abs()
        if phase.size == 28:
            assert diff.max() == 0
        else:  # PIL's and torchvision's antialiased bilinear resizes agree to a grey level or two
            assert diff.mean() < 1.5, diff.mean()


@pytest.mark.slow
def test_crop_pct_below_one_zooms_in_as_the_imagenet_recipes_do(plain_tree):
    folder, memory = ImageFolderSource(plain_tree, workers=0), FashionMNIST(None, val_examples=VAL)
    whole = next(iter(memory.val_batches(28, 8, False, Shard(), crop_pct=1.0)))[0]
    zoomed = next(iter(memory.val_batches(28, 8, False, Shard(), crop_pct=1 / 1.14)))[0]
    assert resize_for(28, 1 / 1.14) == 31
    assert torch.equal(zoomed, resize_center_crop(whole, 28, 31))
    assert not torch.equal(zoomed, whole)
    (folder_zoomed, _), = list(folder.val_batches(28, VAL, False, Shard(), crop_pct=1 / 1.14))
    (folder_whole, _), = list(folder.val_batches(28, VAL, False, Shard(), crop_pct=1.0))
    assert (folder_zoomed.float() - folder_whole.float()).abs().mean() > 5


def shift(image: torch.Tensor, dx: int, dy: int) -> torch.Tensor:
    """`image` (H x W) moved right by dx and down by dy pixels, zeros where nothing moved in."""
    out = torch.zeros_like(image)
    h, w = image.shape
    out[max(dy, 0) : h + min(dy, 0), max(dx, 0) : w + min(dx, 0)] = (
        image[max(-dy, 0) : h - max(dy, 0), max(-dx, 0) : w - max(dx, 0)])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("flip", [True, False])
def test_folder_training_crops_follow_the_phase_geometry(plain_tree, flip):
    """With the Fashion-MNIST geometry (whole image, shape kept, 2 px translation) a folder
    training image is its garment moved by at most 2 px, mirrored only when the phase flips;
    before, the folder path ignored the recipe and always jittered the aspect ratio and flipped."""
    folder, memory = ImageFolderSource(plain_tree, workers=0), FashionMNIST(None, train_examples=TRAIN)
    order = folder_order(folder, "train")
    geometry = dataclasses.replace(BUILTIN["fashion-mnist"].phases[-1], batch_size=TRAIN // 2, flip=flip)
    stream = folder.train_stream(geometry, Shard(), seed=0)
    stream.set_epoch(0)
    images, labels = next(iter(stream))
    stream.close()
    # Which sample each image is: the stream draws rows from the epoch's permutation.
    rows = epoch_permutation(TRAIN, 0, 0)[: len(labels)]
    originals = memory.train_images[order[rows.numpy()], 0]
    moves, mirrored = set(), 0
    for got, original in zip(images[:, 0], originals):
        found = [(dx, dy, m) for dx in range(-2, 3) for dy in range(-2, 3) for m in (False, True)
                 if torch.equal(got, shift(original.flip(-1) if m else original, dx, dy))]
        assert found, "a training crop is not its garment moved by at most 2 px"
        moves.add(found[0][:2])
        mirrored += all(m for _, _, m in found)
    assert len(moves) > 10  # the translation is used, not just the centre
    if flip:
        assert 0.35 < mirrored / len(labels) < 0.65
    else:
        assert mirrored == 0


def test_crop_params_with_translation_and_kept_shape():
    rng = random.Random(0)
    boxes = [crop_params(28, 28, 1.0, rng, ratio=(1.0, 1.0), translate=2 / 28) for _ in range(2000)]
    assert {(w, h) for _, _, w, h in boxes} == {(28, 28)}
    assert {(x, y) for x, y, _, _ in boxes} == {(x, y) for x in range(-2, 3) for y in range(-2, 3)}
    # Without translation the rule is torchvision's: the same draws give the same boxes as before.
    a, b = random.Random(5), random.Random(5)
    assert ([crop_params(500, 375, 0.08, a) for _ in range(100)]
            == [crop_params(500, 375, 0.08, b, (3 / 4, 4 / 3), 0.0) for _ in range(100)])


@pytest.mark.slow
def test_the_cli_trains_the_folder_to_the_in_memory_accuracy(tiny_run, tmp_path):
    """`speedrun train` on the tiny recipe's images as a PNG folder, with the tiny recipe read
    from a file that changes only the dataset, ends within 2 points of the in-memory run's top-1
    with the same seed (before the folder path followed the recipe's geometry it was 4.6 points
    behind: 71.5% against 76.1%). Seeds alone move a run by about 2 points, but a pair with one seed
    starts from the same weights: measured 75.3 against 74.9 (seed 0) and 77.2 against 76.6 (seed
    1). The in-memory run is the session's (conftest.py `tiny_run`: seed 0, deterministic kernels)."""
    tiny = BUILTIN["tiny"]
    root = tmp_path / "png"
    fmnist_tree(root, tiny.train_examples, tiny.val_examples, plain=True)
    recipe_file = tmp_path / "tiny_folder.py"
    recipe_file.write_text(
        "import dataclasses\nfrom speedrun.recipes import BUILTIN\n"
        # The folder holds exactly the tiny recipe's images: no subset to draw.
        "recipe = dataclasses.replace(BUILTIN['tiny'], name='tiny-folder', dataset='imagefolder',\n"
        "                             train_examples=None, val_examples=None)\n"
    )
    memory = json.loads((tiny_run / "results.json").read_text())["final"]["top1"]
    out = tmp_path / "folder"
    proc = speedrun("train", "--recipe", str(recipe_file), "--data", str(root), "--workers", "2",
                    "--seed", "0", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    folder = json.loads((out / "results.json").read_text())["final"]["top1"]
    assert memory > 0.7
    assert abs(folder - memory) < 0.02, (folder, memory)
