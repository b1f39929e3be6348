"""The image-folder index as stored: one versioned ``.npz`` of plain arrays, written atomically.

The cache holds three tables. Folders, in walk order (class by class, depth first, names
sorted): path, split, class, parent row, modification time (ns) and number of entries when
last listed, and how many file rows follow. Files, each folder's rows together in its order:
path, size (bytes), modification time (ns), width and height (pixels; 0 for a file whose content
is not a usable image), device and inode (to use a hard-linked file once). Bad: every image-named
file or folder left out, with its folder row and the reason.

A load trusts a folder whose mtime and entry count are unchanged (``data.index_walk``); its
rows are taken as they are, with no per-file call. Version 1 (one row per file, checked file by
file on every load) is rebuilt with one line saying so.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import logging
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from speedrun import files

log = logging.getLogger("speedrun.data")

CACHE_NAME = ".speedrun-index.npz"
INDEX_VERSION = 2
UNTRUSTED = -1  # a folder mtime that never matches: the folder is listed again on every load


@dataclass
class Table:
    """An index as stored (see the module docstring); every field is one array."""

    folder_paths: np.ndarray  # S: relative to the root
    folder_splits: np.ndarray  # int8: 0 train, 1 val
    folder_classes: np.ndarray  # S: the class folder's name
    folder_parents: np.ndarray  # int64: row of the parent folder, -1 for a class folder
    folder_mtimes: np.ndarray  # int64 ns, or UNTRUSTED
    folder_counts: np.ndarray  # int64: entries listed (any name, image or not)
    folder_files: np.ndarray  # int64: this folder's file rows, which follow the previous folder's
    paths: np.ndarray  # S: file path relative to the root
    sizes: np.ndarray  # int64 bytes
    mtimes: np.ndarray  # int64 ns
    widths: np.ndarray  # int32 px; 0: not a usable image (its reason is in bad_*)
    heights: np.ndarray  # int32 px
    devs: np.ndarray  # uint64
    inos: np.ndarray  # uint64
    bad_folders: np.ndarray  # int64: the folder row each bad entry was found in
    bad_paths: np.ndarray  # S
    bad_reasons: np.ndarray  # S, UTF-8
    token: int = 0  # random, new with every write: two processes read the same cache when equal

    def file_starts(self) -> np.ndarray:
        """First file row of each folder (int64)."""
        return np.concatenate([[0], np.cumsum(self.folder_files)[:-1]]).astype(np.int64)

    def file_owners(self) -> np.ndarray:
        """The folder row of each file row."""
        return owners(self.folder_files)


def owners(folder_files: np.ndarray) -> np.ndarray:
    """The folder row of each file row, from the folders' file counts."""
    return np.repeat(np.arange(len(folder_files)), folder_files)


def bad_columns(bad: list[tuple[int, bytes, bytes]]) -> dict[str, np.ndarray]:
    """Table's bad_* columns from (folder row, path, reason) rows."""
    return {"bad_folders": np.array([b[0] for b in bad], dtype=np.int64),
            "bad_paths": np.array([b[1] for b in bad], dtype=np.bytes_),
            "bad_reasons": np.array([b[2] for b in bad], dtype=np.bytes_)}


def empty_table() -> Table:
    """A table with no rows (what a first build starts from)."""
    kinds = {"S": np.bytes_, "i1": np.int8, "i4": np.int32, "i8": np.int64, "u8": np.uint64}
    arrays = {f.name: np.zeros(0, dtype=kinds[_DTYPES[f.name]]) for f in dataclasses.fields(Table) if f.name != "token"}
    return Table(**arrays)


_DTYPES = {
    "folder_paths": "S", "folder_splits": "i1", "folder_classes": "S", "folder_parents": "i8",
    "folder_mtimes": "i8", "folder_counts": "i8", "folder_files": "i8",
    "paths": "S", "sizes": "i8", "mtimes": "i8", "widths": "i4", "heights": "i4", "devs": "u8", "inos": "u8",
    "bad_folders": "i8", "bad_paths": "S", "bad_reasons": "S",
}


def cache_path(root: Path) -> Path:
    """Where the index of `root` is cached: beside the data when writable, else in the cache dir."""
    root = root.resolve()
    if os.access(root, os.W_OK):
        return root / CACHE_NAME
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "speedrun" / "index"
    digest = hashlib.sha1(os.fsencode(root)).hexdigest()[:16]
    return base / f"{root.name}-{digest}.npz"


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock beside `path`, so that processes starting together build the index once
    (flock; on NFS and EFS the kernel maps it to a lock the server keeps)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_cache(path: Path) -> Table | None:
    """The table stored at `path`; None when there is none, or one to rebuild (another version:
    said in one line; damaged: a warning)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            version = int(z["version"])
            if version != INDEX_VERSION:
                log.warning("index cache %s is version %d, this speedrun keeps version %d: rebuilding it",
                            path, version, INDEX_VERSION)
                return None
            arrays = {name: z[name] for name in _DTYPES}
            return Table(**arrays, token=int(z["token"]))
    except FileNotFoundError:
        return None
    except Exception as e:  # a damaged cache is rebuilt, never trusted
        log.warning("index cache %s unreadable (%s); rebuilding", path, e)
        return None


def write_cache(path: Path, table: Table) -> Table:
    """Store `table` at `path` with a new token, atomically (a crash leaves the old cache or the
    new one); returns the table with that token. A cache that cannot be written is a warning:
    the index is still used, and built again next time."""
    table = dataclasses.replace(table, token=secrets.randbits(62))
    try:
        with files.replacing(path, suffix=".tmp.npz") as tmp:  # .npz: numpy adds it otherwise
            np.savez(tmp, version=np.int64(INDEX_VERSION), token=np.int64(table.token),
                     **{name: getattr(table, name) for name in _DTYPES})
    except OSError as e:
        log.warning("could not write index cache %s: %s", path, e)
    return table


def encode(text: str) -> bytes:
    """A path or reason as stored (undecodable file-name bytes survive the round trip)."""
    return text.encode("utf-8", "surrogateescape")


def decode(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")
