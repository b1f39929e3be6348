"""Checkpoints written atomically (a crash mid-write leaves the previous checkpoint intact) and
off the training thread (`CheckpointWriter`)."""
from __future__ import annotations

import os
import random
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from speedrun.errors import SpeedrunError


def save_atomic(state: dict[str, Any], path: str | os.PathLike) -> None:
    """torch.save to a temporary file in the same folder, fsync, then rename over `path`
    (rename is atomic on POSIX file systems, so readers see the old file or the new one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class CheckpointWriter:
    """Writes checkpoints on a background thread, so that training (and every other rank, which
    would wait at its next collective) does not stand still while rank 0 writes and fsyncs
    hundreds of MB. `save` copies the state first (tensors to the CPU), then returns; a save
    while the previous one is still being written waits for it. A failed write is raised by the
    next `save` or `wait`, on the training thread."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._writing: str | None = None
        self.last_written: str | None = None  # the `label` of the last save that reached the disk

    @property
    def busy(self) -> bool:
        """A write is in progress."""
        return self._thread is not None and self._thread.is_alive()

    def save(self, state: dict[str, Any], path: str | os.PathLike, label: str | None = None) -> None:
        """Copy `state` now and write it to `path` (atomically) in the background. `label` names
        it in `last_written` once it is on disk (e.g. "epoch 3")."""
        snapshot = copy_to_cpu(state)
        self.wait()
        self._writing = label or str(path)
        self._thread = threading.Thread(target=self._write, args=(snapshot, Path(path)), name="checkpoint-writer")
        self._thread.start()

    def _write(self, state: dict[str, Any], path: Path) -> None:
        try:
            save_atomic(state, path)
            self.last_written = self._writing
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            self._error = e

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
