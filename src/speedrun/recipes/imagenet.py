"""The 2018 ImageNet-in-18-minutes schedules (ResNet-50, 93% top-5), one per machine count.

Numbers are the record runs' own (docs/record.md, "The schedules"). Every machine had 8 V100s,
so `world_size` is machines x 8 and batch sizes are per GPU. Rows that change only the batch size
keep the data pipeline; `min_scale` and rectangular validation carry over to later rows at the
same image size, as they did in the original. Unstated min_scale values are 0.08, the loader's
default there and torchvision's.
"""
from speedrun.recipe import OptimizerSettings, Phase, Recipe, Target

_common = dict(
    model="resnet50",
    dataset="imagefolder",
    optimizer=OptimizerSettings(name="sgd", momentum=0.9, weight_decay=1e-4, no_decay="bn"),
    target=Target("top5", 0.93),
)

imagenet_16x8 = Recipe(
    name="imagenet-16x8",
    description="16 machines x 8 GPUs: 93% top-5 in 18:05 (2018 record).",
    world_size=128,
    phases=(
        Phase(0, 6, size=128, batch_size=64, lr=(1.88, 3.76), copy=160),
        Phase(6, 16, size=128, batch_size=128, lr=3.76, copy=160),
        Phase(16, 19, size=224, batch_size=64, lr=1.88),
        Phase(19, 31, size=224, batch_size=192, lr=0.564),
        Phase(31, 37, size=224, batch_size=192, lr=0.0564),
        Phase(37, 38, size=288, batch_size=128, lr=0.0376, min_scale=0.5, rect_val=True),
        Phase(38, 50, size=288, batch_size=128, lr=0.00376, min_scale=0.5, rect_val=True),
    ),
    **_common,
)

imagenet_8x8 = Recipe(
    name="imagenet-8x8",
    description="8 machines x 8 GPUs: 93% top-5 in 18:53.",
    world_size=64,
    phases=(
        Phase(0, 6, size=128, batch_size=128, lr=(1.92, 3.84), copy=160),
        Phase(6, 11, size=128, batch_size=256, lr=3.84, copy=160),
        Phase(11, 14, size=128, batch_size=256, lr=(3.84, 1.92), copy=160),
        Phase(14, 17, size=224, batch_size=128, lr=1.92, min_scale=0.087, copy=352),
        Phase(17, 23, size=224, batch_size=224, lr=(1.92, 0.336), min_scale=0.087, copy=352),
        Phase(23, 29, size=224, batch_size=224, lr=(0.336, 0.0336), min_scale=0.087, copy=352),
        Phase(29, 36, size=288, batch_size=128, lr=(0.0192, 0.00192), min_scale=0.5, rect_val=True),
    ),
    **_common,
)

imagenet_4x8 = Recipe(
    name="imagenet-4x8",
    description="4 machines x 8 GPUs: 93% top-5 in 29:42.",
    world_size=32,
    phases=(
        Phase(0, 6, size=128, batch_size=256, lr=(2.0, 4.0), copy=160),
        Phase(6, 11, size=128, batch_size=512, lr=4.0, copy=160),
        Phase(11, 13, size=128, batch_size=512, lr=(4.0, 2.0), copy=160),
        Phase(13, 16, size=224, batch_size=224, lr=1.75, min_scale=0.087, copy=352),
        Phase(16, 24, size=224, batch_size=224, lr=(1.75, 0.175), min_scale=0.087, copy=352),
        Phase(24, 28, size=224, batch_size=224, lr=(0.175, 0.0175), min_scale=0.087, copy=352),
        Phase(28, 30, size=288, batch_size=128, lr=(0.01, 0.001), min_scale=0.5, rect_val=True),
    ),
    **_common,
)

imagenet_2x8 = Recipe(
    name="imagenet-2x8",
    description="2 machines x 8 GPUs: 93% top-5 in about 54 minutes.",
    world_size=16,
    phases=(
        Phase(0, 6, size=128, batch_size=256, lr=(1.5, 3.0), copy=160),
        Phase(6, 11, size=128, batch_size=512, lr=3.0, copy=160),
        Phase(11, 13, size=128, batch_size=512, lr=(3.0, 1.5), copy=160),
        Phase(13, 16, size=224, batch_size=224, lr=1.3125, min_scale=0.087, copy=352),
        Phase(16, 23, size=224, batch_size=224, lr=(1.3125, 0.13125), min_scale=0.087, copy=352),
        Phase(23, 28, size=224, batch_size=224, lr=(0.13125, 0.013125), min_scale=0.087, copy=352),
        Phase(28, 30, size=288, batch_size=128, lr=(0.0075, 0.00075), min_scale=0.5, rect_val=True),
    ),
    **_common,
)

imagenet_1x8 = Recipe(
    name="imagenet-1x8",
    description="1 machine x 8 GPUs: 93% top-5 in about 109 minutes.",
    world_size=8,
    phases=(
        Phase(0, 7, size=128, batch_size=512, lr=(1.0, 2.0), copy=160),
        Phase(7, 13, size=128, batch_size=512, lr=(2.0, 0.25), copy=160),
        Phase(13, 22, size=224, batch_size=224, lr=(0.4375, 0.04375), min_scale=0.087, copy=352),
        Phase(22, 25, size=224, batch_size=224, lr=(0.04375, 0.004375), min_scale=0.087, copy=352),
        Phase(25, 28, size=288, batch_size=128, lr=(0.0025, 0.00025), min_scale=0.5, rect_val=True),
    ),
    **_common,
)
