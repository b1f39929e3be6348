"""`speedrun data ...` commands: prepare resized copies, generate trees, index a tree."""
from __future__ import annotations

import argparse
import logging

from rich.console import Console

from speedrun.data.bounds import CLASSES, COPY_SIDE, FMNIST_TRAIN, FMNIST_VAL, PER_CLASS, QUALITY, SIDE
from speedrun.inputs import SEED, WORKERS, given


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `data` command group to the top-level parser."""
    data = sub.add_parser("data", help="prepare, generate and inspect image-folder datasets")
    cmds = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)

    p = cmds.add_parser(
        "prepare",
        help="write resized copies (shorter side N px) of an image-folder tree",
        description="Write DST/N/{train,val}/... for each N in --sizes: shorter side resized to N px "
        "(never upscaled), JPEG. Resumable: finished files are skipped. Bad images go to "
        "DST/prepare-report.tsv. Training finds the copies at ROOT-sz/N by default (see docs/data.md).",
    )
    p.add_argument("src", type=given, metavar="SRC", help="image-folder root (with train/ and val/)")
    p.add_argument("dst", type=given, metavar="DST", help="where the copies go (recommended: SRC-sz)")
    p.add_argument("--sizes", type=COPY_SIDE, nargs="+", default=[160, 352], metavar="N",
                   help="shorter sides in px (default: 160 352)")
    p.add_argument("--quality", type=QUALITY, default=90, metavar="Q", help="JPEG quality (default: 90)")
    p.add_argument("--workers", type=WORKERS, default=None, metavar="N", help="processes (default: all cores)")
    p.set_defaults(func=cmd_prepare)

    p = cmds.add_parser("synth",
                        help="generate an image-folder tree (ImageNet-shaped, or learnable from Fashion-MNIST)")
    kinds = p.add_subparsers(dest="kind", metavar="KIND", required=True)
    k = kinds.add_parser("imagenet",
                         help="ImageNet-shaped JPEGs (mean ~400x350 px, mostly 4:3 and 3:4), for speed tests")
    k.add_argument("dst", type=given, metavar="DST")
    k.add_argument("--classes", type=CLASSES, default=10)
    k.add_argument("--train-per-class", type=PER_CLASS, default=100)
    k.add_argument("--val-per-class", type=PER_CLASS, default=20)
    _common_synth(k)
    k.set_defaults(func=cmd_synth_imagenet)
    k = kinds.add_parser("fmnist-tree",
                         help="learnable tree: Fashion-MNIST garments off-centre on canvases of varied aspect ratio")
    k.add_argument("dst", type=given, metavar="DST")
    k.add_argument("--train", type=FMNIST_TRAIN, default=6000, help="training images (from Fashion-MNIST's 60k)")
    k.add_argument("--val", type=FMNIST_VAL, default=1000, help="validation images (from Fashion-MNIST's 10k test set)")
    k.add_argument("--source", type=given, default=None,
                   help="folder with the four IDX .gz files (default: /usr/share/datasets/fashion-mnist)")
    look = k.add_mutually_exclusive_group()
    look.add_argument("--side", type=SIDE, default=None, metavar="PX",
                      help="square canvases of PX pixels instead of varied ones")
    look.add_argument("--plain", action="store_true",
                      help="the 28 x 28 grayscale originals as PNG files, nothing added")
    _common_synth(k)
    k.set_defaults(func=cmd_synth_fmnist)

    p = cmds.add_parser("index", help="build (or check) the cached index of an image-folder tree and summarise it",
                        description="Build the index of an image-folder tree, or check a cached one by folder "
                        "(a folder whose mtime or entry count changed is read again), and summarise it. "
                        "See docs/data.md, 'The index'.")
    p.add_argument("path", type=given, metavar="PATH")
    p.add_argument("--workers", type=WORKERS, default=None, metavar="N")
    p.add_argument("--verify", action="store_true",
                   help="stat every file, trusting no folder: also sees a file rewritten in place under its own name")
    p.set_defaults(func=cmd_index)


def _common_synth(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quality", type=QUALITY, default=90, help="JPEG quality (default: 90)")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--workers", type=WORKERS, default=None, help="processes (default: all cores)")


def _log_to_console() -> None:
    # Bad files are logged one per line with their path; show them on stderr.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")


def cmd_prepare(args: argparse.Namespace) -> int:
    from speedrun.data.prepare import REPORT_NAME, prepare

    _log_to_console()
    s = prepare(args.src, args.dst, args.sizes, quality=args.quality, workers=args.workers)
    Console(soft_wrap=True).print(
        f"prepared {s.images} images into {args.dst}/{{{','.join(map(str, sorted(set(args.sizes))))}}}: "
        f"{s.resized} resized, {s.copied} copied (already small), {s.skipped} already done, "
        f"{len(s.bad)} bad (listed in {args.dst}/{REPORT_NAME}); "
        f"{s.seconds:.1f} s, {s.images_per_s:,.0f} images/s, {s.images_per_s_per_core:,.0f} images/s per core"
    )
    return 0


def cmd_synth_imagenet(args: argparse.Namespace) -> int:
    from speedrun.data.synth import imagenet_tree

    s = imagenet_tree(args.dst, args.classes, args.train_per_class, args.val_per_class, args.quality, args.seed,
                      args.workers)
    Console(soft_wrap=True).print(f"wrote {s.train} train and {s.val} val images in {s.classes} classes to {s.root}")
    return 0


def cmd_synth_fmnist(args: argparse.Namespace) -> int:
    from speedrun.data.synth import FMNIST_DIR, fmnist_tree

    s = fmnist_tree(args.dst, args.train, args.val, args.source or FMNIST_DIR, args.quality, args.seed, args.workers,
                    args.side, args.plain)
    Console(soft_wrap=True).print(f"wrote {s.train} train and {s.val} val images in {s.classes} classes to {s.root}")
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    import numpy as np

    from speedrun.data.index import cache_path, load_index

    _log_to_console()
    index = load_index(args.path, workers=args.workers, verify=args.verify)
    console = Console(soft_wrap=True)
    for name in ("train", "val"):
        split = index.split(name)
        if len(split):
            aspect = split.widths / split.heights
            console.print(
                f"{name}: {len(split)} images, mean {split.widths.mean():.0f} x {split.heights.mean():.0f} px, "
                f"aspect ratio {aspect.min():.2f}..{aspect.max():.2f} (median {np.median(aspect):.2f})"
            )
    console.print(
        f"{len(index.classes)} classes ({len(index.empty_classes)} without training images), "
        f"{len(index.bad)} unusable files; index cached at {cache_path(index.root)}"
    )
    c = index.checked
    console.print(f"this load: {c.folders} folders listed, {c.rescanned} of them read again "
                  f"({c.files_statted} files stat'ed), {c.headers} image headers read; "
                  f"cache {'written' if c.written else 'unchanged'}")
    return 0
