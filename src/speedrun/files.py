"""Files written so that a reader, or a crash, sees the old file or the new one, never half; and
JSONL records read back so that a last line cut short by a crash is dropped, not an error."""
from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from speedrun.errors import SpeedrunError


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


def temporaries(folder: Path, name: str = "*", suffix: str = ".tmp") -> list[Path]:
    """The temporaries `replacing` made for the file `name` in `folder` (every file's by default)
    that are still there: left by a writer killed mid-write."""
    return list(folder.glob(f".{name}.*{suffix}"))


def write_text(path: str | os.PathLike, text: str) -> None:
    """Replace `path`'s content with `text`, atomically."""
    with replacing(path) as tmp:
        tmp.write_text(text)


def to_json(data: Any, indent: int | None = None) -> str:
    """`data` as JSON text, with every float that is not finite written as null. JSON has no NaN
    or infinity: Python's json module writes `NaN` and `Infinity`, which other readers (jq,
    JavaScript, MLflow's) refuse, so a diverged loss is recorded as null."""
    return json.dumps(_finite_or_none(data), indent=indent, allow_nan=False)


def _finite_or_none(data: Any) -> Any:
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: _finite_or_none(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [_finite_or_none(v) for v in data]
    return data


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a JSONL file (empty when it does not exist). A last line cut short (the
    disk filled up, the power went) is dropped: that record was never complete. A damaged line
    anywhere else is a SpeedrunError naming the file and the line."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise SpeedrunError(f"{path} is not UTF-8 text: not one of speedrun's JSONL files") from None
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's json follows
            if number == len(lines):  # no newline after it: the write was cut short
                continue
            raise SpeedrunError(f"{path}, line {number}: not a JSON record ({line[:60]!r}); "
                                "fix or remove the line") from None
    return records
