"""Checkpoints: what a run saves (`RunState`, `save_run`), how it continues (`restore_run`), and
how the file is written: atomically (a crash mid-write leaves the previous checkpoint intact)
and off the training thread (`CheckpointWriter`)."""
from __future__ import annotations

import os
import random
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from speedrun import files
from speedrun.version import __version__
from speedrun.config import TrainConfig
from speedrun.dist import processes
from speedrun.errors import SpeedrunError
from speedrun.learner import Learner
from speedrun.recipe import Recipe


@dataclass
class RunState:
    """What a checkpoint carries besides weights and optimizer state."""

    epoch: int = 0  # next epoch to run (0-based), which is also the number of epochs done
    epoch_step: int = 0  # steps of `epoch` already taken (a run stopped mid-epoch continues there)
    step: int = 0  # optimizer steps taken, all epochs
    startup_s: float = 0.0  # process start -> first step, in the run's first process
    train_s: float = 0.0  # first step -> now, summed over resumed sessions (track.Clock keeps both up to date)
    best: dict[str, float] = field(default_factory=dict)
    time_to_target_s: float | None = None
    time_to_target_from_first_step_s: float | None = None
    target_epoch: int | None = None  # the epoch (1-based, as printed) whose evaluation reached the target
    world_size: int | None = None  # processes the run trains on; a resume must use as many
    interruptions: list[dict] = field(default_factory=list)  # what each resume cost (track.interruption)
    # The labels the weights mean, for `speedrun eval` to check other data against. Checkpoints
    # before these fields have neither; `classes` is None for data without class names.
    classes: list[str] | None = None  # class names in label order (an image folder's folders)
    num_classes: int | None = None
    # What the machines cost (speedrun.money.Price as a dict): the latest process's, kept for a
    # resume that is given none. None: unknown.
    price: dict[str, Any] | None = None
    lost_s_at_target: float | None = None  # seconds interruptions had lost when the target was reached

    def record_classes(self, source: Any) -> None:
        """Note the labels of `source` (a DataSource) that the weights are trained on."""
        names = getattr(source, "classes", None)
        self.classes = [str(c) for c in names] if names is not None else None
        self.num_classes = source.num_classes


def save_run(writer: CheckpointWriter, path: Path, learner: Learner, state: RunState, cfg: TrainConfig) -> None:
    """Hand the run's state to `writer`, which copies it now and writes it in the background."""
    writer.save(
        {
            "model": learner.model.state_dict(),
            "ema": learner.ema.module.state_dict() if learner.ema is not None else None,
            "optimizer": learner.optimizer.state_dict(),
            "scaler": learner.scaler.state_dict() if learner.scaler is not None else None,
            "state": asdict(state),
            "recipe": cfg.recipe.to_dict(),
            "data": cfg.data,  # where `speedrun eval` finds the validation split
            "seed": cfg.seed,  # a resume must use the same, or it would not continue the same run
            "deterministic": cfg.deterministic,
            "rng": rng_state(),
            "speedrun": __version__,
        },
        path,
        label=f"{path} ({where(state)})",
    )


def where(state: RunState) -> str:
    """Where a checkpoint stands: "after epoch 3" or "at step 130, 22 steps into epoch 4"."""
    if state.epoch_step:
        return f"at step {state.step}, {state.epoch_step} steps into epoch {state.epoch + 1}"
    return f"after epoch {state.epoch}"


def restore_run(path: Path, learner: Learner, cfg: TrainConfig, world_size: int) -> RunState:
    """Load a checkpoint into the learner. The recipe, the number of processes, the seed and
    --deterministic must be the ones it was made with: another world size would change the global
    batch and the LR mid-run, another seed the data order; the run would not continue, it would
    become a different one."""
    try:
        saved = load_run(path)
    except SpeedrunError as e:
        raise SpeedrunError(f"--resume: {e}; it cannot be continued: start over in another --out") from None
    if Recipe.from_dict(saved["recipe"]) != cfg.recipe:
        raise SpeedrunError(f"--resume: {path} was made with a different recipe ({saved['recipe']['name']}); "
                            "resume with the same one")
    state = RunState(**saved["state"])
    if state.world_size is not None and state.world_size != world_size:
        raise SpeedrunError(
            f"--resume: {path} was trained on {processes(state.world_size)} and this run has {processes(world_size)}: "
            f"the global batch and LR would change mid-run; resume on {processes(state.world_size)}"
        )
    for name, now in (("seed", cfg.seed), ("deterministic", cfg.deterministic)):
        if name in saved and saved[name] != now:
            flag = (f"--seed {saved[name]}" if name == "seed"
                    else ("--deterministic" if saved[name] else "no --deterministic"))
            raise SpeedrunError(f"--resume: the run was made with {flag}; "
                                f"resume with the same (this run has {name} {now})")
    state.world_size = world_size  # checkpoints before this field: unknown, taken as this run's
    learner.model.load_state_dict(saved["model"])
    if learner.ema is not None:
        learner.ema.module.load_state_dict(saved["ema"])
    learner.optimizer.load_state_dict(saved["optimizer"])
    if learner.scaler is not None and saved.get("scaler"):
        learner.scaler.load_state_dict(saved["scaler"])
    set_rng_state(saved["rng"])
    return state


def load_run(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint that `save_run` wrote; SpeedrunError when it cannot be read or is not one."""
    saved = load(path)
    if not isinstance(saved, dict) or not {"recipe", "model", "optimizer", "state"} <= set(saved):
        raise SpeedrunError(f"{path} is not a speedrun checkpoint")
    return saved


def save_atomic(state: dict[str, Any], path: str | os.PathLike) -> None:
    """torch.save to a temporary file in the same folder, fsync, then rename over `path`
    (rename is atomic on POSIX file systems, so readers see the old file or the new one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with files.replacing(path, fsync=True) as tmp, open(tmp, "wb") as f:
        try:
            torch.save(state, f)
        except (OSError, RuntimeError) as e:
            # A disk that fills part-way through: the file's OSError (ENOSPC) reaches us as is, or
            # as the zip writer's RuntimeError ("unexpected pos", raised while it closes the
            # archive) with the OSError as its context. Either way: that OSError, naming the file.
            failed = e if isinstance(e, OSError) else e.__context__
            if not isinstance(failed, OSError):
                raise
            raise OSError(failed.errno, failed.strerror, str(path)) from None


class CheckpointWriter:
    """Writes checkpoints on a background thread, so that training (and every other rank, which
    would wait at its next collective) does not stand still while rank 0 writes and fsyncs
    hundreds of MB. `save` copies the state first (tensors to the CPU), then returns; a save
    while the previous one is still being written waits for it. A failed write is raised by the
    next `save` or `wait`, on the training thread."""

    def __init__(self, last_written: str | None = None) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # The `label` of the last checkpoint on disk: a failed write leaves the previous one, which
        # may be one this writer did not write (`last_written`, e.g. the one a run resumed from).
        self.last_written = last_written

    @property
    def busy(self) -> bool:
        """A write is in progress."""
        return self._thread is not None and self._thread.is_alive()

    def save(self, state: dict[str, Any], path: str | os.PathLike, label: str | None = None) -> None:
        """Copy `state` now and write it to `path` (atomically) in the background. `label` names
        it in `last_written` once it is on disk (e.g. "epoch 3")."""
        snapshot = copy_to_cpu(state)
        self.wait()
        args = (snapshot, Path(path), label or str(path))
        self._thread = threading.Thread(target=self._write, args=args, name="checkpoint-writer")
        self._thread.start()

    def _write(self, state: dict[str, Any], path: Path, label: str) -> None:
        try:
            save_atomic(state, path)
            self.last_written = label
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            self._error = e

    def check(self) -> None:
        """Raise the error of a write that has failed already; a write in progress is not waited
        for. Cheap: call it after every step, so that a run stops as soon as a checkpoint fails."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> None:
        """Block until the last save is on disk; raise its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


def copy_to_cpu(obj: Any) -> Any:
    """A deep copy of nested dicts, lists and tuples whose tensors are copied to the CPU: later
    in-place updates of the weights and optimizer state do not reach it."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: copy_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(copy_to_cpu(v) for v in obj)
    return obj


def load(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint written by `save_atomic`, on the CPU."""
    path = Path(path)
    if not path.is_file():
        raise SpeedrunError(f"no checkpoint at {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise SpeedrunError(f"checkpoint {path} cannot be read ({type(e).__name__}: {e})") from None


def rng_state() -> dict[str, Any]:
    """Every random generator a training step may use."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
