"""The bounds of the data commands' numbers (`speedrun data ...`), shared by their command line
(where `--help` shows them) and the functions behind it (which check them for Python callers).
Kept apart from those functions so that building the command line imports nothing heavy."""
from speedrun.inputs import Bound
from speedrun.recipe import IMAGE_SIZE

MAX_SIDE = 2048
QUALITY = Bound(int, 1, 100)  # JPEG quality
CLASSES = Bound(int, 2, 100_000)  # a classifier tells two apart at least; ImageNet-21k has 21,841
PER_CLASS = Bound(int, 1, 100_000)  # images per class and split
SIDE = Bound(int, 28, MAX_SIDE)  # px: a garment is 28 px
FMNIST_TRAIN = Bound(int, 1, 60_000)  # Fashion-MNIST's training images
FMNIST_VAL = Bound(int, 1, 10_000)  # its test images
# ImageNet's 1.33M with room: a larger generated tree is hours of writing and over 100 GB.
MAX_IMAGES = 2_000_000
COPY_SIDE = IMAGE_SIZE  # px, the shorter side of a resized copy (`data prepare --sizes`)
