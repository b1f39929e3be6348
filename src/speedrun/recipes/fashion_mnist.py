"""Fashion-MNIST recipes: the default demo (real data, two CPU cores) and a tiny one for tests."""
from speedrun.recipe import OptimizerSettings, Phase, Recipe, Target

# Placeholder schedule; tuned against the main job's target below.
fashion_mnist = Recipe(
    name="fashion-mnist",
    description="Default demo: a small ResNet on Fashion-MNIST, progressive resizing 20 -> 28 px.",
    model="resnet-fmnist",
    dataset="fashion-mnist",
    optimizer=OptimizerSettings(name="sgd", momentum=0.9, nesterov=True, weight_decay=5e-4, label_smoothing=0.1),
    target=Target("top1", 0.92),
    phases=(
        Phase(0, 1, size=20, batch_size=256, lr=(0.08, 0.4), min_scale=0.77),
        Phase(1, 3, size=24, batch_size=256, lr=(0.4, 0.2), min_scale=0.77),
        Phase(3, 5, size=28, batch_size=256, lr=(0.2, 0.0), min_scale=0.77),
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
        Phase(0, 1, size=20, batch_size=64, lr=(0.05, 0.2), min_scale=1.0),
        Phase(1, 2, size=20, batch_size=128, lr=0.2, min_scale=1.0),  # batch-size change only
        Phase(2, 4, size=28, batch_size=128, lr=(0.2, 0.0), min_scale=1.0),
    ),
)
