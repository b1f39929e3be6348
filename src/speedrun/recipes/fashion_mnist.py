"""Fashion-MNIST recipes: the default demo (real data, two CPU cores) and a tiny one for tests."""
from speedrun.recipe import OptimizerSettings, Phase, Recipe, Target

EPOCHS = 14
PEAK_LR = 0.2  # for a batch of 128


# Upright, centred 28 px garments: crops cover the whole image and keep its shape (aspect jitter
# cost about 2 points of top-1 at epoch 4 of 10 in a measured run), move by up to 2 px, and
# flip; evaluation shows the whole image (cropping 1/1.14 of it cuts the garments' edges).
GEOMETRY = dict(min_scale=1.0, ratio=(1.0, 1.0), translate=2 / 28, crop_pct=1.0)


def decay_after_warmup(peak: float, epochs: int, start: int, end: int) -> tuple[float, float]:
    """The LR line from `peak` after one warmup epoch down to 0 at epoch `epochs`, over the
    phase [start, end) (epochs)."""
    return (peak * (1 - (start - 1) / (epochs - 1)), peak * (1 - (end - 1) / (epochs - 1)))


def _decay(start: int, end: int) -> tuple[float, float]:
    return decay_after_warmup(PEAK_LR, EPOCHS, start, end)


# Measured on 2 CPU cores (docs/measurements.md): crosses 92% test top-1 at epoch 7. Small
# images first (20 -> 24 -> 28 px: an epoch at 20 px costs about 0.6 of one at 28 px); crops
# as in GEOMETRY; the evaluated weights are a moving average, which reaches a given accuracy
# epochs before the raw weights do; evaluating each test image and its mirror adds 0.1-0.3
# points (92% one epoch sooner) for 2 s per evaluation.
fashion_mnist = Recipe(
    name="fashion-mnist",
    description="Default demo: a small ResNet on Fashion-MNIST, 20 -> 28 px, to 92% test top-1 on 2 CPU cores.",
    model="resnet-fmnist",
    dataset="fashion-mnist",
    optimizer=OptimizerSettings(name="sgd", momentum=0.9, nesterov=True, weight_decay=5e-4, label_smoothing=0.1),
    target=Target("top1", 0.92),
    ema_decay=0.998,  # a cap that binds after ~24 epochs: here timm's EMA warmup sets the decay throughout
    eval_flip=True,
    val_batch_size=1000,
    phases=(
        Phase(0, 1, size=20, batch_size=128, lr=(0.2 * PEAK_LR, PEAK_LR), **GEOMETRY),  # warmup
        Phase(1, 2, size=20, batch_size=128, lr=_decay(1, 2), **GEOMETRY),
        Phase(2, 4, size=24, batch_size=128, lr=_decay(2, 4), **GEOMETRY),
        Phase(4, EPOCHS, size=28, batch_size=128, lr=_decay(4, EPOCHS), **GEOMETRY),
    ),
)

tiny = Recipe(
    name="tiny",
    description="Seconds-long run for tests: 6,000 Fashion-MNIST images, a tiny ResNet, 4 epochs.",
    model="resnet-fmnist-tiny",
    dataset="fashion-mnist",
    optimizer=OptimizerSettings(name="sgd", momentum=0.9, nesterov=True, weight_decay=5e-4),
    train_examples=6000,
    val_examples=1000,
    val_batch_size=500,
    phases=(
        Phase(0, 1, size=20, batch_size=64, lr=(0.05, 0.2), **GEOMETRY),
        Phase(1, 2, size=20, batch_size=128, lr=0.2, **GEOMETRY),  # batch-size change only
        Phase(2, 4, size=28, batch_size=128, lr=(0.2, 0.0), **GEOMETRY),
    ),
)
