"""The names a recipe and the command line choose among (no torch here: the CLI's parser reads them)."""

LOADERS = ("auto", "pil", "gpu", "dali")  # how image files are decoded for training; see docs/data.md
DATASETS = ("fashion-mnist", "imagefolder")  # what a recipe's `dataset` may name
