"""The GPU decode path (`data.gpu`, `--loader gpu`) run on the CPU, as CI can: the workers read
bytes, torchvision decodes them in the training process, one roi_align crops the batch. It must
give the PIL loader's files, in its order, with its labels, crops and flips."""
from __future__ import annotations

import io
import threading
from pathlib import Path

import pytest
import torch
from PIL import Image

from speedrun.data import augment, gpu
from speedrun.data.augment import crop_resize_flip, crop_resize_flip_ragged, random_crop_boxes
from speedrun.data.base import Shard
from speedrun.data.gpu import GpuDecodeTrainStream, gpu_unsupported
from speedrun.data.imagefolder import ImageFolderSource, resolve_loader
from speedrun.errors import SpeedrunError
from speedrun.recipe import Phase
from test_data_helpers import make_tree, train_from_cli, write_jpeg

CPU = torch.device("cpu")
SIZES = [(120, 90), (90, 120), (160, 80), (100, 100), (70, 130)]
PHASE = Phase(0, 1, size=32, batch_size=4, lr=0.1)
WHOLE = Shard()  # one process reading all the data


def _batches(source: ImageFolderSource, epoch: int, shard: Shard = WHOLE, start_step: int = 0,
             phase: Phase = PHASE) -> list:
    stream = source.train_stream(phase, shard, seed=0)
    try:
        stream.set_epoch(epoch, start_step)
        return list(stream)
    finally:
        stream.close()


def _sources(root, workers: int = 2) -> tuple[ImageFolderSource, ImageFolderSource]:
    # draft=False: the PIL loader then decodes at full size too, so the pixels can be compared.
    return (ImageFolderSource(root, workers=workers, device=CPU, loader="pil", draft=False),
            ImageFolderSource(root, workers=workers, device=CPU, loader="gpu"))


def _mean_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().mean().item()


@pytest.fixture
def tree(tmp_path):
    return make_tree(tmp_path / "d", classes=3, train_per_class=8, sizes=SIZES)


@pytest.mark.slow
def test_the_same_images_crops_flips_and_labels_as_the_pil_loader(tree):
    pil, gpu = _sources(tree)
    assert gpu.loader == "gpu"
    for shard in (Shard(0, 2), Shard(1, 2)):
        for epoch, start in ((0, 0), (1, 1)):  # an epoch resumed at step 1 too
            expected, got = _batches(pil, epoch, shard, start), _batches(gpu, epoch, shard, start)
            assert len(got) == len(expected) == 3 - start
            for (x, y), (gx, gy) in zip(expected, got):
                assert gy.tolist() == y.tolist()
                assert gx.shape == x.shape == (4, 3, 32, 32) and gx.dtype == torch.uint8
                # Other decoders and resamplers: a little off, never another crop or flip.
                assert _mean_difference(gx, x) < 1.5
    # What "another crop" looks like, so the bound above means something.
    other = _batches(pil, 2)[0][0]
    assert _mean_difference(other, _batches(gpu, 0)[0][0]) > 10
    assert gpu.cpu_fallbacks() == 0 and gpu.bad_images.count == 0


def test_one_batched_crop_equals_cropping_each_image_alone(monkeypatch):
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8) for h, w in ((30, 70), (64, 20), (50, 50), (17, 33))]
    flips = torch.tensor([True, False, True, False])
    # Boxes inside their images (up to the edges): exactly roi_align on each image alone.
    inside = torch.tensor([[0.0, 0, 70, 30], [2.5, 3.2, 19.9, 60.1], [0.2, 0.3, 49.8, 49.9], [3, 3, 10, 9]])
    together = crop_resize_flip_ragged(images, inside, flips, 12)
    for i, image in enumerate(images):
        alone = crop_resize_flip(image[None], inside[i : i + 1], flips[i : i + 1], 12)[0]
        assert (together[i].int() - alone.int()).abs().max() <= 1  # float rounding only
    # Boxes reaching past an edge: the image zero-padded there, as the PIL loader pads.
    past = torch.tensor([[-1.4, -1.4, 60.6, 28.6], [1.3, 2.2, 23.7, 66.9], [-5, -5, 55, 55], [-2.5, 0.5, 30.0, 18.2]])
    together = crop_resize_flip_ragged(images, past, flips, 12)
    for i, image in enumerate(images):
        padded = torch.nn.functional.pad(image, (8, 8, 8, 8))
        alone = crop_resize_flip(padded[None], past[i : i + 1] + 8, flips[i : i + 1], 12)[0]
        assert (together[i].int() - alone.int()).abs().max() <= 1
    # Many images, on one canvas and on several (a canvas holds at most MAX_CANVAS_PX): the same crops.
    same = torch.randint(0, 256, (40, 3, 48, 64), dtype=torch.uint8)
    boxes, flips = random_crop_boxes(40, 48, 64, 0.2, torch.Generator().manual_seed(0))
    batched = crop_resize_flip(same, boxes, flips, 16)
    assert (batched.int() - crop_resize_flip_ragged(list(same), boxes, flips, 16).int()).abs().max() <= 1
    monkeypatch.setattr(augment, "MAX_CANVAS_PX", 3 * 66 * 50)  # about three images a canvas
    assert (batched.int() - crop_resize_flip_ragged(list(same), boxes, flips, 16).int()).abs().max() <= 1


def _encoded(width: int, height: int, **save) -> bytes:
    buf = io.BytesIO()
    mode = save.pop("mode", "RGB")
    Image.new(mode, (width, height)).save(buf, save.pop("format", "JPEG"), **save)
    return buf.getvalue()


def test_the_header_says_which_files_nvjpeg_takes():
    assert gpu_unsupported(_encoded(40, 30)) is None
    assert gpu_unsupported(_encoded(40, 30, progressive=True)).startswith("a progressive JPEG")
    assert gpu_unsupported(_encoded(40, 30, mode="L")) is None
    assert gpu_unsupported(_encoded(40, 30, mode="CMYK")) == "a JPEG of 4 colour components"
    assert gpu_unsupported(_encoded(40, 30, format="PNG")) == "not a JPEG"
    assert gpu_unsupported(_encoded(40, 30)[:20]) == "damaged JPEG header"
    assert gpu_unsupported(b"") == "not a JPEG"


@pytest.mark.slow
def test_odd_files_fall_back_to_the_cpu_and_bad_ones_are_replaced_as_in_the_pil_loader(tmp_path, caplog):
    root = make_tree(tmp_path / "d", classes=2, train_per_class=6, sizes=[(90, 70)])
    write_jpeg(root / "train/c00/img000.JPEG", 90, 70, seed=50, mode="CMYK")  # header says: CPU
    write_jpeg(root / "train/c00/img001.JPEG", 90, 70, seed=51, fmt="PNG")  # a PNG named .JPEG: CPU
    pil, gpu = _sources(root)
    truncated = root / "train/c01/img002.JPEG"  # after indexing: the header is fine, the body is not
    truncated.write_bytes(truncated.read_bytes()[:300])
    phase = Phase(0, 1, size=32, batch_size=12, lr=0.1)  # every file in one batch
    (x, y), = _batches(pil, 0, phase=phase)
    (gx, gy), = _batches(gpu, 0, phase=phase)
    assert gy.tolist() == y.tolist() and gx.shape == x.shape
    assert _mean_difference(gx, x) < 1.5  # the truncated file's slot got the PIL loader's substitute
    assert gpu.cpu_fallbacks() == 2
    assert set(gpu.cpu_decoded.files) == {str(root / "train/c00/img000.JPEG"), str(root / "train/c00/img001.JPEG")}
    assert set(gpu.bad_images.files) == {str(truncated)} and gpu.skipped_images()["failures"] == 1
    _batches(gpu, 1, phase=phase)
    assert gpu.cpu_fallbacks() == 4 and gpu.bad_images.count == 2  # counted every time, like bad files


@pytest.mark.slow
def test_train_with_the_gpu_loader_from_the_command_line(tree, tmp_path):
    proc, results = train_from_cli(tree, tmp_path, "gpu")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "(gpu loader)" in proc.stdout
    assert results["status"] == "finished" and results["loader"] == "gpu" and results["steps"] == 6
    assert results["cpu_fallbacks"] == 0


def test_the_stream_class_and_auto_on_the_cpu(tree):
    source = ImageFolderSource(tree, workers=0, device=CPU, loader="gpu")
    assert isinstance(source.train_stream(PHASE, Shard(), 0), GpuDecodeTrainStream)
    assert ImageFolderSource(tree, workers=0, device=CPU).loader == "pil"  # auto picks the GPU path on CUDA only


def test_a_device_torchvision_cannot_decode_on_is_one_clear_error_or_pil_for_auto(tree, monkeypatch):
    def no_nvjpeg(files, device):
        raise RuntimeError("decode_jpegs_cuda: torchvision not compiled with nvJPEG support")

    monkeypatch.setattr(gpu, "_decode", no_nvjpeg)
    with pytest.raises(SpeedrunError, match="--loader gpu: torchvision cannot decode JPEGs on cpu: .*nvJPEG"):
        ImageFolderSource(tree, workers=0, device=CPU, loader="gpu")
    cuda = torch.device("cuda")  # no CUDA is used: the decoder is the one above, the capability below
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))  # an H100 or H200
    assert resolve_loader("auto", cuda) == "pil"  # rather than every file falling back, one by one
    monkeypatch.setattr(gpu, "decoder_problem", lambda device: None)
    assert resolve_loader("auto", cuda) == "gpu"
    # A GPU without hardware JPEG decoders (a V100, 7.0) decodes one image at a time: auto keeps PIL,
    # --loader gpu is still obeyed.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (7, 0))
    assert resolve_loader("auto", cuda) == "pil" and resolve_loader("gpu", cuda) == "gpu"


def test_cuda_without_an_index_becomes_the_current_device(tree, monkeypatch):
    # The GPU path's decode thread sets its device, and torch.cuda.set_device refuses a bare
    # "cuda": benchmarks/loader.py's ImageFolderSource(device=torch.device("cuda")) failed so on an
    # H200. No CUDA is used here: the current device and the decoder check are stand-ins.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(gpu, "decoder_problem", lambda device: None)
    source = ImageFolderSource(tree, workers=0, device=torch.device("cuda"), loader="gpu")
    assert source.device == torch.device("cuda", 1)
    assert ImageFolderSource(tree, workers=0, device=torch.device("cuda", 0), loader="gpu").device.index == 0
    assert ImageFolderSource(tree, workers=0, device=CPU).device == CPU


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    # What torchvision's CUDA decoder raises for whatever it meets, out of memory included.
    RuntimeError("Error while decoding JPEG images: CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("Error while decoding JPEG images: Failed to synchronize CUDA stream: 700"),
])
def test_device_failures_are_raised_not_hidden_as_cpu_fallbacks(tree, monkeypatch, error):
    source = ImageFolderSource(tree, workers=0, device=CPU, loader="gpu")

    def fail(files, device):
        raise error

    monkeypatch.setattr(gpu, "_decode", fail)
    with pytest.raises(RuntimeError, match="CUDA"):
        _batches(source, 0)
    assert source.cpu_fallbacks() == 0 and source.skipped_images()["failures"] == 0


@pytest.mark.slow
def test_an_epoch_left_midway_ends_its_decode_thread_and_the_next_epoch_is_whole(tree):
    source = ImageFolderSource(tree, workers=1, device=CPU, loader="gpu")
    stream = source.train_stream(PHASE, Shard(), 0)
    try:
        stream.set_epoch(0)
        batches = iter(stream)
        next(batches)
        assert "speedrun-gpu-decode" in [t.name for t in threading.enumerate()]
        batches.close()  # the training loop stopped after one step (its target, a stop request)
        assert "speedrun-gpu-decode" not in [t.name for t in threading.enumerate()]
        stream.set_epoch(1)
        assert len(list(stream)) == len(stream) == 6
    finally:
        stream.close()


@pytest.mark.slow
def test_close_with_an_epoch_still_open_ends_its_decode_thread_before_the_workers(tree):
    # benchmarks/loader.py closed a stream while an epoch's iterator was still held: the decode
    # thread then read from workers being shut down, and lived on into interpreter shutdown.
    source = ImageFolderSource(tree, workers=1, device=CPU, loader="gpu")
    stream = source.train_stream(PHASE, Shard(), 0)
    stream.set_epoch(0)
    batches = iter(stream)
    next(batches)
    workers = stream.worker_pids()
    assert workers and "speedrun-gpu-decode" in [t.name for t in threading.enumerate()]
    stream.close()
    assert "speedrun-gpu-decode" not in [t.name for t in threading.enumerate()]
    assert stream.worker_pids() == [] and not any(Path(f"/proc/{pid}").exists() for pid in workers)
    with pytest.raises(StopIteration):  # the epoch left open ends; it does not restart the workers
        next(batches)


@pytest.mark.slow
def test_a_tree_of_undecodable_files_is_one_clear_error(tmp_path):
    root = make_tree(tmp_path / "d", classes=2, train_per_class=4, sizes=[(90, 70)])
    source = ImageFolderSource(root, workers=1, device=CPU, loader="gpu")
    for path in (root / "train").rglob("*.JPEG"):  # headers fine, bodies gone: found when decoding
        path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(SpeedrunError, match="undecodable images in a row"):
        _batches(source, 0)
