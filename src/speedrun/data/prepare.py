"""Resized copies of an image-folder tree: ``speedrun data prepare SRC DST --sizes 160 352``.

For each size N, ``DST/N/{train,val}/<class>/...`` mirrors SRC file for file (same relative
paths, so labels and the index line up): the shorter side becomes N px (aspect kept, Lanczos
after a DCT-scaled decode), saved as JPEG at `quality`. An image whose shorter side is already
<= N is never upscaled: its bytes are copied unchanged. Every class folder is created, empty or
not, so a copy has exactly the source's classes.

Resumable: each output is written to a temporary file in ``DST/.partial-<pid>/`` and renamed
into place when complete, so an existing output is a finished one and is skipped on the next run;
the next run also removes the temporary files of a run that was killed. Worker processes die
with the process that started them (even when it is killed with SIGKILL, as the OOM killer
does), so nothing is written after the command has ended. All cores work in parallel; a bad
image is listed in ``DST/prepare-report.tsv`` (path, reason) and skipped. Each copy's index is
built at the end, so the first training run does not have to.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from speedrun.data.bounds import COPY_SIDE, QUALITY
from speedrun.data.index import load_index
from speedrun.data.transforms import open_image
from speedrun.errors import SpeedrunError, one_line
from speedrun.inputs import WORKERS

REPORT_NAME = "prepare-report.tsv"


@dataclass
class PrepareSummary:
    """What `prepare` did, counted in source images (each covers all sizes)."""

    images: int = 0  # source images considered
    resized: int = 0  # outputs written by resizing
    copied: int = 0  # outputs copied as they are (already small enough)
    skipped: int = 0  # outputs already present (earlier run)
    bad: list[tuple[str, str]] = field(default_factory=list)  # (relative path, reason)
    seconds: float = 0.0
    workers: int = 1

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds else 0.0

    @property
    def images_per_s_per_core(self) -> float:
        return self.images_per_s / max(self.workers, 1)


@dataclass(frozen=True)
class _Task:
    src: str
    rel: str
    outputs: tuple[tuple[int, str], ...]  # (size px, destination path)
    quality: int
    partial: str  # DST/.partial: temporary files go to <partial>-<worker pid>/


PARTIAL = ".partial"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """Pool worker initializer: the kernel kills this worker when its parent dies (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the pool's own shutdown is all there is
        pass


def check_destination(dst: Path) -> None:
    """SpeedrunError when folder `dst` cannot be made and written to: it, or the nearest existing
    path above it, is a file, on a read-only file system (which binds root too) or not writable."""
    blocker = next((p for p in (dst, *dst.parents) if p.exists()), None)
    if blocker is None:
        return
    if not blocker.is_dir():
        raise SpeedrunError(f"DST {dst}: {blocker} is a file, not a folder")
    if os.statvfs(blocker).f_flag & os.ST_RDONLY:
        raise SpeedrunError(f"DST {dst}: {blocker} is on a read-only file system")
    if not os.access(blocker, os.W_OK | os.X_OK):
        raise SpeedrunError(f"DST {dst}: {blocker} is not writable by this user")


def _remove_dead_partials(dst: Path) -> None:
    """Temporary folders of earlier runs whose process is gone (killed mid-write)."""
    for folder in dst.glob(f"{PARTIAL}-*"):
        pid = folder.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a killed worker nobody has reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _temporary(partial: str, dst: str) -> str:
    """A temporary path for `dst` in this worker's own folder under DST (same file system)."""
    folder = f"{partial}-{os.getpid()}"
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, os.path.basename(dst))


def _atomic_save(img: Image.Image, dst: str, quality: int, partial: str) -> None:
    tmp = _temporary(partial, dst)
    try:
        img.save(tmp, "JPEG", quality=quality)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _atomic_copy(src: str, dst: str, partial: str) -> None:
    tmp = _temporary(partial, dst)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def resize_one(task: _Task) -> tuple[int, int, int, str | None]:
    """Make every missing output of one source image: (resized, copied, skipped, error)."""
    todo = [(n, dst) for n, dst in task.outputs if not os.path.exists(dst)]
    skipped = len(task.outputs) - len(todo)
    if not todo:
        return 0, 0, skipped, None
    resized = copied = 0
    try:
        with open_image(task.src) as img:
            width, height = img.size
            short = min(width, height)
            larger = [n for n, _ in todo if n < short]
            if larger and img.format == "JPEG":
                # Decode once at the coarsest DCT scale that still covers the largest output.
                n_max = max(larger)
                s = next((s for s in (8, 4, 2) if short / s >= n_max), 1)
                if s > 1:
                    img.draft(img.mode, (width // s, height // s))
            if img.mode not in ("RGB", "L"):
                img = img.convert("RGB")  # CMYK, palette, alpha: JPEG wants RGB
            img.load()
            for n, dst in todo:
                if n >= short:
                    _atomic_copy(task.src, dst, task.partial)  # never upscale: keep the original bytes
                    copied += 1
                    continue
                w, h = img.size
                size = (n, max(1, round(h * n / w))) if w <= h else (max(1, round(w * n / h)), n)
                _atomic_save(img.resize(size, Image.Resampling.LANCZOS), dst, task.quality, task.partial)
                resized += 1
    except Exception as e:  # a bad image: reported, never fatal
        return resized, copied, skipped, one_line(e)
    return resized, copied, skipped, None


def _progress(enabled: bool):
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task) -> Text:
            speed = task.finished_speed or task.speed
            return Text(f"{speed:,.0f} images/s" if speed else "- images/s")

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), Rate(),
                    TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), disable=not enabled)


def prepare(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    sizes: list[int],
    quality: int = 90,
    workers: int | None = None,
    progress: bool = True,
) -> PrepareSummary:
    """Write the resized copies of `src` under `dst` (see the module docstring)."""
    src, dst = Path(src), Path(dst)
    if not sizes or not all(COPY_SIDE.holds(n) for n in sizes):
        raise SpeedrunError(f"--sizes must be shorter sides in px, each {COPY_SIDE}, got {sizes}")
    if not QUALITY.holds(quality):
        raise SpeedrunError(f"--quality must be {QUALITY}, got {quality!r}")
    inside = [src.resolve()] + [src.resolve() / s for s in ("train", "val")]
    if any(dst.resolve() == p or p in dst.resolve().parents for p in inside[1:]) or dst.resolve() == inside[0]:
        raise SpeedrunError(f"DST {dst} must not be SRC or inside SRC's train/val folders")
    check_destination(dst)
    if workers is not None and not WORKERS.holds(workers):
        raise SpeedrunError(f"--workers must be {WORKERS}, got {workers!r}")
    workers = workers or os.cpu_count() or 1
    index = load_index(src, workers=workers)
    if dst.is_dir():
        _remove_dead_partials(dst)
    sizes = sorted(set(sizes))

    tasks = []
    for split_name in ("train", "val"):
        for n in sizes:
            for cls in index.classes:
                (dst / str(n) / split_name / cls).mkdir(parents=True, exist_ok=True)
        split = index.split(split_name)
        for i in range(len(split)):
            rel = split.path(i)
            outputs = []
            for n in sizes:
                out = dst / str(n) / rel
                out.parent.mkdir(parents=True, exist_ok=True)  # nested folders inside a class
                outputs.append((n, str(out)))
            tasks.append(_Task(str(src / rel), rel, tuple(outputs), quality, str(dst / PARTIAL)))

    summary = PrepareSummary(workers=workers)
    summary.bad = [(b.path, b.reason) for b in index.bad]
    start = time.perf_counter()
    with _progress(progress) as bar:
        job = bar.add_task(f"resizing to {', '.join(map(str, sizes))} px", total=len(tasks))
        with ProcessPoolExecutor(workers, initializer=_die_with_parent) as pool:
            for task, (resized, copied, skipped, error) in zip(tasks, pool.map(resize_one, tasks, chunksize=32)):
                summary.images += 1
                summary.resized += resized
                summary.copied += copied
                summary.skipped += skipped
                if error:
                    summary.bad.append((task.rel, error))
                bar.advance(job)
    summary.seconds = time.perf_counter() - start
    _remove_dead_partials(dst)  # the pool's workers have ended: their (empty) folders go

    dst.mkdir(parents=True, exist_ok=True)
    with open(dst / REPORT_NAME, "w") as f:
        f.write("path\treason\n")
        for rel, reason in summary.bad:
            f.write(f"{rel}\t{reason}\n")
    for n in sizes:
        # Index each copy now, with the full tree's classes, so training starts straight away.
        load_index(dst / str(n), workers=workers, classes=index.classes)
    return summary
