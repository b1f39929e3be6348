"""The GPU decode path (`--loader gpu`): CPU workers only read file bytes, the GPU decodes them.

On an H200 the CPUs, not the GPU, bound training from JPEGs (docs/measurements.md): 16 cores
decode about 4,200 images/s where ResNet-50 trains at 4,700. So here the DataLoader workers do
no decoding: for each sample they read the file's bytes and draw its crop and flip, exactly as
the PIL loader draws them (`transforms.crop_params` with the same `random.Random(seed/epoch/row)`),
and pack the batch's bytes into one buffer. In the training process the batch is decoded in one
call, `torchvision.io.decode_jpeg(files, device=...)` (nvJPEG on CUDA, libjpeg-turbo on the
CPU), and every image is cropped, resized and flipped in one batched `roi_align`
(`augment.crop_resize_flip_ragged`). A thread of the stream's own does that one batch ahead of
the training step (the decoder makes its caller wait for the whole batch), on CUDA streams of its
own, so decoding overlaps the step.

Files nvJPEG cannot take (not a JPEG, CMYK/YCCK, lossless or arithmetic-coded JPEGs) or takes
only one at a time (progressive JPEGs), found from the header (`gpu_unsupported`), are decoded by
PIL in the worker, that file alone, and counted;
a file that the batched decode still refuses is retried alone and then decoded on the CPU,
counted too. A file that nothing decodes is logged, counted and replaced by the next row, as in
the PIL loader. On the CPU the same code runs with CPU decoding, which is how CI tests it.

The same files in the same order with the same labels as the PIL loader; the pixels differ a
little (no DCT-scaled decoding, bilinear sampling by roi_align rather than PIL's resize).
"""
from __future__ import annotations

import contextlib
import logging
import queue
import random
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from speedrun.data.augment import crop_resize_flip_ragged
from speedrun.data.base import CountedFiles, Batch, Shard, host_to_device
from speedrun.data.loading import MAX_SUBSTITUTES, ImageFolderTrainStream, LoaderOptions, shared_buffer
from speedrun.data.index import Split
from speedrun.data.transforms import crop_params, open_image
from speedrun.errors import SpeedrunError, one_line
from speedrun.recipe import Phase

log = logging.getLogger("speedrun.data")
_END = object()  # what the decode thread offers after an epoch's last batch

# Start-of-frame markers the GPU path gives nvJPEG: baseline (SOF0) and extended (SOF1) Huffman
# JPEGs, which its batched (hardware) decoder takes. Progressive ones (SOF2) it decodes too, but one
# at a time with their Huffman decoding on the calling thread (torchvision's decode_jpegs_cuda), so
# a tree of them would be decoded on one core: the workers decode those with PIL, all cores at once.
# The others are lossless, hierarchical or arithmetic-coded, which nvJPEG does not decode.
_GPU_FRAMES = {0xC0, 0xC1}
_SOF = set(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # C4 = Huffman tables, CC = arithmetic tables


def gpu_unsupported(data: bytes | memoryview) -> str | None:
    """Why nvJPEG cannot decode the file whose bytes are `data` (from its header alone), or None
    when it can: a baseline or extended Huffman JPEG of 1 or 3 components."""
    data = memoryview(data)
    if bytes(data[:2]) != b"\xff\xd8":
        return "not a JPEG"
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return "damaged JPEG header"
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte before a marker
            i += 1
            continue
        if 0xD0 <= marker <= 0xD8 or marker == 0x01:  # markers without a length
            i += 2
            continue
        if marker == 0xDA:  # a scan before any frame header
            return "damaged JPEG header"
        if marker in _SOF:
            if marker == 0xC2:
                return "a progressive JPEG (nvJPEG decodes those one at a time, on one host thread)"
            if marker not in _GPU_FRAMES:
                return f"a JPEG coding nvJPEG does not decode (SOF{marker - 0xC0})"
            components = data[i + 9] if i + 9 < len(data) else 0
            return None if components in (1, 3) else f"a JPEG of {components} colour components"
        i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
    return "damaged JPEG header"


def decode_rgb(path: str) -> torch.Tensor:
    """The image at `path` decoded by PIL to RGB (any format, CMYK included): uint8 3 x H x W."""
    with open_image(path) as img:
        rgb = np.asarray(img.convert("RGB"))
    return torch.from_numpy(rgb).permute(2, 0, 1).contiguous()


@dataclass
class EncodedBatch:
    """One training batch as it leaves a worker: bytes to decode, crops to make.

    Sample i's file bytes are packed[offsets[i]:offsets[i + 1]], or, when it was decoded on the
    CPU, that range is empty and `pixels[i]` holds it (uint8 3 x H x W). `boxes` are crop boxes
    (x1, y1, x2, y2) as fractions of the image's width and height, so that they fit whatever
    size the decoder returns.
    """

    packed: torch.Tensor  # uint8, all encoded files end to end
    offsets: torch.Tensor  # int64, N + 1
    pixels: dict[int, torch.Tensor]
    boxes: torch.Tensor  # float64 N x 4, fractions of the image
    flips: torch.Tensor  # bool N
    labels: torch.Tensor  # int64 N
    rows: list[int]  # the split's rows, for replacing a file found bad after decoding
    epoch: int
    bad: list[tuple[str, str]] = field(default_factory=list)  # (path, why) skipped in the worker
    cpu_decoded: list[tuple[str, str]] = field(default_factory=list)  # (path, why) the worker decoded with PIL

    def files(self) -> list[torch.Tensor | None]:
        """Each sample's encoded bytes (1-D uint8 views), None for those decoded already."""
        ends = self.offsets.tolist()
        return [self.packed[a:b] if b > a else None for a, b in zip(ends[:-1], ends[1:])]


@dataclass
class _Sample:
    data: np.ndarray | None  # encoded bytes, or None when `pixels` holds the decoded image
    pixels: torch.Tensor | None
    why_cpu: str | None  # why the worker decoded it (`gpu_unsupported`), when it did
    box: tuple[float, float, float, float]  # fractions of width and height
    flip: bool
    label: int
    row: int
    path: str


class ByteReader(torch.utils.data.Dataset):
    """Keys are (epoch, row). Reads files and draws crops; decodes only what nvJPEG cannot."""

    def __init__(self, root: Path, split: Split, phase: Phase, seed: int):
        self.root, self.split, self.phase, self.seed = root, split, phase, seed

    def __len__(self) -> int:
        return len(self.split)

    def sample(self, epoch: int, row: int, bad: list[tuple[str, str]]) -> _Sample:
        """Row `row`, or the next rows in turn when it is unreadable (each added to `bad`)."""
        p = self.phase
        for attempt in range(MAX_SUBSTITUTES):
            r = (row + attempt) % len(self.split)
            path = str(self.root / self.split.path(r))
            width, height = int(self.split.widths[r]), int(self.split.heights[r])
            # The PIL loader's draws, in its order: crop, then flip (`transforms.decode_train`).
            rng = random.Random(f"{self.seed}/{epoch}/{r}")
            left, top, cw, ch = crop_params(width, height, p.min_scale, rng, p.ratio, p.translate)
            flip = rng.random() < 0.5 and p.flip
            box = (left / width, top / height, (left + cw) / width, (top + ch) / height)
            try:
                data = np.fromfile(path, dtype=np.uint8)
                pixels, why_cpu = None, gpu_unsupported(data)
                if why_cpu is not None:
                    pixels, data = decode_rgb(path), None
            except Exception as e:  # unreadable or undecodable: count it, use another sample
                bad.append((path, one_line(e)))
                continue
            return _Sample(data, pixels, why_cpu, box, flip, int(self.split.labels[r]), r, path)
        raise SpeedrunError(f"{MAX_SUBSTITUTES} unreadable images in a row from {path}: is the data intact?")

    def __getitems__(self, keys: Sequence[tuple[int, int]]) -> EncodedBatch:
        bad: list[tuple[str, str]] = []
        samples = [self.sample(epoch, row, bad) for epoch, row in keys]
        sizes = [0 if s.data is None else len(s.data) for s in samples]
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        packed = shared_buffer((int(offsets[-1]),))
        view = packed.numpy()
        for s, a in zip(samples, offsets[:-1]):
            if s.data is not None:
                view[a : a + len(s.data)] = s.data
        return EncodedBatch(
            packed=packed,
            offsets=torch.from_numpy(offsets.astype(np.int64)),
            pixels={i: s.pixels for i, s in enumerate(samples) if s.pixels is not None},
            boxes=torch.tensor([s.box for s in samples], dtype=torch.float64),
            flips=torch.tensor([s.flip for s in samples], dtype=torch.bool),
            labels=torch.tensor([s.label for s in samples], dtype=torch.int64),
            rows=[s.row for s in samples],
            epoch=keys[0][0] if keys else 0,
            bad=bad,
            cpu_decoded=[(s.path, s.why_cpu) for s in samples if s.pixels is not None],
        )

    def __getitem__(self, key):
        return self.__getitems__([key])


def _decode(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """decode_jpeg on `device` to RGB. (torchvision 0.29 deprecates its decoders in favour of
    TorchCodec, with a DeprecationWarning that Python shows only to __main__; they are what ships
    with torch, on the GPU machine too. The warning is not silenced here: `warnings.catch_warnings`
    changes process-wide state and is not safe in the decode thread.)"""
    from torchvision.io import ImageReadMode, decode_jpeg

    return decode_jpeg(files, mode=ImageReadMode.RGB, device=device)


def _device_failure(e: RuntimeError) -> bool:
    """Whether a decode error is the device's (out of memory, a CUDA error), not the file's:
    torchvision re-raises whatever its CUDA decoder meets as a plain RuntimeError."""
    text = str(e)
    return isinstance(e, torch.OutOfMemoryError) or any(
        s in text for s in ("out of memory", "CUDA error", "Failed to synchronize CUDA stream"))


# CUDA compute capabilities of the GPUs with hardware JPEG decoders (NVJPG engines), which
# torchvision's batched decode uses: A100 and A30 (8.0), H100 and H200 (9.0), B200 (10.0). Elsewhere
# (V100, T4, consumer cards) it decodes one image at a time, its Huffman stage on the calling thread.
JPEG_ENGINE_CAPABILITIES = {(8, 0), (9, 0), (10, 0)}


def has_jpeg_engine(device: torch.device) -> bool:
    """Whether `device` is a GPU with hardware JPEG decoders (`JPEG_ENGINE_CAPABILITIES`)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) in JPEG_ENGINE_CAPABILITIES


def decoder_problem(device: torch.device) -> str | None:
    """Why torchvision cannot decode JPEGs on `device` (a build without nvJPEG, a driver it cannot
    use), or None when it can: found by decoding one 8 x 8 image there."""
    from torchvision.io import encode_jpeg

    # torchvision keeps one decoder, bound to the device current when it is made: make it `device`.
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            _decode([encode_jpeg(torch.zeros(3, 8, 8, dtype=torch.uint8))], device)
    except RuntimeError as e:
        return one_line(e)
    return None


class GpuDecodeTrainStream(ImageFolderTrainStream):
    """Training batches decoded on `device` (see the module docstring); a `data.base.TrainStream`.

    bad: where undecodable files are counted; cpu_decoded: where files decoded on the CPU rather
    than the device are (both `data.base.CountedFiles`).

    A thread of the stream's own prepares each batch (decode, crop) one batch ahead: torchvision's
    decoder makes the calling thread wait until the batch is decoded, and the training loop must
    not wait with it. On CUDA the crops run on a side stream, and a batch is handed over with an
    event that the training stream waits on, so the step of batch N never waits for batch N + 1.
    """

    def __init__(self, reader: ByteReader, shard: Shard, seed: int, batch_size: int, options: LoaderOptions,
                 device: torch.device, bad: CountedFiles, cpu_decoded: CountedFiles):
        # Bytes stay in (shared) pageable memory: nvJPEG copies them to the GPU itself.
        super().__init__(reader, shard, seed, batch_size, replace(options, pin_memory=False), bad)
        self.reader, self.device, self.cpu_decoded = reader, device, cpu_decoded
        cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if cuda else None  # the crops
        # torchvision's decoder allocates its outputs on the current stream but writes them from a
        # stream of its own, without waiting for the current one: on a stream that runs anything
        # else it could be handed memory that queued work still reads. This one runs nothing else.
        self._decode_stream = torch.cuda.Stream(device) if cuda else None
        # The decode thread of each epoch still open (an iterator not yet exhausted or closed), with
        # its stop event and queue: close() ends them before the workers they read from.
        self._open: list[tuple[threading.Thread, threading.Event, queue.Queue]] = []

    def __iter__(self) -> Iterator[Batch]:
        ready: queue.Queue = queue.Queue(maxsize=1)  # one prepared batch ahead
        stop = threading.Event()
        worker = threading.Thread(target=self._produce, args=(ready, stop), name="speedrun-gpu-decode", daemon=True)
        epoch = (worker, stop, ready)
        self._open.append(epoch)
        worker.start()
        try:
            # `stop` set here means close() ended this epoch's thread while the loop held it.
            while not stop.is_set() and (item := ready.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield self._hand_over(*item)
        finally:  # the epoch ended, or the loop stopped early: let the thread finish
            self._end(epoch)

    def _end(self, epoch: tuple[threading.Thread, threading.Event, queue.Queue]) -> None:
        """Stop an epoch's decode thread and wait for it: at most the batch it is preparing."""
        worker, stop, ready = epoch
        stop.set()
        with contextlib.suppress(queue.Empty):
            ready.get_nowait()
        worker.join()
        with contextlib.suppress(ValueError):
            self._open.remove(epoch)

    def close(self) -> None:
        """Stop the decode thread of any epoch still open, then the workers: a thread left
        reading from workers being shut down fails, and one left running outlives the stream into
        interpreter shutdown (benchmarks/loader.py closed streams with an epoch open)."""
        for epoch in list(self._open):
            self._end(epoch)
        super().close()

    def _produce(self, ready: queue.Queue, stop: threading.Event) -> None:
        """The thread's loop: every batch of the epoch prepared and offered to `ready`, then _END
        (or the exception that ended it)."""
        def offer(item) -> bool:
            while not stop.is_set():
                with contextlib.suppress(queue.Full):
                    ready.put(item, timeout=0.1)
                    return True
            return False

        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # a new thread starts on device 0
            for encoded in self._dataloader:
                if not offer(self._prepare(encoded)):
                    return
            offer(_END)
        except BaseException as e:  # noqa: BLE001 - raised again in the training thread
            offer(e)

    def _prepare(self, encoded: EncodedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
        """Decode and crop `encoded`: (images, labels, an event marking the end of that work on
        CUDA, else None)."""
        if encoded.bad:
            self._bad.add(encoded.bad)
        if encoded.cpu_decoded:
            self.cpu_decoded.add(encoded.cpu_decoded)
        if self._stream is None:
            return *self._decode_and_crop(encoded), None
        with torch.cuda.stream(self._stream):
            images, labels = self._decode_and_crop(encoded)
            done = torch.cuda.Event()
            done.record(self._stream)
        return images, labels, done

    def _decode_and_crop(self, encoded: EncodedBatch) -> Batch:
        images = self._decode_batch(encoded)  # may replace samples in `encoded` (bad files)
        sizes = torch.tensor([[im.shape[2], im.shape[1]] * 2 for im in images], dtype=torch.float64)
        boxes = encoded.boxes * sizes  # fractions -> pixels of what was decoded
        out = crop_resize_flip_ragged(images, boxes, encoded.flips, self.reader.phase.size)
        return out, host_to_device(encoded.labels, self.device)

    def _hand_over(self, images: torch.Tensor, labels: torch.Tensor, done: torch.cuda.Event | None) -> Batch:
        """The batch, safe to use on the current stream: it waits for this batch's work only, and
        the memory made on the side stream is not reused before the current stream is done with it."""
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            images.record_stream(current)
            labels.record_stream(current)
        return images, labels

    def _decode_on_device(self, files: list[torch.Tensor]) -> list[torch.Tensor]:
        """decode_jpeg on the device; on CUDA on the decode stream, ordered before the crops."""
        if self._decode_stream is None:
            return _decode(files, self.device)
        with torch.cuda.stream(self._decode_stream):
            images = _decode(files, self.device)
        self._stream.wait_stream(self._decode_stream)
        for image in images:  # freed after the crops have read it, not before
            image.record_stream(self._stream)
        return images

    def _decode_batch(self, encoded: EncodedBatch) -> list[torch.Tensor]:
        """Every sample as uint8 3 x H x W on the device: the encoded ones in one call; where that
        call fails, each alone (`_decode_one`). A file nothing decodes is replaced by the next row,
        whose box, flip and label are then written into `encoded`."""
        files = encoded.files()
        todo = [i for i, f in enumerate(files) if f is not None]
        images: list[torch.Tensor | None] = [None] * len(files)
        for i, pixels in encoded.pixels.items():
            images[i] = host_to_device(pixels, self.device)
        try:
            for i, image in zip(todo, self._decode_on_device([files[i] for i in todo]) if todo else []):
                images[i] = image
        except RuntimeError as e:  # a file the header check let through: find it
            if _device_failure(e):  # not the files' fault: no fallback hides it
                raise
            for i in todo:
                images[i] = self._decode_one(files[i], str(self.reader.root / self.reader.split.path(encoded.rows[i])))
        for i in range(len(images)):
            row = encoded.rows[i]
            for _ in range(MAX_SUBSTITUTES):
                if images[i] is not None:
                    break
                # Like the PIL loader: the next row takes the slot, with its own crop and flip.
                row = (row + 1) % len(self.reader)
                found: list[tuple[str, str]] = []
                s = self.reader.sample(encoded.epoch, row, found)
                self._bad.add(found)
                row = s.row
                encoded.boxes[i], encoded.flips[i], encoded.labels[i] = torch.tensor(s.box), s.flip, s.label
                images[i] = (host_to_device(s.pixels, self.device) if s.pixels is not None
                             else self._decode_one(torch.from_numpy(s.data), s.path))
            else:
                raise SpeedrunError(f"{MAX_SUBSTITUTES} undecodable images in a row from {self.reader.root}: "
                                    "is the data intact?")
        return images  # type: ignore[return-value]

    def _decode_one(self, data: torch.Tensor, path: str) -> torch.Tensor | None:
        """One file on the device, else on the CPU (counted in `cpu_decoded`); None (counted as
        bad) when no decoder reads it."""
        try:
            return self._decode_on_device([data])[0]
        except RuntimeError as e:
            if _device_failure(e):
                raise
        # Only the decoders' own errors are caught below: a failure to move the image to the
        # device is the device's, raised as it is.
        decoded = None
        if self.device.type != "cpu":
            with contextlib.suppress(RuntimeError):
                decoded, why = _decode([data], torch.device("cpu"))[0], "nvJPEG failed on it"
        if decoded is None:
            with contextlib.suppress(Exception):  # what libjpeg refuses, PIL may still read
                decoded, why = decode_rgb(path), "libjpeg failed on it; PIL read it"
        if decoded is None:
            self._bad.add([(path, "no decoder reads it")])
            return None
        self.cpu_decoded.add([(path, why)])
        return host_to_device(decoded, self.device)
