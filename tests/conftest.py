"""Fixtures shared by the trainer's tests: small real file systems (tmpfs mounts) for read-only
and full-disk cases (see fs_helpers)."""
from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from fs_helpers import mount_tmpfs, require_root


def tmpfs(path: Path, options: str, what: str) -> Iterator[Path]:
    require_root(what)
    mount_tmpfs(path, options)
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def read_only_dir(tmp_path) -> Iterator[Path]:
    """An empty read-only file system."""
    yield from tmpfs(tmp_path / "ro", "ro,size=1m", "the read-only file system test")


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """An 8 MiB file system, for filling up."""
    yield from tmpfs(tmp_path / "small", "size=8m", "the full-disk test")
