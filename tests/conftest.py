"""Fixtures shared by the trainer's tests: small real file systems (tmpfs mounts) for read-only
and full-disk cases (see fs_helpers)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from fs_helpers import mount_tmpfs, require_root


@pytest.fixture
def read_only_dir(tmp_path) -> Path:
    """An empty read-only file system."""
    require_root("the read-only file system test")
    path = tmp_path / "ro"
    mount_tmpfs(path, "ro,size=1m")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """An 8 MiB file system, for filling up."""
    require_root("the full-disk test")
    path = tmp_path / "small"
    mount_tmpfs(path, "size=8m")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)
