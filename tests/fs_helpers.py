"""Small real file systems for tests (tmpfs mounts), and filling one up. Mounting needs root:
without it a test skips, except under CI (CI=true), where that is a failure."""
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


def remount_read_only(path: Path) -> None:
    """Make the tmpfs mounted at `path` read-only, with what was written there kept (root ignores
    permission bits; a read-only file system it cannot)."""
    done = subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"cannot remount {path} read-only: {done.stderr.strip()}")
