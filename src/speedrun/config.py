"""What `speedrun train` passes to the loop besides the recipe: one plain dataclass."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from speedrun.money import Price
from speedrun.recipe import Recipe
from speedrun.trackers import TrackSpec


@dataclass(frozen=True)
class TrainConfig:
    """A run's settings. Frozen: the loop derives what it needs (the run directory it claimed)
    without changing its input."""

    recipe: Recipe
    out: Path | None = None  # run directory; None = runs/<recipe>-<date>-<time>
    data: str | None = None  # data path; None = the source's default lookup
    device: str | None = None  # "cpu", "cuda", or None for cuda when available
    resume: bool = False
    compile: bool = False
    seed: int = 0
    deterministic: bool = False
    workers: int | None = None  # decode processes per device (image folders)
    copies: str | None = None  # where an image folder's resized copies are (None: <data>-sz)
    loader: str = "auto"  # image-folder training decode: "auto", "pil" or "dali" (data.build_source)
    verify_index: bool = False  # check the image-folder index file by file, not by folder (data.index)
    log_every: int = 50  # steps between train-loss records
    track: tuple[TrackSpec, ...] = ()  # experiment trackers beside TensorBoard (speedrun.trackers)
    track_group: str | None = None  # the run's group in them (an ablation, a job)
    track_checkpoints: bool = False  # also upload the final checkpoint to them
    checkpoint_every: int = 1  # epochs between checkpoints (0: never)
    checkpoint_minutes: float | None = None  # also a checkpoint mid-epoch when this many minutes passed
    spot_notice_url: str | None = None  # poll it for a spot interruption notice (see speedrun.stopping)
    sync_bn: bool = False  # synchronise BatchNorm statistics across ranks
    bucket_cap_mb: float = 25.0  # DDP gradient bucket size
    dist_timeout_s: float = 300.0  # seconds a collective waits for a peer before the run fails
    bf16_grads: bool = False  # compress gradients to bf16 for the all-reduce (CUDA only)
    price: Price | None = None  # what the machines cost (speedrun.money: given by the job layer), None: unknown
    precision: str = "auto"  # "auto" (see learner.choose_precision), "bf16", "fp16" or "fp32"
    memory_format: str = "auto"  # "auto" (see speedrun.memory_format), "channels_last" or "contiguous"
    process_start: float = field(default_factory=time.time)  # wall clock when the process began


def absolute_data(data: str | None) -> str | None:
    """A --data path made absolute when it exists (it is recorded, and used from other
    directories: `speedrun eval`, ablation runs); anything else as given, for the source to judge."""
    return str(Path(data).resolve()) if data and Path(data).exists() else data
