"""Files written so that a reader, or a crash, sees the old file or the new one, never half."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replacing(path: str | os.PathLike, fsync: bool = False, suffix: str = ".tmp") -> Iterator[Path]:
    """A temporary path beside `path` (named `.<name>.<random><suffix>`) to write to; when the
    block ends without an error it is renamed over `path` (after an fsync when asked: the data
    reach the disk before the name does), otherwise it is removed. Rename is atomic on POSIX
    file systems. The parent folder must exist."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    """Replace `path`'s content with `text`, atomically."""
    with replacing(path) as tmp:
        tmp.write_text(text)
