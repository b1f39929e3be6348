"""Fashion-MNIST: where the files are looked for, corrupt files, and the batched augmentation."""
import gzip
import shutil

import pytest
import torch

from speedrun.data import fashion_mnist as fm
from speedrun.data.augment import TensorTrainStream, random_crop_boxes
from speedrun.data.base import Shard, epoch_generator
from speedrun.errors import SpeedrunError
from speedrun.recipe import Phase

DEBIAN = fm.DEBIAN_DIR


def copy_dataset(to):
    to.mkdir(parents=True)
    for stem in fm.FILES.values():
        shutil.copy(DEBIAN / f"{stem}.gz", to / f"{stem}.gz")
    return to


def test_lookup_order_explicit_then_env_then_cache_then_debian(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPEEDRUN_DATA", raising=False)
    assert fm.find_files(download=False)["train_images"].parent == DEBIAN

    cache = copy_dataset(tmp_path / "home" / ".cache" / "speedrun" / "fashion-mnist")
    assert fm.find_files(download=False)["train_images"].parent == cache

    env = copy_dataset(tmp_path / "env" / "fashion-mnist")
    monkeypatch.setenv("SPEEDRUN_DATA", str(tmp_path / "env"))
    assert fm.find_files(download=False)["train_images"].parent == env

    explicit = copy_dataset(tmp_path / "mine")
    assert fm.find_files(explicit, download=False)["train_images"].parent == explicit


def test_uncompressed_files_are_read_too(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    for stem in fm.FILES.values():
        (tmp_path / stem).write_bytes(gzip.decompress((DEBIAN / f"{stem}.gz").read_bytes()))
    labels = fm.read_idx(fm.find_files(tmp_path)["val_labels"])
    assert labels.shape == (10000,) and labels.max() == 9


def test_corrupt_and_truncated_files_give_clear_errors(tmp_path):
    bad = tmp_path / "t10k-labels-idx1-ubyte"
    bad.write_bytes(b"\x00\x00\x08\x01\x00\x00\x27\x10" + b"\x01" * 100)  # says 10000 labels, has 100
    with pytest.raises(SpeedrunError, match="truncated or corrupt"):
        fm.read_idx(bad)
    bad.write_bytes(b"GIF89a not an idx file")
    with pytest.raises(SpeedrunError, match="not an unsigned-byte IDX file"):
        fm.read_idx(bad)
    zero = tmp_path / "zero.gz"
    zero.write_bytes(b"")
    with pytest.raises(SpeedrunError):
        fm.read_idx(zero)


def test_the_first_items_alone_are_read_and_a_file_cut_short_is_still_refused(tmp_path):
    whole = DEBIAN / "train-images-idx3-ubyte.gz"
    first = fm.read_idx(whole, count=100)
    assert first.shape == (100, 28, 28) and (first == fm.read_idx(whole)[:100]).all()
    assert fm.read_idx(DEBIAN / "t10k-labels-idx1-ubyte.gz", count=10**6).shape == (10000,)  # all there is
    raw = tmp_path / "train-images-idx3-ubyte"
    raw.write_bytes(gzip.decompress(whole.read_bytes()))
    assert (fm.read_idx(raw, count=100) == first).all()
    # Cut after its first images: those still decompress, the length the header gives does not.
    for cut, data in ((tmp_path / "cut.gz", whole.read_bytes()[:200_000]),
                      (tmp_path / "cut", raw.read_bytes()[:100_000])):
        cut.write_bytes(data)
        with pytest.raises(SpeedrunError, match="truncated or corrupt"):
            fm.read_idx(cut, count=10)


def test_source_shapes_subsets_and_val_resize():
    source = fm.FashionMNIST(None, train_examples=1000, val_examples=300)
    assert source.num_train == 1000 and source.num_val == 300
    batches = list(source.val_batches(20, 128, False, Shard()))
    assert [len(y) for _, y in batches] == [128, 128, 44]
    assert batches[0][0].shape == (128, 1, 20, 20) and batches[0][0].dtype == torch.uint8
    with pytest.raises(SpeedrunError, match="no resized copies"):
        source.train_stream(Phase(0, 1, 28, 8, 0.1, copy=160), Shard(), 0)


def test_train_stream_shards_are_disjoint_and_equal_one_big_batch():
    """Rank r of W takes positions r, r+W, ...: step s of all ranks together is step s of one
    process with a W-times-larger batch, augmentation included."""
    images = torch.arange(64, dtype=torch.uint8).view(64, 1, 1, 1).expand(64, 1, 8, 8).contiguous()
    labels = torch.arange(64)
    one = TensorTrainStream(images, labels, Phase(0, 1, 8, 16, 0.1), Shard(0, 1), seed=3)
    parts = [TensorTrainStream(images, labels, Phase(0, 1, 8, 8, 0.1), Shard(r, 2), seed=3) for r in range(2)]
    for s in (one, *parts):
        s.set_epoch(5)
    assert len(one) == 4 and all(len(p) == 4 for p in parts)
    for (x1, y1), (xa, ya), (xb, yb) in zip(one, *parts):
        assert sorted(y1.tolist()) == sorted(ya.tolist() + yb.tolist())
        assert set(ya.tolist()).isdisjoint(yb.tolist())
        by_label = {int(y): x for x, y in zip(torch.cat([xa, xb]), torch.cat([ya, yb]))}
        assert all(torch.equal(by_label[int(y)], x) for x, y in zip(x1, y1))


def test_crop_boxes_stay_in_the_padded_image_and_cover_min_scale():
    boxes, flips = random_crop_boxes(5000, 28, 28, 0.5, epoch_generator(0, 0, 1), translate=2 / 28)
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    assert (boxes[:, :2] >= -2 - 1e-4).all() and (boxes[:, 2:] <= 30 + 1e-4).all()
    assert ((w * h) >= 0.5 * 28 * 28 * 0.999).all()
    assert 0.4 < flips.float().mean() < 0.6


def test_download_when_no_folder_has_the_files(tmp_path, monkeypatch):
    """With nothing on disk, the files are fetched over HTTP into the cache (here from a server on
    loopback standing in for the official mirror); an unreachable mirror is a one-line error."""
    import functools
    import http.server
    import threading

    mirror = copy_dataset(tmp_path / "mirror")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(mirror))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        monkeypatch.delenv("SPEEDRUN_DATA", raising=False)
        monkeypatch.setattr(fm, "DEBIAN_DIR", tmp_path / "no-debian-package")
        monkeypatch.setattr(fm, "OFFICIAL_URL", f"http://127.0.0.1:{server.server_port}/")
        files = fm.find_files()
        assert files["train_labels"].parent == tmp_path / "home" / ".cache" / "speedrun" / "fashion-mnist"
        assert fm.read_idx(files["train_labels"]).shape == (60000,)
    finally:
        server.shutdown()
        server.server_close()
    monkeypatch.setenv("HOME", str(tmp_path / "home2"))
    with pytest.raises(SpeedrunError, match="downloading failed") as error:
        fm.find_files()
    assert "dataset-fashion-mnist" in str(error.value) and "\n" not in str(error.value)
