"""Walking an image-folder tree against its cached table: what a load costs.

A load stats and lists every folder (about 2,000 for ImageNet) and trusts a folder whose
modification time and number of entries are what the cache recorded: its file rows are taken as
stored, with no call per file. Adding, removing or renaming a file changes its folder's mtime, so
such a folder is listed again: its files are stat'ed, and only new or changed files (size or
mtime) have their headers read. A folder changed within `RACY_NS` of the cache's own write is
not trusted (the file system's clock may not have ticked between the two), as git does with its
index; nor is one where something could not be read, so a passing error is retried. What this
misses: a file rewritten in place under the same name, which changes the file's mtime but not
its folder's; `verify=True` stats every file and sees it.

Building streams: each folder's rows become arrays as soon as it is listed, header reads run on
a process pool with a bounded queue, and the table is one concatenation at the end, so memory
peaks at about twice the finished table, plus the pool's queue.

Symlinks are followed where they stay inside their class folder or leave the tree; one that
leads to another class or the other split is reported and not used. A folder reached twice is
used once; so is a file (hard links or links to one file: the first in walk order is kept).
"""
from __future__ import annotations

import dataclasses
import os
import stat
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from speedrun.data.index_cache import UNTRUSTED, Table, bad_columns, decode, empty_table, encode, owners
from speedrun.errors import one_line

# torchvision's ImageFolder extensions; anything else in the tree is not an image.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
RACY_NS = 2_000_000_000  # 2 s: coarser than any file system's mtime granularity we know of but FAT's
HEADER_CHUNK = 512  # files per header-reading task
POOL_AFTER = 2 * HEADER_CHUNK  # headers read in this process before a pool of workers starts
DROP = -1  # a width that marks a row to leave out of the table (a passing read error, a repeat)


@dataclass
class Checked:
    """What one load did: the figures `speedrun data index` prints, and tests read."""

    folders: int = 0  # folders stat'ed and listed
    rescanned: int = 0  # of those, folders whose files were stat'ed (new, changed, or verify)
    files_statted: int = 0
    racy: int = 0  # of those, unchanged folders not trusted: changed just before the cache was written
    headers: int = 0  # image headers read
    written: bool = False  # the cache was (re)written
    class_folders: int = 0  # in train/ and val/


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


class _HeaderReader:
    """read_header over chunks of files as the walk finds them: on `workers` processes with at
    most a few chunks per process queued (memory stays flat however big the tree), or in this
    process for one worker or the first `POOL_AFTER` files. A progress bar appears once there are
    thousands to read."""

    def __init__(self, workers: int, label: str):
        self.workers, self.label = workers, label
        self.pool: ProcessPoolExecutor | None = None
        self.queue: deque[tuple[Future, Callable]] = deque()
        self.submitted = self.done = 0
        self.progress = self.task = None

    def submit(self, paths: list[str], take: Callable[[list[tuple[int, int] | Unreadable]], None]) -> None:
        self.submitted += len(paths)
        # A few changed files are read here: starting processes would cost more than the reads.
        if self.workers <= 1 or (self.pool is None and self.submitted <= POOL_AFTER):
            take(_read_headers(paths))
            self._advance(len(paths))
            return
        if self.pool is None:
            self.pool = ProcessPoolExecutor(self.workers)
        self.queue.append((self.pool.submit(_read_headers, paths), take))
        while len(self.queue) > 4 * self.workers:
            self._take_oldest()

    def _take_oldest(self) -> None:
        future, take = self.queue.popleft()
        result = future.result()
        take(result)
        self._advance(len(result))

    def _advance(self, n: int) -> None:
        self.done += n
        if self.progress is None and self.submitted >= 2000:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.progress = Progress(TextColumn(self.label), BarColumn(), MofNCompleteColumn(), transient=True)
            self.progress.start()
            self.task = self.progress.add_task("headers", total=None)
        if self.progress is not None:
            self.progress.update(self.task, completed=self.done, total=self.submitted)

    def finish(self) -> None:
        try:
            while self.queue:
                self._take_oldest()
        finally:
            if self.pool is not None:
                self.pool.shutdown(cancel_futures=True)
            if self.progress is not None:
                self.progress.stop()


def _is_image_name(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


@dataclass
class _Rows:
    """The new table, appended folder by folder: lists of arrays (views into the old table for
    trusted folders), concatenated once at the end."""

    folders: dict[str, list] = field(default_factory=lambda: {k: [] for k in (
        "folder_paths", "folder_splits", "folder_classes", "folder_parents", "folder_mtimes", "folder_counts",
        "folder_files")})
    files: dict[str, list] = field(default_factory=lambda: {k: [] for k in (
        "paths", "sizes", "mtimes", "widths", "heights", "devs", "inos")})
    # Per folder, per row: a new row that is a symlink or one of several hard links, so it may be
    # a file the tree holds twice (no other row can be: a folder is walked once).
    linked: list[np.ndarray] = field(default_factory=list)
    bad: list[tuple[int, bytes, bytes]] = field(default_factory=list)  # (folder row, path, reason)

    def folder(self, rel: str, split: int, cls: str, parent: int, mtime: int, count: int, nfiles: int) -> int:
        f = self.folders
        for key, value in (("folder_paths", encode(rel)), ("folder_splits", split), ("folder_classes", encode(cls)),
                           ("folder_parents", parent), ("folder_mtimes", mtime), ("folder_counts", count),
                           ("folder_files", nfiles)):
            f[key].append(value)
        return len(f["folder_paths"]) - 1

    def add_files(self, arrays: dict[str, np.ndarray], linked: np.ndarray | None = None) -> None:
        for key, value in arrays.items():
            self.files[key].append(value)
        self.linked.append(np.zeros(len(arrays["paths"]), bool) if linked is None else linked)

    def add_bad(self, row: int, path: str | bytes, reason: str | bytes) -> None:
        self.bad.append((row, path if isinstance(path, bytes) else encode(path),
                         reason if isinstance(reason, bytes) else encode(reason)))

    def table(self, files_of: Table | None = None) -> tuple[Table, np.ndarray]:
        """The finished table (rows marked DROP left out) and, per kept row, whether it is linked.
        `files_of`: a table whose file rows are these rows, in this order (a load that trusted
        every folder of the cache): its arrays are used as they are, not copied."""
        if files_of is not None:
            self.files = {k: [getattr(files_of, k)] for k in self.files}
            self.linked = [np.zeros(len(files_of.paths), bool)]
        base = empty_table()
        # np.bytes_ with no width: each array as wide as its longest path.
        folders = {k: np.array(v, dtype=np.bytes_ if getattr(base, k).dtype.kind == "S" else getattr(base, k).dtype)
                   if v else getattr(base, k) for k, v in self.folders.items()}
        files = {}
        for k, parts in self.files.items():
            files[k] = (parts[0] if len(parts) == 1 else np.concatenate(parts)) if parts else getattr(base, k)
            parts.clear()  # one column's parts at a time beside the whole: the peak stays near 2x
        linked = np.concatenate(self.linked) if self.linked else np.zeros(0, bool)
        self.linked.clear()
        keep = files["widths"] != DROP
        if not keep.all():
            owner = owners(folders["folder_files"])
            folders["folder_files"] = np.bincount(owner[keep], minlength=len(folders["folder_files"])).astype(np.int64)
            files = {k: v[keep] for k, v in files.items()}
            linked = linked[keep]
        bad = sorted(self.bad, key=lambda b: b[0])  # stable: walk order within a folder
        return Table(**folders, **files, **bad_columns(bad)), linked


class _Home:
    """A class folder's real path, resolved only when a link inside it must be checked against
    it (resolving costs a stat per path component)."""

    def __init__(self, top: Path):
        self.top, self._real = top, None

    def real(self) -> Path:
        if self._real is None:
            self._real = self.top.resolve()
        return self._real


class Walk:
    """One load's walk of the tree at `root` against `old` (the cached table; an empty one to
    build from nothing). `verify`: stat every file, trusting no folder. `cache_mtime_ns`: when the
    cache was written (folders changed since just before it are not trusted)."""

    def __init__(self, root: Path, old: Table, verify: bool, cache_mtime_ns: int, workers: int):
        self.root, self.old, self.verify = root, old, verify
        self.root_real = root.resolve()
        self.cut = len(str(root)) + 1  # string slicing, not Path.relative_to: it runs per file
        self.racy_after = cache_mtime_ns - RACY_NS
        self.old_rows = {p: i for i, p in enumerate(old.folder_paths.tolist())}
        self.old_children: dict[int, list[int]] = {}
        for i, parent in enumerate(old.folder_parents.tolist()):
            self.old_children.setdefault(parent, []).append(i)
        self.old_starts = old.file_starts()
        self.old_bad: dict[int, list[int]] = {}  # folder row -> its rows in old.bad_*
        for i, folder in enumerate(old.bad_folders.tolist()):
            self.old_bad.setdefault(folder, []).append(i)
        self.next_old = 0  # the cache's folder row a load that changes nothing takes next
        self.unchanged = True  # so far every folder was the cache's next one, trusted
        self.seen_folders: set[tuple[int, int]] = set()  # (st_dev, st_ino)
        self.linked: set[tuple[int, str]] = set()  # (split, name) of class folders that are symlinks
        self.rows = _Rows()
        self.checked = Checked()
        self.headers = _HeaderReader(workers, f"indexing {root.name}")

    def run(self, classes: list[tuple[int, str]]) -> tuple[Table, Checked]:
        """Walk the class folders given as (split number, class name), in order; the new table."""
        # Which class folders are links, from the listings' entry types: no stat per class.
        self.linked = {(split, e.name) for split, name in enumerate(("train", "val"))
                       for e in os.scandir(self.root / name) if e.is_symlink()}
        try:
            for split, cls in classes:
                self._walk_class(split, cls)
        finally:
            self.headers.finish()
        self.checked.headers = self.headers.done
        unchanged = self.unchanged and self.next_old == len(self.old.folder_files)
        table, linked = self.rows.table(self.old if unchanged else None)
        return _use_each_file_once(table, linked), self.checked

    def _escapes(self, path: str, home: Path) -> Path | None:
        """Where the link at `path` leads, when that is inside the tree but outside `home` (the
        real path of its class folder); None when it may be used."""
        target = Path(os.path.realpath(path))
        if target.is_relative_to(self.root_real) and not target.is_relative_to(home):
            return target
        return None

    def _walk_class(self, split: int, cls: str) -> None:
        split_name = ("train", "val")[split]
        top = self.root / split_name / cls
        if (split, cls) in self.linked and self._escapes(str(top), self.root_real / split_name) is not None:
            self.rows.add_bad(-1, str(top)[self.cut:],
                              f"class folder links to {os.path.realpath(top)}, outside {split_name}/: not used")
            return
        home = _Home(top)
        stack: list[tuple[str, int, int | None]] = [(str(top), -1, self.old_rows.get(encode(str(top)[self.cut:])))]
        while stack:
            folder, parent, old_row = stack.pop()
            stack.extend(reversed(self._folder(folder, split, cls, home, parent, old_row)))

    def _folder(self, folder: str, split: int, cls: str, home: _Home, parent: int,
                old_row: int | None) -> list[tuple[str, int, int | None]]:
        """Add one folder's rows; its sub-folders to walk next, in name order."""
        rel = folder[self.cut:]
        self.unchanged = self.unchanged and old_row == self.next_old
        self.next_old = -1 if old_row is None else old_row + 1
        try:
            st = os.stat(folder)
            if (st.st_dev, st.st_ino) in self.seen_folders:
                self.unchanged = False
                row = self.rows.folder(rel, split, cls, parent, UNTRUSTED, 0, 0)
                self.rows.add_bad(row, rel, "folder reached a second time through a symlink: its images are used once")
                return []
            self.seen_folders.add((st.st_dev, st.st_ino))
            count = len(os.listdir(folder))
        except OSError as e:
            self.unchanged = False
            row = self.rows.folder(rel, split, cls, parent, UNTRUSTED, 0, 0)
            self.rows.add_bad(row, rel, f"cannot list folder: {e.strerror or e}")
            return []
        self.checked.folders += 1
        old = self.old
        if (not self.verify and old_row is not None and int(old.folder_mtimes[old_row]) == st.st_mtime_ns
                and int(old.folder_counts[old_row]) == count):
            if st.st_mtime_ns < self.racy_after:
                return self._trusted(rel, split, cls, parent, old_row)
            self.checked.racy += 1
        return self._rescan(folder, rel, split, cls, home, parent, old_row, st.st_mtime_ns, count)

    def _trusted(self, rel: str, split: int, cls: str, parent: int, old_row: int) -> list[tuple[str, int, int | None]]:
        old = self.old
        start, n = int(self.old_starts[old_row]), int(old.folder_files[old_row])
        row = self.rows.folder(rel, split, cls, parent, int(old.folder_mtimes[old_row]),
                               int(old.folder_counts[old_row]), n)
        self.rows.add_files({k: getattr(old, k)[start:start + n] for k in self.rows.files})
        for i in self.old_bad.get(old_row, []):
            self.rows.add_bad(row, bytes(old.bad_paths[i]), bytes(old.bad_reasons[i]))
        root = str(self.root)
        return [(f"{root}/{decode(old.folder_paths[c])}", row, c) for c in self.old_children.get(old_row, [])]

    def _rescan(self, folder: str, rel: str, split: int, cls: str, home: _Home, parent: int, old_row: int | None,
                mtime: int, count: int) -> list[tuple[str, int, int | None]]:
        """List the folder's entries and stat its files; read headers of the new or changed."""
        self.checked.rescanned += 1
        self.unchanged = False
        old, cut = self.old, self.cut
        known: dict[bytes, int] = {}  # path -> old file row, for this folder's unchanged files
        old_reasons: dict[bytes, bytes] = {}
        if old_row is not None:
            start = int(self.old_starts[old_row])
            mine = old.paths[start:start + int(old.folder_files[old_row])]
            known = {p: start + i for i, p in enumerate(mine.tolist())}
            old_reasons = {bytes(old.bad_paths[i]): bytes(old.bad_reasons[i]) for i in self.old_bad.get(old_row, [])}
        trusted = True  # False: something could not be read, so list the folder again next time
        row = self.rows.folder(rel, split, cls, parent, mtime, count, 0)
        try:
            # Real files before links, so that a file reached both ways is reported as the link.
            entries = sorted(os.scandir(folder), key=lambda e: (e.is_symlink(), e.name))
        except OSError as e:
            self.rows.folders["folder_mtimes"][row] = UNTRUSTED
            self.rows.add_bad(row, rel, f"cannot list folder: {e.strerror or e}")
            return []
        subfolders: list[tuple[str, int, int | None]] = []
        names, sizes, mtimes, devs, inos, widths, heights, linked = [], [], [], [], [], [], [], []
        unread: list[int] = []  # positions whose header must be read
        for entry in entries:
            entry_rel = entry.path[cut:]
            try:
                is_dir = entry.is_dir(follow_symlinks=True)
            except OSError as e:  # e.g. a symlink loop (ELOOP)
                if _is_image_name(entry.name):
                    self.rows.add_bad(row, entry_rel, f"cannot stat: {e.strerror or e}")
                    trusted = False
                continue
            if not is_dir and not _is_image_name(entry.name):
                continue  # README, .DS_Store, labels files: not images, silently ignored
            if entry.is_symlink():
                target = self._escapes(entry.path, home.real())
                if target is not None:
                    what = "folder" if is_dir else "file"
                    self.rows.add_bad(row, entry_rel, f"{what} symlink to {target} leaves its class folder "
                                      f"{('train', 'val')[split]}/{cls}: not used")
                    continue
            if is_dir:
                subfolders.append((entry.path, row, self.old_rows.get(encode(entry_rel))))
                continue
            try:
                st = entry.stat(follow_symlinks=True)
            except OSError as e:
                self.rows.add_bad(row, entry_rel, f"cannot stat (dangling symlink?): {e.strerror or e}")
                trusted = False
                continue
            self.checked.files_statted += 1
            if not stat.S_ISREG(st.st_mode):
                # A FIFO or device named like an image would block or never end when read.
                self.rows.add_bad(row, entry_rel, "not a regular file")
                continue
            if st.st_size == 0:
                self.rows.add_bad(row, entry_rel, "zero bytes")
                continue
            path = encode(entry_rel)
            was = known.get(path)
            if was is not None and (int(old.sizes[was]), int(old.mtimes[was])) == (st.st_size, st.st_mtime_ns):
                width, height = int(old.widths[was]), int(old.heights[was])
                if width == 0:
                    self.rows.add_bad(row, path, old_reasons.get(path, b"not a readable image (cached)"))
            else:
                width = height = 0
                unread.append(len(names))
            names.append(path)
            sizes.append(st.st_size)
            mtimes.append(st.st_mtime_ns)
            devs.append(st.st_dev)
            inos.append(st.st_ino)
            linked.append(st.st_nlink > 1 or entry.is_symlink())
            widths.append(width)
            heights.append(height)
        arrays = {"paths": np.array(names, dtype=np.bytes_), "sizes": np.array(sizes, dtype=np.int64),
                  "mtimes": np.array(mtimes, dtype=np.int64), "widths": np.array(widths, dtype=np.int32),
                  "heights": np.array(heights, dtype=np.int32), "devs": np.array(devs, dtype=np.uint64),
                  "inos": np.array(inos, dtype=np.uint64)}
        self.rows.folders["folder_files"][row] = len(names)
        self.rows.add_files(arrays, np.array(linked, dtype=bool))
        if not trusted:
            self.rows.folders["folder_mtimes"][row] = UNTRUSTED
        for i in range(0, len(unread), HEADER_CHUNK):
            positions = unread[i:i + HEADER_CHUNK]
            self.headers.submit([f"{self.root}/{decode(names[p])}" for p in positions],
                                self._taker(row, arrays, positions))
        return subfolders

    def _taker(self, row: int, arrays: dict[str, np.ndarray], positions: list[int]) -> Callable:
        def take(results: list[tuple[int, int] | Unreadable]) -> None:
            for p, result in zip(positions, results):
                if isinstance(result, Unreadable):
                    self.rows.add_bad(row, bytes(arrays["paths"][p]), result.reason)
                    if result.transient:  # not remembered: read again next time
                        arrays["widths"][p] = DROP
                        self.rows.folders["folder_mtimes"][row] = UNTRUSTED
                    continue
                arrays["widths"][p], arrays["heights"][p] = result
        return take


def _use_each_file_once(table: Table, linked: np.ndarray) -> Table:
    """Leave out every file reached a second time (a hard link, or two links to one file): the
    first in walk order is kept. A repeat needs a new row that is a link (`linked`), so a tree
    without links costs nothing here, and the rows checked are those sharing an inode with one."""
    if not linked.any():
        return table
    candidates = np.flatnonzero(np.isin(table.inos, table.inos[linked]))
    order = candidates[np.lexsort((candidates, table.inos[candidates], table.devs[candidates]))]
    same = (table.devs[order][1:] == table.devs[order][:-1]) & (table.inos[order][1:] == table.inos[order][:-1])
    if not same.any():
        return table
    owner = table.file_owners()
    # Each repeat's first: the row where its run of equal keys starts.
    starts = np.r_[True, ~same]
    first = order[np.maximum.accumulate(np.where(starts, np.arange(len(order)), 0))]
    repeats = order[1:][same]
    bad = list(zip(table.bad_folders.tolist(), table.bad_paths.tolist(), table.bad_reasons.tolist()))
    for r, f in zip(repeats.tolist(), first[1:][same].tolist()):
        reason = f"the same file as {decode(table.paths[f])} (a link): used once"
        bad.append((int(owner[r]), table.paths[r], encode(reason)))
    bad.sort(key=lambda b: b[0])
    keep = np.ones(len(table.paths), bool)
    keep[repeats] = False
    counts = np.bincount(owner[keep], minlength=len(table.folder_files)).astype(np.int64)
    fields = {k: getattr(table, k)[keep] for k in ("paths", "sizes", "mtimes", "widths", "heights", "devs", "inos")}
    return dataclasses.replace(table, folder_files=counts, **fields, **bad_columns(bad))
