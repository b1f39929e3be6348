"""Checkpoints written atomically: a crash mid-write leaves the previous checkpoint intact."""
from __future__ import annotations

import os
import random
import tempfile
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
