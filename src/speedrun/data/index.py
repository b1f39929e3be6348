"""The index of an image-folder tree: every image's relative path, label, width and height.

Layout (ImageNet's): ``ROOT/train/<class>/**/<image>`` and ``ROOT/val/<class>/**/<image>``.
Classes are the sub-folders of ``train`` in sorted order (label = position); a ``val`` class
that ``train`` lacks is an error. Images may sit in nested folders under their class folder.
Symlinks (to folders or files) are followed where they stay inside their class folder or leave
the tree; one that leads to another class or the other split is reported and not used, so no
image is ever labelled twice or crosses from val/ into train/. A folder or file reached twice
(a loop, two links to one place, hard links) is used once and the repeat reported.

Building the index reads only each image's header (a few hundred bytes), in parallel on all
cores, with a progress bar. The index is cached as ``ROOT/.speedrun-index.npz`` or, when ROOT is
not writable, under ``$XDG_CACHE_HOME/speedrun/index/`` (default ``~/.cache``); see
`data.index_cache` for the format. A later load is trusted by folder: it stats and lists the
folders, not the files, and reads again only the folders whose mtime or entry count changed
(`data.index_walk` says what that misses; ``verify=True`` stats every file). Files that are
not images (by extension) are ignored; files that look like images but cannot be used (zero
bytes, not an image, dangling symlink, not a regular file, unreadable) are listed in
``Index.bad`` with a reason and left out.

In a job of many processes, `load_index_once` has one process (rank 0) build or check the
index while the others wait, then read what it wrote: a start on shared storage costs one walk.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from speedrun.data.index_cache import (CACHE_NAME, INDEX_VERSION, Table, cache_path, decode, empty_table, locked,
                                        read_cache, write_cache)
from speedrun.data.index_walk import IMAGE_EXTENSIONS, Checked, Unreadable, Walk, read_header
from speedrun.errors import SpeedrunError

__all__ = ["CACHE_NAME", "IMAGE_EXTENSIONS", "INDEX_VERSION", "SPLITS", "BadFile", "Checked", "Index", "JobShare",
           "Seen", "Split", "Unreadable", "cache_path", "load_index", "load_index_once", "read_header"]

log = logging.getLogger("speedrun.data")

SPLITS = ("train", "val")


@dataclass(frozen=True)
class BadFile:
    """An image file that cannot be used, and why (one line)."""

    path: str  # relative to the tree's root
    reason: str


@dataclass
class Split:
    """One split of the tree as parallel arrays (row i is one image)."""

    paths: np.ndarray  # bytes (os.fsencode of the path relative to the root), dtype S
    labels: np.ndarray  # int64, index into Index.classes
    widths: np.ndarray  # int32, pixels
    heights: np.ndarray  # int32, pixels

    def __len__(self) -> int:
        return len(self.paths)

    def path(self, i: int) -> str:
        return os.fsdecode(self.paths[i])

    def subset(self, rows: np.ndarray) -> Split:
        return Split(self.paths[rows], self.labels[rows], self.widths[rows], self.heights[rows])


@dataclass
class Index:
    """The whole tree: classes (from train), the two splits, and the files left out."""

    root: Path
    classes: list[str]
    train: Split
    val: Split
    bad: list[BadFile]
    empty_classes: list[str]  # train class folders with no usable image
    checked: Checked = field(default_factory=Checked)  # what the load that made it did
    token: int = 0  # the cache's token (see `data.index_cache.Table`)

    def split(self, name: str) -> Split:
        return {"train": self.train, "val": self.val}[name]

    def seen(self) -> Seen:
        """What this process saw, for the other processes of its job to compare theirs with."""
        return Seen(self.token, self.checked.class_folders, len(self.train) + len(self.val))




@dataclass(frozen=True)
class Seen:
    """The index one process of a job checked: its cache's token, and counts another node's view
    of the tree must match."""

    token: int
    class_folders: int  # train's and val's
    images: int  # train + val


class JobShare(Protocol):
    """The processes of one job, as the index needs them (`dist.JobShare` over torch.distributed).
    Every process calls `share` and `gather` at the same points, in the same order."""

    leader: bool  # this process checks the index; the others wait for it
    where: str  # this process in messages ("host gpu-2, rank 9")

    def share(self, value: Any) -> Any:
        """The leader's `value`, in every process."""

    def gather(self, value: Any) -> list[Any]:
        """Every process's `value`, in rank order, in every process."""


# ---------------------------------------------------------------------------------------------


def _class_folders(root: Path, split: str) -> list[str]:
    folder = root / split
    try:
        return sorted(e.name for e in os.scandir(folder)
                      if e.is_dir(follow_symlinks=True) and not e.name.startswith("."))
    except OSError as e:
        raise SpeedrunError(f"cannot list {folder}: {e.strerror or e}") from None


def _check_layout(root: Path) -> None:
    if not root.is_dir():
        raise SpeedrunError(f"data folder {str(root)!r} does not exist or is not a folder")
    missing = [s for s in SPLITS if not (root / s).is_dir()]
    if missing:
        raise SpeedrunError(
            f"{root} is not an image-folder tree: no {' or '.join(missing)} folder "
            f"(expected {root}/train/<class>/<image> and {root}/val/<class>/<image>)"
        )


def _class_lists(root: Path, classes: list[str] | None) -> tuple[list[str], list[str], list[str]]:
    """(train's class folders, val's, the class list labels index): checked against each other."""
    _check_layout(root)
    train_classes = _class_folders(root, "train")
    val_classes = _class_folders(root, "val")
    if classes is None:
        classes = train_classes
        if not classes:
            raise SpeedrunError(f"{root}/train has no class folders")
    unknown = sorted(set(val_classes) - set(classes))
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise SpeedrunError(f"{root}/val has class folders that train lacks: {shown}")
    extra = sorted(set(train_classes) - set(classes))
    if extra:
        raise SpeedrunError(f"{root}/train has class folders the full-size tree lacks: {', '.join(extra[:5])}")
    return train_classes, val_classes, list(classes)


def load_index(root: str | os.PathLike, workers: int | None = None, classes: list[str] | None = None,
               verify: bool = False) -> Index:
    """The index of the tree at `root`, from the cache where the tree's folders have not changed.

    `classes` fixes the class list (used for resized copies, whose labels must match the full
    tree's); by default it is the sorted list of train's class folders. `workers` processes read
    headers (default: all cores). `verify`: stat every file rather than trusting unchanged
    folders (sees a file rewritten in place under the same name). Processes loading one tree at
    once take a file lock: the first builds, the others then find the cache fresh.
    """
    # Absolute: the walk cuts each file's path after root's, and "." is not a prefix of "train/x".
    root = Path(os.path.abspath(root))
    train_classes, val_classes, classes = _class_lists(root, classes)
    cache = cache_path(root)
    with locked(cache):
        old = read_cache(cache)
        written_ns = os.stat(cache).st_mtime_ns if old is not None else 0
        walk = Walk(root, old or empty_table(), verify, written_ns, workers or os.cpu_count() or 1)
        table, checked = walk.run([(0, c) for c in train_classes] + [(1, c) for c in val_classes])
        checked.class_folders = len(train_classes) + len(val_classes)
        if old is None or checked.racy or not _same(table, old, checked):
            table = write_cache(cache, table)
            checked.written = True
        else:
            table.token = old.token
    return _assemble(root, table, classes, checked)


def _same(new: Table, old: Table, checked: Checked) -> bool:
    """Whether the walk found what the cache holds (then it is not written again)."""
    if len(new.folder_files) != len(old.folder_files) or len(new.paths) != len(old.paths):
        return False
    if checked.rescanned == 0:  # every row was copied from `old`, in its order
        names = ("bad_folders", "bad_paths", "bad_reasons")
    else:
        names = [n for n in Table.__dataclass_fields__ if n != "token"]
    return all(np.array_equal(getattr(new, n), getattr(old, n)) for n in names)


def _assemble(root: Path, table: Table, classes: list[str], checked: Checked) -> Index:
    """The Index (arrays per split) from a table, with the same checks for every way it was loaded."""
    label_of = {c: i for i, c in enumerate(classes)}
    folder_labels = np.array([label_of.get(decode(c), -1) for c in table.folder_classes.tolist()], dtype=np.int64)
    owner = table.file_owners()
    labels = folder_labels[owner]
    file_splits = table.folder_splits[owner]
    usable = (table.widths > 0) & (labels >= 0)
    splits = {}
    for code, name in enumerate(SPLITS):
        rows = np.flatnonzero(usable & (file_splits == code))
        if len(rows) and rows[-1] - rows[0] == len(rows) - 1:
            rows = slice(rows[0], rows[-1] + 1)  # a run of rows (train's come first): views, not copies
        splits[name] = Split(table.paths[rows], labels[rows], table.widths[rows], table.heights[rows])
    bad = [BadFile(decode(p), decode(r)) for p, r in zip(table.bad_paths.tolist(), table.bad_reasons.tolist())]
    counts = np.bincount(splits["train"].labels, minlength=len(classes))
    empty = [c for c, n in zip(classes, counts) if n == 0]
    if len(splits["train"]) == 0:
        raise SpeedrunError(f"{root}/train has no usable images ({len(bad)} unusable files)")
    if len(splits["val"]) == 0:
        raise SpeedrunError(f"{root}/val has no usable images ({len(bad)} unusable files)")
    for b in bad:
        log.warning("skipping %s: %s", root / b.path, b.reason)
    if empty:
        log.warning("%d class folder(s) in %s/train have no usable images: %s", len(empty), root, ", ".join(empty[:5]))
    return Index(root, classes, splits["train"], splits["val"], bad, empty, checked, table.token)


def load_seen_index(root: str | os.PathLike, seen: Seen, workers: int | None = None,
                    classes: list[str] | None = None) -> Index:
    """The index another process of this job has just checked (`seen`), read from its cache
    without walking the tree; where this node has its own copy of the tree (another cache), that
    copy is checked here. A tree other than the one `seen` describes is an error."""
    root = Path(os.path.abspath(root))
    train_classes, val_classes, classes = _class_lists(root, classes)
    mine = len(train_classes) + len(val_classes)
    where = "same tree (one shared file system, or identical copies at the same path)"
    if mine != seen.class_folders:
        raise SpeedrunError(f"{root} has {mine} class folders here but {seen.class_folders} on rank 0: "
                            f"every node must see the {where}")
    table = read_cache(cache_path(root))
    if table is not None and table.token == seen.token:
        index = _assemble(root, table, classes, Checked(class_folders=mine))
    else:
        index = load_index(root, workers, classes)
    images = len(index.train) + len(index.val)
    if images != seen.images:
        raise SpeedrunError(f"{root} has {images} usable images here but {seen.images} on rank 0: "
                            f"every node must see the {where}")
    return index


def load_index_once(root: str | os.PathLike, job: JobShare | None, workers: int | None = None,
                    classes: list[str] | None = None, verify: bool = False) -> Index:
    """`load_index` for a job: the leader builds or checks the index while the others wait, then
    they read it (`load_seen_index`). Every process ends with the same index, or every process
    raises the same error: the leader's, or the first process whose tree differs."""
    if job is None:
        return load_index(root, workers, classes, verify)
    problem = None
    if job.leader:
        try:
            index = load_index(root, workers, classes, verify)
        except SpeedrunError as e:
            job.share(str(e))
            raise
        job.share(index.seen())
    else:
        seen = job.share(None)
        if isinstance(seen, str):
            raise SpeedrunError(seen)
        try:
            index = load_seen_index(root, seen, workers, classes)
        except SpeedrunError as e:
            problem = f"{job.where}: {e}"
    problems = [p for p in job.gather(problem) if p]
    if problems:
        raise SpeedrunError(problems[0] + (f" (and {len(problems) - 1} more processes)" if len(problems) > 1 else ""))
    return index
