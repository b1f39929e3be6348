"""The peer side of benchmarks/folder_peer.py: fastai 2.8 trains speedrun's `resnet-fmnist` on an
image folder with its own defaults, as a fastai user would write it: `ImageDataLoaders.from_folder`
(Resize to the image side, `aug_transforms()`, ImageNet normalisation, batch 64), `Learner` with
its default Adam, `lr_find()`'s valley as the LR, `fit_one_cycle(EPOCHS, lr)`.

Run by folder_peer.py with the fastai environment's Python (fastai is installed for the benchmark
only); prints one JSON line per epoch: {"epoch", "wall_s" (from T0, the parent's launch time),
"top1"}, then {"done": true, "lr": ...}.

    python fastai_folder.py DATA SIDE EPOCHS T0
"""
import json
import sys
import time

from fastai.vision.all import (Callback, ImageDataLoaders, Learner, Normalize, Resize, accuracy, aug_transforms,
                               imagenet_stats)

from speedrun.model import build_model

data, side, epochs, t0 = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])


class Report(Callback):
    """After each epoch's validation: the wall time and fastai's accuracy metric."""

    order = 100  # after the Recorder has the epoch's metrics

    def after_epoch(self):
        top1 = float(self.recorder.values[-1][2])  # [train_loss, valid_loss, accuracy]
        print(json.dumps({"epoch": self.epoch + 1, "wall_s": time.time() - t0, "top1": top1}), flush=True)


dls = ImageDataLoaders.from_folder(data, train="train", valid="val", item_tfms=Resize(side), bs=64,
                                   batch_tfms=[*aug_transforms(), Normalize.from_stats(*imagenet_stats)])
learn = Learner(dls, build_model("resnet-fmnist", dls.c, 3), metrics=accuracy)
with learn.no_bar(), learn.no_logging():
    lr = learn.lr_find(show_plot=False).valley
    learn.fit_one_cycle(epochs, lr, cbs=Report())
print(json.dumps({"done": True, "lr": lr}), flush=True)
