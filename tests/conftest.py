"""Fixtures shared by the trainer's tests: small real file systems (tmpfs mounts) for read-only
and full-disk cases. They need root; where it is missing they skip, except under CI (CI=true),
where that is a failure: these tests must run there."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


def require_root(what: str) -> None:
    if os.geteuid() == 0:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI must run {what}, which needs root")
    pytest.skip(f"{what} needs root")


def mount_tmpfs(path: Path, options: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs at {path}: {done.stderr.strip()}")


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


def fill(folder: Path) -> None:
    """Write a file into `folder` until its file system has no space left."""
    chunk = b"\0" * 65536
    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass
        try:
            while True:
                f.write(b"\0" * 512)
        except OSError:
            pass
