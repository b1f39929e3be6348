"""Training streams: batch format, sharding, determinism, batch-size change with the same workers."""
from __future__ import annotations

import pytest
import torch

from speedrun.data.base import Shard
from speedrun.data.imagefolder import ImageFolderSource
from speedrun.recipe import Phase, Recipe
from test_data_helpers import make_tree


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return make_tree(tmp_path_factory.mktemp("stream") / "d", classes=4, train_per_class=6, val_per_class=2,
                     sizes=[(96, 72), (72, 96), (120, 60)])


def _epoch(source, phase, shard, seed=0, epoch=0):
    stream = source.train_stream(phase, shard, seed)
    stream.set_epoch(epoch)
    try:
        return list(stream)
    finally:
        stream.close()


def test_batches_are_uint8_nchw_with_int64_labels(tree):
    source = ImageFolderSource(tree, workers=0)
    assert (source.num_classes, source.num_train, source.num_val, source.channels) == (4, 24, 8, 3)
    batches = _epoch(source, Phase(0, 1, size=40, batch_size=5, lr=0.1), Shard())
    assert len(batches) == 4  # 24 // 5, whole batches only
    for images, labels in batches:
        assert images.shape == (5, 3, 40, 40) and images.dtype == torch.uint8
        assert labels.dtype == torch.int64 and 0 <= labels.min() and labels.max() < 4
        # Channels-last memory: the batch is the decoded H x W x C pixels, not a transposed copy.
        assert images.is_contiguous(memory_format=torch.channels_last)


def test_ranks_together_see_what_one_process_sees(tree):
    # World 2 with batch 4 == world 1 with batch 8, sample by sample, pixel by pixel.
    source = ImageFolderSource(tree, workers=0)
    one = _epoch(source, Phase(0, 1, size=32, batch_size=8, lr=0.1, min_scale=0.3), Shard(0, 1), epoch=3)
    ranks = [_epoch(source, Phase(0, 1, size=32, batch_size=4, lr=0.1, min_scale=0.3), Shard(r, 2), epoch=3)
             for r in range(2)]
    assert len(one) == len(ranks[0]) == len(ranks[1]) == 3
    for step, (images, labels) in enumerate(one):
        joined = {(int(label), bytes(x.contiguous().numpy())) for rank in ranks for x, label in zip(*rank[step])}
        single = {(int(label), bytes(x.contiguous().numpy())) for x, label in zip(images, labels)}
        assert joined == single


def test_epochs_and_seeds_change_the_order_and_the_crops(tree):
    source = ImageFolderSource(tree, workers=0)
    phase = Phase(0, 1, size=32, batch_size=24, lr=0.1)
    a = _epoch(source, phase, Shard(), seed=0, epoch=0)[0]
    b = _epoch(source, phase, Shard(), seed=0, epoch=0)[0]
    c = _epoch(source, phase, Shard(), seed=0, epoch=1)[0]
    d = _epoch(source, phase, Shard(), seed=1, epoch=0)[0]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # deterministic
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[0], d[0])


@pytest.mark.slow
def test_batch_size_change_keeps_the_same_workers(tree):
    source = ImageFolderSource(tree, workers=2)
    stream = source.train_stream(Phase(0, 1, size=32, batch_size=4, lr=0.1), Shard(), 0)
    try:
        stream.set_epoch(0)
        first = list(stream)
        pids = stream.worker_pids()
        assert len(first) == 6 and len(pids) == 2
        stream.batch_size = 8
        stream.set_epoch(1)
        assert len(stream) == 3
        second = list(stream)
        assert [x.shape[0] for x, _ in second] == [8, 8, 8]
        assert stream.worker_pids() == pids
    finally:
        stream.close()
    assert stream.worker_pids() == []


@pytest.mark.slow
def test_workers_and_in_process_decoding_give_identical_batches(tree):
    phase = Phase(0, 1, size=32, batch_size=6, lr=0.1)
    a = _epoch(ImageFolderSource(tree, workers=0), phase, Shard(), epoch=2)
    b = _epoch(ImageFolderSource(tree, workers=2), phase, Shard(), epoch=2)
    assert all(torch.equal(x, y) and torch.equal(labels_x, labels_y) for (x, labels_x), (y, labels_y) in zip(a, b))


def test_train_examples_subset_spans_the_classes(tree):
    # The first 6 training (or 2 validation) images would all be class 0.
    source = ImageFolderSource(tree, workers=0, train_examples=6, val_examples=2)
    assert (source.num_train, source.num_val) == (6, 2)
    labels = torch.cat([y for _, y in _epoch(source, Phase(0, 1, size=32, batch_size=6, lr=0.1), Shard())])
    assert len(labels) == 6 and len(set(labels.tolist())) > 1
    val = torch.cat([y for _, y in source.val_batches(32, 8, False, Shard())])
    assert len(val) == 2 and len(set(val.tolist())) > 1


def test_build_source_dispatches_to_image_folders(tree):
    from speedrun.data import build_source

    recipe = Recipe("t", (Phase(0, 1, size=32, batch_size=4, lr=0.1),), dataset="imagefolder", train_examples=12)
    source = build_source(recipe, str(tree), torch.device("cpu"), workers=0)
    assert isinstance(source, ImageFolderSource) and source.num_train == 12


def test_the_dali_loader_without_dali_is_a_clear_error_and_auto_means_pil_on_the_cpu(tree, monkeypatch):
    from speedrun.data import dali
    from speedrun.data.loading import ImageFolderTrainStream
    from speedrun.errors import SpeedrunError

    monkeypatch.setattr(dali, "installed", lambda: False)
    with pytest.raises(SpeedrunError, match="DALI is not installed"):
        ImageFolderSource(tree, workers=0, device=torch.device("cpu"), loader="dali")
    source = ImageFolderSource(tree, workers=0, device=torch.device("cpu"))
    assert source.loader == "pil"
    assert isinstance(source.train_stream(Phase(0, 1, size=32, batch_size=4, lr=0.1), Shard(), 0),
                      ImageFolderTrainStream)
