"""`folder-small`: a recipe for a user's own folder of small images, fitted to the folder.

What the fashion-mnist recipe learned on 28 px garments, carried to any small-image folder: a
small ResNet, progressive resizing over 0.72 -> 0.86 -> 1.0 of the final size, SGD with
Nesterov momentum, one warmup epoch then a linear decay to zero, label smoothing, a moving average
of the weights, and test-time flips. Two numbers come from the folder itself (its index knows
both): the image side sets the sizes, and the number of training images sets the epochs, so that
a small folder still gets enough steps.
"""
import math

from speedrun.recipe import OptimizerSettings, Phase, Recipe
from speedrun.recipes.fashion_mnist import decay_after_warmup

MAX_SIDE = 64  # px: larger images are trained at 64 px, where a small ResNet on a CPU stays quick
MIN_EPOCHS = 14  # the fashion-mnist recipe's length (60,000 images)
MIN_STEPS = 1500  # at least this many steps, however small the folder ...
MAX_EPOCHS = 60  # ... up to this many epochs
BATCH = 128  # images per step, smaller for folders of under 10 batches
PEAK_LR = 0.2  # for a batch of 128; scaled linearly for smaller batches
# Whole images, shape kept, translated by up to 7% of a side, flipped; evaluated whole.
GEOMETRY = dict(min_scale=1.0, ratio=(1.0, 1.0), translate=0.07, crop_pct=1.0)


def _size(fraction: float, final: int) -> int:
    """fraction x final px, to a multiple of 4 px."""
    return max(8, int(round(fraction * final / 4)) * 4)


def folder_small(image_side: int, num_train: int) -> Recipe:
    """The recipe for a folder whose training images have a typical shorter side of `image_side`
    px (the median) and that holds `num_train` training images."""
    final = min(int(image_side), MAX_SIDE)
    batch = BATCH if num_train >= 10 * BATCH else max(8, 2 ** int(math.log2(max(num_train, 1) / 10)))
    epochs = min(MAX_EPOCHS, max(MIN_EPOCHS, math.ceil(MIN_STEPS * batch / max(num_train, 1))))
    # Phase edges as in fashion-mnist (epochs 2 and 4 of 14): a seventh at each smaller size.
    small, middle = max(2, round(epochs / 7)), max(3, round(2 * epochs / 7))

    peak = PEAK_LR * batch / BATCH

    def decay(start: int, end: int) -> tuple[float, float]:
        return decay_after_warmup(peak, epochs, start, end)

    return Recipe(
        name="folder-small",
        description=f"A small ResNet fitted to a folder of small images: {_size(0.72, final)} -> {final} px, "
                    f"{epochs} epochs (MAX_SIDE {MAX_SIDE} px); the fashion-mnist recipe's methods.",
        model="resnet-fmnist",
        dataset="imagefolder",
        optimizer=OptimizerSettings(name="sgd", momentum=0.9, nesterov=True, weight_decay=5e-4, label_smoothing=0.1),
        ema_decay=0.998,
        eval_flip=True,
        val_batch_size=500,
        phases=(
            Phase(0, 1, size=_size(0.72, final), batch_size=batch, lr=(0.2 * peak, peak), **GEOMETRY),  # warmup
            Phase(1, small, size=_size(0.72, final), batch_size=batch, lr=decay(1, small), **GEOMETRY),
            Phase(small, middle, size=_size(0.86, final), batch_size=batch, lr=decay(small, middle), **GEOMETRY),
            Phase(middle, epochs, size=final, batch_size=batch, lr=decay(middle, epochs), **GEOMETRY),
        ),
    )
