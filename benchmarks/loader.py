"""Train-pipeline throughput: speedrun's image-folder loader vs torchvision's, side by side.

Both read the same generated ImageNet-shaped JPEG tree (mean ~400 x 350 px) with the same
number of worker processes and batch size, and do RandomResizedCrop(size) + horizontal flip:
- speedrun: DCT-scaled decode + one crop-and-resize per image, uint8 batches (channels-last),
  decoded straight into a shared-memory batch buffer;
- torchvision: ImageFolder + RandomResizedCrop + RandomHorizontalFlip + ToTensor + Normalize
  with the DataLoader's default collate (float32 batches), the classic ImageNet pipeline.
Each is timed over `--batches` batches after `--warmup` batches, in images/s; the defaults make
the warm-up longer than the loader's whole prefetch queue (workers x 2 batches) and the timed
window several times longer, so the figure is the steady state, not a drained queue. The ratio
is speedrun / torchvision. With DALI installed, speedrun with `--loader dali` (DALI's CPU
decoder, on as many threads as there are workers) is timed too. A last row times speedrun
reading the resized copy the 2018 recipes use at that size (160 px copy for crops <= 128 px,
352 px copy above), as training would. Then one core's share of each loader's work, in this
process: the PIL loader's decode + crop against the GPU decode path's byte reading (what the CPUs
still do when the GPU decodes); on CUDA, the GPU path's own rate; and the GPU path's agreement
with PIL (on CUDA when there is one: nvJPEG's; else the CPU decoder's).
Also: `prepare` throughput (images/s and per core) making 160 and 352 px copies, and optionally
(`--train`, CUDA) training images/s of a model fed from the JPEGs by each of `--train-loaders`
(pil: decode in the workers; gpu: the GPU decode path), next to the same model fed by one batch
kept on the GPU (the synthetic rate, the model alone).

    python benchmarks/loader.py                      # generates ~3,000 images in a temp dir
    python benchmarks/loader.py --images 20000 --sizes 128 224 --train resnet50 --json out.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch


def _timed(batches_iter, warmup: int, batches: int) -> tuple[float, int]:
    """(images/s, images) over `batches` batches, after `warmup` untimed ones."""
    it = iter(batches_iter)
    for _ in range(warmup):
        next(it)
    images, start = 0, time.perf_counter()
    for _ in range(batches):
        x = next(it)[0]
        images += x.shape[0]
    if x.is_cuda:  # the GPU path hands out batches before the device has made them
        torch.cuda.synchronize(x.device)
    return images / (time.perf_counter() - start), images


def _enough_epochs(stream_factory):
    """Yield batches across epochs until the caller stops (tiny trees need several epochs)."""
    epoch = 0
    while True:
        yield from stream_factory(epoch)
        epoch += 1


def bench_speedrun(tree: Path, size: int, batch: int, workers: int, warmup: int, batches: int,
                   copy: int | None = None, copies_dir: Path | None = None, loader: str = "pil",
                   device: str = "cpu") -> float:
    """Images/s of speedrun's train stream: PIL worker processes, DALI's CPU decoder on `workers`
    threads (`loader="dali"`), or the GPU decode path on `device` (`loader="gpu"`)."""
    from speedrun.data.base import Shard
    from speedrun.data.imagefolder import ImageFolderSource
    from speedrun.recipe import Phase

    source = ImageFolderSource(tree, workers=workers, copies_dir=copies_dir, device=torch.device(device), loader=loader)
    stream = source.train_stream(Phase(0, 1, size=size, batch_size=batch, lr=0.1, copy=copy), Shard(), seed=0)

    def epoch(e):
        stream.set_epoch(e)
        return iter(stream)

    try:
        rate, _ = _timed(_enough_epochs(epoch), warmup, batches)
    finally:
        stream.close()
    return rate


def gpu_path_agreement(tree: Path, size: int, batch: int, workers: int, device: str, batches: int = 3) -> dict:
    """The GPU decode path on `device` against the PIL loader (full-size decoding) on the first
    `batches` batches: are the labels the same, and how far apart are the pixels (mean and largest
    absolute difference, 0..255)? tests/test_data_gpu.py asserts this on the CPU; this is the
    check on a GPU, where nvJPEG decodes."""
    from speedrun.data.base import Shard
    from speedrun.data.imagefolder import ImageFolderSource
    from speedrun.recipe import Phase

    phase = Phase(0, 1, size=size, batch_size=batch, lr=0.1)
    out = []
    for loader in ("pil", "gpu"):
        source = ImageFolderSource(tree, workers=workers, device=torch.device(device), loader=loader, draft=False)
        stream = source.train_stream(phase, Shard(), seed=0)
        stream.set_epoch(0)
        # The epoch is left after a few batches: closed before the stream, so that the GPU path's
        # decode thread ends before the workers it reads from, not at interpreter shutdown.
        try:
            with contextlib.closing(iter(stream)) as it:
                out.append([tuple(t.cpu() for t in next(it)) for _ in range(batches)])
        finally:
            stream.close()
    labels_equal = all(torch.equal(a[1], b[1]) for a, b in zip(*out))
    diffs = [(a[0].float() - b[0].float()).abs() for a, b in zip(*out)]
    return {"device": device, "size": size, "batches": batches, "labels_equal": labels_equal,
            "mean_abs_difference": round(sum(d.mean().item() for d in diffs) / len(diffs), 3),
            "max_abs_difference": max(d.max().item() for d in diffs)}


def bench_worker_work(tree: Path, size: int, batch: int, batches: int) -> dict:
    """Images/s of one core doing one worker's job, in this process: the PIL loader's (decode, crop,
    resize) against the GPU path's (read the bytes, draw the crop). What is left to the CPUs when
    the GPU decodes."""
    from speedrun.data.gpu import ByteReader
    from speedrun.data.imagefolder import ImageFolderSource, _TrainDecoder
    from speedrun.recipe import Phase

    split = ImageFolderSource(tree, workers=1, device=torch.device("cpu"))._train_split(None)
    phase = Phase(0, 1, size=size, batch_size=batch, lr=0.1)
    keys = [[(0, (i * batch + j) % len(split)) for j in range(batch)] for i in range(batches)]
    row = {"size": size}
    for name, dataset in (("pil", _TrainDecoder(tree, split, phase, 0, True)),
                          ("gpu", ByteReader(tree, split, phase, 0))):
        start = time.perf_counter()
        for k in keys:
            dataset.__getitems__(k)
        row[f"{name}_worker_images_per_s_per_core"] = round(len(keys) * batch / (time.perf_counter() - start), 1)
    row["ratio"] = round(row["gpu_worker_images_per_s_per_core"] / row["pil_worker_images_per_s_per_core"], 1)
    return row


def bench_torchvision(tree: Path, size: int, batch: int, workers: int, warmup: int, batches: int) -> float:
    from torch.utils.data import DataLoader
    from torchvision import datasets, transforms

    from speedrun.data.loading import shutdown_workers

    tf = transforms.Compose([
        transforms.RandomResizedCrop(size),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])
    loader = DataLoader(datasets.ImageFolder(str(tree / "train"), tf), batch_size=batch, shuffle=True,
                        num_workers=workers, persistent_workers=workers > 0, drop_last=True)
    try:
        rate, _ = _timed(_enough_epochs(lambda e: iter(loader)), warmup, batches)
    finally:  # the persistent workers end here, not whenever `loader` is collected
        shutdown_workers(loader)
    return rate


def bench_prepare(tree: Path, dst: Path, workers: int, sizes: list[int]) -> dict:
    from speedrun.data.prepare import prepare

    s = prepare(tree, dst, sizes, workers=workers, progress=False)
    return {"images": s.images, "seconds": round(s.seconds, 2), "images_per_s": round(s.images_per_s, 1),
            "images_per_s_per_core": round(s.images_per_s_per_core, 1), "workers": workers, "sizes": sizes}


def bench_train(tree: Path, model_name: str, size: int, batch: int, workers: int, warmup: int, steps: int,
                device_name: str = "cuda", loaders: tuple[str, ...] = ("pil", "gpu")) -> dict:
    """Training images/s of speedrun's step (`learner.train_step`: bf16 autocast on CUDA,
    channels-last, fused SGD on CUDA) fed by each of `loaders` (`--loader` values) from the JPEG
    tree, next to the same step on one batch kept on the device (synthetic: the model alone)."""
    from torch import nn

    from speedrun.data.base import Shard, normalize_on_device
    from speedrun.data.imagefolder import IMAGENET_MEAN, IMAGENET_STD, ImageFolderSource
    from speedrun.learner import choose_precision, device_capability, to_device, train_step
    from speedrun.model import build_model
    from speedrun.optim import build_optimizer
    from speedrun.recipe import OptimizerSettings, Phase

    device = torch.device(device_name)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.backends.cudnn.benchmark = True
    model, channels_last = to_device(build_model(model_name, num_classes=1000), device)  # the trainer's layout
    optimizer = build_optimizer(model, OptimizerSettings(weight_decay=5e-5), lr=0.1, fused=device.type == "cuda")
    precision = choose_precision("auto", device.type, device_capability(device))
    criterion = nn.CrossEntropyLoss()
    mean = torch.tensor(IMAGENET_MEAN, device=device).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=device).view(3, 1, 1)

    def step(x, y):
        x = normalize_on_device(x, mean, std, device, channels_last)
        train_step(model, optimizer, criterion, x, y.to(device, non_blocking=True), precision)

    def run(batches) -> float:
        it = iter(batches)
        for _ in range(warmup):
            step(*next(it))
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            step(*next(it))
        sync()
        return steps * batch / (time.perf_counter() - start)

    row: dict = {"model": model_name, "size": size, "batch": batch, "precision": precision}
    first = None
    for loader in loaders:
        source = ImageFolderSource(tree, workers=workers, device=device, loader=loader)
        stream = source.train_stream(Phase(0, 1, size=size, batch_size=batch, lr=0.1), Shard(), seed=0)

        def epoch(e, stream=stream):
            stream.set_epoch(e)
            return iter(stream)

        try:
            row[f"{loader}_images_per_s"] = round(run(_enough_epochs(epoch)), 1)
            if first is None:
                first = next(iter(epoch(0)))
        finally:
            stream.close()
        row[f"{loader}_cpu_fallbacks"] = source.cpu_fallbacks()
    x0, y0 = first[0].to(device), first[1].to(device)

    def same():
        while True:
            yield x0, y0

    row["synthetic_images_per_s"] = round(run(same()), 1)
    for loader in loaders:
        row[f"{loader}_vs_synthetic"] = round(row[f"{loader}_images_per_s"] / row["synthetic_images_per_s"], 3)
    return row


def save(path: Path | None, results: dict) -> None:
    """Write what is measured so far (a run cut short by a timeout keeps its finished parts),
    atomically: a process killed while writing leaves the previous parts, never half a file."""
    from speedrun.files import write_text

    if path is not None:
        write_text(path, json.dumps(results, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", type=Path, help="existing ImageNet-shaped tree (default: generate one in a temp dir)")
    p.add_argument("--images", type=int, default=3000, help="training images to generate (default 3000)")
    p.add_argument("--classes", type=int, default=20)
    p.add_argument("--sizes", type=int, nargs="+", default=[224], help="crop sizes in px (default 224)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                   help="decode processes (default: all cores)")
    p.add_argument("--warmup", type=int, help="untimed batches first (default: 2 x workers + 4)")
    p.add_argument("--batches", type=int, help="timed batches (default: max(30, 6 x workers))")
    p.add_argument("--no-prepare", action="store_true", help="skip the prepare benchmark")
    p.add_argument("--train", metavar="MODEL",
                   help="also time training of this model (speedrun's names: resnet50) on CUDA")
    p.add_argument("--train-loaders", nargs="+", default=["pil", "gpu"],
                   help="--loader values to feed it (default pil gpu)")
    p.add_argument("--train-steps", type=int, default=60)
    p.add_argument("--train-warmup", type=int, help="untimed --train steps first (default: 4 x workers + 10, past "
                   "the prefetched queue, so the timed steps wait on the loader if it is slower)")
    p.add_argument("--train-device", default="cuda", help="device for --train (default cuda)")
    p.add_argument("--train-first", action="store_true", help="time --train before the rest (a run cut short keeps it)")
    p.add_argument("--json", type=Path, help="write the results here too")
    args = p.parse_args()
    warmup = args.warmup if args.warmup is not None else 2 * args.workers + 4
    batches = args.batches if args.batches is not None else max(30, 6 * args.workers)
    train_warmup = args.train_warmup if args.train_warmup is not None else 4 * args.workers + 10

    from speedrun.data.dali import installed as dali_installed

    results: dict = {"workers": args.workers, "batch": args.batch, "cpu_cores": os.cpu_count()}
    tmp = None
    tree = args.tree
    if tree is None:
        from speedrun.data.synth import imagenet_tree

        tmp = Path(tempfile.mkdtemp(prefix="speedrun-bench-"))
        tree = tmp / "imagenet"
        per_class = max(1, args.images // args.classes)
        start = time.perf_counter()
        imagenet_tree(tree, classes=args.classes, train_per_class=per_class, val_per_class=max(1, per_class // 10),
                      workers=args.workers)
        print(f"generated {per_class * args.classes} train images in {time.perf_counter() - start:.1f} s at {tree}",
              flush=True)
    def train() -> None:
        results["train"] = []
        for size in args.sizes:
            tr = bench_train(tree, args.train, size, args.batch, args.workers, train_warmup,
                             args.train_steps, args.train_device, tuple(args.train_loaders))
            results["train"].append(tr)
            save(args.json, results)
            fed = ", ".join(f"--loader {name} {tr[f'{name}_images_per_s']:,.0f} images/s "
                            f"({tr[f'{name}_vs_synthetic']:.0%})" for name in args.train_loaders)
            print(f"train {args.train} {size} px batch {args.batch}: {fed}; synthetic "
                  f"{tr['synthetic_images_per_s']:,.0f} images/s", flush=True)

    copies = Path(tempfile.mkdtemp(prefix="speedrun-bench-sz-"))
    try:
        if args.train and args.train_first:
            train()
        # Before the decode-only timings: on an H200 they ran past gpu_check's 180 s and took this
        # check with them. On the CPU it checks the benchmark's glue; the agreement that matters is nvJPEG's.
        device = "cuda" if torch.cuda.is_available() else "cpu"
        check = gpu_path_agreement(tree, args.sizes[0], args.batch, args.workers, device)
        results["gpu_path_agreement"] = check
        save(args.json, results)
        print(f"GPU decode path ({device}) vs PIL loader at {check['size']} px: labels equal {check['labels_equal']}, "
              f"pixels differ by {check['mean_abs_difference']} on average, {check['max_abs_difference']:.0f} "
              "at most (0..255)", flush=True)
        results["loader"] = []
        for size in args.sizes:
            ours = bench_speedrun(tree, size, args.batch, args.workers, warmup, batches)
            theirs = bench_torchvision(tree, size, args.batch, args.workers, warmup, batches)
            row = {"size": size, "speedrun_images_per_s": round(ours, 1), "torchvision_images_per_s": round(theirs, 1),
                   "ratio": round(ours / theirs, 2)}
            results["loader"].append(row)
            save(args.json, results)
            print(f"{size:4d} px  full size: speedrun {ours:8,.0f} images/s   torchvision {theirs:8,.0f} images/s   "
                  f"ratio {ours / theirs:.2f}x   ({args.workers} workers, batch {args.batch}, "
                  f"{batches} timed batches)", flush=True)
            others = [("gpu", "cuda", f"nvJPEG, {args.workers} workers reading")] if torch.cuda.is_available() else []
            others += [("dali", "cpu", f"DALI's CPU decoder, {args.workers} threads")] if dali_installed() else []
            for loader, device, what in others:
                rate = bench_speedrun(tree, size, args.batch, args.workers, warmup, batches, loader=loader,
                                      device=device)
                row[f"speedrun_{loader}_{device}_images_per_s"] = round(rate, 1)
                row[f"{loader}_{device}_ratio"] = round(rate / theirs, 2)
                print(f"{size:4d} px  full size: speedrun --loader {loader} ({what}) {rate:8,.0f} images/s   "
                      f"ratio {rate / theirs:.2f}x", flush=True)
        results["worker_work"] = []
        for size in args.sizes:
            row = bench_worker_work(tree, size, args.batch, max(4, batches // 4))
            results["worker_work"].append(row)
            save(args.json, results)
            print(f"{size:4d} px  one core's worker work: "
                  f"PIL decode + crop {row['pil_worker_images_per_s_per_core']:,.0f} images/s; "
                  f"GPU path (read bytes, draw crop) {row['gpu_worker_images_per_s_per_core']:,.0f} images/s"
                  f"   ratio {row['ratio']}x", flush=True)
        if not args.no_prepare:
            pr = bench_prepare(tree, copies, args.workers, [160, 352])
            results["prepare"] = pr
            print(f"prepare 160+352 px: {pr['images']} images in {pr['seconds']} s = "
                  f"{pr['images_per_s']:,.0f} images/s, "
                  f"{pr['images_per_s_per_core']:,.0f} images/s per core ({args.workers} workers)", flush=True)
            for row in results["loader"]:
                copy = 160 if row["size"] <= 128 else 352
                rate = bench_speedrun(tree, row["size"], args.batch, args.workers, warmup, batches, copy, copies)
                row[f"speedrun_{copy}px_copy_images_per_s"] = round(rate, 1)
                print(f"{row['size']:4d} px  speedrun from the {copy} px copy {rate:8,.0f} images/s   "
                      f"({rate / row['torchvision_images_per_s']:.2f}x torchvision on full size)", flush=True)
        if args.train and not args.train_first:
            train()
    finally:
        shutil.rmtree(copies, ignore_errors=True)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    results["complete"] = True  # every part measured: gpu_check.sh tells this from a run cut short
    save(args.json, results)


if __name__ == "__main__":
    main()
