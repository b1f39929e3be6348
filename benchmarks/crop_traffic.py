"""Memory traffic of the GPU decode path's batched crop (`augment.crop_resize_flip_ragged`), side by
side with cropping each image alone (one roi_align per image, the least traffic and the most
kernel launches).

On the GPU the crop runs next to the training step and takes memory bandwidth from it, so what
it writes and reads per batch is the figure to keep small; the number of operations is the
number of kernel launches (each a few microseconds of the decode thread's CPU time). Both are
counted, not timed: every tensor operation's output bytes (written) and input bytes (read), views
excluded, through a TorchDispatchMode. They are the same on any device, so this runs on the CPU.
The batch is ImageNet-like: 256 images of the common ImageNet sizes with RandomResizedCrop boxes.

    PYTHONPATH=src python benchmarks/crop_traffic.py --sizes 128 224 288
"""
from __future__ import annotations

import argparse
import random
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from speedrun.data.augment import crop_resize_flip, crop_resize_flip_ragged
from speedrun.data.transforms import crop_params

IMAGENET_SIZES = [(500, 375), (375, 500), (500, 333), (400, 350), (640, 480), (300, 225)]  # width, height


class Traffic(TorchDispatchMode):
    """Counts operations and the bytes they write (outputs) and read (inputs); views count nothing."""

    def __init__(self):
        super().__init__()
        self.ops, self.written, self.read = 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            storages = {t.untyped_storage().data_ptr() for t in ins}
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
                    and t.untyped_storage().data_ptr() not in storages]  # in-place: counted as read
            self.ops += 1
            self.written += sum(t.numel() * t.element_size() for t in outs)
            self.read += sum(t.numel() * t.element_size() for t in ins)
        return out


def imagenet_batch(n: int, min_scale: float, seed: int = 0):
    """n random uint8 images of ImageNet's common sizes, with RandomResizedCrop boxes and flips."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    images, boxes = [], []
    for _ in range(n):
        w, h = rng.choice(IMAGENET_SIZES)
        images.append(torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=gen))
        left, top, cw, ch = crop_params(w, h, min_scale, rng)
        boxes.append([left, top, left + cw, top + ch])
    return images, torch.tensor(boxes, dtype=torch.float64), torch.rand(n, generator=gen) < 0.5


def count(fn) -> Traffic:
    with Traffic() as traffic:
        fn()
    return traffic


def crop_each_alone(images, boxes, flips, size: int) -> list:
    """The batch's crops made one image at a time."""
    return [crop_resize_flip(im[None], boxes[i : i + 1].float(), flips[i : i + 1], size)
            for i, im in enumerate(images)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[224], help="crop sizes, px")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--min-scale", type=float, default=0.08, help="RandomResizedCrop's smallest area fraction")
    args = p.parse_args()
    images, boxes, flips = imagenet_batch(args.batch, args.min_scale)
    print(f"batch of {args.batch} ImageNet-sized images; GB written + read per batch, and operations")
    for size in args.sizes:
        ragged = count(partial(crop_resize_flip_ragged, images, boxes, flips, size))
        alone = count(partial(crop_each_alone, images, boxes, flips, size))
        traffic = [(t.written + t.read) / 1e9 for t in (ragged, alone)]
        print(f"{size:4d} px  batched crop {traffic[0]:6.2f} GB {ragged.ops:5d} ops   "
              f"each image alone {traffic[1]:6.2f} GB {alone.ops:5d} ops   "
              f"traffic ratio {traffic[0] / traffic[1]:.2f}x, ops ratio {ragged.ops / alone.ops:.2f}x")


if __name__ == "__main__":
    main()
