"""An image-folder recipe for the generated Fashion-MNIST tree (`speedrun data synth fmnist-tree`:
garments off-centre on canvases of aspect ratio 0.5-2.0, 48-96 px), used by docs/ablation.md to
measure the tricks where rectangular validation can matter: a square centre crop of a wide or
tall canvas cuts much of the garment off, a rectangular one keeps it."""
from speedrun.recipe import OptimizerSettings, Phase, Recipe, Target

_crop = dict(min_scale=0.35, rect_val=True, crop_pct=1.0)  # evaluated whole where the shape allows
recipe = Recipe(
    name="fmnist-tree",
    model="resnet-fmnist",
    dataset="imagefolder",
    optimizer=OptimizerSettings(name="sgd", momentum=0.9, nesterov=True, weight_decay=5e-4, label_smoothing=0.1),
    target=Target("top1", 0.75),
    ema_decay=0.998,
    eval_flip=True,
    val_batch_size=250,
    phases=(
        Phase(0, 1, size=32, batch_size=64, lr=(0.02, 0.1), **_crop),  # warmup, small batches
        Phase(1, 4, size=32, batch_size=128, lr=(0.2, 0.16), **_crop),
        Phase(4, 8, size=40, batch_size=128, lr=(0.16, 0.1), **_crop),
        Phase(8, 14, size=48, batch_size=128, lr=(0.1, 0.0), **_crop),
    ),
)
