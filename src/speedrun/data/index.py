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
not writable, under ``$XDG_CACHE_HOME/speedrun/index/`` (default ``~/.cache``). Each load walks
the tree and compares every file's size and mtime (ns) with the cache: a changed tree re-reads
only the headers of new or changed files. Files that are not images (by extension) are ignored;
files that look like images but cannot be used (zero bytes, not an image, dangling symlink, not a
regular file, unreadable) are listed in ``Index.bad`` with a reason and left out.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import stat
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from speedrun import files
from speedrun.errors import SpeedrunError, one_line

log = logging.getLogger("speedrun.data")

SPLITS = ("train", "val")
# torchvision's ImageFolder extensions; anything else in the tree is not an image.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
CACHE_NAME = ".speedrun-index.npz"
INDEX_VERSION = 1


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

    def split(self, name: str) -> Split:
        return {"train": self.train, "val": self.val}[name]


@dataclass(frozen=True, slots=True)
class _Entry:
    """One file found by the walk: where it is and what stat said."""

    rel: str
    split: str
    cls: str
    size: int  # bytes
    mtime_ns: int


# ---------------------------------------------------------------------------------------------
# Walking the tree


def _is_image_name(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


class _Walk:
    """What one index walk has already seen, across every class of both splits: a folder or a
    file reached twice (through symlinks or hard links) is used once, never under two labels."""

    def __init__(self, root: Path):
        self.root = root
        self.root_real = root.resolve()
        self.folders: set[tuple[int, int]] = set()  # (st_dev, st_ino)
        self.files: dict[tuple[int, int], str] = {}  # (st_dev, st_ino) -> the path it was first indexed as
        self.bad: list[BadFile] = []

    def escapes(self, path: str, home: Path) -> Path | None:
        """Where the link at `path` really leads, when that is inside the tree but outside
        `home` (the real path of its class folder): another class, or the other split. Links to
        places outside the tree are fine (and deduplicated); None when the link may be used."""
        target = Path(os.path.realpath(path))
        if target.is_relative_to(self.root_real) and not target.is_relative_to(home):
            return target
        return None


def _walk_class(walk: _Walk, split: str, cls: str) -> Iterator[_Entry]:
    """Every image-named file under ``root/split/cls``, following symlinks only where they stay in
    the class (or leave the tree), each folder and file once."""
    root, bad = walk.root, walk.bad
    top = root / split / cls
    # String slicing, not Path.relative_to: this runs once per file (1.3M times for ImageNet).
    cut = len(str(root)) + 1
    if top.is_symlink() and walk.escapes(str(top), walk.root_real / split) is not None:
        bad.append(BadFile(str(top)[cut:],
                           f"class folder links to {os.path.realpath(top)}, outside {split}/: not used"))
        return
    home = top.resolve()
    stack = [top]
    while stack:
        folder = stack.pop()
        rel_folder = str(folder)[cut:]
        try:
            st = folder.stat()
            key = (st.st_dev, st.st_ino)
            if key in walk.folders:
                bad.append(BadFile(rel_folder,
                                   "folder reached a second time through a symlink: its images are used once"))
                continue
            walk.folders.add(key)
            # Real files before links, so that a file reached both ways is reported as the link.
            entries = sorted(os.scandir(folder), key=lambda e: (e.is_symlink(), e.name))
        except OSError as e:
            bad.append(BadFile(rel_folder, f"cannot list folder: {e.strerror or e}"))
            continue
        subfolders = []
        for entry in entries:
            rel = entry.path[cut:]
            try:
                is_dir = entry.is_dir(follow_symlinks=True)
            except OSError as e:  # e.g. a symlink loop (ELOOP)
                if _is_image_name(entry.name):
                    bad.append(BadFile(rel, f"cannot stat: {e.strerror or e}"))
                continue
            if not is_dir and not _is_image_name(entry.name):
                continue  # README, .DS_Store, labels files: not images, silently ignored
            if entry.is_symlink():
                target = walk.escapes(entry.path, home)
                if target is not None:
                    what = "folder" if is_dir else "file"
                    bad.append(BadFile(rel,
                                       f"{what} symlink to {target} leaves its class folder {split}/{cls}: not used"))
                    continue
            if is_dir:
                subfolders.append(Path(entry.path))
                continue
            try:
                st = entry.stat(follow_symlinks=True)
            except OSError as e:
                bad.append(BadFile(rel, f"cannot stat (dangling symlink?): {e.strerror or e}"))
                continue
            if not stat.S_ISREG(st.st_mode):
                # A FIFO or device named like an image would block or never end when read.
                bad.append(BadFile(rel, "not a regular file"))
                continue
            if st.st_size == 0:
                bad.append(BadFile(rel, "zero bytes"))
                continue
            first = walk.files.setdefault((st.st_dev, st.st_ino), rel)
            if first != rel:
                bad.append(BadFile(rel, f"the same file as {first} (a link): used once"))
                continue
            yield _Entry(rel, split, cls, st.st_size, st.st_mtime_ns)
        stack.extend(reversed(subfolders))  # depth-first, in name order


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


# ---------------------------------------------------------------------------------------------
# Reading headers


@dataclass(frozen=True)
class Unreadable:
    """Why a file could not be read as an image. `transient`: the system refused to read it
    (permissions, I/O error, gone), which may pass; it is not remembered in the cache. Otherwise
    the file's content is not a usable image, remembered until the file changes."""

    reason: str
    transient: bool = False


def read_header(path: str) -> tuple[int, int] | Unreadable:
    """(width, height) in pixels from an image's header, or why it is unusable."""
    from speedrun.data.transforms import open_image

    try:
        with open_image(path) as img:
            width, height = img.size
    except Exception as e:  # any decoder error means: not a usable image
        # PIL's "cannot identify image file" is an OSError too, but without an errno.
        transient = isinstance(e, OSError) and e.errno is not None
        return Unreadable(one_line(e), transient)
    if width <= 0 or height <= 0:
        return Unreadable(f"bad size {width}x{height}")
    return width, height


def _read_headers(paths: list[str]) -> list[tuple[int, int] | Unreadable]:
    return [read_header(p) for p in paths]


def _header_pool_map(paths: list[str], workers: int, progress_label: str) -> list[tuple[int, int] | Unreadable]:
    """read_header over many files on `workers` processes, with a rich progress bar."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    if not paths:
        return []
    chunk = 512
    chunks = [paths[i : i + chunk] for i in range(0, len(paths), chunk)]
    results: list[list] = [None] * len(chunks)  # type: ignore[list-item]
    columns = (TextColumn(progress_label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=True, disable=len(paths) < 2000) as progress:
        task = progress.add_task("headers", total=len(paths))
        if workers <= 1 or len(chunks) == 1:
            for i, c in enumerate(chunks):
                results[i] = _read_headers(c)
                progress.advance(task, len(c))
        else:
            with ProcessPoolExecutor(workers) as pool:
                for i, result in enumerate(pool.map(_read_headers, chunks)):
                    results[i] = result
                    progress.advance(task, len(chunks[i]))
    return [r for rs in results for r in rs]


# ---------------------------------------------------------------------------------------------
# The cache


def cache_path(root: Path) -> Path:
    """Where the index of `root` is cached: beside the data when writable, else in the cache dir."""
    root = root.resolve()
    if os.access(root, os.W_OK):
        return root / CACHE_NAME
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "speedrun" / "index"
    digest = hashlib.sha1(os.fsencode(root)).hexdigest()[:16]
    return base / f"{root.name}-{digest}.npz"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock beside `path`, so that N ranks starting together build the index once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _load_cache(path: Path) -> dict[str, tuple[int, int, int, int]]:
    """rel path -> (size, mtime_ns, width, height) from a cache file, or {} when absent/stale."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if int(z["version"]) != INDEX_VERSION:
                return {}
            paths = [os.fsdecode(p) for p in z["paths"]]
            rows = zip(z["sizes"].tolist(), z["mtimes"].tolist(), z["widths"].tolist(), z["heights"].tolist())
            return dict(zip(paths, rows))
    except FileNotFoundError:
        return {}
    except Exception as e:  # a damaged cache is rebuilt, never trusted
        log.warning("index cache %s unreadable (%s); rebuilding", path, e)
        return {}


def _save_cache(path: Path, rows: dict[str, tuple[int, int, int, int]]) -> None:
    """Atomic write: a crash leaves the old cache or the new one, never half of one."""
    keys = sorted(rows)
    values = np.array([rows[k] for k in keys], dtype=np.int64).reshape(-1, 4)
    try:
        with files.replacing(path, suffix=".tmp.npz") as tmp:  # .npz: numpy adds it otherwise
            np.savez(
                tmp,
                version=np.int64(INDEX_VERSION),
                paths=np.array([os.fsencode(k) for k in keys], dtype=np.bytes_),
                sizes=values[:, 0],
                mtimes=values[:, 1],
                widths=values[:, 2],
                heights=values[:, 3],
            )
    except OSError as e:
        log.warning("could not write index cache %s: %s", path, e)


# ---------------------------------------------------------------------------------------------
# Building


def load_index(root: str | os.PathLike, workers: int | None = None, classes: list[str] | None = None) -> Index:
    """The index of the tree at `root`, from the cache when the tree has not changed.

    `classes` fixes the class list (used for resized copies, whose labels must match the full
    tree's); by default it is the sorted list of train's class folders. `workers` processes read
    headers (default: all cores).
    """
    # Absolute: the walk cuts each file's path after root's, and "." is not a prefix of "train/x".
    root = Path(os.path.abspath(root))
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

    walk = _Walk(root)
    entries = [
        e
        for split, names in (("train", train_classes), ("val", val_classes))
        for cls in names
        for e in _walk_class(walk, split, cls)
    ]
    bad = walk.bad

    cache = cache_path(root)
    with _locked(cache):
        cached = _load_cache(cache)
        todo = [e for e in entries if cached.get(e.rel, (None, None))[:2] != (e.size, e.mtime_ns)]
        if todo:
            if cached:
                log.info("index of %s: %d new or changed files", root, len(todo))
            headers = _header_pool_map(
                [str(root / e.rel) for e in todo], workers or os.cpu_count() or 1, f"indexing {root.name}"
            )
            fresh = {e.rel: h for e, h in zip(todo, headers)}
        else:
            fresh = {}
        rows: dict[str, tuple[int, int, int, int]] = {}
        good: list[tuple[_Entry, int, int]] = []
        for e in entries:
            if e.rel in fresh:
                h = fresh[e.rel]
                if isinstance(h, Unreadable):
                    bad.append(BadFile(e.rel, h.reason))
                    if not h.transient:
                        # Remember bad files too (width 0) so an unchanged bad file is not re-read.
                        rows[e.rel] = (e.size, e.mtime_ns, 0, 0)
                    continue
                w, hgt = h
            else:
                w, hgt = cached[e.rel][2:]
                if w == 0:
                    bad.append(BadFile(e.rel, "not a readable image (cached)"))
                    rows[e.rel] = (e.size, e.mtime_ns, 0, 0)
                    continue
            rows[e.rel] = (e.size, e.mtime_ns, w, hgt)
            good.append((e, w, hgt))
        if todo or set(rows) != set(cached):
            _save_cache(cache, rows)

    label_of = {c: i for i, c in enumerate(classes)}
    splits = {}
    for split in SPLITS:
        mine = [(e, w, h) for e, w, h in good if e.split == split]
        splits[split] = Split(
            paths=np.array([os.fsencode(e.rel) for e, _, _ in mine], dtype=np.bytes_).reshape(-1),
            labels=np.array([label_of[e.cls] for e, _, _ in mine], dtype=np.int64).reshape(-1),
            widths=np.array([w for _, w, _ in mine], dtype=np.int32).reshape(-1),
            heights=np.array([h for _, _, h in mine], dtype=np.int32).reshape(-1),
        )
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
    return Index(root, list(classes), splits["train"], splits["val"], bad, empty)
