"""The run directory's promises: one writer at a time, no stale logs, no dead ends.

`claim(out, resume)` is called by rank 0 before anything is written. It
- refuses an `--out` that is a file or cannot be written to (before any data is loaded);
- takes an exclusive lock (`RUN_DIR/.lock`, flock): a second run on the same directory is
  refused with one line naming the first; a process that dies (even by SIGKILL) releases it;
- removes the temporaries a killed writer left behind;
- decides what the directory holds. With `--resume` it must hold a checkpoint. Without, a
  checkpoint or a finished run is never overwritten; what a run left without a checkpoint (it
  was stopped or failed before its first one: logs, events, results) is moved aside to
  `RUN_DIR/abandoned-<date>-<time>/` and the run starts over, so old lines are never appended to.
A run refused before it wrote anything (nothing to --resume, bad --data) leaves no trace: no
lock file, and no directory where there was none.

`claim_run_dir` is the training loop's way in (rank 0 claims, every rank learns the outcome);
`already_complete` answers a `--resume` of a run with nothing left to do; `run_dir_error` says
in one line that a write to the directory failed (a full disk, say) and what can be continued.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from speedrun import files
from speedrun.errors import SpeedrunError

if TYPE_CHECKING:  # types only: ablate and the launcher read run directories without torch
    from speedrun.checkpoint import RunState
    from speedrun.config import TrainConfig
    from speedrun.dist import DistContext
    from speedrun.recipe import Recipe

CHECKPOINT = "checkpoint.pt"
RESULTS = "results.json"
# What a run writes besides its checkpoint (track.py's files and the plot).
RUN_FILES = ("metrics.jsonl", "steps.jsonl", "tb", RESULTS, "accuracy.png")
WRITTEN_WHOLE = (CHECKPOINT, RESULTS, "metrics.jsonl", "steps.jsonl")  # at some moment by files.replacing
LOCK = ".lock"
FINISHED = ("finished", "target_reached")  # statuses of a run that has nothing left to do


@dataclass
class RunDir:
    """A claimed run directory; `release` (or process exit) frees it for the next run."""

    path: Path
    lock: IO[str] | None
    note: str | None = None  # one line to print: what was moved aside, or None
    created: bool = False  # `claim` made the directory

    def release(self) -> None:
        """Free the directory. A run refused before writing anything (bad --data, say) leaves no
        trace: the lock file goes, and the directory too when `claim` made it."""
        if self.lock is None:
            return
        try:
            if [p.name for p in self.path.iterdir()] == [LOCK]:
                (self.path / LOCK).unlink()  # still holding the lock: no other process can be using it
                if self.created:
                    self.path.rmdir()
        except OSError:  # gone or unreadable: nothing of ours to tidy
            pass
        self.lock.close()  # closing the file releases the flock
        self.lock = None


def claim(out: Path, resume: bool) -> RunDir:
    """Check, lock and prepare `out` for a run (rank 0 only); SpeedrunError for every refusal."""
    if out.exists() and not out.is_dir():
        raise SpeedrunError(f"--out {out} is a file, not a directory; choose a directory")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpeedrunError(f"--out {out}: cannot create the run directory ({e.strerror or e})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise SpeedrunError(f"--out {out} is not writable by this user; choose another directory")
    claimed = RunDir(out, _lock(out), created=created)
    try:
        _remove_temporaries(out)
        claimed.note = _check_contents(out, resume)
    except BaseException:
        claimed.release()  # a refused --resume leaves no empty directory behind
        raise
    return claimed


def _remove_temporaries(out: Path) -> None:
    """The temporaries a writer killed mid-write left: a file the run writes whole is written to a
    temporary beside it first (files.replacing). Nobody holds them once `out` is claimed."""
    leftovers = [tmp for name in WRITTEN_WHOLE for tmp in files.temporaries(out, name)]
    leftovers += files.temporaries(out / "trackers")  # speedrun.trackers' own folder: all of it is theirs
    for tmp in leftovers:
        tmp.unlink(missing_ok=True)


def _lock(out: Path) -> IO[str]:
    f = open(out / LOCK, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise SpeedrunError(f"{out} is in use by another run ({holder}); "
                            "wait for it to end or choose another --out") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f


def _check_contents(out: Path, resume: bool) -> str | None:
    has_checkpoint = (out / CHECKPOINT).is_file()
    if resume:
        if not has_checkpoint:
            left = [name for name in RUN_FILES if (out / name).exists()]
            what = "it holds no run" if not left else "the run there stopped before its first checkpoint"
            raise SpeedrunError(f"--resume: no checkpoint at {out / CHECKPOINT} ({what}); "
                                "run without --resume to start it over")
        return None
    if has_checkpoint:
        raise SpeedrunError(f"{out} already holds a run; continue it with --resume or choose another --out")
    status = run_status(out)
    if status in FINISHED:
        raise SpeedrunError(f"{out} holds a finished run (status {status}, no checkpoint); choose another --out")
    left = [name for name in RUN_FILES if (out / name).exists()]
    if not left:
        return None
    aside = out / f"abandoned-{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir()
    for name in left:
        os.replace(out / name, aside / name)
    return (f"{out} held a run that stopped before its first checkpoint; "
            f"its files were moved to {aside.name}/, starting over")


def in_use(out: Path) -> bool:
    """Whether a live process holds `out` (a run is going on there now)."""
    try:
        f = open(out / LOCK)
    except OSError:
        return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def run_status(out: Path) -> str | None:
    """The status in `out`'s results.json, or None when there is none or it cannot be read."""
    try:
        return json.loads((out / RESULTS).read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return None


def default_run_dir(recipe_name: str) -> Path:
    """runs/<recipe>-<date>-<time>, in the current directory."""
    return Path("runs") / f"{recipe_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def claim_run_dir(cfg: TrainConfig, ctx: DistContext) -> RunDir:
    """The run directory, claimed (checked, locked, cleared of a dead run's leftovers) on rank 0
    and shared, so that every rank writes to the same place; see `claim`."""
    from speedrun.dist import broadcast_object  # torch: only the loop claims this way

    claimed, decision = None, None
    if ctx.is_main:
        out = cfg.out or default_run_dir(cfg.recipe.name)
        try:
            claimed = claim(out, cfg.resume)
            decision = (str(out), None)
        except SpeedrunError as e:
            decision = (str(out), str(e))
    out, problem = broadcast_object(decision, ctx)
    if problem:
        raise SpeedrunError(problem)
    return claimed or RunDir(Path(out), lock=None)


def complete(state: RunState, recipe: Recipe) -> bool:
    """Whether a checkpoint's run has nothing left to train: it reached its target or ran every epoch."""
    return state.target_epoch is not None or state.epoch >= recipe.epochs


def already_complete(out: Path, state: RunState, ctx: DistContext) -> dict[str, Any]:
    """`--resume` of a complete run: say so and change nothing (no interruption is recorded: no
    time was lost). Returns the run's results as results.json holds them."""
    how = (f"reached its target at epoch {state.target_epoch}" if state.target_epoch is not None
           else f"ran all {state.epoch} epochs")
    if ctx.is_main:
        print(f"{out} is complete (it {how}): nothing to resume; nothing was changed", flush=True)
    status = "target_reached" if state.target_epoch is not None else "finished"
    try:
        results = json.loads((out / "results.json").read_text())
    except (OSError, ValueError):  # removed, damaged, or on rank 0's host only: the checkpoint says how it ended
        results = {}
    return {**results, "status": status}


def run_dir_error(e: OSError, out: Path, complete: str | None) -> BaseException:
    """A write to the run directory failed: the disk is full, it became read-only or it was
    removed. That is the machine's fault, not speedrun's: one line (SpeedrunError) with what can
    be continued (`complete`: the last checkpoint on disk). Any other OSError is returned as is."""
    in_run_dir = e.filename is None or Path(os.fsdecode(e.filename)).absolute().is_relative_to(out.absolute())
    if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.ENOENT) or not in_run_dir:
        return e
    where = f"{e.strerror}: {os.fsdecode(e.filename) if e.filename else 'checkpoint'}"
    if e.errno == errno.ENOENT:
        return SpeedrunError(f"the run directory {out} (or part of it) was removed during the run ({where})")
    return SpeedrunError(
        f"cannot write to the run directory {out} ({where}); "
        + (f"the last complete checkpoint is {complete}: free space and continue with --resume"
           if complete else "no checkpoint was completed: free space and start again")
    )
